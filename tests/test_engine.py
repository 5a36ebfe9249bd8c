"""The asyncio engine end to end on the CPU device with a tiny checkpoint."""

import asyncio
import dataclasses
import gc
import logging
import time

import pytest
from helpers import CpuRunner, wait_free

from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams

GREEDY = dict(temperature=0.0)


def run(coro):
    return asyncio.run(coro)


def engine_args(ckpt, **kw):
    base = dict(model=ckpt, max_model_len=512, max_batch=16, cpu_memory_bytes=64 << 20)
    base.update(kw)
    return EngineArgs(**base)


async def collect(stream):
    out = None
    async for out in stream:
        pass
    return out


async def collect_all(stream):
    return [out async for out in stream]


def test_greedy_through_the_engine_equals_the_model(tiny_ckpt):
    prompts = [[5, 17, 300, 42, 9], list(range(40, 110))]
    expected = []
    for p in prompts:
        runner = CpuRunner(tiny_ckpt)
        logits = runner.prefill({0: p})
        toks = [int(logits[0].argmax())]
        for i in range(23):
            toks.append(int(runner.decode({0: toks[-1]}, {0: len(p) + i})[0].argmax()))
        expected.append(toks)

    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as engine:
            outs = await asyncio.gather(*[
                collect(engine.generate(p, SamplingParams(max_tokens=24, ignore_eos=True, **GREEDY)))
                for p in prompts
            ])
            assert await wait_free(engine)
            return outs

    outs = run(main())
    for out, exp in zip(outs, expected):
        assert out.token_ids == exp and out.num_tokens == len(exp)
        assert out.finish_reason == "length" and out.finished


def test_seeded_request_is_the_same_alone_and_in_a_batch(tiny_ckpt):
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    prompt = "the river runs past the mill"

    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as engine:
            alone = await collect(engine.generate(prompt, params))
            others = [engine.generate(f"noise {i} " * (i + 1), SamplingParams(max_tokens=5 + i, temperature=1.0,
                                                                          ignore_eos=True)) for i in range(16)]
            crowded = engine.generate(prompt, params)
            results = await asyncio.gather(collect(crowded), *[collect(o) for o in others])
            return alone, results[0]

    alone, crowded = run(main())
    assert alone.token_ids == crowded.token_ids and len(alone.token_ids) == 20
    assert len(set(alone.token_ids)) > 3  # actually sampled, not stuck on one token


def test_a_batch_lowered_to_fit_memory_fills_its_last_bucket(tiny_ckpt):
    # 900 KiB holds the state of 5 rows (and one full-length request's pages) where 8 were asked: the largest
    # bucket (8) is cut to 5, and a step of 5 rows runs.
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, max_batch=8, cpu_memory_bytes=900 << 10,
                                           enable_prefix_caching=False)) as engine:
            plan = engine.replica.plan
            prompts = [[7 + i, 40 + 3 * i, 99] for i in range(plan.max_batch)]
            crowded = await asyncio.gather(*[collect(engine.generate(p, SamplingParams(
                max_tokens=12, ignore_eos=True, **GREEDY))) for p in prompts])
            alone = [await collect(engine.generate(p, SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)))
                     for p in prompts]
            return plan.max_batch, engine.replica.buckets, crowded, alone

    rows, buckets, crowded, alone = run(main())
    assert rows in (3, 5, 6, 7) and buckets[-1] == rows, (rows, buckets)  # between two default buckets
    assert [c.token_ids for c in crowded] == [a.token_ids for a in alone]


def test_the_prompt_budget_is_the_users_or_the_resolved_default_everywhere(tiny_ckpt):
    """`prefill_token_budget` None resolves once (the CPU: the 8192 default) and the scheduler and the step
    budget take the replica's value; a value the user sets is kept as given."""
    from deltaserve.devices.capacity import PREFILL_TOKEN_BUDGET

    async def main(budget):
        async with AsyncEngine(engine_args(tiny_ckpt, prefill_token_budget=budget)) as engine:
            return (engine.replica.prefill_token_budget, engine.scheduler.prefill_token_budget,
                    engine.scheduler.step_budget.max_tokens)

    assert run(main(None)) == (PREFILL_TOKEN_BUDGET,) * 3
    assert run(main(48)) == (48, 48, 48)


