"""The CUDA device backend: a stream per rank made with cuda-python, raw CUDA-graph decode, NCCL collectives.

Graph capture uses the runtime API directly (cudaStreamBeginCapture in thread-local mode, EndCapture,
Instantiate, Launch): other ranks' threads keep allocating and launching while one captures. Torch allocations
made during a capture go to a private memory pool, so no later tensor is handed memory a graph still uses.
Every Triton kernel is compiled and cuBLAS warmed on the capturing thread and stream before its capture.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable

import torch
from cuda.bindings import runtime as cudart

log = logging.getLogger(__name__)


class CudaError(RuntimeError):
    pass


def check(result, call: str):
    """Raise CudaError naming the call for a failed cuda-python call; return its outputs otherwise."""
    err, *outputs = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        name = cudart.cudaGetErrorName(err)[1]
        text = cudart.cudaGetErrorString(err)[1]
        raise CudaError(f"{call} failed: {name.decode() if isinstance(name, bytes) else name}: "
                        f"{text.decode() if isinstance(text, bytes) else text}")
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


# ---------------------------------------------------------------------------------------------------------------------
# Collectives


class NcclCollective:
    """One NCCL communicator per rank of this process (ncclCommInitAll), driven through nccl4py."""

    def __init__(self, world_size: int) -> None:
        from nccl import core as nccl

        self._nccl = nccl
        self.world_size = world_size
        self.comms = nccl.Communicator.init_all(list(range(world_size)))
        log.info("NCCL: %d communicator(s) created", world_size)

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        comm, nccl = self.comms[rank], self._nccl

        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            comm.allreduce(tensor, tensor, nccl.SUM, stream=torch.cuda.current_stream().cuda_stream)
            return tensor

        return all_reduce

    def warm_up(self, rank: int, device: torch.device) -> None:
        """A first collective before any capture (NCCL sets up its channels lazily)."""
        probe = torch.ones(1024, device=device)
        self.for_rank(rank)(probe)
        torch.cuda.current_stream().synchronize()
        if probe[0].item() != self.world_size:
            raise CudaError(f"NCCL warm-up all-reduce gave {probe[0].item()}, expected {self.world_size}")

    def abort(self) -> None:
        for comm in self.comms:
            with contextlib.suppress(Exception):
                comm.abort()
        self.comms = []

    def close(self) -> None:
        for comm in self.comms:
            comm.destroy()
        self.comms = []


def make_collective(tp: int, use_nccl: bool) -> NcclCollective | None:
    return NcclCollective(tp) if use_nccl else None


# ---------------------------------------------------------------------------------------------------------------------
# One rank


class CudaRankBackend:
    def __init__(self, rank: int, collective: NcclCollective | None) -> None:
        from deltaserve.kernels import triton_ops

        self.rank, self.ops, self.collective = rank, triton_ops, collective
        self.device = torch.device("cuda", rank)
        torch.cuda.set_device(self.device)
        self._raw_stream = check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking),
                                 "cudaStreamCreateWithFlags")
        self.stream = torch.cuda.ExternalStream(int(self._raw_stream), device=self.device)
        self.all_reduce = collective.for_rank(rank) if collective is not None else None
        self.graphs: DecodeGraphs | None = None

    @contextlib.contextmanager
    def context(self):
        torch.cuda.set_device(self.device)  # the current device is per thread
        with torch.cuda.stream(self.stream):
            yield

    def free_memory(self, fraction: float) -> int:
        """Bytes this rank may still allocate: the driver's free memory, once torch has returned its unused cache,
        less the share of the card kept back."""
        self.stream.synchronize()
        gc.collect()  # tensors of an engine closed earlier may wait in reference cycles
        torch.cuda.empty_cache()  # torch's cached blocks are fragments: the pools we allocate next need whole ones
        free, total = torch.cuda.mem_get_info(self.device)
        return max(0, int(free - (1.0 - fraction) * total))

    def warm_up_collective(self) -> None:
        if self.collective is not None:
            self.collective.warm_up(self.rank, self.device)

    def capture_decode_graphs(self, model, runtime, buckets: list[int], progress: bool) -> "DecodeGraphs":
        self.graphs = DecodeGraphs(self, model, runtime, buckets, progress)
        return self.graphs

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.destroy()  # graphs before the stream, the pool and the communicator
            self.graphs = None
        self.stream.synchronize()
        check(cudart.cudaStreamDestroy(self._raw_stream), "cudaStreamDestroy")

    def release_memory(self) -> None:
        """Hand cached blocks back to the driver once the rank's tensors are dropped (the runtime and its
        graphs refer to each other, so a collection runs first)."""
        gc.collect()
        torch.cuda.empty_cache()


class DecodeGraphs:
    """A captured decode step per bucket; `runner(bucket, batch)` replays it and returns its logits."""

    def __init__(self, backend: CudaRankBackend, model, runtime, buckets: list[int], progress: bool) -> None:
        from tqdm import tqdm

        self.backend, self.model, self.runtime = backend, model, runtime
        self.stream = backend._raw_stream
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph, exec, logits)
        self.eager: set[int] = set()
        self.stats: dict[int, dict] = {}
        for bucket in tqdm(sorted(buckets, reverse=True), desc=f"capturing decode graphs (rank {backend.rank})",
                           disable=not progress, leave=False):
            self._capture(bucket)
        if self.eager:
            log.warning("rank %d: CUDA graphs were requested but buckets %s run eagerly (capture refused)",
                        backend.rank, sorted(self.eager))

    def _warm(self, batch) -> None:
        # Compiles every Triton kernel and initialises cuBLAS for these shapes on this thread and stream.
        for _ in range(2):
            self.model.decode(self.runtime.state, batch)
        self.backend.stream.synchronize()

    def _capture(self, bucket: int) -> None:
        device = self.backend.device.index
        self.runtime.inputs.fill([], [], bucket)  # all rows inert padding: they touch only the trash slot/page
        batch = self.runtime.inputs.batch(bucket)
        self._warm(batch)
        started = time.perf_counter()
        before = torch.cuda.memory_reserved(self.backend.device)
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, self.pool)
        graph = None
        try:
            check(cudart.cudaStreamBeginCapture(
                self.stream, cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture")
            try:
                logits = self.model.decode(self.runtime.state, batch)
            finally:
                graph = check(cudart.cudaStreamEndCapture(self.stream), "cudaStreamEndCapture")
        except Exception as exc:
            log.error("rank %d: capture of bucket %d failed (%s); it will run eagerly", self.backend.rank, bucket, exc)
            self.eager.add(bucket)
            if graph is not None:
                cudart.cudaGraphDestroy(graph)
            return
        finally:
            torch._C._cuda_endAllocateToPool(device, self.pool)
        graph_exec = check(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        check(cudart.cudaGraphUpload(graph_exec, self.stream), "cudaGraphUpload")
        self.backend.stream.synchronize()
        _, nodes = check(cudart.cudaGraphGetNodes(graph, 0), "cudaGraphGetNodes")
        self.graphs[bucket] = (graph, graph_exec, logits)
        self.stats[bucket] = {
            "nodes": nodes, "capture_s": time.perf_counter() - started,
            "pool_bytes": torch.cuda.memory_reserved(self.backend.device) - before,
        }

    def __call__(self, bucket: int, batch) -> torch.Tensor:
        entry = self.graphs.get(bucket)
        if entry is None:
            return self.model.decode(self.runtime.state, batch)
        check(cudart.cudaGraphLaunch(entry[1], self.stream), "cudaGraphLaunch")
        return entry[2]

    def dot(self, bucket: int, path: str) -> None:
        check(cudart.cudaGraphDebugDotPrint(self.graphs[bucket][0], path.encode(), 0), "cudaGraphDebugDotPrint")

    def destroy(self) -> None:
        self.backend.stream.synchronize()
        for graph, graph_exec, _ in self.graphs.values():
            check(cudart.cudaGraphExecDestroy(graph_exec), "cudaGraphExecDestroy")
            check(cudart.cudaGraphDestroy(graph), "cudaGraphDestroy")
        self.graphs.clear()
        torch._C._cuda_releasePool(self.backend.device.index, self.pool)
