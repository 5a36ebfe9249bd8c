"""Per-rank shard plans (DESIGN §3): which slices of each checkpoint tensor a tensor-parallel rank holds.

A plan is a dimension plus a list of [start, stop) ranges along it; the rank's tensor is the concatenation of
those slices, read straight from the memory-mapped checkpoint. Replicated tensors have no plan (None).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .config import ModelConfig


# "layers.<i>.<module path>.<leaf>" (or the MTP head's "mtp.layers.<i>. ..."): the module path decides the plan.
_LAYER_TENSOR = re.compile(r"^(?:mtp\.)?layers\.\d+\.(.+)\.[^.]+$")
_EXPERT = re.compile(r"^mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$")


@dataclass(frozen=True)
class ShardPlan:
    dim: int
    ranges: tuple[tuple[int, int], ...]

    def size(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


def _part(total: int, rank: int, tp: int, unit: int = 1) -> tuple[int, int]:
    """The rank's contiguous share of `total` items of `unit` elements each."""
    per = total // tp
    return rank * per * unit, (rank + 1) * per * unit


@dataclass(frozen=True)
class LocalSizes:
    """Head and channel counts one rank holds."""

    num_heads: int
    num_kv_heads: int
    gdn_key_heads: int
    gdn_value_heads: int
    intermediate: int
    gdn_conv_dim: int
    moe_intermediate: int = 0  # each routed expert's
    shared_intermediate: int = 0  # the shared expert's
    experts: int = 0  # routed experts held (expert parallelism: rank r holds r * experts ..)

    @classmethod
    def of(cls, cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> "LocalSizes":
        cfg.check_tp(tp, expert_parallel)
        hk, hv = cfg.linear_num_key_heads // tp, cfg.linear_num_value_heads // tp
        return cls(
            num_heads=cfg.num_attention_heads // tp,
            num_kv_heads=cfg.num_key_value_heads // tp,
            gdn_key_heads=hk,
            gdn_value_heads=hv,
            intermediate=cfg.intermediate_size // tp,
            gdn_conv_dim=2 * hk * cfg.linear_key_head_dim + hv * cfg.linear_value_head_dim,
            moe_intermediate=cfg.moe_intermediate_size // (1 if expert_parallel else tp),
            shared_intermediate=cfg.shared_expert_intermediate_size // tp,
            experts=cfg.num_experts // (tp if expert_parallel else 1),
        )


def expert_range(cfg: ModelConfig, rank: int, tp: int) -> tuple[int, int]:
    """The experts a rank holds under expert parallelism, [start, stop)."""
    return _part(cfg.num_experts, rank, tp)


def gdn_channel_ranges(cfg: ModelConfig, rank: int, tp: int) -> tuple[tuple[int, int], ...]:
    """The rank's channels of the [q | k | v] segments of `in_proj_qkv` and `conv1d`, in that order."""
    kd = cfg.gdn_key_dim
    q = _part(cfg.linear_num_key_heads, rank, tp, cfg.linear_key_head_dim)
    k = _part(cfg.linear_num_key_heads, rank, tp, cfg.linear_key_head_dim)
    v = _part(cfg.linear_num_value_heads, rank, tp, cfg.linear_value_head_dim)
    return (q, (kd + k[0], kd + k[1]), (2 * kd + v[0], 2 * kd + v[1]))


def shard_plan(name: str, cfg: ModelConfig, rank: int, tp: int, expert_parallel: bool = False) -> ShardPlan | None:
    """The plan for a text-model tensor named without the `model.language_model.` prefix; expert_parallel: an
    MoE layer's experts are shared out whole (`expert_range`), each one unsharded."""
    if tp == 1:
        return None
    match = _LAYER_TENSOR.match(name)
    if match is None:
        return None  # embedding, final norm, lm_head: replicated
    module = match.group(1)
    if module == "linear_attn.in_proj_qkv" or module == "linear_attn.conv1d":
        return ShardPlan(0, gdn_channel_ranges(cfg, rank, tp))
    if module in ("linear_attn.in_proj_z",):
        return ShardPlan(0, (_part(cfg.linear_num_value_heads, rank, tp, cfg.linear_value_head_dim),))
    if module in ("linear_attn.in_proj_b", "linear_attn.in_proj_a") or name.endswith(
        ("linear_attn.dt_bias", "linear_attn.A_log")
    ):
        return ShardPlan(0, (_part(cfg.linear_num_value_heads, rank, tp),))
    if module == "linear_attn.out_proj":
        return ShardPlan(1, (_part(cfg.linear_num_value_heads, rank, tp, cfg.linear_value_head_dim),))
    if module == "self_attn.q_proj":
        # Each head's rows are [query(D) | gate(D)]: a head shard keeps the two together.
        return ShardPlan(0, (_part(cfg.num_attention_heads, rank, tp, 2 * cfg.head_dim),))
    if module in ("self_attn.k_proj", "self_attn.v_proj"):
        return ShardPlan(0, (_part(cfg.num_key_value_heads, rank, tp, cfg.head_dim),))
    if module == "self_attn.o_proj":
        return ShardPlan(1, (_part(cfg.num_attention_heads, rank, tp, cfg.head_dim),))
    if module in ("mlp.gate_proj", "mlp.up_proj"):
        return ShardPlan(0, (_part(cfg.intermediate_size, rank, tp),))
    if module == "mlp.down_proj":
        return ShardPlan(1, (_part(cfg.intermediate_size, rank, tp),))
    # Mixture of experts: each expert's intermediate dimension, as a dense MLP's. The experts' 3-D tensors are
    # [E, 2I, H] (each expert's gate rows, then its up rows) and [E, H, I].
    if expert_parallel and name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return ShardPlan(0, (expert_range(cfg, rank, tp),))
    if expert_parallel and _EXPERT.match(module):
        return None
    if _EXPERT.match(module):  # one expert's projection, as stored in the published checkpoints
        I = cfg.moe_intermediate_size
        return ShardPlan(1, (_part(I, rank, tp),)) if module.endswith("down_proj") else \
            ShardPlan(0, (_part(I, rank, tp),))
    if module in ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"):
        return ShardPlan(0, (_part(cfg.shared_expert_intermediate_size, rank, tp),))
    if module == "mlp.shared_expert.down_proj":
        return ShardPlan(1, (_part(cfg.shared_expert_intermediate_size, rank, tp),))
    if name.endswith("mlp.experts.gate_up_proj"):
        I = cfg.moe_intermediate_size
        gate = _part(I, rank, tp)
        return ShardPlan(1, (gate, (I + gate[0], I + gate[1])))
    if name.endswith("mlp.experts.down_proj"):
        return ShardPlan(2, (_part(cfg.moe_intermediate_size, rank, tp),))
    # norms, embedding, lm_head, q_norm/k_norm, the GDN norm, the MTP head's fc, the router (mlp.gate) and the
    # shared expert's gate: replicated
    return None
