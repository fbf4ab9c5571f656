"""``StarTrailCoreAttention``: Megatron's ``core_attention`` slot, backed by StarTrail.

Megatron's ``SelfAttention`` builds it in place of ``DotProductAttention`` /
``TEDotProductAttention`` (``spec.apply_startrail_spec`` does the swap) and
calls it with their forward contract: q ``[sq, b, np, hn]``, k/v
``[sk, b, ng, hn]`` (this TP rank's heads), output ``[sq, b, np*hn]``. The
sequence stays in Megatron's zigzag CP layout, so ``get_batch_on_this_cp_rank``,
RoPE's CP slicing and the loss need no change.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..attention import startrail_attention
from .refusals import REFUSED_FLAGS, causal_window_error, deterministic_mode_error
from .registry import get_startrail_state, subgroup_state
from .versions import cp_group_from

__all__ = ["StarTrailCoreAttention", "hybrid_size", "packed_documents", "packed_seq_params"]


def packed_seq_params(layout, device=None):
    """megatron-core's ``PackedSeqParams(qkv_format="thd")`` of a ``packing.PackedLayout``:
    the global real and padded boundaries (int32), q and kv alike, as TE's THD path and
    ``StarTrailCoreAttention`` read them."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    def cu(xs):
        return torch.tensor(xs, dtype=torch.int32, device=device)

    longest = max(layout.padded_lengths)
    psp = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu(layout.cu_seqlens),
        cu_seqlens_kv=cu(layout.cu_seqlens),
        cu_seqlens_q_padded=cu(layout.cu_seqlens_padded),
        cu_seqlens_kv_padded=cu(layout.cu_seqlens_padded),
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    # the host lists it was made from: the attention reads them instead of the tensors
    psp._startrail_host_boundaries = (list(layout.cu_seqlens), list(layout.cu_seqlens_padded))
    return psp


def packed_documents(
    flat: dict, lengths, cp_size: int, cp_rank: int, device
) -> tuple[dict, object]:
    """Documents of ``lengths``, one after another in each of ``flat``'s 1-D tensors, packed
    for CP rank ``cp_rank`` of ``cp_size``: each document padded to a multiple of 2P and
    sharded by the per-document zigzag (``shard_packed``; padding: token 0, label 0, loss
    mask 0). Returns the local batch (``[1, s_local]`` each, on ``device``) and megatron's
    ``PackedSeqParams(qkv_format="thd")`` with the global boundaries."""
    from ..schedule.packing import pack_lengths
    from ..zigzag import shard_packed

    packed = pack_lengths(lengths, cp_size)
    local = {k: shard_packed(v, packed, cp_rank)[None].to(device) for k, v in flat.items()}
    return local, packed_seq_params(packed, device)


def hybrid_size(psp) -> int | None:
    """``PackedSeqParams.local_cp_size`` where Megatron's hybrid context parallelism set it
    (the call runs on ``psp.cp_group``, a sub-group of that many DP x CP ranks), else None."""
    k = getattr(psp, "local_cp_size", None) if psp is not None else None
    return None if k in (None, 0) else int(k)


def _packed_boundaries(psp, s_local: int) -> tuple[list[int] | None, list[int] | None]:
    """``_read_boundaries``; for the ``PackedSeqParams`` our own code makes
    (``packed_seq_params``: every layer of a micro-batch gets the same one), the host lists
    it was made from, so no layer waits for the device to read them back. Others are read
    at every call (their tensors may be refilled in place, by a collective too, which no
    version counter sees)."""
    own = getattr(psp, "_startrail_host_boundaries", None)
    if own is not None and getattr(psp, "qkv_format", None) == "thd":
        return own
    return _read_boundaries(psp, s_local)


