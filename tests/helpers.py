"""Shared test helpers: tiny checkpoints, the HF reference model, our model on the CPU."""

from __future__ import annotations

import asyncio

from collections import Counter

import torch

from deltaserve.model.batch import PrefillChunk, PromptChunks, StepBatch, TokenRows
from deltaserve.model.config import load_model_config
from deltaserve.model.forward import Qwen35Shard
from deltaserve.model.sharding import LocalSizes
from deltaserve.model.state import PAGE_SIZE, ModelState
from deltaserve.model.weights import load_rank_weights


def hf_model(checkpoint_dir: str, dtype=torch.float32):
    """transformers' Qwen3_5ForCausalLM with the checkpoint's text weights (the oracle)."""
    import json

    from safetensors.torch import load_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from deltaserve.model.weights import canonical_name, checkpoint_files

    with open(f"{checkpoint_dir}/config.json") as f:
        raw = json.load(f)
    text = dict(raw.get("text_config", raw))
    text.pop("model_type", None)
    text["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    config = Qwen3_5TextConfig(**text)
    config._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(config).to(dtype).eval()
    state = {}
    for path in checkpoint_files(checkpoint_dir):
        for stored, tensor in load_file(path).items():
            name = canonical_name(stored)
            if name is None or name.startswith("mtp."):  # HF's model has no MTP head
                continue
            state[name if name == "lm_head.weight" else "model." + name] = tensor.to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    assert not missing and not unexpected, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def transformers_checkpoint(out_dir: str, tokenizer_from: str, **config) -> str:
    """A random checkpoint saved by transformers itself (`save_pretrained`: its config keys, tensor names and
    layout, no MTP head), by default of odd geometry (GDN key heads of 8, value heads of 12, three attention heads
    of 24, max_position_embeddings 4096), with the tokenizer and template of `tokenizer_from`."""
    import os
    import shutil

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    geometry = dict(vocab_size=512, hidden_size=48, num_hidden_layers=8, num_attention_heads=3,
                    num_key_value_heads=1, head_dim=24, intermediate_size=80, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                    max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**geometry, **config})).eval().save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(os.path.join(tokenizer_from, name), out_dir)
    return out_dir


def hf_step(hf, ids: torch.Tensor, cache=None):
    """One forward of the HF model with its cache: (logits [1, T, V], the cache). transformers 5.25 names the
    argument and the output field `cache`; earlier releases (5.17 on the device) `past_key_values`."""
    import inspect

    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = hf(ids, use_cache=True, **({name: cache} if cache is not None else {}))
    return out.logits, getattr(out, name)


def prompt_logits(model, state, chunks: PromptChunks) -> torch.Tensor:
    """Logits at each chunk's last token (of a padded batch, the padding request's after)."""
    return model.logits(model.forward(state, StepBatch.of(chunks=chunks))[chunks.last_token])


class CpuRunner:
    """Our model on one rank with a state pool and a trivial page allocator, for tests; on the CPU unless a device
    is named."""

    def __init__(self, checkpoint_dir: str, dtype=torch.float32, num_slots: int = 16, num_pages: int = 256, tp=1,
                 rank=0, all_reduce=None, ops=None, device="cpu", mtp=False, speculative_tokens=0, keep_fp8=False,
                 expert_parallel=False):
        self.cfg = load_model_config(checkpoint_dir)
        self.device = device
        weights = load_rank_weights(checkpoint_dir, self.cfg, rank=rank, tp=tp, dtype=dtype, device=device,
                                    progress=False, mtp=mtp, keep_fp8=keep_fp8, expert_parallel=expert_parallel)
        local = LocalSizes.of(self.cfg, tp, expert_parallel)
        self.model = Qwen35Shard(self.cfg, weights, local, ops=ops, all_reduce=all_reduce,
                                 expert_start=rank * local.experts if expert_parallel else 0)
        self.state = ModelState(self.cfg, local, num_slots, num_pages, dtype, device, mtp=mtp,
                                speculative_tokens=speculative_tokens)
        self.next_page = 0
        self.pages: dict[int, list[int]] = {}

    def _ensure_pages(self, slot: int, length: int) -> list[int]:
        pages = self.pages.setdefault(slot, [])
        while len(pages) * PAGE_SIZE < length:
            pages.append(self.next_page)
            self.next_page += 1
        return pages

    def prefill(self, prompts: dict[int, list[int]], starts: dict[int, int] | None = None, all_logits=False):
        """prompts: slot -> token ids (a chunk starting at starts[slot], default 0)."""
        starts = starts or {}
        chunks = []
        for slot, ids in prompts.items():
            start = starts.get(slot, 0)
            chunks.append(PrefillChunk(list(ids), start, slot, self._ensure_pages(slot, start + len(ids))))
        batch = StepBatch.of(chunks=PromptChunks.build(chunks, PAGE_SIZE, self.state.trash_page, self.device))
        hidden = self.model.forward(self.state, batch)
        return self.model.logits(hidden if all_logits else hidden[batch.chunks.last_token])

    def prefill_batch(self, slot: int, ids: list[int], start: int = 0) -> StepBatch:
        chunk = PrefillChunk(list(ids), start, slot, self._ensure_pages(slot, start + len(ids)))
        return StepBatch.of(chunks=PromptChunks.build([chunk], PAGE_SIZE, self.state.trash_page, self.device))

    def decode_batch(self, tokens: dict[int, int], positions: dict[int, int]) -> StepBatch:
        """One token a row: slot -> its token, at positions[slot]."""
        return self.verify_batch({s: [t] for s, t in tokens.items()}, positions)

    def verify_batch(self, rows: dict[int, list[int]], starts: dict[int, int]) -> StepBatch:
        """rows: slot -> the step's tokens (slot -1: a padding row, in the trash page)."""
        slots = list(rows)
        T = len(rows[slots[0]])
        pages = [self._ensure_pages(s, starts[s] + T) if s >= 0 else [self.state.trash_page] for s in slots]
        return StepBatch.of(TokenRows.build([rows[s] for s in slots], [starts[s] if s >= 0 else 0 for s in slots],
                                            slots, pages, PAGE_SIZE, self.state.trash_page, self.device))

    def decode(self, tokens: dict[int, int], positions: dict[int, int]):
        return self.model.logits(self.model.forward(self.state, self.decode_batch(tokens, positions)))


