"""StarTrail's command-line flags, in Megatron-LM's ``extra_args_provider`` style.

    --context-parallel-impl {te,startrail}   default te: Megatron's own CP attention
    --startrail-team-size C                  C*C must divide --context-parallel-size
    --startrail-placement {team,ring}
    --startrail-own-rows-first {auto,on,off} the first step's own query rows before the
                                             team gathers are waited on (auto: the rule)
    --startrail-ulysses-size U               the 2-D split: head-parallel all-to-all over
                                             U consecutive CP ranks, StarTrail over the
                                             CP / U ranks holding the same heads
    --startrail-tiled-loss TOKENS            the logits and loss a sequence tile at a time
    --startrail-tiled-mlp TOKENS             every layer's MLP a sequence tile at a time
    --startrail-attention-tile TOKENS        the attention's kernel calls at most TOKENS x
                                             TOKENS (its backward's memory bounded by it)
    --startrail-attention-head-chunks N      the attention on N groups of KV heads one after
                                             the other (its team buffers 1/N as large)

``add_startrail_args(parser)`` adds them (returns the parser, so it can be
Megatron-LM's ``extra_args_provider``); ``validate_startrail_args(args)``
checks them against Megatron's other arguments and raises ``ValueError``
naming the flags; ``install_from_args(args)`` turns StarTrail on.

``--startrail-team-size auto`` needs the autotuner of StarTrail's own entry
point (``python -m startrail_megatron.pretrain_gpt``, whose parser has
``--startrail-autotune-iters``); under upstream Megatron-LM (the launcher or
the patch) it is refused at parsing, naming the flag.
"""

from __future__ import annotations

import argparse
import warnings

from ..schedule import OWN_ROWS_FIRST_SETTINGS
from ..schedule.layout import PLACEMENT_SETTINGS, divisors, valid_team_sizes
from ..schedule.ulysses import kv_repeat
from ..validation import own_rows_first_setting
from .hooks import install
from .memory_args import (
    autotuner_available,
    check_attention_tile,
    check_head_chunks,
    check_tiled_loss,
)
from .refusals import REFUSED_FLAGS, causal_window_error, deterministic_mode_error

__all__ = [
    "IMPLS",
    "add_startrail_args",
    "extra_args_provider",
    "install_from_args",
    "validate_startrail_args",
]

IMPLS = ("te", "startrail")


def _team_size(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--startrail-team-size takes an integer >= 1 or 'auto', got {value!r}"
        ) from None


