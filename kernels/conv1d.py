"""Causal depthwise conv1d + SiLU over the conv state [S+1, K-1, C]: the torch references, then the Triton kernels
for decode and packed prefill."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from .triton_or_absent import tl, triton

from .config import DEFAULT, KernelConfig
from .launch import _pow2, pdl_options, wait_for_previous_kernel


# Torch references


def slot_rows(slots: torch.Tensor, trash: int) -> torch.Tensor:
    """Map slot -1 (padding) to the pool's trash entry."""
    return torch.where(slots < 0, torch.full_like(slots, trash), slots)


def conv1d_prefill_reference(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Causal depthwise conv (kernel K) + SiLU over packed requests, each continuing from its slot's conv state.

    x [T, C]; weight [C, K]; conv_state [S+1, K-1, C], updated in place with each request's last K-1 inputs.
    """
    K = weight.shape[1]
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    w = weight.float().t().flip(0)  # [K, C]: row j multiplies the input j steps back
    for r, slot in enumerate(slots.tolist()):
        start, stop = bounds[r], bounds[r + 1]
        window = torch.cat([conv_state[slot].to(x.dtype), x[start:stop]], dim=0).float()  # [K-1+L, C]
        L = stop - start
        acc = torch.zeros(L, x.shape[1], dtype=torch.float32, device=x.device)
        for j in range(K):
            acc += w[j] * window[K - 1 - j : K - 1 - j + L]
        out[start:stop] = F.silu(acc).to(x.dtype)
        conv_state[slot] = window[L:].to(conv_state.dtype)
    return out


def conv1d_decode_reference(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token per row: x [N, C]; conv_state [S+1, K-1, C] read and written in place through `slots` (-1: none)."""
    rows = slot_rows(slots, conv_state.shape[0] - 1)
    window = torch.cat([conv_state.index_select(0, rows).to(x.dtype), x[:, None]], dim=1)  # [N, K, C]
    acc = (window.float() * weight.float().t()[None]).sum(1)
    conv_state.index_copy_(0, rows, window[:, 1:].to(conv_state.dtype))
    return F.silu(acc).to(x.dtype)


def conv1d_verify_reference(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                            conv_steps: torch.Tensor, slots: torch.Tensor, kept: torch.Tensor,
                            tokens: int) -> torch.Tensor:
    """A speculative verify step: x [R*T, C] holds T tokens a row (row-major), run one after another as decode
    tokens from the state after the first `kept` tokens of the row's last verify step (`gdn.roll_back`); the state
    after each of the first T - 1 goes to conv_steps [S+1, T-1, K-1, C] (slot -1: its trash entry), the state
    after the last to conv_state."""
    from .gdn import roll_back

    roll_back(conv_state, conv_steps, slots, kept, tokens)
    outs = []
    for t in range(tokens):
        outs.append(conv1d_decode_reference(x[t::tokens], weight, conv_state, slots))
        if t < tokens - 1:
            rows = slot_rows(slots, conv_state.shape[0] - 1)
            conv_steps[slot_rows(slots, conv_steps.shape[0] - 1), t] = conv_state[rows]
    return torch.stack(outs, dim=1).flatten(0, 1)


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


def conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                  cfg: KernelConfig = DEFAULT):
    N, C = x.shape
    K = weight.shape[1]
    out = torch.empty_like(x)
    BLOCK_C = 256
    if x.stride(1) != 1:
        x = x.contiguous()
    _conv1d_decode_kernel[(N, triton.cdiv(C, BLOCK_C))](
        x, weight, conv_state, slots, out, C, x.stride(0), conv_state.shape[0] - 1, K=K, BLOCK_C=BLOCK_C,
        **pdl_options(x.device, cfg.pdl))
    return out


# A verify step's T tokens a row in one program per (row, block of channels): the window slides over the row's
# tokens in registers, and the window after each of the first T - 1 tokens is stored to the step pool.


