"""Structured outputs: every request field that constrains the output (OpenAI's response_format and forced tool
calls, vLLM's structured_outputs and guided_*), compiled off the event loop, and every output of a random-weight
model at temperature 1 valid under its constraint, with overlap scheduling, speculation and thinking."""

import asyncio
import json
import os
import re
import time

import aiohttp
import jsonschema
import openai
import pydantic
import torch
from test_agents import TOOLS, _serve

from deltaserve.kernels.sampling import apply_token_mask, mask_words
from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams
from deltaserve.runtime.grammar import strict_schema
from deltaserve.runtime.params import StructuredOutputs

with open(os.path.join(os.path.dirname(__file__), "data", "json_schemas.json")) as f:
    SCHEMAS = json.load(f)

# A random-weight model writes a JSON string until it happens to draw a closing quote: room for the longest.
MAX_TOKENS = 2000


def _run(ckpt, body, **args):
    async def main():
        engine_args = EngineArgs(model=ckpt, max_model_len=4096, max_batch=64, cpu_memory_bytes=512 << 20,
                                 **args)
        async with AsyncEngine(engine_args) as engine:
            return await body(engine)
    return asyncio.run(main())


async def _finals(streams) -> list:
    async def last(s):
        out = None
        async for out in s:
            pass
        return out
    return await asyncio.gather(*(last(s) for s in streams))


def _answer(text: str) -> str:
    """The content after a closed reasoning block (what the server's reasoning parser returns)."""
    return text.split("</think>", 1)[1].lstrip("\n") if "</think>" in text else text


def _check_valid(outs, schemas):
    for out, schema in zip(outs, schemas):
        assert out.finish_reason == "stop", (out.finish_reason, out.text[:200])
        jsonschema.validate(json.loads(_answer(out.text)), schema)


def test_every_output_of_a_random_model_parses_and_validates(tiny_ckpt):
    """200 requests over 20 schemas (nested objects, arrays, enums, bounded numbers, optional fields, anyOf, $ref,
    patterns), temperature 1, all in flight together (overlap scheduling, the default)."""
    async def body(engine):
        streams, schemas = [], []
        for i, schema in enumerate(SCHEMAS):
            for j in range(10):
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=100 * i + j,
                                        structured_outputs=StructuredOutputs(json=schema))
                streams.append(engine.generate("Reply in JSON:", params))
                schemas.append(schema)
        return await _finals(streams), schemas

    outs, schemas = _run(tiny_ckpt, body)
    _check_valid(outs, schemas)


def test_valid_with_thinking_on_and_off(tiny_ckpt):
    """Thinking on, the constraint starts after </think> (the request biases </think> up so a random model closes
    its reasoning within a few hundred tokens); off, at once. (With speculation: the outputs are these, below.)"""
    async def body(engine):
        close = engine.tokenizer.tok.token_to_id("</think>")
        streams, schemas = [], []
        for i, schema in enumerate(SCHEMAS):
            for thinking in (False, True):
                params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
                                        logit_bias={close: 4.0} if thinking else None,
                                        structured_outputs=StructuredOutputs(json=schema))
                messages = [{"role": "user", "content": "Reply in JSON."}]
                streams.append(engine.chat(messages, params, {"enable_thinking": thinking}))
                schemas.append(schema)
        outs = await _finals(streams)
        return outs, schemas

    outs, schemas = _run(tiny_ckpt, body)
    _check_valid(outs, schemas)
    assert sum("</think>" in o.text for o in outs) == len(SCHEMAS)  # each thinking request reasoned, then answered


