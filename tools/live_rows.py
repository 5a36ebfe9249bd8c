"""Decode inputs for diagnostics and benchmarks: `rows` live rows with random state, KV and page tables."""

from __future__ import annotations

import contextlib

import torch

from deltaserve.model.batch import StepBatch


def fill_live_rows(runtime, rows: int, bucket: int, context: int, seed: int = 0, lookahead: int = 0) -> None:
    """Give decode slots 0..rows-1 random GDN state, random KV pages and a position near `context` (pages for
    `lookahead` positions more: a speculative step's drafts), and write the step's inputs (rows live, the rest of
    the bucket inert padding)."""
    gen = torch.Generator().manual_seed(seed)
    state, inputs = runtime.state, runtime.inputs
    page = state.page_size
    positions = [max(0, context - 1 - int(torch.randint(0, max(1, context // 4), (1,), generator=gen)))
                 for _ in range(rows)]
    pages_needed = [(p + lookahead) // page + 1 for p in positions]
    if sum(pages_needed) > state.num_pages:
        raise ValueError(f"{rows} rows at context {context} need {sum(pages_needed)} KV pages; "
                         f"only {state.num_pages} exist")
    order = torch.randperm(state.num_pages, generator=gen).tolist()
    inputs.table_host[:] = state.trash_page
    at = 0
    for r, n in enumerate(pages_needed):
        inputs.table_host[r, :n] = order[at : at + n]
        at += n
    device_gen = torch.Generator(device=state.conv.device).manual_seed(seed)
    with torch.no_grad():  # generated in place: the state pools fill most of the device
        state.conv[:, :rows].normal_(generator=device_gen)
        state.ssm[:, :rows].normal_(std=0.1, generator=device_gen)
        for cache in (state.k_cache, state.v_cache):
            cache.normal_(generator=device_gen)
    tokens = torch.randint(0, runtime.vocab, (rows,), generator=gen).tolist()
    inputs.fill(tokens, positions, bucket)


def snapshot(state):
    """The request slots' GDN state (not the prefix cache's snapshot pool, which the diagnostics never touch and
    which may be a tenth of the GPU), kept in host memory: 64 slots of the 27B's state are 9 GiB, more than the
    device has free once the engine planned its memory. Layer by layer: a slot range of one layer is contiguous,
    so nothing is staged on the device."""
    n = state.num_slots
    return [[layer[:n].to("cpu", copy=True) for layer in pool] for pool in (state.conv, state.ssm)]


def restore(state, saved) -> None:
    n = state.num_slots
    for pool, kept in zip((state.conv, state.ssm), saved):
        for layer, layer_kept in zip(pool, kept):
            layer[:n].copy_(layer_kept)


@contextlib.contextmanager
def live_decode_batch(replica, rank: int, rows: int, context: int, lookahead: int = 0):
    """On one rank, in its device context and inference mode: `rows` live rows (`fill_live_rows`, the bucket no
    larger, pages for `lookahead` positions more) and their one-token step's batch, as (the rank, the batch). The GDN
    state comes back as it was on exit, so the steps a measurement runs leave no trace."""
    r = replica.ranks[rank]
    with r.backend.context(), torch.inference_mode():
        fill_live_rows(r.runtime, rows, rows, context, seed=rows, lookahead=lookahead)
        saved = snapshot(r.runtime.state)
        try:
            yield r, StepBatch.of(r.runtime.inputs.batch(rows))
        finally:
            restore(r.runtime.state, saved)
