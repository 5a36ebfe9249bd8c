"""Block-scaled FP8 weights kept in FP8 (`Fp8Weight`) and the projections that read them, each beside its torch
reference. A decode step reads half the bytes of a bf16 weight.

- One row (batch-1 decode, a draft's FP8 lm_head; `KernelConfig.fp8_gemv_tile`): a CUDA-core GEMV, each weight
  widened and multiplied with the activation already scaled by its column's block scale.
- W8A16 (`linear_w8a16`, every row count): each FP8 tile widened to the activations' dtype in registers, its
  block's scale applied to the partial sums. Up to `DECODE_ROWS` rows (decode) read each weight once, with as
  many loads in flight as the SMs hold: where the column tiles are too few for that (narrow outputs, long K) the
  K range is split across programs, whose fp32 partial sums the last of them adds in a fixed order
  (`launch.store_split`: deterministic, unlike atomics on the output).
- W8A8 (`linear_w8a8`, prefill): the activations quantised to FP8 per token and 128 columns (dynamic scales, as
  DeepSeek's and vLLM's block FP8), then FP8 tensor-core dots, both scales applied per K block. Scaling each
  block's dot apart from the accumulator holds it near the bf16 GEMM's rate (H100: 0.7-1.0x cuBLAS bf16), twice
  the W8A16 kernel's.
`linear` picks by the row count and `KernelConfig.fp8_prefill`: above `KernelConfig.fp8_few_rows` rows cuBLAS's
block-scaled FP8 GEMM takes every weight it can (at 64 rows each of our 32-column tiles rereads all rows'
activations; cuBLAS was 1.2-1.8x faster there). Its input is quantised by the pass that makes it where one does
(`add_rms_norm_quantised`, `silu_mul_quantised`; `gemv.mlp`, `gemv.add_rms_norm_linear`), by
`quantise_activations` elsewhere.

The format (Qwen's FP8 checkpoints, vLLM's "fp8" loader): values [N, K] float8_e4m3fn and scale [ceil(N / B),
ceil(K / B)] float32 (`weight_scale_inv`), the real weight being each B x B tile of values times its entry.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from .triton_or_absent import tl, triton

from .config import DEFAULT, KernelConfig
from .launch import (_dot_bf16, k_splits, multiprocessors, pdl_options, split_buffers, store_split,
                     wait_for_previous_kernel)

FP8_MAX = 448.0  # the largest finite e4m3 value


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

    def __getitem__(self, e: int) -> "Fp8Weight":
        """Expert e of an MoE layer's stacked experts (values [E, N, K], scales [E, N / block, K / block])."""
        return Fp8Weight(self.values[e], self.scale[e], self.block)

    @staticmethod
    def stack(parts: list["Fp8Weight"]) -> "Fp8Weight":
        """Experts of one shape, stacked along a new first dimension."""
        return Fp8Weight(torch.stack([p.values for p in parts]), torch.stack([p.scale for p in parts]), parts[0].block)

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


