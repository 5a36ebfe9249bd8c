"""Capacity math (DESIGN §5): how many decode rows and KV pages fit in the memory left after the weights.

A pure function of byte counts, tested on the CPU. The CUDA-graph reserve depends on the largest captured
bucket, which depends on the batch that fits: start from the bucket of the requested batch, fit the batch in
what the reserve leaves, and step down to the fitted batch's (smaller) bucket until the bucket stops changing;
the batch is then clamped to the bucket whose reserve was subtracted, so the later allocation never exceeds it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass


PREFILL_TOKEN_BUDGET = 8192  # prompt tokens a step carries by default (vLLM's and SGLang's)
MIN_DEFAULT_PREFILL_TOKEN_BUDGET = 2048
PREFILL_SCRATCH_SHARE = 8  # the default budget's activations take at most 1 / this of the memory after weights


def default_prefill_token_budget(free_bytes: int, activation_bytes: Callable[[int], int]) -> int:
    """The prompt tokens a step carries when the user sets none: PREFILL_TOKEN_BUDGET, halved (down to
    MIN_DEFAULT_PREFILL_TOKEN_BUDGET) while its prefill activations (`activation_bytes(tokens)`) would take more
    than 1 / PREFILL_SCRATCH_SHARE of `free_bytes`, which KV pages and state slots share: a bf16 27B on an
    80 GB GPU keeps room for several long requests instead of a few more prompt tokens a step."""
    tokens = PREFILL_TOKEN_BUDGET
    while tokens > MIN_DEFAULT_PREFILL_TOKEN_BUDGET and activation_bytes(tokens) * PREFILL_SCRATCH_SHARE > free_bytes:
        tokens //= 2
    return tokens


class CapacityRefused(ValueError):
    """Not even one request of full context length fits; the message carries the numbers."""


@dataclass(frozen=True)
class CapacityPlan:
    max_batch: int  # decode rows (dense slots)
    prefill_slots: int
    num_pages: int  # KV pages (excluding the trash page)
    page_size: int  # tokens per KV page
    largest_bucket: int  # buckets up to this one are captured
    graph_reserve_bytes: int
    state_bytes: int  # slots + pages + snapshots, as allocated
    snapshots: int = 0  # the prefix cache's state snapshots


def plan_capacity(
    *,
    free_bytes: int,
    bytes_per_slot: int,
    bytes_per_page: int,
    page_size: int,
    max_model_len: int,
    requested_batch: int,
    prefill_slots: int,
    prefill_scratch_bytes: int,
    buckets: list[int],
    graph_reserve: Callable[[int], int],
    snapshot_bytes: int = 0,
    bytes_per_snapshot: int | None = None,
) -> CapacityPlan:
    """Fit the largest batch <= requested_batch whose state slots leave KV pages for at least one full-length
    request, after `snapshot_bytes` for the prefix cache's state snapshots (as many as fit; each
    `bytes_per_snapshot`, by default a request slot's). The rows share the pages: admission reserves each
    request's prompt + max_tokens of them (`runtime.scheduler`), so short requests run many at once and a long
    one waits for pages instead of lowering the batch of everyone."""
    buckets = sorted(buckets)
    per_snapshot = bytes_per_snapshot or bytes_per_slot
    snapshots = max(0, snapshot_bytes) // per_snapshot
    budget = free_bytes - prefill_scratch_bytes - snapshots * per_snapshot
    pages_per_request = -(-max_model_len // page_size)
    # Each decode row needs its slot; one full context of pages (+1 trash page) must fit beside them.
    per_row = bytes_per_slot
    fixed = (prefill_slots + 2) * bytes_per_slot + (pages_per_request + 1) * bytes_per_page  # +2: trash, spare

    def fit(reserve: int) -> int:
        return max(0, min(requested_batch, (budget - reserve - fixed) // per_row))

    index = min(bisect.bisect_left(buckets, requested_batch), len(buckets) - 1)
    while True:
        reserve = graph_reserve(buckets[index])
        batch = fit(reserve)
        if batch == 0:
            if index == 0:
                raise CapacityRefused(
                    f"not even one request fits: {free_bytes / 2**20:.0f} MiB free, minus "
                    f"{prefill_scratch_bytes / 2**20:.0f} MiB prefill scratch, "
                    f"{snapshots * per_snapshot / 2**20:.0f} MiB of prefix-cache snapshots and "
                    f"{reserve / 2**20:.0f} MiB graph "
                    f"reserve (bucket {buckets[0]}), leaves less than one row "
                    f"(state {bytes_per_slot / 2**20:.1f} MiB + {pages_per_request} KV pages of "
                    f"{bytes_per_page / 2**20:.2f} MiB for max_model_len {max_model_len}); lower max_model_len or the "
                    f"prefix cache's state (--prefix-cache-state-gib), or free memory"
                )
            index -= 1
            continue
        fitted = min(bisect.bisect_left(buckets, batch), len(buckets) - 1)
        if fitted >= index:
            batch = min(batch, buckets[index])
            break
        index = fitted
    # Everything left after the rows' slots goes to KV pages (so long and short requests share them).
    slots_bytes = (batch + prefill_slots + 1) * bytes_per_slot
    if bytes_per_page:
        num_pages = (budget - reserve - slots_bytes) // bytes_per_page - 1
    else:  # no attention layer (a truncated checkpoint): pages hold nothing, so each row may take a full context
        num_pages = (batch + prefill_slots) * pages_per_request
    assert num_pages >= pages_per_request
    state = slots_bytes + (num_pages + 1) * bytes_per_page + snapshots * per_snapshot
    return CapacityPlan(batch, prefill_slots, num_pages, page_size, buckets[index], reserve, state, snapshots)
