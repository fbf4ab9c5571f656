"""Shared pieces of the Megatron tests: proof that StarTrail ran in a Megatron run."""

from __future__ import annotations

from startrail_megatron.megatron import StarTrailCoreAttention

MOCK_DOCUMENTS = 1000
"""Documents in megatron-core's ``--mock-data`` dataset on the suite's ranks (megatron-core's
own: 100,000, whose 2-million-sample shuffle index every rank of every Megatron test rebuilt,
0.3 s of CPU each, a third of those tests' time). A test trains a few hundred samples at most.
Entry points spawned as new interpreters keep megatron-core's size."""

MEGATRON_MOCK_DOCUMENTS: int | None = None
"""megatron-core's own size, kept by ``shrink_mock_data``."""


def shrink_mock_data() -> None:
    """``MOCK_DOCUMENTS`` in this process and every rank forked from it afterwards
    (``conftest.py`` calls it after collection, before the first pool)."""
    global MEGATRON_MOCK_DOCUMENTS
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    if MEGATRON_MOCK_DOCUMENTS is None:
        MEGATRON_MOCK_DOCUMENTS = MockGPTLowLevelDataset.size
    MockGPTLowLevelDataset.size = MOCK_DOCUMENTS


def startrail_proof(args, model, steps: int) -> dict | None:
    """With StarTrail on: what it recorded on this rank next to what it must have done.

    ``None`` for a run without StarTrail CP. Otherwise the attention modules in use, the
    local lengths the attention saw and the ledger's totals, beside S/P and the
    accounting's bytes and calls for this layout times the attention calls made
    (steps x layers x micro-batches per step).
    """
    if args.context_parallel_impl != "startrail" or args.context_parallel_size == 1:
        return None
    from megatron.core import parallel_state as ps

    from startrail_megatron.accounting import (
        LocalShape,
        split_comm_bytes,
        split_comm_calls,
        split_ring_shape,
        startrail_comm_bytes,
        startrail_comm_calls,
    )
    from startrail_megatron.megatron.registry import get_startrail_state
    from startrail_megatron.schedule import tail_head_groups
    from startrail_megatron.schedule.ulysses import UlyssesLayout

    state = get_startrail_state(ps.get_context_parallel_group())
    lay, r = state.groups.layout, state.groups.cp_rank
    tp = args.tensor_model_parallel_size
    shape = LocalShape(
        s_local=args.seq_length // lay.cp_size,
        batch=args.micro_batch_size,
        heads_q=args.num_attention_heads // tp,
        heads_kv=(args.num_query_groups or args.num_attention_heads) // tp,
        head_dim=args.hidden_size // args.num_attention_heads,
        elem_bytes=4,
    )
    micro = args.global_batch_size // (args.micro_batch_size * ps.get_data_parallel_world_size())
    n = steps * args.num_layers * micro
    # a recomputed attention runs its forward (and so its forward's transfers) again
    n_fwd = n + steps * micro * recomputed_attention_layers(args)
    dropout = bool(getattr(args, "attention_dropout", 0.0))
    hc = state.attention_head_chunks or 1  # each chunk: the same transfers on 1/hc the heads
    if isinstance(lay, UlyssesLayout):  # the 2-D split: the all-to-alls and StarTrail over R
        ring = split_ring_shape(lay, shape)
        per_call = split_comm_bytes(lay, r, shape)
        tail = len(tail_head_groups(lay.ring, ring.heads_q // hc, ring.heads_kv // hc, dropout))
        calls = split_comm_calls(lay, r, tail, head_chunks=hc)
    else:
        per_call = startrail_comm_bytes(lay, r, shape)
        tail = len(tail_head_groups(lay, shape.heads_q // hc, shape.heads_kv // hc, dropout))
        sends = lay.p2p_sends(r, backward=True)
        calls = startrail_comm_calls(lay.team_size, sends, tail, head_chunks=hc)
    times = {k: n_fwd if k.startswith("fwd") else n for k in per_call}
    want = {k: times[k] * v for k, v in per_call.items()}
    led = state.ledger.summary()
    return {
        "attention": sum(isinstance(m, StarTrailCoreAttention) for m in model.modules()),
        "layers": args.num_layers,
        "local_lengths": (sorted(state.local_lengths), [shape.s_local]),
        # the 2-D split in use exactly when asked for (its U), not plain StarTrail over P
        "ulysses_size": (
            getattr(lay, "ulysses_size", 1),
            getattr(args, "startrail_ulysses_size", 1),
        ),
        "bytes": ({k: led[f"{k}_bytes"] for k in want}, want),
        "calls": (
            {k: led[f"{k}_calls"] for k in want},
            {k: times[k] * v for k, v in calls.items()},
        ),
        "dropout_calls": state.dropout_calls,
        "placement": getattr(lay, "placement", None),
    }


def recomputed_attention_layers(args) -> int:
    """How many layers' attention megatron-core runs again in the backward under the
    recompute flags: full recompute, every layer (uniform) or the first
    ``--recompute-num-layers`` (block); selective, every layer if ``core_attn`` is among
    its modules (the default)."""
    gran = getattr(args, "recompute_granularity", None)
    if gran == "full":
        if args.recompute_method == "uniform":
            return args.num_layers
        return min(args.recompute_num_layers, args.num_layers)
    if gran == "selective":
        return args.num_layers if "core_attn" in (args.recompute_modules or ["core_attn"]) else 0
    return 0


def assert_startrail_ran(proof: dict) -> None:
    assert proof["attention"] == proof["layers"], proof  # StarTrail's module on every layer
    for what in ("local_lengths", "ulysses_size", "bytes", "calls"):
        got, want = proof[what]
        assert got == want, (what, got, want)


def entry_point_train(rank: int, world: int, argv: list[str]) -> None:
    """What each rank of ``python -m startrail_megatron.pretrain_gpt --nproc N`` runs
    (``training.train`` on the parsed flags), on a pool rank: the same training without
    spawning and importing N new interpreters (``test_megatron.py::test_readme_main_command``
    and the Ctrl-C test run the spawn itself)."""
    from startrail_megatron.megatron.training import parse_args, train

    train(parse_args(argv))


def entry_point_train_as_spawned(rank: int, world: int, argv: list[str]) -> None:
    """``entry_point_train`` on megatron-core's own ``--mock-data`` size, the data a spawned
    entry point trains on, for a comparison with one."""
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    shrunk = MockGPTLowLevelDataset.size
    MockGPTLowLevelDataset.size = MEGATRON_MOCK_DOCUMENTS or shrunk
    try:
        entry_point_train(rank, world, argv)
    finally:
        MockGPTLowLevelDataset.size = shrunk
