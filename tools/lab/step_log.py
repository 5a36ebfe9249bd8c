"""A server's step log (`deltaserve serve --log-steps`) summed up by kind of step: how many, and the medians and
90th percentiles of the device time, the time the host saw, the launch's host time and the devices' idle time
before each step. The idle time is what the host path costs the devices: overlap scheduling hides it behind the
step before unless the host takes longer than that step (many streams, a wait for a speculative step's tokens).

    python -m deltaserve.tools.lab.step_log SERVER_LOG
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict

STEP = re.compile(r"(\d+) decode rows \(bucket \d+(, speculative)?\), (\d+) prompt tokens in (\d+) chunks.*?: "
                  r"([\d.]+) ms on the device, ([\d.]+) ms seen by the host, launched in ([\d.]+) ms"
                  r"(?:, devices idle ([\d.]+) ms before it)?")
FIELDS = ("device", "host", "launch", "idle")


def kind(rows: int, speculative: bool, chunks: int) -> str:
    if speculative:
        return "speculative"
    if rows and chunks:
        return "mixed"
    return "decode" if rows else "prefill" if chunks else "empty"


def summarise(lines) -> dict[str, dict[str, list[float]]]:
    """Kind of step -> field -> its values (ms), from the log's step lines."""
    steps: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in lines:
        m = STEP.search(line)
        if m is None:
            continue
        values = steps[kind(int(m[1]), m[2] is not None, int(m[4]))]
        for name, value in zip(FIELDS, m.groups()[4:]):
            if value is not None:
                values[name].append(float(value))
    return steps


def table(steps: dict[str, dict[str, list[float]]]) -> str:
    rows = ["| steps | n | " + " | ".join(f"{f} ms median (p90)" for f in FIELDS) + " |",
            "|---|---:|" + "---:|" * len(FIELDS)]
    for name, values in sorted(steps.items()):
        cells = []
        for field in FIELDS:
            v = sorted(values.get(field, []))
            cells.append(f"{statistics.median(v):.2f} ({v[int(0.9 * (len(v) - 1))]:.2f})" if v else "")
        rows.append(f"| {name} | {len(values['device'])} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    ns = parser.parse_args(argv)
    with open(ns.log, errors="replace") as f:
        print(table(summarise(f)))


if __name__ == "__main__":
    main()
