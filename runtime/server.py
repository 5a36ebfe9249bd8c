"""OpenAI-compatible HTTP server (aiohttp): completions, chat completions, SSE streaming, models, health, metrics.

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}, whatever the body or headers held: a
request is parsed strictly (no NaN or infinity, no number a float cannot hold, no invalid Unicode, bounded
nesting) and any other failure of a handler is a logged 500 with no internals in the body. A client that
disconnects cancels its handler (aiohttp handler cancellation), which aborts the request and frees its slot and
pages. `shutdown` ends live streams with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import math
import socket
from dataclasses import dataclass

from aiohttp import web

from deltaserve import __version__
from deltaserve.args import SERVER_OPTIONS
from .engine import AsyncEngine, CapacityError, EngineDeadError, QueueFullError, RequestOutput
from .connection import ERROR_KEY, USAGE_KEY, AccessLogger, AppRunner, access_log, check_aiohttp
from .openai_protocol import (
    ApiError,
    ParsedRequest,
    chat_logprobs,
    completion_logprobs,
    new_id,
    prompt_completion_logprobs,
    vllm_prompt_logprobs,
    now,
    parse_chat,
    parse_completion,
    usage,
)
from .text import PromptTooLong, ReasoningSplitter, prompt_opens_reasoning
from .responses import ResponseWriter, chat_body, responses_usage
from .tool_calls import CallArguments, CallStart, Content, detect_parser, merged, new_parser
from .grammar import tool_call_grammar

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
MAX_JSON_DEPTH = 32  # the deepest a valid request goes is about 5 (messages[i].content[j].text)
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client
_LARGE_BODY_BYTES = 256 << 10
# A non-streamed response's log-prob entries (tokens x (1 + top)): at most this many, about 100 MB of JSON, and
# made off the event loop above the second figure.
MAX_RESPONSE_LOGPROBS = 1 << 20
_INLINE_LOGPROB_ENTRIES = 4096


@dataclass
class ServerOptions:
    """The HTTP server's own options (the embedded `serve`'s; `deltaserve serve` makes them from its flags), each
    checked by its row of `deltaserve.args.SERVER_OPTIONS`."""

    api_key: str | None = None
    header_timeout_s: float = 10.0  # from a request's first byte to the end of its headers
    body_timeout_s: float = 30.0  # reading a request's body
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    access_log: bool = True
    tool_call_parser: str | None = None  # "qwen3_coder" or "hermes"; None: the chat template's format

    def __post_init__(self) -> None:
        for name, option in SERVER_OPTIONS.items():
            if hasattr(self, name):
                option.check(getattr(self, name))


ENGINE_KEY = web.AppKey("engine", AsyncEngine)
OPTIONS_KEY = web.AppKey("options", ServerOptions)


def _unavailable(engine: AsyncEngine) -> ApiError:
    """503 for a request the engine cannot serve; a failure's cause stays in the server's log."""
    if engine.shutting_down:
        return ApiError(503, "the server is shutting down", code="unavailable")
    return ApiError(503, "the engine failed; the cause is in the server log", code="engine_failed")


def _json_error(request: web.Request, err: ApiError) -> web.Response:
    request[ERROR_KEY] = err.message if err.param is None else f"{err.param}: {err.message}"  # the access line's
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as err:
        return _json_error(request, err)
    except web.HTTPRequestEntityTooLarge:
        return _json_error(request, ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes",
                                             code="body_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _json_error(request, ApiError(exc.status, exc.reason or "error", type_="invalid_request_error"))
    except QueueFullError as exc:
        return _json_error(request, ApiError(503, str(exc), code="queue_full",
                                             headers={"Retry-After": str(RETRY_AFTER_S)}))
    except EngineDeadError:
        return _json_error(request, _unavailable(request.app[ENGINE_KEY]))
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:  # the client left mid-write: the connection layer drops it quietly
        raise
    except Exception:
        log.exception("unhandled error serving %s", request.path)
        return _json_error(request, ApiError(500, "internal server error"))


@web.middleware
async def _auth(request: web.Request, handler):
    key = request.app[OPTIONS_KEY].api_key
    if key and request.path.startswith("/v1/"):
        scheme, _, sent = request.headers.get("Authorization", "").partition(" ")
        # Header text that was not UTF-8 arrives with surrogate escapes: turned back into its bytes, it just
        # fails to match.
        sent_bytes = sent.strip().encode("utf-8", "surrogateescape")
        if not (hmac.compare_digest(sent_bytes, key.encode()) and scheme.lower() == "bearer"):
            raise ApiError(401, "missing or invalid API key", code="invalid_api_key")
    return await handler(request)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} does not fit a 64-bit float")
    return value


_SCALAR_TYPES = {int, float, bool, type(None)}


def _check_json_values(body) -> None:
    """Bounded nesting, and every string (keys too) valid Unicode: JSON's \\ud800 escapes make lone surrogates,
    which no tokenizer or encoder takes."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((k, depth) for k in value)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            if depth < MAX_JSON_DEPTH and set(map(type, value)) <= _SCALAR_TYPES:
                continue  # nothing inside to check (a prompt's ids: one pass in C)
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, "the request body holds a string that is not valid Unicode (a lone "
                               "surrogate)") from None


