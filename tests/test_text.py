"""Incremental detokenisation, stop strings and reasoning splitting (pure text, no model)."""

import asyncio
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.runtime.text import (IncrementalDetokenizer, ReasoningSplitter, StopMatcher, TextTokenizer,
                                     prompt_opens_reasoning)

TEXT = st.text(alphabet=st.sampled_from(list("abc xyzé日本語🙂\n<think>/")), max_size=60)


@settings(max_examples=150, deadline=None)
@given(TEXT)
def test_streamed_deltas_concatenate_to_the_full_decode(tiny_ckpt, text):
    tok = TextTokenizer(tiny_ckpt)
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=True)
    pieces = [detok.add(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in tok.decode(ids)  # no split character leaks
    assert "".join(pieces) == tok.decode(ids)


@settings(max_examples=100, deadline=None)
@given(TEXT)
def test_a_tokens_bytes_are_its_own_and_offsets_count_characters(tiny_ckpt, text):
    """Each token's bytes (`token_bytes`), joined, are the text's UTF-8 bytes, also where a character is split
    across tokens (each part's own text is the replacement character); a completion's text_offset is the length
    of the text before the token, wherever that text ends on a whole character."""
    from types import SimpleNamespace

    from deltaserve.runtime.openai_protocol import completion_logprobs

    tok = TextTokenizer(tiny_ckpt)
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    shape, end = completion_logprobs([SimpleNamespace(token_id=i, logprob=0.0, top=None) for i in ids], tok, 0)
    assert end == len(text)
    for i, offset in enumerate(shape["text_offset"]):
        before = tok.decode(ids[:i])
        if not before.endswith("\ufffd"):
            assert offset == len(before), i


@settings(max_examples=200, deadline=None)
@given(TEXT, st.lists(st.text(alphabet="abcé日 ", min_size=1, max_size=4), min_size=1, max_size=3),
       st.lists(st.integers(1, 5), min_size=1, max_size=30), st.booleans())
def test_stop_strings_never_leak_and_cut_at_the_first_match(text, stops, cuts, include):
    matcher = StopMatcher(stops, include)
    emitted, hit, at = "", False, 0
    for n in itertools.cycle(cuts):
        if at >= len(text):
            break
        out, hit = matcher.feed(text[at : at + n])
        emitted += out
        at += n
        if hit:
            break
    if not hit:
        emitted += matcher.flush()
    # Expected: at the first chunk boundary where some stop string has appeared, the text is cut at the stop
    # that completes first (as per-character streaming would see it); nothing past the cut is ever emitted.
    expected, boundary = None, 0
    for n in itertools.cycle(cuts):
        if boundary >= len(text):
            break
        boundary = min(boundary + n, len(text))
        found = [(i + len(s), i) for s in stops if (i := text[:boundary].find(s)) >= 0]
        if found:
            end, i = min(found)  # the stop that completes first
            expected = text[:end] if include else text[:i]
            break
    if expected is None:
        assert emitted == text and not hit
    else:
        assert hit and emitted == expected


def test_reasoning_splitter_holds_back_partial_markers():
    split = ReasoningSplitter(in_reasoning=True)
    parts = [split.feed(d) for d in ["I think", " so</th", "ink>\n\nAnswer", ": 4"]] + [split.feed("", final=True)]
    assert "".join(r for r, _ in parts) == "I think so"
    assert "".join(c for _, c in parts) == "Answer: 4"
    plain = ReasoningSplitter(in_reasoning=False)
    assert plain.feed("no thinking here", final=True) == ("", "no thinking here")


def test_the_demo_checkpoint_is_made_on_first_use(tmp_path, monkeypatch):
    from deltaserve.runtime import AsyncEngine, SamplingParams
    from deltaserve.runtime.cli import engine_args, serve_parser

    monkeypatch.setenv("DELTASERVE_CACHE", str(tmp_path))
    import argparse

    ns = serve_parser(argparse.ArgumentParser()).parse_args(["--max-batch", "4", "--max-model-len", "256"])
    args = engine_args(ns)
    assert args.model is None and args.device == "cpu" and args.max_batch == 4

    async def main():
        async with AsyncEngine(args) as engine:
            out = None
            async for out in engine.generate("hello", SamplingParams(max_tokens=3, temperature=0)):
                pass
            return engine.model_name, out, engine.render_chat([{"role": "user", "content": "hi"}])

    name, out, chat = asyncio.run(main())
    assert name == "demo-tiny" and out.finished and (tmp_path / "demo-tiny" / "config.json").is_file()
    # Its chat answers in content: the generation prompt closes the (empty) reasoning block, so a client that
    # reads only `content` (LangChain, the Agents SDK) gets the answer.
    assert ReasoningSplitter(prompt_opens_reasoning(chat)).feed("the answer", final=True) == ("", "the answer")


def test_chat_templates_render_as_transformers_renders_them():
    """Tools (key order, `<` and non-ASCII kept), tool calls with indented JSON, multi-part content, reasoning under
    another name, loop controls, namespaces and `{% generation %}`: the same string as transformers'."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from deltaserve.runtime.text import _alias_reasoning, chat_environment

    template = (
        "{%- if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif %}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
        "</think>{% endif %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{{ p.text }}"
        "{% endfor %}{% endif %}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson(indent=2) }}"
        "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}{% generation %}{{ ns.n }}{% endgeneration %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [
        {"role": "system", "content": "Tu es <gentil> & 'sûr'"},
        {"role": "user", "content": [{"type": "text", "text": "a<b"}, {"type": "text", "text": "é"}]},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "", "reasoning": "pensée é",
         "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {"z": 1, "a": "<é>"}}}]},
        {"role": "tool", "content": '{"r": 2}'}]
    tools = [{"type": "function", "function": {"name": "get", "description": "Zé <x>", "parameters": {
        "type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}}}]
    ours = chat_environment().from_string(template).render(messages=_alias_reasoning(messages), tools=tools,
                                                           documents=None, add_generation_prompt=True)
    theirs = render_jinja_template([messages], tools=tools, chat_template=template, add_generation_prompt=True)
    theirs = theirs[0][0] if isinstance(theirs, tuple) else theirs
    assert ours == theirs and '"description": "Zé <x>"' in ours and "<think>pensée é</think>" in ours
