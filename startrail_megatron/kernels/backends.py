"""GPU attention backends behind the kernel contract, and how one is chosen.

Every backend implements ``kernels.AttentionKernel`` (seq-first tensors; forward
-> (out, lse [b, hq, sq] fp32); backward from the final merged out and lse).
Each third-party library is imported only when its backend is built.

========================  ====================================================
name                      what runs
========================  ====================================================
``"flash_attn"``          flash-attn 2 (2.5 - 2.8), its ``_flash_attn_forward``
                          / ``_flash_attn_backward``. CUDA sm80+, fp16/bf16,
                          head_dim % 8 == 0 and <= 256, GQA natively.
``"sdpa_flash"``          ``aten._scaled_dot_product_flash_attention`` (+ its
                          backward). CUDA sm80+, fp16/bf16, GQA natively.
``"sdpa_cudnn"``          ``aten._scaled_dot_product_cudnn_attention`` (+ its
                          backward). CUDA sm80+, cuDNN >= 9, fp16/bf16,
                          head_dim <= 128. KV heads expanded for GQA.
``"sdpa_efficient"``      ``aten._scaled_dot_product_efficient_attention``
                          (+ its backward). CUDA, fp32/fp16/bf16. KV heads
                          expanded for GQA (a view when no copy is needed).
``"te"``                  Transformer Engine 1.9 - 2.18, the cuDNN fused
                          attention its context-parallel ring uses
                          (``cpp_extensions.fused_attn.fused_attn_fwd`` /
                          ``_bwd``, F16_arbitrary_seqlen). CUDA sm80+,
                          cuDNN >= 9, fp16/bf16, head_dim % 8 == 0 and
                          <= 128 (<= 256 on sm90 with cuDNN >= 9.5), GQA
                          natively. Explicit only (not in ``AUTO_ORDER``):
                          tested against stand-ins with TE's exact
                          signatures, never run on a GPU.
``"sdpa"``, ``"torch"``   ``kernels.SdpaKernel`` / ``kernels.TorchKernel``.
========================  ====================================================

Selection (``choose_kernel``, pure): an explicit name is checked against the
inputs and raises if it cannot run them; ``"auto"`` takes the first of
``AUTO_ORDER[device]`` that supports (device, dtype, head_dim, compute
capability) and is installed; float64 always gets the exact ``"torch"``
kernel. The ``STARTRAIL_KERNEL`` environment variable replaces ``"auto"``.
``"te"`` is never chosen by ``"auto"``: ask for it by name or ``STARTRAIL_KERNEL=te``.

Layouts and row statistics, per backend (all read from the upstream sources):
flash-attn wants ``[b, s, h, d]`` with a unit last stride (our ``[s, b, h, d]``
transposed is a view) and returns lse ``[b, h, sq]``; the SDPA ops want
``[b, h, s, d]``; the efficient kernel pads lse to a multiple of 32 rows and
cuDNN returns it as ``[b, h, sq, 1]``. ``lse_to_bhs`` / ``lse_for_op`` convert.

flash-attn's private API changed twice in 2.5 - 2.8, so its adapter reads
parameter names, never counts outputs:

  2.5.x  fwd(q, k, v, dropout_p, softmax_scale, causal, window_size,
             alibi_slopes, return_softmax)
             -> (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
  2.6.x  as 2.5 plus ``softcap`` (fwd and bwd)
  2.7+   fwd(..., causal, window_size_left, window_size_right, softcap,
             alibi_slopes, return_softmax) -> (out, softmax_lse, S_dmask, rng_state);
         a ``torch.library.custom_op`` (signature on ``_init_fn``, schema on
         ``torch.ops.flash_attn``) when torch >= 2.4, a plain function otherwise.
  bwd    writes into the dq, dk, dv buffers passed in, in every version.

Transformer Engine: ``transformer_engine.pytorch.cpp_extensions.fused_attn``
(read at the tags v1.6 - v2.18), the functions TE's own ``AttnFuncWithCPAndKVP2P``
calls (``attention.py`` in 1.x, ``attention/dot_product_attention/
context_parallel.py`` in 2.x). Its adapter also reads parameter names and
refuses any parameter it does not know:

  1.9, 1.10  fwd(is_training, max_seqlen_q, max_seqlen_kv, cu_seqlens_q,
                 cu_seqlens_kv, q, k, v, qkv_dtype, fused_attention_backend,
                 attn_bias=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                 <FP8: d_scale_qkv, d_scale_s, q_scale_s, q_scale_o, amax_s, amax_o>,
                 attn_scale=None, dropout=0.0, fast_zero_fill=True,
                 qkv_layout="sbh3d", attn_bias_type="no_bias",
                 attn_mask_type="padding", window_size=(-1, -1), rng_gen=None)
                 -> (out, aux_ctx_tensors)
             bwd(max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_kv, q, k, v,
                 o, d_o, qkv_dtype, dqkv_dtype, aux_ctx_tensors,
                 fused_attention_backend, cu_seqlens_q_padded, cu_seqlens_kv_padded,
                 <FP8 scales and amaxes>, attn_scale, dropout, fast_zero_fill,
                 qkv_layout, attn_bias_type, attn_mask_type, window_size,
                 deterministic=False) -> [dq, dk, dv, dbias]
             qkv_dtype, dqkv_dtype: ``tex.DType`` (``constants.TE_DType[dtype]``).
             (1.8 has no window_size / deterministic: not supported.)
  1.11-1.13  fwd adds the FP8 ``*_offset`` ints.
  2.0, 2.1   FP8 tensors become quantizers (fwd s_quantizer, o_quantizer; bwd
             s_quantizer, dp_quantizer, dqkv_quantizer); qkv_dtype becomes
             ``fake_dtype``, a ``torch.dtype``; bwd keeps dqkv_dtype (``tex.DType``).
  2.2 - 2.7  fwd adds page_table_k, page_table_v.
  2.8        softmax_type="vanilla" (fwd, bwd); fwd softmax_offset=None.
  2.9        fwd return_max_logit=False (True: -> (out, aux_ctx_tensors, max_logit [h])).
  2.10, 2.11 cuda_graph=False (fwd, bwd).
  2.12-2.14  bottom_right_diagonal=None (fwd, bwd; None: True only for the
             "*causal_bottom_right" masks).
  2.15-2.18  fwd o_format="sbhd", qkv_scale_inv_format; bwd drops dqkv_dtype and
             adds o_format="sbhd", do_format="sbhd", dqkv_layout="sbh3d" (a packed
             layout: always passed), qkv/do_scale_inv_format.
  all        aux_ctx_tensors = [softmaxStats, rng_state, (optional bias / offset)]:
             for F16_arbitrary_seqlen and sbhd/bshd, softmaxStats is the
             natural-log log-sum-exp of the scaled scores, [b, h, sq, 1] fp32 (TE's
             CP code squeezes it and merges it like flash-attn's lse, and hands
             the merged one back to fused_attn_bwd unsqueezed); rng_state is
             [seed, offset] int64 [2] on the GPU. qkv_layout "sbhd_sbhd_sbhd"
             takes our [s, b, h, d] tensors as they are, but TE reads a data
             pointer and a shape only, so they must be contiguous; k, v may have
             fewer heads (GQA). Masks: "no_mask", "causal" (top-left, the
             contract's), "causal_bottom_right". cu_seqlens: int32 [b + 1].
             TE's CP code passes ``FusedAttnBackend["F16_arbitrary_seqlen"]`` for
             fp16/bf16; the C++ side re-derives the backend and raises if the
             inputs are not supported. ``unsupported_reason`` applies its limits
             for training, sbhd, no bias (sm80+, cuDNN >= 9, head_dim).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from . import SdpaKernel, TorchKernel, acc_dtype

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "KERNEL_ENV",
    "KERNEL_NAMES",
    "BackendSpec",
    "FlashAttnAPI",
    "FlashAttnKernel",
    "KernelQuery",
    "SdpaCudnnKernel",
    "SdpaEfficientKernel",
    "SdpaFlashKernel",
    "TEFusedAttnAPI",
    "TEKernel",
    "build_kernel",
    "choose_kernel",
    "detect_flash_attn_api",
    "detect_te_api",
    "lse_to_bhs",
    "unsupported_reason",
]

KERNEL_ENV = "STARTRAIL_KERNEL"
"""Environment variable that replaces ``kernel="auto"`` (any name of ``KERNEL_NAMES``)."""

_HALF = frozenset({torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class BackendSpec:
    """What a backend can run; ``unsupported_reason`` reads it.

    Attributes:
        name: the kernel name users pass.
        devices: device types it runs on.
        dtypes: input dtypes it accepts.
        module: a Python module that must be installed (``None``: torch alone).
        max_head_dim: largest head_dim (``None``: no limit).
        head_dim_multiple: head_dim must be a multiple of this.
        min_capability: lowest CUDA compute capability.
        min_cudnn: lowest cuDNN version (``torch.backends.cudnn.version()``).
    """

    name: str
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    module: str | None = None
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    min_capability: tuple[int, int] | None = None
    min_cudnn: int | None = None


_ALL_FLOAT = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})

BACKENDS: dict[str, BackendSpec] = {
    s.name: s
    for s in (
        BackendSpec("torch", frozenset({"cpu", "cuda", "meta"}), _ALL_FLOAT),
        BackendSpec("sdpa", frozenset({"cpu", "cuda"}), _ALL_FLOAT),
        BackendSpec("flash_attn", frozenset({"cuda"}), _HALF, "flash_attn", 256, 8, (8, 0)),
        BackendSpec("sdpa_flash", frozenset({"cuda"}), _HALF, None, 256, 8, (8, 0)),
        BackendSpec("sdpa_cudnn", frozenset({"cuda"}), _HALF, None, 128, 8, (8, 0), 90000),
        BackendSpec(
            "sdpa_efficient",
            frozenset({"cuda"}),
            frozenset({torch.float32, torch.float16, torch.bfloat16}),
            head_dim_multiple=8,
            min_capability=(5, 0),
        ),
        BackendSpec("te", frozenset({"cuda"}), _HALF, "transformer_engine", 256, 8, (8, 0), 90000),
    )
}
KERNEL_NAMES: tuple[str, ...] = ("auto", *BACKENDS)

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "torch"),
    "cpu": ("sdpa", "torch"),
}
"""Candidates of ``"auto"`` per device type, fastest first (others: ``("torch",)``).