def quantise_activations_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] as e4m3 values and float32 scales [T, ceil(K / group)]: each row's `group` columns scaled so their
    largest magnitude is FP8_MAX."""
    t, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(t, groups, group)
    scale = padded.abs().amax(-1).clamp_min(1e-10) / FP8_MAX
    values = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.view(t, groups * group)[:, :k].contiguous(), scale


def linear_w8a8_reference(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """`linear_w8a8`'s arithmetic in torch: the activations quantised, then both dequantised, in fp32."""
    values, scale = quantise_activations_reference(x, weight.block)
    dequantised = values.float() * scale.repeat_interleave(weight.block, 1)[:, : x.shape[1]]
    return (dequantised @ weight.dequantise().t()).to(x.dtype)


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, out_ptr, partial_ptr, counters_ptr, M, N, K, k_per_split, x_row_stride,
                  scale_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  QBLOCK: tl.constexpr, FP32: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False):
    """out[m, n] = sum over K tiles of (x tile . widened w tile) * scale[n // QBLOCK, k // QBLOCK]; a K tile lies
    inside one quantisation block (QBLOCK a multiple of BLOCK_K), so each column has one scale per tile. Program
    (i, j, s) sums the K range [s * k_per_split, (s + 1) * k_per_split) (whole QBLOCKs); SPLIT (one row tile):
    through fp32 partial [splits, M, N] (`launch.store_split`)."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_live, n_live = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    scale_row = (rn // QBLOCK).to(tl.int64) * scale_cols
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + rk
        k_live = k < k_end
        a = tl.load(x_ptr + rm.to(tl.int64)[:, None] * x_row_stride + k[None, :],
                    mask=m_live[:, None] & k_live[None, :], other=0.0)
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * K + k[None, :], mask=n_live[:, None] & k_live[None, :],
                    other=0.0)
        s = tl.load(s_ptr + scale_row + k0 // QBLOCK, mask=n_live, other=0.0)
        if FP32:
            part = tl.dot(a, tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # every e4m3 value is exact in bf16
            part = _dot_bf16(a, tl.trans(w.to(tl.float32)))
        acc += part * s[None, :]
    out_mask = m_live[:, None] & n_live[None, :]
    at = rm.to(tl.int64)[:, None] * N + rn[None, :]
    if SPLIT:
        store_split(acc, partial_ptr, out_ptr, counters_ptr, at, out_mask, M * N, pid_k, tl.num_programs(2), pid_n)
    else:
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _w8a16_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, scale_cols, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       QBLOCK: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr = False):
    """out [N] = x @ (w * scale).t() for one row x, on the CUDA cores, as the bf16 `gemv._gemv_kernel`: BLOCK_N
    rows a program, all in one QBLOCK row block (BLOCK_N divides QBLOCK), so each column has one scale a program:
    x times its columns' scales once a tile, then one FMA a widened weight; reduced once, at the end."""
    wait_for_previous_kernel(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    ns = n0 + tl.arange(0, BLOCK_N)
    nmask = ns < N
    w_rows = w_ptr + ns.to(tl.int64)[:, None] * K
    s_row = s_ptr + (n0 // QBLOCK) * scale_cols
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        wmask = nmask[:, None] if EVEN_K else nmask[:, None] & kmask[None, :]
        xs = tl.load(x_ptr + ks, mask=kmask, other=0.0).to(tl.float32) * \
            tl.load(s_row + ks // QBLOCK, mask=kmask, other=0.0)
        acc += tl.load(w_rows + ks[None, :], mask=wmask, other=0.0).to(tl.float32) * xs[None, :]
    tl.store(out_ptr + ns, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=nmask)


def decode_tiles(m: int, n: int, k: int, block: int, programs: int, block_n: int = 32) -> tuple[int, int, int]:
    """(BLOCK_N, splits, K a split) for a few-row W8A16 projection: `block_n`-column tiles (twice as wide where
    they would be more than twice `programs`: the widest outputs), and the K range split (in whole blocks) until
    about `programs` programs run, each over at least two blocks."""
    if triton.cdiv(n, block_n) > 2 * programs:
        block_n *= 2
    return block_n, *k_splits(triton.cdiv(n, block_n), k, block, programs)  # one row tile: DECODE_ROWS rows


DECODE_ROWS = 64  # up to this many rows (decode batches, verify steps) a projection reads each weight once


def linear_w8a16(x: torch.Tensor, weight: Fp8Weight, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """x [T, K] @ weight^T on the W8A16 kernels, in x's dtype. One row: the CUDA-core GEMV where
    `KernelConfig.fp8_gemv_tile` is set; up to DECODE_ROWS rows (decode): every row in one row tile,
    `decode_tiles` after `KernelConfig.fp8_decode_tile`; more rows: the prefill tile of
    `KernelConfig.fp8_w8a16_tile`."""
    M, K = x.shape
    N = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 1 and cfg.fp8_gemv_tile is not None:
        block_n, block_k, warps, stages = cfg.fp8_gemv_tile
        if weight.block % block_n:
            raise ValueError(f"fp8_gemv_tile's {block_n} rows a program must divide the {weight.block}-row blocks")
        while K % block_k and block_k > 128:  # unmasked tiles where K allows (an FP8 lm_head's 2560: 512)
            block_k //= 2
        _w8a16_gemv_kernel[(triton.cdiv(N, block_n),)](
            x, weight.values, weight.scale, out, N, K, weight.scale.shape[1], BLOCK_N=block_n, BLOCK_K=block_k,
            QBLOCK=weight.block, EVEN_K=K % block_k == 0, num_warps=warps, num_stages=stages,
            **pdl_options(x.device, cfg.pdl))
        return out
    block_k = min(128, weight.block)
    common = dict(BLOCK_K=block_k, QBLOCK=weight.block, FP32=x.dtype == torch.float32)
    if M <= DECODE_ROWS:
        block_m = max(16, triton.next_power_of_2(M))
        block_n, per_sm, warps, stages = cfg.fp8_decode_tile if M <= cfg.fp8_few_rows else \
            cfg.fp8_decode_many_rows_tile
        block_n, splits, per_split = decode_tiles(M, N, K, weight.block, per_sm * multiprocessors(x.device), block_n)
        tiles = triton.cdiv(N, block_n)
        partial, counters = split_buffers(out, splits, tiles)
        _w8a16_kernel[(1, tiles, splits)](
            x, weight.values, weight.scale, out, partial, counters, M, N, K, per_split, x.stride(0),
            weight.scale.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=splits > 1, **common, num_warps=warps,
            num_stages=stages, **pdl_options(x.device, cfg.pdl))
        return out
    block_m, block_n, warps, stages = cfg.fp8_w8a16_tile
    _w8a16_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n), 1)](
        x, weight.values, weight.scale, out, out, out, M, N, K, K, x.stride(0), weight.scale.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=False, **common, num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _scaled_groups(x, AXIS: tl.constexpr):
    """x's groups along AXIS (fp32) as (values in the e4m3 range, scales): each group divided by its largest
    magnitude / FP8_MAX, as `quantise_activations_reference`; the scales keep AXIS (size 1)."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=AXIS, keep_dims=True), 1e-10) / 448.0  # FP8_MAX
    return tl.minimum(tl.maximum(x / scale, -448.0), 448.0), scale


@triton.jit
def _quantise_activations_kernel(x_ptr, q_ptr, s_ptr, M, R, K, groups, x_row_stride, s_row_stride,
                                 s_group_stride, ROWS: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """ROWS rows by GROUPS groups a program: each row's group scaled by its largest magnitude / FP8_MAX (into
    s[m, g]) and stored as e4m3. Rows from M to R (padding) get zeros. With one group a program (256 bytes of
    bf16) a prefill's activations went at 0.6 TB/s (H100), a program's start costing more than its loads."""
    ms = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None, None]
    gs = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)[None, :, None]
    ks = gs * GROUP + tl.arange(0, GROUP)[None, None, :]
    x = tl.load(x_ptr + ms.to(tl.int64) * x_row_stride + ks, mask=(ks < K) & (ms < M), other=0.0).to(tl.float32)
    q, scale = _scaled_groups(x, 2)
    tl.store(q_ptr + ms.to(tl.int64) * K + ks, q.to(q_ptr.dtype.element_ty), mask=(ks < K) & (ms < R))
    tl.store(s_ptr + ms * s_row_stride + gs * s_group_stride, scale, mask=(gs < groups) & (ms < R))


@triton.jit
def _w8a8_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, groups, scale_cols,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QBLOCK: tl.constexpr):
    """out = sum over K tiles of (a tile . w tile on the FP8 tensor cores) * a_scale[m, k // QBLOCK] *
    w_scale[n // QBLOCK, k // QBLOCK], in fp32, stored in out's dtype (BLOCK_K divides QBLOCK)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_live, n_live = rm < M, rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * K
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    ws_row = (rn // QBLOCK).to(tl.int64) * scale_cols
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_live = k < K
        a = tl.load(a_rows + k[None, :], mask=m_live[:, None] & k_live[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_live[:, None] & k_live[None, :], other=0.0)
        a_s = tl.load(as_ptr + rm * groups + k0 // QBLOCK, mask=m_live, other=0.0)
        w_s = tl.load(ws_ptr + ws_row + k0 // QBLOCK, mask=n_live, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * a_s[:, None] * w_s[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_live[:, None] & n_live[None, :])


def quantise_activations(x: torch.Tensor, group: int, rows: int | None = None, group_major: bool = False,
                         cfg: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantise_activations_reference` on the Triton kernel. `rows` (>= x's): the result padded with zero rows;
    group_major: the scales [rows, groups] stored group by group (stride (1, rows)), as cuBLAS reads them."""
    M, K = x.shape
    rows = rows or M
    groups = triton.cdiv(K, group)
    values = torch.empty(rows, K, dtype=torch.float8_e4m3fn, device=x.device)
    if group_major:
        scale = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    tile_rows, tile_groups, warps = cfg.fp8_quantise_tile
    _quantise_activations_kernel[(triton.cdiv(rows, tile_rows), triton.cdiv(groups, tile_groups))](
        x, values, scale, M, rows, K, groups, x.stride(0), scale.stride(0), scale.stride(1), ROWS=tile_rows,
        GROUPS=tile_groups, GROUP=group, num_warps=warps)
    return values, scale


def linear_w8a8(x: torch.Tensor, weight: Fp8Weight, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """x [T, K] @ weight^T with x quantised to FP8 per token and block (`linear_w8a8_reference`), in x's dtype."""
    return w8a8_matmul(*quantise_activations(x, weight.block, cfg=cfg), weight, x.dtype, cfg)


def w8a8_matmul(values: torch.Tensor, scale: torch.Tensor, weight: Fp8Weight, dtype: torch.dtype,
                cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """Quantised activations (`quantise_activations`) @ weight^T on the FP8 tensor cores, in `dtype`."""
    M, K = values.shape
    N = weight.shape[0]
    values, scale = values.contiguous(), scale.contiguous()
    out = torch.empty(M, N, dtype=dtype, device=values.device)
    block_m, block_n, warps, stages = cfg.fp8_w8a8_tile
    _w8a8_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        values, scale, weight.values, weight.scale, out, M, N, K, scale.shape[1], weight.scale.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(128, weight.block), QBLOCK=weight.block,
        num_warps=warps, num_stages=stages)
    return out


def cublas_takes(weight: Fp8Weight) -> bool:
    """Whether cuBLAS's block-scaled GEMM reads this weight as stored: 128 x 128 blocks, whole blocks along N,
    and a K of whole blocks in a multiple of four (its scale layout; a tp = 4 shard of the 27B's down_proj has
    34). Other weights go to the Triton W8A8 kernel."""
    n, k = weight.shape
    return weight.block == 128 and n % 128 == 0 and k % 128 == 0 and (k // 128) % 4 == 0


def takes_cublas(x: torch.Tensor, weight: Fp8Weight, cfg: KernelConfig = DEFAULT) -> bool:
    """Whether `linear` runs x @ weight^T on cuBLAS's block-scaled GEMM (`linear_cublas`)."""
    return x.dtype != torch.float32 and x.shape[0] > cfg.fp8_few_rows and cfg.fp8_prefill == "cublas" \
        and cublas_takes(weight)


def linear_cublas(x: torch.Tensor, weight: Fp8Weight, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """`linear_w8a8`'s arithmetic on cuBLAS's block-scaled FP8 GEMM (1 x 128 activation groups, 128 x 128 weight
    blocks: DeepSeek's scheme, CUDA 12.9+ on sm90), through `torch._scaled_mm`."""
    M = x.shape[0]
    values, scale = quantise_activations(x, weight.block, rows=cublas_rows(M), group_major=True, cfg=cfg)
    return cublas_matmul(values, scale, weight, M, x.dtype)


def cublas_rows(m: int) -> int:
    """The rows cuBLAS's block-scaled GEMM takes: a multiple of four (the quantised activations are padded)."""
    return -(-m // 4) * 4


def cublas_matmul(values: torch.Tensor, scale: torch.Tensor, weight: Fp8Weight, m: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Quantised activations (rows padded to `cublas_rows(m)`, scales group-major) @ weight^T on cuBLAS, the
    first m rows, in `dtype`. The weight's scales are its `weight_scale_inv`, transposed."""
    out = torch._scaled_mm(values, weight.values.t(), scale_a=scale, scale_b=weight.scale.t(), out_dtype=dtype)
    return out[:m]


def add_rms_norm_quantised_reference(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
                                     eps: float, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's input add-and-norm (`norm.add_rms_norm_reference`, in the model dtype), quantised per token and
    `group` columns: (values, scales, new residual)."""
    from .norm import add_rms_norm_reference

    normed, summed = add_rms_norm_reference(x, residual, norm_weight, eps)
    return *quantise_activations_reference(normed, group), summed


@triton.jit
def _add_rms_norm_quantised_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, M, n_cols, groups,
                                   s_group_stride, eps, HAS_RES: tl.constexpr, HAS_W: tl.constexpr,
                                   GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """Row m: residual += x (stored), its zero-centred norm rounded to x's dtype (as the unfused norm's output
    is), then each group scaled by its largest magnitude / FP8_MAX into s[m, g] (group-major) and stored as e4m3.
    Rows from M on (cuBLAS's padding) get zeros."""
    row = tl.program_id(0).to(tl.int64)
    gs = tl.arange(0, GROUPS)[:, None]
    cols = gs * GROUP + tl.arange(0, GROUP)[None, :]
    live = cols < n_cols
    load = cols < tl.where(row < M, n_cols, 0)
    x = tl.load(x_ptr + row * n_cols + cols, mask=load, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * n_cols + cols, mask=load, other=0.0)  # in the model dtype
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=load)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(tl.sum(xf * xf, axis=1), axis=0) / n_cols + eps)
    y = xf * inv
    if HAS_W:
        y = y * (tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32) + 1.0)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    q, scale = _scaled_groups(y, 1)
    tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=live)
    tl.store(s_ptr + row + gs * s_group_stride, scale, mask=gs < groups)


def add_rms_norm_quantised(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None,
                           eps: float, group: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm_quantised_reference` in one pass, padded to `rows` rows with zeros, the scales group-major
    (as `cublas_matmul` reads them): the normed activation is never written in bf16 and read back."""
    M, n_cols = x.shape
    groups = triton.cdiv(n_cols, group)
    x = x.contiguous()
    values = torch.empty(rows, n_cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(groups, rows, dtype=torch.float32, device=x.device).t()
    summed = x if residual is None else torch.empty_like(x)
    _add_rms_norm_quantised_kernel[(rows,)](
        x, x if residual is None else residual.contiguous(), x if norm_weight is None else norm_weight, values,
        scale, summed, M, n_cols, groups, scale.stride(1), eps, HAS_RES=residual is not None,
        HAS_W=norm_weight is not None, GROUPS=triton.next_power_of_2(groups), GROUP=group, num_warps=8)
    return values, scale, summed


def silu_mul_quantised_reference(gate_up: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP activation silu(gate) * up (in the model dtype, as `norm.silu_mul_reference`), quantised per token
    and `group` columns (`quantise_activations_reference`)."""
    from .norm import silu_mul_reference

    return quantise_activations_reference(silu_mul_reference(gate_up), group)


@triton.jit
def _silu_mul_quantised_kernel(x_ptr, q_ptr, s_ptr, M, inner, groups, x_row_stride, s_group_stride,
                               GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """Row m's GROUPS groups of silu(gate) * up (rounded to x's dtype, as the unfused activation is), each scaled
    by its largest magnitude / FP8_MAX into s[m, g] (group-major) and stored as e4m3. Rows from M on (cuBLAS's
    padding) get zeros."""
    row = tl.program_id(0).to(tl.int64)
    gs = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)[:, None]
    cols = gs * GROUP + tl.arange(0, GROUP)[None, :]
    live = cols < inner
    load = cols < tl.where(row < M, inner, 0)
    g = tl.load(x_ptr + row * x_row_stride + cols, mask=load, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_row_stride + inner + cols, mask=load, other=0.0).to(tl.float32)
    y = (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty).to(tl.float32)
    q, scale = _scaled_groups(y, 1)
    tl.store(q_ptr + row * inner + cols, q.to(q_ptr.dtype.element_ty), mask=live)
    tl.store(s_ptr + row + gs * s_group_stride, scale, mask=gs < groups)


def silu_mul_quantised(gate_up: torch.Tensor, group: int, rows: int,
                       cfg: KernelConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul_quantised_reference` in one pass, padded to `rows` rows with zeros, the scales group-major (as
    `cublas_matmul` reads them): the activation is never written in bf16 and read back."""
    M, two_inner = gate_up.shape
    inner = two_inner // 2
    groups = triton.cdiv(inner, group)
    values = torch.empty(rows, inner, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty(groups, rows, dtype=torch.float32, device=gate_up.device).t()
    tile_groups = cfg.fp8_quantise_tile[1]
    _silu_mul_quantised_kernel[(rows, triton.cdiv(groups, tile_groups))](
        gate_up, values, scale, M, inner, groups, gate_up.stride(0), scale.stride(1), GROUPS=tile_groups,
        GROUP=group, num_warps=cfg.fp8_quantise_tile[2])
    return values, scale


@functools.lru_cache(maxsize=None)
def cublas_block_scaled_works(device: torch.device) -> bool:
    """Whether `linear_cublas` runs on this device and agrees with the reference (a small probe, once a device:
    torch built without it, a GPU before sm90 or an older cuBLAS raise)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(70, 512, device=device, generator=gen).to(torch.bfloat16)
    # Any FP8 values and block scales will do: the probe compares the GEMM with the reference on the same weight.
    values = torch.randn(256, 512, device=device, generator=gen) * 64
    weight = Fp8Weight(values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn),
                       torch.rand(2, 4, device=device, generator=gen) * 1e-3 + 1e-4, 128)
    try:
        got = linear_cublas(x, weight).float()
    except (RuntimeError, NotImplementedError):
        return False
    want = linear_w8a8_reference(x, weight).float()
    return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()))


@triton.jit
def _dequantise_kernel(values_ptr, scale_ptr, out_ptr, N, K, scale_cols, BLOCK: tl.constexpr):
    """One BLOCK x BLOCK tile of the weight: its FP8 values times the tile's scale, in fp32, stored in out's dtype
    (rounded once, as `Fp8Weight.dequantise` does)."""
    i, j = tl.program_id(0), tl.program_id(1)
    rows = i * BLOCK + tl.arange(0, BLOCK)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    offsets = rows.to(tl.int64)[:, None] * K + cols[None, :]
    v = tl.load(values_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + i * scale_cols + j)
    tl.store(out_ptr + offsets, (v * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantised(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype` (`Fp8Weight.dequantise`'s values), in one pass over its bytes and no fp32 copy."""
    n, k = weight.shape
    b = weight.block
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    _dequantise_kernel[(triton.cdiv(n, b), triton.cdiv(k, b))](weight.values, weight.scale, out, n, k,
                                                                 weight.scale.shape[1], BLOCK=b)
    return out


def linear_dequantised(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x @ weight^T on cuBLAS's GEMM in x's dtype, over the weight dequantised for this call (a prefill's
    projection: the GEMM's work dwarfs the dequantising pass, and the output is the dequantised model's)."""
    return x @ dequantised(weight, x.dtype).t()


def linear(x: torch.Tensor, weight: Fp8Weight, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    """The FP8 projection: W8A16 up to DECODE_ROWS rows, above by `KernelConfig.fp8_prefill` ("dequant",
    "w8a16", "cublas" or "w8a8"; "cublas" falls back to "w8a8" for a weight `cublas_takes` refuses, and takes
    every weight it can above `KernelConfig.fp8_few_rows` rows); an fp32 model (tests) stays W8A16."""
    if takes_cublas(x, weight, cfg):
        return linear_cublas(x, weight, cfg)
    if x.shape[0] > DECODE_ROWS and x.dtype != torch.float32:
        if cfg.fp8_prefill == "dequant":
            return linear_dequantised(x, weight)
        if cfg.fp8_prefill in ("w8a8", "cublas"):
            return linear_w8a8(x, weight, cfg)
    return linear_w8a16(x, weight, cfg)
