"""The serving benchmark against the CPU demo server: exact token counts (also when a chunk is held back for an
incomplete UTF-8 sequence), vLLM's metric names, Poisson arrivals, refusals counted as failures."""

from __future__ import annotations

import asyncio
import json

from deltaserve import cli as top_cli
from deltaserve.runtime import AsyncEngine, EngineArgs
from deltaserve.runtime.server import serve
from deltaserve.tools import bench_serve


def bench(ckpt, argv: list[str], **engine_kw) -> dict:
    async def main():
        args = dict(model=ckpt, max_model_len=256, max_batch=8, cpu_memory_bytes=32 << 20, served_model_name="tiny")
        args.update(engine_kw)
        async with AsyncEngine(EngineArgs(**args)) as engine:
            runner = await serve(engine, "127.0.0.1", 0)
            port = runner.addresses[0][1]
            try:
                ns = bench_serve.parser().parse_args(["--base-url", f"http://127.0.0.1:{port}", "--disable-tqdm",
                                                      *argv])
                return await bench_serve.run(ns)
            finally:
                await runner.cleanup()

    return asyncio.run(main())


def test_counts_are_exact_and_metrics_have_vllms_names(tiny_ckpt):
    result = bench(tiny_ckpt, ["--backend", "vllm", "--dataset-name", "random", "--num-prompts", "6",
                               "--max-concurrency", "3", "--random-input-len", "20", "--random-output-len", "24",
                               "--ignore-eos", "--model", "tiny", "--tokenizer", tiny_ckpt])
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_input_tokens"] == 6 * 20 and result["input_lens"] == [20] * 6
    assert result["total_output_tokens"] == 6 * 24 and result["output_lens"] == [24] * 6
    assert result["tokens_counted_by_usage"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{name}_ms" in result
        assert result[f"mean_{name}_ms"] > 0
    assert result["p99_e2el_ms"] >= result["median_e2el_ms"] >= result["median_ttft_ms"]
    duration = result["duration"]
    assert abs(result["output_throughput"] - 144 / duration) < 1e-6
    assert abs(result["total_token_throughput"] - (120 + 144) / duration) < 1e-6
    # Every token arrives in a chunk of its own (text empty while an incomplete UTF-8 sequence waits), so each
    # request has an inter-token latency per token after the first.
    assert [len(itl) for itl in result["itls"]] == [23] * 6
    assert "Output token throughput (tok/s):" in bench_serve.report(result)


def test_vllm_percentile_flags(tiny_ckpt):
    result = bench(tiny_ckpt, ["--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "6",
                               "--ignore-eos", "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,95,99.9"])
    assert {"p50_ttft_ms", "p95_itl_ms", "p99.9_itl_ms", "std_ttft_ms"} <= result.keys()
    assert "mean_tpot_ms" not in result and "p90_ttft_ms" not in result
    assert abs(result["p50_ttft_ms"] - result["median_ttft_ms"]) < 1e-9
    assert "P99.9 ITL (ms):" in bench_serve.report(result)


def test_sampling_flags_reach_the_server(tiny_ckpt, monkeypatch):
    """vLLM's --temperature/--top-p/--top-k/--min-p go into every request body (greedy when none is given)."""
    from deltaserve.runtime import engine as engine_module

    seen = []
    resolve = engine_module.AsyncEngine.resolve_params

    def recording(self, prompt_len, params):
        seen.append(params)
        return resolve(self, prompt_len, params)

    monkeypatch.setattr(engine_module.AsyncEngine, "resolve_params", recording)
    result = bench(tiny_ckpt, ["--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "4",
                               "--ignore-eos", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5",
                               "--min-p", "0.05"])
    assert result["completed"] == 2
    assert result["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "ignore_eos": True}
    assert [(p.temperature, p.top_p, p.top_k, p.min_p) for p in seen] == [(0.7, 0.9, 5, 0.05)] * 2
    assert bench_serve.sampling_fields(bench_serve.parser().parse_args([])) == {"temperature": 0.0}


def test_poisson_arrivals_ranges_and_refusals(tiny_ckpt):
    result = bench(tiny_ckpt, ["--num-prompts", "8", "--request-rate", "50", "--random-input-len", "30",
                               "--random-output-len", "10", "--random-range-ratio", "0.5", "--ignore-eos"])
    assert result["completed"] == 8
    assert all(15 <= n <= 45 for n in result["input_lens"]) and len(set(result["input_lens"])) > 1
    assert all(5 <= n <= 15 for n in result["output_lens"])
    assert result["total_output_tokens"] == sum(result["output_lens"])

    # Prompts longer than the context: every request is refused, and counted as failed with its reason.
    refused = bench(tiny_ckpt, ["--num-prompts", "2", "--random-input-len", "300", "--random-output-len", "4"])
    assert refused["completed"] == 0 and refused["failed"] == 2
    assert all("context" in e for e in refused["errors"])


def test_continuous_usage_stats_on_chat_and_the_command_line(tiny_ckpt, tmp_path, capsys):
    async def main():
        async with AsyncEngine(EngineArgs(model=tiny_ckpt, max_model_len=256, max_batch=4,
                                          cpu_memory_bytes=32 << 20)) as engine:
            runner = await serve(engine, "127.0.0.1", 0)
            port = runner.addresses[0][1]
            try:
                import aiohttp

                async with aiohttp.ClientSession() as session:
                    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True,
                                                               "continuous_usage_stats": True}}) as r:
                        lines = [ln[6:] for ln in (await r.text()).splitlines() if ln.startswith("data: ")]
                out = tmp_path / "result.json"
                argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2",
                        "--random-input-len", "8", "--random-output-len", "5", "--ignore-eos", "--disable-tqdm",
                        "--save-result", "--result-dir", str(tmp_path), "--result-filename", out.name]
                code = await asyncio.to_thread(top_cli.main, argv)
                return lines, code, json.loads(out.read_text())
            finally:
                await runner.cleanup()

    lines, code, saved = asyncio.run(main())
    chunks = [json.loads(x) for x in lines[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c.get("choices")]
    assert counts == sorted(counts) and sorted(set(counts)) == list(range(1, 10))  # a chunk for every token
    assert chunks[-1]["usage"]["completion_tokens"] == 9
    assert code == 0 and saved["completed"] == 2 and saved["total_output_tokens"] == 10
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_shared_prefixes_and_multi_turn_conversations_hit_the_prefix_cache(tiny_ckpt):
    """vLLM's prefix_repetition dataset and our --multi-turn: the server's cached-token counts come back per
    request, as the hit rate and, per turn, the TTFT."""
    shared = bench(tiny_ckpt, ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "40",
                               "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "1",
                               "--prefix-repetition-output-len", "3", "--num-prompts", "5", "--max-concurrency", "1",
                               "--ignore-eos"])
    assert shared["completed"] == 5 and shared["input_lens"] == [48] * 5 and shared["output_lens"] == [3] * 5
    # The second request stops a chunk where its prompt leaves the first's cached pages (32 tokens, a page
    # boundary below the 40 shared) and snapshots there; from the third on, each resumes at 32.
    assert shared["cached_tokens"] == [0, 0, 32, 32, 32]
    assert abs(shared["prefix_cache_hit_rate"] - 96 / 240) < 1e-9

    talks = bench(tiny_ckpt, ["--multi-turn", "3", "--num-prompts", "2", "--max-concurrency", "2",
                              "--random-input-len", "20", "--random-output-len", "5", "--ignore-eos"])
    assert talks["completed"] == 6 and talks["turns"] == [0, 1, 2, 0, 1, 2]
    assert talks["input_lens"] == [20, 45, 70] * 2  # history: the last prompt, its 5-token answer, 20 new tokens
    # Each turn resumes after the turn before's answer (sent back as drawn, `return_token_ids`), all but its last
    # token, which no step was fed.
    assert talks["cached_tokens"] == [0, 24, 49] * 2
    assert len(talks["median_ttft_ms_by_turn"]) == 3 and talks["mean_input_len_by_turn"] == [20, 45, 70]
    assert "turn 3" in bench_serve.report(talks)

    uncached = bench(tiny_ckpt, ["--random-prefix-len", "30", "--num-prompts", "3", "--max-concurrency", "1",
                                 "--random-input-len", "8", "--random-output-len", "2", "--ignore-eos"],
                     enable_prefix_caching=False)
    assert uncached["input_lens"] == [38] * 3 and uncached["cached_tokens"] == [0, 0, 0]
    assert uncached["prefix_cache_hit_rate"] == 0


