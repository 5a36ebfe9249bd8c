"""OpenAI request parsing and response shapes, kept apart from the HTTP plumbing.

Every malformed field raises `ApiError` carrying the HTTP status and the OpenAI error body fields.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .params import MAX_LOGPROBS, SamplingParams, StructuredOutputs, all_ints


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        if type_ is None:
            type_ = {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable"}.get(
                status, "invalid_request_error" if status < 500 else "server_error")
        self.type = type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


_SHARED_FIELDS = {  # request field -> (SamplingParams field, expected python types)
    "temperature": ("temperature", (int, float)),
    "top_p": ("top_p", (int, float)),
    "top_k": ("top_k", (int,)),
    "min_p": ("min_p", (int, float)),
    "seed": ("seed", (int,)),
    "presence_penalty": ("presence_penalty", (int, float)),
    "frequency_penalty": ("frequency_penalty", (int, float)),
    "repetition_penalty": ("repetition_penalty", (int, float)),
    "min_tokens": ("min_tokens", (int,)),
    "ignore_eos": ("ignore_eos", (bool,)),
    "stop_token_ids": ("stop_token_ids", (list,)),
    "include_stop_str_in_output": ("include_stop_str_in_output", (bool,)),
    "skip_special_tokens": ("skip_special_tokens", (bool,)),
}

MAX_CHOICES = 128  # choices a request may ask for in all (n times its prompts), OpenAI's limit on n

_UNSUPPORTED = {"suffix", "functions", "function_call", "audio", "modalities", "prediction"}
# vLLM's older names of the `structured_outputs` fields
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# vLLM's `structured_outputs` options that pick among its backends' behaviours: ours has one (runtime/grammar.py)
_BACKEND_OPTIONS = {"disable_fallback", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                    "backend"}


@dataclass
class ParsedRequest:
    prompts: list  # strings or token-id lists (completions); one rendered string (chat)
    params: SamplingParams
    stream: bool
    usage: tuple[bool, bool]  # stream_options: (include_usage, continuous_usage_stats)
    model: str | None
    chat_template_kwargs: dict = field(default_factory=dict)
    messages: list | None = None
    return_token_ids: bool = False  # completions (vLLM's field): each choice carries its token ids
    n: int = 1  # choices a prompt, each a request of its own (`server._start_all`)
    tools: list | None = None  # chat: the function tools, as the client sent them (the template renders them)
    parse_tool_calls: bool = False  # chat: tools given and tool_choice "auto": calls in the output are parsed
    parallel_tool_calls: bool = True
    echo: bool = False  # completions: the prompt before each choice's text (and log-probs)
    echo_only: bool = False  # completions: max_tokens 0 with echo, the drawn token dropped
    prompt_logprobs: bool = False  # completions: each choice carries vLLM's `prompt_logprobs`
    tool_choice: str | dict = "none"  # chat: "none", "auto", "required" or a named function
    constraint_field: str | None = None  # the request field the output's constraint came from (its 400s name it)



def _typed(body: dict, name: str, types, what: str):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types:
        raise _bad(f"'{name}' must be {what}, got {value!r}", name)
    if not isinstance(value, types):
        raise _bad(f"'{name}' must be {what}, got {type(value).__name__}", name)
    return value


def _common(body: dict, max_tokens_field: str) -> tuple[dict, bool, tuple[bool, bool], str | None, int]:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")  # optional: this server serves one model
    if model is not None and (not isinstance(model, str) or not model):
        raise _bad("'model' must be a non-empty string", "model")
    for name in _UNSUPPORTED & body.keys():
        if body[name] not in (None, {}, [], ""):
            raise _bad(f"'{name}' is not supported by this server", name)
    n = _typed(body, "n", (int,), "an integer")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_CHOICES:
        raise _bad(f"'n' must be between 1 and {MAX_CHOICES}, got {n}", "n")
    best_of = _typed(body, "best_of", (int,), "an integer")
    if best_of is not None and best_of != n:  # more candidates than choices would need ranking them
        raise _bad(f"'best_of' must equal 'n' ({n}), got {best_of}", "best_of")
    kwargs = {}
    for name, (target, types) in _SHARED_FIELDS.items():
        what = {(bool,): "a boolean", (int,): "an integer", (list,): "a list"}.get(types, "a number")
        value = _typed(body, name, types, what)
        if value is not None:
            kwargs[target] = value
    bias = body.get("logit_bias")
    if bias is not None:  # OpenAI's keys are token ids written as strings
        if not isinstance(bias, dict):
            raise _bad("'logit_bias' must be an object of token ids to numbers", "logit_bias")
        try:
            kwargs["logit_bias"] = {int(k): v for k, v in bias.items()}
        except ValueError:
            raise _bad("'logit_bias' keys must be token ids", "logit_bias") from None
    max_tokens = _typed(body, max_tokens_field, (int,), "an integer")
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = _typed(body, "max_tokens", (int,), "an integer")
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("'stop' must be a string or a list of strings", "stop")
        kwargs["stop"] = [s for s in stop if s]
    stream = _typed(body, "stream", (bool,), "a boolean") or False
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    if options and not stream:
        raise _bad("'stream_options' is only allowed with stream=true", "stream_options")
    options = options or {}
    for name in ("include_usage", "continuous_usage_stats"):
        if not isinstance(options.get(name, False), bool):
            raise _bad(f"'stream_options.{name}' must be a boolean", "stream_options")
    # continuous_usage_stats (vLLM's): every chunk carries the usage so far, so a client counts tokens exactly even
    # when a token's text is held back as an incomplete UTF-8 sequence.
    usage_options = (options.get("include_usage", False), options.get("continuous_usage_stats", False))
    return kwargs, stream, usage_options, model, n


def constraint(body: dict) -> tuple[StructuredOutputs | None, str | None]:
    """The output's constraint and the field it came from: OpenAI's `response_format`, vLLM's
    `structured_outputs` or its older `guided_*` fields; more than one is a 400."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema", "structural_tag"):
            raise _bad("'response_format.type' must be 'text', 'json_object', 'json_schema' or 'structural_tag'",
                       "response_format")
        if fmt["type"] == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif fmt["type"] == "json_schema":
            inner = fmt.get("json_schema")
            schema = inner.get("schema", inner.get("json_schema")) if isinstance(inner, dict) else None
            if schema is None:
                raise _bad("'response_format.json_schema.schema' must be a JSON schema", "response_format")
            found.append(("response_format", {"json": schema}))
        elif fmt["type"] == "structural_tag":  # vLLM's: {"structures": [...], "triggers": [...]}
            found.append(("response_format", {"structural_tag": {k: fmt.get(k) for k in ("structures", "triggers")}}))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise _bad("'structured_outputs' must be an object", "structured_outputs")
        fields = {k: v for k, v in outputs.items() if k not in _BACKEND_OPTIONS and v is not None and v is not False}
        found.append(("structured_outputs", fields))
    for name, field_ in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, {field_: body[name]}))
    if not found:
        return None, None
    if len(found) > 1:
        raise _bad(f"one output constraint a request; got {', '.join(name for name, _ in found)}", found[1][0])
    name, fields = found[0]
    try:
        return StructuredOutputs(**fields), name
    except TypeError:
        raise _bad(f"'{name}' takes json, regex, choice, grammar, json_object or structural_tag", name) from None
    except ValueError as exc:
        raise _bad(str(exc).replace("structured_outputs", name, 1), name) from None