def _read_boundaries(psp, s_local: int) -> tuple[list[int] | None, list[int] | None]:
    """(cu_seqlens, cu_seqlens_padded) of self-attention ``PackedSeqParams``, as host ints
    (``(None, None)`` for a hybrid-CP sub-sample in ``sbhd``: one sequence zigzag-sharded
    over its sub-group); ``NotImplementedError`` naming the field for what StarTrail does
    not serve."""
    fmt = getattr(psp, "qkv_format", None)
    k = hybrid_size(psp)
    if fmt != "thd" and not (fmt == "sbhd" and k is not None):
        raise NotImplementedError(
            "StarTrail attention takes packed sequences in qkv_format 'thd' (and hybrid-CP "
            f"sub-samples in 'sbhd'), got {fmt!r}"
        )

    def host(t):
        if t is None:
            return None
        if t.dim() == 2 and t.shape[0] == 1:  # megatron-core 0.16's SFT batches: [1, n]
            t = t[0]
        if t.dim() != 1:
            raise ValueError(f"packed_seq_params.cu_seqlens_*: a 1-D tensor, got {list(t.shape)}")
        return [int(x) for x in t.tolist()]

    cu_q, cu_kv = host(psp.cu_seqlens_q), host(psp.cu_seqlens_kv)
    pad_q = host(getattr(psp, "cu_seqlens_q_padded", None))
    pad_kv = host(getattr(psp, "cu_seqlens_kv_padded", None))
    if fmt == "sbhd" and k is not None:  # megatron-core 0.16's hybrid CP: one sub-sample
        whole = s_local * k
        if cu_q not in (None, [0, whole]) or pad_q not in (None, [0, whole]):
            raise NotImplementedError(
                "StarTrail attention takes a hybrid-CP sub-sample in qkv_format 'sbhd' as one "
                f"sequence: cu_seqlens_q(_padded) [0, {whole}] (local_cp_size {k} x "
                f"{s_local} local tokens), got {cu_q} / {pad_q}"
            )
        return None, None
    if cu_q is None:
        raise ValueError("packed_seq_params.cu_seqlens_q is None")
    if cu_kv is not None and cu_kv != cu_q or pad_kv is not None and pad_kv != pad_q:
        raise NotImplementedError(
            "StarTrail attention serves self-attention: packed_seq_params.cu_seqlens_kv(_padded) "
            "must equal cu_seqlens_q(_padded)"
        )
    return cu_q, pad_q


def _check_hybrid_rope(psp, thd: bool, model_cp, rope_cp) -> None:
    """Refuse a hybrid-CP call whose RoPE megatron-core slices over another group than the
    one the call runs on (the q and k this attention gets would be rotated for other
    positions): in ``thd`` megatron-core rotates over ``pg_collection.cp`` as it is at the
    call (``rope_cp``: the model's CP group, unless the caller set the sub-group there for
    the call, as our entry point does) whatever ``packed_seq_params.cp_group`` is; in
    ``sbhd`` over ``packed_seq_params.cp_group``, or the model's CP group where it is None."""
    group = psp.cp_group
    if thd:
        rope_ranks = dist.get_process_group_ranks(rope_cp) if rope_cp is not None else None
        ranks = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
        if ranks != (rope_ranks or list(range(dist.get_world_size()))):
            raise NotImplementedError(
                f"a hybrid-CP sub-sample in qkv_format 'thd' on ranks {ranks}: megatron-core "
                "applies RoPE's THD context-parallel slicing over pg_collection.cp, the ranks "
                f"{rope_ranks}, not packed_seq_params.cp_group, so its positions would be "
                "wrong; pass the sub-sample in 'sbhd' (megatron-core 0.16's hybrid CP), or "
                "set pg_collection.cp to the sub-group for the call"
            )
    elif group is None and dist.get_world_size(model_cp) > 1:
        raise NotImplementedError(
            "a hybrid-CP sub-sample of local_cp_size 1 without packed_seq_params.cp_group: "
            "megatron-core then slices RoPE over the model's CP group of "
            f"{dist.get_world_size(model_cp)} ranks, so its positions would be wrong; pass a "
            "one-rank group as cp_group (registry.subgroup_group(1))"
        )


_SUPPORTED_MASKS = (AttnMaskType.causal, AttnMaskType.no_mask)


def _is_window_layer(window, skip_freq, layer_number: int) -> bool:
    """megatron-core's ``is_layer_window_attention`` (0.16): whether layer ``layer_number``
    (1-based) has the sliding window: all layers, or per ``window_attn_skip_freq`` (an int
    N: every N-th layer full attention; a list: 1 for a windowed layer)."""
    if not window:
        return False
    if skip_freq is None:
        return True
    if isinstance(skip_freq, int):
        return layer_number % skip_freq != 0
    if isinstance(skip_freq, (list, tuple)):
        return bool(skip_freq[layer_number - 1])
    raise ValueError(f"window_attn_skip_freq={skip_freq!r}: an int or a list of 0/1 per layer")


