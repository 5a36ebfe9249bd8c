"""Qwen3.5 MoE on the CPU: checkpoints saved by transformers itself (its per-expert layout, and the fused 3-D one some
converters write) against transformers' `Qwen3_5MoeForCausalLM`, tensor parallelism, the engine end to end, and
our own MoE checkpoints (MTP head, FP8)."""

import asyncio
import json
import math
import os

import pytest
import torch
from helpers import CpuRunner, rel_err, top8_logprob_gaps
from safetensors.torch import load_file, save_file
from test_tensor_parallel import TpRunners

from deltaserve.kernels import moe
from deltaserve.model.config import ConfigError, ModelConfig, load_model_config
from deltaserve.model.synthetic import SIZES, text_config, train_tokenizer, write_checkpoint
from deltaserve.model.weights import WeightError, random_tensor
from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams

LENGTHS = [1, 6, 33, 70]


def _hf_config():
    from transformers import Qwen3_5MoeTextConfig

    text = text_config("tiny-moe", 512)
    for drop in ("model_type", "mtp_num_hidden_layers"):
        text.pop(drop)
    return Qwen3_5MoeTextConfig(**text)


def _randomise(model) -> None:
    """Every parameter random and well conditioned (transformers' init leaves the norms at zero, the router's
    weights small): our random checkpoints' init, by the parameter's name."""
    gen = torch.Generator().manual_seed(5)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(random_tensor(name.removeprefix("model."), tuple(p.shape), layers, gen))


@pytest.fixture(scope="module")
def hf():
    from transformers import Qwen3_5MoeForCausalLM

    config = _hf_config()
    config._attn_implementation = "eager"
    model = Qwen3_5MoeForCausalLM(config).float().eval()
    _randomise(model)
    return model


def _add_tokenizer(folder: str) -> None:
    train_tokenizer().save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}, f)


