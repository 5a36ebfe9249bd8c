"""Sampling on the GPU in four Triton passes, drawing the same tokens as `kernels.sampling.sample`.

The reference keeps, per row, a prefix of the vocabulary sorted by scaled logit s = logit / T (top-k, then top-p
on the top-k distribution, then min-p) and races the kept ids with counter-based uniforms: argmax p / -log u,
i.e. argmax (s - max s) - log(-log u). No full sort is needed for that:

1. stats   (row x split): max and sum-exp of the raw logits (for logprobs) and of s; the argmax (greedy).
2. hist    (row x split): rows with top-k or top-p count their ids in bins of d = max s - s, 1/16 nat wide.
3. gather  (row x split): from the bin counts, the first bin by which the kept prefix must have ended (the k-th
           id for top-k; for top-p a lower bound on the mass reaches top_p; min-p's cut-off) bounds a small
           candidate set, which is copied out; rows with neither filter race every id above min-p directly.
4. finish  (row): sort the candidates, apply top-k / top-p / min-p exactly as the reference does, race.

A row whose candidate set would exceed MAX_CANDIDATES (a very flat distribution under top-p, say) is flagged,
and the caller samples that row with the reference. Nothing here synchronises with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .sampling import SamplingTensors, apply_penalties, sample, top_logprobs

BINS = tl.constexpr(512)
BINS_PER_NAT = tl.constexpr(16)  # bins cover d in [0, 32) nats; the last bin also holds everything further out
MAX_CANDIDATES = 2048
MAX_SPLITS = 32  # programs per row in the passes over the vocabulary (a runtime count up to this)
BLOCK = 1024


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed_ptr, step_ptr, row):
    """The per-row half of `counter_uniform`'s hash, in wrapping uint32 arithmetic."""
    seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
    step = tl.load(step_ptr + row).to(tl.uint64, bitcast=True)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = (seed >> 32).to(tl.uint32)
    return _mix32(lo ^ _mix32((step & 0xFFFFFFFF).to(tl.uint32) * 0x9E3779B9)) ^ hi


@triton.jit
def _race_key(d, ids, row_key):
    """(s - max s) - log(-log u): the exponential race in the log domain (d = s - max s)."""
    bits = _mix32(row_key + ids.to(tl.uint32) * 0x27D4EB2F)
    u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return d - tl.log(-tl.log(u))


@triton.jit
def _bin_of(s, s_max):
    d = tl.minimum((s_max - s) * BINS_PER_NAT, BINS - 1.0)  # -inf logits land in the last bin
    return d.to(tl.int32)


@triton.jit
def _combine(m_a, l_a, m_b, l_b):
    """Merge two (max, sum exp(x - max)) pairs; an empty pair has max -inf."""
    m = tl.maximum(m_a, m_b)
    safe = tl.where(m == float("-inf"), 0.0, m)
    return m, l_a * tl.exp(m_a - safe) + l_b * tl.exp(m_b - safe)


@triton.jit
def _row_stats(part_ptr, row, splits, MAX_SPLITS: tl.constexpr):
    """Combine the stats pass's partials of one row: raw (max, sum), scaled (max, sum)."""
    i = tl.arange(0, MAX_SPLITS)
    base = part_ptr + (row * splits + i) * 8
    live = i < splits
    rm = tl.load(base + 0, mask=live, other=float("-inf"))
    rl = tl.load(base + 1, mask=live, other=0.0)
    sm = tl.load(base + 2, mask=live, other=float("-inf"))
    sl = tl.load(base + 3, mask=live, other=0.0)
    raw_m, s_m = tl.max(rm, 0), tl.max(sm, 0)
    raw_l = tl.sum(rl * tl.exp(rm - tl.where(raw_m == float("-inf"), 0.0, raw_m)), 0)
    s_l = tl.sum(sl * tl.exp(sm - tl.where(s_m == float("-inf"), 0.0, s_m)), 0)
    return raw_m, raw_l, s_m, s_l


