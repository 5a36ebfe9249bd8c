"""Qwen3.5 checkpoint configuration: parsing, validation and the tensor-parallel limits.

Both checkpoint forms are accepted, dense and mixture-of-experts: the multimodal wrapper (`model_type: qwen3_5` or
`qwen3_5_moe`, the text part under `text_config`) and a plain text config (`qwen3_5_text`, `qwen3_5_moe_text`). Every
problem is reported as a `ValueError` naming the offending field, before any weight is read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
_LAYER_KINDS = (FULL_ATTENTION, LINEAR_ATTENTION)


class ConfigError(ValueError):
    """A checkpoint config that cannot be served; the message names the field."""


@dataclass(frozen=True)
class GenerationDefaults:
    """What `generation_config.json` says a request should use when it leaves a field unset."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    mtp_num_hidden_layers: int = 0  # layers of the multi-token-prediction head (Qwen3.5 ships one)
    # Mixture of experts (0: a dense model, whose MLPs are `intermediate_size` wide): every layer's MLP (the MTP
    # head's too) routes each token to `num_experts_per_tok` of `num_experts` SwiGLU experts, and adds a shared
    # expert gated by sigmoid(shared_expert_gate(x)). An MoE config has no `intermediate_size` (0 here).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    fp8_block: int = 0  # block-scaled FP8 weights: their block (128); 0 for an unquantised checkpoint
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)

    def __post_init__(self) -> None:
        positive = (
            "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads "
            "head_dim linear_num_key_heads linear_num_value_heads linear_key_head_dim linear_value_head_dim "
            "linear_conv_kernel_dim max_position_embeddings"
        ).split()
        positive += ("num_experts num_experts_per_tok moe_intermediate_size shared_expert_intermediate_size".split()
                     if self.num_experts else ["intermediate_size"])
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                              f"({self.num_experts})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in _LAYER_KINDS:
                raise ConfigError(f"layer_types[{i}] is {kind!r}; expected one of {_LAYER_KINDS}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ConfigError(f"rope_parameters.partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ConfigError(
                f"head_dim * partial_rotary_factor = {self.head_dim * self.partial_rotary_factor} must be a positive even integer"
            )
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_parameters.rope_theta must be positive, got {self.rope_theta}")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        mtp = self.mtp_num_hidden_layers
        if not isinstance(mtp, int) or isinstance(mtp, bool) or mtp < 0:
            raise ConfigError(f"config field 'mtp_num_hidden_layers' must be a non-negative integer, got {mtp!r}")

    # Derived sizes -------------------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def check_tp(self, tp: int, expert_parallel: bool = False) -> None:
        """Refuse a tensor-parallel size that does not split every head-indexed dimension evenly (with expert
        parallelism, the experts rather than their width)."""
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tp must be a positive integer, got {tp!r}")
        limits = {
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
        }
        if self.is_moe:  # each expert's intermediate dimension is sharded, as a dense MLP's, or the experts
            limits["num_experts" if expert_parallel else "moe_intermediate_size"] = \
                self.num_experts if expert_parallel else self.moe_intermediate_size
            limits["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        else:
            limits["intermediate_size"] = self.intermediate_size
        for name, value in limits.items():
            if value % tp:
                raise ConfigError(f"tp={tp} does not divide {name}={value}; choose a tp that divides it")

    # Parsing ------------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, generation: GenerationDefaults | None = None) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError("config.json must hold a JSON object")
        model_type = raw.get("model_type")
        tie = raw.get("tie_word_embeddings")
        if model_type in _WRAPPERS:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"config field 'text_config' is missing or not an object (model_type {model_type})")
            want = _WRAPPERS[model_type]
            if text.get("model_type", want) != want:
                raise ConfigError(f"text_config.model_type is {text.get('model_type')!r}; expected {want!r}")
            # The wrapper's own flag wins for tying; the text part may repeat it.
            tie = text.get("tie_word_embeddings", tie) if tie is None else tie
            moe = model_type == "qwen3_5_moe"
        elif model_type in _WRAPPERS.values():
            text = raw
            moe = model_type == "qwen3_5_moe_text"
        else:
            raise ConfigError(f"unsupported model_type {model_type!r}; expected one of "
                              f"{', '.join(repr(t) for pair in _WRAPPERS.items() for t in pair)}")
        if moe:
            for name in ("mlp_only_layers", "decoder_sparse_step"):  # Qwen3-MoE's dense layers: not in Qwen3.5's
                if text.get(name) not in (None, [], 1):
                    raise ConfigError(f"config field {name!r} ({text[name]!r}) is not supported: every Qwen3.5 MoE "
                                      "layer is sparse")

        fp8_block = _fp8_block(raw, text)

        def need(name: str):
            if name not in text:
                raise ConfigError(f"config field {name!r} is missing")
            return text[name]

        num_layers = need("num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            if not isinstance(interval, int) or interval <= 0:
                raise ConfigError(f"config field 'full_attention_interval' must be a positive integer, got {interval!r}")
            if not isinstance(num_layers, int):
                raise ConfigError(f"config field 'num_hidden_layers' must be an integer, got {num_layers!r}")
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]
        if not isinstance(layer_types, list):
            raise ConfigError("config field 'layer_types' must be a list")

        rope = text.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError("config field 'rope_parameters' must be an object")
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", text.get("rope_theta", 10_000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))

        head_dim = text.get("head_dim")
        if head_dim is None:
            head_dim = need("hidden_size") // need("num_attention_heads")

        if generation is None:
            eos = text.get("eos_token_id", raw.get("eos_token_id"))
            generation = GenerationDefaults(eos_token_ids=_as_id_tuple(eos, "eos_token_id"))

        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=0 if moe else need("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=need("num_key_value_heads"),
            head_dim=head_dim,
            linear_num_key_heads=need("linear_num_key_heads"),
            linear_num_value_heads=need("linear_num_value_heads"),
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            layer_types=tuple(layer_types),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            partial_rotary_factor=float(partial),
            max_position_embeddings=text.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(tie),
            hidden_act=text.get("hidden_act", "silu"),
            mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", 0),
            **({name: need(name) for name in _MOE_FIELDS} if moe else {}),
            fp8_block=fp8_block,
            generation=generation,
        )


# The multimodal wrappers' model types, each with its text part's.
_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")

FP8_BLOCK = 128  # the block-scaled FP8 format's block, both dimensions


def _fp8_block(raw: dict, text: dict) -> int:
    """The weight block of a block-scaled FP8 checkpoint (Qwen's and vLLM's `fp8` format: e4m3 values, a float32
    `weight_scale_inv` per 128 x 128 block, dynamic activations), or 0 for an unquantised one. Any other
    quantisation (AWQ, GPTQ, NVFP4, compressed-tensors, FP8 with other blocks or static activations) is refused by
    name: read as plain weights it would serve garbage."""
    found = [(where, c["quantization_config"]) for where, c in (("config", raw), ("text_config", text))
             if c.get("quantization_config") is not None]
    if not found:
        return 0
    where, quant = found[0]
    method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
    if method != "fp8":
        raise ConfigError(f"{where}.quantization_config (quant_method {method!r}) is not supported: this engine "
                          "serves bfloat16/float16/float32 weights and block-scaled FP8 (quant_method 'fp8')")
    block = quant.get("weight_block_size")
    if block != [FP8_BLOCK, FP8_BLOCK]:
        raise ConfigError(f"{where}.quantization_config.weight_block_size {block!r} is not supported (only "
                          f"[{FP8_BLOCK}, {FP8_BLOCK}])")
    for field_, allowed in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        if quant.get(field_, allowed) != allowed:
            raise ConfigError(f"{where}.quantization_config.{field_} {quant[field_]!r} is not supported (only "
                              f"{allowed!r})")
    return FP8_BLOCK


def _as_id_tuple(value, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ConfigError(f"{name} must be an integer or a list of integers, got {value!r}")


def _optional_number(raw: dict, name: str, kind):
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"generation_config field {name!r} must be a number, got {value!r}")
    return kind(value)


def load_generation_defaults(raw: dict, fallback_eos: tuple[int, ...]) -> GenerationDefaults:
    eos = _as_id_tuple(raw.get("eos_token_id"), "generation_config.eos_token_id") or fallback_eos
    return GenerationDefaults(
        eos_token_ids=eos,
        temperature=_optional_number(raw, "temperature", float),
        top_k=_optional_number(raw, "top_k", int),
        top_p=_optional_number(raw, "top_p", float),
        min_p=_optional_number(raw, "min_p", float),
        repetition_penalty=_optional_number(raw, "repetition_penalty", float),
        presence_penalty=_optional_number(raw, "presence_penalty", float),
    )


def generation_defaults(source: str, checkpoint: GenerationDefaults) -> GenerationDefaults:
    """The sampling defaults `--generation-config` names: "vllm", none (the checkpoint's stop ids stay); a folder,
    its generation_config.json."""
    if source == "vllm":
        return GenerationDefaults(eos_token_ids=checkpoint.eos_token_ids)
    path = os.path.join(source, "generation_config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"generation_config {source!r} is not 'auto', 'vllm' or a folder holding a "
                          "generation_config.json")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    return load_generation_defaults(raw, checkpoint.eos_token_ids)


def load_model_config(checkpoint_dir: str | os.PathLike) -> ModelConfig:
    """Read `config.json` (and `generation_config.json` when present) from a checkpoint folder."""
    path = os.path.join(checkpoint_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json in {checkpoint_dir}")
    with open(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    config = ModelConfig.from_dict(raw)
    gen_path = os.path.join(checkpoint_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen_raw = json.load(f)
        from dataclasses import replace

        config = replace(config, generation=load_generation_defaults(gen_raw, config.generation.eos_token_ids))
    return config
