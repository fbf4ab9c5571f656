"""Tokenizers for the GPT dataset and the preprocessing command, as Megatron-LM builds them.

``NullTokenizer`` (megatron-core's: ``--vocab-size V`` ids plus the end-of-document token
``V``, text is space-separated ids) and ``HuggingFaceTokenizer`` (a local directory with a
``transformers`` tokenizer; its EOS token ends documents). ``padded_vocab_size`` pads the
embedding table as Megatron-LM does (``--make-vocab-size-divisible-by`` x TP).
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from functools import lru_cache

__all__ = ["HFTokenizer", "build_tokenizer", "padded_vocab_size"]


class HFTokenizer:
    """A ``transformers`` tokenizer from a local directory, with what megatron-core's
    datasets read (``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``)."""

    def __init__(self, path: str):
        import os

        if not os.path.isdir(path):
            raise ValueError(f"--tokenizer-model {path!r} is not a directory (no download here)")
        from transformers import AutoTokenizer

        self.path = path
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        if self.tok.eos_token_id is None:
            raise ValueError(
                f"--tokenizer-model {path!r}: the tokenizer has no eos token, which ends "
                "documents (set eos_token in its tokenizer_config.json)"
            )

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    @property
    def eod(self) -> int:
        return self.tok.eos_token_id

    @property
    def pad(self) -> int:
        return -1  # megatron-core's "no pad token": the data has none

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict({"class": "HFTokenizer", "path": self.path, "vocab": self.vocab_size})

    def tokenize(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def detokenize(self, ids) -> str:
        return self.tok.decode(list(ids))


def build_tokenizer(args: argparse.Namespace):
    """The tokenizer of ``--tokenizer-type``; sets ``args.padded_vocab_size``. Loaded once
    per process and setting (argument validation and the datasets both ask for it)."""
    tok = _load(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    args.padded_vocab_size = padded_vocab_size(
        tok.vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size
    )
    return tok


@lru_cache(maxsize=4)
def _load(kind: str, model: str | None, vocab_size: int | None):
    if kind == "NullTokenizer":
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

        tok = NullTokenizer(vocab_size)
        tok.tokenize = tok.text_to_ids  # the dataset-side names of megatron-core's tokenizers
        tok.detokenize = tok.ids_to_text
        return tok
    return HFTokenizer(model)


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: the next multiple of divisible_by x TP."""
    m = divisible_by * tp
    return -(-vocab // m) * m
