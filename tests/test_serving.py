"""The serving logic end to end through AsyncEngine on the CPU backend, against oracles that do not share its code.

- Log-probs (fp32) against the model's own teacher-forced forward and against transformers, so a bug that moves
  them without changing an argmax (a KV write to the wrong page, a lost chunk of a prompt) fails.
- A row-by-row reference sampler, written here from the definitions (penalties as vLLM applies them, min-tokens
  masking, temperature and top-k over the counter-based uniforms), for requests that start and finish at
  different times, so their slots are promoted and compacted under them.
- Stopping (EOS from the checkpoint, stop ids, stop strings across token boundaries, min_tokens exactly), every
  finish reason, and the failure paths (a failed, timed-out or cancelled step; a cancelled consumer; duplicate
  ids).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections import Counter

import pytest
import torch
from helpers import CpuRunner, EagerPrograms, flagging_every_filtered_row, hf_model, wait_free

from deltaserve.devices.backend import StepShape
from deltaserve.devices.commands import UNKNOWN_TOKEN
from deltaserve.devices.rank import RankRuntime
from deltaserve.kernels.sampling import counter_uniform
from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams
from deltaserve.runtime.engine import EngineDeadError

LOGPROB_ATOL_OURS = 1e-5  # fp32: the engine's chunks and decode steps against one teacher-forced forward
LOGPROB_ATOL_HF = 1e-4  # fp32 against transformers' own kernels


def run(coro):
    return asyncio.run(coro)


def engine_args(ckpt, **kw):
    base = dict(model=ckpt, max_model_len=512, max_batch=8, cpu_memory_bytes=64 << 20)
    base.update(kw)
    return EngineArgs(**base)


async def collect(stream):
    outs = [out async for out in stream]
    return outs[-1], outs


def record_commands(engine) -> list:
    """Every StepCommand the engine hands to the ranks, in order."""
    commands, start_step = [], engine.replica.start_step

    def recording(cmd, **kw):
        commands.append(cmd)
        return start_step(cmd, **kw)

    engine.replica.start_step = recording
    return commands


def prompt_of(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=gen).tolist()


def teacher_forced_logprobs(forward, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Log-probs [len(generated), V] of each generated position, from one forward over prompt + generated."""
    ids = prompt + generated[:-1]
    logits = forward(ids)[len(prompt) - 1 :]
    return logits.double().log_softmax(-1)


def assert_logprobs_match(out, ref: torch.Tensor, atol: float) -> None:
    assert len(out.logprobs) == len(out.token_ids) == ref.shape[0]
    for i, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
        assert entry.token_id == token
        assert abs(entry.logprob - ref[i, token].item()) <= atol, (i, entry.logprob, ref[i, token].item())
        ref_top = ref[i].topk(len(entry.top))
        assert [t for t, _ in entry.top] == ref_top.indices.tolist(), i
        for (_, lp), expected in zip(entry.top, ref_top.values.tolist()):
            assert abs(lp - expected) <= atol, (i, lp, expected)