@pytest.fixture(scope="module")
def hf_ckpt(hf, tmp_path_factory):
    """transformers' own save: a tensor per expert and projection."""
    folder = str(tmp_path_factory.mktemp("hf_moe"))
    hf.save_pretrained(folder)
    _add_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def fused_ckpt(hf_ckpt, tmp_path_factory):
    """The same weights with each layer's experts as two 3-D tensors ([E, 2I, H] gate then up rows, [E, H, I])."""
    folder = str(tmp_path_factory.mktemp("hf_moe_fused"))
    tensors = load_file(os.path.join(hf_ckpt, "model.safetensors"))
    E = _hf_config().num_experts
    fused = {}
    for name, t in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = t
        elif name.endswith(".0.down_proj.weight"):
            base = name[: -len(".0.down_proj.weight")]
            fused[base + ".gate_up_proj"] = torch.stack([
                torch.cat([tensors[f"{base}.{e}.gate_proj.weight"], tensors[f"{base}.{e}.up_proj.weight"]])
                for e in range(E)])
            fused[base + ".down_proj"] = torch.stack([tensors[f"{base}.{e}.down_proj.weight"] for e in range(E)])
    save_file(fused, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        with open(os.path.join(hf_ckpt, name)) as src, open(os.path.join(folder, name), "w") as dst:
            dst.write(src.read())
    _add_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(99)
    return {n: torch.randint(0, 500, (n,), generator=gen).tolist() for n in LENGTHS}


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_both_moe_model_types_parse_and_dense_only_fields_are_refused():
    text = text_config("tiny-moe", 512)
    cfg = ModelConfig.from_dict(text)
    assert cfg.is_moe and cfg.num_experts == 8 and cfg.num_experts_per_tok == 3 and cfg.intermediate_size == 0
    wrapped = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": text})
    assert wrapped == cfg
    with pytest.raises(ConfigError, match="text_config.model_type"):
        ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": text})
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        ModelConfig.from_dict({**text, "mlp_only_layers": [0]})
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_dict({**text, "num_experts_per_tok": 9})
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        ModelConfig.from_dict({k: v for k, v in text.items() if k != "moe_intermediate_size"})
    with pytest.raises(ConfigError, match="tp=3 does not divide"):
        cfg.check_tp(3)


def test_routing_takes_the_top_k_of_an_fp32_softmax_renormalised():
    gen = torch.Generator().manual_seed(0)
    x, router = torch.randn(5, 16, generator=gen), torch.randn(6, 16, generator=gen)
    router[3] = router[1]  # a tie: topk's choice is kept
    weights, ids = moe.route_reference(x.bfloat16(), router.bfloat16(), 2)
    probs = torch.softmax((x.bfloat16() @ router.bfloat16().t()).float(), -1)
    top, want = torch.topk(probs, 2)
    assert torch.equal(ids, want) and weights.dtype == torch.bfloat16
    assert torch.allclose(weights.float(), (top / top.sum(-1, keepdim=True)).bfloat16().float())


@pytest.mark.parametrize("layout", ["split", "fused"])
@pytest.mark.parametrize("n", LENGTHS)
def test_prefill_logits_match_hf(hf, hf_ckpt, fused_ckpt, prompts, layout, n):
    runner = CpuRunner(hf_ckpt if layout == "split" else fused_ckpt)
    assert rel_err(runner.prefill({0: prompts[n]}, all_logits=True), _hf_logits(hf, prompts[n])) <= 1e-4


def test_packed_prompts_and_chunks_match_hf(hf, hf_ckpt, prompts):
    runner = CpuRunner(hf_ckpt)
    ours = runner.prefill({slot: prompts[n] for slot, n in enumerate(LENGTHS)}, all_logits=True)
    offset = 0
    for n in LENGTHS:
        assert rel_err(ours[offset : offset + n], _hf_logits(hf, prompts[n])) <= 1e-4, n
        offset += n
    chunked = CpuRunner(hf_ckpt)
    prompt = prompts[70]
    chunked.prefill({0: prompt[:20]})
    last = chunked.prefill({0: prompt[20:]}, starts={0: 20}, all_logits=True)
    assert rel_err(last, _hf_logits(hf, prompt)[20:]) <= 1e-4


def test_greedy_decoding_matches_hf_generate(hf, hf_ckpt, prompts):
    for n in (1, 33):
        prompt = prompts[n]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        runner = CpuRunner(hf_ckpt)
        out = [int(runner.prefill({0: prompt})[0].argmax())]
        for i in range(15):
            out.append(int(runner.decode({0: out[-1]}, {0: n + i})[0].argmax()))
        assert out == ref[0, n:].tolist(), n


def test_a_missing_expert_is_named(hf_ckpt, tmp_path):
    tensors = load_file(os.path.join(hf_ckpt, "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(os.path.join(hf_ckpt, "config.json")) as src:
        (tmp_path / "config.json").write_text(src.read())
    with pytest.raises(WeightError, match="layers.2.mlp.experts.5.up_proj.weight"):
        CpuRunner(str(tmp_path))


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_tp1(hf_ckpt, fused_ckpt, prompts, tp):
    """Each expert's and the shared expert's intermediate dimension sharded, router and shared gate whole, one
    all-reduce after the block: prefill and decode logits as one rank computes them, from either layout."""
    single = CpuRunner(hf_ckpt)
    ref = single.prefill({0: prompts[70], 3: prompts[6]}, all_logits=True)
    for ckpt in (hf_ckpt, fused_ckpt):
        multi = TpRunners(ckpt, tp)
        assert multi.ranks[0].model.w["layers.0.mlp.experts.gate_up_proj"].shape[1] == 2 * 32 // tp
        got = multi.call("prefill", {0: prompts[70], 3: prompts[6]}, all_logits=True)[0]
        assert rel_err(got, ref) <= 1e-5
    tokens, positions = {0: int(ref[69].argmax()), 3: int(ref[-1].argmax())}, {0: 70, 3: 6}
    for _ in range(4):
        want = single.decode(tokens, positions)
        assert rel_err(multi.call("decode", tokens, positions)[0], want) <= 1e-5
        tokens = {s: int(want[i].argmax()) for i, s in enumerate(tokens)}
        positions = {s: p + 1 for s, p in positions.items()}


async def _collect(engine, prompt, params):
    async for out in engine.generate(prompt, params):
        pass
    return out


def _engine_outputs(ckpt, prompts, **kw):
    async def main():
        args = EngineArgs(model=ckpt, max_model_len=256, max_batch=4, cpu_memory_bytes=32 << 20, **kw)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
        async with AsyncEngine(args) as engine:
            return await asyncio.gather(*[_collect(engine, p, params) for p in prompts])
    return asyncio.run(main())


def test_the_engine_serves_hf_s_checkpoint_as_hf_generates(hf, hf_ckpt, prompts):
    """Through the engine (chunked prefill under a small budget, the prefix cache, continuous batching) at tp 1
    and 2: HF's greedy tokens."""
    chosen = [prompts[6], prompts[33], prompts[70]]
    want = []
    for p in chosen:
        with torch.no_grad():
            want.append(hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12,
                                    do_sample=False)[0, len(p):].tolist())
    for tp in (1, 2):
        outs = _engine_outputs(hf_ckpt, chosen, tp=tp, prefill_token_budget=32)
        assert [o.token_ids for o in outs] == want, tp


def test_speculative_decoding_with_the_moe_head_keeps_plain_outputs(tmp_path, prompts):
    """Our tiny MoE checkpoint ships an MTP head with an MoE layer, as the published ones do: speculating with it
    changes no token and no log-prob."""
    ckpt = write_checkpoint(str(tmp_path / "moe"), "tiny-moe")
    chosen = [prompts[6], prompts[33]]
    plain = _engine_outputs(ckpt, chosen)
    spec = _engine_outputs(ckpt, chosen, speculative_tokens=2)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4


def test_our_moe_checkpoints_store_the_published_layout_and_load_fp8(tmp_path, prompts):
    split = write_checkpoint(str(tmp_path / "split"), "tiny-moe")
    fused = write_checkpoint(str(tmp_path / "fused"), "tiny-moe", experts="fused")
    names = load_file(os.path.join(split, "model.safetensors")).keys()
    assert "model.language_model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in names
    assert not any(n.endswith("experts.gate_up_proj") for n in names)
    assert load_model_config(split).is_moe
    a = CpuRunner(split).prefill({0: prompts[33]}, all_logits=True)
    b = CpuRunner(fused).prefill({0: prompts[33]}, all_logits=True)
    assert torch.equal(a, b)
    fp8 = write_checkpoint(str(tmp_path / "fp8"), "tiny-moe", fp8=True)
    stored = load_file(os.path.join(fp8, "model.safetensors"))
    assert stored["model.language_model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.language_model.layers.0.mlp.gate.weight"].dtype == torch.float32
    # On its dequantised weights (the oracle), and with the FP8 kernels' references for its dense projections in
    # bf16 (the experts dequantised as read): the bf16 gate.
    dequantised = CpuRunner(fp8).prefill({0: prompts[33]}, all_logits=True)
    served = CpuRunner(fp8, dtype=torch.bfloat16, keep_fp8=True).prefill({0: prompts[33]}, all_logits=True)
    gaps = top8_logprob_gaps(served, dequantised)
    assert gaps.mean() <= 0.06 and gaps.quantile(0.99) <= 0.2


def test_real_moe_sizes_have_the_published_geometry():
    for size, params_b in (("35b-a3b", 35), ("122b-a10b", 122), ("397b-a17b", 397)):
        cfg = ModelConfig.from_dict(text_config(size, 248320))
        from deltaserve.model.weights import model_shapes

        total = sum(math.prod(s) for s in model_shapes(cfg, mtp=False).values())
        assert abs(total / 1e9 - params_b) / params_b < 0.1, (size, total / 1e9)
        assert cfg.num_experts == SIZES[size]["num_experts"]


@pytest.mark.parametrize("group", [moe.group_by_expert_reference, moe.group_by_expert])
def test_grouping_by_expert_pads_each_expert_and_keeps_every_pair_once(group):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]])
    row_pair, block_expert = group(ids, num_experts=6, block_m=4)
    # The most blocks any routing of 8 pairs fills: 8 / 4, plus one part-filled block for each of up to 6 experts
    # and for the pairs of none of them (another rank's, under expert parallelism).
    assert block_expert.numel() == 2 + 7 and row_pair.numel() == 9 * 4
    seen = row_pair[row_pair >= 0]
    assert sorted(seen.tolist()) == list(range(8))
    for b, e in enumerate(block_expert.tolist()):
        rows = row_pair[b * 4 : (b + 1) * 4]
        if e < 6:
            assert all(ids.flatten()[p] == e for p in rows[rows >= 0].tolist())
        else:
            assert (rows < 0).all()
    assert block_expert.tolist()[:4] == [0, 1, 3, 5]
    # Another rank's experts (ids outside the 6 held, shifted as expert parallelism shifts them) take no block of
    # an expert held, and every block past the last exits.
    row_pair, block_expert = group(ids - 3, num_experts=3, block_m=4)
    held = {p for b, e in enumerate(block_expert.tolist()) if e < 3 for p in row_pair[b * 4 : (b + 1) * 4].tolist()
            if p >= 0}
    assert held == {i for i, e in enumerate((ids - 3).flatten().tolist()) if 0 <= e < 3}


