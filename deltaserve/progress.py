"""Progress of long start-up work (loading weights, capturing graphs, warm-up requests): a bar on a terminal, log
lines otherwise. A bar redirected into a log file leaves `\\r` frames stuck at its first percent; a log gets a
line when a stage starts, one at most every LOG_EVERY_S seconds while it runs, and one when it ends."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("deltaserve.progress")

LOG_EVERY_S = 10.0


class _LoggedProgress:
    """tqdm's interface as used here (iterate, update, close), written as log lines."""

    def __init__(self, iterable, total, desc: str, unit: str, unit_scale: bool) -> None:
        self.iterable, self.desc, self.unit, self.unit_scale = iterable, desc, unit, unit_scale
        self.total = len(iterable) if total is None and hasattr(iterable, "__len__") else total
        self.n, self.started = 0, time.monotonic()
        self.last_line, self.closed = self.started, False
        log.info("%s: started (%s)", desc, self._amount(self.total) if self.total is not None else "")

    def _amount(self, n) -> str:
        if self.unit_scale and n >= 1e6:
            return f"{n / 1e9:.2f} G{self.unit}" if n >= 1e9 else f"{n / 1e6:.1f} M{self.unit}"
        return f"{n} {self.unit}"

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last_line >= LOG_EVERY_S and self.total:
            self.last_line = now
            log.info("%s: %.0f%% (%s of %s)", self.desc, 100 * self.n / self.total, self._amount(self.n),
                     self._amount(self.total))

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update()
        finally:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            log.info("%s: done, %s in %.1f s", self.desc, self._amount(self.n), time.monotonic() - self.started)


def progress(iterable=None, *, total=None, desc: str, unit: str = "it", unit_scale: bool = False,
             disable: bool = False):
    """A tqdm bar when stderr is a terminal, else `_LoggedProgress`; `disable`: neither (the iterable itself, or
    a silent counter)."""
    if disable or sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=disable,
                    leave=False)
    return _LoggedProgress(iterable, total, desc, unit, unit_scale)
