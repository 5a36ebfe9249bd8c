"""`deltaserve serve ...` (also `python -m deltaserve.runtime.serve ...`): start an engine and the OpenAI HTTP
server.

The flags are vLLM's where vLLM has one (`--tensor-parallel-size/-tp`, `--max-num-seqs`, ...), with our older
spellings kept as aliases. A mistake in the flags or the checkpoint, or a port that cannot be bound, ends the
process with one line naming it and exit status 2. The first SIGTERM/SIGINT drains (live streams end within
`--shutdown-timeout`, aborted ones with finish_reason "abort"), then exits 0; a second exits at once. A poisoned
engine ends the process with status 1, so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import sys

from deltaserve import __version__

from deltaserve.args import GROUPS, MAX_SPECULATIVE_TOKENS, OPTIONS, SERVER_OPTIONS, EngineArgs, Option
from deltaserve.runtime.tool_calls import PARSERS

log = logging.getLogger("deltaserve")

EXIT_STARTUP_FAILED = 2
EXIT_ENGINE_FAILED = 1


class StartupError(Exception):
    """A start-up failure the user can fix; its message is the one line they see."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(EXIT_STARTUP_FAILED, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown where they say something: not for switches, unset values, or help that names its own."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.nargs == 0 or action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _option_type(option: Option):
    """argparse's `type` for an engine option: the text converted to its kind, then the table's check."""
    def parse(text: str):
        try:
            value = option.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if option.kind is int else 'a number'}"
                                             ) from None
        try:
            option.check(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value} is out of range: {option.valid}") from None
        return value

    return parse


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every engine option the table gives flags (`deltaserve.args.OPTIONS`), with its help, default and
    check; then the options whose command line is not a plain flag."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    groups = {name: parser.add_argument_group(f"{name} options") for name in GROUPS}
    for option in OPTIONS.values():
        if not option.flags:
            continue
        kwargs = {"dest": option.name, "default": defaults[option.name], "help": option.help}
        if option.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif option.choices:
            kwargs["choices"] = option.choices
        elif option.kind in (int, float):
            kwargs.update(type=_option_type(option), metavar=option.metavar)
        elif option.metavar:
            kwargs["metavar"] = option.metavar
        groups[option.group].add_argument(*option.flags, **kwargs)
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint folder (the same as --model)")
    groups["model"].add_argument("--model", default=None, help=OPTIONS["model"].help)
    groups["model"].add_argument("--dtype", default="auto", choices=("auto",) + OPTIONS["dtype"].choices,
                                 help=OPTIONS["dtype"].help)
    groups["kernels"].add_argument("--enforce-eager", "--no-cuda-graph", dest="enforce_eager", action="store_true",
                                   help="launch every step eagerly, without CUDA graphs")
    speculative = OPTIONS["speculative_tokens"]
    groups["speculative"].add_argument("--speculative-tokens", type=_option_type(speculative), metavar="K",
                                       default=None, help=speculative.help)
    groups["speculative"].add_argument(
        "--speculative-config", type=_speculative_config, metavar="JSON", default=None,
        help='vLLM\'s form of --speculative-tokens: \'{"method": "mtp", "num_speculative_tokens": K}\'')
    groups["runtime"].add_argument("--no-warmup", dest="warmup", action="store_false", default=None,
                                   help="skip the start-up warm-up requests that compile every kernel (cuda) before "
                                        "serving")


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.formatter_class = _HelpFormatter
    add_engine_flags(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $DELTASERVE_API_KEY)")
    from .server import ServerOptions

    defaults = {"port": 8000, "shutdown_timeout": 5.0,
                **{f.name: f.default for f in dataclasses.fields(ServerOptions) if f.name in SERVER_OPTIONS}}
    for option in SERVER_OPTIONS.values():
        parser.add_argument(*option.flags, dest=option.name, type=_option_type(option), metavar=option.metavar,
                            default=defaults[option.name], help=option.help)
    parser.add_argument("--disable-access-log", "--disable-uvicorn-access-log", dest="access_log",
                        action="store_false", help="no log line per request")
    parser.add_argument("--keep-running-on-engine-error", action="store_true",
                        help="stay up answering 503 after the engine fails, instead of exiting 1 (debugging)")
    parser.add_argument("--log-level", default="info", type=str.lower,
                        choices=["debug", "info", "warning", "error"], help="log verbosity")
    parser.add_argument("--log-steps", action="store_true",
                        help="log every engine step: decode rows, prompt tokens, time, device idle (logger "
                             "deltaserve.steps, at debug)")
    parser.add_argument("--version", action="version", version=f"deltaserve {__version__}")
    replicas = parser.add_argument_group("data parallelism on one host")
    replicas.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                          help="N replicas of this server, each a process on its own GPUs (tp of them) and on port "
                               "--port + 1 + i, behind --router on --port")
    replicas.add_argument("--router", choices=("vllm", "sglang", "none"), default="vllm",
                          help="with --data-parallel-size: vllm-router or sglang-router (cache-aware) on --port, or "
                               "none (the replicas alone)")
    agents = parser.add_argument_group("tool calls and reasoning")
    agents.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                        help="the format of the model's tool calls (default: the one its chat template shows)")
    agents.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's switch for parsing tool calls: here they are parsed whenever a request sends "
                             "tools with tool_choice 'auto' (accepted, implied)")
    agents.add_argument("--reasoning-parser", choices=("qwen3", "deepseek_r1"), default=None,
                        help="the reasoning between <think> and </think> goes to reasoning_content (always on; "
                             "accepted for vLLM's command lines)")
    compat = parser.add_argument_group("vLLM flags that change nothing here (accepted, so its command lines run)")
    compat.add_argument("--trust-remote-code", action="store_true",
                        help="no checkpoint code is ever run: Qwen3.5 is built in")
    compat.add_argument("--disable-log-requests", "--enable-log-requests", action="store_true", dest="log_requests",
                        help="request contents are never logged")
    compat.add_argument("--prefix-caching-hash-algo", choices=("sha256_cbor",), default="sha256_cbor",
                        help="KV events name blocks by vLLM's sha256_cbor hashes (the scheme routers recompute; seed "
                             "PYTHONHASHSEED)")
    compat.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                        help="chunked prefill is always on (--max-num-batched-tokens sizes the chunks)")
    return parser


