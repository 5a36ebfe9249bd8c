"""Would the prefill MLP gain from one GEMM whose epilogue applies silu(gate) * up? Today a prefill's MLP input runs
cuBLAS's [gate | up] GEMM (writing both halves in bf16), then `_silu_mul_kernel` reads them back and writes the
product: on an H100 the 4B's 8k-token prefill spends 4.9 ms of its 122 ms in that pass, at the copy bandwidth. A
Triton GEMM that keeps a gate tile and its up tile in registers and stores only the product skips the pass and half
the GEMM's writes, if it comes close enough to cuBLAS's rate on the GEMM itself. It did not (H100, gpu-2026-12-07-fcb3039): the best
tile took 1.10-1.11x the engine's time (610 against cuBLAS's 704 TFLOP/s), and 125.5 against 120.05 ms in the 8k
prefill (`docs/benchmarks/log/gpu-2026-12-07-fcb3039.md`).

    python -m deltaserve.tools.lab.swiglu_gemm_lab [--size 4b] [--tokens 2048,8192] [--check]

Per prompt length: cuBLAS + silu_mul (what the engine runs), the fused kernel (pointer loads, then TMA descriptors)
at each tile of SWIGLU_TILES, and its largest difference from the reference (fp32 silu of the bf16 GEMM, as the
engine rounds). `--check` runs the correctness check alone on small shapes (also on the CPU under
TRITON_INTERPRET=1)."""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
import triton.testing

from deltaserve.kernels.gemv import linear_reference
from deltaserve.kernels.norm import silu_mul_reference

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): BLOCK_N columns of gate and as many of up, so the output tile of the
# GEMM underneath is BLOCK_M x 2 BLOCK_N.
SWIGLU_TILES = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4),
                (128, 64, 64, 8, 4), (256, 64, 64, 8, 3)]


