"""The `deltaserve` command: `deltaserve serve ...` (the OpenAI server, runtime/cli.py), `deltaserve bench serve
...` (the serving benchmark, tools/bench_serve.py) and `deltaserve capture-check ...` (every decode graph captured
and checked, tools/capture_check.py)."""

from __future__ import annotations

import sys

USAGE = """usage: deltaserve {serve,bench,capture-check} ...

  serve          serve the OpenAI-compatible HTTP API (deltaserve serve --help)
  bench serve    benchmark any OpenAI-compatible server (deltaserve bench serve --help)
  capture-check  capture every decode bucket's graph and check it against eager decode
  --version      print the version
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["capture-check"]:
        from deltaserve.tools.capture_check import main as capture_check

        return capture_check(argv[1:])
    if argv[:2] == ["bench", "serve"]:
        from deltaserve.tools.bench_serve import main as bench_serve

        return bench_serve(argv[2:])
    if argv[:1] == ["--version"]:
        from deltaserve import __version__

        print(f"deltaserve {__version__}")
        return 0
    if argv[:1] == ["serve"]:
        from deltaserve.runtime.cli import main as serve

        return serve(argv)
    asked = argv[:1] in (["-h"], ["--help"])
    print(USAGE, file=sys.stdout if asked else sys.stderr, end="")
    return 0 if asked else 2
