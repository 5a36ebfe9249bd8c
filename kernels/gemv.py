"""Projections, alone and fused with the block's input add-and-norm: the torch references, then the one-row
Triton GEMVs (batch-1 decode); more rows go to cuBLAS (a few-row Triton kernel, which read each weight tile once
for 2 to 16 rows, edged cuBLAS at the 4B batch-8 step but slowed the speculative five-row verify, H100: it was
removed, docs/decisions/0001-few-row-kernel-removed.md). A weight kept in FP8 (`fp8.Fp8Weight`) takes the FP8
kernels at every row count, after an unfused add-and-norm (fused into the FP8 kernel, the norm's loads inside its
K loop made it 2.5x slower: 27B, H100)."""

from __future__ import annotations

import torch
from .triton_or_absent import tl, triton

from . import fp8
from .config import DEFAULT, KernelConfig, Tile, WholeRows
from .launch import pdl_options, wait_for_previous_kernel
from .norm import add_rms_norm, add_rms_norm_reference, silu_mul, silu_mul_reference


# ---------------------------------------------------------------------------------------------------------------------
# Torch references


def linear_reference(x: torch.Tensor, weight) -> torch.Tensor:
    """A projection: x [T, K] @ weight [N, K]^T."""
    if isinstance(weight, fp8.Fp8Weight):
        return fp8.linear_reference(x, weight)
    return x @ weight.t()


def add_rms_norm_linear_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's input: `add_rms_norm_reference`, then the projection that reads it. Returns (projected, new residual)."""
    normed, residual = add_rms_norm_reference(x, residual, norm_weight, eps)
    return linear_reference(normed, weight), residual


def add_rms_norm_gate_up_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
    gate_up: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP's input: `add_rms_norm_reference`, the fused [gate | up] projection, silu(gate) * up. Returns (activation,
    new residual)."""
    normed, residual = add_rms_norm_reference(x, residual, norm_weight, eps)
    return silu_mul_reference(linear_reference(normed, gate_up)), residual


def mlp_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
    gate_up: torch.Tensor, down: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP block: `add_rms_norm_gate_up_reference`, then down_proj (before a row-parallel all-reduce).
    Returns (output, new residual)."""
    act, residual = add_rms_norm_gate_up_reference(x, residual, norm_weight, eps, gate_up)
    return linear_reference(act, down), residual


# ---------------------------------------------------------------------------------------------------------------------
# One-row Triton GEMVs. Two kernels (KernelConfig says which takes what):
# - whole rows: a program loads its few weight rows in full at once, as two power-of-two spans (K = K1 + K2:
#   4096, 9216 = 8192 + 1024, 2560 = 2048 + 512), and reduces once. All of a program's loads are in flight
#   together, and many short programs share the SMs. It takes the narrowing projections whose K splits so, and,
#   fused with the input norm below, the narrow models' widening ones.
# - a loop over K tiles, BLOCK_N rows a program: every other K, and the widening projections of the plain GEMV.


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


def _whole_rows_take(cfg: KernelConfig, config: WholeRows, n: int, k: int) -> bool:
    """Whether the whole-rows kernels are on and fit an [n, k] weight in `config`."""
    return cfg.whole_rows and n % config.rows == 0 and whole_row_spans(k) is not None


