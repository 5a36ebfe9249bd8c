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


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs (token t's j-th choice is pair t * k + j) in expert order, each expert's padded to a multiple of
    block_m: (pair of each padded row, -1 for padding [blocks * block_m]; expert of each block, num_experts or more
    for a block past the last or of pairs whose id is outside [0, num_experts) [blocks]). `blocks` is the most the
    pairs can fill, whatever the routing."""
    flat = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts).flatten()
    num_experts += 1  # the pairs no expert here takes, grouped last
    pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    blocks = -(-pairs // block_m) + min(num_experts, pairs)
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


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, cfg: KernelConfig = DEFAULT):
    """`route_reference` with the router's projection on our kernels (torch's softmax and top-k: graph-safe)."""
    probs = torch.softmax(linear(x, router, cfg).float(), dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True)).to(x.dtype), ids


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
