"""Our prefill attention against torch's kernels on one fresh causal prompt at head dim 256: which is fastest, and
what a cuDNN plan costs the first time a sequence length is seen.

    python -m deltaserve.tools.lab.attention_peers [--size 4b] [--tokens 8192] [--lengths 8192,8191,5000,1024,300]

Per SDPA backend (cuDNN, flash, memory-efficient; GQA native or with the K/V heads repeated) and
`torch.nn.attention.varlen.varlen_attn` where this torch has it: time and TFLOP/s on the causal half, beside ours
over a paged cache of contiguous pages. Then cuDNN's first call at each new length (its plan build) and its steady
time, whether zero padding after the prompt leaves the causal output exact, and whether it captures in a graph."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from deltaserve.kernels import attention
from deltaserve.model.config import ModelConfig
from deltaserve.model.synthetic import text_config

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa(q, k, v, backend, gqa=True):
    with sdpa_kernel(BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def peers(nh: int, nkv: int, d: int, n: int) -> None:
    dev, bf = "cuda", torch.bfloat16
    flops = 4 * nh * d * n * n / 2
    q = torch.randn(1, nh, n, d, device=dev, dtype=bf)
    k, v = (torch.randn(1, nkv, n, d, device=dev, dtype=bf) for _ in range(2))

    def row(name, fn):
        try:
            t = triton.testing.do_bench(fn) * 1e-3
            print(f"{name}: {t * 1e6:.0f} us, {flops / t / 1e12:.0f} TFLOP/s")
        except RuntimeError as exc:  # a backend that does not take the shape
            print(f"{name}: {str(exc).splitlines()[0][:100]}")

    for backend in BACKENDS:
        row(f"SDPA {backend}, GQA", lambda: sdpa(q, k, v, backend))
        row(f"SDPA {backend}, heads repeated", lambda: sdpa(q, k.repeat_interleave(nh // nkv, 1),
                                                           v.repeat_interleave(nh // nkv, 1), backend, gqa=False))
    page = 16
    k_cache = k[0].transpose(0, 1).reshape(n // page, page, nkv, d).contiguous()
    v_cache = v[0].transpose(0, 1).reshape(n // page, page, nkv, d).contiguous()
    q_tokens = q[0].transpose(0, 1).contiguous()
    table = torch.arange(n // page, device=dev, dtype=torch.int32)[None]
    cu = torch.tensor([0, n], device=dev, dtype=torch.int32)
    row("ours (paged)", lambda: attention.prefill_attention(q_tokens, k_cache, v_cache, table, cu,
                                                            torch.zeros(1, device=dev, dtype=torch.long), d**-0.5))
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return
    keys, values = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    if nh != nkv:  # varlen_attn before torch 2.12 takes no GQA
        keys, values = keys.repeat_interleave(nh // nkv, 1), values.repeat_interleave(nh // nkv, 1)
    row("varlen_attn (flash), heads repeated", lambda: varlen_attn(q_tokens, keys, values, cu, cu, n, n,
                                                                    window_size=(-1, 0)))


def cudnn_plans(nh: int, nkv: int, d: int, lengths: list[int]) -> None:
    dev, bf = "cuda", torch.bfloat16
    for n in lengths:
        q = torch.randn(1, nh, n, d, device=dev, dtype=bf)
        k, v = (torch.randn(1, nkv, n, d, device=dev, dtype=bf) for _ in range(2))
        torch.cuda.synchronize()
        started = time.perf_counter()
        sdpa(q, k, v, "cudnn")
        torch.cuda.synchronize()
        first = time.perf_counter() - started
        steady = triton.testing.do_bench(lambda: sdpa(q, k, v, "cudnn")) * 1e-3
        print(f"cuDNN, {n} tokens: first call {first * 1e3:.1f} ms, then {steady * 1e6:.0f} us")
    n, padded = 5000, 5120
    q = torch.randn(1, nh, padded, d, device=dev, dtype=bf)
    k, v = (torch.randn(1, nkv, padded, d, device=dev, dtype=bf) for _ in range(2))
    q[:, :, n:], k[:, :, n:], v[:, :, n:] = 0, 0, 0
    exact = sdpa(q[:, :, :n], k[:, :, :n], v[:, :, :n], "cudnn")
    print(f"zero padding {n} -> {padded}: largest change {(sdpa(q, k, v, 'cudnn')[:, :, :n] - exact).abs().max():.3g}")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sdpa(q, k, v, "cudnn")
        with torch.cuda.graph(graph, stream=stream):
            sdpa(q, k, v, "cudnn")
    graph.replay()
    torch.cuda.synchronize()
    print("captured in a CUDA graph and replayed")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--lengths", default="8192,8191,5000,1024,300")
    ns = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("attention_peers needs a CUDA device")
    cfg = ModelConfig.from_dict(text_config(ns.size, 248320))
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    print(f"{ns.size}: {nh} query heads, {nkv} key/value heads of {d}; {ns.tokens} causal tokens")
    peers(nh, nkv, d, ns.tokens)
    cudnn_plans(nh, nkv, d, [int(n) for n in ns.lengths.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
