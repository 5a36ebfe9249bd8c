"""GPU checks (run on the device; skipped without CUDA): kernels at real shapes in bf16, fla-core as a second
GDN oracle, graph decode identical to eager decode through the engine, tp = 1 through NCCL, server start-up."""

import asyncio
import logging
import re

import pytest
import torch

from deltaserve.kernels import attention, conv1d, gdn, gemv, launch, norm  # noqa: F401
from deltaserve.kernels.config import DEFAULT, GDN_FACTOR_MODES, KernelConfig
from deltaserve.devices.backend import StepShape
from deltaserve.kernels.ops import triton_ops
from deltaserve.model.config import ModelConfig
from deltaserve.model.synthetic import text_config, write_checkpoint

pytestmark = pytest.mark.gpu
BF16_TOL = 2e-2  # relative to the largest reference value


def rel(a, b):
    a, b = a.float(), b.float()
    assert not torch.isnan(a).any()
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def T():
    return triton_ops()


@pytest.mark.parametrize("size", ["4b", "9b", "27b"])
def test_kernels_at_real_shapes_in_bf16(T, size):
    cfg = ModelConfig.from_dict(text_config(size, 248320))
    dev, bf = "cuda", torch.bfloat16
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    C = 2 * hk * dk + hv * dv
    N = 48
    mixed = torch.randn(N, C, device=dev, dtype=bf)
    a, b = torch.randn(N, hv, device=dev, dtype=bf), torch.randn(N, hv, device=dev, dtype=bf)
    A_log, dt_bias = torch.rand(hv, device=dev) * 2, torch.rand(hv, device=dev)
    state = torch.randn(N + 1, hv, dk, dv, device=dev) * 0.1
    slots = torch.randperm(N, device=dev)
    slots[5] = -1
    ref_state = state.clone()
    got = gdn.gdn_decode(mixed, a, b, A_log, dt_bias, state, slots, hk, dk, dv)
    ref = gdn.gdn_decode_reference(mixed.float(), a, b, A_log, dt_bias, ref_state, slots, hk, dk, dv)
    assert rel(got, ref) <= BF16_TOL and rel(state[:N], ref_state[:N]) <= 1e-4

    conv = torch.randn(N + 1, 3, C, device=dev, dtype=bf)
    wc = torch.randn(C, 4, device=dev, dtype=bf) * 0.3
    ref_conv = conv.clone()
    assert rel(conv1d.conv1d_decode(mixed, wc, conv, slots), conv1d.conv1d_decode_reference(mixed, wc, ref_conv, slots)) <= BF16_TOL
    assert torch.equal(conv[:N], ref_conv[:N])

    H = cfg.hidden_size
    x, r, w = (torch.randn(N, H, device=dev, dtype=bf), torch.randn(N, H, device=dev, dtype=bf),
               torch.randn(H, device=dev, dtype=bf) * 0.1)
    assert rel(norm.add_rms_norm(x, r, w, 1e-6)[0], norm.add_rms_norm_reference(x.float(), r.float(), w, 1e-6)[0]) <= BF16_TOL

    nh, nkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pages = 6000
    kc = torch.randn(pages + 1, 16, nkv, D, device=dev, dtype=bf)
    vc = torch.randn_like(kc)
    q = torch.randn(8, nh, D, device=dev, dtype=bf)
    table = torch.randperm(pages, device=dev)[: 8 * 200].view(8, 200).to(torch.int32)
    lens = torch.tensor([1, 17, 300, 1000, 2048, 2500, 3000, 3200], device=dev)
    got = attention.decode_attention(q, kc, vc, table, lens, D**-0.5)
    assert rel(got, attention.decode_attention_reference(q, kc, vc, table, lens, D**-0.5)) <= BF16_TOL

    cos, sin = attention.rope_tables(cfg.rotary_dim, cfg.rope_theta, 4096, device=dev)
    qkv = torch.randn(64, (2 * nh + 2 * nkv) * D, device=dev, dtype=bf)
    qn, kn = (torch.randn(D, device=dev, dtype=bf) * 0.1 for _ in range(2))
    pos = torch.randint(0, 4096, (64,), device=dev)
    mapping = torch.randperm(160, device=dev)[:64]
    caches = [torch.zeros(11, 16, nkv, D, device=dev, dtype=bf) for _ in range(4)]
    got = attention.qk_norm_rope_cache(qkv, qn, kn, 1e-6, pos, cos, sin, caches[0], caches[1], mapping, nh, nkv)
    ref = attention.qk_norm_rope_cache_reference(qkv, qn, kn, 1e-6, pos, cos, sin, caches[2], caches[3], mapping, nh, nkv)
    assert rel(got, ref) <= BF16_TOL and rel(caches[0], caches[2]) <= BF16_TOL and torch.equal(caches[1], caches[3])

    # Prefill attention over paged context: a fresh request, a chunk after cached pages, one token.
    lens_p, ctx_p = [700, 300, 1], [0, 1500, 2999]
    q = torch.randn(sum(lens_p), nh, D, device=dev, dtype=bf)
    cu = torch.tensor([0, 700, 1000, 1001], dtype=torch.int32, device=dev)
    ctx_t = torch.tensor(ctx_p, device=dev)
    gate = torch.randn(sum(lens_p), nh, 2 * D, device=dev, dtype=bf)[..., D:]  # a view, as the model passes it
    want = attention.prefill_attention_reference(q, kc, vc, table[:3], cu, ctx_t, D**-0.5, gate)
    for splits in (1, 4):  # 4: the chunks after 1500 and 2999 cached keys split 2 and 3 ways, the fresh one not
        got = attention.prefill_attention(q, kc, vc, table[:3], cu, ctx_t, D**-0.5, gate, splits=splits,
                                          split_keys=1024)
        assert rel(got, want) <= BF16_TOL, splits

    conv_state = torch.randn(5, 3, C, device=dev, dtype=bf)
    ref_state = conv_state.clone()
    x = torch.randn(1001, C, device=dev, dtype=bf)
    slots3 = torch.tensor([3, 0, 1], device=dev)
    got = conv1d.conv1d_prefill(x, wc, conv_state, cu, slots3)
    assert rel(got, conv1d.conv1d_prefill_reference(x, wc, ref_state, cu, slots3)) <= BF16_TOL
    assert torch.equal(conv_state, ref_state)

    # One-row projections that do not widen (the GEMV): the 9B/27B-sized out_proj and down_proj shapes.
    for n, k in ((H, hv * dv), (H, cfg.intermediate_size)):
        w_, x_ = torch.randn(n, k, device=dev, dtype=bf) * 0.02, torch.randn(1, k, device=dev, dtype=bf)
        assert rel(gemv.gemv(x_, w_), gemv.linear_reference(x_.float(), w_.float())) <= BF16_TOL
    # The block input's add-and-norm fused into the one-row projection that reads it: in_proj, and gate_up with
    # silu(gate) * up (fp32 reference on the same bf16 inputs).
    x_, res_, nw_ = (torch.randn(1, H, device=dev, dtype=bf) for _ in range(3))
    for n, silu in ((2 * hk * dk + 2 * hv * dv + 2 * hv, False), (2 * cfg.intermediate_size, True)):
        w_ = torch.randn(n, H, device=dev, dtype=bf) * 0.02
        fused, unfused = (gemv.add_rms_norm_gate_up, gemv.add_rms_norm_gate_up_reference) if silu else (gemv.add_rms_norm_linear,
                                                                                        gemv.add_rms_norm_linear_reference)
        got, got_res = fused(x_, res_, nw_, cfg.rms_norm_eps, w_)
        ref, ref_res = unfused(x_.float(), res_.float(), nw_.float(), cfg.rms_norm_eps, w_.float())
        assert rel(got, ref) <= BF16_TOL and rel(got_res, ref_res) <= BF16_TOL


