"""aiohttp's connection layer, adapted: OpenAI error bodies for what its HTTP parser refuses, a timeout on reading
request headers, and the access log (one line per request with its token counts).

aiohttp answers malformed HTTP (a bad request line, oversized headers, a broken chunked body) from the connection
handler, before any middleware runs, with a plain-text body; `_Connection.handle_error` gives those answers the
same JSON body as every other error. aiohttp has keep-alive and no header timeout: a client trickling header bytes
would hold a connection for ever, so `_Connection` closes one whose headers are not complete in time.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from .openai_protocol import ApiError

log = logging.getLogger(__name__)
access_log = logging.getLogger("deltaserve.access")

# request[USAGE_KEY] = (prompt tokens, completion tokens, cached prompt tokens), for the access log
USAGE_KEY = web.RequestKey("usage", tuple)
# request[ERROR_KEY]: why a request was refused ("field: message"), for its access line
ERROR_KEY = web.RequestKey("error", str)
ERROR_LOG_CHARS = 200  # a refusal's reason in the access line, at most (a message may quote the client's input)


# What `_Connection` and `AppRunner` read of aiohttp's internals (checked on the range pyproject.toml pins).
_INTERNALS = [(RequestHandler, "_request_in_progress"), (RequestHandler, "_messages"),
              (web.AppRunner, "_make_server")]


def check_aiohttp() -> None:
    """RuntimeError, in one line, where this aiohttp lacks an internal the connection layer relies on, before the
    server starts (rather than serving without the header timeout)."""
    import aiohttp

    missing = [f"{cls.__name__}.{name}" for cls, name in _INTERNALS
               if name not in getattr(cls, "__slots__", ()) and not hasattr(cls, name)]
    if missing:
        raise RuntimeError(f"aiohttp {aiohttp.__version__} lacks {', '.join(missing)}, which the server's "
                           "connection layer needs; install the version pyproject.toml pins (aiohttp>=3.14,<3.15)")


class _Connection(RequestHandler):
    header_timeout_s: float = 10.0  # set per server by `_Server`

    _header_timer = None

    def _waiting_for_headers(self) -> bool:
        # aiohttp's own state (3.14): no request being handled and none parsed yet (`check_aiohttp`).
        return not self._request_in_progress and not self._messages

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_headers() and self._header_timer is None and self.header_timeout_s > 0:
            self._header_timer = self._loop.call_later(self.header_timeout_s, self._headers_timed_out)
        super().data_received(data)
        if self._header_timer is not None and not self._waiting_for_headers():  # the headers are complete
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers():
            log.debug("closing a connection whose request headers took over %.1f s", self.header_timeout_s)
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def log_exception(self, *args, **kwargs) -> None:
        # A body that failed its Content-Encoding or framing was answered 400 already; aiohttp meets the same error
        # again while it drains the rest of the body, and would log it as unhandled.
        if isinstance(kwargs.get("exc_info"), RequestPayloadError):
            log.debug("dropped the rest of a request body that could not be read")
            return
        super().log_exception(*args, **kwargs)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # the response has started (a client that left mid-stream): nothing
            raise ConnectionError("the response was already started")  # can be said; aiohttp drops it quietly
        if status >= 500:
            log.error("error handling %s %s", request.method, request.path, exc_info=exc)
        else:
            log.debug("refused a malformed request: %s", message or exc)
        if status >= 500:
            message = "internal server error"
        elif not message:
            message = HTTPStatus(status).phrase
        response = web.json_response(ApiError(status, message).body(), status=status)
        response.force_close()
        return response


class _Server(web.Server):
    header_timeout_s = 10.0

    def __call__(self) -> RequestHandler:
        connection = _Connection(self, loop=self._loop, **self._kwargs)
        connection.header_timeout_s = self.header_timeout_s
        return connection


class AppRunner(web.AppRunner):
    """web.AppRunner whose connections are `_Connection`s."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self.header_timeout_s = header_timeout_s

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # aiohttp builds the Server itself; this adds only the connection factory
        server.header_timeout_s = self.header_timeout_s
        return server


class AccessLogger(AbstractAccessLogger):
    """`127.0.0.1 "POST /v1/completions" 200 0.412s prompt=12 completion=64` (and `cached=N` when a cached prefix
    spared N prompt tokens); a refusal says why: `400 0.001s error='max_tokens: ...'` (quoted as Python does, so
    no control character of the client's reaches the log)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        usage = request.get(USAGE_KEY)
        tokens = f" prompt={usage[0]} completion={usage[1]}" if usage else ""
        if usage and usage[2]:
            tokens += f" cached={usage[2]}"
        error = request.get(ERROR_KEY)
        if error:
            tokens += f" error={error[:ERROR_LOG_CHARS]!r}"
        self.logger.info('%s "%s %s" %d %.3fs%s', request.remote, request.method, request.path, response.status,
                         time, tokens)
