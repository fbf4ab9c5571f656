"""The communication layer on both call shapes, and the harness's no-hang guarantees."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
from harness import MultiRankError, gloo_loop_threads, run_ranks, shutdown

import startrail_megatron as st
from startrail_megatron.comm import torch_dist as comm


def _team_collectives(rank, world, shape_name):
    """TeamComm with torch 2.13's flat collectives and with the older names."""
    import torch.distributed as dist

    fns = {
        "single": (dist.all_gather_single, dist.reduce_scatter_single),
        "into_tensor": (dist.all_gather_into_tensor, dist.reduce_scatter_tensor),
    }[shape_name]
    calls = {"all_gather": 0, "reduce_scatter": 0}

    def spy(name, fn):
        def counted(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return counted

    saved = comm._all_gather, comm._reduce_scatter
    comm._all_gather = spy("all_gather", fns[0])
    comm._reduce_scatter = spy("reduce_scatter", fns[1])
    try:
        groups = st.StarTrailGroups.create(2)
        ledger = st.CommLedger()
        tc = comm.TeamComm(groups.team_group, 2, ledger)
        x = torch.full((3, 2), float(rank), dtype=torch.float64)
        gathered = tc.all_gather(x, "x")
        summed = tc.reduce_scatter(torch.arange(8.0).reshape(4, 2) * (rank + 1), "y")
        bf = tc.all_gather(torch.full((2,), rank, dtype=torch.bfloat16), "bf")
    finally:
        comm._all_gather, comm._reduce_scatter = saved
    return gathered, summed, bf, [(e.op, e.nbytes, e.group) for e in ledger.events], calls


@pytest.mark.parametrize("shape_name", ["single", "into_tensor"])
def test_team_collectives_both_call_shapes(shape_name):
    res = run_ranks(4, _team_collectives, shape_name)
    for r, (gathered, summed, bf, events, calls) in enumerate(res):
        assert calls == {"all_gather": 2, "reduce_scatter": 1}  # this call shape was used
        team = [r - r % 2, r - r % 2 + 1]
        assert gathered[:, 0].tolist() == [team[0]] * 3 + [team[1]] * 3
        mult = sum(t + 1 for t in team)
        half = (torch.arange(8.0).reshape(4, 2) * mult)[2 * (r % 2) : 2 * (r % 2) + 2]
        torch.testing.assert_close(summed, half)
        assert bf.tolist() == [team[0]] * 2 + [team[1]] * 2
        team = tuple(team)  # each collective records its members, global ranks
        assert events == [
            ("all_gather", 48, team),
            ("reduce_scatter", 16, team),
            ("all_gather", 4, team),
        ]


def _start_three(team, p2p, member: int, rank: int):
    """Two collectives and an exchange in flight at once, waited on in reverse order."""
    x = torch.arange(6.0).reshape(3, 2) + 10 * member
    y = torch.arange(8.0).reshape(4, 2) * (member + 1)
    a = team.all_gather_start(x, "a")
    b = team.reduce_scatter_start(y, "b")
    e = p2p.exchange(torch.tensor([rank * 1.0]), rank ^ 1, rank ^ 1, "e")
    got = (e.wait(), b.wait(), a.wait())
    try:
        a.wait()
        twice = None
    except RuntimeError as err:
        twice = str(err)
    return got, (team.reduce_scatter(y, "b"), team.all_gather(x, "a")), twice


def _in_flight(rank, world):
    groups = st.StarTrailGroups.create(2)
    led = st.CommLedger()
    team = comm.TeamComm(groups.team_group, 2, led)
    got, blocking, twice = _start_three(team, comm.P2PComm(None, rank, led), rank % 2, rank)
    return got, blocking, twice, led.waits()


def test_transfers_in_flight_together_both_transports():
    from startrail_megatron.comm.in_process import (
        Baton,
        InProcessP2P,
        InProcessTeam,
        InProcessWorld,
    )

    res = run_ranks(4, _in_flight)
    world = InProcessWorld(st.StarTrailLayout(4, 2))
    world.baton = Baton(4, torch.device("cpu"), None)

    def rank_fn(r):
        def fn():
            team, p2p = InProcessTeam(world, r, None), InProcessP2P(world, r, None)
            return _start_three(team, p2p, team.member, r)[0]

        return fn

    one = world.baton.run([rank_fn(r) for r in range(4)])
    for r, (got, blocking, twice, waits) in enumerate(res):
        assert got[0].tolist() == [float(r ^ 1)]
        torch.testing.assert_close(got[1], blocking[0])
        torch.testing.assert_close(got[2], blocking[1])
        assert "twice" in twice
        for x, y in zip(got, one[r]):
            assert torch.equal(x, y)
        # every transfer's wait was timed on these CPU ranks: in flight + exposed
        assert set(waits) == {"fwd/collective/a", "fwd/collective/b", "fwd/p2p/e"}
        assert waits["fwd/collective/a"]["count"] == 2  # the async and the blocking one
        assert 0 <= waits["fwd/p2p/e"]["hidden"] <= 1


def _fan(p2p, rank: int):
    """Pieces to this rank and its partner, one from each; a piece to oneself is kept."""
    peer = rank ^ 1
    sends = [(d, torch.tensor([10.0 * rank + d])) for d in (rank, peer)]
    h = p2p.exchange_many(sends, [peer, rank], sends[0][1], "fan")
    got = h.wait()
    try:
        p2p.exchange_many([(rank, sends[0][1])], [peer], sends[0][1], "fan")
        bad = None
    except ValueError as e:
        bad = str(e)
    buf = torch.empty(2)  # the pieces received into one buffer, in srcs order
    views = p2p.exchange_many(sends, [peer, rank], sends[0][1], "fan", out=buf).wait()
    into = buf.tolist() == [10.0 * peer + rank, 10.0 * rank + rank] and views[0]._base is buf
    return [g.tolist() for g in got], got[1] is sends[0][1] and into, bad


def _fan_rank(rank, world):
    led = st.CommLedger()
    got = _fan(comm.P2PComm(None, rank, led), rank)
    return (*got, [(e.what, e.peer) for e in led.events])


def test_exchange_many_both_transports():
    from startrail_megatron.comm.in_process import Baton, InProcessP2P, InProcessWorld

    res = run_ranks(4, _fan_rank)
    world = InProcessWorld(st.StarTrailLayout(4, 2))
    world.baton = Baton(4, torch.device("cpu"), None)
    one = world.baton.run([lambda r=r: _fan(InProcessP2P(world, r, None), r) for r in range(4)])
    for r, (got, kept, bad, events) in enumerate(res):
        assert got == [[10.0 * (r ^ 1) + r], [10.0 * r + r]]
        assert kept, "the piece to oneself is the tensor itself"
        assert "self-send must also be a self-receive" in bad
        assert events == [("fan", r ^ 1)] * 2  # one transfer each: the piece to oneself is none
        assert one[r][:2] == (got, True) and one[r][2] == bad


def _p2p(rank, world):
    """Two-rank rings (next == prev), self-exchanges and misuse checks."""
    p2p = comm.P2PComm(None, rank, st.CommLedger())
    peer = rank ^ 1
    got = p2p.exchange(torch.tensor([rank, 10 * rank]), peer, peer, "x").wait()
    same = torch.tensor([7])
    self_x = p2p.exchange(same, rank, rank, "x")
    assert self_x.wait() is same
    try:
        self_x.wait()
        twice = None
    except RuntimeError as e:
        twice = str(e)
    try:
        p2p.exchange(same, rank, peer, "x")
        bad = None
    except ValueError as e:
        bad = str(e)
    buf = torch.empty(2, dtype=torch.int64)
    into = p2p.exchange(torch.tensor([rank, 1]), peer, peer, "x", out=buf).wait()
    try:
        p2p.exchange(torch.tensor([rank, 1]), peer, peer, "x", out=torch.empty(3))
        bad_out = None
    except ValueError as e:
        bad_out = str(e)
    ok = into is buf and buf.tolist() == [peer, 1]
    return got.tolist(), twice, bad, len(p2p.ledger.events), ok, bad_out


def test_p2p_exchange():
    for r, (got, twice, bad, n, into, bad_out) in enumerate(run_ranks(4, _p2p)):
        assert got == [r ^ 1, 10 * (r ^ 1)]
        assert "twice" in twice and "self-send must also be a self-receive" in bad
        assert n == 2  # the self-exchange is not a transfer
        assert into, "out= is the receive buffer"
        assert "out= must be like the tensor sent" in bad_out


def _skip_on_rank0(rank, world):
    import torch.distributed as dist

    if rank != 0:
        dist.all_reduce(torch.ones(1))


def _die_on_rank1(rank, world):
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def test_mismatched_ranks_end_in_timeout_not_hang():
    t0 = time.monotonic()
    with pytest.raises(MultiRankError, match=r"ranks \[1, 2, 3\] did not answer within 3s"):
        run_ranks(4, _skip_on_rank0, timeout=3)
    assert time.monotonic() - t0 < 30


def test_dead_peer_is_reported_as_root_cause():
    with pytest.raises(MultiRankError, match="rank 1 died"):
        run_ranks(4, _die_on_rank1, timeout=10)


def _group_timeout(rank, world):
    """A team group created with a timeout: a missing peer raises, never hangs."""
    groups = st.StarTrailGroups.create(2, timeout=timedelta(seconds=2))
    if rank % 2 == 0:
        return "skipped"
    t0 = time.monotonic()
    try:
        comm.TeamComm(groups.team_group, 2, None).all_gather(torch.ones(2), "x")
    except RuntimeError as e:
        return f"raised after {time.monotonic() - t0:.1f}s: {e}"[:200]
    return "no error"


def test_group_timeout_raises():
    res = run_ranks(4, _group_timeout, timeout=60)
    shutdown()  # the skipped collective leaves the groups unusable: start afresh
    for r in (1, 3):
        assert res[r].startswith("raised after"), res[r]


def _gloo_loop_policies(rank, world):
    """The scheduling policy of each gloo event-loop thread of this rank."""
    return [os.sched_getscheduler(tid) for tid in gloo_loop_threads()]


def test_the_ranks_gloo_loop_yields_the_core():
    """The harness runs each rank's one gloo event loop (one device shared by its groups)
    under SCHED_IDLE, so that its spin on a locked pair takes no core from the ranks
    (harness._idle_gloo_loop); a torch whose thread is named otherwise fails here."""
    assert run_ranks(2, _gloo_loop_policies) == [[os.SCHED_IDLE]] * 2


# ---- group creation: warm-up and rank order ------------------------------------------
def test_warm_up_device_follows_the_backend():
    from startrail_megatron.groups import _warm_up_device

    assert _warm_up_device("nccl", True) == "cuda:0"
    assert _warm_up_device("cpu:gloo,cuda:nccl", True) == "cuda:0"
    assert _warm_up_device("gloo", True) == "cpu"
    assert _warm_up_device("nccl", False) == "cpu"
    # the group's bound device (init_process_group(device_id=...)) first, else the current
    assert _warm_up_device("nccl", True, torch.device("cuda:3"), 0) == "cuda:3"
    assert _warm_up_device("nccl", True, None, 5) == "cuda:5"
    assert _warm_up_device("gloo", True, torch.device("cuda:3"), 5) == "cpu"


def _warm_up_calls(rank, world, team_size):
    """The all-reduces StarTrailGroups.create makes, per group (None = the world)."""
    import torch.distributed as dist

    from startrail_megatron import groups as gmod

    seen, real = [], dist.all_reduce

    def spy(t, *a, group=None, **kw):
        seen.append(group)
        return real(t, *a, group=group, **kw)

    dist.all_reduce = spy
    try:
        g = gmod.StarTrailGroups.create(team_size)
    finally:
        dist.all_reduce = real

    def name(x):  # the CP group is the world here (None)
        if x is None:
            return "cp"
        return "team" if x is g.team_group else "subring" if x is g.subring_group else "other"

    return [name(x) for x in seen]


@pytest.mark.parametrize("world,team_size,expect", [(4, 2, ["cp", "team"]),
                                                    (8, 2, ["cp", "team", "subring"]),
                                                    (4, 1, ["cp", "subring"])])  # fmt: skip
def test_create_warms_up_every_group_it_uses(world, team_size, expect):
    """The CP group's first operation is then a collective of all its ranks, not the
    initial KV placement (which the ranks keeping their own KV skip): NCCL needs that."""
    assert run_ranks(world, _warm_up_calls, team_size) == [expect] * world


def _old_torch_groups(rank, world, descending):
    """new_group without sort_ranks (older torch): ascending CP ranks work, others refused."""
    import torch.distributed as dist

    from startrail_megatron import groups as gmod

    cp = None
    if descending:
        cp = dist.new_group(list(range(world))[::-1], sort_ranks=False)
    saved = gmod._new_group_sorts
    gmod._new_group_sorts = lambda: False
    try:
        g = gmod.StarTrailGroups.create(2, cp_group=cp)
    except ValueError as e:
        return str(e)
    finally:
        gmod._new_group_sorts = saved
    return dist.get_process_group_ranks(g.team_group)


def test_groups_on_torch_without_sort_ranks():
    assert run_ranks(4, _old_torch_groups, False) == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for msg in run_ranks(4, _old_torch_groups, True):
        assert "sorts a new group's ranks" in msg and "cp_group whose global ranks ascend" in msg


def test_ledger_totals_exact_events_bounded():
    led = st.CommLedger(max_events=3)
    for i in range(5):
        led.phase = "bwd" if i >= 3 else "fwd"
        led.record("p2p", "send", "kv", 10 * (i + 1), peer=1)
    led.record("collective", "all_gather", "qkv", 7)
    assert len(led.events) == 3 and led.events[-1].what == "qkv"  # the most recent
    assert led.bytes("p2p") == 150 and led.calls("p2p") == 5
    assert led.bytes("p2p", "fwd") == 60 and led.bytes("p2p", "bwd") == 90
    assert led.summary()["bwd_collective_bytes"] == 7  # recorded in phase "bwd"
    again = st.CommLedger.from_events(list(led.events))
    assert again.bytes() == 40 + 50 + 7 and again.calls() == 3
    led.clear()
    assert not led.events and led.bytes() == 0 and led.calls() == 0
    assert st.CommLedger(max_events=None).events.maxlen is None
    with pytest.raises(ValueError, match="max_events"):
        st.CommLedger(max_events=-1)


def test_ledger_bytes_by_link_class():
    """Ranks 0-3 on nodes 0, 0, 1, 1; this rank is 1."""
    led = st.CommLedger()
    led.record("p2p", "send", "kv", 100, peer=0)  # same node
    led.record("p2p", "send", "kv", 200, peer=2)  # the other node
    led.record("collective", "all_gather", "q", 30, group=(0, 1))  # to 0: the ring wraps
    led.record("collective", "reduce_scatter", "out", 40, group=(3, 1, 0))  # after 1: 0
    led.record("collective", "all_gather", "lse", 50, group=(1, 2))  # after 1: 2
    led.phase = "bwd"
    led.record("collective", "all_to_all", "q", 90, group=(0, 1, 2, 3))  # 30 to each other
    led.record("collective", "all_gather", "x", 7)  # no group recorded
    led.record("collective", "all_gather", "y", 5, group=(2, 3))  # not a member
    led.record("p2p", "send", "kv", 11, peer=0, group=(3,))  # peer: a ring group's rank 0
    node = [0, 0, 1, 1].__getitem__
    got = led.bytes_by_link(1, node)
    assert got == {
        "intra_node": 100 + 30 + 40 + 30,
        "inter_node": 200 + 50 + 60 + 11,
        "unknown": 12,
    }
    assert sum(got.values()) == led.bytes()
    # P2P peers are CP ranks: with CP ranks 0, 1, 2 on global ranks 2, 3, 0 the peers move
    got = led.bytes_by_link(1, node, cp_ranks=[2, 3, 0])
    assert got["intra_node"] == 200 + 30 + 40 + 30 and got["inter_node"] == 100 + 50 + 60 + 11
    # an all-to-all that does not split evenly: every byte is still counted, once
    led.record("collective", "all_to_all", "k", 10, group=(0, 1, 2, 3))  # 4, 3, 3
    got = led.bytes_by_link(1, node)
    assert got["intra_node"] == 100 + 30 + 40 + 30 + 4 and sum(got.values()) == led.bytes()
    again = st.CommLedger.from_events(list(led.events))
    assert again.bytes_by_link(1, node) == led.bytes_by_link(1, node)


def _op_order(rank, world):
    """The ops each exchange hands ``batch_isend_irecv``, in order ("recv" / "send"), and
    what arrived (the recording wrapper passes them on unchanged)."""
    import torch.distributed as dist

    real, order = dist.batch_isend_irecv, []

    def recording(ops):
        order.append(["recv" if o.op is dist.irecv else "send" for o in ops])
        return real(ops)

    p2p = comm.P2PComm(None, rank, None)
    peer, nxt, prv = rank ^ 1, (rank + 1) % world, (rank - 1) % world
    dist.batch_isend_irecv = recording
    try:
        one = p2p.exchange(torch.tensor([float(rank)]), nxt, prv, "x").wait()
        many = p2p.exchange_many(
            [(peer, torch.tensor([1.0 + rank])), (nxt, torch.tensor([2.0 + rank]))],
            [peer, prv], torch.tensor([0.0]), "y",
        ).wait()  # fmt: skip
    finally:
        dist.batch_isend_irecv = real
    return order, one.tolist(), [t.tolist() for t in many]


def test_exchanges_post_receives_before_sends():
    """Note [receives first]: gloo runs a two-way exchange one direction after the other
    when a send is posted before the receive (measured on the emulated cluster); every exchange
    hands its receives first, and what arrives is unchanged."""
    for r, (order, one, many) in enumerate(run_ranks(4, _op_order)):
        assert order == [["recv", "send"], ["recv", "recv", "send", "send"]], order
        assert one == [float((r - 1) % 4)]
        assert many == [[1.0 + (r ^ 1)], [2.0 + (r - 1) % 4]]


def _all_to_all(rank, world):
    """``TeamComm.all_to_all`` (``all_to_all_single``) against the list form
    ``dist.all_to_all`` on the same data, its ledger record, and its refusals."""
    import torch.distributed as dist

    x = torch.arange(world * 3 * 2, dtype=torch.float32).view(world * 3, 2) + 100 * rank
    ledger = st.CommLedger()
    tc = comm.TeamComm(None, world, ledger)
    got = tc.all_to_all(x, "x")
    outs = [torch.empty(3, 2) for _ in range(world)]
    dist.all_to_all(outs, list(x.chunk(world)))
    one = comm.TeamComm(None, 1, ledger).all_to_all(x, "one")  # a group of one: no transfer
    try:
        tc.all_to_all_start(x[:5], "bad")
        bad = None
    except ValueError as e:
        bad = str(e)
    events = [(e.op, e.what, e.nbytes, e.group) for e in ledger.events]
    return got, torch.cat(outs), one is x, events, bad


def test_all_to_all_both_call_shapes():
    for rank, (got, listed, one, events, bad) in enumerate(run_ranks(4, _all_to_all)):
        assert torch.equal(got, listed)
        # rows j*3 .. of the result came from rank j, its rows rank*3 ..
        want = torch.cat(
            [torch.arange(24.0).view(12, 2)[3 * rank : 3 * rank + 3] + 100 * j for j in range(4)]
        )
        assert torch.equal(got, want)
        assert one and events == [("all_to_all", "x", 3 * 24 * 4 // 4, (0, 1, 2, 3))]
        assert "5 rows do not split over 4 ranks" in bad