def test_gdn_matches_fla_core():
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    torch.manual_seed(0)
    dev, L, H, dk, dv = "cuda", 1000, 8, 128, 128
    q = gdn.l2_normalize(torch.randn(L, H, dk, device=dev))
    k = gdn.l2_normalize(torch.randn(L, H, dk, device=dev))
    v = torch.randn(L, H, dv, device=dev)
    g = -torch.rand(L, H, device=dev) * 0.5
    beta = torch.rand(L, H, device=dev)
    S0 = torch.randn(H, dk, dv, device=dev) * 0.1
    exact, exact_state = gdn.gdn_recurrent(q * dk**-0.5, k, v, g, beta, S0)
    ours, ours_state = gdn.gdn_chunked(q * dk**-0.5, k, v, g, beta, S0)
    theirs, theirs_state = fla.chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=dk**-0.5,
                                                      initial_state=S0[None], output_final_state=True)
    # Ours in fp32 against the exact recurrence; fla (TF32 dots inside) against both, looser.
    assert rel(ours, exact) <= 1e-4 and rel(ours_state, exact_state) <= 1e-4
    assert rel(theirs[0], exact) <= 5e-3 and rel(theirs_state[0], exact_state) <= 5e-3
    assert rel(ours, theirs[0]) <= 5e-3
    step, step_state = fla.fused_recurrent_gated_delta_rule(q[None, :1], k[None, :1], v[None, :1], g=g[None, :1],
                                                            beta=beta[None, :1], scale=dk**-0.5,
                                                            initial_state=S0[None], output_final_state=True)
    mixed = torch.cat([q[:1].flatten(1), k[:1].flatten(1), v[:1].flatten(1)], dim=1)
    # Undo the gates so gdn_decode sees the same g and beta: a = softplus^-1(-g), A_log = 0; b = logit(beta).
    a = torch.log(torch.expm1(-g[:1]))
    b = torch.log(beta[:1] / (1 - beta[:1]))
    pool = torch.cat([S0[None], torch.zeros(1, H, dk, dv, device=dev)])
    got = gdn.gdn_decode(mixed, a, b, torch.zeros(H, device=dev), torch.zeros(H, device=dev), pool,
                       torch.zeros(1, dtype=torch.long, device=dev), H, dk, dv)
    assert rel(got, step[0]) <= 5e-3 and rel(pool[0], step_state[0]) <= 5e-3


@pytest.mark.parametrize("size", ["4b", "27b"])
def test_triton_gdn_prefill_at_real_shapes(T, size):
    """Both factor precisions against the fp32 reference on packed requests from slots, bf16 factors (what a bf16
    model runs) with each state-pass tile gdn_scan_config can choose for them, since a tile can miscompile on its
    own (32-wide fp32 factors once gave NaN outputs); bf16 factors also against fla-core's error on the
    same case, when it is installed."""
    from deltaserve.tools.bench_kernels import fla_prefill, gdn_prefill_case, gdn_prefill_errors, gdn_prefill_reference

    case = gdn_prefill_case(ModelConfig.from_dict(text_config(size, 248320)))
    reference = gdn_prefill_reference(case)
    errors = {mode: gdn_prefill_errors(case, lambda **c: gdn.gdn_prefill(**c, factors=mode), reference)
              for mode in GDN_FACTOR_MODES}
    by_tile = {tile: gdn_prefill_errors(case, lambda **c: gdn.gdn_prefill(**c, factors="bf16", scan_config=tile),
                                        reference) for tile in (DEFAULT.gdn_scan_narrow, DEFAULT.gdn_scan_wide)}
    assert not gdn._PREFILL_FALLBACK, "a Triton kernel did not fit; the torch chunked form ran instead"
    (out_fp32, state_fp32), (out_bf16, state_bf16) = errors["fp32"], errors["bf16"]
    assert out_fp32 <= BF16_TOL and state_fp32 <= 5e-3
    assert out_bf16 <= BF16_TOL and state_bf16 <= 1e-2
    assert all(out <= BF16_TOL and state <= 1e-2 for out, state in by_tile.values()), by_tile
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return
    fla_out, fla_state = gdn_prefill_errors(case, lambda **c: fla_prefill(chunk_gated_delta_rule, **c), reference)
    assert out_bf16 <= 2 * fla_out and state_bf16 <= 2 * fla_state, (errors, fla_out, fla_state)


def test_triton_sampler_at_the_real_vocabulary():
    from deltaserve.kernels.sampling import SamplingTensors, lm_like_logits, sample_reference
    from deltaserve.kernels.triton_sampling import draw, sample_on_gpu

    n, vocab, dev = 64, 248320, "cuda"
    logits = lm_like_logits(n, vocab, dev)
    mixed = dict(temperature=torch.tensor([0.0, 1.0, 0.7, 1.0, 1.0, 0.8, 1.3, 0.6], device=dev).repeat(8),
                 top_k=torch.tensor([0, 0, 20, 0, 0, 50, 0, 1000], device=dev).repeat(8),
                 top_p=torch.tensor([1.0, 1.0, 0.8, 0.95, 1.0, 0.9, 0.5, 1.0], device=dev).repeat(8),
                 min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.1], device=dev).repeat(8))
    for trial in range(3):
        p = SamplingTensors.filled(n, dev, seeds=torch.randint(0, 2**62, (n,), device=dev),
                                   steps=torch.full((n,), trial, device=dev), **mixed)
        drawn = draw(logits, p)
        tokens, chosen, *_ = sample_reference(logits, p)
        done = drawn.done == 1
        assert done.all()  # top-p alone included: the refine pass places its band
        wrong = (done & (drawn.tokens != tokens)).nonzero()[:, 0].tolist()
        assert not wrong, [(i, {k: v[i].item() for k, v in mixed.items()}) for i in wrong]
        assert torch.allclose(drawn.logprobs[done], chosen[done], atol=1e-4)
        assert torch.equal(sample_on_gpu(logits, p)[0], tokens)
    # The model hands over bf16 logits; the kernels widen them as they read, exactly as .float() would (the
    # compiled reductions may add in another order: logprobs agree to rounding).
    low = logits.bfloat16()
    as_bf16, as_fp32 = draw(low, p), draw(low.float(), p)
    assert torch.equal(as_bf16.tokens, as_fp32.tokens) and torch.equal(as_bf16.done, as_fp32.done)
    assert torch.allclose(as_bf16.logprobs, as_fp32.logprobs, atol=1e-5)


