"""Triton kernels for the Qwen3.5 forward, with the signatures of `kernels.reference` (the forward swaps them).

Every kernel launches on the current torch stream with no host synchronisation and reads lengths, slots and page
tables from device tensors, so the decode ones can be captured in a CUDA graph.
CI runs these kernels under TRITON_INTERPRET=1 against the references on small shapes.
"""

from __future__ import annotations

import functools
import logging
import os
import typing

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import reference


log = logging.getLogger(__name__)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


# The interpreter's tl.dot on bf16 operands returns garbage (Triton 3.9), so there `_dot_bf16` multiplies the
# bf16-rounded operands in fp32: the same products (exact in fp32), summed in another order.
BF16_MMA = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _dot_bf16(a, b, acc=None):
    """acc + a @ b on operands rounded to bf16, accumulated in fp32."""
    a, b = a.to(tl.bfloat16), b.to(tl.bfloat16)
    if BF16_MMA:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


# ---------------------------------------------------------------------------------------------------------------------
# Programmatic dependent launch (sm90+). A decode step is some 230 short kernels; launched with PDL, a kernel's
# programs start on the SMs the previous kernel's tail leaves idle instead of after a launch gap.
# The rule that keeps this safe: before `wait_for_previous_kernel` a kernel reads only what no kernel writes (model
# weights, and the decode slots, which the host writes before the step) and writes nothing. Each kernel lets the
# next one launch only after its own wait, so at most two kernels overlap. The conv and the GDN decode read their
# row's slot before the wait, which takes one load off their chain of dependent loads (4B batch-1 step 8-11 µs
# faster, runs T1 and T2; batch 64 unchanged). Reading more before the wait (the layers' state, a projection two
# kernels back) slowed the 4B batch-1 step from 2.59 to 3.00 ms (run Q2, decode.md), and the attention's lengths
# and first pages slowed batch 64 by 42-45 µs (runs S4, S6, T1). The decode step's kernels take part (the
# norms and q/k norm + RoPE also run in prefill), and so do the sampler's passes (`kernels.triton_sampling`); off
# (PDL = False), on the CPU and before sm90 every kernel launches plainly.

PDL = True


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """Launch options for a kernel with a `PDL` constexpr (one that calls `wait_for_previous_kernel` first)."""
    return {"PDL": True, "launch_pdl": True} if PDL and _pdl_capable(device) else {}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible, then let the next
    kernel launch. A no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# ---------------------------------------------------------------------------------------------------------------------
# RMSNorm: zero-centred (1 + w), optionally fused with the residual add; the GDN gated norm.


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     HAS_RES: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Zero-centred: out = norm(x) * (1 + w); without HAS_W, norm(x) (the weight folded into the next projection)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + 1.0
    else:
        w = 1.0
    wait_for_previous_kernel(PDL)
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)  # in the model dtype, as HF does
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * n_cols + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x2 = x.contiguous().view(-1, x.shape[-1])
    out = torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, x2, x2 if weight is None else weight, out, out, x2.shape[1], eps,
                                     HAS_RES=False, HAS_W=weight is not None, BLOCK=_pow2(x2.shape[1]),
                                     **pdl_options(x.device))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float):
    if residual is None:
        return rms_norm(x, weight, eps), x
    x2, r2 = x.contiguous().view(-1, x.shape[-1]), residual.contiguous().view(-1, x.shape[-1])
    out, summed = torch.empty_like(x2), torch.empty_like(x2)
    _rms_norm_kernel[(x2.shape[0],)](x2, r2, x2 if weight is None else weight, out, summed, x2.shape[1], eps,
                                     HAS_RES=True, HAS_W=weight is not None, BLOCK=_pow2(x2.shape[1]),
                                     **pdl_options(x.device))
    return out.view(x.shape), summed.view(x.shape)


