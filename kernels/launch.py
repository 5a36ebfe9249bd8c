"""What the Triton kernels share: launch options (programmatic dependent launch), the device's SM count, the
bf16 matmul helper that also runs under the interpreter, and split-K for projections of few rows."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


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
# each program streaming its tile's K serially, so the K range is split across programs. Their fp32 partial sums
# are added by `sum_splits` in a fixed order (deterministic, unlike atomics).


def k_splits(tiles: int, k: int, block: int, programs: int) -> tuple[int, int]:
    """(splits, K a split): programs sharing each column tile's K range, enough for about `programs` programs in
    all, each over at least two whole blocks of `block` columns (the last split takes what is left)."""
    blocks = triton.cdiv(k, block)
    splits = max(1, min(triton.cdiv(programs, tiles), blocks // 2))
    per_split = triton.cdiv(blocks, splits) * block
    return triton.cdiv(k, per_split), per_split


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = the SPLITS fp32 partial sums [SPLITS, size] added in order, in out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < size
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(partial_ptr + s * size + offs, mask=live, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=live)


def sum_splits(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (contiguous) = partial [splits, *out.shape] (fp32) summed over its first axis, in order."""
    _sum_splits_kernel[(triton.cdiv(out.numel(), 1024),)](partial, out, out.numel(), SPLITS=partial.shape[0],
                                                           BLOCK=1024)
    return out
