"""Batched sampling semantics (DESIGN §6) on the torch reference."""

import pytest
import torch

from deltaserve.kernels.sampling import SamplingTensors, bits_to_uniform, counter_uniform, sample_reference


def params(n, **kw):
    return SamplingTensors.filled(n, **kw)


def test_uniforms_are_in_range_and_depend_only_on_seed_step_and_id():
    u = counter_uniform(torch.tensor([1, 2, 1]), torch.tensor([5, 5, 5]), 1000)
    assert (u > 0).all() and (u < 1).all()
    extremes = bits_to_uniform(torch.tensor([0, 0xFFFFFFFF]))
    assert extremes[0] > 0 and extremes[1] < 1  # strictly inside, in fp32
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert abs(u.mean().item() - 0.5) < 0.02


def test_filters_that_leave_one_token_equal_greedy():
    logits = torch.randn(4, 300)
    best = logits.argmax(-1)
    for kw in (dict(temperature=0.0), dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        for seed in range(5):
            tokens, *_ = sample_reference(logits, params(4, seeds=seed, **kw))
            assert torch.equal(tokens, best), kw


def test_ties_rank_highest_id_first_in_every_path():
    """torch's sort and topk leave the order of ties open; the reference fixes it (the Triton sampler's order),
    so a cut through tied logits keeps the same ids in the full sort and the top-k path."""
    from deltaserve.kernels.sampling import ranked

    x = (torch.randn(5, 400) * 4).round() / 2  # a coarse grid: every value is shared by many ids
    expected = [sorted(range(400), key=lambda i, row=row: (-row[i], -i)) for row in x.tolist()]
    values, ids = ranked(x)
    assert ids.tolist() == expected and torch.equal(values, x.gather(1, ids))
    for k in (1, 7, 50):
        values, ids = ranked(x, k)
        assert ids.tolist() == [e[:k] for e in expected] and torch.equal(values, x.gather(1, ids))
    p = params(5, top_k=torch.tensor([3, 7, 20, 50, 50]), top_p=0.8, seeds=torch.arange(5))
    assert torch.equal(sample_reference(x, p)[0], sample_reference(x, p, max_top_k=50)[0])


def test_sampling_follows_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    n = 4000
    counts = torch.zeros(5)
    for s in range(n):
        tok, *_ = sample_reference(logits, params(1, temperature=0.7, seeds=s, steps=3))
        counts[tok] += 1
    expected = (logits[0] / 0.7).softmax(-1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 20, (counts, expected)  # 4 dof: p < 0.001


def test_top_k_top_p_min_p_only_draw_kept_tokens():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -2.0]])
    probs = logits.softmax(-1)[0]
    seen = {"k": set(), "p": set(), "m": set()}
    for s in range(400):
        seen["k"].add(int(sample_reference(logits, params(1, top_k=2, seeds=s))[0]))
        seen["p"].add(int(sample_reference(logits, params(1, top_p=0.6, seeds=s))[0]))
        seen["m"].add(int(sample_reference(logits, params(1, min_p=0.5, seeds=s))[0]))
    assert seen["k"] == {0, 1}
    assert seen["p"] == {0, 1} and probs[0] < 0.6 <= probs[:2].sum()
    assert seen["m"] == {i for i in range(6) if probs[i] >= 0.5 * probs[0]}


def test_a_seeded_row_ignores_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(9, 500)
    seeds = torch.arange(100, 109)
    steps = torch.arange(9) * 3
    batch, *_ = sample_reference(logits, params(9, seeds=seeds, steps=steps, temperature=1.3, top_p=0.9))
    for i in range(9):
        alone, *_ = sample_reference(logits[i : i + 1], params(1, seeds=seeds[i : i + 1], steps=steps[i : i + 1],
                                                     temperature=1.3, top_p=0.9))
        assert alone.item() == batch[i].item()


