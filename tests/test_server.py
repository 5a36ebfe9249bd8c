"""The OpenAI-compatible server, driven by the official `openai` client and by raw HTTP for bad input."""

import asyncio
import json
import logging
import socket

import aiohttp
import openai
import pytest
from helpers import wait_free

from deltaserve.runtime import AsyncEngine, EngineArgs
from deltaserve.runtime.server import ServerOptions, serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_server(ckpt, body, api_key=None, **engine_kw):
    async def main():
        args = dict(model=ckpt, max_model_len=256, max_batch=8, cpu_memory_bytes=32 << 20,
                    served_model_name="tiny")
        args.update(engine_kw)
        async with AsyncEngine(EngineArgs(**args)) as engine:
            port = free_port()
            runner = await serve(engine, "127.0.0.1", port, ServerOptions(api_key=api_key))
            try:
                return await body(engine, f"http://127.0.0.1:{port}")
            finally:
                await runner.cleanup()

    return asyncio.run(main())


def test_openai_client_completions_and_chat(tiny_ckpt):
    async def body(engine, url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused")
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]

        plain = await client.completions.create(model="tiny", prompt="the river", max_tokens=12, temperature=0,
                                                logprobs=2, extra_body={"ignore_eos": True})
        choice = plain.choices[0]
        assert plain.usage.completion_tokens == 12 and plain.usage.prompt_tokens > 0
        assert len(choice.logprobs.tokens) == 12 and len(choice.logprobs.top_logprobs[0]) == 2

        pieces, usage = [], None
        stream = await client.completions.create(model="tiny", prompt="the river", max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                pieces.append(c.text)
        assert "".join(pieces) == choice.text  # streamed text equals the non-streamed text
        assert usage.completion_tokens == 12 and usage.total_tokens == usage.prompt_tokens + 12

        messages = [{"role": "user", "content": "What is two plus two?"}]
        chat = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                    logprobs=True, top_logprobs=3,
                                                    extra_body={"ignore_eos": True})
        msg = chat.choices[0].message
        assert msg.role == "assistant" and chat.usage.completion_tokens == 10
        assert len(chat.choices[0].logprobs.content) == 10
        assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
        # Thinking is on by default: text before </think> is reasoning.
        reasoning = getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get("reasoning_content")
        assert reasoning is not None

        content, reasoning_parts, finish, usage = [], [], None, None
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                extra = c.delta.model_extra or {}
                reasoning_parts.append(extra.get("reasoning_content") or "")
                content.append(c.delta.content or "")
                finish = c.finish_reason or finish
        assert "".join(reasoning_parts) == reasoning and "".join(content) == (msg.content or "")
        assert finish == "length" and usage.completion_tokens == 10

        no_think = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
        assert (no_think.choices[0].message.model_extra or {}).get("reasoning_content") is None

        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as health:
                assert health.status == 200 and (await health.json())["status"] == "ok"
        return True

    assert with_server(tiny_ckpt, body)


BAD = [
    # (path, raw body or JSON object, status, param)
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", {"model": 5, "prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [3, -1]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, True]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2.0]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [[1, 2], [3, True]]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [[1, 2], []]}, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi " * 400}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": "warm"}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_k": -3}, 400, "top_k"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"], "n": 65}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": 7}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 2000}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": "think"}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/chat/completions", "x" * (5 << 20), 413, None),
]


