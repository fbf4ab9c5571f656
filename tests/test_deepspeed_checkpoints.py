"""DeepSpeed checkpoints through ``startrail_megatron.deepspeed.save_checkpoint`` /
``load_checkpoint`` (4 ranks, StarTrail P = 4, C = 2, ZeRO 2, the tiny Llama through the
unmodified-script launcher): a resume continues bitwise; a save that dies leaves the last
complete checkpoint the tracker's; a flipped byte, a missing manifest, a bad tracker and a
file that would run code are errors naming the file, on every rank."""

from __future__ import annotations

import gc
import json
import os
import shutil

import pytest
import torch
from common import plant_code
from ds_common import REPO, SEQ, rank_env
from ds_common import ds_config as make_cfg
from harness import run_ranks

STEPS = 4
DROP = ("--attention-dropout", "0.3")
"""Every run here trains with attention dropout: a resume is bitwise only where each rank's
generators come back with the checkpoint (DeepSpeed's engine keeps none)."""
SCRIPT = os.path.join(REPO, "scripts", "train_tiny_llama.py")


def _train(rank: int, world: int, cfg_path: str, out: str, crash_tag, *extra: str):
    """The script under the launcher; with ``crash_tag``, the save of that tag dies on every
    rank at its first barrier after the rank's optimizer file is written (inside DeepSpeed's
    own save: rank 0 has written its files and, saving in place, DeepSpeed's ``latest``),
    as a crash there would."""
    import torch.distributed as dist

    from startrail_megatron.deepspeed import launch

    rank_env(rank, world)
    plain_save, plain_barrier, written = torch.save, dist.barrier, []

    def save(obj, f, *a, **k):
        plain_save(obj, f, *a, **k)
        if crash_tag and f"{os.sep}{crash_tag}" in str(f) and "optim_states" in str(f):
            written.append(f)

    def barrier(*a, **k):
        if written:
            raise RuntimeError("crash during the save")
        return plain_barrier(*a, **k)

    torch.save, dist.barrier = save, barrier
    argv = [SCRIPT, "--deepspeed_config", cfg_path, "--seq", str(SEQ), "--steps", str(STEPS)]
    try:
        launch.main([*argv, "--out", out, *extra])
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        torch.save, dist.barrier = plain_save, plain_barrier
        gc.collect()
    with open(f"{out}.{rank}") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One uninterrupted run saving every step; its losses and folder."""
    tmp = tmp_path_factory.mktemp("ds_ckpt")
    cfg = make_cfg(2, 1, {"enabled": True, "sequence_parallel_size": 4, "team_size": 2})
    cfg_path = tmp / "ds.json"
    cfg_path.write_text(json.dumps(cfg))
    save = tmp / "ckpt"
    res = run_ranks(4, _train, str(cfg_path), str(tmp / "out"), None, "--save", str(save), *DROP)
    assert all(isinstance(r, dict) and r["startrail"] for r in res), res
    return {"cfg": str(cfg_path), "save": save, "losses": res[0]["losses"]}


def _resume(tmp, saved, folder, *extra):
    out = str(tmp / "out2")
    return run_ranks(4, _train, saved["cfg"], out, None, "--load", str(folder), *DROP, *extra)


def test_the_saves_are_complete_and_a_resume_continues_bitwise(saved, tmp_path):
    save = saved["save"]
    assert (save / "latest").read_text() == f"step{STEPS}"
    assert not list(save.glob("*.partial")), "a save left its .partial folder"
    step2 = save / "step2"
    sums = json.loads((step2 / "checksums.json").read_text())["files"]
    files = [str(p.relative_to(step2)) for p in step2.rglob("*") if p.is_file()]
    assert sorted(sums) == sorted(f for f in files if f != "checksums.json")
    assert [f for f in sorted(sums) if f.startswith("rng/")] == [
        f"rng/rank{r:05d}.pt" for r in range(4)
    ]
    assert sum("optim_states" in n for n in sums) == 4  # ZeRO 2: one file per rank
    folder = tmp_path / "from2"
    folder.mkdir()
    shutil.copytree(step2, folder / "step2")
    (folder / "latest").write_text("step2")
    for r in _resume(tmp_path, saved, folder):
        assert r["first_step"] == 2 and r["losses"] == saved["losses"][2:], (r, saved["losses"])
    for r in _resume(tmp_path, saved, folder, "--no-load-rng"):  # the seeded generators
        assert r["losses"][0] != saved["losses"][2], (r, saved["losses"])


def test_a_save_that_dies_leaves_the_last_complete_checkpoint(saved, tmp_path):
    """The save of step 3 dies inside DeepSpeed's save, after every rank's files are written:
    ``latest`` still names step 2, ``step3`` does not exist (its ``.partial`` folder does),
    and a resume takes step 2. (DeepSpeed's in-place save fails this: its rank 0 has
    written ``latest`` = step3 by then.)"""
    save = tmp_path / "ckpt"
    out = str(tmp_path / "out")
    res = run_ranks(4, _train, saved["cfg"], out, "step3", "--save", str(save), *DROP)
    assert res == ["RuntimeError: crash during the save"] * 4, res
    assert (save / "latest").read_text() == "step2"
    assert not (save / "step3").exists() and (save / "step3.partial").is_dir()
    for r in _resume(tmp_path, saved, save):
        assert r["first_step"] == 2 and r["losses"] == saved["losses"][2:], r


def _copy(saved, tmp, name: str):
    folder = tmp / name
    shutil.copytree(saved["save"], folder)
    return folder, folder / f"step{STEPS}"


def test_a_flipped_byte_a_missing_manifest_or_a_bad_or_lost_tracker_is_named(saved, tmp_path):
    folder, last = _copy(saved, tmp_path, "bad")
    victim = last / "zero_pp_rank_3_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    want = f"ValueError: load_checkpoint: {last} is corrupted: {victim.name} (checksum differs)"
    assert _resume(tmp_path, saved, folder) == [want] * 4
    victim.unlink()
    want = f"ValueError: load_checkpoint: {last} is corrupted: {victim.name} (missing)"
    assert _resume(tmp_path, saved, folder) == [want] * 4
    (last / "checksums.json").unlink()
    res = _resume(tmp_path, saved, folder)
    assert all(f"{last} has no checksums.json" in r for r in res), res
    for text in ("", "step9.partial"):
        (folder / "latest").write_text(text)
        res = _resume(tmp_path, saved, folder)
        assert all(f"the tracker {folder / 'latest'} holds {text!r}" in r for r in res), res
    (folder / "latest").write_text("step9")  # a tag that is no folder
    res = _resume(tmp_path, saved, folder)
    assert all(f"the tracker {folder / 'latest'} names 'step9'" in r for r in res), res
    (folder / "latest").unlink()  # no silent start from scratch beside complete checkpoints
    res = _resume(tmp_path, saved, folder)
    assert all(
        "holds complete checkpoints (step1, step2, step3) but no tracker" in r for r in res
    ), res


def test_a_file_that_would_run_code_is_refused_and_runs_nothing(saved, tmp_path):
    """A crafted model file, its checksum written into the manifest too (whoever can write
    the folder can): the weights-only load refuses it by name and the code never runs."""
    folder, last = _copy(saved, tmp_path, "crafted")
    marker = tmp_path / "ran"
    victim = last / "mp_rank_00_model_states.pt"
    plant_code(victim, marker, "module", torch.save)
    res = _resume(tmp_path, saved, folder)
    assert all(f"{victim} holds more than tensors" in r for r in res), res
    assert not marker.exists(), "the crafted file ran code"
