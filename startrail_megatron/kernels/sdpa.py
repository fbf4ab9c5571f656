"""PyTorch's fused SDPA ops that return the log-sum-exp, behind the kernel contract.

``SdpaKernel`` (``"sdpa"``): the CPU flash kernel; on CUDA it runs the
efficient-attention kernel. ``SdpaFlashKernel``, ``SdpaCudnnKernel`` and
``SdpaEfficientKernel`` (``"sdpa_flash"``, ``"sdpa_cudnn"``, ``"sdpa_efficient"``):
PyTorch's CUDA flash, cuDNN and memory-efficient ops.

Layouts and row statistics (read from PyTorch's sources): the ops want
``[b, h, s, d]`` (our ``[s, b, h, d]`` permuted, a view); the efficient kernel
pads its lse to a multiple of 32 rows and cuDNN returns it as ``[b, h, sq, 1]``.
``contract.lse_to_bhs`` brings them to ``[b, h, sq]``; ``_pad_rows`` gives the
efficient backward the padded form back.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .contract import AttentionKernel, acc_dtype, lse_to_bhs
from .spec import ALL_FLOAT, HALF, BackendSpec

__all__ = ["SdpaCudnnKernel", "SdpaEfficientKernel", "SdpaFlashKernel", "SdpaKernel"]


class SdpaKernel:
    """PyTorch's fused SDPA kernels that return the log-sum-exp.

    CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ backward),
    any float dtype, GQA natively. CUDA: ``aten._scaled_dot_product_efficient_
    attention`` (+ backward), fp32/fp16/bf16; KV heads are expanded (a view
    where possible) since that kernel has no GQA.
    """

    name = "sdpa"
    # no dropout: the CPU op returns no RNG state to rebuild a mask from
    spec = BackendSpec(name, frozenset({"cpu", "cuda"}), ALL_FLOAT, dropout=False)
    supports_dropout = spec.dropout

    @staticmethod
    def _bhsd(x: Tensor) -> Tensor:
        return x.permute(1, 2, 0, 3)  # [s, b, h, d] -> (b, h, s, d)

    def forward(self, q, k, v, *, causal, scale):
        if q.device.type != "cpu":
            return self._cuda().forward(q, k, v, causal=causal, scale=scale)
        qb, kb, vb = self._bhsd(q), self._bhsd(k), self._bhsd(v)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qb, kb, vb, 0.0, causal, scale=scale
        )
        return out.permute(2, 0, 1, 3), lse.to(acc_dtype(q.dtype))

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        if q.device.type != "cpu":
            return self._cuda().backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        qb, kb, vb = self._bhsd(q), self._bhsd(k), self._bhsd(v)
        dob, ob = self._bhsd(dout.to(q.dtype)), self._bhsd(out.to(q.dtype))
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dob,
            qb,
            kb,
            vb,
            ob,
            lse.to(acc_dtype(q.dtype)).contiguous(),
            0.0,
            causal,
            scale=scale,
        )
        return dq.permute(2, 0, 1, 3), dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3)

    @staticmethod
    def _cuda() -> AttentionKernel:
        return SdpaEfficientKernel()


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
# With dropout each op draws a Philox (seed, offset) from the current CUDA generator
# (Megatron's RNG tracker ``fork`` swaps it) and returns it; the record keeps the pair
# and the backward op rebuilds the mask from it.


def _drop_p(dropout) -> float:
    if dropout is None:
        return 0.0
    if dropout.generator is not None:
        raise NotImplementedError(
            "PyTorch's SDPA ops draw dropout from the CUDA default generator; they take no "
            "generator of their own"
        )
    return dropout.p


def _keep_philox(dropout, seed: Tensor, offset: Tensor) -> None:
    if dropout is not None:
        dropout.state = (seed, offset)


class SdpaFlashKernel:
    """``aten._scaled_dot_product_flash_attention``: PyTorch's flash kernel, GQA natively."""

    name = "sdpa_flash"
    spec = BackendSpec(name, frozenset({"cuda"}), HALF, None, 256, 8, (8, 0))
    supports_dropout = spec.dropout

    def forward(self, q, k, v, *, causal, scale, dropout=None):
        sq, b, hq, _ = q.shape
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), _drop_p(dropout), causal, False, scale=scale
        )
        out, lse = res[0], res[1]  # (b, hq, sq, d), (b, hq, sq) fp32
        _keep_philox(dropout, res[6], res[7])
        return _sbhd(out), lse_to_bhs(lse, b, hq, sq)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, dropout=None):
        sq, sk = q.shape[0], k.shape[0]
        dev = q.device
        if dropout is not None:
            rng, unused = dropout.state  # the forward's Philox seed and offset
        else:  # unused without dropout
            rng = torch.zeros(2, dtype=torch.uint64, device=dev)
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
            _drop_p(dropout),
            causal,
            rng,
            unused,
            scale=scale,
        )
        return _sbhd(dq), _sbhd(dk), _sbhd(dv)