# Chunked prefill ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf(tiny_ckpt):
    return hf_model(tiny_ckpt)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_prompts_of_several_chunks_alone_and_packed_match_the_model_and_hf(tiny_ckpt, hf, overlap):
    """A 24-token prefill budget cuts every long prompt into chunks, and packs the chunks of several prompts
    into one step; the log-probs of every generated token equal a one-piece forward's and transformers'."""
    prompts = [prompt_of(n, seed) for seed, n in enumerate((70, 49, 5, 131))]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=5, ignore_eos=True)

    async def main():
        # Prefix caching off: it would end chunks at page boundaries, and these chunks start at odd offsets.
        async with AsyncEngine(engine_args(tiny_ckpt, prefill_token_budget=24, async_scheduling=overlap,
                                           enable_prefix_caching=False)) as engine:
            commands = record_commands(engine)
            alone, _ = await collect(engine.generate(prompts[0], params))
            alone_commands = list(commands)
            packed = await asyncio.gather(*[collect(engine.generate(p, params)) for p in prompts])
            return alone, alone_commands, [out for out, _ in packed], commands[len(alone_commands):]

    alone, alone_commands, packed, packed_commands = run(main())
    # The runs did what they claim: several chunks per prompt, later chunks at offsets, chunks packed together.
    starts = [p.start for cmd in alone_commands for p in cmd.prefill]
    assert starts == [0, 24, 48]
    assert any(len(cmd.prefill) >= 2 and any(p.start > 0 for p in cmd.prefill) for cmd in packed_commands)
    assert all(sum(len(p.token_ids) for p in cmd.prefill) <= 24 for cmd in packed_commands)

    runner = CpuRunner(tiny_ckpt)

    def ours(ids):
        runner.__init__(tiny_ckpt)
        return runner.prefill({0: ids}, all_logits=True)

    def theirs(ids):
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0]

    assert alone.token_ids == packed[0].token_ids
    for prompt, out in zip([prompts[0], *prompts], [alone, *packed]):
        assert out.finish_reason == "length" and len(out.token_ids) == 10
        assert_logprobs_match(out, teacher_forced_logprobs(ours, prompt, out.token_ids), LOGPROB_ATOL_OURS)
        assert_logprobs_match(out, teacher_forced_logprobs(theirs, prompt, out.token_ids), LOGPROB_ATOL_HF)


@pytest.mark.parametrize("tp", [1, 2])
def test_one_chunk_prefills_padded_to_a_bucket_change_no_output(tiny_tp_ckpt, tp):
    """Prefills that fit a bucket (one chunk or several packed) go through the padded fixed inputs a prefill graph
    reads, the others eagerly: the same tokens and log-probs (1e-5) as every prefill eager. Prompts from 1 token to
    several chunks, some resuming after a cached prefix, arriving together and one by one."""
    prompts = [prompt_of(n, 700 + n) for n in (1, 15, 16, 40, 64, 100)]
    prompts += [prompts[3] + prompt_of(20, 9), prompts[5][:50] + prompt_of(7, 10)]  # cached prefixes
    fresh = [prompt_of(n, 800 + n) for n in (1, 15, 16, 40, 64)]  # together (repeats would resume whole)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)

    async def serve_all(padded):
        async with AsyncEngine(engine_args(tiny_tp_ckpt, tp=tp, max_batch=4, prefill_slots=2,
                                           prefill_token_budget=48)) as engine:
            programs = []
            if padded:
                for r in engine.replica.ranks:
                    programs.append(EagerPrograms.install(r.runtime, [StepShape(0, 1, t) for t in (16, 32, 64)], 2))
                    fill = r.runtime.prefill_inputs.fill
                    r.runtime.prefill_inputs.fill = lambda chunks, bucket, *head, fill=fill: (
                        packed.append(len(chunks)), fill(chunks, bucket, *head))
            alone = [(await collect(engine.generate(p, params)))[0] for p in prompts]
            together = await asyncio.gather(*[collect(engine.generate(p, params)) for p in fresh])
            assert await wait_free(engine)
        return alone + [out for out, _ in together], programs

    packed = []  # chunks a replayed step carried
    padded, programs = run(serve_all(True))
    eager, _ = run(serve_all(False))
    for a, b in zip(padded, eager):
        assert a.token_ids == b.token_ids and a.num_cached_tokens == b.num_cached_tokens
        for x, y in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert max(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)) <= LOGPROB_ATOL_OURS
    assert padded[6].num_cached_tokens == 40  # the resumed ones did resume
    # Every rank replayed every bucket, packed chunks too (two prefill slots).
    assert all({s.prompt_tokens for s in p.replays} == {16, 32, 64} for p in programs) and max(packed) == 2
    assert all(sum(p.replays.values()) == sum(programs[0].replays.values()) for p in programs)


