"""Sliding windows and attention sinks through Megatron.

A GPT through the entry point's pieces at CP = 4 (C = 2) equals Megatron's own attention at
CP = 1 (``DotProductAttention``: its sliding-window mask, its ``softmax_offset``) in losses
and every gradient over 3 SGD steps, for ``--window-size`` on every layer, on alternate
layers (``--window-attn-skip-freq``), and the sink softmax types ``learnable`` (the
``softmax_offset`` parameter, its gradient included) and ``off-by-one``; each run differs
from plain causal attention, so the feature was used. StarTrail's module ran on every layer
with the accounting's bytes (``assert_startrail_ran``).
"""

from __future__ import annotations

import pytest
from harness import run_ranks
from test_megatron import BASE, _assert_close_runs, _baseline, _train, st_flags

SGD = ["--optimizer", "sgd"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--window-size", "6,0"],  # shorter than a zigzag chunk (32 / 8 = 4 tokens: spans 2)
        ["--window-size", "9,0", "--window-attn-skip-freq", "2"],  # alternating layers
        ["--softmax-type", "learnable"],  # GPT-OSS-style sinks, trained
        ["--softmax-type", "off-by-one", "--window-size", "3,0"],
    ],
    ids=["window", "alternating", "learnable-sinks", "off-by-one+window"],
)
def test_megatron_window_and_sinks_match_cp1(extra):
    ref = _baseline(SGD + extra)
    plain = _baseline(SGD)
    assert ref[0] != plain[0]  # the setting changes the model's losses
    for r in run_ranks(4, _train, BASE + SGD + extra + st_flags(4, 2), 3):
        _assert_close_runs(r, ref)
