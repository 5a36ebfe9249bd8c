"""Two CPU replicas behind a real router (vllm-router and the SGLang model gateway, from PyPI): a shared-prefix
workload keeps more of its prefix hits with cache-aware routing than round-robin (the hits each replica counts
under vLLM's metric name), and a replica that goes away mid-run loses no request that had not started on it."""

import asyncio
import random
import shutil
import subprocess
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import free_port

from deltaserve.runtime import AsyncEngine, EngineArgs
from deltaserve.runtime.replicas import ROUTERS, router_command
from deltaserve.runtime.server import ServerOptions, serve

pytestmark = pytest.mark.parametrize("kind", [
    pytest.param(kind, marks=pytest.mark.skipif(shutil.which(ROUTERS[kind][0]) is None,
                                                reason=f"{ROUTERS[kind][0]} is not installed"))
    for kind in ROUTERS])


async def _replica(ckpt):
    engine = AsyncEngine(EngineArgs(model=ckpt, max_model_len=1024, max_batch=8, cpu_memory_bytes=32 << 20,
                                    served_model_name="m"))
    await engine.start()
    port = free_port()
    runner = await serve(engine, "127.0.0.1", port, ServerOptions(access_log=False))
    return engine, runner, f"http://127.0.0.1:{port}"


async def _router(kind: str, urls: list[str], policy: str):
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        *router_command(kind, "127.0.0.1", port, urls, free_port(), policy), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return process, url
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    process.kill()
    raise RuntimeError("the router did not come up")


async def _hits(s, url) -> float:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "vllm:prefix_cache_hits_total")


def _workload(seed: int) -> list[str]:
    """Six long system prompts, each asked three times with its own question, in a shuffled order."""
    rng = random.Random(seed)
    words = "river mill bridge sea baker bread street model language engine queue worker request step".split()
    systems = [" ".join(rng.choice(words) for _ in range(120)) for _ in range(6)]
    prompts = [f"{system}\nQ{j}: {rng.choice(words)}?" for system in systems for j in range(3)]
    rng.shuffle(prompts)
    return prompts


def test_cache_aware_routing_keeps_more_prefix_hits_than_round_robin(tiny_ckpt, kind):
    async def run(policy: str) -> tuple[float, int]:
        replicas = [await _replica(tiny_ckpt) for _ in range(2)]
        router, url = await _router(kind, [r[2] for r in replicas], policy)
        try:
            async with aiohttp.ClientSession() as s:
                done = 0
                for prompt in _workload(0):
                    async with s.post(url + "/v1/completions", json={"model": "m", "prompt": prompt,
                                                                      "max_tokens": 2}) as r:
                        done += r.status == 200
                return sum([await _hits(s, r[2]) for r in replicas]), done
        finally:
            router.kill()
            await router.wait()
            for engine, runner, _ in replicas:
                await runner.cleanup()
                await engine.close()

    aware, aware_done = asyncio.run(run("cache_aware"))
    spread, spread_done = asyncio.run(run("round_robin"))
    assert aware_done == spread_done == 18
    assert aware >= 1.5 * spread, (aware, spread)


def test_a_replica_going_away_loses_no_request_that_had_not_started_on_it(tiny_ckpt, kind):
    async def main():
        replicas = [await _replica(tiny_ckpt) for _ in range(2)]
        router, url = await _router(kind, [r[2] for r in replicas], "round_robin")
        results = []
        try:
            async with aiohttp.ClientSession() as s:
                async def one(i):
                    started = time.monotonic()
                    try:
                        async with s.post(url + "/v1/completions", json={
                                "model": "m", "prompt": f"request {i}", "max_tokens": 8}) as r:
                            results.append((started, r.status, await r.text()))
                    except aiohttp.ClientError as exc:
                        results.append((started, 0, str(exc)))

                first = [asyncio.create_task(one(i)) for i in range(8)]
                await asyncio.gather(*first)
                engine, runner, _ = replicas[1]
                gone = time.monotonic()
                await runner.cleanup()  # replica 1 stops listening and its engine ends
                await engine.close()
                await asyncio.gather(*[one(i) for i in range(8, 24)])
                return results, gone
        finally:
            router.kill()
            await router.wait()
            await replicas[0][1].cleanup()
            await replicas[0][0].close()

    results, gone = asyncio.run(main())
    assert len(results) == 24
    failed = [(t, status, text[:200]) for t, status, text in results if status != 200]
    assert not failed, failed  # none was in flight on the replica when it went: every request is served