@pytest.mark.parametrize("tp", [1, 2])
def test_overlap_scheduling_changes_no_output(tiny_tp_ckpt, tp):
    """The same requests, arriving at the same moments, with overlap scheduling off and on: the same tokens, text,
    finish reasons and log-probs (greedy and seeded sampling; stop strings, stop ids, EOS, max_tokens). At tp = 2
    the second rank takes the tokens it was not sent from rank 0 on the device (an all-reduce with zeros)."""
    cases = [(prompt_of(4 + 9 * i, 300 + i), SamplingParams(
        max_tokens=5 + 3 * i, temperature=0.0 if i % 2 else 0.8, seed=50 + i, top_k=8, logprobs=2,
        stop=["e"] if i % 3 == 0 else [], stop_token_ids=[11 + i] if i % 4 == 1 else [], ignore_eos=i % 5 == 4))
        for i in range(10)]

    async def serve_all(overlap):
        async with AsyncEngine(engine_args(tiny_tp_ckpt, tp=tp, max_batch=4, prefill_slots=2,
                                           prefill_token_budget=32, async_scheduling=overlap)) as engine:
            async def late(i):
                await asyncio.sleep(0.003 * i)
                return (await collect(engine.generate(*cases[i])))[0]

            outs = await asyncio.gather(*[late(i) for i in range(len(cases))])
            assert await wait_free(engine)
            return outs

    sync, overlapped = run(serve_all(False)), run(serve_all(True))
    for a, b in zip(sync, overlapped):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        for x, y in zip(a.logprobs, b.logprobs):  # the batches differ (a stopped row draws once more)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert max(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)) < LOGPROB_ATOL_OURS
    assert {o.finish_reason for o in sync} == {"stop", "length"}


# A row-by-row reference sampler ---------------------------------------------------------------------------------------
def explicit(**kw) -> SamplingParams:
    """Every sampling field set, so none comes from the checkpoint's generation config (which sets top_p 0.8)."""
    full = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=1.0, ignore_eos=True)
    full.update(kw)
    return SamplingParams(**full)


def reference_generate(runner: CpuRunner, prompt: list[int], p: SamplingParams, stop_ids: set[int]) -> list[int]:
    """What one request alone should produce, from the definitions: presence/frequency penalties on the output
    counts, repetition penalty on ids seen in the prompt or output, stop ids masked while fewer than min_tokens
    tokens exist, greedy at temperature 0, else top-k at the temperature raced over counter_uniform(seed, index)."""
    vocab = runner.cfg.vocab_size
    logits = runner.prefill({0: prompt})[0]
    out: list[int] = []
    counts: Counter = Counter()
    for index in range(p.max_tokens):
        x = logits.double().clone()
        for token in set(prompt) | set(counts):
            x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
        for token, n in counts.items():
            x[token] -= p.frequency_penalty * n + p.presence_penalty
        if index < p.min_tokens:
            x[sorted(stop_ids)] = float("-inf")
        if p.temperature == 0:
            token = int(x.argmax())
        else:
            scaled = x / p.temperature
            if p.top_k:
                scaled[scaled < scaled.topk(p.top_k).values[-1]] = float("-inf")
            probs = scaled.softmax(-1)
            u = counter_uniform(torch.tensor([p.seed]), torch.tensor([index]), vocab)[0].double()
            token = int((probs / -u.log()).argmax())
        if token in stop_ids and index >= p.min_tokens:
            return out
        out.append(token)
        counts[token] += 1
        logits = runner.decode({0: token}, {0: len(prompt) + index})[0]
    return out


@pytest.mark.parametrize("overlap,flagged", [(False, False), (True, False), (True, True)],
                         ids=["sync", "overlap", "overlap-flagged"])
