"""Batched sampling on rank 0's logits (DESIGN §6): penalties, greedy, temperature, top-k, top-p, min-p, logprobs.

Randomness is counter-based: row n draws uniform u[v] = hash(seed_n, token_index_n, v) for every vocabulary
id v and picks argmax(p[v] / -log(u[v])) (an exponential race, equivalent to sampling from p). A seeded row
therefore gives the same token whatever batch row or batch size it lands in; unseeded rows get a per-step seed.
The hash uses 32-bit wrapping arithmetic so a Triton kernel can reproduce it bit for bit. Filters rank the
vocabulary by logit with ties highest id first (`ranked`), as the Triton sampler does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding uint32 values (products wrap; the low bits are exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def counter_uniform(seeds: torch.Tensor, steps: torch.Tensor, ids: torch.Tensor | int) -> torch.Tensor:
    """u in (0, 1), a pure function of (seed, step, vocabulary id): [N, V] for ids = V (the whole vocabulary),
    or [N, K] for ids [N, K] (candidates only; the same values the whole-vocabulary call gives them)."""
    row = _mix32((seeds & _MASK32) ^ _mix32((steps * 0x9E3779B9) & _MASK32)) ^ (seeds >> 32 & _MASK32)
    if isinstance(ids, int):
        ids = torch.arange(ids, device=seeds.device, dtype=torch.int64)[None, :]
    return bits_to_uniform(_mix32((row[:, None] + ids.long() * 0x27D4EB2F) & _MASK32))


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32 hash bits to u in (0, 1): 23 bits, as (k + 0.5) / 2^23, which fp32 holds exactly. (With 24 bits the
    top value rounds to 1.0, and a dropped id's 0 / -log(1) is a NaN that argmax picks.)"""
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the logits' device. temperature 0 means greedy; top_k 0 means off."""

    temperature: torch.Tensor  # [N] float
    top_k: torch.Tensor  # [N] long
    top_p: torch.Tensor  # [N] float
    min_p: torch.Tensor  # [N] float
    presence_penalty: torch.Tensor  # [N] float
    frequency_penalty: torch.Tensor  # [N] float
    repetition_penalty: torch.Tensor  # [N] float
    seeds: torch.Tensor  # [N] long
    steps: torch.Tensor  # [N] long: index of the token being drawn
    output_counts: torch.Tensor | None = None  # [N, V] int: times each id was generated so far
    prompt_mask: torch.Tensor | None = None  # [N, V] bool: ids in the prompt (repetition penalty)

    def rows(self, index: torch.Tensor) -> "SamplingTensors":
        """The parameters of the given rows only."""
        return SamplingTensors(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                                  for f in fields(self)})

    @classmethod
    def filled(cls, n: int, device=None, **values) -> "SamplingTensors":
        """n rows sharing each given value (a number, or a ready [n] tensor); unset fields are neutral."""
        fields_ = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                       repetition_penalty=1.0, seeds=0, steps=0)
        fields_.update(values)
        integer = ("top_k", "seeds", "steps")
        return cls(**{name: v if isinstance(v, torch.Tensor) else
                      torch.full((n,), v, device=device, dtype=torch.long if name in integer else torch.float32)
                      for name, v in fields_.items()})