def test_json_object_and_choice_and_grammar_outputs(tiny_ckpt):
    """Any JSON object (its keys and values free: a random model may run out of tokens, and what it ended is an
    object), a choice, a regex, an EBNF grammar, vLLM's structural tag, and a schema's n choices."""
    async def body(engine):
        specs = [StructuredOutputs(json_object=True)] * 4 + [
            StructuredOutputs(choice=["up", "down", "left right"]), StructuredOutputs(regex=r"\(?[0-9]{3}\) [0-9]{4}"),
            StructuredOutputs(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+'),
            StructuredOutputs(structural_tag={"triggers": ["<f="], "structures": [{
                "begin": "<f=go>", "schema": {"type": "object", "properties": {"n": {"enum": [1, 2]}},
                                              "required": ["n"]}, "end": "</f>"}]})]
        streams = [engine.generate("Say:", SamplingParams(max_tokens=300, temperature=1.0, seed=i,
                                                          structured_outputs=spec)) for i, spec in enumerate(specs)]
        choices = engine.generate_choices("Say:", SamplingParams(max_tokens=600, temperature=1.0, seed=9,
                                                                 structured_outputs=StructuredOutputs(
                                                                     json=SCHEMAS[1])), 3)
        outs = await _finals(streams), await _finals(choices)
        # the structural tag's matcher (compiled for the request above): a triggered call must follow its schema
        encode = engine.tokenizer.encode
        good, bad = engine.grammars.matcher(specs[-1], False), engine.grammars.matcher(specs[-1], False)
        assert good.consume_tokens(encode('so <f=go>{"n": 2}</f> and on'))
        assert not bad.consume_tokens(encode('so <f=go>{"n": 3}'))
        return outs

    outs, choices = _run(tiny_ckpt, body)
    assert len({o.text for o in choices}) == 3  # n = 3: each choice its own matcher, each output valid
    for o in choices:
        jsonschema.validate(json.loads(o.text), SCHEMAS[1])
    ended = [o for o in outs[:4] if o.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(o.text), dict) for o in ended)
    assert all(o.text.startswith("{") for o in outs[:4])
    choice, regex, grammar, tagged = outs[4:]
    for call in re.findall("<f=(.*?)</f>", tagged.text, re.S):  # free text around calls whose JSON is the schema's
        assert call.startswith("go>") and json.loads(call[3:])["n"] in (1, 2)
    assert "<f=" not in re.sub("<f=.*?</f>", "", tagged.text, flags=re.S) or tagged.finish_reason == "length"
    assert choice.text in ("up", "down", "left right") and choice.finish_reason == "stop"
    assert re.fullmatch(r"\(?[0-9]{3}\) [0-9]{4}", regex.text) and regex.finish_reason == "stop"
    assert re.fullmatch(r"\([a-c]+(,[a-c]+)*\)", grammar.text) and grammar.finish_reason == "stop"


def test_constrained_outputs_equal_across_overlap_and_speculation(tiny_ckpt):
    """An optimisation is exact: constrained requests (beside unconstrained ones) stream the same deltas, text,
    log-probs and finish reasons with overlap scheduling on and off, and with speculation."""
    def requests():
        out = []
        for i, schema in enumerate(SCHEMAS[:6]):
            out.append(SamplingParams(max_tokens=300, temperature=1.0, seed=i, logprobs=2,
                                      structured_outputs=StructuredOutputs(json=schema)))
            out.append(SamplingParams(max_tokens=40, temperature=1.0, seed=50 + i, logprobs=2))
        out.append(SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputs(
            regex=r"[a-z]{3,6}-[0-9]{2}")))
        out.append(SamplingParams(max_tokens=8, temperature=1.0, seed=7, structured_outputs=StructuredOutputs(
            choice=["alpha", "beta", "gamma"])))
        return out

    async def body(engine):
        streams = [engine.generate(f"Prompt {i}:", p) for i, p in enumerate(requests())]

        async def deltas(s):  # (a slow reader gets several tokens' deltas in one output: their sum is compared)
            got, reasons = [], []
            async for out in s:
                got.append(out.delta_text)
                reasons.append(out.finish_reason)
            lps = [e.logprob for e in out.logprobs] if out.logprobs is not None else None
            assert "".join(got) == out.text and reasons.count(None) == len(reasons) - 1
            return out.text, out.finish_reason, list(out.token_ids), lps
        return await asyncio.gather(*(deltas(s) for s in streams))

    plain = _run(tiny_ckpt, body, async_scheduling=False)
    for other in (_run(tiny_ckpt, body), _run(tiny_ckpt, body, speculative_tokens=2)):
        assert [o[:3] for o in other] == [o[:3] for o in plain]
        for got, want in zip(other, plain):  # steps of other sizes round the log-probs apart
            assert got[3] is None and want[3] is None or torch.allclose(torch.tensor(got[3]), torch.tensor(want[3]),
                                                                        atol=1e-4)
    assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", plain[-2][0]) and plain[-1][0] in ("alpha", "beta", "gamma")
    ended = [(o[0], schema) for o, schema in zip(plain[:12:2], SCHEMAS) if o[1] == "stop"]
    assert len(ended) >= 4
    for text, schema in ended:
        jsonschema.validate(json.loads(text), schema)


