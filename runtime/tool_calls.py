"""Tool calls in an assistant's text, parsed as it streams: Qwen3.5's format (`qwen3_coder`, vLLM's name)

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

each value converted by the type its tool's JSON schema gives the parameter, and Qwen3's JSON one (`hermes`)

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A parser takes the content part of the text (after the reasoning is split off: a call inside <think> is not a call)
delta by delta and returns events: content outside the calls, a call's start (its id and name), and fragments of
its arguments that concatenate to one JSON object. Any split of the text into deltas gives the same events merged.
A Qwen3.5 call cut short (max_tokens) keeps the parameters that completed; a JSON call cut short, or one that does
not parse, stays content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from .text import partial_suffix

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PARSERS = ("qwen3_coder", "hermes")


@dataclass
class Content:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class CallArguments:
    index: int
    fragment: str


def detect_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches: Qwen3.5's XML-like calls, Qwen3's JSON ones, or None."""
    if not chat_template:
        return None
    if "<function=" in chat_template:
        return "qwen3_coder"
    return "hermes" if CALL_OPEN in chat_template else None


def new_parser(name: str, tools: list[dict], parallel: bool = True) -> "ToolCallParser":
    if name not in PARSERS:
        raise ValueError(f"tool-call parser {name!r} is not one of {', '.join(PARSERS)}")
    return (Qwen3CoderParser if name == "qwen3_coder" else HermesParser)(tools, parallel)