``"te"`` is left out on purpose: its adapter has run only against stand-ins."""


@dataclass(frozen=True)
class KernelQuery:
    """The facts selection looks at (built by ``KernelQuery.of`` or by hand in tests).

    Attributes:
        device_type: ``"cpu"``, ``"cuda"``, ...
        dtype: the input dtype (``None``: not known, no dtype check).
        head_dim: the head dimension (``None``: not known).
        capability: CUDA compute capability (``None`` off CUDA).
        cudnn_version: ``torch.backends.cudnn.version()`` (``None``: no cuDNN).
    """

    device_type: str = "cpu"
    dtype: torch.dtype | None = None
    head_dim: int | None = None
    capability: tuple[int, int] | None = None
    cudnn_version: int | None = None

    @classmethod
    def of(
        cls,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        head_dim: int | None,
    ) -> KernelQuery:
        """Read capability and cuDNN version of ``device`` from the running torch."""
        dev = torch.device(device) if device is not None else torch.device("cpu")
        cap = cudnn = None
        if dev.type == "cuda" and torch.cuda.is_available():
            cap = tuple(torch.cuda.get_device_capability(dev))
            if torch.backends.cudnn.is_available():
                cudnn = torch.backends.cudnn.version()
        return cls(dev.type, dtype, head_dim, cap, cudnn)  # type: ignore[arg-type]


@functools.cache
def _installed(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (cached per process)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def unsupported_reason(
    name: str, query: KernelQuery, installed: Callable[[str], bool] = _installed
) -> str | None:
    """Why backend ``name`` cannot run ``query`` (``None``: it can). Pure given ``installed``."""
    spec = BACKENDS[name]
    if query.device_type not in spec.devices:
        return f"runs on {sorted(spec.devices)}, not {query.device_type!r}"
    if query.dtype is not None and query.dtype not in spec.dtypes:
        allowed = sorted(str(d).removeprefix("torch.") for d in spec.dtypes)
        return f"takes {allowed}, not {str(query.dtype).removeprefix('torch.')}"
    if query.head_dim is not None:
        if spec.max_head_dim is not None and query.head_dim > spec.max_head_dim:
            return f"head_dim {query.head_dim} > {spec.max_head_dim}"
        if query.head_dim % spec.head_dim_multiple:
            return f"head_dim {query.head_dim} is not a multiple of {spec.head_dim_multiple}"
    if spec.min_capability is not None and query.device_type == "cuda":
        if query.capability is None or query.capability < spec.min_capability:
            return f"needs compute capability >= {spec.min_capability}, got {query.capability}"
    if spec.min_cudnn is not None and (
        query.cudnn_version is None or query.cudnn_version < spec.min_cudnn
    ):
        return f"needs cuDNN >= {spec.min_cudnn}, got {query.cudnn_version}"
    if name == "te":
        why = _te_limits(query)
        if why is not None:
            return why
    if spec.module is not None and not installed(spec.module):
        return f"the {spec.module!r} package is not installed"
    return None


def _te_limits(query: KernelQuery) -> str | None:
    """TE's F16_arbitrary_seqlen limits (``nvte_get_fused_attn_backend``, training,
    sbhd, no bias) beyond the spec: head_dim > 128 only on sm90 with cuDNN >= 9.5;
    Blackwell (sm100+) needs cuDNN >= 9.7."""
    cap, cudnn, d = query.capability, query.cudnn_version, query.head_dim
    if cap is not None and cap >= (10, 0) and (cudnn is None or cudnn < 90700):
        return f"needs cuDNN >= 90700 on compute capability {cap}, got {cudnn}"
    if d is not None and d > 128 and not (cap == (9, 0) and cudnn is not None and cudnn >= 90500):
        return (
            f"head_dim {d} > 128 needs compute capability (9, 0) and cuDNN >= 90500, got "
            f"{cap} and {cudnn}"
        )
    return None


def _resolve_name(name: str, env: Mapping[str, str]) -> tuple[str, str]:
    """(kernel name, the setting it came from); ValueError on an unknown name."""
    setting = "kernel"
    if name == "auto" and env.get(KERNEL_ENV):
        name, setting = env[KERNEL_ENV].strip(), KERNEL_ENV
    if name not in KERNEL_NAMES:
        raise ValueError(f"{setting}={name!r} is not known; allowed: {list(KERNEL_NAMES)}")
    return name, setting


def choose_kernel(
    name: str,
    query: KernelQuery,
    installed: Callable[[str], bool] = _installed,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """The kernel names to try, in order, for ``name`` and ``query``. Pure.

    An explicit name gives ``[name]`` or raises ``NotImplementedError`` with the
    reason it cannot run the inputs; ``"auto"`` (or ``$STARTRAIL_KERNEL``) gives
    every supported candidate of ``AUTO_ORDER``, fastest first, ending with
    ``"torch"``. ``ValueError`` names the setting and the allowed values.
    """
    env = os.environ if env is None else env
    name, setting = _resolve_name(name, env)
    if name != "auto":
        why = unsupported_reason(name, query, installed)
        if why is not None:
            raise NotImplementedError(f"{setting}={name!r} cannot run these inputs: {why}")
        return [name]
    if query.dtype == torch.float64:
        return ["torch"]
    order = AUTO_ORDER.get(query.device_type, ("torch",))
    return [n for n in order if unsupported_reason(n, query, installed) is None] or ["torch"]


def build_kernel(
    name: str = "auto",
    dtype: torch.dtype | None = None,
    *,
    device: torch.device | str | None = None,
    head_dim: int | None = None,
    env: Mapping[str, str] | None = None,
    query: KernelQuery | None = None,
    installed: Callable[[str], bool] = _installed,
) -> Any:
    """A kernel object for ``name`` (see ``choose_kernel``), imported lazily.

    With ``"auto"`` a backend whose import fails (a broken install) is skipped.
    ``query`` replaces what ``device``/``dtype``/``head_dim`` would give.
    """
    q = query or KernelQuery.of(device, dtype, head_dim)
    candidates = choose_kernel(name, q, installed, env)
    errors = []
    for cand in candidates:
        try:
            return _instance(_CONSTRUCTORS[cand])
        except (ImportError, OSError) as e:
            if len(candidates) == 1:
                raise
            errors.append(f"{cand}: {e}")
    raise RuntimeError(f"no attention kernel could be built: {errors}")  # "torch" never fails


@functools.cache
def _instance(constructor: Callable[[], Any]) -> Any:
    """One kernel object per constructor: kernels hold no per-call state, and
    flash-attn's import and signature detection then run once per process."""
    return constructor()