async def _body(request: web.Request) -> tuple[dict, bool]:
    """The request's JSON object, and whether it is large: a large body's parsing (and its template rendering) run
    on a worker thread, so many of them arriving together do not hold up the loop one after another."""
    try:
        raw = await asyncio.wait_for(request.read(), request.app[OPTIONS_KEY].body_timeout_s)
    except web.HTTPException:
        raise  # over MAX_BODY_BYTES: 413 in _errors
    except asyncio.TimeoutError:
        raise ApiError(408, "the request body did not arrive in time", code="timeout") from None
    except Exception as exc:  # a body that fails its Content-Encoding or its chunked framing
        raise ApiError(400, f"the request body could not be read: {exc}") from None
    large = len(raw) > _LARGE_BODY_BYTES
    if large:
        return await request.app[ENGINE_KEY].run_text_work(_parse_json, raw), large
    return _parse_json(raw), large


def _parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, undecodable bytes, a number no type can hold
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_json_values(body)
    return body


def _check_model(engine: AsyncEngine, name: str | None) -> None:
    if name is not None and name != engine.model_name:
        raise ApiError(404, f"model {name!r} does not exist; this server serves {engine.model_name!r}", "model",
                       "model_not_found")


async def _check_prompt(engine: AsyncEngine, prompt, parsed: ParsedRequest) -> list[int]:
    """Encode and size-check one prompt: 400 before anything is queued or any byte is sent."""
    field = "messages" if parsed.messages else "prompt"
    try:
        ids = await engine.tokenize(prompt)
    except PromptTooLong as exc:
        raise ApiError(400, f"the prompt is {'' if exc.exact else 'at least '}{exc.tokens} tokens; this model's "
                       f"context is {engine.max_model_len}", field, "context_length_exceeded") from None
    except ValueError as exc:
        raise ApiError(400, str(exc), field) from None
    params = parsed.params
    if params.max_tokens is not None and len(ids) + params.max_tokens > engine.max_model_len:
        raise ApiError(
            400, f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
            f"length {engine.max_model_len}", "max_tokens", "context_length_exceeded")
    return ids


async def _start_all(engine: AsyncEngine, prompts: list, parsed: ParsedRequest) -> list:
    """Enqueue each prompt's n choices (choice i is prompt i // n's), or none: a refusal aborts the ones already
    queued. A prompt's choices are requests of their own (`AsyncEngine.generate_choices`); with the prefix cache on,
    the scheduler runs one prefill of the prompt and the others resume from its end."""
    choices = len(prompts) * parsed.n
    if choices > engine.args.max_waiting:  # a 503 would be retried forever: it can never be queued
        raise ApiError(400, f"the request asks for {choices} choices; this server queues at most "
                       f"{engine.args.max_waiting} requests", "n")
    checked = [await _check_prompt(engine, p, parsed) for p in prompts]
    params = parsed.params
    if params.structured_outputs is not None:  # compiled off the loop, once; one that does not compile is a 400
        try:
            for ids in checked:
                await engine.compile_constraint(ids, params)
        except ValueError as exc:
            raise ApiError(400, str(exc), parsed.constraint_field) from None
    if params.logprobs is not None and not parsed.stream:  # the whole body is made at once: bound it
        tokens = sum(params.max_tokens or engine.max_model_len - len(ids) for ids in checked) * parsed.n
        if tokens * (1 + params.logprobs) > MAX_RESPONSE_LOGPROBS:
            raise ApiError(400, f"{parsed.n} choices x up to {tokens // parsed.n} tokens x {1 + params.logprobs} "
                           f"log-probs exceeds {MAX_RESPONSE_LOGPROBS} for one response: stream it, or lower n, "
                           "max_tokens or the top log-probs", "logprobs")
    streams = []
    try:
        for ids in checked:
            streams += engine.generate_choices(ids, params, parsed.n)
    except CapacityError as exc:
        _abort(engine, streams)
        raise ApiError(400, str(exc), "max_tokens", "context_length_exceeded") from None
    except ValueError as exc:  # a field only the model can judge (a token id outside its vocabulary)
        _abort(engine, streams)
        message = str(exc)
        raise ApiError(400, message, message.split(":", 1)[0].split(" ", 1)[0]) from None
    except BaseException:
        _abort(engine, streams)
        raise
    return streams


