"""What a hostile or careless client can send, and what the server must still do: answer 4xx with OpenAI's error
body (never a 500), keep its event loop responsive, time out slow clients, and keep serving afterwards.

The corpus is generated: every request field with each kind of wrong value, pathological JSON, text that is not
valid Unicode, bodies that fail their Content-Encoding, and malformed HTTP (request lines, headers, framing). It is
sent over raw sockets, so nothing a client library would refuse to send is left out.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import threading
import time
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from helpers import wait_free
from hypothesis import strategies as st

from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams
from deltaserve.runtime.server import ServerOptions, serve
from deltaserve.runtime.speculation import SpeculationOverride

KEY = "sesame-open-2f9c41d7"  # longer than 8 characters: a check of a prefix alone would show
AUTH = {"Authorization": f"Bearer {KEY}"}
VOCAB_OUTSIDE = 10**9


async def raw_request(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """Send bytes as they are; (status, headers, body) of the reply (its Content-Length, or until the close)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        if "content-length" in headers:
            body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout)
        else:
            body = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    if headers.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    return int(lines[0].split()[1]), headers, body


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, data = out + rest[:n], rest[n + 2:]
    return out


def http(method: str, path: str, body: bytes = b"", headers: dict | None = None, auth: bool = True) -> bytes:
    """One HTTP/1.1 request; header values may be bytes (sent as they are)."""
    fields = {"Host": "localhost", "Connection": "close", **(AUTH if auth else {}), **(headers or {})}
    if "Content-Length" not in fields and "Transfer-Encoding" not in fields:
        fields["Content-Length"] = str(len(body))
    head = f"{method} {path} HTTP/1.1\r\n".encode()
    for k, v in fields.items():
        head += k.encode() + b": " + (v if isinstance(v, bytes) else v.encode()) + b"\r\n"
    return head + b"\r\n" + body


def post(path: str, body, **kw) -> bytes:
    data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode(
        "utf-8", "surrogatepass")
    return http("POST", path, data, {"Content-Type": "application/json", **kw.pop("headers", {})}, **kw)


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def base(path: str) -> dict:
    if path == COMPLETIONS:
        return {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def with_field(path: str, name: str, literal: str) -> bytes:
    """The base request with one field set to a raw JSON literal (NaN, 1e999 and 5,000-digit numbers included)."""
    text = json.dumps(base(path))
    return post(path, text[:-1] + f', "{name}": {literal}}}')


NUMBERS = {  # field -> out-of-range literals
    "max_tokens": ["0", "-1", "1000000", str(2**40)],
    "temperature": ["-0.5", "1000"],
    "top_p": ["0", "1.5", "-1"],
    "top_k": ["-2", str(2**40)],
    "min_p": ["-0.5", "2"],
    "seed": ["-1", str(2**64)],
    "presence_penalty": ["-3", "3"],
    "frequency_penalty": ["-3", "3"],
    "repetition_penalty": ["0", "-1", "11"],
    "min_tokens": ["-1", str(2**40), "17"],
}
INT_FIELDS = {"max_tokens", "top_k", "seed", "min_tokens"}
NON_NUMBERS = ['"1"', "[1]", '{"a": 1}']
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 5000]
OTHER_FIELDS = {
    "stop": ["1", "[1]", '{"a": 1}', json.dumps(["x"] * 17), json.dumps(["x" * 2000])],
    "stop_token_ids": ["[-1]", f"[{2**40}]", '"x"', "[1.5]", f"[{VOCAB_OUTSIDE}]"],
    "ignore_eos": ['"yes"', "1"],
    "skip_special_tokens": ['"no"', "0"],
    "include_stop_str_in_output": ['"no"'],
    "stream": ['"true"', "1"],
    "stream_options": ['"x"', '{"include_usage": true}'],
    "n": ["0", "129", '"1"'],
    "best_of": ["2"],
    "model": ["5", "[]", '"other"'],
    "logit_bias": ['{"1": 101}', '{"x": 5}', '[1]', f'{{"{VOCAB_OUTSIDE}": 1}}', '{"1": "5"}', '{"1": true}'],
}


