"""Peak memory of a region on one rank: CUDA allocator, live CPU tensors, MemTracker, RSS."""

from __future__ import annotations

import gc
import re
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PHASES", "LiveTensorBytes", "PeakMemory", "phase_hooks"]

PHASES = ("decoder", "rest")
"""The phases of a step whose peaks the GPT entry point logs (``--log-peak-memory``):
``phase_hooks(decoder, tracker, "decoder")`` names the first, the rest is ``"rest"``."""


def _status_kib(field: str) -> int:
    m = re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read())
    return int(m.group(1)) if m else 0


class LiveTensorBytes(TorchDispatchMode):
    """The peak of the bytes of every live CPU tensor storage while the mode is on.

    At entry it counts every CPU tensor the garbage collector knows of (parameters,
    gradients, optimizer state, buffers: what a training step starts with); then every
    storage an operator returns (forward, backward, optimizer: all go through PyTorch's
    dispatcher), each storage once however many views share it, until it is freed (a
    weak reference's callback). Tensors only: no allocator slack, nothing a library
    allocates outside PyTorch's operators (a gloo transport's own buffers). Unlike
    PyTorch's ``MemTracker`` it needs no module hooks, so it runs on Megatron's DDP
    (whose ``buffers`` attribute shadows ``nn.Module.buffers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self.phase = "rest"
        """The phase now (``phase_hooks`` sets it); ``phase_peaks`` keeps each one's peak."""
        self.phase_peaks: dict[str, int] = {}
        self._sizes: dict[int, int] = {}
        self._finalizers: list[weakref.finalize] = []

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or t.is_meta:
            return
        st = t.untyped_storage()
        key, n = st._cdata, st.nbytes()
        old = self._sizes.get(key)
        if old is None:
            self._finalizers.append(weakref.finalize(st, self._free, key))
        self._sizes[key] = n
        self.current += n - (old or 0)
        self.peak = max(self.peak, self.current)
        if self.current > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.current

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)

    def __enter__(self):
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):
                self._track(obj)
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._sizes.clear()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def phase_hooks(module: torch.nn.Module, tracker: LiveTensorBytes, name: str) -> list:
    """Make ``tracker`` count what happens inside ``module``'s forward and backward as phase
    ``name`` (and the rest as ``"rest"``); returns the hook handles (``.remove()`` each).

    The forward is bracketed by forward hooks. The backward is bracketed by gradient hooks
    on the tensors themselves: it starts when the gradient of the module's output arrives
    and ends when the gradients of its inputs are made. (Module backward hooks cannot do
    it: they see positional inputs only, and a module called with keywords, as Megatron
    calls its decoder, has its "backward done" hook fired at once, so its backward would
    be counted outside.)

    A step's peak is the larger of its phases' peaks, each of which grows with the sequence
    at its own rate: a transformer's layers (``name``) with their kept activations and
    their backward's buffers, the rest with the logits and the loss, whose fixed costs (a
    tile, the output layer's weight gradient) can hold the whole step's peak at short
    lengths and hide the layers' slope."""

    def enter(*_):
        tracker.phase = name

    def leave(*_):
        tracker.phase = "rest"

    def grads(tree) -> list:
        return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad]

    def pre(_module, args, kwargs):
        enter()
        for t in grads((args, kwargs)):
            t.register_hook(leave)  # its gradient made: the module's backward is over

    def post(_module, args, kwargs, output):
        leave()
        for t in grads(output):
            t.register_hook(enter)  # the output's gradient arrived: the backward starts

    return [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True),
    ]


class PeakMemory:
    """Peak memory of a region on one rank.

    ``"cuda"``: ``torch.cuda.max_memory_allocated`` above the allocation at entry.
    ``"live"`` (CPU): the peak bytes of every live tensor during the region, those
    alive at entry included (``LiveTensorBytes``: the CPU's ``max_memory_allocated``,
    less allocator slack).
    ``"tracker"`` (CPU): the peak of live tensor bytes during the region,
    from PyTorch's dispatch-level ``MemTracker``
    (``torch.distributed._tools.mem_tracker``, a private tool; tensors only,
    those of modules called in the region and those made in it, no allocator slack).
    ``"rss"`` (CPU): growth of the resident set (Linux ``VmHWM`` after a reset
    through ``/proc/self/clear_refs``, minus ``VmRSS`` at entry); pages kept
    by the allocator from earlier work are reused without growth, so it can
    read low (even 0) for whatever runs after a larger run.

    ``whole=True`` (``cuda``, ``rss``): the peak itself, not its growth over the entry:
    the CUDA allocator's peak, or the resident set's high-water mark (the interpreter and
    libraries included).
    """

    METHODS = {
        "cuda": "torch.cuda.max_memory_allocated above the allocation at entry",
        "live": "peak bytes of every live tensor (LiveTensorBytes, CPU)",
        "tracker": "peak live tensor bytes in one iteration (torch MemTracker, CPU)",
        "rss": "RSS high-water growth (VmHWM reset via /proc/self/clear_refs)",
        "none": "not measured",
    }

    def __init__(self, device: torch.device, method: str = "auto", whole: bool = False):
        if method == "auto":
            method = "cuda" if device.type == "cuda" else "tracker"
        if method not in self.METHODS:
            raise ValueError(f"memory method {method!r} not known; allowed: {list(self.METHODS)}")
        self.device, self.method, self.peak, self.whole = device, method, 0, whole

    @property
    def description(self) -> str:
        return self.METHODS[self.method]

    def __enter__(self) -> PeakMemory:
        if self.method == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        elif self.method == "rss":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = _status_kib("VmRSS") * 1024
        elif self.method == "live":
            self.tracker = LiveTensorBytes()
            self.tracker.__enter__()
        elif self.method == "tracker":
            from torch.distributed._tools.mem_tracker import MemTracker

            self.tracker = MemTracker()
            self._quiet = warnings.catch_warnings()
            self._quiet.__enter__()
            warnings.simplefilter("ignore")  # its module hooks warn about non-modules
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        base = 0 if self.whole else getattr(self, "base", 0)
        if self.method == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - base
        elif self.method == "rss":
            self.peak = _status_kib("VmHWM") * 1024 - base
        elif self.method == "live":
            self.tracker.__exit__(*exc)
            self.peak = self.tracker.peak
        elif self.method == "tracker":
            self.tracker.__exit__(*exc)
            self._quiet.__exit__(*exc)
            peak = self.tracker.get_tracker_snapshot("peak")
            self.peak = max((v.get("Total", 0) for v in peak.values()), default=0)
