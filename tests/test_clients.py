"""Real clients against the server, as their users run them: LangChain's ChatOpenAI (tools bound and forced,
structured output in json_schema and function-calling modes), the OpenAI Agents SDK running a one-tool agent and a
structured-output agent through /v1/responses, and lm-evaluation-harness's local-completions model on a
multiple-choice task (its log-likelihoods are the model's) and a generate_until task, both from local files."""

import asyncio
import json
import os

import jsonschema
import pydantic
from test_agents import _serve

from deltaserve.runtime import SamplingParams

DATA = os.path.join(os.path.dirname(__file__), "data", "lm_eval")


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=7)


def get_weather(city: str, days: int = 1) -> str:
    """The weather in a city over the next days."""
    return "sunny"


def test_langchain_binds_and_forces_tools_and_structures_its_output(tiny_ckpt):
    async def body(engine, url):
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(base_url=url + "/v1", api_key="x", model="m", max_tokens=1500, temperature=1.0, seed=1)
        forced = await llm.bind_tools([get_weather], tool_choice="required").ainvoke("Weather in Lima?")
        offered = await llm.bind_tools([get_weather]).ainvoke("Weather in Lima?")  # "auto": text or calls
        by_schema = await llm.with_structured_output(Weather, method="json_schema").ainvoke("Weather?")
        by_call = await llm.with_structured_output(Weather, method="function_calling").ainvoke("Weather?")
        return forced, offered, by_schema, by_call

    forced, offered, by_schema, by_call = _serve(tiny_ckpt, body, max_model_len=2048,
                                                 tool_call_parser="qwen3_coder")
    assert forced.tool_calls and all(c["name"] == "get_weather" for c in forced.tool_calls)
    for call in forced.tool_calls:
        jsonschema.validate(call["args"], {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]})
    assert isinstance(offered.content, str)
    assert isinstance(by_schema, Weather) and isinstance(by_call, Weather)


def test_the_agents_sdk_runs_a_tool_and_a_structured_agent(tiny_ckpt):
    ran = []

    async def body(engine, url):
        from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
        from openai import AsyncOpenAI

        set_tracing_disabled(True)

        @function_tool
        def weather(city: str) -> str:
            """The weather in a city."""
            ran.append(city)
            return "sunny"

        model = OpenAIResponsesModel(model="m", openai_client=AsyncOpenAI(base_url=url + "/v1", api_key="x"))
        settings = ModelSettings(max_tokens=1500, temperature=1.0)
        tool_agent = Agent(name="w", instructions="Use the tool.", tools=[weather], model=model,
                           model_settings=settings.resolve(ModelSettings(tool_choice="required")))
        told = await Runner.run(tool_agent, "Weather in Lima?", max_turns=3)
        structured = Agent(name="s", instructions="Answer.", output_type=Weather, model=model,
                           model_settings=settings)
        answered = await Runner.run(structured, "Weather in Lima?", max_turns=1)
        return told.final_output, answered.final_output

    told, answered = _serve(tiny_ckpt, body, max_model_len=4096)
    assert len(ran) == 1 and isinstance(ran[0], str)  # the forced call ran the tool; then the choice went back to auto
    assert isinstance(told, str) and isinstance(answered, Weather)


def _task(folder: str, name: str, text: str) -> None:
    with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
        f.write(text.replace("DATA", DATA))


def test_lm_eval_scores_a_multiple_choice_task_with_the_model_s_log_likelihoods(tiny_ckpt, tmp_path, monkeypatch):
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # the tasks' data are local files: no hub is asked
        monkeypatch.setenv(name, "1")
    _task(tmp_path, "mc", """task: deltaserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: DATA/multiple_choice.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
""")
    _task(tmp_path, "gen", """task: deltaserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: DATA/generate.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Q: {{question}}\\nA:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")

    async def body(engine, url):
        import lm_eval
        from lm_eval.tasks import TaskManager

        def evaluate():
            return lm_eval.simple_evaluate(
                model="local-completions", tasks=["deltaserve_mc", "deltaserve_gen"], log_samples=True,
                model_args=f"model=m,base_url={url}/v1/completions,tokenizer={tiny_ckpt},num_concurrent=2,"
                           "max_retries=1,tokenized_requests=True",
                task_manager=TaskManager(include_path=str(tmp_path)))

        results = await asyncio.to_thread(evaluate)
        # The model's own log-likelihood of each choice after its question: teacher-forced prompt log-probs of the
        # ids lm-eval sent (transformers' tokenizer class for the checkpoint, which lm-eval loads)
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(tiny_ckpt)
        expected = []
        for sample in results["samples"]["deltaserve_mc"]:
            for context, continuation in (r["arguments"] if isinstance(r, dict) else r
                                          for r in _arguments(sample)):
                # as lm-eval splits a pair: the whole text's tokens, the context's count of them first
                whole, ctx = hf.encode(context + continuation), hf.encode(context)
                out = None
                async for out in engine.generate(whole, SamplingParams(max_tokens=1, prompt_logprobs=0)):
                    pass
                expected.append(sum(e.logprob for e in out.prompt_logprobs[len(ctx):]))
        return results, expected

    results, expected = _serve(tiny_ckpt, body, max_model_len=512)
    got = [resp[0][0] for sample in results["samples"]["deltaserve_mc"] for resp in sample["resps"]]
    assert len(got) == len(expected) == 24
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4, [(i, a, b) for i, (a, b) in
                                                                   enumerate(zip(got, expected)) if abs(a - b) > 1e-4]
    assert 0 <= results["results"]["deltaserve_mc"]["acc,none"] <= 1
    generated = [resp[0] for sample in results["samples"]["deltaserve_gen"] for resp in sample["resps"]]
    assert len(generated) == 4 and all(isinstance(g, str) and "\n" not in g for g in generated)


def _arguments(sample: dict) -> list:
    """A logged sample's (context, continuation) pairs, one a choice."""
    return [tuple(a) for a in sample["arguments"]] if isinstance(sample["arguments"], list) else \
        [tuple(v) for v in json.loads(sample["arguments"]).values()]