def test_64_concurrent_streams_with_cancellations_free_everything(tiny_ckpt):
    async def consume(engine, i):
        params = SamplingParams(max_tokens=4 + (i * 7) % 29, temperature=0.8, seed=i, ignore_eos=True)
        stream = engine.generate([3 + i % 50] * (1 + (i * 13) % 60), params)
        n = 0
        async for out in stream:
            n += 1
            if i % 5 == 0 and n == 3:
                break  # leave mid-stream: aborts the request
        return out

    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, max_batch=24)) as engine:
            tasks = [asyncio.create_task(consume(engine, i)) for i in range(64)]
            await asyncio.sleep(0.05)
            for i in (1, 8, 22):
                tasks[i].cancel()  # cancel the consuming task itself
            results = await asyncio.gather(*tasks, return_exceptions=True)
            free = await wait_free(engine)
            engine.scheduler.check_invariants()
            return results, free

    results, free = run(main())
    assert free, "pages or slots were left allocated"
    for i, r in enumerate(results):
        if i in (1, 8, 22) and isinstance(r, asyncio.CancelledError):
            continue
        assert not isinstance(r, BaseException), r
        if i % 5 == 0:
            continue
        assert r.finished and r.finish_reason == "length"
        assert len(r.token_ids) == 4 + (i * 7) % 29


def test_a_ready_engine_keeps_its_start_up_objects_out_of_full_collections(tiny_ckpt):
    """A full collection walking the weights, modules and graphs would stall the event loop for ~0.1-0.2 s; they are
    frozen once the engine is ready, and thawed when the last engine closes."""
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as first:
            frozen = gc.get_freeze_count()
            async with AsyncEngine(engine_args(tiny_ckpt)):
                both = gc.get_freeze_count()
            out = await collect(first.generate([1, 2, 3], SamplingParams(max_tokens=2, **GREEDY)))
            return frozen, both, gc.get_freeze_count(), out

    assert gc.get_freeze_count() == 0
    frozen, both, after_second, out = run(main())
    assert frozen > 10_000 and both > frozen and after_second > frozen // 2  # the first engine is still up
    assert out.num_tokens == 2 and gc.get_freeze_count() == 0


def test_each_step_is_handed_over_before_the_last_steps_outputs_are_made(tiny_ckpt):
    """The devices must not wait on detokenisation: when a step goes to the ranks, the previous step's token is
    appended (it decided the plan) but its output is not made yet. The streamed deltas still add up, in order.
    (Without overlap scheduling; with it, a step is handed over before the last one's tokens are back.)"""
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, async_scheduling=False)) as engine:
            outputs, at_hand_over = [], []
            start_step = engine.replica.start_step

            def recording_start_step(cmd, overlapped=False):
                for req in engine.requests.values():
                    made = len(outputs) + len(req.queue.items)
                    at_hand_over.append((len(req.output_ids), made))
                return start_step(cmd, overlapped)

            engine.replica.start_step = recording_start_step
            async for out in engine.generate("the cat", SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)):
                outputs.append(out)
            return outputs, at_hand_over

    outputs, at_hand_over = run(main())
    decoding = [(tokens, made) for tokens, made in at_hand_over if tokens > 0]
    assert len(decoding) == 11  # the 11 decode steps after the prefill drew the first token
    assert all(made == tokens - 1 for tokens, made in decoding)
    final = outputs[-1]
    assert final.finish_reason == "length" and len(final.token_ids) == 12
    assert "".join(o.delta_text for o in outputs) == final.text
    assert [t for o in outputs for t in o.delta_token_ids] == final.token_ids


