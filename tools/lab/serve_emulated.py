"""`deltaserve serve` with a trained MTP head's draft acceptance emulated on random weights: the serving cost of
speculation at a given per-position acceptance (its outputs are not the model's, so the served product has no such
flag). Every other argument is `deltaserve serve`'s.

    python -m deltaserve.tools.lab.serve_emulated --acceptance 0.92,0.84,0.65,0.54 CKPT --speculative-tokens 4 ...
"""

from __future__ import annotations

import argparse
import logging
import sys

from deltaserve.runtime import cli
from deltaserve.runtime.speculation import SpeculationOverride


def main(argv: list[str] | None = None) -> int:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--acceptance", required=True, metavar="P1,...,PK",
                      help="draft j is kept in a share Pj of the steps (per-position rates, as /metrics reports them)")
    known, rest = ours.parse_known_args(argv)
    ns = cli.serve_parser(cli._Parser(prog="serve_emulated")).parse_args(rest)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    override = SpeculationOverride(acceptance=tuple(float(p) for p in known.acceptance.split(",")))
    try:
        return cli.run(cli.run_server(ns, speculation_override=override))
    except cli.StartupError as exc:
        logging.getLogger("serve_emulated").error("cannot start: %s", exc)
        return cli.EXIT_STARTUP_FAILED


if __name__ == "__main__":
    sys.exit(main())