def test_penalties_push_away_from_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0, -3.0]])
    counts = torch.tensor([[3, 0, 0, 0]], dtype=torch.int32)
    p = params(1, temperature=0.0, frequency_penalty=0.1)
    p.output_counts, p.prompt_mask = counts, torch.zeros(1, 4, dtype=torch.bool)
    assert sample_reference(logits, p)[0].item() == 1  # 2.0 - 0.3 < 1.9
    p = params(1, temperature=0.0, presence_penalty=0.05)
    p.output_counts, p.prompt_mask = counts, torch.zeros(1, 4, dtype=torch.bool)
    assert sample_reference(logits, p)[0].item() == 0  # 2.0 - 0.05 > 1.9
    p = params(1, temperature=0.0, repetition_penalty=1.2)
    p.output_counts = torch.zeros(1, 4, dtype=torch.int32)
    p.prompt_mask = torch.tensor([[True, False, False, False]])
    assert sample_reference(logits, p)[0].item() == 1  # 2.0 / 1.2 < 1.9


def test_logprobs_are_the_raw_distribution():
    logits = torch.randn(3, 50)
    tokens, chosen, top_ids, top_lp = sample_reference(logits, params(3, temperature=0.5, seeds=1), num_logprobs=4)
    ref = logits.log_softmax(-1)
    assert torch.allclose(chosen, ref.gather(1, tokens[:, None])[:, 0])
    assert torch.equal(top_ids, ref.topk(4).indices) and torch.allclose(top_lp, ref.topk(4).values)


def test_the_top_k_fast_path_draws_the_same_tokens_as_the_full_sort():
    torch.manual_seed(3)
    logits = torch.randn(6, 2000) * 3
    top_k = torch.tensor([1, 5, 20, 50, 50, 7])
    for seed in range(30):
        p = params(6, temperature=0.9, top_k=top_k, top_p=0.8, min_p=0.01, seeds=torch.arange(6) + 100 * seed,
                   steps=torch.full((6,), seed))
        full, *_ = sample_reference(logits, p)
        fast, *_ = sample_reference(logits, p, max_top_k=50)
        assert torch.equal(full, fast)
    greedy_flag, *_ = sample_reference(logits, params(6, temperature=0.0), all_greedy=True)
    assert torch.equal(greedy_flag, logits.argmax(-1))


# The Triton sampler (kernels/triton_sampling.py) draws what the reference draws -------------------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _draw_module():
    from deltaserve.kernels import triton_sampling

    return triton_sampling


MIXED_ROWS = dict(  # one batch holding every mode: greedy, plain, min-p, top-k + top-p, top-p, top-k, penalties
    temperature=torch.tensor([0.0, 1.0, 0.9, 0.7, 0.5, 0.8]),
    top_k=torch.tensor([0, 0, 0, 20, 0, 5]),
    top_p=torch.tensor([1.0, 1.0, 1.0, 0.8, 0.6, 1.0]),
    min_p=torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.02]),
)


def test_the_triton_sampler_draws_the_reference_tokens_and_logprobs():
    T = _draw_module()
    n, vocab = 6, 3000
    for trial in range(6):
        logits = torch.randn(n, vocab, device=DEVICE) * (2 + trial % 4)
        if trial >= 4:  # peaked: 30 ids far above a body that falls in the histogram's last bin (32+ nats down)
            picks = torch.randperm(vocab, device=DEVICE)[:30].expand(n, 30)
            logits.scatter_add_(1, picks, 25 + 10 * torch.rand(n, 30, device=DEVICE))
        p = params(n, device=DEVICE, seeds=torch.randint(0, 2**62, (n,), device=DEVICE),
                   steps=torch.randint(0, 1000, (n,), device=DEVICE),
                   **{k: v.to(DEVICE) for k, v in MIXED_ROWS.items()})
        if trial % 2:  # penalties change the sampled distribution but not the logprobs
            p.output_counts = torch.randint(0, 3, (n, vocab), device=DEVICE, dtype=torch.int32)
            p.prompt_mask = torch.rand(n, vocab, device=DEVICE) < 0.1
            p.repetition_penalty.fill_(1.3)
            p.frequency_penalty.fill_(0.2)
        got = T.draw(logits, p, splits=3, max_candidates=64)
        tokens, chosen, *_ = sample_reference(logits, p)
        assert got.done.tolist() == [1] * n
        assert torch.equal(got.tokens, tokens), (trial, got.tokens, tokens)
        assert torch.allclose(got.logprobs, chosen, atol=1e-5)


