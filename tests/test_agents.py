"""Agents' requests through the server: tools rendered by the chat template and the model's calls parsed into
OpenAI's `tool_calls` (streamed and not, with the `openai` client), vLLM's token endpoints and serve flags."""

import asyncio
import json

import aiohttp
import openai
import pytest
from test_server import free_port

from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams
from deltaserve.runtime.outputs import RequestOutput
from deltaserve.runtime.server import ServerOptions, serve

# A Qwen3.5-style template: the tools as JSON, the call format it teaches, the calls of earlier turns.
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call as <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now>", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]

SCRIPT = ("I will look that up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
          "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


class ScriptedStream:
    """Stands in for a request's stream: `text` in chunks of `size` characters, then a stop."""

    def __init__(self, request_id: str, prompt_ids: list[int], text: str, size: int) -> None:
        self.request_id, self.prompt_ids, self.text, self.size = request_id, prompt_ids, text, size

    def __aiter__(self):
        return self._outputs()

    async def _outputs(self):
        ids, parts = [], []
        pieces = [self.text[i : i + self.size] for i in range(0, len(self.text), self.size)]
        for j, piece in enumerate(pieces):
            ids.append(7)
            parts.append(piece)
            last = j == len(pieces) - 1
            yield RequestOutput(self.request_id, self.prompt_ids, ids, parts, [7], piece, finished=last,
                                finish_reason="stop" if last else None)

    async def __anext__(self):
        if not hasattr(self, "_it"):
            self._it = self._outputs()
        return await self._it.__anext__()

    async def aclose(self):
        pass


def _scripted(engine, text: str, size: int, prompts: list):
    def generate_choices(prompt_ids, params, n, request_id=None):
        prompts.append(prompt_ids)
        return [ScriptedStream(f"s{i}", prompt_ids, text, size) for i in range(n)]
    engine.generate_choices = generate_choices


def _serve(ckpt, body, max_model_len=512, **options):
    async def main():
        args = EngineArgs(model=ckpt, max_model_len=max_model_len, max_batch=4, cpu_memory_bytes=32 << 20,
                          chat_template=TEMPLATE, served_model_name="m")
        async with AsyncEngine(args) as engine:
            port = free_port()
            runner = await serve(engine, "127.0.0.1", port, ServerOptions(**options))
            try:
                return await body(engine, f"http://127.0.0.1:{port}")
            finally:
                await runner.cleanup()
    return asyncio.run(main())


@pytest.mark.parametrize("size", [1, 7, 1000])
def test_tool_calls_reach_the_openai_client_streamed_and_not(tiny_ckpt, size):
    async def body(engine, url):
        prompts = []
        _scripted(engine, SCRIPT, size, prompts)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
        messages = [{"role": "user", "content": "Weather in São Paulo?"}]
        whole = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        stream = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)
        calls, content, finish = {}, "", None
        async for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for c in delta.tool_calls or []:
                entry = calls.setdefault(c.index, {"id": c.id, "name": c.function.name, "arguments": ""})
                entry["arguments"] += c.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        none = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none")
        prompt = engine.tokenizer.decode(prompts[0], skip_special_tokens=False)
        return whole, (content, calls, finish), none, prompt

    whole, (content, calls, finish), none, prompt = _serve(tiny_ckpt, body)
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "São Paulo", "days": 2}
    assert whole.choices[0].message.content == "I will look that up.\n"
    assert finish == "tool_calls" and content == "I will look that up.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather",
                                                                                  {"city": "São Paulo", "days": 2})]
    assert calls[0]["id"].startswith("call_")
    # tool_choice "none": the tools are described to the model, its text is not parsed
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == SCRIPT
    # the template saw the tools as transformers renders them: key order kept, < and non-ASCII as they are
    assert '{"type": "function", "function": {"name": "get_weather", "description": "Weather <now>"' in prompt


def test_bad_tools_are_a_400(tiny_ckpt):
    async def body(engine, url):
        async with aiohttp.ClientSession() as s:
            out = []
            for extra in ({"tool_choice": {"type": "function", "function": {"name": "absent"}}},
                          {"tool_choice": "always"}, {"tools": [{"type": "function", "function": {}}]},
                          {"tools": "x"}, {"parallel_tool_calls": "yes"}):
                payload = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **extra}
                async with s.post(url + "/v1/chat/completions", json=payload) as r:
                    out.append((r.status, (await r.json())["error"]))
            return out

    for status, error in _serve(tiny_ckpt, body):
        assert status == 400 and error["param"] in ("tool_choice", "tools", "parallel_tool_calls"), error