def field_corpus() -> list[tuple[str, bytes]]:
    cases = []
    for path in (COMPLETIONS, CHAT):
        for name, literals in NUMBERS.items():
            if path == CHAT and name == "min_tokens" and literals == ["17"]:
                continue
            bad = literals + NON_NUMBERS + NON_FINITE
            if name in INT_FIELDS:
                bad = bad + ["1.5"]
            cases += [(f"{path} {name}={v[:20]}", with_field(path, name, v)) for v in bad
                      if not (path == CHAT and name == "min_tokens" and v == "17")]
        for name, literals in OTHER_FIELDS.items():
            cases += [(f"{path} {name}={v[:20]}", with_field(path, name, v)) for v in literals]
    cases += [(f"logprobs={v}", with_field(COMPLETIONS, "logprobs", v)) for v in ["-1", "21", '"x"', "NaN"]]
    cases += [(f"chat logprobs={v}", with_field(CHAT, "logprobs", v)) for v in ["3", '"yes"']]
    cases += [(f"top_logprobs={v}", post(CHAT, {**base(CHAT), "logprobs": True, "top_logprobs": v}))
              for v in [-1, 21, 10**9, "x"]]
    prompts = [5, [], [[]], [-1], [VOCAB_OUTSIDE], [1.5], {"a": 1}, "", [""], ["x"] * 65, [[1], "x"], None]
    cases += [(f"prompt={p!r:.20}", post(COMPLETIONS, {"model": "tiny", "prompt": p})) for p in prompts]
    cases.append(("prompt over the context", post(COMPLETIONS, {"model": "tiny", "prompt": [1] * 300})))
    messages = [[], "x", [1], [{"role": "bad", "content": "x"}], [{"role": "user", "content": 5}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None]
    cases += [(f"messages={m!r:.20}", post(CHAT, {"model": "tiny", "messages": m})) for m in messages]
    cases += [(f"chat_template_kwargs={v}", with_field(CHAT, "chat_template_kwargs", v))
              for v in ['"x"', "5", '{"messages": 1}']]
    return cases


def json_corpus() -> list[tuple[str, bytes]]:
    deep = '{"model": "tiny", "prompt": "x", "chat_template_kwargs": ' + '{"a": ' * 40 + "1" + "}" * 40 + "}"
    bodies = {
        "empty body": "", "whitespace": "   ", "null": "null", "a list": "[1, 2]", "a string": '"x"', "a number": "5",
        "true": "true", "truncated": '{"model": "tiny", "prompt": "x"', "trailing garbage": '{"prompt": "x"} xyz',
        "single quotes": "{'prompt': 'x'}", "nested 100k lists": "[" * 100_000 + "]" * 100_000,
        "nested 50k objects": '{"a": ' * 50_000 + "1" + "}" * 50_000, "nested 41 deep": deep,
        "numbers one level too deep": '{"model": "tiny", "prompt": "x", "chat_template_kwargs": ' + '{"a": ' * 30
                                      + "[1, 2]" + "}" * 30 + "}",
        "NaN top level": "NaN",
        "huge exponent": '{"model": "tiny", "prompt": "x", "temperature": 1e99999999}',
        "control character": '{"model": "tiny", "prompt": "a\x01b"',
    }
    return [(name, post(COMPLETIONS, body)) for name, body in bodies.items()]


def unicode_corpus() -> list[tuple[str, bytes]]:
    good = json.dumps(base(COMPLETIONS)).encode()
    return [
        ("invalid UTF-8 byte", good.replace(b'"hi"', b'"h\xff"')),
        ("overlong encoding", good.replace(b'"hi"', b'"\xc0\xaf"')),
        ("UTF-8 encoded surrogate", good.replace(b'"hi"', b'"\xed\xa0\x80"')),
        ("truncated sequence", good.replace(b'"hi"', b'"\xe2\x82"')),
        ("lone surrogate in prompt", good.replace(b'"hi"', b'"\\ud800"')),
        ("lone low surrogate", good.replace(b'"hi"', b'"x\\udfff"')),
        ("surrogate in a key", good.replace(b'"prompt"', b'"\\ud800", "prompt"')),
        ("surrogate in stop", good[:-1] + b', "stop": ["\\ud83d"]}'),
        ("surrogate in a message", json.dumps({"model": "tiny", "messages": [
            {"role": "user", "content": "\ud800"}]}).encode()),
        ("surrogate in the model name", good.replace(b'"tiny"', b'"t\\udc00"')),
    ]


def encoding_corpus() -> list[tuple[str, bytes]]:
    good = json.dumps(base(COMPLETIONS)).encode()
    bomb = gzip.compress(b"0" * (64 << 20))  # 64 MiB of zeros in 64 KiB: over the body limit once inflated
    return [
        ("gzip that is not gzip", post(COMPLETIONS, good, headers={"Content-Encoding": "gzip"})),
        ("deflate that is not deflate", post(COMPLETIONS, good, headers={"Content-Encoding": "deflate"})),
        ("truncated gzip", post(COMPLETIONS, gzip.compress(good)[:-12], headers={"Content-Encoding": "gzip"})),
        ("gzip of invalid JSON", post(COMPLETIONS, gzip.compress(b"{oops"), headers={"Content-Encoding": "gzip"})),
        ("deflate of a list", post(COMPLETIONS, zlib.compress(b"[1]"), headers={"Content-Encoding": "deflate"})),
        ("a gzip bomb", post(COMPLETIONS, bomb, headers={"Content-Encoding": "gzip"})),
        ("bad chunk size", post(COMPLETIONS, b"zz\r\n" + good + b"\r\n0\r\n\r\n",
                                headers={"Transfer-Encoding": "chunked"})),
        ("chunked body of invalid JSON", post(COMPLETIONS, b"5\r\n{oops\r\n0\r\n\r\n",
                                               headers={"Transfer-Encoding": "chunked"})),
        ("Content-Length not a number", post(COMPLETIONS, good, headers={"Content-Length": "abc"})),
        ("Content-Length and chunked", post(COMPLETIONS, good, headers={
            "Transfer-Encoding": "chunked", "Content-Length": str(len(good))})),
        ("body over 4 MiB", post(COMPLETIONS, b" " * (5 << 20))),
    ]


def header_corpus() -> list[tuple[str, bytes]]:
    good = json.dumps(base(COMPLETIONS)).encode()
    return [
        ("no Authorization", post(COMPLETIONS, good, auth=False)),
        ("wrong key", post(COMPLETIONS, good, auth=False, headers={"Authorization": "Bearer nope"})),
        ("key with invalid UTF-8", post(COMPLETIONS, good, auth=False, headers={"Authorization": b"Bearer \xff\xfe"})),
        ("Authorization with Latin-1", post(COMPLETIONS, good, auth=False,
                                            headers={"Authorization": b"Bearer caf\xe9"})),
        ("another scheme", post(COMPLETIONS, good, auth=False, headers={"Authorization": f"Basic {KEY}"})),
        ("a wrong key sharing the first 8 characters", post(COMPLETIONS, good, auth=False,
                                                            headers={"Authorization": f"Bearer {KEY[:8]}wrongkey"})),
        ("a proper prefix of the key", post(COMPLETIONS, good, auth=False,
                                            headers={"Authorization": f"Bearer {KEY[:-1]}"})),
        ("the key and one character more", post(COMPLETIONS, good, auth=False,
                                                headers={"Authorization": f"Bearer {KEY}x"})),
        ("an empty bearer token", post(COMPLETIONS, good, auth=False, headers={"Authorization": "Bearer "})),
        ("a bare scheme", post(COMPLETIONS, good, auth=False, headers={"Authorization": "Bearer"})),
        ("a header without a colon", post(COMPLETIONS, good, headers={"X-Broken\r\nNoColon": "x"})),
        ("a NUL in a header value", post(COMPLETIONS, good, headers={"X-Nul": b"a\x00b"})),
        ("a control byte in a header", post(COMPLETIONS, good, headers={"X-Ctl": b"a\x01b"})),
        ("an 8 KiB header", post(COMPLETIONS, good, headers={"X-Big": "x" * 9000})),
        ("200 headers", post(COMPLETIONS, good, headers={f"X-{i}": "x" for i in range(200)})),
        ("a space in a header name", post(COMPLETIONS, good, headers={"X Bad": "x"})),
        ("non-UTF-8 Content-Type", post(COMPLETIONS, b"{oops", headers={"Content-Type": b"application/\xffjson"})),
        ("garbage request line", b"GARBAGE\r\n\r\n"),
        ("no HTTP version", b"POST /v1/completions\r\n\r\n"),
        ("HTTP/9.9", b"POST /v1/completions HTTP/9.9\r\nHost: x\r\n\r\n"),
        ("a method nobody knows", http("BREW", COMPLETIONS)),
        ("GET on a POST route", http("GET", COMPLETIONS)),
        ("PUT on a POST route", http("PUT", CHAT, b"{}")),
        ("an unknown path", http("GET", "/v2/nothing")),
        ("a path with invalid UTF-8", b"GET /v1/\xff\xfe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        ("a space in the path", b"GET /v1/a b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    ]


def corpus() -> list[tuple[str, bytes]]:
    return field_corpus() + json_corpus() + unicode_corpus() + encoding_corpus() + header_corpus()


def with_server(ckpt, body, options: ServerOptions | None = None, **engine_kw):
    async def main():
        args = dict(model=ckpt, max_model_len=256, max_batch=8, cpu_memory_bytes=32 << 20, served_model_name="tiny")
        args.update(engine_kw)
        async with AsyncEngine(EngineArgs(**args)) as engine:
            runner = await serve(engine, "127.0.0.1", 0, options or ServerOptions(api_key=KEY))
            port = runner.addresses[0][1]
            try:
                return await body(engine, port)
            finally:
                await runner.cleanup()

    return asyncio.run(main())


def is_openai_error(body: bytes) -> bool:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]


def test_no_malformed_request_gets_a_500_or_takes_the_server_down(tiny_ckpt):
    cases = corpus()
    assert len(cases) >= 150, len(cases)

    async def body(engine, port):
        wrong = []
        for name, data in cases:
            status, _, reply = await raw_request(port, data)
            if not (400 <= status < 500 and is_openai_error(reply)):
                wrong.append((name, status, reply[:120]))
        assert not wrong, f"{len(wrong)} of {len(cases)} cases: {wrong}"
        # Still serving, healthy, and nothing left allocated.
        status, _, reply = await raw_request(port, post(COMPLETIONS, {"prompt": "ok", "max_tokens": 3}))
        assert status == 200 and json.loads(reply)["usage"]["completion_tokens"] <= 3  # "model" may be left out
        assert engine.healthy and await wait_free(engine)
        return True

    assert with_server(tiny_ckpt, body)


def test_auth_scheme_is_case_insensitive_and_a_full_queue_says_when_to_retry(tiny_ckpt):
    async def body(engine, port):
        good = json.dumps(base(COMPLETIONS)).encode()
        for scheme in ("bearer", "BEARER", "Bearer"):
            status, _, _ = await raw_request(port, post(COMPLETIONS, good, auth=False,
                                                        headers={"Authorization": f"{scheme} {KEY}"}))
            assert status == 200, scheme
        # The three admitted requests run one after another: on a loaded host that can take longer than the
        # default reply timeout, which bounds the harness, not the server.
        replies = await asyncio.gather(*[raw_request(port, post(COMPLETIONS, {**base(COMPLETIONS), "max_tokens": 30}),
                                                     timeout=120) for _ in range(12)])
        full = [(h, b) for s, h, b in replies if s == 503]
        assert full and all(h.get("retry-after") == "1" and json.loads(b)["error"]["code"] == "queue_full"
                            for h, b in full)
        return True

    assert with_server(tiny_ckpt, body, max_batch=1, prefill_slots=1, max_waiting=2)


def test_large_prompts_never_stall_the_event_loop(tiny_ckpt):
    """4 MB prompts are refused by their length alone; 200 kB ones are tokenised on worker threads. Either way a
    heartbeat on the server's loop never waits 80 ms, and a stream running beside them keeps its pace."""
    text = "the quick brown fox jumps over the lazy dog. " * 100_000
    huge = [post(COMPLETIONS, {"prompt": text[: 4_000_000 - i]}) for i in range(4)]
    large = [post(COMPLETIONS, {"prompt": text[: 200_000 - i]}) for i in range(4)]
    chats = [post(CHAT, {"messages": [{"role": "user", "content": text[: n - i]}]}) for n in (4_000_000, 200_000)
             for i in range(2)]

    async def body(engine, port):
        gaps = []

        async def heartbeat():
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        async def send_all():
            return await asyncio.gather(*[raw_request(port, data, timeout=60) for data in huge + large + chats])

        # The clients run on a loop of their own (another thread), as they would in another process: the
        # heartbeat measures the server's loop alone.
        beat = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.05)
        replies = await asyncio.to_thread(asyncio.run, send_all())
        beat.cancel()
        codes = [json.loads(b)["error"]["code"] for _, _, b in replies]
        assert [s for s, _, _ in replies] == [400] * 12 and codes == ["context_length_exceeded"] * 12
        # One 200 kB prompt tokenised on the loop would stall it ~110 ms (2 cores); the two text threads sharing
        # those cores with it already cost gaps of up to ~60 ms (one run of the full suite).
        assert max(gaps) < 0.080, f"the loop stalled for {max(gaps) * 1000:.0f} ms"
        return True

    assert with_server(tiny_ckpt, body, max_model_len=4096)