# ---- layouts and row statistics ---------------------------------------------------------


def _bhsd(x: Tensor) -> Tensor:
    return x.permute(1, 2, 0, 3)  # [s, b, h, d] -> (b, h, s, d), a view


def _sbhd(x: Tensor) -> Tensor:
    return x.permute(2, 0, 1, 3)  # (b, h, s, d) -> [s, b, h, d], a view


def _expand_kv(x: Tensor, hq: int) -> Tensor:
    """(b, hkv, s, d) -> (b, hq, s, d): a view for hkv == 1 or hq, else one copy."""
    b, hkv, s, d = x.shape
    if hkv == hq:
        return x
    return x.unsqueeze(2).expand(b, hkv, hq // hkv, s, d).reshape(b, hq, s, d)


def _reduce_kv(g: Tensor, hkv: int) -> Tensor:
    """Gradient of ``_expand_kv``: (b, hq, s, d) -> (b, hkv, s, d)."""
    b, hq, s, d = g.shape
    if hkv == hq:
        return g
    return g.reshape(b, hkv, hq // hkv, s, d).sum(2)


def lse_to_bhs(lse: Tensor, b: int, h: int, sq: int) -> Tensor:
    """A kernel's log-sum-exp as ``[b, h, sq]`` fp32.

    Accepts ``[b, h, sq]`` (flash), ``[b, h, >= sq]`` (efficient attention pads
    the rows to a multiple of 32) and ``[b, h, sq, 1]`` (cuDNN).
    """
    if lse.dim() == 4 and lse.shape[-1] == 1:
        lse = lse.squeeze(-1)
    if lse.dim() != 3 or tuple(lse.shape[:2]) != (b, h) or lse.shape[2] < sq:
        raise RuntimeError(
            f"kernel returned log-sum-exp of shape {tuple(lse.shape)}; expected [{b}, {h}, "
            f">= {sq}] or [{b}, {h}, {sq}, 1]"
        )
    return lse[..., :sq].float()


def _pad_rows(lse: Tensor, multiple: int) -> Tensor:
    """[b, h, sq] -> [b, h, ceil(sq/multiple)*multiple] contiguous, the extra rows +inf.

    The efficient-attention forward returns its lse in this padded form and the
    backward takes the head stride from it; +inf is what the kernel means the
    padding to hold (a row with lse = +inf has zero probabilities).
    """
    sq = lse.shape[-1]
    pad = -sq % multiple
    return torch.nn.functional.pad(lse.float(), (0, pad), value=math.inf).contiguous()


# ---- PyTorch's fused CUDA SDPA ops ------------------------------------------------------


class SdpaFlashKernel:
    """``aten._scaled_dot_product_flash_attention``: PyTorch's flash kernel, GQA natively."""

    name = "sdpa_flash"

    def forward(self, q, k, v, *, causal, scale):
        sq, b, hq, _ = q.shape
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale
        )
        out, lse = res[0], res[1]  # (b, hq, sq, d), (b, hq, sq) fp32
        return _sbhd(out), lse_to_bhs(lse, b, hq, sq)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        sq, sk = q.shape[0], k.shape[0]
        dev = q.device
        rng = torch.zeros(2, dtype=torch.uint64, device=dev)  # unused without dropout
        unused = torch.zeros((), dtype=torch.uint64, device=dev)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            _bhsd(dout.to(q.dtype)),
            _bhsd(q),
            _bhsd(k),
            _bhsd(v),
            _bhsd(out.to(q.dtype)),
            lse.float().contiguous(),
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            rng,
            unused,
            scale=scale,
        )
        return _sbhd(dq), _sbhd(dk), _sbhd(dv)


