"""The CPU device backend: the torch reference ops, a configured memory budget, no graphs, and the threads'
in-process all-reduce.

`ThreadAllReduce`: the worker threads meet at a barrier, every rank sums the buffers in rank order (so every rank
gets bit-identical, deterministic results), and a second barrier keeps any rank from overwriting its buffer while
another still reads it. A rank that fails aborts the barrier, so the others raise instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from deltaserve.kernels.ops import reference_ops


class CollectiveError(RuntimeError):
    pass


class ThreadAllReduce:
    def __init__(self, world_size: int, timeout_s: float = 120.0) -> None:
        self.world_size = world_size
        self._buffers: list[torch.Tensor | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise CollectiveError("all-reduce aborted: another rank failed or timed out") from None

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place."""
        if self.world_size == 1:
            return tensor
        self._buffers[rank] = tensor
        self._wait()
        total = self._buffers[0].clone()
        for other in self._buffers[1:]:
            total += other
        self._wait()
        tensor.copy_(total)
        return tensor

    def for_rank(self, rank: int):
        return lambda tensor: self.all_reduce(rank, tensor)

    def abort(self) -> None:
        self._barrier.abort()

    def close(self) -> None:
        pass


class CpuRankBackend:
    def __init__(self, rank: int, collective: ThreadAllReduce, memory_bytes: int) -> None:
        self.rank, self.device, self.ops = rank, torch.device("cpu"), reference_ops()
        self.all_reduce = collective.for_rank(rank)
        self.memory_bytes = memory_bytes
        self.graphs = None

    def context(self):
        return contextlib.nullcontext()

    def free_memory(self, fraction: float) -> int:
        return self.memory_bytes  # the configured budget counts state only

    def warm_up_collective(self) -> None:
        pass

    def check_fp8_ops(self) -> None:
        pass  # the torch references run everywhere

    def capture(self, programs, progress: bool, prepare) -> None:
        return None

    def close(self) -> None:
        pass

    def release_memory(self) -> None:
        pass


class CpuBackend:
    name, has_graphs = "cpu", False

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes

    def check_devices(self, tp: int) -> None:
        pass  # any number of ranks share the host

    def make_collective(self, tp: int, use_nccl: bool | None, timeout_s: float) -> ThreadAllReduce:
        if use_nccl:
            raise ValueError("use_nccl needs device='cuda'; the CPU backend's ranks all-reduce in process")
        return ThreadAllReduce(tp, timeout_s=timeout_s)

    def open_rank(self, rank: int, collective: ThreadAllReduce) -> CpuRankBackend:
        return CpuRankBackend(rank, collective, self.memory_bytes)