async def _greedy_run(ckpt, graph: bool, use_nccl=None, n=32, tokens=128, kernel_config=None, overlap=True,
                      at_once=False, sampled=False, prefill_graphs=True):
    """n requests of different lengths (greedy, or seeded top-p / top-k sampling); each arrives once the one before
    has three tokens, or all `at_once` (the same batches with overlap scheduling on and off). Returns the tokens
    and the buckets used."""
    from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams

    args = EngineArgs(model=ckpt, device="cuda", cuda_graph=graph, max_batch=32, max_model_len=1024,
                      load_format="random", use_nccl=use_nccl, buckets=[1, 2, 4, 8, 16, 24, 32],
                      kernel_config=kernel_config, async_scheduling=overlap,
                      prefill_graph_tokens=1024 if prefill_graphs else 0)
    async with AsyncEngine(args) as engine:
        results: dict[int, list[int]] = {}
        started = asyncio.Event()

        def params(i):
            sampling = dict(temperature=0.8, seed=i, top_p=0.9, top_k=(0, 20)[i % 2]) if sampled else \
                dict(temperature=0)
            return SamplingParams(max_tokens=tokens - 3 * (i % 7), ignore_eos=True, **sampling)

        async def one(i, stream):
            async for out in stream:
                if len(out.token_ids) == 3:
                    started.set()
            results[i] = out.token_ids

        tasks = []
        for i in range(n):  # arrivals tied to progress, so both runs see the same batches
            started.clear()
            stream = engine.generate([(17 * i + j) % 3000 for j in range(5 + 11 * i)], params(i))
            tasks.append(asyncio.create_task(one(i, stream)))
            if not at_once:
                await started.wait()
        await asyncio.gather(*tasks)
        buckets_used = sorted(engine.replica.buckets)
    return [results[i] for i in range(n)], buckets_used


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_overlap_scheduling_changes_no_token_on_the_gpu(real_geometry_ckpt, sampled):
    """With overlap scheduling the next step is launched before this one's tokens reach the host and takes them on
    the device; the same batches must give the same tokens, greedy and seeded top-p / top-k (whose rows wait for the
    sampler's flags before the next step reads them)."""
    sync, _ = asyncio.run(_greedy_run(real_geometry_ckpt, graph=True, n=24, tokens=64, at_once=True,
                                      sampled=sampled, overlap=False))
    overlapped, _ = asyncio.run(_greedy_run(real_geometry_ckpt, graph=True, n=24, tokens=64, at_once=True,
                                            sampled=sampled, overlap=True))
    assert sync == overlapped
    assert len({tuple(t) for t in sync}) > 1


def triton_variants() -> dict[str, int]:
    """Compiled variants per Triton kernel of ours, in this process (Triton keeps one per specialisation: an integer
    1, divisible by 16 or neither; a pointer 16-byte aligned or not; each constexpr)."""
    import triton

    from deltaserve.kernels import triton_sampling

    counts = {}
    for module in (attention, conv1d, gdn, gemv, launch, norm, triton_sampling):
        for name, obj in vars(module).items():
            while not isinstance(obj, triton.runtime.JITFunction) and hasattr(obj, "fn"):
                obj = obj.fn  # autotuner and heuristics wrappers
            if isinstance(obj, triton.runtime.JITFunction):
                counts[f"{obj.fn.__module__.rsplit('.', 1)[-1]}.{obj.fn.__name__}"] = sum(
                    len(cache[0]) for cache in obj.device_caches.values())
    return counts


def test_serving_after_the_warm_up_compiles_no_triton_kernel(real_geometry_ckpt):
    """The warm-up before "engine ready" must reach every specialisation a server then meets: 96 requests arriving
    over half a second (prompts of 1-700 tokens, packed and chunked; decode batches up to 48; greedy, top-k, top-p,
    penalties with log-probs) compile nothing more. A kernel compiled while serving stalls every stream for
    seconds."""
    import random

    from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams

    rng = random.Random(0)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=20), dict(temperature=0.7, top_p=0.9),
             dict(temperature=0.9, top_p=0.95, presence_penalty=0.5, repetition_penalty=1.1, logprobs=3)]

    async def main():
        args = EngineArgs(model=real_geometry_ckpt, device="cuda", max_batch=48, max_model_len=1024,
                          load_format="random", buckets=[1, 2, 4, 8, 16, 24, 32, 48], prefill_token_budget=512)
        async with AsyncEngine(args) as engine:
            before = triton_variants()

            async def one(i):
                await asyncio.sleep(rng.random() * 0.5)
                prompt = [rng.randrange(3000) for _ in range(rng.randint(1, 700))]
                params = SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, seed=i, **kinds[i % 4])
                async for _ in engine.generate(prompt, params):
                    pass

            await asyncio.gather(*[one(i) for i in range(96)])
            after = triton_variants()
        return {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}

    assert asyncio.run(main()) == {}


@pytest.mark.parametrize("mode", ["plain", "speculative", "fused"])
def test_launching_a_step_never_waits_for_the_device(real_geometry_ckpt, monkeypatch, mode):
    """Overlap scheduling holds only while launching a step queues work without waiting for the stream: one hidden
    synchronisation (a blocking copy, a host index list, `.item()`) makes the host wait for the step before, and
    the GPU then idles while the host launches. Every launch while serving runs under torch's sync debug mode, each
    synchronising call recorded with its stack: mixed decode and prompt steps (graphed and eager chunks, cache
    hits and snapshots), greedy and sampled rows with penalties, log-probs, `min_tokens` and stop ids; with
    speculation, speculative and one-token steps; fused, decode rows and chunks in one forward. Only the sampler's
    settle may wait: it waits for the flagged draws of the step before by design."""
    import random
    import traceback
    import warnings

    from deltaserve.devices.rank import RankRuntime
    from deltaserve.devices.sampling import SlotSampling
    from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams

    launch, settle = RankRuntime.launch, SlotSampling.settle
    waits: dict[str, int] = {}  # where a launch synchronised (its stack) -> how often

    def record(message, *args, **kwargs):
        if "called a synchronizing CUDA operation" in str(message):
            where = "".join(traceback.format_stack(limit=14)[:-2])
            waits[where] = waits.get(where, 0) + 1

    def checked_launch(self, *args, **kwargs):
        # Warn rather than raise, so that one run finds every place that waits, not only the first.
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return launch(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def waiting_settle(self, *args, **kwargs):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return settle(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    rng = random.Random(1)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=20, logprobs=2),
             dict(temperature=0.7, top_p=0.9, min_tokens=1, stop_token_ids=[5, 6]),
             dict(temperature=0.9, presence_penalty=0.5, repetition_penalty=1.1, frequency_penalty=0.2)]
    shared = [rng.randrange(3000) for _ in range(200)]  # a system prompt: hits, restores and page copies

    async def main():
        args = EngineArgs(model=real_geometry_ckpt, device="cuda", max_batch=32, max_model_len=1024,
                          load_format="random", buckets=[1, 2, 4, 8, 16, 32], prefill_token_budget=512,
                          prefill_graph_tokens=256,  # chunks above 256 tokens run eagerly
                          speculative_tokens=3 if mode == "speculative" else 0, fused_mixed_steps=mode == "fused")
        async with AsyncEngine(args) as engine:
            monkeypatch.setattr(RankRuntime, "launch", checked_launch)
            monkeypatch.setattr(SlotSampling, "settle", waiting_settle)
            monkeypatch.setattr(warnings, "showwarning", record)
            warnings.simplefilter("always")

            async def one(i):
                await asyncio.sleep(rng.random() * 0.3)
                tail = [rng.randrange(3000) for _ in range(rng.randint(1, 600))]
                prompt = shared + tail if i % 2 else tail
                params = SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, seed=i, **kinds[i % 4])
                return await _last(engine.generate(prompt, params))

            outs = await asyncio.gather(*[one(i) for i in range(64)])
            monkeypatch.undo()
        return outs

    with warnings.catch_warnings():
        outs = asyncio.run(main())
    assert all(out.finished and out.error is None and out.token_ids for out in outs), [o.error for o in outs]
    assert not waits, "\n".join(f"{n} launches waited at:\n{where}" for where, n in waits.items())


