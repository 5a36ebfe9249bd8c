"""Few-row projection candidates against the few-row kernel and cuBLAS, per 4B projection and row count: which
kernel reads the weights of a 2-16 row step (decode batches, a speculative verify) nearest the copy bandwidth.

    python -m deltaserve.tools.lab.few_rows_lab [--size 4b] [--rows 4,5,8]

Candidates (CUDA cores, no tensor cores; each with K split across programs as `launch.k_splits` does):
- fma: each K tile's products with all rows summed at once (a [BLOCK_N, ROWS, BLOCK_K] reduction a tile);
- fma_late: the products accumulated over K in registers, summed once at the end;
- whole: the one-row GEMV's whole rows (`gemv._gemv_whole_rows_kernel`) with a loop over the rows of x.
Timed as `bench_kernels` times projections: graph replays cycling through copies larger than L2."""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
import triton
import triton.language as tl

from deltaserve.kernels import gemv
from deltaserve.kernels.config import DEFAULT
from deltaserve.kernels.gemv import whole_row_spans
from deltaserve.kernels.launch import k_splits, multiprocessors, split_buffers, store_split
from deltaserve.model.config import ModelConfig
from deltaserve.tools.bench_kernels import ceilings, graph_time_per_call, projection_shapes
from deltaserve.model.synthetic import text_config


