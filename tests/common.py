"""Shared pieces of the multi-rank tests: tolerances, cached groups, and the package's one
float64 reference (``startrail_megatron.testing``) under the names the tests use."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys

import torch

import startrail_megatron as st
from startrail_megatron.testing import make_inputs, rel_err, shard, unshard
from startrail_megatron.testing import reference_attention as reference
from startrail_megatron.validation import OWN_ROWS_FIRST_ENV

__all__ = [
    "TOL",
    "load_script",
    "assert_padding_rows_zero",
    "groups_for",
    "make_inputs",
    "noisy_packed_shards",
    "packed_inputs",
    "packed_reference",
    "padding_rows",
    "reference",
    "reference_per_document",
    "rel_err",
    "shard",
    "unshard",
]

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
_GROUPS: dict = {}


def groups_for(team_size: int, placement: str = "team", cp_group=None, key=None):
    """Per-process cache: groups live as long as the pool's process group."""
    k = (team_size, placement, key)
    if k not in _GROUPS:
        _GROUPS[k] = st.StarTrailGroups.create(team_size, cp_group=cp_group, placement=placement)
    return _GROUPS[k]


def assert_matches_reference(results, ref, causal: bool, dtype, tol: float) -> None:
    """Every rank's [out, dq, dk, dv] (``results[r][0]``), unsharded, against the reference."""
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        got = unshard([r[0][i] for r in results], causal)
        assert got.dtype == dtype and got.shape == ref[i].shape
        err = rel_err(got, ref[i])
        assert err <= tol, f"{what}: relative max error {err:.2e} > {tol:.0e}"


def dense_rank_inputs(
    rank: int, world: int, s_local: int, b: int, heads: tuple[int, int], d: int,
    causal: bool, window=None, sinks: bool = False, seed: int = 3,
):  # fmt: skip
    """This rank's float64 leaves q, k, v (requiring gradients), its dout shard and the
    sinks leaf (or None) of the inputs ``assert_dense_parity`` checks against (zigzag
    shards under the causal mask or a window)."""
    hq, hkv = heads
    q, k, v, do = make_inputs(seed, s_local * world, b, hq, hkv, d)
    zig = causal or window is not None
    local = [shard(x, rank, world, zig).to(torch.float64).requires_grad_() for x in (q, k, v)]
    sink = torch.linspace(-1, 1, hq, dtype=torch.float64).requires_grad_() if sinks else None
    return local, shard(do, rank, world, zig).to(torch.float64), sink


def assert_dense_parity(
    results, p: int, s_local: int, b: int, heads: tuple[int, int], d: int, causal: bool,
    window=None, softcap=None, sinks: bool = False, seed: int = 3,
) -> None:  # fmt: skip
    """Every rank's [out, dq, dk, dv] (``results[r][0]``) and, with ``sinks``, the ranks'
    summed sinks gradient (``results[r][1]``) against the float64 reference of
    ``make_inputs(seed, s_local * p, b, *heads, d)`` (sinks ``linspace(-1, 1, heads_q)``)."""
    hq, hkv = heads
    q, k, v, do = make_inputs(seed, s_local * p, b, hq, hkv, d)
    ref_sinks = torch.linspace(-1, 1, hq, dtype=torch.float64) if sinks else None
    ref = reference(q, k, v, do, causal, window=window, softcap=softcap, sinks=ref_sinks)
    zig = causal or window is not None
    assert_matches_reference(results, ref[:4], zig, torch.float64, TOL[torch.float64])
    if sinks:
        total = sum(r[1] for r in results)
        assert (total - ref[4]).abs().max().item() < TOL[torch.float64]