def apply_penalties(logits: torch.Tensor, p: SamplingTensors) -> torch.Tensor:
    if p.output_counts is None:
        return logits
    counts = p.output_counts.float()
    seen = counts > 0
    if p.prompt_mask is not None:
        seen = seen | p.prompt_mask
    rep = p.repetition_penalty[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - p.frequency_penalty[:, None] * counts - p.presence_penalty[:, None] * (counts > 0).float()
    return logits


def _filter_sorted(sorted_logits: torch.Tensor, p: SamplingTensors, vocab: int) -> torch.Tensor:
    """Probabilities over logits sorted in descending order at each row's temperature, with top-k, top-p and
    min-p applied (dropped entries get 0)."""
    scaled = sorted_logits / p.temperature.clamp(min=1e-5)[:, None]
    ranks = torch.arange(scaled.shape[1], device=scaled.device)[None, :]
    k = torch.where(p.top_k > 0, p.top_k.clamp(max=vocab), torch.full_like(p.top_k, vocab))
    drop = ranks >= k[:, None]
    probs = scaled.masked_fill(drop, float("-inf")).softmax(-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before = probs.cumsum(-1) - probs
    drop = drop | (before >= p.top_p[:, None])
    # min-p: drop tokens below min_p times the most likely token's probability.
    drop = drop | (probs < p.min_p[:, None] * probs[:, :1])
    return scaled.masked_fill(drop, float("-inf")).softmax(-1)


def ranked(x: torch.Tensor, k: int = 0):
    """(values, ids) of each row's k largest entries (every entry for k = 0), largest first. Tied entries go
    highest id first, as the Triton sampler ranks them: torch's sort and topk leave the order of ties open, and
    bf16 logits tie often, so which tied ids a top-k or top-p cut keeps must not be left to them."""
    V = x.shape[1]
    if not k or k >= V:
        values, flipped = x.flip(-1).sort(dim=-1, descending=True, stable=True)
        return values, V - 1 - flipped
    # Every entry tied with a row's k-th value is a candidate: enough of the largest to hold them all in any row,
    # put in id order (highest first), then stably in value order.
    values, ids = x.topk(k, dim=-1)
    wide = int((x >= values[:, -1:]).sum(-1).max())
    if wide > k:
        values, ids = x.topk(wide, dim=-1)
    ids, by_id = ids.sort(dim=-1, descending=True)
    values, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values[:, :k], ids.gather(1, order)[:, :k]


TOP_K_BOUND = 1024  # rows that all use top_k up to this sample among top-k candidates, without a full sort


def draw_tokens(logits: torch.Tensor, p: SamplingTensors, num_logprobs: int = 0, *, all_greedy: bool = False,
                max_top_k: int = 0, top_p_alone: bool = True, pdl: bool = True):
    """The sampler for the logits' device, without waiting for it: `sample_reference`'s tuple plus `done` ([N]
    int32 on CUDA, None elsewhere). On CUDA the Triton sampler draws, and rows it flags (done 0) must be drawn
    again by the reference (`kernels.triton_sampling.sample_on_gpu` does so at once; `devices.sampling` once the
    flags are on the host); elsewhere the reference draws every row. The keywords are what the host knows of
    every row, each letting a path skip work: `all_greedy` and `max_top_k` (the reference's), `top_p_alone=False`
    when no row has top-p without top-k (the Triton sampler's race rounds). `pdl`: the Triton passes' launch."""
    if logits.is_cuda:
        from .triton_sampling import TOP_P_ROUNDS, draw

        drawn = draw(logits, p, top_p_rounds=TOP_P_ROUNDS if top_p_alone else 0, pdl=pdl)
        return drawn.tokens, drawn.logprobs, *top_logprobs(logits, num_logprobs), drawn.done
    return *sample_reference(logits, p, num_logprobs, all_greedy, max_top_k if max_top_k <= TOP_K_BOUND else 0), None


def sample_reference(logits: torch.Tensor, p: SamplingTensors, num_logprobs: int = 0, all_greedy: bool = False,
                     max_top_k: int = 0):
    """Returns (tokens [N], chosen logprob [N], top ids [N, k], top logprobs [N, k]); logprobs are of the raw
    model distribution (before penalties and temperature).

    What the host knows about the rows picks the cheapest exact path: `all_greedy` skips sampling; `max_top_k`
    (every row has 1 <= top_k <= max_top_k) samples among the top max_top_k candidates instead of sorting the
    whole vocabulary, with the same uniforms, so the same tokens come out."""
    logits = logits.float()
    logprobs = logits.log_softmax(-1)
    adjusted = apply_penalties(logits, p)
    greedy = adjusted.argmax(-1)
    if all_greedy:
        return greedy, logprobs.gather(1, greedy[:, None])[:, 0], *top_logprobs(logits, num_logprobs)
    vocab = logits.shape[1]
    candidates, ids = ranked(adjusted, max_top_k)
    probs = _filter_sorted(candidates, p, vocab)
    race = probs / -torch.log(counter_uniform(p.seeds, p.steps, ids))
    sampled = ids.gather(1, race.argmax(-1, keepdim=True))[:, 0]
    tokens = torch.where(p.temperature <= 0, greedy, sampled)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0], *top_logprobs(logits, num_logprobs)


def top_logprobs(logits: torch.Tensor, k: int):
    """(ids [N, k], logprobs [N, k]) of the k most likely tokens under the raw distribution; (None, None) for 0."""
    if not k:
        return None, None
    values, ids = logits.float().topk(k, dim=-1)
    return ids, values - logits.float().logsumexp(-1, keepdim=True)


def mask_words(vocab: int) -> int:
    """int32 words of a token mask over the vocabulary (a bit a token)."""
    return (vocab + 31) // 32


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> None:
    """Bars, in place, every token a row's mask does not allow: logits [N, V]; rows [R] (long, which rows of the
    logits); mask [R, mask_words(V)] int32, bit j of word w allowing token 32 w + j (xgrammar's layout). A few
    element-wise passes over the R rows, queued without a host wait."""
    ids = torch.arange(logits.shape[1], device=logits.device)
    allowed = (mask.index_select(1, ids >> 5) >> (ids & 31).int()) & 1
    picked = logits.index_select(0, rows)
    logits.index_copy_(0, rows, picked.masked_fill(allowed == 0, float("-inf")))


def lm_like_logits(rows: int, vocab: int, device=None) -> torch.Tensor:
    """Test and benchmark logits shaped like a trained model's: a broad normal body and, per row, ten plausible
    tokens 10-20 nats above it (random-weight models give flat logits no real request sees)."""
    logits = torch.randn(rows, vocab, device=device) * 2
    picks = torch.randint(0, vocab, (rows, 10), device=device)
    return logits.scatter_add_(1, picks, torch.rand(rows, 10, device=device) * 10 + 10)
