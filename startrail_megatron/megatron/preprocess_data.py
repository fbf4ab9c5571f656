"""JSON lines -> megatron-core's ``.bin``/``.idx`` token files, as Megatron-LM's
``tools/preprocess_data.py`` writes them (``{output_prefix}_{key}_document``), for
``--data-path``.

    startrail-preprocess-data --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER_DIR --append-eod
    python -m startrail_megatron.pretrain_gpt --data-path data/corpus_text_document \\
        --split 949,50,1 --tokenizer-type HuggingFaceTokenizer --tokenizer-model TOKENIZER_DIR ...

One document per JSON line (the ``--json-keys`` fields, ``text`` by default); with
``--append-eod`` each ends with the tokenizer's end-of-document token, which the GPT
dataset uses for ``--reset-position-ids`` / ``--reset-attention-mask`` / ``--eod-mask-loss``.
Single process (``--workers`` is accepted for Megatron-LM's command lines and ignored).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

__all__ = ["main", "preprocess"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="startrail-preprocess-data",
        description="Tokenize JSON lines into megatron-core's indexed dataset (.bin/.idx).",
        allow_abbrev=False,
    )
    p.add_argument("--input", required=True, help="a JSON-lines file")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer-type", required=True, help="NullTokenizer or HuggingFaceTokenizer")
    p.add_argument("--tokenizer-model", default=None, help="a local tokenizer directory")
    p.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's")
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--workers", type=int, default=1, help="accepted and ignored (one process)")
    p.add_argument("--log-interval", type=int, default=10000)
    for flag, why in (
        ("--split-sentences", "needs nltk; one document per line here"),
        ("--keep-newlines", "needs --split-sentences"),
        ("--partitions", "one output file here"),
        ("--vocab-file", "use --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR"),
        ("--merge-file", "use --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR"),
    ):
        p.add_argument(flag, nargs="?", const=True, default=None, help=argparse.SUPPRESS)
        p.set_defaults(**{f"_why_{flag[2:].replace('-', '_')}": why})
    return p


def _tokenizer(args: argparse.Namespace):
    from .training.tokenizer import build_tokenizer

    if args.tokenizer_type not in ("NullTokenizer", "HuggingFaceTokenizer"):
        raise ValueError(
            f"--tokenizer-type {args.tokenizer_type}: allowed NullTokenizer, HuggingFaceTokenizer"
        )
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR")
    ns = argparse.Namespace(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        make_vocab_size_divisible_by=1,
        tensor_model_parallel_size=1,
    )
    return build_tokenizer(ns)


def preprocess(args: argparse.Namespace, log=print) -> dict[str, str]:
    """Write one ``{output_prefix}_{key}_document`` dataset per JSON key; returns the
    prefixes (what ``--data-path`` takes)."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    for name, value in vars(args).items():
        if name.startswith("_why_"):
            flag = "--" + name[len("_why_") :].replace("_", "-")
            if getattr(args, flag[2:].replace("-", "_"), None) is not None:
                raise ValueError(f"{flag} is refused here: {value}")
    tok = _tokenizer(args)
    import os

    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    dtype = DType.optimal_dtype(tok.vocab_size)
    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    builders = {k: IndexedDatasetBuilder(get_bin_path(p), dtype=dtype) for k, p in prefixes.items()}
    t0, docs, tokens = time.perf_counter(), 0, 0
    with open(args.input, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{args.input}:{line_no}: not a JSON line ({e})") from None
            for k, b in builders.items():
                if k not in record:
                    raise ValueError(f"{args.input}:{line_no}: no key {k!r} (--json-keys)")
                ids = tok.tokenize(record[k])
                if args.tokenizer_type == "NullTokenizer":  # the text is the ids themselves
                    bad = [i for i in ids if not 0 <= i < args.vocab_size]
                    if bad:
                        raise ValueError(
                            f"{args.input}:{line_no}: NullTokenizer's ids must be in [0, "
                            f"--vocab-size {args.vocab_size}), got {bad[:5]} (the end-of-"
                            f"document id is {args.vocab_size}; above it, no embedding)"
                        )
                if args.append_eod:
                    ids = [*ids, tok.eod]
                if ids:
                    b.add_document(torch.tensor(numpy.array(ids, dtype=dtype)), [len(ids)])
                tokens += len(ids)
            docs += 1
            if docs % args.log_interval == 0:
                log(
                    f"processed {docs} documents, {tokens} tokens ({time.perf_counter() - t0:.1f} s)"
                )
    for k, b in builders.items():
        b.finalize(get_idx_path(prefixes[k]))
    log(f"wrote {docs} documents, {tokens} tokens: {', '.join(prefixes.values())}")
    return prefixes


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings(  # megatron-core's import notes, as in pretrain_gpt
        "ignore", message=r".*(Apex|Transformer Engine and Apex) (is|are) not installed"
    )
    p = _parser()
    args = p.parse_args(argv)
    try:
        preprocess(args)
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