def test_the_routing_kernel_takes_what_the_reference_takes():
    gen = torch.Generator().manual_seed(8)
    x, router = torch.randn(40, 16, generator=gen), torch.randn(12, 16, generator=gen)
    for top_k in (1, 3, 8):
        weights, ids = moe.route(x, router, top_k)
        want_w, want_ids = moe.route_reference(x, router, top_k)
        assert torch.equal(ids, want_ids) and torch.allclose(weights, want_w, atol=1e-6)
    tied = torch.zeros(1, 16)  # every expert equally likely: the lower ids, each 1 / k
    weights, ids = moe.route(tied, router, 3)
    assert ids.tolist() == [[0, 1, 2]] and torch.allclose(weights, torch.full((1, 3), 1 / 3))


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 3), (5, 8, 3), (37, 6, 2)])
def test_triton_experts_match_the_reference(tokens, experts, top_k):
    """Interpreted on the CPU (fp32): one token (a decode step's few experts), and more tokens than a block."""
    from test_kernels import poisoned_outputs, rel

    gen = torch.Generator().manual_seed(tokens)
    H, I = 32, 48
    x = torch.randn(tokens, H, generator=gen)
    router = torch.randn(experts, H, generator=gen)
    gate_up, down = torch.randn(experts, 2 * I, H, generator=gen) / 6, torch.randn(experts, H, I, generator=gen) / 7
    weights, ids = moe.route_reference(x, router, top_k)
    with poisoned_outputs():
        got = moe.experts(x, weights, ids, gate_up, down)
        routed = moe.route(x, router, top_k)
    assert torch.equal(routed[1], ids) and torch.allclose(routed[0], weights)
    assert rel(got, moe.experts_reference(x, weights, ids, gate_up, down)) <= 1e-5


