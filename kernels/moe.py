"""The mixture-of-experts block of Qwen3.5 MoE (35B-A3B, 122B-A10B, 397B-A17B): the router, the routed experts and
the gated shared expert, as torch references (the semantics of transformers' `qwen3_5_moe`).

Layouts, one rank's: the router `gate` [E, H] and the shared expert's gate [1, H] whole; the experts as two 3-D
tensors, `gate_up` [E, 2I, H] (each expert's gate rows, then its up rows) and `down` [E, H, I], I the rank's share
of each expert's intermediate width; the shared expert's fused [gate | up] [2S, H] and down [H, S]. Under tensor
parallelism the block's output is a partial sum, reduced once after it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import DEFAULT, KernelConfig
from .fp8 import Fp8Weight
from .gemv import linear, linear_reference
from .launch import _dot_bf16
from .norm import add_rms_norm, add_rms_norm_reference, silu_mul, silu_mul_reference
from .triton_or_absent import tl, triton


def route_reference(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights: the router's logits (in the model dtype), a softmax in fp32 over all
    experts, the top k (ties as `torch.topk` breaks them), renormalised to sum 1, cast to the model dtype.
    Returns (weights [T, k], expert ids [T, k] long)."""
    probs = torch.softmax(linear_reference(x, router).float(), dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True)).to(x.dtype), ids


def experts_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j], summed in the model dtype expert by
    expert as the reference does; a pair whose id is not one of the experts held (outside [0, E): another rank's,
    under expert parallelism) adds nothing. Each expert the tokens chose is found on the host: not for CUDA
    graphs."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        if not 0 <= e < gate_up.shape[0]:
            continue
        token, slot = torch.where(ids == e)
        act = silu_mul_reference(linear_reference(x[token], gate_up[e]))
        out.index_add_(0, token, linear_reference(act, down[e]) * weights[token, slot, None])
    return out