class Heartbeat:
    """The longest the server's loop went without running a 2 ms timer, while the clients run on a loop of their
    own (another thread), as they would in another process."""

    def __init__(self) -> None:
        self.gaps = [0.0]

    async def run(self, send):
        async def beat():
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                self.gaps.append(now - last)
                last = now

        task = asyncio.create_task(beat())
        await asyncio.sleep(0.05)
        try:
            return await asyncio.to_thread(asyncio.run, send())
        finally:
            task.cancel()


def test_per_request_work_is_bounded_and_done_off_the_loop(tiny_ckpt):
    """n = 128 choices with 4096 stop ids (the most a request may list) are checked once, not once a choice; more
    ids are refused; a non-streamed body of 64 x 16 tokens x 21 log-probs is made on a text thread; one that
    would pass a million entries is refused. Meanwhile the loop never stalls (each of the first two took seconds
    on the loop before)."""
    ids = [i % 500 for i in range(4096)]  # inside the tiny vocabulary
    many_ids = post(COMPLETIONS, {"prompt": "hi", "n": 128, "max_tokens": 2, "stop_token_ids": ids * 2})
    n_ids = post(COMPLETIONS, {"prompt": "hi", "n": 128, "max_tokens": 2, "stop_token_ids": ids})
    big_body = post(CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 64, "max_tokens": 16,
                           "logprobs": True, "top_logprobs": 20, "ignore_eos": True})
    too_big = post(CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 128, "logprobs": True,
                          "top_logprobs": 20})

    async def body(engine, port):
        beat = Heartbeat()

        async def send():
            return [await raw_request(port, data, timeout=300) for data in (many_ids, n_ids, big_body, too_big)]
        (s1, _, b1), (s2, _, b2), (s3, _, b3), (s4, _, b4) = await beat.run(send)
        assert s1 == 400 and "at most 4096" in json.loads(b1)["error"]["message"]
        assert s2 == 200 and len(json.loads(b2)["choices"]) == 128
        assert s3 == 200
        choices = json.loads(b3)["choices"]
        assert len(choices) == 64 and all(len(c["logprobs"]["content"]) == 16 for c in choices)
        assert all(len(e["top_logprobs"]) == 20 for c in choices for e in c["logprobs"]["content"])
        assert s4 == 400 and json.loads(b4)["error"]["param"] == "logprobs"
        assert max(beat.gaps) < 0.25, f"the loop stalled for {max(beat.gaps) * 1000:.0f} ms"
        return True

    assert with_server(tiny_ckpt, body, max_batch=32, max_waiting=256, max_model_len=1024)


