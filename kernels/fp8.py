"""Block-scaled FP8 weights kept in FP8 (`Fp8Weight`) and the projection that reads them: the torch reference, then
the Triton kernel (W8A16: each FP8 tile widened to the activations' dtype in registers, its block's scale applied to
the partial sums), one kernel for every row count. A decode step reads half the bytes of a bf16 weight.

The format (Qwen's FP8 checkpoints, vLLM's "fp8" loader): values [N, K] float8_e4m3fn and scale [ceil(N / B),
ceil(K / B)] float32 (`weight_scale_inv`), the real weight being each B x B tile of values times its entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .config import DEFAULT, KernelConfig
from .launch import _dot_bf16, multiprocessors


@dataclass
class Fp8Weight:
    values: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [ceil(N / block), ceil(K / block)] float32
    block: int = 128

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.values.numel() + self.scale.numel() * 4

    def to(self, device) -> "Fp8Weight":
        return Fp8Weight(self.values.to(device).contiguous(), self.scale.to(device, torch.float32).contiguous(),
                         self.block)

    def dequantise(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.values.shape
        b = self.block
        full = self.scale.float().repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
        return (self.values.float() * full).to(dtype)

    @staticmethod
    def cat(parts: list["Fp8Weight"]) -> "Fp8Weight | None":
        """The parts stacked along N (same K and block), or None where a part other than the last does not end
        on a block boundary (its last scale row would cover the next part's first rows too)."""
        block = parts[0].block
        if any(p.block != block or p.shape[1] != parts[0].shape[1] for p in parts) or \
                any(p.shape[0] % block for p in parts[:-1]):
            return None
        return Fp8Weight(torch.cat([p.values for p in parts]), torch.cat([p.scale for p in parts]), block)


def linear_reference(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x [T, K] @ the dequantised weight^T, in fp32, rounded to x's dtype."""
    return (x.float() @ weight.dequantise().t()).to(x.dtype)


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, x_row_stride, scale_cols,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QBLOCK: tl.constexpr,
                       FP32: tl.constexpr):
    """out[m, n] = sum over K tiles of (x tile . widened w tile) * scale[n // QBLOCK, k // QBLOCK]; a K tile lies
    inside one quantisation block (QBLOCK a multiple of BLOCK_K), so each column has one scale per tile."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_live, n_live = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    scale_row = (rn // QBLOCK).to(tl.int64) * scale_cols
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_live = k < K
        a = tl.load(x_ptr + rm.to(tl.int64)[:, None] * x_row_stride + k[None, :],
                    mask=m_live[:, None] & k_live[None, :], other=0.0)
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * K + k[None, :], mask=n_live[:, None] & k_live[None, :],
                    other=0.0).to(tl.float32)  # every e4m3 value is exact in bf16 and fp32
        s = tl.load(s_ptr + scale_row + k0 // QBLOCK, mask=n_live, other=0.0)
        if FP32:
            part = tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            part = _dot_bf16(a, tl.trans(w))
        acc += part * s[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_live[:, None] & n_live[None, :])


def linear(x: torch.Tensor, weight: Fp8Weight, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """x [T, K] @ weight^T on the Triton kernel, in x's dtype. Tiles: 16 rows up to 16 (decode), else 64; the
    widest column tile that still gives every SM two programs (a decode step reads each weight once, so its speed
    is how many loads are in flight), 16 at the narrowest."""
    M, K = x.shape
    N = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else 64
    programs = 2 * multiprocessors(x.device)
    block_n = next((b for b in (64, 32) if triton.cdiv(M, block_m) * triton.cdiv(N, b) >= programs), 16)
    block_k = min(128, weight.block)
    _fp8_linear_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        x, weight.values, weight.scale, out, M, N, K, x.stride(0), weight.scale.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, QBLOCK=weight.block,
        FP32=x.dtype == torch.float32, num_warps=4, num_stages=3)
    return out