def _token_counts(out) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of one choice's output so far."""
    return len(out.prompt_token_ids), out.num_tokens, out.num_cached_tokens


def _request_usage(per_choice: list, n: int) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of a request from each choice's: a prompt counts once for its n
    choices (its first choice's figures: the one that prefilled it)."""
    return (sum(c[0] for c in per_choice[::n]), sum(c[1] for c in per_choice),
            sum(c[2] for c in per_choice[::n]))


def _abort(engine: AsyncEngine, streams: list) -> None:
    for s in streams:
        engine.abort(s.request_id)


async def _first(stream):
    return await stream.__anext__()


class _Sse:
    def __init__(self, request: web.Request) -> None:
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self.request = request

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
        await self.response.write(f"data: {data}\n\n".encode())


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body, _ = await _body(request)
    parsed = parse_completion(body)
    _check_model(engine, parsed.model)
    gens = await _start_all(engine, parsed.prompts, parsed)
    rid, created = new_id("cmpl"), now()
    try:
        firsts = [await _first(g) for g in gens]
        if parsed.stream:
            return await _stream_completions(request, engine, parsed, gens, firsts, rid, created)
        finals = [await _drain(g, f) for g, f in zip(gens, firsts)]
    finally:
        for g in gens:
            await g.aclose()
    for out in finals:
        _raise_if_failed(out)
    request[USAGE_KEY] = _request_usage([_token_counts(out) for out in finals], parsed.n)

    if parsed.echo_only:  # the drawn token is not part of the answer
        request[USAGE_KEY] = (request[USAGE_KEY][0], 0, request[USAGE_KEY][2])

    def build() -> dict:
        choices = []
        for i, out in enumerate(finals):
            text, entries, ids = out.text, out.logprobs, out.token_ids
            if parsed.echo_only:
                text, entries, ids = "", [] if entries is not None else None, []
            logprobs, offset = None, 0
            if parsed.echo:
                text = engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) + text
                if entries is not None:
                    logprobs, offset = prompt_completion_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                                  engine.tokenizer)
            if entries is not None:
                generated, _ = completion_logprobs(entries, engine.tokenizer, offset)
                logprobs = generated if logprobs is None else {k: logprobs[k] + generated[k] for k in generated}
            choices.append({"index": i, "text": text, "logprobs": logprobs,
                            "finish_reason": "length" if parsed.echo_only else out.finish_reason})
            if parsed.prompt_logprobs:
                choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs, engine.tokenizer)
            if parsed.return_token_ids:
                choices[-1].update(prompt_token_ids=out.prompt_token_ids, token_ids=ids)
        return {"id": rid, "object": "text_completion", "created": created, "model": engine.model_name,
                "choices": choices, "usage": usage(*request[USAGE_KEY])}
    return await _json_body(engine, build, finals)


async def _json_body(engine: AsyncEngine, build, finals: list) -> web.Response:
    """A whole (non-streamed) response: `build()`'s object as JSON, made on a text thread when its log-probs are
    many (n x tokens x top_logprobs reach megabytes), so the event loop keeps serving the other streams meanwhile."""
    entries = sum(out.num_tokens * (1 + len(out.logprobs[0].top or ())) for out in finals if out.logprobs)
    if entries <= _INLINE_LOGPROB_ENTRIES:
        return web.json_response(build())
    body = await engine.run_text_work(lambda: json.dumps(build(), separators=(",", ":")).encode())
    return web.Response(body=body, content_type="application/json")


async def _drain(gen, first: RequestOutput) -> RequestOutput:
    out = first
    while not out.finished:
        out = await gen.__anext__()
    return out


def _raise_if_failed(out: RequestOutput) -> None:
    if out.finish_reason == "error":
        raise EngineDeadError(out.error or "the engine failed")


