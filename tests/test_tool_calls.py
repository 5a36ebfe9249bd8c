"""Tool-call parsing: hand-written model outputs, each parsed whole and streamed in chunks of every size, to the
same content and calls."""

import json

import pytest

from deltaserve.runtime.tool_calls import detect_parser, merged, new_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "where": {"type": "object"}, "hours": {"type": "array"}, "ratio": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}}}}},
]

CODER = [
    ("plain text, no call", "Hello <b>world</b> a < b", "Hello <b>world</b> a < b", []),
    ("one call with typed values",
     "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n</function>\n"
     "</tool_call>",
     "Let me check.\n", [("get_weather", {"city": "Paris", "days": 3, "metric": True, "ratio": 0.5})]),
    ("two calls, nested JSON and a string with < and newlines",
     "<tool_call>\n<function=get_weather>\n<parameter=where>\n{\"lat\": 1.5, \"tags\": [\"a\", {\"b\": null}]}\n"
     "</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=run>\n"
     "<parameter=code>\nif a < b:\n    print(\"<tool_call>\")\n</parameter>\n</function>\n</tool_call>",
     "\n", [("get_weather", {"where": {"lat": 1.5, "tags": ["a", {"b": None}]}, "hours": [1, 2]}),
            ("run", {"code": "if a < b:\n    print(\"<tool_call>\")"})]),
    ("a value that does not fit its type stays a string, a call with no parameters",
     "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"
     "<tool_call>\n<function=run>\n</function>\n</tool_call> done",
     " done", [("get_weather", {"days": "three"}), ("run", {})]),
    ("cut short by max_tokens: the parameters that completed",
     "ok <tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n4",
     "ok ", [("get_weather", {"city": "Rome"})]),
]

HERMES = [
    ("two JSON calls", 'Sure.<tool_call>\n{"name": "run", "arguments": {"code": "x = \\"<\\"\\nprint(x)"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
     "Sure.\n", [("run", {"code": 'x = "<"\nprint(x)'}), ("get_weather", {"city": "Oslo"})]),
    ("a call that does not parse stays content", "<tool_call>{not json}</tool_call>",
     "<tool_call>{not json}</tool_call>", []),
    ("cut short by max_tokens: content", 'a<tool_call>\n{"name": "run", "argu', 'a<tool_call>\n{"name": "run", "argu',
     []),
]


def _parse(parser_name: str, text: str, size: int | None):
    parser = new_parser(parser_name, TOOLS)
    events = []
    pieces = [text] if size is None else [text[i : i + size] for i in range(0, len(text), size)]
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    content, calls = merged(events)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser_name,case", [("qwen3_coder", c) for c in CODER] + [("hermes", c) for c in HERMES],
                         ids=lambda v: v if isinstance(v, str) else v[0])
def test_every_chunking_parses_to_the_same_calls(parser_name, case):
    _, text, content, calls = case
    assert _parse(parser_name, text, None) == (content, calls)
    for size in range(1, len(text) + 1):
        assert _parse(parser_name, text, size) == (content, calls), size


def test_argument_fragments_stream_as_parameters_complete():
    parser = new_parser("qwen3_coder", TOOLS)
    events = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa")
    assert [type(e).__name__ for e in events] == ["CallStart"] and events[0].name == "get_weather"
    events = parser.feed("ris\n</parameter>\n<parameter=days>\n")
    assert [e.fragment for e in events] == ['{"city": "Paris"']
    events = parser.feed("2\n</parameter>\n</function>\n</tool_call>")
    assert "".join(e.fragment for e in events) == ', "days": 2}'


def test_the_format_is_detected_from_the_template():
    assert detect_parser("... <tool_call>\n<function=example_function_name>\n<parameter=x> ...") == "qwen3_coder"
    assert detect_parser('... <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>} ...') == "hermes"
    assert detect_parser("{{ messages }}") is None and detect_parser(None) is None
    with pytest.raises(ValueError, match="not one of"):
        new_parser("mistral", TOOLS)


def test_odd_schemas_and_outputs_never_raise():
    odd = [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["x"]}}},
           {"type": "function", "function": {"name": "g", "parameters": "nope"}}]
    deep = "[" * 100_000 + "]" * 100_000
    for name, text in (("qwen3_coder", f"<tool_call>\n<function=f>\n<parameter=x>\n{deep}\n</parameter>\n</function>"
                                       "\n</tool_call>"),
                       ("hermes", '<tool_call>{"name": "g", "arguments": ' + deep + "}</tool_call>")):
        parser = new_parser(name, odd)
        content, calls = merged(parser.feed(text) + parser.finish())
        assert calls or content  # parsed or kept as content: nothing raised


def test_without_parallel_calls_the_first_call_alone_comes_out_however_it_streams():
    _, text, content, calls = CODER[2]  # two calls
    for size in (None, 1, 9):
        parser = new_parser("qwen3_coder", TOOLS, parallel=False)
        pieces = [text] if size is None else [text[i : i + size] for i in range(0, len(text), size)]
        events = [e for j, piece in enumerate(pieces) for e in parser.feed(piece, final=j == len(pieces) - 1)]
        got_content, got_calls = merged(events)
        assert got_content == content
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got_calls] == calls[:1]
