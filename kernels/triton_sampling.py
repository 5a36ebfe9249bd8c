"""Sampling on the GPU in five Triton passes (and race rounds for top-p alone), drawing the same tokens as
`kernels.sampling.sample_reference`.

The reference keeps, per row, a prefix of the vocabulary sorted by scaled logit s = logit / T, ties highest id
first (top-k, then top-p on the top-k distribution, then min-p), and races the kept ids with counter-based
uniforms: argmax p / -log u, i.e. argmax (s - max s) - log(-log u). No full sort is needed for that:

1. stats   (row x split): max and sum-exp of the raw logits (for logprobs) and of s; the argmax (greedy). Rows
           with top-k <= LANE_TOP_K also keep the split's k largest per-lane maxima (each lane's running max over
           the split; k distinct ids).
   race rounds (TOP_P_ROUNDS of them, for rows with top-p and no top-k): the kept ids are those above a
           boundary, so the race's winner over every id is the winner over the kept ones whenever top-p keeps it,
           which it does with probability about top_p. A round races the ids above the row's floor (each split's
           winner), sums the mass above the winner and tied with it, and settles the row on the winner if top-p
           keeps it whatever the order of its ties; if top-p drops it even so, the floor rises to it. Rounds
           after the first race only the rows the round before listed, with more programs to a row. A row left
           unsettled (or whose answer depends on the order of ties) takes the passes below like any other.
2. hist    (row x split): threshold rows (top-k <= LANE_TOP_K) take the k-th largest of all the splits' kept
           lane maxima: k distinct ids reach it, so the k-th id does, and only the ids in the k lanes whose max
           reaches it can (at most k ids a lane, usually about k in all). Other rows with top-k or top-p count
           their ids in bins of d = max s - s, 1/16 nat wide.
3. take or refine (row x split): threshold rows copy out every id at or above the threshold. Top-p rows
           without top-k whose bins leave too wide a band (a bin bounds its ids' mass only within e^(1/16), so
           on a broad distribution the band can hold thousands of ids) are refined: the exact mass before a
           window of bins (from the band's first bin to a little past the boundary's estimate) and in it, and
           the window's ids counted in 511 slices.
4. gather  (row x split): for the other histogram rows the bin (or slice) counts bound where the kept prefix
           ends. Top-k: every id up to the bin holding the k-th is a candidate (top-p then normalises by their
           exact mass). Top-p alone: bins (slices) whose upper bound on the mass before them is under top_p are
           kept for sure (raced here, their mass summed), those whose lower bound already reaches it are
           dropped, and only the band between is copied out. Rows with neither filter race every id that min-p
           keeps.
5. finish  (row): a row the race rounds settled takes its token. The others rank the candidates by comparing
           every pair (cheaper than a sort for a band of this size), apply top-k / top-p / min-p exactly as the
           reference does, race, and compare with the sure ids' winner.

A row whose candidates would exceed MAX_CANDIDATES (top-k in the thousands, a flat distribution's mass spread
past 32 nats, or more ids than that tied at a threshold), or a refined row whose boundary lies past its window,
is flagged, and the caller samples that row with the reference. Nothing here synchronises with the host, so
`draw` can be captured in a CUDA graph. The programs per row (`splits`, `W`) change with the batch size: Triton
does not specialise on them, so one compiled variant serves every batch (`chunk`, a multiple of the block, keeps
its divisibility hint). On sm90 each pass is launched with programmatic dependent launch and waits for the pass
before it at its start (`kernels.launch.pdl_options`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from .triton_or_absent import tl, triton

from .sampling import SamplingTensors, apply_penalties, lm_like_logits, sample_reference, top_logprobs
from .launch import multiprocessors, pdl_options, wait_for_previous_kernel

BINS = tl.constexpr(512)
BINS_PER_NAT = tl.constexpr(16)  # bins cover d in [0, 32) nats; the last bin also holds everything further out
MAX_CANDIDATES = 512  # the finish pass compares every pair: its cost grows with the square
LANE_TOP_K = tl.constexpr(64)  # top-k up to this finds its candidates by a threshold from per-lane maxima
MAX_SPLITS = 128  # programs per row in the passes over the vocabulary (a runtime count up to this)
BLOCK = 1024
NEG = tl.constexpr(float("-inf"))
PART = tl.constexpr(10)  # floats a (row, split) program leaves for the later passes
FINE = tl.constexpr(512)  # the refine pass's slices of a top-p window; the last one holds every id outside it
# The race key's logs: the GPU's fast approximation (libdevice's precise logf cost about half of a race pass),
# or the exact one in the interpreter, which runs no GPU library code.
FAST_LOG = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
REFINE_MARGIN = tl.constexpr(4)  # bins past the estimated top-p point that the refine window also covers
TOP_P_ROUNDS = 2  # races a top-p-alone row runs before it falls back to the histogram passes


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
def _log(x):
    if FAST_LOG:
        return tl.extra.cuda.libdevice.fast_logf(x)
    else:
        return tl.log(x)


@triton.jit
def _race_key(d, ids, row_key):
    """(s - max s) - log(-log u): the exponential race in the log domain (d = s - max s)."""
    bits = _mix32(row_key + ids.to(tl.uint32) * 0x27D4EB2F)
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # as counter_uniform: exact, strictly below 1
    # The fast log is accurate in absolute terms (about 1e-7), as good as d's own fp32 rounding for the key, which
    # is in the log domain. -log(u) needs relative accuracy, though: near u = 1 the fast log would be wrong by
    # orders of magnitude. There v = 1 - u is exact and -log(1 - v) = v + v^2/2 + ... converges fast; below
    # u = 15/16, -log(u) > 0.06 and its relative error stays under 2e-6.
    v = 1.0 - u
    series = v * (1.0 + v * (0.5 + v * (1.0 / 3.0 + v * (0.25 + v * (0.2 + v * (1.0 / 6.0))))))
    return d - _log(tl.where(v < 0.0625, series, -_log(u)))


@triton.jit
def _bin_of(s, s_max):
    d = tl.minimum((s_max - s) * BINS_PER_NAT, BINS - 1.0)  # -inf logits land in the last bin
    return d.to(tl.int32)


@triton.jit
def _load_block(row_ptr, off, stop, BLOCK: tl.constexpr):
    """A row's logits [off, off + BLOCK), -inf from `stop` on, as stored. The gather pass loads the next block
    before it works on this one (and converts it only then), so its latency hides behind the work (36 against
    43 us at batch 64 on the H200; the same in the stats pass made it slower)."""
    cols = off + tl.arange(0, BLOCK)
    return tl.load(row_ptr + cols, mask=cols < stop, other=NEG)


@triton.jit
def _keep_best(best, best_i, r, cols):
    """Per-lane running argmax; a lane keeps its earliest id on ties."""
    better = r > best
    return tl.where(better, r, best), tl.where(better, cols, best_i)


@triton.jit
def _lanes_best(best, best_i):
    """(value, lowest id holding it) over the lanes."""
    b = tl.max(best, 0)
    return b, tl.min(tl.where(best == b, best_i, 2**31 - 1), 0)


@triton.jit
def _row_stats(part_ptr, row, splits, MAX_SPLITS: tl.constexpr):
    """Combine the stats pass's partials of one row: raw (max, sum), scaled (max, sum)."""
    i = tl.arange(0, MAX_SPLITS)
    base = part_ptr + (row * splits + i) * PART
    live = i < splits
    rm = tl.load(base + 0, mask=live, other=NEG)
    rl = tl.load(base + 1, mask=live, other=0.0)
    sm = tl.load(base + 2, mask=live, other=NEG)
    sl = tl.load(base + 3, mask=live, other=0.0)
    raw_m, s_m = tl.max(rm, 0), tl.max(sm, 0)
    raw_l = tl.sum(tl.where(rm > NEG, rl * tl.exp(rm - raw_m), 0.0), 0)
    s_l = tl.sum(tl.where(sm > NEG, sl * tl.exp(sm - s_m), 0.0), 0)
    return raw_m, raw_l, s_m, s_l


