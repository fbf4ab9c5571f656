"""The paper's closed forms (eqs. 4-10), beside which the exact counts are checked."""

from __future__ import annotations

from .strategies import Strategy

__all__ = ["paper_comm_bytes", "paper_memory_units"]


def paper_comm_bytes(
    seq_len: int, hidden: int, cp_size: int, team_size: int, batch: int = 1, elem_bytes: int = 2
) -> dict[str, float]:
    """The paper's per-rank forward volumes (eqs. 4-7), in bytes.

    ring ``2BNH`` (K and V of the whole sequence, P steps), StarTrail P2P
    ``2BNH/C``, StarTrail team collectives ``4BNH(C-1)/P`` (q, k, v gathered,
    out reduce-scattered, all in the input dtype).
    """
    bnh = batch * seq_len * hidden * elem_bytes
    return {
        "ring_p2p": 2 * bnh,
        "startrail_p2p": 2 * bnh / team_size,
        "startrail_collective": 4 * bnh * (team_size - 1) / cp_size,
    }


def paper_memory_units(strategy: Strategy, layers: int) -> int:
    """Activation memory in units of A = BNH/P (paper, eqs. 8-10), beyond model states M.

    Ring / all-gather / Ulysses: Y + 4; StarTrail: Y + 3C + 1.
    """
    c = strategy.team_size if strategy.spec.teams else 1
    return layers + 3 * c + 1 if c > 1 else layers + 4
