"""SFT data for upstream Megatron-LM's hybrid context parallelism on CPU ranks (a check tool).

Megatron-LM's ``--hybrid-context-parallel`` reads packed documents with their boundaries,
which only its SFT dataset gives (``--sft``: conversations in JSONL, a ``transformers``
tokenizer with Nemotron's chat template). This writes both, from this machine alone:

    python scripts/megatron_lm_cpu/sft_data.py --out /tmp/sft

``/tmp/sft/tokenizer/``: the stdlib corpus's byte-level BPE tokenizer
(``training.corpus.train_bpe_tokenizer``) with the special tokens the
``nemotron-h-aligned`` prompt format names (``<SPECIAL_10>``, ``<SPECIAL_11>``, and
``<SPECIAL_233>`` as padding). ``/tmp/sft/conversations.jsonl``: one line per group of
standard-library modules, each module a conversation (system: its name, user: its first
lines, assistant: the next ones), its length the module's own share of ``--max-chars``:
long-tailed as the modules are, nobody picked it. Megatron-LM then needs the
``datasets`` package (``pip install --target DIR datasets``, on ``PYTHONPATH`` for the run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from startrail_megatron.megatron.training.corpus import (  # noqa: E402
    stdlib_documents,
    train_bpe_tokenizer,
)

SPECIAL = ["<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_233>"]


def conversations(docs: list[str], per_line: int, max_chars: int, scale: int) -> list[list]:
    """Each module a conversation of about ``len(module) / scale`` characters (at most
    ``max_chars``), ``per_line`` conversations per JSONL line."""
    lines, cur = [], []
    for i, text in enumerate(docs):
        n = max(40, min(max_chars, len(text) // scale))
        body = text[:n]
        cut = max(10, n // 3)
        cur += [
            {"role": "system", "content": f"module {i}"},
            {"role": "user", "content": body[:cut]},
            {"role": "assistant", "content": body[cut:] or "pass"},
        ]
        if (i + 1) % per_line == 0:
            lines.append(cur)
            cur = []
    if cur:
        lines.append(cur)
    return lines


def rendered(conv: list[dict]) -> str:
    """``conv`` as the ``nemotron-h-aligned`` chat template renders it."""
    out = ""
    for m in conv:
        c = m["content"].strip()
        out += {
            "system": f"<SPECIAL_10>System\n{c}\n",
            "user": f"<SPECIAL_11>User\n{c}\n<SPECIAL_11>Assistant\n",
            "assistant": f"{c}\n",
        }[m["role"]]
    return out


def round_up(conv: list[dict], tok, multiple: int, eod: int = 1) -> list[dict]:
    """``conv`` with its assistant turn lengthened until its tokens and the ``eod``
    end-of-document tokens Megatron-LM appends are a multiple of ``multiple`` (its hybrid CP
    needs each sub-sample divisible by 2 x its sub-group, and its SFT dataset pads to 2 x CP
    only). Megatron-LM's SFT dataset appends one up to core_r0.16.0, none from core_r0.17.0."""
    for i in range(200):
        n = len(tok.encode(rendered(conv), add_special_tokens=False)) + eod
        if n % multiple == 0:
            return conv
        conv[-1]["content"] += " x" if i % 2 else "#"
    raise ValueError(f"could not round a conversation up to a multiple of {multiple} tokens")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--modules", type=int, default=120, help="standard-library modules used")
    ap.add_argument("--per-line", type=int, default=3, help="conversations per sample")
    ap.add_argument("--max-chars", type=int, default=900)
    ap.add_argument("--scale", type=int, default=40, help="module characters per character")
    ap.add_argument(
        "--multiple", type=int, default=1,
        help="round every conversation up to a multiple of this many tokens (2 x DP x CP)",
    )  # fmt: skip
    ap.add_argument(
        "--eod", type=int, choices=(0, 1), default=1,
        help="end-of-document tokens Megatron-LM's SFT dataset appends to a conversation: "
        "1 up to core_r0.16.0, 0 from core_r0.17.0 (counted by --multiple)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    docs = stdlib_documents(args.modules)
    tok_dir = os.path.join(args.out, "tokenizer")
    train_bpe_tokenizer(docs, tok_dir, 1024)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.save_pretrained(tok_dir)
    cfg_path = os.path.join(tok_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # readable by transformers 4 and 5
    if isinstance(cfg.get("extra_special_tokens"), list):  # transformers 5's spelling
        cfg["additional_special_tokens"] = cfg.pop("extra_special_tokens")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    path = os.path.join(args.out, "conversations.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for msgs in conversations(docs, args.per_line, args.max_chars, args.scale):
            convs = [msgs[i : i + 3] for i in range(0, len(msgs), 3)]
            msgs = [m for c in convs for m in round_up(c, tok, args.multiple, args.eod)]
            f.write(json.dumps({"messages": msgs}) + "\n")
    print(f"{tok_dir} ({len(tok)} tokens), {path}")


if __name__ == "__main__":
    main()
