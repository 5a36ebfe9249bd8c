"""Checkpoint layouts, config parsing and the errors that name what is wrong."""

import json
import os

import pytest
import torch
from helpers import CpuRunner, rel_err, top8_logprob_gaps
from safetensors.torch import load_file, save_file

from deltaserve.model.config import ConfigError, ModelConfig, load_model_config
from deltaserve.model.weights import WeightError, load_rank_weights
from deltaserve.model.synthetic import write_checkpoint


@pytest.mark.parametrize(
    "layout,sharded,tied", [("wrapper", 1, False), ("wrapper", 3, True), ("plain", 1, True), ("plain", 4, False)]
)
def test_layouts_load_to_the_same_model(tmp_path, layout, sharded, tied):
    reference = write_checkpoint(str(tmp_path / "ref"), "tiny", tied=tied, seed=3)
    other = write_checkpoint(str(tmp_path / "other"), "tiny", layout=layout, sharded=sharded, tied=tied, seed=3)
    if sharded > 1:
        assert os.path.isfile(os.path.join(other, "model.safetensors.index.json"))
    cfg_a, cfg_b = load_model_config(reference), load_model_config(other)
    assert cfg_a == cfg_b
    a = load_rank_weights(reference, cfg_a, progress=False)
    b = load_rank_weights(other, cfg_b, progress=False)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert ("lm_head.weight" in load_file(os.path.join(reference, "model.safetensors"))) == (not tied)
    ids = list(range(3, 40))
    # Same weights; only BLAS blocking (tensor alignment) may differ.
    assert rel_err(CpuRunner(other).prefill({0: ids}), CpuRunner(reference).prefill({0: ids})) <= 1e-6


@pytest.mark.parametrize("layout", ["wrapper", "plain"])
def test_the_mtp_head_loads_from_both_layouts_and_shards_like_an_attention_layer(tmp_path, layout):
    ckpt = write_checkpoint(str(tmp_path / layout), "tiny-tp", layout=layout, seed=5)
    stored = load_file(os.path.join(ckpt, "model.safetensors"))
    assert "mtp.fc.weight" in stored and "mtp.layers.0.self_attn.q_proj.weight" in stored  # at the top level
    cfg = load_model_config(ckpt)
    assert cfg.mtp_num_hidden_layers == 1
    plain = load_rank_weights(ckpt, cfg, progress=False)
    assert not any(n.startswith("mtp.") for n in plain)  # only speculative decoding reads the head
    full = load_rank_weights(ckpt, cfg, progress=False, mtp=True)
    head = {n: t for n, t in full.items() if n.startswith("mtp.")}
    assert len(head) == 15
    assert torch.equal(head["mtp.fc.weight"], stored["mtp.fc.weight"])
    halves = [load_rank_weights(ckpt, cfg, rank=r, tp=2, progress=False, mtp=True) for r in range(2)]
    for name in ("mtp.layers.0.self_attn.k_proj.weight", "mtp.layers.0.mlp.gate_proj.weight"):
        assert torch.equal(torch.cat([h[name] for h in halves]), head[name]), name
    for name in ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
        assert torch.equal(torch.cat([h[name] for h in halves], dim=1), head[name]), name
    for name in ("mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight"):  # replicated
        assert all(torch.equal(h[name], head[name]) for h in halves), name


def test_a_checkpoint_without_the_mtp_head_is_refused_for_speculation(tmp_path):
    ckpt = write_checkpoint(str(tmp_path / "no-mtp"), "tiny", mtp=False)
    cfg = load_model_config(ckpt)
    load_rank_weights(ckpt, cfg, progress=False)  # serves without speculation
    with pytest.raises(WeightError,
                       match="no complete MTP head .*mtp.pre_fc_norm_embedding.weight.*--speculative-tokens 0"):
        load_rank_weights(ckpt, cfg, progress=False, mtp=True)


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


@pytest.mark.parametrize("quant, words", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
    ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
    ({"quant_method": "modelopt_fp4"}, "quant_method 'modelopt_fp4'"),
    ({**FP8, "weight_block_size": [64, 64]}, "weight_block_size \\[64, 64\\]"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({**FP8, "fmt": "e5m2"}, "fmt 'e5m2'")])
@pytest.mark.parametrize("where", ["top", "text"])
def test_a_quantisation_other_than_block_fp8_is_refused_by_name(tiny_ckpt, quant, words, where):
    raw = json.load(open(os.path.join(tiny_ckpt, "config.json")))
    (raw if where == "top" else raw["text_config"])["quantization_config"] = quant
    with pytest.raises(ConfigError, match=words + ".* not supported"):
        ModelConfig.from_dict(raw)
    (raw if where == "top" else raw["text_config"])["quantization_config"] = FP8
    assert ModelConfig.from_dict(raw).fp8_block == 128