class SdpaEfficientKernel:
    """``aten._scaled_dot_product_efficient_attention`` (memory-efficient); KV expanded."""

    name = "sdpa_efficient"

    def forward(self, q, k, v, *, causal, scale):
        sq, b, hq, _ = q.shape
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            _bhsd(q),
            _expand_kv(_bhsd(k), hq),
            _expand_kv(_bhsd(v), hq),
            None,
            True,
            0.0,
            causal,
            scale=scale,
        )
        return _sbhd(out), lse_to_bhs(lse, b, hq, sq)  # lse rows padded to 32

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        hq, hkv = q.shape[2], k.shape[2]
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bhsd(dout.to(q.dtype)),
            _bhsd(q),
            _expand_kv(_bhsd(k), hq),
            _expand_kv(_bhsd(v), hq),
            None,
            _bhsd(out.to(q.dtype)),
            _pad_rows(lse, 32),  # the forward's padded form
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return _sbhd(dq), _sbhd(_reduce_kv(dk, hkv)), _sbhd(_reduce_kv(dv, hkv))


class SdpaCudnnKernel:
    """``aten._scaled_dot_product_cudnn_attention`` (cuDNN >= 9); KV expanded, dense inputs."""

    name = "sdpa_cudnn"

    def forward(self, q, k, v, *, causal, scale):
        sq, b, hq, _ = q.shape
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhsd(q).contiguous(),
            _expand_kv(_bhsd(k), hq).contiguous(),
            _expand_kv(_bhsd(v), hq).contiguous(),
            None,
            True,
            0.0,
            causal,
            False,
            scale=scale,
        )
        return _sbhd(res[0]), lse_to_bhs(res[1], b, hq, sq)  # lse (b, hq, sq, 1)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        sq, sk, hq, hkv = q.shape[0], k.shape[0], q.shape[2], k.shape[2]
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(dout.to(q.dtype)).contiguous(),
            _bhsd(q).contiguous(),
            _expand_kv(_bhsd(k), hq).contiguous(),
            _expand_kv(_bhsd(v), hq).contiguous(),
            _bhsd(out.to(q.dtype)).contiguous(),
            lse.float().unsqueeze(-1).contiguous(),  # the forward's (b, hq, sq, 1)
            seed,
            seed,
            None,
            None,
            None,
            sq,
            sk,
            0.0,
            causal,
            scale=scale,
        )
        return _sbhd(dq), _sbhd(_reduce_kv(dk, hkv)), _sbhd(_reduce_kv(dv, hkv))


# ---- flash-attn 2 -----------------------------------------------------------------------


def _param_names(fn: Any) -> tuple[tuple[str, ...], frozenset[str]]:
    """(parameter names, those without a default) of a function, custom op or torch op.

    ``torch.library.custom_op`` objects show ``(*args, **kwargs)``; their Python
    function is ``_init_fn``. A ``torch.ops`` packet or overload carries a schema.
    """
    target = getattr(fn, "_init_fn", None) or fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        sig = None
    var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if sig is not None and not any(p.kind in var for p in sig.parameters.values()):
        names = tuple(sig.parameters)
        required = frozenset(n for n, p in sig.parameters.items() if p.default is p.empty)
        return names, required
    schema = getattr(fn, "_schema", None)
    if schema is None and hasattr(fn, "default"):
        schema = getattr(fn.default, "_schema", None)
    if schema is not None:
        args = schema.arguments
        return tuple(a.name for a in args), frozenset(
            a.name for a in args if not a.has_default_value()
        )
    raise NotImplementedError(f"cannot read the parameters of {fn!r}")


def _fixed_kwargs(causal: bool, scale: float) -> dict[str, Any]:
    """flash-attn arguments shared by forward and backward: no dropout, window, softcap, alibi."""
    return {
        "dropout_p": 0.0,
        "softmax_scale": scale,
        "causal": causal,
        "window_size": (-1, -1),
        "window_size_left": -1,
        "window_size_right": -1,
        "softcap": 0.0,
        "alibi_slopes": None,
    }


