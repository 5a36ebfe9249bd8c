"""All-reduce between the ranks of one process.

`ThreadAllReduce` is the CPU backend's collective: the worker threads meet at a barrier, every rank sums the
buffers in rank order (so every rank gets bit-identical, deterministic results), and a second barrier keeps
any rank from overwriting its buffer while another still reads it. A rank that fails aborts the barrier, so
the others raise instead of waiting forever. The CUDA backend uses NCCL (devices/nccl.py) with the same call.
"""

from __future__ import annotations

import threading

import torch


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
