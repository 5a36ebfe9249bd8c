"""Device-side pieces on the CPU: capacity math, slot protocol and poisoning, the worker group."""

import asyncio

import pytest
import torch
from helpers import CpuRunner

from deltaserve.devices.capacity import CapacityRefused, default_prefill_token_budget, plan_capacity
from deltaserve.devices.commands import PrefillCommand, RowSampling, StepCommand
from deltaserve.devices.rank import RankRuntime
from deltaserve.devices.worker import ReplicaPoisoned, WorkerGroup
from deltaserve.devices.commands import PromoteSlot, RetireSlot

MiB = 1 << 20


def capacity(**kw):
    args = dict(free_bytes=1000 * MiB, bytes_per_slot=2 * MiB, bytes_per_page=MiB // 4, page_size=16,
                max_model_len=1024, requested_batch=64, prefill_slots=4, prefill_scratch_bytes=50 * MiB,
                buckets=[1, 2, 4, 8, 16, 24, 32, 48, 64], graph_reserve=lambda b: b * 4 * MiB)
    args.update(kw)
    return plan_capacity(**args)


def check_fits(plan, **kw):
    free = kw["free_bytes"]
    total = plan.state_bytes + plan.graph_reserve_bytes + kw["prefill_scratch_bytes"]
    assert total <= free, "the allocation would exceed what was measured free"
    assert plan.max_batch <= plan.largest_bucket
    assert plan.graph_reserve_bytes == kw["graph_reserve"](plan.largest_bucket)
    assert plan.num_pages >= kw["max_model_len"] // 16  # one full-length request fits


def test_roomy_memory_keeps_the_requested_batch():
    plan = capacity(free_bytes=2000 * MiB)  # 64 rows of 18 MiB + 256 MiB reserve + scratch fit
    assert plan.max_batch == 64 and plan.largest_bucket == 64


@pytest.mark.parametrize("free_mib", [120, 160, 200, 260, 330, 400, 440])
def test_reserve_iterates_down_and_the_batch_is_clamped(free_mib):
    kw = dict(free_bytes=free_mib * MiB, bytes_per_slot=2 * MiB, bytes_per_page=MiB // 4, page_size=16,
              max_model_len=1024, requested_batch=64, prefill_slots=4, prefill_scratch_bytes=50 * MiB,
              buckets=[1, 2, 4, 8, 16, 24, 32, 48, 64], graph_reserve=lambda b: b * 4 * MiB)
    plan = plan_capacity(**kw)
    check_fits(plan, **kw)
    assert 1 <= plan.max_batch < 64


def test_tight_memory_where_the_first_reserve_leaves_nothing():
    # With the reserve of bucket 64 (256 MiB) nothing fits; smaller buckets leave room for a few rows.
    kw = dict(free_bytes=280 * MiB, bytes_per_slot=2 * MiB, bytes_per_page=MiB // 4, page_size=16,
              max_model_len=1024, requested_batch=64, prefill_slots=4, prefill_scratch_bytes=40 * MiB,
              buckets=[1, 2, 4, 8, 16, 24, 32, 48, 64], graph_reserve=lambda b: b * 4 * MiB)
    assert kw["graph_reserve"](64) > kw["free_bytes"] - kw["prefill_scratch_bytes"]
    plan = plan_capacity(**kw)
    check_fits(plan, **kw)
    assert plan.max_batch >= 1


def test_rows_share_the_pages_rather_than_each_reserving_a_full_context():
    # 64 rows of 2 MiB state and 256 MiB of graph reserve fit in 600 MiB; 64 full contexts of pages (16 MiB each)
    # would not. Admission reserves each request's own pages, so the batch stays and the pages are what is left.
    kw = dict(free_bytes=600 * MiB, bytes_per_slot=2 * MiB, bytes_per_page=MiB // 4, page_size=16,
              max_model_len=1024, requested_batch=64, prefill_slots=4, prefill_scratch_bytes=50 * MiB,
              buckets=[1, 2, 4, 8, 16, 24, 32, 48, 64], graph_reserve=lambda b: b * 4 * MiB)
    plan = plan_capacity(**kw)
    check_fits(plan, **kw)
    assert plan.max_batch == 64
    assert 64 <= plan.num_pages < 64 * 64
    assert (600 - 50 - 256 - 70 * 2) * 4 - 2 <= plan.num_pages  # everything else went to pages