def test_bad_input_gets_the_right_status_and_error_body(tiny_ckpt):
    assert len(BAD) >= 25

    async def body(engine, url):
        async with aiohttp.ClientSession() as session:
            for path, payload, status, param in BAD:
                data = payload if isinstance(payload, str) else json.dumps(payload)
                async with session.post(url + path, data=data, headers={"Content-Type": "application/json"}) as r:
                    got = await r.json()
                    assert r.status == status, (payload if len(data) < 200 else data[:50], r.status, got)
                    err = got["error"]
                    assert set(err) == {"message", "type", "param", "code"} and err["message"]
                    assert err["param"] == param, (payload, err)
            async with session.get(url + "/nowhere") as r:
                assert r.status == 404 and "error" in await r.json()
            # Still serving, and nothing leaked.
            async with session.post(url + "/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 3}) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] <= 3
        assert await wait_free(engine)
        return True

    assert with_server(tiny_ckpt, body)


def test_api_key_is_required_when_set(tiny_ckpt):
    async def body(engine, url):
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/v1/models") as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
            async with session.get(url + "/v1/models", headers={"Authorization": "Bearer sesame"}) as r:
                assert r.status == 200
            async with session.get(url + "/health") as r:
                assert r.status == 200
        return True

    assert with_server(tiny_ckpt, body, api_key="sesame")


def test_disconnect_mid_stream_aborts_and_metrics_report(tiny_ckpt, caplog):
    async def body(engine, url):
        async with aiohttp.ClientSession() as session:
            resp = await session.post(url + "/v1/completions", json={
                "model": "tiny", "prompt": "a long story", "max_tokens": 200, "stream": True, "ignore_eos": True})
            await resp.content.readline()  # the first event arrived
            assert engine.scheduler.requests
            resp.close()  # drop the connection mid-stream
        assert await wait_free(engine), "the disconnected request still holds its slot"
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/metrics") as r:
                text = await r.text()
        assert 'deltaserve_requests_finished_total{finish_reason="abort"} 1.0' in text
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # a client leaving is not an error
        for name in ("deltaserve_time_to_first_token_seconds", "deltaserve_request_queue_time_seconds",
                     "deltaserve_request_prefill_time_seconds", "deltaserve_inter_token_latency_seconds",
                     "deltaserve_e2e_request_latency_seconds", "deltaserve_prompt_tokens_total",
                     "deltaserve_generation_tokens_total", "deltaserve_kv_pages_usage_ratio",
                     "deltaserve_decode_slots_usage_ratio", "deltaserve_requests_running",
                     "deltaserve_requests_waiting"):
            assert name in text, name
        return True

    assert with_server(tiny_ckpt, body)


def test_full_queue_answers_503(tiny_ckpt):
    async def body(engine, url):
        async with aiohttp.ClientSession() as session:
            statuses = await asyncio.gather(*[
                session.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 30})
                for _ in range(12)
            ])
            codes = sorted(r.status for r in statuses)
            bodies = [await r.json() for r in statuses]
        assert 503 in codes and 200 in codes
        assert all(b["error"]["type"] == "service_unavailable" for b in bodies if "error" in b)
        return True

    assert with_server(tiny_ckpt, body, max_batch=1, prefill_slots=1, max_waiting=2)


def test_n_above_the_queue_is_a_400_not_a_503_to_retry(tiny_ckpt):
    """A request whose choices could never be queued together is refused for good (a 503 with Retry-After would
    be retried forever); the same n fits a server with a longer queue."""
    async def body(engine, url):
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 3}) as r:
                assert r.status == 400 and "Retry-After" not in r.headers
                assert (await r.json())["error"]["param"] == "n"
            async with session.post(url + "/v1/completions", json={"prompt": ["x", "y"], "max_tokens": 2}) as r:
                assert r.status == 200
        return True

    assert with_server(tiny_ckpt, body, max_waiting=2)


def _gauges(text: str) -> dict[str, float]:
    names = ("requests_running", "requests_waiting", "kv_pages_usage_ratio", "decode_slots_usage_ratio",
             "prefix_cache_snapshots_usage_ratio")
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("deltaserve_") and name[len("deltaserve_"):] in names:
            values[name[len("deltaserve_"):]] = float(value)
    assert len(values) == len(names), values
    return values


@pytest.mark.parametrize("overlap", [True, False])
def test_metrics_gauges_follow_the_load(tiny_ckpt, overlap):
    """Under 40 concurrent requests (default scheduling: overlapped) the gauges show requests running and waiting,
    pages, slots and snapshots in use; once all have finished, nothing runs or waits."""
    async def body(engine, url):
        async with aiohttp.ClientSession() as session:
            async def one(i):
                async with session.post(url + "/v1/completions", json={
                        "prompt": f"request {i} " * 8, "max_tokens": 40, "ignore_eos": True}) as r:
                    assert r.status == 200
            tasks = [asyncio.create_task(one(i)) for i in range(40)]
            seen = []
            while not all(t.done() for t in tasks):
                async with session.get(url + "/metrics") as r:
                    seen.append(_gauges(await r.text()))
                await asyncio.sleep(0.02)
            await asyncio.gather(*tasks)
            async with session.get(url + "/metrics") as r:
                after = _gauges(await r.text())
        for name in ("requests_running", "requests_waiting", "kv_pages_usage_ratio", "decode_slots_usage_ratio",
                     "prefix_cache_snapshots_usage_ratio"):
            assert max(g[name] for g in seen) > 0, name
        assert after["requests_running"] == after["requests_waiting"] == 0
        assert after["decode_slots_usage_ratio"] == 0
        return True

    assert with_server(tiny_ckpt, body, async_scheduling=overlap)


