"""Checkpoint reading: single-file or sharded safetensors, memory-mapped, one tensor (slice) at a time.

Each rank reads only its own slices (model/sharding.py) straight from the mapped file, casts them and moves them
to the target device, so host memory never holds more than one tensor.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from deltaserve.progress import progress as show_progress

from deltaserve.kernels.fp8 import Fp8Weight

from .config import ModelConfig
from .sharding import expert_range, shard_plan

log = logging.getLogger(__name__)

# Prefixes under which checkpoints store the text model; the first one that matches is stripped.
_TEXT_PREFIXES = ("model.language_model.", "model.")
# Tensors of other towers that the text runtime ignores. The multi-token-prediction head (`mtp.*`, at the top
# level in both layouts) is read only for speculative decoding.
_SKIPPED_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIX = "mtp."


class WeightError(ValueError):
    """A checkpoint whose tensors do not match its config; the message names the tensor."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every text-model tensor, by its canonical name (no prefix), with its full unsharded shape."""
    H = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, H), "norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    for i, kind in enumerate(cfg.layer_types):
        shapes.update(_decoder_layer_shapes(cfg, f"layers.{i}.", kind))
    return shapes


def _decoder_layer_shapes(cfg: ModelConfig, p: str, kind: str) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors under prefix p ("layers.i." or "mtp.layers.i.")."""
    H, D = cfg.hidden_size, cfg.head_dim
    shapes = {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    m = p + "mlp."
    if cfg.is_moe:
        E, I, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        shapes.update({m + "gate.weight": (E, H), m + "experts.gate_up_proj": (E, 2 * I, H),
                       m + "experts.down_proj": (E, H, I), m + "shared_expert.gate_proj.weight": (S, H),
                       m + "shared_expert.up_proj.weight": (S, H), m + "shared_expert.down_proj.weight": (H, S),
                       m + "shared_expert_gate.weight": (1, H)})
    else:
        shapes.update({m + "gate_proj.weight": (cfg.intermediate_size, H),
                       m + "up_proj.weight": (cfg.intermediate_size, H),
                       m + "down_proj.weight": (H, cfg.intermediate_size)})
    if kind == "full_attention":
        a = p + "self_attn."
        shapes[a + "q_proj.weight"] = (cfg.num_attention_heads * D * 2, H)
        shapes[a + "k_proj.weight"] = (cfg.num_key_value_heads * D, H)
        shapes[a + "v_proj.weight"] = (cfg.num_key_value_heads * D, H)
        shapes[a + "o_proj.weight"] = (H, cfg.num_attention_heads * D)
        shapes[a + "q_norm.weight"] = (D,)
        shapes[a + "k_norm.weight"] = (D,)
    else:
        g = p + "linear_attn."
        hv = cfg.linear_num_value_heads
        shapes[g + "in_proj_qkv.weight"] = (cfg.gdn_conv_dim, H)
        shapes[g + "in_proj_z.weight"] = (cfg.gdn_value_dim, H)
        shapes[g + "in_proj_b.weight"] = (hv, H)
        shapes[g + "in_proj_a.weight"] = (hv, H)
        shapes[g + "conv1d.weight"] = (cfg.gdn_conv_dim, 1, cfg.linear_conv_kernel_dim)
        shapes[g + "dt_bias"] = (hv,)
        shapes[g + "A_log"] = (hv,)
        shapes[g + "norm.weight"] = (cfg.linear_value_head_dim,)
        shapes[g + "out_proj.weight"] = (H, cfg.gdn_value_dim)
    return shapes


def mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The multi-token-prediction head's tensors: two input norms, fc over [embedding | hidden], one full-attention
    decoder layer, the final norm (the embedding and lm_head are the model's)."""
    H = cfg.hidden_size
    shapes = {"mtp.pre_fc_norm_embedding.weight": (H,), "mtp.pre_fc_norm_hidden.weight": (H,),
              "mtp.fc.weight": (H, 2 * H), "mtp.norm.weight": (H,)}
    shapes.update(_decoder_layer_shapes(cfg, "mtp.layers.0.", "full_attention"))
    return shapes