@triton.jit
def _gated_rms_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, n_cols, heads, z_row_stride, z_head_stride, eps,
                           BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)  # token * heads + head
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_previous_kernel(PDL)
    o = tl.load(o_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    z_base = z_ptr + (row // heads) * z_row_stride + (row % heads) * z_head_stride
    z = tl.load(z_base + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / n_cols + eps)
    normed = (o * inv).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference rounds
    y = (w * normed).to(out_ptr.dtype.element_ty).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """o [T, H, d] contiguous; z [T, H, d] may be a strided view (of the fused input projection)."""
    o2 = o.contiguous().view(-1, o.shape[-1])
    if z.stride(-1) != 1:
        z = z.contiguous()
    out = torch.empty_like(o2)
    _gated_rms_norm_kernel[(o2.shape[0],)](o2, z, weight, out, o2.shape[1], o.shape[1], z.stride(0), z.stride(1), eps,
                                           BLOCK=_pow2(o2.shape[1]), **pdl_options(o.device))
    return out.view(o.shape)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inner, x_row_stride, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    g = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_row_stride + inner + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inner + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    T, two_i = gate_up.shape
    inner = two_i // 2
    out = torch.empty(T, inner, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(T, triton.cdiv(inner, BLOCK))](gate_up, out, inner, gate_up.stride(0), BLOCK=BLOCK,
                                                     **pdl_options(gate_up.device))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# One-row projections (batch-1 decode). cuBLAS reaches about half the copy bandwidth on the small matrices at one
# row; GEMVs of our own reach 62-106% (docs/benchmarks/kernels.md: inside a CUDA graph over weights larger than L2,
# 4B/9B/27B shapes). Larger batches stay on cuBLAS. Two kernels:
# - whole rows: a program loads its few weight rows in full at once, as two power-of-two spans (K = K1 + K2:
#   4096, 9216 = 8192 + 1024, 2560 = 2048 + 512), and reduces once. All of a program's loads are in flight
#   together, and many short programs share the SMs. It takes the narrowing projections whose K splits so, and,
#   fused with the input norm below, the 4B widening ones: 4B batch-1 step 2.610 -> 2.530 ms (run R5, decode.md;
#   9B, whose narrowing projections it takes too, 4.160 -> 4.169 ms).
# - a loop over K tiles, BLOCK_N rows a program: every other K, and the widening projections of the plain GEMV
#   (lm_head at 104% of copy; 9B's, where whole rows moved the step by -33 to +30 us across runs R2-R3).

GEMV_ONE_ROW = True
GEMV_CONFIG = (2, 2048, 2, 2)  # (BLOCK_N, BLOCK_K, warps, stages)
GEMV_NARROW_WIDENING_CONFIG = (4, 512, 4, 2)  # a widening projection of an input narrower than GEMV_WIDE_K
GEMV_WIDE_K = 4096


class WholeRows(typing.NamedTuple):
    """The whole-rows GEMV's launch configuration."""
    rows: int  # weight rows a program (gate rows, with as many up rows, for silu(gate) * up)
    warps: int


GEMV_WHOLE_ROWS_ON = True  # off: the loop takes every one-row projection (tools.bench_decode --whole-rows off)
GEMV_WHOLE_ROWS = WholeRows(1, 4)


def whole_row_spans(k: int) -> tuple[int, int] | None:
    """K as a power of two and a smaller power of two or zero, the spans the whole-rows kernels load; None when K
    does not split so."""
    k1 = 1 << (k.bit_length() - 1)
    k2 = k - k1
    return (k1, k2) if k2 & (k2 - 1) == 0 else None


def _spans_for(config: WholeRows, n: int, k: int) -> tuple[int, int]:
    spans = whole_row_spans(k)
    if spans is None or n % config.rows or config.rows & (config.rows - 1):
        raise ValueError(f"{config} needs K ({k}) to be a power of two plus a smaller one or zero, and its rows to "
                         f"be a power of two that divides N ({n})")
    return spans


def _whole_rows_take(config: WholeRows, n: int, k: int) -> bool:
    """Whether the whole-rows kernels are on and fit an [n, k] weight in `config`."""
    return GEMV_WHOLE_ROWS_ON and n % config.rows == 0 and whole_row_spans(k) is not None


def gemv_config(n: int, k: int) -> tuple:
    """The one-row GEMV's launch configuration for an [n, k] weight: a `WholeRows`, or a loop tile (BLOCK_N,
    BLOCK_K, warps, stages)."""
    if n <= k and _whole_rows_take(GEMV_WHOLE_ROWS, n, k):
        return GEMV_WHOLE_ROWS
    return GEMV_NARROW_WIDENING_CONFIG if n > k and k < GEMV_WIDE_K else GEMV_CONFIG


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PDL: tl.constexpr = False):
    """out [N] = x @ w.t() for one row x. It waits first: loading a first weight tile before the wait, in a
    peeled iteration, broke the pipelining of two-tile rows (9B batch-1 step 4.32 -> 5.29 ms, decode.md)."""
    wait_for_previous_kernel(PDL)
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < N
    w_rows = w_ptr + ns.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)  # reduced once, at the end
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        wmask = nmask[:, None] if EVEN_K else nmask[:, None] & kmask[None, :]
        x = tl.load(x_ptr + ks, mask=kmask, other=0.0).to(tl.float32)[None, :]
        acc += tl.load(w_rows + ks[None, :], mask=wmask, other=0.0).to(tl.float32) * x
    tl.store(out_ptr + ns, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _gemv_whole_rows_kernel(x_ptr, w_ptr, out_ptr, K, ROWS: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                            PDL: tl.constexpr = False):
    """out [N] = x @ w.t() for one row x, ROWS whole weight rows a program (N a multiple of ROWS, K = K1 + K2).
    It waits first: loading the rows before the wait changed nothing (4B step 2.523 against 2.518 ms, run R2)."""
    wait_for_previous_kernel(PDL)
    ns = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    w_rows = w_ptr + ns.to(tl.int64)[:, None] * K
    c1 = tl.arange(0, K1)
    w1 = tl.load(w_rows + c1[None, :])
    if K2 > 0:
        c2 = K1 + tl.arange(0, K2)
        w2 = tl.load(w_rows + c2[None, :])
    acc = tl.sum(w1.to(tl.float32) * tl.load(x_ptr + c1).to(tl.float32)[None, :], axis=1)
    if K2 > 0:
        acc += tl.sum(w2.to(tl.float32) * tl.load(x_ptr + c2).to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + ns, acc.to(out_ptr.dtype.element_ty))


def gemv(x: torch.Tensor, weight: torch.Tensor, config=None) -> torch.Tensor:
    """x [1, K] @ weight [N, K].t(); config as `gemv_config` gives it."""
    K, N = x.shape[1], weight.shape[0]
    config = config or gemv_config(N, K)
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    if isinstance(config, WholeRows):
        k1, k2 = _spans_for(config, N, K)
        _gemv_whole_rows_kernel[(N // config.rows,)](x.contiguous(), weight, out, K, ROWS=config.rows, K1=k1, K2=k2,
                                                     num_warps=config.warps, num_stages=1, **pdl_options(x.device))
        return out
    block_n, block_k, warps, stages = config
    _gemv_kernel[(triton.cdiv(N, block_n),)](x.contiguous(), weight, out, N, K, BLOCK_N=block_n, BLOCK_K=block_k,
                                             EVEN_K=K % block_k == 0, num_warps=warps, num_stages=stages,
                                             **pdl_options(x.device))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if GEMV_ONE_ROW and x.shape[0] == 1:
        return gemv(x, weight)
    return x @ weight.t()


# A block's input add-and-norm fused into the one-row projection that reads it (and, for the MLP, silu(gate) * up
# into its epilogue). Each program sums x^2 over the row itself and scales its dot products by 1/rms at the end,
# so no weight load waits for the norm (normalising first, in the prologue, cost 5 us a projection). Every program
# reloads the input, the residual and the norm weight from L2, which on 4096-wide and wider inputs costs what the
# saved launches give back (9B step: 4.42 against 4.32 ms with the MLP's fused), so only inputs narrower than
# GEMV_WIDE_K are fused (4B step: 2.79 against 2.85 ms; kernels.md). Whole rows where K splits into two spans, the
# loop over K tiles otherwise.

GEMV_FUSED_NORM = True
# Two rows (two gate and two up rows with silu) in 4 warps gained on both kinds of H200 node the runs landed on
# (runs R2, R4, R5); 2 warps was best on one and no gain on the other (runs R2, R3).
NORM_GEMV_WHOLE_ROWS = WholeRows(2, 4)
NORM_GEMV_SILU_WHOLE_ROWS = WholeRows(2, 4)
NORM_GEMV_CONFIG = (4, 512, 4, 2)  # (BLOCK_N, BLOCK_K, warps, stages)
# BLOCK_N gate rows and as many up rows. (8, 256, 4, 3) beat (8, 512, 4, 2): 4B gate_up 26.9 against 27.5 us
# (run P1's sweep), 4B batch-1 step 2.613 against 2.629 ms (run P4).
NORM_GEMV_SILU_CONFIG = (8, 256, 4, 3)


def norm_gemv_config(n: int, k: int, silu_mul: bool) -> tuple:
    """As `gemv_config`, for the fused add-and-norm GEMV of n output rows (gate rows, with silu_mul)."""
    whole = NORM_GEMV_SILU_WHOLE_ROWS if silu_mul else NORM_GEMV_WHOLE_ROWS
    if _whole_rows_take(whole, n, k):
        return whole
    return NORM_GEMV_SILU_CONFIG if silu_mul else NORM_GEMV_CONFIG


@triton.jit
def _norm_gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, out_ptr, res_out_ptr, N, K, up_rows, eps,
                      HAS_RES: tl.constexpr, HAS_NW: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr = False):
    """out [N] = rms_norm(x + res) @ w.t() for one row; with SILU_MUL, silu(out) * (the same for w's rows
    up_rows on). Program 0 writes the new residual x + res. Without HAS_NW the norm's (1 + w) is folded into w.
    The input, residual and norm weight are loaded twice: once for the sum of squares and the residual store, and
    once in the weight tile's own layout, through row pointers that repeat (the repeats are L1 hits). Loaded once,
    the input had to change layout through shared memory, and that change's barriers held each iteration's weight
    loads back until the input had arrived. With EVEN (no partial tile) no load carries a mask, whose zeroed
    registers can let ptxas serialise a tile's loads. 4B batch-1 step 2.717 -> 2.624 ms (run P3, decode.md)."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    ns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < N
    w_rows = w_ptr + ns.to(tl.int64)[:, None] * K
    up_rows_ptr = w_rows + up_rows.to(tl.int64) * K
    repeat = tl.zeros((BLOCK_N, 1), tl.int32)
    x_rows, res_rows, nw_rows = x_ptr + repeat, res_ptr + repeat, nw_ptr + repeat
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)  # reduced once, at the end
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    sq = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        ks2 = ks[None, :]
        if EVEN:
            w = tl.load(w_rows + ks2)
            w_up = tl.load(up_rows_ptr + ks2) if SILU_MUL else w
            x2, x = tl.load(x_rows + ks2), tl.load(x_ptr + ks)
            nw2 = tl.load(nw_rows + ks2) if HAS_NW else x2
            if HAS_RES:  # the sum in the model dtype, as the reference does
                x2 += tl.load(res_rows + ks2)
                x += tl.load(res_ptr + ks)
        else:
            kmask, kmask2 = ks < K, ks2 < K
            wmask = nmask[:, None] & kmask2
            w = tl.load(w_rows + ks2, mask=wmask, other=0.0)
            w_up = tl.load(up_rows_ptr + ks2, mask=wmask, other=0.0) if SILU_MUL else w
            x2 = tl.load(x_rows + ks2, mask=kmask2, other=0.0)
            nw2 = tl.load(nw_rows + ks2, mask=kmask2, other=0.0) if HAS_NW else x2
            x = tl.load(x_ptr + ks, mask=kmask, other=0.0)
            if HAS_RES:
                x2 += tl.load(res_rows + ks2, mask=kmask2, other=0.0)
                x += tl.load(res_ptr + ks, mask=kmask, other=0.0)
        if HAS_RES:
            if pid == 0:
                tl.store(res_out_ptr + ks, x, mask=ks < K)
        xf = x.to(tl.float32)
        sq += xf * xf
        scaled = x2.to(tl.float32)
        if HAS_NW:
            scaled *= 1.0 + nw2.to(tl.float32)
        acc += w.to(tl.float32) * scaled
        if SILU_MUL:
            acc_up += w_up.to(tl.float32) * scaled
    inv = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
    y = (tl.sum(acc, axis=1) * inv).to(out_ptr.dtype.element_ty)
    if SILU_MUL:  # rounded to the model dtype first, as the unfused projection's output is
        g = y.to(tl.float32)
        u = (tl.sum(acc_up, axis=1) * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + ns, y, mask=nmask)


@triton.jit
def _norm_gemv_whole_rows_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, out_ptr, res_out_ptr, K, up_rows, eps,
                                 HAS_RES: tl.constexpr, HAS_NW: tl.constexpr, SILU_MUL: tl.constexpr,
                                 ROWS: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, PDL: tl.constexpr = False):
    """`_norm_gemv_kernel` on ROWS whole weight rows a program (and as many up rows), K = K1 + K2."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    ns = pid * ROWS + tl.arange(0, ROWS)
    w_rows = w_ptr + ns.to(tl.int64)[:, None] * K
    u_rows = w_rows + up_rows.to(tl.int64) * K
    c1 = tl.arange(0, K1)
    w1 = tl.load(w_rows + c1[None, :])
    u1 = tl.load(u_rows + c1[None, :]) if SILU_MUL else w1
    x1 = tl.load(x_ptr + c1)
    nw1 = tl.load(nw_ptr + c1) if HAS_NW else x1
    if HAS_RES:  # the sum in the model dtype, as the reference does
        x1 += tl.load(res_ptr + c1)
    if K2 > 0:
        c2 = K1 + tl.arange(0, K2)
        w2 = tl.load(w_rows + c2[None, :])
        u2 = tl.load(u_rows + c2[None, :]) if SILU_MUL else w2
        x2 = tl.load(x_ptr + c2)
        nw2 = tl.load(nw_ptr + c2) if HAS_NW else x2
        if HAS_RES:
            x2 += tl.load(res_ptr + c2)
    # The residual is stored after every load: a load cannot move past a store that may alias it, and compiled
    # offline, a store between the spans held the second span's input loads until the first span was reduced.
    if HAS_RES:
        if pid == 0:
            tl.store(res_out_ptr + c1, x1)
            if K2 > 0:
                tl.store(res_out_ptr + c2, x2)
    f1 = x1.to(tl.float32)
    sq = tl.sum(f1 * f1, axis=0)
    s1 = (f1 * (1.0 + nw1.to(tl.float32)))[None, :] if HAS_NW else f1[None, :]
    acc = tl.sum(w1.to(tl.float32) * s1, axis=1)
    acc_up = tl.sum(u1.to(tl.float32) * s1, axis=1) if SILU_MUL else acc
    if K2 > 0:
        f2 = x2.to(tl.float32)
        sq += tl.sum(f2 * f2, axis=0)
        s2 = (f2 * (1.0 + nw2.to(tl.float32)))[None, :] if HAS_NW else f2[None, :]
        acc += tl.sum(w2.to(tl.float32) * s2, axis=1)
        if SILU_MUL:
            acc_up += tl.sum(u2.to(tl.float32) * s2, axis=1)
    inv = 1.0 / tl.sqrt(sq / K + eps)
    y = (acc * inv).to(out_ptr.dtype.element_ty)
    if SILU_MUL:  # rounded to the model dtype first, as the unfused projection's output is
        g = y.to(tl.float32)
        u = (acc_up * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + ns, y)


def norm_gemv(x, residual, norm_weight, eps: float, weight, silu_mul_rows: int = 0, config=None):
    """One row: (rms_norm(x + residual) @ weight.t(), x + residual). With silu_mul_rows = I, weight is a fused
    [gate | up] of 2I rows and the first output is silu(gate) * up, [1, I]. norm_weight None: the norm's (1 + w)
    is folded into weight's columns. config as `norm_gemv_config` gives it."""
    K = x.shape[1]
    N = silu_mul_rows or weight.shape[0]
    config = config or norm_gemv_config(N, K, silu_mul_rows > 0)
    x = x.contiguous()
    has_res = residual is not None
    residual = residual.contiguous() if has_res else x
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x) if has_res else x
    has_nw = norm_weight is not None
    norm_weight = norm_weight if has_nw else x
    if isinstance(config, WholeRows):
        k1, k2 = _spans_for(config, N, K)
        _norm_gemv_whole_rows_kernel[(N // config.rows,)](
            x, residual, norm_weight, weight, out, summed, K, silu_mul_rows, eps, HAS_RES=has_res, HAS_NW=has_nw,
            SILU_MUL=silu_mul_rows > 0, ROWS=config.rows, K1=k1, K2=k2, num_warps=config.warps, num_stages=1,
            **pdl_options(x.device))
        return out, summed
    block_n, block_k, warps, stages = config
    _norm_gemv_kernel[(triton.cdiv(N, block_n),)](
        x, residual, norm_weight, weight, out, summed, N, K, silu_mul_rows, eps, HAS_RES=has_res, HAS_NW=has_nw,
        SILU_MUL=silu_mul_rows > 0, BLOCK_N=block_n, BLOCK_K=block_k, EVEN=K % block_k == 0 and N % block_n == 0,
        num_warps=warps, num_stages=stages, **pdl_options(x.device))
    return out, summed


def _fuses_norm(x: torch.Tensor) -> bool:
    return GEMV_FUSED_NORM and x.shape[0] == 1 and x.shape[1] < GEMV_WIDE_K


def add_rms_norm_linear(x, residual, norm_weight, eps: float, weight):
    if _fuses_norm(x):
        return norm_gemv(x, residual, norm_weight, eps, weight)
    normed, residual = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight), residual


