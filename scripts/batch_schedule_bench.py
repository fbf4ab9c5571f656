"""Per-batch layouts on real length distributions, on the cost model (issue 49, item 4's
model half: no attention runs here).

    python scripts/batch_schedule_bench.py [--dist stdlib lognormal] [--ranks 8 16]
        [--batch-tokens 65536 262144] [--batches 8] [--layer gpt-7b] [--json OUT.json]

Distributions: ``stdlib``, the token lengths of this interpreter's standard-library
modules (``corpus.stdlib_documents`` whole, tokenized with the byte-level BPE tokenizer
the stdlib example trains on them, ``corpus.train_bpe_tokenizer``); ``lognormal``,
Megatron's dynamic-CP benchmark distribution (min 128, max 8192, mean 1024, sigma 1.5:
``mu = ln(mean) - sigma^2 / 2``, clipped). Global batches of documents drawn in a seeded
order until the token budget is filled (the last one cut to fit).

Per batch and rank count, side by side, each priced by ``planner.batch.BatchPrices`` on the
``h100-ib`` preset (GPT-7B's attention call: 32 heads of 128, bf16):
- ``static ring`` / ``static StarTrail``: every document on all P ranks (one CP group),
  C = 1 / the best C;
- ``megatron``: megatron-core's ``BalancedCPScheduler`` (imported, its rounds of groups
  of power-of-two sizes; ``max_seq_len_per_rank`` the batch's tokens / P, or the longest
  document / P where larger), each rank's round the sum of its documents' times (one
  forward per document), rounds one after the other (a batch it refuses is counted);
- ``ours``: ``schedule_batch``.
With ``--layer MODEL`` (a ``startrail-plan`` model preset) every layout is priced as the
whole layer, the attention call and the model's GEMMs per token a rank holds
(``BatchPrices(model=...)``), ours is scheduled on that price, and one more row,
``ours, pairs only``, is ours scheduled on the attention alone and priced as the layer.
Printed: the model's makespan (the slowest rank) relative to static StarTrail's, the
balance (max / mean causal pairs per rank), the token balance (max / mean tokens per
rank: what the GEMMs and activations grow with), the most bytes a rank sends, and the
scheduler's own time. Nothing here is measured on ranks (``batch_measure.py`` does that).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from startrail_megatron.planner.batch import BatchPrices, schedule_batch
from startrail_megatron.planner.cluster import CLUSTER_PRESETS, MODEL_PRESETS
from startrail_megatron.schedule.batch import BatchBlock, BatchLayout, doc_pairs
from startrail_megatron.schedule.layout import valid_team_sizes

SHAPE = dict(heads_q=32, heads_kv=32, head_dim=128, elem_bytes=2)


def stdlib_lengths() -> list[int]:
    """Token lengths of every ``.py`` file under the standard library's folder (tests and
    packages included), whole, by the stdlib example's tokenizer (trained on the top-level
    modules, ``corpus.train_bpe_tokenizer``)."""
    import os
    import sysconfig
    import tempfile

    from transformers import AutoTokenizer

    from startrail_megatron.megatron.training.corpus import stdlib_documents, train_bpe_tokenizer

    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(
        os.path.join(d, n)
        for d, _, names in os.walk(root)
        if "site-packages" not in d
        for n in names
        if n.endswith(".py")
    )
    texts = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text.strip():
            texts.append(text)
    with tempfile.TemporaryDirectory() as tmp:
        tok = AutoTokenizer.from_pretrained(train_bpe_tokenizer(stdlib_documents(), tmp))
        return [len(ids) for ids in tok(texts)["input_ids"]]


def lognormal_lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    sigma, mean = 1.5, 1024
    mu = math.log(mean) - sigma**2 / 2
    return [min(8192, max(128, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def batches(pool: list[int], tokens: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        order = list(pool)
        rng.shuffle(order)
        batch, total = [], 0
        for n in order:
            if total >= tokens:
                break
            n = min(n, tokens - total)
            batch.append(n)
            total += n
        out.append(batch)
    return out


def static(lengths, p: int, c: int) -> BatchLayout:
    return BatchLayout(p, tuple(lengths), (BatchBlock(0, p, c, tuple(range(len(lengths)))),))


def megatron_seconds(lengths, p: int, prices: BatchPrices, max_per_rank: int) -> tuple:
    """(makespan, balance, max bytes) of megatron-core's BalancedCPScheduler's rounds."""
    from startrail_megatron.megatron.training.hybrid import megatron_rounds

    max_per_rank = max(max_per_rank, math.ceil(max(lengths) / p))  # every document fits
    try:
        rounds = megatron_rounds(lengths, p, max_per_rank)
    except ValueError:  # megatron-core refuses some batches (e.g. fewer documents than
        return None  # it can group): counted, not priced
    total, pairs, sent, held = 0.0, [0.0] * p, [0.0] * p, [0.0] * p
    for rnd in rounds:
        k = {d: sum(d in ids for ids in rnd) for ids in rnd for d in ids}
        t = [0.0] * p
        for r, ids in enumerate(rnd):
            for d in ids:
                c = prices.team_size(k[d])
                t[r] += prices.rank_seconds(k[d], c, doc_pairs(lengths[d]), lengths[d])
                pairs[r] += doc_pairs(lengths[d]) / k[d]
                held[r] += lengths[d] / k[d]
                sent[r] += prices.block_price(k[d], c)[1] * lengths[d] / k[d]
        total += max(t)
    return (
        total,
        max(pairs) / statistics.fmean(pairs),
        max(held) / statistics.fmean(held),
        max(sent),
    )


def token_balance(layout: BatchLayout) -> float:
    toks = layout.rank_tokens()
    return max(toks) / statistics.fmean(toks)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist", nargs="+", default=["stdlib", "lognormal"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[8, 16])
    ap.add_argument("--batch-tokens", nargs="+", type=int, default=[65536, 262144])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument(
        "--layer",
        choices=sorted(MODEL_PRESETS),
        default=None,
        help="price the whole layer of this model (default: the attention alone)",
    )
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rows, refused = [], {}
    for dist in args.dist:
        pool = stdlib_lengths() if dist == "stdlib" else lognormal_lengths(20000, 1)
        sq = sorted((n * n for n in pool), reverse=True)
        top = sum(sq[: max(1, len(sq) // 100)]) / sum(sq)
        print(f"{dist}: {len(pool)} documents, mean {statistics.fmean(pool):.0f} tokens, "
              f"max {max(pool)}; top 1% carry {top:.0%} of the sum of squared lengths")  # fmt: skip
        for p in args.ranks:
            cl = CLUSTER_PRESETS["h100-ib"].with_(gpus_per_node=min(p, 8))
            model = MODEL_PRESETS[args.layer] if args.layer else None
            prices = BatchPrices(cl, **SHAPE, model=model)
            for tokens in args.batch_tokens:
                acc: dict[str, list] = {}
                for lengths in batches(pool, tokens, args.batches, seed=p + tokens):
                    best_c = min(valid_team_sizes(p), key=lambda c: prices.block_price(p, c)[0])
                    t0 = time.perf_counter()
                    ours = schedule_batch(lengths, p, cluster=cl, model=model, **SHAPE)
                    cost = time.perf_counter() - t0
                    layouts = [("static ring", static(lengths, p, 1)),
                               (f"static StarTrail C={best_c}", static(lengths, p, best_c)),
                               ("ours", ours)]  # fmt: skip
                    if model is not None:
                        layouts.append(
                            ("ours, pairs only", schedule_batch(lengths, p, cluster=cl, **SHAPE))
                        )
                    for name, lay in layouts:
                        acc.setdefault(name, []).append((
                            max(prices.layout_seconds(lay)), lay.balance(), token_balance(lay),
                            max(prices.layout_bytes(lay)),
                            cost if name == "ours" else 0.0,
                        ))  # fmt: skip
                    mega = megatron_seconds(lengths, p, prices, tokens // p)
                    refused[(p, tokens)] = refused.get((p, tokens), 0) + (mega is None)
                    if mega is not None:
                        acc.setdefault("megatron BalancedCPScheduler", []).append((*mega, 0.0))
                base = statistics.fmean(v[0] for v in next(
                    v for k, v in acc.items() if k.startswith("static StarTrail")))  # fmt: skip
                print(f"  P={p}, {tokens} tokens per batch, {args.batches} batches"
                      f" (megatron-core's scheduler refused {refused.get((p, tokens), 0)}):")  # fmt: skip
                for name, vals in acc.items():
                    mk = statistics.fmean(v[0] for v in vals)
                    row = {
                        "dist": dist, "ranks": p, "batch_tokens": tokens, "layout": name,
                        "makespan_s": mk, "throughput_vs_static_startrail": base / mk,
                        "layer": args.layer or "attention",
                        "balance": statistics.fmean(v[1] for v in vals),
                        "token_balance": statistics.fmean(v[2] for v in vals),
                        "max_bytes": statistics.fmean(v[3] for v in vals),
                        "schedule_ms": 1e3 * max(v[4] for v in vals),
                    }  # fmt: skip
                    rows.append(row)
                    print(f"    {name:30s} makespan {mk * 1e3:8.2f} ms  x{base / mk:5.2f}  "
                          f"balance {row['balance']:5.2f}  tokens {row['token_balance']:5.2f}  max sent {row['max_bytes'] / 2**20:8.1f} "
                          f"MiB" + (f"  scheduled in {row['schedule_ms']:.1f} ms" if name == "ours" else ""))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
