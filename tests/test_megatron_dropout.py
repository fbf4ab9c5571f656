"""Attention dropout through Megatron: Megatron-LM's default
``--attention-dropout 0.1 --hidden-dropout 0.1`` trains under StarTrail (CP = 4, C = 2).

In-process (the entry point's pieces, 3 SGD steps): two runs with the same seed and layout
give bitwise the same losses and gradients, another ``--seed`` different ones, and turning
attention dropout off (hidden dropout kept) changes them too, so the attention's masks were
used; every layer's StarTrail attention ran dropout (``dropout_calls``) and moved exactly
the bytes of the run without it. Through the real entry point
(``python -m startrail_megatron.pretrain_gpt --nproc 2``, CP = 2: the spawn is what this
adds; CP = 4, C = 2 with dropout is the in-process test's): the default flags are accepted,
and its logged losses are bitwise those of a second run of the same training (the entry
point's per-rank ``train`` on pool ranks, on the spawned run's data), with dropout calls
recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from harness import run_ranks
from megatron_common import assert_startrail_ran, entry_point_train_as_spawned
from test_megatron import BASE, _train, st_flags

DROP = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
SGD = ["--optimizer", "sgd"]


def test_dropout_training_is_reproducible_and_uses_the_masks():
    argv = BASE + SGD + DROP + st_flags(4, 2)
    a = run_ranks(4, _train, argv, 3)
    b = run_ranks(4, _train, argv, 3)
    other_seed = run_ranks(4, _train, argv + ["--seed", "7"], 3)
    no_attn = run_ranks(4, _train, BASE + SGD + ["--hidden-dropout", "0.1"] + st_flags(4, 2), 3)
    for ra, rb in zip(a, b):
        assert ra[0] == rb[0]  # losses, bitwise
        for ga, gb in zip(ra[1], rb[1]):
            assert all(torch.equal(ga[n], gb[n]) for n in ga)
    assert a[0][0] != other_seed[0][0]
    assert a[0][0] != no_attn[0][0]  # the attention's dropout masks changed the run
    for r in range(4):
        proof = a[r][2]
        assert_startrail_ran(proof)  # the same transfers as without dropout
        assert proof["dropout_calls"] == 3 * proof["layers"]  # every layer, every step
        assert no_attn[r][2]["dropout_calls"] == 0


def _entry_point(tmp_path, name, spawn: bool):
    """The entry point spawned as a user runs it, or its per-rank training on pool ranks."""
    log = tmp_path / f"{name}.json"
    argv = [*BASE, *DROP, *st_flags(2, 1), "--train-iters", "3", "--log-json", str(log)]
    if spawn:
        cmd = [sys.executable, "-m", "startrail_megatron.pretrain_gpt", *argv, "--nproc", "2"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-4000:]
    else:
        run_ranks(2, entry_point_train_as_spawned, argv)
    return json.loads(log.read_text())


def test_entry_point_accepts_megatron_default_dropout(tmp_path):
    first, second = _entry_point(tmp_path, "a", True), _entry_point(tmp_path, "b", False)
    assert len(first) == len(second) == 3
    assert [e["loss"] for e in first] == [e["loss"] for e in second]
    assert all(e["startrail"]["dropout_calls"] > 0 for e in first)
