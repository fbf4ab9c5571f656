"""A real text corpus that ships with every machine, and a tokenizer trained on it: the
second example's data (no download).

    python -m startrail_megatron.megatron.training.corpus --out data/stdlib

writes ``data/stdlib/corpus.jsonl`` (one document per Python standard-library module: its
source text, sorted by path, so the corpus is the same on every machine with the same
Python) and ``data/stdlib/tokenizer/`` (a byte-level BPE tokenizer trained on it with the
``tokenizers`` library, saved as a ``transformers`` tokenizer with ``<|endoftext|>`` as
its EOS token): what ``startrail-preprocess-data`` and ``--tokenizer-model`` take.
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig

__all__ = ["stdlib_documents", "train_bpe_tokenizer", "write_corpus"]

EOS = "<|endoftext|>"


def stdlib_documents(limit: int | None = None, max_chars: int = 20000) -> list[str]:
    """The source of the standard library's top-level modules (``*.py`` in the stdlib
    folder, sorted; each cut to ``max_chars``)."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))
    docs = []
    for n in names[:limit]:
        with open(os.path.join(root, n), encoding="utf-8", errors="replace") as f:
            text = f.read()[:max_chars]
        if text.strip():
            docs.append(text)
    return docs


def train_bpe_tokenizer(texts: list[str], out_dir: str, vocab_size: int = 2048) -> str:
    """A byte-level BPE tokenizer trained on ``texts``, saved in ``out_dir`` for
    ``AutoTokenizer.from_pretrained`` (EOS ``<|endoftext|>``); returns ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


def write_corpus(texts: list[str], path: str) -> str:
    """One JSON line ``{"text": ...}`` per document."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for corpus.jsonl and tokenizer/")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=None, help="at most this many modules")
    args = ap.parse_args(argv)
    docs = stdlib_documents(args.limit)
    write_corpus(docs, os.path.join(args.out, "corpus.jsonl"))
    train_bpe_tokenizer(docs, os.path.join(args.out, "tokenizer"), args.vocab_size)
    print(
        f"{len(docs)} documents ({sum(map(len, docs)):,} characters) -> {args.out}/corpus.jsonl; "
        f"tokenizer -> {args.out}/tokenizer"
    )


if __name__ == "__main__":
    main()