def add_startrail_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="StarTrail context parallelism")
    group.add_argument(
        "--context-parallel-impl",
        choices=IMPLS,
        default="te",
        help="Context-parallel attention: 'te' (Megatron/Transformer Engine, default) or "
        "'startrail' (concentric-ring StarTrail).",
    )
    group.add_argument(
        "--startrail-team-size",
        type=_team_size,
        default=1,
        help="StarTrail team size C (C*C must divide --context-parallel-size; 1 = ring "
        "attention), or 'auto' to profile the candidates and keep the fastest (with "
        "--hybrid-context-parallel: the cost model's pick per sub-group size) "
        "(python -m startrail_megatron.pretrain_gpt only).",
    )
    group.add_argument(
        "--startrail-placement",
        choices=PLACEMENT_SETTINGS,
        default="team",
        help="'team': team members on adjacent CP ranks (collectives inside a node); "
        "'ring': sub-ring neighbours adjacent (P2P inside a node); 'auto': the map of "
        "teams and sub-rings onto the CP ranks that the planner's cost model predicts "
        "fastest on the nodes the ranks run on (found by hostname), printed at start.",
    )
    group.add_argument(
        "--startrail-own-rows-first",
        choices=tuple(OWN_ROWS_FIRST_SETTINGS),
        default="auto",
        help="StarTrail's first sub-ring step runs the rank's own query rows while the team "
        "gathers q (forward) and dout (backward): 'on', 'off', or 'auto' (default: "
        "$STARTRAIL_OWN_ROWS_FIRST where set, else on only where the team spans hosts and "
        "the gather outweighs the K,V placement; docs/performance.md section 11).",
    )
    group.add_argument(
        "--startrail-ulysses-size",
        type=int,
        default=1,
        help="The 2-D split: all-to-all of heads over U consecutive CP ranks (a node's fast "
        "links), StarTrail over the CP/U ranks holding the same heads; U divides "
        "--context-parallel-size and the attention heads per TP rank, team size squared "
        "divides CP/U (default 1: StarTrail over the whole CP group).",
    )
    group.add_argument(
        "--startrail-tiled-loss",
        type=int,
        default=None,
        metavar="TOKENS",
        help="compute the output layer's logits and the loss TOKENS local sequence positions "
        "at a time, the logits recomputed in the backward, so that the [tokens, vocab] logits "
        "never exist whole (the same loss and gradients; megatron/tiled_loss.py)",
    )
    group.add_argument(
        "--startrail-tiled-mlp",
        type=int,
        default=None,
        metavar="TOKENS",
        help="run every layer's MLP TOKENS local sequence positions at a time, recomputed in "
        "the backward, so that its [tokens, ffn] intermediates exist for one tile only (the "
        "same result; megatron/tiled_mlp.py)",
    )
    group.add_argument(
        "--startrail-attention-tile",
        type=int,
        default=None,
        metavar="TOKENS",
        help="cut StarTrail's attention kernel calls into calls of at most TOKENS query rows by "
        "TOKENS key rows, so that the attention backward's per-call gradients are bounded by "
        "the tile, not the sequence (the same result, more calls; schedule.tile_calls). "
        "Default: whole calls",
    )
    group.add_argument(
        "--startrail-attention-head-chunks",
        type=int,
        default=None,
        metavar="N",
        help="run StarTrail's attention on N groups of KV heads (each with its query heads) "
        "one after the other, forward and backward, so that its team-sized buffers (the "
        "gathered queries and output gradient, the fp32 accumulators, the K,V ring) hold "
        "1/N of the heads (the same result, N times the messages of the same bytes). N "
        "divides the KV heads of a TP rank (of a ring rank with --startrail-ulysses-size). "
        "Default: all heads at once",
    )
    return parser


