"""One tensor-parallel rank's Qwen3.5 forward, built only from the ops of a `kernels.ops.ForwardOps` (torch
references or Triton).

One forward computes any step (`StepBatch`): rows of one token (decode) or k + 1 (speculative verify) and packed
prompt chunks of any length, in one pass over the weights; each mixer runs each part on its own kernels.
Under tensor parallelism the three row-parallel projections (GDN out_proj, attention o_proj, MLP down_proj)
are followed by `all_reduce`, an in-place sum over ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.kernels.fp8 import Fp8Weight
from deltaserve.kernels.ops import ForwardOps, reference_ops

from .batch import PromptChunks, StepBatch, TokenRows
from .config import ModelConfig
from .sharding import LocalSizes
from .state import ModelState


MTP_LAYER = "mtp.layers.0."  # the head's decoder layer (Qwen3.5 ships one)


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class Qwen35Shard:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        local: LocalSizes,
        *,
        ops: ForwardOps | None = None,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        expert_start: int = 0,
    ) -> None:
        """expert_start: an MoE model under expert parallelism, the first of the experts this rank holds."""
        self.cfg, self.w, self.local = cfg, weights, local
        self.expert_start = expert_start
        self.ops = ops or reference_ops()
        self.all_reduce = all_reduce or _no_reduce
        embed = weights["embed_tokens.weight"]
        self.dtype, self.device = embed.dtype, embed.device
        self.cos, self.sin = self.ops.rope_tables(
            cfg.rotary_dim, cfg.rope_theta, cfg.max_position_embeddings, device=self.device
        )
        self.scale = cfg.head_dim**-0.5
        # The multi-token-prediction head, when its weights were loaded (speculative decoding): its decoder layer
        # is fused and folded like the model's, and its KV is the attention pools' last layer.
        self.has_mtp = MTP_LAYER + "self_attn.q_proj.weight" in weights
        self.layer_prefixes = [f"layers.{i}." for i in range(cfg.num_hidden_layers)] + [MTP_LAYER] * self.has_mtp
        self._fuse_projections()
        self._fold_block_norms()
        if self.has_mtp:
            self._fold_mtp_input_norms()
        # Layer index -> its index among the layers of its kind (row of the state pools).
        self.state_index = {}
        for kind_layers in (cfg.gdn_layers, cfg.attention_layers):
            for j, i in enumerate(kind_layers):
                self.state_index[i] = j
        self.mtp_kv_index = len(cfg.attention_layers)

    # Projections that read the same input run as one GEMM: fewer, larger matmuls and fewer graph nodes.
    _FUSED = {
        "linear_attn.in_proj_all.weight": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                                           "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
        "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "mlp.shared_expert.gate_up_proj.weight": ("mlp.shared_expert.gate_proj.weight",
                                                  "mlp.shared_expert.up_proj.weight"),
    }

    def _fuse_projections(self) -> None:
        """Concatenate each layer's same-input projections (this rank's shards) into one weight, in place. FP8
        parts fuse into one FP8 weight where each ends on a block boundary; FP8 and other parts do not fuse (the
        GDN's FP8 qkv and z beside its small bf16 b and a: `linear_attn.in_proj_ba.weight` apart)."""
        w = self.w
        for p in self.layer_prefixes:
            for fused, parts in self._FUSED.items():
                if p + parts[0] not in w:
                    continue
                tensors = [w[p + part] for part in parts]
                kinds = [isinstance(t, Fp8Weight) for t in tensors]
                gdn_split = fused == "linear_attn.in_proj_all.weight" and kinds == [True, True, False, False]
                joined = Fp8Weight.cat(tensors[:2] if gdn_split else tensors) if all(kinds) or gdn_split else None
                if not any(kinds):
                    w[p + fused] = torch.cat(tensors, dim=0)
                elif joined is not None:
                    w[p + fused] = joined
                    if gdn_split:
                        w[p + "linear_attn.in_proj_ba.weight"] = torch.cat(tensors[2:], dim=0)
                else:  # no shared block grid: the parts as the model dtype, fused
                    dtype = next(t.dtype for t in tensors if not isinstance(t, Fp8Weight)) if not all(kinds) \
                        else self.dtype
                    w[p + fused] = torch.cat([t.dequantise(dtype) if isinstance(t, Fp8Weight) else t
                                              for t in tensors], dim=0)
                for part in parts:
                    del w[p + part]

    # A block's input norm is zero-centred, norm(x) * (1 + w), and only the block's first projection reads it, so
    # (1 + w) is folded into that projection's columns here and the ops get norm weight None. The one-row add-and-norm
    # GEMV then loads one vector fewer a program: 4B batch-1 step 2.466 against 2.529 ms (H100;
    # docs/benchmarks/log/decode.md). The scaled weight is rounded once to the model dtype, where the reference
    # rounds the normalised activation.
    _BLOCK_NORMS = {
        "input_layernorm.weight": ("linear_attn.in_proj_all.weight", "self_attn.qkv_proj.weight"),
        "post_attention_layernorm.weight": ("mlp.gate_up_proj.weight",),  # an MoE block's norm stays apart
    }

    def _fold_block_norms(self) -> None:
        """Scale each block's first (fused) projection by its input norm's (1 + w), in place, in fp32; drop the
        norm weight. An FP8 projection's blocks share a scale across columns: its norm stays, applied by the
        ops."""
        w = self.w
        for p in self.layer_prefixes:
            for norm, readers in self._BLOCK_NORMS.items():
                found = [p + r for r in readers if p + r in w]
                if not found or isinstance(w[found[0]], Fp8Weight):
                    continue
                reader = found[0]
                scale = 1.0 + w.pop(p + norm).float()
                for rows in w[reader].split(4096):  # the fused weight is this shard's own copy; bounds the fp32 one
                    rows.copy_(rows.float() * scale)

    def _fold_mtp_input_norms(self) -> None:
        """The head's fc reads [norm(embedding) | norm(hidden)], each zero-centred: their (1 + w) scale fc's two
        column halves, in place, as `_fold_block_norms` does."""
        w, H = self.w, self.cfg.hidden_size
        fc = w["mtp.fc.weight"]
        if isinstance(fc, Fp8Weight):
            return
        for half, norm in enumerate(("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")):
            cols = fc[:, half * H : (half + 1) * H]
            cols.copy_(cols.float() * (1.0 + w.pop(norm).float()))

    # Layers: each takes the layer's input x and the residual stream, p the layer's prefix ("layers.i."), and
    # returns (its output, the new residual). The add-and-norm before a block goes with the block's first
    # projection, so the ops can fuse the two; its weight is in the projection (norm weight None).
    def _mlp(self, x: torch.Tensor, residual: torch.Tensor, p: str):
        w, ops = self.w, self.ops
        if self.cfg.is_moe:
            m = p + "mlp."
            out, residual = ops.moe(x, residual, w[p + "post_attention_layernorm.weight"], self.cfg.rms_norm_eps,
                                    w[m + "gate.weight"], self.cfg.num_experts_per_tok, w[m + "experts.gate_up_proj"],
                                    w[m + "experts.down_proj"], w[m + "shared_expert.gate_up_proj.weight"],
                                    w[m + "shared_expert.down_proj.weight"], w[m + "shared_expert_gate.weight"],
                                    expert_start=self.expert_start)
            return self.all_reduce(out), residual
        gate_up = w[p + "mlp.gate_up_proj.weight"]
        norm = w.get(p + "post_attention_layernorm.weight")  # None: folded into gate_up
        out, residual = ops.mlp(x, residual, norm, self.cfg.rms_norm_eps, gate_up, w[p + "mlp.down_proj.weight"])
        return self.all_reduce(out), residual

    def _input_projection(self, x: torch.Tensor, residual: torch.Tensor | None, p: str, weight: str):
        """The layer's input add-and-norm and the first projection of its mixer; (projected, new residual)."""
        norm = self.w.get(p + "input_layernorm.weight")  # None: folded into the projection
        return self.ops.add_rms_norm_linear(x, residual, norm, self.cfg.rms_norm_eps, self.w[p + weight])

    def _gdn_inputs(self, x: torch.Tensor, residual: torch.Tensor | None, p: str):
        """Views of the fused [qkv | z | b | a] projection, and the new residual."""
        w, ops = self.w, self.ops
        C, hv = self.local.gdn_conv_dim, self.local.gdn_value_heads
        vd = hv * self.cfg.linear_value_head_dim
        ba = w.get(p + "linear_attn.in_proj_ba.weight")
        if ba is None:
            y, residual = self._input_projection(x, residual, p, "linear_attn.in_proj_all.weight")
            mixed, z, b, a = y.split([C, vd, hv, hv], dim=1)
        else:  # an FP8 [qkv | z] and the bf16 [b | a]: two projections of one add-and-norm (the ops read views)
            normed, residual = ops.add_rms_norm(x, residual, w[p + "input_layernorm.weight"], self.cfg.rms_norm_eps)
            mixed, z = ops.linear(normed, w[p + "linear_attn.in_proj_all.weight"]).split([C, vd], dim=1)
            b, a = ops.linear(normed, ba).split([hv, hv], dim=1)
        return mixed, z, a, b, residual

    def _gdn_output(self, o: torch.Tensor, z: torch.Tensor, p: str) -> torch.Tensor:
        T = o.shape[0]
        dv = self.cfg.linear_value_head_dim
        la = p + "linear_attn."
        normed = self.ops.gated_rms_norm(o, z.reshape(T, -1, dv), self.w[la + "norm.weight"], self.cfg.rms_norm_eps)
        return self.all_reduce(self.ops.linear(normed.reshape(T, -1), self.w[la + "out_proj.weight"]))

    def _gdn(self, x, residual, p, state: ModelState, batch: StepBatch, j: int):
        """One projection for all of the step's tokens, then each part's own recurrence."""
        mixed, z, a, b, residual = self._gdn_inputs(x, residual, p)
        o = self._by_part(batch, lambda *t: self._gdn_rows(*t, p, state, batch.rows, j),
                          lambda *t: self._gdn_chunks(*t, p, state, batch.chunks, j), mixed, a, b)
        return self._gdn_output(o, z, p), residual

    def _gdn_chunks(self, mixed, a, b, p, state: ModelState, chunks: PromptChunks, j: int) -> torch.Tensor:
        cfg, w, la = self.cfg, self.w, p + "linear_attn."
        mixed = self.ops.conv1d_prefill(mixed, w[la + "conv1d.weight"], state.conv[j], chunks.cu_seqlens, chunks.slots)
        return self.ops.gdn_prefill(
            mixed, a, b, w[la + "A_log"], w[la + "dt_bias"], state.ssm[j], chunks.cu_seqlens, chunks.slots,
            self.local.gdn_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, chunks.gdn_chunks,
        )

    def _gdn_rows(self, mixed, a, b, p, state: ModelState, rows: TokenRows, j: int) -> torch.Tensor:
        """One recurrent step a token. A row of T > 1 tokens (verify) starts from the state after the tokens its
        last verify step kept (`rows.kept`); the state after each of its first T - 1 goes to the verify-step pools
        for the next roll-back."""
        cfg, w, la, T = self.cfg, self.w, p + "linear_attn.", rows.tokens_per_row
        conv, heads = w[la + "conv1d.weight"], (self.local.gdn_key_heads, cfg.linear_key_head_dim,
                                                cfg.linear_value_head_dim)
        if T == 1:
            mixed = self.ops.conv1d_decode(mixed, conv, state.conv[j], rows.slots)
            return self.ops.gdn_decode(mixed, a, b, w[la + "A_log"], w[la + "dt_bias"], state.ssm[j], rows.slots,
                                       *heads)
        mixed = self.ops.conv1d_verify(mixed, conv, state.conv[j], state.conv_steps[j], rows.slots, rows.kept, T)
        return self.ops.gdn_verify(mixed, a, b, w[la + "A_log"], w[la + "dt_bias"], state.ssm[j],
                                   state.ssm_steps[j], rows.slots, rows.kept, T, *heads)

    def _attn_inputs(self, x, residual, p, state: ModelState, j: int, positions, slot_mapping):
        """The fused q/k/v projection, then q/k norms, RoPE and the paged K/V write; (rotated q, gate view, new
        residual)."""
        cfg, w, sa = self.cfg, self.w, p + "self_attn."
        qkv, residual = self._input_projection(x, residual, p, "self_attn.qkv_proj.weight")
        nh, nkv = self.local.num_heads, self.local.num_kv_heads
        q = self.ops.qk_norm_rope_cache(
            qkv, w[sa + "q_norm.weight"], w[sa + "k_norm.weight"], cfg.rms_norm_eps, positions, self.cos, self.sin,
            state.k_cache[j], state.v_cache[j], slot_mapping, nh, nkv,
        )
        D = cfg.head_dim  # each head's q_proj rows are [query | gate]
        gate = qkv[:, : nh * 2 * D].view(qkv.shape[0], nh, 2 * D)[..., D:]
        return q, gate, residual

    def _attn_output(self, o: torch.Tensor, p: str) -> torch.Tensor:
        return self.all_reduce(self.ops.linear(o.reshape(o.shape[0], -1), self.w[p + "self_attn.o_proj.weight"]))

    def _attention(self, x, residual, p, state: ModelState, batch: StepBatch, j: int):
        """One q/k/v projection (and K/V write) for all of the step's tokens, then each part's own attention
        kernel (the sigmoid output gate applied inside): a decode row a token for the rows, the prefill kernel for
        the chunks."""
        q, gate, residual = self._attn_inputs(x, residual, p, state, j, batch.positions, batch.slot_mapping)
        k_cache, v_cache = state.k_cache[j], state.v_cache[j]

        def rows(q, gate):
            r = batch.rows
            o = self.ops.decode_attention(q, k_cache, v_cache, r.page_table, r.seq_lens, self.scale, gate)
            return o.reshape(o.shape[0], -1)

        def chunks(q, gate):
            c = batch.chunks
            o = self.ops.prefill_attention(q, k_cache, v_cache, c.page_table, c.cu_seqlens, c.context_lens,
                                           self.scale, gate)
            return o.reshape(o.shape[0], -1)

        return self._attn_output(self._by_part(batch, rows, chunks, q, gate), p), residual

    @staticmethod
    def _by_part(batch: StepBatch, on_rows, on_chunks, *tensors: torch.Tensor) -> torch.Tensor:
        """`on_rows` over the rows' slice of each token-major tensor and `on_chunks` over the chunks', their
        outputs joined in token order (a step of one part: that part's output, no copy)."""
        if batch.chunks is None:
            return on_rows(*tensors)
        if batch.rows is None:
            return on_chunks(*tensors)
        n = batch.row_tokens
        return torch.cat([on_rows(*(t[:n] for t in tensors)), on_chunks(*(t[n:] for t in tensors))])

    # Whole model --------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, state: ModelState, batch: StepBatch) -> torch.Tensor:
        """Any mix of rows and prompt chunks; the final-normed hidden state of every token [N, H] (what lm_head
        reads, and what the MTP head takes), in the batch's token order. A chunk starting its prompt starts from a
        zeroed state (`chunks.fresh_slots`); each chunk's last hidden state is kept with its slot
        (`ModelState.last_hidden`). A row's GDN state ends after all of its tokens, and after each earlier one in
        the verify-step pools: the next verify step (`rows.kept`) or `ModelState.commit_verified` rolls it back to
        the tokens kept."""
        cfg, w, ops, chunks = self.cfg, self.w, self.ops, batch.chunks
        if chunks is not None and chunks.fresh_slots.numel():
            state.reset_slots(chunks.fresh_slots)
        x = w["embed_tokens.weight"][batch.input_ids]
        residual = None
        for i, kind in enumerate(cfg.layer_types):
            p = f"layers.{i}."
            mix = self._attention if kind == "full_attention" else self._gdn
            x, residual = mix(x, residual, p, state, batch, self.state_index[i])
            x, residual = self._mlp(x, residual, p)
        hidden, _ = ops.add_rms_norm(x, residual, w["norm.weight"], cfg.rms_norm_eps)
        if chunks is not None:
            state.last_hidden[chunks.slots] = hidden[batch.chunk_ends()]
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model dtype: the samplers widen them as they read (bf16 to fp32 is exact), so no fp32 copy is
        made (at batch 64 on the 248k vocabulary, 96 MB of traffic a step)."""
        return self.ops.linear(hidden, self.w["lm_head.weight"])

    # The multi-token-prediction head ------------------------------------------------------------------------------
    @torch.inference_mode()
    def mtp(self, token_ids: torch.Tensor, hidden: torch.Tensor, state: ModelState,
            batch: StepBatch) -> torch.Tensor:
        """The head at each token of `batch`: at position i it takes the model's final-normed hidden state at i and
        the token at i + 1 (`token_ids`), and returns its own final-normed hidden state, from which lm_head gives
        the token at i + 2. Its attention layer reads and writes its KV at the batch's positions (the pools' last
        layer). `batch.input_ids` is not read."""
        if not self.has_mtp:
            raise RuntimeError("the model was loaded without its MTP head")
        cfg, w, ops, p = self.cfg, self.w, self.ops, MTP_LAYER
        # Both (1 + w) are folded into fc (not into an FP8 fc: then their weights are still here).
        embedded, _ = ops.add_rms_norm(w["embed_tokens.weight"][token_ids], None,
                                       w.get("mtp.pre_fc_norm_embedding.weight"), cfg.rms_norm_eps)
        normed, _ = ops.add_rms_norm(hidden, None, w.get("mtp.pre_fc_norm_hidden.weight"), cfg.rms_norm_eps)
        x = ops.linear(torch.cat([embedded, normed], dim=1), w["mtp.fc.weight"])
        x, residual = self._attention(x, None, p, state, batch, self.mtp_kv_index)
        x, residual = self._mlp(x, residual, p)
        out, _ = ops.add_rms_norm(x, residual, w["mtp.norm.weight"], cfg.rms_norm_eps)
        return out
