"""Launch choices of the FP8 projections (`kernels.fp8`), swept on one model's shapes: the W8A16 decode tile
(`KernelConfig.fp8_decode_tile`) and the CUDA-core GEMV's (`fp8_gemv_tile`) at one row, and the prefill tiles of
W8A8 and W8A16 at 2048 rows, each timed as `bench_kernels` times projections (a CUDA graph cycling through
weights larger than L2). `--decode-rows 64` sweeps the decode tile at that many rows instead (a batch-64 step)
beside cuBLAS's block-scaled FP8 GEMM, the bf16 weight on cuBLAS, and the FP8 bytes' time at `--bandwidth`.

    python -m deltaserve.tools.lab.fp8_sweep [--size 27b] [--top 3] [--decode-rows 64] [--fields F1,F2]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

import torch

from deltaserve.kernels import fp8
from deltaserve.kernels.config import DEFAULT, Tile
from deltaserve.model.config import ModelConfig
from deltaserve.model.synthetic import text_config
from deltaserve.model.weights import quantise_fp8
from deltaserve.tools.bench_kernels import graph_time_per_call, projection_shapes

DECODE_TILES = [(bn, per_sm, w, st) for bn, per_sm, w, st in
                itertools.product((32, 64, 128), (4, 8), (4, 8), (3, 4))]
GEMV_TILES = [Tile(*t) for t in ((4, 1024, 2, 2), (8, 1024, 4, 2), (8, 1024, 8, 2), (16, 1024, 8, 2),
                                 (8, 2048, 8, 2), (16, 512, 4, 2), (8, 512, 4, 2), (8, 512, 2, 3), (4, 4096, 4, 1),
                                 (2, 4096, 2, 1), (8, 1024, 4, 3), (32, 256, 4, 3), (8, 2048, 4, 2),
                                 (4, 2048, 4, 2), (16, 1024, 4, 2), (8, 4096, 8, 1), (16, 2048, 8, 1))]
FIELDS = ("fp8_decode_tile", "fp8_gemv_tile", "fp8_w8a8_tile", "fp8_w8a16_tile")  # what a sweep may cover
PREFILL_TILES = [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4),
                 (128, 256, 8, 3), (64, 256, 4, 3), (128, 64, 4, 4)]


def sweep(size: str, top: int, decode_rows: int = 0, bandwidth: float = 3.35e12,
          fields: tuple[str, ...] = FIELDS) -> None:
    cfg, dev = ModelConfig.from_dict(text_config(size, 248320)), torch.device("cuda")
    for name, (n, k) in projection_shapes(cfg).items():
        if name == "lm_head" and not {"fp8_decode_tile", "fp8_gemv_tile"} & set(fields):
            continue  # an FP8 lm_head is the drafts' (one-row and few-row decode)
        copies = max(2, -(-(512 << 20) // (n * k)))
        weights = [fp8.Fp8Weight(*quantise_fp8(torch.randn(n, k, device=dev) * 0.02, 128)) for _ in range(copies)]
        cases = ((1, "fp8_decode_tile", DECODE_TILES, fp8.linear_w8a16),
                 (1, "fp8_gemv_tile", GEMV_TILES, fp8.linear_w8a16),
                 (2048, "fp8_w8a8_tile", PREFILL_TILES, fp8.linear_w8a8),
                 (2048, "fp8_w8a16_tile", PREFILL_TILES, fp8.linear_w8a16))
        if decode_rows:
            cases = ((decode_rows, "fp8_decode_tile", DECODE_TILES, fp8.linear_w8a16),)
            x = torch.randn(decode_rows, k, device=dev, dtype=torch.bfloat16)
            cublas = graph_time_per_call(lambda w: lambda: fp8.linear_cublas(x, w), weights) \
                if fp8.cublas_takes(weights[0]) else float("nan")
            bf16 = [w.dequantise(torch.bfloat16) for w in weights[: max(2, copies // 2)]]
            dense = graph_time_per_call(lambda w: lambda: x @ w.t(), bf16)
            del bf16
            print(f"{name} {decode_rows} x {k} -> {n}: FP8 bytes {n * k / bandwidth * 1e6:.1f} us; cuBLAS FP8 "
                  f"{cublas * 1e6:.1f} us; cuBLAS bf16 {dense * 1e6:.1f} us", flush=True)
        for rows, field, tiles, fn in cases:
            if field not in fields or (name == "lm_head" and rows > fp8.DECODE_ROWS):
                continue
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            times = []
            for tile in tiles:
                kc = dataclasses.replace(DEFAULT, **{field: tile})
                try:
                    times.append((graph_time_per_call(lambda w: lambda: fn(x, w, kc), weights), tile))
                except Exception as exc:  # a tile that does not fit shared memory
                    print(f"  {name} {field} {tile}: {type(exc).__name__}", flush=True)
            times.sort()
            default = next((t for t, tile in times if tile == getattr(DEFAULT, field)), float("nan"))
            best = ", ".join(f"{tile} {t * 1e6:.1f} us" for t, tile in times[:top])
            print(f"{name} {rows} x {k} -> {n} {field}: FP8 bytes {n * k / bandwidth * 1e6:.1f} us; default "
                  f"{default * 1e6:.1f} us; best {best}", flush=True)
        del weights


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="27b")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--decode-rows", type=int, default=0, help="sweep the decode tile at this many rows only")
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s the FP8 bytes' time is taken at")
    parser.add_argument("--fields", default=",".join(FIELDS), help="the KernelConfig fields to sweep")
    ns = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8_sweep needs a CUDA device", file=sys.stderr)
        return 2
    sweep(ns.size, ns.top, ns.decode_rows, ns.bandwidth, tuple(ns.fields.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
