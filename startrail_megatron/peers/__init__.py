"""StarTrail's peers as attention functions with ``startrail_attention``'s contract.

``allgather_attention``: Megatron's ``all_gather`` CP kind (all-gather K,V).
``ulysses_attention``: DeepSpeed-Ulysses (DeepSpeed's ``DistributedAttention``).
Their bytes and calls: ``accounting.py``; their kernel calls: ``block_plan.py``.
"""

from .allgather import allgather_attention, ulysses_attention

__all__ = ["allgather_attention", "ulysses_attention"]
