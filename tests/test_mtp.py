"""Speculative decoding with Qwen3.5's multi-token-prediction head: the head against an oracle built from
transformers' own decoder layer."""

import pytest
import torch
from helpers import CpuRunner, hf_model, rel_err
from safetensors.torch import load_file

from deltaserve.model.weights import checkpoint_files


def mtp_oracle(ckpt: str, hf, tokens: torch.Tensor, next_token: int) -> torch.Tensor:
    """The head's logits at every position of `tokens` (with `next_token` after them), from the semantics: at
    position i, fc([norm(embed(token i+1)) | norm(the model's final hidden state at i)]), a full-attention decoder
    layer (transformers' own, with the checkpoint's mtp.layers.0 weights) over positions 0..i, the head's norm,
    lm_head."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    cfg = hf.config
    head = {}
    for path in checkpoint_files(ckpt):
        head.update({k[len("mtp."):]: v.float() for k, v in load_file(path).items() if k.startswith("mtp.")})
    layer = m.Qwen3_5DecoderLayer(cfg, layer_idx=cfg.layer_types.index("full_attention")).float().eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in head.items() if k.startswith("layers.0.")})

    def norm(name):
        n = m.Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        n.load_state_dict({"weight": head[name + ".weight"]})
        return n

    L = tokens.shape[0]
    with torch.no_grad():
        hidden = hf.model(tokens[None]).last_hidden_state[0]  # final-normed
        shifted = torch.cat([tokens[1:], torch.tensor([next_token])])
        x = torch.cat([norm("pre_fc_norm_embedding")(hf.model.embed_tokens(shifted)),
                       norm("pre_fc_norm_hidden")(hidden)], dim=-1) @ head["fc.weight"].t()
        positions = torch.arange(L).view(1, 1, L).expand(3, 1, L)
        mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
        y = layer(x[None], position_embeddings=hf.model.rotary_emb(x[None], positions), attention_mask=mask,
                  position_ids=positions[0])
        return hf.lm_head(norm("norm")(y[0]))


def test_the_mtp_head_matches_its_oracle_over_chunks_and_decode(tiny_ckpt):
    """The head over a prompt in two chunks (its KV in the pools' last layer), then two decode positions, each
    from the model's own hidden states, against the oracle over the whole sequence."""
    runner = CpuRunner(tiny_ckpt, mtp=True)
    model, state = runner.model, runner.state
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, runner.cfg.vocab_size - 1, (44,), generator=g)
    L = 40
    ours = []
    for start, stop in ((0, 23), (23, L)):  # a chunk boundary inside a page
        batch = runner.prefill_batch(0, seq[start:stop].tolist(), start)
        hidden = model.prefill_hidden(state, batch)
        ours.append(model.logits(model.mtp(seq[start + 1 : stop + 1], hidden, state, batch, prefill=True)))
    for pos in (L, L + 1):
        batch = runner.decode_batch({0: int(seq[pos])}, {0: pos})
        hidden = model.decode_hidden(state, batch)
        ours.append(model.logits(model.mtp(seq[pos + 1 : pos + 2], hidden, state, batch, prefill=False)))
    oracle = mtp_oracle(tiny_ckpt, hf_model(tiny_ckpt), seq[: L + 2], int(seq[L + 2]))
    assert rel_err(torch.cat(ours), oracle) <= 1e-4


def test_a_model_without_its_head_refuses_to_draft(tiny_ckpt):
    runner = CpuRunner(tiny_ckpt)
    batch = runner.prefill_batch(0, [1, 2, 3])
    hidden = runner.model.prefill_hidden(runner.state, batch)
    with pytest.raises(RuntimeError, match="without its MTP head"):
        runner.model.mtp(torch.tensor([2, 3, 4]), hidden, runner.state, batch, prefill=True)