def canonical_name(stored: str) -> str | None:
    """The text-model name of a stored tensor, or None for tensors of other towers."""
    if stored.startswith(_SKIPPED_PREFIXES):
        return None
    for prefix in _TEXT_PREFIXES:
        if stored.startswith(prefix):
            return stored[len(prefix) :]
    return stored  # lm_head.weight, or a checkpoint saved without any prefix


def checkpoint_files(checkpoint_dir: str | os.PathLike) -> list[str]:
    """The safetensors files of a checkpoint: those its index names, or every *.safetensors file."""
    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightError(f"{index} has no 'weight_map' object")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(checkpoint_dir, name)):
                raise WeightError(f"{index} names {name}, which is missing from {checkpoint_dir}")
    else:
        files = sorted(f for f in os.listdir(checkpoint_dir) if f.endswith(".safetensors"))
    if not files:
        raise WeightError(f"no .safetensors files in {checkpoint_dir}")
    return [os.path.join(checkpoint_dir, f) for f in files]


def _locate(files: list[str]) -> dict[str, tuple[str, str]]:
    """canonical name -> (file, stored name) for every text tensor in the checkpoint."""
    found: dict[str, tuple[str, str]] = {}
    for path in files:
        try:
            f = safe_open(path, framework="pt")
        except Exception as exc:  # safetensors' own error type is not exported under one stable name
            raise WeightError(f"{path} is not a readable safetensors file: {exc}") from None
        with f:
            for stored in f.keys():
                name = canonical_name(stored)
                if name is None:
                    continue
                if name in found:
                    raise WeightError(f"tensor {name!r} is stored twice ({found[name][1]} and {stored})")
                found[name] = (path, stored)
    return found


def check_checkpoint(checkpoint_dir: str | os.PathLike) -> None:
    """Fail early, on the caller's thread, with the file named: every safetensors file readable, none stored twice."""
    _locate(checkpoint_files(checkpoint_dir))


def _read(handle, stored: str, plan) -> torch.Tensor:
    if plan is None:
        return handle.get_tensor(stored)
    view = handle.get_slice(stored)
    pieces = []
    for start, stop in plan.ranges:
        index = [slice(None)] * len(view.get_shape())
        index[plan.dim] = slice(start, stop)
        pieces.append(view[tuple(index)])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=plan.dim)


def model_shapes(cfg: ModelConfig, mtp: bool) -> dict[str, tuple[int, ...]]:
    """`expected_shapes`, and with mtp the head's."""
    return {**expected_shapes(cfg), **(mtp_shapes(cfg) if mtp else {})}