def test_a_model_without_attention_layers_gets_a_full_context_of_pages_a_row():
    # A truncated checkpoint of GDN layers alone has no KV: its pages cost nothing and must not divide by zero.
    plan = capacity(bytes_per_page=0)
    assert plan.max_batch == 64
    assert plan.num_pages == (64 + 4) * 1024 // 16


def test_refuses_with_numbers_when_not_even_one_request_fits():
    with pytest.raises(CapacityRefused, match=r"not even one request fits: 40 MiB free.*max_model_len 1024"):
        capacity(free_bytes=40 * MiB)


def test_the_default_prompt_budget_halves_until_its_activations_take_an_eighth_of_the_memory():
    GiB = 1 << 30
    # A 27B's prefill activations: 0.5 MiB a token plus 288 MiB (`model.state.prefill_activation_bytes`).
    def activations(tokens):
        return tokens * (GiB // 2048) + 288 * MiB

    assert default_prefill_token_budget(60 * GiB, activations) == 8192  # an FP8 27B or a 4B on an 80 GB GPU
    assert default_prefill_token_budget(24 * GiB, activations) == 4096  # a bf16 27B on one: 4.3 GiB would be 18%
    assert default_prefill_token_budget(2 * GiB, activations) == 2048  # never below, however short the memory


def test_an_fp8_prefill_reserves_its_widest_weight_dequantised():
    """An FP8 checkpoint's prefill dequantises each projection's weight for its GEMM: the activation reserve holds
    the widest of them (the 27B's gate_up, 34816 x 5120 in bf16: 340 MiB), and nothing more for bf16 weights."""
    import torch

    from deltaserve.model.config import ModelConfig
    from deltaserve.model.sharding import LocalSizes
    from deltaserve.model.state import prefill_activation_bytes
    from deltaserve.model.synthetic import text_config

    bf16 = ModelConfig.from_dict(text_config("27b", 248320))
    fp8 = ModelConfig.from_dict({**text_config("27b", 248320), "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})
    extra = prefill_activation_bytes(fp8, LocalSizes.of(fp8, 1), torch.bfloat16, 2048) - \
        prefill_activation_bytes(bf16, LocalSizes.of(bf16, 1), torch.bfloat16, 2048)
    assert extra == 2 * 17408 * 5120 * 2


def make_runtime(ckpt, max_batch=4):
    runner = CpuRunner(ckpt, num_slots=max_batch + 2, num_pages=64)
    return RankRuntime(runner.model, runner.state, rank=0, max_batch=max_batch, max_pages_per_seq=8,
                       device=torch.device("cpu")), runner


def prefill_into(rt, slot, tokens, pages):
    return rt.execute(StepCommand(prefill=[PrefillCommand(tokens, 0, slot, pages, True, RowSampling(temperature=0))]))


def test_promotion_copies_state_and_compaction_moves_it(tiny_ckpt):
    rt, runner = make_runtime(tiny_ckpt)
    prefill_into(rt, 4, [5, 6, 7], [0])
    prefill_into(rt, 5, [8, 9], [1])
    promoted = rt.state.ssm[:, 5].clone()
    rt.execute(StepCommand(promotions=[PromoteSlot(4, 0, [0]), PromoteSlot(5, 1, [1])],
                           decode_tokens=[1, 2], decode_positions=[3, 2], decode_token_index=[1, 1], bucket=2))
    assert rt.slots.occupied[:2] == [True, True]
    state_b = rt.state.ssm[:, 1].clone()
    assert not torch.equal(state_b, promoted)  # it decoded one token from the promoted state
    # Retire slot 0: slot 1 moves into the hole, with its state and page-table row.
    rt.slots.before_step(StepCommand(compactions=[RetireSlot(0, 1)], decode_tokens=[3], decode_positions=[3],
                                     decode_token_index=[2], bucket=1), roll_back=None)
    assert rt.slots.occupied[:2] == [True, False]
    assert torch.equal(rt.state.ssm[:, 0], state_b) and rt.inputs.table_host[0, 0] == 1


@pytest.mark.parametrize("bad", [
    StepCommand(compactions=[RetireSlot(2, None)]),  # retiring a free slot
    StepCommand(compactions=[RetireSlot(0, 3)]),  # moving from a free slot
    StepCommand(promotions=[PromoteSlot(4, 0, [2])]),  # promoting into a taken slot
    StepCommand(decode_tokens=[1, 2, 3], decode_positions=[1, 1, 1], decode_token_index=[1, 1, 1], bucket=4),
])
def test_slot_protocol_mismatch_raises(tiny_ckpt, bad):
    from deltaserve.devices.commands import SlotProtocolError

    rt, _ = make_runtime(tiny_ckpt)
    prefill_into(rt, 4, [5, 6, 7], [0])
    rt.execute(StepCommand(promotions=[PromoteSlot(4, 0, [0])], decode_tokens=[1], decode_positions=[3],
                           decode_token_index=[1], bucket=1))
    with pytest.raises(SlotProtocolError):
        rt.execute(bad)


def test_worker_group_runs_every_rank_and_poisons_on_failure():
    async def main():
        group = WorkerGroup(3, step_timeout_s=5)
        assert await group.call(lambda rank: rank * 10) == [0, 10, 20]

        def fail_on_rank_2(rank):
            if rank == 2:
                raise ValueError("bad compaction")
            return rank

        with pytest.raises(ReplicaPoisoned, match="bad compaction"):
            await group.call(fail_on_rank_2)
        with pytest.raises(ReplicaPoisoned):
            await group.call(lambda rank: rank)  # nothing runs on a poisoned replica
        group.stop()

    asyncio.run(main())


def test_a_pipelined_step_is_held_while_the_next_launches_and_results_keep_their_order():
    """A pipelined command may return a deferred result (a step queued on the device): the worker launches the
    next command before it finishes the held one when the next comes first, finishes it by itself when it is done
    and nothing comes, finishes it before any other command, and resolves every future in command order, a
    failing launch included."""
    import threading

    log: list[str] = []
    done = {name: threading.Event() for name in "abcd"}

    class Launched:
        def __init__(self, name):
            self.name = name

        def ready(self):
            return done[self.name].is_set()

        def finish(self):
            log.append(f"finish {self.name}")
            return self.name

    def launch(name):
        def fn(rank):
            log.append(f"launch {name}")
            if name == "c":
                raise ValueError("launch failed")
            return Launched(name)
        return fn

    async def main():
        group = WorkerGroup(1, step_timeout_s=5)
        a = group.submit(launch("a"), pipelined=True)
        b = group.submit(launch("b"), pipelined=True)  # queued before a is done: launched before a finishes
        assert await asyncio.gather(*a) == ["a"]
        d = group.submit(launch("d"), pipelined=True)
        assert await asyncio.gather(*b) == ["b"]
        await asyncio.sleep(0.05)
        assert not d[0].done()  # held: not done on the device, and nothing else came
        done["d"].set()
        assert await asyncio.gather(*d) == ["d"]
        done["a"].set()
        e = group.submit(launch("a"), pipelined=True)
        plain = group.submit(lambda rank: log.append("plain") or "plain")  # finishes the held step first
        assert await asyncio.gather(*e, *plain) == ["a", "plain"]
        f = group.submit(launch("b"), pipelined=True)
        c = group.submit(launch("c"), pipelined=True)
        results = await asyncio.gather(*f, *c, return_exceptions=True)
        assert results[0] == "b" and isinstance(results[1], ValueError)
        assert isinstance(group.poisoned, ValueError)  # by the worker itself, before anyone awaited c
        group.stop()

    asyncio.run(main())
    assert log == ["launch a", "launch b", "finish a", "launch d", "finish b", "finish d",
                   "launch a", "finish a", "plain", "launch b", "launch c", "finish b"]


def test_step_timeout_poisons_instead_of_hanging():
    import threading

    release = threading.Event()

    async def main():
        group = WorkerGroup(2, step_timeout_s=0.2, on_abort=release.set)
        with pytest.raises(ReplicaPoisoned, match="did not finish"):
            await group.call(lambda rank: release.wait(10) if rank == 1 else rank)
        assert release.is_set()  # the abort hook ran, releasing the stuck rank
        group.stop()

    asyncio.run(main())


def test_a_call_cancelled_while_a_rank_is_busy_poisons_the_group():
    """The caller giving up mid-step leaves the ranks anywhere: the group is poisoned (the abort hook runs, so a
    rank waiting in a collective is released), and every later command is refused."""
    import threading

    release, busy = threading.Event(), threading.Event()

    def step(rank):
        if rank == 1:
            busy.set()
            release.wait(10)
        return rank

    async def main():
        group = WorkerGroup(2, step_timeout_s=30, on_abort=release.set)
        call = asyncio.ensure_future(group.call(step))
        await asyncio.to_thread(busy.wait, 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert release.is_set() and "cancelled" in str(group.poisoned)
        with pytest.raises(ReplicaPoisoned, match="cancelled"):
            await group.call(lambda rank: rank)
        group.stop()

    asyncio.run(main())


def test_a_handed_step_starts_while_the_loop_thread_is_still_busy():
    """The loop thread keeps running Python after a hand-off (the last step's outputs); the rank must get the GIL
    and start within a fraction of a millisecond, not after CPython's default 5 ms switch interval."""
    import sys

    from deltaserve.tools.bench_engine_overhead import handoff_delay

    default = sys.getswitchinterval()
    # The fastest of the trials: a loaded CI host can delay any wake-up, but with the default interval every
    # trial waits at least 5 ms for the GIL.
    assert asyncio.run(handoff_delay(busy_s=0.02, statistic=min)) < 2.5e-3
    assert sys.getswitchinterval() == default  # restored when the workers stop

    first, second = WorkerGroup(1), WorkerGroup(1)
    assert sys.getswitchinterval() <= 2e-4
    first.stop()
    assert sys.getswitchinterval() <= 2e-4  # another group still runs
    second.stop()
    assert sys.getswitchinterval() == default


def test_bad_compaction_from_the_engine_poisons_and_fails_requests(tiny_ckpt):
    from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams

    async def main():
        async with AsyncEngine(EngineArgs(model=tiny_ckpt, max_model_len=128, max_batch=4,
                                          cpu_memory_bytes=8 << 20)) as engine:
            stream = engine.generate([4, 5, 6], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            await stream.__anext__()  # first token (prefill)
            await stream.__anext__()  # second token: the request now owns decode slot 0
            engine.replica.ranks[0].runtime.slots.occupied[0] = False  # corrupt the worker's view
            outs = [o async for o in stream]
            assert outs[-1].finish_reason == "error" and "decode rows" in outs[-1].error
            assert not engine.healthy

    asyncio.run(main())


def test_capture_check_cpu_mode_checks_the_eager_path(tiny_ckpt, capsys):
    from deltaserve.tools import capture_check

    assert capture_check.main(["--model", tiny_ckpt, "--device", "cpu", "--buckets", "1,2,4",
                               "--prefill-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "CUDA graphs need a CUDA device" in out and out.strip().endswith("OK")
    rows = [line.split()[:2] for line in out.splitlines() if line.split()[:1] in (["decode"], ["prefill"], ["mixed"])]
    assert rows == [["decode", "1"], ["decode", "2"], ["decode", "4"], ["prefill", "16"], ["prefill", "32"],
                    ["prefill", "64"], ["mixed", "1+64"]]


@pytest.mark.parametrize("saved_by,context,extra", [("transformers", 40, []), ("transformers", 100, []),
                                                      ("ours", 56, ["--speculative-tokens", "2"])])
def test_capture_check_passes_where_the_context_is_shorter_than_the_prefill_buckets(
        tiny_ckpt, tmp_path, capsys, saved_by, context, extra):
    """capture_check (max_model_len twice --context) on checkpoints saved by transformers (odd head sizes) and by
    us (with the MTP head, speculative): no prefill bucket is larger than the context, so every bucket's chunk
    fits the page table that the context sizes."""
    from helpers import transformers_checkpoint

    from deltaserve.tools import capture_check

    ckpt = transformers_checkpoint(str(tmp_path / "hf"), tiny_ckpt) if saved_by == "transformers" else tiny_ckpt
    assert capture_check.main(["--model", ckpt, "--device", "cpu", "--buckets", "1,2", "--context", str(context),
                               *extra]) == 0
    out = capsys.readouterr().out
    prefill = [int(line.split()[1]) for line in out.splitlines() if line.split()[:1] == ["prefill"]]
    assert out.strip().endswith("OK") and prefill and max(prefill) <= 2 * context


def test_live_decode_batch_leaves_the_state_as_it_found_it(tiny_ckpt):
    """The rows the GPU tools measure on (bench_decode, profile_decode, knockout_decode): live rows whose decode
    steps change the GDN state, put back as it was when the measurement ends."""
    from deltaserve.runtime import AsyncEngine, EngineArgs
    from deltaserve.tools.live_rows import live_decode_batch

    async def main():
        async with AsyncEngine(EngineArgs(model=tiny_ckpt, max_model_len=128, max_batch=4, prefill_slots=1)) as engine:
            replica = engine.replica

            def on_rank(rank):
                state = replica.ranks[rank].runtime.state
                with live_decode_batch(replica, rank, 3, 40) as (r, batch):
                    before = state.conv.clone(), state.ssm.clone()
                    r.model.forward(state, batch)
                    stepped = not torch.equal(state.ssm, before[1])
                    rows = batch.input_ids.shape[0], int((batch.rows.slots >= 0).sum())
                return stepped, rows, torch.equal(state.conv, before[0]) and torch.equal(state.ssm, before[1])

            return await replica.group.call(on_rank)

    for stepped, rows, restored in asyncio.run(main()):
        assert stepped and rows == (3, 3) and restored


def test_penalty_counts_are_paid_for_only_by_steps_with_a_penalised_row():
    """One penalised request once made every later step gather [N, V] counts and scatter into them; now a step
    pays only while a row with a penalty is in it, and that row's counts stay exact."""
    from deltaserve.devices.sampling import SlotSampling

    vocab = 32
    sampling = SlotSampling(4, vocab, torch.device("cpu"))
    sampling.start(0, RowSampling(temperature=0.0, presence_penalty=1.0), [3, 4])
    sampling.start(1, RowSampling(temperature=0.0), [5])
    logits = torch.zeros(1, vocab)
    logits[0, 7] = 1.0

    plain = sampling.prepare([1], [0], step_seed=1)
    assert plain[1].output_counts is None
    assert sampling.sample(logits.clone(), plain)[0].token == 7

    mixed = sampling.prepare([0, 1], [0, 1], step_seed=2)
    assert mixed[1].output_counts is not None and bool(mixed[1].prompt_mask[0, 3])
    tokens = [t.token for t in sampling.sample(logits.repeat(2, 1), mixed)]
    assert tokens == [7, 7] and int(sampling.output_counts[0, 7]) == 1
    # The presence penalty (1.0) now outweighs the lead of token 7 for the penalised row only.
    again = sampling.prepare([0, 1], [1, 2], step_seed=3)
    assert [t.token for t in sampling.sample(logits.repeat(2, 1), again)] == [0, 7]

    sampling.move(0, 2)  # a compaction: the counts go with the request
    assert int(sampling.output_counts[2, 7]) == 1


def test_kernels_are_cached_under_the_users_cache_folder(monkeypatch, tmp_path):
    from deltaserve.devices.backend import kernel_cache_dir

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_cache_dir() == str(tmp_path / "deltaserve" / "triton")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache_dir() == str(tmp_path / "home" / ".cache" / "deltaserve" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")  # the user's choice wins
    assert kernel_cache_dir() == "/somewhere/else"