def test_constrained_rows_keep_drafts_the_grammar_allows(tiny_ckpt):
    """Speculation with drafts checked against the grammar: drafts of the plain run's own continuation (a trained
    head's best case) are kept, each later position drawn under the mask its drafts lead to, and the outputs
    are the plain run's; drafts that break the grammar (every one a '}') are never kept, and change nothing."""
    from deltaserve.runtime.speculation import SpeculationOverride

    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_outputs=StructuredOutputs(
        json=schema)) for i, schema in enumerate(SCHEMAS[:8])]
    prompts = [f"JSON {i}:" for i in range(len(params))]

    def run(propose=None, k=0):
        async def main():
            args = EngineArgs(model=tiny_ckpt, max_model_len=1024, max_batch=8, cpu_memory_bytes=128 << 20,
                              speculative_tokens=k, speculative_adaptive=False)
            async with AsyncEngine(args, speculation_override=SpeculationOverride(propose)) as engine:
                outs = await _finals([engine.generate(p, q) for p, q in zip(prompts, params)])
                return [(o.text, list(o.token_ids), o.finish_reason) for o in outs], \
                    engine.metrics.spec_accepted._value.get()
        return asyncio.run(main())

    plain, _ = run()
    by_prompt = {}

    def own(prompt_ids, output, k):  # the plain run's continuation (any drafts for the warm-up's prompts)
        full = by_prompt.get(tuple(prompt_ids), []) + [0] * (len(output) + k)
        return full[len(output): len(output) + k]

    async def ids():
        async with AsyncEngine(EngineArgs(model=tiny_ckpt, max_model_len=1024, cpu_memory_bytes=16 << 20)) as e:
            return [e.tokenizer.encode(p) for p in prompts]
    for prompt_ids, out in zip(asyncio.run(ids()), plain):
        by_prompt[tuple(prompt_ids)] = out[1]
    spec, accepted = run(own, k=3)
    assert spec == plain and accepted >= sum(len(o[1]) for o in plain) // 3
    brace = [None]

    def braces(prompt_ids, output, k):
        return [brace[0]] * k

    async def brace_id():
        async with AsyncEngine(EngineArgs(model=tiny_ckpt, max_model_len=1024, cpu_memory_bytes=16 << 20)) as e:
            return e.tokenizer.encode("}")[0]
    brace[0] = asyncio.run(brace_id())
    wrong, _ = run(braces, k=3)
    assert wrong == plain


def test_a_large_schema_compiles_off_the_event_loop_once(tiny_ckpt):
    """A 1500-property schema takes a while to compile: the event loop keeps ticking meanwhile, and the same
    schema asked for again (by another request, while and after) compiles once."""
    big = {"type": "object", "properties": {f"field_{i}": {"anyOf": [
        {"type": "string", "maxLength": i % 40 + 1}, {"type": "integer", "minimum": i},
        {"enum": [f"v{j}" for j in range(12)]}]} for i in range(1500)}, "required": ["field_0"]}

    async def body(engine):
        gaps, stop = [], asyncio.Event()

        async def tick():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        compiles = []
        original = engine.grammars._compile
        engine.grammars._compile = lambda *a: compiles.append(a) or original(*a)
        params = SamplingParams(max_tokens=3, temperature=0.0, structured_outputs=StructuredOutputs(json=big))
        began = time.perf_counter()
        outs = await _finals([engine.generate("Reply:", params) for _ in range(3)])
        took = time.perf_counter() - began
        await _finals([engine.generate("Reply:", params)])
        stop.set()
        await ticker
        return outs, max(gaps), took, len(compiles)

    outs, worst_gap, took, compiles = _run(tiny_ckpt, body)
    assert compiles == 1 and all(o.text == '{"fie' for o in outs), [o.text for o in outs]
    # the loop's worst wait stays far below the compile's time (a stalled loop would wait it all)
    assert worst_gap < max(0.25, took / 3), (worst_gap, took)


def test_the_token_mask_matches_a_bit_by_bit_reference():
    torch.manual_seed(0)
    vocab, rows = 200, 5
    logits = torch.randn(7, vocab)
    mask = torch.randint(-2**31, 2**31 - 1, (rows, mask_words(vocab)), dtype=torch.int32)
    at = torch.tensor([6, 0, 3, 2, 5])
    expected = logits.clone()
    for r, row in enumerate(at.tolist()):
        for t in range(vocab):
            if not (int(mask[r, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    apply_token_mask(logits, at, mask)
    assert torch.equal(logits, expected)


def test_strict_schema_closes_objects_that_do_not_say():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "object", "additionalProperties": True}},
              "$defs": {"d": {"properties": {"x": {"enum": [{"properties": 1}]}}}}}
    strict = strict_schema(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["a"]["additionalProperties"] is False
    assert strict["properties"]["c"]["additionalProperties"] is True
    assert strict["$defs"]["d"]["additionalProperties"] is False
    assert strict["$defs"]["d"]["properties"]["x"]["enum"] == [{"properties": 1}]  # values are left alone


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=7)
    unit: str = pydantic.Field(pattern="^(C|F)$")


