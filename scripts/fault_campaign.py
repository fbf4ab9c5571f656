"""Fault campaign: inject faults at random points of training runs that save every
iteration; check that each ends in a named error within a bound, that no partial
checkpoint is ever taken as complete, and that the last complete checkpoint resumes to
the uninterrupted run's losses.

    python scripts/fault_campaign.py --path megatron --seeds 3 --json out.json
    python scripts/fault_campaign.py --path deepspeed --seeds 3 --faults kill-one,corrupt

Paths: ``megatron`` trains ``python -m startrail_megatron.pretrain_gpt --nproc 4`` (CP = 4,
C = 2 by default; ``--layout`` takes other flags, e.g. the 2-D split); ``deepspeed``
trains ``scripts/train_tiny_llama.py`` under ``torchrun --nproc-per-node 4 -m
startrail_megatron.deepspeed.launch`` (``configs/startrail_deepspeed.json``: P = 4, C = 2,
ZeRO 2), saving with ``startrail_megatron.deepspeed.save_checkpoint``. Every run has a
60 s collective timeout (``TIMEOUT_S``). Each trial injects one fault, at a seeded random
moment between the first checkpoint and the last one (as timed in the uninterrupted run: a
step or a save under way; a job that has saved its last checkpoint by then counts as
finished before the fault):

``kill-one``   SIGKILL of one random rank: the launcher exits non-zero within
               ``--exit-bound-s``, no process left behind;
``kill-all``   SIGKILL of every process of the job (a node lost, a job killed mid-save);
``stop-one``   SIGSTOP of one random rank: its peers give up at the collective timeout; the
               launcher exits non-zero within that plus the bound (``megatron``: naming the
               stopped rank's pid, ``spawn.py``; ``deepspeed``: plus torchrun's 30 s between
               its SIGTERM, pending at a stopped rank, and its SIGKILL; torchrun names no
               stopped rank: ``named`` records whether a survivor's error names its global
               rank);
``full-disk``  the save folder is a tmpfs of 1.3 - 3.8 checkpoints: a save fails mid-way
               (which file: random); the job exits non-zero within the bound with an error
               saying the disk is full; the resume loads from the tmpfs;
``corrupt``    after the uninterrupted run, one damage to its last checkpoint (a flipped
               byte, a truncated or deleted file, an empty, garbled or deleted tracker): the
               resume must exit non-zero within the bound naming the file, having trained
               nothing (a silent start from scratch or from damaged weights fails);
``cut-link``   (megatron) on an emulated 2 x 2 cluster (``startrail_megatron.emulate``), one
               node's link is set down for the collective timeout plus 15 s, then up: the
               job exits non-zero within the timeout plus the bound, naming a rank;
``flap-link``  (megatron) as ``cut-link``, down 1 - 10 s only: the job finishes, losses equal.

Then (but for ``flap-link``) the tracker's checkpoint, which the resume verifies
(checksums), is resumed to the end: its losses must equal the uninterrupted run's from
that iteration bitwise; with ``--resume-layout`` also at another layout (megatron: another
CP size and team size, e.g. ``"--context-parallel-size 2 --context-parallel-impl startrail
--startrail-team-size 1"``; deepspeed: ``team_size=1``: DeepSpeed's ZeRO refuses another
world size by name), within ``OTHER_LAYOUT_RTOL``. A trial where the run finished before the
fault counts as such, not as a pass. Figures: ``docs/reliability.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--seq-length", "64",
    "--micro-batch-size", "1", "--global-batch-size", "1", "--mock-data",
    "--optimizer", "sgd", "--lr", "1e-2", "--log-interval", "100",
    "--distributed-timeout-minutes", "1",
]  # fmt: skip
TIMEOUT_S = 60.0  # the collective timeout of every run (both paths' flag)
LAYOUT = "--context-parallel-size 4 --context-parallel-impl startrail --startrail-team-size 2"
DS_CONFIG = os.path.join(REPO, "configs", "startrail_deepspeed.json")
FAULTS = {
    "megatron": ("kill-one", "kill-all", "stop-one", "full-disk", "corrupt", "cut-link",
                 "flap-link"),
    "deepspeed": ("kill-one", "kill-all", "stop-one", "full-disk", "corrupt"),
}  # fmt: skip
TORCHRUN_GRACE_S = 30.0  # torchrun waits this long after SIGTERM before SIGKILL
STARTUP_S = 60.0  # a resume's start (imports, groups) before it reads the checkpoint
OTHER_LAYOUT_RTOL = 1e-5  # losses of a resume at another layout (another reduction order)
EMULATE = ("2x2", "200mbit")


def _proc_stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _running_stat(pid: int) -> list[str] | None:
    """``_proc_stat`` of a process still running (None: gone, or a zombie)."""
    st = _proc_stat(pid)
    return st if st and st[0] != "Z" else None


def _live(field: int, value: int) -> list[int]:
    """The live processes whose ``/proc/PID/stat`` field ``field`` (after the name: 0 state,
    1 parent, 2 process group) is ``value``."""
    pids = (int(d) for d in os.listdir("/proc") if d.isdigit())
    return sorted(p for p in pids if (st := _running_stat(p)) and int(st[field]) == value)


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (the launcher's ranks)."""
    return _live(1, pid)


