"""OpenAI-compatible HTTP server (aiohttp): completions, chat completions, SSE streaming, models, health, metrics.

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}. A client that disconnects cancels
its handler (aiohttp handler cancellation), which aborts the request and frees its slot and pages.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

from aiohttp import web

from .engine import AsyncEngine, CapacityError, EngineDeadError, QueueFullError, RequestOutput
from .openai_protocol import (
    ApiError,
    ParsedRequest,
    chat_logprobs,
    completion_logprobs,
    new_id,
    now,
    parse_chat,
    parse_completion,
    usage,
)
from .text import ReasoningSplitter, TemplateError, prompt_opens_reasoning

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20
ENGINE_KEY = web.AppKey("engine", AsyncEngine)
API_KEY = web.AppKey("api_key", object)


def _json_error(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as err:
        return _json_error(err)
    except web.HTTPRequestEntityTooLarge:
        return _json_error(ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _json_error(ApiError(exc.status, exc.reason or "error", type_="invalid_request_error"))
    except (EngineDeadError, QueueFullError) as exc:
        return _json_error(ApiError(503, str(exc), code="unavailable"))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error serving %s", request.path)
        return _json_error(ApiError(500, "internal server error"))


@web.middleware
async def _auth(request: web.Request, handler):
    key = request.app[API_KEY]
    if key and request.path.startswith("/v1/"):
        sent = request.headers.get("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "missing or invalid API key", code="invalid_api_key")
    return await handler(request)


async def _body(request: web.Request) -> dict:
    raw = await request.read()  # over MAX_BODY_BYTES raises HTTPRequestEntityTooLarge: 413 in _errors
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _check_model(engine: AsyncEngine, name: str) -> None:
    if name != engine.model_name:
        raise ApiError(404, f"model {name!r} does not exist; this server serves {engine.model_name!r}", "model",
                       "model_not_found")


def _check_prompt(engine: AsyncEngine, prompt, parsed: ParsedRequest) -> list[int]:
    """Encode and size-check one prompt: 400 before anything is queued or any byte is sent."""
    try:
        ids = engine.encode_prompt(prompt)
        if len(ids) >= engine.max_model_len:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this model's context is {engine.max_model_len}",
                           "messages" if parsed.messages else "prompt", "context_length_exceeded")
        params = parsed.params
        if params.max_tokens is not None and len(ids) + params.max_tokens > engine.max_model_len:
            raise ApiError(
                400, f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length {engine.max_model_len}", "max_tokens", "context_length_exceeded")
    except ValueError as exc:
        raise ApiError(400, str(exc), "prompt") from None
    return ids


def _start_all(engine: AsyncEngine, prompts: list, parsed: ParsedRequest) -> list:
    """Enqueue every prompt, or none: a refusal aborts the ones already queued."""
    checked = [_check_prompt(engine, p, parsed) for p in prompts]
    streams = []
    try:
        for ids in checked:
            streams.append(engine.generate(ids, parsed.params))
    except CapacityError as exc:
        _abort(engine, streams)
        raise ApiError(400, str(exc), "max_tokens", "context_length_exceeded") from None
    except BaseException:
        _abort(engine, streams)
        raise
    return streams


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
    parsed = parse_completion(await _body(request))
    _check_model(engine, parsed.model)
    gens = _start_all(engine, parsed.prompts, parsed)
    rid, created = new_id("cmpl"), now()
    try:
        firsts = [await _first(g) for g in gens]
        if parsed.stream:
            return await _stream_completions(request, engine, parsed, gens, firsts, rid, created)
        finals = [await _drain(g, f) for g, f in zip(gens, firsts)]
    finally:
        for g in gens:
            await g.aclose()
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, out in enumerate(finals):
        _raise_if_failed(out)
        logprobs = None
        if out.logprobs is not None:
            logprobs = completion_logprobs(out.logprobs, engine.tokenizer.token_text, 0)
        choices.append({"index": i, "text": out.text, "logprobs": logprobs, "finish_reason": out.finish_reason})
        prompt_tokens += len(out.prompt_token_ids)
        completion_tokens += len(out.token_ids)
    return web.json_response({"id": rid, "object": "text_completion", "created": created, "model": engine.model_name,
                              "choices": choices, "usage": usage(prompt_tokens, completion_tokens)})


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
    totals = [[0, 0] for _ in gens]
    async for i, out in _merged(gens, firsts):
        if out.error:
            await sse.send({"error": ApiError(503, out.error).body()["error"]})
            break
        choice = {"index": i, "text": out.delta_text, "logprobs": None, "finish_reason": out.finish_reason}
        if out.logprobs is not None and out.delta_token_ids:
            fresh = out.logprobs[len(out.logprobs) - len(out.delta_token_ids):]
            choice["logprobs"] = completion_logprobs(fresh, engine.tokenizer.token_text, offsets[i])
        offsets[i] += len(out.delta_text)
        totals[i] = [len(out.prompt_token_ids), len(out.token_ids)]
        if out.delta_text or out.finished or choice["logprobs"]:
            await sse.send({"id": rid, "object": "text_completion", "created": created, "model": engine.model_name,
                            "choices": [choice]})
    if parsed.include_usage:
        await sse.send({"id": rid, "object": "text_completion", "created": created, "model": engine.model_name,
                        "choices": [], "usage": usage(sum(t[0] for t in totals), sum(t[1] for t in totals))})
    await sse.send("[DONE]")
    await sse.response.write_eof()
    return sse.response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    parsed = parse_chat(await _body(request))
    _check_model(engine, parsed.model)
    try:
        prompt = engine.render_chat(parsed.messages, parsed.chat_template_kwargs)
    except (TemplateError, TypeError) as exc:
        raise ApiError(400, f"cannot render the chat template: {exc}", "messages") from None
    (gen,) = _start_all(engine, [prompt], parsed)
    rid, created = new_id("chatcmpl"), now()
    splitter = ReasoningSplitter(prompt_opens_reasoning(prompt))
    try:
        first = await _first(gen)
        if parsed.stream:
            return await _stream_chat(request, engine, parsed, gen, first, splitter, rid, created)
        out = await _drain(gen, first)
    finally:
        await gen.aclose()
    _raise_if_failed(out)
    reasoning, content = splitter.feed(out.text, final=True)
    message = {"role": "assistant", "content": content}
    if reasoning or splitter.in_reasoning:
        message["reasoning_content"] = reasoning
    logprobs = chat_logprobs(out.logprobs, engine.tokenizer.token_text) if out.logprobs is not None else None
    return web.json_response({
        "id": rid, "object": "chat.completion", "created": created, "model": engine.model_name,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": out.finish_reason}],
        "usage": usage(len(out.prompt_token_ids), len(out.token_ids)),
    })


async def _stream_chat(request, engine, parsed, gen, first, splitter, rid, created):
    sse = _Sse(request)
    await sse.open()

    def chunk(delta: dict, finish=None, logprobs=None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    await sse.send(chunk({"role": "assistant", "content": ""}))
    out = first
    while True:
        if out.error:
            await sse.send({"error": ApiError(503, out.error).body()["error"]})
            break
        reasoning, content = splitter.feed(out.delta_text, final=out.finished)
        logprobs = None
        if out.logprobs is not None and out.delta_token_ids:
            fresh = out.logprobs[len(out.logprobs) - len(out.delta_token_ids):]
            logprobs = chat_logprobs(fresh, engine.tokenizer.token_text)
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if delta or logprobs:
            await sse.send(chunk(delta, logprobs=logprobs))
        if out.finished:
            await sse.send(chunk({}, out.finish_reason))
            break
        out = await gen.__anext__()
    if parsed.include_usage:
        await sse.send({"id": rid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name,
                        "choices": [], "usage": usage(len(out.prompt_token_ids), len(out.token_ids))})
    await sse.send("[DONE]")
    await sse.response.write_eof()
    return sse.response


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"object": "list", "data": [{
        "id": engine.model_name, "object": "model", "created": now(), "owned_by": "deltaserve",
        "max_model_len": engine.max_model_len,
    }]})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if engine.healthy:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unhealthy", "reason": engine._dead or "not running"}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[ENGINE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def build_app(engine: AsyncEngine, api_key: str | None = None) -> web.Application:
    app = web.Application(middlewares=[_errors, _auth], client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    app[API_KEY] = api_key
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(engine: AsyncEngine, host: str, port: int, api_key: str | None = None) -> web.AppRunner:
    """Start serving on host:port (the engine must be started); returns the runner to clean up."""
    runner = web.AppRunner(build_app(engine, api_key), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("serving %s on http://%s:%d", engine.model_name, host, port)
    return runner
