"""When a decode step speculates: a step drafting k tokens a row pays when its time over the tokens it yields a row
is below a one-token step's time. Both depend on the batch (a verify step's k + 1 rows a request cost more as the
batch grows) and the yield on the text and the head, so the engine measures them as it serves, per decode bucket:

- each bucket first runs `TRIES` steps of each kind, then the faster per token, and the other again every `RETRY`
  steps, so a change (the text, the batch's make-up) is seen; once chosen, a kind gives way only to one measured
  `MARGIN` faster (near a tie, the medians' noise would switch it back and forth);
- a kind's time is the median of its last `WINDOW` decode-only steps on the devices' timeline: the step's device
  time plus the devices' wait for the host before it (overlap scheduling hides the host's routing, outputs and
  planning behind the step before, unless they take longer than it: many streams, or a wait for a speculative
  step's tokens, `StepLoop._needs_tokens_first`). The median keeps a compile or a pause from swaying it; the
  yield is the mean tokens a row over the last speculative steps of any bucket.

The ranks keep the MTP head's KV up to date in one-token steps too, so drafts after a stretch of them are as good
as after speculative steps.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

TRIES = 4
RETRY = 64
WINDOW = 8
MARGIN = 0.03


@dataclass(frozen=True)
class SpeculationOverride:
    """What tests and benchmarks put in place of the speculative step's own drafting or keeping, handed to
    `AsyncEngine(args, speculation_override=...)` (no flag or EngineArgs field reaches it: outputs under it are not
    the model's).

    propose: (prompt ids, output ids so far, k) -> k draft ids, made on the host in place of the head's (which still
    runs): tests script exactly which drafts are right. acceptance: k per-position rates (as /metrics reports them,
    so never rising with the position); draft j is kept in that share of the steps instead of when it equals the
    token drawn, emulating a trained head on random weights (benchmarks of the step's cost)."""

    propose: Callable[[list[int], list[int], int], list[int]] | None = None
    acceptance: tuple[float, ...] | None = None

    def check(self, k: int) -> None:
        """ValueError unless the acceptance fits k drafts a step."""
        values = self.acceptance
        if values is None:
            return
        if len(values) != k or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
                                       for v in values) or any(b > a for a, b in zip(values, values[1:])):
            raise ValueError(f"acceptance must hold speculative_tokens ({k}) per-position rates in [0, 1], none "
                             f"above the one before (a draft is kept only after the ones before it), got {values!r}")


@dataclass
class _Bucket:
    steps: int = 0
    times: dict[bool, deque] = field(default_factory=lambda: {True: deque(maxlen=WINDOW), False: deque(maxlen=WINDOW)})
    choice: bool | None = None  # the last choice made on the measurements (None: still trying both)


class SpeculationPolicy:
    def __init__(self, k: int, max_batch: int | None = None, adaptive: bool = True) -> None:
        """k drafts a step; buckets above `max_batch` never speculate; not `adaptive`: the others always do."""
        self.k, self.max_batch, self.adaptive = k, max_batch, adaptive
        self.buckets: dict[int, _Bucket] = {}
        self.yields: deque[float] = deque(maxlen=4 * WINDOW)  # tokens a row of recent speculative steps

    def reset(self) -> None:
        """Forget what was measured (the warm-up's steps compile kernels: not what serving costs)."""
        self.buckets.clear()
        self.yields.clear()

    def decide(self, bucket: int) -> bool:
        """Whether the next decode step of `bucket` rows speculates."""
        if self.k == 0 or (self.max_batch is not None and bucket > self.max_batch):
            return False
        if not self.adaptive:
            return True
        b = self.buckets.setdefault(bucket, _Bucket())
        b.steps += 1
        for kind in (True, False):
            if len(b.times[kind]) < TRIES:
                return kind
        faster = self.speculation_pays(bucket, b.choice)
        if faster != b.choice:
            log.info("decode bucket %d: %s (speculative %.2f ms a token at %.2f tokens a row, one-token %.2f ms)",
                     bucket, "speculating" if faster else "one token a step", self._per_token(b), self.yield_,
                     1e3 * statistics.median(b.times[False]))
            b.choice = faster
        return faster != (b.steps % RETRY == 0)

    def observe(self, bucket: int, speculated: bool, seconds: float, tokens_per_row: float) -> None:
        """A decode-only step of `bucket` rows took `seconds` and gave `tokens_per_row` tokens a row."""
        self.buckets.setdefault(bucket, _Bucket()).times[speculated].append(seconds)
        if speculated:
            self.yields.append(tokens_per_row)

    @property
    def yield_(self) -> float:
        return statistics.fmean(self.yields) if self.yields else 1.0

    def _per_token(self, b: _Bucket) -> float:
        return 1e3 * statistics.median(b.times[True]) / self.yield_

    def speculation_pays(self, bucket: int, speculating: bool | None = None) -> bool:
        """Whether speculating costs less a token; `speculating`: the kind chosen now (None: none), kept unless
        the other is `MARGIN` faster."""
        b = self.buckets[bucket]
        ratio = statistics.median(b.times[True]) / self.yield_ / statistics.median(b.times[False])
        return ratio < (1.0 if speculating is None else 1.0 + MARGIN if speculating else 1.0 - MARGIN)
