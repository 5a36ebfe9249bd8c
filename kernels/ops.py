"""The op set the forward calls, written down once: `ForwardOps`, with the torch references (`reference_ops`, the
CPU path and every kernel's oracle) or the Triton kernels under one launch configuration (`triton_ops`).

Conventions every op keeps, whichever implements it:
- Token tensors are packed over requests: [T, ...], with `cu_seqlens` [R+1] offsets for prefill.
- State pools carry one extra "trash" entry at the end (slot -1 and padding rows map there), so a padding row
  reads and writes only memory no request owns, with no data-dependent branching (CUDA-graph safe).
- Conv state per slot is [K-1, C]: the last K-1 pre-conv inputs, channel-contiguous.
- Recurrent (GDN) state per slot is [Hv, dk, dv] in fp32.
- Paged KV per attention layer is [num_pages + 1, page_size, n_kv_heads, D]; `slot_mapping` holds each token's
  flat index page * page_size + offset.
Every Triton op launches on the current torch stream with no host synchronisation and reads lengths, slots and
page tables from device tensors, so the decode ones can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from .config import DEFAULT, KernelConfig


@dataclass(frozen=True)
class ForwardOps:
    add_rms_norm: Callable  # (x, residual, weight, eps) -> (normed, new residual): the final norm
    add_rms_norm_linear: Callable  # a block's input add-and-norm and its first projection
    mlp: Callable  # the MLP block: its input add-and-norm, gate/up, silu(gate) * up, down (before the all-reduce)
    moe: Callable  # an MoE model's MLP block: add-and-norm, router, routed and shared experts (`kernels.moe`)
    linear: Callable  # x @ weight.T
    gated_rms_norm: Callable  # the GDN output norm, times silu(z)
    conv1d_prefill: Callable
    conv1d_decode: Callable
    gdn_prefill: Callable
    gdn_decode: Callable
    conv1d_verify: Callable  # a speculative verify step's T tokens a row, keeping the state after each
    gdn_verify: Callable
    roll_back_pool: Callable  # a one-token step's rows back to the GDN state their last verify step kept
    qk_norm_rope_cache: Callable  # q/k norms, RoPE and the paged K/V write, from the fused projection
    prefill_attention: Callable  # both with the sigmoid output gate applied inside
    decode_attention: Callable
    rope_tables: Callable  # (rotary_dim, theta, max_positions, device) -> cos, sin
    config: KernelConfig | None = None  # the Triton ops' launch configuration; None for the references


def reference_ops() -> ForwardOps:
    from . import attention, conv1d, gdn, gemv, moe, norm

    return ForwardOps(
        add_rms_norm=norm.add_rms_norm_reference,
        add_rms_norm_linear=gemv.add_rms_norm_linear_reference,
        mlp=gemv.mlp_reference,
        moe=moe.moe_reference,
        linear=gemv.linear_reference,
        gated_rms_norm=norm.gated_rms_norm_reference,
        conv1d_prefill=conv1d.conv1d_prefill_reference,
        conv1d_decode=conv1d.conv1d_decode_reference,
        gdn_prefill=gdn.gdn_prefill_reference,
        gdn_decode=gdn.gdn_decode_reference,
        conv1d_verify=conv1d.conv1d_verify_reference,
        gdn_verify=gdn.gdn_verify_reference,
        roll_back_pool=gdn.roll_back_pool_reference,
        qk_norm_rope_cache=attention.qk_norm_rope_cache_reference,
        prefill_attention=attention.prefill_attention_reference,
        decode_attention=attention.decode_attention_reference,
        rope_tables=attention.rope_tables,
    )


def triton_ops(config: KernelConfig = DEFAULT) -> ForwardOps:
    from . import attention, conv1d, gdn, gemv, moe, norm

    def bound(module, name: str) -> Callable:
        return functools.partial(getattr(module, name), cfg=config)

    return ForwardOps(
        add_rms_norm=bound(norm, "add_rms_norm"),
        add_rms_norm_linear=bound(gemv, "add_rms_norm_linear"),
        mlp=bound(gemv, "mlp"),
        moe=bound(moe, "moe"),
        linear=bound(gemv, "linear"),
        gated_rms_norm=bound(norm, "gated_rms_norm"),
        conv1d_prefill=bound(conv1d, "conv1d_prefill"),
        conv1d_decode=bound(conv1d, "conv1d_decode"),
        gdn_prefill=bound(gdn, "gdn_prefill"),
        gdn_decode=bound(gdn, "gdn_decode"),
        conv1d_verify=bound(conv1d, "conv1d_verify"),
        gdn_verify=bound(gdn, "gdn_verify"),
        roll_back_pool=bound(gdn, "roll_back_pool"),
        qk_norm_rope_cache=bound(attention, "qk_norm_rope_cache"),
        prefill_attention=bound(attention, "prefill_attention"),
        decode_attention=bound(attention, "decode_attention"),
        rope_tables=attention.rope_tables,
        config=config,
    )
