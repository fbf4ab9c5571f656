"""StarTrail's peers as attention functions with the same contract, for benchmarks.

Same call shape as ``startrail_attention``: q ``[s_local, b, heads_q, head_dim]``,
k/v ``[s_local, b, heads_kv, head_dim]`` (Megatron layout; causal expects the
zigzag split), an explicit process group, ``ledger=CommLedger`` accounting.

``allgather_attention`` (``allgather.py``): Megatron's ``all_gather`` CP kind.
``ulysses_attention`` (``ulysses.py``): DeepSpeed-Ulysses, DeepSpeed's
``DistributedAttention`` around our kernel (DeepSpeed imported lazily).
Ring attention is ``startrail_attention`` with ``team_size=1``.

Communication per rank and call: the table and the functions
(``allgather_comm_bytes``, ``ulysses_comm_bytes``, their ``*_comm_calls``) are in
``accounting.py``, pure arithmetic; the tests check them against the ledger, and
the planner uses them. Their kernel calls: ``schedule.allgather_calls``.
"""

from .allgather import allgather_attention
from .ulysses import ulysses_attention

__all__ = ["allgather_attention", "ulysses_attention"]