@dataclass(frozen=True)
class FlashAttnAPI:
    """flash-attn's private forward/backward as detected from their signatures.

    Attributes:
        fwd_params, bwd_params: parameter names, in order.
        split_window: ``window_size_left``/``_right`` (2.7+) instead of ``window_size``.
        lse_index: where ``softmax_lse`` sits in the forward's outputs: 1 for the
            2.7+ ``(out, softmax_lse, S_dmask, rng_state)``, 5 for the 2.5/2.6
            ``(out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)``.
        version: the package's ``__version__`` (messages only).
    """

    fwd_params: tuple[str, ...]
    bwd_params: tuple[str, ...]
    fwd_required: frozenset[str]
    bwd_required: frozenset[str]
    split_window: bool
    lse_index: int
    version: str = "?"

    _KNOWN = frozenset(
        {
            "q",
            "k",
            "v",
            "dout",
            "out",
            "softmax_lse",
            "dq",
            "dk",
            "dv",
            "dropout_p",
            "softmax_scale",
            "causal",
            "window_size",
            "window_size_left",
            "window_size_right",
            "softcap",
            "alibi_slopes",
            "return_softmax",
            "deterministic",
            "rng_state",
        }
    )

    def _kwargs(self, params, required, values: dict[str, Any], which: str) -> dict[str, Any]:
        unknown = sorted(n for n in required if n not in self._KNOWN)
        if unknown:
            raise NotImplementedError(
                f"flash-attn {self.version}: {which} has parameters {unknown} this adapter does "
                f"not know (supported: flash-attn 2.5 - 2.8); parameters: {list(params)}"
            )
        out = {n: values[n] for n in params if n in values}
        if self.split_window:
            out.pop("window_size", None)
        return out

    def forward_kwargs(self, q, k, v, *, causal: bool, scale: float) -> dict[str, Any]:
        """Keyword arguments of ``_flash_attn_forward`` for [b, s, h, d] inputs."""
        values = {"q": q, "k": k, "v": v, **_fixed_kwargs(causal, scale), "return_softmax": False}
        return self._kwargs(self.fwd_params, self.fwd_required, values, "_flash_attn_forward")

    def backward_kwargs(self, dout, q, k, v, out, lse, dq, dk, dv, *, causal, scale):
        """Keyword arguments of ``_flash_attn_backward``; it fills dq, dk, dv."""
        values = {
            "dout": dout,
            "q": q,
            "k": k,
            "v": v,
            "out": out,
            "softmax_lse": lse,
            "dq": dq,
            "dk": dk,
            "dv": dv,
            **_fixed_kwargs(causal, scale),
            "deterministic": False,
            "rng_state": None,
        }
        return self._kwargs(self.bwd_params, self.bwd_required, values, "_flash_attn_backward")


def detect_flash_attn_api(fwd: Any, bwd: Any, version: str = "?") -> FlashAttnAPI:
    """Read flash-attn's forward/backward conventions from their parameters."""
    fp, freq = _param_names(fwd)
    bp, breq = _param_names(bwd)
    fset, bset = set(fp), set(bp)
    if {"window_size_left", "window_size_right"} <= fset:
        split, lse_index = True, 1
    elif "window_size" in fset:
        split, lse_index = False, 5
    else:
        raise NotImplementedError(
            f"flash-attn {version}: _flash_attn_forward{fp} has neither window_size nor "
            "window_size_left/right; supported: flash-attn 2.5 - 2.8"
        )
    need_b = {"dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "causal"}
    if not {"q", "k", "v", "causal", "softmax_scale"} <= fset or not need_b <= bset:
        raise NotImplementedError(
            f"flash-attn {version}: unexpected signatures _flash_attn_forward{fp}, "
            f"_flash_attn_backward{bp}; supported: flash-attn 2.5 - 2.8"
        )
    if split != ({"window_size_left", "window_size_right"} <= bset):
        raise NotImplementedError(
            f"flash-attn {version}: forward and backward disagree on the window arguments"
        )
    return FlashAttnAPI(fp, bp, freq, breq, split, lse_index, version)


class FlashAttnKernel:
    """flash-attn 2's kernels through their private, signature-detected API.

    Args:
        interface: the ``flash_attn.flash_attn_interface`` module (imported
            when ``None``); tests pass stand-ins with each version's signatures.
    """

    name = "flash_attn"

    def __init__(self, interface: ModuleType | Any | None = None):
        if interface is None:
            interface = importlib.import_module("flash_attn.flash_attn_interface")
            version = getattr(importlib.import_module("flash_attn"), "__version__", "?")
        else:
            version = getattr(interface, "__version__", "?")
        self._fwd = interface._flash_attn_forward
        self._bwd = interface._flash_attn_backward
        self.api = detect_flash_attn_api(self._fwd, self._bwd, version)

    def forward(self, q, k, v, *, causal, scale):
        sq, b, hq, _ = q.shape
        qb, kb, vb = (x.transpose(0, 1) for x in (q, k, v))  # [b, s, h, d] views
        res = self._fwd(**self.api.forward_kwargs(qb, kb, vb, causal=causal, scale=scale))
        out, lse = res[0], res[self.api.lse_index]
        if tuple(out.shape) != tuple(qb.shape):
            raise RuntimeError(
                f"flash-attn {self.api.version}: output {tuple(out.shape)} != q {tuple(qb.shape)}"
            )
        return out.transpose(0, 1), lse_to_bhs(lse, b, hq, sq)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        qb, kb, vb = (x.transpose(0, 1) for x in (q, k, v))
        dob, ob = dout.to(q.dtype).transpose(0, 1), out.to(q.dtype).transpose(0, 1)
        dq = torch.empty(qb.shape, dtype=q.dtype, device=q.device)  # [b, sq, hq, d]
        dk = torch.empty(kb.shape, dtype=k.dtype, device=k.device)  # [b, sk, hkv, d]
        dv = torch.empty(vb.shape, dtype=v.dtype, device=v.device)
        kw = self.api.backward_kwargs(
            dob, qb, kb, vb, ob, lse.float().contiguous(), dq, dk, dv, causal=causal, scale=scale
        )
        self._bwd(**kw)
        return dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)