def test_bf16_model_at_the_4b_width_matches_hf(T, tmp_path):
    """Our bf16 forward on the GPU (Triton ops) against transformers' in fp32, at the 4B width with four layers
    (three GDN, one attention) from a bf16 checkpoint: a 40-token prefill, then 24 one-row decode steps (the fused
    add-and-norm GEMVs, the block norms folded into the projections) fed the reference's tokens. The CPU bf16
    gate on the reference's top-8 log-probs, over the 4B geometry's real widths. Untied: with random weights a
    tied lm_head gives each input token a logit far above the rest (93 against a spread of 2), and bf16 log-probs
    then differed from fp32 by 0.12 on average, against 0.018 untied (the CPU reference ops, same weights)."""
    from helpers import CpuRunner, hf_model, hf_step, top8_logprob_gaps

    ckpt = write_checkpoint(str(tmp_path), "4b", layers=4, dtype="bfloat16", tied=False)
    hf = hf_model(ckpt).to("cuda")
    ours = CpuRunner(ckpt, dtype=torch.bfloat16, ops=T, device="cuda", num_slots=2, num_pages=8)
    prompt = [(37 * j) % 500 + 3 for j in range(40)]
    ref, cache = hf_step(hf, torch.tensor([prompt], device="cuda"))
    prefill_gaps = top8_logprob_gaps(ours.prefill({0: prompt}, all_logits=True), ref[0])
    decode_gaps = []
    for i in range(24):
        token = int(ref[0, -1].argmax())
        got = ours.decode({0: token}, {0: len(prompt) + i})
        ref, cache = hf_step(hf, torch.tensor([[token]], device="cuda"), cache)
        decode_gaps.append(top8_logprob_gaps(got, ref[0, -1:]))
    for name, d in (("prefill", prefill_gaps), ("decode", torch.cat(decode_gaps))):
        logging.getLogger(__name__).info("%s: |Δ log-prob| mean %.4f, p99 %.4f", name, d.mean(), d.quantile(0.99))
        assert d.mean() <= 0.06 and d.quantile(0.99) <= 0.2, (name, d.mean(), d.quantile(0.99))


@pytest.fixture(scope="module")
def real_geometry_ckpt(tmp_path_factory):
    return write_checkpoint(str(tmp_path_factory.mktemp("g4b")), "4b", layers=8, weights=False)


def test_graph_decode_equals_eager_through_the_engine(real_geometry_ckpt):
    # Prefill graphs off: padded to a bucket, a prefill's GEMMs take other shapes and round otherwise in bf16 (the
    # next test compares those in fp32).
    eager, _ = asyncio.run(_greedy_run(real_geometry_ckpt, graph=False))
    graphs, buckets = asyncio.run(_greedy_run(real_geometry_ckpt, graph=True, prefill_graphs=False))
    assert buckets[-1] >= 32
    assert eager == graphs
    assert len(eager[0]) == 128 and len({tuple(t) for t in eager}) > 1


async def _last(stream):
    out = None
    async for out in stream:
        pass
    return out


def first_token_gaps(ours, reference) -> torch.Tensor:
    """|Δ log-prob| between two runs' first tokens, over the top-8 tokens both list, request by request."""
    gaps = []
    for a, b in zip(ours, reference):
        ref = dict(b.logprobs[0].top)
        gaps += [abs(lp - ref[t]) for t, lp in a.logprobs[0].top if t in ref]
    return torch.tensor(gaps)


class _Counting:
    """Step graphs that record the shapes they replay."""

    def __init__(self, graphs):
        self.graphs, self.replays, self.shapes = graphs, [], graphs.shapes

    def captured(self, shape):
        return self.graphs.captured(shape)

    def __call__(self, shape):
        self.replays.append(shape)
        return self.graphs(shape)

    def destroy(self):
        self.graphs.destroy()