async def _merged(gens, firsts):
    """Yield (index, output) from several generators as they produce."""
    if len(gens) == 1:  # the usual request: no task and queue hop a token
        out = firsts[0]
        yield 0, out
        while not out.finished:
            out = await gens[0].__anext__()
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen, first):
        await queue.put((i, first))
        out = first
        while not out.finished:
            out = await gen.__anext__()
            await queue.put((i, out))

    tasks = [asyncio.create_task(pump(i, g, f)) for i, (g, f) in enumerate(zip(gens, firsts))]
    try:
        remaining = len(gens)
        while remaining:
            i, out = await queue.get()
            remaining -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream_completions(request, engine, parsed, gens, firsts, rid, created):
    sse = _Sse(request)
    await sse.open()
    offsets = [0] * len(gens)
    totals = [(0, 0, 0)] * len(gens)
    include_usage, continuous_usage = parsed.usage
    async for i, out in _merged(gens, firsts):
        if out.error:
            await sse.send(_unavailable(engine).body())
            break
        choice = {"index": i, "text": out.delta_text, "logprobs": None, "finish_reason": out.finish_reason}
        if parsed.return_token_ids:
            choice["token_ids"] = list(out.delta_token_ids)
        if out.logprobs is not None and out.delta_token_ids:
            choice["logprobs"], offsets[i] = completion_logprobs(out.delta_logprobs, engine.tokenizer, offsets[i])
        totals[i] = _token_counts(out)
        # With per-chunk usage the client is counting tokens: a chunk for every token, its text empty while an
        # incomplete UTF-8 sequence waits (as vLLM streams), so its timing is the token's, not the text's.
        if out.delta_text or out.finished or choice["logprobs"] or (
                (continuous_usage or parsed.return_token_ids) and out.delta_token_ids):
            chunk = {"id": rid, "object": "text_completion", "created": created, "model": engine.model_name,
                     "choices": [choice]}
            if continuous_usage:
                chunk["usage"] = usage(*totals[i])
            await sse.send(chunk)
    request[USAGE_KEY] = _request_usage(totals, parsed.n)
    if include_usage:
        await sse.send({"id": rid, "object": "text_completion", "created": created, "model": engine.model_name,
                        "choices": [], "usage": usage(*request[USAGE_KEY])})
    await sse.send("[DONE]")
    await sse.response.write_eof()
    return sse.response


async def _render_chat(engine: AsyncEngine, parsed: ParsedRequest, large: bool, field: str) -> str:
    """The chat's prompt text (on a text thread for a large body); a failure is a 400 naming `field`."""
    try:
        render = functools.partial(engine.render_chat, parsed.messages, parsed.chat_template_kwargs, parsed.tools)
        return await engine.run_text_work(render) if large else render()
    except Exception as exc:  # the template is the checkpoint's code run on the client's data: any failure is theirs
        raise ApiError(400, f"cannot render the chat template: {exc}", field) from None


