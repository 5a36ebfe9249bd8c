"""Prompt log-probs (vLLM's `prompt_logprobs`, and `echo` with `logprobs`, as lm-evaluation-harness scores choices):
each prompt token's log-prob given the ones before it, as the model computes it teacher-forced and as transformers
does, through chunked prefill, tensor parallelism and the server."""

import asyncio

import aiohttp
import pytest
import torch
from helpers import CpuRunner, hf_model
from test_server import with_server

from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams


def _prompt(n: int, seed: int = 3) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _teacher_forced(ckpt, prompt):
    logits = CpuRunner(ckpt).prefill({0: prompt}, all_logits=True)
    logprobs = torch.log_softmax(logits.float(), -1)
    return [float(logprobs[i, prompt[i + 1]]) for i in range(len(prompt) - 1)], logprobs


def _served(ckpt, prompts, top, **kw):
    async def main():
        args = EngineArgs(model=ckpt, max_model_len=512, max_batch=4, cpu_memory_bytes=32 << 20, **kw)
        async with AsyncEngine(args) as engine:
            async def one(p):
                async for out in engine.generate(p, SamplingParams(max_tokens=2, prompt_logprobs=top,
                                                                   temperature=0)):
                    pass
                return out
            return await asyncio.gather(*[one(p) for p in prompts])
    return asyncio.run(main())


@pytest.mark.parametrize("kw", [{}, {"prefill_token_budget": 32}, {"tp": 2, "prefill_token_budget": 48}],
                         ids=["one-chunk", "chunked", "tp2-chunked"])
def test_prompt_logprobs_are_the_teacher_forced_ones(tiny_tp_ckpt, kw):
    # the third repeats the first (no cached prefix may stand in); the last is scored in slices of positions
    prompts = [_prompt(70), _prompt(9, seed=4), _prompt(70), _prompt(300, seed=7)]
    outs = _served(tiny_tp_ckpt, prompts, top=3, **kw)
    for prompt, out in zip(prompts, outs):
        want, logprobs = _teacher_forced(tiny_tp_ckpt, prompt)
        got = out.prompt_logprobs
        assert got[0] is None and len(got) == len(prompt)
        assert [e.token_id for e in got[1:]] == prompt[1:]
        # Chunk boundaries move the fp32 GDN state's rounding (one chunk against many: ~2e-5 at 300 tokens)
        assert max(abs(e.logprob - w) for e, w in zip(got[1:], want)) <= (5e-5 if kw else 1e-5)
        top_ids = logprobs[:-1].topk(3, -1).indices.tolist()
        assert [[t for t, _ in e.top] for e in got[1:]] == top_ids
        assert out.num_cached_tokens == 0


def test_prompt_logprobs_match_transformers(tiny_ckpt):
    prompt = _prompt(40, seed=9)
    (out,) = _served(tiny_ckpt, [prompt], top=0)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(tiny_ckpt)(torch.tensor([prompt])).logits[0].float(), -1)
    want = [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert max(abs(e.logprob - w) for e, w in zip(out.prompt_logprobs[1:], want)) <= 1e-4
    assert out.prompt_logprobs[1].top is None


def test_echo_scores_a_choice_as_lm_eval_asks(tiny_ckpt):
    """`echo` with `logprobs` and `max_tokens` 0: the prompt's text and its tokens' log-probs, no completion."""
    prompt = "The cat sat on the mat because"

    async def body(engine, url):
        async with aiohttp.ClientSession() as s:
            payload = {"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0,
                       "temperature": 0}
            async with s.post(url + "/v1/completions", json=payload) as r:
                scored = await r.json()
            async with s.post(url + "/v1/completions", json={**payload, "max_tokens": 2}) as r:
                continued = await r.json()
            async with s.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                             "prompt_logprobs": 2}) as r:
                vllm_style = await r.json()
            async with s.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0}) as r:
                refused = r.status
            return scored, continued, vllm_style, refused, engine.tokenizer.encode(prompt)

    scored, continued, vllm_style, refused, ids = with_server(tiny_ckpt, body)
    (choice,) = scored["choices"]
    want, logprobs = _teacher_forced(tiny_ckpt, ids)
    lp = choice["logprobs"]
    assert choice["text"] == prompt and scored["usage"]["completion_tokens"] == 0
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want)) <= 1e-5
    assert "".join(lp["tokens"]) == prompt and lp["text_offset"][0] == 0
    # each position's most likely token (what lm-eval reads to tell whether the choice is the greedy one)
    best = logprobs[:-1].max(-1).values.tolist()
    assert all(len(t) == 1 and abs(next(iter(t.values())) - m) <= 1e-5 for t, m in zip(lp["top_logprobs"][1:], best))
    c = continued["choices"][0]
    assert c["text"].startswith(prompt) and len(c["logprobs"]["token_logprobs"]) == len(ids) + 2
    p = vllm_style["choices"][0]["prompt_logprobs"]
    assert p[0] is None and abs(p[1][str(ids[1])]["logprob"] - want[0]) <= 1e-5 and len(p[1]) >= 2
    assert refused == 400


def test_a_speculative_engine_scores_prompts_as_a_plain_one(tiny_ckpt):
    prompts = [_prompt(50, seed=5), _prompt(12, seed=6)]
    plain = _served(tiny_ckpt, prompts, top=2, prefill_token_budget=32)
    spec = _served(tiny_ckpt, prompts, top=2, prefill_token_budget=32, speculative_tokens=2)
    for a, b in zip(plain, spec):
        assert [e and (e.token_id, e.top and [t for t, _ in e.top]) for e in a.prompt_logprobs] == \
            [e and (e.token_id, e.top and [t for t, _ in e.top]) for e in b.prompt_logprobs]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])) <= 1e-5
        assert a.token_ids == b.token_ids