def test_prefill_graphs_compute_what_the_eager_prefill_does(real_geometry_ckpt):
    """One-chunk prefills replay a graph padded to a bucket of tokens. In fp32 at the 4B width, each prompt's
    first-token top-8 log-probs agree with an all-eager engine's within 2e-3: prompts of 1 to 1500 tokens, fresh,
    chunked, packed and resumed after a cached prefix; and the graphs did replay."""
    import random

    from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams

    rng = random.Random(5)
    prompts = [[rng.randrange(3000) for _ in range(n)] for n in (1, 15, 16, 17, 100, 511, 700, 1500)]
    prompts += [prompts[6] + [rng.randrange(3000) for _ in range(33)]]  # resumes after 700 cached tokens
    params = SamplingParams(max_tokens=1, logprobs=8, temperature=0)

    async def run(prefill_graphs: bool):
        args = EngineArgs(model=real_geometry_ckpt, device="cuda", max_batch=8, max_model_len=2048, dtype="float32",
                          load_format="random", prefill_token_budget=1024,
                          prefill_graph_tokens=1024 if prefill_graphs else 0)
        async with AsyncEngine(args) as engine:
            runtime = engine.replica.ranks[0].runtime
            if prefill_graphs:
                assert [s.prompt_tokens for s in runtime.graphs.shapes if s.prompt_tokens and not s.rows] == [
                    16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
                runtime.graphs = _Counting(runtime.graphs)
            outs = [(await _last(engine.generate(p, params))) for p in prompts]
            outs += await asyncio.gather(*[_last(engine.generate(p, params)) for p in prompts[:4]])
        return outs, runtime.graphs

    graphed, counting = asyncio.run(run(True))
    eager, _ = asyncio.run(run(False))
    gaps = first_token_gaps(graphed, eager)
    logging.getLogger(__name__).info("prefill graphs on/off: |Δ log-prob| max %.2e over %d; replays %s",
                                     gaps.max(), len(gaps), counting.replays)
    assert len(gaps) >= 8 * len(graphed) * 3 // 4 and gaps.max() <= 2e-3
    assert {16, 32, 128, 512, 1024} <= {s.prompt_tokens for s in counting.replays if not s.rows}
    assert graphed[8].num_cached_tokens == 700  # the 700-token prompt's end


def test_fused_mixed_graphs_compute_what_steps_apart_do(real_geometry_ckpt):
    """With `fused_mixed_steps`, a step's decode rows and prompt chunk replay one graph per (decode bucket, prompt
    bucket). In fp32 at the 4B width, requests arriving while others decode (prompts of 1 to 900 tokens, some
    chunked) give the tokens, and the top-8 log-probs within 2e-3 at every position, of steps run apart; and mixed
    graphs of several buckets did replay."""
    import random

    from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams

    rng = random.Random(9)
    prompts = [[rng.randrange(3000) for _ in range(n)] for n in (40, 1, 63, 64, 65, 200, 513, 900, 7, 300)]
    params = SamplingParams(max_tokens=10, logprobs=8, temperature=0, ignore_eos=True)

    async def run(fused: bool):
        args = EngineArgs(model=real_geometry_ckpt, device="cuda", max_batch=16, max_model_len=2048, dtype="float32",
                          load_format="random", buckets=[1, 2, 4, 8, 16], prefill_token_budget=512,
                          prefill_graph_tokens=512, step_latency_ratio=0, fused_mixed_steps=fused)
        async with AsyncEngine(args) as engine:
            runtime = engine.replica.ranks[0].runtime
            if fused:
                assert [s for s in runtime.graphs.shapes if s.rows and s.prompt_tokens] == [
                    StepShape(d, 1, t) for d in (1, 2, 4, 8, 16) for t in (64, 128, 192, 256, 384, 512)]
                runtime.graphs = _Counting(runtime.graphs)
            started, tasks = asyncio.Event(), []

            async def one(prompt):
                out = None
                async for out in engine.generate(prompt, params):
                    if len(out.token_ids) >= 2:
                        started.set()
                return out

            for prompt in prompts:  # each arrives while the ones before it decode
                started.clear()
                tasks.append(asyncio.create_task(one(prompt)))
                await started.wait()
            outs = await asyncio.gather(*tasks)
        return outs, runtime.graphs

    fused, counting = asyncio.run(run(True))
    mixed = [s for s in counting.replays if s.rows and s.prompt_tokens]
    apart, _ = asyncio.run(run(False))
    gaps, same = [], 0
    for a, b in zip(fused, apart):
        for got, ref, token_a, token_b in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids):
            expected = dict(ref.top)
            gaps += [abs(lp - expected[t]) for t, lp in got.top if t in expected]
            if token_a != token_b:
                break
            same += 1
    gaps = torch.tensor(gaps)
    logging.getLogger(__name__).info("fused mixed graphs / apart: |Δ log-prob| max %.2e over %d, %d of %d tokens "
                                     "the same; replays %s", gaps.max(), len(gaps), same, 10 * len(prompts),
                                     sorted(set(map(str, mixed))))
    assert same == 10 * len(prompts) and gaps.max() <= 2e-3
    assert len(set(mixed)) >= 4 and any(s.rows > 1 for s in mixed)


def test_an_engine_closed_in_process_gives_its_graph_pools_back(real_geometry_ckpt):
    """Embedded users start and close engines in one process: every graph's use of its memory pool is released
    (the mixed graphs share the prefill graphs' pool) and the cuBLAS workspaces of the closed streams dropped, so
    a second engine's lifetime leaves no more reserved than the first's (2.4 GiB more on an H100 before). Closing
    returns the memory to the driver itself, while the caller still holds the engine (69 GiB stayed in torch's
    cache before: a worker thread held the last step, and with it the state, past the teardown)."""
    import gc

    from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams

    async def lifetime() -> int:
        args = EngineArgs(model=real_geometry_ckpt, device="cuda", max_batch=4, max_model_len=1024,
                          load_format="random", buckets=[1, 2, 4], prefill_graph_tokens=256, warmup=False)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        async with AsyncEngine(args) as engine:
            assert any(s.rows and s.prompt_tokens for s in engine.replica.ranks[0].runtime.graphs.shapes)
            await _last(engine.generate(list(range(1, 300)), SamplingParams(max_tokens=4, ignore_eos=True)))
        left = torch.cuda.memory_reserved() - before
        assert left <= 1 << 30, f"{left / 2**30:.1f} GiB more reserved by torch after the engine closed"
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    first = asyncio.run(lifetime())
    second = asyncio.run(lifetime())
    logging.getLogger(__name__).info("reserved after one engine %.0f MiB, after two %.0f MiB", first / 2**20,
                                     second / 2**20)
    assert second - first <= 64 << 20, f"{(second - first) / 2**20:.0f} MiB more reserved after a second engine"