def test_slow_clients_time_out(tiny_ckpt):
    options = ServerOptions(header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_timeout_s=0.5)

    async def body(engine, port):
        # Headers trickled a byte at a time: the connection is closed once they are 0.5 s late.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.perf_counter()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        while not reader.at_eof() and time.perf_counter() - started < 5.0:
            await asyncio.sleep(0.05)
            writer.write(b"y")
        closed_after = time.perf_counter() - started
        writer.close()
        assert reader.at_eof() and 0.5 <= closed_after < 1.5, closed_after

        # A body that stops arriving: 408 with OpenAI's body.
        data = http("POST", COMPLETIONS, b'{"prompt"', {"Content-Length": "100"}, auth=False)
        started = time.perf_counter()
        status, _, reply = await raw_request(port, data)
        assert status == 408 and is_openai_error(reply) and time.perf_counter() - started < 2.0

        # An idle keep-alive connection is closed after its timeout.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.perf_counter()
        rest = await asyncio.wait_for(reader.read(), 5.0)  # the reply, then EOF when the server closes
        assert b"200 OK" in rest and time.perf_counter() - started < 3.0
        writer.close()
        return True

    assert with_server(tiny_ckpt, body, options)


# The engine under random sampling parameters and prompts -----------------------------------------------------------
class EngineThread:
    """An engine on its own event loop thread, so Hypothesis examples (plain functions) can share it."""

    def __init__(self, args: EngineArgs, override: SpeculationOverride | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = AsyncEngine(args, speculation_override=override)
        self.run(self.engine.start())

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.engine.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


# The speculative engine keeps drafts on an emulated acceptance (random weights accept none), so its overlapped
# steps take several tokens a row on the device, past stop ids, min_tokens and max_tokens caps.
@pytest.fixture(scope="module", params=[0, 3], ids=["plain", "speculative"])
def fuzz_engine(tiny_ckpt, request):
    k = request.param
    runner = EngineThread(EngineArgs(model=tiny_ckpt, max_model_len=96, max_batch=4, prefill_slots=2,
                                     cpu_memory_bytes=32 << 20, speculative_tokens=k, speculative_adaptive=False),
                          SpeculationOverride(acceptance=(0.9, 0.7, 0.5)) if k else None)
    yield runner
    runner.close()


_WILD_INTS = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70), st.sampled_from(
    [0, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63), 10**30]))
