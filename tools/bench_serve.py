"""`deltaserve bench serve` (also `python -m deltaserve.tools.bench_serve`): a serving benchmark for any
OpenAI-compatible server, with `vllm bench serve`'s flags and metric names.

    deltaserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 8 \\
        --random-input-len 512 --random-output-len 256 --ignore-eos --result-file result.json

Prompts are random token ids (so their lengths are exact on any server that takes token-id prompts), sent to
`/v1/completions` streaming. Datasets for prefix caching:
- `--random-prefix-len N` (vLLM's): the same N random tokens before every random prompt.
- `--dataset-name prefix_repetition` (vLLM's flags): `--prefix-repetition-num-prefixes` shared prefixes of
  `--prefix-repetition-prefix-len` tokens, each request one of them plus its own `--prefix-repetition-suffix-len`
  tokens (a system prompt and different questions).
- `--dataset-name multi_tenant`: many tenants' system prompts (`--multi-tenant-num-prefixes` of
  `--multi-tenant-prefix-len` tokens), each conversation one tenant's, drawn Zipf-distributed (exponent
  `--multi-tenant-zipf`: a few tenants take most of the traffic, as on a shared deployment), then
  `--random-input-len` tokens of its own; with `--multi-turn`, conversations of several turns.
- `--multi-turn T`: `--num-prompts` conversations of T turns, turns of a conversation one after another; each turn
  resends the history (the last prompt, then the answer, then `--random-input-len` new tokens). The answer goes
  back as the ids the server drew where it returns them (vLLM's `return_token_ids`, which ours serves), so an
  engine that caches its answers hits them, else as random ids of its length. The result gives TTFT per turn.
The cached prompt tokens a server reports (`usage.prompt_tokens_details.cached_tokens`) give the hit rate.
Tokens are counted from `usage` on every chunk (`stream_options.continuous_usage_stats`, as vLLM serves it), so a
chunk held back for an incomplete UTF-8 sequence, or one that carries two tokens, still counts right; a server
without it is counted by chunks, and the result says so.

Metrics (vLLM's names): request, output and total token throughput; TTFT (arrival to first token), TPOT ((E2EL -
TTFT) / (output tokens - 1) per request), ITL (between chunks that carry tokens) and E2EL, each as mean, median,
std and the `--metric-percentiles` (default p90, p99) in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger(__name__)


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # E2EL, seconds
    itl: list[float] = field(default_factory=list)  # seconds between token-carrying chunks
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the server reports it
    counted_by_usage: bool = False
    turn: int = 0  # --multi-turn: the turn's index in its conversation
    text: str = ""
    token_ids: list[int] | None = None  # the answer's ids, where the server returns them (`return_token_ids`)


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                    seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request; lengths uniform in [len * (1 - ratio), len * (1 + ratio)]."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(math.floor(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))))

    out = []
    for _ in range(n):
        prompt_len, max_tokens = length(input_len), length(output_len)
        out.append(([rng.randrange(vocab_size) for _ in range(prompt_len)], max_tokens))
    return out


def prefix_requests(n: int, prefix_len: int, suffix_len: int, num_prefixes: int, output_len: int, vocab_size: int,
                    seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): each prompt one of `num_prefixes` shared prefixes (taken in turn) and a suffix
    of its own."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [(prefixes[i % num_prefixes] + [rng.randrange(vocab_size) for _ in range(suffix_len)], output_len)
            for i in range(n)]


def zipf_weights(n: int, exponent: float) -> list[float]:
    """P(rank k) proportional to 1 / k^exponent, k = 1..n."""
    weights = [1.0 / (k ** exponent) for k in range(1, n + 1)]
    total = sum(weights)
    return [w / total for w in weights]


def multi_tenant_requests(n: int, num_prefixes: int, prefix_len: int, zipf: float, input_len: int,
                          output_len: int, range_ratio: float, vocab_size: int,
                          seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens): a tenant's system prompt, the tenant drawn Zipf-distributed over `num_prefixes`,
    then a question of its own (lengths as `random_requests`)."""
    rng = random.Random(seed + 3)
    prefixes = [[rng.randrange(vocab_size) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    tenants = rng.choices(range(num_prefixes), zipf_weights(num_prefixes, zipf), k=n)
    questions = random_requests(n, input_len, output_len, range_ratio, vocab_size, seed)
    return [(prefixes[t] + prompt, max_tokens) for t, (prompt, max_tokens) in zip(tenants, questions)]


async def stream_one(session: aiohttp.ClientSession, url: str, model: str | None, prompt: list[int],
                     max_tokens: int, sampling: dict, headers: dict, token_ids: bool = False) -> RequestResult:
    """One streamed completion; `sampling` goes into the body as it is (temperature, top_p, ignore_eos, ...);
    `token_ids`: ask for the answer's ids (vLLM's `return_token_ids`; servers that ignore it leave them None)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, **sampling,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if token_ids:
        body["return_token_ids"] = True
    if model:
        body["model"] = model
    result = RequestResult(prompt_len=len(prompt))
    started = last = time.perf_counter()
    counted = 0  # tokens seen so far (usage when the server sends it, else one per chunk with text)
    pieces = []
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                now = time.perf_counter()
                text = "".join(c.get("text") or "" for c in chunk.get("choices", []))
                pieces.append(text)
                for c in chunk.get("choices", []):
                    if isinstance(c.get("token_ids"), list):
                        result.token_ids = (result.token_ids or []) + c["token_ids"]
                usage = chunk.get("usage")
                cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
                if isinstance(cached, int):
                    result.cached_tokens = cached
                if usage and usage.get("completion_tokens") is not None:
                    result.counted_by_usage = True
                    total = usage["completion_tokens"]
                elif chunk.get("choices") and text:
                    total = counted + 1
                else:
                    total = counted
                if total > counted:
                    if counted == 0:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last, counted = now, total
        result.latency = time.perf_counter() - started
        result.output_tokens, result.text, result.success = counted, "".join(pieces), counted > 0
        if not result.success:
            result.error = "no tokens came back"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _pct_name(p: float) -> str:
    return f"p{int(p) if p == int(p) else p}"


def _summary(values_s: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values_s)

    def pct(p: float) -> float:  # linear interpolation, as numpy.percentile
        k = (len(ms) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ms[lo] + (ms[hi] - ms[lo]) * (k - lo)

    if not ms:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{_pct_name(p): 0.0 for p in percentiles}}
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms),
            "std": statistics.pstdev(ms) if len(ms) > 1 else 0.0, **{_pct_name(p): pct(p) for p in percentiles}}


METRICS = ("ttft", "tpot", "itl", "e2el")


def metrics(results: list[RequestResult], duration: float, percentiles: tuple[float, ...] = (90, 99),
            names: tuple[str, ...] = METRICS) -> dict:
    done = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    summary = {
        "duration": duration, "completed": len(done), "failed": len(results) - len(done),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "tokens_counted_by_usage": all(r.counted_by_usage for r in done),
        # Prompt tokens the server reports it took from its prefix cache (None: it reports none).
        "prefix_cache_hit_rate": sum(r.cached_tokens for r in done) / max(1, in_tokens)
        if done and all(r.cached_tokens is not None for r in done) else None,
        "percentiles": list(percentiles), "percentile_metrics": list(names),
    }
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [x for r in done for x in r.itl],
        "e2el": [r.latency for r in done],
    }
    for name in names:
        for stat, value in _summary(series[name], percentiles).items():
            summary[f"{stat}_{name}_ms"] = value
    turns = sorted({r.turn for r in done})
    if turns != [0]:
        summary["median_ttft_ms_by_turn"] = [_summary([r.ttft for r in done if r.turn == t], ())["median"]
                                             for t in turns]
        summary["mean_input_len_by_turn"] = [statistics.fmean(r.prompt_len for r in done if r.turn == t)
                                             for t in turns]
    return summary


def dataset(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """The requests (prompt ids, max_tokens) of --dataset-name; with --multi-turn, each conversation's first turn."""
    if args.dataset_name == "prefix_repetition":
        return prefix_requests(args.num_prompts, args.prefix_repetition_prefix_len,
                               args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                               args.prefix_repetition_output_len, vocab, args.seed)
    if args.dataset_name == "multi_tenant":
        return multi_tenant_requests(args.num_prompts, args.multi_tenant_num_prefixes, args.multi_tenant_prefix_len,
                                     args.multi_tenant_zipf, args.random_input_len, args.random_output_len,
                                     args.random_range_ratio, vocab, args.seed)
    requests = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, vocab, args.seed)
    if args.random_prefix_len:
        rng = random.Random(args.seed + 2)
        prefix = [rng.randrange(vocab) for _ in range(args.random_prefix_len)]
        requests = [(prefix + prompt, max_tokens) for prompt, max_tokens in requests]
    return requests


async def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        vocab = args.vocab_size or _tokenizer_vocab_size(args.tokenizer) or await _served_vocab_size(
            session, base, headers)
        requests = dataset(args, vocab)
        url = base + args.endpoint
        gate = asyncio.Semaphore(args.max_concurrency or len(requests))
        rng = random.Random(args.seed + 1)
        turns = args.multi_turn or 1
        bar = _progress(len(requests) * turns, args.disable_tqdm)
        sampling = sampling_fields(args)

        async def conversation(index: int, prompt: list[int], max_tokens: int) -> list[RequestResult]:
            """One request, or with --multi-turn the turns of one conversation, each resending the history."""
            talk, results = random.Random(args.seed * 7919 + index), []
            async with gate:
                for turn in range(turns):
                    if turn:  # the answer as drawn where the server said, else as many random tokens
                        last = results[-1]
                        answer = last.token_ids if last.token_ids and len(last.token_ids) == last.output_tokens \
                            else [talk.randrange(vocab) for _ in range(last.output_tokens)]
                        prompt = prompt + answer + [talk.randrange(vocab) for _ in range(args.random_input_len)]
                    result = await stream_one(session, url, args.model, prompt, max_tokens, sampling, headers,
                                              token_ids=turns > 1)
                    result.turn = turn
                    results.append(result)
                    bar.update(1)
                    if not result.success:
                        break
            return results

        for prompt, max_tokens in requests[: args.num_warmups]:
            await stream_one(session, url, args.model, prompt, max_tokens, sampling, headers)
        started = time.perf_counter()
        tasks = []
        for i, (prompt, max_tokens) in enumerate(requests):
            tasks.append(asyncio.create_task(conversation(i, prompt, max_tokens)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
        duration = time.perf_counter() - started
        bar.close()
    summary = metrics(results, duration, tuple(float(p) for p in args.metric_percentiles.split(",")),
                      tuple(args.percentile_metrics.split(",")))
    summary.update({
        "base_url": args.base_url, "model": args.model, "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
        "dataset_name": args.dataset_name, "multi_turn": args.multi_turn,
        **({"multi_tenant": {"num_prefixes": args.multi_tenant_num_prefixes,
                             "prefix_len": args.multi_tenant_prefix_len, "zipf": args.multi_tenant_zipf}}
           if args.dataset_name == "multi_tenant" else {}),
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio, "random_prefix_len": args.random_prefix_len,
        "ignore_eos": args.ignore_eos, "sampling": sampling,
        "errors": [r.error for r in results if not r.success],
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
        "cached_tokens": [r.cached_tokens for r in results], "turns": [r.turn for r in results],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
    })
    return summary


def sampling_fields(args: argparse.Namespace) -> dict:
    """The request fields the sampling flags set: temperature always (greedy unless given), the others if given."""
    fields = {"temperature": args.temperature}
    fields.update({name: getattr(args, name) for name in ("top_p", "top_k", "min_p")
                   if getattr(args, name) is not None})
    if args.ignore_eos:
        fields["ignore_eos"] = True
    if args.json_schema:
        with open(args.json_schema) as f:
            schema = json.load(f)
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    return fields


def _tokenizer_vocab_size(folder: str | None) -> int | None:
    if folder is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).get_vocab_size()


async def _served_vocab_size(session, base: str, headers: dict) -> int:
    """Our server lists `vocab_size` with its model; for another engine pass --vocab-size."""
    async with session.get(base + "/v1/models", headers=headers) as r:
        listing = await r.json()
    sizes = [m.get("vocab_size") for m in listing.get("data", []) if isinstance(m, dict)]
    if not sizes or not isinstance(sizes[0], int):
        raise SystemExit("the server does not report its vocabulary size: pass --vocab-size")
    return sizes[0]


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, disabled: bool):
    if disabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req")


def report(summary: dict) -> str:
    lines = ["============ Serving Benchmark Result ============"]

    def row(label: str, value) -> None:
        lines.append(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Maximum request concurrency:", summary["max_concurrency"] or "inf")
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name in summary["percentile_metrics"]:
        lines.append(f"{titles[name]:-^50}")
        for stat in ("mean", "median", "std", *map(_pct_name, summary["percentiles"])):
            row(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {name.upper()} (ms):",
                summary[f"{stat}_{name}_ms"])
    if summary["prefix_cache_hit_rate"] is not None:
        row("Prefix cache hit rate (prompt tokens):", summary["prefix_cache_hit_rate"])
    for turn, ttft in enumerate(summary.get("median_ttft_ms_by_turn", [])):
        row(f"Median TTFT (ms), turn {turn + 1}:", ttft)
    if not summary["tokens_counted_by_usage"]:
        lines.append("note: the server sent no per-chunk usage; tokens were counted one per chunk")
    lines.append("=" * 50)
    return "\n".join(lines)


def parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="deltaserve bench serve", description=__doc__.split("\n\n")[0])
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--backend", default="openai", choices=["openai", "vllm", "sglang", "deltaserve"],
                   help="accepted for vllm bench serve's command lines: every backend is spoken to as OpenAI")
    p.add_argument("--dataset-name", default="random", choices=["random", "prefix_repetition", "multi_tenant"],
                   help="random token-id prompts; prefix_repetition: shared prefixes with suffixes of their own; "
                        "multi_tenant: tenants' system prompts, Zipf-distributed, then random questions")
    p.add_argument("--endpoint", default="/v1/completions", help="the completions route")
    p.add_argument("--model", default=None, help="model name sent with each request (none: the server's)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key (env OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (none: all)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens")
    p.add_argument("--random-output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly within this fraction of the means")
    p.add_argument("--random-prefix-len", type=int, default=0, help="the same random tokens before every prompt")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="tokens of each shared prefix")
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="each request's own tokens after it")
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, help="shared prefixes, taken in turn")
    p.add_argument("--prefix-repetition-output-len", type=int, default=128, help="max_tokens per request")
    p.add_argument("--multi-tenant-num-prefixes", type=int, default=64, help="tenants (system prompts)")
    p.add_argument("--multi-tenant-prefix-len", type=int, default=1024, help="tokens of each tenant's system prompt")
    p.add_argument("--multi-tenant-zipf", type=float, default=1.1,
                   help="Zipf exponent of the tenants' traffic (0: uniform)")
    p.add_argument("--multi-turn", type=int, default=0, metavar="T",
                   help="conversations of T turns, each turn resending the history plus --random-input-len tokens")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids are drawn below this (none: --tokenizer's, else the vocab_size our server lists)")
    p.add_argument("--tokenizer", default=None, help="a folder with tokenizer.json: its vocabulary bounds the ids")
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens whatever the model says")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=None, help="top-p sent with each request (none: not sent)")
    p.add_argument("--top-k", type=int, default=None, help="top-k sent with each request (none: not sent)")
    p.add_argument("--min-p", type=float, default=None, help="min-p sent with each request (none: not sent)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="every request's output constrained to this JSON schema (response_format)")
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent one by one before timing")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a stream may stay silent")
    p.add_argument("--percentile-metrics", default=",".join(METRICS),
                   help="which of ttft,tpot,itl,e2el get percentiles")
    p.add_argument("--metric-percentiles", default="90,99", help="the percentiles, comma-separated")
    p.add_argument("--result-file", default=None, help="write the metrics and per-request data here (JSON)")
    p.add_argument("--save-result", action="store_true",
                   help="vllm's spelling: write them to --result-dir/--result-filename")
    p.add_argument("--result-dir", default=".", help="with --save-result")
    p.add_argument("--result-filename", default=None,
                   help="with --save-result (default: deltaserve-bench-<time>.json)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name in ("num_prompts", "random_input_len", "random_output_len", "prefix_repetition_prefix_len",
                 "prefix_repetition_suffix_len", "prefix_repetition_num_prefixes", "prefix_repetition_output_len",
                 "multi_tenant_num_prefixes", "multi_tenant_prefix_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("random_prefix_len", "multi_turn"):
        if getattr(args, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 0")
    if args.multi_turn and args.dataset_name == "prefix_repetition":
        raise SystemExit("--multi-turn takes --dataset-name random or multi_tenant")
    if not args.multi_tenant_zipf >= 0:
        raise SystemExit("--multi-tenant-zipf must be at least 0")
    if not 0 <= args.random_range_ratio < 1:
        raise SystemExit("--random-range-ratio must be in [0, 1)")
    if not args.request_rate > 0:
        raise SystemExit("--request-rate must be positive")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be at least 1")
    unknown = set(args.percentile_metrics.split(",")) - set(METRICS)
    if unknown:
        raise SystemExit(f"--percentile-metrics: unknown {sorted(unknown)}; choose from {','.join(METRICS)}")
    try:
        if not all(0 < float(p) < 100 for p in args.metric_percentiles.split(",")):
            raise ValueError
    except ValueError:
        raise SystemExit("--metric-percentiles must be numbers in (0, 100), comma-separated") from None
    if args.save_result and args.result_file is None:
        name = args.result_filename or f"deltaserve-bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
        args.result_file = os.path.join(args.result_dir, name)
    summary = asyncio.run(run(args))
    print(report(summary))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