def timed_hand_offs(args, max_tokens: int, marks: dict, replica_device: str | None = None):
    """Serve one greedy request, recording each `start_step` as (overlapped, called, returned, the ranks' `marks`
    then; `marks` is cleared at each hand-off). Returns (records, outputs). `replica_device`: what the replica's
    spec says it runs on."""
    async def main():
        async with AsyncEngine(args) as engine:
            if replica_device:
                spec = engine.replica.spec
                engine.replica.spec = dataclasses.replace(spec, args=spec.args.replace(device=replica_device))
            stream = engine.generate("the cat", SamplingParams(max_tokens=max_tokens, ignore_eos=True, **GREEDY))
            handed, start_step = [], engine.replica.start_step

            def timed_start_step(cmd, overlapped=False):
                marks.clear()
                called = time.perf_counter()
                step = start_step(cmd, overlapped)
                handed.append((overlapped, called, time.perf_counter(), dict(marks)))
                return step

            engine.replica.start_step = timed_start_step
            return handed, [out async for out in stream]

    return run(main())


@pytest.mark.parametrize("wake_s,wait_s", [(0.005, 1.0), (0.05, 0.001)])
def test_the_hand_off_returns_once_every_rank_has_launched(tiny_ckpt, monkeypatch, wake_s, wait_s):
    """start_step keeps the event loop (and the GIL) away from the ranks until each has launched its step (here,
    with no graph to launch, until each has started), but never longer than LAUNCH_WAIT_S."""
    from deltaserve.devices import replica
    from deltaserve.devices.rank import RankRuntime

    execute, started = RankRuntime.execute, {}

    def late_rank(runtime, cmd, *args):
        time.sleep(wake_s)  # a rank thread that wakes late
        started[runtime.rank] = time.perf_counter()
        return execute(runtime, cmd, *args)

    monkeypatch.setattr(RankRuntime, "execute", late_rank)
    monkeypatch.setattr(replica, "LAUNCH_WAIT_S", wait_s)

    handed, outs = timed_hand_offs(engine_args(tiny_ckpt, tp=2, async_scheduling=False), 3, started)
    assert len(handed) >= 3 and outs[-1].finished and len(outs[-1].token_ids) == 3
    for _, called, returned, ranks in handed:
        if wait_s > wake_s:
            assert sorted(ranks) == [0, 1] and max(ranks.values()) <= returned
        else:
            assert not ranks and returned - called < wake_s / 2


def test_an_overlapped_hand_off_to_a_gpu_waits_until_the_whole_step_is_queued(tiny_ckpt, monkeypatch):
    """With overlap scheduling on a GPU the ranks launch a step while the one before runs, and each torch call of
    a launch gives the GIL up: the loop waits (at most LAUNCH_WAIT_S) until every rank has queued the whole step,
    or its Python would stretch the launch. Here the ranks' launches take 5 ms (a CPU engine whose replica says
    cuda; the launch signals at its end, as a GPU's does), within a LAUNCH_WAIT_S raised to 1 s."""
    from deltaserve.devices.rank import RankRuntime

    launch, queued = RankRuntime.launch, {}

    def gpu_like_launch(runtime, cmd, on_launched=lambda: None):
        step = launch(runtime, cmd)
        time.sleep(0.005)
        queued[runtime.rank] = time.perf_counter()
        on_launched()
        return step

    from deltaserve.devices import replica

    monkeypatch.setattr(RankRuntime, "launch", gpu_like_launch)
    monkeypatch.setattr(replica, "LAUNCH_WAIT_S", 1.0)

    handed, outs = timed_hand_offs(engine_args(tiny_ckpt, tp=2), 6, queued, replica_device="cuda")
    assert outs[-1].finished and len(outs[-1].token_ids) == 6
    overlapped = [(returned, ranks) for over, _, returned, ranks in handed if over]
    assert len(overlapped) >= 4
    for returned, ranks in overlapped:
        assert sorted(ranks) == [0, 1] and max(ranks.values()) <= returned


def test_time_to_first_token_splits_into_queue_and_prefill_time(tiny_ckpt):
    """Each request's TTFT is its queue time (arrival to its prompt's first chunk handed over) plus its prefill time
    (that hand-off to the first token); requests admitted behind others wait in the queue."""
    def value(metric, suffix):
        return next(s.value for m in metric.collect() for s in m.samples if s.name.endswith(suffix))

    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, max_batch=2, prefill_slots=1)) as engine:
            params = SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY)
            await asyncio.gather(*[collect(engine.generate([3 + i] * (40 + 30 * i), params)) for i in range(6)])
            return engine.metrics

    m = run(main())
    assert value(m.queue_time, "_count") == value(m.prefill_time, "_count") == value(m.ttft, "_count") == 6
    total = value(m.queue_time, "_sum") + value(m.prefill_time, "_sum")
    assert abs(total - value(m.ttft, "_sum")) < 1e-6
    assert value(m.queue_time, "_sum") > value(m.prefill_time, "_sum") / 6  # the later requests waited


