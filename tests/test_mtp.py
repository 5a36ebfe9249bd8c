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
        ours.append(model.logits(model.mtp(seq[start + 1 : stop + 1], hidden, state, batch)))
    for pos in (L, L + 1):
        batch = runner.decode_batch({0: int(seq[pos])}, {0: pos})
        hidden = model.decode_hidden(state, batch)
        ours.append(model.logits(model.mtp(seq[pos + 1 : pos + 2], hidden, state, batch)))
    oracle = mtp_oracle(tiny_ckpt, hf_model(tiny_ckpt), seq[: L + 2], int(seq[L + 2]))
    assert rel_err(torch.cat(ours), oracle) <= 1e-4


def test_a_model_without_its_head_refuses_to_draft(tiny_ckpt):
    runner = CpuRunner(tiny_ckpt)
    batch = runner.prefill_batch(0, [1, 2, 3])
    hidden = runner.model.prefill_hidden(runner.state, batch)
    with pytest.raises(RuntimeError, match="without its MTP head"):
        runner.model.mtp(torch.tensor([2, 3, 4]), hidden, runner.state, batch)


@pytest.mark.parametrize("accepted", [(1, 4), (2, 3), (4, 1)])
def test_a_verify_step_computes_what_decoding_its_tokens_does_and_rolls_back_to_the_accepted(tiny_ckpt, accepted):
    """Two requests and a padding row verify four tokens each; every position's logits equal one-token decodes,
    and after keeping `accepted` tokens a row decodes on as a request that decoded only those."""
    k = 3
    spec = CpuRunner(tiny_ckpt, verify_steps=k)
    g = torch.Generator().manual_seed(9)
    prompts = {0: torch.randint(0, 200, (21,), generator=g).tolist(), 1: torch.randint(0, 200, (32,), generator=g).tolist()}
    steps = {s: torch.randint(0, 200, (k + 1,), generator=g).tolist() for s in prompts}
    for s, ids in prompts.items():
        spec.prefill({s: ids})
    starts = {s: len(ids) for s, ids in prompts.items()}
    batch = spec.verify_batch({0: steps[0], -1: [5] * (k + 1), 1: steps[1]}, {**starts, -1: 0})
    verified = spec.model.logits(spec.model.verify_hidden(spec.state, batch)).view(3, k + 1, -1)
    spec.state.commit_verified(batch.slots, torch.tensor([accepted[0], 1, accepted[1]]))
    for row, s in ((0, 0), (2, 1)):
        plain = CpuRunner(tiny_ckpt)
        plain.prefill({s: prompts[s]})
        for t, token in enumerate(steps[s]):
            expected = plain.decode({s: token}, {s: starts[s] + t})
            assert rel_err(verified[row, t], expected[0]) <= 1e-5, (s, t)
        # Roll-back: the next token after the accepted ones, on both.
        plain = CpuRunner(tiny_ckpt)
        plain.prefill({s: prompts[s] + steps[s][: accepted[row // 2]]})
        nxt, pos = 7, starts[s] + accepted[row // 2]
        assert rel_err(spec.decode({s: nxt}, {s: pos}), plain.decode({s: nxt}, {s: pos})) <= 1e-5, s


def test_the_verify_step_and_the_head_on_the_triton_ops_match_the_references(tiny_ckpt):
    """The Triton ops (interpreted on the CPU) take the verify's strided token views and the head's layer."""
    from deltaserve.kernels.ops import triton_ops

    k, prompt, step = 2, list(range(3, 22)), [40, 41, 42]
    results = []
    for ops in (None, triton_ops()):
        runner = CpuRunner(tiny_ckpt, ops=ops, mtp=True, verify_steps=k)
        runner.prefill({0: prompt})
        batch = runner.verify_batch({0: step, -1: [1] * (k + 1)}, {0: len(prompt), -1: 0})
        hidden = runner.model.verify_hidden(runner.state, batch)
        head = runner.model.mtp(batch.input_ids.roll(-1), hidden, runner.state, batch)
        runner.state.commit_verified(batch.slots, torch.tensor([2, 1]))
        results.append((runner.model.logits(hidden), runner.model.logits(head), runner.state.ssm[:, 0].clone()))
    for ours, ref in zip(results[1], results[0]):
        assert rel_err(ours, ref) <= 1e-4