def test_penalties_min_tokens_and_seeds_follow_requests_through_slot_moves(tiny_ckpt, overlap, flagged, monkeypatch):
    """Twelve requests on four decode slots, arriving and finishing at different times, each with its own
    penalties, seed, min_tokens and stop ids: every one equals the row-by-row reference, though its slot was
    promoted into and compacted under it. With overlap scheduling too, where most input tokens are taken on the
    device by rank 0 and a stopped request draws one token more that is dropped; and with every sampled row
    flagged by the sampler, so the reference draws it again (its token on the device, its penalty counts) after
    the next step has moved its slot."""
    order = flagging_every_filtered_row(monkeypatch) if flagged else None
    cases = []
    for i in range(12):
        prompt = prompt_of(3 + (i * 7) % 19, 100 + i)
        params = explicit(
            max_tokens=6 + (i * 5) % 11, temperature=0.0 if i % 3 == 0 else 0.9, top_k=(0, 40, 12)[i % 3],
            seed=1000 + i, presence_penalty=(0.0, 1.5, -0.5, 0.8)[i % 4], frequency_penalty=(0.7, 0.0, 0.4)[i % 3],
            repetition_penalty=(1.0, 1.8, 1.3, 0.7)[(i + 1) % 4], min_tokens=(0, 3, 6)[i % 3],
            stop_token_ids=[prompt[0], 7 + i])
        cases.append((prompt, params))

    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, max_batch=4, prefill_slots=2,
                                           async_scheduling=overlap)) as engine:
            commands = record_commands(engine)

            async def late(i):
                await asyncio.sleep(0.004 * i)  # arrivals spread over the others' decode steps
                return await collect(engine.generate(*cases[i]))

            outs = await asyncio.gather(*[late(i) for i in range(len(cases))])
            assert await wait_free(engine)
            return [o for o, _ in outs], commands

    outs, commands = run(main())
    unknown = sum(t == UNKNOWN_TOKEN for cmd in commands for t in cmd.decode_tokens)
    assert (unknown > 0) == overlap, unknown
    if order is not None:  # step k+1 launched before step k was finished, many times
        at = {event: i for i, event in enumerate(order)}
        ahead = sum(at.get(("launch", seq + 1), len(order)) < i for (what, seq), i in at.items() if what == "finish")
        assert ahead > 10, order
    moved = [c for cmd in commands for c in cmd.compactions if c.moved_from is not None]
    assert moved, "no request changed slot under another: the test lost its point"
    assert any(p.to_slot > 0 for cmd in commands for p in cmd.promotions)
    for i, ((prompt, params), out) in enumerate(zip(cases, outs)):
        expected = reference_generate(CpuRunner(tiny_ckpt), prompt, params, set(params.stop_token_ids))
        assert out.token_ids == expected, i
        assert out.finish_reason == ("length" if len(expected) == params.max_tokens else "stop"), i
        assert len(out.token_ids) >= params.min_tokens


def test_penalties_change_greedy_text_exactly_as_the_reference_says(tiny_ckpt):
    """Penalised greedy rows beside an unpenalised one: the penalties change the text (so the reference is
    exercised), and each row is the reference's. The prompt holds a fifth of the vocabulary and comes in eight
    chunks: the repetition penalty must count the ids of every one of them."""
    prompt = prompt_of(120, 7)
    plain = explicit(max_tokens=32)
    penalised = [explicit(max_tokens=32, **kw) for kw in (
        dict(repetition_penalty=1.9), dict(frequency_penalty=2.0), dict(presence_penalty=1.5),
        dict(presence_penalty=-1.0))]

    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, prefill_token_budget=16)) as engine:
            return await asyncio.gather(*[collect(engine.generate(prompt, p)) for p in [plain, *penalised]])

    outs = [o for o, _ in run(main())]
    for params, out in zip([plain, *penalised], outs):
        assert out.token_ids == reference_generate(CpuRunner(tiny_ckpt), prompt, params, set())
    assert all(out.token_ids != outs[0].token_ids for out in outs[1:]), [o.token_ids for o in outs]