@triton.jit
def _stats_kernel(raw_ptr, adj_ptr, temp_ptr, part_ptr, part_i_ptr, hist_ptr, count_ptr, V, chunk,
                  splits, MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    inv_t = 1.0 / tl.maximum(tl.load(temp_ptr + row), 1e-5)
    raw_m, raw_l = float("-inf"), 0.0
    s_m, s_l = float("-inf"), 0.0
    best, best_i = float("-inf"), 0
    start = split * chunk
    for off in range(start, tl.minimum(start + chunk, V), BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(raw_ptr + row * V + cols, mask=mask, other=float("-inf")).to(tl.float32)
        a = tl.load(adj_ptr + row * V + cols, mask=mask, other=float("-inf")).to(tl.float32)
        bm = tl.max(x, 0)
        raw_m, raw_l = _combine(raw_m, raw_l, bm, tl.sum(tl.exp(x - tl.where(bm == float("-inf"), 0.0, bm)), 0))
        s = a * inv_t
        bs = tl.max(s, 0)
        s_m, s_l = _combine(s_m, s_l, bs, tl.sum(tl.exp(s - tl.where(bs == float("-inf"), 0.0, bs)), 0))
        ba = tl.max(a, 0)
        if ba > best:
            best, best_i = ba, off + tl.argmax(a, 0)
    base = part_ptr + (row * splits + split) * 8
    tl.store(base + 0, raw_m)
    tl.store(base + 1, raw_l)
    tl.store(base + 2, s_m)
    tl.store(base + 3, s_l)
    tl.store(base + 4, best)
    tl.store(part_i_ptr + (row * splits + split) * 2, best_i)
    if split == 0:  # the next passes accumulate into these
        tl.store(hist_ptr + row * BINS + tl.arange(0, BINS), tl.zeros([BINS], tl.int32))
        tl.store(count_ptr + row, 0)


@triton.jit
def _filtered(temp_ptr, topk_ptr, topp_ptr, row):
    """True for rows that need the candidate set: sampled (T > 0) with top-k or top-p on."""
    return (tl.load(temp_ptr + row) > 0) & ((tl.load(topk_ptr + row) > 0) | (tl.load(topp_ptr + row) < 1.0))


@triton.jit
def _hist_kernel(adj_ptr, temp_ptr, topk_ptr, topp_ptr, part_ptr, hist_ptr, V, chunk,
                 splits, MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if _filtered(temp_ptr, topk_ptr, topp_ptr, row):
        inv_t = 1.0 / tl.maximum(tl.load(temp_ptr + row), 1e-5)
        _, _, s_m, _ = _row_stats(part_ptr, row, splits, MAX_SPLITS)
        counts = tl.zeros([BINS], tl.int32)
        start = split * chunk
        for off in range(start, tl.minimum(start + chunk, V), BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < V
            s = tl.load(adj_ptr + row * V + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
            counts += tl.histogram(_bin_of(s, s_m), BINS)  # padding lanes count in the last bin, never kept
        tl.atomic_add(hist_ptr + row * BINS + tl.arange(0, BINS), counts)


@triton.jit
def _cut_bin(hist_ptr, row, top_k, top_p, min_p, s_l):
    """The last bin the kept prefix can reach, and the number of ids up to it."""
    bins = tl.arange(0, BINS)
    counts = tl.load(hist_ptr + row * BINS + bins)
    through = tl.cumsum(counts, 0)
    # Every id in bin b has d < (b + 1) / 16, so its exp(-d) mass is above exp(-(b + 1) / 16): a lower bound.
    mass_low = tl.cumsum(tl.where(bins < BINS - 1, counts.to(tl.float32) * tl.exp(-(bins + 1.0) / BINS_PER_NAT), 0.0), 0)
    cut = BINS - 1
    if top_k > 0:  # every top-k id must be a candidate: top-p normalises by their mass
        cut = tl.min(tl.where(through >= top_k, bins, BINS - 1), 0)
    else:
        if top_p < 1.0:
            cut = tl.min(tl.where(mass_low >= top_p * s_l, bins, BINS - 1), 0)
    if (min_p > 0.0) & ((top_k == 0) | (top_p >= 1.0)):  # ids with d > -log(min_p) are dropped
        cut = tl.minimum(cut, tl.minimum((-tl.log(min_p) * BINS_PER_NAT).to(tl.int32), BINS - 1))
    total = tl.sum(tl.where(bins <= cut, counts, 0), 0)
    return cut, total


@triton.jit
def _gather_kernel(adj_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, part_ptr, part_i_ptr,
                   hist_ptr, count_ptr, cand_s_ptr, cand_i_ptr, V, chunk,
                   splits, MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr, MAX_CAND: tl.constexpr):
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t = tl.load(temp_ptr + row)
    if t > 0:
        inv_t = 1.0 / tl.maximum(t, 1e-5)
        _, _, s_m, s_l = _row_stats(part_ptr, row, splits, MAX_SPLITS)
        min_p = tl.load(minp_ptr + row)
        start = split * chunk
        stop = tl.minimum(start + chunk, V)
        if _filtered(temp_ptr, topk_ptr, topp_ptr, row):
            cut, total = _cut_bin(hist_ptr, row, tl.load(topk_ptr + row), tl.load(topp_ptr + row), min_p, s_l)
            if (cut < BINS - 1) & (total <= MAX_CAND):
                for off in range(start, stop, BLOCK):
                    cols = off + tl.arange(0, BLOCK)
                    mask = cols < V
                    s = tl.load(adj_ptr + row * V + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
                    take = mask & (_bin_of(s, s_m) <= cut)
                    n = tl.sum(take.to(tl.int32), 0)
                    if n > 0:
                        at = tl.atomic_add(count_ptr + row, n) + tl.cumsum(take.to(tl.int32), 0) - 1
                        tl.store(cand_s_ptr + row * MAX_CAND + at, s, mask=take)
                        tl.store(cand_i_ptr + row * MAX_CAND + at, cols, mask=take)
        else:  # no top-k / top-p: race every id that min-p keeps
            key = _row_key(seed_ptr, step_ptr, row)
            best, best_i = float("-inf"), 0
            for off in range(start, stop, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                mask = cols < V
                s = tl.load(adj_ptr + row * V + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
                keep = mask & (tl.exp(s - s_m) >= min_p) & (s > float("-inf"))
                r = tl.where(keep, _race_key(s - s_m, cols, key), float("-inf"))
                br = tl.max(r, 0)
                if br > best:
                    best, best_i = br, off + tl.argmax(r, 0)
            tl.store(part_ptr + (row * splits + split) * 8 + 5, best)
            tl.store(part_i_ptr + (row * splits + split) * 2 + 1, best_i)


@triton.jit
def _float_order(s):
    """int32 whose signed order is the float order of s."""
    b = s.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _finish_kernel(raw_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, part_ptr, part_i_ptr,
                   hist_ptr, cand_s_ptr, cand_i_ptr, token_ptr, logprob_ptr, done_ptr, V,
                   splits, MAX_SPLITS: tl.constexpr, MAX_CAND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    raw_m, raw_l, s_m, s_l = _row_stats(part_ptr, row, splits, MAX_SPLITS)
    parts = tl.arange(0, MAX_SPLITS)
    part_at = row * splits + parts
    t = tl.load(temp_ptr + row)
    done = tl.full([], 1, tl.int32)
    token = tl.full([], 0, tl.int32)
    if t <= 0:  # greedy on the penalised logits
        vals = tl.load(part_ptr + part_at * 8 + 4, mask=parts < splits, other=float("-inf"))
        token = tl.load(part_i_ptr + (row * splits + tl.argmax(vals, 0)) * 2)
    elif _filtered(temp_ptr, topk_ptr, topp_ptr, row):
        top_k, top_p, min_p = tl.load(topk_ptr + row), tl.load(topp_ptr + row), tl.load(minp_ptr + row)
        cut, total = _cut_bin(hist_ptr, row, top_k, top_p, min_p, s_l)
        if (cut < BINS - 1) & (total <= MAX_CAND):
            i = tl.arange(0, MAX_CAND)
            s = tl.load(cand_s_ptr + row * MAX_CAND + i, mask=i < total, other=float("-inf"))
            ids = tl.load(cand_i_ptr + row * MAX_CAND + i, mask=i < total, other=0)
            packed = tl.sort((_float_order(s).to(tl.int64) << 32) | ids.to(tl.int64), 0, descending=True)
            ids = (packed & 0xFFFFFFFF).to(tl.int32)
            o = (packed >> 32).to(tl.int32)
            s = (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
            e = tl.where(i < total, tl.exp(s - s_m), 0.0)
            in_k = i < tl.where(top_k > 0, top_k, V)
            z = tl.where(top_k > 0, tl.sum(tl.where(in_k, e, 0.0), 0), s_l)
            probs = e / z
            before = tl.cumsum(probs, 0) - probs
            keep = in_k & (i < total) & (before < tl.where(top_p >= 1.0, float("inf"), top_p)) & (e >= min_p)
            r = tl.where(keep, _race_key(s - s_m, ids, _row_key(seed_ptr, step_ptr, row)), float("-inf"))
            token = tl.sum(tl.where(i == tl.argmax(r, 0), ids, 0), 0)
        else:
            done = tl.full([], 0, tl.int32)
    else:
        races = tl.load(part_ptr + part_at * 8 + 5, mask=parts < splits, other=float("-inf"))
        token = tl.load(part_i_ptr + (row * splits + tl.argmax(races, 0)) * 2 + 1)
    x = tl.load(raw_ptr + row * V + token).to(tl.float32)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, x - raw_m - tl.log(raw_l))
    tl.store(done_ptr + row, done)


@dataclass
class Drawn:
    tokens: torch.Tensor  # [N] long
    logprobs: torch.Tensor  # [N] float: of the chosen token under the raw distribution
    done: torch.Tensor  # [N] int32: 0 where the row must be sampled by the reference instead


def default_splits(rows: int, vocab: int, device: torch.device) -> int:
    """Enough programs per pass to fill the GPU (a few per SM), never a block less than BLOCK per split."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    want = max(1, triton.cdiv(4 * sms, rows))
    return min(MAX_SPLITS, triton.next_power_of_2(want), max(1, triton.next_power_of_2(triton.cdiv(vocab, 8 * BLOCK))))


def draw(logits: torch.Tensor, p: SamplingTensors, splits: int | None = None,
         max_candidates: int = MAX_CANDIDATES) -> Drawn:
    """Greedy / temperature / top-k / top-p / min-p with penalties, for every row at once (see the module doc).
    `splits` (programs per row) and `max_candidates` (a power of two) are exposed for tests."""
    N, V = logits.shape
    dev = logits.device
    adjusted = apply_penalties(logits, p)
    splits = splits or default_splits(N, V, dev)
    chunk = triton.cdiv(triton.cdiv(V, splits), BLOCK) * BLOCK
    part = torch.empty(N, splits, 8, dtype=torch.float32, device=dev)
    part_i = torch.empty(N, splits, 2, dtype=torch.int32, device=dev)
    hist = torch.empty(N, BINS.value, dtype=torch.int32, device=dev)
    count = torch.empty(N, dtype=torch.int32, device=dev)
    cand_s = torch.empty(N, max_candidates, dtype=torch.float32, device=dev)
    cand_i = torch.empty(N, max_candidates, dtype=torch.int32, device=dev)
    out = Drawn(torch.empty(N, dtype=torch.long, device=dev), torch.empty(N, dtype=torch.float32, device=dev),
                torch.empty(N, dtype=torch.int32, device=dev))
    temp, top_p, min_p = p.temperature.float(), p.top_p.float(), p.min_p.float()
    top_k = torch.where(p.top_k >= V, 0, p.top_k)  # keeping the whole vocabulary is no top-k
    grid = (N, splits)
    _stats_kernel[grid](logits, adjusted, temp, part, part_i, hist, count, V, chunk, splits, MAX_SPLITS=MAX_SPLITS, BLOCK=BLOCK)
    _hist_kernel[grid](adjusted, temp, top_k, top_p, part, hist, V, chunk, splits, MAX_SPLITS=MAX_SPLITS, BLOCK=BLOCK)
    _gather_kernel[grid](adjusted, temp, top_k, top_p, min_p, p.seeds, p.steps, part, part_i, hist, count,
                         cand_s, cand_i, V, chunk, splits, MAX_SPLITS=MAX_SPLITS, BLOCK=BLOCK, MAX_CAND=max_candidates)
    _finish_kernel[(N,)](logits, temp, top_k, top_p, min_p, p.seeds, p.steps, part, part_i, hist, cand_s, cand_i,
                         out.tokens, out.logprobs, out.done, V, splits, MAX_SPLITS=MAX_SPLITS, MAX_CAND=max_candidates, num_warps=8)
    return out


def sample_on_gpu(logits: torch.Tensor, p: SamplingTensors, num_logprobs: int = 0,
                  max_candidates: int = MAX_CANDIDATES):
    """`kernels.sampling.sample`'s contract on `draw`: rows `draw` flags are sampled again by the reference.
    Reads the flags on the host (one synchronisation; the caller reads the tokens right after anyway)."""
    drawn = draw(logits, p, max_candidates=max_candidates)
    tokens, chosen = drawn.tokens, drawn.logprobs
    redo = (drawn.done == 0).nonzero()[:, 0]
    if redo.numel():
        tokens[redo], chosen[redo], _, _ = sample(logits[redo], p.rows(redo))
    return (tokens, chosen, *top_logprobs(logits, num_logprobs))