def log_compatibility_flags(ns: argparse.Namespace) -> None:
    """One line for each vLLM flag given that means nothing or something fixed here."""
    if ns.trust_remote_code:
        log.info("--trust-remote-code: ignored (no checkpoint code runs; Qwen3.5 is built in)")
    if ns.enable_auto_tool_choice:
        log.info("--enable-auto-tool-choice: tool calls are parsed whenever a request sends tools (tool_choice auto)")
    if ns.enable_chunked_prefill is False:
        log.warning("--no-enable-chunked-prefill: ignored (chunked prefill is always on)")


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def checkpoint_folder(ns: argparse.Namespace) -> str | None:
    """The checkpoint folder the flags name, checked for what loading needs; StartupError names what is missing."""
    if ns.model_tag and ns.model and ns.model_tag != ns.model:
        raise StartupError(f"two models given: {ns.model_tag!r} and --model {ns.model!r}")
    model = ns.model or ns.model_tag
    if model is None:
        return None
    if not os.path.isdir(model):
        if _HUB_ID.match(model) and not os.path.exists(model):
            raise StartupError(f"{model!r} looks like a model hub id; models are loaded from a local folder "
                               f"(download it first, e.g. `hf download {model} --local-dir DIR`)")
        raise StartupError(f"model folder {model!r} does not exist")
    need = ["config.json", "tokenizer.json"]
    missing = [name for name in need if not os.path.isfile(os.path.join(model, name))]
    if missing:
        raise StartupError(f"{model} has no {missing[0]}")
    if ns.load_format == "safetensors" and not any(f.endswith(".safetensors") for f in os.listdir(model)):
        raise StartupError(f"{model} has no *.safetensors weights (--load-format random serves random weights)")
    return model


def _speculative_config(text: str) -> int:
    """vLLM's --speculative-config, of which only the MTP method is served: its number of tokens."""
    try:
        config = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a JSON object") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    unknown = sorted(set(config) - {"method", "num_speculative_tokens"})
    if unknown:
        raise argparse.ArgumentTypeError(f"field {unknown[0]!r} is not supported (only method and "
                                         "num_speculative_tokens)")
    if config.get("method", "mtp") != "mtp":
        raise argparse.ArgumentTypeError(f"method {config['method']!r} is not supported (only 'mtp', the "
                                         "checkpoint's own head)")
    k = config.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"num_speculative_tokens must be an integer in [1, "
                                         f"{MAX_SPECULATIVE_TOKENS}], got {k!r}")
    return k