# Stopping -------------------------------------------------------------------------------------------------------------
def with_generation_config(ckpt: str, tmp_path, **fields) -> str:
    """A copy of the checkpoint whose generation_config.json has the given fields changed (same weights)."""
    out = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, out)
    path = f"{out}/generation_config.json"
    with open(path) as f:
        gen = json.load(f)
    gen.update(fields)
    with open(path, "w") as f:
        json.dump(gen, f)
    return out


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_eos_from_the_generation_config_stops_unless_ignored(tiny_ckpt, tmp_path, overlap):
    prompt = prompt_of(9, 3)

    async def base_run():
        async with AsyncEngine(engine_args(tiny_ckpt, async_scheduling=overlap)) as engine:
            return (await collect(engine.generate(prompt, greedy(30, ignore_eos=True))))[0]

    base = run(base_run())
    k = next(i for i in range(3, 30) if base.token_ids[i] not in base.token_ids[:i])
    eos = base.token_ids[k]
    ckpt = with_generation_config(tiny_ckpt, tmp_path, eos_token_id=[eos, 1])

    async def main():
        async with AsyncEngine(engine_args(ckpt, async_scheduling=overlap)) as engine:
            stopped, stopped_stream = await collect(engine.generate(prompt, greedy(30)))
            ignored, _ = await collect(engine.generate(prompt, greedy(30, ignore_eos=True)))
            late, _ = await collect(engine.generate(prompt, greedy(30, min_tokens=k + 1)))
            return stopped, stopped_stream, ignored, late

    stopped, stream, ignored, late = run(main())
    assert stopped.finish_reason == "stop" and stopped.token_ids == base.token_ids[:k]  # EOS is not output
    assert [t for o in stream for t in o.delta_token_ids] == stopped.token_ids
    assert "".join(o.delta_text for o in stream) == stopped.text
    assert ignored.finish_reason == "length" and ignored.token_ids == base.token_ids
    # Under min_tokens the EOS cannot be drawn at index k, so the text departs from the base there.
    assert late.token_ids[:k] == base.token_ids[:k] and late.token_ids[k] != eos
    assert eos not in late.token_ids[: k + 1]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_min_tokens_holds_every_stop_back_until_exactly_then(tiny_ckpt, overlap):
    """Every id but one is a stop id: the first min_tokens tokens can only be that id, and the request stops
    right after them (the next argmax is almost surely a stop id; the test checks that it is)."""
    prompt = prompt_of(6, 11)

    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, async_scheduling=overlap)) as engine:
            vocab = engine.cfg.vocab_size
            free_run, _ = await collect(engine.generate(prompt, greedy(1, ignore_eos=True)))
            keep = (free_run.token_ids[0] + 1) % vocab  # not the free argmax, so the mask is what decides
            stops = [t for t in range(vocab) if t != keep]
            outs = [await collect(engine.generate(prompt, greedy(20, min_tokens=m, stop_token_ids=stops,
                                                                  ignore_eos=True)))
                    for m in (0, 1, 5)]
            return keep, [o for o, _ in outs]

    keep, (none, one, five) = run(main())
    assert none.token_ids == [] and none.finish_reason == "stop"
    assert one.token_ids == [keep] and one.finish_reason == "stop"
    assert five.token_ids == [keep] * 5 and five.finish_reason == "stop"


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_stop_strings_across_token_boundaries(tiny_ckpt, overlap):
    prompt = prompt_of(8, 5)

    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, async_scheduling=overlap)) as engine:
            base, _ = await collect(engine.generate(prompt, greedy(40, ignore_eos=True)))
            pieces = [engine.tokenizer.decode([t]) for t in base.token_ids]
            # A stop string made of the end of one token's text and the start of the next one's.
            j = next(i for i in range(4, 39) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
                     and "".join(pieces).find(pieces[i][-2:] + pieces[i + 1][:2]) == len("".join(pieces[:i])) +
                     len(pieces[i]) - 2)
            stop = pieces[j][-2:] + pieces[j + 1][:2]
            cut, cut_stream = await collect(engine.generate(prompt, greedy(40, ignore_eos=True, stop=[stop])))
            kept, _ = await collect(engine.generate(prompt, greedy(40, ignore_eos=True, stop=["\x00never", stop],
                                                                   include_stop_str_in_output=True)))
            return base, pieces, j, stop, cut, cut_stream, kept

    base, pieces, j, stop, cut, stream, kept = run(main())
    before = "".join(pieces[: j + 1])[:-2]
    assert cut.finish_reason == "stop" and cut.text == before
    assert cut.token_ids == base.token_ids[: j + 2]  # through the token that completed the stop string
    assert "".join(o.delta_text for o in stream) == before  # nothing past the stop was ever streamed
    assert kept.finish_reason == "stop" and kept.text == before + stop


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_every_finish_reason(tiny_ckpt, overlap):
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, async_scheduling=overlap)) as engine:
            length, _ = await collect(engine.generate([5, 6, 7], greedy(4, ignore_eos=True)))
            by_id, _ = await collect(engine.generate([5, 6, 7], greedy(20, ignore_eos=True,
                                                                       stop_token_ids=[length.token_ids[2]])))
            stream = engine.generate([5, 6, 7], greedy(400, ignore_eos=True))
            outs = []
            async for out in stream:
                outs.append(out)
                if len(outs) == 3:
                    engine.abort(stream.request_id)  # by id, as the server does for a lost client
            return length, by_id, outs

    length, by_id, aborted = run(main())
    assert length.finish_reason == "length" and len(length.token_ids) == 4
    assert by_id.finish_reason == "stop" and by_id.token_ids == length.token_ids[:2]
    assert aborted[-1].finished and aborted[-1].finish_reason == "abort" and len(aborted) == 4
    assert all(not o.finished for o in aborted[:-1])


