"""Torch reference ops for the Qwen3.5 forward: the CPU path, and the oracle every Triton kernel is tested against.

Conventions shared with the Triton kernels (same signatures, so the forward swaps one for the other):
- Token tensors are packed over requests: [T, ...], with `cu_seqlens` [R+1] offsets for prefill.
- State pools carry one extra "trash" entry at the end (slot -1 and padding rows map there), so a padding row
  reads and writes only memory no request owns, with no data-dependent branching (CUDA-graph safe).
- Conv state per slot is [K-1, C]: the last K-1 pre-conv inputs, channel-contiguous.
- Recurrent (GDN) state per slot is [Hv, dk, dv] in fp32.
- Paged KV per attention layer is [num_pages + 1, page_size, n_kv_heads, D]; `slot_mapping` holds each token's
  flat index page * page_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------------------------------
# Norms


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32.
    weight None: (1 + w) is already folded into the projection that reads the norm (model/forward.py)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * (1.0 + weight.float())
    return out.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in the model dtype, as the reference does), then the zero-centred norm of the sum (weight
    None: folded into the next projection).

    Returns (normed, new residual). With residual None the input itself becomes the residual.
    """
    summed = x if residual is None else residual + x
    return rms_norm(summed, weight, eps), summed


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm with a plain weight: w * norm(o) * silu(z), normalised in fp32 over the last dim."""
    of = o.float()
    normed = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return ((weight * normed).float() * F.silu(z.float())).to(o.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The MLP activation on a fused [gate | up] projection: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A projection: x [T, K] @ weight [N, K]^T."""
    return x @ weight.t()


def add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's input: `add_rms_norm`, then the projection that reads it. Returns (projected, new residual)."""
    normed, residual = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight), residual


def add_rms_norm_gate_up(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
    gate_up: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLP's input: `add_rms_norm`, the fused [gate | up] projection, silu(gate) * up. Returns (activation,
    new residual)."""
    normed, residual = add_rms_norm(x, residual, norm_weight, eps)
    return silu_mul(linear(normed, gate_up)), residual


# ---------------------------------------------------------------------------------------------------------------------
# Causal depthwise conv1d + SiLU


def slot_rows(slots: torch.Tensor, trash: int) -> torch.Tensor:
    """Map slot -1 (padding) to the pool's trash entry."""
    return torch.where(slots < 0, torch.full_like(slots, trash), slots)


def conv1d_prefill(
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


def conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token per row: x [N, C]; conv_state [S+1, K-1, C] read and written in place through `slots` (-1: none)."""
    rows = slot_rows(slots, conv_state.shape[0] - 1)
    window = torch.cat([conv_state.index_select(0, rows).to(x.dtype), x[:, None]], dim=1)  # [N, K, C]
    acc = (window.float() * weight.float().t()[None]).sum(1)
    conv_state.index_copy_(0, rows, window[:, 1:].to(conv_state.dtype))
    return F.silu(acc).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias); both fp32, [T, Hv]."""
    beta = torch.sigmoid(b.float())
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, beta


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)


def gdn_split_qkv(mixed: torch.Tensor, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int):
    """Split the post-conv [q | k | v] channels; q and k l2-normalised (q also scaled by dk^-0.5), all fp32.

    q, k come back expanded to the value heads: value head h reads key head h // (Hv / Hk).
    """
    T = mixed.shape[0]
    kd = num_k_heads * head_k_dim
    q, k, v = mixed.split([kd, kd, num_v_heads * head_v_dim], dim=-1)
    q = l2_normalize(q.reshape(T, num_k_heads, head_k_dim)) * head_k_dim**-0.5
    k = l2_normalize(k.reshape(T, num_k_heads, head_k_dim))
    group = num_v_heads // num_k_heads
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    return q, k, v.reshape(T, num_v_heads, head_v_dim).float()