def _params(kwargs: dict) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
        raise _bad(message, message.split(" ", 1)[0]) from None


def parse_completion(body: dict) -> ParsedRequest:
    kwargs, stream, usage_options, model, n = _common(body, "max_tokens")
    kwargs.setdefault("max_tokens", 16)  # the OpenAI default for completions
    logprobs = _typed(body, "logprobs", (int,), "an integer")
    if logprobs is not None:
        if not 0 <= logprobs <= MAX_LOGPROBS:  # OpenAI's 5, vLLM's 20; the server's --max-logprobs may lower it
            raise _bad(f"'logprobs' must be between 0 and {MAX_LOGPROBS}", "logprobs")
        kwargs["logprobs"] = logprobs
    # echo (lm-evaluation-harness scores a choice so): the prompt before the completion, and with logprobs its
    # tokens' log-probs too; max_tokens 0 then returns the prompt alone (one token is drawn and dropped).
    echo = _typed(body, "echo", (bool,), "a boolean") or False
    echo_only = kwargs["max_tokens"] == 0
    if echo_only and not echo:
        raise _bad("'max_tokens' 0 needs 'echo': true", "max_tokens")
    if echo and stream:
        raise _bad("'echo' is served without 'stream'", "echo")
    if echo_only:
        kwargs["max_tokens"] = 1
    if echo and logprobs is not None:
        kwargs["prompt_logprobs"] = logprobs
    prompt_logprobs = _typed(body, "prompt_logprobs", (int,), "an integer")  # vLLM's
    if prompt_logprobs is not None and stream:
        raise _bad("'prompt_logprobs' is served without 'stream'", "prompt_logprobs")
    if prompt_logprobs is not None:
        if not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise _bad(f"'prompt_logprobs' must be between 0 and {MAX_LOGPROBS}", "prompt_logprobs")
        kwargs["prompt_logprobs"] = max(prompt_logprobs, kwargs.get("prompt_logprobs") or 0)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all_ints(prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all_ints(p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise _bad("'prompt' must be a string, a list of strings, or a list of token ids", "prompt")
    if any(p == "" for p in prompts):
        raise _bad("'prompt' must not be empty", "prompt")
    if len(prompts) > 64:
        raise _bad("at most 64 prompts per request", "prompt")
    if len(prompts) * n > MAX_CHOICES:
        raise _bad(f"{len(prompts)} prompts x n = {n} asks for more than {MAX_CHOICES} choices", "n")
    return_ids = _typed(body, "return_token_ids", (bool,), "a boolean") or False
    kwargs["structured_outputs"], field_ = constraint(body)
    return ParsedRequest(prompts, _params(kwargs), stream, usage_options, model, return_token_ids=return_ids, n=n,
                         echo=echo, echo_only=echo_only, prompt_logprobs=prompt_logprobs is not None,
                         constraint_field=field_)


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message_text(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content[{j}] must be a text part (only text is supported)",
                           f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body: dict) -> ParsedRequest:
    kwargs, stream, usage_options, model, n = _common(body, "max_completion_tokens")
    want_logprobs = _typed(body, "logprobs", (bool,), "a boolean") or False
    top = _typed(body, "top_logprobs", (int,), "an integer")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise _bad(f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}", "top_logprobs")
    if top and not want_logprobs:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if want_logprobs:
        kwargs["logprobs"] = top or 0
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"messages[{i}].role must be one of {list(_ROLES)}", f"messages[{i}].role")
        clean.append({**m, "role": "system" if role == "developer" else role,
                      "content": _message_text(m.get("content"), i)})
    tools, choice, parallel = _tools(body)
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    template_kwargs = dict(template_kwargs)
    add = _typed(body, "add_generation_prompt", (bool,), "a boolean")  # vLLM's field
    if add is not None:
        template_kwargs["add_generation_prompt"] = add
    kwargs["structured_outputs"], field_ = constraint(body)
    if field_ is not None and choice not in ("none", "auto"):
        raise _bad(f"a forced tool call and '{field_}' cannot both constrain the output", "tool_choice")
    return ParsedRequest([], _params(kwargs), stream, usage_options, model, template_kwargs, clean, n=n, tools=tools,
                         parse_tool_calls=bool(tools) and choice != "none", parallel_tool_calls=parallel,
                         tool_choice=choice, constraint_field=field_ or ("tool_choice" if choice not in ("none", "auto")
                                                                         else None))


def _tools(body: dict) -> tuple[list | None, str, bool]:
    """(the function tools, tool_choice, parallel_tool_calls), checked. A choice that forces a call ("required",
    a named function) is made a constraint on the output by the server (`grammar.tool_call_grammar`)."""
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
                raise _bad(f"tools[{i}] must be a function tool ({{'type': 'function', 'function': {{...}}}})",
                           "tools")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise _bad(f"tools[{i}].function.name must be a non-empty string", "tools")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise _bad("a named 'tool_choice' must be {'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise _bad(f"'tool_choice' names {name!r}, which is not among 'tools'", "tool_choice")
        choice = {"type": "function", "function": {"name": name}}
    elif choice == "required" and not tools:
        raise _bad("'tool_choice' 'required' needs 'tools'", "tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise _bad(f"'tool_choice' must be 'none', 'auto', 'required' or a function, got {choice!r}", "tool_choice")
    parallel = _typed(body, "parallel_tool_calls", (bool,), "a boolean")
    return tools or None, choice, True if parallel is None else parallel


# Responses -----------------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens a cached prefix spared the prefill."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(entries, tokenizer, offset: int) -> tuple[dict, int]:
    """The legacy completions shape (tokens, token_logprobs, top_logprobs, text_offset) and the offset after it.
    A token's offset counts the characters begun before it (UTF-8 lead bytes), so a character split across tokens
    counts once, and not as the replacement character each part's own text shows."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(tokenizer.token_text(e.token_id))
        lps.append(e.logprob)
        tops.append({tokenizer.token_text(t): lp for t, lp in (e.top or [])})
        offsets.append(offset)
        offset += _chars_begun(tokenizer, e.token_id)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def _chars_begun(tokenizer, token_id: int) -> int:
    """The characters a token begins (its UTF-8 lead bytes): what it moves a text offset by."""
    return sum(1 for b in tokenizer.token_bytes(token_id) if b & 0xC0 != 0x80)


def prompt_completion_logprobs(prompt_ids: list[int], entries, tokenizer) -> tuple[dict, int]:
    """`completion_logprobs` of an echoed prompt: its first token has no log-prob (None, as OpenAI's)."""
    scored, offset = completion_logprobs(entries[1:], tokenizer, _chars_begun(tokenizer, prompt_ids[0]))
    return {"tokens": [tokenizer.token_text(prompt_ids[0])] + scored["tokens"],
            "token_logprobs": [None] + scored["token_logprobs"], "top_logprobs": [None] + scored["top_logprobs"],
            "text_offset": [0] + scored["text_offset"]}, offset


def vllm_prompt_logprobs(entries, tokenizer) -> list:
    """vLLM's `prompt_logprobs`: None for the first token, then each token's {id: {logprob, decoded_token}}, its
    own and its top ones."""
    out = [None]
    for e in entries[1:]:
        listed = {e.token_id: e.logprob, **dict(e.top or ())}
        out.append({str(t): {"logprob": lp, "decoded_token": tokenizer.token_text(t)} for t, lp in listed.items()})
    return out


def chat_logprobs(entries, tokenizer) -> dict:
    """OpenAI's chat shape; `bytes` are the token's own (`TextTokenizer.token_bytes`)."""
    def item(token_id, lp):
        return {"token": tokenizer.token_text(token_id), "logprob": lp, "bytes": list(tokenizer.token_bytes(token_id))}

    return {"content": [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in (e.top or [])]} for e in entries
    ]}