# Failure paths --------------------------------------------------------------------------------------------------------
async def live_streams(engine, n, max_tokens=400):
    """n requests that are all decoding: each has produced a first output."""
    streams = [engine.generate([3 + i, 4, 5], greedy(max_tokens, ignore_eos=True)) for i in range(n)]
    firsts = [await s.__anext__() for s in streams]
    return streams, firsts


async def rest_of(streams, timeout=10):
    return [await asyncio.wait_for(collect(s), timeout) for s in streams]


async def ends_once_dead(engine, streams) -> list:
    """The final output of each stream, once the engine has failed: it is unhealthy and refuses new work."""
    ends = await rest_of(streams)
    assert not engine.healthy
    with pytest.raises(EngineDeadError):
        engine.generate([1, 2], greedy(2))
    return [end for end, _ in ends]


@pytest.mark.parametrize("tp,overlap", [(1, False), (2, False), (1, True), (2, True)])
def test_a_failing_step_poisons_the_engine_and_ends_every_request_with_an_error(tiny_tp_ckpt, monkeypatch, tp,
                                                                                 overlap):
    launch, calls = RankRuntime.launch, []  # what every step runs, overlapped or not

    def failing(runtime, cmd, *args):
        calls.append(runtime.rank)
        if len(calls) > 8 * tp and runtime.rank == tp - 1:
            raise RuntimeError("the device fell over")
        return launch(runtime, cmd, *args)

    async def main():
        async with AsyncEngine(engine_args(tiny_tp_ckpt, tp=tp, async_scheduling=overlap)) as engine:
            streams, _ = await live_streams(engine, 3)
            monkeypatch.setattr(RankRuntime, "launch", failing)
            ranks = engine.replica.ranks
            return await ends_once_dead(engine, streams), ranks

    ends, ranks = run(main())
    assert all(e.finished and e.finish_reason == "error" and "fell over" in e.error for e in ends)
    assert all(r.runtime is None and r.model is None for r in ranks)  # closed, it lets go of weights and state


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_step_past_the_watchdog_poisons_the_engine(tiny_ckpt, monkeypatch, overlap):
    launch, calls = RankRuntime.launch, []

    def stalls(runtime, cmd, *args):
        calls.append(1)
        if len(calls) == 6:
            time.sleep(5.0)
        return launch(runtime, cmd, *args)

    monkeypatch.setattr(RankRuntime, "launch", stalls)

    async def main():
        # A watchdog that no step of a loaded 2-core machine reaches, and a stall well past it.
        async with AsyncEngine(engine_args(tiny_ckpt, step_timeout_s=2.0, async_scheduling=overlap)) as engine:
            streams, _ = await live_streams(engine, 2)
            return await ends_once_dead(engine, streams)

    ends = run(main())
    assert all(e.finish_reason == "error" and "did not finish" in e.error for e in ends)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_cancelled_step_loop_ends_every_request_with_an_error(tiny_ckpt, monkeypatch, overlap):
    launch, in_step = RankRuntime.launch, []

    def slow(runtime, cmd, *args):
        in_step.append(1)
        time.sleep(0.02)
        return launch(runtime, cmd, *args)

    monkeypatch.setattr(RankRuntime, "launch", slow)

    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, async_scheduling=overlap)) as engine:
            streams, _ = await live_streams(engine, 3)
            n = len(in_step)
            while len(in_step) == n:  # a step is with the ranks now
                await asyncio.sleep(0.001)
            engine.steps.task.cancel()
            return await ends_once_dead(engine, streams)

    ends = run(main())
    assert all(e.finished and e.finish_reason == "error" and "cancelled" in e.error for e in ends)