def test_stop_strings_stop_tokens_min_tokens_and_logprobs(tiny_ckpt):
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as engine:
            base = await collect(engine.generate("the cat", SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY)))
            text = base.text
            stop = text[5:8]
            stopped = await collect(engine.generate("the cat", SamplingParams(max_tokens=30, stop=[stop],
                                                                           ignore_eos=True, **GREEDY)))
            included = await collect(engine.generate("the cat", SamplingParams(
                max_tokens=30, stop=[stop], include_stop_str_in_output=True, ignore_eos=True, **GREEDY)))
            stop_tok = base.token_ids[3]
            by_token = await collect(engine.generate("the cat", SamplingParams(
                max_tokens=30, stop_token_ids=[stop_tok], ignore_eos=True, **GREEDY)))
            delayed = await collect(engine.generate("the cat", SamplingParams(
                max_tokens=30, stop_token_ids=[stop_tok], min_tokens=10, ignore_eos=True, **GREEDY)))
            lp = await collect(engine.generate("the cat", SamplingParams(max_tokens=6, logprobs=3, **GREEDY)))
            return base, stop, stopped, included, by_token, delayed, lp

    base, stop, stopped, included, by_token, delayed, lp = run(main())
    first = base.text.find(stop)
    assert stopped.finish_reason == "stop" and stopped.text == base.text[:first]
    assert included.text == base.text[: first + len(stop)]
    assert by_token.finish_reason == "stop" and by_token.token_ids == base.token_ids[: base.token_ids.index(base.token_ids[3])]
    assert len(delayed.token_ids) >= 10 and base.token_ids[3] not in delayed.token_ids[:10]
    assert len(lp.logprobs) == len(lp.token_ids)
    for entry, token in zip(lp.logprobs, lp.token_ids):
        assert entry.token_id == token and len(entry.top) == 3
        assert entry.top[0][0] == token and abs(entry.top[0][1] - entry.logprob) < 1e-6  # greedy: the top one
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]


def test_stop_strings_wait_for_min_tokens(tiny_ckpt):
    """As in vLLM, no stop string ends a request before min_tokens: the first match that completes in a later
    token's text does (a match inside the first min_tokens tokens' text is not cut)."""
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as engine:
            base = await collect(engine.generate("the cat", SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY)))
            head = engine.tokenizer.decode(base.token_ids[:10])
            stop = next(c for c in head if c.strip() and c in base.text[len(head):])  # seen before and after
            late = await collect(engine.generate("the cat", SamplingParams(
                max_tokens=40, stop=[stop], min_tokens=10, ignore_eos=True, **GREEDY)))
            early = await collect(engine.generate("the cat", SamplingParams(
                max_tokens=40, stop=[stop], ignore_eos=True, **GREEDY)))
            return base, head, stop, late, early

    base, head, stop, late, early = run(main())
    assert early.text == base.text[: base.text.index(stop)] and len(early.token_ids) <= 10
    cut = base.text.index(stop, len(head))
    assert late.finish_reason == "stop" and late.text == base.text[:cut] and len(late.token_ids) > 10
    assert late.token_ids == base.token_ids[: len(late.token_ids)]


def test_choices_of_one_prompt_are_checked_once_and_seeded_apart(tiny_ckpt):
    """`generate_choices`: n requests of one prompt; a seeded request's choice j samples with seed + j (so it
    equals a single request seeded so); n beyond the queue can never be queued (a ValueError); a request's stop
    ids are bounded."""
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, max_waiting=4)) as engine:
            params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
            choices = [await collect(s) for s in engine.generate_choices("the cat", params, 3)]
            alone = [await collect(engine.generate("the cat", SamplingParams(
                max_tokens=8, temperature=1.0, seed=5 + j, ignore_eos=True))) for j in range(3)]
            with pytest.raises(ValueError, match="n must be"):
                engine.generate_choices("the cat", params, 5)
            assert not engine.requests
            return choices, alone

    choices, alone = run(main())
    assert [c.token_ids for c in choices] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in choices}) > 1
    with pytest.raises(ValueError, match="at most 4096"):
        SamplingParams(stop_token_ids=list(range(4097)))