@triton.jit
def _conv1d_verify_kernel(x_ptr, w_ptr, state_ptr, steps_ptr, slot_ptr, kept_ptr, out_ptr, C, x_row_stride, trash,
                          steps_trash, T: tl.constexpr, K: tl.constexpr, BLOCK_C: tl.constexpr,
                          PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < C
    slot = tl.load(slot_ptr + row)  # written by the host before the step: safe before the wait
    wait_for_previous_kernel(PDL)
    step_slot = tl.where(slot < 0, steps_trash, slot).to(tl.int64)
    slot = tl.where(slot < 0, trash, slot).to(tl.int64)
    base = state_ptr + slot * (K - 1) * C
    # The window of the last K - 1 inputs, oldest first, as K - 1 register rows (K is 4 in every Qwen3.5 size),
    # after the last step's first `kept` tokens: from its steps entry (read before this program writes it) or the
    # slot; one of each pair of loads is masked off whole.
    kept = tl.load(kept_ptr + row)
    back = steps_ptr + ((step_slot * (T - 1) + tl.minimum(kept - 1, T - 2)) * (K - 1)) * C
    kept_cols = cols * 0 + kept  # masks of the columns' shape (a scalar in a mask is not taken everywhere)
    here, there = mask & (kept_cols >= T), mask & (kept_cols < T)
    w0 = tl.load(base + cols, mask=here, other=0.0) + tl.load(back + cols, mask=there, other=0.0)
    w1 = w0
    w2 = w0
    if K > 2:
        w1 = tl.load(base + C + cols, mask=here, other=0.0) + tl.load(back + C + cols, mask=there, other=0.0)
    if K > 3:
        w2 = tl.load(base + 2 * C + cols, mask=here, other=0.0) + tl.load(back + 2 * C + cols, mask=there, other=0.0)
    for t in tl.static_range(T):
        x = tl.load(x_ptr + (row * T + t) * x_row_stride + cols, mask=mask, other=0.0)
        acc = x.to(tl.float32) * tl.load(w_ptr + cols * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
        acc += w0.to(tl.float32) * tl.load(w_ptr + cols * K, mask=mask, other=0.0).to(tl.float32)
        if K > 2:
            acc += w1.to(tl.float32) * tl.load(w_ptr + cols * K + 1, mask=mask, other=0.0).to(tl.float32)
        if K > 3:
            acc += w2.to(tl.float32) * tl.load(w_ptr + cols * K + 2, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + (row * T + t) * C + cols, (acc / (1.0 + tl.exp(-acc))).to(out_ptr.dtype.element_ty),
                 mask=mask)
        x = x.to(state_ptr.dtype.element_ty)
        if K == 2:
            w0 = x
        elif K == 3:
            w0, w1 = w1, x
        else:
            w0, w1, w2 = w1, w2, x
        dst = base if t == T - 1 else steps_ptr + ((step_slot * (T - 1) + t) * (K - 1)) * C
        tl.store(dst + cols, w0, mask=mask)
        if K > 2:
            tl.store(dst + C + cols, w1, mask=mask)
        if K > 3:
            tl.store(dst + 2 * C + cols, w2, mask=mask)


def conv1d_verify(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, conv_steps: torch.Tensor,
                  slots: torch.Tensor, kept: torch.Tensor, tokens: int, cfg: KernelConfig = DEFAULT):
    """`conv1d_verify_reference` in one launch (K from 2 to 4)."""
    N, C = x.shape
    K = weight.shape[1]
    if not 2 <= K <= 4:
        raise ValueError(f"the verify conv takes kernels of 2 to 4 taps, not {K}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(N, C, dtype=x.dtype, device=x.device)
    BLOCK_C = 256
    _conv1d_verify_kernel[(N // tokens, triton.cdiv(C, BLOCK_C))](
        x, weight, conv_state, conv_steps, slots, kept, out, C, x.stride(0), conv_state.shape[0] - 1,
        conv_steps.shape[0] - 1, T=tokens, K=K, BLOCK_C=BLOCK_C, **pdl_options(x.device, cfg.pdl))
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


@triton.jit(do_not_specialize=["T", "R"])  # they change every step: one compiled variant for all
def _conv1d_prefill_kernel(x_ptr, w_ptr, state_ptr, cu_ptr, slot_ptr, out_ptr, T, C, R, x_row_stride,
                           K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    """A tile whose every token is K - 1 or more past its request's first reads only the chunk's inputs: most
    tiles of a long prompt; the others take each window row from the input or, before the chunk, the conv state."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = t < T
    req = _request_of(t, cu_ptr, R, BLOCK_R)
    start = tl.load(cu_ptr + req, mask=live, other=0)
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    cmask = cols < C
    m = live[:, None] & cmask[None, :]
    x_rows = x_ptr + t.to(tl.int64)[:, None] * x_row_stride + cols[None, :]
    if tl.min(tl.where(live, t - start, K), axis=0) >= K - 1:
        for j in tl.static_range(K):  # input j steps back, weight column K-1-j
            xv = tl.load(x_rows - j * x_row_stride, mask=m, other=0.0)
            w = tl.load(w_ptr + cols * K + (K - 1 - j), mask=cmask, other=0.0).to(tl.float32)
            acc += xv.to(tl.float32) * w[None, :]
    else:
        slot = tl.load(slot_ptr + req, mask=live, other=0).to(tl.int64)
        for j in tl.static_range(K):
            inside = t - j >= start
            xv = tl.load(x_rows - j * x_row_stride, mask=m & inside[:, None], other=0.0)
            row = K - 1 + t - j - start  # row of the conv state when the input predates the chunk
            sv = tl.load(state_ptr + (slot * (K - 1) + row)[:, None] * C + cols[None, :], mask=m & ~inside[:, None],
                         other=0.0).to(xv.dtype)
            w = tl.load(w_ptr + cols * K + (K - 1 - j), mask=cmask, other=0.0).to(tl.float32)
            acc += tl.where(inside[:, None], xv, sv).to(tl.float32) * w[None, :]
    tl.store(out_ptr + t[:, None] * C + cols[None, :], (acc / (1.0 + tl.exp(-acc))).to(out_ptr.dtype.element_ty),
             mask=m)


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
                   slots: torch.Tensor, cfg: KernelConfig = DEFAULT) -> torch.Tensor:
    T, C = x.shape
    K, R = weight.shape[1], slots.shape[0]
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    block_t, block_c, warps = cfg.conv1d_prefill_tile
    _conv1d_prefill_kernel[(triton.cdiv(T, block_t), triton.cdiv(C, block_c))](
        x, weight, conv_state, cu_seqlens, slots, out, T, C, R, x.stride(0),
        K=K, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_R=max(16, _pow2(R)), num_warps=warps)
    _conv1d_state_kernel[(R, triton.cdiv(C, 128))](
        x, conv_state, cu_seqlens, slots, C, x.stride(0), K=K, BLOCK_K=max(2, _pow2(K - 1)), BLOCK_C=128)
    return out