@triton.jit
def _grouped_tile(M, inner, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program: programs walk GROUP_M row tiles per column tile, so the weight
    tiles they share stay in L2."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(inner, BLOCK_N)
    group_first = pid // (GROUP_M * tiles_n) * GROUP_M
    group_size = tl.minimum(tiles_m - group_first, GROUP_M)
    return group_first + pid % group_size, pid % (GROUP_M * tiles_n) // group_size


@triton.jit
def _swiglu_gemm_kernel(x_ptr, w_ptr, out_ptr, M, inner, K, x_row_stride, w_row_stride, out_row_stride,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        PRECISION: tl.constexpr):
    """out[m, n] = silu(x[m] . w[n]) * (x[m] . w[inner + n]) for w = [gate | up] rows."""
    pid_m, pid_n = _grouped_tile(M, inner, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_live, col_live = rows < M, cols < inner
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride + ks[None, :]
    gate_ptrs = w_ptr + cols.to(tl.int64)[None, :] * w_row_stride + ks[:, None]
    up_ptrs = gate_ptrs + inner * w_row_stride
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_live = k0 + ks < K
        x = tl.load(x_ptrs + k0, mask=row_live[:, None] & k_live[None, :], other=0.0)
        w_mask = k_live[:, None] & col_live[None, :]
        gate = tl.dot(x, tl.load(gate_ptrs + k0, mask=w_mask, other=0.0), gate, input_precision=PRECISION)
        up = tl.dot(x, tl.load(up_ptrs + k0, mask=w_mask, other=0.0), up, input_precision=PRECISION)
    # The engine's unfused path rounds the GEMM to bf16 before the silu: round alike, so the two agree to the bit
    # where the fp32 sums do.
    gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_row_stride + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_live[:, None] & col_live[None, :])


@triton.jit
def _swiglu_gemm_tma_kernel(x_desc, w_desc, out_desc, M, inner, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    """`_swiglu_gemm_kernel` with its tiles moved by the tensor memory accelerator (host-made descriptors): no
    address arithmetic or masks in the loop, out-of-range rows and columns read as zero and are not stored."""
    pid_m, pid_n = _grouped_tile(M, inner, BLOCK_M, BLOCK_N, GROUP_M)
    row0, col0 = pid_m * BLOCK_M, pid_n * BLOCK_N
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = x_desc.load([row0, k0])
        gate = tl.dot(x, w_desc.load([col0, k0]).T, gate, input_precision=PRECISION)
        up = tl.dot(x, w_desc.load([inner + col0, k0]).T, up, input_precision=PRECISION)
    gate = gate.to(out_desc.dtype).to(tl.float32)
    up = up.to(out_desc.dtype).to(tl.float32)
    out_desc.store([row0, col0], (gate / (1.0 + tl.exp(-gate)) * up).to(out_desc.dtype))


def swiglu_gemm_tma(x: torch.Tensor, gate_up: torch.Tensor, tile=SWIGLU_TILES[0]) -> torch.Tensor:
    """`swiglu_gemm` on the TMA kernel. The up half's tiles start at row `inner`: BLOCK_N must divide it, or a
    gate tile would read up rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    inner = gate_up.shape[0] // 2
    block_m, block_n, block_k, warps, stages = tile
    if inner % block_n:
        raise ValueError(f"BLOCK_N {block_n} must divide the {inner} gate rows")
    out = torch.empty(M, inner, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(inner, block_n),)
    _swiglu_gemm_tma_kernel[grid](
        TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(gate_up, [block_n, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, block_n]), M, inner, K, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=8, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages)
    return out


def swiglu_gemm(x: torch.Tensor, gate_up: torch.Tensor, tile=SWIGLU_TILES[0]) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for gate_up = [gate | up] ([2I, K]); x [M, K]."""
    M, K = x.shape
    inner = gate_up.shape[0] // 2
    block_m, block_n, block_k, warps, stages = tile
    out = torch.empty(M, inner, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(inner, block_n),)
    _swiglu_gemm_kernel[grid](x, gate_up, out, M, inner, K, x.stride(0), gate_up.stride(0), out.stride(0),
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                              PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
                              num_stages=stages)
    return out


def reference(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return silu_mul_reference(linear_reference(x, gate_up))


def check(device: str) -> float:
    """The fused kernel against the reference on ragged small shapes; its largest difference relative to the
    output's largest magnitude."""
    worst = 0.0
    gen = torch.Generator().manual_seed(0)
    for M, inner, K in ((37, 48, 80), (130, 64, 64), (5, 32, 96)):
        x = torch.randn(M, K, generator=gen).to(device)
        w = (torch.randn(2 * inner, K, generator=gen) / K**0.5).to(device)
        want = reference(x, w)
        for kernel in (swiglu_gemm, swiglu_gemm_tma):
            got = kernel(x, w, (32, 16, 32, 4, 2))
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    return worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4b")
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--check", action="store_true", help="only the correctness check, on small shapes")
    ns = parser.parse_args(argv)
    if ns.check:
        worst = check("cuda" if torch.cuda.is_available() else "cpu")
        print(f"fused against the reference, small shapes: largest difference {worst:.2e} of the largest output")
        return 0 if worst < 1e-4 else 1
    if not torch.cuda.is_available():
        print("swiglu_gemm_lab needs a CUDA device (or --check under TRITON_INTERPRET=1)")
        return 2
    from deltaserve.kernels import gemv, norm
    from deltaserve.model.synthetic import SIZES

    H, inner = SIZES[ns.size]["hidden_size"], SIZES[ns.size]["intermediate_size"]
    w = torch.randn(2 * inner, H, device="cuda", dtype=torch.bfloat16) / H**0.5
    for M in (int(t) for t in ns.tokens.split(",")):
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        flops = 2 * M * H * 2 * inner
        engine = triton.testing.do_bench(lambda: norm.silu_mul(gemv.linear(x, w))) * 1e-3
        gemm = triton.testing.do_bench(lambda: gemv.linear(x, w)) * 1e-3
        print(f"{ns.size} M={M} [{2 * inner}, {H}]: cuBLAS + silu_mul {engine * 1e6:.0f} us (the GEMM alone "
              f"{gemm * 1e6:.0f} us, {flops / gemm / 1e12:.0f} TFLOP/s)")
        want = norm.silu_mul(gemv.linear(x, w)).float()
        for kernel, tile in [(k, t) for k in (swiglu_gemm, swiglu_gemm_tma) for t in SWIGLU_TILES]:
            name = "fused tma" if kernel is swiglu_gemm_tma else "fused"
            try:
                t = triton.testing.do_bench(lambda: kernel(x, w, tile)) * 1e-3
                diff = (kernel(x, w, tile).float() - want).abs().max().item()
                print(f"  {name} {tile}: {t * 1e6:.0f} us ({flops / t / 1e12:.0f} TFLOP/s) = {t / engine:.2f}x the "
                      f"engine's; largest difference {diff:.3g} (outputs up to {want.abs().max().item():.3g})")
            except Exception as exc:  # a tile that does not fit this GPU's shared memory
                print(f"  {name} {tile}: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