def top8_logprob_gaps(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|our log-prob - the reference's| of each row's eight most likely reference tokens, flattened: the bf16
    gate (mean <= 0.06, 99th percentile <= 0.2)."""
    ours, ref = ours.float().log_softmax(-1), ref.float().log_softmax(-1)
    top = ref.topk(8, dim=-1).indices
    return (ours.gather(-1, top) - ref.gather(-1, top)).abs().flatten()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


async def wait_free(engine, timeout=10.0) -> bool:
    """Retirement happens at the next step: wait for it, then report whether all resources are back."""
    for _ in range(int(timeout / 0.01)):
        if engine.resources_free():
            return True
        await asyncio.sleep(0.01)
    return engine.resources_free()


class EagerPrograms:
    """The CPU's stand-in for a rank's graphs: each shape's program run eagerly, so the padded fixed-input path a
    graph replays (`RankRuntime.programs`) runs through the engine in CI. `replays`: by shape."""

    def __init__(self, programs) -> None:
        self.programs, self.stats, self.shapes = programs, {}, sorted(programs)
        self.replays = Counter()

    @classmethod
    def install(cls, runtime, shapes, prompt_requests: int = 1) -> "EagerPrograms":
        runtime.graphs = cls(runtime.programs(shapes, prompt_requests))
        return runtime.graphs

    def captured(self, shape) -> bool:
        return shape in self.programs

    def __call__(self, shape):
        self.replays[shape] += 1
        return self.programs[shape]()

    def drop(self, shapes) -> None:
        for shape in shapes:
            del self.programs[shape]
        self.shapes = sorted(self.programs)

    def destroy(self) -> None:
        pass


def flagging_every_filtered_row(monkeypatch) -> list:
    """Make rank 0's sampler return a wrong token for every sampled row with top-k or top-p and flag it, as the
    Triton sampler flags a row it cannot draw exactly: the reference must draw it again before anything reads it.
    A draw also reads as not done for its first 20 looks (about 2 ms of a worker holding it), as a GPU's would,
    so the next step is launched before this one is finished. Returns rank 0's ("launch" | "finish", seq) log."""
    import deltaserve.devices.sampling as slot_sampling
    from deltaserve.devices.rank import RankRuntime

    real = slot_sampling.draw_tokens
    order = []
    launch, finish = RankRuntime.launch, RankRuntime.finish

    def logged_launch(runtime, cmd, *args):
        if runtime.rank == 0:
            order.append(("launch", cmd.seq))
        return launch(runtime, cmd, *args)

    def logged_finish(runtime, step):
        order.append(("finish", step.cmd.seq))
        return finish(runtime, step)

    def slow_ready(draw):
        draw.looks = getattr(draw, "looks", 0) + 1
        return draw.looks > 20

    def draw_tokens(logits, p, num_logprobs=0, **kw):
        tokens, chosen, top_ids, top_lp, _ = real(logits, p, num_logprobs, **kw)
        flagged = (p.temperature > 0) & ((p.top_k > 0) | (p.top_p < 1))
        wrong = torch.where(flagged, (tokens + 1) % logits.shape[1], tokens)
        return wrong, chosen, top_ids, top_lp, (~flagged).to(torch.int32)

    monkeypatch.setattr(slot_sampling, "draw_tokens", draw_tokens)
    monkeypatch.setattr(slot_sampling.Draw, "ready", slow_ready)
    monkeypatch.setattr(RankRuntime, "launch", logged_launch)
    monkeypatch.setattr(RankRuntime, "finish", logged_finish)
    return order
