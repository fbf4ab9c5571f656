"""The checks every StarTrail call makes before it sends anything.

``validate_inputs``: local shape/dtype/device checks (``ValueError`` naming what
is wrong, identical on every rank); ``packed_layout``: the ``cu_seqlens`` of
packed documents; ``agree_once``: the one collective check, the first time a
rank sees a call setting, that every CP rank has the same (so that ranks that
disagree raise instead of hanging).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import struct

import torch
from torch import Tensor

from .comm import DEFAULT_COMM, CommOptions, check_agreement
from .comm.overlap import refuse_device_delay
from .groups import StarTrailGroups, UlyssesStarTrailGroups
from .schedule import OWN_ROWS_FIRST_SETTINGS, check_tile, normalize_window
from .schedule.layout import placement_code
from .schedule.packing import PackedLayout

__all__ = [
    "AttnOptions",
    "agree_once",
    "first_order_only",
    "check_joint_kv",
    "check_options",
    "packed_layout",
    "validate_inputs",
]


def first_order_only(what: str):
    """Decorates an autograd Function's ``backward`` whose gradients are not themselves
    differentiable (transfers between ranks, kernels' saved statistics, an inner
    ``torch.autograd.grad``): a backward asked to build a graph (``create_graph=True``: a
    double backward, a gradient penalty) raises a ``RuntimeError`` naming ``what``.
    ``torch.autograd.function.once_differentiable`` is not enough: it raises only where the
    incoming gradient requires one, so a loss linear in the output (a frozen projection)
    got gradients whose second-order terms were silently missing. Autograd runs a backward
    with grad mode on exactly where ``create_graph=True``; a plain backward, activation
    checkpointing's included, runs it off."""

    def wrap(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(
                    f"{what} has no double backward: its gradients are not differentiable, "
                    "so a backward with create_graph=True (a gradient penalty, a Hessian "
                    "product) would miss their second-order terms; take the gradients "
                    "without create_graph"
                )
            return backward(ctx, *grads)

        return checked

    return wrap


_DTYPE_CODES = {torch.float64: 0, torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


def validate_inputs(q: Tensor, k: Tensor, v: Tensor, cp_size: int, causal: bool) -> None:
    """Local checks, identical on every rank, made before any communication."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims [s_local, batch, heads, head_dim], got shape "
                f"{tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPE_CODES:  # fp8: the merges and kernels would run at its precision
        raise ValueError(
            f"q, k, v are {q.dtype}; StarTrail takes float64, float32, float16 or bfloat16"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    (s, b, hq, d), (sk, bk, hkv, dk) = q.shape, k.shape
    if (sk, bk, dk) != (s, b, d):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on s_local, batch and head_dim"
        )
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA/MQA"
        )
    if s == 0:
        raise ValueError("s_local is 0: every CP rank needs at least one token")
    if causal and s % 2 != 0:
        raise ValueError(
            f"causal StarTrail needs Megatron's zigzag layout: the sequence must split into "
            f"2*cp_size = {2 * cp_size} equal chunks, i.e. an even s_local; got s_local={s} "
            f"(sequence length {s * cp_size})"
        )


def check_dropout(dropout_p) -> float:
    """``dropout_p`` as a float in [0, 1) (``ValueError`` naming it otherwise)."""
    ok = isinstance(dropout_p, numbers.Real) and not isinstance(dropout_p, bool)
    if not ok or not math.isfinite(dropout_p) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} must be a number with 0 <= dropout_p < 1")
    return float(dropout_p)


@dataclasses.dataclass(frozen=True)
class AttnOptions:
    """A call's attention variants, checked (``check_options``): dropout probability, the
    normalized window (``schedule.normalize_window``), logit soft-capping (0: off);
    ``tile``, the largest kernel call in tokens (``schedule.tile_calls``; None: whole
    calls), which changes how the pairs are cut into calls, never the result; and
    ``head_chunks``, how many KV-head groups the call runs one after the other
    (``attention.py``: the team buffers of one group at a time; 1: all heads at once)."""

    dropout_p: float = 0.0
    window: tuple[int | None, int | None] | None = None
    softcap: float = 0.0
    tile: int | None = None
    head_chunks: int = 1

    @property
    def kernel_needs(self) -> dict[str, bool]:
        """What the kernel must run (``kernels.resolve_kernel``'s keywords)."""
        return {
            "dropout": self.dropout_p > 0,
            "window": self.window is not None,
            "softcap": self.softcap > 0,
        }


NO_OPTIONS = AttnOptions()
"""Plain attention: no dropout, window or soft-capping."""


def check_head_chunks(head_chunks, heads_kv: int, dropout_p: float = 0.0) -> int:
    """``head_chunks`` checked against ``heads_kv`` (``ValueError`` naming it): None or 1
    (all heads at once), or a divisor of the KV heads (each chunk keeps its query heads:
    GQA groups stay whole); not with dropout yet (a call's mask is drawn for the heads it
    runs, and its record is kept per step and call, not per chunk)."""
    if head_chunks is None:
        return 1
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
        raise ValueError(f"head_chunks={head_chunks!r} must be None or an integer >= 1")
    if heads_kv % head_chunks:
        allowed = [n for n in range(1, heads_kv + 1) if heads_kv % n == 0]
        raise ValueError(
            f"head_chunks={head_chunks} must divide the KV heads ({heads_kv}); allowed: {allowed}"
        )
    if head_chunks > 1 and dropout_p > 0:
        raise ValueError(
            f"head_chunks={head_chunks} with dropout_p={dropout_p} is not supported yet: use "
            "head_chunks=1 with dropout"
        )
    return head_chunks


def check_options(
    q: Tensor, cp_size: int, causal: bool, dropout_p, window, softcap, sinks, tile=None,
    head_chunks=None, heads_kv: int | None = None,
):  # fmt: skip
    """The checked ``AttnOptions`` of a call on this rank's ``q`` (``ValueError`` naming the
    argument); ``sinks`` are checked too (they travel as a tensor, not as an option).
    ``heads_kv``: the KV heads ``head_chunks`` must divide (default: q's heads)."""
    dropout_p = check_dropout(dropout_p)
    win = normalize_window(window, cp_size * q.shape[0], bool(causal))
    check_window_layout(win and window, q.shape[0])
    cap = check_softcap(softcap)
    check_sinks(sinks, q)
    hkv = q.shape[2] if heads_kv is None else heads_kv
    chunks = check_head_chunks(head_chunks, hkv, dropout_p)
    return AttnOptions(dropout_p, win, cap, check_tile(tile), chunks)


OWN_ROWS_FIRST_ENV = "STARTRAIL_OWN_ROWS_FIRST"


def own_rows_first_setting(raw, name: str) -> bool | None:
    """``raw`` (``auto``, ``on``, ``off``, any case) -> None, True, False; ``ValueError``
    naming the setting ``name`` and the allowed words otherwise."""
    value = raw.strip().lower() if isinstance(raw, str) else None
    if value not in OWN_ROWS_FIRST_SETTINGS:
        raise ValueError(f"{name}={raw!r} is not known; allowed: {list(OWN_ROWS_FIRST_SETTINGS)}")
    return OWN_ROWS_FIRST_SETTINGS[value]


def own_rows_first_from_env(environ=os.environ) -> bool | None:
    """``$STARTRAIL_OWN_ROWS_FIRST`` (``auto``, ``on``, ``off``; unset: ``auto``): what
    ``CommOptions(own_rows_first=None)`` means where the groups carry no setting either,
    so that any caller can set it without a flag of its own, as ``$STARTRAIL_KERNEL`` does
    the kernel. ``ValueError`` naming the variable on any other value."""
    return own_rows_first_setting(environ.get(OWN_ROWS_FIRST_ENV, "auto"), OWN_ROWS_FIRST_ENV)


def check_comm_options(comm_options, q: Tensor, groups_default: bool | None = None) -> CommOptions:
    """``comm_options`` checked (``None``: the default): a ``CommOptions``, and no injected
    delay on CUDA tensors (a host-side sleep does not slow a transfer on its stream).
    ``own_rows_first=None`` takes ``groups_default`` (``StarTrailGroups.own_rows_first``:
    the adapter's flag or config key) where it is set, else ``$STARTRAIL_OWN_ROWS_FIRST``
    (``own_rows_first_from_env``), else stays None (the rule)."""
    if comm_options is None:
        comm_options = DEFAULT_COMM
    if not isinstance(comm_options, CommOptions):
        raise ValueError(
            f"comm_options must be a comm.CommOptions or None, got {type(comm_options).__name__}"
        )
    if q.device.type == "cuda":
        refuse_device_delay(comm_options)
    if comm_options.own_rows_first is None:
        pick = groups_default if groups_default is not None else own_rows_first_from_env()
        if pick is not None:
            comm_options = dataclasses.replace(comm_options, own_rows_first=pick)
    return comm_options


def check_joint_kv(joint_kv, k: Tensor, causal: bool, options: AttnOptions):
    """``joint_kv``: ``None`` or ``(k_joint, v_joint)`` shaped ``[t, batch, heads_kv,
    head_dim]`` like ``k`` but for ``t >= 1`` tokens, in k's dtype and device; full
    attention without dropout or window (``ValueError`` naming what is wrong)."""
    if joint_kv is None:
        return None, None
    if not isinstance(joint_kv, (tuple, list)) or len(joint_kv) != 2:
        raise ValueError("joint_kv must be a pair (k_joint, v_joint) of tensors, or None")
    _, b, hkv, d = k.shape
    for name, t in zip(("k_joint", "v_joint"), joint_kv):
        if not isinstance(t, Tensor) or t.dim() != 4 or tuple(t.shape[1:]) != (b, hkv, d):
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(
                f"joint_kv: {name} must be [t, batch, heads_kv, head_dim] = [t, {b}, {hkv}, {d}], "
                f"got {got}"
            )
        if t.dtype != k.dtype or t.device != k.device:
            raise ValueError(
                f"joint_kv: {name} is {t.dtype} on {t.device}; k is {k.dtype} on {k.device}"
            )
    if joint_kv[0].shape != joint_kv[1].shape or joint_kv[0].shape[0] < 1:
        raise ValueError(
            f"joint_kv: k_joint {tuple(joint_kv[0].shape)} and v_joint "
            f"{tuple(joint_kv[1].shape)} must have the same shape, with at least one token"
        )
    if causal:
        raise ValueError("joint_kv needs causal=False (joint attention is full attention)")
    if options.dropout_p or options.window is not None:
        raise ValueError(
            f"joint_kv takes no dropout_p ({options.dropout_p}) or window ({options.window}); "
            "allowed: dropout_p=0 and window=None"
        )
    return joint_kv[0], joint_kv[1]


def check_window_layout(window, s_local: int) -> None:
    """A window needs the zigzag layout (global positions of the local rows), causal or not:
    an even ``s_local`` (``ValueError`` naming it)."""
    if window is not None and s_local % 2:
        raise ValueError(
            f"window={window} needs the zigzag layout (zigzag_shard: CP rank r holds chunks r "
            f"and 2P-1-r), so an even s_local; got s_local = {s_local}"
        )


def check_softcap(softcap) -> float:
    """Logit soft-capping as a float (0: off); ``ValueError`` naming ``softcap``."""
    if softcap is None:
        return 0.0
    ok = isinstance(softcap, numbers.Real) and not isinstance(softcap, bool)
    if not ok or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap={softcap!r} must be a finite number > 0, or None / 0 for none")
    return float(softcap)


def check_sinks(sinks, q: Tensor) -> None:
    """``sinks`` is ``None`` or a floating ``[heads_q]`` tensor on q's device."""
    if sinks is None:
        return
    hq = q.shape[2]
    if not isinstance(sinks, Tensor):
        raise ValueError(f"sinks must be a [heads_q] = [{hq}] tensor, got {type(sinks).__name__}")
    if tuple(sinks.shape) != (hq,) or not sinks.is_floating_point():
        raise ValueError(
            f"sinks must be a floating-point [heads_q] = [{hq}] tensor, got shape "
            f"{tuple(sinks.shape)} {sinks.dtype}"
        )
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device}, q on {q.device}")


def agree_once(
    groups: StarTrailGroups | UlyssesStarTrailGroups,
    q: Tensor,
    k: Tensor,
    causal: bool,
    packed: PackedLayout | None = None,
    options: AttnOptions = NO_OPTIONS,
    sinks: bool = False,
    *,
    scale: float,
    joint_tokens: int = 0,
) -> None:
    """Check, the first time this rank sees a call setting, that every CP rank has the same.

    Ranks that disagree on the local length, batch, heads, head_dim, dtype,
    causal, softmax scale (the resolved ``scale``: partials at different scales would
    merge into a wrong output, silently), dropout_p, window, softcap, sinks, joint tokens, head chunks or the packed documents (or on C, placement, P, U through their groups)
    would post mismatched
    transfers and hang until the group's timeout; instead every rank raises the
    same ``ValueError`` naming what differs. One tiny all-reduce, and one device
    synchronization to read it, per new setting (not per call). A rank that
    changes its setting while the others reuse one they already checked is not
    caught here: its transfers then fail at the group's timeout, naming the peers.
    Skipped while a CUDA graph is being captured (no host read is allowed there;
    the warm-up iterations before a capture make the check).
    """
    (s, b, hq, d), hkv = q.shape, k.shape[2]
    lay, window = groups.layout, options.window
    fields = {
        "s_local": s,
        "batch": b,
        "heads_q": hq,
        "heads_kv": hkv,
        "head_dim": d,
        "dtype": _DTYPE_CODES[q.dtype],
        "causal": int(causal),
        "cp_size": lay.cp_size,
        "team_size": lay.team_size,
        "placement": placement_code(lay.placement),
        "ulysses_size": getattr(lay, "ulysses_size", 1),
        "documents": packed.num_docs if packed is not None else 0,
        "cu_seqlens": packed.fingerprint() if packed is not None else 0,
        "dropout_p (1e-9)": round(options.dropout_p * 1e9),
        "window left (-1: none)": -1 if window is None or window[0] is None else window[0],
        "window right (-1: none)": -1 if window is None or window[1] is None else window[1],
        "softmax_scale (float64 bits)": _float_bits(scale),
        "softcap (float64 bits)": _float_bits(options.softcap),
        "sinks": int(sinks),
        "joint tokens": joint_tokens,
        "head_chunks": options.head_chunks,
    }
    key = tuple(fields.values())
    if lay.cp_size == 1 or key in groups.agreed:
        return
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    check_agreement(groups.cp_group, fields, q.device)
    if len(groups.agreed) >= 256:  # packed batches give a new setting per micro-batch
        groups.agreed.clear()
    groups.agreed.add(key)


def _float_bits(x: float) -> int:
    """``x``'s float64 bits as an integer: equal exactly where the floats are."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def packed_layout(
    cp_size: int, s_local: int, cu_seqlens, cu_seqlens_padded=None
) -> PackedLayout | None:
    """The ``PackedLayout`` of a call's ``cu_seqlens`` (``None`` for none), checked against
    the local length: ``ValueError`` naming the argument, before any communication."""
    if cu_seqlens is None:
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded needs cu_seqlens (the real boundaries)")
        return None
    packed = PackedLayout.create(cp_size, cu_seqlens, cu_seqlens_padded)
    if packed.total != cp_size * s_local:
        name = "cu_seqlens_padded" if cu_seqlens_padded is not None else "cu_seqlens"
        raise ValueError(
            f"{name} ends at {packed.total}, but the sequence has cp_size * s_local = "
            f"{cp_size} * {s_local} = {cp_size * s_local} tokens"
        )
    return packed
