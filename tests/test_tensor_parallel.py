"""Tensor parallelism on the CPU backend: tp = 2 and 4 against tp = 1, and failure handling."""

import asyncio
import threading

import pytest
import torch
from helpers import CpuRunner, rel_err

from deltaserve.devices.cpu import ThreadAllReduce
from deltaserve.model.config import ConfigError, load_model_config
from deltaserve.model.sharding import LocalSizes
from deltaserve.model.state import StateSizes
from deltaserve.model.weights import load_rank_weights
from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams


class TpRunners:
    """tp CpuRunners sharing a ThreadAllReduce; every call runs on all ranks in threads, returns rank 0's."""

    def __init__(self, ckpt, tp, **kw):
        self.collective = ThreadAllReduce(tp, timeout_s=60)
        self.ranks = [CpuRunner(ckpt, tp=tp, rank=r, all_reduce=self.collective.for_rank(r), **kw) for r in range(tp)]

    def call(self, method, *args, **kw):
        results = [None] * len(self.ranks)
        errors = []

        def work(r):
            try:
                results[r] = getattr(self.ranks[r], method)(*args, **kw)
            except BaseException as exc:
                errors.append(exc)
                self.collective.abort()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(len(self.ranks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def test_tiny_tp_geometry_makes_every_shard_non_trivial(tiny_tp_ckpt):
    cfg = load_model_config(tiny_tp_ckpt)
    local = LocalSizes.of(cfg, 4)
    assert (local.num_heads, local.num_kv_heads, local.gdn_key_heads, local.gdn_value_heads) == (1, 1, 1, 2)


def test_rank_weights_are_the_right_slices(tiny_tp_ckpt):
    cfg = load_model_config(tiny_tp_ckpt)
    full = load_rank_weights(tiny_tp_ckpt, cfg, progress=False)
    parts = [load_rank_weights(tiny_tp_ckpt, cfg, rank=r, tp=2, progress=False) for r in range(2)]
    name = "layers.0.linear_attn.in_proj_qkv.weight"
    kd, vd = cfg.gdn_key_dim, cfg.gdn_value_dim
    q, k, v = full[name].split([kd, kd, vd])
    for r, part in enumerate(parts):
        pq, pk, pv = part[name].split([kd // 2, kd // 2, vd // 2])
        assert torch.equal(pq, q.chunk(2)[r]) and torch.equal(pk, k.chunk(2)[r]) and torch.equal(pv, v.chunk(2)[r])
    qp = "layers.3.self_attn.q_proj.weight"  # [query | gate] per head stays together
    assert torch.equal(torch.cat([p[qp] for p in parts]), full[qp])
    for name in ("layers.3.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight", "layers.0.linear_attn.out_proj.weight"):
        assert torch.equal(torch.cat([p[name] for p in parts], dim=1), full[name])
    assert torch.equal(parts[1]["layers.0.linear_attn.norm.weight"], full["layers.0.linear_attn.norm.weight"])


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_tp1_for_prefill_and_32_decode_steps(tiny_tp_ckpt, tp):
    gen = torch.Generator().manual_seed(7)
    prompts = {0: torch.randint(0, 500, (70,), generator=gen).tolist(), 5: torch.randint(0, 500, (9,), generator=gen).tolist()}
    single = CpuRunner(tiny_tp_ckpt)
    multi = TpRunners(tiny_tp_ckpt, tp)
    ref = single.prefill(prompts, all_logits=True)
    got = multi.call("prefill", prompts, all_logits=True)[0]
    assert rel_err(got, ref) <= 1e-5
    tokens = {0: int(ref[69].argmax()), 5: int(ref[-1].argmax())}
    positions = {0: 70, 5: 9}
    for _ in range(32):
        ref = single.decode(tokens, positions)
        got = multi.call("decode", tokens, positions)[0]
        assert rel_err(got, ref) <= 1e-5
        tokens = {s: int(ref[i].argmax()) for i, s in enumerate(tokens)}
        positions = {s: p + 1 for s, p in positions.items()}
    # Recurrent state stays local: each rank holds its own value heads, never a reduced copy.
    assert multi.ranks[0].state.ssm.shape[2] == single.state.ssm.shape[2] // tp


def test_greedy_generations_are_identical_for_tp_1_2_4(tiny_tp_ckpt):
    async def generate(tp):
        args = EngineArgs(model=tiny_tp_ckpt, tp=tp, max_model_len=256, max_batch=8, cpu_memory_bytes=16 << 20)
        async with AsyncEngine(args) as engine:
            outs = await asyncio.gather(*[
                _collect(engine.generate([7 + i, 40, 3 * i + 1] * (i + 1),
                                         SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)))
                for i in range(6)
            ])
            return [o.token_ids for o in outs]

    results = {tp: asyncio.run(generate(tp)) for tp in (1, 2, 4)}
    assert results[1] == results[2] == results[4]


async def _collect(stream):
    async for out in stream:
        pass
    return out


def test_tp_that_does_not_divide_is_refused_before_loading(tiny_tp_ckpt):
    with pytest.raises(ConfigError, match="tp=3 does not divide num_attention_heads=4"):
        asyncio.run(AsyncEngine(EngineArgs(model=tiny_tp_ckpt, tp=3)).start())


def test_a_rank_that_raises_mid_step_poisons_the_engine(tiny_tp_ckpt, monkeypatch):
    async def main():
        args = EngineArgs(model=tiny_tp_ckpt, tp=2, max_model_len=256, max_batch=8, cpu_memory_bytes=16 << 20,
                          step_timeout_s=30)
        async with AsyncEngine(args) as engine:
            streams = [engine.generate([5, 6, 7], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
                       for _ in range(3)]
            first = await streams[0].__anext__()
            assert not first.finished
            runtime = engine.replica.ranks[1].runtime
            original = runtime.model.forward

            def broken(*a, **k):
                raise RuntimeError("rank 1 exploded")

            runtime.model.forward = broken
            outs = await asyncio.wait_for(asyncio.gather(*[_collect(s) for s in streams]), timeout=60)
            assert all(o.finished and o.finish_reason == "error" and "exploded" in o.error for o in outs)
            assert not engine.healthy
            with pytest.raises(Exception, match="exploded"):
                engine.generate([1, 2], SamplingParams(max_tokens=2))
            runtime.model.forward = original
        return True

    assert asyncio.run(asyncio.wait_for(main(), timeout=120))


def test_rank_memory_for_the_27b_geometry_at_tp2():
    from deltaserve.model.config import ModelConfig
    from deltaserve.model.synthetic import text_config

    cfg = ModelConfig.from_dict(text_config("27b", 248320))
    sizes = StateSizes.of(cfg, LocalSizes.of(cfg, 2), torch.bfloat16)
    n_gdn, n_attn = 48, 16
    # conv: K-1 = 3 inputs of (2*Hk*dk + Hv*dv)/tp channels, bf16
    assert sizes.conv_bytes_per_slot == n_gdn * 3 * ((2 * 16 * 128 + 48 * 128) // 2) * 2
    # recurrent: Hv/tp heads of dk x dv in fp32
    assert sizes.ssm_bytes_per_slot == n_gdn * (48 // 2) * 128 * 128 * 4
    # KV page: 16 tokens x kv_heads/tp x head_dim, K and V, bf16
    assert sizes.kv_bytes_per_page == n_attn * 2 * 16 * (4 // 2) * 256 * 2
    assert sizes.ssm_bytes_per_slot == 75_497_472  # 72 MiB of recurrent state per request per rank


@pytest.mark.parametrize("speculative", [0, 3], ids=["plain", "speculative"])
@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded"])
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_mixed_steps_change_no_output(tiny_tp_ckpt, tp, padded, speculative, monkeypatch):
    """Decode rows and prompt chunks in one forward (`fused_mixed_steps`) give the tokens they give apart: prompts
    arrive while others decode, chunked (a budget of 24 tokens a step), some resuming after a cached prefix.
    Padded: the steps run what a mixed graph replays (`RankRuntime.programs`: the decode rows padded to a
    bucket and the chunks to a bucket of tokens, in the fixed inputs), on every rank. Speculative: the decode-only
    steps draft 3 tokens with the head and verify them; a fused step rolls back what the one before it left."""
    from helpers import EagerPrograms

    from deltaserve.devices.backend import StepShape
    from deltaserve.model.forward import Qwen35Shard

    fused_steps = []  # forwards of rows and chunks together
    forward = Qwen35Shard.forward

    def counted(self, state, batch):
        if batch.rows is not None and batch.chunks is not None:
            fused_steps.append(1)
        return forward(self, state, batch)

    monkeypatch.setattr(Qwen35Shard, "forward", counted)
    shared = [11 + j % 50 for j in range(40)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    longer = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def generate(fused):
        args = EngineArgs(model=tiny_tp_ckpt, tp=tp, max_model_len=256, max_batch=8, cpu_memory_bytes=32 << 20,
                          prefill_token_budget=24, step_latency_ratio=0, fused_mixed_steps=fused,
                          speculative_tokens=speculative if fused else 0, speculative_adaptive=False)
        async with AsyncEngine(args) as engine:
            if fused and padded:
                shapes = [StepShape(b, 1, t) for b in [0] + engine.replica.buckets for t in (16, 32)]
                for r in engine.replica.ranks:
                    replays.append(EagerPrograms.install(r.runtime, shapes, 4).replays)
            first = [engine.generate([7 + i, 40, 3 * i + 1], longer) for i in range(3)]
            heads = [await stream.__anext__() for stream in first]  # decoding, while the rest prefill beside them
            later = [_collect(engine.generate(shared + [60 + i] * (i + 1), greedy)) for i in range(4)]
            outs = await asyncio.gather(*map(_collect, first), *later)
            drafted = engine.metrics.spec_drafts._value.get()
            return [h.token_ids for h in heads] + [o.token_ids for o in outs], drafted

    replays = []  # per rank, the padded mixed steps it ran by bucket
    apart, _ = asyncio.run(generate(False))
    assert not fused_steps
    together, drafted = asyncio.run(generate(True))
    assert len(fused_steps) >= 4 and together == apart
    assert (drafted > 0) == bool(speculative)
    if padded:
        assert len(replays) == tp and all(r == replays[0] for r in replays)
        mixed = {s: n for s, n in replays[0].items() if s.rows}
        assert sum(mixed.values()) == len(fused_steps) // tp and len(mixed) >= 2
