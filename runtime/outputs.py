"""A request's outputs: the host's one record of a request (`Request`, which the scheduler keeps too), what its
stream yields (`RequestOutput`), and the rules that turn drawn tokens into outputs: stop ids, stop strings,
min_tokens, max_tokens, incremental detokenising, log-probs and finish reasons. The step loop routes each drawn
token here and acts on the answer (frees the request's slot, counts it); nothing here knows about steps or
devices."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from deltaserve.devices.commands import RowSampling

from .params import SamplingParams
from .scheduler import SchedRequest
from .text import IncrementalDetokenizer, StopMatcher


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None


class RequestOutput:
    """One update of a request. `token_ids` (all generated so far), `logprobs` and `text` are snapshots taken
    lazily: the engine hands out lengths, not copies, so a step costs the same at token 10 and token 10,000."""

    __slots__ = ("request_id", "prompt_token_ids", "delta_token_ids", "delta_text", "finished", "finish_reason",
                 "error", "num_cached_tokens", "prompt_logprobs", "_ids", "_logprobs", "_n", "_text_parts",
                 "_text_n")

    def __init__(self, request_id: str, prompt_token_ids: list[int], ids: list[int], text_parts: list[str],
                 delta_token_ids: list[int], delta_text: str, finished: bool = False, finish_reason: str | None = None,
                 logprobs: list[TokenLogprob] | None = None, error: str | None = None,
                 num_cached_tokens: int = 0, prompt_logprobs: list[TokenLogprob | None] | None = None) -> None:
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.num_cached_tokens = num_cached_tokens  # prompt tokens a cached prefix spared the prefill
        # Asked for (`SamplingParams.prompt_logprobs`): each prompt token's, None for the first (complete from the
        # first output on: the prompt is scored before the first token is drawn)
        self.prompt_logprobs = prompt_logprobs
        self.delta_token_ids, self.delta_text = delta_token_ids, delta_text
        self.finished, self.finish_reason, self.error = finished, finish_reason, error  # "stop"|"length"|"abort"|"error"
        self._ids, self._logprobs, self._n = ids, logprobs, len(ids)
        self._text_parts, self._text_n = text_parts, len(text_parts)

    @property
    def text(self) -> str:
        """All the text generated so far (the parts only ever grow, like the ids)."""
        return "".join(self._text_parts[: self._text_n])

    @property
    def token_ids(self) -> list[int]:
        return self._ids[: self._n]

    @property
    def num_tokens(self) -> int:
        """len(token_ids), without its copy (a stream's per-token usage would otherwise cost O(n) a token)."""
        return self._n

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return None if self._logprobs is None else self._logprobs[: self._n]

    @property
    def delta_logprobs(self) -> list[TokenLogprob] | None:
        """The log-probs of `delta_token_ids` alone (a stream's per-token cost stays O(1))."""
        if self._logprobs is None:
            return None
        return self._logprobs[self._n - len(self.delta_token_ids) : self._n]

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids}, text={self.text!r}, "
                f"finished={self.finished}, finish_reason={self.finish_reason!r})")


class OutputQueue:
    """A request's pending outputs: a deque and at most one waiting consumer (lighter than asyncio.Queue on the
    per-token path)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[RequestOutput] = deque()
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, out: RequestOutput) -> None:
        self.items.append(out)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


@dataclass(kw_only=True, eq=False)
class Request(SchedRequest):
    """The host's one record of a request. The scheduler's part (`SchedRequest`: its phase, slots, pages, the
    tokens counted, the prompt tokens a cached prefix spared, `cached`) and the outputs' part: its parameters, the
    tokens drawn (`drawn`: every one, a stop token too, which the prefix cache keys), its output so far (ids,
    text pieces, log-probs), and the queue its stream reads."""

    params: SamplingParams
    sampling: RowSampling
    stop_ids: frozenset[int]
    detok: IncrementalDetokenizer
    stops: StopMatcher
    queue: OutputQueue = field(default_factory=OutputQueue)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled as its chunks are scored
    text_parts: list[str] = field(default_factory=list)  # the output's text, a piece a token (joined when read)
    finished: bool = False  # its stream has had its last output (its slot and pages go at the next plan)
    arrival: float = field(default_factory=time.perf_counter)
    prefill_start: float | None = None  # when its prompt's first chunk was handed to the devices
    last_token_time: float | None = None

    @classmethod
    def new(cls, request_id: str, prompt_ids: list[int], params: SamplingParams, sampling: RowSampling,
            stop_ids: frozenset[int], detok: IncrementalDetokenizer, stops: StopMatcher) -> "Request":
        return cls(request_id, len(prompt_ids), params.max_tokens, prompt_ids=prompt_ids, drawn=[], params=params,
                   sampling=sampling, stop_ids=stop_ids, detok=detok, stops=stops,
                   logprobs=[] if params.logprobs is not None else None,
                   prompt_logprobs=[None] if params.prompt_logprobs is not None else None)

    def take(self, sampled) -> str | None:
        """Append a drawn token (and its log-prob); "stop" where it is a stop id past min_tokens: it ends the
        request, and neither it nor its text is part of the output."""
        token = sampled.token
        self.drawn.append(token)
        self.output_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(TokenLogprob(token, sampled.logprob, sampled.top))
        if token in self.stop_ids and len(self.output_ids) > self.params.min_tokens:
            self.output_ids.pop()
            if self.logprobs is not None:
                self.logprobs.pop()
            return "stop"
        return None

    @property
    def text_decides(self) -> bool:
        """Whether the last token's text must be made at once: a stop string may end the request on it, or it is
        the last (max_tokens) and the final output carries it."""
        return self.stops.active or len(self.output_ids) >= self.params.max_tokens

    def detokenize(self, token: int) -> tuple[str, str | None]:
        """The token's text to emit now, and the finish reason it brings ("stop": a stop string past min_tokens;
        "length": max_tokens), if any."""
        delta, hit = self.stops.feed(self.detok.add(token), len(self.output_ids) > self.params.min_tokens)
        if delta:
            self.text_parts.append(delta)
        if hit:
            return delta, "stop"
        return delta, "length" if len(self.output_ids) >= self.params.max_tokens else None

    def flush_text(self) -> str:
        """At the end: the text held back for a stop string that never came."""
        tail = self.stops.flush()
        if tail:
            self.text_parts.append(tail)
        return tail

    def output(self, delta_ids, delta_text: str, reason: str | None = None, error: str | None = None) -> RequestOutput:
        # The lists only ever grow (a stop token is popped before its output is made), so a length snapshots them.
        return RequestOutput(self.request_id, self.prompt_ids, self.output_ids, self.text_parts, list(delta_ids),
                             delta_text, finished=reason is not None, finish_reason=reason, logprobs=self.logprobs,
                             error=error, num_cached_tokens=self.cached, prompt_logprobs=self.prompt_logprobs)
