"""OpenAI's Responses API (`POST /v1/responses`, the OpenAI Agents SDK's default), stateless: a request is turned into
the chat request it means (`chat_body`), served as a chat, and its output told as Responses items and, streamed,
as its events (`ResponseWriter`). Nothing is stored, so `previous_response_id` is refused: the client sends the
whole conversation (the Agents SDK does, with `store` false)."""

from __future__ import annotations

import json

from .openai_protocol import ApiError, new_id, now


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def chat_body(body: dict) -> dict:
    """The chat-completions body a Responses request means: `instructions` as the system message, the input items
    as messages (an assistant's function calls and their outputs as tool calls and tool messages), function tools,
    and the sampling fields under their chat names."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise _bad("previous_response_id needs stored responses, which this server does not keep: send the whole "
                   "conversation as input", "previous_response_id")
    fmt = ((body.get("text") or {}).get("format") or {}) if isinstance(body.get("text"), dict) else {}
    if not isinstance(fmt, dict) or fmt.get("type", "text") not in ("text", "json_object", "json_schema"):
        raise _bad("text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format")
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("'input' must be a string or a non-empty list of items", "input")
    for i, item in enumerate(items):
        messages += _as_messages(item, i, messages)
    chat = {"messages": messages, "stream": bool(body.get("stream"))}
    if fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt.get("type") == "json_schema":  # the Responses form holds the schema at the format's top level
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt.get(k) for k in ("name", "schema", "strict") if fmt.get(k) is not None}}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"),
                         ("tool_choice", "tool_choice")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if isinstance(chat.get("tool_choice"), dict):  # {"type": "function", "name": ...} in the Responses form
        chat["tool_choice"] = {"type": "function", "function": {"name": chat["tool_choice"].get("name")}}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        chat["tools"] = []
        for j, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise _bad(f"tools[{j}]: only function tools are served", "tools")
            chat["tools"].append({"type": "function", "function": {
                k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}})
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        # Qwen3.5 thinks or not: no effort levels; "minimal" and "none" turn thinking off.
        chat["chat_template_kwargs"] = {"enable_thinking": reasoning["effort"] not in ("minimal", "none")}
    return chat


def _as_messages(item, i: int, before: list) -> list[dict]:
    if not isinstance(item, dict):
        raise _bad(f"input[{i}] must be an object", "input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise _bad(f"input[{i}].role must be user, assistant, system or developer", "input")
        return [{"role": role, "content": _text(item.get("content"), i)}]
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": _arguments(item.get("arguments"), i)}}
        if before and before[-1]["role"] == "assistant":  # its text, then its calls: one assistant turn
            before[-1].setdefault("tool_calls", []).append(call)
            return []
        return [{"role": "assistant", "content": "", "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output")
        return [{"role": "tool", "tool_call_id": item.get("call_id"),
                 "content": output if isinstance(output, str) else json.dumps(output)}]
    if kind == "reasoning":
        return []  # the model's own earlier reasoning: Qwen's templates drop it from earlier turns anyway
    raise _bad(f"input[{i}].type {kind!r} is not served (message, function_call, function_call_output)", "input")


def _text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise _bad(f"input[{i}].content: only text parts are served", "input")
            parts.append(part.get("text") or "")
        return "".join(parts)
    raise _bad(f"input[{i}].content must be a string or a list of text parts", "input")


def _arguments(arguments, i: int):
    """A call's arguments for the chat template, which prints them key by key (Qwen's templates iterate them)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            raise _bad(f"input[{i}].arguments must be a JSON object", "input") from None
    return arguments or {}


class ResponseWriter:
    """A response built from the chat's output as it streams (`reasoning`, `text` and tool-call events in order),
    with the Responses events each piece makes (`events`), and the whole response at the end (`response`)."""

    def __init__(self, model: str, body: dict) -> None:
        self.id, self.created, self.model = new_id("resp"), now(), model
        self.echo = {k: body.get(k) for k in ("instructions", "tool_choice", "tools", "temperature", "top_p",
                                             "parallel_tool_calls", "max_output_tokens", "metadata")}
        self.output: list[dict] = []
        self.sequence = 0
        self.open: dict | None = None  # the output item text or reasoning is going into
        self.calls: dict[int, dict] = {}

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def response(self, status: str = "completed", usage: dict | None = None, incomplete: str | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "output": self.output, "usage": usage, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "parallel_tool_calls": True if self.echo["parallel_tool_calls"] is None else
                self.echo["parallel_tool_calls"], "tool_choice": self.echo["tool_choice"] or "auto",
                "tools": self.echo["tools"] or [], **{k: self.echo[k] for k in
                                                      ("instructions", "temperature", "top_p", "max_output_tokens",
                                                       "metadata")}}

    def start(self) -> list[dict]:
        started = self.response("in_progress")
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def _close_open(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = self.output.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            return [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part),
                    self._event("response.output_item.done", output_index=index, item=item)]
        return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=item["content"][0]["text"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _opened(self, kind: str) -> tuple[dict, list[dict]]:
        if self.open is not None and self.open["type"] == kind:
            return self.open, []
        events = self._close_open()
        if kind == "message":
            item = {"type": "message", "id": new_id("msg"), "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        else:
            item = {"type": "reasoning", "id": new_id("rs"), "status": "in_progress", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
        self.output.append(item)
        self.open = item
        index = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=item))
        if kind == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part=item["content"][0]))
        return item, events

    def text(self, delta: str) -> list[dict]:
        return self._append("message", "response.output_text.delta", delta, logprobs=[])

    def reasoning(self, delta: str) -> list[dict]:
        return self._append("reasoning", "response.reasoning_text.delta", delta)

    def _append(self, kind: str, event: str, delta: str, **fields) -> list[dict]:
        """`delta` onto the open item of `kind` (opened if another is), and its delta event."""
        if not delta:
            return []
        item, events = self._opened(kind)
        item["content"][0]["text"] += delta
        return events + [self._event(event, item_id=item["id"], output_index=self.output.index(item),
                                     content_index=0, delta=delta, **fields)]

    def call_started(self, index: int, call_id: str, name: str) -> list[dict]:
        events = self._close_open()
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name, "arguments": "",
                "status": "in_progress"}
        self.output.append(item)
        self.calls[index] = item
        return events + [self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def call_arguments(self, index: int, fragment: str) -> list[dict]:
        item = self.calls[index]
        item["arguments"] += fragment
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=self.output.index(item), delta=fragment)]

    def finish(self, usage: dict, finish_reason: str) -> list[dict]:
        events = self._close_open()
        for item in self.calls.values():
            item["status"] = "completed"
            index = self.output.index(item)
            events += [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"]),
                       self._event("response.output_item.done", output_index=index, item=item)]
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        final = self.response("incomplete" if incomplete else "completed", usage, incomplete)
        return events + [self._event("response.incomplete" if incomplete else "response.completed", response=final)]


def responses_usage(prompt: int, completion: int, cached: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}