def add_rms_norm_gate_up(x, residual, norm_weight, eps: float, gate_up):
    if _fuses_norm(x):
        return norm_gemv(x, residual, norm_weight, eps, gate_up, silu_mul_rows=gate_up.shape[0] // 2)
    normed, residual = add_rms_norm(x, residual, norm_weight, eps)
    return silu_mul(linear(normed, gate_up)), residual


# ---------------------------------------------------------------------------------------------------------------------
# Causal depthwise conv1d + SiLU, decode: conv state [S+1, K-1, C] read and written in place through slots.


@triton.jit
def _conv1d_decode_kernel(x_ptr, w_ptr, state_ptr, slot_ptr, out_ptr, C, x_row_stride, trash,
                          K: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    w_last = tl.load(w_ptr + cols * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + row)  # written by the host before the step: safe before the wait
    wait_for_previous_kernel(PDL)
    slot = tl.where(slot < 0, trash, slot).to(tl.int64)
    base = state_ptr + slot * (K - 1) * C
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    acc = x.to(tl.float32) * w_last
    for j in tl.static_range(K - 1):
        prev = tl.load(base + j * C + cols, mask=mask, other=0.0)
        acc += prev.to(tl.float32) * tl.load(w_ptr + cols * K + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(base + (j - 1) * C + cols, prev, mask=mask)  # shift the window left by one
    tl.store(base + (K - 2) * C + cols, x.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + row * C + cols, (acc / (1.0 + tl.exp(-acc))).to(out_ptr.dtype.element_ty), mask=mask)


def conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor):
    N, C = x.shape
    K = weight.shape[1]
    out = torch.empty_like(x)
    BLOCK_C = 256
    if x.stride(1) != 1:
        x = x.contiguous()
    _conv1d_decode_kernel[(N, triton.cdiv(C, BLOCK_C))](
        x, weight, conv_state, slots, out, C, x.stride(0), conv_state.shape[0] - 1, K=K, BLOCK_C=BLOCK_C,
        **pdl_options(x.device))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Causal depthwise conv1d + SiLU, prefill over packed requests. Kernel 1, parallel over (block of packed tokens,
# block of channels): each token finds its request in cu_seqlens and reads the K-1 inputs before it from the packed
# chunk or, near the request's start, from the slot's conv state. Kernel 2, after it (so no read sees a new state),
# writes each request's last K-1 inputs back to its slot.


@triton.jit
def _request_of(t, cu_ptr, R, BLOCK_R: tl.constexpr):
    """Index of the request holding each packed token t (cu_seqlens has R+1 entries)."""
    r = tl.arange(0, BLOCK_R)
    ends = tl.load(cu_ptr + 1 + r, mask=r < R, other=2**31 - 1)
    return tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), 1)


@triton.jit
def _conv1d_prefill_kernel(x_ptr, w_ptr, state_ptr, cu_ptr, slot_ptr, out_ptr, T, C, R, x_row_stride,
                           K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = t < T
    req = _request_of(t, cu_ptr, R, BLOCK_R)
    start = tl.load(cu_ptr + req, mask=live, other=0)
    slot = tl.load(slot_ptr + req, mask=live, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    cmask = cols < C
    for j in tl.static_range(K):  # input j steps back, weight column K-1-j
        src = t - j
        inside = src >= start
        m = live[:, None] & cmask[None, :]
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * x_row_stride + cols[None, :], mask=m & inside[:, None], other=0.0)
        row = K - 1 + src - start  # row of the conv state when the input predates the chunk
        sv = tl.load(state_ptr + (slot * (K - 1) + row)[:, None] * C + cols[None, :], mask=m & ~inside[:, None],
                     other=0.0).to(xv.dtype)
        w = tl.load(w_ptr + cols * K + (K - 1 - j), mask=cmask, other=0.0).to(tl.float32)
        acc += tl.where(inside[:, None], xv, sv).to(tl.float32) * w[None, :]
    tl.store(out_ptr + t[:, None] * C + cols[None, :], (acc / (1.0 + tl.exp(-acc))).to(out_ptr.dtype.element_ty),
             mask=live[:, None] & cmask[None, :])


@triton.jit
def _conv1d_state_kernel(x_ptr, state_ptr, cu_ptr, slot_ptr, C, x_row_stride,
                         K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start, stop = tl.load(cu_ptr + r), tl.load(cu_ptr + r + 1)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    m = tl.arange(0, BLOCK_K)  # new state row m is window row L + m: an input of the chunk, or an old state row
    src = stop - (K - 1) + m
    inside = src >= start
    ok = (m < K - 1)[:, None] & (cols < C)[None, :]
    xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * x_row_stride + cols[None, :], mask=ok & inside[:, None], other=0.0)
    old = tl.load(state_ptr + (slot * (K - 1) + (stop - start) + m)[:, None] * C + cols[None, :],
                  mask=ok & ~inside[:, None], other=0.0)
    new = tl.where(inside[:, None], xv.to(state_ptr.dtype.element_ty), old)
    tl.store(state_ptr + (slot * (K - 1) + m)[:, None] * C + cols[None, :], new, mask=ok)


def conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    T, C = x.shape
    K, R = weight.shape[1], slots.shape[0]
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    BLOCK_T, BLOCK_C = 32, 128
    _conv1d_prefill_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(C, BLOCK_C))](
        x, weight, conv_state, cu_seqlens, slots, out, T, C, R, x.stride(0),
        K=K, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, BLOCK_R=max(2, _pow2(R)))
    _conv1d_state_kernel[(R, triton.cdiv(C, BLOCK_C))](
        x, conv_state, cu_seqlens, slots, C, x.stride(0), K=K, BLOCK_K=max(2, _pow2(K - 1)), BLOCK_C=BLOCK_C)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet decode: one token per row; q/k l2-norm, gates, the delta-rule update and the read fused.