_WILD_FLOATS = st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
    [0.0, -0.0, 1e-30, 100.0, 1e300, float("nan"), float("inf"), float("-inf")]))
_INT_FIELDS = ("max_tokens", "min_tokens", "top_k", "seed", "logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _requests(vocab: int):
    """Requests in range (edges included: top_k at and past the vocabulary, 20 log-probs, temperature 0), each
    with up to two fields then set to anything at all (NaN, infinities, integers far past int64, ids outside the
    vocabulary), so both the served and the refused paths are walked."""
    token = st.integers(0, vocab - 1)
    valid = st.fixed_dictionaries({}, optional={
        "max_tokens": st.integers(1, 12), "min_tokens": st.integers(0, 8), "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1), "top_k": st.one_of(st.integers(-1, 40), st.sampled_from([vocab - 1, vocab,
                                                                                             2**31 - 1])),
        "min_p": st.floats(0, 1), "seed": st.integers(0, 2**63 - 1), "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.01, 10),
        "logprobs": st.integers(0, 20), "stop_token_ids": st.lists(token, max_size=3),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
    })
    wild = st.one_of(
        st.tuples(st.sampled_from(_INT_FIELDS), _WILD_INTS),
        st.tuples(st.sampled_from(_FLOAT_FIELDS), _WILD_FLOATS),
        st.tuples(st.just("stop_token_ids"), st.lists(st.one_of(_WILD_INTS, st.integers(vocab - 2, vocab + 2)),
                                                      min_size=1, max_size=3)),
    )
    corrupted = st.one_of(st.just({}), st.lists(wild, min_size=1, max_size=2).map(dict))
    params = st.tuples(valid, corrupted).map(lambda pair: {**pair[0], **pair[1]})
    prompt = st.one_of(st.lists(token, min_size=1, max_size=100), st.text(min_size=1, max_size=80),
                       st.lists(st.integers(-2, vocab + 2), max_size=40))
    return st.lists(st.tuples(prompt, params), min_size=1, max_size=6)