# ---- Transformer Engine fused attention ------------------------------------------------

_TE_DEVICES: frozenset[str] = frozenset({"cuda"})
"""Device types ``TEKernel`` accepts. Only the tests widen it (to run stand-ins on CPU)."""
_TE_DTYPES: frozenset[torch.dtype] = _HALF
"""Input dtypes ``TEKernel`` accepts (F16_arbitrary_seqlen). Only the tests widen it."""

_TE_SUPPORTED = "Transformer Engine 1.9 - 2.18"
_TE_LAYOUT = "sbhd_sbhd_sbhd"  # our [s, b, h, d] tensors, each in its own buffer
_TE_FORMAT = "sbhd"

# Every parameter fused_attn_fwd / fused_attn_bwd have had in TE 1.9 - 2.18. A name
# outside these sets means a release this adapter has not read: its default could
# change what the kernel computes (2.15's dqkv_layout defaults to "sbh3d"), so refuse.
_TE_FWD_KNOWN = frozenset(
    {
        "is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv",
        "q", "k", "v", "qkv_dtype", "fake_dtype", "fused_attention_backend", "attn_bias",
        "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "page_table_k", "page_table_v",
        "d_scale_qkv", "d_scale_qkv_offset", "d_scale_s", "d_scale_s_offset", "q_scale_s",
        "q_scale_s_offset", "q_scale_o", "q_scale_o_offset", "amax_s", "amax_s_offset",
        "amax_o", "amax_o_offset", "s_quantizer", "o_quantizer", "attn_scale", "dropout",
        "fast_zero_fill", "qkv_layout", "o_format", "qkv_scale_inv_format", "attn_bias_type",
        "attn_mask_type", "softmax_type", "window_size", "bottom_right_diagonal", "rng_gen",
        "softmax_offset", "return_max_logit", "cuda_graph",
    }
)  # fmt: skip
_TE_BWD_KNOWN = frozenset(
    {
        "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "o",
        "d_o", "qkv_dtype", "fake_dtype", "dqkv_dtype", "aux_ctx_tensors",
        "fused_attention_backend", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
        "d_scale_qkv", "d_scale_s", "d_scale_o", "d_scale_do", "d_scale_dp", "q_scale_s",
        "q_scale_dp", "q_scale_dqkv", "amax_dp", "amax_dqkv", "s_quantizer", "dp_quantizer",
        "dqkv_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout", "o_format",
        "do_format", "dqkv_layout", "qkv_scale_inv_format", "do_scale_inv_format",
        "attn_bias_type", "attn_mask_type", "softmax_type", "window_size",
        "bottom_right_diagonal", "deterministic", "cuda_graph",
    }
)  # fmt: skip
_TE_FWD_NEEDED = frozenset(
    {
        "is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv",
        "q", "k", "v", "fused_attention_backend", "attn_scale", "dropout", "qkv_layout",
        "attn_bias_type", "attn_mask_type", "window_size",
    }
)  # fmt: skip
_TE_BWD_NEEDED = frozenset(
    {
        "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v",
        "o", "d_o", "aux_ctx_tensors", "fused_attention_backend", "attn_scale", "dropout",
        "qkv_layout", "attn_bias_type", "attn_mask_type", "window_size", "deterministic",
    }
)  # fmt: skip


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (TE's ``cuda_graph``)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _te_fixed_kwargs(causal: bool, scale: float, device: torch.device) -> dict[str, Any]:
    """TE arguments shared by forward and backward: no bias, dropout, window, sink.

    ``"causal"`` is TE's top-left causal mask (``"causal_bottom_right"`` is the
    other one), the contract's; ``bottom_right_diagonal=False`` is what TE
    derives from it when left ``None``. The window is ``(-1, 0)`` for causal, as
    TE's ``DotProductAttention`` passes it (``check_set_window_size``): TE >= 2.12
    with cuDNN 9.2 - 9.5 finds no backend for a causal mask with ``(-1, -1)``.
    ``cuda_graph`` says whether the stream is being captured, as TE's own code does
    (it changes which backward cuDNN may run).
    """
    return {
        "attn_scale": float(scale),
        "dropout": 0.0,
        "qkv_layout": _TE_LAYOUT,
        "attn_bias_type": "no_bias",
        "attn_mask_type": "causal" if causal else "no_mask",
        "softmax_type": "vanilla",
        "window_size": (-1, 0) if causal else (-1, -1),
        "bottom_right_diagonal": False,
        "cuda_graph": _capturing(device),
    }


@dataclass(frozen=True)
class TEFusedAttnAPI:
    """TE's ``fused_attn_fwd`` / ``fused_attn_bwd`` as detected from their signatures.

    Attributes:
        fwd_params, bwd_params: parameter names, in order.
        fwd_required, bwd_required: those without a default.
        dtype_arg: ``"qkv_dtype"`` (1.x: a ``tex.DType``) or ``"fake_dtype"`` (2.x:
            the ``torch.dtype``).
        dqkv_dtype: the backward takes ``dqkv_dtype`` (a ``tex.DType``; 1.9 - 2.14).
        version: ``transformer_engine.__version__`` (messages only).
    """

    fwd_params: tuple[str, ...]
    bwd_params: tuple[str, ...]
    fwd_required: frozenset[str]
    bwd_required: frozenset[str]
    dtype_arg: str
    dqkv_dtype: bool
    version: str = "?"

    @property
    def needs_te_dtype(self) -> bool:
        """Whether dtypes go in as ``tex.DType`` (``constants.TE_DType[...]``)."""
        return self.dtype_arg == "qkv_dtype" or self.dqkv_dtype

    def _kwargs(self, params, required, values: dict[str, Any], which: str) -> dict[str, Any]:
        missing = sorted(n for n in required if n not in values)
        if missing:
            raise NotImplementedError(
                f"Transformer Engine {self.version}: {which} requires {missing}, which this "
                f"adapter does not provide (supported: {_TE_SUPPORTED})"
            )
        return {n: values[n] for n in params if n in values}

    def forward_kwargs(self, q, k, v, cu_q, cu_kv, backend, dtype, *, causal, scale, rng_gen=None):
        """Keyword arguments of ``fused_attn_fwd`` for sbhd q, k, v. ``rng_gen``: the
        generator TE draws its (unused, dropout 0) Philox state from."""
        values = {
            "is_training": True,  # the softmax statistics come only with training
            "max_seqlen_q": q.shape[0],
            "max_seqlen_kv": k.shape[0],
            "cu_seqlens_q": cu_q,
            "cu_seqlens_kv": cu_kv,
            "q": q,
            "k": k,
            "v": v,
            self.dtype_arg: dtype,
            "fused_attention_backend": backend,
            **_te_fixed_kwargs(causal, scale, q.device),
            "o_format": _TE_FORMAT,
            "return_max_logit": False,
            "rng_gen": rng_gen,
        }
        return self._kwargs(self.fwd_params, self.fwd_required, values, "fused_attn_fwd")

    def backward_kwargs(
        self, d_o, q, k, v, o, aux, cu_q, cu_kv, backend, dtype, dqkv_dtype, *, causal, scale
    ):
        """Keyword arguments of ``fused_attn_bwd``; it returns new dq, dk, dv."""
        values = {
            "max_seqlen_q": q.shape[0],
            "max_seqlen_kv": k.shape[0],
            "cu_seqlens_q": cu_q,
            "cu_seqlens_kv": cu_kv,
            "q": q,
            "k": k,
            "v": v,
            "o": o,
            "d_o": d_o,
            self.dtype_arg: dtype,
            "dqkv_dtype": dqkv_dtype,
            "aux_ctx_tensors": aux,
            "fused_attention_backend": backend,
            **_te_fixed_kwargs(causal, scale, q.device),
            "o_format": _TE_FORMAT,
            "do_format": _TE_FORMAT,
            "dqkv_layout": _TE_LAYOUT,
            "deterministic": False,
        }
        return self._kwargs(self.bwd_params, self.bwd_required, values, "fused_attn_bwd")


def detect_te_api(fwd: Any, bwd: Any, version: str = "?") -> TEFusedAttnAPI:
    """Read TE's fused-attention conventions from the parameters of fwd and bwd.

    Raises ``NotImplementedError`` naming the TE version for any parameter the
    adapter does not know, or a missing one it needs.
    """
    fp, freq = _param_names(fwd)
    bp, breq = _param_names(bwd)
    checks = (("fused_attn_fwd", fp, _TE_FWD_KNOWN), ("fused_attn_bwd", bp, _TE_BWD_KNOWN))
    for which, params, known in checks:
        unknown = [n for n in params if n not in known]
        if unknown:
            raise NotImplementedError(
                f"Transformer Engine {version}: {which} has parameters {unknown} this adapter "
                f"does not know (supported: {_TE_SUPPORTED}); parameters: {list(params)}"
            )
    fset, bset = set(fp), set(bp)
    dtype_args = [a for a in ("qkv_dtype", "fake_dtype") if a in fset]
    problems = sorted(_TE_FWD_NEEDED - fset) + sorted(_TE_BWD_NEEDED - bset)
    if len(dtype_args) != 1 or dtype_args[0] not in bset:
        problems.append("exactly one of qkv_dtype / fake_dtype, the same in fwd and bwd")
    if problems:
        raise NotImplementedError(
            f"Transformer Engine {version}: fused_attn_fwd{fp} / fused_attn_bwd{bp} lack "
            f"{problems} (supported: {_TE_SUPPORTED})"
        )
    return TEFusedAttnAPI(fp, bp, freq, breq, dtype_args[0], "dqkv_dtype" in bset, version)


def _check_te_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.device.type not in _TE_DEVICES:
        raise NotImplementedError(
            f"kernel 'te' runs on {sorted(_TE_DEVICES)} tensors, not {q.device.type!r}"
        )
    if q.dtype not in _TE_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise NotImplementedError(
            f"kernel 'te' takes q, k, v of one dtype in "
            f"{sorted(str(d).removeprefix('torch.') for d in _TE_DTYPES)}; got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    # TE reads the batch size and head_dim from q's shape only: check k, v agree.
    if (
        q.shape[2] % k.shape[2]
        or k.shape != v.shape
        or (q.shape[1], q.shape[3]) != (k.shape[1], k.shape[3])
    ):
        raise ValueError(
            f"kernel 'te': q {tuple(q.shape)} and k/v {tuple(k.shape)}, {tuple(v.shape)} "
            "must share batch and head_dim, k and v one shape, q heads a multiple of k heads"
        )


@functools.lru_cache(maxsize=64)
def _cached_cu_seqlens(b: int, s: int, device: torch.device) -> Tensor:
    return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)


def _full_cu_seqlens(b: int, s: int, device: torch.device) -> Tensor:
    """[b + 1] int32 offsets of b unpadded sequences of s tokens (TE's full cu_seqlens);
    cached, except while a CUDA graph is captured (the cached tensor would be unfilled)."""
    if _capturing(device):
        return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)
    return _cached_cu_seqlens(b, s, device)


