"""The CUDA device backend: a stream per rank made with cuda-python, the Triton ops, raw CUDA graphs of decode
steps (one-token and speculative) and of prefill steps, NCCL collectives.

Graph capture uses the runtime API directly (cudaStreamBeginCapture in thread-local mode, EndCapture,
Instantiate, Launch): other ranks' threads keep allocating and launching while one captures. Torch allocations
made during a capture go to a private memory pool, so no later tensor is handed memory a graph still uses.
Every Triton kernel is compiled and cuBLAS warmed on the capturing thread and stream before its capture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import threading
import time
from collections.abc import Callable

import torch
from cuda.bindings import runtime as cudart

from deltaserve.kernels.config import KernelConfig
from deltaserve.progress import progress as show_progress

from .backend import GraphProgram, StepShape, kernel_cache_dir

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


class CudaBackend:
    name, has_graphs = "cuda", True

    def __init__(self, kernel_config: KernelConfig) -> None:
        self.kernel_config = kernel_config
        # Before the first compile: Triton reads it then. A second start loads every kernel from here.
        os.environ["TRITON_CACHE_DIR"] = kernel_cache_dir()
        log.info("Triton kernel cache: %s", os.environ["TRITON_CACHE_DIR"])

    def check_devices(self, tp: int) -> None:
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is visible; use device='cpu'")
        if tp > torch.cuda.device_count():
            raise ValueError(f"tp={tp} needs {tp} GPUs; {torch.cuda.device_count()} visible")

    def make_collective(self, tp: int, use_nccl: bool | None, timeout_s: float) -> NcclCollective | None:
        """NCCL when there is more than one rank, or when asked for at tp = 1 (to measure its cost)."""
        return NcclCollective(tp) if (tp > 1 if use_nccl is None else use_nccl) else None

    def open_rank(self, rank: int, collective: NcclCollective | None) -> "CudaRankBackend":
        return CudaRankBackend(rank, collective, self.kernel_config)


# ---------------------------------------------------------------------------------------------------------------------
# One rank


class CudaRankBackend:
    # Open backends in this process: torch keeps a cuBLAS workspace per (handle, stream) until told to drop them
    # all, and a rank's stream is new each engine, so the last backend to close drops them.
    _open = 0
    _open_lock = threading.Lock()

    def __init__(self, rank: int, collective: NcclCollective | None, kernel_config: KernelConfig) -> None:
        from deltaserve.kernels.ops import triton_ops

        self.rank, self.ops, self.collective = rank, triton_ops(kernel_config), collective
        self.device = torch.device("cuda", rank)
        torch.cuda.set_device(self.device)
        self._raw_stream = check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking),
                                 "cudaStreamCreateWithFlags")
        self.stream = torch.cuda.ExternalStream(int(self._raw_stream), device=self.device)
        self._last_to_close = False
        with CudaRankBackend._open_lock:
            CudaRankBackend._open += 1
        self.all_reduce = collective.for_rank(rank) if collective is not None else None
        self.graphs: CudaGraphs | None = None

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
        allocated, reserved = torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        # Where the rest of the card went: torch's cache left after empty_cache sits in part-used segments (not
        # counted free), so a large figure means the load fragmented memory the KV pages then lack.
        log.info("rank %d: %.1f GiB of %.1f free after the weights; torch holds %.1f GiB allocated and %.1f GiB cached "
                 "beyond that; %.1f GiB kept back (memory_fraction %.2f)", self.rank, free / 2**30, total / 2**30,
                 allocated / 2**30, (reserved - allocated) / 2**30, (1.0 - fraction) * total / 2**30, fraction)
        return max(0, int(free - (1.0 - fraction) * total))

    def warm_up_collective(self) -> None:
        if self.collective is not None:
            self.collective.warm_up(self.rank, self.device)

    def check_fp8_ops(self) -> None:
        from deltaserve.kernels import fp8
        from deltaserve.kernels.ops import triton_ops

        config = self.ops.config
        if config.fp8_prefill == "cublas" and not fp8.cublas_block_scaled_works(self.device):
            log.warning("rank %d: no block-scaled FP8 GEMM in this cuBLAS or GPU (it needs sm90 and CUDA 12.9+); "
                        "FP8 prefill runs the Triton W8A8 kernel", self.rank)
            self.ops = triton_ops(dataclasses.replace(config, fp8_prefill="w8a8"))

    def capture(self, programs: dict[StepShape, GraphProgram], progress: bool,
                prepare: Callable[[StepShape], None]) -> "CudaGraphs":
        self.graphs = CudaGraphs(self, programs, progress, prepare)
        return self.graphs

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.destroy()  # graphs before the stream, the pools and the communicator
        self.graphs = None
        self.stream.synchronize()
        check(cudart.cudaStreamDestroy(self._raw_stream), "cudaStreamDestroy")
        with CudaRankBackend._open_lock:
            CudaRankBackend._open -= 1
            self._last_to_close = CudaRankBackend._open == 0

    def release_memory(self) -> None:
        """Hand cached blocks back to the driver once the rank's tensors are dropped. A workspace kept alive pins
        the whole segment it was cut from (a freed weight's, say), so the last backend to close drops them first."""
        gc.collect()
        if self._last_to_close and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
            torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


class CudaGraphs:
    """A captured forward per shape. Each is captured from a program (a function of the shape's fixed inputs and
    the state) and keeps only its executable graph and its outputs; `graphs(shape)` replays one. Graphs of one
    memory pool may replay in any order, never at once (each keeps its outputs; what else they allocate is
    scratch): one-token steps share a pool, speculative steps another, and every step with prompt chunks a third
    (a mixed step replaces a prefill step, never runs beside one, and its activations are the prefill's plus a
    decode bucket's rows)."""

    def __init__(self, backend: CudaRankBackend, programs: dict[StepShape, GraphProgram], progress: bool,
                 prepare: Callable[[StepShape], None]) -> None:
        """`prepare(shape)` sets the fixed inputs up for that shape before its program first runs (outside the
        capture)."""
        self.rank, self.device = backend.rank, backend.device
        self.torch_stream, self.stream = backend.stream, backend._raw_stream
        self.pools: dict[str, object] = {}
        # Each capture takes a use of its pool (torch counts them); its memory goes back once every use is released.
        self.pool_uses: dict[str, int] = {}
        self.graphs: dict[StepShape, tuple] = {}  # shape -> (graph, exec, outputs)
        self.eager: set[StepShape] = set()
        self.stats: dict[StepShape, dict] = {}
        # By pool, the largest first (later captures reuse its blocks); one-token, speculative, prefill, mixed.
        order = sorted(programs, key=lambda s: (s.prompt_tokens > 0, s.rows > 0 and s.prompt_tokens > 0,
                                                s.tokens_per_row, -s.rows, -s.prompt_tokens))
        for shape in show_progress(order, unit="graph", disable=not progress,
                                   desc=f"capturing graphs (rank {self.rank})"):
            prepare(shape)
            self._capture(shape, programs[shape])
        self.shapes = sorted(self.graphs)  # the captured ones, ascending (read by every step with prompt chunks)
        if self.eager:
            log.warning("rank %d: CUDA graphs were requested but shapes %s run eagerly (capture refused)",
                        self.rank, ", ".join(map(str, sorted(self.eager))))


    @staticmethod
    def _pool_of(shape: StepShape) -> str:
        return "prompts" if shape.prompt_tokens else "rows" if shape.tokens_per_row == 1 else "speculative"

    def _capture(self, shape: StepShape, program: GraphProgram) -> None:
        # Two eager runs first compile every Triton kernel and initialise cuBLAS for these shapes on this thread
        # and stream.
        for _ in range(2):
            program()
        self.torch_stream.synchronize()
        device = self.device.index
        started = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        name = self._pool_of(shape)
        pool = self.pools.setdefault(name, torch.cuda.graph_pool_handle())
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)
        self.pool_uses[name] = self.pool_uses.get(name, 0) + 1
        graph = None
        try:
            check(cudart.cudaStreamBeginCapture(
                self.stream, cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture")
            try:
                outputs = program()
            finally:
                graph = check(cudart.cudaStreamEndCapture(self.stream), "cudaStreamEndCapture")
        except Exception as exc:
            log.error("rank %d: capture of the %s step %s failed (%s); it will run eagerly", self.rank, shape.kind,
                      shape, exc)
            self.eager.add(shape)
            if graph is not None:
                cudart.cudaGraphDestroy(graph)
            return
        finally:
            torch._C._cuda_endAllocateToPool(device, pool)
        graph_exec = check(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
        check(cudart.cudaGraphUpload(graph_exec, self.stream), "cudaGraphUpload")
        self.torch_stream.synchronize()
        _, nodes = check(cudart.cudaGraphGetNodes(graph, 0), "cudaGraphGetNodes")
        self.graphs[shape] = (graph, graph_exec, outputs)
        self.stats[shape] = {
            "nodes": nodes, "capture_s": time.perf_counter() - started,
            "pool_bytes": torch.cuda.memory_reserved(self.device) - before,
        }

    def captured(self, shape: StepShape) -> bool:
        return shape in self.graphs

    def __call__(self, shape: StepShape):
        _, graph_exec, outputs = self.graphs[shape]
        check(cudart.cudaGraphLaunch(graph_exec, self.stream), "cudaGraphLaunch")
        return outputs

    def drop(self, shapes) -> None:
        """Replay these shapes no more (their steps run eagerly)."""
        for shape in shapes:
            graph, graph_exec, _ = self.graphs.pop(shape)
            self.torch_stream.synchronize()
            check(cudart.cudaGraphExecDestroy(graph_exec), "cudaGraphExecDestroy")
            check(cudart.cudaGraphDestroy(graph), "cudaGraphDestroy")
            self.stats.pop(shape)
        self.shapes = sorted(self.graphs)

    def dot(self, shape: StepShape, path: str) -> None:
        check(cudart.cudaGraphDebugDotPrint(self.graphs[shape][0], path.encode(), 0), "cudaGraphDebugDotPrint")

    def destroy(self) -> None:
        self.torch_stream.synchronize()
        for graph, graph_exec, _ in self.graphs.values():
            check(cudart.cudaGraphExecDestroy(graph_exec), "cudaGraphExecDestroy")
            check(cudart.cudaGraphDestroy(graph), "cudaGraphDestroy")
        self.graphs.clear()
        self.shapes = []
        for name, uses in self.pool_uses.items():  # a pool's memory goes back with the last of its graphs' releases
            for _ in range(uses):
                torch._C._cuda_releasePool(self.device.index, self.pools[name])
        self.pool_uses.clear()