def test_triton_moe_block_matches_the_reference(hf_ckpt):
    from deltaserve.kernels.ops import triton_ops

    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 500, (9,), generator=gen).tolist()
    want = CpuRunner(hf_ckpt).prefill({0: prompt}, all_logits=True)
    got = CpuRunner(hf_ckpt, ops=triton_ops()).prefill({0: prompt}, all_logits=True)
    assert rel_err(got, want) <= 1e-4


def test_triton_fp8_experts_match_the_dequantised_reference():
    """Experts kept in FP8 (each expert's 128-blocks as the checkpoint stores them): each weight tile widened in
    registers, its partial sums scaled by its block's scale, against the reference on the same FP8 weights."""
    from test_kernels import poisoned_outputs, rel

    from deltaserve.kernels.config import KernelConfig
    from deltaserve.kernels.fp8 import Fp8Weight
    from deltaserve.model.weights import quantise_fp8

    gen = torch.Generator().manual_seed(11)
    E, H, I, top_k = 5, 160, 64, 2
    x = torch.randn(7, H, generator=gen)

    def fp8(t):
        return Fp8Weight.stack([Fp8Weight(*quantise_fp8(e, 128), 128) for e in t])

    gate_up, down = fp8(torch.randn(E, 2 * I, H, generator=gen) / 12), fp8(torch.randn(E, H, I, generator=gen) / 8)
    weights, ids = moe.route_reference(x, torch.randn(E, H, generator=gen), top_k)
    with poisoned_outputs():
        got = moe.experts(x, weights, ids, gate_up, down, KernelConfig(moe_tile=(16, 32, 32, 1, 1)))
    assert rel(got, moe.experts_reference(x, weights, ids, gate_up, down)) <= 1e-5
    with pytest.raises(ValueError, match="moe_tile"):
        moe.experts(x, weights, ids, gate_up, down, KernelConfig(moe_tile=(16, 48, 32, 1, 1)))


