"""The ``torch.cuda`` API on the CPU: lets CUDA-only training code run on CPU (gloo) ranks.

Megatron-LM's training loop (``megatron.training``) asserts and uses CUDA throughout: it
sets the device, creates tensors with ``device="cuda"`` or ``torch.cuda.current_device()``,
moves batches with ``.cuda()``, times with CUDA events and seeds CUDA's generator. This
module answers all of that on the CPU, so that the code runs unmodified, one "GPU" per
local rank. ``install()`` changes the process for good (there is no undo: it is meant for
a process started to run such code, see ``runner.py``), and must run before that code is
imported:

* ``torch.cuda``: available, initialised, ``LOCAL_WORLD_SIZE`` devices, the current one
  ``LOCAL_RANK``; streams, events (timing with the host clock), synchronisation, memory
  statistics (zeros), device properties (an sm_80 "CPU") and NVTX do nothing harmful;
  ``torch.cuda.FloatTensor(...)`` and its siblings make CPU tensors;
* the RNG: CUDA's generator of every device *is* the CPU default generator, so
  ``torch.cuda.manual_seed``, ``get_rng_state`` / ``set_rng_state`` and
  ``default_generators`` (what Megatron's ``CudaRNGStatesTracker`` uses) drive the
  generator that CPU tensors draw from;
* device arguments: a ``TorchFunctionMode`` (entered for the calling thread) rewrites
  ``device="cuda"`` / ``"cuda:N"`` / ``N`` to the CPU in every torch call, and
  ``Tensor.to("cuda")``; ``Tensor.cuda()``, ``Tensor.pin_memory()`` and
  ``Tensor.record_stream()`` return the tensor (or nothing) in every thread;
  ``pin_memory=True`` becomes ``False``; ``Tensor.type()`` answers with the CUDA type name
  (``torch.cuda.FloatTensor``) that such code compares against;
* ``torch.compile``: off (``torch._dynamo.config.disable``). With CUDA "available",
  inductor would pick Triton's CUDA backend; the compiled functions run eagerly instead;
* a CUDA build of torch (the only one for Python 3.12) on a machine without a GPU:
  ``torch.accelerator.is_available()`` answers ``False``, as a CPU build does, so that
  e.g. the DataLoader does not pin memory through the missing driver.

Limits: tensors still say ``device.type == "cpu"`` and ``is_cuda`` is ``False``; nothing
of CUDA itself runs (no kernels, no NCCL: the ranks use gloo); threads other than the one
that called ``install()`` get the class-level patches but not the device rewriting.
"""

from __future__ import annotations

import contextlib
import os
import time
import types
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install", "installed"]

_CPU = torch.device("cpu")
_mode: TorchFunctionMode | None = None


def _is_cuda_device(device: Any) -> bool:
    """A device argument that names CUDA: ``"cuda"``, ``"cuda:N"``, a CUDA device, an int."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


class _Event:
    """``torch.cuda.Event``: ``elapsed_time`` is the host time between two ``record``s."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **_: Any) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end._t - self._t) * 1000.0  # ms, as CUDA's


class _Stream:
    """``torch.cuda.Stream``: everything runs in order on the host already."""

    cuda_stream = 0

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = _CPU
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event or _Event()
        event.record()
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


_DEFAULT_STREAM = _Stream()


def _device_properties(device: Any = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="CPU (cuda_on_cpu)",
        major=8,
        minor=0,
        total_memory=64 << 30,
        multi_processor_count=1,
        L2_cache_size=0,
        uuid="cpu",
        gcnArchName="",
    )


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, _types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])  # t.to("cuda", ...), t.to(N, ...)
        elif func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:  # t.type(): "torch.cuda.FloatTensor"
                name = func(*args)
                return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
            if len(args) > 1 and isinstance(args[1], str):  # t.type("torch.cuda.HalfTensor")
                args = (args[0], args[1].replace("torch.cuda.", "torch."), *args[2:])
        return func(*args, **kwargs)


def _typed_constructor(dtype: torch.dtype):
    """``torch.cuda.FloatTensor(...)`` and siblings: from data, or of a shape."""

    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        if args and isinstance(args[0], (list, tuple)):
            return torch.tensor(args[0], dtype=dtype)
        return torch.empty(*args, dtype=dtype)

    return make