def assert_startrail_ledger(events, layout, rank: int, shape, active=None) -> None:
    """One rank's recorded transfers equal the accounting (bytes per phase and kind, P2P
    calls, never a self-send). ``shape``: an ``accounting.LocalShape``; ``active``: the
    steps each sub-ring computes (``schedule.startrail_active_steps``)."""
    from startrail_megatron.accounting import startrail_comm_bytes

    want = startrail_comm_bytes(layout, rank, shape, active)
    led = st.CommLedger.from_events(events)
    for ph in ("fwd", "bwd"):
        for kind in ("p2p", "collective"):
            assert led.bytes(kind, ph) == want[f"{ph}_{kind}"], (rank, ph, kind)
    sends = layout.p2p_sends(rank, backward=True, active=active)
    assert led.calls("p2p", "fwd") == sends["kv"] + sends["kv_place"]
    assert led.calls("p2p", "bwd") == sum(sends.values())
    assert all(e.peer != rank for e in led.events if e.kind == "p2p"), "no self-sends"


def assert_messages(msgs: dict, want: dict) -> None:
    """Each case of ``want`` raised (``msgs[name]`` not None) with ``want[name]`` in its
    message (``value_errors``' result against the texts it must name)."""
    for name, text in want.items():
        assert msgs[name] is not None and text in msgs[name], (name, msgs[name])


def value_errors(cases: dict, error: type[Exception] = ValueError) -> dict:
    """Run each no-argument callable; its ``error`` message (a ValueError by default), or
    None if it raised none."""
    msgs = {}
    for name, fn in cases.items():
        try:
            fn()
            msgs[name] = None
        except error as e:
            msgs[name] = str(e)
    return msgs


@contextlib.contextmanager
def own_rows_first_env(value: str | None):
    """``STARTRAIL_OWN_ROWS_FIRST=value`` inside (``None``: unset), and a list that collects
    how many calls each first-step split cut off for the rank's own rows
    (``schedule.split_own_rows``, as ``schedule.plan_step`` calls it), as a Megatron or
    DeepSpeed user's run would set it."""
    import startrail_megatron.schedule.step as step_module

    real, made = step_module.split_own_rows, []

    def counted(calls, own):
        result = real(calls, own)
        made.append(len(result[0]))
        return result

    old = os.environ.pop(OWN_ROWS_FIRST_ENV, None)
    if value is not None:
        os.environ[OWN_ROWS_FIRST_ENV] = value
    step_module.split_own_rows = counted
    try:
        yield made
    finally:
        step_module.split_own_rows = real
        if old is None:
            os.environ.pop(OWN_ROWS_FIRST_ENV, None)
        else:
            os.environ[OWN_ROWS_FIRST_ENV] = old


# ---- packed documents: inputs, reference, the padding rows ---------------------------------
def packed_inputs(lengths, b: int, hq: int, hkv: int, d: int, seed: int) -> list:
    """float64 q, k, v, d_out of the documents ``lengths`` one after another (real tokens
    only, no padding): ``[sum(lengths), b, hq or hkv, d]``, drawn from ``seed``."""
    total = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    shapes = ((total, b, hq, d), (total, b, hkv, d), (total, b, hkv, d), (total, b, hq, d))
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def reference_per_document(lengths, causal: bool, q, k, v, do) -> list:
    """The float64 reference (out, dq, dk, dv) of each document of ``lengths`` alone (no
    attention across documents), concatenated in the documents' order."""
    outs = [[], [], [], []]
    at = 0
    for n in lengths:
        if n:
            sl = slice(at, at + n)
            for i, x in enumerate(reference(q[sl], k[sl], v[sl], do[sl], causal)):
                outs[i].append(x)
        at += n
    return [torch.cat(x) for x in outs]


@functools.cache
def packed_reference(
    lengths: tuple, causal: bool, b: int, hq: int, hkv: int, d: int, seed: int
) -> list:
    """``reference_per_document`` of ``packed_inputs(lengths, b, hq, hkv, d, seed)``, computed
    once per argument list in a test session: the cases that draw the same inputs share it
    (read it, never change it)."""
    return reference_per_document(lengths, causal, *packed_inputs(lengths, b, hq, hkv, d, seed))


