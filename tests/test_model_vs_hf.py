"""Our CPU forward against transformers' Qwen3_5ForCausalLM on a tiny random checkpoint (DESIGN §2)."""

import pytest
import torch
from helpers import CpuRunner, hf_model, hf_step, rel_err, top8_logprob_gaps

from deltaserve.model.weights import load_rank_weights

LENGTHS = [1, 5, 63, 64, 65, 130]


@pytest.fixture(scope="module")
def hf(tiny_ckpt):
    return hf_model(tiny_ckpt)


@pytest.fixture(scope="module")
def prompts(tiny_ckpt):
    gen = torch.Generator().manual_seed(1234)
    return {n: torch.randint(0, 500, (n,), generator=gen).tolist() for n in LENGTHS}


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_tiny_checkpoint_exercises_both_layer_kinds(tiny_ckpt):
    runner = CpuRunner(tiny_ckpt)
    assert len(runner.cfg.layer_types) >= 8
    assert len(runner.cfg.attention_layers) >= 2 and len(runner.cfg.gdn_layers) >= 2
    # Norm weights are random, so the (1 + w) form, and its folding into the projections, is actually tested.
    stored = load_rank_weights(tiny_ckpt, runner.cfg, progress=False)
    assert stored["layers.0.input_layernorm.weight"].abs().max() > 0.05
    assert stored["layers.0.post_attention_layernorm.weight"].abs().max() > 0.05
    assert not any(name.endswith("layernorm.weight") for name in runner.model.w)  # folded


@pytest.mark.parametrize("n", LENGTHS)
def test_prefill_logits_match_hf(tiny_ckpt, hf, prompts, n):
    runner = CpuRunner(tiny_ckpt)
    ours = runner.prefill({0: prompts[n]}, all_logits=True)
    assert rel_err(ours, hf_logits(hf, prompts[n])) <= 1e-4


def test_packed_batch_of_mixed_lengths_matches_hf(tiny_ckpt, hf, prompts):
    runner = CpuRunner(tiny_ckpt)
    ours = runner.prefill({slot: prompts[n] for slot, n in enumerate(LENGTHS)}, all_logits=True)
    offset = 0
    for n in LENGTHS:
        assert rel_err(ours[offset : offset + n], hf_logits(hf, prompts[n])) <= 1e-4, n
        offset += n


def test_prefill_then_decode_matches_hf_with_cache(tiny_ckpt, hf, prompts):
    runner = CpuRunner(tiny_ckpt)
    prompt_a, prompt_b = prompts[65], prompts[5]
    ours = runner.prefill({0: prompt_a, 3: prompt_b})
    caches, tokens = {}, {}
    for slot, prompt in ((0, prompt_a), (3, prompt_b)):
        logits, caches[slot] = hf_step(hf, torch.tensor([prompt]))
        tokens[slot] = int(logits[0, -1].argmax())
    assert tokens == {0: int(ours[0].argmax()), 3: int(ours[1].argmax())}
    positions = {0: len(prompt_a), 3: len(prompt_b)}
    for _ in range(32):
        ours = runner.decode(tokens, positions)  # both requests in one batched step
        for row, slot in enumerate(tokens):
            logits, caches[slot] = hf_step(hf, torch.tensor([[tokens[slot]]]), caches[slot])
            assert rel_err(ours[row], logits[0, -1]) <= 1e-4
        tokens = {slot: int(ours[row].argmax()) for row, slot in enumerate(tokens)}
        positions = {slot: p + 1 for slot, p in positions.items()}


@pytest.mark.parametrize("cuts", [[70], [20, 97]])
def test_chunked_prefill_equals_one_piece(tiny_ckpt, prompts, cuts):
    prompt = prompts[130]
    whole = CpuRunner(tiny_ckpt)
    expected = whole.prefill({2: prompt})
    pieces = CpuRunner(tiny_ckpt)
    bounds = [0, *cuts, len(prompt)]
    for start, stop in zip(bounds, bounds[1:]):
        got = pieces.prefill({2: prompt[start:stop]}, starts={2: start})
    assert rel_err(got, expected) <= 1e-4
    assert rel_err(pieces.state.ssm[:, 2], whole.state.ssm[:, 2]) <= 1e-4
    assert rel_err(pieces.state.conv[:, 2], whole.state.conv[:, 2]) <= 1e-4
    n = len(prompt)
    for cache in ("k_cache", "v_cache"):
        ours = getattr(pieces.state, cache)[:, pieces.pages[2]].flatten(1, 2)[:, :n]
        ref = getattr(whole.state, cache)[:, whole.pages[2]].flatten(1, 2)[:, :n]
        assert rel_err(ours, ref) <= 1e-4


def greedy(runner: CpuRunner, prompt: list[int], steps: int) -> list[int]:
    logits = runner.prefill({0: prompt})
    out = [int(logits[0].argmax())]
    for i in range(steps - 1):
        logits = runner.decode({0: out[-1]}, {0: len(prompt) + i})
        out.append(int(logits[0].argmax()))
    return out


def test_greedy_continuation_matches_hf_generate(tiny_ckpt, hf, prompts):
    for n in (1, 5, 64, 130):
        prompt = prompts[n]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert greedy(CpuRunner(tiny_ckpt), prompt, 32) == ref[0, n:].tolist(), n


def test_bf16_stays_within_the_gate(tiny_ckpt, hf, prompts):
    runner = CpuRunner(tiny_ckpt, dtype=torch.bfloat16)
    deltas = []
    for n in (5, 65, 130):
        deltas.append(top8_logprob_gaps(runner.prefill({0: prompts[n]}, all_logits=True), hf_logits(hf, prompts[n])))
        runner = CpuRunner(tiny_ckpt, dtype=torch.bfloat16)
    d = torch.cat(deltas)
    assert d.mean() <= 0.06 and d.quantile(0.99) <= 0.2, (d.mean(), d.quantile(0.99))


def test_tied_checkpoint_matches_hf(tmp_path, prompts):
    from deltaserve.model.synthetic import write_checkpoint

    ckpt = write_checkpoint(str(tmp_path), "tiny", tied=True, seed=5)
    runner = CpuRunner(ckpt)
    assert runner.cfg.tie_word_embeddings
    assert runner.model.w["lm_head.weight"] is runner.model.w["embed_tokens.weight"]
    ours = runner.prefill({0: prompts[65]}, all_logits=True)
    assert rel_err(ours, hf_logits(hf_model(ckpt), prompts[65])) <= 1e-4


def test_triton_forward_matches_the_reference(tiny_ckpt, prompts):
    """The whole forward on the Triton ops (the interpreter on the CPU), one-row GEMV included, against the
    reference ops."""
    from deltaserve.kernels.ops import triton_ops

    ours, ref = CpuRunner(tiny_ckpt, ops=triton_ops()), CpuRunner(tiny_ckpt)
    prompt_a, prompt_b = prompts[5], prompts[63]
    assert rel_err(ours.prefill({0: prompt_a}), ref.prefill({0: prompt_a})) <= 1e-4
    assert rel_err(ours.prefill({3: prompt_b}), ref.prefill({3: prompt_b})) <= 1e-4
    tokens, positions = {0: 7}, {0: len(prompt_a)}
    for step in range(3):
        if step == 1:  # a second row joins
            tokens[3], positions[3] = 11, len(prompt_b)
        got, expected = ours.decode(tokens, positions), ref.decode(tokens, positions)
        assert rel_err(got, expected) <= 1e-4, step
        tokens = {slot: int(expected[row].argmax()) for row, slot in enumerate(tokens)}
        positions = {slot: p + 1 for slot, p in positions.items()}