@triton.jit(do_not_specialize=["splits"])
def _stats_kernel(raw_ptr, adj_ptr, temp_ptr, topk_ptr, part_ptr, part_i_ptr, lanes_ptr, hist_ptr, fine_ptr, count_ptr,
                  settled_ptr, floor_ptr, arrived_ptr, V, chunk, splits, PENALISED: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    inv_t = 1.0 / tl.maximum(tl.load(temp_ptr + row), 1e-5)
    # Running maxima are scalars; the exp sums stay per lane and are rescaled only when a block raises the max.
    m_x, m_a = tl.full([], NEG, tl.float32), tl.full([], NEG, tl.float32)
    l_x, l_s = tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32)
    best, best_i = tl.full([BLOCK], NEG, tl.float32), tl.zeros([BLOCK], tl.int32)
    start = split * chunk
    for off in range(start, tl.minimum(start + chunk, V), BLOCK):
        cols = off + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(raw_ptr + row * V + cols, mask=mask, other=NEG).to(tl.float32)
        if PENALISED:
            a = tl.load(adj_ptr + row * V + cols, mask=mask, other=NEG).to(tl.float32)
        else:
            a = x
        bx = tl.max(x, 0)
        if bx > m_x:
            l_x = l_x * tl.exp(m_x - bx)
            m_x = bx
        if PENALISED:
            ba = tl.max(a, 0)
        else:
            ba = bx
        if ba > m_a:
            l_s = l_s * tl.exp((m_a - ba) * inv_t)
            m_a = ba
        l_x += tl.where(x > NEG, tl.exp(x - m_x), 0.0)
        l_s += tl.where(a > NEG, tl.exp((a - m_a) * inv_t), 0.0)
        best, best_i = _keep_best(best, best_i, a, cols)
    b, b_i = _lanes_best(best, best_i)
    if _by_lanes(temp_ptr, topk_ptr, row):  # this split's top_k lane maxima (ties kept apart)
        i = tl.arange(0, LANE_TOP_K)
        tl.store(lanes_ptr + (row * splits + split) * LANE_TOP_K + i, tl.topk(best, LANE_TOP_K) * inv_t,
                 mask=i < tl.load(topk_ptr + row))
    base = part_ptr + (row * splits + split) * PART
    tl.store(base + 0, m_x)
    tl.store(base + 1, tl.sum(l_x, 0))
    tl.store(base + 2, m_a * inv_t)
    tl.store(base + 3, tl.sum(l_s, 0))
    tl.store(base + 4, b)
    tl.store(part_i_ptr + (row * splits + split) * 2, b_i)
    if split == 0:  # the next passes accumulate into these
        tl.store(hist_ptr + row * BINS + tl.arange(0, BINS), tl.zeros([BINS], tl.int32))
        tl.store(fine_ptr + row * FINE + tl.arange(0, FINE), tl.zeros([FINE], tl.int32))
        tl.store(count_ptr + row, 0)
        tl.store(settled_ptr + row, -1)
        tl.store(floor_ptr + row, NEG)
        tl.store(arrived_ptr + row, 0)


@triton.jit
def _filtered(temp_ptr, topk_ptr, topp_ptr, row):
    """True for rows that need the candidate band: sampled (T > 0) with top-k or top-p on."""
    return (tl.load(temp_ptr + row) > 0) & ((tl.load(topk_ptr + row) > 0) | (tl.load(topp_ptr + row) < 1.0))


@triton.jit
def _top_p_alone(temp_ptr, topk_ptr, topp_ptr, settled_ptr, row):
    """True for sampled rows with top-p and no top-k that no race round has settled yet."""
    return ((tl.load(temp_ptr + row) > 0) & (tl.load(topk_ptr + row) == 0) & (tl.load(topp_ptr + row) < 1.0)
            & (tl.load(settled_ptr + row) == -1))


@triton.jit(do_not_specialize=["splits", "W"])
def _race_above_kernel(adj_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, part_ptr, settled_ptr,
                       floor_ptr, race_ptr, race_i_ptr, rows_ptr, n_rows_ptr, next_n_ptr, V, splits, rchunk, W,
                       MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr, LISTED: tl.constexpr,
                       PDL: tl.constexpr = False):
    """A top-p race round: each of a row's W programs' winner among the ids above the row's floor that min-p
    keeps. The first round takes program (row, split); a LISTED round walks the rows the last round left (rows_ptr,
    n_rows_ptr of them), W programs to a row, so a round that few rows run is short."""
    wait_for_previous_kernel(PDL)
    if LISTED:
        p = tl.program_id(0)
        if p == 0:
            tl.store(next_n_ptr, 0)  # the mass pass after this one lists the rows it leaves there
        for a in range(p // W, tl.load(n_rows_ptr), tl.num_programs(0) // W):
            _race_above(adj_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, part_ptr, settled_ptr,
                        floor_ptr, race_ptr, race_i_ptr, tl.load(rows_ptr + a).to(tl.int64), p % W, V, splits, rchunk,
                        W, MAX_SPLITS, BLOCK, True)
    else:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(next_n_ptr, 0)
        _race_above(adj_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, part_ptr, settled_ptr,
                    floor_ptr, race_ptr, race_i_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), V, splits,
                    rchunk, W, MAX_SPLITS, BLOCK, False)