class SdpaEfficientKernel:
    """``aten._scaled_dot_product_efficient_attention`` (memory-efficient); KV expanded."""

    name = "sdpa_efficient"
    spec = BackendSpec(
        name,
        frozenset({"cuda"}),
        frozenset({torch.float32, torch.float16, torch.bfloat16}),
        head_dim_multiple=8,
        min_capability=(5, 0),
    )
    supports_dropout = spec.dropout

    def forward(self, q, k, v, *, causal, scale, dropout=None):
        sq, b, hq, _ = q.shape
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            _bhsd(q),
            _expand_kv(_bhsd(k), hq),
            _expand_kv(_bhsd(v), hq),
            None,
            True,
            _drop_p(dropout),
            causal,
            scale=scale,
        )
        _keep_philox(dropout, seed, offset)
        return _sbhd(out), lse_to_bhs(lse, b, hq, sq)  # lse rows padded to 32

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, dropout=None):
        hq, hkv = q.shape[2], k.shape[2]
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
        if dropout is not None:
            seed, offset = dropout.state
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bhsd(dout.to(q.dtype)),
            _bhsd(q),
            _expand_kv(_bhsd(k), hq),
            _expand_kv(_bhsd(v), hq),
            None,
            _bhsd(out.to(q.dtype)),
            _pad_rows(lse, 32),  # the forward's padded form
            seed,
            offset,
            _drop_p(dropout),
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return _sbhd(dq), _sbhd(_reduce_kv(dk, hkv)), _sbhd(_reduce_kv(dv, hkv))


class SdpaCudnnKernel:
    """``aten._scaled_dot_product_cudnn_attention`` (cuDNN >= 9); KV expanded, dense inputs."""

    name = "sdpa_cudnn"
    spec = BackendSpec(name, frozenset({"cuda"}), HALF, None, 128, 8, (8, 0), 90000)
    supports_dropout = spec.dropout

    def forward(self, q, k, v, *, causal, scale, dropout=None):
        sq, b, hq, _ = q.shape
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhsd(q).contiguous(),
            _expand_kv(_bhsd(k), hq).contiguous(),
            _expand_kv(_bhsd(v), hq).contiguous(),
            None,
            True,
            _drop_p(dropout),
            causal,
            False,
            scale=scale,
        )
        _keep_philox(dropout, res[6], res[7])
        return _sbhd(res[0]), lse_to_bhs(res[1], b, hq, sq)  # lse (b, hq, sq, 1)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, dropout=None):
        sq, sk, hq, hkv = q.shape[0], k.shape[0], q.shape[2], k.shape[2]
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
        if dropout is not None:
            seed, offset = dropout.state
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(dout.to(q.dtype)).contiguous(),
            _bhsd(q).contiguous(),
            _expand_kv(_bhsd(k), hq).contiguous(),
            _expand_kv(_bhsd(v), hq).contiguous(),
            _bhsd(out.to(q.dtype)).contiguous(),
            lse.float().unsqueeze(-1).contiguous(),  # the forward's (b, hq, sq, 1)
            seed,
            offset,
            None,
            None,
            None,
            sq,
            sk,
            _drop_p(dropout),
            causal,
            scale=scale,
        )
        return _sbhd(dq), _sbhd(_reduce_kv(dk, hkv)), _sbhd(_reduce_kv(dv, hkv))
