"""The `deltaserve` command: `deltaserve serve ...` (the OpenAI server, runtime/cli.py) and
`deltaserve capture-check ...` (every decode graph captured and checked, tools/capture_check.py)."""

from __future__ import annotations

import sys

USAGE = """usage: deltaserve {serve,capture-check} ...

  serve          serve the OpenAI-compatible HTTP API (deltaserve serve --help)
  capture-check  capture every decode bucket's graph and check it against eager decode
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["capture-check"]:
        from deltaserve.tools.capture_check import main as capture_check

        return capture_check(argv[1:])
    if argv[:1] == ["serve"]:
        from deltaserve.runtime.cli import main as serve

        return serve(argv)
    asked = argv[:1] in (["-h"], ["--help"])
    print(USAGE, file=sys.stdout if asked else sys.stderr, end="")
    return 0 if asked else 2
