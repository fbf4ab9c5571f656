"""``--hybrid-context-parallel``: per-batch CP sub-groups in the entry point.

Megatron's hybrid context parallelism (megatron-core 0.16+) runs each document of a batch
on a sub-group of the DP x CP ranks of its own size (``schedule/batch.py``'s Note
[per-batch CP layouts]): one rank alone where it is short, many where it is long. Here
every rank reads the whole global batch's micro-batch (all DP replicas' rows; the dataset
is indexable, so no sample is sent), cuts it into documents at the end-of-document tokens
(as ``--reset-attention-mask``), and a scheduler assigns each document to an aligned
sub-group of the DP x CP ranks Megatron made groups for (``registry.hybrid_group_sizes``):

* ``--startrail-batch-scheduler startrail``: ``planner.batch.schedule_batch`` on the
  planner's cost model (of ``--startrail-batch-cluster``; the run's GPT layer, whose dense
  GEMMs cost a rank per token it holds, ``batch_model``), each sub-group of k ranks with the
  team size the run gives it (``team_size_within(k, --startrail-team-size)``; with ``auto``
  the cost model's pick for k, ``model_team_sizes``), a document's share per rank within
  ``--max-seqlen-per-dp-cp-rank`` where given;
* ``--startrail-batch-scheduler megatron``: megatron-core's own ``BalancedCPScheduler``
  (``--max-seqlen-per-dp-cp-rank``), its rounds one after the other.

Each rank then runs its documents sub-group by sub-group, larger sub-groups first (a rank
is in one aligned sub-group of each size, so every rank of a sub-group reaches it in the
same order and no two sub-groups wait on each other in a cycle), the documents of one
sub-group packed into THD forwards (``schedule.batch.document_bins``: first fit, longest
first, as many as ``--max-seqlen-per-dp-cp-rank`` allows in one; each document padded to a multiple of 2k
and sharded by the per-document zigzag over the sub-group's k ranks,
``PackedSeqParams(qkv_format="thd", local_cp_size=k, cp_group=...)``). megatron-core
rotates a THD call's RoPE over ``pg_collection.cp``, so for each forward ``rope_over``
sets that to the sub-group (StarTrailCoreAttention checks it). (megatron-core 0.16's own
hybrid schedule passes one ``sbhd`` sub-sample per forward instead, which the attention
also takes.) Our scheduler prices a sub-group's calls as these bins (``binned``).
The loss is the per-token mean over the global batch, and megatron's DDP averages the
gradients over DP x CP: the same loss and gradients as CP = 1.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist

__all__ = [
    "SCHEDULERS",
    "add_hybrid_args",
    "batch_cluster",
    "batch_model",
    "check_hybrid_args",
    "document_lengths",
    "hybrid_forward_backward",
    "megatron_rounds",
    "model_team_sizes",
    "rope_over",
]

SCHEDULERS = ("startrail", "megatron")
"""``--startrail-batch-scheduler``: ours (``planner.batch.schedule_batch``) or
megatron-core's ``BalancedCPScheduler``."""


def document_lengths(tokens: torch.Tensor, eod: int) -> list[int]:
    """The documents of ``tokens`` ``[rows, S]``, in order: each ends at an end-of-document
    token and at each row's end (Megatron-LM's ``--reset-attention-mask`` rule)."""
    seq = tokens.shape[1]
    lengths = []
    for row in tokens:
        ends = [i + 1 for i in (row == eod).nonzero().flatten().tolist()]
        if not ends or ends[-1] != seq:
            ends.append(seq)
        lengths += [b - a for a, b in zip([0, *ends[:-1]], ends)]
    return lengths