def padding_rows(lengths, p: int, rank: int) -> torch.Tensor:
    """``[s_local]`` bool: which of ``rank``'s local rows are padding in
    ``pack_lengths(lengths, p)``'s layout, worked out here from the layout's definition (each
    document padded to the next multiple of 2P; the rank holds, per document, its chunks
    ``rank`` and ``2P-1-rank``; padding at each document's end), not from ``PackedLayout``."""
    rows: list[bool] = []
    for n in lengths:
        c = -(-n // (2 * p))  # one chunk of the padded document
        for j in (rank, 2 * p - 1 - rank):
            rows += [j * c + i >= n for i in range(c)]
    return torch.tensor(rows, dtype=torch.bool)


def noisy_packed_shards(xs, lengths, p: int, rank: int, dtype=torch.float64) -> list:
    """``rank``'s ``st.shard_packed`` of each of ``xs`` (real tokens one after another), in
    ``dtype``, with random values instead of zeros on the padding rows, as a real batch may
    hold there: a kernel call that reads a padding row then changes the result."""
    from startrail_megatron.schedule.packing import pack_lengths

    packed, pad = pack_lengths(lengths, p), padding_rows(lengths, p, rank)
    out = []
    for seed, x in enumerate(xs):
        shard = st.shard_packed(x, packed, rank)
        g = torch.Generator().manual_seed(seed * 1009 + rank)
        noise = torch.randn((int(pad.sum()), *shard.shape[1:]), generator=g, dtype=x.dtype)
        shard[pad] = noise + 1.0
        out.append(shard.to(dtype))
    return out


def assert_padding_rows_zero(per_rank, lengths, p: int) -> None:
    """``per_rank[r]``: rank r's local tensors (out, dq, dk, dv): each exactly zero on the
    padding rows (the padding rows are in no kernel call)."""
    assert len(per_rank) == p
    pads = [padding_rows(lengths, p, r) for r in range(p)]
    assert any(pad.any() for pad in pads), "a layout without padding proves nothing here"
    for r, (tensors, pad) in enumerate(zip(per_rank, pads)):
        for what, x in zip(("out", "dq", "dk", "dv"), tensors, strict=True):
            assert x.shape[0] == pad.shape[0], (what, tuple(x.shape))
            assert (x[pad] == 0).all(), f"rank {r}: {what} is not zero on a padding row"


class AllocationCap:
    """A dispatch mode that records every tensor an operator makes of ``cap`` bytes or more
    as (op, shape, bytes) in ``over`` (recorded rather than raised, so every rank of a
    multi-rank step finishes it): forward, backward, recompute and optimizer alike."""

    def __init__(self, cap: int):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        over = self.over = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() >= cap:
                        over.append((str(func), tuple(t.shape), t.untyped_storage().nbytes()))
                return out

        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts are not a package)."""
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"scripts.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class _CodePayload:
    """Unpickled without restriction, it creates ``marker``: code a crafted file runs."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant_code(file, marker, key: str, save) -> None:
    """Overwrite the checkpoint file ``file`` (a ``pathlib.Path``) with ``{key: payload}``
    written by ``save(obj, file)`` (``torch.save`` or a plain pickle) and write its SHA-256
    into the folder's manifest too, as whoever can write the folder can: only a load that
    runs no code keeps ``marker`` from being created."""
    import json

    from startrail_megatron.checkpoint_files import MANIFEST, sha256

    save({key: _CodePayload(str(marker))}, file)
    manifest_path = file.parent / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][file.name] = sha256(str(file))
    manifest_path.write_text(json.dumps(manifest))


def rel_err_floor1(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error over the reference's largest entry, that scale at least 1: where the
    exact gradient is zero (a window of one key, a document of one token give exactly zero
    dq) the error is absolute, not divided by zero."""
    scale = max(ref.double().abs().max().item(), 1.0)
    return (got.double() - ref.double()).abs().max().item() / scale