@triton.jit
def _race_above(adj_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, part_ptr, settled_ptr, floor_ptr,
                race_ptr, race_i_ptr, row, split, V, splits, rchunk, W, MAX_SPLITS: tl.constexpr,
                BLOCK: tl.constexpr, ABOVE_FLOOR: tl.constexpr):
    """ABOVE_FLOOR: the floor is a dropped winner's score, above which few ids lie, so a block with none of them
    skips the race keys (a hash and two logs an id)."""
    if _top_p_alone(temp_ptr, topk_ptr, topp_ptr, settled_ptr, row):
        inv_t = 1.0 / tl.maximum(tl.load(temp_ptr + row), 1e-5)
        _, _, s_m, _ = _row_stats(part_ptr, row, splits, MAX_SPLITS)
        min_p, floor = tl.load(minp_ptr + row), tl.load(floor_ptr + row)
        key = _row_key(seed_ptr, step_ptr, row)
        start = split * rchunk
        stop = tl.minimum(start + rchunk, V)
        best, best_i = tl.full([BLOCK], NEG, tl.float32), tl.zeros([BLOCK], tl.int32)
        s_next = _load_block(adj_ptr + row * V, start, stop, BLOCK)
        for off in range(start, stop, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            s = s_next.to(tl.float32) * inv_t
            s_next = _load_block(adj_ptr + row * V, off + BLOCK, stop, BLOCK)
            if not ABOVE_FLOOR or tl.max(s, 0) > floor:
                keep = (cols < stop) & (s > floor)
                if min_p > 0:  # exp(.) >= 0 holds for every id: without min-p the race skips an exp an id
                    keep = keep & (tl.exp(s - s_m) >= min_p)
                best, best_i = _keep_best(best, best_i, tl.where(keep, _race_key(s - s_m, cols, key), NEG), cols)
        b, b_i = _lanes_best(best, best_i)
        tl.store(race_ptr + row * W + split, b)
        tl.store(race_i_ptr + row * W + split, b_i)


@triton.jit
def _round_winner(race_ptr, race_i_ptr, row, splits, MAX_SPLITS: tl.constexpr):
    """The race round's winner over the splits (the lowest id on a tie, as the lanes keep it)."""
    parts = tl.arange(0, MAX_SPLITS)
    races = tl.load(race_ptr + row * splits + parts, mask=parts < splits, other=NEG)
    return tl.load(race_i_ptr + row * splits + tl.argmax(races, 0))


@triton.jit(do_not_specialize=["splits", "W"])
def _mass_ahead_kernel(adj_ptr, temp_ptr, topk_ptr, topp_ptr, part_ptr, settled_ptr, floor_ptr, race_ptr,
                       race_i_ptr, ahead_ptr, arrived_ptr, rows_ptr, n_rows_ptr, next_rows_ptr, next_n_ptr, V, splits,
                       rchunk, W, MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr, LISTED: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Each of a row's W programs' exp mass of the ids above the round's winner and of the other ids tied with it:
    whatever order a sort gives ties, the top-p mass before the winner lies between the first and the sum. The
    row's last program to finish settles the round for it. Rows and programs as in `_race_above_kernel`."""
    wait_for_previous_kernel(PDL)
    if LISTED:
        p = tl.program_id(0)
        for a in range(p // W, tl.load(n_rows_ptr), tl.num_programs(0) // W):
            _mass_ahead(adj_ptr, temp_ptr, topk_ptr, topp_ptr, part_ptr, settled_ptr, floor_ptr, race_ptr, race_i_ptr,
                        ahead_ptr, arrived_ptr, next_rows_ptr, next_n_ptr, tl.load(rows_ptr + a).to(tl.int64), p % W,
                        V, splits, rchunk, W, MAX_SPLITS, BLOCK)
    else:
        _mass_ahead(adj_ptr, temp_ptr, topk_ptr, topp_ptr, part_ptr, settled_ptr, floor_ptr, race_ptr, race_i_ptr,
                    ahead_ptr, arrived_ptr, next_rows_ptr, next_n_ptr, tl.program_id(0).to(tl.int64),
                    tl.program_id(1), V, splits, rchunk, W, MAX_SPLITS, BLOCK)


@triton.jit
def _mass_ahead(adj_ptr, temp_ptr, topk_ptr, topp_ptr, part_ptr, settled_ptr, floor_ptr, race_ptr, race_i_ptr,
                ahead_ptr, arrived_ptr, next_rows_ptr, next_n_ptr, row, split, V, splits, rchunk, W,
                MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    if _top_p_alone(temp_ptr, topk_ptr, topp_ptr, settled_ptr, row):
        inv_t = 1.0 / tl.maximum(tl.load(temp_ptr + row), 1e-5)
        _, _, s_m, s_l = _row_stats(part_ptr, row, splits, MAX_SPLITS)
        winner = _round_winner(race_ptr, race_i_ptr, row, W, MAX_SPLITS)
        s_w = tl.load(adj_ptr + row * V + winner).to(tl.float32) * inv_t
        start = split * rchunk
        stop = tl.minimum(start + rchunk, V)
        above, tied = tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32)
        s_next = _load_block(adj_ptr + row * V, start, stop, BLOCK)
        for off in range(start, stop, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            s = s_next.to(tl.float32) * inv_t
            s_next = _load_block(adj_ptr + row * V, off + BLOCK, stop, BLOCK)
            e = tl.exp(s - s_m)  # 0 for padding
            above += tl.where(s > s_w, e, 0.0)
            tied += tl.where((s == s_w) & (cols != winner), e, 0.0)
        tl.store(ahead_ptr + (row * W + split) * 2, tl.sum(above, 0))
        tl.store(ahead_ptr + (row * W + split) * 2 + 1, tl.sum(tied, 0))
        # The row's last program to arrive settles it (a launch fewer a round): the barrier puts every thread's
        # store before the arrival, whose release the last program's acquire pairs with.
        tl.debug_barrier()
        if tl.atomic_add(arrived_ptr + row, 1, sem="acq_rel") == W - 1:
            tl.store(arrived_ptr + row, 0)  # for the next round
            _settle_round(topp_ptr, settled_ptr, floor_ptr, ahead_ptr, next_rows_ptr, next_n_ptr, row, winner, s_w,
                          s_l, W, MAX_SPLITS)


@triton.jit
def _settle_round(topp_ptr, settled_ptr, floor_ptr, ahead_ptr, next_rows_ptr, next_n_ptr, row, winner, s_w, s_l, W,
                  MAX_SPLITS: tl.constexpr):
    """The winner is the row's token if top-p keeps it; if top-p drops it, it drops every id at or below it too,
    and the next round races only the ids above it (the row is listed for it). When the answer depends on how ties
    are ordered, the row is left to the histogram passes (settled = -2). s_w is the winner's scaled logit, s_l the
    row's sum-exp of scaled logits."""
    parts = tl.arange(0, MAX_SPLITS)
    at = ahead_ptr + (row * W + parts) * 2
    above = tl.sum(tl.load(at, mask=parts < W, other=0.0), 0) / s_l
    tied = tl.sum(tl.load(at + 1, mask=parts < W, other=0.0), 0) / s_l
    top_p = tl.load(topp_ptr + row)
    if above + tied < top_p:
        tl.store(settled_ptr + row, winner)
    elif above >= top_p:
        tl.store(floor_ptr + row, s_w)
        tl.store(next_rows_ptr + tl.atomic_add(next_n_ptr, 1), row.to(tl.int32))
    else:
        tl.store(settled_ptr + row, -2)


TAKEN = tl.constexpr(-(2**63))  # below every key


@triton.jit
def _value_then_index_keys(x, idx, COUNT: tl.constexpr):
    """int64 keys, distinct, ordered by x and then by the lower index: one max a step takes one entry."""
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as int32 order
    return (ordered.to(tl.int64) << 32) | (-idx.to(tl.int64) + (COUNT - 1))


@triton.jit
def _key_value(key):
    ordered = (key >> 32).to(tl.int32)
    return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _by_lanes(temp_ptr, topk_ptr, row):
    """True for sampled rows whose top-k is small enough to find its candidates from the kept lane maxima."""
    top_k = tl.load(topk_ptr + row)
    return (tl.load(temp_ptr + row) > 0) & (top_k > 0) & (top_k <= LANE_TOP_K)


@triton.jit
def _kth_of_kept_lanes(lanes_ptr, row, splits, top_k, BLOCK_S: tl.constexpr):
    """The top_k-th largest of every split's kept lane maxima (scaled), one entry a step so ties count apart."""
    sp = tl.arange(0, BLOCK_S)[:, None]
    i = tl.arange(0, LANE_TOP_K)[None, :]
    flat = sp * LANE_TOP_K + i
    vals = tl.load(lanes_ptr + row * splits * LANE_TOP_K + flat, mask=(sp < splits) & (i < top_k), other=NEG)
    keys = _value_then_index_keys(vals, flat, BLOCK_S * LANE_TOP_K)
    top = tl.max(keys)
    for _ in range(1, top_k):
        keys = tl.where(keys == top, TAKEN, keys)
        top = tl.max(keys)
    return _key_value(top)


@triton.jit(do_not_specialize=["splits"])
def _hist_kernel(adj_ptr, temp_ptr, topk_ptr, topp_ptr, part_ptr, lanes_ptr, kth_ptr, hist_ptr, settled_ptr, V, chunk,
                 splits, MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                 PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if _by_lanes(temp_ptr, topk_ptr, row):
        if split == 0:
            tl.store(kth_ptr + row, _kth_of_kept_lanes(lanes_ptr, row, splits, tl.load(topk_ptr + row), BLOCK_S))
    elif _filtered(temp_ptr, topk_ptr, topp_ptr, row) & (tl.load(settled_ptr + row) < 0):
        inv_t = 1.0 / tl.maximum(tl.load(temp_ptr + row), 1e-5)
        _, _, s_m, _ = _row_stats(part_ptr, row, splits, MAX_SPLITS)
        counts = tl.zeros([BINS], tl.int32)
        start = split * chunk
        for off in range(start, tl.minimum(start + chunk, V), BLOCK):
            cols = off + tl.arange(0, BLOCK)
            s = tl.load(adj_ptr + row * V + cols, mask=cols < V, other=NEG).to(tl.float32) * inv_t
            counts += tl.histogram(_bin_of(s, s_m), BINS)  # padding lanes count in the last bin, never kept
        tl.atomic_add(hist_ptr + row * BINS + tl.arange(0, BINS), counts)


@triton.jit
def _band(hist_ptr, row, top_k, top_p, min_p, s_l):
    """(lo, hi, n): ids in bins below lo are kept for sure, ids in bins lo..hi (n of them) are the candidates,
    ids past hi are dropped. An id in bin b has d in [b, b + 1) / 16, so exp(-d) is within those bounds."""
    bins = tl.arange(0, BINS)
    counts = tl.load(hist_ptr + row * BINS + bins)
    if top_k > 0:  # every top-k id must be a candidate: top-p normalises by their mass
        lo = 0
        hi = tl.min(tl.where(tl.cumsum(counts, 0) >= top_k, bins, BINS - 1), 0)
    else:
        c = counts.to(tl.float32)
        upper = tl.cumsum(c * tl.exp(-bins.to(tl.float32) / BINS_PER_NAT), 0)
        lower = tl.cumsum(tl.where(bins < BINS - 1, c * tl.exp(-(bins + 1.0) / BINS_PER_NAT), 0.0), 0)
        lo = tl.min(tl.where(upper >= top_p * s_l, bins, BINS - 1), 0)
        hi = tl.min(tl.where(lower >= top_p * s_l, bins, BINS - 1), 0)
    if (min_p > 0.0) & ((top_k == 0) | (top_p >= 1.0)):  # ids with d > -log(min_p) are dropped anyway
        hi = tl.minimum(hi, tl.minimum((-tl.log(min_p) * BINS_PER_NAT).to(tl.int32), BINS - 1))
    lo = tl.minimum(lo, hi)
    n = tl.sum(tl.where((bins >= lo) & (bins <= hi), counts, 0), 0)
    return lo, hi, n


@triton.jit
def _refines(placed, top_k, lo):
    """A top-p-alone row whose bins leave too many candidates, or no end to the band, is refined."""
    return (not placed) & (top_k == 0) & (lo < BINS - 1)


@triton.jit
def _refine_window(hist_ptr, row, lo, top_p, s_l):
    """The refine window's last bin: REFINE_MARGIN bins past where the mass, estimated at the bins' midpoints,
    reaches top_p. Only a guess (a bin of few ids, a plausible token's say, is estimated only within e^(1/32)):
    the exact masses the refine pass sums tell whether the boundary lies inside."""
    bins = tl.arange(0, BINS)
    c = tl.load(hist_ptr + row * BINS + bins).to(tl.float32)
    est = tl.cumsum(tl.where(bins < BINS - 1, c * tl.exp(-(bins + 0.5) / BINS_PER_NAT), 0.0), 0)
    at = tl.min(tl.where(est >= top_p * s_l, bins, BINS - 1), 0)
    return tl.maximum(tl.minimum(at + REFINE_MARGIN, BINS - 2), lo)


@triton.jit
def _window_scale(lo, hr):
    """(d where the refine window starts, its slices per nat)."""
    return lo.to(tl.float32) / BINS_PER_NAT, (FINE - 1.0) * BINS_PER_NAT / (hr - lo + 1).to(tl.float32)


@triton.jit
def _fine_slice(s, s_m, b, lo, hr):
    """The refine window's slice holding each id, b its bin (FINE - 1 for ids outside bins lo..hr)."""
    start, per_nat = _window_scale(lo, hr)
    f = tl.minimum(tl.maximum((tl.minimum(s_m - s - start, 64.0) * per_nat).to(tl.int32), 0), FINE - 2)
    return tl.where((b >= lo) & (b <= hr), f, FINE - 1)


@triton.jit
def _fine_band(fine_ptr, part_ptr, row, splits, lo, hr, top_p, s_l, MAX_SPLITS: tl.constexpr):
    """(flo, fhi, n, inside) of a refined row: ids in window slices below flo are kept for sure, slices flo..fhi
    (n ids) are the candidates, later ones are dropped. The bounds start from the exact mass before the window;
    inside is False when the exact mass through the window falls short of top_p (the boundary lies past it)."""
    parts = tl.arange(0, MAX_SPLITS)
    at = part_ptr + (row * splits + parts) * PART
    before = tl.sum(tl.load(at + 7, mask=parts < splits, other=0.0), 0)
    window = tl.sum(tl.load(at + 8, mask=parts < splits, other=0.0), 0)
    j = tl.arange(0, FINE)
    c = tl.load(fine_ptr + row * FINE + j, mask=j < FINE - 1, other=0)
    start, per_nat = _window_scale(lo, hr)
    # An id in slice j has d in [start + j / per_nat, start + (j + 1) / per_nat); the 1e-5 covers rounding.
    most = c.to(tl.float32) * tl.exp(-(start + j / per_nat)) * (1.0 + 1e-5)
    least = c.to(tl.float32) * tl.exp(-(start + (j + 1.0) / per_nat)) * (1.0 - 1e-5)
    upper = before + tl.cumsum(most, 0)
    lower = before + tl.maximum(tl.cumsum(least, 0), window - (tl.sum(most, 0) - tl.cumsum(most, 0)))
    target = top_p * s_l
    flo = tl.min(tl.where(upper >= target, j, FINE - 2), 0)
    fhi = tl.min(tl.where(lower >= target, j, FINE - 2), 0)
    flo = tl.minimum(flo, fhi)
    n = tl.sum(tl.where((j >= flo) & (j <= fhi), c, 0), 0)
    return flo, fhi, n, before + window >= target


@triton.jit
def _coarse_band(hist_ptr, row, top_k, top_p, min_p, s_l, MAX_CAND: tl.constexpr):
    """`_band`, whether its bins place the band (bounded, at most MAX_CAND ids), and whether the row is refined."""
    lo, hi, n_band = _band(hist_ptr, row, top_k, top_p, min_p, s_l)
    placed = (hi < BINS - 1) & (n_band <= MAX_CAND)
    return lo, hi, n_band, placed, _refines(placed, top_k, lo)


@triton.jit
def _hist_band(hist_ptr, fine_ptr, part_ptr, row, splits, top_k, top_p, min_p, s_l,
               MAX_SPLITS: tl.constexpr, MAX_CAND: tl.constexpr):
    """A histogram row's candidates: (lo, hi, refined, hr, flo, fhi, n_band, placed). Ids in bins below lo are
    kept for sure and bins lo..hi are the band; a refined row's band is slices flo..fhi of its window (bins
    lo..hr) instead, and the window's slices below flo are kept for sure too. placed: the band is bounded and
    fits in MAX_CAND."""
    lo, hi, n_band, placed, refined = _coarse_band(hist_ptr, row, top_k, top_p, min_p, s_l, MAX_CAND)
    hr, flo, fhi = lo, lo * 0, lo * 0
    if refined:
        hr = _refine_window(hist_ptr, row, lo, top_p, s_l)
        flo, fhi, n_band, inside = _fine_band(fine_ptr, part_ptr, row, splits, lo, hr, top_p, s_l, MAX_SPLITS)
        placed = inside & (n_band <= MAX_CAND)
    return lo, hi, refined, hr, flo, fhi, n_band, placed


@triton.jit
def _copy_out(count_ptr, cand_s_ptr, cand_i_ptr, row, take, s, cols, MAX_CAND: tl.constexpr):
    """Append the taken ids to the row's candidates, a slot each by one atomic a block. Past MAX_CAND nothing is
    written; the count tells the finish pass that the row overflowed."""
    n = tl.sum(take.to(tl.int32), 0)
    if n > 0:
        at = tl.atomic_add(count_ptr + row, n) + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(cand_s_ptr + row * MAX_CAND + at, s, mask=take & (at < MAX_CAND))
        tl.store(cand_i_ptr + row * MAX_CAND + at, cols, mask=take & (at < MAX_CAND))


@triton.jit(do_not_specialize=["splits"])
def _take_or_refine_kernel(adj_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, part_ptr, hist_ptr, fine_ptr, kth_ptr,
                           count_ptr, cand_s_ptr, cand_i_ptr, settled_ptr, V, chunk, splits, MAX_SPLITS: tl.constexpr,
                           BLOCK: tl.constexpr, MAX_CAND: tl.constexpr, PDL: tl.constexpr = False):
    """Threshold rows copy out every id at or above their threshold: all their candidates. Refined rows sum the
    exact mass before their window and in it (per split) and count the window's ids in FINE - 1 slices."""
    wait_for_previous_kernel(PDL)
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    inv_t = 1.0 / tl.maximum(tl.load(temp_ptr + row), 1e-5)
    start = split * chunk
    stop = tl.minimum(start + chunk, V)
    if _by_lanes(temp_ptr, topk_ptr, row):
        kth = tl.load(kth_ptr + row)
        s_next = _load_block(adj_ptr + row * V, start, stop, BLOCK)
        for off in range(start, stop, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            s = s_next.to(tl.float32) * inv_t
            s_next = _load_block(adj_ptr + row * V, off + BLOCK, stop, BLOCK)
            _copy_out(count_ptr, cand_s_ptr, cand_i_ptr, row, (cols < stop) & (s >= kth), s, cols, MAX_CAND)
    elif _filtered(temp_ptr, topk_ptr, topp_ptr, row) & (tl.load(settled_ptr + row) < 0):
        top_k, top_p = tl.load(topk_ptr + row), tl.load(topp_ptr + row)
        _, _, s_m, s_l = _row_stats(part_ptr, row, splits, MAX_SPLITS)
        lo, _, _, _, refined = _coarse_band(hist_ptr, row, top_k, top_p, tl.load(minp_ptr + row), s_l, MAX_CAND)
        if refined:
            hr = _refine_window(hist_ptr, row, lo, top_p, s_l)
            before, window = tl.zeros([BLOCK], tl.float32), tl.zeros([BLOCK], tl.float32)
            counts = tl.zeros([FINE], tl.int32)
            for off in range(start, stop, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                s = tl.load(adj_ptr + row * V + cols, mask=cols < stop, other=NEG).to(tl.float32) * inv_t
                e = tl.exp(s - s_m)  # 0 for padding
                b = _bin_of(s, s_m)
                f = _fine_slice(s, s_m, b, lo, hr)
                inside = f < FINE - 1
                before += tl.where(b < lo, e, 0.0)
                window += tl.where(inside, e, 0.0)
                counts += tl.histogram(f, FINE)  # ids outside count in the last slice (masking them: no faster)
            tl.atomic_add(fine_ptr + row * FINE + tl.arange(0, FINE), counts)
            base = part_ptr + (row * splits + split) * PART
            tl.store(base + 7, tl.sum(before, 0))
            tl.store(base + 8, tl.sum(window, 0))


@triton.jit(do_not_specialize=["splits"])
def _gather_kernel(adj_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, part_ptr, part_i_ptr,
                   hist_ptr, fine_ptr, count_ptr, cand_s_ptr, cand_i_ptr, settled_ptr, V, chunk, splits,
                   MAX_SPLITS: tl.constexpr, BLOCK: tl.constexpr, MAX_CAND: tl.constexpr,
                   PDL: tl.constexpr = False):
    """Histogram rows race their sure ids and copy out their band; rows without top-k or top-p race every id
    min-p keeps. Threshold rows took their candidates in the pass before (and have no sure ids); rows a top-p
    race round settled have their token."""
    wait_for_previous_kernel(PDL)
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t = tl.load(temp_ptr + row)
    if (t > 0) & (tl.load(settled_ptr + row) < 0):
        inv_t = 1.0 / tl.maximum(t, 1e-5)
        _, _, s_m, s_l = _row_stats(part_ptr, row, splits, MAX_SPLITS)
        min_p = tl.load(minp_ptr + row)
        key = _row_key(seed_ptr, step_ptr, row)
        start = split * chunk
        stop = tl.minimum(start + chunk, V)
        best, best_i = tl.full([BLOCK], NEG, tl.float32), tl.zeros([BLOCK], tl.int32)
        sure_mass = tl.zeros([BLOCK], tl.float32)
        filtered = _filtered(temp_ptr, topk_ptr, topp_ptr, row)
        if filtered & (not _by_lanes(temp_ptr, topk_ptr, row)):
            lo, hi, refined, hr, flo, fhi, n_band, placed = _hist_band(
                hist_ptr, fine_ptr, part_ptr, row, splits, tl.load(topk_ptr + row), tl.load(topp_ptr + row),
                min_p, s_l, MAX_SPLITS, MAX_CAND)
            has_sure = (lo > 0) | (refined & (flo > 0))
            if placed:
                s_next = _load_block(adj_ptr + row * V, start, stop, BLOCK)
                for off in range(start, stop, BLOCK):
                    cols = off + tl.arange(0, BLOCK)
                    mask = cols < stop
                    s = s_next.to(tl.float32) * inv_t
                    s_next = _load_block(adj_ptr + row * V, off + BLOCK, stop, BLOCK)
                    b = _bin_of(s, s_m)
                    if refined:  # slices of the window; outside it, FINE - 1 is past both flo and fhi
                        f = _fine_slice(s, s_m, b, lo, hr)
                        sure = mask & ((b < lo) | (f < flo))
                        band = (f >= flo) & (f <= fhi)
                    else:
                        sure = mask & (b < lo)
                        band = (b >= lo) & (b <= hi)
                    if has_sure:
                        e = tl.exp(s - s_m)
                        sure_mass += tl.where(sure, e, 0.0)
                        r = tl.where(sure & (e >= min_p), _race_key(s - s_m, cols, key), NEG)
                        best, best_i = _keep_best(best, best_i, r, cols)
                    _copy_out(count_ptr, cand_s_ptr, cand_i_ptr, row, mask & band, s, cols, MAX_CAND)
        elif not filtered:  # no top-k / top-p: race every id that min-p keeps
            for off in range(start, stop, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                mask = cols < V
                s = tl.load(adj_ptr + row * V + cols, mask=mask, other=NEG).to(tl.float32) * inv_t
                keep = mask & (s > NEG)
                if min_p > 0:
                    keep = keep & (tl.exp(s - s_m) >= min_p)
                best, best_i = _keep_best(best, best_i, tl.where(keep, _race_key(s - s_m, cols, key), NEG), cols)
        b, b_i = _lanes_best(best, best_i)
        tl.store(part_ptr + (row * splits + split) * PART + 5, b)
        tl.store(part_ptr + (row * splits + split) * PART + 6, tl.sum(sure_mass, 0))
        tl.store(part_i_ptr + (row * splits + split) * 2 + 1, b_i)


@triton.jit
def _band_tile(cand_s_ptr, cand_i_ptr, row, i, n_band, MAX_CAND: tl.constexpr):
    """Scaled logits and ids of band candidates i (-inf and id -1 past the band's end)."""
    live = i < n_band
    return (tl.load(cand_s_ptr + row * MAX_CAND + i, mask=live, other=NEG),
            tl.load(cand_i_ptr + row * MAX_CAND + i, mask=live, other=-1))


@triton.jit
def _ahead_of(cand_s_ptr, cand_i_ptr, row, n_band, s_i, id_i, s_m,
              MAX_CAND: tl.constexpr, TILE: tl.constexpr):
    """For candidates i: how many candidates sort before them (s descending, then id descending) and the exp mass
    of those: ranks and exclusive prefix sums in sorted order, by comparing every pair instead of sorting."""
    rank = tl.zeros([TILE], tl.int32)
    before = tl.zeros([TILE], tl.float32)
    for j0 in range(0, n_band, TILE):
        j = j0 + tl.arange(0, TILE)
        s_j, id_j = _band_tile(cand_s_ptr, cand_i_ptr, row, j, n_band, MAX_CAND)
        ahead = (j < n_band)[None, :] & ((s_j[None, :] > s_i[:, None]) |
                                 ((s_j[None, :] == s_i[:, None]) & (id_j[None, :] > id_i[:, None])))
        rank += tl.sum(ahead.to(tl.int32), 1)
        before += tl.sum(tl.where(ahead, tl.exp(s_j - s_m)[None, :], 0.0), 1)
    return rank, before


@triton.jit(do_not_specialize=["splits"])
def _finish_kernel(raw_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, step_ptr, part_ptr, part_i_ptr,
                   hist_ptr, fine_ptr, count_ptr, cand_s_ptr, cand_i_ptr, settled_ptr, token_ptr, logprob_ptr,
                   done_ptr, V, splits, MAX_SPLITS: tl.constexpr, MAX_CAND: tl.constexpr, TILE: tl.constexpr,
                   PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    raw_m, raw_l, s_m, s_l = _row_stats(part_ptr, row, splits, MAX_SPLITS)
    parts = tl.arange(0, MAX_SPLITS)
    part_at = row * splits + parts
    t = tl.load(temp_ptr + row)
    done = tl.full([], 1, tl.int32)
    if t <= 0:  # greedy on the penalised logits
        vals = tl.load(part_ptr + part_at * PART + 4, mask=parts < splits, other=NEG)
        token = tl.load(part_i_ptr + (row * splits + tl.argmax(vals, 0)) * 2)
    else:
        races = tl.load(part_ptr + part_at * PART + 5, mask=parts < splits, other=NEG)
        winner = tl.argmax(races, 0)
        token = tl.load(part_i_ptr + (row * splits + winner) * 2 + 1)  # the sure ids' (or every id's) winner
        settled = tl.load(settled_ptr + row)
        if settled >= 0:
            token = settled
        elif _filtered(temp_ptr, topk_ptr, topp_ptr, row):
            top_k, top_p, min_p = tl.load(topk_ptr + row), tl.load(topp_ptr + row), tl.load(minp_ptr + row)
            if _by_lanes(temp_ptr, topk_ptr, row):
                n_band = tl.load(count_ptr + row)  # every id at or above the threshold, as the take pass copied
                placed = n_band <= MAX_CAND
            else:
                _, _, _, _, _, _, n_band, placed = _hist_band(hist_ptr, fine_ptr, part_ptr, row, splits, top_k, top_p,
                                                              min_p, s_l, MAX_SPLITS, MAX_CAND)
            if placed:
                sure_mass = tl.sum(tl.load(part_ptr + part_at * PART + 6, mask=parts < splits, other=0.0), 0)
                k_eff = tl.where(top_k > 0, top_k, V)  # with top-k on, lo = 0 and the band starts at rank 0
                key = _row_key(seed_ptr, step_ptr, row)
                z = s_l
                if top_k > 0:  # top-p normalises by the top-k mass
                    z = 0.0
                    for i0 in range(0, n_band, TILE):
                        i = i0 + tl.arange(0, TILE)
                        s_i, id_i = _band_tile(cand_s_ptr, cand_i_ptr, row, i, n_band, MAX_CAND)
                        e_i = tl.exp(s_i - s_m)
                        rank, _ = _ahead_of(cand_s_ptr, cand_i_ptr, row, n_band, s_i, id_i, s_m,
                                            MAX_CAND, TILE)
                        z += tl.sum(tl.where((i < n_band) & (rank < k_eff), e_i, 0.0), 0)
                best, best_id = tl.max(races, 0), token
                for i0 in range(0, n_band, TILE):
                    i = i0 + tl.arange(0, TILE)
                    live = i < n_band
                    s_i, id_i = _band_tile(cand_s_ptr, cand_i_ptr, row, i, n_band, MAX_CAND)
                    e_i = tl.exp(s_i - s_m)
                    rank, ahead_mass = _ahead_of(cand_s_ptr, cand_i_ptr, row, n_band, s_i, id_i, s_m,
                                                 MAX_CAND, TILE)
                    before = (sure_mass + ahead_mass) / z
                    keep = live & (rank < k_eff) & (before < tl.where(top_p >= 1.0, float("inf"), top_p))
                    keep = keep & (e_i >= min_p)
                    r = tl.where(keep, _race_key(s_i - s_m, id_i, key), NEG)
                    tile_best, tile_id = _lanes_best(r, id_i)
                    if tile_best > best:
                        best, best_id = tile_best, tile_id
                token = best_id
            else:
                done = tl.full([], 0, tl.int32)
    x = tl.load(raw_ptr + row * V + token).to(tl.float32)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, x - raw_m - tl.log(raw_l))
    tl.store(done_ptr + row, done)


@dataclass
class Drawn:
    tokens: torch.Tensor  # [N] long
    logprobs: torch.Tensor  # [N] float: of the chosen token under the raw distribution
    done: torch.Tensor  # [N] int32: 0 where the row must be sampled by the reference instead
    settled: torch.Tensor  # [N] int32: the token a top-p race round settled on, or negative (not by one)


def default_splits(rows: int, vocab: int, device: torch.device, top_p_rounds: bool = False) -> int:
    """Enough programs per pass to fill the GPU (a few per SM), never a block less than BLOCK per split. With the
    top-p race rounds, twice as many: a row the rounds leave takes the histogram passes about alone, and more
    programs shorten them (batch 64 at top-p 0.8, T 0.7 on the H200: such a batch 153.2 -> 133.6 µs; a top-k
    threshold batch, which has no rounds, would lose 10 µs; docs/benchmarks/log/kernels.md)."""
    want = max(1, triton.cdiv((8 if top_p_rounds else 4) * multiprocessors(device), rows))
    return min(MAX_SPLITS, triton.next_power_of_2(want), max(1, triton.next_power_of_2(triton.cdiv(vocab, 8 * BLOCK))))


def compile_for_batches(max_rows: int, vocab: int, dtype: torch.dtype, device: torch.device, pdl: bool = True) -> int:
    """Draw once for every batch size class up to `max_rows` that compiles the passes anew (the histogram pass's
    BLOCK_S follows `default_splits`, which follows the rows), with and without the top-p rounds, on logits in the
    model dtype and in fp32 (what the penalties make of them), so that a batch growing while serving meets no
    compile. Returns the draws made."""
    classes: dict[tuple[int, int], int] = {}
    for rows in range(1, max_rows + 1):
        for rounds in (0, TOP_P_ROUNDS):
            splits = default_splits(rows, vocab, device, rounds > 0)
            classes.setdefault((triton.next_power_of_2(splits), rounds), rows)
    for (_, rounds), rows in classes.items():
        for logits_dtype in {dtype, torch.float32}:
            logits = lm_like_logits(rows, vocab, device).to(logits_dtype)
            p = SamplingTensors.filled(rows, device, top_k=0 if rounds else 20, top_p=0.9 if rounds else 1.0)
            draw(logits, p, top_p_rounds=rounds, pdl=pdl)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return len(classes)


def later_round_programs(vocab: int, block: int = BLOCK) -> int:
    """Programs to a row in the race rounds after the first: a block or two of ids each (up to MAX_SPLITS)."""
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(vocab, block)))


def draw(logits: torch.Tensor, p: SamplingTensors, splits: int | None = None,
         max_candidates: int = MAX_CANDIDATES, block: int = BLOCK, warps: int = 4,
         top_p_rounds: int = TOP_P_ROUNDS, pdl: bool = True) -> Drawn:
    """Greedy / temperature / top-k / top-p / min-p with penalties, for every row at once (see the module doc).
    `top_p_rounds` race rounds run for top-p-alone rows (0 when the caller knows there are none: two launches a
    round fewer). `splits` (programs per row), `max_candidates` (a power of two), `block` and `warps` (the passes'
    tile) are exposed for tests and the benchmark's sweep."""
    N, V = logits.shape
    dev = logits.device
    adjusted = apply_penalties(logits, p)
    splits = splits or default_splits(N, V, dev, top_p_rounds > 0)
    pdl = pdl_options(dev, pdl)  # each pass waits for the one before at its start
    if splits > MAX_SPLITS:
        raise ValueError(f"splits={splits}: at most MAX_SPLITS={MAX_SPLITS} programs per row")
    chunk = triton.cdiv(triton.cdiv(V, splits), block) * block
    part = torch.empty(N, splits, PART.value, dtype=torch.float32, device=dev)
    part_i = torch.empty(N, splits, 2, dtype=torch.int32, device=dev)
    hist = torch.empty(N, BINS.value, dtype=torch.int32, device=dev)
    fine = torch.empty(N, FINE.value, dtype=torch.int32, device=dev)
    lanes = torch.empty(N, splits, LANE_TOP_K.value, dtype=torch.float32, device=dev)
    kth = torch.empty(N, dtype=torch.float32, device=dev)
    count = torch.empty(N, dtype=torch.int32, device=dev)
    cand_s = torch.empty(N, max_candidates, dtype=torch.float32, device=dev)
    cand_i = torch.empty(N, max_candidates, dtype=torch.int32, device=dev)
    settled = torch.empty(N, dtype=torch.int32, device=dev)  # -1 racing, -2 left to the histogram, else the token
    floor = torch.empty(N, dtype=torch.float32, device=dev)
    later = later_round_programs(V, block)
    widest = max(splits, later)
    race, race_i = (torch.empty(N, widest, dtype=dt, device=dev) for dt in (torch.float32, torch.int32))
    ahead = torch.empty(N, widest, 2, dtype=torch.float32, device=dev)
    listed = torch.empty(2, N, dtype=torch.int32, device=dev)  # the rows each round leaves for the next
    n_listed = torch.empty(2, dtype=torch.int32, device=dev)
    arrived = torch.empty(N, dtype=torch.int32, device=dev)  # a round's mass-pass programs done, per row
    out = Drawn(torch.empty(N, dtype=torch.long, device=dev), torch.empty(N, dtype=torch.float32, device=dev),
                torch.empty(N, dtype=torch.int32, device=dev), settled)
    temp, top_p, min_p = p.temperature.float(), p.top_p.float(), p.min_p.float()
    top_k = torch.where(p.top_k >= V, 0, p.top_k)  # keeping the whole vocabulary is no top-k
    grid = (N, splits)
    _stats_kernel[grid](logits, adjusted, temp, top_k, part, part_i, lanes, hist, fine, count, settled, floor,
                        arrived, V, chunk, splits, PENALISED=adjusted is not logits, BLOCK=block, num_warps=warps,
                        **pdl)
    for r in range(top_p_rounds):
        # The first round races every top-p row, `splits` programs to a row. The later ones race only the rows the
        # round before listed, each over `later` programs, on as many programs in all as the first round had.
        w = splits if r == 0 else later
        rchunk = triton.cdiv(triton.cdiv(V, w), block) * block
        rounds_grid = grid if r == 0 else (max(1, N * splits // later) * later,)
        rows, n_rows, next_rows, next_n = listed[(r + 1) % 2], n_listed[(r + 1) % 2], listed[r % 2], n_listed[r % 2]
        _race_above_kernel[rounds_grid](adjusted, temp, top_k, top_p, min_p, p.seeds, p.steps, part, settled, floor,
                                        race, race_i, rows, n_rows, next_n, V, splits, rchunk, w,
                                        MAX_SPLITS=MAX_SPLITS, BLOCK=block, LISTED=r > 0, num_warps=warps, **pdl)
        _mass_ahead_kernel[rounds_grid](adjusted, temp, top_k, top_p, part, settled, floor, race, race_i, ahead,
                                        arrived, rows, n_rows, next_rows, next_n, V, splits, rchunk, w,
                                        MAX_SPLITS=MAX_SPLITS, BLOCK=block, LISTED=r > 0, num_warps=warps, **pdl)
    _hist_kernel[grid](adjusted, temp, top_k, top_p, part, lanes, kth, hist, settled, V, chunk, splits,
                       MAX_SPLITS=MAX_SPLITS, BLOCK=block, BLOCK_S=triton.next_power_of_2(splits), num_warps=warps,
                       **pdl)
    _take_or_refine_kernel[grid](adjusted, temp, top_k, top_p, min_p, part, hist, fine, kth, count, cand_s, cand_i,
                                 settled, V, chunk, splits, MAX_SPLITS=MAX_SPLITS, BLOCK=block,
                                 MAX_CAND=max_candidates, num_warps=warps, **pdl)
    _gather_kernel[grid](adjusted, temp, top_k, top_p, min_p, p.seeds, p.steps, part, part_i, hist, fine, count,
                         cand_s, cand_i, settled, V, chunk, splits, MAX_SPLITS=MAX_SPLITS, BLOCK=block,
                         MAX_CAND=max_candidates, num_warps=warps, **pdl)
    _finish_kernel[(N,)](logits, temp, top_k, top_p, min_p, p.seeds, p.steps, part, part_i, hist, fine, count, cand_s,
                         cand_i, settled, out.tokens, out.logprobs, out.done, V, splits, MAX_SPLITS=MAX_SPLITS,
                         MAX_CAND=max_candidates, TILE=64, num_warps=4, **pdl)
    return out


def top_p_alone(temperature: float, top_p: float, top_k: int, vocab: int) -> bool:
    """Whether a row's parameters take the top-p race rounds (sampled, top-p on, no top-k short of the
    vocabulary): the host's twin of `_top_p_alone`, so callers launch the rounds only when a row needs them."""
    return temperature > 0 and top_p < 1 and not 0 < top_k < vocab


def sample_on_gpu(logits: torch.Tensor, p: SamplingTensors, num_logprobs: int = 0,
                  max_candidates: int = MAX_CANDIDATES, top_p_alone: bool = True, pdl: bool = True):
    """`kernels.sampling.sample_reference`'s contract on `draw`: rows `draw` flags are sampled again by the reference.
    Reads the flags on the host (one synchronisation; the caller reads the tokens right after anyway).
    top_p_alone=False (the caller knows no row has top-p without top-k) skips the top-p race rounds."""
    drawn = draw(logits, p, max_candidates=max_candidates, top_p_rounds=TOP_P_ROUNDS if top_p_alone else 0, pdl=pdl)
    tokens, chosen = drawn.tokens, drawn.logprobs
    redo = (drawn.done == 0).nonzero()[:, 0]
    if redo.numel():
        tokens[redo], chosen[redo], _, _ = sample_reference(logits[redo], p.rows(redo))
    return (tokens, chosen, *top_logprobs(logits, num_logprobs))