def test_a_failed_device_turns_health_and_new_requests_into_503(tiny_ckpt):
    async def body(engine, url):
        runtime = engine.replica.ranks[0].runtime

        def broken(*args, **kwargs):
            raise RuntimeError("device fell over")

        runtime.model.forward = broken
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={
                    "model": "tiny", "prompt": "hi", "max_tokens": 5, "ignore_eos": True}) as r:
                err = (await r.json())["error"]
                assert r.status == 503 and err["code"] == "engine_failed"
                assert "fell over" not in err["message"]  # the cause is the server log's, not the client's
            async with session.get(url + "/health") as r:
                assert r.status == 503 and await r.json() == {"status": "unhealthy"}
            async with session.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}) as r:
                assert r.status == 503 and (await r.json())["error"]["type"] == "service_unavailable"
        return True

    assert with_server(tiny_ckpt, body)


# Edges ----------------------------------------------------------------------------------------------------------------
BOOLEANS_FOR_NUMBERS = [
    ("/v1/completions", "max_tokens"), ("/v1/completions", "temperature"), ("/v1/completions", "top_k"),
    ("/v1/completions", "top_p"), ("/v1/completions", "seed"), ("/v1/completions", "logprobs"),
    ("/v1/completions", "presence_penalty"), ("/v1/completions", "min_tokens"), ("/v1/completions", "n"),
    ("/v1/chat/completions", "max_completion_tokens"), ("/v1/chat/completions", "top_logprobs"),
    ("/v1/chat/completions", "frequency_penalty"), ("/v1/chat/completions", "repetition_penalty"),
]


def request_body(path: str, **fields) -> dict:
    if path == "/v1/completions":
        return {"model": "tiny", "prompt": "hi", **fields}
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


async def post(session, url, body):
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


def test_booleans_are_refused_for_numeric_fields(tiny_ckpt):
    async def body(engine, url):
        async with aiohttp.ClientSession() as session:
            for path, name in BOOLEANS_FOR_NUMBERS:
                for value in (True, False):
                    extra = {"logprobs": True} if name == "top_logprobs" else {}
                    status, got = await post(session, url + path, request_body(path, **{name: value}, **extra))
                    assert status == 400 and got["error"]["param"] == name, (name, value, got)
        return True

    assert with_server(tiny_ckpt, body)


def test_usage_reports_the_prompt_tokens_a_cached_prefix_spared(tiny_ckpt, caplog):
    """The next turn of a conversation resends the last prompt: usage (and the access log) says how much of it was
    not prefilled."""
    async def body(engine, url):
        first, turn = list(range(3, 40)), list(range(3, 40)) + [5, 6, 7]
        async with aiohttp.ClientSession() as session:
            cached = []
            for prompt in (first, turn):
                status, got = await post(session, url + "/v1/completions", request_body(
                    "/v1/completions", prompt=prompt, max_tokens=2))
                assert status == 200, got
                cached.append(got["usage"]["prompt_tokens_details"]["cached_tokens"])
        return cached

    with caplog.at_level(logging.INFO, logger="deltaserve.access"):
        assert with_server(tiny_ckpt, body) == [0, 37]
    lines = [r.getMessage() for r in caplog.records if r.name == "deltaserve.access"]
    assert len(lines) == 2 and "cached" not in lines[0] and lines[1].endswith("prompt=40 completion=2 cached=37")


def test_a_refused_requests_access_line_says_why(tiny_ckpt, caplog):
    async def body(engine, url):
        async with aiohttp.ClientSession() as session:
            status, _ = await post(session, url + "/v1/completions", {"prompt": "x", "max_tokens": -1})
            assert status == 400
            status, _ = await post(session, url + "/v1/completions", {"prompt": "x", "stop": ["y" * 5000]})
            assert status == 400
        return True

    with caplog.at_level(logging.INFO, logger="deltaserve.access"):
        assert with_server(tiny_ckpt, body)
    lines = [r.getMessage() for r in caplog.records if r.name == "deltaserve.access"]
    assert " 400 " in lines[0] and "error='max_tokens: max_tokens must be >= 1, got -1'" in lines[0], lines[0]
    assert "error='stop" in lines[1] and len(lines[1]) < 400, lines[1]  # the reason, truncated