def test_unset_fields_take_the_checkpoint_defaults(tiny_ckpt):
    """tools.make_checkpoint writes temperature 0.7, top_k 20, top_p 0.8 and no min_p or penalties."""
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as engine:
            return engine.resolve_params(5, SamplingParams()), engine.resolve_params(5, SamplingParams(
                temperature=0.0, top_k=3, max_tokens=9))

    unset, given = run(main())
    assert (unset.temperature, unset.top_k, unset.top_p, unset.min_p) == (0.7, 20, 0.8, 0.0)
    assert (unset.presence_penalty, unset.repetition_penalty, unset.frequency_penalty) == (0.0, 1.0, 0.0)
    assert unset.max_tokens == 512 - 5  # what the context leaves
    assert (given.temperature, given.top_k, given.top_p, given.max_tokens) == (0.0, 3, 0.8, 9)


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0), ("max_tokens", 0),
    ("logprobs", 99), ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("seed", -5), ("stop", [""]),
    ("stop_token_ids", [-1]), ("min_tokens", -1), ("temperature", "hot"), ("ignore_eos", 1),
    # NaN passes every range comparison; integers beyond what the ranks' tensors hold
    ("temperature", float("nan")), ("top_p", float("nan")), ("min_p", float("nan")),
    ("presence_penalty", float("nan")), ("frequency_penalty", float("-inf")), ("repetition_penalty", float("inf")),
    ("top_k", 2**31), ("max_tokens", 2**40), ("min_tokens", 2**63), ("stop_token_ids", [2**31]),
    ("seed", 2**64), ("stop", ["x" * 2000]),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_model_bounds_are_checked_and_top_k_off_has_two_spellings(tiny_ckpt):
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as engine:
            vocab = engine.cfg.vocab_size
            with pytest.raises(ValueError, match="stop_token_ids: token id .* outside the vocabulary"):
                engine.generate([1, 2], SamplingParams(stop_token_ids=[3, vocab]))
            late = SamplingParams()
            late.temperature = float("nan")  # set after construction: checked again on admission
            with pytest.raises(ValueError, match="temperature"):
                engine.generate([1, 2], late)
            resolved = [engine.resolve_params(2, SamplingParams(top_k=k)).top_k for k in (-1, 0, 5, vocab, 2**31 - 1)]
            assert resolved == [0, 0, 5, 0, 0]
            assert engine.resources_free()

    run(main())


def test_warm_up_serves_every_path_then_leaves_nothing_behind(tiny_ckpt, caplog):
    async def main():
        with caplog.at_level(logging.INFO):
            async with AsyncEngine(engine_args(tiny_ckpt, warmup=True, prefill_token_budget=64)) as engine:
                assert engine.resources_free() and engine.healthy
                assert b"deltaserve_requests_finished_total{" not in engine.metrics.render()  # counts start at 0
                budget = engine.scheduler.step_budget  # decode times kept, the chunks' (compiles) dropped
                assert max(budget.decode_s) == engine.replica.buckets[-1] and budget.chunk_cost() is None
                out = [o async for o in engine.generate([1, 2, 3], SamplingParams(max_tokens=2))][-1]
                assert out.finish_reason in ("stop", "length")

    run(main())
    # 17 (one prompt of doubling length below the chunked one's 64 + 19 tokens) + a wave of max_batch
    assert any("warm-up: 33 requests" in r.getMessage() for r in caplog.records)


def test_bad_prompts_raise_before_queueing(tiny_ckpt):
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as engine:
            for bad, match in (("", "empty"), ([], "empty"), ([10**7], "vocabulary"), ([1] * 600, "context")):
                with pytest.raises(ValueError, match=match):
                    engine.generate(bad, SamplingParams(max_tokens=4))
            assert await wait_free(engine)

    run(main())


