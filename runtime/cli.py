"""`deltaserve serve ...` (also `python -m deltaserve.runtime.serve ...`): start an engine and the OpenAI HTTP
server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from .args import EngineArgs


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: a tiny demo checkpoint)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly (no CUDA graphs)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="INFO")
    return parser


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(model=ns.model, device=ns.device, tp=ns.tp, dtype=ns.dtype, max_batch=ns.max_batch,
                      max_model_len=ns.max_model_len, cuda_graph=not ns.no_cuda_graph,
                      served_model_name=ns.served_model_name, seed=ns.seed)


async def run_server(ns: argparse.Namespace) -> None:
    from .engine import AsyncEngine
    from .server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    async with AsyncEngine(engine_args(ns)) as engine:
        runner = await serve(engine, ns.host, ns.port, ns.api_key)
        try:
            await stop.wait()
        finally:
            logging.getLogger(__name__).info("shutting down")
            await runner.cleanup()


def run(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltaserve", description="Qwen3.5 serving runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser(sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API"))
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run(run_server(ns))
    except ValueError as exc:  # bad arguments or an unsupported configuration: say which, exit non-zero
        logging.getLogger("deltaserve").error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