def speculative_tokens(ns: argparse.Namespace) -> int:
    if ns.speculative_tokens is not None and ns.speculative_config is not None \
            and ns.speculative_tokens != ns.speculative_config:
        raise StartupError(f"--speculative-tokens {ns.speculative_tokens} and --speculative-config's "
                           f"num_speculative_tokens {ns.speculative_config} disagree")
    return ns.speculative_config or ns.speculative_tokens or 0


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    flags = {o.name: getattr(ns, o.name) for o in OPTIONS.values() if o.flags}
    return EngineArgs(**flags, model=checkpoint_folder(ns), dtype=None if ns.dtype == "auto" else ns.dtype,
                      cuda_graph=not ns.enforce_eager, speculative_tokens=speculative_tokens(ns), warmup=ns.warmup)


def server_options(ns: argparse.Namespace):
    from .server import ServerOptions

    api_key = ns.api_key or os.environ.get("DELTASERVE_API_KEY") or None
    return ServerOptions(api_key=api_key, header_timeout_s=ns.header_timeout_s, body_timeout_s=ns.body_timeout_s,
                         keep_alive_timeout_s=ns.keep_alive_timeout_s, access_log=ns.access_log,
                         tool_call_parser=ns.tool_call_parser)


async def run_server(ns: argparse.Namespace, speculation_override=None) -> int:
    """Serve until a signal (exit 0) or the engine's failure (exit 1); a start-up failure raises StartupError.
    `speculation_override`: a benchmark's emulated acceptance (`tools/lab/serve_emulated.py`)."""
    from .engine import AsyncEngine
    from .server import serve, shutdown

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second %s: exiting now", sig.name)
            os._exit(128 + sig)
        log.info("%s: draining (live requests get %.1f s), then exiting", sig.name, ns.shutdown_timeout)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    check_aiohttp_or_refuse()
    log_compatibility_flags(ns)
    # The address is bound before anything loads (minutes for a large model, to then find the port taken), and
    # the server listens on this very socket.
    try:
        sock = socket.create_server((ns.host, ns.port))
    except OSError as exc:  # the port is taken, the host does not resolve
        raise StartupError(f"cannot listen on {ns.host}:{ns.port}: {exc.strerror or exc}") from exc
    engine = None
    try:
        try:
            engine = AsyncEngine(engine_args(ns), speculation_override=speculation_override)
            await engine.start()
        except StartupError:
            raise
        except OSError as exc:
            raise StartupError(f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc)) from exc
        except Exception as exc:  # a bad value, or a checkpoint file its library cannot parse
            raise StartupError(str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}") from exc
        runner = await serve(engine, ns.host, ns.port, server_options(ns), sock=sock)
        stopped = asyncio.ensure_future(stop.wait())
        died = asyncio.ensure_future(engine.died.wait())
        await asyncio.wait([stopped, died], return_when=asyncio.FIRST_COMPLETED)
        if died.done() and not ns.keep_running_on_engine_error:
            stopped.cancel()
            log.error("exiting: the engine failed (the cause is logged above)")
            await shutdown(runner, engine, 0.0)
            return EXIT_ENGINE_FAILED
        await stopped
        died.cancel()
        await shutdown(runner, engine, ns.shutdown_timeout)
        return 0
    finally:
        sock.close()  # the runner's cleanup closes it too; a start-up failure leaves it to here
        if engine is not None:
            await engine.close()


async def run_replicas(ns: argparse.Namespace, serve_argv: list[str]) -> int:
    """`--data-parallel-size N`: the replicas and their router until a signal (`runtime.replicas`)."""
    from .replicas import Replicas

    if ns.data_parallel_size < 1:
        raise StartupError(f"--data-parallel-size must be at least 1, got {ns.data_parallel_size}")
    try:
        replicas = Replicas(serve_argv, ns.data_parallel_size, ns.host, ns.port, ns.router, ns.tp, ns.device)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return await replicas.run(stop)


def check_aiohttp_or_refuse() -> None:
    from .connection import check_aiohttp

    try:
        check_aiohttp()
    except RuntimeError as exc:
        raise StartupError(str(exc)) from None


def run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="deltaserve", description="Qwen3.5 serving runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                                description="Serve a Qwen3.5 checkpoint over the OpenAI HTTP API."))
    ns = parser.parse_args(argv)  # a bad flag: argparse prints one line and exits 2
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.log_steps:
        logging.getLogger("deltaserve.steps").setLevel(logging.DEBUG)
    try:
        if ns.data_parallel_size != 1:
            return run(run_replicas(ns, (sys.argv[1:] if argv is None else argv)[1:]))
        return run(run_server(ns))
    except StartupError as exc:
        log.debug("start-up failed", exc_info=exc.__cause__ or exc)
        log.error("cannot start: %s", exc)
        return EXIT_STARTUP_FAILED


if __name__ == "__main__":
    sys.exit(main())