def gdn_recurrent(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule for one sequence (the ground truth for the chunked form).

    q, k [L, Hv, dk]; v [L, Hv, dv]; g, beta [L, Hv]; state [Hv, dk, dv] fp32. Returns (o [L, Hv, dv], new state).
    """
    S = state.float().clone()
    out = []
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[t], S)
        u = (v[t] - predicted) * beta[t][:, None]
        S = S + k[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], S))
    return torch.stack(out), S


def gdn_chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (WY) form of `gdn_recurrent` for one sequence: same arguments, same results.

    Within a chunk with cumulative log-decay c_i, the corrections u solve the unit lower-triangular system
    (I + A) U = diag(beta) V - diag(beta * exp(c)) K S0, with A_ij = beta_i exp(c_i - c_j) k_i.k_j for j < i.
    """
    L, H, dk = k.shape
    pad = (-L) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))  # beta 0: padding writes nothing
    n = (L + pad) // chunk
    # [H, n, C, d] and [H, n, C]
    q, k, v = (x.float().reshape(n, chunk, H, -1).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.float().reshape(n, chunk, H).permute(2, 0, 1) for x in (g, beta))
    c = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # exp(c_i - c_j), j <= i
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(chunk, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * c.exp())[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w, kd = solved.split([v.shape[-1], dk], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay  # intra-chunk q_i.k_j exp(c_i - c_j), j <= i
    q_decayed = q * c.exp()[..., None]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]
    S = state.float().clone()
    out = torch.empty_like(v)
    for i in range(n):
        u = w[:, i] - kd[:, i] @ S
        out[:, i] = q_decayed[:, i] @ S + attn[:, i] @ u
        S = S * c[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    out = out.permute(1, 2, 0, 3).reshape(n * chunk, H, -1)[:L]
    return out, S


GDN_CHUNK = 64  # tokens per chunk of the chunked GDN form (the Triton kernels' tile)


@dataclass
class GdnChunks:
    """A prefill batch's GDN chunks, laid out on the host once when the batch is built, so that no layer reads the
    lengths back from the device: `spans` [n, 2] int32 holds each chunk's (start, end) in the packed batch, and
    request r owns chunks first[r] .. first[r + 1] - 1 (`first` [R + 1] int32)."""

    spans: torch.Tensor
    first: torch.Tensor

    @classmethod
    def build(cls, cu_seqlens: list[int], device) -> "GdnChunks":
        spans, first = [], [0]
        for s0, e in zip(cu_seqlens, cu_seqlens[1:]):
            spans.extend((s, min(s + GDN_CHUNK, e)) for s in range(s0, e, GDN_CHUNK))
            first.append(len(spans))
        return cls(torch.tensor(spans, dtype=torch.int32, device=device).reshape(-1, 2),
                   torch.tensor(first, dtype=torch.int32, device=device))


def gdn_prefill(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    chunks: GdnChunks | None = None,
) -> torch.Tensor:
    """Chunked GDN over packed requests from their slots' states; final states written back (fp32).

    mixed [T, C] post-conv [q|k|v]; a, b [T, Hv]; ssm_state [S+1, Hv, dk, dv]. Returns o [T, Hv, dv] in mixed's dtype.
    `chunks` (the batch's chunk layout) is for the Triton kernels; this loop reads `cu_seqlens` itself.
    """
    num_v_heads = a.shape[1]
    q, k, v = gdn_split_qkv(mixed, num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    out = torch.empty(mixed.shape[0], num_v_heads, head_v_dim, dtype=torch.float32, device=mixed.device)
    bounds = cu_seqlens.tolist()
    for r, slot in enumerate(slots.tolist()):
        s, e = bounds[r], bounds[r + 1]
        out[s:e], ssm_state[slot] = gdn_chunked(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], ssm_state[slot])
    return out.to(mixed.dtype)


def gdn_decode(
    mixed: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> torch.Tensor:
    """One recurrent step for each row, state read and written in place through `slots` (-1: the trash entry)."""
    num_v_heads = a.shape[1]
    q, k, v = gdn_split_qkv(mixed, num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    rows = slot_rows(slots, ssm_state.shape[0] - 1)
    S = ssm_state.index_select(0, rows) * torch.exp(g)[..., None, None]
    u = (v - torch.einsum("nhk,nhkv->nhv", k, S)) * beta[..., None]
    S = S + k[..., None] * u[:, :, None, :]
    ssm_state.index_copy_(0, rows, S)
    return torch.einsum("nhk,nhkv->nhv", q, S).to(mixed.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Attention: partial RoPE, paged KV, gated softmax attention


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


def qk_norm_rope_cache(
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
    return rope_and_cache(rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps), v, positions, cos, sin, k_cache,
                          v_cache, slot_mapping)


def apply_output_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated attention: o * sigmoid(gate), in fp32, rounded once."""
    return (o.float() * torch.sigmoid(gate.float())).to(o.dtype)


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one request, [length, n_kv, D]."""
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached context plus themselves (paged KV).

    q [T, nH, D]; the new tokens' K/V must already be in the cache. context_lens [R]: tokens before this chunk.
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
        out[s:e] = torch.einsum("hts,shd->thd", probs, values).to(q.dtype)
    return out


def decode_attention(
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
