"""Per-rank model state: GDN conv and recurrent state per slot, paged KV for the full-attention layers.

Every pool has one extra trailing entry (the trash slot / trash page) that padding rows read and write, so a
padded CUDA-graph row never touches state a request owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.gdn import roll_back_pool_reference
from .config import ModelConfig
from .sharding import LocalSizes

PAGE_SIZE = 16  # tokens per KV page


@dataclass(frozen=True)
class StateSizes:
    """Bytes one rank spends per request slot and per KV page (the inputs of the capacity math)."""

    conv_bytes_per_slot: int
    ssm_bytes_per_slot: int
    kv_bytes_per_page: int
    page_size: int
    verify_bytes_per_slot: int = 0  # speculative decoding: the verify-step pools, hidden states and drafts
    hidden_bytes_per_slot: int = 0  # the hidden state of the last prompt token the slot's state consumed

    @property
    def bytes_per_slot(self) -> int:
        """The GDN state a decode step reads and writes for a row."""
        return self.conv_bytes_per_slot + self.ssm_bytes_per_slot

    @property
    def bytes_per_snapshot(self) -> int:
        return self.bytes_per_slot + self.hidden_bytes_per_slot

    @property
    def bytes_per_request_slot(self) -> int:
        return self.bytes_per_snapshot + self.verify_bytes_per_slot

    @classmethod
    def of(cls, cfg: ModelConfig, local: LocalSizes, dtype: torch.dtype, page_size: int = PAGE_SIZE,
           speculative_tokens: int = 0) -> "StateSizes":
        """With speculative_tokens k > 0, the KV pages hold the multi-token-prediction head's attention layer too,
        and a request slot its k verify-step states, k + 1 hidden states and k drafts."""
        elem = torch.tensor([], dtype=dtype).element_size()
        n_gdn, n_attn = len(cfg.gdn_layers), len(cfg.attention_layers) + (1 if speculative_tokens else 0)
        conv = n_gdn * (cfg.linear_conv_kernel_dim - 1) * local.gdn_conv_dim * elem
        ssm = n_gdn * local.gdn_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        kv = n_attn * 2 * page_size * local.num_kv_heads * cfg.head_dim * elem
        k = speculative_tokens
        verify = k * (conv + ssm) + (k + 1) * cfg.hidden_size * elem + k * 8 if k else 0
        return cls(conv, ssm, kv, page_size, verify, cfg.hidden_size * elem)


class ModelState:
    """Fixed-address state of one rank: `num_slots` request slots, then `num_snapshots` snapshot slots (the prefix
    cache's copies of a request slot's GDN state), then the trash slot (the last entry: the kernels send slot -1
    there); `num_pages` KV pages and the trash page. With mtp, the KV pools have one layer more, the last: the
    multi-token-prediction head's, whose keys and values sit in the same pages at the same positions."""

    def __init__(
        self,
        cfg: ModelConfig,
        local: LocalSizes,
        num_slots: int,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        page_size: int = PAGE_SIZE,
        num_snapshots: int = 0,
        mtp: bool = False,
        speculative_tokens: int = 0,
    ) -> None:
        """mtp: KV for the multi-token-prediction head; speculative_tokens k: the pools of speculative steps of k
        drafts (EngineArgs.speculative_tokens)."""
        self.num_slots, self.num_pages, self.page_size = num_slots, num_pages, page_size
        self.num_snapshots = num_snapshots
        self.trash_slot, self.trash_page = num_slots + num_snapshots, num_pages
        n_gdn, n_attn = len(cfg.gdn_layers), len(cfg.attention_layers) + (1 if mtp else 0)
        entries = num_slots + 1 + num_snapshots
        self.conv = torch.zeros(
            n_gdn, entries, cfg.linear_conv_kernel_dim - 1, local.gdn_conv_dim, dtype=dtype, device=device
        )
        self.ssm = torch.zeros(
            n_gdn, entries, local.gdn_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
            dtype=torch.float32, device=device,
        )
        # The final-normed hidden state of the last prompt token each entry's state consumed in a prefill (a decode
        # step leaves it stale): a prompt whose every token a snapshot holds takes its first token's logits from
        # the snapshot's, with no forward (`PrefixCache.match`).
        self.last_hidden = torch.zeros(entries, cfg.hidden_size, dtype=dtype, device=device)
        # Speculative decoding, per request slot (and a trash entry last): the GDN state after each of the last
        # verify step's first k tokens (after its last one, it is the slot's own), what the step drafts from (that
        # step's k + 1 final-normed hidden states) and the k tokens drafted for the next one.
        self.speculative_tokens = speculative_tokens
        self.conv_steps = self.ssm_steps = self.verify_hidden = self.drafts = None
        if speculative_tokens:
            self.conv_steps = torch.zeros((n_gdn, num_slots + 1, speculative_tokens) + self.conv.shape[2:], dtype=dtype,
                                          device=device)
            self.ssm_steps = torch.zeros((n_gdn, num_slots + 1, speculative_tokens) + self.ssm.shape[2:],
                                         dtype=torch.float32, device=device)
            self.verify_hidden = torch.zeros(num_slots + 1, speculative_tokens + 1, cfg.hidden_size, dtype=dtype,
                                             device=device)
            self.drafts = torch.zeros(num_slots + 1, speculative_tokens, dtype=torch.long, device=device)
        kv_shape = (n_attn, num_pages + 1, page_size, local.num_kv_heads, cfg.head_dim)
        self.k_cache = torch.zeros(kv_shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(kv_shape, dtype=dtype, device=device)

    def reset_slots(self, slots: torch.Tensor) -> None:
        """Zero the GDN state of these slots (a request starting from its first token). `index_fill_` takes the
        zero as a scalar: `t[:, slots] = 0` would first copy a 0-d tensor to the device, waiting for the stream."""
        self.conv.index_fill_(1, slots, 0)
        self.ssm.index_fill_(1, slots, 0)

    def reset_slot(self, slot: int) -> None:
        """`reset_slots` for one slot known on the host: no index tensor to upload."""
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one slot's GDN state (and last prompt hidden state) to another, device to device."""
        self.conv[:, dst].copy_(self.conv[:, src])
        self.ssm[:, dst].copy_(self.ssm[:, src])
        self.last_hidden[dst].copy_(self.last_hidden[src])

    def snapshot_slot(self, index: int) -> int:
        if not 0 <= index < self.num_snapshots:
            raise IndexError(f"snapshot {index} is outside the pool of {self.num_snapshots}")
        return self.num_slots + index

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one KV page (every attention layer's keys and values) to another."""
        self.k_cache[:, dst].copy_(self.k_cache[:, src])
        self.v_cache[:, dst].copy_(self.v_cache[:, src])

    def verify_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Request slots (-1: padding) as rows of the verify pools (hidden states, drafts, step states)."""
        return self._rows(slots)[1]

    def _rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Request slots (-1: padding) as rows of the state pools and of the verify-step pools (each its trash)."""
        pad = slots < 0
        return (torch.where(pad, torch.full_like(slots, self.trash_slot), slots),
                torch.where(pad, torch.full_like(slots, self.num_slots), slots))

    def commit_verified(self, slots: torch.Tensor, accepted: torch.Tensor, roll_back_pool=None) -> None:
        """After a verify step of speculative_tokens + 1 tokens a row: each slot keeps the state after its first
        `accepted` tokens (1 .. speculative_tokens + 1; the last needs no copy). Device tensors, no host sync, fixed
        shapes (a graph can hold it). `roll_back_pool`: the op (`ForwardOps.roll_back_pool`; by default the reference,
        which reads and writes every row's whole state)."""
        roll_back_pool = roll_back_pool or roll_back_pool_reference
        for pool, steps in ((self.conv, self.conv_steps), (self.ssm, self.ssm_steps)):
            roll_back_pool(pool, steps, slots, accepted, self.speculative_tokens + 1)

    def move_verify_slot(self, src: int, dst: int) -> None:
        """A request slot's last verify step (its states, to roll back to before the next one, hidden states and
        drafts) follows its request into another slot (promotion, compaction)."""
        if self.speculative_tokens:
            self.conv_steps[:, dst].copy_(self.conv_steps[:, src])
            self.ssm_steps[:, dst].copy_(self.ssm_steps[:, src])
            self.verify_hidden[dst].copy_(self.verify_hidden[src])
            self.drafts[dst].copy_(self.drafts[src])

    def nbytes(self) -> int:
        pools = [self.conv, self.ssm, self.last_hidden, self.k_cache, self.v_cache] + (
            [self.conv_steps, self.ssm_steps, self.verify_hidden, self.drafts] if self.speculative_tokens else [])
        return sum(t.numel() * t.element_size() for t in pools)


# Activation memory: what the forward needs beside the state, which the capacity plan keeps free.


def _widest_projection(cfg: ModelConfig, local: LocalSizes) -> int:
    """Widest per-rank activation row: the GDN conv channels, the attention q+gate, or the MLP gate+up (an MoE
    token's: its k experts', or the shared expert's)."""
    mlp = max(local.intermediate, cfg.num_experts_per_tok * local.moe_intermediate, local.shared_intermediate)
    return max(local.gdn_conv_dim, 2 * local.num_heads * cfg.head_dim, 2 * mlp)


def decode_activation_bytes(cfg: ModelConfig, local: LocalSizes, dtype: torch.dtype, bucket: int) -> int:
    """Activation memory a decode step of `bucket` rows needs (what a captured graph keeps), an upper estimate."""
    if bucket == 0:
        return 0
    elem = torch.tensor([], dtype=dtype).element_size()
    per_row = (8 * cfg.hidden_size + 4 * _widest_projection(cfg, local)) * elem + 3 * cfg.vocab_size * 4
    return bucket * per_row + (64 << 20)


def prefill_activation_bytes(cfg: ModelConfig, local: LocalSizes, dtype: torch.dtype, tokens: int) -> int:
    """Activations of one prefill step of `tokens` tokens (chunked GDN works 64 tokens at a time); with FP8
    weights, also the widest projection's weight dequantised for its GEMM (`kernels.fp8.linear_dequantised`)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    widest = _widest_projection(cfg, local)
    per_token = (8 * cfg.hidden_size + 6 * widest) * elem
    dequantised = widest * cfg.hidden_size * elem if cfg.fp8_block else 0
    return tokens * per_token + 4 * cfg.vocab_size * 4 * 8 + (256 << 20) + dequantised