def test_rows_without_top_k_or_top_p_race_at_their_temperature():
    """Tempered rows with no filter, or min-p alone, race every id they keep, on s = logit / T: each draws the
    reference's token at temperatures either side of 1."""
    T = _draw_module()
    n, vocab = 16, 3000
    logits = torch.randn(n, vocab, device=DEVICE) * 3
    temperature = torch.tensor([0.5, 1.3, 2.0, 0.8], device=DEVICE).repeat(4)
    min_p = torch.tensor([0.0] * 12 + [0.01] * 4, device=DEVICE)
    for step in range(2):
        p = params(n, device=DEVICE, temperature=temperature, min_p=min_p, seeds=torch.arange(n, device=DEVICE) + 9,
                   steps=torch.full((n,), step, device=DEVICE))
        got = T.draw(logits, p, splits=3)
        assert got.done.tolist() == [1] * n
        assert torch.equal(got.tokens, sample_reference(logits, p)[0]), step


def test_a_row_whose_candidates_overflow_is_flagged_for_the_reference():
    T = _draw_module()
    logits = torch.randn(4, 2000, device=DEVICE) * 0.01  # nearly flat: top-p 0.9 keeps ~1800 ids
    logits[0] = logits[3] = 0.5  # exactly flat: all 2000 ids tie at the top-p boundary or the top-k threshold
    p = params(4, device=DEVICE, top_p=torch.tensor([0.9, 0.9, 1.0, 1.0], device=DEVICE),
               top_k=torch.tensor([0, 0, 3, 3], device=DEVICE), seeds=7)
    got = T.draw(logits, p, splits=2, max_candidates=64)
    # 2000 tied ids overflow 64 candidates; the nearly flat rows' boundaries are placed (top-p: by the refine)
    assert got.done.tolist() == [0, 1, 1, 0]
    tokens, *_ = sample_reference(logits, p)
    assert torch.equal(got.tokens[1:3], tokens[1:3])
    assert torch.equal(T.sample_on_gpu(logits, p, max_candidates=64)[0], tokens)  # flagged rows: the reference


