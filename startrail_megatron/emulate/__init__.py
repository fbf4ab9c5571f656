"""An emulated multi-node cluster on one host (root: network namespaces, veth, tc tbf).

``cluster``: ``EmulationSpec`` (``NODESxRANKS``, rates), ``EmulatedCluster`` (build, start
ranks in their nodes, remove everything; Note [the emulated cluster]). ``probe``: one
rank of the link probe (transfer times inside a node and between nodes).
"""

from .cluster import EmulatedCluster, EmulationSpec, check_can_emulate, parse_rate, parse_topology

__all__ = [
    "EmulatedCluster",
    "EmulationSpec",
    "check_can_emulate",
    "parse_rate",
    "parse_topology",
]