def group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    return _live(2, pgid)


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (not gone, not zombies)."""
    return [p for p in pids if _running_stat(p)]


def _rank_of(pid: int) -> int | None:
    """A rank process's ``RANK`` (torchrun's and the emulated cluster's ranks have it)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return int(env[b"RANK"]) if b"RANK" in env else None
    except (OSError, ValueError):
        return None


@dataclass
class Job:
    """How one path's runs are started and read."""

    path: str
    layout: list[str]  # megatron: the CP flags; deepspeed: [the config file]

    @property
    def tracker(self) -> str:
        return "latest_checkpointed_iteration.txt" if self.path == "megatron" else "latest"

    def tracker_iteration(self, text: str) -> int:
        text = text.strip()
        return int(text) if self.path == "megatron" else int(text.removeprefix("step"))

    def checkpoint(self, save: str, it: int) -> str:
        name = f"iter_{it:07d}" if self.path == "megatron" else f"step{it}"
        return os.path.join(save, name)

    def nproc(self, layout: list[str]) -> int:
        """Ranks of a run (one replica: the global batch is one sequence): the CP size."""
        if self.path == "megatron":
            at = (
                layout.index("--context-parallel-size")
                if "--context-parallel-size" in layout
                else -1
            )
            return int(layout[at + 1]) if at >= 0 else 1
        with open(layout[0]) as f:
            return int(json.load(f)["startrail"]["sequence_parallel_size"])

    def cmd(self, iters: int, save: str | None, log: str, load: str | None = None,
            layout: list[str] | None = None, emulate_tag: str | None = None) -> list[str]:  # fmt: skip
        layout = self.layout if layout is None else layout
        if self.path == "megatron":
            launch = ["--nproc", str(self.nproc(layout))] if emulate_tag is None else []
            cmd = [
                sys.executable, "-m", "startrail_megatron.pretrain_gpt", *launch, *MODEL,
                *layout, "--train-iters", str(iters), "--log-json", log,
            ]  # fmt: skip
            cmd += ["--save", save, "--save-interval", "1"] if save else []
            cmd += ["--load", load] if load else []
            if emulate_tag is not None:
                nodes, rate = EMULATE
                cmd = [sys.executable, "-m", "startrail_megatron.emulate", "--emulate", nodes,
                       "--inter-node", rate, "--tag", emulate_tag, "--timeout", "900",
                       "--", *cmd]  # fmt: skip
            return cmd
        cmd = [
            os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
            "--nproc-per-node", str(self.nproc(layout)), "-m", "startrail_megatron.deepspeed.launch",
            os.path.join(REPO, "scripts", "train_tiny_llama.py"), "--deepspeed_config",
            layout[0], "--steps", str(iters), "--distributed-timeout-minutes",
            str(TIMEOUT_S / 60), "--out", log,
        ]  # fmt: skip
        cmd += ["--save", save, "--save-interval", "1"] if save else []
        return cmd + (["--load", load] if load else [])

    def losses(self, log: str) -> dict[int, float]:
        """Iteration (1-based: the step it ends) -> loss; empty if the run logged none."""
        if self.path == "megatron":
            if not os.path.exists(log):
                return {}
            with open(log) as f:
                return {e["iteration"]: e["loss"] for e in json.load(f)}
        if not os.path.exists(log + ".0"):
            return {}
        with open(log + ".0") as f:
            out = json.load(f)
        return {out["first_step"] + i + 1: x for i, x in enumerate(out["losses"])}


