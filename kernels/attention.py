"""Gated attention over the paged KV cache: partial RoPE and the cache write, decode (split-K) and prefill (flash)
attention. The torch references, then the Triton kernels."""

from __future__ import annotations

import torch
from .triton_or_absent import tl, triton

from .config import DEFAULT, KernelConfig
from .launch import _pow2, multiprocessors, pdl_options, rows_per_program, wait_for_previous_kernel
from .norm import rms_norm_reference


# Torch references


def rope_tables(rotary_dim: int, theta: float, max_positions: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, rotary_dim // 2] in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq[None]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half on the first rotary_dim dims of each head. x [T, heads, D]."""
    half = cos.shape[1]
    c, s = cos[positions][:, None], sin[positions][:, None]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    rotated = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    return rotated.to(x.dtype)


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k, write k and v into the paged cache at `slot_mapping`; returns the rotated q."""
    q = apply_rope(q, positions, cos, sin)
    k = apply_rope(k, positions, cos, sin)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Views of a fused [q_proj | k_proj | v_proj] row: query and gate [T, nH, D] (each head's q_proj rows are
    [query | gate]), k and v [T, nKV, D]."""
    T, D = qkv.shape[0], head_dim
    qg = qkv[:, : num_heads * 2 * D].view(T, num_heads, 2 * D)
    k = qkv[:, num_heads * 2 * D : (num_heads * 2 + num_kv_heads) * D].view(T, num_kv_heads, D)
    v = qkv[:, (num_heads * 2 + num_kv_heads) * D :].view(T, num_kv_heads, D)
    return qg[..., :D], qg[..., D:], k, v


def qk_norm_rope_cache_reference(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """From the fused projection: q_norm/k_norm, RoPE, the paged K/V write; returns the rotated query [T, nH, D]."""
    q, _, k, v = split_qkv(qkv, num_heads, num_kv_heads, q_norm.shape[0])
    return rope_and_cache(rms_norm_reference(q, q_norm, eps), rms_norm_reference(k, k_norm, eps), v, positions, cos, sin, k_cache,
                          v_cache, slot_mapping)


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one request, [length, n_kv, D]."""
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached context plus themselves (paged KV), times
    sigmoid(gate) when given (gated attention, before the output is rounded).

    q, gate [T, nH, D]; the new tokens' K/V must already be in the cache. context_lens [R]: tokens before this chunk.
    """
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    page_size = k_cache.shape[1]
    bounds, contexts = cu_seqlens.tolist(), context_lens.tolist()
    for r in range(len(contexts)):
        s, e = bounds[r], bounds[r + 1]
        total = contexts[r] + (e - s)
        pages = page_table[r, : (total + page_size - 1) // page_size].long()
        keys = _gather_pages(k_cache, pages, total).float().repeat_interleave(group, dim=1)
        values = _gather_pages(v_cache, pages, total).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q[s:e].float(), keys) * scale
        query_pos = torch.arange(contexts[r], total, device=q.device)[:, None]
        mask = torch.arange(total, device=q.device)[None, :] > query_pos
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        o = torch.einsum("hts,shd->thd", probs, values)
        if gate is not None:
            o = o * torch.sigmoid(gate[s:e].float())
        out[s:e] = o.to(q.dtype)
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per row over its first seq_lens[n] cached tokens, times sigmoid(gate) when given.
    q, gate [N, nH, D]; page_table [N, P]."""
    N, nH, D = q.shape
    n_kv = k_cache.shape[2]
    group = nH // n_kv
    keys = k_cache[page_table.long()].reshape(N, -1, n_kv, D).float()  # [N, P*page, n_kv, D]
    values = v_cache[page_table.long()].reshape(N, -1, n_kv, D).float()
    qg = q.float().reshape(N, n_kv, group, D)
    scores = torch.einsum("nkgd,nskd->nkgs", qg, keys) * scale
    positions = torch.arange(keys.shape[1], device=q.device)
    scores = scores.masked_fill(positions[None, None, None, :] >= seq_lens[:, None, None, None], float("-inf"))
    out = torch.einsum("nkgs,nskd->nkgd", scores.softmax(-1), values).reshape(N, nH, D)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    return out.to(q.dtype)


# From the fused q/k/v projection: q_norm/k_norm, partial RoPE (NeoX rotate-half on the first rotary dims) and
# the paged K/V write. Program (token block, head): ROWS tokens of one head (`launch.rows_per_program`: one in
# decode, several in a prefill).


@triton.jit
def _qk_norm_rope_cache_kernel(qkv_ptr, qn_ptr, kn_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, map_ptr, qo_ptr,
                               T, row_stride, NQ, NKV, eps, HALF: tl.constexpr, D: tl.constexpr,
                               BLOCK_D: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    head = tl.program_id(1)
    tmask = t < T
    pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    mask = tmask[:, None] & dmask[None, :]
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    rot = d < 2 * HALF
    idx = tl.where(rot, d % HALF, 0)[None, :]
    rot_mask = tmask[:, None] & rot[None, :]
    c = tl.load(cos_ptr + pos * HALF + idx, mask=rot_mask, other=1.0)
    s = tl.load(sin_ptr + pos * HALF + idx, mask=rot_mask, other=0.0)
    s = tl.where((d < HALF)[None, :], -s, s)
    rows = qkv_ptr + t[:, None] * row_stride
    if head < NQ:
        src = rows + head * 2 * D  # each q_proj head is [query | gate]
        w_ptr = qn_ptr
    else:
        src = rows + NQ * 2 * D + (head - NQ) * D
        w_ptr = kn_ptr
    x = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
    normed = x * inv * (1.0 + tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32))[None, :]
    normed = normed.to(qo_ptr.dtype.element_ty).to(tl.float32)  # the norm's output is in the model dtype
    pmask = tmask[:, None] & (rot & dmask)[None, :]
    xp = tl.load(src + partner[None, :], mask=pmask, other=0.0).to(tl.float32)
    normed_p = xp * inv * (1.0 + tl.load(w_ptr + partner, mask=rot & dmask, other=0.0).to(tl.float32))[None, :]
    normed_p = normed_p.to(qo_ptr.dtype.element_ty).to(tl.float32)
    y = tl.where(rot[None, :], normed * c + normed_p * s, normed)
    if head < NQ:
        tl.store(qo_ptr + ((t * NQ + head) * D)[:, None] + d[None, :], y.to(qo_ptr.dtype.element_ty), mask=mask)
    else:
        kh = head - NQ
        dest = (tl.load(map_ptr + t, mask=tmask, other=0).to(tl.int64) * NKV + kh) * D
        tl.store(kc_ptr + dest[:, None] + d[None, :], y.to(kc_ptr.dtype.element_ty), mask=mask)
        vv = tl.load(rows + NQ * 2 * D + NKV * D + kh * D + d[None, :], mask=mask, other=0.0)
        tl.store(vc_ptr + dest[:, None] + d[None, :], vv.to(vc_ptr.dtype.element_ty), mask=mask)


def qk_norm_rope_cache(qkv, q_norm, k_norm, eps, positions, cos, sin, k_cache, v_cache, slot_mapping,
                       num_heads: int, num_kv_heads: int, cfg: KernelConfig = DEFAULT):
    T, D = qkv.shape[0], q_norm.shape[0]
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    out = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    heads, block = num_heads + num_kv_heads, _pow2(D)
    rows = rows_per_program(T * heads, block, qkv.device)
    _qk_norm_rope_cache_kernel[(triton.cdiv(T, rows), heads)](
        qkv, q_norm, k_norm, positions, cos, sin, k_cache, v_cache, slot_mapping, out, T, qkv.stride(0),
        num_heads, num_kv_heads, eps, HALF=cos.shape[1], D=D, BLOCK_D=block, ROWS=rows,
        **pdl_options(qkv.device, cfg.pdl))
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
def _times_sigmoid_gate(out, gate_ptrs, mask):
    """Gated attention: out * sigmoid(gate), in fp32 (the gate is a view into the q projection's output)."""
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    return out / (1.0 + tl.exp(-gate))


@triton.jit
def _merge_splits_kernel(part_o_ptr, part_ml_ptr, out_ptr, gate_ptr, counts_ptr, NH, gate_row_stride,
                         gate_head_stride, D: tl.constexpr, SPLITS: tl.constexpr, HAS_GATE: tl.constexpr,
                         HAS_COUNTS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                         PDL: tl.constexpr = False):
    """HAS_COUNTS: row i has counts[i] parts (the first of them); a row of one part was written whole already."""
    wait_for_previous_kernel(PDL)
    rh = tl.program_id(0).to(tl.int64)  # row * NH + head
    parts = SPLITS
    todo = True
    if HAS_COUNTS:
        parts = tl.load(counts_ptr + rh // NH)
        todo = parts > 1
    if todo:
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        smask, dmask = s < parts, d < D
        m = tl.load(part_ml_ptr + (rh * SPLITS + s) * 2, mask=smask, other=float("-inf"))
        l = tl.load(part_ml_ptr + (rh * SPLITS + s) * 2 + 1, mask=smask, other=0.0)
        m_all = tl.max(m, axis=0)
        w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)
        o = tl.load(part_o_ptr + (rh * SPLITS + s[:, None]) * D + d[None, :], mask=smask[:, None] & dmask[None, :],
                    other=0.0)
        total = tl.sum(o * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        if HAS_GATE:
            total = _times_sigmoid_gate(
                total, gate_ptr + (rh // NH) * gate_row_stride + (rh % NH) * gate_head_stride + d, dmask)
        tl.store(out_ptr + rh * D + d, total.to(out_ptr.dtype.element_ty), mask=dmask)


DECODE_ATTN_BLOCK_N = 64  # cached tokens per iteration
MAX_DECODE_SPLITS = 64


def decode_splits(rows: int, kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Splits per (row, kv head): enough programs for two per multiprocessor, no more than the longest
    possible context can use."""
    wanted = _pow2(triton.cdiv(2 * multiprocessors(device), rows * kv_heads))
    return max(1, min(wanted, MAX_DECODE_SPLITS, triton.cdiv(max_tokens, DECODE_ATTN_BLOCK_N)))


def decode_attention(q, k_cache, v_cache, page_table, seq_lens, scale: float, gate=None, cfg: KernelConfig = DEFAULT,
                     splits: int | None = None):
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
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, **pdl_options(q.device, cfg.pdl),
    )
    out = torch.empty_like(q)
    if gate is not None and gate.stride(2) != 1:
        gate = gate.contiguous()
    _merge_splits_kernel[(N * NH,)](
        part_o, part_ml, out, gate if gate is not None else out, out, NH, gate.stride(0) if gate is not None else 0,
        gate.stride(1) if gate is not None else 0, D=D, SPLITS=splits, HAS_GATE=gate is not None, HAS_COUNTS=False,
        BLOCK_S=_pow2(splits), BLOCK_D=_pow2(D), **pdl_options(q.device, cfg.pdl))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Prefill attention (flash attention over paged KV): packed variable-length chunks, each causal over its cached
# context plus itself. Program (query head, query block); request r owns program blocks from cu[r] // BLOCK_M + r,
# which leaves room for its cdiv(len, BLOCK_M) blocks without a host-side block table.


@triton.jit
def _prefill_attn_keys(acc, m_i, l_i, q, kc_ptr, vc_ptr, table_row_ptr, n_lo, n_hi, kv_end, q_pos, kvh, NKV, scale,
                       d, dmask, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       PRECISION: tl.constexpr, MASKED: tl.constexpr, SPLITS: tl.constexpr):
    """The online softmax over keys [n_lo, n_hi). MASKED = False: whole blocks every query of the block sees (the
    cached context and the chunk's keys before the block), so no causal or bounds mask; True: the diagonal and a
    ragged last block."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            k_live = k_pos < kv_end
            page = tl.load(table_row_ptr + k_pos // PAGE, mask=k_live, other=0).to(tl.int64)
        else:
            page = tl.load(table_row_ptr + k_pos // PAGE).to(tl.int64)
        kv_at = ((page * PAGE + k_pos % PAGE) * NKV + kvh) * D
        k_ptrs = kc_ptr + kv_at[:, None] + d[None, :]
        v_ptrs = vc_ptr + kv_at[:, None] + d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=k_live[:, None] & dmask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=k_live[:, None] & dmask[None, :], other=0.0)
        elif BLOCK_D == D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=dmask[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=dmask[None, :], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # times scale: log2 units (scale has log2(e))
        if MASKED:
            visible = (k_pos[None, :] <= q_pos[:, None]) & k_live[None, :]
            scores = tl.where(visible, scores * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
        else:  # scale > 0: the row maximum scales with the scores, and the scale folds into exp2's argument (FMA)
            m_new = tl.maximum(m_i, tl.max(scores, 1) * scale)
        m_use = m_new
        if MASKED and SPLITS > 1:  # a split's keys may all lie after a query (no split but the first sees key 0)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        if MASKED:
            probs = tl.exp2(scores - m_use[:, None])
        else:
            probs = tl.exp2(scores * scale - m_use[:, None])
        l_i = l_i * alpha + tl.sum(probs, 1)
        acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _store_attn_out(out_ptr, acc, l_i, m_idx, q_live, head, NH, d, dmask, gate_ptr, gate_row_stride,
                    gate_head_stride, D: tl.constexpr, HAS_GATE: tl.constexpr):
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if HAS_GATE:
        rows = gate_ptr + m_idx.to(tl.int64)[:, None] * gate_row_stride + head * gate_head_stride
        out = _times_sigmoid_gate(out, rows + d[None, :], q_live[:, None] & dmask[None, :])
    tl.store(out_ptr + (m_idx.to(tl.int64)[:, None] * NH + head) * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_live[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["R", "table_width", "split_keys"])  # they change every step: one variant for all
def _prefill_attn_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, cu_ptr, ctx_ptr, out_ptr, part_o_ptr, part_ml_ptr,
                         row_splits_ptr, gate_ptr, R, NH, NKV, table_width, q_row_stride, gate_row_stride,
                         gate_head_stride, scale, split_keys, GROUP: tl.constexpr, D: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, SPLITS: tl.constexpr,
                         HAS_GATE: tl.constexpr):
    """SPLITS > 1: a request with a cached context shares each block's keys out over cdiv(context, split_keys)
    programs, at most SPLITS (a fresh prompt's blocks are short and many: it keeps one); each stores its
    unnormalised output and (max, sum) in natural-log units into the parts, which `_merge_splits_kernel` adds, and
    the first the request's count for its rows (a row of one program is stored whole, and the merge passes it)."""
    # Heads vary fastest and query blocks run last to first: within a request the later blocks see the most keys,
    # so the heaviest programs start first and the light ones fill the tail; a block's heads of one K/V group run
    # side by side and read the same keys.
    head, split = tl.program_id(0), tl.program_id(2)
    p = tl.num_programs(1) - 1 - tl.program_id(1)
    rs = tl.arange(0, BLOCK_R)
    first_block = tl.load(cu_ptr + rs, mask=rs < R, other=0) // BLOCK_M + rs
    r = tl.sum(((first_block <= p) & (rs < R)).to(tl.int32), 0) - 1
    start, stop = tl.load(cu_ptr + r), tl.load(cu_ptr + r + 1)
    q0 = start + (p - (start // BLOCK_M + r)) * BLOCK_M  # this program's block within request r
    ctx = tl.load(ctx_ptr + r)
    parts = 1
    if SPLITS > 1:
        parts = tl.minimum(tl.maximum(tl.cdiv(ctx, split_keys), 1), SPLITS)
    if (q0 < stop) & (split < parts):
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
        share = tl.cdiv(tl.cdiv(kv_end, parts), BLOCK_N) * BLOCK_N
        kv_start = split * share
        kv_end = tl.minimum(kv_end, kv_start + share)
        # Keys up to the block's first query are seen by all its queries: whole blocks of them need no mask.
        seen_by_all = tl.minimum((ctx + q0 - start + 1) // BLOCK_N * BLOCK_N, kv_end)
        table_row_ptr = table_ptr + r.to(tl.int64) * table_width
        acc, m_i, l_i = _prefill_attn_keys(acc, m_i, l_i, q, kc_ptr, vc_ptr, table_row_ptr, kv_start, seen_by_all,
                                           kv_end, q_pos, kvh, NKV, scale, d, dmask, D, PAGE, BLOCK_N, BLOCK_D,
                                           PRECISION, False, SPLITS)
        acc, m_i, l_i = _prefill_attn_keys(acc, m_i, l_i, q, kc_ptr, vc_ptr, table_row_ptr,
                                           tl.maximum(kv_start, seen_by_all), kv_end, kv_end, q_pos, kvh, NKV, scale,
                                           d, dmask, D, PAGE, BLOCK_N, BLOCK_D, PRECISION, True, SPLITS)
        if SPLITS > 1:
            if split == 0:
                tl.store(row_splits_ptr + m_idx, tl.full([BLOCK_M], 0, tl.int32) + parts, mask=q_live)
            if parts > 1:
                base = (m_idx.to(tl.int64) * NH + head) * SPLITS + split
                tl.store(part_o_ptr + base[:, None] * D + d[None, :], acc, mask=q_live[:, None] & dmask[None, :])
                tl.store(part_ml_ptr + base * 2, m_i * 0.6931471805599453, mask=q_live)  # log2 units to natural
                tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=q_live)
            else:
                _store_attn_out(out_ptr, acc, l_i, m_idx, q_live, head, NH, d, dmask, gate_ptr, gate_row_stride,
                                gate_head_stride, D, HAS_GATE)
        else:
            _store_attn_out(out_ptr, acc, l_i, m_idx, q_live, head, NH, d, dmask, gate_ptr, gate_row_stride,
                            gate_head_stride, D, HAS_GATE)


# A request's keys are shared out over one more program for every PREFILL_SPLIT_KEYS cached keys (up to
# KernelConfig.prefill_attention_splits): a chat's later turn, a 1025-token chunk after 7.6k cached keys, ran its
# attention 1.50x faster over four programs than over one, while a fresh 1024-token prompt ran 1.46x slower over
# two (H100, `log/gpu-2026-12-06.md`).
PREFILL_SPLIT_KEYS = 2048


def prefill_attention(q, k_cache, v_cache, page_table, cu_seqlens, context_lens, scale: float, gate=None,
                      cfg: KernelConfig = DEFAULT, config=None, splits: int | None = None,
                      split_keys: int = PREFILL_SPLIT_KEYS):
    """Same contract as prefill_attention_reference; no host synchronisation, no score matrix in memory. The gate
    is applied as the output is stored (apart, in torch, its fp32 passes cost the 4B's 8k-token prefill 4.3 ms).
    `config` overrides cfg.prefill_attention_tile (the benchmark sweeps it). A chunk after a long cached context
    has too few query blocks to fill the GPU, each over the whole context: its blocks' keys are shared out over up
    to `splits` programs (cfg.prefill_attention_splits, then one wherever the grid fills the GPU twice anyway), one
    for every `split_keys` cached keys of its request, whose parts a second kernel merges."""
    T_, NH, D = q.shape
    NKV, PAGE = k_cache.shape[2], k_cache.shape[1]
    R = context_lens.shape[0]
    block_m, block_n, warps, stages = config or (
        cfg.prefill_attention_tile_fp32 if q.dtype == torch.float32 else cfg.prefill_attention_tile)
    if splits is None:
        full_grid = (T_ // block_m + R) * NH >= 2 * multiprocessors(q.device)
        splits = 1 if full_grid else cfg.prefill_attention_splits
    out = torch.empty(T_, NH, D, dtype=q.dtype, device=q.device)
    part_o = part_ml = row_splits = out  # unread with one split
    if splits > 1:
        part_o = torch.empty(T_, NH, splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(T_, NH, splits, 2, dtype=torch.float32, device=q.device)
        row_splits = torch.ones(T_, dtype=torch.int32, device=q.device)  # padding rows: nothing to merge
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    if gate is not None and gate.stride(2) != 1:
        gate = gate.contiguous()
    gate_row_stride, gate_head_stride = gate.stride()[:2] if gate is not None else (0, 0)
    _prefill_attn_kernel[(NH, T_ // block_m + R, splits)](
        q, k_cache, v_cache, page_table, cu_seqlens, context_lens, out, part_o, part_ml, row_splits,
        gate if gate is not None else out, R, NH, NKV, page_table.shape[1], q.stride(0), gate_row_stride,
        gate_head_stride, scale * 1.4426950408889634, split_keys, GROUP=NH // NKV, D=D, PAGE=PAGE, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=_pow2(D), BLOCK_R=max(16, _pow2(R + 1)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLITS=splits, HAS_GATE=gate is not None,
        num_warps=warps, num_stages=stages)
    if splits > 1:
        _merge_splits_kernel[(T_ * NH,)](part_o, part_ml, out, gate if gate is not None else out, row_splits, NH,
                                         gate_row_stride, gate_head_stride, D=D, SPLITS=splits,
                                         HAS_GATE=gate is not None, HAS_COUNTS=True, BLOCK_S=_pow2(splits),
                                         BLOCK_D=_pow2(D))
    return out