def batch_cluster(args: argparse.Namespace, n: int):
    """The ``ClusterSpec`` ours prices layouts on (``--startrail-batch-cluster``: a preset
    of ``planner.cluster.CLUSTER_PRESETS``, its nodes holding ``min(n, 8)`` ranks, or a
    JSON file as ``startrail-plan --cluster-json`` reads); ``ValueError`` naming the flag."""
    from ...planner.cli import named_cluster

    name = args.startrail_batch_cluster
    return named_cluster(name, f"--startrail-batch-cluster {name!r}", n)


def batch_model(args):
    """The layer ``schedule_batch`` prices around the attention call (``planner.ModelSpec``
    of the run's GPT): its dense GEMMs cost each rank per token it holds."""
    from ...planner.cluster import ModelSpec

    return ModelSpec(
        "run", args.num_layers, args.hidden_size, args.num_attention_heads,
        args.num_query_groups or args.num_attention_heads,
        args.ffn_hidden_size or 4 * args.hidden_size,  # Megatron-LM's default
        gated_mlp=bool(args.swiglu), vocab=getattr(args, "padded_vocab_size", None) or 1,
    )  # fmt: skip


def _priced_run(args, n: int) -> dict:
    """What ``planner.batch`` prices the run's layouts on over ``n`` DP x CP ranks, as
    keywords of ``BatchPrices`` and ``schedule_batch``: the cluster of
    ``--startrail-batch-cluster``, the heads a TP rank holds, the GPT layer around them."""
    tp = args.tensor_model_parallel_size
    return dict(
        cluster=batch_cluster(args, n), heads_q=args.num_attention_heads // tp,
        heads_kv=max((args.num_query_groups or args.num_attention_heads) // tp, 1),
        head_dim=args.hidden_size // args.num_attention_heads,
        elem_bytes=2 if args.bf16 else 4, model=batch_model(args), tp_size=tp,
        recompute=args.recompute_granularity == "full",
    )  # fmt: skip


def model_team_sizes(args) -> dict[int, int]:
    """``--startrail-team-size auto`` under ``--hybrid-context-parallel``: each sub-group
    size's team size (Megatron's sizes over the DP x CP ranks) as ``schedule_batch`` picks
    it by default, the cost model's fewest communication seconds per token on
    ``--startrail-batch-cluster`` (``BatchPrices.team_size``; ties to the smaller). The
    same on every rank: a pure function of the flags."""
    from ...planner.batch import BatchPrices
    from ..registry import hybrid_group_sizes

    n = args.data_parallel_size * args.context_parallel_size
    prices = BatchPrices(**_priced_run(args, n))
    return {k: prices.team_size(k) for k in hybrid_group_sizes(n)}


def _ours(args, lengths: list[int], n: int, sizes: dict[int, int]) -> list:
    from ...planner.batch import schedule_batch

    cap = args.max_seqlen_per_dp_cp_rank
    try:
        layout = schedule_batch(
            lengths, n, **_priced_run(args, n), sizes=list(sizes), team_sizes=sizes,
            max_tokens_per_rank=cap, binned=True,
        )  # fmt: skip
    except ValueError as e:
        if cap is None or "max_tokens_per_rank" not in str(e):
            raise
        raise ValueError(f"--max-seqlen-per-dp-cp-rank {cap}: {e}") from None
    return [(d, b.size, b.start) for b in layout.blocks for d in b.docs]


def megatron_rounds(lengths: list[int], n: int, cap: int) -> list:
    """megatron-core's ``BalancedCPScheduler`` rounds for documents of ``lengths`` on ``n``
    DP x CP ranks, ``cap`` tokens per rank (``--max-seqlen-per-dp-cp-rank``): per round,
    per rank, the documents it holds. ``ValueError`` where megatron-core refuses the batch
    (it asserts)."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    class _Group:  # the scheduler reads the group's size alone
        def size(self) -> int:
            return n

    try:
        return BalancedCPScheduler(cap, _Group()).get_groups_and_subsamples(
            list(enumerate(lengths)), None
        )[1]
    except AssertionError as e:
        raise ValueError(
            f"megatron-core's BalancedCPScheduler refused a batch of {len(lengths)} documents "
            f"(lengths {sorted(lengths)[-5:]}... with --max-seqlen-per-dp-cp-rank {cap}): "
            f"{e or 'an assertion'}; use --startrail-batch-scheduler startrail"
        ) from None


def _megatrons(args, lengths: list[int], n: int, sizes: dict[int, int]) -> list:
    """``megatron_rounds`` as runs (a document on the ranks that hold it in its round);
    ``ValueError`` where megatron-core refuses the batch or places a document on ranks that
    are not one of Megatron's sub-groups."""
    from ...schedule.batch import runs_from_rounds

    return runs_from_rounds(megatron_rounds(lengths, n, args.max_seqlen_per_dp_cp_rank), sizes)


@contextlib.contextmanager
def rope_over(model, group):
    """For one forward: every ``pg_collection`` of ``model`` with ``cp`` = ``group``, the
    sub-group the call runs on. megatron-core rotates a THD call's RoPE over
    ``pg_collection.cp`` (its per-document zigzag slice of the positions for that group's
    size and rank), which is the model's CP group; StarTrailCoreAttention refuses a THD
    sub-sample unless ``pg_collection.cp`` is its sub-group at the call. Nothing else in
    the forward of our entry point's GPT reads it; RoPE's backward reads no group. Restored
    on exit, also on error."""
    seen: dict[int, object] = {}
    for m in model.modules():
        pgc = getattr(m, "pg_collection", None)
        if pgc is not None and hasattr(pgc, "cp"):
            seen.setdefault(id(pgc), pgc)
    saved = [(pgc, pgc.cp) for pgc in seen.values()]
    try:
        for pgc, _ in saved:
            pgc.cp = group
        yield
    finally:
        for pgc, cp in saved:
            pgc.cp = cp


def hybrid_forward_backward(args, model, micro_batches, dev, backward: bool = True):
    """(loss sum, token count) of the global batch's micro-batches (each ``[DP x rows, S]``:
    every DP replica's rows), run under per-batch sub-groups (module docstring); gradients
    left in ``main_grad`` for DDP's average over DP x CP. ``dev``: the rank's device."""
    from megatron.core import parallel_state

    from ...schedule.batch import document_bins, rank_runs
    from ..attention import packed_documents
    from ..registry import hybrid_team_sizes, subgroup_group
    from .data import eod_id

    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    n, me = dist.get_world_size(dp_cp), dist.get_rank(dp_cp)
    sizes = hybrid_team_sizes()  # {k: team size} of the sub-groups registered
    total = max(sum(float(mb["loss_mask"].sum()) for mb in micro_batches), 1.0)
    loss_sum = torch.zeros(1, dtype=torch.float64, device=dev)
    schedule = _ours if args.startrail_batch_scheduler == "startrail" else _megatrons

    def run(batch: dict, psp, group) -> None:
        nonlocal loss_sum
        with torch.set_grad_enabled(backward), rope_over(model, group):
            losses = model(
                batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                packed_seq_params=psp,
            )  # fmt: skip
            local = (losses.float() * batch["loss_mask"]).sum()
        if backward:
            (local * n / total).backward()
        loss_sum += local.detach().double()

    for mb in micro_batches:
        lengths = document_lengths(mb["tokens"], eod_id(args))
        cuts = [0]
        for length in lengths:
            cuts.append(cuts[-1] + length)
        flat = {k: mb[k].reshape(-1) for k in ("tokens", "labels", "loss_mask", "position_ids")}
        runs = rank_runs(schedule(args, lengths, n, sizes), me)
        # a rank's documents of one sub-group size share its one aligned sub-group of that
        # size: packed into THD forwards there (bins within the cap), larger sizes first
        for k in sorted({k for _, k, _ in runs}, reverse=True):
            group = subgroup_group(k)
            docs = [d for d, size, _ in runs if size == k]
            rank = dist.get_rank(group)
            for part in document_bins(docs, lengths, k, args.max_seqlen_per_dp_cp_rank):
                parts = {
                    key: torch.cat([v[cuts[d] : cuts[d + 1]] for d in part])
                    for key, v in flat.items()
                }
                batch, psp = packed_documents(parts, [lengths[d] for d in part], k, rank, dev)
                psp.local_cp_size, psp.cp_group = k, group
                run(batch, psp, group)
    return loss_sum, total


def add_hybrid_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("hybrid (per-batch) context parallelism")
    g.add_argument(
        "--hybrid-context-parallel",
        action="store_true",
        help="per-batch CP sub-groups: each document (--reset-attention-mask) on a sub-group "
        "of the DP x CP ranks of its own size, with the largest team size up to "
        "--startrail-team-size that fits it, or with 'auto' the cost model's pick for its "
        "size (training/hybrid.py)",
    )
    g.add_argument(
        "--startrail-batch-scheduler",
        choices=list(SCHEDULERS),
        default=None,
        help="with --hybrid-context-parallel: which scheduler places the documents: ours "
        "(startrail, the default), on the planner's cost model, or megatron-core's "
        "BalancedCPScheduler",
    )
    g.add_argument(
        "--startrail-batch-cluster",
        default=None,
        help="with --hybrid-context-parallel: the cluster our scheduler's cost model prices "
        "layouts on (and --startrail-team-size auto its team sizes): a preset of "
        "startrail-plan --cluster, or a cluster JSON file (default: h100-ib)",
    )
    g.add_argument(
        "--max-seqlen-per-dp-cp-rank",
        type=int,
        default=None,
        help="with --hybrid-context-parallel: the most tokens of one document a rank may "
        "hold (padding included); megatron-core's BalancedCPScheduler sizes each document's "
        "sub-group from it (needed there), ours keeps within it where given",
    )


def check_hybrid_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag where ``--hybrid-context-parallel`` cannot run here,
    or where a flag of its own is given without it (it would be ignored); fills in the
    defaults of ``--startrail-batch-scheduler`` and ``--startrail-batch-cluster``."""
    if not args.hybrid_context_parallel:
        own = {
            "--startrail-batch-scheduler": args.startrail_batch_scheduler,
            "--startrail-batch-cluster": args.startrail_batch_cluster,
            "--max-seqlen-per-dp-cp-rank": args.max_seqlen_per_dp_cp_rank,
        }
        given = [flag for flag, value in own.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} without --hybrid-context-parallel would be ignored: give "
                "--hybrid-context-parallel, or drop them"
            )
        return
    if args.startrail_batch_scheduler is None:
        args.startrail_batch_scheduler = "startrail"
    if args.startrail_batch_cluster is None:
        args.startrail_batch_cluster = "h100-ib"
    if args.context_parallel_impl != "startrail":
        raise ValueError("--hybrid-context-parallel needs --context-parallel-impl startrail here")
    if not args.reset_attention_mask:
        raise ValueError(
            "--hybrid-context-parallel runs documents on sub-groups: give --reset-attention-mask "
            "(documents end at the end-of-document token)"
        )
    n = args.data_parallel_size * args.context_parallel_size
    if n < 2 or n & (n - 1):
        raise ValueError(
            f"--hybrid-context-parallel needs a power-of-two number of DP x CP ranks (megatron-"
            f"core's sub-groups), got {args.data_parallel_size} x {args.context_parallel_size}"
        )
    if args.startrail_batch_scheduler == "megatron" and not args.max_seqlen_per_dp_cp_rank:
        raise ValueError(
            "--startrail-batch-scheduler megatron needs --max-seqlen-per-dp-cp-rank (megatron-"
            "core's BalancedCPScheduler sizes each document's sub-group from it)"
        )
    batch_cluster(args, n)  # a bad --startrail-batch-cluster fails here, by name