def _check_ulysses(args: argparse.Namespace, cp: int, c) -> int:
    """R = CP / U after checking ``--startrail-ulysses-size`` (``ValueError`` naming it)."""
    u = getattr(args, "startrail_ulysses_size", 1)
    if not isinstance(u, int) or u < 1 or cp % u != 0:
        allowed = divisors(cp)
        raise ValueError(
            f"--startrail-ulysses-size {u} does not fit --context-parallel-size {cp}: it must "
            f"divide it; allowed: {allowed}"
        )
    if u == 1:
        return cp
    if c == "auto":
        raise ValueError(
            "--startrail-team-size auto is not supported with --startrail-ulysses-size > 1 yet: "
            "give an integer team size (startrail-plan searches both)"
        )
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    heads = getattr(args, "num_attention_heads", None)
    groups = getattr(args, "num_query_groups", None) or heads
    if heads is not None:
        try:
            kv_repeat(u, heads // tp, max(groups // tp, 1))
        except ValueError as e:
            raise ValueError(
                f"--startrail-ulysses-size {u} with --num-attention-heads {heads}, "
                f"--num-query-groups {groups} and --tensor-model-parallel-size {tp}: {e}"
            ) from None
    drop = getattr(args, "attention_dropout", 0.0)
    if drop:
        raise ValueError(
            f"--attention-dropout {drop} is not supported with --startrail-ulysses-size {u} yet: "
            "pass --attention-dropout 0"
        )
    return cp // u


def _refuse_auto() -> ValueError:
    return ValueError(
        "--startrail-team-size auto needs StarTrail's autotuner, which only "
        "'python -m startrail_megatron.pretrain_gpt' runs; under Megatron-LM give an integer "
        "team size (e.g. from 'startrail-plan')"
    )


def validate_startrail_args(
    args: argparse.Namespace,
    *,
    allow_auto: bool | None = None,
    allow_packed: bool | None = None,
) -> None:
    """Raise ``ValueError`` naming the flag when StarTrail's flags do not fit.

    ``allow_auto``: whether ``--startrail-team-size auto`` is accepted;
    ``allow_packed``: whether ``--reset-attention-mask`` / ``--reset-position-ids``
    are (packed documents, any ``--seq-length``); default for both: only for
    StarTrail's own entry point (args with ``startrail_autotune_iters``).
    """
    impl = getattr(args, "context_parallel_impl", "te")
    if impl not in IMPLS:
        raise ValueError(f"--context-parallel-impl {impl!r} is not known; allowed: {list(IMPLS)}")
    check_tiled_loss(args, impl)
    check_attention_tile(args, impl)
    check_head_chunks(args, impl)
    if impl != "startrail":
        if getattr(args, "startrail_team_size", 1) == "auto" and not autotuner_available(args):
            raise _refuse_auto()  # under Megatron-LM, with or without the impl flag
        defaults = {
            "team_size": 1,
            "placement": "team",
            "ulysses_size": 1,
            "own_rows_first": "auto",
        }
        given = [
            f"--startrail-{k.replace('_', '-')} {getattr(args, 'startrail_' + k)}"
            for k, v in defaults.items()
            if getattr(args, "startrail_" + k, v) != v
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} without --context-parallel-impl startrail would be "
                "ignored: add --context-parallel-impl startrail, or drop them"
            )
        return
    comm = getattr(args, "cp_comm_type", None)
    comm = list(comm) if isinstance(comm, (list, tuple)) else [comm]
    if any(v not in (None, "p2p") for v in comm):
        raise ValueError(
            f"--cp-comm-type {' '.join(map(str, comm))}: StarTrail's transfers follow its own "
            "schedule (team collectives and sub-ring P2P), so another kind would be ignored; "
            "allowed with --context-parallel-impl startrail: p2p (the default)"
        )
    cp = getattr(args, "context_parallel_size", 1) or 1
    if getattr(args, "mtp_num_layers", None) and cp > 1:
        if not getattr(args, "calculate_per_token_loss", False):
            warnings.warn(
                "--mtp-num-layers at --context-parallel-size > 1 without "
                "--calculate-per-token-loss: megatron-core averages each CP rank's MTP loss "
                "over that rank's own tokens, so training differs slightly from CP = 1 (with "
                "Megatron's own CP attention too); add --calculate-per-token-loss for CP = 1's",
                stacklevel=2,
            )
    c = args.startrail_team_size
    auto_ok = autotuner_available(args) if allow_auto is None else allow_auto
    ring = _check_ulysses(args, cp, c)
    if c == "auto":
        if not auto_ok:
            raise _refuse_auto()
        if getattr(args, "startrail_placement", "team") == "auto":
            raise ValueError(
                "--startrail-placement auto with --startrail-team-size auto is not supported "
                "yet: the team-size autotuner times the named placements ('team', 'ring'); "
                "give an integer team size, or a named placement"
            )
    elif not isinstance(c, int) or c < 1 or ring % (c * c) and not _hybrid(args):
        over = (
            f"--context-parallel-size {cp}"
            if ring == cp
            else f"the {ring} ranks per ring group (--context-parallel-size {cp} / "
            f"--startrail-ulysses-size {cp // ring})"
        )
        raise ValueError(
            f"--startrail-team-size {c} does not fit {over}: its "
            f"square must divide it; allowed: {valid_team_sizes(ring)}" + (" or 'auto'" * auto_ok)
        )
    packed_ok = auto_ok if allow_packed is None else allow_packed
    packed = bool(getattr(args, "reset_attention_mask", False))
    seq = getattr(args, "seq_length", None)
    if seq is not None and seq % (2 * cp) != 0 and not (packed and packed_ok):
        raise ValueError(
            f"--seq-length {seq} must be divisible by 2 * --context-parallel-size = {2 * cp} "
            "for StarTrail's causal zigzag layout"
        )
    drop = getattr(args, "attention_dropout", 0.0)
    if drop is not None and not 0.0 <= drop < 1.0:
        raise ValueError(f"--attention-dropout {drop}: StarTrail needs 0 <= it < 1")
    window = getattr(args, "window_size", None)
    if window is not None and (len(tuple(window)) != 2 or min(window) < -1):
        raise ValueError(f"--window-size {window}: give left,right as integers >= -1")
    if window is not None and tuple(window)[1] != 0:  # a GPT's layers are causal
        raise ValueError(causal_window_error(tuple(window), "--window-size"))
    for flag in ("reset_attention_mask", "reset_position_ids"):
        if getattr(args, flag, False) and not packed_ok:
            raise ValueError(
                f"--{flag.replace('_', '-')} makes packed sequences, which StarTrail takes only "
                "from its own entry point (python -m startrail_megatron.pretrain_gpt) or as "
                "PackedSeqParams(qkv_format='thd'); Megatron-LM's dense document mask is not used"
            )
    own_rows_first_arg(args)
    _check_hybrid(args)
    if getattr(args, "hierarchical_context_parallel_sizes", None):
        raise ValueError(
            "--hierarchical-context-parallel-sizes is a Transformer Engine CP option; StarTrail "
            "uses --startrail-team-size instead"
        )
    if getattr(args, "deterministic_mode", False):
        import torch

        why = deterministic_mode_error(torch.cuda.is_available())
        if why:
            raise ValueError(why)
    for flag, why in REFUSED_FLAGS.items():
        if getattr(args, flag, False):
            raise ValueError(
                f"--{flag.replace('_', '-')} is not supported with --context-parallel-impl "
                f"startrail: it {why}"
            )