def test_top_p_race_rounds_settle_rows_exactly_and_leave_the_rest_to_the_histogram():
    """A top-p-alone row races all its ids; the winner is its token if top-p keeps it, and if not the next round
    races only the ids above it. Rows the rounds do not settle (top-p 0.3 fails a round about 70% of the time)
    take the histogram passes. Every row draws the reference's token, whatever the number of rounds."""
    T = _draw_module()
    n, vocab = 32, 3000
    logits = torch.randn(n, vocab, device=DEVICE) * torch.linspace(0.5, 4, n, device=DEVICE)[:, None]
    settled_by_rounds = 0
    for step in range(3):
        p = params(n, device=DEVICE, top_p=torch.tensor([0.3, 0.3, 0.3, 0.8], device=DEVICE).repeat(n // 4),
                   temperature=torch.tensor([0.7, 1.3], device=DEVICE).repeat(n // 2),
                   min_p=torch.tensor([0.0] * (n - 4) + [0.05] * 4, device=DEVICE),
                   seeds=torch.randint(0, 2**62, (n,), device=DEVICE), steps=torch.full((n,), step, device=DEVICE))
        tokens, chosen, *_ = sample_reference(logits, p)
        # Rounds after the first walk the rows left, 4 programs to a row (blocks of 1024 ids), or 16 (of 256).
        settled_after = {}
        cases = ((0, 1024), (T.TOP_P_ROUNDS, 1024))
        if not step:
            cases += ((1, 1024), (3, 1024), (3, 256))
        for rounds, block in cases:
            got = T.draw(logits, p, splits=3, top_p_rounds=rounds, block=block)
            assert got.done.tolist() == [1] * n
            assert torch.equal(got.tokens, tokens), (step, rounds, block)
            assert torch.allclose(got.logprobs, chosen, atol=1e-5)
            settled = got.settled >= 0
            assert torch.equal(got.tokens[settled], got.settled[settled].long())
            if rounds == T.TOP_P_ROUNDS and block == 1024:
                settled_by_rounds += int(settled.sum())
            settled_after[rounds, block] = int(settled.sum())
        if not step:  # the later rounds settle rows the first one left (the rows they race are listed right)
            assert settled_after[1, 1024] < settled_after[3, 1024] and settled_after[1, 1024] < settled_after[3, 256]
    assert 0 < settled_by_rounds < 3 * n


def test_the_host_knows_which_rows_take_the_race_rounds():
    T = _draw_module()
    assert T.top_p_alone(1.0, 0.9, 0, 1000) and T.top_p_alone(0.7, 0.9, 1000, 1000)  # top-k of the whole vocab
    assert not T.top_p_alone(0.0, 0.9, 0, 1000)  # greedy
    assert not T.top_p_alone(1.0, 1.0, 0, 1000)  # no top-p
    assert not T.top_p_alone(1.0, 0.9, 20, 1000)  # top-k first


def test_the_passes_run_twice_the_programs_when_the_race_rounds_run(monkeypatch):
    """A row the race rounds leave takes the histogram passes about alone, so `draw` asks for twice the programs
    a row when the rounds run; never a split of fewer than 8 blocks."""
    T = _draw_module()
    dev = torch.device(DEVICE)
    rows = T.multiprocessors(dev)  # 4 programs a row without the rounds, below every cap
    assert T.default_splits(rows, 248320, dev) == 4 and T.default_splits(rows, 248320, dev, top_p_rounds=True) == 8
    assert T.default_splits(rows, 8 * T.BLOCK, dev, top_p_rounds=True) == 1
    asked, default_splits = [], T.default_splits
    monkeypatch.setattr(T, "default_splits", lambda rows, vocab, device, top_p_rounds=False: asked.append(
        top_p_rounds) or default_splits(rows, vocab, device, top_p_rounds))
    logits = torch.randn(2, 3000, device=DEVICE)
    for rounds in (0, T.TOP_P_ROUNDS):
        T.draw(logits, params(2, device=DEVICE, top_p=0.9, seeds=1), top_p_rounds=rounds)
    assert asked == [False, True]


def test_a_top_p_boundary_that_depends_on_tie_order_is_left_to_the_histogram():
    """All ids tie: which of them top-p keeps depends on how a sort orders ties, so no race round settles the row."""
    T = _draw_module()
    logits = torch.full((2, 500), 0.25, device=DEVICE)
    got = T.draw(logits, params(2, device=DEVICE, top_p=0.5, seeds=3), splits=2)
    assert got.settled.tolist() == [-2, -2]


def test_tied_logits_draw_the_reference_tokens():
    """bf16 logits tie often; where a top-k or top-p cut falls inside a tie, the kernels and the reference keep
    the same tied ids (highest id first). The last four rows have 40 ids tied far above the rest, so their cuts
    keep half the tie or less: the other order would keep other ids."""
    T = _draw_module()
    n, vocab = 16, 1500
    for step in range(2):
        logits = (torch.randn(n, vocab, device=DEVICE) * 12).round() / 4  # every value shared by ~50 ids
        logits[12:] = torch.randn(4, vocab, device=DEVICE) - 20
        logits[12:, torch.randperm(vocab, device=DEVICE)[:40]] = 5.0
        p = params(n, device=DEVICE, seeds=torch.randint(0, 2**62, (n,), device=DEVICE),
                   steps=torch.full((n,), step, device=DEVICE),
                   top_k=torch.tensor([0, 5, 20, 0] * 3 + [20, 0, 5, 0], device=DEVICE),
                   top_p=torch.tensor([0.5, 1.0, 0.9, 0.95] * 3 + [1.0, 0.3, 1.0, 0.5], device=DEVICE),
                   temperature=torch.tensor([1.0, 0.8], device=DEVICE).repeat(8))
        got = T.draw(logits, p, splits=3)
        assert got.done.tolist() == [1] * n
        assert torch.equal(got.tokens, sample_reference(logits, p)[0]), step


def test_top_k_rows_draw_the_reference_tokens_however_spread_their_top_is():
    """Top-k rows take their candidates from a threshold on per-lane maxima, whether the k-th id is a fraction of
    a nat below the max or many nats, with one split or several, and with k up to LANE_TOP_K."""
    T = _draw_module()
    vocab = 3000
    logits = torch.stack([torch.randn(vocab, device=DEVICE),  # the 20th id ~1 nat down
                          -0.5 * torch.randperm(vocab, device=DEVICE).float(),  # the 20th id 9.5 nats down
                          torch.randn(vocab, device=DEVICE) * 8])
    top_k = torch.tensor([20, 20, T.LANE_TOP_K.value], device=DEVICE)
    for splits in (1, 3):
        for step in range(2):
            p = params(3, device=DEVICE, top_k=top_k, top_p=0.9, temperature=0.8, seeds=step + 11,
                       steps=torch.full((3,), step, device=DEVICE))
            got = T.draw(logits, p, splits=splits, max_candidates=512)
            assert got.done.tolist() == [1, 1, 1]
            assert torch.equal(got.tokens, sample_reference(logits, p)[0]), (splits, step)


def test_top_p_keeps_more_ids_than_it_copies():
    """Bins surely inside the nucleus are raced where they lie; only the band the histogram can't place is copied."""
    T = _draw_module()
    from deltaserve.kernels.sampling import _filter_sorted

    n, vocab = 4, 3000
    logits = torch.randn(n, vocab, device=DEVICE)
    p = params(n, device=DEVICE, top_p=0.5, seeds=torch.arange(n, device=DEVICE) + 5,
               steps=torch.arange(n, device=DEVICE))
    kept = (_filter_sorted(logits.sort(descending=True).values, p, vocab) > 0).sum(-1)
    assert (kept > 256).all()  # the nucleus is larger than the candidate buffer
    got = T.draw(logits, p, splits=3, max_candidates=256)
    assert got.done.tolist() == [1] * n
    assert torch.equal(got.tokens, sample_reference(logits, p)[0])


def test_top_p_alone_over_a_broad_body_is_refined_not_left_to_the_reference():
    """Top-p 0.95 on a broad body puts thousands of ids between the 1/16-nat bins' mass bounds; the refine pass's
    exact masses and finer slices narrow that to a band that fits in 64 candidates."""
    T = _draw_module()
    n, vocab = 6, 3000
    logits = torch.randn(n, vocab, device=DEVICE) * 2
    logits[:3, :5] += 8.0  # a few plausible tokens above the body, as a trained model has
    for step in range(2):
        p = params(n, device=DEVICE, top_p=0.95, seeds=torch.arange(n, device=DEVICE) + 3,
                   steps=torch.full((n,), step, device=DEVICE))
        got = T.draw(logits, p, splits=3, max_candidates=64)
        assert got.done.tolist() == [1] * n
        assert torch.equal(got.tokens, sample_reference(logits, p)[0]), step


def test_top_p_keeps_exactly_the_reference_nucleus():
    """The two ids either side of the nucleus boundary, 1e-5 apart in logit, get the two largest race bonuses
    (-log -log u), in a layout where the reference draws the last id it keeps and would draw the first one it
    drops had it kept it: keeping one id too many, or one too few, changes the token."""
    T = _draw_module()
    from deltaserve.kernels.sampling import _filter_sorted

    vocab = 3000
    for top_p in (0.9, 0.5):
        for seed in range(200):
            p = params(1, device=DEVICE, top_p=top_p, temperature=1.0, seeds=seed)
            values = (torch.randn(vocab, device=DEVICE) * 0.2).sort(descending=True).values
            kept = int((_filter_sorted(values[None], p, vocab) > 0).sum())
            values[kept] = values[kept - 1] - 1e-5  # the first id dropped all but ties the last kept
            mass_before = values.softmax(0).cumsum(0)
            if kept != int((_filter_sorted(values[None], p, vocab) > 0).sum()) or \
                    not mass_before[kept - 2] < top_p - 1e-5 < top_p + 1e-5 < mass_before[kept - 1]:
                continue  # float sums could move a boundary this close to top_p
            by_bonus = counter_uniform(p.seeds, p.steps, vocab)[0].argsort(descending=True)
            rest = by_bonus[2:][torch.randperm(vocab - 2, device=DEVICE)]
            logits = torch.empty(1, vocab, device=DEVICE)
            logits[0, torch.cat([rest[:kept - 1], by_bonus[1:2], by_bonus[0:1], rest[kept - 1:]])] = values
            one_more = params(1, device=DEVICE, top_p=float(mass_before[kept - 1]) + 1e-6, seeds=seed)
            if sample_reference(logits, p)[0][0] == by_bonus[1] and sample_reference(logits, one_more)[0][0] == by_bonus[0]:
                break
        else:
            raise AssertionError("no layout found")
        for cands in (512, 64):  # the bins place the band, or the refine pass's slices do
            got = T.draw(logits, p, splits=3, max_candidates=cands)
            assert got.done.tolist() == [1] and got.tokens[0] == by_bonus[1], (top_p, cands)


def test_more_splits_than_the_passes_combine_is_refused():
    T = _draw_module()
    with pytest.raises(ValueError, match="MAX_SPLITS"):
        T.draw(torch.randn(2, 500, device=DEVICE), params(2, device=DEVICE), splits=T.MAX_SPLITS + 1)


def test_the_sampler_compiles_every_batch_size_class_once(monkeypatch):
    """At start-up the engine draws once per class of batch sizes that compiles the passes anew (the splits per
    row, a power of two, follow the rows), with and without the race rounds: every batch size up to the most is
    covered, none twice."""
    T = _draw_module()
    dev = torch.device(DEVICE)
    vocab = 64 * T.BLOCK  # enough blocks that the rows decide the splits
    drawn, real_draw = [], T.draw

    def recording(logits, p, top_p_rounds, pdl):
        if not drawn:  # one real draw: the arguments are the sampler's (narrowed: the interpreter is slow)
            real_draw(logits[:, :3000].contiguous(), p, top_p_rounds=top_p_rounds, pdl=pdl)
        drawn.append((logits.shape[0], top_p_rounds))

    monkeypatch.setattr(T, "draw", recording)
    count = T.compile_for_batches(40, vocab, torch.float32, dev)
    assert count == len(drawn) == len(set(drawn))
    for rounds in (0, T.TOP_P_ROUNDS):
        wanted = {T.triton.next_power_of_2(T.default_splits(n, vocab, dev, rounds > 0)) for n in range(1, 41)}
        got = {T.triton.next_power_of_2(T.default_splits(n, vocab, dev, rounds > 0)) for n, r in drawn if r == rounds}
        assert got == wanted and len(wanted) > 1
