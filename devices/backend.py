"""What a device backend provides: one module per backend (devices/cpu.py, devices/cuda.py), behind these protocols.

A backend checks the devices a replica asks for, makes the collective its ranks share, and opens one
`RankBackend` per rank: the rank's device, its op set, its all-reduce, its memory and, where the device has
them, its captured forwards (graphs). The replica drives every backend the same way and never asks which one it has.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

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
class ForwardOutputs(NamedTuple):
    """What one forward of a step gives its draws (a graph keeps them, and each replay overwrites them)."""

    row_logits: torch.Tensor | None  # [rows, V]: each row's (first) position
    chunk_logits: torch.Tensor | None = None  # [R, V]: each chunk's last token (then a padded step's padding)
    draft_logits: torch.Tensor | None = None  # [rows, k, V]: a speculative row's k positions after its first
    drafts: torch.Tensor | None = None  # [rows, k]: the drafts those positions verify
    prompt_hidden: torch.Tensor | None = None  # eager steps that score prompts: each chunk token's final hidden state


GraphProgram = Callable[[], ForwardOutputs]  # one forward over a shape's fixed inputs


@dataclass(frozen=True, order=True)
class StepShape:
    """What a captured forward is keyed by: `rows` rows of the fixed decode inputs, `tokens_per_row` tokens each
    (1: decode; k + 1: drafts and their verification), and prompt chunks padded to `prompt_tokens` in the fixed
    prompt inputs (0: none). Written rows, rows x tokens_per_row, then + prompt_tokens: "8", "8x5", "256", "8+256"."""

    rows: int = 0
    tokens_per_row: int = 1
    prompt_tokens: int = 0

    def __str__(self) -> str:
        parts = [f"{self.rows}x{self.tokens_per_row}" if self.tokens_per_row > 1 else str(self.rows)] if self.rows \
            else []
        return "+".join(parts + ([str(self.prompt_tokens)] if self.prompt_tokens else []))

    @property
    def kind(self) -> str:
        """For logs: decode, speculative, prefill or mixed."""
        if self.rows and self.prompt_tokens:
            return "mixed"
        if self.prompt_tokens:
            return "prefill"
        return "speculative" if self.tokens_per_row > 1 else "decode"


class Collective(Protocol):
    def for_rank(self, rank: int) -> AllReduce: ...

    def abort(self) -> None:
        """Break every wait, so ranks blocked in a collective raise instead of hanging."""

    def close(self) -> None: ...


class StepGraphs(Protocol):
    """Captured forwards, one per shape."""

    stats: dict[StepShape, dict]  # shape -> {"nodes", "capture_s", "pool_bytes"}
    shapes: list[StepShape]  # the captured ones, ascending

    def captured(self, shape: StepShape) -> bool: ...

    def __call__(self, shape: StepShape):
        """Replay the shape's graph; its program's outputs (fixed tensors the next replay overwrites)."""

    def drop(self, shapes) -> None:
        """Replay these shapes no more (their steps run eagerly)."""

    def destroy(self) -> None: ...


class RankBackend(Protocol):
    rank: int
    device: torch.device
    ops: ForwardOps
    all_reduce: AllReduce | None
    graphs: StepGraphs | None

    def context(self) -> contextlib.AbstractContextManager: ...

    def free_memory(self, fraction: float) -> int:
        """Bytes this rank may still allocate for state."""

    def warm_up_collective(self) -> None: ...

    def check_fp8_ops(self) -> None:
        """Before a model on FP8 weights is built: the op set's FP8 choices checked against the device (an op the
        device lacks replaced by one it has, with a line in the log)."""

    def capture(self, programs: dict[StepShape, GraphProgram], progress: bool,
                prepare: Callable[[StepShape], None]) -> StepGraphs | None:
        """Capture each shape's program, `prepare(shape)` first (None: this device has no graphs)."""

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
