"""Compile the decode step's GEMVs, the few-row kernel, the GDN decode and the prefill attention for sm90 without a
GPU and report what their machine code does.

    python -m deltaserve.tools.lab.inspect_kernels [--arch 90]

Triton compiles for a named target with the `ptxas` it ships, so this runs on the development machine. For each
kernel and tile it prints the registers a thread uses, how many programs an SM therefore holds at once (these
kernels are bound by the loads in flight, so this moved their times: docs/benchmarks/log/decode.md,
"The add-and-norm GEMV without barriers in its loop")
and, per loop of the SASS, the global loads and the `BAR.SYNC`s in it. A barrier in a GEMV's loop made each
iteration wait for its input's load before it asked for its weights (the same section). Pointers and the integer sizes are
declared 16-divisible, as the launcher specialises them at run time.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import re
import subprocess
import sys
import tempfile

# Compiling needs the kernels as Triton JIT functions, which the interpreter (the CPU tests' setting) replaces.
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from deltaserve.kernels import attention, gdn, gemv  # noqa: E402
from deltaserve.kernels.config import DEFAULT  # noqa: E402

log = logging.getLogger(__name__)

GEMV_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "K": "i32",
                  "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "EVEN_K": "constexpr", "PDL": "constexpr"}
NORM_GEMV_SIGNATURE = {"x_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                       "res_out_ptr": "*bf16", "N": "i32", "K": "i32", "up_rows": "i32", "eps": "fp32",
                       "HAS_RES": "constexpr", "HAS_NW": "constexpr", "SILU_MUL": "constexpr",
                       "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "EVEN": "constexpr", "PDL": "constexpr"}
WHOLE_ROWS_GEMV_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "K": "i32", "ROWS": "constexpr",
                             "K1": "constexpr", "K2": "constexpr", "PDL": "constexpr"}
WHOLE_ROWS_NORM_GEMV_SIGNATURE = {"x_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*bf16",
                                  "out_ptr": "*bf16", "res_out_ptr": "*bf16", "K": "i32", "up_rows": "i32",
                                  "eps": "fp32", "HAS_RES": "constexpr", "HAS_NW": "constexpr",
                                  "SILU_MUL": "constexpr", "ROWS": "constexpr", "K1": "constexpr", "K2": "constexpr",
                                  "PDL": "constexpr"}
GDN_DECODE_SIGNATURE = {"mixed_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16", "alog_ptr": "*fp32",
                        "dtb_ptr": "*fp32", "state_ptr": "*fp32", "slot_ptr": "*i64", "out_ptr": "*bf16", "C": "i32",
                        "ab_row_stride": "i32", "trash": "i32", "HV": "i32", "GROUP": "i32", "scale": "fp32",
                        "DK": "constexpr", "DV": "constexpr", "KEY_DIM": "constexpr", "BLOCK_K": "constexpr",
                        "BLOCK_V": "constexpr", "PDL": "constexpr"}
PREFILL_ATTENTION_SIGNATURE = {"q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "table_ptr": "*i32",
                               "cu_ptr": "*i32", "ctx_ptr": "*i64", "out_ptr": "*bf16", "part_o_ptr": "*fp32",
                               "part_ml_ptr": "*fp32", "row_splits_ptr": "*i32", "gate_ptr": "*bf16", "R": "i32",
                               "NH": "i32", "NKV": "i32", "table_width": "i32", "q_row_stride": "i32",
                               "gate_row_stride": "i32", "gate_head_stride": "i32", "scale": "fp32",
                               "split_keys": "i32", "GROUP": "constexpr", "D": "constexpr", "PAGE": "constexpr",
                               "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_D": "constexpr",
                               "BLOCK_R": "constexpr", "PRECISION": "constexpr", "SPLITS": "constexpr",
                               "HAS_GATE": "constexpr"}
MERGE_SPLITS_SIGNATURE = {"part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*bf16", "gate_ptr": "*bf16",
                          "counts_ptr": "*i32", "NH": "i32", "gate_row_stride": "i32", "gate_head_stride": "i32",
                          "D": "constexpr", "SPLITS": "constexpr", "HAS_GATE": "constexpr",
                          "HAS_COUNTS": "constexpr", "BLOCK_S": "constexpr", "BLOCK_D": "constexpr",
                          "PDL": "constexpr"}
SIXTEEN_DIVISIBLE = {"N", "K", "up_rows", "C", "ab_row_stride", "HV", "q_row_stride", "gate_row_stride",
                     "gate_head_stride", "k_per_split", "x_stride"}

# What one sm90 SM holds: registers (granted 8 a thread at a time), threads, programs, shared memory (a program
# also takes 1 KB the runtime reserves).
SM90_REGISTERS, SM90_THREADS, SM90_PROGRAMS, SM90_SHARED, SHARED_RESERVED = 65536, 2048, 32, 233472, 1024


def cases():
    """(name, kernel, signature, constexprs, warps, stages, tile) of the decode step's GEMVs, the few-row kernel and
    the GDN decode, and the prefill attention with and without its keys split and the merge of split parts (4B
    sizes); tile names the launch configuration. The whole-rows GEMVs have no loop."""
    for config in (DEFAULT.gemv_tile, DEFAULT.gemv_narrow_widening_tile):
        block_n, block_k, warps, stages = config
        yield ("gemv", gemv._gemv_kernel, GEMV_SIGNATURE, dict(EVEN_K=True, PDL=True, BLOCK_N=block_n, BLOCK_K=block_k),
               warps, stages, f"(BLOCK_N, BLOCK_K, warps, stages) {config}")
    for silu, config in ((False, DEFAULT.norm_gemv_tile), (True, DEFAULT.norm_gemv_silu_tile)):
        block_n, block_k, warps, stages = config
        yield ("norm_gemv + silu" if silu else "norm_gemv", gemv._norm_gemv_kernel, NORM_GEMV_SIGNATURE,
               dict(HAS_RES=True, HAS_NW=False, SILU_MUL=silu, EVEN=True, PDL=True, BLOCK_N=block_n,
                    BLOCK_K=block_k),
               warps, stages, f"(BLOCK_N, BLOCK_K, warps, stages) {config}")
    for k in (4096, 9216):  # 4B out_proj / o_proj, down_proj
        k1, k2 = gemv.whole_row_spans(k)
        rows, warps = DEFAULT.gemv_whole_rows
        yield ("whole-rows gemv", gemv._gemv_whole_rows_kernel, WHOLE_ROWS_GEMV_SIGNATURE,
               dict(ROWS=rows, K1=k1, K2=k2, PDL=True), warps, 1, f"{DEFAULT.gemv_whole_rows}, K {k}")
    k1, k2 = gemv.whole_row_spans(2560)  # the 4B hidden size
    for silu, config in ((False, DEFAULT.norm_gemv_whole_rows), (True, DEFAULT.norm_gemv_silu_whole_rows)):
        yield ("whole-rows norm_gemv + silu" if silu else "whole-rows norm_gemv", gemv._norm_gemv_whole_rows_kernel,
               WHOLE_ROWS_NORM_GEMV_SIGNATURE, dict(HAS_RES=True, HAS_NW=False, SILU_MUL=silu, ROWS=config.rows,
                                                    K1=k1, K2=k2, PDL=True), config.warps, 1, f"{config}, K 2560")
    defaults = inspect.signature(gdn.gdn_decode).parameters
    block_v, warps = defaults["block_v"].default, defaults["num_warps"].default
    yield ("gdn_decode", gdn._gdn_decode_kernel, GDN_DECODE_SIGNATURE,
           dict(DK=128, DV=128, KEY_DIM=2048, BLOCK_K=128, BLOCK_V=block_v, PDL=True), warps, 1,
           f"(BLOCK_V, warps) {(block_v, warps)}")
    block_m, block_n, warps, stages = DEFAULT.prefill_attention_tile
    for splits in (1, 4):
        yield (f"prefill_attention, splits {splits}", attention._prefill_attn_kernel, PREFILL_ATTENTION_SIGNATURE,
               dict(GROUP=4, D=256, PAGE=16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=256, BLOCK_R=16,
                    PRECISION="tf32", SPLITS=splits, HAS_GATE=True), warps, stages,
               f"(BLOCK_M, BLOCK_N, warps, stages) {DEFAULT.prefill_attention_tile}")
    for counts in (False, True):  # decode attention's merge (gated), the prefill's (split counts a row)
        yield (f"merge_splits{', counts' if counts else ''}", attention._merge_splits_kernel, MERGE_SPLITS_SIGNATURE,
               dict(D=256, SPLITS=4, HAS_GATE=not counts, HAS_COUNTS=counts, BLOCK_S=4, BLOCK_D=256, PDL=False), 4,
               1, "4 warps")


def programs_per_sm(registers: int, shared: int, warps: int) -> int:
    """How many programs of one kernel an sm90 SM holds at once."""
    threads = 32 * warps
    by_registers = SM90_REGISTERS // (-(-registers // 8) * 8 * threads)
    return min(by_registers, SM90_THREADS // threads, SM90_PROGRAMS, SM90_SHARED // (shared + SHARED_RESERVED))


def sass_of(kernel, signature: dict, constexprs: dict, warps: int, stages: int, arch: int) -> tuple[int, int, str]:
    """(registers a thread, shared memory bytes a program, SASS) of one specialisation, from `cuobjdump` on the
    cubin and Triton's launch metadata."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if signature[name].startswith("*") or name in SIXTEEN_DIVISIBLE}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), compiled.metadata.shared, sass


