"""Speculative decoding with Qwen3.5's multi-token-prediction head, on the CPU backend.

- The head against an oracle built from transformers' own decoder layer; the verify step against one-token
  decodes, and its roll-back against a request that decoded only the kept tokens.
- Through the engine: greedy and seeded outputs equal decoding without speculation, with the head's drafts
  (random weights: mostly rejected) and with a controlled drafter (the model's own continuation, corrupted at
  chosen positions), at tp 1 and 2, across slot moves, stops, the batch limit and cached prefixes.
"""

import asyncio
import logging
import time

import pytest
import torch
from helpers import CpuRunner, EagerPrograms, flagging_every_filtered_row, hf_model, rel_err
from safetensors.torch import load_file

from deltaserve.devices.backend import StepShape
from deltaserve.kernels.fp8 import Fp8Weight
from deltaserve.model.synthetic import write_checkpoint
from deltaserve.model.weights import checkpoint_files
from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams
from deltaserve.runtime.speculation import SpeculationOverride


def mtp_oracle(ckpt: str, hf, tokens: torch.Tensor, next_token: int) -> torch.Tensor:
    """The head's logits at every position of `tokens` (with `next_token` after them), from the semantics: at
    position i, fc([norm(embed(token i+1)) | norm(the model's final hidden state at i)]), a full-attention decoder
    layer (transformers' own, with the checkpoint's mtp.layers.0 weights) over positions 0..i, the head's norm,
    lm_head."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    cfg = hf.config
    head = {}
    for path in checkpoint_files(ckpt):
        head.update({k[len("mtp."):]: v.float() for k, v in load_file(path).items() if k.startswith("mtp.")})
    layer = m.Qwen3_5DecoderLayer(cfg, layer_idx=cfg.layer_types.index("full_attention")).float().eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in head.items() if k.startswith("layers.0.")})

    def norm(name):
        n = m.Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        n.load_state_dict({"weight": head[name + ".weight"]})
        return n

    L = tokens.shape[0]
    with torch.no_grad():
        hidden = hf.model(tokens[None]).last_hidden_state[0]  # final-normed
        shifted = torch.cat([tokens[1:], torch.tensor([next_token])])
        x = torch.cat([norm("pre_fc_norm_embedding")(hf.model.embed_tokens(shifted)),
                       norm("pre_fc_norm_hidden")(hidden)], dim=-1) @ head["fc.weight"].t()
        positions = torch.arange(L).view(1, 1, L).expand(3, 1, L)
        mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
        y = layer(x[None], position_embeddings=hf.model.rotary_emb(x[None], positions), attention_mask=mask,
                  position_ids=positions[0])
        return hf.lm_head(norm("norm")(y[0]))


def test_the_mtp_head_matches_its_oracle_over_chunks_and_decode(tiny_ckpt):
    """The head over a prompt in two chunks (its KV in the pools' last layer), then two decode positions, each
    from the model's own hidden states, against the oracle over the whole sequence."""
    runner = CpuRunner(tiny_ckpt, mtp=True)
    model, state = runner.model, runner.state
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, runner.cfg.vocab_size - 1, (44,), generator=g)
    L = 40
    ours = []
    for start, stop in ((0, 23), (23, L)):  # a chunk boundary inside a page
        batch = runner.prefill_batch(0, seq[start:stop].tolist(), start)
        hidden = model.forward(state, batch)
        ours.append(model.logits(model.mtp(seq[start + 1 : stop + 1], hidden, state, batch)))
    for pos in (L, L + 1):
        batch = runner.decode_batch({0: int(seq[pos])}, {0: pos})
        hidden = model.forward(state, batch)
        ours.append(model.logits(model.mtp(seq[pos + 1 : pos + 2], hidden, state, batch)))
    oracle = mtp_oracle(tiny_ckpt, hf_model(tiny_ckpt), seq[: L + 2], int(seq[L + 2]))
    assert rel_err(torch.cat(ours), oracle) <= 1e-4


def test_a_model_without_its_head_refuses_to_draft(tiny_ckpt):
    runner = CpuRunner(tiny_ckpt)
    batch = runner.prefill_batch(0, [1, 2, 3])
    hidden = runner.model.forward(runner.state, batch)
    with pytest.raises(RuntimeError, match="without its MTP head"):
        runner.model.mtp(torch.tensor([2, 3, 4]), hidden, runner.state, batch)