def moe_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, router: torch.Tensor,
    top_k: int, gate_up: torch.Tensor, down: torch.Tensor, shared_gate_up: torch.Tensor, shared_down: torch.Tensor,
    shared_gate: torch.Tensor, expert_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block: its input add-and-norm, the routed experts, plus the shared expert scaled by
    sigmoid(shared_gate(x)) (before a row-parallel all-reduce). Returns (output, new residual). `expert_start`:
    the first expert held (expert parallelism: the others' pairs are other ranks' share of the sum)."""
    normed, residual = add_rms_norm_reference(x, residual, norm_weight, eps)
    weights, ids = route_reference(normed, router, top_k)
    routed = experts_reference(normed, weights, ids - expert_start, gate_up, down)
    shared = linear_reference(silu_mul_reference(linear_reference(normed, shared_gate_up)), shared_down)
    return routed + F.sigmoid(linear_reference(normed, shared_gate)) * shared, residual


# ---------------------------------------------------------------------------------------------------------------------
# Triton: the routed experts as two grouped GEMMs over the token-expert pairs grouped by expert on the device (no
# host sync, shapes fixed by the token count: a CUDA graph holds them). Each expert's pairs are padded to a multiple
# of BLOCK_M, so a program's rows all read one expert's weights, which each program of that expert reads once; a
# decode step's programs read only the experts its tokens chose. The gate_up kernel applies silu(gate) * up in its
# epilogue; the down kernel scales each pair by its routing weight; the k pairs of a token are summed in fp32.


def _most_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks `pairs` pairs fill, whatever the routing: pairs / block_m, plus a part-filled block for each
    expert they reach and for the pairs of none of those held (another rank's, under expert parallelism)."""
    return -(-pairs // block_m) + min(num_experts + 1, pairs)


def group_by_expert_reference(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (token t's j-th choice is pair t * k + j) grouped by expert, each expert's padded to a multiple of
    block_m: (pair of each padded row, -1 for padding [blocks * block_m]; expert of each block, num_experts or more
    for a block past the last or of pairs whose id is outside [0, num_experts) [blocks], `_most_blocks` of them).
    In torch ops, graph-safe (fifteen kernels a layer: `group_by_expert` takes two)."""
    flat = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts).flatten()
    num_experts += 1  # the pairs no expert here takes, grouped last
    pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    blocks = _most_blocks(pairs, num_experts - 1, block_m)
    block_expert = torch.searchsorted(ends, torch.arange(blocks, device=device) * block_m, right=True)
    order = torch.sort(flat, stable=True).indices
    expert = flat[order]
    rank = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert]
    row_pair = torch.full((blocks * block_m,), -1, dtype=torch.long, device=device)
    row_pair[(ends - padded)[expert] + rank] = order
    return row_pair, block_expert.to(torch.int32)


@triton.jit
def _dot(a, b, acc, BF16: tl.constexpr):
    if BF16:
        return _dot_bf16(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _scaled_dot(a, w_ptrs, mask, scale_ptr, acc, FP8: tl.constexpr, BF16: tl.constexpr):
    """acc + a @ the weight tile; an FP8 tile (all in one block of its scale) widened, its partial sum scaled."""
    w = tl.load(w_ptrs, mask=mask, other=0.0)
    if FP8:
        part = _dot(a, w.to(tl.float32), tl.zeros(acc.shape, dtype=tl.float32), BF16)
        return acc + part * tl.load(scale_ptr)
    return _dot(a, w, acc, BF16)


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, scale_ptr, row_pair_ptr, block_expert_ptr, act_ptr, H, I, E, SN, SK,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SCALE_BLOCK: tl.constexpr, FP8: tl.constexpr, BF16: tl.constexpr):
    block, tile = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + block).to(tl.int64)
    if e >= E:
        return
    pair = tl.load(row_pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair >= 0
    token = tl.where(valid, pair // TOP_K, 0)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w = w_ptr + e * 2 * I * H
    scales = scale_ptr + e * SN * SK
    n0 = tile * BLOCK_N
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + k
        a = tl.load(x_ptr + token[:, None] * H + kk[None, :], mask=valid[:, None] & (kk[None, :] < H), other=0.0)
        wmask = (kk[:, None] < H) & (n[None, :] < I)
        gate = _scaled_dot(a, w + n[None, :] * H + kk[:, None], wmask,
                           scales + (n0 // SCALE_BLOCK) * SK + k0 // SCALE_BLOCK, gate, FP8, BF16)
        up = _scaled_dot(a, w + (I + n[None, :]) * H + kk[:, None], wmask,
                         scales + ((I + n0) // SCALE_BLOCK) * SK + k0 // SCALE_BLOCK, up, FP8, BF16)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(act_ptr + pair[:, None] * I + n[None, :], act.to(act_ptr.dtype.element_ty),
             mask=valid[:, None] & (n[None, :] < I))


@triton.jit
def _moe_down_kernel(act_ptr, w_ptr, scale_ptr, weight_ptr, row_pair_ptr, block_expert_ptr, out_ptr, H, I, E, SN,
                     SK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SCALE_BLOCK: tl.constexpr, FP8: tl.constexpr, BF16: tl.constexpr):
    block, tile = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert_ptr + block).to(tl.int64)
    if e >= E:
        return
    pair = tl.load(row_pair_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair >= 0
    safe = tl.where(valid, pair, 0)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w = w_ptr + e * H * I
    scales = scale_ptr + e * SN * SK + (tile * BLOCK_N // SCALE_BLOCK) * SK
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        kk = k0 + k
        a = tl.load(act_ptr + safe[:, None] * I + kk[None, :], mask=valid[:, None] & (kk[None, :] < I), other=0.0)
        acc = _scaled_dot(a, w + n[None, :] * I + kk[:, None], (kk[:, None] < I) & (n[None, :] < H),
                          scales + k0 // SCALE_BLOCK, acc, FP8, BF16)
    acc *= tl.load(weight_ptr + safe, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + safe[:, None] * H + n[None, :], acc, mask=valid[:, None] & (n[None, :] < H))


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            cfg: KernelConfig = DEFAULT, others: bool = False) -> torch.Tensor:
    """`experts_reference` on the device, graph-safe: each chosen expert's weights read once a step. others: some
    ids may be outside the experts held (expert parallelism), pairs that then add nothing."""
    (T, top_k), (E, two_i, H) = ids.shape, gate_up.shape
    inner = two_i // 2
    block_m, block_n, block_k, warps, stages = cfg.moe_tile
    row_pair, block_expert = group_by_expert(ids, E, block_m)
    blocks = block_expert.numel()
    act = torch.empty(T * top_k, inner, dtype=x.dtype, device=x.device)
    common = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BF16=x.dtype == torch.bfloat16,
                  num_warps=warps, num_stages=stages)
    gu, gu_scale, gu_grid, fp8 = _weight_args(gate_up, block_n, block_k, inner)
    _moe_gate_up_kernel[(blocks, triton.cdiv(inner, block_n))](
        x.contiguous(), gu, gu_scale, row_pair, block_expert, act, H, inner, E, *gu_grid, TOP_K=top_k,
        SCALE_BLOCK=gate_up.block if fp8 else 1, FP8=fp8, **common)
    pairs = (torch.zeros if others else torch.empty)(T * top_k, H, dtype=torch.float32, device=x.device)
    dw, dw_scale, dw_grid, fp8 = _weight_args(down, block_n, block_k, H)
    _moe_down_kernel[(blocks, triton.cdiv(H, block_n))](
        act, dw, dw_scale, weights.contiguous(), row_pair, block_expert, pairs, H, inner, E, *dw_grid,
        SCALE_BLOCK=down.block if fp8 else 1, FP8=fp8, **common)
    return pairs.view(T, top_k, H).sum(1).to(x.dtype)


def _weight_args(w, block_n: int, block_k: int, rows: int):
    """(values, scales, (scale rows, scale columns), whether FP8) of an expert tensor for the kernels. An FP8 one
    needs each weight tile within one scale block: BLOCK_N and BLOCK_K dividing the block, and the up rows (from
    `rows`, the gate's count) starting on a tile."""
    if not isinstance(w, Fp8Weight):
        return w, w, (0, 0), False
    if w.block % block_n or w.block % block_k or rows % block_n:
        raise ValueError(f"FP8 experts of {w.block}-blocks need tiles dividing the block and {rows} rows a whole "
                         f"number of {block_n}-row tiles (KernelConfig.moe_tile)")
    return w.values, w.scale, tuple(w.scale.shape[1:]), True


@triton.jit
def _route_kernel(logits_ptr, weight_ptr, ids_ptr, E, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """A token's softmax over its router logits in fp32, its top k (exact ties to the lower id: torch.topk leaves
    their order unspecified), renormalised."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + row * E + offs, mask=offs < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    p = tl.where(offs < E, p / tl.sum(p, 0), -1.0)
    slot = tl.arange(0, BLOCK_K)
    top = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), 0)
        top = tl.where(slot == j, best, top)
        chosen = tl.where(slot == j, idx, chosen)
        p = tl.where(offs == idx, -1.0, p)
    tl.store(ids_ptr + row * TOP_K + slot, chosen, mask=slot < TOP_K)
    tl.store(weight_ptr + row * TOP_K + slot, (top / tl.sum(top, 0)).to(weight_ptr.dtype.element_ty),
             mask=slot < TOP_K)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, cfg: KernelConfig = DEFAULT):
    """`route_reference`: the router's projection on our kernels, then the rest in one kernel."""
    logits = linear(x, router, cfg)
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(T, top_k, dtype=torch.long, device=x.device)
    _route_kernel[(T,)](logits, weights, ids, E, TOP_K=top_k, BLOCK_E=triton.next_power_of_2(E),
                        BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)
    return weights, ids


@triton.jit
def _count_kernel(ids_ptr, cursor_ptr, block_expert_ptr, row_pair_ptr, P, E, BLOCKS, BLOCK_M: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program: each expert's pairs counted (ids outside [0, E) in bucket E), padded to BLOCK_M; each expert's
    first row left in `cursor` for `_place_kernel`, each block's expert (E + 1 and up past the last), every row
    emptied (-1)."""
    bins = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        offs = p0 + tl.arange(0, BLOCK_P)
        e = tl.load(ids_ptr + offs, mask=offs < P, other=0)
        e = tl.where((e >= 0) & (e < E), e, E).to(tl.int32)
        counts += tl.histogram(tl.where(offs < P, e, BLOCK_E - 1), BLOCK_E)
    counts = tl.where(bins <= E, counts, 0)  # padding lanes counted in the last bin, which no expert is
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + bins, ends - padded, mask=bins <= E)
    for b0 in range(0, BLOCKS, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        starts = (b * BLOCK_M).to(tl.int32)
        past = (tl.where(bins <= E, ends, 2**30)[None, :] <= starts[:, None]).to(tl.int32)
        tl.store(block_expert_ptr + b, tl.sum(past, 1), mask=b < BLOCKS)
    for r0 in range(0, BLOCKS * BLOCK_M, BLOCK_P):
        r = r0 + tl.arange(0, BLOCK_P)
        tl.store(row_pair_ptr + r, tl.full([BLOCK_P], -1, tl.int64), mask=r < BLOCKS * BLOCK_M)


@triton.jit
def _place_kernel(ids_ptr, cursor_ptr, row_pair_ptr, P, E, BLOCK_P: tl.constexpr):
    """Each pair to the next free row of its expert's (the order within an expert is free: a row's output is its
    own)."""
    offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    e = tl.load(ids_ptr + offs, mask=offs < P, other=0)
    e = tl.where((e >= 0) & (e < E), e, E)
    row = tl.atomic_add(cursor_ptr + e, 1, mask=offs < P)
    tl.store(row_pair_ptr + row, offs.to(tl.int64), mask=offs < P)


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_by_expert_reference` in two kernels (a pair's row within its expert's may differ)."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    blocks = _most_blocks(pairs, num_experts, block_m)
    cursor = torch.empty(num_experts + 1, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
    row_pair = torch.empty(blocks * block_m, dtype=torch.long, device=ids.device)
    _count_kernel[(1,)](flat, cursor, block_expert, row_pair, pairs, num_experts, blocks, BLOCK_M=block_m,
                        BLOCK_P=1024, BLOCK_E=triton.next_power_of_2(num_experts + 2), BLOCK_B=16, num_warps=8)
    _place_kernel[(triton.cdiv(pairs, 1024),)](flat, cursor, row_pair, pairs, num_experts, BLOCK_P=1024,
                                               num_warps=4)
    return row_pair, block_expert


def moe(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, router: torch.Tensor,
    top_k: int, gate_up: torch.Tensor, down: torch.Tensor, shared_gate_up: torch.Tensor, shared_down: torch.Tensor,
    shared_gate: torch.Tensor, expert_start: int = 0, cfg: KernelConfig = DEFAULT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_reference` on our kernels."""
    normed, residual = add_rms_norm(x, residual, norm_weight, eps, cfg)
    weights, ids = route(normed, router, top_k, cfg)
    others = expert_start > 0 or gate_up.shape[0] < router.shape[0]
    routed = experts(normed, weights, ids - expert_start if expert_start else ids, gate_up, down, cfg, others)
    shared = linear(silu_mul(linear(normed, shared_gate_up, cfg), cfg), shared_down, cfg)
    return routed + torch.sigmoid(linear(normed, shared_gate, cfg)) * shared, residual