def loops(sass: str) -> list[dict]:
    """Each backward conditional branch of the SASS closes a loop: its global loads and barriers."""
    code = []
    for line in sass.splitlines():
        if address := re.search(r"/\*([0-9a-f]{4,})\*/", line):
            code.append((int(address.group(1), 16), line))
    found = []
    for address, line in code:
        branch = re.search(r"@!?U?P\d+\s+BRA\s+(0x[0-9a-f]+)", line)
        if branch and int(branch.group(1), 16) < address:
            body = [text for at, text in code if int(branch.group(1), 16) <= at <= address]
            found.append({"loads": sum("LDG" in text for text in body),
                          "barriers": sum("BAR.SYNC" in text for text in body)})
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability to compile for (90: H100/H200)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info("| kernel | tile | registers | loops: global loads / barriers | programs an sm90 SM holds |")
    log.info("|---|---|---:|---|---:|")
    for name, kernel, signature, constexprs, warps, stages, tile in cases():
        registers, shared, sass = sass_of(kernel, signature, constexprs, warps, stages, args.arch)
        per_loop = "; ".join(f"{loop['loads']} / {loop['barriers']}" for loop in loops(sass)) or "no loop"
        log.info(f"| {name} | {tile} | {registers} | {per_loop} | {programs_per_sm(registers, shared, warps)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