def _returning_self(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _returning_none(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    return None


def installed() -> bool:
    """Whether ``install()`` ran in this process."""
    return _mode is not None


def install() -> None:
    """Make ``torch.cuda`` answer on the CPU for the rest of the process (module docstring).

    Idempotent. Call it before importing the CUDA-only code, in the thread that runs it."""
    global _mode
    if _mode is not None:
        return
    cuda = torch.cuda
    gen = torch.default_generator
    n_devices = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    def seed(value: int) -> None:
        gen.manual_seed(int(value))

    api: dict[str, Any] = {
        # availability and devices
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_lazy_init": lambda: None,
        "_lazy_call": lambda callable_, **_: callable_(),
        "device_count": lambda: n_devices,
        "set_device": lambda device: None,
        "current_device": lambda: local_rank,
        "device": lambda device=None: contextlib.nullcontext(),
        "get_device_properties": _device_properties,
        "get_device_capability": lambda device=None: (8, 0),
        "get_device_name": lambda device=None: "CPU (cuda_on_cpu)",
        "is_bf16_supported": lambda including_emulation=True: True,
        "is_current_stream_capturing": lambda: False,
        # streams, events, synchronisation
        "synchronize": lambda device=None: None,
        "Event": _Event,
        "Stream": _Stream,
        "ExternalStream": _Stream,
        "current_stream": lambda device=None: _DEFAULT_STREAM,
        "default_stream": lambda device=None: _DEFAULT_STREAM,
        "set_stream": lambda stream: None,
        "stream": lambda stream=None: contextlib.nullcontext(),
        # memory
        "empty_cache": lambda: None,
        "ipc_collect": lambda: None,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "reset_max_memory_allocated": lambda device=None: None,
        "memory_stats": lambda device=None: {},
        "mem_get_info": lambda device=None: (64 << 30, 64 << 30),
        # the RNG: CUDA's generator is the CPU default generator
        "manual_seed": seed,
        "manual_seed_all": seed,
        "seed": lambda: gen.seed(),
        "seed_all": lambda: gen.seed(),
        "initial_seed": lambda: gen.initial_seed(),
        "get_rng_state": lambda device="cuda": gen.get_state(),
        "set_rng_state": lambda new_state, device="cuda": gen.set_state(new_state),
        "get_rng_state_all": lambda: [gen.get_state()] * n_devices,
        "set_rng_state_all": lambda states: gen.set_state(states[0]),
        "default_generators": (gen,) * n_devices,
        "nvtx": types.SimpleNamespace(
            range_push=lambda *a, **k: 0,
            range_pop=lambda *a, **k: 0,
            mark=lambda *a, **k: None,
            range=lambda *a, **k: contextlib.nullcontext(),
        ),
    }
    for name, value in api.items():
        setattr(cuda, name, value)
    for name in (
        "manual_seed",
        "manual_seed_all",
        "seed",
        "initial_seed",
        "get_rng_state",
        "set_rng_state",
        "get_rng_state_all",
        "set_rng_state_all",
    ):
        setattr(cuda.random, name, api[name])
    for name in (
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "max_memory_reserved",
        "memory_stats",
        "empty_cache",
        "mem_get_info",
        "reset_peak_memory_stats",
    ):
        setattr(cuda.memory, name, api[name])
    for name, dtype in (
        ("FloatTensor", torch.float32),
        ("DoubleTensor", torch.float64),
        ("HalfTensor", torch.float16),
        ("BFloat16Tensor", torch.bfloat16),
        ("LongTensor", torch.int64),
        ("IntTensor", torch.int32),
        ("ByteTensor", torch.uint8),
        ("BoolTensor", torch.bool),
    ):
        setattr(cuda, name, _typed_constructor(dtype))
    # in every thread, inside the mode or not
    torch.Tensor.cuda = _returning_self
    torch.Tensor.pin_memory = _returning_self
    torch.Tensor.record_stream = _returning_none
    if hasattr(torch, "accelerator"):  # a CUDA build of torch without a GPU
        torch.accelerator.is_available = lambda *a, **k: False
    import torch._dynamo as dynamo

    dynamo.config.disable = True
    _mode = _CudaToCpu()
    _mode.__enter__()
