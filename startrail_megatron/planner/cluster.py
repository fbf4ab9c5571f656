"""Cluster and model descriptions for the cost model, with documented presets.

Numbers are *achieved* rates (what NCCL / the kernels reach), not data-sheet
peaks; each preset says where its numbers come from. Units: bytes, seconds,
FLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

__all__ = ["ClusterSpec", "ModelSpec", "CLUSTER_PRESETS", "MODEL_PRESETS"]


@dataclass(frozen=True)
class ClusterSpec:
    """An alpha-beta (latency-bandwidth) model of a GPU cluster.

    CP rank r runs on GPU r; GPUs ``[k*gpus_per_node, (k+1)*gpus_per_node)``
    share node k, unless ``rank_nodes`` names each CP rank's node (a CP group spread
    over its nodes in any order: ``schedule.layout.nodes_from_hosts``). A transfer between
    two GPUs of one node uses the intra-node link; otherwise the inter-node network: one
    GPU alone reaches
    ``inter_bw_per_gpu`` (its NIC), and the GPUs of a node that send off-node
    at the same time share the node's ``inter_bw``.
    """

    name: str
    gpus_per_node: int
    """GPUs in one node (one CP rank each)."""
    num_nodes: int
    """Nodes available."""
    intra_bw: float
    """Achieved intra-node bandwidth per GPU and direction, bytes/s."""
    intra_latency: float
    """Latency of one intra-node message, s."""
    inter_bw: float
    """Achieved inter-node bandwidth per *node* and direction (all its NICs), bytes/s."""
    inter_bw_per_gpu: float
    """Achieved inter-node bandwidth one GPU reaches alone (its NIC rail), bytes/s."""
    inter_latency: float
    """Latency of one inter-node message, s."""
    attn_flops: float
    """Achieved attention-kernel throughput (forward), FLOP/s."""
    attn_bwd_ratio: float
    """Attention backward time / forward time at equal work (flash: 5 matmuls vs 2 -> 2.5)."""
    matmul_flops: float
    """Achieved dense GEMM throughput (projections, MLP), FLOP/s."""
    kernel_overhead: float
    """Fixed cost per attention kernel call (launch, small-block inefficiency), s."""
    gpu_memory: float
    """Memory per GPU, bytes."""
    overlap: bool = True
    """Whether transfers in flight overlap compute and each other (``times``: the
    overlaps the code makes); False: every transfer's time adds up (gloo on shared cores)."""
    all_to_all_inter_bw: float = 0.0
    """Per node and direction, the rate an all-to-all's off-node parts reach (every rank
    of a node sending to every rank of the others at once: many flows on the node's
    link), bytes/s; 0 = ``inter_bw``."""
    own_rows_first: bool | None = None
    """StarTrail's first step runs its calls on the rank's own query rows before waiting the
    team gathers (a few more calls, the gathers hidden behind them) or not: the code's
    ``comm.CommOptions(own_rows_first=)``; None: its default rule
    (``schedule.own_rows_first_pays``)."""
    causal_tile_waste: float = 64.0
    """Masked (q, k) pairs a causal call still computes per query row (diagonal tiles;
    about half the kernel's key-block size: 64 for flash-attn's 128-key blocks)."""
    mem_bw: float = 0.0
    """Achieved memory bandwidth of the elementwise tensor ops outside the kernels and the
    communication (copies, reorders, zero-fills, accumulations, dtype casts), bytes read +
    written per second per rank; 0 = that work is not modelled."""
    reduce_scatter_via_allreduce: bool = False
    """The backend runs a reduce-scatter as clone + all-reduce of the whole input + copy of
    this rank's chunk (PyTorch's gloo ``reduce_scatter_tensor``, ProcessGroupGloo.cpp):
    twice a ring reduce-scatter's bytes and steps, plus the clone and the copy. NCCL runs
    a real reduce-scatter (False)."""
    kernel_cache_bytes: float = 0.0
    """Per-core cache a kernel's per-head K,V (forward) or K,V,dK,dV (backward) must fit in
    to be read once per call; above it they are re-streamed once per query block (see
    ``kv_stream_bw``). 0 = the term is off (the GPU presets: flash-attn's K,V re-reads are
    part of its measured throughput)."""
    kernel_q_blocks: tuple[tuple[int, int], ...] = ()
    """The kernel's query block size by query length: ``((min_q, block), ...)``, the first
    whose ``min_q <= q`` applies (PyTorch's CPU flash kernel: ``((768, 256), (192, 64),
    (0, 32))``)."""
    kv_stream_bw: float = 0.0
    """Bytes/s of the forward's K,V re-reads beyond the cache (bytes: K and V once per
    query block); 0 = not modelled."""
    kv_stream_bw_bwd: float = 0.0
    """Bytes/s of the backward's re-streaming (K, V read, dK, dV read and written once per
    query block); 0 = not modelled."""

    host_cores: float = 0.0
    """Cores that every rank's kernels and every transfer's host work share (an emulated
    cluster on one host: ``kernel_time`` is measured with every rank computing at once,
    and the packets of a transfer in flight take these cores from the kernels); 0 = each
    rank computes on its own device and a transfer's work is the NIC's (GPUs). With it,
    the ring pipeline overlaps its transfers' wire time with compute and adds their host
    CPU (``host_cpu_intra``, ``host_cpu_inter``) to it (``times.ring_pipeline``), and
    every transfer takes at least the host CPU of all the bytes moving with it over these
    cores (``links``)."""
    host_cpu_intra: float = 0.0
    """With ``host_cores``: host CPU seconds per byte moved between two ranks of a node."""
    host_cpu_inter: float = 0.0
    """With ``host_cores``: host CPU seconds per byte moved between nodes."""
    rank_nodes: tuple[int, ...] = ()
    """The node of each CP rank (``node(r) = rank_nodes[r]``), where the CP ranks do not
    fill the nodes in order; () = contiguous (``r // gpus_per_node``). StarTrail's times
    read it (``node``); the peers' all-to-all and the 2-D split's node count use
    ``gpus_per_node``."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in (
                "name", "overlap", "own_rows_first", "reduce_scatter_via_allreduce",
                "kernel_q_blocks", "rank_nodes",
            ):  # fmt: skip
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"cluster setting {f.name}={v!r} must be a number >= 0")
        if self.gpus_per_node < 1 or self.num_nodes < 1:
            raise ValueError(
                f"gpus_per_node={self.gpus_per_node} and num_nodes={self.num_nodes} must be >= 1"
            )
        blocks = self.kernel_q_blocks
        try:  # JSON gives lists: keep tuples, so the spec stays hashable and comparable
            blocks = tuple(tuple(pair) for pair in blocks)
        except TypeError:
            blocks = ((),)
        if any(
            len(pair) != 2 or any(not isinstance(x, int) or x < 0 for x in pair) or not pair[1]
            for pair in blocks
        ):
            raise ValueError(
                f"cluster setting kernel_q_blocks={self.kernel_q_blocks!r} must be "
                "((min_q, block), ...) with integers min_q >= 0 and block >= 1"
            )
        object.__setattr__(self, "kernel_q_blocks", blocks)
        nodes = self.rank_nodes
        if not isinstance(nodes, (tuple, list)) or any(
            not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < self.num_nodes
            for n in nodes
        ):
            raise ValueError(
                f"cluster setting rank_nodes={nodes!r} must list each CP rank's node, an "
                f"integer 0 .. num_nodes-1 = {self.num_nodes - 1}"
            )
        if any(nodes.count(n) > self.gpus_per_node for n in set(nodes)):
            raise ValueError(
                f"cluster setting rank_nodes={nodes!r} puts more than gpus_per_node="
                f"{self.gpus_per_node} CP ranks on one node"
            )
        object.__setattr__(self, "rank_nodes", tuple(nodes))
        for f in (
            "intra_bw",
            "inter_bw",
            "inter_bw_per_gpu",
            "attn_flops",
            "matmul_flops",
        ):
            if getattr(self, f) <= 0:
                raise ValueError(f"cluster setting {f} must be > 0, got {getattr(self, f)!r}")

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    def node(self, rank: int) -> int:
        if self.rank_nodes:
            return self.rank_nodes[rank]
        return rank // self.gpus_per_node

    def with_(self, **changes) -> ClusterSpec:
        return replace(self, **changes)


GB = 1e9
GiB = 2**30

CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    # 8 x 8 H100 SXM (DGX H100 class), the paper's cluster (sec. 5).
    # NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s per direction; NCCL
    # reaches ~80% of it -> 360 GB/s, ~3 us per message.
    # 8 x 400 Gb/s ConnectX-7 per node (one NIC per GPU) = 400 GB/s per node per
    # direction; ~90% achieved -> 360 GB/s per node, 45 GB/s for one GPU on its
    # own rail, ~8 us per message.
    # FlashAttention-2 forward on H100 bf16 at head_dim 128 runs ~330-350
    # TFLOP/s (FA2 paper, fig. 7-8 class numbers); we take 300e12 in a real
    # training step. Dense bf16 GEMMs: 989 TFLOP/s peak, ~60% -> 600e12.
    # HBM3: 3.35 TB/s peak (H100 SXM datasheet); copy/elementwise kernels reach
    # ~90% of it (STREAM-like copies) -> 3.0e12 bytes read + written per second.
    "h100-ib": ClusterSpec(
        name="8 x 8 H100 NVLink + 8 x 400 Gb/s IB",
        gpus_per_node=8,
        num_nodes=8,
        intra_bw=360 * GB,
        intra_latency=3e-6,
        inter_bw=360 * GB,
        inter_bw_per_gpu=45 * GB,
        inter_latency=8e-6,
        attn_flops=300e12,
        attn_bwd_ratio=2.5,
        matmul_flops=600e12,
        kernel_overhead=10e-6,
        gpu_memory=80 * GiB,
        mem_bw=3.0e12,
    ),
    # A100 40GB nodes (8 per node, NVLink 3: 600 GB/s bidirectional = 300 per
    # direction, ~77% achieved -> 230 GB/s) joined by one 100 GbE port per node
    # (12.5 GB/s; TCP/RoCE reach ~10 GB/s, ~30 us per message). FA2 forward on
    # A100 ~ 180-190 TFLOP/s of 312 peak: take 150e12; GEMMs ~ 200e12.
    # HBM2: 1.555 TB/s peak (A100 40GB datasheet), ~90% for copies -> 1.4e12.
    "a100-eth": ClusterSpec(
        name="A100 40GB nodes with 100 GbE",
        gpus_per_node=8,
        num_nodes=8,
        intra_bw=230 * GB,
        intra_latency=5e-6,
        inter_bw=10 * GB,
        inter_bw_per_gpu=10 * GB,
        inter_latency=30e-6,
        attn_flops=150e12,
        attn_bwd_ratio=2.5,
        matmul_flops=200e12,
        kernel_overhead=10e-6,
        gpu_memory=40 * GiB,
        mem_bw=1.4e12,
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """The transformer whose attention is planned (a decoder layer: attention + MLP)."""

    name: str
    layers: int
    """Transformer layers (Y in the paper's memory formula)."""
    hidden: int
    """Hidden size H."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (= heads without GQA)."""
    ffn_hidden: int
    """MLP inner size."""
    gated_mlp: bool = False
    """SwiGLU-style MLP (three matrices) instead of two."""
    vocab: int = 50304
    """Vocabulary size (embedding parameters); a DiT's output projection size."""
    causal: bool = True
    """Causal attention (GPT); ``False``: full attention (DiT: no zigzag balance needed)."""
    adaln_zero: bool = False
    """DiT's adaLN-Zero modulation: 6 H^2 more parameters per layer."""

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"model setting {f}={v!r} must be an integer >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be a multiple of heads={self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def params_per_layer(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn_hidden
        return h * (h + 2 * kv) + h * h + mlp + (6 * h * h if self.adaln_zero else 0)

    @property
    def params(self) -> int:
        return self.layers * self.params_per_layer + self.vocab * self.hidden


MODEL_PRESETS: dict[str, ModelSpec] = {
    # GPT-7B of the paper's H100 runs (GPT-3 "6.7B" shape).
    "gpt-7b": ModelSpec("gpt-7b", layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=16384),
    # GPT-3B of the paper's A100 runs (GPT-3 "2.7B" shape).
    "gpt-3b": ModelSpec("gpt-3b", layers=32, hidden=2560, heads=32, kv_heads=32, ffn_hidden=10240),
    # LLaMA-30B, the paper's worked communication example (H = 6656).
    "llama-30b": ModelSpec(
        "llama-30b",
        layers=60,
        hidden=6656,
        heads=52,
        kv_heads=52,
        ffn_hidden=17920,
        gated_mlp=True,
        vocab=32000,
    ),
    # LLaMA-3-8B: GQA (8 KV heads).
    "llama3-8b": ModelSpec(
        "llama3-8b",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        ffn_hidden=14336,
        gated_mlp=True,
        vocab=128256,
    ),
    # DiT-1B of the paper's diffusion runs (sec. 5: 24 layers, hidden 1536, 24 heads),
    # full attention over image / video tokens; adaLN-Zero blocks, MLP ratio 4; the
    # "vocab" is the per-token output projection (patch 2 x 2, 8 latent channels).
    "dit-1b": ModelSpec(
        "dit-1b",
        layers=24,
        hidden=1536,
        heads=24,
        kv_heads=24,
        ffn_hidden=6144,
        vocab=32,
        causal=False,
        adaln_zero=True,
    ),
}
