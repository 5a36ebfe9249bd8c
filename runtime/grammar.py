"""Structured outputs on the host: a request's constraint (`params.StructuredOutputs`, or the calls a forced tool
choice must make) compiled by llguidance against the tokenizer, off the event loop and once per distinct
constraint; each request then takes a copy of that constraint's fresh matcher, which rank 0 advances
(`devices.grammar`). Why llguidance: `docs/decisions/0005-structured-outputs.md`.

Where the prompt opens a reasoning block (thinking on), the constraint is wrapped: any text up to the first
`</think>`, the blank line Qwen writes after it, then the constraint; so the reasoning stays free and the answer
is what the client parses. A JSON schema's objects take no properties beyond the listed ones unless the schema
says they may (OpenAI's strict mode, and what keeps a weak model from inventing keys), and JSON's whitespace is
the compact separators' own (a free run of whitespace is where constrained models loop).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from .params import StructuredOutputs
from .text import THINK_CLOSE, TextTokenizer

log = logging.getLogger(__name__)

TOOL_CALL_END = "}\n</tool_call>"
# Distinct compiled constraints kept (a matcher each); the least recently used goes first.
CACHED_GRAMMARS = 256


class GrammarError(ValueError):
    """A constraint llguidance cannot compile (an unsupported schema keyword, a bad regex): the client's 400."""


def _llguidance():
    import llguidance  # imported on first use, on the grammar thread (`_vocabulary`, while the engine starts)

    return llguidance


def tool_call_grammar(tools: list[dict], choice, parallel: bool) -> StructuredOutputs:
    """The constraint that makes the model call a tool: `choice` "required" (any of `tools`; several calls where
    `parallel`) or a named function ({"type": "function", "function": {"name": ...}}). The calls are written in
    Qwen3's layout (the `hermes` parser's: `<tool_call>` {"name": ..., "arguments": JSON} `</tool_call>`), whatever
    the model's own: JSON arguments end at their closing quote or brace, where Qwen3.5's XML layout leaves a string
    argument open until the model writes its closing tag, which a weak model may never do."""
    if isinstance(choice, dict):
        tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    rules = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        schema = _compact(strict_schema(fn.get("parameters") or {"type": "object", "properties": {}}))
        head = json.dumps('<tool_call>\n{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": ',
                          ensure_ascii=False)
        rules.append(f"call_{i}: {head} %json {json.dumps(schema)} {json.dumps(TOOL_CALL_END)}")
    call = "(" + " | ".join(f"call_{i}" for i in range(len(tools))) + ")"
    if parallel and not isinstance(choice, dict):
        call += f' ("\\n" {call})*'
    return StructuredOutputs(grammar=f"start: {call}\n" + "\n".join(rules))


def strict_schema(schema):
    """The schema with `additionalProperties: false` on every object that does not say (its outputs validate
    against the schema as given), and without `uniqueItems: false` (a no-op llguidance refuses as unknown)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) if k not in ("enum", "const", "default", "examples") else v
           for k, v in schema.items() if not (k == "uniqueItems" and v is False)}
    if ("properties" in out or out.get("type") == "object") and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _compact(schema):
    """The schema with llguidance's option for JSON's whitespace: the separators' own (", " and ": ")."""
    if not isinstance(schema, dict):  # true / false: any value / none
        return schema
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}


