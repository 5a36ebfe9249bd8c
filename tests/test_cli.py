"""`deltaserve serve` as an operator meets it: vLLM's flag names, one-line start-up errors (exit 2), a drain on
SIGTERM that ends live streams with finish_reason "abort" within the grace period (exit 0), a second signal that
exits at once, a failed engine that ends the process (exit 1), and the access and stats log lines."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from deltaserve import __version__
from deltaserve.runtime import cli
from deltaserve.runtime.engine import AsyncEngine
from deltaserve.runtime.server import ServerOptions, serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_failure(caplog, argv: list[str]) -> str:
    """Run the CLI expecting a start-up failure: exit 2 and exactly one error line, without a traceback."""
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert cli.main(["serve", *argv]) == cli.EXIT_STARTUP_FAILED
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None, [r.getMessage() for r in errors]
    message = errors[0].getMessage()
    assert "\n" not in message
    return message


def test_start_up_mistakes_end_in_one_line_naming_them(tiny_ckpt, tmp_path, caplog):
    assert "local folder" in start_failure(caplog, ["Qwen/Qwen3.5-4B"])
    assert "does not exist" in start_failure(caplog, [str(tmp_path / "nowhere")])

    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_ckpt, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    assert "safetensors" in start_failure(caplog, [str(no_weights)])

    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_ckpt, truncated)
    weights = next(truncated.glob("*.safetensors"))
    os.truncate(weights, weights.stat().st_size - 100)
    assert str(weights) in start_failure(caplog, [str(truncated)])

    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_ckpt, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    assert "tokenizer.json" in start_failure(caplog, [str(no_tokenizer)])

    bad_config = tmp_path / "bad_config"
    shutil.copytree(tiny_ckpt, bad_config)
    (bad_config / "config.json").write_text("{oops")
    assert "config.json" in start_failure(caplog, [str(bad_config)])

    assert "max_position_embeddings" in start_failure(caplog, [tiny_ckpt, "--max-model-len", "100000000"])

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert "cannot listen" in start_failure(caplog, [tiny_ckpt, "--port", str(port)])
        # Refused before anything loads (for a large model: minutes of loading and capture before finding out).
        assert not [r for r in caplog.records if r.name.startswith(("deltaserve.devices", "deltaserve.runtime.engine"))]
    assert "cannot listen on nosuch.invalid" in start_failure(caplog, [tiny_ckpt, "--host", "nosuch.invalid"])
    assert "`hf download Qwen/Qwen3.5-9B" in start_failure(caplog, ["Qwen/Qwen3.5-9B"])


def test_embedded_engine_args_default_to_auto_as_the_cli(monkeypatch):
    from deltaserve.runtime import EngineArgs

    monkeypatch.setattr("deltaserve.devices.backend.default_device", lambda: "cuda")  # a GPU machine, as seen
    args = EngineArgs()
    assert args.device == "cuda" and args.dtype == "bfloat16"
    assert cli.serve_parser(argparse.ArgumentParser()).get_default("device") == "auto"


@pytest.mark.parametrize("argv,words", [
    (["--port", "80000"], "80000 is out of range"), (["--port", "x"], "not an integer"),
    (["--max-model-len", "1"], "out of range"), (["--gpu-memory-utilization", "1.5"], "out of range"),
    (["--tensor-parallel-size", "0"], "out of range"), (["--shutdown-timeout", "nan"], "out of range"),
    (["--no-such-flag"], "unrecognized arguments"), (["--speculative-tokens", "9"], "out of range"),
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "only 'mtp'"),
    (["--speculative-config", '{"num_speculative_tokens": 0}'], "num_speculative_tokens must be"),
    (["--speculative-config", "[2]"], "JSON object"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err and err.count("\n") == 1, err


def test_help_version_and_vllm_names(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"deltaserve {__version__}"

    parser = cli.serve_parser(cli._Parser(prog="deltaserve serve"))
    assert all(a.help for a in parser._actions), [a.dest for a in parser._actions if not a.help]
    text = parser.format_help()
    for shown in ("(default: 8000)", "(default: 5.0)", "--tensor-parallel-size", "-tp", "--max-num-seqs",
                  "--gpu-memory-utilization", "--enforce-eager", "--served-model-name", "--api-key"):
        assert shown in text, shown

    ns = parser.parse_args(["-tp", "2", "--max-num-seqs", "12", "--gpu-memory-utilization", "0.5", "--enforce-eager",
                            "--max-model-len", "128", "--served-model-name", "m", "--max-num-batched-tokens", "512",
                            "--dtype", "bfloat16", "--load-format", "random", "--async-scheduling"])
    args = cli.engine_args(ns)
    assert (args.tp, args.max_batch, args.memory_fraction, args.cuda_graph, args.max_model_len) == (
        2, 12, 0.5, False, 128)
    assert (args.served_model_name, args.prefill_token_budget, args.dtype, args.load_format) == (
        "m", 512, "bfloat16", "random")
    assert args.async_scheduling and cli.engine_args(parser.parse_args([])).async_scheduling  # on by default
    assert not cli.engine_args(parser.parse_args(["--no-async-scheduling"])).async_scheduling
    assert cli.engine_args(parser.parse_args([])).enable_prefix_caching  # on by default
    assert cli.engine_args(parser.parse_args([])).prefill_graph_tokens == 2048
    assert cli.engine_args(parser.parse_args(["--prefill-graph-tokens", "512"])).prefill_graph_tokens == 512
    cache_off = cli.engine_args(parser.parse_args(["--no-enable-prefix-caching", "--prefix-cache-state-gib", "2.5"]))
    assert (cache_off.enable_prefix_caching, cache_off.prefix_cache_state_gib) == (False, 2.5)
    assert cli.engine_args(parser.parse_args(["--step-latency-ratio", "0"])).step_latency_ratio == 0
    assert cli.engine_args(parser.parse_args(["--step-latency-ratio", "3"])).step_latency_ratio == 3.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--step-latency-ratio", "0.5"])
    assert cli.engine_args(parser.parse_args([])).speculative_tokens == 0  # off by default
    assert cli.engine_args(parser.parse_args(["--speculative-tokens", "3"])).speculative_tokens == 3
    vllm_form = parser.parse_args(["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'])
    assert cli.engine_args(vllm_form).speculative_tokens == 2
    with pytest.raises(cli.StartupError, match="disagree"):
        cli.engine_args(parser.parse_args(["--speculative-tokens", "3", "--speculative-config",
                                           '{"method": "mtp", "num_speculative_tokens": 2}']))
    old = parser.parse_args(["--tp", "2", "--max-batch", "3", "--no-cuda-graph"])
    assert (old.tp, old.max_batch, old.enforce_eager) == (2, 3, True)


def test_device_auto_picks_a_visible_gpu(monkeypatch):
    from deltaserve.devices import backend

    ns = cli.serve_parser(cli._Parser()).parse_args([])
    assert ns.device == "auto"
    monkeypatch.setattr(backend, "default_device", lambda: "cuda")
    args = cli.engine_args(ns)
    assert (args.device, args.dtype) == ("cuda", "bfloat16")
    monkeypatch.setattr(backend, "default_device", lambda: "cpu")
    assert (cli.engine_args(ns).device, cli.engine_args(ns).dtype) == ("cpu", "float32")


# Signals, as an operator sends them ---------------------------------------------------------------------------------
def launch(ckpt: str, port: int, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deltaserve.runtime.serve", ckpt, "--port", str(port), "--max-model-len", "4096",
           "--served-model-name", "tiny", "--stats-interval", "0", *flags]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


async def wait_healthy(session, url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("the server never became healthy")


async def open_streams(session, url: str, n: int) -> list:
    streams = []
    for _ in range(n):
        r = await session.post(url + "/v1/completions", json={
            "prompt": "once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True})
        assert r.status == 200
        await r.content.readline()  # the first event: the stream is live
        streams.append(r)
    return streams


async def events(response) -> list[str]:
    return [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: ")]


def test_sigterm_drains_live_streams_with_abort_and_exits_0(tiny_ckpt):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch(tiny_ckpt, port, "--shutdown-timeout", "2")

    async def main():
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, url, proc)
            streams = await open_streams(session, url, 8)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            tails = await asyncio.gather(*[events(r) for r in streams])
            ended = time.monotonic() - signalled
            rc = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
            return tails, rc, ended, time.monotonic() - signalled

    try:
        tails, rc, ended, took = asyncio.run(main())
    finally:
        proc.kill()
    assert rc == 0, proc.stderr.read()
    # What the grace period promises: the streams end when it does, and then the process exits. The margins
    # hold on a loaded 2-core machine; a drain that ignored the grace period would miss them by far (the streams
    # ask for 3000 tokens each).
    assert ended < 2.0 + 3.0, f"the streams ended {ended:.1f} s after SIGTERM with a 2 s grace period"
    assert took < 2.0 + 10.0, f"the process exited {took:.1f} s after SIGTERM with a 2 s grace period"
    for tail in tails:
        assert tail[-1] == "[DONE]"
        finish = [c["finish_reason"] for e in tail[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
        assert finish == ["abort"], tail[-3:]


def test_a_second_signal_exits_at_once(tiny_ckpt):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch(tiny_ckpt, port, "--shutdown-timeout", "60")

    async def main():
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, url, proc)
            streams = await open_streams(session, url, 2)
            proc.send_signal(signal.SIGINT)
            await asyncio.sleep(0.3)
            assert proc.poll() is None  # draining: the streams have 60 s
            signalled = time.monotonic()
            proc.send_signal(signal.SIGINT)
            rc = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
            for r in streams:
                r.close()
            return rc, time.monotonic() - signalled

    try:
        rc, took = asyncio.run(main())
    finally:
        proc.kill()
    assert rc != 0 and took < 5.0, (rc, took)  # at once, not after the 60 s grace period


def test_a_failed_engine_ends_the_process_with_status_1(tiny_ckpt, monkeypatch, caplog):
    from deltaserve.runtime.scheduler import Scheduler

    def broken(self):  # the step loop's first question, before any request
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(Scheduler, "has_work", property(broken))
    ns = cli.serve_parser(cli._Parser()).parse_args([tiny_ckpt, "--port", str(free_port()), "--stats-interval", "0"])
    with caplog.at_level(logging.INFO):
        assert cli.run(cli.run_server(ns)) == cli.EXIT_ENGINE_FAILED
    causes = [r for r in caplog.records if "fell over" in r.getMessage()]
    assert len(causes) == 1, [r.getMessage() for r in causes]  # the cause, logged once

    port = free_port()
    ns = cli.serve_parser(cli._Parser()).parse_args(
        [tiny_ckpt, "--port", str(port), "--stats-interval", "0", "--keep-running-on-engine-error"])

    async def stays_up():
        server = asyncio.create_task(cli.run_server(ns))
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health") as r:
                        assert r.status == 503 and await r.json() == {"status": "unhealthy"}
                        break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.05)
        assert not server.done()
        os.kill(os.getpid(), signal.SIGINT)  # the handler run_server installed: a drain, then exit 0
        return await server

    assert cli.run(stays_up()) == 0


def test_access_log_and_stats_lines(tiny_ckpt, caplog):
    async def main():
        args = cli.EngineArgs(model=tiny_ckpt, max_model_len=256, max_batch=4, cpu_memory_bytes=32 << 20,
                              stats_interval_s=0.05)
        async with AsyncEngine(args) as engine:
            runner = await serve(engine, "127.0.0.1", 0, ServerOptions())
            port = runner.addresses[0][1]
            try:
                async with aiohttp.ClientSession() as session:
                    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json={
                            "prompt": "hello", "max_tokens": 40, "ignore_eos": True}) as r:
                        usage = (await r.json())["usage"]
                    await asyncio.sleep(0.1)
            finally:
                await runner.cleanup()
        return usage

    with caplog.at_level(logging.INFO):
        usage = asyncio.run(main())
    access = [r.getMessage() for r in caplog.records if r.name == "deltaserve.access"]
    assert any('"POST /v1/completions" 200' in line and f"prompt={usage['prompt_tokens']} completion=40" in line
               for line in access), access
    stats = [r.getMessage() for r in caplog.records if "generation" in r.getMessage() and "tok/s" in r.getMessage()]
    assert stats and "KV pages" in stats[0], stats


def test_the_benchmarks_kernel_flag_sets_any_kernel_config_field():
    """`bench_decode --kernel FIELD=VALUE` (also profile_decode's): a tuple becomes the field's tile type, None
    switches a kernel off, and an unknown field ends the run naming it."""
    import argparse

    from deltaserve.kernels.config import Tile
    from deltaserve.tools.bench_decode import add_engine_args, kernel_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser, "1")
    cfg = kernel_config(parser.parse_args(["--kernel", "gemv_tile=(16, 256, 4, 3)", "--kernel",
                                           "fp8_gemv_tile=None", "--kernel", "wide_input_k=2048", "--pdl", "off"]))
    assert cfg.gemv_tile == Tile(16, 256, 4, 3) and isinstance(cfg.gemv_tile, Tile)
    assert cfg.fp8_gemv_tile is None and cfg.wide_input_k == 2048 and not cfg.pdl
    with pytest.raises(SystemExit, match="no field 'few_row'"):
        kernel_config(parser.parse_args(["--kernel", "few_row=8"]))


def test_progress_is_log_lines_when_stderr_is_not_a_terminal(caplog, monkeypatch, capsys):
    """A redirected log gets a line at a stage's start and end, never a bar's `\\r` frames."""
    import io

    from deltaserve.model.weights import load_rank_weights
    from deltaserve.model.config import load_model_config
    from deltaserve.model.synthetic import demo_checkpoint

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    ckpt = demo_checkpoint()
    with caplog.at_level(logging.INFO, logger="deltaserve.progress"):
        load_rank_weights(ckpt, load_model_config(ckpt))
    lines = [r.getMessage() for r in caplog.records if r.name == "deltaserve.progress"]
    assert lines[0].startswith("loading weights (rank 0/1): started") and "done" in lines[-1]
    assert "\r" not in sys.stderr.getvalue()


def test_an_aiohttp_without_the_internals_the_server_reads_is_refused_at_start_up(caplog, monkeypatch, tiny_ckpt):
    """Rather than serving without the header timeout, a start-up line names what this aiohttp lacks."""
    from aiohttp.web_protocol import RequestHandler

    from deltaserve.runtime import connection

    connection.check_aiohttp()  # the installed one has them all
    monkeypatch.setattr(connection, "_INTERNALS", [*connection._INTERNALS, (RequestHandler, "_renamed_later")])
    message = start_failure(caplog, [tiny_ckpt])
    assert "RequestHandler._renamed_later" in message and "aiohttp>=3.14,<3.15" in message


def test_emulated_acceptance_is_a_lab_tool_not_a_serve_flag(tiny_ckpt, caplog):
    """The served product has no flag that changes outputs for a benchmark's sake; the lab's server takes the
    emulated acceptance, checked against the drafts a step makes."""
    from deltaserve.tools.lab import serve_emulated

    with pytest.raises(SystemExit):
        cli.main(["serve", tiny_ckpt, "--speculative-acceptance", "0.9"])
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert serve_emulated.main(["--acceptance", "0.9,0.8", tiny_ckpt, "--speculative-tokens", "3",
                                    "--port", str(free_port())]) == cli.EXIT_STARTUP_FAILED
    assert any("acceptance must hold speculative_tokens (3)" in r.getMessage() for r in caplog.records)


def test_the_flags_and_the_embedded_api_refuse_a_value_in_the_same_words(capsys):
    """One table validates both: for every numeric engine flag, a value below its range is refused by the CLI and
    by EngineArgs, each naming the same valid range; every flagged option's default is EngineArgs' own."""
    import dataclasses

    from deltaserve.args import OPTIONS, EngineArgs

    parser = cli.serve_parser(cli._Parser(prog="deltaserve serve"))
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    numeric = [o for o in OPTIONS.values() if o.flags and o.kind in (int, float) and o.low is not None]
    assert {o.name for o in numeric} >= {"tp", "max_batch", "memory_fraction", "step_latency_ratio", "seed"}
    for option in numeric:
        bad = option.low - (0.5 if option.zero_off else 1)
        bad = option.kind(bad) if option.kind is float else int(bad)
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([option.flags[0], str(bad)])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and option.valid in err, (option.name, err)
        with pytest.raises(ValueError, match=rf"^{option.name} must be ") as refused:
            EngineArgs(**{option.name: bad})
        assert option.valid in str(refused.value)
    parsed = parser.parse_args([])
    for option in OPTIONS.values():
        if option.flags:
            assert getattr(parsed, option.name) == defaults[option.name], option.name
