"""Request sampling parameters: validation (a ValueError naming the field) and the checkpoint's defaults."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace

from deltaserve.model.config import GenerationDefaults

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # biased ids a request: each is uploaded and added before every draw
MAX_STOP_TOKEN_IDS = 4096  # each request's stop ids travel to rank 0 and bar their draw before min_tokens
MAX_STOP_CHARS = 1024  # the stream holds back this much text while a stop string may still complete
INT32_MAX = 2**31 - 1  # counts and token ids travel to the ranks as int32/int64 tensors: bounded before they go


MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar's text: compiled once per distinct text, off the loop
MAX_CHOICE_STRINGS = 1024  # `choice` alternatives


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match (vLLM's `structured_outputs`; OpenAI's `response_format` and forced tool calls
    are written as one of these): exactly one of a JSON schema (`json`: an object or its text), any JSON object
    (`json_object`), a regular expression, one of the `choice` strings, a `grammar` (Lark, or GBNF / EBNF), or
    vLLM's `structural_tag` ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}, an object or its
    text). Held as text, so equal constraints compile once.
    Where the prompt opens a reasoning block, the constraint starts after it closes (`runtime.grammar`)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __init__(self, json: str | dict | None = None, json_object: bool = False, regex: str | None = None,
                 choice: list[str] | tuple[str, ...] | None = None, grammar: str | None = None,
                 structural_tag: str | dict | None = None) -> None:
        set_ = object.__setattr__
        set_(self, "json", _json_text("json", json))
        set_(self, "json_object", json_object)
        set_(self, "regex", regex)
        set_(self, "choice", tuple(choice) if isinstance(choice, (list, tuple)) else choice)
        set_(self, "grammar", grammar)
        set_(self, "structural_tag", _json_text("structural_tag", structural_tag))
        self.validate()

    def validate(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, name)
                 is not None] + (["json_object"] if self.json_object is True else [])
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean")
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, choice, grammar and "
                             f"structural_tag, got {', '.join(given) or 'none'}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, tuple) or not self.choice or len(self.choice) > MAX_CHOICE_STRINGS
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICE_STRINGS} strings")
        size = sum(len(t) for t in (self.json, self.regex, self.grammar, self.structural_tag) if t) \
            + sum(map(len, self.choice or ()))
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs: the constraint is {size} characters; at most "
                             f"{MAX_GRAMMAR_CHARS} are taken")


def _json_text(name: str, value) -> str | None:
    """A JSON value given as an object or as its text, as canonical text (so equal schemas share one compile)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"structured_outputs.{name} is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"structured_outputs.{name} must be a JSON object")
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"structured_outputs.{name} is not JSON: {exc}") from None


def all_ints(values: list) -> bool:
    """Whether every item is a plain int (not a bool): one pass in C, as a prompt's ids may number 100k."""
    return set(map(type, values)) <= {int}


@dataclass
class SamplingParams:
    """Unset (None) fields take the checkpoint's generation_config defaults, then the OpenAI defaults."""

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1 (vLLM's spelling): off
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0: only the chosen token's)
    # vLLM's: each prompt token's log-prob given the ones before it, with this many top log-probs (0: its own);
    # the whole prompt is then computed (no cached prefix is reused)
    prompt_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # OpenAI's: token id -> a number in [-100, 100] added to its logit before every draw (the log-probs reported are
    # of the biased distribution)
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputs | None = None  # the output constrained to a grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def number(name, lo=None, hi=None, integer=False, lo_open=False):
            value = getattr(self, name)
            if value is None:
                return
            kinds = (int,) if integer else (int, float)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
            if not integer and not math.isfinite(value):  # NaN passes every comparison below
                raise ValueError(f"{name} must be a finite number, got {value}")
            if lo is not None and (value <= lo if lo_open else value < lo):
                raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
            if hi is not None and value > hi:
                raise ValueError(f"{name} must be <= {hi}, got {value}")

        number("max_tokens", 1, INT32_MAX, integer=True)
        number("min_tokens", 0, INT32_MAX, integer=True)
        number("temperature", 0.0, 100.0)
        number("top_p", 0.0, 1.0, lo_open=True)
        number("top_k", -1, INT32_MAX, integer=True)
        number("min_p", 0.0, 1.0)
        number("seed", 0, 2**63 - 1, integer=True)
        number("logprobs", 0, MAX_LOGPROBS, integer=True)
        number("prompt_logprobs", 0, MAX_LOGPROBS, integer=True)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, 10.0, lo_open=True)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 16:
            raise ValueError("stop takes at most 16 strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        ids = self.stop_token_ids
        if not isinstance(ids, list):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if len(ids) > MAX_STOP_TOKEN_IDS:  # before any pass over it
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        if not all_ints(ids) or (ids and not 0 <= min(ids) <= max(ids) <= INT32_MAX):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids")
            for token, value in bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT32_MAX:
                    raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError("structured_outputs must be a StructuredOutputs")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean")

    def check_model(self, vocab_size: int) -> None:
        """What only the model can tell: every token id inside its vocabulary (they index the logits on the rank)."""
        if self.stop_token_ids and max(self.stop_token_ids) >= vocab_size:
            bad = next(t for t in self.stop_token_ids if t >= vocab_size)
            raise ValueError(f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            bad = next(t for t in self.logit_bias if t >= vocab_size)
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab_size})")
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise ValueError(f"logprobs must be <= the vocabulary size {vocab_size}, got {self.logprobs}")

    def with_defaults(self, defaults: GenerationDefaults, max_tokens_left: int) -> "SamplingParams":
        """Fill unset fields from the checkpoint; max_tokens defaults to what the context leaves."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        fallback = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                    "repetition_penalty": 1.0}
        for name, last_resort in fallback.items():
            if values[name] is None:
                value = getattr(defaults, name)
                values[name] = last_resort if value is None else value
        if values["top_k"] == -1:
            values["top_k"] = 0
        if values["max_tokens"] is None:
            values["max_tokens"] = max_tokens_left
        return replace(self, **values)