# Program (row, value head, block of dv): the state tile [dk, BLOCK_V] stays in registers for the whole step.


@triton.jit
def _gdn_decode_kernel(mixed_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr, out_ptr,
                       C, ab_row_stride, trash, HV, GROUP, scale,
                       DK: tl.constexpr, DV: tl.constexpr, KEY_DIM: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // GROUP
    ks = tl.arange(0, BLOCK_K)
    vs = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = ks < DK, vs < DV
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    decay_rate = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    slot = tl.load(slot_ptr + row)  # written by the host before the step: safe before the wait
    wait_for_previous_kernel(PDL)
    q = tl.load(mixed_ptr + row * C + hk * DK + ks, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(mixed_ptr + row * C + KEY_DIM + hk * DK + ks, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(mixed_ptr + row * C + 2 * KEY_DIM + h * DV + vs, mask=vmask, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    a = tl.load(a_ptr + row * ab_row_stride + h).to(tl.float32) + dt_bias
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    g = decay_rate * softplus
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + row * ab_row_stride + h).to(tl.float32)))
    slot = tl.where(slot < 0, trash, slot).to(tl.int64)
    sptr = state_ptr + ((slot * HV + h) * DK + ks[:, None]) * DV + vs[None, :]
    smask = kmask[:, None] & vmask[None, :]
    S = tl.load(sptr, mask=smask, other=0.0) * tl.exp(g)
    predicted = tl.sum(S * k[:, None], axis=0)
    u = (v - predicted) * beta
    S = S + k[:, None] * u[None, :]
    tl.store(sptr, S, mask=smask)
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(out_ptr + (row * HV + h) * DV + vs, o.to(out_ptr.dtype.element_ty), mask=vmask)


def gdn_decode(mixed, a, b, A_log, dt_bias, ssm_state, slots, num_k_heads: int, head_k_dim: int, head_v_dim: int,
               block_v: int = 64, num_warps: int = 4):
    N, C = mixed.shape
    HV = a.shape[1]
    out = torch.empty(N, HV, head_v_dim, dtype=mixed.dtype, device=mixed.device)
    BLOCK_V = min(block_v, _pow2(head_v_dim))
    grid = (N, HV, triton.cdiv(head_v_dim, BLOCK_V))
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        a, b = a.contiguous(), b.contiguous()
    _gdn_decode_kernel[grid](
        mixed.contiguous(), a, b, A_log, dt_bias, ssm_state, slots, out,
        C, a.stride(0), ssm_state.shape[0] - 1, HV, HV // num_k_heads, head_k_dim**-0.5,
        DK=head_k_dim, DV=head_v_dim, KEY_DIM=num_k_heads * head_k_dim,
        BLOCK_K=_pow2(head_k_dim), BLOCK_V=BLOCK_V, num_warps=num_warps, **pdl_options(mixed.device),
    )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# From the fused q/k/v projection: q_norm/k_norm, partial RoPE (NeoX rotate-half on the first rotary dims) and
# the paged K/V write, one program per (token, head).


@triton.jit
def _qk_norm_rope_cache_kernel(qkv_ptr, qn_ptr, kn_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, map_ptr, qo_ptr,
                               row_stride, NQ, NKV, eps, HALF: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                               PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    rot = d < 2 * HALF
    idx = tl.where(rot, d % HALF, 0)
    c = tl.load(cos_ptr + pos * HALF + idx, mask=rot, other=1.0)
    s = tl.load(sin_ptr + pos * HALF + idx, mask=rot, other=0.0)
    s = tl.where(d < HALF, -s, s)
    row = qkv_ptr + t * row_stride
    if head < NQ:
        src = row + head * 2 * D  # each q_proj head is [query | gate]
        w_ptr = qn_ptr
    else:
        src = row + NQ * 2 * D + (head - NQ) * D
        w_ptr = kn_ptr
    x = tl.load(src + d, mask=dmask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * inv * (1.0 + tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)))
    normed = normed.to(qo_ptr.dtype.element_ty).to(tl.float32)  # the norm's output is in the model dtype
    xp = tl.load(src + partner, mask=rot & dmask, other=0.0).to(tl.float32)
    normed_p = xp * inv * (1.0 + tl.load(w_ptr + partner, mask=rot & dmask, other=0.0).to(tl.float32))
    normed_p = normed_p.to(qo_ptr.dtype.element_ty).to(tl.float32)
    y = tl.where(rot, normed * c + normed_p * s, normed)
    if head < NQ:
        tl.store(qo_ptr + (t * NQ + head) * D + d, y.to(qo_ptr.dtype.element_ty), mask=dmask)
    else:
        kh = head - NQ
        dest = tl.load(map_ptr + t).to(tl.int64)
        tl.store(kc_ptr + (dest * NKV + kh) * D + d, y.to(kc_ptr.dtype.element_ty), mask=dmask)
        vv = tl.load(row + NQ * 2 * D + NKV * D + kh * D + d, mask=dmask, other=0.0)
        tl.store(vc_ptr + (dest * NKV + kh) * D + d, vv.to(vc_ptr.dtype.element_ty), mask=dmask)


def qk_norm_rope_cache(qkv, q_norm, k_norm, eps, positions, cos, sin, k_cache, v_cache, slot_mapping,
                       num_heads: int, num_kv_heads: int):
    T, D = qkv.shape[0], q_norm.shape[0]
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    out = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    _qk_norm_rope_cache_kernel[(T, num_heads + num_kv_heads)](
        qkv, q_norm, k_norm, positions, cos, sin, k_cache, v_cache, slot_mapping, out, qkv.stride(0),
        num_heads, num_kv_heads, eps, HALF=cos.shape[1], D=D, BLOCK_D=_pow2(D), **pdl_options(qkv.device))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Decode attention over paged KV, split-K (flash decoding), any GQA group; a second kernel merges the splits.
# Program (row, kv head, split): all query heads of the group at once, 64 cached tokens per iteration. Each row's
# actual length is shared out evenly over the splits when the kernel runs, so a graph captured with a fixed
# split count still spreads a short context over many programs; the count is chosen to fill the GPU.


@triton.jit
def _decode_attn_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, len_ptr, part_o_ptr, part_ml_ptr,
                        NH, NKV, WIDTH, scale,
                        GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, SPLITS: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(len_ptr + row)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask, dmask = g < GROUP, d < D
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + (row * NH + heads[:, None]) * D + d[None, :], mask=gmask[:, None] & dmask[None, :],
                other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    share = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
    start = split * share
    stop = tl.minimum(start + share, seq_len)
    for t0 in range(start, stop, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        tmask = tok < stop
        page = tl.load(table_ptr + row * WIDTH + tok // PAGE, mask=tmask, other=0).to(tl.int64)
        flat = page * PAGE + tok % PAGE
        kv_off = (flat[:, None] * NKV + kvh) * D + d[None, :]
        kvmask = tmask[:, None] & dmask[None, :]
        kt = tl.load(kc_ptr + kv_off, mask=kvmask, other=0.0)
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION).to(tl.float32) * scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        vt = tl.load(vc_ptr + kv_off, mask=kvmask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION).to(tl.float32)
        m = m_new
    base = (row * NH + heads) * SPLITS + split
    tl.store(part_o_ptr + base[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
    tl.store(part_ml_ptr + base * 2, m, mask=gmask)
    tl.store(part_ml_ptr + base * 2 + 1, l, mask=gmask)


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_ml_ptr, out_ptr, gate_ptr, NH, gate_row_stride, gate_head_stride,
                         D: tl.constexpr, SPLITS: tl.constexpr, HAS_GATE: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    rh = tl.program_id(0).to(tl.int64)  # row * NH + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask, dmask = s < SPLITS, d < D
    m = tl.load(part_ml_ptr + (rh * SPLITS + s) * 2, mask=smask, other=float("-inf"))
    l = tl.load(part_ml_ptr + (rh * SPLITS + s) * 2 + 1, mask=smask, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)
    o = tl.load(part_o_ptr + (rh * SPLITS + s[:, None]) * D + d[None, :], mask=smask[:, None] & dmask[None, :],
                other=0.0)
    total = tl.sum(o * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    if HAS_GATE:  # gated attention: o * sigmoid(gate)
        gate = tl.load(gate_ptr + (rh // NH) * gate_row_stride + (rh % NH) * gate_head_stride + d, mask=dmask,
                       other=0.0).to(tl.float32)
        total = total / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + rh * D + d, total.to(out_ptr.dtype.element_ty), mask=dmask)


DECODE_ATTN_BLOCK_N = 64  # cached tokens per iteration
MAX_DECODE_SPLITS = 64


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's SM count (4 on the CPU, where the interpreter runs the kernels), for sizing grids."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def decode_splits(rows: int, kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Splits per (row, kv head): enough programs for two per multiprocessor, no more than the longest
    possible context can use."""
    wanted = _pow2(triton.cdiv(2 * multiprocessors(device), rows * kv_heads))
    return max(1, min(wanted, MAX_DECODE_SPLITS, triton.cdiv(max_tokens, DECODE_ATTN_BLOCK_N)))


def decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale: float, gate=None, splits: int | None = None):
    N, NH, D = q.shape
    NKV, PAGE = k_cache.shape[2], k_cache.shape[1]
    group = NH // NKV
    width = page_table.shape[1]
    splits = splits or decode_splits(N, NKV, width * PAGE, q.device)
    part_o = torch.empty(N, NH, splits, D, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(N, NH, splits, 2, dtype=torch.float32, device=q.device)
    _decode_attn_kernel[(N, NKV, splits)](
        q.contiguous(), k_cache, v_cache, page_table, seq_lens, part_o, part_ml,
        NH, NKV, width, scale,
        GROUP=group, D=D, PAGE=PAGE, SPLITS=splits, BLOCK_G=max(16, _pow2(group)), BLOCK_D=_pow2(D),
        BLOCK_N=DECODE_ATTN_BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, **pdl_options(q.device),
    )
    out = torch.empty_like(q)
    if gate is not None and gate.stride(2) != 1:
        gate = gate.contiguous()
    _merge_splits_kernel[(N * NH,)](
        part_o, part_ml, out, gate if gate is not None else out, NH, gate.stride(0) if gate is not None else 0,
        gate.stride(1) if gate is not None else 0, D=D, SPLITS=splits, HAS_GATE=gate is not None,
        BLOCK_S=_pow2(splits), BLOCK_D=_pow2(D), **pdl_options(q.device))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Prefill attention (flash attention over paged KV): packed variable-length chunks, each causal over its cached
# context plus itself. Program (query block, query head); request r owns program blocks from cu[r] // BLOCK_M + r,
# which leaves room for its cdiv(len, BLOCK_M) blocks without a host-side block table.


@triton.jit
def _prefill_attn_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, cu_ptr, ctx_ptr, out_ptr, R, NH, NKV, table_width,
                         q_row_stride, scale, GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                         PRECISION: tl.constexpr):
    p, head = tl.program_id(0), tl.program_id(1)
    rs = tl.arange(0, BLOCK_R)
    first_block = tl.load(cu_ptr + rs, mask=rs < R, other=0) // BLOCK_M + rs
    r = tl.sum(((first_block <= p) & (rs < R)).to(tl.int32), 0) - 1
    start, stop = tl.load(cu_ptr + r), tl.load(cu_ptr + r + 1)
    q0 = start + (p - (start // BLOCK_M + r)) * BLOCK_M  # this program's block within request r
    if q0 < stop:
        ctx = tl.load(ctx_ptr + r)
        kvh = head // GROUP
        m_idx = q0 + tl.arange(0, BLOCK_M)
        q_live = m_idx < stop
        q_pos = ctx + m_idx - start  # absolute positions of the queries
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(q_ptr + m_idx.to(tl.int64)[:, None] * q_row_stride + head * D + d[None, :],
                    mask=q_live[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_end = ctx + tl.minimum(q0 + BLOCK_M, stop) - start  # keys past the block's last query are masked anyway
        for n0 in range(0, kv_end, BLOCK_N):
            k_pos = n0 + tl.arange(0, BLOCK_N)
            k_live = k_pos < kv_end
            page = tl.load(table_ptr + r.to(tl.int64) * table_width + k_pos // PAGE, mask=k_live, other=0).to(tl.int64)
            kv_at = ((page * PAGE + k_pos % PAGE) * NKV + kvh) * D
            kv_mask = k_live[:, None] & dmask[None, :]
            k = tl.load(kc_ptr + kv_at[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(vc_ptr + kv_at[:, None] + d[None, :], mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # log2 units: scale has log2(e)
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_live[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            probs = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(probs, 1)
            acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (m_idx.to(tl.int64)[:, None] * NH + head) * D + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=q_live[:, None] & dmask[None, :])


PREFILL_ATTN_CONFIG = (128, 64, 8, 3)  # (BLOCK_M, BLOCK_N, warps, stages): the H200 sweep's best for D = 256


def prefill_attention(q, k_cache, v_cache, page_table, cu_seqlens, context_lens, scale: float, config=None):
    """Same contract as reference.prefill_attention; no host synchronisation, no score matrix in memory.
    `config` overrides PREFILL_ATTN_CONFIG (the benchmark sweeps it)."""
    T_, NH, D = q.shape
    NKV, PAGE = k_cache.shape[2], k_cache.shape[1]
    R = context_lens.shape[0]
    out = torch.empty(T_, NH, D, dtype=q.dtype, device=q.device)
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    block_m, block_n, warps, stages = config or PREFILL_ATTN_CONFIG
    _prefill_attn_kernel[(T_ // block_m + R, NH)](
        q, k_cache, v_cache, page_table, cu_seqlens, context_lens, out, R, NH, NKV, page_table.shape[1],
        q.stride(0), scale * 1.4426950408889634, GROUP=NH // NKV, D=D, PAGE=PAGE, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=_pow2(D), BLOCK_R=max(2, _pow2(R + 1)), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet prefill, chunked (64-token chunks, the WY form), over packed variable-length requests.
# Kernel 1, parallel over (chunk, value head): l2-norm, gates, the chunk's cumulative decay c, the WY factors
#   W = T (beta V), Kd = T (beta exp(c) K) with T = (I + A)^-1, A_ij = beta_i exp(c_i - c_j) k_i.k_j (j < i)
#   (A is nilpotent, so T = (I - A)(I + A^2)(I + A^4)(I + A^8)(I + A^16)(I + A^32): eleven 64x64 matmuls), the
#   causal intra-chunk scores P = (q k^T exp(c_i - c_j))_{j<=i}, and two per-token scales: Ke = k exp(c_last - c)
#   and Qd = q exp(c) are those scales times k and q as stored, so kernel 2 reads k and q (bf16) instead of
#   Ke and Qd written here (fp32 Ke was a third of this kernel's writes and of kernel 2's reads).
# Kernel 2, parallel over (request, value head, block of dv), sequential over the request's chunks: per chunk,
#   u = W - Kd S and the chunk's output o = Qd S + P u from its entry state S, then S = exp(c_last) S + Ke^T u. Only
#   the recurrence is on the dependent path; the output's two products run beside it. The initial state comes from
#   the request's slot and the final state is written back there (fp32). Forming o here, not in a third kernel
#   parallel over chunks, saves writing and reading every chunk's entry state and u (at the 27B heads and 8k tokens,
#   some 600 MB), and made the whole 13% faster there, 8% at the 4B heads (run L1).

CHUNK = reference.GDN_CHUNK


@triton.jit
def _gdn_chunk_prep_kernel(mixed_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, chunk_ptr, kscale_ptr, qscale_ptr, w_ptr,
                           kd_ptr, p_ptr, glast_ptr, ab_row_stride, HV: tl.constexpr, GROUP: tl.constexpr, scale,
                           DK: tl.constexpr, DV: tl.constexpr, KEY_DIM: tl.constexpr, BT: tl.constexpr,
                           BH: tl.constexpr, PRECISION: tl.constexpr, BF16_FACTORS: tl.constexpr):
    ch = tl.program_id(0)
    h = tl.program_id(1)
    # As in the scan: constant row strides from scalar bases, so the tiles' offsets need no 64-bit registers.
    C: tl.constexpr = 2 * KEY_DIM + HV * DV
    start = tl.load(chunk_ptr + 2 * ch).to(tl.int64)
    rows = tl.arange(0, BT)
    tmask = rows < tl.load(chunk_ptr + 2 * ch + 1) - start
    cols = tl.arange(0, BH)
    k_rows = mixed_ptr + start * C + KEY_DIM + (h // GROUP) * DK + rows[:, None] * C  # q is KEY_DIM before k
    v_rows = mixed_ptr + start * C + 2 * KEY_DIM + h * DV + rows[:, None] * C
    first_row = start * HV + h  # this head's first row in the [T, HV, ...] outputs, and its rows' steps
    steps = rows * HV
    # Every [BT, dk] or [BT, dv] product runs over column blocks of BH (64), so only [BT, BH] fp32 tiles are ever
    # live beside the [BT, BT] ones: whole 128-wide fp32 tiles made this kernel spill kilobytes a thread.
    gram = tl.zeros([BT, BT], tl.float32)
    qk = tl.zeros([BT, BT], tl.float32)
    k_sq = tl.zeros([BT], tl.float32)
    q_sq = tl.zeros([BT], tl.float32)
    for c0 in tl.static_range(0, DK, BH):
        m = tmask[:, None] & (c0 + cols[None, :] < DK)
        k_raw = tl.load(k_rows + c0 + cols[None, :], mask=m, other=0.0)
        q_raw = tl.load(k_rows - KEY_DIM + c0 + cols[None, :], mask=m, other=0.0)
        kb, qb = k_raw.to(tl.float32), q_raw.to(tl.float32)
        k_sq += tl.sum(kb * kb, axis=1)
        q_sq += tl.sum(qb * qb, axis=1)
        # On k and q as stored: in a bf16 model these products are exact on bf16 operands, at twice the TF32 rate.
        gram += tl.dot(k_raw, tl.trans(k_raw), input_precision=PRECISION)
        qk += tl.dot(q_raw, tl.trans(k_raw), input_precision=PRECISION)
    rk = 1.0 / tl.sqrt(k_sq + 1e-6)  # the l2 norms, applied to the Gram products by rank-one scaling
    rq = scale / tl.sqrt(q_sq + 1e-6)
    rk_col = tl.reshape(rk, (1, BT))
    ab_rows = (start + rows) * ab_row_stride + h
    a = tl.load(a_ptr + ab_rows, mask=tmask, other=0.0).to(tl.float32) + tl.load(dtb_ptr + h)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    g = tl.where(tmask, -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus, 0.0)
    beta = tl.where(tmask, 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + ab_rows, mask=tmask, other=0.0).to(tl.float32))), 0.0)
    c = tl.cumsum(g, axis=0)
    c_last = tl.min(c, axis=0)  # c never increases; padding rows repeat the last value
    i = tl.arange(0, BT)[:, None]
    j = tl.arange(0, BT)[None, :]
    P = (rq[:, None] * qk * rk_col) * tl.exp(tl.where(i >= j, c[:, None] - c[None, :], float("-inf")))
    tl.store(p_ptr + first_row * BT + steps[:, None] * BT + j, P.to(p_ptr.dtype.element_ty), mask=tmask[:, None])
    A = (beta * rk)[:, None] * gram * rk_col * tl.exp(tl.where(i > j, c[:, None] - c[None, :], float("-inf")))
    inv = tl.where(i == j, 1.0, 0.0) - A
    power = tl.dot(A, A, input_precision=PRECISION)
    for step in tl.static_range(5):  # inv (I + power) as inv + inv power: no identity tile stays live
        inv = tl.dot(inv, power, inv, input_precision=PRECISION)
        if step < 4:
            power = tl.dot(power, power, input_precision=PRECISION)
    if BF16_FACTORS:
        inv = inv.to(tl.bfloat16)  # rounded once for the four products below
    kd_row = (beta * tl.exp(c) * rk)[:, None]
    for c0 in tl.static_range(0, DK, BH):
        m = tmask[:, None] & (c0 + cols[None, :] < DK)
        kb = tl.load(k_rows + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if BF16_FACTORS:
            kd = _dot_bf16(inv, kd_row * kb)  # the factors' products in bf16, as fla-core's
        else:
            kd = tl.dot(inv, kd_row * kb, input_precision=PRECISION)
        tl.store(kd_ptr + first_row * DK + steps[:, None] * DK + c0 + cols[None, :], kd.to(kd_ptr.dtype.element_ty),
                 mask=m)
    for c0 in tl.static_range(0, DV, BH):
        m = tmask[:, None] & (c0 + cols[None, :] < DV)
        vb = tl.load(v_rows + c0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if BF16_FACTORS:
            wb = _dot_bf16(inv, beta[:, None] * vb)
        else:
            wb = tl.dot(inv, beta[:, None] * vb, input_precision=PRECISION)
        tl.store(w_ptr + first_row * DV + steps[:, None] * DV + c0 + cols[None, :], wb.to(w_ptr.dtype.element_ty),
                 mask=m)
    tl.store(kscale_ptr + first_row + steps, rk * tl.exp(c_last - c), mask=tmask)  # Ke = k as stored, times this
    tl.store(qscale_ptr + first_row + steps, rq * tl.exp(c), mask=tmask)  # Qd = q as stored, times this
    tl.store(glast_ptr + ch * HV + h, c_last)


@triton.jit
def _gdn_chunk_scan_out_kernel(mixed_ptr, kscale_ptr, qscale_ptr, w_ptr, kd_ptr, p_ptr, glast_ptr, chunk_ptr,
                               req_chunk_ptr, slot_ptr, state_ptr, out_ptr, trash, HV: tl.constexpr,
                               GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KEY_DIM: tl.constexpr,
                               BT: tl.constexpr, BK: tl.constexpr, BVB: tl.constexpr, PRECISION: tl.constexpr,
                               BF16_FACTORS: tl.constexpr):
    # The state pass with the output fused in: each chunk's o = qscale (q S) + P u is formed from the entry state
    # and u while they are in registers, off the state's dependent chain, instead of storing both for a third
    # kernel. The row strides are compile-time constants (mixed is contiguous) and each chunk moves scalar base
    # pointers only: per-element int64 offsets rebuilt from a loaded chunk start made this loop spill kilobytes a
    # thread (347 against 264-269 us at the 27B heads, runs K1-K5).
    C: tl.constexpr = 2 * KEY_DIM + HV * DV
    MODEL_BF16: tl.constexpr = mixed_ptr.dtype.element_ty == tl.bfloat16
    r = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slot_ptr + r)
    slot = tl.where(slot < 0, trash, slot).to(tl.int64)
    first = tl.load(req_chunk_ptr + r)
    last = tl.load(req_chunk_ptr + r + 1)
    some = first < last  # an empty request has no chunk to read
    start = tl.load(chunk_ptr + 2 * first, mask=some, other=0).to(tl.int64)  # a request's chunks are contiguous
    left = tl.load(chunk_ptr + 2 * last - 1, mask=some, other=0).to(tl.int64) - start  # from this chunk to the end
    rows = tl.arange(0, BT)
    ks = tl.arange(0, BK)
    vs = vb * BVB + tl.arange(0, BVB)
    # Masks cost registers this loop has none to spare for: where the tiles cover whole heads, only rows have them.
    WHOLE: tl.constexpr = (BK == DK) & (DV % BVB == 0)
    sptr = state_ptr + (slot * HV + h) * DK * DV + ks[:, None] * DV + vs[None, :]
    if WHOLE:
        smask = None
        columns = tl.full([1, BK], 1, tl.int1)
        S = tl.load(sptr)
    else:
        smask = (ks[:, None] < DK) & (vs[None, :] < DV)
        columns = ks[None, :] < DK
        S = tl.load(sptr, mask=smask, other=0.0)
    kd_base = kd_ptr + (start * HV + h) * DK
    k_base = mixed_ptr + start * C + KEY_DIM + (h // GROUP) * DK
    row_base = start * HV + h  # this head's first row in the [T, HV, ...] tensors
    w_base = w_ptr + row_base * DV  # the output has w's layout
    out_base = out_ptr + row_base * DV
    p_base = p_ptr + row_base * BT
    kscale_base = kscale_ptr + row_base
    qscale_base = qscale_ptr + row_base
    for ch in range(first, last):
        tmask = rows < left
        kmask = tmask[:, None] & columns
        vmask = tmask[:, None] if WHOLE else tmask[:, None] & (vs[None, :] < DV)
        kd = tl.load(kd_base + rows[:, None] * (HV * DK) + ks[None, :], mask=kmask, other=0.0)
        q = tl.load(k_base - KEY_DIM + rows[:, None] * C + ks[None, :], mask=kmask, other=0.0)
        if BF16_FACTORS:  # the state rounded to bf16 in both products, as fla-core does; S itself stays fp32
            kd_s = _dot_bf16(kd, S)
        else:
            kd_s = tl.dot(kd, S, input_precision=PRECISION)
        # The output's two terms take the state and u in the model dtype (q as stored; Qd = q qscale).
        if MODEL_BF16:
            q_s = _dot_bf16(q, S)
        else:
            q_s = tl.dot(q, S.to(q.dtype), input_precision=PRECISION)
        u = tl.load(w_base + rows[:, None] * (HV * DV) + vs[None, :], mask=vmask, other=0.0).to(tl.float32) - kd_s
        P = tl.load(p_base + rows[:, None] * (HV * BT) + rows[None, :], mask=tmask[:, None], other=0.0)
        q_s *= tl.load(qscale_base + rows * HV, mask=tmask, other=0.0)[:, None]
        if MODEL_BF16:
            o = _dot_bf16(P, u, q_s)
        else:
            o = tl.dot(P, u.to(P.dtype), q_s, input_precision=PRECISION)
        tl.store(out_base + rows[:, None] * (HV * DV) + vs[None, :], o.to(out_ptr.dtype.element_ty), mask=vmask)
        # Ke^T u = k^T (kscale u), k as stored: a quarter of the bytes of an fp32 Ke from the prep kernel.
        u *= tl.load(kscale_base + rows * HV, mask=tmask, other=0.0)[:, None]
        decayed = S * tl.exp(tl.load(glast_ptr + ch * HV + h))
        k = tl.load(k_base + rows[:, None] * C + ks[None, :], mask=kmask, other=0.0)
        if BF16_FACTORS:
            S = _dot_bf16(tl.trans(k), u, decayed)
        else:
            S = tl.dot(tl.trans(k.to(tl.float32)), u, decayed, input_precision=PRECISION)
        left -= BT
        kd_base += BT * HV * DK
        k_base += BT * C
        w_base += BT * HV * DV
        out_base += BT * HV * DV
        p_base += BT * HV * BT
        kscale_base += BT * HV
        qscale_base += BT * HV
    tl.store(sptr, S, mask=smask)


# (warps, stages, column block, register cap) of the parallel prep kernel. Uncapped, it takes 255 registers a
# thread, which leaves room for two programs an SM; capped at 168 (the most that lets three programs of four warps
# share an SM's 64K registers) it spills a little and runs 18% faster: 299.5 against 365.5 us at the 27B heads,
# 205.6 against 252.6 at the 4B heads (run L1; a cap of 128, four programs, gave 319.6 and 238.6).
GDN_PREP_CONFIG = (4, 1, 64, 168)
# (block of dv, warps, stages) of the state pass, whose programs walk their request's chunks one after another. A
# batch of few long requests is bound by that walk's latency, so narrow blocks pay while every program runs at once;
# otherwise wide blocks (k, q, Kd and P read half as often) do. Runs L1 and L2, bf16 factors, 8k tokens as 1 to 64
# requests at the 4B and 27B heads: (32, 4, 3) was the fastest tile for one 8k request at the 4B heads (291 against
# 318 us wide in L2), and (64, 4, 3) in every other layout (two stages: 1.03-1.18x slower; 32-wide blocks, once
# programs take turns: 1.3-1.7x).
GDN_SCAN_NARROW = (32, 4, 3)
GDN_SCAN_WIDE = (64, 4, 3)
# fp32 factors take the wide block with two stages whatever the layout: three stages of fp32 Kd and W tiles need
# 254 KB of shared memory at the 27B heads (run L2), and 32-wide blocks with fp32 factors in a bf16 model gave NaN
# outputs on the H200 (Triton 3.6, run L4; the state was right, and bf16 factors at 32 wide were right too).
GDN_SCAN_FP32_FACTORS = (64, 4, 2)


def gdn_scan_config(requests: int, v_heads: int, dv: int, device: torch.device, factors: str = "bf16") -> tuple:
    if factors == "fp32":
        return GDN_SCAN_FP32_FACTORS
    if requests * v_heads * triton.cdiv(dv, GDN_SCAN_NARROW[0]) <= multiprocessors(device):
        return GDN_SCAN_NARROW
    return GDN_SCAN_WIDE


# The precision of the WY factors Kd and W. "bf16": formed from the inverse rounded to bf16, stored in bf16, and
# applied in the scan to the state rounded to bf16 (S itself stays fp32), as fla-core does: 1.4x faster than
# "fp32" at the 27B heads, with fla-core's accuracy (runs J1-J7, kernels.md). "fp32": fp32 factors and TF32 products,
# about 5x closer to the fp32 reference in the final state. A bf16 model takes GDN_FACTORS, an fp32 model "fp32".
GDN_FACTOR_MODES = ("fp32", "bf16")
GDN_FACTORS = "bf16"


def gdn_prefill(mixed, a, b, A_log, dt_bias, ssm_state, cu_seqlens, slots, num_k_heads: int, head_k_dim: int,
                head_v_dim: int, chunks: reference.GdnChunks | None = None, scan_config=None, prep_config=None,
                factors: str | None = None):
    """Same contract as reference.gdn_prefill (chunked WY GDN from each request's slot state). Without `chunks`
    (the forward passes its batch's) the chunk layout is built here, reading `cu_seqlens` back from the device.
    `scan_config`, `prep_config` and `factors` override gdn_scan_config's choice, GDN_PREP_CONFIG and GDN_FACTORS
    (the benchmark sweeps them)."""
    mixed = mixed.contiguous()
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        a, b = a.contiguous(), b.contiguous()
    if _PREFILL_FALLBACK:
        return reference.gdn_prefill(mixed, a, b, A_log, dt_bias, ssm_state, cu_seqlens, slots, num_k_heads,
                                     head_k_dim, head_v_dim)
    chunks = chunks or reference.GdnChunks.build(cu_seqlens.tolist(), mixed.device)
    try:
        return _gdn_prefill_triton(mixed, a, b, A_log, dt_bias, ssm_state, slots, num_k_heads, chunks, head_k_dim,
                                   head_v_dim, scan_config, prep_config or GDN_PREP_CONFIG,
                                   factors or ("fp32" if mixed.dtype == torch.float32 else GDN_FACTORS))
    except OutOfResources as exc:  # a capability gate, decided once per process
        log.warning("Triton chunked GDN prefill does not fit this GPU (%s); using the torch chunked form", exc)
        _PREFILL_FALLBACK.append(True)
        return reference.gdn_prefill(mixed, a, b, A_log, dt_bias, ssm_state, cu_seqlens, slots, num_k_heads,
                                     head_k_dim, head_v_dim)


_PREFILL_FALLBACK: list[bool] = []


def _gdn_prefill_triton(mixed, a, b, A_log, dt_bias, ssm_state, slots, num_k_heads, chunks, dk, dv, scan_config,
                        prep_config, factors):
    T, C = mixed.shape
    HV = a.shape[1]
    if C != 2 * num_k_heads * dk + HV * dv:  # the kernels derive the row stride from the heads
        raise ValueError(f"mixed has {C} columns; {num_k_heads} key heads of {dk} and {HV} value heads of {dv} make "
                         f"{2 * num_k_heads * dk + HV * dv}")
    dev, dt = mixed.device, mixed.dtype
    precision = "tf32" if dt != torch.float32 else "ieee"  # fp32 models keep fp32 accuracy
    chunk_table, req_chunks = chunks.spans, chunks.first
    n, requests = chunk_table.shape[0], req_chunks.shape[0] - 1
    if factors not in GDN_FACTOR_MODES:
        raise ValueError(f"factors must be one of {GDN_FACTOR_MODES}, got {factors!r}")
    # The state S and the scales stay fp32, the WY factors Kd and W as `factors` says; P, which only feeds the
    # output, is in the model dtype.
    factor_dtype = torch.float32 if factors == "fp32" else torch.bfloat16
    kd = torch.empty(T, HV, dk, dtype=factor_dtype, device=dev)
    w = torch.empty(T, HV, dv, dtype=factor_dtype, device=dev)
    kscale = torch.empty(T, HV, dtype=torch.float32, device=dev)
    qscale = torch.empty_like(kscale)
    P = torch.empty(T, HV, CHUNK, dtype=dt, device=dev)
    glast = torch.empty(n, HV, dtype=torch.float32, device=dev)
    _gdn_chunk_prep_kernel[(n, HV)](
        mixed, a, b, A_log, dt_bias, chunk_table, kscale, qscale, w, kd, P, glast, a.stride(0), HV=HV,
        GROUP=HV // num_k_heads, scale=dk**-0.5, DK=dk, DV=dv, KEY_DIM=num_k_heads * dk, BT=CHUNK,
        BH=min(prep_config[2], _pow2(max(dk, dv))), PRECISION=precision, BF16_FACTORS=factors == "bf16",
        num_warps=prep_config[0], num_stages=prep_config[1], maxnreg=prep_config[3])
    block_v, warps, stages = scan_config or gdn_scan_config(requests, HV, dv, dev, factors)
    BVB = min(block_v, _pow2(dv))
    out = torch.empty(T, HV, dv, dtype=dt, device=dev)
    _gdn_chunk_scan_out_kernel[(requests, HV, triton.cdiv(dv, BVB))](
        mixed, kscale, qscale, w, kd, P, glast, chunk_table, req_chunks, slots, ssm_state, out, ssm_state.shape[0] - 1,
        HV=HV, GROUP=HV // num_k_heads, DK=dk, DV=dv, KEY_DIM=num_k_heads * dk, BT=CHUNK, BK=_pow2(dk), BVB=BVB,
        PRECISION=precision, BF16_FACTORS=factors == "bf16", num_warps=warps, num_stages=stages)
    return out
