"""megatron-core on CPU ranks: scoped, reversible patches.

megatron-core assumes CUDA in a few places (``torch.cuda.current_device()``
for buffers and RoPE frequencies, ``torch.cuda.synchronize()`` in the
checkpoint writer, ``torch.cuda.current_stream()`` in the DDP's gradient
sync from 0.19, the hybrid stack's final norm that is always Transformer
Engine's in 0.19, a CUDA causal mask, ``pin_memory`` in RoPE's CP slicing,
the CUDA RNG tracker, the CUDA generator's state that activation recompute
saves and restores). On a machine without CUDA we point those at the CPU;
nothing is patched when CUDA is available, and nothing on import.

The patches change process-wide objects (``torch.cuda`` functions, functions
and globals of megatron-core modules), so they are scoped: ``with
cpu_support_enabled():``, or ``enable_cpu_support()`` paired with
``disable_cpu_support()``. Scopes nest (a count): the first enable applies
the patches, the matching last disable restores every patched attribute.
StarTrail's entry point enables them in ``training.initialize`` and disables
them in ``training.teardown``. megatron-core's version differences are in
``versions.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "cpu_manual_seed",
    "cpu_support_active",
    "cpu_support_enabled",
    "disable_cpu_support",
    "enable_cpu_support",
]

_UNDO: list[Callable[[], None]] = []
_scopes = 0  # enable_cpu_support() calls not yet matched by disable_cpu_support()


def _patch(obj: Any, name: str, value: Any) -> None:
    old = getattr(obj, name)
    setattr(obj, name, value)
    _UNDO.append(lambda: setattr(obj, name, old))


class _CpuRNGTracker:
    """Megatron's RNG tracker API on the CPU generator (dropout inside ``fork``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        g = torch.Generator().manual_seed(seed)
        self.states_[name] = g.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


class _CpuStream:
    """``torch.cuda.current_stream()`` on the CPU: one in-order stream, nothing to wait on."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


_CPU_STREAM = _CpuStream()


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    """megatron-core's ``get_sliding_window_causal_mask`` (True = masked) on the CPU."""
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
    return ~ml


def _cpu_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    from ..zigzag import zigzag_shard

    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    return zigzag_shard(pos_emb, cp_group.rank(), cp_group.size(), dim=seq_dim)


def cpu_manual_seed(seed: int) -> None:
    """``model_parallel_cuda_manual_seed`` for CPU runs: same seeds per TP rank."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker.add("model-parallel-rng", seed + 2718 + tp_rank)
    tracker.add(mrandom.get_data_parallel_rng_tracker_name(), seed)
    tracker.add(mrandom.get_expert_parallel_rng_tracker_name(), seed + 1024 + tp_rank)
    torch.manual_seed(seed)


def enable_cpu_support() -> bool:
    """Point megatron-core's CUDA-only spots at the CPU; returns whether they are patched.

    Without CUDA: opens a scope (the first one applies the patches) which one
    ``disable_cpu_support()`` closes. With CUDA: nothing, and returns ``False``
    (then no ``disable_cpu_support()`` is owed, though one is harmless).
    """
    global _scopes
    if torch.cuda.is_available():
        return False
    if not _scopes:
        _apply_patches()
    _scopes += 1
    return True


def disable_cpu_support() -> None:
    """Close one ``enable_cpu_support()`` scope; the last one restores what was patched."""
    global _scopes
    if not _scopes:
        return
    _scopes -= 1
    if not _scopes:
        while _UNDO:
            _UNDO.pop()()


def cpu_support_active() -> bool:
    return bool(_UNDO)


@contextlib.contextmanager
def cpu_support_enabled() -> Iterator[bool]:
    """``with cpu_support_enabled() as patched:`` megatron-core on the CPU inside the block."""
    patched = enable_cpu_support()
    try:
        yield patched
    finally:
        if patched:
            disable_cpu_support()


def _apply_patches() -> None:
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rotary
    import megatron.core.transformer.utils as tutils
    from megatron.core.tensor_parallel import random as mrandom

    _patch(torch.cuda, "current_device", lambda: torch.device("cpu"))
    _patch(torch.cuda, "synchronize", lambda device=None: None)  # checkpoint writer; no device
    _patch(torch.cuda, "current_stream", lambda device=None: _CPU_STREAM)  # DDP grad sync (0.19)
    for mod in (tutils, fused_softmax):
        _patch(mod, "get_default_causal_mask", _cpu_causal_mask)
        if hasattr(mod, "get_sliding_window_causal_mask"):
            _patch(mod, "get_sliding_window_causal_mask", _cpu_sliding_window_causal_mask)
    for mod in (rope_utils, rotary):
        _patch(mod, "get_pos_emb_on_this_cp_rank", _cpu_pos_emb_on_this_cp_rank)
    try:  # megatron-core >= 0.19: HybridStack's final norm is TENorm whatever the spec
        import megatron.core.models.hybrid.hybrid_block as hybrid_block
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
    except ImportError:
        hybrid_block = None
    if hybrid_block is not None:
        _patch(hybrid_block, "TENorm", WrappedTorchNorm)
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER", _CpuRNGTracker())
    _patch(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)
    # activation recompute (tensor_parallel.checkpoint) saves and restores the CPU generator,
    # the tracker's states and the CUDA generator's: there is none on CPU ranks
    _patch(mrandom, "_get_cuda_rng_state", lambda *args, **kwargs: None)
    _patch(mrandom, "_set_cuda_rng_state", lambda *args, **kwargs: None)