class ToolCallParser:
    def __init__(self, tools: list[dict], parallel: bool = True) -> None:
        """parallel False (OpenAI's `parallel_tool_calls`): the first call only; later ones leave no event."""
        self.parallel = parallel
        self.schemas = {t["function"]["name"]: _properties(t["function"].get("parameters")) for t in tools}
        self.buffer = ""
        self.inside = False
        self.names: list[str] = []  # each call's, by index
        self.events: list = []
        # How far into the buffer a closing tag was already looked for: a long value streamed token by token is
        # scanned once, not once a token.
        self.scanned = 0

    def feed(self, text: str, final: bool = False) -> list:
        """The events `text` completes (some of it may wait for the next delta; with `final`, none does)."""
        self.buffer += text
        while self.buffer:
            if self.inside:
                if not self._inside():
                    break
                continue
            i = self.buffer.find(CALL_OPEN)
            if i < 0:
                keep = partial_suffix(self.buffer, CALL_OPEN)
                self._content(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            self._content(self.buffer[:i])
            self.buffer = self.buffer[i + len(CALL_OPEN) :]
            self.inside = True
            self._opened()
        return self.finish() if final else self._taken()

    def finish(self) -> list:
        """The events the end of the text decides."""
        if self.inside:
            self._truncated()
        else:
            self._content(self.buffer)
        self.buffer = ""
        return self._taken()

    def _taken(self) -> list:
        events, self.events = self.events, []
        return events if self.parallel else [e for e in events if isinstance(e, Content) or e.index == 0]

    def _content(self, text: str) -> None:
        if text:
            self.events.append(Content(text))

    def _start(self, name: str) -> int:
        self.names.append(name)
        self.events.append(CallStart(len(self.names) - 1, f"call_{uuid.uuid4().hex[:24]}", name))
        return len(self.names) - 1

    # Each format: what a call's opening tag starts, how its inside is consumed (False: wait for more text), and
    # what a call cut short leaves.
    def _opened(self) -> None:
        pass

    def _inside(self) -> bool:
        raise NotImplementedError

    def _truncated(self) -> None:
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: a call is known once it closes."""

    def _inside(self) -> bool:
        end = self.buffer.find(CALL_CLOSE, max(0, self.scanned - len(CALL_CLOSE)))
        if end < 0:
            self.scanned = len(self.buffer)
            return False
        body, self.buffer, self.scanned = self.buffer[:end], self.buffer[end + len(CALL_CLOSE) :], 0
        self.inside = False
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise ValueError
        except (ValueError, KeyError, TypeError, RecursionError):
            self._content(CALL_OPEN + body + CALL_CLOSE)
            return True
        index = self._start(name)
        self.events.append(CallArguments(index, json.dumps(arguments, ensure_ascii=False)))
        return True

    def _truncated(self) -> None:
        self._content(CALL_OPEN + self.buffer)


FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"


class Qwen3CoderParser(ToolCallParser):
    """Qwen3.5's calls: each parameter is a fragment of the arguments as soon as its closing tag comes."""

    def _opened(self) -> None:
        self.call, self.params = None, 0

    def _inside(self) -> bool:
        text = self.buffer.lstrip()
        if not text:
            return False
        if text.startswith(CALL_CLOSE):
            self._close_function()
            self.buffer, self.inside = text[len(CALL_CLOSE) :], False
            return True
        if text.startswith(FUNCTION_CLOSE):
            self._close_function()
            self.buffer = text[len(FUNCTION_CLOSE) :]
            return True
        for tag in (FUNCTION_OPEN, PARAMETER_OPEN):
            if text.startswith(tag):
                head = text.find(">")
                if head < 0:
                    return False
                name = text[len(tag) : head]
                if tag == FUNCTION_OPEN:
                    self._close_function()
                    self.call, self.params = self._start(name), 0
                    self.buffer = text[head + 1 :]
                    return True
                end = text.find(PARAMETER_CLOSE, max(head, self.scanned - len(PARAMETER_CLOSE)))
                if end < 0:
                    self.scanned = len(text)  # the buffer stays as it is: `text` keeps its offsets
                    return False
                self._parameter(name, text[head + 1 : end])
                self.buffer, self.scanned = text[end + len(PARAMETER_CLOSE) :], 0
                return True
        if any(tag.startswith(text) for tag in (CALL_CLOSE, FUNCTION_CLOSE, FUNCTION_OPEN, PARAMETER_OPEN)):
            return False  # a tag still arriving
        # Text that is no tag inside a call: skipped up to the next tag.
        nxt = text.find("<", 1)
        if nxt < 0:
            self.buffer = ""
            return False
        self.buffer = text[nxt:]
        return True

    def _parameter(self, name: str, raw: str) -> None:
        if self.call is None:  # a parameter outside any function: nothing to attach it to
            return
        if raw.startswith("\n"):
            raw = raw[1:]
        if raw.endswith("\n"):
            raw = raw[:-1]
        schema = self.schemas.get(self.names[self.call], {}).get(name, {})
        value = _converted(raw, schema.get("type") if isinstance(schema, dict) else None)
        self.events.append(CallArguments(self.call, ("{" if self.params == 0 else ", ") + json.dumps(name)
                                         + ": " + json.dumps(value, ensure_ascii=False)))
        self.params += 1

    def _close_function(self) -> None:
        if self.call is not None:
            self.events.append(CallArguments(self.call, "}" if self.params else "{}"))
            self.call = None

    def _truncated(self) -> None:
        self._close_function()


def _properties(schema) -> dict:
    """A tool's parameters' schemas by name, where its JSON schema lists them as an object."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}


def _converted(raw: str, kind) -> object:
    """A parameter's text as its schema's type says (a list of types: the first that fits); as a string where it
    does not fit or the schema names none."""
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        try:
            if k == "integer":
                return int(raw.strip())
            if k == "number":
                value = float(raw.strip())
                return int(value) if value.is_integer() and "." not in raw and "e" not in raw.lower() else value
            if k == "boolean" and raw.strip().lower() in ("true", "false"):
                return raw.strip().lower() == "true"
            if k == "null" and raw.strip().lower() in ("null", "none"):
                return None
            if k in ("object", "array"):
                value = json.loads(raw)
                if isinstance(value, dict if k == "object" else list):
                    return value
        except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than Python parses
            continue
    return raw


def merged(events: list) -> tuple[str, list[dict]]:
    """(content, calls as OpenAI's message lists them) of a run of events."""
    content, calls = [], {}
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls[e.index] = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
        else:
            calls[e.index]["function"]["arguments"] += e.fragment
    return "".join(content), [calls[i] for i in sorted(calls)]