def _grammar(spec: StructuredOutputs) -> dict:
    """The constraint as one of llguidance's grammars."""
    llg = _llguidance()
    if spec.json is not None:
        return {"json_schema": _compact(strict_schema(json.loads(spec.json)))}
    if spec.json_object:
        return {"json_schema": _compact({"type": "object"})}
    if spec.regex is not None:
        return {"lark_grammar": f"start: /{llg.regex_to_lark(spec.regex, 'dw')}/"}
    if spec.choice is not None:
        return {"lark_grammar": "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)}
    if spec.grammar is not None:
        try:  # Lark as it is; GBNF (llama.cpp's, xgrammar's EBNF) converted
            return {"lark_grammar": llg.gbnf_to_lark.any_to_lark(spec.grammar)}
        except Exception as exc:  # noqa: BLE001 (the converter raises whatever its parser does)
            raise GrammarError(f"structured_outputs.grammar does not parse: {_first_line(exc)}") from None
    return {"lark_grammar": _structural_tag_lark(json.loads(spec.structural_tag))}


def _structural_tag_lark(tag) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}): free text, and each
    structure, once its trigger is written, as its begin, JSON following its schema, and its end."""
    llg = _llguidance()
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) or not tag["structures"] \
            or not isinstance(tag.get("triggers"), list) or not tag["triggers"]:
        raise GrammarError("structured_outputs.structural_tag must have 'structures' and 'triggers' lists")
    tags = []
    for s in tag["structures"]:
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise GrammarError("each structural_tag structure needs 'begin' and 'end' strings")
        trigger = next((t for t in tag["triggers"] if isinstance(t, str) and t and s["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"no trigger of structural_tag begins {s['begin']!r}")
        tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=strict_schema(s.get("schema") or {}),
                                  end=s["end"]))
    return llg.StructTag.to_grammar(tags, assume_special=False)


def top_level(spec: StructuredOutputs, after_reasoning: bool) -> str:
    """The llguidance grammar (its JSON) for the constraint, behind the reasoning where `after_reasoning`."""
    inner = _grammar(spec)
    if not after_reasoning:
        return json.dumps({"grammars": [inner]})
    wrapper = f'start: thinking "\\n\\n" @answer\nthinking[lazy]: /(.|\\n)*/ {json.dumps(THINK_CLOSE)}'
    return json.dumps({"grammars": [{"lark_grammar": wrapper}, {**inner, "name": "answer"}]})


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary (the model's: ids past the tokenizer's never match),
    on a thread of its own, and keeps each compiled one as a fresh matcher; `matcher` hands a request a copy. A
    constraint asked for again while it compiles waits for the same compile."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_token_ids) -> None:
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[tuple, object] = OrderedDict()
        self._compiling: dict[tuple, asyncio.Future] = {}
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        # The vocabulary's bytes, read by llguidance once: 0.75 s at a 151k vocabulary, 0.44 s of it holding the
        # GIL, so the engine waits for it (`ready`) while it starts, not while it serves.
        self._tokenizer = self._thread.submit(_vocabulary, tokenizer, vocab_size, list(stop_token_ids))

    async def ready(self) -> None:
        """Once the vocabulary is read; without llguidance the engine serves all else (`compile` refuses)."""
        try:
            await asyncio.wrap_future(self._tokenizer)
        except ImportError as exc:
            log.warning("structured outputs are off: %s (pip install llguidance)", exc)

    def compiled(self, spec: StructuredOutputs, after_reasoning: bool) -> bool:
        return (spec, after_reasoning) in self._compiled

    def matcher(self, spec: StructuredOutputs, after_reasoning: bool):
        """A matcher of its own for a request, if the constraint is compiled, else None."""
        key = (spec, after_reasoning)
        found = self._compiled.get(key)
        if found is None:
            return None
        self._compiled.move_to_end(key)
        return found.deep_copy()

    async def compile(self, spec: StructuredOutputs, after_reasoning: bool) -> None:
        """Compile the constraint (GrammarError if it cannot); `matcher` then finds it."""
        key = (spec, after_reasoning)
        if key in self._compiled:
            return
        pending = self._compiling.get(key)
        if pending is None:
            pending = asyncio.get_running_loop().run_in_executor(self._thread, self._compile, spec, after_reasoning)
            self._compiling[key] = pending
            pending.add_done_callback(lambda f: self._done(key, f))
        await asyncio.shield(pending)

    def _done(self, key: tuple, future: asyncio.Future) -> None:
        self._compiling.pop(key, None)
        if not future.cancelled() and future.exception() is None:
            self._compiled[key] = future.result()
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)

    def _compile(self, spec: StructuredOutputs, after_reasoning: bool):
        try:
            llg = _llguidance()
            tokenizer = self._tokenizer.result()
        except ImportError:
            raise GrammarError("structured outputs need llguidance, which this server lacks (pip install "
                               "llguidance)") from None
        began = time.perf_counter()
        try:
            grammar = top_level(spec, after_reasoning)
            error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        except (ValueError, TypeError, RecursionError) as exc:
            raise GrammarError(f"structured_outputs: {_first_line(exc)}") from None
        if error:
            raise GrammarError(f"structured_outputs: {_first_line(error)}")
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured_outputs: {_first_line(matcher.get_error())}")
        seconds = time.perf_counter() - began
        if seconds > 0.1:
            log.info("compiled a constraint of %d characters in %.2f s", len(grammar), seconds)
        return matcher

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def _vocabulary(tokenizer: TextTokenizer, vocab_size: int, stop_token_ids: list[int]):
    """The vocabulary as llguidance reads it: each id's own bytes; special tokens (and ids past the tokenizer's)
    marked special, which no constraint matches; the checkpoint's stop ids end a complete output."""
    llg = _llguidance()
    tok = tokenizer.tok
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    n = min(tok.get_vocab_size(with_added_tokens=True), vocab_size)
    # llguidance marks a special token by a leading 0xff byte (never in UTF-8 text)
    tokens = [b"\xff" + tokenizer.token_text(i).encode() if i in special else tokenizer.token_bytes(i)
              for i in range(n)] + [b"\xff<unused%d>" % i for i in range(n, vocab_size)]

    # A complete constraint allows only these; a checkpoint naming none ends a complete output on its first special
    # token (a request then stops there only if its stop ids hold it).
    stop_token_ids = stop_token_ids or sorted(special)[:1] or [0]

    class Vocabulary:  # the shape llguidance's TokenizerWrapper reads
        eos_token_id, bos_token_id = stop_token_ids[0], None
        special_token_ids = sorted(special | set(range(n, vocab_size)))

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text) -> list[int]:  # forced text is tokenised canonically
            return tokenizer.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)

    return llg.LLTokenizer(llg.TokenizerWrapper(Vocabulary()), n_vocab=vocab_size, eos_token=stop_token_ids)


def _first_line(exc) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:500] if text else type(exc).__name__