def test_tokenize_detokenize_and_version_as_vllm_serves_them(tiny_ckpt):
    async def body(engine, url):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/tokenize", json={"prompt": "hello world", "return_token_strs": True}) as r:
                plain = await r.json()
            async with s.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "tools": TOOLS}) as r:
                chat = await r.json()
            async with s.post(url + "/detokenize", json={"tokens": plain["tokens"]}) as r:
                back = await r.json()
            async with s.post(url + "/detokenize", json={"tokens": [10**9]}) as r:
                bad = r.status
            async with s.get(url + "/version") as r:
                ver = await r.json()
            rendered = engine.render_chat([{"role": "user", "content": "hi"}], None, TOOLS)
            return plain, chat, back, bad, ver, engine.tokenizer.encode(rendered)

    plain, chat, back, bad, ver, want = _serve(tiny_ckpt, body)
    assert plain["count"] == len(plain["tokens"]) > 0 and "".join(plain["token_strs"]) == "hello world"
    assert back["prompt"] == "hello world" and bad == 400 and ver["version"]
    assert chat["tokens"] == want and chat["max_model_len"] == 512


def test_vllm_s_qwen3_5_launch_line_parses(tmp_path, tiny_ckpt):
    """The documented Qwen3.5 command line (reasoning and tool parsers, a chat template file, the generation
    config, log-probs and the flags that change nothing here) parses into our engine and server options."""
    from deltaserve.runtime import cli

    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    ns = cli.serve_parser(cli._Parser()).parse_args([
        tiny_ckpt, "--tensor-parallel-size", "1", "--max-model-len", "262144", "--reasoning-parser", "qwen3",
        "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--chat-template", str(template),
        "--trust-remote-code", "--generation-config", "vllm", "--max-logprobs", "10", "--disable-log-requests",
        "--enable-chunked-prefill", "--served-model-name", "Qwen/Qwen3.5-27B", "--gpu-memory-utilization", "0.9",
        "--max-num-seqs", "64", "--enable-prefix-caching"])
    args, options = cli.engine_args(ns), cli.server_options(ns)
    assert args.chat_template == str(template) and args.generation_config == "vllm" and args.max_logprobs == 10
    assert options.tool_call_parser == "qwen3_coder"

    async def main():
        async with AsyncEngine(args.replace(max_model_len=256, cpu_memory_bytes=16 << 20)) as engine:
            return engine.tokenizer.chat_template, engine.cfg.generation
    rendered_with, defaults = asyncio.run(main())
    assert rendered_with == TEMPLATE and defaults.temperature is None and defaults.eos_token_ids


def test_max_logprobs_bounds_what_a_request_may_ask(tiny_ckpt):
    """vLLM's --max-logprobs (20 by default): the completions API takes up to it too (OpenAI's own 5 is lower)."""
    async def body(engine, url):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": "hi", "logprobs": 8, "max_tokens": 2}) as r:
                completion = r.status, await r.json()
            async with s.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 8,
                    "max_tokens": 2}) as r:
                return completion, (r.status, await r.json())

    (status, got), (chat_status, chat) = _serve(tiny_ckpt, body)
    # the legacy shape keys the top tokens by text: tokens of one text (parts of a character) share an entry
    top = got["choices"][0]["logprobs"]["top_logprobs"][0]
    assert status == 200 and 1 <= len(top) <= 8 and all(lp <= 0 for lp in top.values())
    assert chat_status == 200 and len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 8

    async def lowered():
        args = EngineArgs(model=tiny_ckpt, max_model_len=256, cpu_memory_bytes=16 << 20, max_logprobs=4)
        async with AsyncEngine(args) as engine:
            with pytest.raises(ValueError, match="max_logprobs"):
                engine.generate("hi", SamplingParams(logprobs=5))
    asyncio.run(lowered())


def test_a_call_inside_the_reasoning_is_not_a_call(tiny_ckpt):
    thought = "<think>\nMaybe " + SCRIPT + "\n</think>\n\nNo call needed."

    async def body(engine, url):
        _scripted(engine, thought, 5, [])
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
        return await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    tools=TOOLS)

    out = _serve(tiny_ckpt, body)
    message = out.choices[0].message
    assert message.tool_calls is None and message.content == "No call needed."
    assert "<function=get_weather>" in message.model_extra["reasoning_content"]
    assert out.choices[0].finish_reason == "stop"


RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather <now>",
                    "parameters": TOOLS[0]["function"]["parameters"]}]


@pytest.mark.parametrize("size", [3, 1000])
def test_the_responses_api_serves_an_agent_s_turns(tiny_ckpt, size):
    """What the OpenAI Agents SDK sends (instructions, tools, the conversation so far with a call and its output):
    the reasoning, the text and the call come back as Responses items, and streamed as its events."""
    thought = "<think>\nThe user wants weather.\n</think>\n\n" + SCRIPT

    async def body(engine, url):
        prompts = []
        _scripted(engine, thought, size, prompts)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
        conversation = [{"role": "user", "content": "Weather in Lima?"},
                        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                         "arguments": '{"city": "Lima"}'},
                        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                        {"role": "user", "content": [{"type": "input_text", "text": "And São Paulo?"}]}]
        whole = await client.responses.create(model="m", instructions="Be brief.", input=conversation,
                                              tools=RESPONSES_TOOLS)
        kinds, final = [], None
        async with await client.responses.create(model="m", input="hi", tools=RESPONSES_TOOLS, stream=True) as s:
            async for event in s:
                kinds.append(event.type)
                if event.type == "response.completed":
                    final = event.response
        refused = []
        for extra in ({"previous_response_id": "resp_1"}, {"text": {"format": {"type": "xml"}}}):
            try:
                await client.responses.create(model="m", input="hi", **extra)
            except openai.BadRequestError as exc:
                refused.append(exc.body["param"])
        return whole, kinds, final, refused, engine.tokenizer.decode(prompts[0], skip_special_tokens=False)

    whole, kinds, final, refused, prompt = _serve(tiny_ckpt, body)
    for response in (whole, final):
        types = [item.type for item in response.output]
        assert types == ["reasoning", "message", "function_call"], types
        call = response.output[2]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "São Paulo", "days": 2}
        assert response.output[1].content[0].text == "I will look that up.\n" and response.status == "completed"
        assert response.usage.output_tokens > 0
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for kind in ("response.output_text.delta", "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done"):
        assert kind in kinds
    assert refused == ["previous_response_id", "text.format"]
    # the conversation reached the template as chat messages: instructions, the earlier call and its output
    assert prompt.startswith("<tools>") and "<|im_start|>system\nBe brief." in prompt
    assert "<tool_call>get_weather</tool_call>" in prompt and "<|im_start|>tool\nsunny" in prompt


def test_logit_bias_steers_every_draw_plain_and_speculative(tiny_ckpt):
    """A +100 bias makes its token the greedy one at every step; a -100 bias on the unbiased greedy tokens keeps
    them out; speculation (drafts drawn from the same biased logits) changes neither. Through the server too."""
    prompt = [5, 6, 7, 8, 9]

    async def run(bias, **kw):
        args = EngineArgs(model=tiny_ckpt, max_model_len=256, max_batch=2, cpu_memory_bytes=32 << 20, **kw)
        async with AsyncEngine(args) as engine:
            async for out in engine.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                                    logit_bias=bias)):
                pass
            return out.token_ids

    plain = asyncio.run(run(None))
    assert asyncio.run(run({42: 100})) == [42] * 8
    banned = asyncio.run(run({t: -100 for t in set(plain)}))
    assert not set(banned) & set(plain)
    assert asyncio.run(run({42: 100}, speculative_tokens=2)) == [42] * 8
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={1: 101})

    async def body(engine, url):
        async with aiohttp.ClientSession() as s:
            payload = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "logit_bias": {"42": 100}}
            async with s.post(url + "/v1/completions", json={**payload, "return_token_ids": True}) as r:
                ok = await r.json()
            async with s.post(url + "/v1/completions", json={**payload, "logit_bias": {"x": 1}}) as r:
                bad = r.status, (await r.json())["error"]["param"]
            async with s.post(url + "/v1/completions", json={**payload, "logit_bias": {"99999999": 1}}) as r:
                outside = r.status
            return ok, bad, outside

    ok, bad, outside = _serve(tiny_ckpt, body)
    assert ok["choices"][0]["token_ids"] == [42, 42, 42] and bad == (400, "logit_bias") and outside == 400

