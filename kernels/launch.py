"""What the Triton kernels share: launch options (programmatic dependent launch), the device's SM count, the
bf16 matmul helper that also runs under the interpreter, and split-K for projections of few rows."""

from __future__ import annotations

import functools
import os

import torch
from .triton_or_absent import tl, triton


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's SM count (4 on the CPU, where the interpreter runs the kernels), for sizing grids."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def rows_per_program(n_rows: int, block: int, device: torch.device) -> int:
    """Rows (each padded to `block` elements) a program of a row-wise kernel takes: the largest power of two that
    keeps a program within 2048 elements and still leaves every SM four programs; one in decode. A prefill's rows
    are tens of thousands of short ones (a head's 128 or 256 elements), which one a program would leave a few
    elements a thread. It doubles with the rows, so prompts of doubling lengths (the warm-up's) meet every value."""
    share, most = n_rows // (4 * multiprocessors(device)), 2048 // block
    return 1 if share < 2 or most < 2 else min(most, 1 << (share.bit_length() - 1))


# The interpreter's tl.dot on bf16 operands returns garbage, so there `_dot_bf16` multiplies the bf16-rounded
# operands in fp32: the same products (exact in fp32), summed in another order.
BF16_MMA = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _dot_bf16(a, b, acc=None):
    """acc + a @ b on operands rounded to bf16, accumulated in fp32."""
    a, b = a.to(tl.bfloat16), b.to(tl.bfloat16)
    if BF16_MMA:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


# Programmatic dependent launch (sm90+). A decode step is some 230 short kernels; launched with PDL, a kernel's
# programs start on the SMs the previous kernel's tail leaves idle instead of after a launch gap.
# The rule that keeps this safe: before `wait_for_previous_kernel` a kernel reads only what no kernel writes (model
# weights, and the decode slots, which the host writes before the step) and writes nothing. Each kernel lets the
# next one launch only after its own wait, so at most two kernels overlap. The conv and the GDN decode read their
# row's slot before the wait, which takes one load off their chain of dependent loads. Reading more before the wait
# (the layers' state, a projection two kernels back, the attention's lengths and first pages) made the step slower:
# those loads then wait behind the previous kernel's writes anyway, and hold the SM while they do. Off
# (`KernelConfig.pdl`), on the CPU and before sm90 every kernel launches plainly.


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_options(device: torch.device, enabled: bool) -> dict:
    """Launch options for a kernel with a `PDL` constexpr (one that calls `wait_for_previous_kernel` first)."""
    return {"PDL": True, "launch_pdl": True} if enabled and _pdl_capable(device) else {}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible, then let the next
    kernel launch. A no-op without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# Split-K for projections of few rows: a narrow output (few column tiles) over a long K leaves most SMs idle and
# each program streaming its tile's K serially, so the K range is split across programs. Each writes its fp32
# partial sum; the last program of a column tile to finish adds them in split order (deterministic, unlike
# atomics on the output) and writes the tile: no second kernel, whose launch boundary cost about as much as its
# work. Programs count their arrivals in a counter a tile, which the last one resets to zero. The counters are
# one set a stream: a stream's kernels run one after another (with PDL a kernel waits for the previous one
# before it touches them), while two streams (two engines on one device) may run theirs at once.

SPLIT_COUNTERS = 1 << 12  # column tiles a split projection may have (fewer than the programs it aims at)


def k_splits(tiles: int, k: int, block: int, programs: int) -> tuple[int, int]:
    """(splits, K a split): programs sharing each column tile's K range, enough for about `programs` programs in
    all, each over at least two whole blocks of `block` columns (the last split takes what is left)."""
    blocks = triton.cdiv(k, block)
    splits = max(1, min(triton.cdiv(programs, tiles), blocks // 2))
    per_split = triton.cdiv(blocks, splits) * block
    return triton.cdiv(k, per_split), per_split


_counters: dict[tuple[torch.device, int], torch.Tensor] = {}


def split_buffers(out: torch.Tensor, splits: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, counters) of a projection into `out` [M, N] whose K range `splits` programs share in each of its
    `tiles` column tiles: the fp32 partial sums [splits, M, N] and the stream's arrival counters (`store_split`);
    unsplit, `out` for both (the kernel touches neither)."""
    if splits == 1:
        return out, out
    return (torch.empty(splits, *out.shape, dtype=torch.float32, device=out.device),
            _split_counters(out.device, tiles))


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The current stream's zeroed arrival counters, made by its first split projection: eagerly, as a graph is
    captured on a stream that ran its program eagerly first (the engine's rank stream)."""
    if tiles > SPLIT_COUNTERS:
        raise ValueError(f"a split projection of {tiles} column tiles exceeds the {SPLIT_COUNTERS} counters")
    key = (device, torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0)
    counters = _counters.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a split projection is captured on a stream that has not run one eagerly")
        counters = _counters[key] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
    return counters


@triton.jit
def store_split(acc, partial_ptr, out_ptr, counters_ptr, offsets, mask, size, split, splits, tile):
    """A split program's end: its fp32 partial sum `acc` into partial[split] ([splits, size], at `offsets`); the
    last program of column tile `tile` to arrive adds the partials in split order into out (its dtype)."""
    tl.store(partial_ptr + split.to(tl.int64) * size + offsets, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial stored before the (one-thread, releasing) arrival
    arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == splits - 1:
        total = tl.zeros_like(acc)
        for s in range(0, splits):
            total += tl.load(partial_ptr + s * size + offsets, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counters_ptr + tile, 0)