def test_cancelling_the_consuming_task_aborts_the_request_by_itself(tiny_ckpt):
    """The stream object stays referenced (so no finaliser helps): the cancellation alone must abort."""
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as engine:
            stream = engine.generate([4, 5, 6], greedy(400, ignore_eos=True))
            seen = []

            async def consume():
                async for out in stream:
                    seen.append(out)

            task = asyncio.create_task(consume())
            while len(seen) < 2:
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert stream.request_id not in engine.requests
            for _ in range(500):
                if engine.resources_free():
                    break
                await asyncio.sleep(0.005)
            finished = engine.metrics.finished.labels("abort")._value.get()
            return engine.resources_free(), finished, stream

    free, aborted, _ = run(main())
    assert free and aborted == 1


def test_a_stream_dropped_unread_is_aborted(tiny_ckpt):
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as engine:
            engine.generate([4, 5, 6], greedy(400, ignore_eos=True))  # the stream is dropped at once
            for _ in range(500):
                if engine.resources_free():
                    break
                await asyncio.sleep(0.005)
            return engine.resources_free(), engine.metrics.finished.labels("abort")._value.get()

    free, aborted = run(main())
    assert free and aborted == 1


def test_duplicate_request_ids_are_refused_and_the_first_request_is_untouched(tiny_ckpt):
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as engine:
            first = engine.generate([4, 5, 6], greedy(12, ignore_eos=True), request_id="same")
            with pytest.raises(ValueError, match="same"):
                engine.generate([9, 9], greedy(3), request_id="same")
            out, _ = await collect(first)
            alone, _ = await collect(engine.generate([4, 5, 6], greedy(12, ignore_eos=True)))
            return out, alone

    out, alone = run(main())
    assert out.finish_reason == "length" and out.token_ids == alone.token_ids and out.request_id == "same"


def test_a_host_side_bug_in_planning_ends_every_request_with_an_error(tiny_ckpt, monkeypatch):
    from deltaserve.runtime.scheduler import Scheduler

    schedule, plans = Scheduler.schedule, []

    def breaks(sched):
        plans.append(1)
        if len(plans) > 6:
            raise AssertionError("decode slots are not dense")
        return schedule(sched)

    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as engine:
            streams, _ = await live_streams(engine, 2)
            monkeypatch.setattr(Scheduler, "schedule", breaks)
            return await ends_once_dead(engine, streams)

    ends = run(main())
    assert all(e.finish_reason == "error" and "not dense" in e.error for e in ends)