def test_pdl_launches_change_no_token(real_geometry_ckpt):
    """The decode kernels overlap under programmatic dependent launch; a kernel that read its input before the
    previous kernel finished writing it would change tokens."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm90")
    assert launch.pdl_options(torch.device("cuda"), DEFAULT.pdl) == {"PDL": True, "launch_pdl": True}
    with_pdl, _ = asyncio.run(_greedy_run(real_geometry_ckpt, graph=True, n=12, tokens=64))
    assert launch.pdl_options(torch.device("cuda"), False) == {}
    plain, _ = asyncio.run(_greedy_run(real_geometry_ckpt, graph=True, n=12, tokens=64,
                                       kernel_config=KernelConfig(pdl=False)))
    assert with_pdl == plain


def test_tp1_through_nccl_equals_the_plain_path(real_geometry_ckpt):
    pytest.importorskip("nccl.core")
    plain, _ = asyncio.run(_greedy_run(real_geometry_ckpt, graph=True, n=6, tokens=40))
    nccl, _ = asyncio.run(_greedy_run(real_geometry_ckpt, graph=True, use_nccl=True, n=6, tokens=40))
    assert plain == nccl


@pytest.mark.parametrize("size,layers", [("4b", 8), ("27b", 8)])
def test_capture_check_exits_zero(tmp_path, size, layers):
    from deltaserve.tools import capture_check

    ckpt = write_checkpoint(str(tmp_path), size, layers=layers, weights=False)
    assert capture_check.main(["--model", ckpt, "--load-format", "random", "--buckets", "1,2,8,24,32",
                               "--prefill-tokens", "1024", "--context", "600", "--dot", str(tmp_path / "dot")]) == 0
    assert (tmp_path / "dot" / "decode_8.dot").is_file()
    assert (tmp_path / "dot" / "prefill_512.dot").is_file()
    assert (tmp_path / "dot" / "mixed_1+64.dot").is_file()


@pytest.mark.parametrize("context", [40, 300])
def test_a_checkpoint_with_gdn_heads_narrower_than_a_dot_serves_on_the_gpu(tmp_path, context):
    """A checkpoint saved by transformers with GDN key heads of 8 and value heads of 12 (the CPU engine serves it
    exactly) starts on the GPU: every decode, prefill and mixed graph captures and replays as its eager step (the
    chunked GDN's tiles are padded to the 16 a dot needs), at a context shorter than the prefill buckets too."""
    from helpers import transformers_checkpoint

    from deltaserve.model.synthetic import demo_checkpoint
    from deltaserve.tools import capture_check

    ckpt = transformers_checkpoint(str(tmp_path / "hf"), demo_checkpoint())
    assert capture_check.main(["--model", ckpt, "--buckets", "1,2,8", "--context", str(context), "--dtype",
                               "float32"]) == 0


def test_capture_check_replays_the_speculative_steps(tmp_path):
    """Each bucket's speculative step (roll-back, three drafts, verify) replayed from its graph against its program
    run eagerly: logits within the tolerance, drafts equal; and the speculative engine's mixed steps."""
    from deltaserve.tools import capture_check

    ckpt = write_checkpoint(str(tmp_path), "4b", layers=8, weights=False)
    assert capture_check.main(["--model", ckpt, "--load-format", "random", "--buckets", "1,4,16",
                               "--prefill-tokens", "256", "--context", "600", "--speculative-tokens", "3"]) == 0


def test_server_starts_with_graphs_and_logs_the_capture_sweep(real_geometry_ckpt, caplog):
    import aiohttp

    from deltaserve.runtime import AsyncEngine, EngineArgs
    from deltaserve.runtime.server import serve

    async def main():
        args = EngineArgs(model=real_geometry_ckpt, device="cuda", max_batch=16, max_model_len=512,
                          load_format="random", served_model_name="m")
        async with AsyncEngine(args) as engine:
            runner = await serve(engine, "127.0.0.1", 18731)
            try:
                async with aiohttp.ClientSession() as s:
                    async with s.post("http://127.0.0.1:18731/v1/completions",
                                      json={"model": "m", "prompt": "hello", "max_tokens": 8}) as r:
                        return r.status, await r.json()
            finally:
                await runner.cleanup()

    with caplog.at_level(logging.INFO):
        status, body = asyncio.run(main())
    assert status == 200 and body["usage"]["completion_tokens"] == 8
    assert any(re.match(r"\d+ decode graphs per rank", m) for m in caplog.messages)
    assert any(m.startswith("graphs captured in") for m in caplog.messages)


def test_prefix_cache_resumes_as_a_cold_prefill_computes(real_geometry_ckpt):
    """At the 4B width: a shared system prompt, a conversation's next turns, repeats and a branch inside a page,
    served one after another with the prefix cache on and off. In fp32, so that a mistake is not hidden in
    rounding (a bf16 logit near 100 moves in steps of 0.5 whenever the GDN chunks fall elsewhere): the first
    token's top-8 log-probs agree within 2e-3, and the expected prefixes hit."""
    import random

    from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams

    rng = random.Random(3)
    system = [rng.randrange(3000) for _ in range(700)]
    turn = system + [rng.randrange(3000) for _ in range(300)]
    prompts = [system + [rng.randrange(3000) for _ in range(40)] for _ in range(4)]
    prompts += [turn, turn + [rng.randrange(3000) for _ in range(250)], turn, turn, system[:333] + [7] * 50]

    async def run(cache: bool):
        args = EngineArgs(model=real_geometry_ckpt, device="cuda", max_batch=8, max_model_len=2048,
                          load_format="random", enable_prefix_caching=cache, prefill_token_budget=512,
                          dtype="float32")
        outs = []
        async with AsyncEngine(args) as engine:
            for prompt in prompts:
                outs.append(await _last(engine.generate(prompt, SamplingParams(max_tokens=1, logprobs=8,
                                                                               temperature=0))))
            assert engine.resources_free()
        return outs

    cached, cold = asyncio.run(run(True)), asyncio.run(run(False))
    gaps = first_token_gaps(cached, cold)
    logging.getLogger(__name__).info("prefix cache on/off: |Δ log-prob| mean %.4f, max %.4f over %d; cached %s",
                                     gaps.mean(), gaps.max(), len(gaps), [o.num_cached_tokens for o in cached])
    assert len(gaps) >= 8 * len(prompts) * 3 // 4 and gaps.max() <= 2e-3
    hits = [o.num_cached_tokens for o in cached]
    # From the third question on, the system prompt's last page boundary (the second question's branch point);
    # the conversation's next turn from the turn's end; its repeats after all of it (lm_head over the hidden
    # state the turn's end snapshot kept, in a graphed prefill).
    assert hits[2] == hits[3] == 688 and hits[5] == hits[6] == hits[7] == len(turn)
    assert all(o.num_cached_tokens == 0 for o in cold)


def test_speculative_decoding_keeps_the_tokens_of_plain_decoding(real_geometry_ckpt):
    """At the 4B width on the GPU (the Triton ops, the steps in captured graphs, overlapped: each step takes the
    last one's kept counts on the device): greedy tokens with the head drafting (random weights: drafts mostly
    rejected) and with drafts of the model's own continuation (all kept but the last step's), in fp32, equal plain
    decoding's; the verify path's log-probs within 2e-3 of the decode path's."""
    from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams
    from deltaserve.runtime.speculation import SpeculationOverride

    prompts = [[(7 * i + 13 * j) % 3000 for j in range(40 + 37 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)

    async def run(k: int, drafter=None):
        # Prefill graphs off: the decode and speculative graphs are what this checks, and fp32 captures are slow.
        args = EngineArgs(model=real_geometry_ckpt, device="cuda", max_batch=4, max_model_len=1024,
                          load_format="random", dtype="float32", speculative_tokens=k,
                          speculative_adaptive=False, prefill_graph_tokens=0)
        async with AsyncEngine(args, speculation_override=SpeculationOverride(drafter)) as engine:
            graphs = engine.replica.ranks[0].backend.graphs
            assert not graphs.eager and (not k or any(s.tokens_per_row == k + 1 for s in graphs.shapes))
            outs = await asyncio.gather(*[_last(engine.generate(p, params)) for p in prompts])
            accepted = engine.metrics.spec_accepted._value.get()
            assert engine.resources_free()
        return outs, accepted

    plain, _ = asyncio.run(run(0))
    known = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}

    def drafter(prompt, output, k):  # the warm-up's prompts are not known: any drafts
        full = known.get(tuple(prompt), []) + [0] * (len(output) + k)
        return full[len(output) : len(output) + k]

    for k, draft in ((3, None), (3, drafter), (1, drafter)):
        spec, accepted = asyncio.run(run(k, draft))
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain], (k, draft)
        gap = max(abs(a.logprob - b.logprob) for s, p in zip(spec, plain) for a, b in zip(s.logprobs, p.logprobs))
        logging.getLogger(__name__).info("speculation k=%d (%s drafts): %d accepted, |Δ log-prob| max %.2e", k,
                                         "own" if draft else "head", accepted, gap)
        assert gap <= 2e-3
        if draft:
            assert accepted >= len(prompts) * (24 - 1 - -(-23 // (k + 1)))


def _trained_like(weights: dict, cfg, generator: torch.Generator) -> None:
    """Random weights given a trained model's scales, in place: embeddings and lm_head of std 0.02, every norm's
    gain (1 + w) near 1 with a few channels of large gains (trained models' outlier channels, which quantising
    activations meets), and the final norm's gain such that logits spread as a trained model's (std about 2)."""
    from deltaserve.kernels.fp8 import Fp8Weight

    dev = generator.device
    for name, w in weights.items():
        if isinstance(w, Fp8Weight):
            continue
        if name in ("embed_tokens.weight", "lm_head.weight"):
            w.copy_(torch.randn(w.shape, generator=generator, device=dev) * 0.02)
        elif name in ("norm.weight", "mtp.norm.weight"):
            gain = 2.0 / (0.02 * cfg.hidden_size ** 0.5)
            w.copy_(torch.randn(w.shape, generator=generator, device=dev) * 0.2 * gain + gain - 1.0)
        elif name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            gains = 1.0 + torch.randn(w.shape, generator=generator, device=dev) * 0.2
            outliers = torch.randperm(w.shape[0], generator=generator, device=dev)[: max(1, w.shape[0] // 256)]
            gains[outliers] *= 4.0
            w.copy_(gains - 1.0)


@pytest.mark.parametrize("size", ["4b", "9b", "27b"])
def test_fp8_kernels_pass_the_accuracy_gate_at_real_widths(size):
    """Random block-scaled FP8 projections at the 4B, 9B and 27B widths (four layers), drawn at a trained model's
    scales (`_trained_like`), on the default FP8 kernels with bf16 activations, against the same weights
    dequantised to fp32 on the torch references: top-8 log-probs of a 200-token prefill (prefill-sized projections)
    and three decode steps within the gate (mean <= 0.06, p99 <= 0.2). The opt-in W8A8 prefill
    (`fp8_prefill="cublas"`) is measured and logged beside it, for the record its docs cite."""
    from helpers import top8_logprob_gaps

    from deltaserve.kernels.fp8 import Fp8Weight
    from deltaserve.model.batch import PrefillChunk, PromptChunks, StepBatch, TokenRows
    from deltaserve.model.forward import Qwen35Shard
    from deltaserve.model.sharding import LocalSizes
    from deltaserve.model.state import ModelState
    from deltaserve.model.weights import random_rank_weights

    cfg = ModelConfig.from_dict({**text_config(size, 248320, layers=4), "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}})
    local, dev = LocalSizes.of(cfg, 1), "cuda"
    kept = random_rank_weights(cfg, device=dev, dtype=torch.bfloat16, seed=2, progress=False, fp8_block=128)
    _trained_like(kept, cfg, torch.Generator(device=dev).manual_seed(3))
    assert isinstance(kept["layers.0.mlp.up_proj.weight"], Fp8Weight)
    full = {n: w.dequantise() if isinstance(w, Fp8Weight) else w.float().clone() for n, w in kept.items()}
    ids = torch.randint(0, 248320, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    pages = list(range(14))
    in_bf16 = {n: w.to(torch.bfloat16) for n, w in full.items()}  # the dequantised model in bf16
    reference = Qwen35Shard(cfg, full, local)  # the torch references in fp32 (it folds norms into `full`)

    def gaps(config: KernelConfig, weights=kept) -> torch.Tensor:
        models = [Qwen35Shard(cfg, weights, local, ops=triton_ops(config)), reference]
        states = [ModelState(cfg, local, 2, 16, dtype, dev) for dtype in (torch.bfloat16, torch.float32)]
        logits = [m.logits(m.forward(s, StepBatch.of(chunks=PromptChunks.build([PrefillChunk(ids, 0, 0, pages)], 16,
                                                                                  s.trash_page, dev))))
                  for m, s in zip(models, states)]
        found = [top8_logprob_gaps(*logits)]
        for t, token in enumerate((11, 12, 13)):
            pos = len(ids) + t
            logits = [m.logits(m.forward(s, StepBatch.of(TokenRows.build([[token]], [pos], [0], [pages], 16,
                                                                          s.trash_page, dev))))
                      for m, s in zip(models, states)]
            found.append(top8_logprob_gaps(*logits))
        return torch.cat(found)

    d = gaps(DEFAULT)
    w8a8 = gaps(KernelConfig(fp8_prefill="cublas"))
    bf16 = gaps(DEFAULT, in_bf16)
    logging.getLogger(__name__).info(
        "FP8 %s: top-8 |Δ log-prob| mean %.4f, p99 %.4f; the dequantised weights in bf16 %.4f, %.4f; opt-in W8A8 "
        "prefill %.4f, %.4f", size, d.mean(), d.quantile(0.99), bf16.mean(), bf16.quantile(0.99), w8a8.mean(),
        w8a8.quantile(0.99))
    # Within the gate, or (where these scales leave bf16 itself outside it) no worse than the bf16 model's error.
    assert d.mean() <= max(0.06, 1.1 * bf16.mean()) and d.quantile(0.99) <= max(0.2, 1.1 * bf16.quantile(0.99))


@pytest.mark.parametrize("fp8_block", [0, 128])
def test_random_weights_strand_no_cached_memory(fp8_block):
    """Random weights at the 4B width, bf16 and FP8: once torch returns its cache, it keeps beyond them no more than
    its allocator's rounding and 0.5% of the weights' bytes. Temporaries made in the shared cache left kept tensors
    in their segments: 2% of the weights at 4B, and 8 GiB of a 27B server's memory once its projections were fused."""
    from deltaserve.kernels.fp8 import Fp8Weight
    from deltaserve.model.weights import random_rank_weights, weight_bytes

    def cached_beyond_allocated() -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved() - torch.cuda.memory_allocated()

    def rounding(weights) -> int:
        """What torch's allocator itself adds: a tensor over 10 MiB gets a segment of whole 2 MiB (FP8 values are
        rarely such multiples: 146 MiB at 4B), smaller ones share 20 MiB segments (one may be part-empty)."""
        tensors = [p for t in weights.values() for p in ((t.values, t.scale) if isinstance(t, Fp8Weight) else (t,))]
        sizes = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values()
        return sum(-n % (2 << 20) for n in sizes if n > 10 << 20) + (20 << 20)

    before = cached_beyond_allocated()
    cfg = ModelConfig.from_dict(text_config("4b", 248320))
    weights = random_rank_weights(cfg, device="cuda", dtype=torch.bfloat16, progress=False, fp8_block=fp8_block)
    stranded, held = cached_beyond_allocated() - before, weight_bytes(weights)
    allowed = rounding(weights) + 0.005 * held
    del weights
    assert stranded <= allowed, f"{stranded / 2**20:.0f} MiB cached beside {held / 2**20:.0f} MiB of weights"


def test_random_weights_load_when_torch_caches_the_card():
    """An engine closed earlier in the process leaves its memory in torch's shared cache, which the random weights'
    scratch pool cannot take: the load hands it back to the driver first (else every engine after the first in a
    process ran out of memory)."""
    from deltaserve.model.weights import random_rank_weights

    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (2 << 30), dtype=torch.uint8, device="cuda")
    del hog  # cached by torch, not free in the driver's count
    assert torch.cuda.mem_get_info()[0] < 3 << 30
    cfg = ModelConfig.from_dict(text_config("4b", 248320))
    weights = random_rank_weights(cfg, device="cuda", dtype=torch.bfloat16, progress=False)
    assert weights["lm_head.weight"].is_cuda
    del weights
    torch.cuda.empty_cache()


@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_moe_experts_at_the_35b_a3b_shapes(tokens):
    """The grouped expert GEMMs against the reference in bf16 at the 35B-A3B's widths: a decode step's few experts,
    a batch's many, a prefill's all."""
    from deltaserve.kernels import moe

    cfg = ModelConfig.from_dict(text_config("35b-a3b", 248320))
    E, k, H, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, H, device="cuda", generator=gen).bfloat16()
    router = (torch.randn(E, H, device="cuda", generator=gen) / H**0.5).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).bfloat16()
    weights, ids = moe.route(x, router, k)
    want_w, want_ids = moe.route_reference(x, router, k)
    # The kernel's fp32 softmax sums in another order: a near tie may swap, a weight move by a bf16 rounding.
    assert (ids == want_ids).all(1).float().mean() >= 0.99
    assert torch.allclose(weights.float(), want_w.float(), atol=1e-2)
    got = moe.experts(x, weights, ids, gate_up, down)
    assert rel(got, moe.experts_reference(x.float(), weights.float(), ids, gate_up.float(), down.float())) <= BF16_TOL
    # FP8 experts (W8A16: each tile widened in registers, its block's scale on the partial sums)
    from deltaserve.kernels.fp8 import Fp8Weight
    from deltaserve.model.weights import quantise_fp8

    def fp8(t):
        return Fp8Weight.stack([Fp8Weight(*quantise_fp8(e, 128), 128) for e in t])

    gate_up, down = fp8(gate_up), fp8(down)
    got = moe.experts(x, weights, ids, gate_up, down)
    assert rel(got, moe.experts_reference(x.float(), weights.float(), ids, gate_up, down)) <= BF16_TOL


def test_an_moe_checkpoint_s_graphed_steps_equal_its_eager_ones(tmp_path):
    """Random MoE weights at a small width: decode graphs (and the fused mixed steps) hold the routing and the
    grouped expert kernels, whose tokens equal the eager engine's."""
    ckpt = write_checkpoint(str(tmp_path / "moe"), "tiny-moe", weights=False)
    eager, _ = asyncio.run(_greedy_run(ckpt, graph=False, n=12, tokens=48))
    graphs, buckets = asyncio.run(_greedy_run(ckpt, graph=True, n=12, tokens=48, prefill_graphs=False))
    assert eager == graphs and len({tuple(t) for t in eager}) > 1


def test_moe_at_the_35b_a3b_width_matches_hf(tmp_path):
    """A 4-layer 35B-A3B-width MoE saved by transformers in bf16: our Triton forward's logits (bf16) against
    transformers' in fp32 on the same weights, under the bf16 gate."""
    import json

    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from deltaserve.kernels.ops import triton_ops
    from deltaserve.model.synthetic import train_tokenizer
    from deltaserve.model.weights import random_tensor

    from helpers import CpuRunner, top8_logprob_gaps

    text = text_config("35b-a3b", 248320, layers=4)
    for drop in ("model_type", "mtp_num_hidden_layers"):
        text.pop(drop)
    config = Qwen3_5MoeTextConfig(**text)
    config._attn_implementation = "eager"
    with torch.device("cuda"):
        hf = Qwen3_5MoeForCausalLM(config).eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(random_tensor(name.removeprefix("model."), tuple(p.shape), 4, gen).bfloat16())
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path))
    train_tokenizer().save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|im_end|>"}, f)
    prompt = [(37 * i) % 248000 for i in range(300)]
    with torch.no_grad():
        want = hf.float()(torch.tensor([prompt], device="cuda")).logits[0]
    del hf
    torch.cuda.empty_cache()
    ours = CpuRunner(str(tmp_path), dtype=torch.bfloat16, device="cuda", ops=triton_ops()).prefill(
        {0: prompt}, all_logits=True)
    gaps = top8_logprob_gaps(ours, want)
    logging.getLogger("test_gpu").info("35B-A3B width vs HF: top-8 |Δ log-prob| mean %.4f, p99 %.4f",
                                       gaps.mean(), gaps.quantile(0.99))
    assert gaps.mean() <= 0.06 and gaps.quantile(0.99) <= 0.2


def test_prompt_logprobs_on_a_graphed_engine_are_the_eager_forward_s(real_geometry_ckpt):
    """With prefill graphs captured, a scored prompt's chunks run eagerly and keep every position: its prompt
    log-probs equal the teacher-forced ones of the eager forward (same bf16 weights), chunked or not."""
    from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams

    prompt = [(31 * i) % 3000 + 7 for i in range(700)]

    async def main():
        args = EngineArgs(model=real_geometry_ckpt, device="cuda", max_batch=4, max_model_len=1024,
                          load_format="random", buckets=[1, 2, 4], prefill_graph_tokens=512,
                          prefill_token_budget=256)
        async with AsyncEngine(args) as engine:
            async for out in engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0,
                                                                    prompt_logprobs=0)):
                pass
            r = engine.replica.ranks[0]
            with r.backend.context(), torch.inference_mode():
                from deltaserve.model.batch import PrefillChunk, PromptChunks, StepBatch
                slot = r.runtime.state.num_slots - 1
                pages = list(range(r.runtime.state.num_pages - 44, r.runtime.state.num_pages))
                batch = StepBatch.of(chunks=PromptChunks.build([PrefillChunk(prompt, 0, slot, pages)],
                                                                r.runtime.state.page_size,
                                                                r.runtime.state.trash_page, "cuda"))
                logits = r.model.logits(r.model.forward(r.runtime.state, batch)).float()
            want = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
            return out.prompt_logprobs, want.cpu()

    got, want = asyncio.run(main())
    assert got[0] is None and len(got) == len(prompt)
    gaps = (torch.tensor([e.logprob for e in got[1:]]) - want).abs()
    logging.getLogger("test_gpu").info("prompt log-probs, chunked against one eager forward: |Δ| max %.2e", gaps.max())
    assert gaps.max() <= 0.05  # 256-token chunks against one 700-token forward: bf16 GEMMs of other shapes


def test_constrained_outputs_on_the_graphed_engine_are_valid_and_overlap_exact(real_geometry_ckpt):
    """On the GPU (decode graphs, pinned mask uploads, the Triton sampler), JSON-schema requests beside free ones:
    every ended output validates, and overlap scheduling and speculation change no token of any request (fp32: a
    speculative step's logits round apart from a plain one's in bf16)."""
    import json
    import os

    import jsonschema

    from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams
    from deltaserve.runtime.params import StructuredOutputs

    with open(os.path.join(os.path.dirname(__file__), "data", "json_schemas.json")) as f:
        schemas = json.load(f)

    async def run(**extra):
        args = EngineArgs(model=real_geometry_ckpt, device="cuda", max_batch=32, max_model_len=1024,
                          load_format="random", dtype="float32", prefill_graph_tokens=0,
                          buckets=[1, 2, 4, 8, 16, 32], **extra)
        async with AsyncEngine(args) as engine:
            streams = []
            for i, schema in enumerate(schemas):
                streams.append(engine.generate(f"JSON {i}:", SamplingParams(
                    max_tokens=256, temperature=1.0, seed=i, structured_outputs=StructuredOutputs(json=schema))))
                streams.append(engine.generate(f"Free {i}:", SamplingParams(max_tokens=64, temperature=1.0,
                                                                          seed=100 + i)))
            outs = [await _last(s) for s in streams]
            return [(o.text, list(o.token_ids), o.finish_reason) for o in outs]

    plain = asyncio.run(run(async_scheduling=False))
    assert asyncio.run(run()) == plain
    assert asyncio.run(run(speculative_tokens=2)) == plain
    ended = 0
    for (text, _, reason), schema in zip(plain[::2], schemas):
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            ended += 1
    logging.getLogger("test_gpu").info("constrained on the GPU: %d of %d ended within 256 tokens", ended, len(schemas))
    assert ended
