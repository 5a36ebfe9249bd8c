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
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, res_ptr, nw_ptr, sum_ptr, M, N, K, x_row_stride, scale_cols, eps,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QBLOCK: tl.constexpr,
                       FP32: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_NW: tl.constexpr):
    """out[m, n] = sum over K tiles of (x tile . widened w tile) * scale[n // QBLOCK, k // QBLOCK]; a K tile lies
    inside one quantisation block (QBLOCK a multiple of BLOCK_K), so each column has one scale per tile.
    With NORM the input is rms_norm(x + res) * (1 + nw) (zero-centred): the sum, in the input dtype as the
    reference adds, times (1 + nw) goes into the dots, its squares are summed on the way, and 1 / rms scales the
    result at the end; the column tile 0 programs write the new residual x + res (`sum_ptr`)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_live, n_live = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    squares = tl.zeros([BLOCK_M], tl.float32)
    scale_row = (rn // QBLOCK).to(tl.int64) * scale_cols
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_live = k < K
        at = rm.to(tl.int64)[:, None] * x_row_stride + k[None, :]
        xk_mask = m_live[:, None] & k_live[None, :]
        a = tl.load(x_ptr + at, mask=xk_mask, other=0.0)
        if NORM:
            if HAS_RES:
                r = tl.load(res_ptr + at, mask=xk_mask, other=0.0)
                a = (a.to(tl.float32) + r.to(tl.float32)).to(a.dtype)  # rounded as the reference's add
                if pid_n == 0:
                    tl.store(sum_ptr + rm.to(tl.int64)[:, None] * K + k[None, :], a, mask=xk_mask)
            af = a.to(tl.float32)
            squares += tl.sum(af * af, axis=1)
            if HAS_NW:
                af *= 1.0 + tl.load(nw_ptr + k, mask=k_live, other=0.0).to(tl.float32)[None, :]
            a = af.to(a.dtype)
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * K + k[None, :], mask=n_live[:, None] & k_live[None, :],
                    other=0.0).to(tl.float32)  # every e4m3 value is exact in bf16 and fp32
        s = tl.load(s_ptr + scale_row + k0 // QBLOCK, mask=n_live, other=0.0)
        if FP32:
            part = tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            part = _dot_bf16(a, tl.trans(w))
        acc += part * s[None, :]
    if NORM:
        acc *= tl.rsqrt(squares / K + eps)[:, None]
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
        x, weight.values, weight.scale, out, x, x, x, M, N, K, x.stride(0), weight.scale.shape[1], 0.0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, QBLOCK=weight.block,
        FP32=x.dtype == torch.float32, NORM=False, HAS_RES=False, HAS_NW=False, num_warps=4, num_stages=3)
    return out


FUSED_NORM_ROWS = 16  # up to this many rows (decode) the add-and-norm runs inside the projection


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
                        eps: float, weight: Fp8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's input add-and-norm (zero-centred; norm_weight None: no (1 + w)) and the FP8 projection that
    reads it, in one kernel for up to FUSED_NORM_ROWS rows: (projected, x + residual, or x without one). Each
    column tile's programs sum the rows' squares themselves, so no load waits for the norm."""
    M, K = x.shape
    N = weight.shape[0]
    x = x.contiguous()
    has_res = residual is not None
    summed = torch.empty_like(x) if has_res else x
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    programs = 2 * multiprocessors(x.device)
    block_n = next((b for b in (64, 32) if triton.cdiv(N, b) >= programs), 16)
    _fp8_linear_kernel[(triton.cdiv(M, 16), triton.cdiv(N, block_n))](
        x, weight.values, weight.scale, out, residual.contiguous() if has_res else x,
        norm_weight if norm_weight is not None else x, summed, M, N, K, K, weight.scale.shape[1], eps,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=min(128, weight.block), QBLOCK=weight.block,
        FP32=x.dtype == torch.float32, NORM=True, HAS_RES=has_res, HAS_NW=norm_weight is not None,
        num_warps=4, num_stages=3)
    return out, summed