def iter_rank_tensors(
    checkpoint_dir: str | os.PathLike, cfg: ModelConfig, rank: int = 0, tp: int = 1, progress: bool = True,
    mtp: bool = False, keep_fp8: bool = False, expert_parallel: bool = False,
) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
    """Yield (canonical name, this rank's slice on the CPU) for every tensor the model needs (with mtp, the
    multi-token-prediction head's too), checked first. Block-scaled FP8 tensors come dequantised to float32, or
    with keep_fp8 as `Fp8Weight` (values and scales, both sharded; an MoE layer's experts stacked)."""
    shapes = model_shapes(cfg, mtp)
    located = _locate(checkpoint_files(checkpoint_dir))
    # An MoE layer's experts are read as two 3-D tensors; the published checkpoints store one tensor per expert
    # and projection (`mlp.experts.{e}.gate_proj.weight`, ...), which are stacked as read.
    experts = range(*expert_range(cfg, rank, tp)) if expert_parallel else range(cfg.num_experts)
    split = {name: _expert_parts(name, cfg, experts) for name in shapes if name.endswith(_EXPERT_TENSORS)
             and name not in located and f"{name.rsplit('.', 1)[0]}.0.down_proj.weight" in located}
    stored_shapes = {n: shape for n, shape in shapes.items() if n not in split}
    for name, parts in split.items():
        stored_shapes.update({part: shape for row in parts for part, shape in row})
    # Expert parallelism: the other ranks' experts, stored one by one, are not this rank's to read.
    not_held = [e for e in range(cfg.num_experts) if e not in experts]
    others = {part for name in split for row in _expert_parts(name, cfg, not_held) for part, _ in row}
    if mtp and any(n.startswith(MTP_PREFIX) and n not in located for n in stored_shapes):
        missing = next(n for n in stored_shapes if n.startswith(MTP_PREFIX) and n not in located)
        raise WeightError(f"checkpoint {checkpoint_dir} has no complete MTP head (tensor {missing!r} is missing), "
                          "which speculative decoding needs; serve it with --speculative-tokens 0")
    missing = [n for n in stored_shapes if n not in located]
    if missing:
        raise WeightError(f"checkpoint {checkpoint_dir} is missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    scales = {_scale_name(n) for n in stored_shapes}
    unknown = sorted(n for n in located if n not in stored_shapes and n not in scales and n != "lm_head.weight"
                     and not n.startswith(MTP_PREFIX) and n not in others and _scale_base(n) not in others)
    if unknown:
        log.warning("ignoring %d tensors the config does not use, e.g. %s", len(unknown), unknown[0])
    if cfg.tie_word_embeddings and "lm_head.weight" in located:
        log.info("tie_word_embeddings is set: ignoring the stored lm_head.weight")

    handles: dict[str, object] = {}
    sizes = {}
    fp8: set[str] = set()  # stored as block-scaled FP8: dequantised as read
    for name, want in stored_shapes.items():
        path, stored = located[name]
        if path not in handles:
            handles[path] = safe_open(path, framework="pt")
        view = handles[path].get_slice(stored)
        if view.get_dtype() == "F8_E4M3":
            fp8.add(name)
        elif view.get_dtype() not in _FLOAT_DTYPES:
            raise WeightError(f"tensor {name!r} is stored as {view.get_dtype()}: quantised or integer weights are not "
                              "supported (bfloat16, float16 or float32, or block-scaled FP8)")
        shape = tuple(view.get_shape())
        if shape != want:
            raise WeightError(f"tensor {name!r} has shape {list(shape)}; the config implies {list(want)}")
        plan = shard_plan(name, cfg, rank, tp, expert_parallel)
        numel = 1
        for d in shape:
            numel *= d
        sizes[name] = (numel // shape[plan.dim] * plan.size() if plan else numel) * _DTYPE_BYTES.get(view.get_dtype(), 4)
        if name in fp8:
            _check_fp8(name, shape, cfg, located, handles, plan, tp)

    if fp8 and rank == 0:
        log.info("%d of %d tensors are block-scaled FP8 (%.2f GB): %s", len(fp8), len(stored_shapes),
                 sum(sizes[n] for n in fp8) * tp / 1e9,
                 "kept in FP8 for the FP8 kernels" if keep_fp8 else
                 "dequantised to the model dtype as they are read")
    bar = show_progress(total=sum(sizes.values()), unit="B", unit_scale=True,
                        desc=f"loading weights (rank {rank}/{tp})", disable=not progress)

    def read(name: str, keep: bool):
        path, stored = located[name]
        plan = shard_plan(name, cfg, rank, tp, expert_parallel)
        tensor = _read(handles[path], stored, plan)
        if name in fp8:
            scale_path, scale_stored = located[_scale_name(name)]
            scale = _read(handles[scale_path], scale_stored, _scale_plan(plan, cfg.fp8_block))
            tensor = Fp8Weight(tensor, scale.float(), cfg.fp8_block) if keep else \
                dequantise_fp8(tensor, scale, cfg.fp8_block)
        bar.update(sizes[name])
        return tensor

    try:
        for name in shapes:
            if name in split:  # each expert's projections (gate and up joined), stacked
                yield name, _stack_experts([[read(part, keep_fp8) for part, _ in row] for row in split[name]])
            else:
                yield name, read(name, keep_fp8)
    finally:
        bar.close()
        handles.clear()


# The experts of an MoE layer, as the model holds them: [E, 2I, H] (each expert's gate rows, then its up rows) and
# [E, H, I].
_EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _stack_experts(rows: list[list]) -> torch.Tensor | Fp8Weight:
    """One 3-D tensor of the experts' parts (each row an expert's parts, joined along N): FP8 where every part is
    and each joins on a block boundary, else in float32."""
    if all(isinstance(p, Fp8Weight) for row in rows for p in row):
        joined = [Fp8Weight.cat(row) for row in rows]
        if all(j is not None for j in joined):
            return Fp8Weight.stack(joined)
    dense = [[p.dequantise() if isinstance(p, Fp8Weight) else p for p in row] for row in rows]
    return torch.stack([torch.cat(row) for row in dense])


def _expert_parts(name: str, cfg: ModelConfig, experts) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The per-expert tensors one of `_EXPERT_TENSORS` is stacked from, a row for each of `experts`, with their
    shapes."""
    base, kind = name.rsplit(".", 1)
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    projections = [("gate_proj", (I, H)), ("up_proj", (I, H))] if kind == "gate_up_proj" else [("down_proj", (H, I))]
    return [[(f"{base}.{e}.{proj}.weight", shape) for proj, shape in projections] for e in experts]


_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


# Block-scaled FP8 (quant_method "fp8"): NAME.weight in float8_e4m3fn, NAME.weight_scale_inv in float32 with one
# entry per block of FP8_BLOCK x FP8_BLOCK; the weight is the FP8 value times its block's entry. Read as
# `kernels.fp8.Fp8Weight` for the FP8 kernels, or dequantised to the model dtype (`EngineArgs.fp8_kernels`).


def _scale_base(scale: str) -> str:
    """The weight a `_scale_name` belongs to."""
    return scale.removesuffix("_scale_inv") if scale.endswith("_scale_inv") else scale


def _scale_name(name: str) -> str:
    return name[: -len("weight")] + "weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"


def dequantise_fp8(values: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """A block-scaled FP8 weight [N, K] in float32: each block x block tile times its scale entry."""
    return Fp8Weight(values, scale, block).dequantise()


FP8_MAX = 448.0  # the largest float8_e4m3fn value

# The projections an FP8 checkpoint stores in FP8; the embedding, lm_head, norms, the conv and the small GDN
# projections (in_proj_a, in_proj_b) stay in the checkpoint's dtype, as in the published ones.
FP8_PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                   "up_proj.weight", "down_proj.weight", "in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight")


def quantise_fp8(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values, scale per block) of a 2-D weight, each block scaled so its largest magnitude is FP8_MAX."""
    n, k = weight.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight.float()
    tiles = padded.view(rows, block, cols, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    values = (tiles / scale[:, None, :, None]).view(rows * block, cols * block)[:n, :k]
    return values.to(torch.float8_e4m3fn), scale


def fp8_copy(weight: torch.Tensor, block: int = 128, rows_at_once: int = 16384) -> Fp8Weight:
    """A block-scaled FP8 copy of a 2-D weight, quantised `rows_at_once` rows at a time (a multiple of `block`), so
    the fp32 temporaries stay small beside a model already on the device (a whole 27B lm_head would take 5 GB)."""
    step = max(block, rows_at_once // block * block)
    return Fp8Weight.cat([Fp8Weight(*quantise_fp8(weight[i : i + step], block), block)
                          for i in range(0, weight.shape[0], step)])


def _scale_plan(plan, block: int):
    """A weight shard's plan, in scale entries (the shard's ranges are whole blocks: `_check_fp8`)."""
    if plan is None:
        return None
    return type(plan)(plan.dim, tuple((a // block, -(-b // block)) for a, b in plan.ranges))


def _check_fp8(name, shape, cfg: ModelConfig, located, handles, plan, tp: int) -> None:
    """An FP8 tensor needs the config's FP8 block, a 2-D shape, its scale tensor of the block grid's shape, and a
    tensor-parallel shard made of whole blocks."""
    if not cfg.fp8_block:
        raise WeightError(f"tensor {name!r} is stored as F8_E4M3 but config.json has no FP8 quantization_config")
    block = cfg.fp8_block
    if len(shape) != 2:
        raise WeightError(f"tensor {name!r} is FP8 with shape {list(shape)}; only 2-D weights are read as FP8")
    scale = _scale_name(name)
    if scale not in located:
        raise WeightError(f"tensor {name!r} is FP8 but its scale {scale!r} is missing")
    path, stored = located[scale]
    if path not in handles:
        handles[path] = safe_open(path, framework="pt")
    grid = tuple(handles[path].get_slice(stored).get_shape())
    if grid != (-(-shape[0] // block), -(-shape[1] // block)):
        raise WeightError(f"tensor {scale!r} has shape {list(grid)}; {block} x {block} blocks of {name!r} "
                          f"{list(shape)} need {[-(-shape[0] // block), -(-shape[1] // block)]}")
    for a, b in plan.ranges if plan else ():
        if a % block or (b % block and b != shape[plan.dim]):
            raise WeightError(f"tp={tp} cuts a {block}-wide FP8 block of tensor {name!r} (a shard spans "
                              f"[{a}, {b}) of dimension {plan.dim}); choose a tp whose shards are whole blocks")
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "F8_E4M3": 1}

# Small per-head parameters the math consumes in fp32 whatever the model dtype.
_FP32_TENSORS = ("linear_attn.A_log", "linear_attn.dt_bias")


def load_rank_weights(
    checkpoint_dir: str | os.PathLike,
    cfg: ModelConfig,
    *,
    rank: int = 0,
    tp: int = 1,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    mtp: bool = False,
    keep_fp8: bool = False,
    expert_parallel: bool = False,
) -> dict[str, torch.Tensor | Fp8Weight]:
    """This rank's weights by canonical name, on `device`, in `dtype` (A_log and dt_bias stay fp32, and with
    keep_fp8 the FP8 ones FP8); with mtp the multi-token-prediction head's too; expert_parallel: an MoE layer's
    experts shared out whole."""
    weights = {name: _as_model_tensor(name, tensor, device, dtype)
               for name, tensor in iter_rank_tensors(checkpoint_dir, cfg, rank, tp, progress, mtp, keep_fp8,
                                                     expert_parallel)}
    return _tie(cfg, weights)


def _as_model_tensor(name: str, tensor, device, dtype: torch.dtype):
    """A checkpoint tensor as the forward holds it: conv weights [C, K], A_log/dt_bias in fp32, contiguous."""
    if isinstance(tensor, Fp8Weight):
        return tensor.to(device)
    if name.endswith("conv1d.weight"):
        tensor = tensor.squeeze(1)  # [C, 1, K] depthwise -> [C, K]
    target = torch.float32 if name.endswith(_FP32_TENSORS) else dtype
    return tensor.to(device=device, dtype=target).contiguous()


def _tie(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if cfg.tie_word_embeddings:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    return weights


def weight_bytes(weights: dict[str, torch.Tensor | Fp8Weight]) -> int:
    """Bytes held, counting a tied lm_head once."""
    return sum(bytes_by_dtype(weights).values())


def bytes_by_kind(weights: dict[str, torch.Tensor | Fp8Weight]) -> dict[str, int]:
    """Bytes held by the routed experts, the embedding and lm_head, and the rest (dense), a tied lm_head once."""
    held: dict[str, int] = {}
    seen = set()
    for name, t in weights.items():
        key = (t.values if isinstance(t, Fp8Weight) else t).data_ptr()
        if key in seen:
            continue
        seen.add(key)
        kind = "experts" if ".mlp.experts." in name else \
            "embeddings" if name in ("embed_tokens.weight", "lm_head.weight") else "dense"
        held[kind] = held.get(kind, 0) + (t.nbytes if isinstance(t, Fp8Weight) else t.numel() * t.element_size())
    return held


def bytes_by_dtype(weights: dict[str, torch.Tensor | Fp8Weight]) -> dict[str, int]:
    """Bytes held per storage dtype (an FP8 weight's scales with it), counting a tied lm_head once."""
    held: dict[str, int] = {}
    seen = set()
    for t in weights.values():
        key = (t.values if isinstance(t, Fp8Weight) else t).data_ptr()
        if key in seen:
            continue
        seen.add(key)
        name = str(t.dtype).removeprefix("torch.")
        held[name] = held.get(name, 0) + (t.nbytes if isinstance(t, Fp8Weight) else t.numel() * t.element_size())
    return held


def random_tensor(name: str, shape: tuple[int, ...], num_layers: int, generator: torch.Generator) -> torch.Tensor:
    """A random fp32 tensor for `name`, scaled so a many-layer random model stays well conditioned.

    Residual branches are scaled down, and the final norm's (1 + w) is about 2 / sqrt(hidden size) (0.25 at the
    tiny width 64) so logits spread over about 2 nats at every width, as in trained models: bf16 rounding is then
    not amplified through the layers, and bf16 comparisons measure our arithmetic rather than a chaotic random
    network (with 0.25 at the 4B width, logits reached 590 and the bf16 model's log-probs differed from fp32 by 0.9
    on average). Generated on the generator's device.
    """
    device = generator.device

    def normal(scale: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device) * scale + mean

    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=generator).log()
    if name.endswith("dt_bias"):
        return torch.rand(shape, generator=generator, device=device) * 0.5
    if name.endswith("linear_attn.norm.weight"):
        return normal(0.1, 1.0)  # a plain weight
    if name in ("norm.weight", "mtp.norm.weight"):
        final_scale = 2.0 / math.sqrt(shape[0])
        return normal(0.2 * final_scale, final_scale - 1.0)  # zero-centred: (1 + w) about final_scale
    if name.endswith(("norm.weight", "norm_embedding.weight", "norm_hidden.weight")):
        return normal(0.1)  # zero-centred: the model uses (1 + w)
    if name.endswith("conv1d.weight"):
        return normal(0.3)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return normal()
    if name.endswith("experts.down_proj"):  # [E, H, I]
        return normal(1.0 / math.sqrt(2 * num_layers) / math.sqrt(shape[2]))
    if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]
        return normal(1.0 / math.sqrt(shape[2]))
    if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
        return normal(1.0 / math.sqrt(2 * num_layers) / math.sqrt(shape[1]))
    return normal(1.0 / math.sqrt(shape[1]))


def random_rank_weights(
    cfg: ModelConfig, *, rank: int = 0, tp: int = 1, device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16, seed: int = 0, progress: bool = True, mtp: bool = False,
    fp8_block: int = 0, expert_parallel: bool = False,
) -> dict[str, torch.Tensor | Fp8Weight]:
    """Random weights generated on `device` (no checkpoint files): for benchmarks at real sizes; with fp8_block,
    the projections an FP8 checkpoint stores in FP8 (`FP8_PROJECTIONS`) as `Fp8Weight`, each shard quantised.

    Every rank generates each full tensor from the same seed and keeps its slice, so shards agree.
    """
    weights: dict[str, torch.Tensor] = {}
    generator = torch.Generator(device=device)
    # On a GPU the fp32 temporaries come from a pool of their own, given back whole at the end, and each kept tensor
    # is copied out of it: in the shared cache, kept tensors were carved from freed temporaries' segments, whose
    # free rest no empty_cache could then return (27B bf16 on an H100: 8-13.5 GiB stranded).
    # That pool cannot take blocks cached in the shared one (an engine closed earlier in the process leaves its
    # memory there), so the cache goes back to the driver first.
    scratch = None
    if generator.device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        scratch = torch.cuda.MemPool()
    shapes = model_shapes(cfg, mtp)
    for i, (name, shape) in enumerate(show_progress(shapes.items(), desc=f"random weights (rank {rank}/{tp})",
                                                    disable=not progress)):
        generator.manual_seed(seed * 1_000_003 + i)
        with torch.cuda.use_mem_pool(scratch) if scratch is not None else contextlib.nullcontext():
            full = random_tensor(name, shape, cfg.num_hidden_layers, generator)
            plan = shard_plan(name, cfg, rank, tp, expert_parallel)
            if plan is not None:
                full = torch.cat([full.narrow(plan.dim, a, b - a) for a, b in plan.ranges], dim=plan.dim)
            if fp8_block and name.endswith(_EXPERT_TENSORS):  # each expert quantised as a checkpoint stores it
                kept = Fp8Weight.stack([Fp8Weight(*quantise_fp8(e, fp8_block), fp8_block) for e in full]).to(device)
            elif fp8_block and name.endswith(FP8_PROJECTIONS):
                kept = Fp8Weight(*quantise_fp8(full, fp8_block), fp8_block)
            else:
                kept = _as_model_tensor(name, full, device, dtype)
            del full
        if scratch is not None:
            kept = Fp8Weight(kept.values.clone(), kept.scale.clone(), kept.block) if isinstance(kept, Fp8Weight) \
                else kept.clone()
        weights[name] = kept
        del kept
    if scratch is not None:
        del scratch
        torch.cuda.empty_cache()
    return _tie(cfg, weights)