def _env() -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "st-faults-ext"))
    return env


def _start(cmd: list[str], out: str) -> subprocess.Popen:
    """``cmd`` in a session of its own (its process group killable at once), its output to
    the file ``out``."""
    with open(out, "w") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), start_new_session=True
        )


def _run(cmd: list[str], out: str, timeout: float) -> tuple[int | None, float]:
    """(exit status, None past ``timeout``; seconds) of ``cmd``."""
    t0 = time.monotonic()
    proc = _start(cmd, out)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    return rc, time.monotonic() - t0


def _must_run(cmd: list[str], out: str, timeout: float = 900) -> None:
    rc, _ = _run(cmd, out, timeout)
    if rc != 0:
        with open(out) as f:
            raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {rc}):\n{f.read()[-3000:]}")


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(folder) for n in ns)


def _set_link(tag: str, node: int, state: str) -> bool:
    res = subprocess.run(
        ["ip", "-n", f"{tag}-sw", "link", "set", f"p{node}", state],
        capture_output=True,
        check=False,
    )
    return res.returncode == 0


def _damage(rng: random.Random, job: Job, save: str, last: str) -> tuple[str, str]:
    """One damage to the checkpoint ``last`` or its tracker; (what, the name an error must
    give)."""
    files = sorted(n for n in os.listdir(last) if n != "checksums.json")
    kind = rng.choice(
        ["flip", "truncate", "delete", "empty-tracker", "garbled-tracker", "deleted-tracker"]
    )
    tracker = os.path.join(save, job.tracker)
    if kind == "deleted-tracker":  # complete checkpoints there: no silent start from scratch
        os.unlink(tracker)
        return kind, os.path.basename(tracker)
    if kind.endswith("tracker"):
        with open(tracker, "w") as f:
            f.write("" if kind == "empty-tracker" else "12x")
        return kind, tracker
    victim = os.path.join(last, rng.choice(files))
    data = bytearray(open(victim, "rb").read())
    if kind == "flip":
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        open(victim, "wb").write(bytes(data))
    elif kind == "truncate":
        open(victim, "wb").write(bytes(data[: rng.randrange(len(data))]))
    else:
        os.unlink(victim)
    return f"{kind} {os.path.basename(victim)}", os.path.basename(victim)


@dataclass
class Reference:
    losses: dict[int, float]
    delay: float  # seconds from the first checkpoint to the last (steps and saves)
    ckpt_bytes: int  # one checkpoint's size
    save: str


def reference(job: Job, iters: int, work: str) -> Reference:
    """The uninterrupted run (saving every iteration, as the trials)."""
    save, log, out = (os.path.join(work, n) for n in ("ckpt", "log.json", "out.txt"))
    proc = _start(job.cmd(iters, save, log), out)
    tracker = os.path.join(save, job.tracker)
    first = last = None
    while proc.poll() is None and last is None:
        at = _tracker_at(job, tracker)
        if at is not None and first is None:
            first = time.monotonic()
        if at == iters:
            last = time.monotonic()
        time.sleep(0.01)
    if proc.wait(timeout=900) != 0 or first is None:
        raise RuntimeError(f"the uninterrupted run failed: {_read(out)[-3000:]}")
    delay = (last or time.monotonic()) - first
    return Reference(job.losses(log), delay, _size(job.checkpoint(save, 1)), save)


def _tracker_at(job: Job, tracker: str) -> int | None:
    """The iteration ``tracker`` names now (None: none yet, or being replaced)."""
    try:
        with open(tracker) as f:
            return job.tracker_iteration(f.read())
    except (OSError, ValueError):
        return None


def _resume_check(job: Job, rec: dict, ref: Reference, iters: int, load: str, work: str,
                  save: str, other: list[str] | None) -> None:  # fmt: skip
    with open(os.path.join(load, job.tracker)) as f:
        rec["resumed_from"] = at = job.tracker_iteration(f.read())
    if at >= iters:
        return
    if other:  # first: the same-layout resume below saves on into ``load``
        log3, out3 = os.path.join(work, "other.json"), os.path.join(work, "other.txt")
        _must_run(job.cmd(iters, None, log3, load=load, layout=other), out3)
        got = job.losses(log3)
        rec["other_layout_iterations"] = sorted(got)
        rec["other_layout_max_rel_diff"] = max(
            (abs(got[i] - ref.losses[i]) / abs(ref.losses[i]) for i in got), default=None
        )
    log2, out2 = os.path.join(work, "resumed.json"), os.path.join(work, "resumed.txt")
    _must_run(job.cmd(iters, save, log2, load=load), out2)
    got = job.losses(log2)
    rec["resumed_iterations"] = sorted(got)
    rec["loss_max_abs_diff"] = max((abs(got[i] - ref.losses[i]) for i in got), default=None)


