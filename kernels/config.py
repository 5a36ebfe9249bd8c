"""Launch choices of the Triton ops, as data: one frozen `KernelConfig` is handed to the op set
(`kernels.ops.triton_ops(config)`) and from there to every op; nothing reads a module global. Benchmarks and tests
make their own with `dataclasses.replace`. Plain Python: the runtime can name it without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Tile(NamedTuple):
    """A loop-over-K GEMV's tile: BLOCK_N output rows a program, BLOCK_K columns an iteration."""

    block_n: int
    block_k: int
    warps: int
    stages: int


class WholeRows(NamedTuple):
    """The whole-rows GEMV's launch configuration."""

    rows: int  # weight rows a program (gate rows, with as many up rows, for silu(gate) * up)
    warps: int


GDN_FACTOR_MODES = ("fp32", "bf16")


@dataclass(frozen=True)
class KernelConfig:
    # Programmatic dependent launch for the decode kernels and the sampler's passes (kernels/launch.py).
    pdl: bool = True

    # One-row projections (batch-1 decode): our GEMVs instead of cuBLAS, which reaches about half the copy bandwidth
    # on small matrices at one row. Off also unfuses the input norms.
    gemv_one_row: bool = True
    # Whole rows: a program loads its few weight rows in full, as two power-of-two spans (K = K1 + K2), and reduces
    # once, so all its loads are in flight together; it takes the narrowing projections whose K splits so. Off: the
    # loop over K tiles takes every one-row projection.
    whole_rows: bool = True
    gemv_whole_rows: WholeRows = WholeRows(1, 4)
    gemv_tile: Tile = Tile(2, 2048, 2, 2)
    # A widening projection of an input narrower than `wide_input_k` has few columns to stream per row: more rows a
    # program keep it busy.
    gemv_narrow_widening_tile: Tile = Tile(4, 512, 4, 2)
    wide_input_k: int = 4096

    # The block's input add-and-norm fused into the one-row projection that reads it (and silu(gate) * up into the
    # MLP's epilogue). Every program reloads the input, the residual and the norm weight, which on wide inputs costs
    # what the saved launches give back, so only inputs narrower than `wide_input_k` are fused.
    fused_norm: bool = True
    # Two rows a program (two gate and two up rows with silu) in four warps: the fastest of the H200 sweep on every
    # node it ran on (two warps won on one node and lost on another).
    norm_gemv_whole_rows: WholeRows = WholeRows(2, 4)
    norm_gemv_silu_whole_rows: WholeRows = WholeRows(2, 4)
    norm_gemv_tile: Tile = Tile(4, 512, 4, 2)
    # BLOCK_N gate rows and as many up rows; a shorter K tile with a third stage beat (8, 512, 4, 2) on the H200.
    norm_gemv_silu_tile: Tile = Tile(8, 256, 4, 3)


    # FP8 weights (`kernels.fp8`) up to 64 rows (decode): (BLOCK_N, programs an SM that K splits aim at, warps,
    # stages) of the W8A16 kernel: the fastest of the 27B sweep (`tools/lab/fp8_sweep.py`) on every projection
    # but the widest, whose tiles `fp8.decode_tiles` doubles.
    fp8_decode_tile: tuple[int, int, int, int] = (32, 4, 4, 3)
    # One row (batch-1 decode, a draft's FP8 lm_head): the CUDA-core GEMV (`fp8._w8a16_gemv_kernel`; BLOCK_N
    # divides the 128-row blocks, BLOCK_K halves until it divides K) instead of the tensor-core tile above, which
    # it beat on every 9B and 27B projection (H100, `tools/lab/fp8_sweep.py`): the 9B batch-1 step 4.09 -> 3.68
    # ms, the 27B's 11.61 -> 11.17. None: the tile above.
    fp8_gemv_tile: Tile | None = Tile(8, 1024, 4, 2)
    # Above `fp8_few_rows` rows (batch-32 and batch-64 steps) every column tile rereads all rows' activations, which
    # wider tiles share out: BLOCK_N 128 was the fastest at 64 rows on every 27B projection (H100, `fp8_sweep
    # --decode-rows 64`), and cuBLAS's block-scaled FP8 GEMM (W8A8, as `fp8_prefill` "cublas") faster still where
    # it takes the weight (1.2-1.8x our tile at 64 rows: 81 against 142 us on gate_up).
    fp8_few_rows: int = 16
    fp8_decode_many_rows_tile: tuple[int, int, int, int] = (128, 4, 4, 3)
    # Above 64 rows (prefill): "dequant" dequantises each weight to the activations' dtype (one pass over its
    # bytes, `fp8.dequantised`) and runs cuBLAS's GEMM, so the output is the dequantised model's up to bf16
    # rounding, at nearly bf16's prefill rate (the default). "w8a16" widens the weights in registers in our tile:
    # as exact, a third of the rate (27B, 16 layers, 8k tokens on an H100: 365.9 against 116.7 ms for "cublas").
    # "cublas" quantises the activations per token and 128 columns and runs cuBLAS's block-scaled FP8 GEMM (sm90,
    # CUDA 12.9+; the rank checks at start-up and falls back to "w8a8"), taking every weight it can above
    # `fp8_few_rows` rows (decode batches too: 22.6 against 29.9 ms W8A16 for the 27B batch-64 step); "w8a8" the
    # same arithmetic on our Triton kernel. Quantising the activations costs accuracy where channels carry
    # outliers, as trained models' do: on a 4B-width checkpoint quantised by an independent converter, top-8
    # |Δ log-prob| mean 0.066 / p99 0.47 against HF in fp32, where W8A16 gave 0.035 / 0.110 (the gate: 0.06 /
    # 0.2). Opt-in only.
    fp8_prefill: str = "dequant"
    # (BLOCK_M, BLOCK_N, warps, stages) of each prefill kernel.
    fp8_w8a8_tile: tuple[int, int, int, int] = (128, 128, 8, 3)
    fp8_w8a16_tile: tuple[int, int, int, int] = (128, 128, 8, 3)
    # (rows, 128-column groups, warps) a program of the activations' FP8 quantisation before a W8A8 / cuBLAS
    # projection (groups a power of two; the fused silu_mul pass takes its groups and warps): H100, 8192 x 5120
    # bf16 in 49.5 us (2.6 TB/s) against 200.8 with one group a program; tiles (1, 8) to (16, 4) within 5%.
    fp8_quantise_tile: tuple[int, int, int] = (4, 8, 4)

    # Prefill attention (BLOCK_M, BLOCK_N, warps, stages): the fastest of the H200 sweep at head dim 256 (8k causal
    # tokens, 4B heads: 1309 us against 1357 with three stages; `log/gpu-2026-12-06-bf71da1.md`). An fp32
    # model's tiles are twice the bytes: (128, 64, 8, 3) asked for 289 KB of shared memory (an H100 has 227 KB).
    prefill_attention_tile: tuple[int, int, int, int] = (128, 64, 8, 2)
    prefill_attention_tile_fp32: tuple[int, int, int, int] = (32, 32, 4, 2)
    # Most programs each query block's keys are shared out over (a second kernel merges them). A chunk after a long
    # cached context (a chat's later turn) has few query blocks, each over the whole context: 160 programs, two
    # waves on 132 SMs for a 1025-token chunk at 4B. A request splits one way more for every
    # `attention.PREFILL_SPLIT_KEYS` cached keys; 4 ran that chunk's attention 1.50x faster on an H100. 1 (off)
    # until the engine's prefill with it is measured (`profile_prefill --prefill-attention-splits 4`).
    prefill_attention_splits: int = 1
    # The routed experts (`kernels.moe`): (BLOCK_M token-expert pairs, BLOCK_N, BLOCK_K, warps, stages) a program
    # of the gate_up and the down kernels. BLOCK_M pads each expert's pairs; 16 is the smallest tensor-core tile,
    # which a decode step's one or few pairs an expert fill least badly. Not yet swept on a GPU.
    moe_tile: tuple[int, int, int, int, int] = (16, 64, 64, 4, 3)

    # Prefill conv (BLOCK_T tokens, BLOCK_C channels, warps) a program: the fastest of an H200 sweep over 8192 tokens
    # of 8192 channels (129 us, about half the copy bandwidth; wider or taller tiles and 8 warps were slower).
    conv1d_prefill_tile: tuple[int, int, int] = (32, 128, 4)

    # Chunked GDN prefill, prep kernel (warps, stages, column block, register cap). Uncapped it takes 255 registers
    # a thread, two programs an SM; 168 lets three programs of four warps share the 64K registers, and the little it
    # spills costs less than the occupancy gives.
    gdn_prep: tuple[int, int, int, int] = (4, 1, 64, 168)
    # State pass (block of dv, warps, stages). Its programs walk their request's chunks one after another, so a batch
    # of few long requests is bound by that walk's latency: narrow blocks pay while every program runs at once;
    # otherwise wide blocks (k, q, Kd and P read half as often) do.
    gdn_scan_narrow: tuple[int, int, int] = (32, 4, 3)
    gdn_scan_wide: tuple[int, int, int] = (64, 4, 3)
    # fp32 factors take the wide block with two stages: three stages of fp32 tiles outgrow shared memory at the
    # widest heads, and 32-wide blocks with fp32 factors in a bf16 model gave NaN outputs under Triton 3.6.
    gdn_scan_fp32_factors: tuple[int, int, int] = (64, 4, 2)
    # The precision of the WY factors Kd and W in a bf16 model. "bf16": formed from the inverse rounded to bf16,
    # stored in bf16 and applied to the state rounded to bf16 (the state itself stays fp32), as fla-core does, 1.4x
    # faster at the 27B heads. "fp32": fp32 factors and TF32 products, about 5x closer to the fp32 reference in the
    # final state. An fp32 model always takes "fp32".
    gdn_factors: str = "bf16"

    def __post_init__(self) -> None:
        if self.gdn_factors not in GDN_FACTOR_MODES:
            raise ValueError(f"gdn_factors must be one of {GDN_FACTOR_MODES}, got {self.gdn_factors!r}")


DEFAULT = KernelConfig()