def test_bad_engine_args_name_the_field():
    for field, value in (("device", "tpu"), ("tp", 0), ("dtype", "int8"), ("max_batch", -1),
                         ("memory_fraction", 0.0), ("step_latency_ratio", 1.0), ("step_latency_ratio", -2)):
        with pytest.raises(ValueError, match=field):
            EngineArgs(**{field: value})


def test_chat_renders_the_template(tiny_ckpt):
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt)) as engine:
            prompt = engine.render_chat([{"role": "user", "content": "hi"}], {"enable_thinking": False})
            out = await collect(engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3),
                                            {"enable_thinking": False}))
            return prompt, out

    prompt, out = run(main())
    assert prompt.startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.endswith("</think>\n\n")
    assert len(out.prompt_token_ids) > 5 and out.finished


def test_closing_the_engine_ends_live_streams_without_hanging(tiny_ckpt):
    async def main():
        engine = AsyncEngine(engine_args(tiny_ckpt))
        await engine.start()
        streams = [engine.generate([4, 5, 6], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
                   for _ in range(3)]
        first = await streams[0].__anext__()
        await asyncio.wait_for(engine.close(), timeout=30)
        rest = [await asyncio.wait_for(collect_all(s), timeout=5) for s in streams]
        outs = [r[-1] for r in rest]
        assert all(o.finished and o.finish_reason == "abort" and "shut down" in o.error for o in outs)
        # Every token drawn before the shutdown reached its stream: the deltas add up to the final output.
        for seen, out in zip([[first] + rest[0]] + rest[1:], outs):
            assert [t for o in seen for t in o.delta_token_ids] == out.token_ids
            assert "".join(o.delta_text for o in seen) == out.text
        with pytest.raises(Exception, match="not running|shut"):
            engine.generate([1, 2], SamplingParams(max_tokens=2))

    run(main())


@pytest.mark.parametrize("overlap", [True, False])
def test_closing_the_engine_drops_its_state_before_the_memory_is_handed_back(tiny_ckpt, monkeypatch, overlap):
    """A rank's teardown hands its cached memory back (on a GPU, torch's cache to the driver) once its state is
    gone. A worker thread that still held its last step's result kept the whole state alive until the thread
    ended, after the hand-back: a closed engine's memory then stayed in torch's cache (69 GiB on an H100)."""
    import weakref

    from deltaserve.devices.cpu import CpuRankBackend

    state_alive_at_release = []
    release = CpuRankBackend.release_memory

    def checked_release(self):
        state_alive_at_release.append(state() is not None)
        return release(self)

    async def main():
        nonlocal state
        async with AsyncEngine(engine_args(tiny_ckpt, async_scheduling=overlap)) as engine:
            await collect(engine.generate([4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True)))
            state = weakref.ref(engine.replica.ranks[0].runtime.state.ssm)
            monkeypatch.setattr(CpuRankBackend, "release_memory", checked_release)

    state = None
    run(main())
    assert state_alive_at_release == [False]


def test_profile_engine_step_splits_the_step_and_restores_what_it_wraps(tiny_ckpt):
    """tools.profile_engine_step on the CPU engine: rank 0's execute and the gap before the next one add up to the
    step the streams see, the gap splits at the hand-off, and the wrapped methods come back on exit."""
    from deltaserve.devices.rank import RankRuntime
    from deltaserve.devices.replica import Replica
    from deltaserve.devices.sampling import SlotSampling
    from deltaserve.tools.bench_decode import engine_step_time
    from deltaserve.tools.lab.profile_engine_step import StepTimer

    originals = (Replica.start_step, RankRuntime.execute, SlotSampling.draw, SlotSampling.collect)

    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, prefill_token_budget=64, async_scheduling=False)) as engine:
            with StepTimer() as timer:
                step, start, end = await engine_step_time(engine, 4, 16, window_tokens=32)
            return step, timer.summary(start, end), len(timer.steps)

    step, s, recorded = run(main())
    assert (Replica.start_step, RankRuntime.execute, SlotSampling.draw, SlotSampling.collect) == originals
    assert recorded >= 32
    assert s["execute_s"] > 0 and s["sample_s"] > 0 and s["to_handoff_s"] > 0 and s["handoff_to_start_s"] > 0
    assert abs(s["gap_s"] - s["to_handoff_s"] - s["handoff_to_start_s"]) < 1e-9
    assert 0.5 * step < s["execute_s"] + s["gap_s"] < 1.5 * step


