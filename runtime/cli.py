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
import json
import asyncio
import logging
import os
import re
import signal
import socket
import sys

from deltaserve import __version__

from .args import MAX_SPECULATIVE_TOKENS, EngineArgs

log = logging.getLogger("deltaserve")

EXIT_STARTUP_FAILED = 2
EXIT_ENGINE_FAILED = 1


class StartupError(Exception):
    """A start-up failure the user can fix; its message is the one line they see."""


def _int_in(lo: int, hi: int | None = None, what: str = "an integer"):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is out of range [{lo}, {hi if hi is not None else 'inf'}]")
        return value

    return parse


def _float_in(lo: float, hi: float | None = None, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (value > lo if lo_open else value >= lo) or (hi is not None and value > hi) or value != value:
            bound = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"{value} is out of range {bound}")
        return value

    return parse


def _ratio(text: str) -> float:
    value = _float_in(0.0)(text)
    if 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} must be above 1, or 0 (off)")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(EXIT_STARTUP_FAILED, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown where they say something: not for switches, unset values, or help that names its own."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.nargs == 0 or action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    defaults = EngineArgs()
    parser.formatter_class = _HelpFormatter
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint folder (the same as --model)")
    parser.add_argument("--model", default=None,
                        help="checkpoint folder (config.json, *.safetensors, tokenizer.json); by default a tiny "
                             "demo checkpoint")
    parser.add_argument("--load-format", default=defaults.load_format, choices=["safetensors", "random"],
                        help="'random': random weights of the checkpoint's shapes, made on the device (benchmarks "
                             "at real sizes; the folder needs only config.json and the tokenizer)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where the model runs; auto: cuda when a GPU is visible, else cpu")
    parser.add_argument("--tensor-parallel-size", "-tp", "--tp", dest="tp", type=_int_in(1, 64), metavar="N",
                        default=defaults.tp, help="tensor-parallel ranks (one GPU each)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations; auto: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--max-model-len", type=_int_in(2), default=None,
                        help="context length (prompt + output); default: the checkpoint's limit, at most 32768")
    parser.add_argument("--max-num-seqs", "--max-batch", dest="max_batch", type=_int_in(1, 4096), metavar="N",
                        default=defaults.max_batch, help="requests decoding at once (lowered if memory is short)")
    parser.add_argument("--max-num-batched-tokens", dest="prefill_token_budget", type=_int_in(1), metavar="N",
                        default=defaults.prefill_token_budget,
                        help="prompt tokens prefilled per step at most; default 8192, halved down to 2048 where its "
                             "prefill activations would take more than an eighth of the GPU memory left after the "
                             "weights")
    parser.add_argument("--step-latency-ratio", type=_ratio, metavar="R", default=defaults.step_latency_ratio,
                        help="a step that prefills beside running requests takes at most R times a decode-only "
                             "step, its prompt tokens' share widened by the requests waiting for a first token "
                             "over those decoding: this bounds ITL p99 (0: always up to --max-num-batched-tokens)")
    parser.add_argument("--max-waiting", type=_int_in(1), default=defaults.max_waiting,
                        help="requests queued before new ones get 503 with Retry-After")
    parser.add_argument("--gpu-memory-utilization", dest="memory_fraction", metavar="FRACTION",
                        type=_float_in(0.0, 1.0, lo_open=True),
                        default=defaults.memory_fraction,
                        help="fraction of the GPU's free memory (after weights) for state and KV pages")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=defaults.enable_prefix_caching,
                        help="share cached prompt prefixes at any 16-token page boundary (KV pages and "
                             "recurrent-state snapshots)")
    parser.add_argument("--prefix-cache-state-gib", type=_float_in(0.0), metavar="GIB", default=None,
                        help="memory per GPU for the prefix cache's recurrent-state snapshots (default: a tenth "
                             "of what the weights leave)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=defaults.async_scheduling,
                        help="launch each step before the last one's tokens are back (overlap scheduling)")
    parser.add_argument("--enforce-eager", "--no-cuda-graph", dest="enforce_eager", action="store_true",
                        help="decode eagerly, without CUDA graphs")
    parser.add_argument("--prefill-graph-tokens", type=_int_in(0), metavar="N", default=defaults.prefill_graph_tokens,
                        help="prefill steps of up to N tokens replay CUDA graphs captured at 16, 32, 64, 128, every "
                             "64 tokens to 512, then every 128, instead of launching ~450 kernels from Python (0: none)")
    parser.add_argument("--fused-mixed-steps", action=argparse.BooleanOptionalAction,
                        default=defaults.fused_mixed_steps,
                        help="a step carrying prompt chunks beside decode rows runs both in one forward, reading the "
                             "weights once, replayed from CUDA graphs; such a step does not speculate (default: on "
                             "with CUDA and prefill graphs; off: the decode graph then the prefill)")
    parser.add_argument("--speculative-tokens", type=_int_in(0, MAX_SPECULATIVE_TOKENS), metavar="K", default=None,
                        help="speculative decoding: K tokens drafted a step by the checkpoint's MTP head and verified "
                             "in one forward (default 0: off)")
    parser.add_argument("--speculative-config", type=_speculative_config, metavar="JSON", default=None,
                        help='vLLM\'s form of --speculative-tokens: \'{"method": "mtp", "num_speculative_tokens": K}\'')
    parser.add_argument("--speculative-max-batch", type=_int_in(0), metavar="N", default=None,
                        help="with speculation: a decode step whose batch (padded to its graph bucket) is above "
                             "N decodes one token a request (default: no limit)")
    parser.add_argument("--fp8-kernels", action=argparse.BooleanOptionalAction, default=defaults.fp8_kernels,
                        help="FP8 checkpoints: keep the block-scaled FP8 weights in FP8 and run the FP8 projections "
                             "(half the bytes a decode step reads; the default); --no-fp8-kernels dequantises them "
                             "to --dtype as they are read")
    parser.add_argument("--speculative-draft-vocab", type=_int_in(0), metavar="N", default=0,
                        help="with speculation: the head drafts among the first N token ids only, reading N rows of "
                             "lm_head a draft instead of all (outputs do not change; 0: the whole vocabulary)")
    parser.add_argument("--speculative-fp8-draft-head", action=argparse.BooleanOptionalAction,
                        default=defaults.speculative_fp8_draft_head,
                        help="with speculation: the drafts read an FP8 copy of lm_head, half the bytes a draft reads "
                             "(the default; outputs do not change, verification reads the model's lm_head)")
    parser.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction,
                        default=defaults.speculative_adaptive,
                        help="with speculation: each batch size speculates only while its steps are measured to "
                             "give tokens faster than one-token steps (--no-speculative-adaptive: always)")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", default=None,
                        help="skip the start-up warm-up requests that compile every kernel (cuda) before serving")
    parser.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=defaults.seed,
                        help="seed of the step randomness for requests without their own seed")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=_int_in(1, 65535, "a port number"), default=8000, help="TCP port")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send and see (default: the checkpoint folder's name)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $DELTASERVE_API_KEY)")
    parser.add_argument("--shutdown-timeout", type=_float_in(0.0), default=5.0,
                        help="seconds a SIGTERM/SIGINT gives live requests before they are aborted")
    parser.add_argument("--header-timeout", type=_float_in(0.0, lo_open=True), default=10.0,
                        help="seconds a client has to send a request's headers")
    parser.add_argument("--body-timeout", type=_float_in(0.0, lo_open=True), default=30.0,
                        help="seconds a client has to send a request's body")
    parser.add_argument("--keep-alive-timeout", type=_float_in(0.0), default=5.0,
                        help="seconds an idle keep-alive connection stays open")
    parser.add_argument("--disable-access-log", "--disable-uvicorn-access-log", dest="access_log",
                        action="store_false", help="no log line per request")
    parser.add_argument("--stats-interval", type=_float_in(0.0), default=defaults.stats_interval_s,
                        help="seconds between throughput/usage log lines while busy (0: none)")
    parser.add_argument("--keep-running-on-engine-error", action="store_true",
                        help="stay up answering 503 after the engine fails, instead of exiting 1 (debugging)")
    parser.add_argument("--log-level", default="info", type=str.lower,
                        choices=["debug", "info", "warning", "error"], help="log verbosity")
    parser.add_argument("--log-steps", action="store_true",
                        help="log every engine step: decode rows, prompt tokens, time, device idle (logger "
                             "deltaserve.steps, at debug)")
    parser.add_argument("--version", action="version", version=f"deltaserve {__version__}")
    return parser


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
    return EngineArgs(
        model=checkpoint_folder(ns), device=ns.device, tp=ns.tp, dtype=None if ns.dtype == "auto" else ns.dtype,
        max_batch=ns.max_batch, max_model_len=ns.max_model_len, cuda_graph=not ns.enforce_eager,
        prefill_graph_tokens=ns.prefill_graph_tokens,
        served_model_name=ns.served_model_name, seed=ns.seed, prefill_token_budget=ns.prefill_token_budget,
        step_latency_ratio=ns.step_latency_ratio,
        max_waiting=ns.max_waiting, memory_fraction=ns.memory_fraction, load_format=ns.load_format,
        stats_interval_s=ns.stats_interval, warmup=ns.warmup, async_scheduling=ns.async_scheduling,
        enable_prefix_caching=ns.enable_prefix_caching, prefix_cache_state_gib=ns.prefix_cache_state_gib,
        speculative_tokens=speculative_tokens(ns),
        speculative_max_batch=ns.speculative_max_batch, speculative_adaptive=ns.speculative_adaptive,
        speculative_draft_vocab=ns.speculative_draft_vocab, speculative_fp8_draft_head=ns.speculative_fp8_draft_head,
        fp8_kernels=ns.fp8_kernels, fused_mixed_steps=ns.fused_mixed_steps,
    )


def server_options(ns: argparse.Namespace):
    from .server import ServerOptions

    api_key = ns.api_key or os.environ.get("DELTASERVE_API_KEY") or None
    return ServerOptions(api_key=api_key, header_timeout_s=ns.header_timeout, body_timeout_s=ns.body_timeout,
                         keep_alive_timeout_s=ns.keep_alive_timeout, access_log=ns.access_log)


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
        return run(run_server(ns))
    except StartupError as exc:
        log.debug("start-up failed", exc_info=exc.__cause__ or exc)
        log.error("cannot start: %s", exc)
        return EXIT_STARTUP_FAILED


if __name__ == "__main__":
    sys.exit(main())