def trial(fault: str, seed: int, job: Job, iters: int, ref: Reference, work: str,
          bound: float, other: list[str] | None = None) -> dict:  # fmt: skip
    """One fault (the module's docstring); its record."""
    rng = random.Random(f"{fault}-{seed}")
    save, log, out = (os.path.join(work, n) for n in ("ckpt", "log.json", "out.txt"))
    rec: dict = {"path": job.path, "fault": fault, "seed": seed}
    if fault == "corrupt":
        os.makedirs(save)
        last = job.checkpoint(ref.save, iters)
        shutil.copytree(last, os.path.join(save, os.path.basename(last)))
        shutil.copy(os.path.join(ref.save, job.tracker), save)
        rec["damage"], name = _damage(rng, job, save, job.checkpoint(save, iters))
        rc, secs = _run(job.cmd(iters, None, log, load=save), out, STARTUP_S + bound)
        text = _read(out)
        rec.update(launcher_rc=rc, exit_s=round(secs, 1), named=name in text)
        rec["trained"] = job.losses(log)
        rec["outcome"] = (
            "pass" if rc not in (0, None) and rec["named"] and not rec["trained"] else "FAIL"
        )
        return rec
    mounted = False
    if fault == "full-disk":
        os.makedirs(save)
        rec["tmpfs_checkpoints"] = k = round(rng.uniform(1.3, 3.8), 2)
        size = f"{int(k * ref.ckpt_bytes) // 1024}k"
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", save], check=True)
        mounted = True
    tag = None
    if fault in ("cut-link", "flap-link"):
        tag = f"stf{os.getpid() % 1000}s{seed}"
    tracker = os.path.join(save, job.tracker)
    ranks: list[int] = []
    try:
        proc = _start(job.cmd(iters, save, log, emulate_tag=tag), out)
        try:
            deadline = time.monotonic() + 300
            while not os.path.exists(tracker):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"no checkpoint (exit {proc.poll()}): {_read(out)[-2000:]}")
                time.sleep(0.05)
            if fault != "full-disk":  # the disk fills when it does
                time.sleep(rng.uniform(0.0, 0.8 * ref.delay))  # a step or a save under way
            ranks = children(proc.pid)
            if proc.poll() is not None or len(ranks) < 4 or _tracker_at(job, tracker) == iters:
                rec["outcome"] = "finished before the fault"
                return rec
            t0 = time.monotonic()
            if fault in ("kill-one", "stop-one"):
                rec["pid"] = victim = rng.choice(ranks)
                rec["rank"] = _rank_of(victim)
                os.kill(victim, signal.SIGKILL if fault == "kill-one" else signal.SIGSTOP)
            elif fault == "kill-all":  # torchrun's ranks are sessions of their own
                os.killpg(proc.pid, signal.SIGKILL)
                for r in ranks:
                    os.kill(r, signal.SIGKILL)
            elif fault == "full-disk":  # the fault: the moment the tmpfs is full
                while proc.poll() is None:
                    st = os.statvfs(save)
                    if st.f_bavail * st.f_frsize < 64 * 1024:
                        break
                    time.sleep(0.01)
                t0 = time.monotonic()
            elif fault in ("cut-link", "flap-link"):
                rec["node"] = node = rng.randrange(2)
                down = TIMEOUT_S + 15 if fault == "cut-link" else rng.uniform(1.0, 10.0)
                rec["down_s"] = round(down, 1)
                if not _set_link(tag, node, "down"):
                    raise RuntimeError(f"could not set {tag}'s link p{node} down")
                try:
                    proc.wait(timeout=down)
                except subprocess.TimeoutExpired:
                    pass
                rec["restored"] = _set_link(tag, node, "up")
            time.sleep(0.2)
            rec["mid_save"] = any(n.endswith(".partial") for n in os.listdir(save))
            limit = bound + (TIMEOUT_S if fault in ("stop-one", "cut-link") else 0.0)
            if fault == "stop-one" and job.path == "deepspeed":
                limit += TORCHRUN_GRACE_S  # torchrun's SIGTERM to a stopped rank is pending
            wait = limit + 60 + (600 if fault == "flap-link" else 0)
            try:
                rec["launcher_rc"] = proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                rec["launcher_rc"] = None  # a hang
            rec["exit_s"] = round(time.monotonic() - t0, 1)
            time.sleep(0.5)
            rec["left_behind"] = alive(ranks) + group(proc.pid)
            text = _read(out)
            if fault == "kill-one":  # the launcher names the dead process
                rec["named"] = (
                    "terminated with signal SIGKILL" in text
                    if job.path == "megatron"
                    else f"(pid: {victim})" in text
                )
            elif fault == "stop-one":
                rec["named"] = (
                    f"(pid {victim}, stopped for" in text
                    if job.path == "megatron"
                    else f"(global {rec['rank']})" in text
                )
            elif fault == "full-disk":
                rec["named"] = "the disk is full" in text
            elif fault == "cut-link":
                rec["named"] = "emulated rank" in text and (
                    "did not answer" in text or "imed out" in text
                )
            if tag is not None:
                from startrail_megatron.emulate.cluster import leftovers

                rec["left_behind"] += leftovers(tag)
        finally:
            if proc.poll() is None or group(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
            for r in alive(ranks):  # torchrun's ranks are sessions of their own
                os.kill(r, signal.SIGKILL)
            proc.wait()
        if fault == "flap-link":
            got = job.losses(log)
            rec["loss_max_abs_diff"] = (
                max(abs(got[i] - ref.losses[i]) for i in ref.losses) if got else None
            )
            ok = rec["launcher_rc"] == 0 and rec["loss_max_abs_diff"] == 0.0
            rec["outcome"] = "pass" if ok and not rec["left_behind"] else "FAIL"
            return rec
        resume_save = os.path.join(work, "resumed_ckpt") if fault == "full-disk" else save
        _resume_check(job, rec, ref, iters, save, work, resume_save, other)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", save], check=False)
    ok_exit = rec["launcher_rc"] is not None and (
        fault == "kill-all" or (rec["launcher_rc"] != 0 and rec["exit_s"] <= limit)
    )
    if fault in ("kill-one", "full-disk", "cut-link") or (
        fault == "stop-one" and job.path == "megatron"
    ):
        ok_exit = ok_exit and rec["named"]
    at = rec["resumed_from"]
    ok_resume = at == iters or (
        rec["resumed_iterations"] == list(range(at + 1, iters + 1))
        and rec["loss_max_abs_diff"] == 0.0
        and (
            not other
            or rec["other_layout_iterations"] == list(range(at + 1, iters + 1))
            and rec["other_layout_max_rel_diff"] <= OTHER_LAYOUT_RTOL
        )
    )
    rec["outcome"] = "pass" if ok_exit and ok_resume and not rec["left_behind"] else "FAIL"
    return rec


def campaign(faults: list[str], seeds: int, job: Job, iters: int = 30, bound: float = 30.0,
             other: list[str] | None = None, log=print,
             ref: Reference | None = None) -> list[dict]:  # fmt: skip
    """``seeds`` trials of each fault against one uninterrupted run (``ref``: one of ``job``
    at ``iters`` made before, else one made here); the records."""
    with tempfile.TemporaryDirectory() as work:
        if ref is None:
            ref_dir = os.path.join(work, "ref")
            os.makedirs(ref_dir)
            ref = reference(job, iters, ref_dir)
        records = []
        for fault in faults:
            for seed in range(seeds):
                d = os.path.join(work, f"{fault}-{seed}")
                os.makedirs(d)
                t0 = time.monotonic()
                records.append(trial(fault, seed, job, iters, ref, d, bound, other))
                records[-1]["trial_s"] = round(time.monotonic() - t0, 1)
                log(json.dumps(records[-1]), flush=True)
    return records


def _ds_config_with(base: str, overrides: str, folder: str, parser) -> str:
    """``base`` with ``KEY=INT,...`` set in its ``"startrail"`` section, as a file."""
    with open(base) as f:
        cfg = json.load(f)
    for item in overrides.split(","):
        key, _, value = item.partition("=")
        if key not in cfg["startrail"] or not value.isdigit():
            parser.error(
                f"--resume-layout {item!r}: deepspeed takes KEY=INT of the config's startrail "
                f"section ({sorted(cfg['startrail'])})"
            )
        cfg["startrail"][key] = int(value)
    path = os.path.join(folder, "resume.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def summarize(records: list[dict], label: str = "") -> list[str]:
    """Markdown table rows, one per fault: trials, faults injected (the job still running),
    passed, mid-save, hangs (no exit within the wait), data lost (a resume that did not
    give the uninterrupted losses, or a damaged checkpoint loaded), exit seconds (median,
    max), the largest relative loss difference of a resume at another layout."""
    rows = []
    for fault in dict.fromkeys(r["fault"] for r in records):
        rs = [r for r in records if r["fault"] == fault]
        ran = [r for r in rs if r["outcome"] != "finished before the fault"]
        exits = sorted(r["exit_s"] for r in ran if r.get("exit_s") is not None)
        lost = [
            r
            for r in ran
            if r.get("loss_max_abs_diff") not in (None, 0.0)
            or (fault == "corrupt" and (r["launcher_rc"] == 0 or r["trained"]))
        ]
        other = [r["other_layout_max_rel_diff"] for r in ran if r.get("other_layout_max_rel_diff")]
        rows.append(
            f"| {label}{fault} | {len(rs)} | {len(ran)} "
            f"| {sum(r['outcome'] == 'pass' for r in ran)} "
            f"| {sum(bool(r.get('mid_save')) for r in ran)} "
            f"| {sum(r.get('launcher_rc', 0) is None for r in ran)} | {len(lost)} "
            + (f"| {exits[len(exits) // 2]:.1f} / {exits[-1]:.1f} " if exits else "| - ")
            + (f"| {max(other):.1e} |" if other else "| - |")
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--path", choices=sorted(FAULTS), default="megatron")
    p.add_argument("--seeds", type=int, default=2, help="trials per fault")
    p.add_argument("--faults", default=None, help="some of the path's faults (default: all)")
    p.add_argument("--layout", default=None, help="megatron: the CP flags; deepspeed: a config")
    p.add_argument(
        "--resume-layout",
        default=None,
        help="also resume at this layout (megatron: CP flags; deepspeed: KEY=INT,... of the "
        "config's startrail section, e.g. team_size=1)",
    )
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--exit-bound-s", type=float, default=30.0)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--summarize",
        nargs="+",
        metavar="JSON",
        help="print the table of earlier runs' --json records (LABEL=FILE) and exit",
    )
    args = p.parse_args(argv)
    if args.summarize:
        print("| fault | trials | injected | passed | mid-save | hangs | data lost "
              "| exit s (median / max) | other layout, max rel. loss diff |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for item in args.summarize:
            label, _, path = item.rpartition("=")
            with open(path) as f:
                print("\n".join(summarize(json.load(f), f"{label}: " if label else "")))
        return 0
    allowed = FAULTS[args.path]
    faults = [f for f in (args.faults or ",".join(allowed)).split(",") if f]
    for f in faults:
        if f not in allowed:
            p.error(f"--faults {f!r} is not a fault of --path {args.path}; allowed: {allowed}")
    if any(f in ("full-disk", "cut-link", "flap-link") for f in faults) and os.geteuid() != 0:
        p.error("full-disk, cut-link and flap-link need root (tmpfs, network namespaces)")
    if args.path == "megatron":
        job = Job("megatron", (args.layout or LAYOUT).split())
        other = args.resume_layout.split() if args.resume_layout else None
        records = campaign(faults, args.seeds, job, args.iters, args.exit_bound_s, other)
    else:
        job = Job("deepspeed", [args.layout or DS_CONFIG])
        with tempfile.TemporaryDirectory() as tmp:
            other = None
            if args.resume_layout:
                other = [_ds_config_with(job.layout[0], args.resume_layout, tmp, p)]
            records = campaign(faults, args.seeds, job, args.iters, args.exit_bound_s, other)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    bad = [r for r in records if r["outcome"] == "FAIL"]
    ran = [r for r in records if r["outcome"] != "finished before the fault"]
    hangs = [r for r in records if r.get("launcher_rc", 0) is None]
    print(
        f"{len(ran)} faults injected, {len(ran) - len(bad)} passed, {len(bad)} failed, "
        f"{len(hangs)} hangs, {len(records) - len(ran)} too late"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