def test_profile_mixed_step_measures_decode_only_then_prompt_steps(tiny_ckpt):
    """tools.lab.profile_mixed_step's windows on the CPU engine: the first only decode-only steps, the second only
    steps carrying prompt chunks beside the decode rows, each timed; its step observer is removed after."""
    from deltaserve.tools.lab.profile_mixed_step import measure

    async def main():
        args = engine_args(tiny_ckpt, max_batch=6, prefill_slots=2, prefill_token_budget=64, step_latency_ratio=0,
                           max_model_len=4096)
        async with AsyncEngine(args) as engine:
            windows = await measure(engine, rows=4, prompt=24, chunks=2, steps=6)
            return windows, engine.steps.observers == [], await wait_free(engine)

    (decode, mixed), restored, free = run(main())
    assert restored and free
    assert len(decode["kind"]) >= 6 and all(tokens == 0 and s > 0 for tokens, s in decode["kind"])
    assert len(mixed["kind"]) >= 6 and all(0 < tokens <= 48 and s > 0 for tokens, s in mixed["kind"])
    assert mixed["all_steps"] >= len(mixed["kind"])


@pytest.mark.parametrize("overlap", [True, False])
def test_step_log_names_what_each_step_carried(tiny_ckpt, caplog, overlap):
    async def main():
        async with AsyncEngine(engine_args(tiny_ckpt, async_scheduling=overlap, prefill_token_budget=16)) as engine:
            with caplog.at_level(logging.DEBUG, logger="deltaserve.steps"):
                await collect(engine.generate(list(range(1, 41)), SamplingParams(max_tokens=3, **GREEDY)))

    run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "deltaserve.steps"]
    # 40 prompt tokens in chunks of at most 16 (three steps), then two decode steps of one row.
    assert [line.split(":")[0] for line in lines] == [
        "0 decode rows (bucket 0), 16 prompt tokens in 1 chunks (budget 16)",
        "0 decode rows (bucket 0), 16 prompt tokens in 1 chunks (budget 16)",
        "0 decode rows (bucket 0), 8 prompt tokens in 1 chunks (budget 16)",
        "1 decode rows (bucket 1), 0 prompt tokens in 0 chunks (budget 0)",
        "1 decode rows (bucket 1), 0 prompt tokens in 0 chunks (budget 0)",
    ]
    # Every step after the first says how long the devices waited for it, overlapped or not (the host's work
    # between steps where it outlasts the step before, which the speculation policy charges the step).
    assert all("devices idle" in line for line in lines[1:]) and "devices idle" not in lines[0]
    device_ms = [float(line.split(": ")[1].split(" ms on the device")[0]) for line in lines]
    assert all(ms > 0 for ms in device_ms)  # rank 0 timed each step (on the CPU: its launch computes it)
    launch_ms = [float(line.split("launched in ")[1].split(" ms")[0]) for line in lines]
    assert all(0 < launch <= device for launch, device in zip(launch_ms, device_ms))


def test_bench_engine_overhead_runs_its_instant_device_through_the_overlapped_loop(tiny_ckpt):
    """tools.bench_engine_overhead: every stream gets all its tokens from the instant device (the overlap loop
    hands steps over with `overlapped=True`), and the host time per step and its critical path are measured."""
    from deltaserve.runtime.cli import run as run_on_uvloop
    from deltaserve.tools import bench_engine_overhead as bench

    run_on_uvloop(bench.measure(tiny_ckpt, 4, 30))
    per_step_us, critical_us = bench.RESULTS.pop()
    assert 0 < critical_us <= per_step_us


