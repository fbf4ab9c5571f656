"""Peak memory of a region on one rank: CUDA allocator, PyTorch's MemTracker, or RSS."""

from __future__ import annotations

import re
import warnings

import torch

__all__ = ["PeakMemory"]


def _status_kib(field: str) -> int:
    m = re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read())
    return int(m.group(1)) if m else 0


class PeakMemory:
    """Peak memory of a region on one rank.

    ``"cuda"``: ``torch.cuda.max_memory_allocated`` above the allocation at entry.
    ``"tracker"`` (CPU): the peak of live tensor bytes during the region,
    from PyTorch's dispatch-level ``MemTracker``
    (``torch.distributed._tools.mem_tracker``, a private tool; tensors only,
    including those alive at entry, no allocator slack).
    ``"rss"`` (CPU): growth of the resident set (Linux ``VmHWM`` after a reset
    through ``/proc/self/clear_refs``, minus ``VmRSS`` at entry); pages kept
    by the allocator from earlier work are reused without growth, so it can
    read low (even 0) for whatever runs after a larger run.
    """

    METHODS = {
        "cuda": "torch.cuda.max_memory_allocated above the allocation at entry",
        "tracker": "peak live tensor bytes in one iteration (torch MemTracker, CPU)",
        "rss": "RSS high-water growth (VmHWM reset via /proc/self/clear_refs)",
        "none": "not measured",
    }

    def __init__(self, device: torch.device, method: str = "auto"):
        if method == "auto":
            method = "cuda" if device.type == "cuda" else "tracker"
        if method not in self.METHODS:
            raise ValueError(f"memory method {method!r} not known; allowed: {list(self.METHODS)}")
        self.device, self.method, self.peak = device, method, 0

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
        elif self.method == "tracker":
            from torch.distributed._tools.mem_tracker import MemTracker

            self.tracker = MemTracker()
            self._quiet = warnings.catch_warnings()
            self._quiet.__enter__()
            warnings.simplefilter("ignore")  # its module hooks warn about non-modules
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.method == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        elif self.method == "rss":
            self.peak = _status_kib("VmHWM") * 1024 - self.base
        elif self.method == "tracker":
            self.tracker.__exit__(*exc)
            self._quiet.__exit__(*exc)
            peak = self.tracker.get_tracker_snapshot("peak")
            self.peak = max((v.get("Total", 0) for v in peak.values()), default=0)