def test_multi_tenant_conversations_are_zipf_distributed_and_hit_their_tenant_s_prefix(tiny_ckpt):
    """--dataset-name multi_tenant: each conversation a tenant's system prompt (the popular ones taking most of
    the traffic) and its own question; with --multi-turn, its later turns resume the history."""
    requests = bench_serve.multi_tenant_requests(2000, 8, 32, 1.1, 10, 4, 0.0, 500, seed=1)
    prefixes = {tuple(p[:32]) for p, _ in requests}
    assert len(prefixes) == 8 and all(len(p) == 42 and n == 4 for p, n in requests)
    counts = sorted((sum(tuple(p[:32]) == prefix for p, _ in requests) for prefix in prefixes), reverse=True)
    expected = [2000 * w for w in bench_serve.zipf_weights(8, 1.1)]  # 586, 273, ..., 60
    assert all(abs(c - e) < 0.25 * e for c, e in zip(counts, expected)), counts
    flat = bench_serve.multi_tenant_requests(2000, 8, 32, 0.0, 10, 4, 0.0, 500, seed=1)
    assert max(sum(tuple(p[:32]) == prefix for p, _ in flat) for prefix in {tuple(p[:32]) for p, _ in flat}) < 320

    argv = ["--dataset-name", "multi_tenant", "--multi-tenant-num-prefixes", "2", "--multi-tenant-prefix-len", "48",
            "--multi-turn", "2", "--num-prompts", "6", "--max-concurrency", "1", "--random-input-len", "8",
            "--random-output-len", "3", "--ignore-eos", "--vocab-size", "500"]
    talks = bench(tiny_ckpt, argv)
    assert talks["completed"] == 12 and talks["multi_tenant"]["num_prefixes"] == 2
    assert talks["input_lens"] == [56, 67] * 6  # the tenant's 48 and 8 own tokens; then its 3-token answer and 8
    # A tenant's second conversation branches off its first at 48 tokens (a snapshot is taken there), so from its
    # third on each resumes the tenant's prompt; every second turn resumes its first turn and answer.
    tenants = [tuple(p[:48]) for p, _ in bench_serve.dataset(bench_serve.parser().parse_args(argv), 500)]
    expected = [48 if tenants[:i].count(t) >= 2 else 0 for i, t in enumerate(tenants)]
    assert talks["cached_tokens"] == [c for e in expected for c in (e, 58)] and 48 in expected