def test_a_prompt_at_the_context_length_is_refused_and_one_token_under_is_served(tiny_ckpt):
    async def body(engine, url):
        n = engine.max_model_len
        assert n == 256
        async with aiohttp.ClientSession() as session:
            for length in (n, n + 1):
                status, got = await post(session, url + "/v1/completions",
                                         request_body("/v1/completions", prompt=[7] * length, max_tokens=1))
                assert status == 400 and got["error"]["code"] == "context_length_exceeded", (length, got)
                assert got["error"]["param"] == "prompt"
            status, got = await post(session, url + "/v1/completions", request_body(
                "/v1/completions", prompt=[7] * (n - 1), max_tokens=1, ignore_eos=True))
            assert status == 200 and got["usage"] == {"prompt_tokens": n - 1, "completion_tokens": 1,
                                                      "total_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}
            status, got = await post(session, url + "/v1/completions", request_body(
                "/v1/completions", prompt=[7] * (n - 1), max_tokens=2))
            assert status == 400 and got["error"]["param"] == "max_tokens"
        return True

    assert with_server(tiny_ckpt, body)


def test_multi_prompt_completions_streamed_and_not(tiny_ckpt):
    prompts = ["the river", "a mill by the water runs", [5, 6, 7, 8]]

    async def body(engine, url):
        common = dict(max_tokens=7, temperature=0, ignore_eos=True, logprobs=1)
        async with aiohttp.ClientSession() as session:
            solo = []
            for p in prompts:
                status, got = await post(session, url + "/v1/completions",
                                         request_body("/v1/completions", prompt=p, **common))
                assert status == 200
                solo.append(got["choices"][0]["text"])
            status, got = await post(session, url + "/v1/completions", request_body(
                "/v1/completions", prompt=prompts[:2], **common))
            assert status == 200 and [c["index"] for c in got["choices"]] == [0, 1]
            assert [c["text"] for c in got["choices"]] == solo[:2]
            assert all(c["finish_reason"] == "length" and len(c["logprobs"]["tokens"]) == 7 for c in got["choices"])
            assert got["usage"]["completion_tokens"] == 14
            status, got = await post(session, url + "/v1/completions", request_body(
                "/v1/completions", prompt=[[5, 6, 7, 8], [5, 6, 7, 8]], **common))
            assert [c["text"] for c in got["choices"]] == [solo[2]] * 2

            texts, finishes, usage = ["", ""], [[], []], None
            async with session.post(url + "/v1/completions", json=request_body(
                    "/v1/completions", prompt=prompts[:2], stream=True, stream_options={"include_usage": True},
                    **common)) as r:
                events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            for event in map(json.loads, events[:-1]):
                usage = event.get("usage") or usage
                for c in event["choices"]:
                    texts[c["index"]] += c["text"]
                    if c["finish_reason"]:
                        finishes[c["index"]].append(c["finish_reason"])
            assert texts == solo[:2] and finishes == [["length"], ["length"]]
            assert usage["completion_tokens"] == 14
        return True

    assert with_server(tiny_ckpt, body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_choices_streamed_and_not(tiny_ckpt, path):
    """n choices of one prompt: greedy ones equal the single answer; seeded sampled ones differ from each other
    and come back the same when asked again; the prompt counts once in the usage, every choice's tokens count."""
    def text(part):  # a completion's text, or a chat message's (its reasoning first: the template opens it)
        return part["text"] if "text" in part else part.get("reasoning_content", "") + (part.get("content") or "")

    def texts_of(got):
        return [text(c) if "text" in c else text(c["message"]) for c in got["choices"]]

    async def body(engine, url):
        common = dict(max_tokens=6, ignore_eos=True) if path == "/v1/completions" else \
            dict(max_completion_tokens=6, ignore_eos=True)
        async with aiohttp.ClientSession() as session:
            before = engine.metrics.prompt_tokens._value.get()
            status, greedy = await post(session, url + path, request_body(path, n=3, temperature=0, **common))
            prefilled = engine.metrics.prompt_tokens._value.get() - before
            assert status == 200 and [c["index"] for c in greedy["choices"]] == [0, 1, 2]
            assert prefilled == greedy["usage"]["prompt_tokens"]  # one prefill; the other choices resume after it
            _, one = await post(session, url + path, request_body(path, temperature=0, **common))
            assert texts_of(greedy) == texts_of(one) * 3
            assert greedy["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
            assert greedy["usage"]["completion_tokens"] == 18

            sampled = [await post(session, url + path, request_body(path, n=4, best_of=4, temperature=1.0, seed=7,
                                                                     **common)) for _ in range(2)]
            assert texts_of(sampled[0][1]) == texts_of(sampled[1][1])  # reproducible
            assert len(set(texts_of(sampled[0][1]))) > 1  # the choices' seeds differ

            texts, finishes, usage = [""] * 4, [[] for _ in range(4)], None
            async with session.post(url + path, json=request_body(
                    path, n=4, temperature=1.0, seed=7, stream=True, stream_options={"include_usage": True},
                    **common)) as r:
                events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            for event in map(json.loads, events[:-1]):
                usage = event.get("usage") or usage
                for c in event["choices"]:
                    texts[c["index"]] += text(c) if "text" in c else text(c["delta"])
                    if c["finish_reason"]:
                        finishes[c["index"]].append(c["finish_reason"])
            assert texts == texts_of(sampled[0][1]) and finishes == [["length"]] * 4
            assert usage["completion_tokens"] == 24 and usage["prompt_tokens"] == one["usage"]["prompt_tokens"]
        aborted = engine.metrics.finished.labels("abort")._value.get()
        async with aiohttp.ClientSession() as session:  # a client gone mid-stream takes all its choices with it
            async with session.post(url + path, json=request_body(path, n=3, stream=True, **{
                    **common, "max_tokens" if path == "/v1/completions" else "max_completion_tokens": 200})) as r:
                await r.content.readline()
        assert await wait_free(engine) and not engine.requests
        assert engine.metrics.finished.labels("abort")._value.get() - aborted == 3
        return True

    assert with_server(tiny_ckpt, body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_device_failure_mid_stream_sends_an_error_event_then_done(tiny_ckpt, path):
    async def body(engine, url):
        runtime = engine.replica.ranks[0].runtime
        decode, calls = runtime.model.forward, []

        def fails_later(*args, **kwargs):
            calls.append(1)
            if len(calls) > 4:
                raise RuntimeError("device fell over mid-stream")
            return decode(*args, **kwargs)

        runtime.model.forward = fails_later
        async with aiohttp.ClientSession() as session:
            async with session.post(url + path, json=request_body(
                    path, max_tokens=50, ignore_eos=True, stream=True)) as r:
                assert r.status == 200  # the stream had begun
                events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        payloads = [json.loads(e) for e in events[:-1]]
        assert "error" in payloads[-1] and payloads[-1]["error"]["code"] == "engine_failed"
        assert set(payloads[-1]["error"]) == {"message", "type", "param", "code"}
        assert not any(c.get("finish_reason") for p in payloads[:-1] for c in p.get("choices", []))
        assert len(payloads) >= 4  # tokens were streamed before the failure
        return True

    assert with_server(tiny_ckpt, body)


def test_add_generation_prompt_is_honoured_and_errors_name_no_internals(tiny_ckpt):
    """`add_generation_prompt` (vLLM's field, or inside chat_template_kwargs) renders the conversation without the
    assistant's opening; the prompt is one generation prompt shorter. A bad value is a 400 naming the field, in
    the client's terms, not our functions'."""
    async def body(engine, url):
        path = url + "/v1/chat/completions"
        messages = [{"role": "user", "content": "hello there"}]
        async with aiohttp.ClientSession() as session:
            usage = []
            for extra in ({}, {"chat_template_kwargs": {"add_generation_prompt": False}},
                          {"add_generation_prompt": False}):
                status, got = await post(session, path, {"messages": messages, "max_tokens": 2, **extra})
                assert status == 200, got
                usage.append(got["usage"]["prompt_tokens"])
            assert usage[1] == usage[2] < usage[0]
            for bad in ({"chat_template_kwargs": {"add_generation_prompt": "no"}},
                        {"chat_template_kwargs": {"messages": []}}, {"add_generation_prompt": 1}):
                status, got = await post(session, path, {"messages": messages, "max_tokens": 2, **bad})
                message = got["error"]["message"]
                assert status == 400 and ("add_generation_prompt" in message or "messages" in message), message
                assert "deltaserve" not in message and "()" not in message, message
        return True

    assert with_server(tiny_ckpt, body)


def test_chat_message_forms_and_max_completion_tokens(tiny_ckpt, tmp_path):
    async def body(engine, url):
        path = url + "/v1/chat/completions"
        common = dict(temperature=0, ignore_eos=True, max_tokens=6, logprobs=True, top_logprobs=5)
        async with aiohttp.ClientSession() as session:
            system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
            as_system = await post(session, path, {"model": "tiny", "messages": system, **common})
            developer = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hello there"}]
            as_developer = await post(session, path, {"model": "tiny", "messages": developer, **common})
            parts = [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text",
                                                                                        "text": "brief"}]},
                     {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
            as_parts = await post(session, path, {"model": "tiny", "messages": parts, **common})
            other = [{"role": "user", "content": "hello there"}]
            without = await post(session, path, {"model": "tiny", "messages": other, **common})
            capped = await post(session, path, {"model": "tiny", "messages": other, **common,
                                                "max_completion_tokens": 3})
        # The developer role is the system role; text parts are the same text as a string.
        assert as_developer == (200, as_developer[1]) and as_developer[1]["usage"] == as_system[1]["usage"]
        assert as_developer[1]["choices"] == as_system[1]["choices"] == as_parts[1]["choices"]
        assert as_parts[1]["usage"] == as_system[1]["usage"]
        assert without[1]["usage"]["prompt_tokens"] < as_system[1]["usage"]["prompt_tokens"]
        # The log-probs see the whole prompt (a random model's greedy text may not): another prompt moves them.
        assert without[1]["choices"][0]["logprobs"] != as_system[1]["choices"][0]["logprobs"]
        assert capped[0] == 200 and capped[1]["usage"]["completion_tokens"] == 3  # it wins over max_tokens
        assert capped[1]["choices"][0]["finish_reason"] == "length"
        return True

    # Bit-for-bit equal outputs mean equal prompts only without the prefix cache: a prompt resumed from a cached
    # prefix agrees with a cold one within fp32 rounding (tests/test_prefix_cache.py).
    assert with_server(tiny_ckpt, body, enable_prefix_caching=False)


def test_a_chat_template_error_is_a_400(tiny_ckpt, tmp_path):
    import shutil

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(tiny_ckpt, ckpt)
    with open(f"{ckpt}/chat_template.jinja", "w") as f:
        f.write("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}"
                "{% endif %}{{ m['content'] }}{% endfor %}")

    async def body(engine, url):
        async with aiohttp.ClientSession() as session:
            status, got = await post(session, url + "/v1/chat/completions", {
                "model": "tiny", "messages": [{"role": "tool", "content": "x"}], "max_tokens": 2})
            assert status == 400 and "no tools here" in got["error"]["message"]
            assert got["error"]["param"] == "messages" and got["error"]["type"] == "invalid_request_error"
            status, got = await post(session, url + "/v1/chat/completions", {
                "model": "tiny", "messages": [{"role": "user", "content": "fine"}], "max_tokens": 2})
            assert status == 200
        assert engine.healthy
        return True

    assert with_server(ckpt, body)


def test_completions_return_token_ids_as_vllm_does(tiny_ckpt):
    """`return_token_ids`: the non-streamed choice carries the prompt's and the answer's ids, each streamed chunk
    its new ids, which add up to the answer; a non-boolean is a 400 naming the field."""
    async def main():
        async with AsyncEngine(EngineArgs(model=tiny_ckpt, max_model_len=256, max_batch=2,
                                          cpu_memory_bytes=32 << 20)) as engine:
            runner = await serve(engine, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 7, "ignore_eos": True, "temperature": 0,
                    "return_token_ids": True}
            try:
                async with aiohttp.ClientSession() as session:
                    async with session.post(url, json=body) as r:
                        whole = await r.json()
                    async with session.post(url, json={**body, "stream": True}) as r:
                        lines = [ln[6:] for ln in (await r.text()).splitlines() if ln.startswith("data: ")]
                    async with session.post(url, json={**body, "return_token_ids": "yes"}) as r:
                        bad = (r.status, await r.json())
            finally:
                await runner.cleanup()
        return whole, [json.loads(x) for x in lines[:-1]], bad

    whole, chunks, bad = asyncio.run(main())
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == [5, 6, 7, 8] and len(choice["token_ids"]) == 7
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert bad[0] == 400 and bad[1]["error"]["param"] == "return_token_ids"