def gemv_config(n: int, k: int, cfg: KernelConfig = DEFAULT) -> WholeRows | Tile:
    """The one-row GEMV's launch configuration for an [n, k] weight."""
    if n <= k and _whole_rows_take(cfg, cfg.gemv_whole_rows, n, k):
        return cfg.gemv_whole_rows
    return cfg.gemv_narrow_widening_tile if n > k and k < cfg.wide_input_k else cfg.gemv_tile


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PDL: tl.constexpr = False):
    """out [N] = x @ w.t() for one row x. It waits first: loading a first weight tile before the wait, in a
    peeled iteration, broke the pipelining of two-tile rows (the 9B batch-1 step was 22% slower)."""
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
    It waits first: loading the rows before the wait made no measurable difference."""
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


def gemv(x: torch.Tensor, weight: torch.Tensor, cfg: KernelConfig = DEFAULT, config: WholeRows | Tile | None = None):
    """x [1, K] @ weight [N, K].t(); `config` overrides `gemv_config`'s choice (the benchmark sweeps it)."""
    K, N = x.shape[1], weight.shape[0]
    config = config or gemv_config(N, K, cfg)
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    if isinstance(config, WholeRows):
        k1, k2 = _spans_for(config, N, K)
        _gemv_whole_rows_kernel[(N // config.rows,)](x.contiguous(), weight, out, K, ROWS=config.rows, K1=k1, K2=k2,
                                                     num_warps=config.warps, num_stages=1, **pdl_options(x.device, cfg.pdl))
        return out
    block_n, block_k, warps, stages = config
    _gemv_kernel[(triton.cdiv(N, block_n),)](x.contiguous(), weight, out, N, K, BLOCK_N=block_n, BLOCK_K=block_k,
                                             EVEN_K=K % block_k == 0, num_warps=warps, num_stages=stages,
                                             **pdl_options(x.device, cfg.pdl))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Few-row projections (decode batches of 2 to 16 rows, a speculative verify's k + 1 rows): each program streams
# BLOCK_N weight rows once over its part of K and multiplies every tile with all the rows at once on the tensor
# cores (the rows padded to 16, the smallest dot). Bound by the weight read, like the one-row GEMV; cuBLAS picks
# tiles made for more rows. Narrow outputs split K across programs (`launch.k_splits`), so every SM streams. With
# SILU_MUL the epilogue applies silu(gate) * up, the MLP's, so the activation is written once (its output is wide:
# no split).


def linear(x: torch.Tensor, weight, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    if isinstance(weight, fp8.Fp8Weight):
        return fp8.linear(x, weight, cfg)
    if cfg.gemv_one_row and x.shape[0] == 1:
        return gemv(x, weight, cfg)
    return x @ weight.t()


# A block's input add-and-norm fused into the one-row projection that reads it (and, for the MLP, silu(gate) * up
# into its epilogue). Each program sums x^2 over the row itself and scales its dot products by 1/rms at the end,
# so no weight load waits for the norm (normalising first, in the prologue, cost 5 us a projection). Whole rows
# where K splits into two spans, the loop over K tiles otherwise.


def norm_gemv_config(n: int, k: int, silu_mul: bool, cfg: KernelConfig = DEFAULT) -> WholeRows | Tile:
    """As `gemv_config`, for the fused add-and-norm GEMV of n output rows (gate rows, with silu_mul)."""
    whole = cfg.norm_gemv_silu_whole_rows if silu_mul else cfg.norm_gemv_whole_rows
    if _whole_rows_take(cfg, whole, n, k):
        return whole
    return cfg.norm_gemv_silu_tile if silu_mul else cfg.norm_gemv_tile


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
    registers can let ptxas serialise a tile's loads (the unmasked form made the 4B batch-1 step 3% faster)."""
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


def norm_gemv(x, residual, norm_weight, eps: float, weight, silu_mul_rows: int = 0, cfg: KernelConfig = DEFAULT,
              config: WholeRows | Tile | None = None):
    """One row: (rms_norm(x + residual) @ weight.t(), x + residual). With silu_mul_rows = I, weight is a fused
    [gate | up] of 2I rows and the first output is silu(gate) * up, [1, I]. norm_weight None: the norm's (1 + w)
    is folded into weight's columns. `config` overrides `norm_gemv_config`'s choice."""
    K = x.shape[1]
    N = silu_mul_rows or weight.shape[0]
    config = config or norm_gemv_config(N, K, silu_mul_rows > 0, cfg)
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
            **pdl_options(x.device, cfg.pdl))
        return out, summed
    block_n, block_k, warps, stages = config
    _norm_gemv_kernel[(triton.cdiv(N, block_n),)](
        x, residual, norm_weight, weight, out, summed, N, K, silu_mul_rows, eps, HAS_RES=has_res, HAS_NW=has_nw,
        SILU_MUL=silu_mul_rows > 0, BLOCK_N=block_n, BLOCK_K=block_k, EVEN=K % block_k == 0 and N % block_n == 0,
        num_warps=warps, num_stages=stages, **pdl_options(x.device, cfg.pdl))
    return out, summed


def _fuses_norm(x: torch.Tensor, cfg: KernelConfig) -> bool:
    return cfg.gemv_one_row and cfg.fused_norm and x.shape[0] == 1 and x.shape[1] < cfg.wide_input_k


def add_rms_norm_linear(x, residual, norm_weight, eps: float, weight, cfg: KernelConfig = DEFAULT):
    if _fuses_norm(x, cfg) and not isinstance(weight, fp8.Fp8Weight):
        return norm_gemv(x, residual, norm_weight, eps, weight, cfg=cfg)
    if isinstance(weight, fp8.Fp8Weight) and fp8.takes_cublas(x, weight, cfg):
        return _add_rms_norm_cublas(x, residual, norm_weight, eps, weight)
    normed, residual = add_rms_norm(x, residual, norm_weight, eps, cfg)
    return linear(normed, weight, cfg), residual


def _add_rms_norm_cublas(x, residual, norm_weight, eps: float, weight: fp8.Fp8Weight):
    """An FP8 projection on cuBLAS (prefill) reading the add-and-norm quantised by the norm's own pass."""
    M = x.shape[0]
    values, scale, residual = fp8.add_rms_norm_quantised(x, residual, norm_weight, eps, weight.block,
                                                         fp8.cublas_rows(M))
    return fp8.cublas_matmul(values, scale, weight, M, x.dtype), residual


def add_rms_norm_gate_up(x, residual, norm_weight, eps: float, gate_up, cfg: KernelConfig = DEFAULT):
    if _fuses_norm(x, cfg) and not isinstance(gate_up, fp8.Fp8Weight):
        return norm_gemv(x, residual, norm_weight, eps, gate_up, silu_mul_rows=gate_up.shape[0] // 2, cfg=cfg)
    normed, residual = add_rms_norm(x, residual, norm_weight, eps, cfg)
    return silu_mul(linear(normed, gate_up, cfg), cfg), residual


def mlp(x, residual, norm_weight, eps: float, gate_up, down, cfg: KernelConfig = DEFAULT):
    """`mlp_reference` on the kernels. FP8 projections on cuBLAS (prefill) take their inputs quantised by the
    passes that make them (the add-and-norm, silu(gate) * up): those activations, the widest of the layer, are
    not written in bf16 and read back."""
    if isinstance(down, fp8.Fp8Weight) and fp8.takes_cublas(x, down, cfg):
        gate_up_out, residual = add_rms_norm_linear(x, residual, norm_weight, eps, gate_up, cfg)
        M = x.shape[0]
        values, scale = fp8.silu_mul_quantised(gate_up_out, down.block, fp8.cublas_rows(M), cfg)
        return fp8.cublas_matmul(values, scale, down, M, x.dtype), residual
    act, residual = add_rms_norm_gate_up(x, residual, norm_weight, eps, gate_up, cfg)
    return linear(act, down, cfg), residual