def test_fuzzed_sampling_params_and_prompts_never_hurt_the_engine(fuzz_engine):
    """Every request is refused with a ValueError naming the problem, or runs to a normal finish; the engine
    stays healthy and, once they are done, holds nothing."""
    engine = fuzz_engine.engine
    vocab = engine.cfg.vocab_size
    served = []

    async def one(prompt, kwargs):
        try:
            params = SamplingParams(**kwargs)
            stream = engine.generate(prompt, params)
        except ValueError:  # CapacityError and PromptTooLong are ValueErrors too
            return None
        last = None
        async for out in stream:
            last = out
        return params, last

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_requests(vocab))
    def example(requests):
        async def batch():
            return await asyncio.gather(*[one(p, k) for p, k in requests])

        for result in fuzz_engine.run(batch()):
            if result is None:
                continue
            params, out = result
            served.append(out)
            assert out.finished and out.finish_reason in ("stop", "length"), out
            assert all(0 <= t < vocab for t in out.token_ids)
            assert params.max_tokens is None or len(out.token_ids) <= params.max_tokens
        assert engine.healthy

    example()
    assert len(served) >= 20, f"only {len(served)} fuzzed requests were valid: the strategy tests little"
    if engine.args.speculative_tokens:
        assert engine.metrics.spec_accepted._value.get() > 0  # drafts were kept, overlapped steps took them

    assert fuzz_engine.run(wait_free(engine))