def _hybrid(args: argparse.Namespace) -> bool:
    """Whether ``--hybrid-context-parallel`` is on (the team size is then each sub-group's
    cap: ``team_size_within``)."""
    return bool(getattr(args, "hybrid_context_parallel", False))


def _check_hybrid(args: argparse.Namespace) -> None:
    """``--hybrid-context-parallel`` (per-batch sub-groups, each with the largest team size
    up to ``--startrail-team-size`` that fits it, or with ``auto``, which only our entry
    point takes, the cost model's pick per sub-group size) takes a named placement, without
    the 2-D split."""
    if not _hybrid(args):
        return
    why = None
    if getattr(args, "startrail_placement", "team") == "auto":
        why = "--startrail-placement auto (give 'team' or 'ring')"
    elif (getattr(args, "startrail_ulysses_size", 1) or 1) > 1:
        why = "--startrail-ulysses-size > 1 (the 2-D split)"
    if why:
        raise ValueError(f"--hybrid-context-parallel is not supported with {why}")


def own_rows_first_arg(args: argparse.Namespace) -> bool | None:
    """``--startrail-own-rows-first`` (absent: ``auto``) as ``StarTrailGroups.own_rows_first``;
    ``ValueError`` naming the flag on a value argparse did not check (a Namespace built in
    code)."""
    raw = getattr(args, "startrail_own_rows_first", "auto")
    return own_rows_first_setting(raw, "--startrail-own-rows-first")


