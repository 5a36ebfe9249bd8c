"""What a device backend provides: one module per backend (devices/cpu.py, devices/cuda.py), behind these protocols.

A backend checks the devices a replica asks for, makes the collective its ranks share, and opens one
`RankBackend` per rank: the rank's device, its op set, its all-reduce, its memory and, where the device has
them, its decode and prefill graphs. The replica drives every backend the same way and never asks which one it has.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Protocol

import torch

from deltaserve.kernels.config import KernelConfig
from deltaserve.kernels.ops import ForwardOps

def kernel_cache_dir() -> str:
    """Where compiled Triton kernels are kept across starts: $TRITON_CACHE_DIR when set, else deltaserve/triton
    under the user's cache folder ($XDG_CACHE_HOME, or ~/.cache)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return os.environ["TRITON_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deltaserve", "triton")


AllReduce = Callable[[torch.Tensor], torch.Tensor]
GraphProgram = Callable[[], torch.Tensor]  # one step over a bucket's fixed inputs (decode or prefill); its logits
# A graph's bucket: decode rows or prefill tokens, or (decode rows, prompt tokens) for a mixed step.
Bucket = int | tuple[int, int]


class Collective(Protocol):
    def for_rank(self, rank: int) -> AllReduce: ...

    def abort(self) -> None:
        """Break every wait, so ranks blocked in a collective raise instead of hanging."""

    def close(self) -> None: ...


class StepGraphs(Protocol):
    """Captured steps of one kind (decode rows, prefill tokens, or both in mixed steps), one per bucket."""

    stats: dict[Bucket, dict]  # bucket -> {"nodes", "capture_s", "pool_bytes"}
    buckets: list[Bucket]  # the captured ones, ascending

    def captured(self, bucket: Bucket) -> bool: ...

    def __call__(self, bucket: Bucket) -> torch.Tensor:
        """Replay the bucket's graph; its logits (a fixed tensor the next replay overwrites)."""

    def destroy(self) -> None: ...


class RankBackend(Protocol):
    rank: int
    device: torch.device
    ops: ForwardOps
    all_reduce: AllReduce | None
    graphs: StepGraphs | None
    speculative_graphs: StepGraphs | None
    prefill_graphs: StepGraphs | None
    mixed_graphs: StepGraphs | None

    def context(self) -> contextlib.AbstractContextManager: ...

    def free_memory(self, fraction: float) -> int:
        """Bytes this rank may still allocate for state."""

    def warm_up_collective(self) -> None: ...

    def check_fp8_ops(self) -> None:
        """Before a model on FP8 weights is built: the op set's FP8 choices checked against the device (an op the
        device lacks replaced by one it has, with a line in the log)."""

    def capture_decode(self, programs: dict[int, GraphProgram], progress: bool) -> StepGraphs | None:
        """Capture each bucket's decode program (None: this device has no graphs)."""

    def capture_speculative(self, programs: dict[int, GraphProgram], progress: bool) -> StepGraphs | None:
        """Capture each bucket's speculative decode program (None: this device has no graphs)."""

    def capture_prefill(self, programs: dict[int, GraphProgram], progress: bool,
                        prepare: Callable[[int], None]) -> StepGraphs | None:
        """Capture each bucket's padded prefill program, `prepare(bucket)` first (None: this device has
        no graphs)."""

    def capture_mixed(self, programs: dict[tuple[int, int], GraphProgram], progress: bool,
                      prepare: Callable[[tuple[int, int]], None]) -> StepGraphs | None:
        """Capture each (decode rows, prompt tokens) bucket's mixed-step program, `prepare(bucket)` first, in the
        prefill graphs' memory pool (None: this device has no graphs)."""

    def close(self) -> None: ...

    def release_memory(self) -> None: ...


class DeviceBackend(Protocol):
    name: str
    has_graphs: bool

    def check_devices(self, tp: int) -> None:
        """Raise ValueError naming the limit when `tp` ranks do not fit the visible devices."""

    def make_collective(self, tp: int, use_nccl: bool | None, timeout_s: float) -> Collective | None: ...

    def open_rank(self, rank: int, collective: Collective | None) -> RankBackend: ...


def default_device() -> str:
    """What device="auto" means: "cuda" when a CUDA device is visible, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_backend(device: str, *, cpu_memory_bytes: int, kernel_config: KernelConfig) -> DeviceBackend:
    """The backend of `device` ("cpu" or "cuda"); the CUDA module is imported only when asked for."""
    if device == "cuda":
        from .cuda import CudaBackend

        return CudaBackend(kernel_config)
    if device == "cpu":
        from .cpu import CpuBackend

        return CpuBackend(cpu_memory_bytes)
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
