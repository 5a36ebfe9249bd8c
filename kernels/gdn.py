"""Gated DeltaNet: the torch references (recurrent and chunked forms), then the Triton decode step and the chunked
prefill."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from .triton_or_absent import OutOfResources, tl, triton


from .config import DEFAULT, GDN_FACTOR_MODES, KernelConfig
from .conv1d import slot_rows
from .launch import _dot_bf16, _pow2, multiprocessors, pdl_options, wait_for_previous_kernel

log = logging.getLogger(__name__)


# Torch references


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

    @staticmethod
    def layout(cu_seqlens: list[int]) -> tuple[list[int], list[int]]:
        """(spans flattened as start, end, start, end, ...; first) on the host."""
        spans, first = [], [0]
        for s0, e in zip(cu_seqlens, cu_seqlens[1:]):
            for s in range(s0, e, GDN_CHUNK):
                spans += (s, min(s + GDN_CHUNK, e))
            first.append(len(spans) // 2)
        return spans, first

    @classmethod
    def build(cls, cu_seqlens: list[int], device) -> "GdnChunks":
        spans, first = cls.layout(cu_seqlens)
        return cls(torch.tensor(spans, dtype=torch.int32, device=device).reshape(-1, 2),
                   torch.tensor(first, dtype=torch.int32, device=device))


def gdn_prefill_reference(
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
        if s == e:  # an empty request (a padded batch's padding, when the chunk fills the bucket)
            continue
        out[s:e], ssm_state[slot] = gdn_chunked(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], ssm_state[slot])
    return out.to(mixed.dtype)


def gdn_decode_reference(
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


def roll_back(state: torch.Tensor, steps: torch.Tensor, slots: torch.Tensor, kept: torch.Tensor,
              tokens: int) -> None:
    """Each slot's state becomes the one after the first `kept` tokens (1 .. T) of the last verify step: its
    steps entry kept - 1, or, for T, the slot's own. One layer's pool [E, ...] and steps [S+1, T-1, ...]."""
    rows, step_rows = slot_rows(slots, state.shape[0] - 1), slot_rows(slots, steps.shape[0] - 1)
    rolled = (kept < tokens).view((-1,) + (1,) * (state.dim() - 1))
    state[rows] = torch.where(rolled, steps[step_rows, (kept - 1).clamp(max=tokens - 2)], state[rows])


def roll_back_pool_reference(pool: torch.Tensor, steps: torch.Tensor, slots: torch.Tensor, kept: torch.Tensor,
                             tokens: int) -> None:
    """`roll_back` over every layer of a pool [L, E, ...] with its steps [L, S+1, T-1, ...], a layer at a time (all
    at once, the temporaries are three pools' worth of the rows)."""
    for layer, layer_steps in zip(pool, steps):
        roll_back(layer, layer_steps, slots, kept, tokens)


def gdn_verify_reference(mixed, a, b, A_log, dt_bias, ssm_state, ssm_steps, slots, kept, tokens: int,
                         num_k_heads: int, head_k_dim: int, head_v_dim: int) -> torch.Tensor:
    """A speculative verify step: T tokens a row (row-major [R*T, ...]), one recurrent step each, from the state
    after the first `kept` tokens of the row's last verify step (`roll_back`); the state after each of the first
    T - 1 goes to ssm_steps [S+1, T-1, Hv, dk, dv] (slot -1: its trash entry), the state after the last to
    ssm_state."""
    roll_back(ssm_state, ssm_steps, slots, kept, tokens)
    outs = []
    for t in range(tokens):
        outs.append(gdn_decode_reference(mixed[t::tokens], a[t::tokens], b[t::tokens], A_log, dt_bias, ssm_state,
                                         slots, num_k_heads, head_k_dim, head_v_dim))
        if t < tokens - 1:
            rows = slot_rows(slots, ssm_state.shape[0] - 1)
            ssm_steps[slot_rows(slots, ssm_steps.shape[0] - 1), t] = ssm_state[rows]
    return torch.stack(outs, dim=1).flatten(0, 1)


# ---------------------------------------------------------------------------------------------------------------------
# Gated DeltaNet decode: one token per row; q/k l2-norm, gates, the delta-rule update and the read fused.
# Program (row, value head, block of dv): the state tile [dk, BLOCK_V] stays in registers for the whole step.


@triton.jit
def _gdn_token(mixed_ptr, a_ptr, b_ptr, token, h, hk, ks, vs, kmask, vmask, C, ab_row_stride, dt_bias, decay_rate,
               scale, DK: tl.constexpr, DV: tl.constexpr, KEY_DIM: tl.constexpr):
    """One token's recurrence inputs for value head h: l2-normed q (scaled) and k, v, the state's decay exp(g) and
    the write strength beta (the decode and the verify kernels' shared prologue)."""
    q = tl.load(mixed_ptr + token * C + hk * DK + ks, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(mixed_ptr + token * C + KEY_DIM + hk * DK + ks, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(mixed_ptr + token * C + 2 * KEY_DIM + h * DV + vs, mask=vmask, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    a = tl.load(a_ptr + token * ab_row_stride + h).to(tl.float32) + dt_bias
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + token * ab_row_stride + h).to(tl.float32)))
    return q, k, v, tl.exp(decay_rate * softplus), beta


@triton.jit
def _gdn_program(alog_ptr, dtb_ptr, slot_ptr, GROUP, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    """A decode or verify program's row, value head and its key head, its dk and dv index ranges with their masks,
    the head's dt bias and decay rate, and the row's slot (written by the host before the step: safe to read
    before the wait for the previous kernel)."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    decay_rate = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    return row, h, h // GROUP, ks, vs, ks < DK, vs < DV, dt_bias, decay_rate, tl.load(slot_ptr + row)


@triton.jit
def _gdn_decode_kernel(mixed_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr, out_ptr,
                       C, ab_row_stride, trash, HV, GROUP, scale,
                       DK: tl.constexpr, DV: tl.constexpr, KEY_DIM: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False):
    row, h, hk, ks, vs, kmask, vmask, dt_bias, decay_rate, slot = _gdn_program(
        alog_ptr, dtb_ptr, slot_ptr, GROUP, DK, DV, BLOCK_K, BLOCK_V)
    wait_for_previous_kernel(PDL)
    q, k, v, decay, beta = _gdn_token(mixed_ptr, a_ptr, b_ptr, row, h, hk, ks, vs, kmask, vmask, C, ab_row_stride,
                                      dt_bias, decay_rate, scale, DK, DV, KEY_DIM)
    slot = tl.where(slot < 0, trash, slot).to(tl.int64)
    sptr = state_ptr + ((slot * HV + h) * DK + ks[:, None]) * DV + vs[None, :]
    smask = kmask[:, None] & vmask[None, :]
    S = tl.load(sptr, mask=smask, other=0.0) * decay
    predicted = tl.sum(S * k[:, None], axis=0)
    u = (v - predicted) * beta
    S = S + k[:, None] * u[None, :]
    tl.store(sptr, S, mask=smask)
    o = tl.sum(S * q[:, None], axis=0)
    tl.store(out_ptr + (row * HV + h) * DV + vs, o.to(out_ptr.dtype.element_ty), mask=vmask)


def gdn_decode(mixed, a, b, A_log, dt_bias, ssm_state, slots, num_k_heads: int, head_k_dim: int, head_v_dim: int,
               cfg: KernelConfig = DEFAULT, block_v: int = 64, num_warps: int = 4):
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
        BLOCK_K=_pow2(head_k_dim), BLOCK_V=BLOCK_V, num_warps=num_warps, **pdl_options(mixed.device, cfg.pdl),
    )
    return out


# A verify step's T tokens a row in one program per (row, value head, block of dv): the state tile stays in
# registers across the tokens; after each of the first T - 1 it is stored to the step pool, after the last to the
# slot. One read of the state and T writes, where T decode steps read and write it T times.


@triton.jit
def _gdn_verify_kernel(mixed_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, steps_ptr, slot_ptr, kept_ptr, out_ptr,
                       C, ab_row_stride, trash, steps_trash, HV, GROUP, scale, T: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, KEY_DIM: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = False):
    row, h, hk, ks, vs, kmask, vmask, dt_bias, decay_rate, slot = _gdn_program(
        alog_ptr, dtb_ptr, slot_ptr, GROUP, DK, DV, BLOCK_K, BLOCK_V)
    wait_for_previous_kernel(PDL)
    step_slot = tl.where(slot < 0, steps_trash, slot).to(tl.int64)
    slot = tl.where(slot < 0, trash, slot).to(tl.int64)
    tile = (ks[:, None] * DV + vs[None, :])
    smask = kmask[:, None] & vmask[None, :]
    sptr = state_ptr + (slot * HV + h) * DK * DV + tile
    # The roll-back: the state after the last step's first `kept` tokens, from its steps entry or the slot (one of
    # the two loads is masked off whole). This program reads its tile of the entry before it writes it.
    kept = tl.load(kept_ptr + row)
    back = steps_ptr + ((step_slot * (T - 1) + tl.minimum(kept - 1, T - 2)) * HV + h) * DK * DV + tile
    kept_tile = tile * 0 + kept  # masks of the tile's shape (a scalar in a mask is not taken everywhere)
    S = tl.load(sptr, mask=smask & (kept_tile >= T), other=0.0) + tl.load(back, mask=smask & (kept_tile < T),
                                                                           other=0.0)
    for t in tl.static_range(T):
        token = row * T + t
        q, k, v, decay, beta = _gdn_token(mixed_ptr, a_ptr, b_ptr, token, h, hk, ks, vs, kmask, vmask, C,
                                          ab_row_stride, dt_bias, decay_rate, scale, DK, DV, KEY_DIM)
        S = S * decay
        u = (v - tl.sum(S * k[:, None], axis=0)) * beta
        S = S + k[:, None] * u[None, :]
        if t < T - 1:
            tl.store(steps_ptr + ((step_slot * (T - 1) + t) * HV + h) * DK * DV + tile, S, mask=smask)
        else:
            tl.store(sptr, S, mask=smask)
        o = tl.sum(S * q[:, None], axis=0)
        tl.store(out_ptr + (token * HV + h) * DV + vs, o.to(out_ptr.dtype.element_ty), mask=vmask)


def gdn_verify(mixed, a, b, A_log, dt_bias, ssm_state, ssm_steps, slots, kept, tokens: int, num_k_heads: int,
               head_k_dim: int, head_v_dim: int, cfg: KernelConfig = DEFAULT, block_v: int = 64, num_warps: int = 4):
    """`gdn_verify_reference` in one launch."""
    N, C = mixed.shape
    HV = a.shape[1]
    out = torch.empty(N, HV, head_v_dim, dtype=mixed.dtype, device=mixed.device)
    BLOCK_V = min(block_v, _pow2(head_v_dim))
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        a, b = a.contiguous(), b.contiguous()
    _gdn_verify_kernel[(N // tokens, HV, triton.cdiv(head_v_dim, BLOCK_V))](
        mixed.contiguous(), a, b, A_log, dt_bias, ssm_state, ssm_steps, slots, kept, out,
        C, a.stride(0), ssm_state.shape[0] - 1, ssm_steps.shape[0] - 1, HV, HV // num_k_heads, head_k_dim**-0.5,
        T=tokens, DK=head_k_dim, DV=head_v_dim, KEY_DIM=num_k_heads * head_k_dim,
        BLOCK_K=_pow2(head_k_dim), BLOCK_V=BLOCK_V, num_warps=num_warps, **pdl_options(mixed.device, cfg.pdl),
    )
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
#   some 600 MB), and made the whole 13% faster there, 8% at the 4B heads.

CHUNK = GDN_CHUNK


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
    # thread (347 against 264-269 us at the 27B heads, docs/benchmarks/log/kernels.md).
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


def _dot_width(n: int) -> int:
    """A tile dimension that a `tl.dot` contracts over: a power of two, and at least the 16 that Triton's NVIDIA
    backend requires (masked beyond n), so heads narrower than 16 (a key head dim of 8) compile."""
    return max(16, _pow2(n))


def gdn_scan_config(requests: int, v_heads: int, dv: int, device: torch.device, factors: str = "bf16",
                    cfg: KernelConfig = DEFAULT) -> tuple[int, int, int]:
    """The state pass's tile: narrow blocks while every program runs at once, wide ones once programs take turns."""
    if factors == "fp32":
        return cfg.gdn_scan_fp32_factors
    if requests * v_heads * triton.cdiv(dv, cfg.gdn_scan_narrow[0]) <= multiprocessors(device):
        return cfg.gdn_scan_narrow
    return cfg.gdn_scan_wide


def gdn_prefill(mixed, a, b, A_log, dt_bias, ssm_state, cu_seqlens, slots, num_k_heads: int, head_k_dim: int,
                head_v_dim: int, chunks: GdnChunks | None = None, cfg: KernelConfig = DEFAULT, scan_config=None,
                prep_config=None, factors: str | None = None):
    """Same contract as gdn_prefill_reference (chunked WY GDN from each request's slot state). Without `chunks`
    (the forward passes its batch's) the chunk layout is built here, reading `cu_seqlens` back from the device.
    `scan_config`, `prep_config` and `factors` override gdn_scan_config's choice, cfg.gdn_prep and cfg.gdn_factors
    (the benchmark sweeps them)."""
    mixed = mixed.contiguous()
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        a, b = a.contiguous(), b.contiguous()
    if _PREFILL_FALLBACK:
        return gdn_prefill_reference(mixed, a, b, A_log, dt_bias, ssm_state, cu_seqlens, slots, num_k_heads,
                                     head_k_dim, head_v_dim)
    chunks = chunks or GdnChunks.build(cu_seqlens.tolist(), mixed.device)
    try:
        return _gdn_prefill_triton(mixed, a, b, A_log, dt_bias, ssm_state, slots, num_k_heads, chunks, head_k_dim,
                                   head_v_dim, scan_config, prep_config or cfg.gdn_prep,
                                   factors or ("fp32" if mixed.dtype == torch.float32 else cfg.gdn_factors), cfg)
    except OutOfResources as exc:  # a capability gate, decided once per process
        log.warning("Triton chunked GDN prefill does not fit this GPU (%s); using the torch chunked form", exc)
        _PREFILL_FALLBACK.append(True)
        return gdn_prefill_reference(mixed, a, b, A_log, dt_bias, ssm_state, cu_seqlens, slots, num_k_heads,
                                     head_k_dim, head_v_dim)


_PREFILL_FALLBACK: list[bool] = []


def _gdn_prefill_triton(mixed, a, b, A_log, dt_bias, ssm_state, slots, num_k_heads, chunks, dk, dv, scan_config,
                        prep_config, factors, cfg):
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
        BH=_dot_width(min(prep_config[2], max(dk, dv))), PRECISION=precision, BF16_FACTORS=factors == "bf16",
        num_warps=prep_config[0], num_stages=prep_config[1], maxnreg=prep_config[3])
    block_v, warps, stages = scan_config or gdn_scan_config(requests, HV, dv, dev, factors, cfg)
    BVB = min(block_v, _pow2(dv))
    out = torch.empty(T, HV, dv, dtype=dt, device=dev)
    _gdn_chunk_scan_out_kernel[(requests, HV, triton.cdiv(dv, BVB))](
        mixed, kscale, qscale, w, kd, P, glast, chunk_table, req_chunks, slots, ssm_state, out, ssm_state.shape[0] - 1,
        HV=HV, GROUP=HV // num_k_heads, DK=dk, DV=dv, KEY_DIM=num_k_heads * dk, BT=CHUNK, BK=_dot_width(dk), BVB=BVB,
        PRECISION=precision, BF16_FACTORS=factors == "bf16", num_warps=warps, num_stages=stages)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# A one-token step after a verify step: each row's GDN state (conv or recurrent pool) back to what that step kept.
# A row that kept every token (a promoted row, or one after a one-token step: most of them) costs nothing; the
# reference reads and writes every row's state whole.


@triton.jit
def _roll_back_pool_kernel(pool_ptr, steps_ptr, slot_ptr, kept_ptr, numel, entries, step_entries,
                           T: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    wait_for_previous_kernel(PDL)
    kept = tl.load(kept_ptr + row)
    if kept < T:
        slot = tl.load(slot_ptr + row)
        step_slot = tl.where(slot < 0, step_entries - 1, slot).to(tl.int64)
        slot = tl.where(slot < 0, entries - 1, slot).to(tl.int64)
        src = steps_ptr + ((layer * step_entries + step_slot) * (T - 1) + tl.minimum(kept - 1, T - 2)) * numel
        dst = pool_ptr + (layer * entries + slot) * numel
        offs = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def roll_back_pool(pool: torch.Tensor, steps: torch.Tensor, slots: torch.Tensor, kept: torch.Tensor, tokens: int,
                   cfg: KernelConfig = DEFAULT) -> None:
    """`roll_back_pool_reference` in one launch, copying only the rows that roll back."""
    if not (pool.is_contiguous() and steps.is_contiguous()):
        raise ValueError("roll_back_pool needs contiguous pools")
    layers, entries = pool.shape[:2]
    numel = pool[0, 0].numel()
    BLOCK = 4096
    grid = (slots.shape[0], layers, triton.cdiv(numel, BLOCK))
    if grid[0] and layers:
        _roll_back_pool_kernel[grid](pool, steps, slots, kept, numel, entries, steps.shape[1], T=tokens, BLOCK=BLOCK,
                                     **pdl_options(pool.device, cfg.pdl))
