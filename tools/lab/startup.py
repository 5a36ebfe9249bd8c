"""How long `deltaserve serve` takes to become ready, and what the first request waits compared with later ones.

    python -m deltaserve.tools.lab.startup [--input-len 512] [--repeats 5] -- SERVE_ARGS...

Starts the server with SERVE_ARGS (plus --port), times until /health answers 200, then sends one streamed request
(random token ids, 2 output tokens) and `--repeats` more: prints one JSON line with the ready time, the first
request's TTFT and the median of the rest. Run it twice with the same $TRITON_CACHE_DIR to see a cold and a warm
start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time

import aiohttp


async def ttft(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True, "temperature": 0.0}
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: ") and b'"text"' in line:
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without a token")


async def measure(url: str, proc: subprocess.Popen, input_len: int, repeats: int, vocab: int | None) -> dict:
    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with status {proc.returncode}")
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        ready = time.perf_counter() - started
        if vocab is None:
            async with session.get(url + "/v1/models") as r:
                vocab = (await r.json())["data"][0]["vocab_size"]
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(input_len)] for _ in range(repeats + 1)]
        first = await ttft(session, url, prompts[0])
        rest = [await ttft(session, url, p) for p in prompts[1:]]
    return {"ready_s": round(ready, 2), "first_ttft_ms": round(first * 1000, 1),
            "steady_ttft_ms": round(statistics.median(rest) * 1000, 1), "input_len": input_len}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="startup")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--vocab-size", type=int, default=None, help="prompt ids below this (none: what the server lists)")
    args = p.parse_args(ours)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "deltaserve.runtime.serve", *serve_args, "--port", str(port)]
    proc = subprocess.Popen(cmd)
    try:
        result = asyncio.run(measure(f"http://127.0.0.1:{port}", proc, args.input_len, args.repeats,
                                     args.vocab_size))
    finally:
        proc.terminate()
        proc.wait(60)
    print(json.dumps({**result, "serve_args": " ".join(serve_args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