def test_the_openai_client_parses_constrained_chat_and_forced_calls(tiny_ckpt):
    async def body(engine, url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
        messages = [{"role": "user", "content": "Weather?"}]
        common = {"model": "m", "messages": messages, "max_tokens": 1500, "seed": 3}
        parsed = await client.beta.chat.completions.parse(response_format=Weather, **common)
        response = await client.responses.create(model="m", input="Weather?", max_output_tokens=1500, text={
            "format": {"type": "json_schema", "name": "weather", "schema": Weather.model_json_schema()}})
        required = await client.chat.completions.create(tools=TOOLS, tool_choice="required", **common)
        named = await client.chat.completions.create(
            tools=TOOLS + [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True, **common)
        streamed = {}
        async for chunk in named:
            for c in chunk.choices[0].delta.tool_calls or []:
                entry = streamed.setdefault(c.index, {"name": c.function.name, "arguments": ""})
                entry["arguments"] += c.function.arguments or ""
        extra = {"guided_choice": ["red", "green"]}, {"guided_regex": r"[0-9]{4}"}, \
            {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}
        raw = []
        async with aiohttp.ClientSession() as s:
            for e in extra:
                async with s.post(url + "/v1/completions", json={"prompt": "Answer:", "max_tokens": 10,
                                                                  "temperature": 1.0, **e}) as r:
                    raw.append((await r.json())["choices"][0]["text"])
        return parsed, response, required, streamed, raw

    parsed, response, required, streamed, raw = _serve(tiny_ckpt, body, max_model_len=2048,
                                                          tool_call_parser="qwen3_coder")
    weather = parsed.choices[0].message.parsed
    assert isinstance(weather, Weather) and 1 <= weather.days <= 7 and weather.unit in "CF"
    Weather.model_validate_json(response.output_text)  # the Agents SDK's structured output, through /v1/responses
    schema = TOOLS[0]["function"]["parameters"]
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schema)
    (only,) = streamed.values()
    assert only["name"] == "get_weather"
    jsonschema.validate(json.loads(only["arguments"]), schema)
    assert raw[0] in ("red", "green") and re.fullmatch("[0-9]{4}", raw[1]) and raw[2] in ("yes", "no")


def test_constraints_that_cannot_be_served_are_a_400_naming_the_field(tiny_ckpt):
    async def body(engine, url):
        out = []
        async with aiohttp.ClientSession() as s:
            for extra in ({"response_format": {"type": "text"}},
                          {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                          {"response_format": {"type": "xml"}},
                          {"guided_json": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}},
                          {"guided_regex": "[a-"},
                          {"structured_outputs": {"grammar": "root ::= ("}},
                          {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
                          {"guided_choice": ["a"], "guided_regex": "b"},
                          {"tool_choice": "required"},
                          {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                          {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}):
                payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
                async with s.post(url + "/v1/chat/completions", json=payload) as r:
                    got = await r.json()
                    out.append((r.status, got.get("error", {}).get("param")))
        return out

    assert _serve(tiny_ckpt, body, tool_call_parser="qwen3_coder") == [
        (200, None), (400, "response_format"), (400, "response_format"), (400, "guided_json"),
        (400, "guided_regex"), (400, "structured_outputs"), (400, "structured_outputs"), (400, "guided_choice"),
        (400, "tool_choice"), (400, "tool_choice"), (400, "tool_choice")]


def test_constrained_outputs_at_tp_2_are_tp_1_s(tiny_tp_ckpt):
    """Rank 0 alone holds the matchers and draws; the other rank runs the same steps: tp 2 gives tp 1's outputs."""
    async def body(engine):
        streams = [engine.generate(f"JSON {i}:", SamplingParams(max_tokens=200, temperature=1.0, seed=i,
                                                                structured_outputs=StructuredOutputs(json=schema)))
                   for i, schema in enumerate(SCHEMAS[:4])]
        return [(o.text, list(o.token_ids), o.finish_reason) for o in await _finals(streams)]

    one = _run(tiny_tp_ckpt, body)
    assert _run(tiny_tp_ckpt, body, tp=2) == one
    for (text, _, reason), schema in zip(one, SCHEMAS):
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)


def test_without_llguidance_the_engine_serves_and_refuses_constraints_by_name(tiny_ckpt, monkeypatch):
    def missing():
        raise ImportError("No module named 'llguidance'")

    monkeypatch.setattr("deltaserve.runtime.grammar._llguidance", missing)

    async def body(engine):
        plain = await _finals([engine.generate("Hi:", SamplingParams(max_tokens=3, temperature=0.0))])
        try:
            await engine.compile_constraint("Hi:", SamplingParams(structured_outputs=StructuredOutputs(
                json_object=True)))
        except ValueError as exc:
            return plain, str(exc)
        return plain, None

    (plain,), refused = _run(tiny_ckpt, body)
    assert plain.finish_reason == "length" and "pip install llguidance" in refused