def test_the_fake_device_server_s_engine_runs_steps_back_to_back_at_its_step_time():
    """tools.lab.fake_device_server: every stream gets its tokens, and a step takes the fake device's time once
    the one before it is done (a stream's tokens come no faster than one a step)."""
    from deltaserve.tools.lab.fake_device_server import fake_engine

    async def main():
        engine = await fake_engine(step_ms=3.0, max_batch=8)
        try:
            params = SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY)
            started = time.perf_counter()
            outs = await asyncio.gather(*[collect(engine.generate([5 + i, 6, 7], params)) for i in range(8)])
            return outs, time.perf_counter() - started, engine.steps.replica.steps
        finally:
            await engine.close()

    outs, elapsed, steps = run(main())
    assert all(o.num_tokens == 20 and o.finish_reason == "length" for o in outs)
    assert steps >= 20 and elapsed >= 20 * 3e-3


def test_a_first_token_reaches_its_stream_before_the_next_hand_over_holds_the_loop():
    """Overlap scheduling hands step k+2 over right after routing step k's tokens, and a hand-over holds the loop
    while rank 0 launches (`launch_ms` here). A request's first token must reach its stream before that, while the
    step already handed over runs: its time to first token is then the prefill's, not the prefill's plus a launch."""
    from deltaserve.tools.lab.fake_device_server import fake_engine

    launch_s = 0.05

    async def main():
        engine = await fake_engine(step_ms=100.0, max_batch=2, launch_ms=launch_s * 1e3)
        try:
            routed = []  # when the step loop had routed a step carrying a first token

            def timed(step):
                if any(work.last for work in step.plan.prefill):
                    routed.append(time.perf_counter())

            engine.steps.observers.append(timed)
            stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True, **GREEDY))
            first = await stream.__anext__()
            received = time.perf_counter()
            rest = [out async for out in stream]
            return routed, received, first, rest
        finally:
            await engine.close()

    routed, received, first, rest = run(main())
    assert len(routed) == 1 and first.num_tokens == 1 and rest[-1].num_tokens == 4
    assert received - routed[0] < launch_s / 2  # without the yield: at least launch_s later


def test_the_fake_device_teaches_the_budget_its_times_and_keeps_to_graph_sizes():
    """Its step budget starts as a GPU engine's warm-up leaves it (each bucket's decode time, a chunk's cost), and
    with graph_tokens its scheduler rounds prompt tokens to a CUDA engine's prefill and mixed graph sizes."""
    from deltaserve.tools.lab.fake_device_server import fake_engine

    async def main():
        engine = await fake_engine(step_ms=3.0, max_batch=8, step_ms_full=10.0, prefill_us_per_token=50.0,
                                   prefill_ms_fixed=1.0, graph_tokens=256)
        try:
            sched = engine.scheduler
            return (sched.mixed_graph_sizes, sched.prefill_graph_sizes[-1], dict(sched.step_budget.decode_s),
                    sched.step_budget.chunk_cost(), sched.prompt_budget(8, 8))
        finally:
            await engine.close()

    mixed, largest, decode, (fixed, per_token), budget = run(main())
    assert mixed == [64, 128, 192, 256] and largest == 256
    assert decode[1] == pytest.approx(3e-3) and decode[8] == pytest.approx(10e-3)
    assert fixed == pytest.approx(1e-3) and per_token == pytest.approx(50e-6)
    assert budget == 128  # (2 - 1) x 10 ms less 1 ms fixed is 180 tokens, rounded down to a mixed graph's 128


def test_the_fake_device_models_a_step_from_its_rows_and_prompt_tokens():
    """fake_device_server's cost model, which the throughput it predicts rests on: decode linear in the rows, a
    step's prompt tokens adding a fixed pass and a cost a token; without a per-token cost, every step one time."""
    from deltaserve.tools.lab.fake_device_server import StepCost

    cost = StepCost(one_row_s=2.0, full_s=8.0, max_rows=4, token_s=0.5, prefill_s=3.0)
    assert [cost.seconds(rows, 0) for rows in (0, 1, 2, 4)] == [0.0, 2.0, 4.0, 8.0]
    assert cost.seconds(0, 10) == 3.0 + 5.0 and cost.seconds(4, 10) == 8.0 + 3.0 + 5.0
    flat = StepCost(one_row_s=3.0)
    assert flat.seconds(1, 0) == flat.seconds(7, 0) == flat.seconds(0, 100) == flat.seconds(2, 50) == 3.0