def _tool_call_format(request: web.Request, engine: AsyncEngine, parsed: ParsedRequest) -> str | None:
    """The format of the tool calls to parse out of this request's content (None where it sends no tools); a
    forced choice ("required", a named function) constrains the output to calls in it."""
    if not parsed.parse_tool_calls:
        return None
    if parsed.tool_choice not in ("none", "auto"):
        parsed.params.structured_outputs = tool_call_grammar(parsed.tools, parsed.tool_choice,
                                                             parsed.parallel_tool_calls)
        return "hermes"  # the layout the constraint writes the calls in
    found = request.app[OPTIONS_KEY].tool_call_parser or detect_parser(engine.tokenizer.chat_template)
    if found is None:
        raise ApiError(400, "this model's chat template shows no tool-call format; start the server with "
                       "--tool-call-parser qwen3_coder or hermes", "tools")
    return found


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body, large = await _body(request)
    parsed = parse_chat(body)
    _check_model(engine, parsed.model)
    calls_as = _tool_call_format(request, engine, parsed)
    prompt = await _render_chat(engine, parsed, large, "messages")
    gens = await _start_all(engine, [prompt], parsed)
    rid, created = new_id("chatcmpl"), now()
    opens_reasoning = prompt_opens_reasoning(prompt)
    try:
        firsts = [await _first(g) for g in gens]
        if parsed.stream:
            return await _stream_chat(request, engine, parsed, gens, firsts, opens_reasoning, calls_as, rid,
                                      created)
        finals = [await _drain(g, f) for g, f in zip(gens, firsts)]
    finally:
        for g in gens:
            await g.aclose()
    for out in finals:
        _raise_if_failed(out)
    request[USAGE_KEY] = _request_usage([_token_counts(out) for out in finals], parsed.n)

    def build() -> dict:
        choices = []
        for i, out in enumerate(finals):
            splitter = ReasoningSplitter(opens_reasoning)
            reasoning, content = splitter.feed(out.text, final=True)
            message, finish = {"role": "assistant", "content": content}, out.finish_reason
            if calls_as is not None:
                content, calls = merged(new_parser(calls_as, parsed.tools, parsed.parallel_tool_calls).feed(
                    content, final=True))
                message["content"] = content or (None if calls else "")
                if calls:
                    message["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            if reasoning or splitter.in_reasoning:
                message["reasoning_content"] = reasoning
            logprobs = chat_logprobs(out.logprobs, engine.tokenizer) if out.logprobs is not None else None
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        return {"id": rid, "object": "chat.completion", "created": created, "model": engine.model_name,
                "choices": choices, "usage": usage(*request[USAGE_KEY])}
    return await _json_body(engine, build, finals)


def _call_deltas(events: list) -> tuple[str, list[dict]]:
    """A streamed chunk's content and `tool_calls` entries from a tool-call parser's events."""
    content, calls = [], []
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            calls.append({"index": e.index, "id": e.id, "type": "function",
                          "function": {"name": e.name, "arguments": ""}})
        elif isinstance(e, CallArguments):
            calls.append({"index": e.index, "function": {"arguments": e.fragment}})
    return "".join(content), calls


async def _stream_chat(request, engine, parsed, gens, firsts, opens_reasoning, calls_as, rid, created):
    sse = _Sse(request)
    await sse.open()

    include_usage, continuous_usage = parsed.usage
    splitters = [ReasoningSplitter(opens_reasoning) for _ in gens]
    parsers = [new_parser(calls_as, parsed.tools, parsed.parallel_tool_calls) if calls_as else None for _ in gens]
    called = [False] * len(gens)
    totals = [(0, 0, 0)] * len(gens)

    def chunk(i: int, delta: dict, finish=None, logprobs=None) -> dict:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if continuous_usage:
            body["usage"] = usage(*totals[i])
        return body

    for i, first in enumerate(firsts):
        totals[i] = _token_counts(first)
        await sse.send(chunk(i, {"role": "assistant", "content": ""}))
    async for i, out in _merged(gens, firsts):
        if out.error:
            await sse.send(_unavailable(engine).body())
            break
        totals[i] = _token_counts(out)
        reasoning, content = splitters[i].feed(out.delta_text, final=out.finished)
        calls = []
        if parsers[i] is not None:
            content, calls = _call_deltas(parsers[i].feed(content, final=out.finished))
            called[i] = called[i] or bool(calls)
        logprobs = None
        if out.logprobs is not None and out.delta_token_ids:
            logprobs = chat_logprobs(out.delta_logprobs, engine.tokenizer)
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if delta or logprobs or (continuous_usage and out.delta_token_ids and not out.finished):
            await sse.send(chunk(i, delta, logprobs=logprobs))
        if out.finished:
            finish = "tool_calls" if called[i] and out.finish_reason == "stop" else out.finish_reason
            await sse.send(chunk(i, {}, finish))
    request[USAGE_KEY] = _request_usage(totals, parsed.n)
    if include_usage:
        await sse.send({"id": rid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name,
                        "choices": [], "usage": usage(*request[USAGE_KEY])})
    await sse.send("[DONE]")
    await sse.response.write_eof()
    return sse.response


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"object": "list", "data": [{
        "id": engine.model_name, "object": "model", "created": now(), "owned_by": "deltaserve",
        "max_model_len": engine.max_model_len, "vocab_size": engine.tokenizer.vocab_size,
    }]})