@triton.jit
def _fma_kernel(x_ptr, w_ptr, out_ptr, partial_ptr, counters_ptr, M, N, K, k_per_split, x_stride,
                ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LATE: tl.constexpr,
                SPLIT: tl.constexpr):
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.arange(0, ROWS)
    nmask, mmask = ns < N, ms < M
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    if LATE:
        acc3 = tl.zeros((BLOCK_N, ROWS, BLOCK_K), tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, ROWS), tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k_end
        w = tl.load(w_ptr + ns.to(tl.int64)[:, None] * K + ks[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        x = tl.load(x_ptr + ms[:, None] * x_stride + ks[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        if LATE:
            acc3 += w[:, None, :] * x[None, :, :]
        else:
            acc += tl.sum(w[:, None, :] * x[None, :, :], axis=2)
    if LATE:
        acc = tl.sum(acc3, axis=2)
    omask = nmask[:, None] & mmask[None, :]
    if SPLIT:
        store_split(acc, partial_ptr, out_ptr, counters_ptr, ms[None, :] * N + ns[:, None], omask, M * N,
                    tl.program_id(1), tl.num_programs(1), tl.program_id(0))
    else:
        tl.store(out_ptr + ms[None, :] * N + ns[:, None], acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _whole_rows_kernel(x_ptr, w_ptr, out_ptr, M, N, K, x_stride, ROWS: tl.constexpr, K1: tl.constexpr,
                       K2: tl.constexpr):
    ns = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    w_rows = w_ptr + ns.to(tl.int64)[:, None] * K
    c1 = tl.arange(0, K1)
    w1 = tl.load(w_rows + c1[None, :]).to(tl.float32)
    if K2 > 0:
        c2 = K1 + tl.arange(0, K2)
        w2 = tl.load(w_rows + c2[None, :]).to(tl.float32)
    for m in range(M):
        acc = tl.sum(w1 * tl.load(x_ptr + m * x_stride + c1).to(tl.float32)[None, :], axis=1)
        if K2 > 0:
            acc += tl.sum(w2 * tl.load(x_ptr + m * x_stride + c2).to(tl.float32)[None, :], axis=1)
        tl.store(out_ptr + m * N + ns, acc.to(out_ptr.dtype.element_ty))


def fma(x, weight, block_n, block_k, warps, stages, late=False, split_programs=4):
    M, K = x.shape
    N = weight.shape[0]
    rows = max(2, triton.next_power_of_2(M))
    splits, per_split = (1, K) if not split_programs else k_splits(
        triton.cdiv(N, block_n), K, block_k, split_programs * multiprocessors(x.device))
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(N, block_n)
    partial, counters = split_buffers(out, splits, tiles)
    _fma_kernel[(tiles, splits)](x, weight, out, partial, counters, M, N, K, per_split, x.stride(0), ROWS=rows,
                                 BLOCK_N=block_n, BLOCK_K=block_k, LATE=late, SPLIT=splits > 1, num_warps=warps,
                                 num_stages=stages)
    return out


def whole(x, weight, rows, warps):
    M, K = x.shape
    N = weight.shape[0]
    k1, k2 = whole_row_spans(K)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _whole_rows_kernel[(N // rows,)](x, weight, out, M, N, K, x.stride(0), ROWS=rows, K1=k1, K2=k2, num_warps=warps,
                                     num_stages=1)
    return out


FMA_CONFIGS = [(16, 64, 4, 3), (32, 64, 4, 3), (16, 128, 4, 3), (8, 256, 4, 3), (32, 32, 4, 4), (64, 64, 8, 3)]
FMA_LATE_CONFIGS = [(4, 128, 4, 3), (8, 64, 4, 3), (8, 128, 8, 3), (16, 64, 8, 3)]
WHOLE_CONFIGS = [(2, 4), (4, 4), (4, 8), (8, 8)]


def candidates(x, n, k):
    """(name, make_call(w)) of every candidate configuration for x [M, k] against an [n, k] weight."""
    out = [("cuBLAS", lambda w: lambda: x @ w.t()),
           ("few_rows (default)", lambda w: lambda: gemv.few_rows(x, w, cfg=replace(DEFAULT, few_rows=16)))]
    for split in (4, 0):
        for c in FMA_CONFIGS:
            out.append((f"fma {c} split {split}", lambda w, c=c, s=split: lambda: fma(x, w, *c, split_programs=s)))
        for c in FMA_LATE_CONFIGS:
            out.append((f"fma_late {c} split {split}",
                        lambda w, c=c, s=split: lambda: fma(x, w, *c, late=True, split_programs=s)))
    if whole_row_spans(k):
        for rows, warps in WHOLE_CONFIGS:
            if n % rows == 0:
                out.append((f"whole ({rows}, {warps})", lambda w, r=rows, wp=warps: lambda: whole(x, w, r, wp)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4b")
    parser.add_argument("--rows", default="4,5,8")
    args = parser.parse_args(argv)
    dev, bf = torch.device("cuda"), torch.bfloat16
    cfg = ModelConfig.from_dict(text_config(args.size, 248320))
    bw, _ = ceilings(dev)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| projection | rows | best | us | % of copy | cuBLAS us | default few_rows us | "
          "best fma / fma_late / whole |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for name, (n, k) in projection_shapes(cfg).items():
        if name.startswith("lm_head"):
            continue
        copies = max(2, -(-(512 << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=bf) * 0.02 for _ in range(copies)]
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=bf)
            want = x.float() @ weights[0].float().t()
            times = {}
            for label, make in candidates(x, n, k):
                try:
                    got = make(weights[0])()
                    if (got.float() - want).abs().max().item() > 0.05 * want.abs().max().item():
                        print(f"  {label} at {m} rows: WRONG")
                        continue
                    times[label] = graph_time_per_call(make, weights)
                except Exception as e:  # out of resources, a layout Triton cannot build: skip the configuration
                    print(f"  {label} at {m} rows: {type(e).__name__}")
            nbytes = (n * k + 2 * m * (n + k)) * 2
            best = min(times, key=times.get)

            def best_of(prefix):
                got = {lab: t for lab, t in times.items() if lab.startswith(prefix + " ")}
                return f"{min(got.values()) * 1e6:.1f} ({min(got, key=got.get)})" if got else "-"
            print(f"| {name} {n}x{k} | {m} | {best} | {times[best] * 1e6:.1f} | {nbytes / times[best] / bw:.0%} | "
                  f"{times['cuBLAS'] * 1e6:.1f} | {times.get('few_rows (default)', float('nan')) * 1e6:.1f} | "
                  f"{best_of('fma')} / {best_of('fma_late')} / {best_of('whole')} |", flush=True)
        del weights
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