def test_fp8_experts_load_as_fp8_and_serve_within_the_gate(tmp_path):
    from deltaserve.kernels.fp8 import Fp8Weight
    from deltaserve.kernels.ops import triton_ops

    ckpt = write_checkpoint(str(tmp_path / "fp8"), "tiny-moe-fp8", fp8=True)
    prompt = list(range(3, 40, 2))
    oracle = CpuRunner(ckpt).prefill({0: prompt}, all_logits=True)  # on the dequantised weights, fp32
    kept = CpuRunner(ckpt, keep_fp8=True)
    experts = kept.model.w["layers.0.mlp.experts.gate_up_proj"]
    assert isinstance(experts, Fp8Weight) and experts.values.shape == (4, 256, 128)
    assert rel_err(kept.prefill({0: prompt}, all_logits=True), oracle) <= 1e-4
    # The Triton forward with the FP8 experts (interpreted in fp32: the interpreter's bf16 forward is not ours to
    # check, tests/test_gpu.py runs it), and the served precision (bf16 activations) under the gate.
    triton = CpuRunner(ckpt, keep_fp8=True, ops=triton_ops()).prefill({0: prompt}, all_logits=True)
    assert rel_err(triton, oracle) <= 1e-4
    served = CpuRunner(ckpt, dtype=torch.bfloat16, keep_fp8=True).prefill({0: prompt}, all_logits=True)
    gaps = top8_logprob_gaps(served, oracle)
    assert gaps.mean() <= 0.06 and gaps.quantile(0.99) <= 0.2


@pytest.mark.parametrize("tp", [2, 4])
def test_expert_parallelism_matches_one_rank(hf_ckpt, fused_ckpt, prompts, tp):
    """Each rank holds E / tp whole experts (from either layout) and sums only its own experts' pairs; one
    all-reduce after the block gives the logits one rank computes."""
    single = CpuRunner(hf_ckpt)
    ref = single.prefill({0: prompts[70], 3: prompts[6]}, all_logits=True)
    for ckpt in (hf_ckpt, fused_ckpt):
        multi = TpRunners(ckpt, tp, expert_parallel=True)
        held = multi.ranks[1].model.w["layers.0.mlp.experts.gate_up_proj"]
        assert held.shape == (8 // tp, 2 * 32, 64)  # whole experts, the second rank's
        whole = CpuRunner(hf_ckpt).model.w["layers.0.mlp.experts.gate_up_proj"]
        assert torch.equal(held, whole[8 // tp : 2 * 8 // tp])
        got = multi.call("prefill", {0: prompts[70], 3: prompts[6]}, all_logits=True)[0]
        assert rel_err(got, ref) <= 1e-5


def test_triton_experts_of_one_rank_s_share_add_up_to_all_of_them():
    """Under expert parallelism the kernels take the pairs of the experts held and leave the others' (ids outside
    the rank's range) at zero: the ranks' sums add up to one rank's."""
    gen = torch.Generator().manual_seed(4)
    E, H, I = 8, 32, 16
    x = torch.randn(9, H, generator=gen)
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen) / 6, torch.randn(E, H, I, generator=gen) / 4
    weights, ids = moe.route_reference(x, torch.randn(E, H, generator=gen), 3)
    whole = moe.experts_reference(x, weights, ids, gate_up, down)
    shares = [moe.experts(x, weights, ids - start, gate_up[start : start + 4], down[start : start + 4], others=True)
              for start in (0, 4)]
    assert rel_err(shares[0] + shares[1], whole) <= 1e-5
    assert rel_err(moe.experts_reference(x, weights, ids - 4, gate_up[4:], down[4:]), shares[1]) <= 1e-5


def test_the_engine_serves_with_expert_parallelism_and_refuses_it_for_a_dense_model(hf_ckpt, tiny_ckpt, prompts):
    chosen = [prompts[6], prompts[33]]
    plain = _engine_outputs(hf_ckpt, chosen)
    ep = _engine_outputs(hf_ckpt, chosen, tp=2, enable_expert_parallel=True)
    assert [o.token_ids for o in ep] == [o.token_ids for o in plain]
    with pytest.raises(ValueError, match="enable_expert_parallel needs a mixture-of-experts checkpoint"):
        _engine_outputs(tiny_ckpt, chosen, tp=2, enable_expert_parallel=True)
    six = ModelConfig.from_dict({**text_config("tiny-moe", 512), "num_experts": 6})
    six.check_tp(4)  # each expert's width splits four ways; six experts do not
    with pytest.raises(ConfigError, match="tp=4 does not divide num_experts=6"):
        six.check_tp(4, expert_parallel=True)
