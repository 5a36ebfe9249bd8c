"""Replicas behind a router, on modelled devices: how much throughput a replica keeps as they are added, and how
many prefix hits the routing policy keeps, against one replica that holds every prefix.

    python -m deltaserve.tools.lab.replica_study [--replicas 1,2,4,8] [--router vllm] \\
        [--policies cache_aware,round_robin] [--concurrency 16] [--conversations 48] [--out FILE.md]

Each replica is `fake_device_server` (the real engine, scheduler, prefix cache and HTTP server; each step a
modelled device time: by default the 27B FP8 on an H100, decode 11.18 ms at one row to 29.88 ms at 64, a step's
prompt tokens 8 ms plus 55 us each). A run starts N of them and the router (`runtime.replicas.router_command`),
then `deltaserve bench serve`'s multi_tenant workload scaled with N (`--conversations` and `--concurrency` per
replica: tenants' system prompts, Zipf-distributed, conversations of `--turns` turns); the replicas restart
between runs, so each starts cold. Per N it reports, for each policy: output tok/s per replica against one
replica's, the prefix hit rate (prompt tokens served from cache, as the replicas count them under
`vllm:prefix_cache_hits`), TTFT median and p99; and the hit rate of one replica with every request of the same
workload (its batch as large as the N replicas' together): the most any routing could keep.

Every process shares this machine's cores: where they are busy, throughput per replica falls for want of host,
not device; the table gives the machine's load beside each run (`os.getloadavg`, 1 min).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from deltaserve.runtime.replicas import router_command
from deltaserve.tools import bench_serve

log = logging.getLogger("replica_study")


def _free_ports(k: int) -> list[int]:
    sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(k)]
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _get(url: str, timeout: float = 1.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode() if r.status == 200 else None
    except OSError:
        return None


def _wait(urls: list[str], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not up after {timeout_s:.0f} s: {pending}")
        pending = [u for u in pending if _get(u + "/health") is None]
        time.sleep(0.3)


def _counters(url: str, names: tuple[str, ...]) -> list[float]:
    """The replica's counters `names`, from one read of its /metrics."""
    text = _get(url + "/metrics", timeout=5.0) or ""
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return [sum(s.value for s in samples if s.name == name) for name in names]