@pytest.mark.parametrize("accepted", [(1, 4), (2, 3), (4, 1)])
def test_a_verify_step_computes_what_decoding_its_tokens_does_and_rolls_back_to_the_accepted(tiny_ckpt, accepted):
    """Two requests and a padding row verify four tokens each; every position's logits equal one-token decodes,
    and after keeping `accepted` tokens a row decodes on as a request that decoded only those."""
    k = 3
    spec = CpuRunner(tiny_ckpt, speculative_tokens=k)
    g = torch.Generator().manual_seed(9)
    prompts = {s: torch.randint(0, 200, (n,), generator=g).tolist() for s, n in ((0, 21), (1, 32))}
    steps = {s: torch.randint(0, 200, (k + 1,), generator=g).tolist() for s in prompts}
    for s, ids in prompts.items():
        spec.prefill({s: ids})
    starts = {s: len(ids) for s, ids in prompts.items()}
    batch = spec.verify_batch({0: steps[0], -1: [5] * (k + 1), 1: steps[1]}, {**starts, -1: 0})
    verified = spec.model.logits(spec.model.forward(spec.state, batch)).view(3, k + 1, -1)
    spec.state.commit_verified(batch.rows.slots, torch.tensor([accepted[0], 1, accepted[1]]))
    for row, s in ((0, 0), (2, 1)):
        plain = CpuRunner(tiny_ckpt)
        plain.prefill({s: prompts[s]})
        for t, token in enumerate(steps[s]):
            expected = plain.decode({s: token}, {s: starts[s] + t})
            assert rel_err(verified[row, t], expected[0]) <= 1e-5, (s, t)
        # Roll-back: the next token after the accepted ones, on both.
        plain = CpuRunner(tiny_ckpt)
        plain.prefill({s: prompts[s] + steps[s][: accepted[row // 2]]})
        nxt, pos = 7, starts[s] + accepted[row // 2]
        assert rel_err(spec.decode({s: nxt}, {s: pos}), plain.decode({s: nxt}, {s: pos})) <= 1e-5, s


def test_the_verify_step_and_the_head_on_the_triton_ops_match_the_references(tiny_ckpt):
    """The Triton ops (interpreted on the CPU) take the verify's strided token views and the head's layer."""
    from deltaserve.kernels.ops import triton_ops

    k, prompt, step = 2, list(range(3, 22)), [40, 41, 42]
    results = []
    for ops in (None, triton_ops()):
        runner = CpuRunner(tiny_ckpt, ops=ops, mtp=True, speculative_tokens=k)
        runner.prefill({0: prompt})
        batch = runner.verify_batch({0: step, -1: [1] * (k + 1)}, {0: len(prompt), -1: 0})
        hidden = runner.model.forward(runner.state, batch)
        head = runner.model.mtp(batch.input_ids.roll(-1), hidden, runner.state, batch)
        runner.state.commit_verified(batch.rows.slots, torch.tensor([2, 1]))
        results.append((runner.model.logits(hidden), runner.model.logits(head), runner.state.ssm[:, 0].clone()))
    for ours, ref in zip(results[1], results[0]):
        assert rel_err(ours, ref) <= 1e-4


# The engine ---------------------------------------------------------------------------------------------------------


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 300, (n,), generator=g).tolist() for n in (5, 23, 40, 17, 64, 9)]


async def _serve(ckpt, prompts, params, tp=1, propose=None, acceptance=None, **kw):
    """Every prompt at once (staggered finishes: slots are promoted and compacted under the others); the outputs
    and the engine's speculative counters. Every step speculates unless `speculative_adaptive` is given; `propose`
    and `acceptance`: the `SpeculationOverride`'s."""
    kw.setdefault("speculative_adaptive", False)
    args = EngineArgs(model=ckpt, max_model_len=256, max_batch=4, cpu_memory_bytes=96 << 20, tp=tp, **kw)
    async with AsyncEngine(args, speculation_override=SpeculationOverride(propose, acceptance)) as engine:
        async def one(i, ids):
            p = params(i)
            last = None
            async for out in engine.generate(ids, p):
                last = out
            return last.token_ids, [e.logprob for e in last.logprobs or []], last.finish_reason
        outs = await asyncio.gather(*[one(i, ids) for i, ids in enumerate(prompts)])
        m = engine.metrics
        return outs, (m.spec_drafts._value.get(), m.spec_accepted._value.get())


def _greedy(i):
    return SamplingParams(temperature=0.0, max_tokens=7 + 5 * i, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def plain_greedy(tiny_tp_ckpt):
    return asyncio.run(_serve(tiny_tp_ckpt, _prompts(), _greedy))[0]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_output_is_identical_with_the_head_drafting(tiny_tp_ckpt, plain_greedy, k, tp):
    """The real head (random weights: its drafts are mostly rejected) at tp 1 and 2: tokens, log-probs and the
    lengths as without speculation."""
    outs, (drafted, _) = asyncio.run(_serve(tiny_tp_ckpt, _prompts(), _greedy, tp=tp, speculative_tokens=k))
    for (ids, lps, reason), (ref_ids, ref_lps, ref_reason) in zip(outs, plain_greedy):
        assert ids == ref_ids and reason == ref_reason
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4
    assert drafted > 0


def _continuation_drafter(plain, prompts, corrupt_at=()):
    """Drafts the target's own greedy continuation (from a run without speculation), wrong at the chosen output
    positions: every draft before a corrupted one is accepted."""
    by_prompt = {tuple(p): ids for p, (ids, _, _) in zip(prompts, plain)}

    def drafter(prompt, output, k):
        # Past the continuation's end: asked for each count a step in flight may keep, it may be asked up to
        # 2k + 1 tokens beyond what was generated.
        full = by_prompt[tuple(prompt)] + [0] * (2 * k + 2)
        n = len(output)
        return [(full[n + j] + 1) % 300 if n + j in corrupt_at else full[n + j] for j in range(k)]
    return drafter


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("corrupt_at", [(), (3, 4, 9, 20, 21, 22)])
def test_controlled_drafts_are_accepted_exactly_where_they_are_right(tiny_tp_ckpt, plain_greedy, k, corrupt_at):
    prompts = _prompts()
    drafter = _continuation_drafter(plain_greedy, prompts, set(corrupt_at))
    outs, (drafted, accepted) = asyncio.run(_serve(tiny_tp_ckpt, prompts, _greedy, speculative_tokens=k,
                                                   propose=drafter))
    assert [o[0] for o in outs] == [o[0] for o in plain_greedy]
    for (_, lps, _), (_, ref_lps, _) in zip(outs, plain_greedy):
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4
    if not corrupt_at:  # every step keeps all k drafts (the last one's past the known continuation aside)
        steps = [-(-(len(o[0]) - 1) // (k + 1)) for o in plain_greedy]  # the first token comes from the prefill
        assert drafted == k * sum(steps)
        assert accepted >= sum(len(o[0]) - 1 - n for o, n in zip(plain_greedy, steps))
    else:
        assert 0 < accepted < drafted


def test_seeded_sampling_draws_the_same_tokens_with_speculation(tiny_tp_ckpt):
    """A seeded row's token i is drawn from the same distribution with the same key (seed, i) whether it is a
    verify row or a plain decode row; drafts that equal the draw are kept. With penalties a row keeps no drafts."""
    prompts = _prompts()

    def sampled(i):
        extra = dict(presence_penalty=0.5) if i == 2 else {}
        return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=12, ignore_eos=True, **extra)

    plain, _ = asyncio.run(_serve(tiny_tp_ckpt, prompts, sampled))
    drafter = _continuation_drafter(plain, prompts)
    spec, (drafted, accepted) = asyncio.run(_serve(tiny_tp_ckpt, prompts, sampled, speculative_tokens=3,
                                                   propose=drafter))
    assert [o[0] for o in spec] == [o[0] for o in plain]
    assert accepted > 0


def test_a_flagged_speculative_draw_keeps_the_drafts_of_its_redrawn_tokens(tiny_tp_ckpt, monkeypatch):
    """A speculative step's kept counts are computed on the device behind its draw; where the sampler flagged a
    row (and its first token was wrong), the counts are computed again from the redrawn tokens before the next
    step, overlapped, takes them: the drafts of the right continuation are kept, and the tokens are those drawn
    without speculation."""
    prompts = _prompts()

    def sampled(i):
        return SamplingParams(temperature=0.9, top_k=30, seed=300 + i, max_tokens=12, ignore_eos=True)

    plain, _ = asyncio.run(_serve(tiny_tp_ckpt, prompts, sampled))
    flagging_every_filtered_row(monkeypatch)
    spec, (drafted, accepted) = asyncio.run(_serve(tiny_tp_ckpt, prompts, sampled, speculative_tokens=3,
                                                   propose=_continuation_drafter(plain, prompts)))
    assert [o[0] for o in spec] == [o[0] for o in plain]
    assert accepted >= 0.6 * drafted


def test_max_tokens_and_stop_ids_hold_on_the_kept_drafts(tiny_tp_ckpt, plain_greedy):
    """A step keeping several tokens stops exactly at max_tokens and at a stop id inside them."""
    prompts = _prompts()
    stop = plain_greedy[1][0][5]  # the sixth greedy token of prompt 1

    def params(i):
        if i == 1:
            return SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop], ignore_eos=True, logprobs=1)
        return SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True, logprobs=1)

    drafter = _continuation_drafter(plain_greedy, prompts)
    outs, _ = asyncio.run(_serve(tiny_tp_ckpt, prompts, params, speculative_tokens=4, propose=drafter))
    for i, (ids, _, reason) in enumerate(outs):
        ref = plain_greedy[i][0]
        if i == 1:
            cut = ref.index(stop)
            assert ids == ref[:cut] and reason == "stop"
        else:
            assert ids == ref[: 4 + i] and reason == "length"


async def _streamed(ckpt, prompts, params, propose=None, **kw):
    """Every prompt at once; per request what its stream delivered: (token_ids, text, the deltas' ids joined, the
    deltas' text joined, the deltas' log-probs joined, finish_reason, how many outputs said finished); and the
    engine's finished-requests count."""
    kw.setdefault("speculative_adaptive", False)
    args = EngineArgs(model=ckpt, max_model_len=256, max_batch=4, cpu_memory_bytes=96 << 20, **kw)
    async with AsyncEngine(args, speculation_override=SpeculationOverride(propose)) as engine:
        async def one(i, ids):
            outs = [out async for out in engine.generate(ids, params(i))]
            last = outs[-1]
            return (last.token_ids, last.text, [t for o in outs for t in o.delta_token_ids],
                    "".join(o.delta_text for o in outs), [e.logprob for o in outs for e in o.delta_logprobs or []],
                    last.finish_reason, sum(o.finished for o in outs))
        streams = await asyncio.gather(*[one(i, ids) for i, ids in enumerate(prompts)])
        finished = sum(s.value for m in engine.metrics.finished.collect() for s in m.samples
                       if s.name.endswith("_total"))
        return streams, finished


def _same_streams(spec, plain):
    for got, ref in zip(spec, plain):
        ids, text, delta_ids, delta_text, delta_lps, reason, finals = got
        assert (ids, text, reason, finals) == ref[:2] + ref[5:]
        assert delta_ids == ids and delta_text == text, "the stream lost or repeated tokens"
        assert len(delta_lps) == len(ref[4]) and max((abs(a - b) for a, b in zip(delta_lps, ref[4])), default=0) <= 1e-4


@pytest.mark.parametrize("ending", ["max_tokens", "stop_id", "stop_string"])
def test_streams_equal_plain_decoding_when_a_kept_draft_ends_the_request(tiny_tp_ckpt, plain_greedy, ending):
    """Every draft is right (the model's own continuation), so each speculative step keeps k + 1 tokens; the
    requests end at every position inside such a step, by length, by a stop id and by a stop string (with
    min_tokens holding one back). The streamed deltas, the text, the log-probs, the finish reason and the one
    final output each equal decoding without speculation, and the engine counts each request once."""
    prompts = _prompts()[:4]
    longest = plain_greedy[3][0]  # 22 greedy tokens of prompt 3
    cases = list(range(1, 12))

    def params(i):
        j = cases[i]
        base = dict(temperature=0.0, ignore_eos=True, logprobs=1)
        if ending == "max_tokens":
            return SamplingParams(max_tokens=j, **base)
        if ending == "stop_id":
            return SamplingParams(max_tokens=20, stop_token_ids=[longest[j]], **base)
        return SamplingParams(max_tokens=20, stop=[stop_texts[j]], min_tokens=j // 3, **base)

    stop_texts = {}
    if ending == "stop_string":
        from deltaserve.runtime.text import TextTokenizer
        tok = TextTokenizer(tiny_tp_ckpt)
        stop_texts = {j: tok.decode(longest[j : j + 1]) or "x" for j in cases}
    requests = [prompts[3]] * len(cases)
    plain, plain_finished = asyncio.run(_streamed(tiny_tp_ckpt, requests, params, enable_prefix_caching=False))
    drafter = _continuation_drafter(plain_greedy, prompts)
    for k in (2, 4):
        spec, finished = asyncio.run(_streamed(tiny_tp_ckpt, requests, params, speculative_tokens=k,
                                               propose=drafter, enable_prefix_caching=False))
        _same_streams(spec, plain)
        assert finished == plain_finished == len(cases)
    assert len({r[5] for r in plain}) >= 1 and len({len(r[0]) for r in plain}) >= 5  # the endings vary


def test_speculation_needs_the_head(tmp_path):
    ckpt = write_checkpoint(str(tmp_path / "no-mtp"), "tiny", mtp=False)

    async def start():
        async with AsyncEngine(EngineArgs(model=ckpt, speculative_tokens=2, cpu_memory_bytes=64 << 20)):
            pass
    with pytest.raises(Exception, match="MTP head"):
        asyncio.run(start())
    with pytest.raises(ValueError, match="speculative_tokens"):
        EngineArgs(speculative_tokens=9)


def _speculative_rank(ckpt):
    """A speculative (k = 3) rank of 4 decode slots and 2 prefill slots over 40 KV pages, every pool random; and
    those pools."""
    from deltaserve.devices.rank import RankRuntime

    state = (runner := CpuRunner(ckpt, mtp=True, speculative_tokens=3, num_slots=6, num_pages=40)).state
    pools = [state.conv, state.ssm, state.k_cache, state.v_cache, state.verify_hidden, state.drafts,
             state.conv_steps, state.ssm_steps]
    for pool in pools:
        pool.copy_(torch.randint_like(pool, 1, 50) if pool.dtype == torch.long else torch.randn_like(pool) * 0.1)
    return RankRuntime(runner.model, state, rank=1, max_batch=4, max_pages_per_seq=8, device="cpu"), pools


def test_the_speculative_programs_on_inert_inputs_touch_only_the_trash(tiny_ckpt):
    """What a graph capture runs before recording: every bucket's programs (one-token and speculative) over inert
    inputs leave every request slot's state, drafts and hidden states and every page as they were."""
    runtime, _ = _speculative_rank(tiny_ckpt)
    state = runtime.state
    def request_state():
        return [state.conv[:, :6], state.ssm[:, :6], state.verify_hidden[:6], state.drafts[:6]]
    before = [t.clone() for t in request_state()]
    pages = [state.k_cache[:, :40].clone(), state.v_cache[:, :40].clone()]
    shapes = ([StepShape(b) for b in (1, 2, 4)] + [StepShape(b, 4) for b in (1, 2, 4)]
              + [StepShape(b, 1, t) for b in (0, 1, 4) for t in (16, 32)])
    for shape, program in runtime.programs(shapes, prompt_requests=2).items():
        runtime.prepare(shape)
        out = program()
        if shape.tokens_per_row > 1:
            assert out.row_logits.shape[0] == shape.rows and out.draft_logits.shape[:2] == (shape.rows, 3)
            assert out.drafts.shape == (shape.rows, 3)
        elif shape.rows:
            assert out.row_logits.shape[0] == shape.rows
        if shape.prompt_tokens:
            assert out.chunk_logits.shape[0] == 3  # two chunks and the padding request
    assert all(torch.equal(x, y) for x, y in zip(before, request_state()))
    assert torch.equal(pages[0], state.k_cache[:, :40]) and torch.equal(pages[1], state.v_cache[:, :40])


def test_a_fused_mixed_step_leaves_the_head_what_its_steps_apart_do(tiny_ckpt):
    """A speculative engine's fused mixed step against its one-token decode step then its prefill with the head
    (each shape's program over the fixed inputs): the same logits, and the same state after it, the MTP head's KV
    and the hidden states its next drafts start from included; one decode row rolls back first, the other keeps
    all."""
    from deltaserve.model.batch import PrefillChunk

    runtime, pools = _speculative_rank(tiny_ckpt)
    start = [t.clone() for t in pools]
    programs = runtime.programs([StepShape(2), StepShape(0, 1, 16), StepShape(2, 1, 16)])
    runtime.inputs.table_host[0], runtime.inputs.table_host[1] = range(8), range(8, 16)
    chunk = PrefillChunk([3, 14, 15, 9, 26, 5, 35, 8, 9, 7], 0, 4, [16])

    def step(shapes: list[StepShape]):
        for pool, values in zip(pools, start):
            pool.copy_(values)
        runtime.inputs.fill([21, 17], [37, 70], 2)
        runtime.speculation.accepted[:2] = torch.tensor([2, 4])
        runtime.speculation.keep[:2] = torch.tensor([2, 4])
        runtime.prefill_inputs.fill([chunk], 16, chunk.token_ids[1:] + [11], [4])
        runtime.state.reset_slot(4)
        outs = [programs[s]() for s in shapes]
        return (outs[0].row_logits, outs[-1].chunk_logits[:1]), [t.clone() for t in pools]

    (apart, apart_state), (fused, fused_state) = step([StepShape(2), StepShape(0, 1, 16)]), step([StepShape(2, 1, 16)])
    for ours, ref in zip(fused, apart):
        assert rel_err(ours, ref) <= 1e-5
    for ours, ref in zip(fused_state, apart_state):
        assert torch.allclose(ours.float(), ref.float(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(apart_state[4][:2], start[4][:2])  # the decode rows' hidden states were written
    assert not torch.equal(apart_state[1][:, 0], start[1][:, 0])  # and row 0 rolled back before stepping


def test_an_emulated_acceptance_keeps_the_drafts_it_says(tiny_tp_ckpt):
    """Benchmarks emulate a trained head's acceptance on random weights: with (1, 1, 0) every step keeps two of
    its three drafts, whatever they are, but none past max_tokens, where a request ends exactly."""
    outs, (drafted, accepted) = asyncio.run(_serve(tiny_tp_ckpt, _prompts(), _greedy, speculative_tokens=3,
                                                   acceptance=(1.0, 1.0, 0.0)))
    lengths = [7 + 5 * i for i in range(len(outs))]
    assert [len(ids) for ids, _, _ in outs] == lengths
    steps = sum(-(-(n - 1) // 3) for n in lengths)  # the first token comes from the prefill; 3 tokens a step
    assert drafted == 3 * steps and accepted == sum(n - 1 for n in lengths) - steps
    with pytest.raises(ValueError, match="acceptance must hold speculative_tokens \\(3\\)"):
        SpeculationOverride(acceptance=(0.5, 0.5)).check(3)
    with pytest.raises(ValueError, match="none above the one before"):
        SpeculationOverride(acceptance=(0.5, 0.6)).check(2)


@pytest.mark.parametrize("tp", [1, 2])
def test_speculative_steps_overlap_and_change_no_token(tiny_tp_ckpt, monkeypatch, tp):
    """Overlap scheduling hands a step over before the speculative step ahead of it is back: its rows take that
    step's kept count and last token on the device (position, roll-back, token index). With a count that varies
    row by row and step by step (an emulated acceptance, on coins of each request's seed and token index), greedy,
    sampled, penalised and min_tokens requests keep the tokens and log-probs of an engine that waits for each
    step's tokens; the overlapped one ran steps that took counts on the device."""
    from deltaserve.devices.commands import KEPT_ON_DEVICE
    from deltaserve.devices.rank import RankRuntime

    prompts = _prompts()
    launch, pending_rows = RankRuntime.launch, []

    def counting(runtime, cmd, *args):
        if runtime.rank == 0:
            pending_rows.append(cmd.verify_accepted.count(KEPT_ON_DEVICE))
        return launch(runtime, cmd, *args)

    monkeypatch.setattr(RankRuntime, "launch", counting)

    def params(i):
        kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=20), dict(temperature=0.7, presence_penalty=0.6),
                 dict(temperature=0.0, min_tokens=9, stop_token_ids=[prompts[i][0]])]
        return SamplingParams(max_tokens=9 + 4 * i, seed=40 + i, logprobs=1, ignore_eos=True, **kinds[i % 4])

    runs = []
    for overlap in (False, True):
        pending_rows.clear()
        outs, (drafted, accepted) = asyncio.run(_serve(tiny_tp_ckpt, prompts, params, tp=tp, speculative_tokens=3,
                                                       acceptance=(0.9, 0.6, 0.3),
                                                       async_scheduling=overlap))
        runs.append((outs, sum(pending_rows)))
        assert 0 < accepted < drafted
    (sync, none_pending), (overlapped, pending) = runs
    assert none_pending == 0 and pending > 0
    for (ids, lps, reason), (ref_ids, ref_lps, ref_reason) in zip(overlapped, sync):
        assert ids == ref_ids and reason == ref_reason
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4


def test_no_step_runs_for_a_request_its_last_speculative_step_ended(tiny_tp_ckpt, monkeypatch):
    """Overlapped, the step after a speculative one is planned before its counts are back; where that step may end
    a request at max_tokens, the loop waits for them instead, so no step runs for a request already done (a
    request arriving then would queue behind it)."""
    from deltaserve.devices.rank import RankRuntime

    launch, decode_steps = RankRuntime.launch, []

    def counting(runtime, cmd, *args):
        if runtime.rank == 0 and cmd.decode_tokens:
            decode_steps.append(len(cmd.decode_tokens))
        return launch(runtime, cmd, *args)

    monkeypatch.setattr(RankRuntime, "launch", counting)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (13, 14, 2)]

    async def main():
        args = EngineArgs(model=tiny_tp_ckpt, max_model_len=256, max_batch=4, cpu_memory_bytes=96 << 20,
                          speculative_tokens=3, speculative_adaptive=False, warmup=False)
        async with AsyncEngine(args, speculation_override=SpeculationOverride(acceptance=(1.0, 1.0, 1.0))) as engine:
            for p in params:  # one at a time
                decode_steps.clear()
                out = await _collect(engine, _prompts()[1], p)
                assert len(out[0]) == p.max_tokens
                # The first token comes from the prefill, then four a step.
                assert len(decode_steps) == -(-(p.max_tokens - 1) // 4), (p.max_tokens, decode_steps)

    asyncio.run(main())


def test_an_emulated_acceptance_is_what_the_metrics_report_per_position(tiny_tp_ckpt):
    """A published profile is per-position rates (the share of steps whose draft j is kept, as vLLM's metrics
    and ours count them): emulated, the engine's per-position counters give it back, and a step keeps 1 + the
    rates' sum tokens on average (kept only after the one before, draft 4 would be kept 0.27 of the time)."""
    rates = (0.92, 0.84, 0.65, 0.54)
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)

    async def main():
        args = EngineArgs(model=tiny_tp_ckpt, max_model_len=512, max_batch=4, cpu_memory_bytes=96 << 20,
                          speculative_tokens=4, speculative_adaptive=False)
        async with AsyncEngine(args, speculation_override=SpeculationOverride(acceptance=rates)) as engine:
            async def one(ids):
                async for _ in engine.generate(ids, params):
                    pass
            await asyncio.gather(*[one(ids) for ids in _prompts()[:4]])
            m = engine.metrics
            steps = m.spec_drafts._value.get() / 4
            return steps, [m.spec_accepted_at.labels(str(j))._value.get() / steps for j in range(4)]

    steps, measured = asyncio.run(main())
    assert steps >= 100
    for want, got in zip(rates, measured):
        assert abs(got - want) <= 0.08, (measured, rates)


def test_step_log_sums_up_the_engines_steps_by_kind(tiny_tp_ckpt, caplog):
    """tools.lab.step_log reads the engine's own step lines (`--log-steps`): a speculative engine's steps by kind,
    each line's four times parsed (the idle time from the second step on)."""
    from deltaserve.tools.lab.step_log import summarise, table

    caplog.set_level(logging.DEBUG, logger="deltaserve.steps")
    asyncio.run(_serve(tiny_tp_ckpt, _prompts()[:2], _greedy, speculative_tokens=2))
    lines = [r.getMessage() for r in caplog.records if r.name == "deltaserve.steps"]
    steps = summarise(lines)
    assert sum(len(v["device"]) for v in steps.values()) == len(lines) > 0
    spec = steps["speculative"]
    assert len(spec["device"]) == len(spec["host"]) == len(spec["launch"]) == len(spec["idle"]) > 0
    assert min(spec["device"]) > 0 and "| speculative | " in table(steps)


def test_steps_above_the_speculative_batch_limit_decode_one_token_and_hand_over_cleanly(tiny_tp_ckpt, plain_greedy):
    """With speculative_max_batch 2: two requests speculate (drafts partly kept), then three more join and the
    steps of 3-5 rows decode one token a row, rolling back first what the last verify step left, until the batch
    is small again: the tokens and log-probs are still plain decoding's."""
    prompts = _prompts()
    drafter = _continuation_drafter(plain_greedy, prompts, set(range(2, 40, 3)))  # partly kept: roll-backs

    async def main():
        args = EngineArgs(model=tiny_tp_ckpt, max_model_len=256, max_batch=4, cpu_memory_bytes=96 << 20,
                          speculative_tokens=3, speculative_max_batch=2, speculative_adaptive=False)
        async with AsyncEngine(args, speculation_override=SpeculationOverride(drafter)) as engine:
            async def one(i, wait_for=None):
                if wait_for is not None:
                    await wait_for.wait()
                last = None
                async for out in engine.generate(prompts[i], _greedy(i)):
                    last = out
                    if i == 5 and len(out.token_ids) >= 6:
                        joined.set()
                return last.token_ids, [e.logprob for e in last.logprobs]
            joined = asyncio.Event()
            outs = await asyncio.gather(*[one(i, None if i >= 4 else joined) for i in range(6)])
            return outs, engine.metrics.spec_accepted._value.get()

    outs, accepted = asyncio.run(main())
    assert [o[0] for o in outs] == [o[0] for o in plain_greedy]
    for (_, lps), (_, ref_lps, _) in zip(outs, plain_greedy):
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4
    assert accepted > 0


def test_capture_check_runs_the_speculative_programs(tiny_ckpt, capsys):
    from deltaserve.tools import capture_check

    assert capture_check.main(["--model", tiny_ckpt, "--device", "cpu", "--buckets", "1,2,4", "--prefill-tokens",
                               "128", "--speculative-tokens", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[:2] for line in out.splitlines() if line.split()[:1] in (["speculative"], ["mixed"])]
    assert rows == [["speculative", "1x3"], ["speculative", "2x3"], ["speculative", "4x3"], ["mixed", "1+64"],
                    ["mixed", "2+128"]]
    assert out.strip().endswith("OK")  # the mixed steps' roll-back and head as the steps apart


def test_speculation_over_cached_prefixes_keeps_the_tokens(tiny_tp_ckpt):
    """Prompts that share a system prompt and extend one another, served one after another with the prefix cache
    (on by default): a speculative engine resumes from the cached prefixes (its head reading the head's KV there)
    and still emits plain decoding's tokens, at tp 1 and 2. A repeated prompt resumes after all of it, its first
    draft from the hidden state its snapshot kept."""
    g = torch.Generator().manual_seed(21)
    system = torch.randint(0, 300, (70,), generator=g).tolist()
    turn = system + torch.randint(0, 300, (30,), generator=g).tolist()
    prompts = [system + [5, 6, 7], system + [8] * 20, turn, turn + [9] * 17, system[:40] + [3] * 9, turn]

    async def serve(**kw):
        args = EngineArgs(model=tiny_tp_ckpt, max_model_len=256, max_batch=4, cpu_memory_bytes=96 << 20, **kw)
        async with AsyncEngine(args) as engine:
            outs = []
            for i, ids in enumerate(prompts):
                last = None
                async for out in engine.generate(ids, _greedy(i % 3)):
                    last = out
                outs.append((last.token_ids, last.num_cached_tokens))
            return outs

    plain = asyncio.run(serve())
    for tp in (1, 2):
        spec = asyncio.run(serve(tp=tp, speculative_tokens=3))
        assert [ids for ids, _ in spec] == [ids for ids, _ in plain]
        assert [cached for _, cached in spec] == [cached for _, cached in plain] and spec[2][1] > 0
    assert plain[5] == (plain[2][0], len(turn))  # the repeat: every prompt token cached, the same tokens


def test_the_policy_speculates_where_it_is_measured_to_pay():
    """Each bucket tries both kinds, then takes the one with fewer seconds a token (keeping it near a tie), and
    tries the other again every RETRY steps; buckets above the limit never speculate; not adaptive: every step
    does."""
    from deltaserve.runtime.speculation import RETRY, TRIES, WINDOW, SpeculationPolicy

    def serve(policy, bucket, spec_s, plain_s, tokens, steps):
        kinds = []
        for _ in range(steps):
            kind = policy.decide(bucket)
            policy.observe(bucket, kind, spec_s if kind else plain_s, tokens if kind else 1.0)
            kinds.append(kind)
        return kinds

    policy = SpeculationPolicy(3, max_batch=16)
    kinds = serve(policy, 4, spec_s=0.010, plain_s=0.004, tokens=3.0, steps=2 * RETRY)  # 3.3 ms a token < 4
    assert kinds[:2 * TRIES] == [True] * TRIES + [False] * TRIES
    assert kinds[2 * TRIES:].count(False) == 2  # the retries, at steps RETRY and 2 RETRY
    kinds = serve(SpeculationPolicy(3), 8, spec_s=0.010, plain_s=0.004, tokens=1.2, steps=RETRY)  # 8.3 > 4
    assert kinds[2 * TRIES:].count(True) == 1
    assert serve(policy, 32, 0.001, 0.004, 4.0, 5) == [False] * 5  # above max_batch
    # Near a tie the chosen kind stays: 2% slower a token still speculates, 5% slower switches.
    tie = SpeculationPolicy(3)
    serve(tie, 2, spec_s=0.0108, plain_s=0.004, tokens=3.0, steps=2 * TRIES + 1)  # 3.6 ms a token: speculates
    assert serve(tie, 2, spec_s=0.01224, plain_s=0.004, tokens=3.0, steps=RETRY - 2 * TRIES - 2).count(False) == 0
    assert serve(tie, 2, spec_s=0.0126, plain_s=0.004, tokens=3.0, steps=2 * WINDOW)[-1] is False
    assert serve(SpeculationPolicy(3, adaptive=False), 8, 0.010, 0.004, 1.0, 5) == [True] * 5
    policy.reset()
    assert not policy.buckets and policy.yield_ == 1.0


def test_adaptive_speculation_runs_both_kinds_of_step_and_changes_no_output(tiny_tp_ckpt, plain_greedy):
    """With the policy on, a bucket's steps alternate between speculative and one-token ones (rolling back what
    a verify step left): the tokens and log-probs are still plain decoding's."""
    prompts = _prompts()
    drafter = _continuation_drafter(plain_greedy, prompts, set(range(2, 40, 3)))

    async def main():
        args = EngineArgs(model=tiny_tp_ckpt, max_model_len=256, max_batch=4, cpu_memory_bytes=96 << 20,
                          speculative_tokens=3)
        async with AsyncEngine(args, speculation_override=SpeculationOverride(drafter)) as engine:
            outs = [await _collect(engine, p, _greedy(i)) for i, p in enumerate(prompts)]
            return outs, engine.speculation.buckets[1].times

    outs, times = asyncio.run(main())
    assert [o[0] for o in outs] == [o[0] for o in plain_greedy]
    for (_, lps), (_, ref_lps, _) in zip(outs, plain_greedy):
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4
    assert len(times[True]) > 0 and len(times[False]) > 0


def test_the_policy_charges_each_step_the_host_time_it_exposes(tiny_tp_ckpt, plain_greedy):
    """Both kinds of step are overlapped with the host's routing and outputs, which the devices wait for where
    they take longer than a step: each step is charged that wait. With slow host work after each decode step
    (0.5 s: more than a step's time varies by on a loaded 2-core machine) and every draft kept, a speculative
    step's four tokens come for one wait, and the policy settles on speculating."""
    prompts = _prompts()

    def slow_host(step):
        if step.plan.decode_ids:
            time.sleep(0.5)

    async def main():
        args = EngineArgs(model=tiny_tp_ckpt, max_model_len=256, max_batch=4, cpu_memory_bytes=96 << 20,
                          speculative_tokens=3)
        drafter = SpeculationOverride(_continuation_drafter(plain_greedy, prompts))
        async with AsyncEngine(args, speculation_override=drafter) as engine:
            engine.steps.observers.append(slow_host)
            await _collect(engine, prompts[5], _greedy(5))
            return engine.speculation.buckets[1]

    bucket = asyncio.run(main())
    assert len(bucket.times[True]) >= 3 and len(bucket.times[False]) >= 3
    assert bucket.choice is True


def test_one_token_steps_keep_the_heads_kv_as_speculative_steps_do(tiny_ckpt):
    """The head's KV at the positions a request decoded is the same whether every step decoded one token (the
    head run over each step's last position) or every step speculated with drafts that were all kept."""
    prompt = _prompts()[2]
    params = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)

    async def head_kv(propose=None, **kw):
        args = EngineArgs(model=tiny_ckpt, max_model_len=256, max_batch=1, cpu_memory_bytes=96 << 20,
                          speculative_tokens=3, enable_prefix_caching=False, **kw)
        async with AsyncEngine(args, speculation_override=SpeculationOverride(propose)) as engine:
            ids, _ = await _collect(engine, prompt, params)
            state = engine.replica.ranks[0].runtime.state
            return ids, state.k_cache[-1, :4].flatten(0, 1).clone()  # the first request's pages: 0, 1, ...

    plain_ids, one_token = asyncio.run(head_kv(speculative_max_batch=0))
    drafter = _continuation_drafter([(plain_ids, None, None)], [prompt])
    spec_ids, speculated = asyncio.run(head_kv(speculative_adaptive=False, propose=drafter))
    assert spec_ids == plain_ids
    written = len(prompt) + len(plain_ids) - 3 - 2  # up to the last step's first position, either way
    assert one_token[:written].abs().sum() > 0
    assert torch.allclose(one_token[:written], speculated[:written], atol=1e-4)


async def _collect(engine, prompt, params):
    last = None
    async for out in engine.generate(prompt, params):
        last = out
    return last.token_ids, [e.logprob for e in last.logprobs or []]


@pytest.mark.parametrize("draft_vocab", [0, 64])
@pytest.mark.parametrize("fp8", [True, False])
def test_a_draft_vocabulary_limits_the_drafts_not_the_output(tiny_tp_ckpt, plain_greedy, draft_vocab, fp8):
    """With speculative_draft_vocab N the head drafts among token ids below N (lm_head's first N rows), from an
    FP8 copy of them by default; the output is plain decoding's either way."""
    async def main():
        args = EngineArgs(model=tiny_tp_ckpt, max_model_len=256, max_batch=4, cpu_memory_bytes=96 << 20,
                          speculative_tokens=3, speculative_adaptive=False, speculative_draft_vocab=draft_vocab,
                          speculative_fp8_draft_head=fp8)
        async with AsyncEngine(args) as engine:
            runtime = engine.replica.ranks[0].runtime
            lm_head = runtime.model.w["lm_head.weight"]
            rows, head = draft_vocab or lm_head.shape[0], runtime.speculation.draft_head
            if fp8:
                assert isinstance(head, Fp8Weight) and head.shape == (rows, lm_head.shape[1])
                err = (head.dequantise() - lm_head[:rows].float()).abs().max()
                assert 0 < err <= lm_head.abs().max() / 8  # e4m3 keeps 3 mantissa bits
            else:
                assert head is None if not draft_vocab else head.data_ptr() == \
                    lm_head.data_ptr()  # a view of lm_head's first rows
            state = runtime.state
            drafts = []
            for i, p in enumerate(_prompts()):
                outs = await _collect(engine, p, _greedy(i))
                drafts.append(state.drafts[:4].clone())  # the last step's drafts of the slots in use
                yield outs
            yield torch.cat(drafts)

    async def run_all():
        return [item async for item in main()]

    *outs, drafts = asyncio.run(run_all())
    assert [o[0] for o in outs] == [o[0] for o in plain_greedy]
    assert (drafts.max() < 64) == bool(draft_vocab)
    with pytest.raises(ValueError, match="speculative_draft_vocab must be an integer >= 0"):
        EngineArgs(speculative_draft_vocab=-1)


def test_a_speculative_engines_padded_prefills_change_no_output_and_no_draft(tiny_tp_ckpt):
    """A speculative engine's prefills through the padded fixed inputs its prefill graphs read, the head's inputs
    with them (each token's following token, the rows its last hidden states go to): the tokens, log-probs and
    the head's drafts of every prefill run eagerly."""
    prompts = _prompts()

    async def serve(padded: bool):
        args = EngineArgs(model=tiny_tp_ckpt, max_model_len=256, max_batch=4, prefill_slots=2,
                          cpu_memory_bytes=96 << 20, prefill_token_budget=48, speculative_tokens=3,
                          speculative_adaptive=False)
        async with AsyncEngine(args) as engine:
            runtime = engine.replica.ranks[0].runtime
            if padded:
                EagerPrograms.install(runtime, [StepShape(0, 1, t) for t in (16, 32, 64)], 2)
            outs, drafts = [], []
            for i, p in enumerate(prompts):
                outs.append(await _collect(engine, p, _greedy(i)))
                drafts.append(runtime.state.drafts[:4].clone())
            outs += await asyncio.gather(*[_collect(engine, p, _greedy(i)) for i, p in enumerate(prompts[:3])])
            return outs, torch.cat(drafts), sum(runtime.graphs.replays.values()) if padded else 0

    padded, padded_drafts, replays = asyncio.run(serve(True))
    eager, eager_drafts, _ = asyncio.run(serve(False))
    assert replays > 0
    assert [o[0] for o in padded] == [o[0] for o in eager]
    for (_, a), (_, b) in zip(padded, eager):
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5
    assert torch.equal(padded_drafts, eager_drafts)


def test_the_padded_prefill_with_the_head_writes_what_the_eager_one_writes(tiny_ckpt):
    """A speculative engine's prefill step (two chunks, one ending its prompt, one not) replayed over the padded
    fixed inputs against the same step run eagerly: the head's KV, the hidden state each prompt's first draft
    starts from (only for the chunk that ends its prompt) and every other state are the same; and the padded
    program's logits are the model's at each chunk's last token."""
    from deltaserve.devices.commands import PrefillCommand, StepCommand
    from deltaserve.devices.rank import RankRuntime

    from helpers import EagerPrograms

    runner = CpuRunner(tiny_ckpt, mtp=True, speculative_tokens=3, num_slots=6, num_pages=40)
    state = runner.state
    runtime = RankRuntime(runner.model, state, rank=1, max_batch=2, max_pages_per_seq=8, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    ends, goes_on = (torch.randint(0, 300, (n,), generator=g).tolist() for n in (21, 12))
    cmd = StepCommand(prefill=[PrefillCommand(ends, 0, 2, [0, 1], True),
                               PrefillCommand(goes_on, 0, 3, [4], False, next_token=77)])
    state.verify_hidden.copy_(torch.randn_like(state.verify_hidden))
    pools = (state.k_cache, state.v_cache, state.verify_hidden, state.conv, state.ssm, state.last_hidden)
    before = [t.clone() for t in pools]

    runtime.launch(cmd)
    after_eager = [t.clone() for t in pools]
    for t, saved in zip(pools, before):
        t.copy_(saved)
    outputs = []
    graphs = EagerPrograms.install(runtime, [StepShape(0, 1, 32), StepShape(0, 1, 64)], prompt_requests=2)
    graphs.programs = {s: (lambda p=p: outputs.append(p()) or outputs[-1]) for s, p in graphs.programs.items()}
    runtime.launch(cmd)
    assert graphs.replays == {StepShape(0, 1, 64): 1}
    (padded,) = outputs
    assert padded.chunk_logits.shape[0] == 3
    assert rel_err(padded.chunk_logits[:2], runner.model.logits(state.last_hidden[[2, 3]])) <= 1e-6
    # Every request slot's state and every page but the trash the padding writes to.
    requests = [(slice(None), slice(None, state.num_pages)), (slice(None), slice(None, state.num_pages)),
                (slice(None, state.num_slots),), (slice(None), slice(None, state.num_slots)),
                (slice(None), slice(None, state.num_slots)), (slice(None, state.num_slots),)]
    for now, want, part in zip(pools, after_eager, requests):
        assert rel_err(now[part], want[part]) <= 1e-5
    assert not torch.equal(state.verify_hidden[2], before[2][2])  # the prompt that ended kept its last hidden
    assert torch.equal(state.verify_hidden[3], before[2][3])  # the one that goes on did not
    assert not torch.equal(state.k_cache[-1][[0, 1, 4]], before[0][-1][[0, 1, 4]])  # the head wrote its KV


@pytest.mark.parametrize("tp", [1, 2])
def test_speculation_on_an_fp8_checkpoint_keeps_the_tokens_of_plain_decoding(tmp_path, tp):
    """Block-scaled FP8 weights kept in FP8 (the head's `mtp.*` too) at tp 1 and 2: greedy tokens with the head
    drafting k = 2 are those of decoding one token a step on the same checkpoint."""
    ckpt = write_checkpoint(str(tmp_path / "fp8"), "tiny-fp8", seed=3, fp8=True)
    plain = asyncio.run(_serve(ckpt, _prompts(), _greedy, tp=tp))[0]
    outs, (drafted, _) = asyncio.run(_serve(ckpt, _prompts(), _greedy, tp=tp, speculative_tokens=2))
    assert [o[0] for o in outs] == [o[0] for o in plain] and drafted > 0
    for (_, lps, _), (_, ref_lps, _) in zip(outs, plain):
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= 1e-4


def test_the_draft_head_is_lm_heads_first_rows_in_the_form_asked():
    """`draft_head`: None for the whole bf16 lm_head, a view of its first rows, or an FP8 copy quantised a few rows
    at a time exactly as a whole (the same blocks); an lm_head stored in FP8 gives its rows with their scales."""
    from deltaserve.devices.speculation import draft_head
    from deltaserve.model.weights import fp8_copy, quantise_fp8

    lm = torch.randn(300, 256, generator=torch.Generator().manual_seed(2))
    whole = Fp8Weight(*quantise_fp8(lm, 128), 128)
    sliced = fp8_copy(lm, rows_at_once=128)  # three slices, the last one short
    assert torch.equal(sliced.values.view(torch.uint8), whole.values.view(torch.uint8))
    assert torch.equal(sliced.scale, whole.scale)
    assert draft_head(lm) is None
    view = draft_head(lm, 100)
    assert view.shape == (100, 256) and view.data_ptr() == lm.data_ptr()
    assert draft_head(lm, 200, fp8=True).shape == (200, 256) and draft_head(lm, fp8=True).shape == (300, 256)
    assert draft_head(whole) is None
    assert torch.equal(draft_head(whole, 200).dequantise(), whole.dequantise()[:200])
