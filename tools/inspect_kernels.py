"""Compile the one-row GEMVs for sm90 without a GPU and report what their machine code does in each loop.

    python -m tools.inspect_kernels [--arch 90]

Triton compiles for a named target with the `ptxas` it ships, so this runs on the development machine. For each
kernel and tile it prints the registers a thread uses (which bound how many programs fit on an SM) and, per loop
of the SASS, the global loads and the `BAR.SYNC`s in it. A barrier in a GEMV's loop made each iteration wait
for its input's load before it asked for its weights (run P3, docs/benchmarks/decode.md). Pointers and the
integer sizes are declared 16-divisible, as the launcher specialises them at run time.
"""

from __future__ import annotations

import argparse
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

from kernels import triton_ops as T  # noqa: E402

log = logging.getLogger(__name__)

GEMV_SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "K": "i32",
                  "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "EVEN_K": "constexpr", "PDL": "constexpr"}
NORM_GEMV_SIGNATURE = {"x_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                       "res_out_ptr": "*bf16", "N": "i32", "K": "i32", "up_rows": "i32", "eps": "fp32",
                       "HAS_RES": "constexpr", "SILU_MUL": "constexpr", "BLOCK_N": "constexpr",
                       "BLOCK_K": "constexpr", "EVEN": "constexpr", "PDL": "constexpr"}
SIXTEEN_DIVISIBLE = {"N", "K", "up_rows"}


def cases():
    """(name, kernel, signature, constexprs, (BLOCK_N, BLOCK_K, warps, stages)) of the GEMVs the decode step runs."""
    for config in (T.GEMV_CONFIG, T.GEMV_NARROW_WIDENING_CONFIG):
        yield "gemv", T._gemv_kernel, GEMV_SIGNATURE, dict(EVEN_K=True, PDL=True), config
    for silu, config in ((False, T.NORM_GEMV_CONFIG), (True, T.NORM_GEMV_SILU_CONFIG)):
        yield ("norm_gemv + silu" if silu else "norm_gemv", T._norm_gemv_kernel, NORM_GEMV_SIGNATURE,
               dict(HAS_RES=True, SILU_MUL=silu, EVEN=True, PDL=True), config)


def sass_of(kernel, signature: dict, constexprs: dict, warps: int, stages: int, arch: int) -> tuple[str, str]:
    """(resource usage, SASS) of one specialisation, from `cuobjdump` on the cubin."""
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
    return usage, sass


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
    log.info("| kernel | tile (BLOCK_N, BLOCK_K, warps, stages) | registers | loops: global loads / barriers |")
    log.info("|---|---|---:|---|")
    for name, kernel, signature, constexprs, (block_n, block_k, warps, stages) in cases():
        usage, sass = sass_of(kernel, signature, dict(constexprs, BLOCK_N=block_n, BLOCK_K=block_k), warps, stages,
                              args.arch)
        registers = re.search(r"REG:(\d+)", usage).group(1)
        per_loop = "; ".join(f"{loop['loads']} / {loop['barriers']}" for loop in loops(sass)) or "no loop"
        log.info(f"| {name} | {(block_n, block_k, warps, stages)} | {registers} | {per_loop} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
