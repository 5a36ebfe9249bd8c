"""Upper bound of one decode-step lead: fetch a projection's weights into L2 from a parallel branch of the graph
while the memory-light kernels before it run (a 4B GDN layer's conv, recurrence and gated norm, about 8 µs with
little HBM traffic), so that the projection then reads L2 instead of HBM.

    python -m deltaserve.tools.probe_prefetch_branch

The projection is the 4B GDN out_proj GEMV (4096 -> 2560, 21 MB bf16). The small kernels are stand-ins: a
dependent FMA chain, one program per SM, three in a row (5.2 or 8.4 µs together, run N4). Every iteration of the
timed graph uses another copy of the weights (32 copies, far more than L2), as a decode step does. Prints µs an
iteration for the GEMV alone (and over one copy, resident in L2: what a perfect prefetch could give), the small
kernels alone, both in sequence, the prefetch kernel alone, and both with the prefetch on a side branch, for two
prefetch forms: one `prefetch.global.L2` a 128-byte line, and `cp.async.bulk.prefetch.L2` (sm90's bulk form: one
instruction a span of bytes).
"""

from __future__ import annotations

import logging
import sys

import torch
import triton
import triton.language as tl

from deltaserve.kernels import triton_ops

COPIES = 32  # weight copies cycled through: together far larger than L2
N, K = 2560, 4096  # 4B out_proj
LINE = tl.constexpr(128)  # bytes an L2 line
LANES = tl.constexpr(128)  # prefetch requests a program issues at once


@triton.jit
def _spin_kernel(x_ptr, n):
    """Memory-light busy work: a dependent FMA chain of n steps."""
    acc = tl.load(x_ptr + tl.program_id(0))
    for _ in range(n):
        acc = acc * 1.0000001 + 1e-7
    tl.store(x_ptr + tl.program_id(0), acc)


@triton.jit
def _prefetch_lines_kernel(w_ptr, n_bytes, LINES_PER_LANE: tl.constexpr):
    """Each lane asks L2 for LINES_PER_LANE lines, one instruction a line."""
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    for j in range(LINES_PER_LANE):
        off = tl.minimum((lane * LINES_PER_LANE + j) * LINE, n_bytes - LINE).to(tl.int64)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [w_ptr.to(tl.pointer_type(tl.int8)) + off],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_bulk_kernel(w_ptr, n_bytes, span):
    """Each lane asks L2 for one span of bytes with a single bulk prefetch (span a multiple of 16)."""
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    start = lane.to(tl.int64) * span
    size = tl.maximum(tl.minimum(n_bytes - start, span), 0).to(tl.int32)
    tl.inline_asm_elementwise("{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; }"
                              " // $0", "=r,l,r", [w_ptr.to(tl.pointer_type(tl.int8)) + start, size],
                              dtype=tl.int32, is_pure=False, pack=1)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        logging.error("probe_prefetch_branch needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    weights = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    sms = triton_ops.multiprocessors(dev)
    scratch = torch.zeros(sms, device=dev)
    n_bytes = N * K * 2
    side = torch.cuda.Stream()

    def small(spin):
        for _ in range(3):
            _spin_kernel[(sms,)](scratch, spin)

    def prefetch(w, form, programs):
        if form == "lines":
            per_lane = triton.cdiv(n_bytes // LINE.value, programs * LANES.value)
            _prefetch_lines_kernel[(programs,)](w, n_bytes, LINES_PER_LANE=per_lane)
        else:
            span = triton.cdiv(triton.cdiv(n_bytes, programs * LANES.value), 16) * 16
            _prefetch_bulk_kernel[(programs,)](w, n_bytes, span)

    def with_branch(w, spin, form, programs):
        fork = torch.cuda.Event()
        fork.record()
        side.wait_event(fork)
        with torch.cuda.stream(side):
            prefetch(w, form, programs)
        small(spin)
        join = torch.cuda.Event()
        join.record(side)
        torch.cuda.current_stream().wait_event(join)
        triton_ops.gemv(x, w)

    def per_iteration_us(fn, copies=weights) -> float:
        for w in copies:  # compile and warm up outside the capture
            fn(w)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for w in copies:
                fn(w)
        torch.cuda.current_stream().wait_stream(stream)
        return triton.testing.do_bench(graph.replay) * 1e3 / len(copies)

    gemv_us = per_iteration_us(lambda w: triton_ops.gemv(x, w))
    print(f"GEMV {N}x{K} alone: {gemv_us:.1f} us ({n_bytes / gemv_us / 1e6:.2f} TB/s)")
    hot_us = per_iteration_us(lambda w: triton_ops.gemv(x, w), [weights[0]] * COPIES)
    print(f"GEMV {N}x{K} alone, its weights resident in L2 (one copy each iteration): {hot_us:.1f} us")
    for spin in (200, 400):
        small_us = per_iteration_us(lambda w: small(spin))
        seq_us = per_iteration_us(lambda w: (small(spin), triton_ops.gemv(x, w)))
        print(f"spin {spin}: small kernels {small_us:.1f} us, then the GEMV {seq_us:.1f} us")
        for form in ("lines", "bulk"):
            for programs in (16, 64, sms):
                alone = per_iteration_us(lambda w: prefetch(w, form, programs))
                branch = per_iteration_us(lambda w: with_branch(w, spin, form, programs))
                print(f"  {form} prefetch, {programs} programs: alone {alone:.1f} us; on a branch beside the small "
                      f"kernels, then the GEMV {branch:.1f} us ({branch - seq_us:+.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