def _tp_group(pg_collection, model_comm_pgs):
    for pgs in (pg_collection, model_comm_pgs):
        if pgs is not None and getattr(pgs, "tp", None) is not None:
            return pgs.tp
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(check_initialized=False)


def _group_size(group) -> int:
    if group is None:
        return 1
    return group.size() if hasattr(group, "size") else torch.distributed.get_world_size(group)


def _dropout_rng(dropout_p: float, config):
    """Where ``DotProductAttention`` draws its attention dropout: inside the RNG tracker's
    ``fork`` (the model-parallel stream) unless sequence parallelism is on."""
    if not dropout_p or getattr(config, "sequence_parallel", False):
        return contextlib.nullcontext()
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker().fork()


class StarTrailCoreAttention(MegatronModule):
    """Exact attention over the context-parallel sequence with StarTrail's schedule.

    Accepts the constructor arguments of megatron-core 0.13-0.16
    (``pg_collection`` or ``model_comm_pgs``). Raises ``NotImplementedError``
    at build time for what it does not support yet: masks other than causal / no mask,
    cross attention, ``qk_clip`` / ``log_max_attention_logit`` (no
    ``current_max_attn_logits``); and at call time
    for bias and for packed sequences other than self-attention in ``thd``
    format. Packed sequences (``PackedSeqParams``, ``qkv_format="thd"``): q, k, v
    ``[t, heads, hn]``, this rank's tokens in the per-document zigzag layout of
    the global ``cu_seqlens_q(_padded)`` (as TE's CP attention takes them); the
    output is ``[t, np*hn]``. Hybrid context parallelism (``PackedSeqParams.local_cp_size``
    set): the call runs on ``packed_seq_params.cp_group`` (one rank alone where the size is
    1) with the StarTrail groups registered for it (``registry.subgroup_state``), a
    sub-sample in ``sbhd`` (megatron-core 0.16: one sequence, zigzag over the sub-group) or
    packed in ``thd`` (0.19). Attention dropout (``attention_dropout``, in training mode
    only) runs inside every kernel call (``startrail_attention(dropout_p=)``), drawn
    inside Megatron's RNG tracker ``fork`` unless sequence parallelism is on, exactly where
    ``DotProductAttention`` draws its dropout. Sliding windows: ``config.window_size`` on
    the layers ``window_attn_skip_freq`` selects (Megatron's ``is_layer_window_attention``)
    reach ``startrail_attention(window=)``. ``softmax_type`` ``"off-by-one"`` (a zero sink
    logit per head) and ``"learnable"`` (the ``softmax_offset`` parameter, initialised and
    checkpointed as ``DotProductAttention`` does) are attention sinks (``sinks=``).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        model_comm_pgs=None,
        **kwargs,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.attention_dropout_p = float(dropout or 0.0)
        if attn_mask_type not in _SUPPORTED_MASKS:
            raise NotImplementedError(
                f"StarTrail attention supports attn_mask_type causal or no_mask, got {attn_mask_type}"
            )
        if attention_type != "self":
            raise NotImplementedError("StarTrail attention supports self-attention only")
        if cp_comm_type not in (None, "p2p"):  # StarTrail's schedule is its own
            raise NotImplementedError(
                f"cp_comm_type {cp_comm_type!r} (--cp-comm-type): StarTrail attention runs its "
                "own schedule; allowed: 'p2p' (the default) or None"
            )
        window = getattr(config, "window_size", None)
        freq = getattr(config, "window_attn_skip_freq", None)
        self.window = tuple(window) if _is_window_layer(window, freq, layer_number) else None
        if self.window and attn_mask_type == AttnMaskType.causal and self.window[1] != 0:
            raise ValueError(causal_window_error(self.window, "config.window_size"))
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise NotImplementedError(
                f"StarTrail attention supports softmax_type vanilla, off-by-one or learnable, "
                f"got {softmax_type!r}"
            )
        self.softmax_type = softmax_type
        why = deterministic_mode_error(torch.cuda.is_available())
        if getattr(config, "deterministic_mode", False) and why:
            raise NotImplementedError(why)
        self.tp_group = _tp_group(pg_collection, model_comm_pgs)
        heads = config.num_attention_heads // _group_size(self.tp_group)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.softmax_offset = None
        if softmax_type == "off-by-one":  # a fixed sink logit of 0 per head
            self.register_buffer("_zero_sinks", torch.zeros(heads, device=device), persistent=False)
        elif softmax_type == "learnable":  # as DotProductAttention: same name and init
            self.softmax_offset = torch.nn.Parameter(
                torch.empty(heads, device=device, dtype=config.params_dtype)
            )
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        for name, why in REFUSED_FLAGS.items():  # the flags argument validation refuses
            if getattr(config, name, False):
                raise NotImplementedError(
                    f"StarTrail attention does not support {name} (--{name.replace('_', '-')}): "
                    f"it {why}"
                )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # scores back in the softmax: the effective scale is unchanged.
        self.softmax_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.cp_group = cp_group_from(pg_collection, model_comm_pgs)
        # the parent attention's own collection (megatron-core passes it on): its ``cp`` at
        # call time is the group megatron-core rotated this call's THD RoPE over
        self._pg_collection = pg_collection
        get_startrail_state(self.cp_group)  # fail at build time when the groups are missing

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable sink logits (``softmax_offset``, split over TP ranks along the
        heads), as ``DotProductAttention`` checkpoints them; nothing otherwise."""
        if self.softmax_offset is None:
            return {}
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        params = inspect.signature(make_sharded_tensors_for_checkpoint).parameters
        kw = {}
        if "tp_group" in params:
            kw["tp_group"] = self.tp_group
        if "dp_cp_group" in params:
            kw["dp_cp_group"] = (metadata or {}).get("dp_cp_group")
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            **kw,
        )

    @property
    def state(self):
        """The StarTrail groups of this CP group, looked up per call (``--startrail-team-size
        auto`` swaps them between trials)."""
        return get_startrail_state(self.cp_group)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias=None,
        packed_seq_params=None,
        **kwargs,
    ):
        if attention_bias is not None:
            raise NotImplementedError("StarTrail attention does not support attention_bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in _SUPPORTED_MASKS:
            raise NotImplementedError(
                f"StarTrail attention supports attn_mask_type causal or no_mask, got {mask_type}"
            )
        # A causal mask tensor, if the data loader made one, is the standard causal mask
        # (as TEDotProductAttention, we follow attn_mask_type and ignore it).
        psp = packed_seq_params
        k = hybrid_size(psp)
        # hybrid CP: the sub-group the sub-sample runs on, named per call
        state = self.state if k is None else subgroup_state(psp.cp_group, k)
        thd = psp is not None and getattr(psp, "qkv_format", None) == "thd"
        if k is not None:
            rope_cp = getattr(self._pg_collection, "cp", None) or self.cp_group
            _check_hybrid_rope(psp, thd, self.cp_group, rope_cp)
        cu, cu_padded = (None, None) if psp is None else _packed_boundaries(psp, query.shape[0])
        if thd:  # [t, np, hn]: the local tokens of the packed sequence, batch 1
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        state.local_lengths.add(query.shape[0])
        state.calls_by_length[query.shape[0]] += 1
        dropout_p = self.attention_dropout_p if self.training else 0.0
        sinks = None
        if self.softmax_type == "learnable":
            sinks = self.softmax_offset
        elif self.softmax_type == "off-by-one":
            sinks = self._zero_sinks
        with _dropout_rng(dropout_p, self.config):
            out = startrail_attention(
                query,
                key,
                value,
                state.groups,
                causal=mask_type == AttnMaskType.causal,
                softmax_scale=self.softmax_scale,
                kernel=state.kernel,
                ledger=state.ledger,
                cu_seqlens=cu,
                cu_seqlens_padded=cu_padded,
                dropout_p=dropout_p,
                window=self.window,
                sinks=None if sinks is None else sinks.to(query.device),
                tile=state.attention_tile,
                head_chunks=state.attention_head_chunks,
            )
        if dropout_p:
            state.dropout_calls += 1
        sq, b = out.shape[:2]
        if thd:
            return out.reshape(sq, -1)  # [t, np*hn], as TEDotProductAttention's thd output
        return out.reshape(sq, b, -1)  # [sq, b, np*hn]
