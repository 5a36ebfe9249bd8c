"""Text side: the checkpoint's tokenizer and chat template, incremental detokenisation, stop strings."""

from __future__ import annotations

import datetime
import json
import os

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TemplateError(ValueError):
    pass


class PromptTooLong(ValueError):
    """A prompt over the token limit. `tokens` is its length, or a lower bound (`exact` False) when its character
    count alone proved it too long, so it was never tokenised."""

    def __init__(self, tokens: int, limit: int, exact: bool = True) -> None:
        self.tokens, self.limit, self.exact = tokens, limit, exact
        super().__init__(f"the prompt is {'' if exact else 'at least '}{tokens} tokens; at most {limit} fit the context")


# NFC (Qwen's normaliser) composes at most 4 code points into one, so normalised text is at least a quarter as long.
_NORMALISED_SHRINK = 4


class TextTokenizer:
    def __init__(self, checkpoint_dir: str) -> None:
        path = os.path.join(checkpoint_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json in {checkpoint_dir}")
        self.tok = Tokenizer.from_file(path)
        # No token spans more characters than its vocabulary string has (byte-level strings have one per byte).
        self.max_token_chars = max(map(len, self.tok.get_vocab(with_added_tokens=True)))
        self._single: dict[tuple[int, bool], str] = {}  # at most 2 x vocabulary entries
        self._bytes: dict[int, bytes] = {}  # at most a vocabulary's entries
        self._added = set(self.tok.get_added_tokens_decoder())
        self._byte_level = _byte_level_chars() if type(self.tok.decoder).__name__ == "ByteLevel" else None
        self.chat_template = self._load_template(checkpoint_dir)
        self._template = chat_environment().from_string(self.chat_template) if self.chat_template else None

    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` instead of the checkpoint's (`--chat-template`)."""
        try:
            compiled = chat_environment().from_string(template)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template does not parse: {exc}") from None
        self.chat_template, self._template = template, compiled

    @staticmethod
    def _load_template(checkpoint_dir: str) -> str | None:
        path = os.path.join(checkpoint_dir, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path) as f:
                return f.read()
        config = os.path.join(checkpoint_dir, "tokenizer_config.json")
        if os.path.isfile(config):
            with open(config) as f:
                template = json.load(f).get("chat_template")
            if isinstance(template, str):
                return template
        return None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """The text's token ids; over `limit` tokens raises PromptTooLong. `encode_batch` lets go of the GIL while
        it tokenises and the ids list (which holds it) is made only for a prompt that fits, so a large prompt
        tokenised on a worker thread does not stall the event loop."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        if limit is not None and len(text) > (limit + 1) * self.max_token_chars * _NORMALISED_SHRINK:
            raise PromptTooLong(len(text) // (self.max_token_chars * _NORMALISED_SHRINK), limit, exact=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"the text is not valid Unicode (a lone surrogate at character {exc.start})") from None
        (encoding,) = self.tok.encode_batch([text], add_special_tokens=False)
        if limit is not None and len(encoding) > limit:
            raise PromptTooLong(len(encoding), limit)
        return encoding.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) == 1:  # the common case on the streaming path: served from a cache
            key = (ids[0], skip_special_tokens)
            text = self._single.get(key)
            if text is None:
                text = self._single[key] = self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
            return text
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own UTF-8 bytes, also where it holds only part of a character (its text then ends in the
        replacement character, whose bytes are not the token's): byte-level vocabularies map each byte to one
        character, which is mapped back here."""
        found = self._bytes.get(token_id)
        if found is None:
            piece = self.tok.id_to_token(token_id)
            if (self._byte_level is not None and piece is not None and token_id not in self._added
                    and all(c in self._byte_level for c in piece)):
                found = bytes(self._byte_level[c] for c in piece)
            else:
                found = self.token_text(token_id).encode("utf-8")
            self._bytes[token_id] = found
        return found

    def ids_open_reasoning(self, ids: list[int]) -> bool:
        """`prompt_opens_reasoning` for a prompt of token ids: its last think marker is an opening one."""
        opening, closing = self.tok.token_to_id(THINK_OPEN), self.tok.token_to_id(THINK_CLOSE)
        if opening is None or opening not in ids:
            return False
        backwards = ids[::-1]  # list.index runs in C: a 100k-token prompt costs no Python loop
        return closing not in ids or backwards.index(opening) < backwards.index(closing)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                    documents: list | None = None, **kwargs) -> str:
        """The chat as transformers' `apply_chat_template` renders it: `tools` and `documents` passed through, a
        message's reasoning under `reasoning_content` (and `thinking`) whichever of the names it came in."""
        if self._template is None:
            raise TemplateError("this checkpoint has no chat template")
        try:
            return self._template.render(messages=_alias_reasoning(messages), tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from None


def read_chat_template(source: str) -> str:
    """`--chat-template`: a file's text, or the argument itself where it is a template (vLLM takes both)."""
    if os.path.isfile(source):
        with open(source, encoding="utf-8") as f:
            return f.read()
    if "{" not in source:
        raise TemplateError(f"chat_template {source!r} is neither a file nor a Jinja template")
    return source


# Chat templates are the checkpoint's Jinja code, run as transformers' `apply_chat_template` runs them: Qwen's
# templates print tool schemas with `tojson` and date the system prompt with `strftime_now`, and a prompt rendered
# any other way is not the one the model was trained on. jinja2's own `tojson` sorts keys and escapes `<`, `>`, `&`
# and `'` for HTML; transformers' keeps the order and the characters, and writes non-ASCII as is. Written here
# rather than imported: transformers is not a dependency of the server (tests/test_text.py renders both ways).


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` refusing underscore names, which could reach the interpreter's internals."""

    def __init__(*args, **kwargs):  # noqa: N805 (jinja2's own signature: `self` may be a keyword)
        self, args = args[0], args[1:]
        for name in dict(*args, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which marks the assistant's tokens for training: rendered as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def chat_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, namespace=_Namespace)
    return env


_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    """Each message's reasoning under `reasoning_content`, which Qwen's templates read, and `thinking`, whichever
    of the three names the client used (as transformers does)."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in _REASONING_NAMES if isinstance(m, dict) and m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): printable bytes stand for themselves, the others for the code points
    from 256 on, in byte order. Returned as character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _raise(message: str):
    raise TemplateError(message)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas; bytes of a character split across tokens wait for the rest."""

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # tokens before this are final text
        self.read_offset = 0  # tokens before this have been emitted

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = decode(self.ids[self.prefix_offset :], self.skip)
        if full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the token that completes it
        # The previous chunk stays as left context, so decoders that look across tokens stay consistent.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]


class StopMatcher:
    """Finds stop strings in streamed text and holds back any tail that could still start one. It keeps only that
    tail (at most the longest stop string less one character), so each token costs the same however long the
    output grows."""

    def __init__(self, stops: list[str], include_stop: bool) -> None:
        self.stops, self.include = stops, include_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""  # text not yet emitted: where a stop string may still begin

    @property
    def active(self) -> bool:
        """Whether a stop string can end the request: then each token's text decides if it goes on."""
        return bool(self.stops)

    def feed(self, delta: str, can_stop: bool = True) -> tuple[str, bool]:
        """Add text; returns (text safe to emit now, whether a stop string was hit). With `can_stop` False (the
        request is short of its min_tokens) no stop string ends it, as in vLLM; the held tail still lets one that
        completes in a later delta match across the two."""
        if not self.stops:
            return delta, False
        text = self.pending + delta
        hit = None  # the stop string that completes first (earliest end; then the longest), as if fed per character
        for s in self.stops if can_stop else ():
            i = text.find(s)
            if i >= 0 and (hit is None or (i + len(s), i) < (hit[0] + len(hit[1]), hit[0])):
                hit = (i, s)
        if hit is not None:
            self.pending = ""
            return text[: hit[0] + (len(hit[1]) if self.include else 0)], True
        safe = max(len(text) - self.hold, 0)
        self.pending = text[safe:]
        return text[:safe], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open <think> block (thinking enabled)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class ReasoningSplitter:
    """Splits streamed assistant text into reasoning (inside <think>…</think>) and content.

    A tail that could be the start of a marker is held back until the next delta decides it.
    """

    def __init__(self, in_reasoning: bool) -> None:
        self.in_reasoning = in_reasoning
        self.pending = ""
        self.started = False  # content so far is only whitespace after </think> (stripped, as Qwen's parser does)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text = self.pending + delta
        self.pending = ""
        reasoning, content = [], []
        while text:
            marker = THINK_CLOSE if self.in_reasoning else THINK_OPEN
            i = text.find(marker)
            if i >= 0:
                (reasoning if self.in_reasoning else content).append(text[:i])
                text = text[i + len(marker) :]
                self.in_reasoning = not self.in_reasoning
                continue
            keep = 0 if final else partial_suffix(text, marker)
            (reasoning if self.in_reasoning else content).append(text[: len(text) - keep])
            self.pending = text[len(text) - keep :]
            break
        content_text = "".join(content)
        if not self.started:
            content_text = content_text.lstrip("\n")
            self.started = bool(content_text)
        return "".join(reasoning), content_text


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