async def responses(request: web.Request) -> web.StreamResponse:
    """`/v1/responses`: the request served as the chat it means (`runtime.responses`), told as Responses items."""
    engine = request.app[ENGINE_KEY]
    body, large = await _body(request)
    parsed = parse_chat(chat_body(body))
    _check_model(engine, parsed.model)
    calls_as = _tool_call_format(request, engine, parsed)
    prompt = await _render_chat(engine, parsed, large, "input")
    (gen,) = await _start_all(engine, [prompt], parsed)
    writer = ResponseWriter(engine.model_name, body)
    splitter = ReasoningSplitter(prompt_opens_reasoning(prompt))
    parser = new_parser(calls_as, parsed.tools, parsed.parallel_tool_calls) if calls_as else None

    def events_of(out) -> list[dict]:
        reasoning, content = splitter.feed(out.delta_text, final=out.finished)
        events = writer.reasoning(reasoning)
        for e in [Content(content)] if parser is None else parser.feed(content, final=out.finished):
            if isinstance(e, Content):
                events += writer.text(e.text)
            elif isinstance(e, CallStart):
                events += writer.call_started(e.index, e.id, e.name)
            else:
                events += writer.call_arguments(e.index, e.fragment)
        if out.finished:
            events += writer.finish(responses_usage(*_token_counts(out)), out.finish_reason)
        return events

    try:
        if not parsed.stream:
            async for out in gen:
                _raise_if_failed(out)
                events = events_of(out)
            request[USAGE_KEY] = _request_usage([_token_counts(out)], 1)
            return web.json_response(events[-1]["response"], dumps=lambda v: json.dumps(v, ensure_ascii=False))
        sse = _Sse(request)
        await sse.open()
        for event in writer.start():
            await sse.send(event)
        async for out in gen:
            if out.error:
                await sse.send({"type": "error", "sequence_number": writer.sequence, "code": "engine_failed",
                                "message": "the engine failed; the cause is in the server log", "param": None})
                break
            request[USAGE_KEY] = _request_usage([_token_counts(out)], 1)
            for event in events_of(out):
                await sse.send(event)
        await sse.response.write_eof()
        return sse.response
    finally:
        await gen.aclose()


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a prompt's ids ({"prompt": ...}), or a chat's as rendered ({"messages": ...})."""
    engine = request.app[ENGINE_KEY]
    body, large = await _body(request)
    _check_model(engine, body.get("model"))
    if body.get("messages") is not None:
        prompt = await _render_chat(engine, parse_chat({**body, "max_tokens": None}), large, "messages")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string (or send 'messages')", "prompt")
    try:
        ids = await engine.run_text_work(engine.tokenizer.encode, prompt) if large else engine.tokenizer.encode(prompt)
    except ValueError as exc:
        raise ApiError(400, str(exc), "prompt") from None
    result = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
    if body.get("return_token_strs"):
        result["token_strs"] = [engine.tokenizer.token_text(t) for t in ids]
    return web.json_response(result)


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: {"tokens": [...]} to {"prompt": text}."""
    engine = request.app[ENGINE_KEY]
    body, _ = await _body(request)
    _check_model(engine, body.get("model"))
    tokens = body.get("tokens")
    vocab = engine.cfg.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                 for t in tokens):
        raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
    return web.json_response({"prompt": engine.tokenizer.decode(tokens, skip_special_tokens=False)})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if engine.healthy:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unhealthy"}, status=503)  # the cause is in the server's log


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def build_app(engine: AsyncEngine, options: ServerOptions | None = None) -> web.Application:
    app = web.Application(middlewares=[_errors, _auth], client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    app[OPTIONS_KEY] = options or ServerOptions()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(engine: AsyncEngine, host: str, port: int, options: ServerOptions | None = None,
                sock: socket.socket | None = None) -> web.AppRunner:
    """Start serving on host:port, or on `sock` (bound already: the CLI binds before the model loads) (the engine
    must be started); returns the runner for `shutdown`."""
    options = options or ServerOptions()
    check_aiohttp()
    runner = AppRunner(
        build_app(engine, options), header_timeout_s=options.header_timeout_s, handler_cancellation=True,
        keepalive_timeout=options.keep_alive_timeout_s, shutdown_timeout=2.0,
        access_log=access_log if options.access_log else None,
        access_log_class=AccessLogger,
    )
    await runner.setup()
    site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    log.info("serving %s on http://%s:%d", engine.model_name, host, port)
    return runner


async def shutdown(runner: web.AppRunner, engine: AsyncEngine, grace_s: float) -> None:
    """Stop listening, let live requests run for most of `grace_s`, abort the rest (each stream ends with a chunk
    whose finish_reason is "abort", then [DONE]), and close the connections; the engine is left to close."""
    for site in list(runner.sites):
        await site.stop()
    await engine.drain(max(0.0, grace_s - _FLUSH_S))
    await runner.cleanup()  # waits (up to its shutdown_timeout) for the handlers to write their last chunks


_FLUSH_S = 1.0  # of the grace period, kept for aborted streams to send their last chunks
