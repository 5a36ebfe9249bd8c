"""Kernel benchmark on a GPU: time, achieved bandwidth or FLOP rate, and the ratio to ceilings measured in the
same run (a large device-to-device copy; a large bf16 matmul), and for GDN the ratio to fla-core.

    python -m deltaserve.tools.bench_kernels [--size 4b|9b|27b] [--out FILE] [--only decode,projections,fp8,prefill,sampling]
        [--sweeps decode,scan,prep,attention,conv,sampler,rounds,gemv]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton.testing
from triton.runtime.errors import OutOfResources

from deltaserve.kernels import attention, conv1d, gdn, gemv, norm
from deltaserve.kernels.config import DEFAULT, GDN_FACTOR_MODES, WholeRows
from deltaserve.kernels.sampling import SamplingTensors, lm_like_logits, sample_reference
from deltaserve.kernels.triton_sampling import MAX_CANDIDATES, TOP_P_ROUNDS, draw, sample_on_gpu, top_p_alone
from deltaserve.model.config import ModelConfig
from deltaserve.model.synthetic import text_config


PREFILL_ATTN_SWEEP = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 8, 4),  # (BLOCK_M, BLOCK_N,
                      (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3)]  # warps, stages)
# (BLOCK_T, BLOCK_C, warps)
CONV_PREFILL_SWEEP = [(32, 128, 4), (16, 256, 4), (64, 64, 4), (64, 128, 4), (32, 256, 4), (32, 128, 8)]
GDN_SCAN_SWEEP = [(32, 4, 3), (64, 4, 3), (32, 4, 2), (64, 4, 2), (64, 8, 2)]  # (block of dv, warps, stages)
GDN_PREP_SWEEP = [(4, 1, 64, 168), (4, 1, 64, None), (4, 1, 64, 128), (8, 1, 64, None),
                  (4, 1, 32, 168)]  # (warps, stages, column block, register cap)
SAMPLER_SWEEP = [(1024, 4, 16), (1024, 4, 32), (1024, 4, 64), (512, 4, 64), (512, 2, 128), (2048, 4, 32),
                 (256, 2, 128)]  # (block, warps, splits per row) of the sampler's passes
TOP_P_ROUNDS_SWEEP = (2, 3, 4, 5, 6)  # top-p race rounds
ROUND_STEPS = 200  # token steps drawn per round count: the share of batches a row leaves to the histogram
# Loop tiles (BLOCK_N, BLOCK_K, warps, stages), then whole rows (rows a program, warps).
GEMV_SWEEP = [(2, 4096, 4, 1), (2, 2048, 2, 2), (2, 2048, 4, 2), (2, 1024, 2, 3), (4, 2048, 4, 2),
              (1, 2048, 2, 2), (4, 512, 4, 2), (8, 512, 4, 2), (8, 256, 4, 3), (4, 1024, 4, 1),
              (8, 512, 8, 1)] + [WholeRows(*c) for c in ((1, 2), (1, 4), (1, 8), (2, 4))]
NORM_GEMV_SWEEP = [(8, 512, 4, 2), (4, 512, 4, 2), (4, 512, 4, 3), (8, 256, 4, 3), (8, 256, 2, 3), (4, 1024, 4, 2),
                   (2, 2048, 2, 2), (16, 256, 4, 2), (8, 512, 8, 2), (16, 512, 8, 2)
                   ] + [WholeRows(*c) for c in ((1, 2), (2, 2), (2, 4), (4, 4))]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50) / 1e3


def device_seconds(event) -> float:
    """GPU time of a profiler event (its older name on older torch)."""
    return getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0)) / 1e6


def kernel_time(fn, reps: int = 10) -> float:
    """Seconds of GPU kernel time per call (the profiler's sum over every kernel the call launches): unlike
    `bench`, blind to the host gaps of a call that synchronises (fla's reads the request lengths back)."""
    return sum(seconds for _, seconds in kernel_split(fn, reps))


def kernel_split(fn, reps: int = 10) -> list[tuple[str, float]]:
    """(kernel name, GPU seconds per call) for every kernel `fn` launches, longest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    split = [(e.key, device_seconds(e) / reps) for e in prof.key_averages()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(split, key=lambda item: -item[1])


def ceilings(dev):
    n = 2**31 // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    copy_bw = 2 * n * 2 / bench(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    flops = 2 * 8192**3 / bench(lambda: a @ b)
    del src, dst
    return copy_bw, flops


SWEEPS = ("decode", "scan", "prep", "attention", "conv", "sampler", "rounds", "gemv")


def graph_time_per_call(make_call, weights: list[torch.Tensor]) -> float:
    """Seconds per call of `make_call(w)` replayed in one CUDA graph that cycles through `weights` (together
    larger than L2), as a decode step streams its weights: no launch gaps, no warm cache."""
    calls = [make_call(w) for w in weights]
    stream = _capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # eager first, on the capturing stream (as the engine captures its graphs)
        for call in calls:
            call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    return bench(graph.replay) / len(calls)


@functools.cache
def _capture_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(N, K) of every projection of the model, by name."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return {"gdn in_proj (qkv,z,b,a)": (2 * hk * dk + 2 * hv * dv + 2 * hv, H), "gdn out_proj": (H, hv * dv),
            "attn qkv_proj": ((2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D, H),
            "attn o_proj": (H, cfg.num_attention_heads * D), "mlp gate_up": (2 * I, H), "mlp down_proj": (H, I),
            "lm_head": (cfg.vocab_size, H)}


def projections(cfg, rows: list, bw: float, sweep: bool) -> None:
    """One-row (batch-1 decode) projections: our GEMV against cuBLAS on every shape of the model, each timed
    inside a CUDA graph over copies of the weight that together do not fit in L2 (`linear` picks by shape)."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    for name, (n, k) in projection_shapes(cfg).items():
        copies = max(2, -(-(512 << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=bf) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=bf)
        nbytes = (n * k + k + n) * 2
        t = graph_time_per_call(lambda w: lambda: gemv.gemv(x, w), weights)
        t_peer = graph_time_per_call(lambda w: lambda: x @ w.t(), weights)
        routed = f"ours, {gemv.gemv_config(n, k)}"
        rows.append((f"one-row projection {name} (runs on {routed})", f"1 x {k} -> {n}", t,
                     f"{nbytes / t / 1e12:.2f} TB/s", f"{nbytes / t / bw:.0%} of copy; cuBLAS {nbytes / t_peer / bw:.0%}"
                     f" ({t_peer / t:.2f}x our time)"))
        for config in GEMV_SWEEP if sweep else ():
            try:
                t = graph_time_per_call(lambda w: lambda: gemv.gemv(x, w, config=config), weights)
            except OutOfResources:
                continue
            rows.append((f"one-row projection {name} config {config}", f"1 x {k} -> {n}", t,
                         f"{nbytes / t / 1e12:.2f} TB/s", f"{nbytes / t / bw:.0%} of copy"))
        del weights
    norm_projections(cfg, rows, bw, sweep)


def norm_projections(cfg, rows: list, bw: float, sweep: bool) -> None:
    """A block's add-and-norm with the one-row projection that reads it (silu(gate) * up for the MLP): the fused
    GEMV against the add-and-norm kernel followed by the unfused projection (`linear`'s pick) and by cuBLAS. As the
    model runs them, the norm weight is folded into the projection (norm weight None)."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    H, every = cfg.hidden_size, projection_shapes(cfg)
    shapes = {"gdn in_proj": (every["gdn in_proj (qkv,z,b,a)"][0], False),
              "attn qkv_proj": (every["attn qkv_proj"][0], False),
              "mlp gate_up + silu_mul": (every["mlp gate_up"][0], True)}
    x, res = (torch.randn(1, H, device=dev, dtype=bf) for _ in range(2))
    eps = cfg.rms_norm_eps
    for name, (n, silu) in shapes.items():
        copies = max(2, -(-(512 << 20) // (n * H * 2)))
        weights = [torch.randn(n, H, device=dev, dtype=bf) * 0.02 for _ in range(copies)]
        fused = gemv.add_rms_norm_gate_up if silu else gemv.add_rms_norm_linear
        act = norm.silu_mul_reference if silu else (lambda y: y)

        def unfused(w, project):
            normed, _ = norm.add_rms_norm(x, res, None, eps)
            return act(project(normed, w))

        nbytes = (n * H + 2 * H + (n // 2 if silu else n)) * 2
        t = graph_time_per_call(lambda w: lambda: fused(x, res, None, eps, w), weights)
        t_split = graph_time_per_call(lambda w: lambda: unfused(w, gemv.linear), weights)
        t_cublas = graph_time_per_call(lambda w: lambda: unfused(w, lambda h, w_: h @ w_.t()), weights)
        rows.append((f"one-row add-and-norm + {name}, fused", f"1 x {H} -> {n}", t, f"{nbytes / t / 1e12:.2f} TB/s",
                     f"{nbytes / t / bw:.0%} of copy; unfused (norm kernel, linear's pick) {t_split * 1e6:.1f} us = "
                     f"{t_split / t:.2f}x ours; norm + cuBLAS {t_cublas * 1e6:.1f} us = {t_cublas / t:.2f}x ours"))
        for config in NORM_GEMV_SWEEP if sweep else ():
            try:
                t = graph_time_per_call(lambda w: lambda: gemv.norm_gemv(x, res, None, eps, w, n // 2 if silu else 0,
                                                                      config=config), weights)
            except OutOfResources:
                continue
            rows.append((f"one-row add-and-norm + {name}, fused, config {config}", f"1 x {H} -> {n}", t,
                         f"{nbytes / t / 1e12:.2f} TB/s", f"{nbytes / t / bw:.0%} of copy"))
        del weights


def fp8_activations(cfg, memory_row, tokens: int = 8192) -> None:
    """A prefill's activations quantised for the FP8 projections on cuBLAS, against their bytes (bf16 in, e4m3 and
    scales out): apart (`fp8.quantise_activations`, at each input width), and in the passes that make them, the
    add-and-norm (hidden width) and silu(gate) * up (against `norm.silu_mul` then the quantisation)."""
    from deltaserve.kernels import fp8

    dev, bf = torch.device("cuda"), torch.bfloat16
    rows = fp8.cublas_rows(tokens)
    widths = sorted({k for _, k in projection_shapes(cfg).values()})
    for k in widths:
        x = torch.randn(tokens, k, device=dev, dtype=bf)
        memory_row("fp8 activation quantisation", f"{tokens}x{k}",
                   lambda: fp8.quantise_activations(x, 128, rows=rows, group_major=True), tokens * k * 3)
    H, inner = cfg.hidden_size, cfg.intermediate_size
    x, r, w = (torch.randn(tokens, H, device=dev, dtype=bf), torch.randn(tokens, H, device=dev, dtype=bf),
               torch.randn(H, device=dev, dtype=bf))
    memory_row("fp8 add-and-norm, quantised in the pass", f"{tokens}x{H}",
               lambda: fp8.add_rms_norm_quantised(x, r, w, 1e-6, 128, rows), tokens * H * 7)
    gate_up = torch.randn(tokens, 2 * inner, device=dev, dtype=bf)
    t_apart = bench(lambda: fp8.quantise_activations(norm.silu_mul(gate_up), 128, rows=rows, group_major=True))
    memory_row("fp8 silu(gate) * up, quantised in the pass", f"{tokens}x{2 * inner}",
               lambda: fp8.silu_mul_quantised(gate_up, 128, rows), tokens * inner * 5,
               f"; silu_mul then the quantisation {t_apart * 1e6:.1f} us")


def fp8_projections(cfg, rows: list, bw: float, flops: float, counts=(1, 5, 8, 64, 2048)) -> None:
    """The FP8 projections (`kernels.fp8`) on every shape of the model: at decode row counts (to 64) W8A16 against
    its bytes over the copy bandwidth; at 64 and 2048 rows W8A8 beside it, against the bytes or the bf16 FLOPs.
    Each beside the bf16 projection the engine runs otherwise (`gemv.linear`), timed as `projections` does."""
    from deltaserve.kernels import fp8
    from deltaserve.model.weights import quantise_fp8

    dev, bf = torch.device("cuda"), torch.bfloat16
    for name, (n, k) in projection_shapes(cfg).items():
        copies = max(2, -(-(512 << 20) // (n * k)))
        weights = [fp8.Fp8Weight(*quantise_fp8(torch.randn(n, k, device=dev) * 0.02, 128)) for _ in range(copies)]
        plain = [w.dequantise(bf) for w in weights[:max(2, copies // 2)]]
        for m in counts:
            x = torch.randn(m, k, device=dev, dtype=bf)
            nbytes = n * k + (m * k + m * n) * 2
            bound = max(nbytes / bw, 2 * m * n * k / flops)
            t_bf16 = graph_time_per_call(lambda w: lambda: gemv.linear(x, w), plain)
            # W8A8 from the largest decode batch up: where FP8 tensor cores could beat widening the weights
            kinds = [("w8a16", fp8.linear_w8a16)] + ([("w8a8", fp8.linear_w8a8)] if m >= fp8.DECODE_ROWS else [])
            if m > fp8.DECODE_ROWS and fp8.cublas_takes(weights[0]) and fp8.cublas_block_scaled_works(dev):
                kinds += [("w8a8 on cuBLAS", fp8.linear_cublas), ("w8a8 on cuBLAS, as W x^T", _cublas_transposed)]
            for kind, fn in kinds:
                try:
                    t = graph_time_per_call(lambda w: lambda: fn(x, w), weights)
                except RuntimeError as exc:  # a layout this cuBLAS does not take
                    rows.append((f"fp8 projection {name} ({kind})", f"{m} x {k} -> {n}", float("nan"), "",
                                 f"not run: {str(exc).splitlines()[0][:80]}"))
                    continue
                rows.append((f"fp8 projection {name} ({kind})", f"{m} x {k} -> {n}", t,
                             f"{nbytes / t / 1e12:.2f} TB/s", f"{bound / t:.0%} of its bound (bytes or bf16 FLOPs); the "
                             f"bf16 projection {t_bf16 * 1e6:.1f} us = {t_bf16 / t:.2f}x ours"))
        del weights, plain


def _cublas_transposed(x: torch.Tensor, weight) -> torch.Tensor:
    """`fp8.linear_cublas` as the transposed problem (weight @ x^T, then transposed back): cuBLAS picks its kernel
    by shape, and ran the 27B's N = 5120 outputs at 1.03-1.10x the bf16 GEMM against 1.3-1.6x on wide ones."""
    from deltaserve.kernels import fp8

    M = x.shape[0]
    values, scale = fp8.quantise_activations(x, weight.block, rows=fp8.cublas_rows(M), group_major=True)
    out = torch._scaled_mm(weight.values, values.t(), scale_a=weight.scale.t(), scale_b=scale, out_dtype=x.dtype)
    return out.t()[:M].contiguous()


SECTIONS = ("decode", "projections", "fp8", "prefill", "sampling")


def run(size: str, sweeps=SWEEPS, sections=SECTIONS) -> list[tuple]:
    dev = torch.device("cuda")
    cfg = ModelConfig.from_dict(text_config(size, 248320))
    bw, flops = ceilings(dev)
    rows = [("copy (ceiling)", "4 GiB read + written", None, f"{bw / 1e12:.2f} TB/s", ""),
            ("bf16 matmul 8192^3 (ceiling)", "", None, f"{flops / 1e12:.0f} TFLOP/s", "")]
    bf = torch.bfloat16

    def memory_row(name, shape_note, fn, nbytes, note=""):
        t = bench(fn)
        rows.append((name, shape_note, t, f"{nbytes / t / 1e12:.2f} TB/s", f"{nbytes / t / bw:.0%} of copy {note}"))
        return t

    H = cfg.hidden_size
    for n in (1, 64, 4096) if "decode" in sections else ():
        x, r = torch.randn(n, H, device=dev, dtype=bf), torch.randn(n, H, device=dev, dtype=bf)
        w = torch.randn(H, device=dev, dtype=bf)
        memory_row("add_rms_norm", f"{n}x{H}", lambda: norm.add_rms_norm(x, r, w, 1e-6), 4 * n * H * 2)

    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    C = 2 * hk * dk + hv * dv
    if "projections" in sections:
        projections(cfg, rows, bw, "gemv" in sweeps)
    if "fp8" in sections:
        fp8_activations(cfg, memory_row)
        fp8_projections(cfg, rows, bw, flops)
    N, S = 64, 64
    mixed = torch.randn(N, C, device=dev, dtype=bf)
    a, b = torch.randn(N, hv, device=dev, dtype=bf), torch.randn(N, hv, device=dev, dtype=bf)
    A_log, dt_bias = torch.rand(hv, device=dev), torch.rand(hv, device=dev)
    state = torch.randn(S + 1, hv, dk, dv, device=dev) * 0.1
    slots = torch.arange(N, device=dev)
    conv_state = torch.randn(S + 1, 3, C, device=dev, dtype=bf)
    wc = torch.randn(C, 4, device=dev, dtype=bf)
    if "decode" in sections:
        decode_gdn(rows, memory_row, sweeps, mixed, a, b, A_log, dt_bias, state, slots, conv_state, wc, hk, dk, dv)
        decode_attention(cfg, rows, memory_row)
    if "prefill" in sections:
        prefill(cfg, rows, memory_row, flops, sweeps, A_log, dt_bias, wc)
    if "sampling" in sections:
        sampling(cfg, rows, sweeps)
    return rows


def decode_gdn(rows, memory_row, sweeps, mixed, a, b, A_log, dt_bias, state, slots, conv_state, wc, hk, dk, dv):
    N, C = mixed.shape
    hv = a.shape[1]
    state_bytes = 2 * N * hv * dk * dv * 4
    t_ours = memory_row("gdn_decode (fused)", f"batch {N}, Hv {hv}", lambda: gdn.gdn_decode(
        mixed, a, b, A_log, dt_bias, state, slots, hk, dk, dv), state_bytes, "(state traffic; target 80%)")

    # The sweep behind the default (64, 4 warps), at batch 64, then at batch 1 and a verify step's five tokens
    # at batch 1 (the state read once, written five times).
    one = state_bytes // N
    for block_v in (16, 32, 64) if "decode" in sweeps else ():
        for warps in (2, 4, 8):
            memory_row(f"gdn_decode block_v={block_v} warps={warps}", f"batch {N}", lambda: gdn.gdn_decode(
                mixed, a, b, A_log, dt_bias, state, slots, hk, dk, dv, block_v=block_v, num_warps=warps), state_bytes)
    for block_v in (16, 32, 64) if "decode" in sweeps else (64,):
        memory_row(f"gdn_decode block_v={block_v}", "batch 1", lambda: gdn.gdn_decode(
            mixed[:1], a[:1], b[:1], A_log, dt_bias, state, slots[:1], hk, dk, dv, block_v=block_v), one)
    T = 5
    steps = torch.zeros(state.shape[0], T - 1, hv, dk, dv, device=mixed.device)
    kept = torch.full((1,), T, device=mixed.device, dtype=torch.long)
    for block_v in (16, 32, 64) if "decode" in sweeps else (64,):
        memory_row(f"gdn_verify block_v={block_v}", f"batch 1, {T} tokens", lambda: gdn.gdn_verify(
            mixed[:T], a[:T], b[:T], A_log, dt_bias, state, steps, slots[:1], kept, T, hk, dk, dv, block_v=block_v),
            one // 2 * (1 + T))

    memory_row("conv1d_decode", f"batch {N}, C {C}", lambda: conv1d.conv1d_decode(mixed, wc, conv_state, slots),
               N * C * 2 * (3 * 2 + 2))
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        rows.append(("fla-core", "not installed", float("nan"), "", "no GDN comparison"))
        return
    q, k, v = gdn.gdn_split_qkv(mixed, hk, dk, hv, dv)
    g, beta = gdn.gdn_gates(a, b, A_log, dt_bias)
    qf, kf, vf = (x.to(torch.bfloat16)[None] for x in (q / dk**-0.5, k, v))
    s0 = state[:N].clone()
    t_fla = bench(lambda: fused_recurrent_gated_delta_rule(qf.transpose(0, 1), kf.transpose(0, 1),
                                                           vf.transpose(0, 1), g=g[:, None], beta=beta[:, None],
                                                           initial_state=s0, output_final_state=True))
    rows.append(("fla fused_recurrent (decode)", f"batch {N}", t_fla, "", f"ours/fla time {t_ours / t_fla:.2f}"))


def gdn_prefill_case(cfg, dev="cuda", seed=0) -> dict:
    """Four packed requests (1, 700, 64 and 2000 tokens) from slots 2, 0, 3, 1 of a five-slot state pool, bf16
    activations and fast decay (g as low as about -30 a token): the case the GPU test and the accuracy rows use."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    lens, bf = [1, 700, 64, 2000], torch.bfloat16
    tokens, C = sum(lens), 2 * hk * dk + hv * dv

    def randn(*shape):
        return torch.randn(*shape, device=dev, generator=gen)

    cu_seqlens = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
    return dict(mixed=randn(tokens, C).to(bf), a=randn(tokens, hv).to(bf), b=randn(tokens, hv).to(bf),
                A_log=torch.rand(hv, device=dev, generator=gen) * 2, dt_bias=torch.rand(hv, device=dev, generator=gen),
                ssm_state=randn(5, hv, dk, dv) * 0.1, cu_seqlens=cu_seqlens,
                slots=torch.tensor([2, 0, 3, 1], device=dev), num_k_heads=hk, head_k_dim=dk, head_v_dim=dv)


def gdn_prefill_reference(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 reference's output and final slot states for `case` (which is left as it was)."""
    state = case["ssm_state"].clone()
    out = gdn.gdn_prefill_reference(**dict(case, ssm_state=state, mixed=case["mixed"].float()))
    return out, state


def gdn_prefill_errors(case: dict, call, reference: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """Largest error of `call(**case)` (which updates its ssm_state) against `gdn_prefill_reference(case)`,
    relative to the reference's largest value: (output, final states of the requests' slots)."""
    run_case = dict(case, ssm_state=case["ssm_state"].clone())
    got = call(**run_case)
    used = run_case["slots"]
    ref_out, ref_state = reference

    def rel(x, y):
        return ((x.float() - y).abs().max() / y.abs().max()).item()

    return rel(got, ref_out), rel(run_case["ssm_state"][used], ref_state[used])


def fla_prefill(chunk_gated_delta_rule, mixed, a, b, A_log, dt_bias, ssm_state, cu_seqlens, slots, num_k_heads,
                head_k_dim, head_v_dim):
    """fla-core's chunked GDN under our prefill contract: raw bf16 q and k (fla normalises them), the gates in fp32,
    each request's initial state gathered from its slot and its final state written back."""
    hv = a.shape[1]
    q, k, v = mixed.split([num_k_heads * head_k_dim, num_k_heads * head_k_dim, hv * head_v_dim], dim=-1)
    group = hv // num_k_heads
    q, k = (x.unflatten(1, (num_k_heads, head_k_dim)).repeat_interleave(group, dim=1)[None] for x in (q, k))
    g, beta = gdn.gdn_gates(a, b, A_log, dt_bias)
    out, final = chunk_gated_delta_rule(q, k, v.unflatten(1, (hv, head_v_dim))[None], g=g[None], beta=beta[None],
                                        scale=head_k_dim**-0.5, initial_state=ssm_state[slots],
                                        output_final_state=True, use_qk_l2norm_in_kernel=True,
                                        cu_seqlens=cu_seqlens.long())
    ssm_state[slots] = final.float()
    return out[0]


def prefill_accuracy(cfg, rows, chunk_gated_delta_rule) -> None:
    case = gdn_prefill_case(cfg)
    reference = gdn_prefill_reference(case)
    shape = "4 requests, 2765 tokens"
    for mode in GDN_FACTOR_MODES:
        out_err, state_err = gdn_prefill_errors(case, lambda **c: gdn.gdn_prefill(**c, factors=mode), reference)
        rows.append((f"gdn_prefill accuracy, factors {mode}", shape, None, "",
                     f"error vs fp32 reference: output {out_err:.1e}, state {state_err:.1e}"))
    out_err, state_err = gdn_prefill_errors(case, lambda **c: fla_prefill(chunk_gated_delta_rule, **c), reference)
    rows.append(("fla chunk_gated_delta_rule accuracy", shape, None, "",
                 f"error vs fp32 reference: output {out_err:.1e}, state {state_err:.1e}"))


def scan_layouts(rows, mixed, a, b, A_log, dt_bias, hk, dk, dv) -> None:
    """The state pass's GPU time with gdn_scan_config's two tiles and two others, for the same tokens packed as 1 to
    64 requests: the evidence for its choice."""
    L, hv = mixed.shape[0], a.shape[1]
    tiles = GDN_SCAN_SWEEP[:4]  # both of gdn_scan_config's, and each with the other block and stage count
    for requests in (1, 2, 4, 16, 64):
        cu = [L // requests * r for r in range(requests + 1)]
        chunks = gdn.GdnChunks.build(cu, mixed.device)
        cu_t = torch.tensor(cu, device=mixed.device, dtype=torch.int32)
        slots = torch.arange(requests, device=mixed.device)
        pool = torch.zeros(requests + 1, hv, dk, dv, device=mixed.device)
        times = {}
        for tile in tiles:
            split = kernel_split(lambda: gdn.gdn_prefill(mixed, a, b, A_log, dt_bias, pool, cu_t, slots, hk, dk, dv,
                                                       chunks, scan_config=tile))
            times[tile] = dict(split)["_gdn_chunk_scan_out_kernel"]
        chosen = gdn.gdn_scan_config(requests, hv, dv, mixed.device)
        rows.append((f"gdn_prefill state pass, {requests} x {L // requests} tokens", "tiles " + ", ".join(
            f"{tile}: {seconds * 1e6:.1f}" for tile, seconds in times.items()), times[chosen], "",
            f"chosen {chosen}, {times[chosen] / min(times.values()):.2f}x the fastest"))


def prefill(cfg, rows, memory_row, flops, sweeps, A_log, dt_bias, wc):
    dev, bf = torch.device("cuda"), torch.bfloat16
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    C = 2 * hk * dk + hv * dv
    nh, nkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        L = 8192
        mixed_p = torch.randn(L, C, device=dev, dtype=bf)
        ap, bp = torch.randn(L, hv, device=dev, dtype=bf), torch.randn(L, hv, device=dev, dtype=bf)
        cu = torch.tensor([0, L], device=dev, dtype=torch.int32)
        one = torch.tensor([0], device=dev)
        chunks = gdn.GdnChunks.build([0, L], dev)  # built with the batch, as the forward does
        pool = torch.zeros(2, hv, dk, dv, device=dev)
        t_pre = bench(lambda: gdn.gdn_prefill(mixed_p, ap, bp, A_log, dt_bias, pool, cu, one, hk, dk, dv, chunks))
        for name, seconds in kernel_split(lambda: gdn.gdn_prefill(mixed_p, ap, bp, A_log, dt_bias, pool, cu, one, hk,
                                                                dk, dv, chunks)):
            rows.append((f"gdn_prefill phase {name[:40]}", f"{L} tokens", seconds, "", ""))
        for kind, sweep in (("scan", GDN_SCAN_SWEEP), ("prep", GDN_PREP_SWEEP)):
            for config in sweep if kind in sweeps else ():
                t = bench(lambda: gdn.gdn_prefill(mixed_p, ap, bp, A_log, dt_bias, pool, cu, one, hk, dk, dv, chunks,
                                                **{f"{kind}_config": config}))
                fits = not gdn._PREFILL_FALLBACK  # a config that does not fit turns the torch fallback on: undo it
                gdn._PREFILL_FALLBACK.clear()
                rows.append((f"gdn_prefill {kind} config {config}", f"{L} tokens", t if fits else float("nan"), "",
                             "" if fits else "does not fit this GPU"))
        if "scan" in sweeps:
            scan_layouts(rows, mixed_p, ap, bp, A_log, dt_bias, hk, dk, dv)
        qp, kp, vp = gdn.gdn_split_qkv(mixed_p, hk, dk, hv, dv)
        gp, betap = gdn.gdn_gates(ap, bp, A_log, dt_bias)
        qp, kp, vp = ((x / dk**-0.5 if i == 0 else x).to(bf)[None] for i, x in enumerate((qp, kp, vp)))
        t_fla_pre = bench(lambda: chunk_gated_delta_rule(qp, kp, vp, g=gp[None], beta=betap[None], scale=dk**-0.5,
                                                         initial_state=pool[:1], output_final_state=True,
                                                         cu_seqlens=cu.long()))
        k_pre = kernel_time(lambda: gdn.gdn_prefill(mixed_p, ap, bp, A_log, dt_bias, pool, cu, one, hk, dk, dv,
                                                  chunks))
        k_fla = kernel_time(lambda: chunk_gated_delta_rule(qp, kp, vp, g=gp[None], beta=betap[None], scale=dk**-0.5,
                                                           initial_state=pool[:1], output_final_state=True,
                                                           cu_seqlens=cu.long()))
        fl = 4 * L * hv * dk * dv
        rows.append(("gdn_prefill (ours: Triton chunked WY)", f"{L} tokens", t_pre, f"{fl / t_pre / 1e12:.1f} TFLOP/s",
                     f"ours/fla time {t_pre / t_fla_pre:.2f} (target <= 1.0)"))
        rows.append(("fla chunk_gated_delta_rule", f"{L} tokens", t_fla_pre, f"{fl / t_fla_pre / 1e12:.1f} TFLOP/s", ""))
        rows.append(("gdn_prefill kernel time (ours)", f"{L} tokens", k_pre, "",
                     f"ours/fla kernel time {k_pre / k_fla:.2f} (target <= 1.0)"))
        rows.append(("fla chunk_gated_delta_rule kernel time", f"{L} tokens", k_fla, "", ""))
        fla_split = kernel_split(lambda: chunk_gated_delta_rule(
            qp, kp, vp, g=gp[None], beta=betap[None], scale=dk**-0.5, initial_state=pool[:1],
            output_final_state=True, cu_seqlens=cu.long()))
        for name, seconds in fla_split[:4]:
            rows.append((f"fla phase {name[:40]}", f"{L} tokens", seconds, "", ""))
        rows.append((f"fla phase: {len(fla_split) - 4} other kernels", f"{L} tokens",
                     sum(seconds for _, seconds in fla_split[4:]), "", ""))
        for mode in GDN_FACTOR_MODES:
            k_mode = kernel_time(lambda: gdn.gdn_prefill(mixed_p, ap, bp, A_log, dt_bias, pool, cu, one, hk, dk, dv,
                                                       chunks, factors=mode))
            rows.append((f"gdn_prefill kernel time, factors {mode}", f"{L} tokens", k_mode, "",
                         f"ours/fla kernel time {k_mode / k_fla:.2f}"))
        prefill_accuracy(cfg, rows, chunk_gated_delta_rule)
    except ImportError:
        rows.append(("fla-core", "not installed", float("nan"), "", "no GDN comparison"))

    L = 8192  # prefill attention: one 8k request, and the same tokens as a chunk after 8k cached
    for ctx_len in (0, 8192):
        total = ctx_len + L
        kc3 = torch.randn(total // 16 + 1, 16, nkv, D, device=dev, dtype=bf)
        vc3 = torch.randn_like(kc3)
        qp = torch.randn(L, nh, D, device=dev, dtype=bf)
        table3 = torch.arange(total // 16, device=dev, dtype=torch.int32)[None]
        cu3 = torch.tensor([0, L], device=dev, dtype=torch.int32)
        ctx3 = torch.tensor([ctx_len], device=dev)
        fl = 4 * nh * D * (L * ctx_len + L * L / 2)  # QK^T and PV over the causal half
        for config in PREFILL_ATTN_SWEEP if ctx_len == 0 and "attention" in sweeps else ():
            t = bench(lambda: attention.prefill_attention(qp, kc3, vc3, table3, cu3, ctx3, D**-0.5, config=config))
            rows.append((f"prefill_attention config {config}", f"{L} tokens", t, f"{fl / t / 1e12:.0f} TFLOP/s", ""))
        t = bench(lambda: attention.prefill_attention(qp, kc3, vc3, table3, cu3, ctx3, D**-0.5))
        kk = kc3[:-1].flatten(0, 1).transpose(0, 1)[None]  # peer: torch SDPA on contiguous K/V, no paging
        vv = vc3[:-1].flatten(0, 1).transpose(0, 1)[None]
        qq = qp.transpose(0, 1)[None]
        if ctx_len:
            mask = torch.ones(L, total, device=dev, dtype=torch.bool).tril(ctx_len)
            t_sdpa = bench(lambda: F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, enable_gqa=True))
        else:
            t_sdpa = bench(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True))
        rows.append(("prefill_attention (paged, causal)", f"{L} tokens after {ctx_len} cached, group {nh // nkv}",
                     t, f"{fl / t / 1e12:.0f} TFLOP/s", f"{fl / t / flops:.0%} of matmul; torch SDPA (contiguous "
                     f"K/V) {t_sdpa * 1e6:.0f} us = {t_sdpa / t:.2f}x ours"))
        del kc3, vc3

    # A chat's later turn: a 1025-token chunk after 7.6k cached tokens, its keys shared out over up to 1, 2 or 4
    # programs a query block (`KernelConfig.prefill_attention_splits`); and a fresh 1024-token prompt, which
    # should cost what it costs with one.
    for n_new, ctx_len in ((1025, 7616), (1024, 0)):
        total = ctx_len + n_new
        kc3 = torch.randn(total // 16 + 1, 16, nkv, D, device=dev, dtype=bf)
        vc3 = torch.randn_like(kc3)
        qp = torch.randn(n_new, nh, D, device=dev, dtype=bf)
        table3 = torch.arange(total // 16 + 1, device=dev, dtype=torch.int32)[None]
        cu3 = torch.tensor([0, n_new], device=dev, dtype=torch.int32)
        ctx3 = torch.tensor([ctx_len], device=dev)
        fl = 4 * nh * D * (n_new * ctx_len + n_new * n_new / 2)
        times = {splits: bench(lambda: attention.prefill_attention(qp, kc3, vc3, table3, cu3, ctx3, D**-0.5,
                                                                    splits=splits)) for splits in (1, 2, 4)}
        for splits, t in times.items():  # a fresh prompt keeps one program (`PREFILL_SPLIT_KEYS`)
            rows.append((f"prefill_attention, keys over up to {splits} programs a block",
                         f"{n_new} tokens after {ctx_len} cached", t, f"{fl / t / 1e12:.0f} TFLOP/s",
                         f"{times[1] / t:.2f}x one program"))
        del kc3, vc3

    mixed_long = torch.randn(L, C, device=dev, dtype=bf)
    conv_pool = torch.randn(3, 3, C, device=dev, dtype=bf)
    cu1, slot1 = torch.tensor([0, L], device=dev, dtype=torch.int32), torch.tensor([1], device=dev)
    memory_row("conv1d_prefill", f"{L} tokens, C {C}", lambda: conv1d.conv1d_prefill(mixed_long, wc, conv_pool, cu1, slot1),
               L * C * 2 * 2, "(input + output)")
    for tile in CONV_PREFILL_SWEEP if "conv" in sweeps else ():
        tiled = replace(DEFAULT, conv1d_prefill_tile=tile)
        memory_row(f"conv1d_prefill tile {tile}", f"{L} tokens, C {C}",
                   lambda: conv1d.conv1d_prefill(mixed_long, wc, conv_pool, cu1, slot1, cfg=tiled), L * C * 2 * 2, "")

    T_ = 4096
    cos, sin = attention.rope_tables(cfg.rotary_dim, cfg.rope_theta, 8192, device=dev)
    qkv = torch.randn(T_, (2 * nh + 2 * nkv) * D, device=dev, dtype=bf)
    qn, kn = torch.randn(D, device=dev, dtype=bf), torch.randn(D, device=dev, dtype=bf)
    pos = torch.arange(T_, device=dev)
    kc2 = torch.empty(T_ // 16 + 1, 16, nkv, D, device=dev, dtype=bf)
    vc2 = torch.empty_like(kc2)
    mapping = torch.arange(T_, device=dev)
    memory_row("qk_norm_rope_cache", f"{T_} tokens", lambda: attention.qk_norm_rope_cache(
        qkv, qn, kn, 1e-6, pos, cos, sin, kc2, vc2, mapping, nh, nkv), T_ * (2 * nh + 4 * nkv) * D * 2)


def decode_attention(cfg, rows, memory_row):
    dev, bf = torch.device("cuda"), torch.bfloat16
    nh, nkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    N, ctx = 32, 4096
    pages = N * ctx // 16
    kc = torch.randn(pages + 1, 16, nkv, D, device=dev, dtype=bf)
    vc = torch.randn_like(kc)
    q = torch.randn(N, nh, D, device=dev, dtype=bf)
    table = torch.randperm(pages, device=dev).view(N, ctx // 16).to(torch.int32)
    lens = torch.full((N,), ctx, device=dev)
    memory_row("decode_attention (split-K)", f"batch {N} x {ctx} ctx, group {nh // nkv}",
               lambda: attention.decode_attention(q, kc, vc, table, lens, D**-0.5), 2 * N * ctx * nkv * D * 2,
               "(KV traffic; target 75%)")
    for n, ctx in ((1, 1024), (64, 1024)):  # the decode benchmark's shapes (page tables 2048 tokens wide)
        q = torch.randn(n, nh, D, device=dev, dtype=bf)
        table = torch.randperm(pages, device=dev)[: n * 128].view(n, 128).to(torch.int32)
        lens = torch.full((n,), ctx, device=dev)
        t = triton.testing.do_bench_cudagraph(lambda: attention.decode_attention(q, kc, vc, table, lens, D**-0.5)) / 1e3
        rows.append((f"decode_attention, {attention.decode_splits(n, nkv, 128 * 16, dev)} splits (graph replay)",
                     f"batch {n} x {ctx} ctx", t, f"{2 * n * ctx * nkv * D * 2 / t / 1e12:.2f} TB/s", ""))


def sampling(cfg, rows, sweeps):
    dev = torch.device("cuda")
    V, n = cfg.vocab_size, 64
    torch.manual_seed(0)  # the same logits every run: top-p's cost depends on where each row's boundary falls
    lm_logits = lm_like_logits(n, V, dev).bfloat16()  # the model's dtype, in which the engine hands them over
    modes = {"greedy": dict(temperature=0.0), "temperature 0.8": dict(temperature=0.8),
             "Qwen default (T 0.7, top-k 20, top-p 0.8)": dict(temperature=0.7, top_k=20, top_p=0.8),
             "top-p 0.95": dict(temperature=1.0, top_p=0.95), "top-p 0.8, T 0.7": dict(temperature=0.7, top_p=0.8),
             "top-p 0.95 without the race rounds": dict(temperature=1.0, top_p=0.95, rounds=0),
             "top-p 0.95 on fp32 logits": dict(temperature=1.0, top_p=0.95, fp32=True),
             "min-p 0.05": dict(temperature=1.0, min_p=0.05)}
    for name, kw in modes.items():
        kw = dict(kw)
        # As the engine calls it: race rounds only when some row has top-p without top-k.
        alone = top_p_alone(kw.get("temperature", 1.0), kw.get("top_p", 1.0), kw.get("top_k", 0), V)
        rounds = kw.pop("rounds", TOP_P_ROUNDS if alone else 0)
        logits = lm_logits.float() if kw.pop("fp32", False) else lm_logits
        p = SamplingTensors.filled(n, dev, seeds=torch.arange(n, device=dev), **kw)
        swept = "sampler" in sweeps and name in ("greedy", "Qwen default (T 0.7, top-k 20, top-p 0.8)", "top-p 0.95")
        for block, warps, splits in SAMPLER_SWEEP if swept else ():
            t_gpu = triton.testing.do_bench_cudagraph(lambda: draw(logits, p, splits, block=block, warps=warps,
                                                                   top_p_rounds=rounds)) / 1e3
            rows.append((f"sampling, {name}, block {block}, {warps} warps, {splits} splits", f"batch {n} x {V}",
                         t_gpu, "", ""))
        if swept:  # GPU time of each pass, at the default tile
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    draw(logits, p, top_p_rounds=rounds)
                torch.cuda.synchronize()
            for e in prof.key_averages():
                if e.key.startswith("_") and e.key.endswith("_kernel"):
                    rows.append((f"sampling pass {e.key}, {name}", f"batch {n} x {V}",
                                 device_seconds(e) / 10, "", ""))
        if "rounds" in sweeps and name in ("top-p 0.95", "top-p 0.8, T 0.7"):
            top_p_rounds_sweep(name, logits, p, rows)
        drawn = draw(logits, p, top_p_rounds=rounds)
        flagged, settled = int((drawn.done == 0).sum()), int((drawn.settled >= 0).sum())
        t_gpu = triton.testing.do_bench_cudagraph(lambda: draw(logits, p, top_p_rounds=rounds)) / 1e3
        t_eager = bench(lambda: draw(logits, p, top_p_rounds=rounds))
        # with the reference's redraw of flagged rows
        t_engine = bench(lambda: sample_on_gpu(logits, p, top_p_alone=rounds > 0))
        t_ref = bench(lambda: sample_reference(logits, p, all_greedy=kw["temperature"] == 0, max_top_k=kw.get("top_k", 0)))
        rows.append((f"sampling, {name}, {MAX_CANDIDATES} candidates (ours, graph replay)", f"batch {n} x {V}", t_gpu,
                     f"{logits.nbytes / t_gpu / 1e12:.2f} TB/s",
                     f"target <= 100 us; eager call {t_eager * 1e6:.0f} us; "
                     f"torch reference {t_ref * 1e6:.0f} us ({t_ref / t_gpu:.1f}x); {flagged}/{n} rows left to "
                     f"the reference; with their redraw (sample_on_gpu) {t_engine * 1e6:.0f} us; {settled}/{n} rows "
                     f"settled by the top-p race rounds"))


def top_p_rounds_sweep(name, logits, p, rows):
    """Per race-round count: graph-replay time of a batch the rounds settle whole and of one they leave a row of
    to the histogram passes, and how often a batch is of the second kind over ROUND_STEPS token steps (each step
    draws fresh uniforms for every row)."""
    n, V = logits.shape
    for rounds in TOP_P_ROUNDS_SWEEP:
        left = []  # per step: rows the rounds left to the histogram
        for step in range(ROUND_STEPS):
            p.steps.fill_(step)
            left.append(int((draw(logits, p, top_p_rounds=rounds).settled < 0).sum()))
        times = {}
        for kind, steps in (("settled", [s for s, k in enumerate(left) if k == 0]),
                            ("left", [s for s, k in enumerate(left) if k > 0])):
            if steps:
                p.steps.fill_(steps[0])
                times[kind] = triton.testing.do_bench_cudagraph(lambda: draw(logits, p, top_p_rounds=rounds)) / 1e3
        p.steps.fill_(0)
        hit = sum(k > 0 for k in left)
        mean = (times.get("settled", 0) * (ROUND_STEPS - hit) + times.get("left", 0) * hit) / ROUND_STEPS
        fmt = {kind: f"{t * 1e6:.1f} us" for kind, t in times.items()}
        rows.append((f"sampling, {name}, {rounds} race rounds (graph replay, expected over steps)", f"batch {n} x {V}",
                     mean, "", f"batch settled whole: {fmt.get('settled', 'none seen')}; batch with a row left: "
                     f"{fmt.get('left', 'none seen')}; {hit}/{ROUND_STEPS} steps left a row ({sum(left)} rows)"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="27b")
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweeps", default=",".join(SWEEPS), help="launch-configuration sweeps to run: any of "
                        f"{', '.join(SWEEPS)}, comma-separated (none: '')")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run: any of {', '.join(SECTIONS)}")
    ns = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device")
        return 2
    rows = run(ns.size, ns.sweeps.split(","), ns.only.split(","))
    lines = [f"### {datetime.date.today()} {torch.cuda.get_device_name()} `python -m deltaserve.tools.bench_kernels "
             f"{' '.join(argv or sys.argv[1:])}` ({ns.size} shapes)", "",
             "| kernel | shape | time us | rate | vs ceiling / peer |", "|---|---|---:|---:|---|"]
    for name, shape, t, rate, note in rows:
        lines.append(f"| {name} | {shape} | {'' if t is None else f'{t * 1e6:.1f}'} | {rate} | {note} |")
    text = "\n".join(lines)
    print(text)
    if ns.out:
        with open(ns.out, "a") as f:
            f.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