class Fleet:
    """N modelled replicas (and a router over them, or none)."""

    def __init__(self, n: int, max_num_seqs: int, device_flags: list[str], router: str | None, policy: str,
                 router_flags: list[str]) -> None:
        *ports, port, metrics_port = _free_ports(n + 2)
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]
        self.processes = [subprocess.Popen(
            [sys.executable, "-m", "deltaserve.tools.lab.fake_device_server", "--port", str(p),
             "--max-num-seqs", str(max_num_seqs), *device_flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
        self.url = self.urls[0]
        _wait(self.urls)  # first: a router that finds its workers down checks again only half a minute later
        if router is not None:
            self.processes.append(subprocess.Popen(
                router_command(router, "127.0.0.1", port, self.urls, metrics_port, policy) + router_flags,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.url = f"http://127.0.0.1:{port}"
            _wait([self.url])

    def counters(self) -> list[list[float]]:
        """Per replica: prefix-cache hit tokens, queried tokens, generated tokens."""
        names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:generation_tokens_total")
        return [_counters(u, names) for u in self.urls]

    def close(self) -> None:
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def bench(url: str, ns, n: int) -> dict:
    args = bench_serve.parser().parse_args([
        "--base-url", url, "--dataset-name", "multi_tenant", "--num-prompts", str(ns.conversations * n),
        "--max-concurrency", str(ns.concurrency * n), "--multi-turn", str(ns.turns),
        "--multi-tenant-num-prefixes", str(ns.tenants), "--multi-tenant-prefix-len", str(ns.tenant_prompt_len),
        "--multi-tenant-zipf", str(ns.zipf), "--random-input-len", str(ns.question_len),
        "--random-output-len", str(ns.output_len), "--ignore-eos", "--vocab-size", "500", "--seed", str(ns.seed),
        "--disable-tqdm"])
    return asyncio.run(bench_serve.run(args))


def one_run(ns, n: int, router: str | None, policy: str, max_num_seqs: int) -> dict:
    fleet = Fleet(n, max_num_seqs, ns.device_flags, router, policy, ns.router_flags)
    try:
        result = bench(fleet.url, ns, n)
        hits, queries, generated = zip(*fleet.counters())
        return {"n": n, "policy": policy, "tok_s": result["output_throughput"], "failed": result["failed"],
                "hit_rate": sum(hits) / max(1.0, sum(queries)), "ttft_median": result["median_ttft_ms"],
                "ttft_p99": result["p99_ttft_ms"], "spread": max(generated) / max(1.0, sum(generated) / n),
                "load": os.getloadavg()[0]}
    finally:
        fleet.close()


def study(ns) -> tuple[dict, list[dict]]:
    """One replica alone, then per replica count each policy's run: (the lone replica's row, the others)."""
    rows = []
    single = one_run(ns, 1, None, "-", ns.concurrency)  # one replica alone: the throughput each should keep
    log.info("one replica: %.0f tok/s, hit rate %.3f", single["tok_s"], single["hit_rate"])
    for n in ns.counts:
        if n == 1:
            continue
        best = one_run(ns, 1, None, "-", ns.concurrency * n)  # every prefix in one cache
        for policy in ns.policies:
            row = one_run(ns, n, ns.router, policy, ns.concurrency)
            row["per_replica"] = row["tok_s"] / n / single["tok_s"]
            row["hits_vs_one"] = row["hit_rate"] / best["hit_rate"] if best["hit_rate"] else float("nan")
            rows.append(row)
            log.info("%d replicas, %s: %.2fx a replica's tok/s, hit rate %.3f (one cache: %.3f), TTFT %.0f / "
                     "%.0f ms, busiest replica %.2fx the mean, load %.1f", n, policy, row["per_replica"],
                     row["hit_rate"], best["hit_rate"], row["ttft_median"], row["ttft_p99"], row["spread"],
                     row["load"])
    return single, rows


def table(single: dict, rows: list[dict], router: str) -> str:
    lines = [f"| replicas | policy ({router}-router) | tok/s a replica / one replica's | hit rate (/ one cache's) | "
             "TTFT median / p99 ms | busiest replica's tokens / mean | failed | load |",
             "|---:|---|---:|---|---|---:|---:|---:|",
             f"| 1 | - | {single['tok_s']:.0f} tok/s | {single['hit_rate']:.3f} | {single['ttft_median']:.0f} / "
             f"{single['ttft_p99']:.0f} | 1 | {single['failed']} | {single['load']:.1f} |"]
    for r in rows:
        lines.append(f"| {r['n']} | {r['policy']} | {r['per_replica']:.3f} | {r['hit_rate']:.3f} "
                     f"({r['hits_vs_one']:.3f}x) | {r['ttft_median']:.0f} / {r['ttft_p99']:.0f} | {r['spread']:.2f} | "
                     f"{r['failed']} | "
                     f"{r['load']:.1f} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="1,2,4,8", help="replica counts, comma-separated")
    p.add_argument("--router", default="vllm", choices=["vllm", "sglang"])
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--router-flags", default="", help="more of the router's flags (e.g. its balance thresholds)")
    p.add_argument("--concurrency", type=int, default=16, help="conversations in flight per replica")
    p.add_argument("--conversations", type=int, default=48, help="conversations per replica")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--tenants", type=int, default=32)
    p.add_argument("--tenant-prompt-len", type=int, default=2048)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--question-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="--step-ms 11.18 --step-ms-full 29.88 --prefill-us-per-token 55 "
                                       "--prefill-ms-fixed 8 --max-model-len 8192",
                   help="fake_device_server's flags: the modelled step times (default: 27B FP8, H100)")
    p.add_argument("--out", default=None, help="append the table here (markdown)")
    return p


def options(argv=None) -> argparse.Namespace:
    ns = parser().parse_args(argv)
    ns.device_flags, ns.router_flags = ns.device.split(), ns.router_flags.split()
    ns.counts, ns.policies = [int(x) for x in ns.replicas.split(",")], ns.policies.split(",")
    return ns


def main(argv=None) -> int:
    ns = options(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    text = table(*study(ns), ns.router)
    print(text)
    if ns.out:
        with open(ns.out, "a") as f:
            f.write(f"\n`python -m deltaserve.tools.lab.replica_study {' '.join(argv or sys.argv[1:])}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