def _dequantised(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The FP8 format's definition, block by block."""
    out = q.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= scale[i, j]
    return out


@pytest.mark.parametrize("layout", ["wrapper", "plain"])
def test_an_fp8_checkpoint_loads_dequantised_and_shards_by_whole_blocks(tmp_path, layout):
    ckpt = write_checkpoint(str(tmp_path / "fp8"), "tiny-fp8", seed=4, fp8=True, layout=layout)
    stored = load_file(os.path.join(ckpt, "model.safetensors"))
    prefix = "model.language_model." if layout == "wrapper" else "model."
    up = prefix + "layers.0.mlp.up_proj.weight"
    assert stored[up].dtype == torch.float8_e4m3fn and stored[up + "_scale_inv"].shape == (2, 1)
    assert stored[prefix + "layers.0.linear_attn.in_proj_a.weight"].dtype == torch.float32  # kept as stored
    cfg = load_model_config(ckpt)
    full = load_rank_weights(ckpt, cfg, progress=False, mtp=True)
    for name in ("layers.0.mlp.up_proj.weight", "layers.0.linear_attn.in_proj_qkv.weight",
                 "layers.3.self_attn.o_proj.weight", "mtp.layers.0.self_attn.q_proj.weight"):
        key = name if name.startswith("mtp.") else prefix + name
        assert torch.equal(full[name], _dequantised(stored[key], stored[key + "_scale_inv"])), name
    halves = [load_rank_weights(ckpt, cfg, rank=r, tp=2, progress=False) for r in range(2)]
    for name in ("layers.0.mlp.gate_proj.weight", "layers.3.self_attn.k_proj.weight"):
        assert torch.equal(torch.cat([h[name] for h in halves]), full[name]), name
    for name in ("layers.0.mlp.down_proj.weight", "layers.0.linear_attn.out_proj.weight"):
        assert torch.equal(torch.cat([h[name] for h in halves], dim=1), full[name]), name


@pytest.mark.parametrize("keep_fp8", [False, True])
def test_every_fp8_weight_with_a_2x2_scale_grid_loads_as_the_format_defines(tmp_path, keep_fp8):
    """Each stored FP8 projection whose scale grid is at least 2 x 2, loaded (dequantised as read, or kept in FP8
    and dequantised by its own method) at tp 1 and sharded at tp 2, equals the format's definition applied block
    by block to the stored values and scales."""
    ckpt = write_checkpoint(str(tmp_path / "fp8"), "tiny-fp8-grid", seed=5, fp8=True, layout="plain")
    stored = load_file(os.path.join(ckpt, "model.safetensors"))
    cfg = load_model_config(ckpt)

    def values(t):
        return t.dequantise() if keep_fp8 else t

    full = load_rank_weights(ckpt, cfg, progress=False, mtp=True, keep_fp8=keep_fp8)
    grids = {key[: -len("_scale_inv")]: s for key, s in stored.items() if key.endswith("_scale_inv")}
    assert sum(min(s.shape) >= 2 for s in grids.values()) >= 8
    for key, scale in grids.items():
        name = key if key.startswith("mtp.") else key[len("model."):]
        assert torch.equal(values(full[name]), _dequantised(stored[key], scale)), name
    halves = [load_rank_weights(ckpt, cfg, rank=r, tp=2, progress=False, keep_fp8=keep_fp8) for r in range(2)]
    for name, dim in (("layers.0.mlp.up_proj.weight", 0), ("layers.3.self_attn.o_proj.weight", 1),
                      ("layers.0.linear_attn.out_proj.weight", 1)):
        key = "model." + name
        assert grids[key].shape[0] >= 2 and grids[key].shape[1] >= 2
        assert torch.equal(torch.cat([values(h[name]) for h in halves], dim=dim),
                           _dequantised(stored[key], grids[key])), name


def test_an_fp8_shard_that_cuts_a_block_is_refused(tmp_path):
    ckpt = write_checkpoint(str(tmp_path / "fp8"), "tiny-tp", fp8=True)
    with pytest.raises(WeightError, match="tp=2 cuts a 128-wide FP8 block of tensor"):
        load_rank_weights(ckpt, load_model_config(ckpt), rank=0, tp=2, progress=False)


def test_fp8_decode_and_prefill_in_bf16_pass_the_accuracy_gate(tmp_path):
    """bf16 activations on the FP8 checkpoint against the same weights dequantised in fp32: top-8 log-probs."""
    ckpt = write_checkpoint(str(tmp_path / "fp8"), "tiny-fp8", seed=6, fp8=True)
    ids = list(range(3, 60))
    ours, ref = CpuRunner(ckpt, dtype=torch.bfloat16), CpuRunner(ckpt)
    gaps = [top8_logprob_gaps(ours.prefill({0: ids}, all_logits=True), ref.prefill({0: ids}, all_logits=True))]
    for t, token in enumerate((7, 8, 9, 10)):
        pos = {0: len(ids) + t}
        gaps.append(top8_logprob_gaps(ours.decode({0: token}, pos), ref.decode({0: token}, pos)))
    d = torch.cat(gaps)
    assert d.mean() <= 0.06 and d.quantile(0.99) <= 0.2, (d.mean(), d.quantile(0.99))


def test_fp8_weights_kept_in_fp8_are_the_stored_values_and_scales_sharded_by_blocks(tmp_path):
    from deltaserve.kernels.fp8 import Fp8Weight

    ckpt = write_checkpoint(str(tmp_path / "fp8"), "tiny-fp8", seed=4, fp8=True)
    cfg = load_model_config(ckpt)
    dequantised = load_rank_weights(ckpt, cfg, progress=False, mtp=True)
    kept = load_rank_weights(ckpt, cfg, progress=False, mtp=True, keep_fp8=True)
    fp8 = [name for name, t in kept.items() if isinstance(t, Fp8Weight)]
    assert "layers.0.mlp.up_proj.weight" in fp8 and "mtp.layers.0.mlp.down_proj.weight" in fp8
    assert not isinstance(kept["layers.0.linear_attn.in_proj_a.weight"], Fp8Weight)
    for name in fp8:
        assert torch.equal(kept[name].dequantise(), dequantised[name]), name
    halves = [load_rank_weights(ckpt, cfg, rank=r, tp=2, progress=False, keep_fp8=True) for r in range(2)]
    for name, dim in (("layers.0.mlp.gate_proj.weight", 0), ("layers.0.mlp.down_proj.weight", 1)):
        assert torch.equal(torch.cat([h[name].dequantise() for h in halves], dim=dim), dequantised[name]), name


@pytest.mark.parametrize("ops,dtype", [("reference", torch.bfloat16), ("triton", torch.float32)])
def test_the_fp8_kernels_pass_the_accuracy_gate(tmp_path, ops, dtype):
    """Weights kept in FP8 on the FP8 projection, against the same weights dequantised in fp32: top-8 log-probs
    in prefill and decode. bf16 activations on the torch ops; the Triton ops interpreted in fp32 (the interpreter
    cannot run the bf16 GDN prefill; `test_kernels` checks the FP8 kernel in bf16)."""
    from deltaserve.kernels.ops import triton_ops

    ckpt = write_checkpoint(str(tmp_path / "fp8"), "tiny-fp8", seed=6, fp8=True)
    ids = list(range(3, 40))
    ours = CpuRunner(ckpt, dtype=dtype, keep_fp8=True, ops=triton_ops() if ops == "triton" else None)
    ref = CpuRunner(ckpt)
    gaps = [top8_logprob_gaps(ours.prefill({0: ids}, all_logits=True), ref.prefill({0: ids}, all_logits=True))]
    for t, token in enumerate((7, 8, 9)):
        pos = {0: len(ids) + t}
        gaps.append(top8_logprob_gaps(ours.decode({0: token}, pos), ref.decode({0: token}, pos)))
    d = torch.cat(gaps)
    assert d.mean() <= 0.06 and d.quantile(0.99) <= 0.2, (d.mean(), d.quantile(0.99))


def test_fp8_kernels_in_the_engine_at_tp2_give_the_dequantised_outputs(tmp_path):
    """fp32 activations: the FP8 weights kept (sharded with their scales over two ranks, the norms not folded
    into them) compute what the same weights dequantised as read do."""
    import asyncio

    from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams

    ckpt = write_checkpoint(str(tmp_path / "fp8"), "tiny-fp8", seed=3, fp8=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)

    async def serve(fp8_kernels):
        args = EngineArgs(model=ckpt, tp=2, max_model_len=128, max_batch=2, cpu_memory_bytes=32 << 20,
                          fp8_kernels=fp8_kernels)
        async with AsyncEngine(args) as engine:
            outs = [await _last(engine.generate(list(range(5, 5 + n)), params)) for n in (3, 21)]
            held = engine.replica.ranks[0].runtime.model.w
        return outs, held

    kept, held = asyncio.run(serve(True))
    dequantised, _ = asyncio.run(serve(False))
    from deltaserve.kernels.fp8 import Fp8Weight
    assert isinstance(held["layers.0.mlp.gate_up_proj.weight"], Fp8Weight)
    for a, b in zip(kept, dequantised):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


async def _last(stream):
    out = None
    async for out in stream:
        pass
    return out


def test_fp8_tensors_without_a_quantization_config_are_refused(tiny_ckpt, tmp_path):
    edited = _with_tensor(tiny_ckpt, tmp_path, lambda t: t.update(
        {"model.language_model.layers.0.mlp.up_proj.weight":
         t["model.language_model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)}))
    with pytest.raises(WeightError, match="layers.0.mlp.up_proj.weight' is stored as F8_E4M3"):
        load_rank_weights(edited, load_model_config(edited), progress=False)


def test_config_fields_are_parsed(tiny_ckpt):
    cfg = load_model_config(tiny_ckpt)
    assert cfg.layer_types[3] == "full_attention" and cfg.layer_types[0] == "linear_attention"
    assert cfg.rope_theta == 1e7 and cfg.rotary_dim == cfg.head_dim // 4
    gen = json.load(open(os.path.join(tiny_ckpt, "generation_config.json")))
    assert cfg.generation.eos_token_ids == tuple(gen["eos_token_id"])
    assert cfg.generation.temperature == gen["temperature"] and cfg.generation.top_k == gen["top_k"]


def test_full_attention_interval_is_used_without_layer_types(tiny_ckpt):
    raw = json.load(open(os.path.join(tiny_ckpt, "config.json")))
    text = dict(raw["text_config"])
    del text["layer_types"]
    text["full_attention_interval"] = 2
    cfg = ModelConfig.from_dict(text)
    assert cfg.attention_layers == (1, 3, 5, 7)


def _with_tensor(ckpt, tmp_path, edit):
    out = tmp_path / "edited"
    os.makedirs(out)
    for f in os.listdir(ckpt):
        if f != "model.safetensors":
            os.symlink(os.path.join(ckpt, f), out / f)
    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


def test_missing_tensor_is_named(tiny_ckpt, tmp_path):
    name = "model.language_model.layers.2.linear_attn.A_log"
    bad = _with_tensor(tiny_ckpt, tmp_path, lambda t: t.pop(name))
    with pytest.raises(WeightError, match="layers.2.linear_attn.A_log"):
        load_rank_weights(bad, load_model_config(bad), progress=False)


def test_misshaped_tensor_is_named(tiny_ckpt, tmp_path):
    name = "model.language_model.layers.3.self_attn.k_proj.weight"

    def edit(t):
        t[name] = t[name][:-1]

    bad = _with_tensor(tiny_ckpt, tmp_path, edit)
    with pytest.raises(WeightError, match=r"layers.3.self_attn.k_proj.weight.*shape"):
        load_rank_weights(bad, load_model_config(bad), progress=False)


def test_untied_checkpoint_without_lm_head_is_refused(tiny_ckpt, tmp_path):
    bad = _with_tensor(tiny_ckpt, tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(WeightError, match="lm_head.weight"):
        load_rank_weights(bad, load_model_config(bad), progress=False)


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda c: c.update(model_type="llama"), "model_type"),
        (lambda c: c["text_config"].pop("hidden_size"), "hidden_size"),
        (lambda c: c["text_config"].update(num_key_value_heads=3), "num_key_value_heads"),
        (lambda c: c["text_config"].update(linear_num_value_heads=3), "linear_num_value_heads"),
        (lambda c: c["text_config"].update(layer_types=["linear_attention"] * 3), "layer_types"),
        (lambda c: c["text_config"].update(head_dim=-4), "head_dim"),
        (lambda c: c["text_config"]["layer_types"].__setitem__(0, "sliding"), "layer_types"),
        (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type"),
        (lambda c: c["text_config"]["rope_parameters"].update(partial_rotary_factor=1.5), "partial_rotary_factor"),
        (lambda c: c.pop("text_config"), "text_config"),
    ],
)
def test_bad_config_is_refused_naming_the_field(tiny_ckpt, edit, field):
    raw = json.load(open(os.path.join(tiny_ckpt, "config.json")))
    edit(raw)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("tp,field", [(3, "num_attention_heads"), (8, "num_attention_heads"), (0, "tp")])
def test_tp_that_does_not_divide_is_refused(tiny_tp_ckpt, tp, field):
    cfg = load_model_config(tiny_tp_ckpt)
    with pytest.raises(ConfigError, match=field):
        cfg.check_tp(tp)


def test_published_geometries_parse():
    from deltaserve.model.synthetic import SIZES, text_config

    for size in ("0.8b", "4b", "9b", "27b"):
        cfg = ModelConfig.from_dict(text_config(size, 248320))
        assert cfg.vocab_size == 248320 and cfg.rotary_dim == 64 and len(cfg.attention_layers) * 4 == len(cfg.layer_types)
        assert cfg.linear_num_value_heads == SIZES[size]["linear_num_value_heads"]