class TEKernel:
    """Transformer Engine's cuDNN fused attention (F16_arbitrary_seqlen) behind the contract.

    Calls ``transformer_engine.pytorch.cpp_extensions.fused_attn.fused_attn_fwd``
    / ``fused_attn_bwd`` as TE's own context-parallel ring attention does:
    layout ``sbhd_sbhd_sbhd`` (our tensors, made contiguous: TE reads a pointer
    and a shape), full ``cu_seqlens`` (int32 [b + 1]), ``fused_attention_backend
    = FusedAttnBackend["F16_arbitrary_seqlen"]``, softmax statistics from
    ``aux_ctx_tensors[0]`` ([b, h, sq, 1] fp32). The backward passes the final
    merged lse back as those statistics with a zero ``rng_state`` (no dropout).
    GQA natively (k, v keep their heads). Tested only against stand-ins with
    TE's exact signatures; never run on a GPU.

    Args:
        fused_attn: the ``cpp_extensions.fused_attn`` module (imported when ``None``).
        te_dtype: the ``constants.TE_DType`` mapping (imported when needed and ``None``).
        version: TE's version for messages (``transformer_engine.__version__``).
    """

    name = "te"

    def __init__(
        self,
        fused_attn: ModuleType | Any | None = None,
        te_dtype: Mapping[torch.dtype, Any] | None = None,
        version: str | None = None,
    ):
        if fused_attn is None:
            fused_attn = importlib.import_module(
                "transformer_engine.pytorch.cpp_extensions.fused_attn"
            )
            te = importlib.import_module("transformer_engine")
            version = version or str(getattr(te, "__version__", "?"))
        version = version or str(getattr(fused_attn, "__version__", "?"))
        self._fwd = fused_attn.fused_attn_fwd
        self._bwd = fused_attn.fused_attn_bwd
        self.api = detect_te_api(self._fwd, self._bwd, version)
        backends = getattr(fused_attn, "FusedAttnBackend", None)
        if not isinstance(backends, Mapping) or "F16_arbitrary_seqlen" not in backends:
            raise NotImplementedError(
                f"Transformer Engine {version}: cpp_extensions.fused_attn has no "
                f"FusedAttnBackend['F16_arbitrary_seqlen'] (supported: {_TE_SUPPORTED})"
            )
        self._backend = backends["F16_arbitrary_seqlen"]  # what TE's CP code passes for F16
        if te_dtype is None and self.api.needs_te_dtype:
            te_dtype = importlib.import_module("transformer_engine.pytorch.constants").TE_DType
        self._te_dtype = te_dtype
        self._generators: dict[str, torch.Generator] = {}

    def _dtypes(self, dtype: torch.dtype) -> tuple[Any, Any]:
        """(value of qkv_dtype / fake_dtype, value of dqkv_dtype) for inputs of ``dtype``."""
        te = self._te_dtype[dtype] if self._te_dtype is not None else None
        return (te if self.api.dtype_arg == "qkv_dtype" else dtype), te

    def _generator(self, device: torch.device) -> torch.Generator:
        """A private generator per device: TE draws a Philox state on every forward even
        without dropout, which would otherwise advance the default CUDA generator."""
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device)
        return self._generators[key]

    def _stats_to_bhs(self, stats: Tensor, b: int, h: int, sq: int, dtype: torch.dtype) -> Tensor:
        if tuple(stats.shape) != (b, h, sq, 1):
            raise RuntimeError(
                f"Transformer Engine {self.api.version}: softmax statistics of shape "
                f"{tuple(stats.shape)}; expected [{b}, {h}, {sq}, 1]"
            )
        return stats.squeeze(-1).to(acc_dtype(dtype))

    def forward(self, q, k, v, *, causal, scale):
        _check_te_inputs(q, k, v)
        sq, b, hq, _ = q.shape
        qc, kc, vc = (x.contiguous() for x in (q, k, v))  # no copy when already sbhd
        cu_q = _full_cu_seqlens(b, sq, q.device)
        cu_kv = _full_cu_seqlens(b, k.shape[0], q.device)
        dtype, _ = self._dtypes(q.dtype)
        # A private generator keeps TE's (unused, dropout 0) Philox draw off the default
        # one; under CUDA graph capture only the default generator is registered, so None.
        gen = None if _capturing(q.device) else self._generator(q.device)
        kw = self.api.forward_kwargs(
            qc, kc, vc, cu_q, cu_kv, self._backend, dtype, causal=causal, scale=scale,
            rng_gen=gen,
        )  # fmt: skip
        res = self._fwd(**kw)
        out, aux = res[0], res[1]  # (out, [stats, rng_state, ...]) in every version
        if tuple(out.shape) != tuple(q.shape):
            raise RuntimeError(
                f"Transformer Engine {self.api.version}: output {tuple(out.shape)} != q "
                f"{tuple(q.shape)}"
            )
        return out, self._stats_to_bhs(aux[0], b, hq, sq, q.dtype)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        _check_te_inputs(q, k, v)
        sq, b, hq, _ = q.shape
        if tuple(lse.shape) != (b, hq, sq):
            raise ValueError(f"lse {tuple(lse.shape)} != [{b}, {hq}, {sq}]")
        qc, kc, vc = (x.contiguous() for x in (q, k, v))
        oc, doc = out.to(q.dtype).contiguous(), dout.to(q.dtype).contiguous()
        # TE's aux_ctx_tensors: the softmax statistics as the forward returns them
        # ([b, h, sq, 1] fp32), here the final merged lse, then the [seed, offset]
        # rng_state (int64 [2]), which no kernel reads without dropout.
        stats = lse.to(acc_dtype(q.dtype)).unsqueeze(-1).contiguous()
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
        cu_q = _full_cu_seqlens(b, sq, q.device)
        cu_kv = _full_cu_seqlens(b, k.shape[0], q.device)
        dtype, dqkv_dtype = self._dtypes(q.dtype)
        aux = [stats, rng_state]
        kw = self.api.backward_kwargs(
            doc,
            qc,
            kc,
            vc,
            oc,
            aux,
            cu_q,
            cu_kv,
            self._backend,
            dtype,
            dqkv_dtype,
            causal=causal,
            scale=scale,
        )
        res = self._bwd(**kw)
        grads = tuple(res[:3])  # [dq, dk, dv, dbias, (d_softmax_offset)]
        for g, x in zip(grads, (q, k, v)):
            if tuple(g.shape) != tuple(x.shape):
                raise RuntimeError(
                    f"Transformer Engine {self.api.version}: gradient {tuple(g.shape)} for "
                    f"an input of shape {tuple(x.shape)}"
                )
        return grads


_CONSTRUCTORS: dict[str, Callable[[], Any]] = {
    "torch": TorchKernel,
    "sdpa": SdpaKernel,
    "flash_attn": FlashAttnKernel,
    "sdpa_flash": SdpaFlashKernel,
    "sdpa_cudnn": SdpaCudnnKernel,
    "sdpa_efficient": SdpaEfficientKernel,
    "te": TEKernel,
}