def placement_shape(args: argparse.Namespace):
    """The attention call ``--startrail-placement auto`` prices (``planner.shape.AttnShape``)
    from the flags: one micro-batch's tokens per CP rank, the heads per tensor-parallel
    rank, the head size, the dtype, causal; with the 2-D split, the call its ring groups
    run after the all-to-all (``accounting.split_ring_shape``). None where the flags do not
    give them (a Namespace built in code: the planner's default shape)."""
    from ..accounting import LocalShape, split_ring_shape
    from ..planner.shape import AttnShape
    from ..schedule.ulysses import UlyssesLayout

    cp = getattr(args, "context_parallel_size", 1) or 1
    u = getattr(args, "startrail_ulysses_size", 1) or 1
    heads, seq = getattr(args, "num_attention_heads", None), getattr(args, "seq_length", None)
    hidden = getattr(args, "hidden_size", None)
    if not (heads and seq and hidden):
        return None
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    gqa = getattr(args, "group_query_attention", False)
    kv = (getattr(args, "num_query_groups", None) or heads) if gqa else heads
    d = getattr(args, "kv_channels", None) or hidden // heads
    elem = 2 if getattr(args, "bf16", False) or getattr(args, "fp16", False) else 4
    local = LocalShape(
        max(seq // cp, 1), getattr(args, "micro_batch_size", 1) or 1, heads // tp,
        max(kv // tp, 1), d, elem,
    )  # fmt: skip
    ring = split_ring_shape(UlyssesLayout(cp, u, 1), local)
    return AttnShape(
        cp // u, ring.s_local, ring.batch, ring.heads_q, ring.heads_kv, ring.head_dim,
        elem_bytes=elem, acc_bytes=4, causal=True,
    )  # fmt: skip


def install_from_args(
    args: argparse.Namespace, team_size: int | None = None, hybrid_team_sizes=None
) -> None:
    """Install the StarTrail hooks when ``--context-parallel-impl startrail``.
    ``hybrid_team_sizes``: ``{sub-group size: team size}`` under ``--hybrid-context-parallel``
    (our entry point's ``auto``: the cost model's pick per size; ``hooks.install``)."""
    if getattr(args, "context_parallel_impl", "te") != "startrail":
        return
    c = team_size if team_size is not None else args.startrail_team_size
    if c == "auto":
        if not autotuner_available(args):
            raise _refuse_auto()
        if _hybrid(args) and hybrid_team_sizes is None:
            raise ValueError(
                "--startrail-team-size auto with --hybrid-context-parallel: the team size of "
                "each sub-group size (hybrid_team_sizes) is needed"
            )
        # a placeholder until the entry point's autotuner picks one; under hybrid CP the
        # largest of the sizes' (each group takes its own from hybrid_team_sizes)
        c = max(hybrid_team_sizes.values(), default=1) if _hybrid(args) else 1
    install(
        int(c),
        args.startrail_placement,
        own_rows_first=own_rows_first_arg(args),
        ulysses_size=getattr(args, "startrail_ulysses_size", 1),
        tiled_loss=getattr(args, "startrail_tiled_loss", None),
        tiled_mlp=getattr(args, "startrail_tiled_mlp", None),
        attention_tile=getattr(args, "startrail_attention_tile", None),
        attention_head_chunks=getattr(args, "startrail_attention_head_chunks", None),
        placement_shape=placement_shape(args) if args.startrail_placement == "auto" else None,
        hybrid_team_sizes=hybrid_team_sizes,
    )


def extra_args_provider(parser: argparse.ArgumentParser, *, chain=None) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: adds the flags and turns StarTrail on after parsing.

    ``chain`` is another provider to run first (e.g. Megatron-LM's
    ``add_modelopt_args``). The parser's ``parse_known_args`` (which
    ``parse_args`` calls) is wrapped so that, once Megatron-LM has parsed,
    StarTrail's flags are validated (a bad one exits naming it, like any
    argparse error) and the hooks are installed before Megatron initializes
    its process groups.
    """
    if chain is not None:
        parser = chain(parser)
    add_startrail_args(parser)
    parse_known = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, rest = parse_known(args, namespace)
        try:
            # Megatron-LM runs no autotuner, and packs documents with a dense mask StarTrail
            # does not read
            validate_startrail_args(ns, allow_auto=False, allow_packed=False)
        except ValueError as e:
            parser.error(str(e))
        install_from_args(ns)
        return ns, rest

    parser.parse_known_args = parse_known_args
    return parser
