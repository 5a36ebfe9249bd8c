"""Synthetic checkpoints: a random Qwen3.5 in the real Hugging Face layout with a small trained tokenizer.

The tokenizer is a byte-level BPE trained with `tokenizers` on model/data/corpus.txt, with the Qwen special
tokens; real-size geometries keep the published vocabulary size (the tokenizer uses only its first ids).
Nothing is downloaded. The tests, the benchmarks and the demo server use it; tools/make_checkpoint.py is its CLI.
"""

from __future__ import annotations

import json
import logging
import math
import os
from importlib import resources

import torch
from safetensors.torch import save_file

from .config import ModelConfig
from .config import FP8_BLOCK
from .weights import FP8_PROJECTIONS, MTP_PREFIX, model_shapes, quantise_fp8, random_tensor

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
# As in Qwen's tokenizer, the reasoning markers are added tokens that stay in decoded text.
PLAIN_ADDED = {"<think>", "</think>"}

# Published dense geometries (DESIGN §2) and small test ones.
SIZES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                 linear_value_head_dim=16, tie_word_embeddings=False),
    # Every tensor-parallel shard non-trivial at tp = 2 and 4.
    "tiny-tp": dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                    intermediate_size=128, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                    linear_value_head_dim=8, tie_word_embeddings=False),
    # Every projection's tensor-parallel shard whole 128 x 128 blocks at tp = 2 (FP8 checkpoints).
    "tiny-fp8": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                     intermediate_size=256, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
                     linear_value_head_dim=128, tie_word_embeddings=False),
    # Every FP8 projection's scale grid at least 2 x 2 (a grid read transposed shows).
    "tiny-fp8-grid": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                          head_dim=128, intermediate_size=512, linear_num_key_heads=2, linear_num_value_heads=2,
                          linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False),
    "0.8b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                 intermediate_size=3584, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                 linear_value_head_dim=128, tie_word_embeddings=True, vocab_size=248320),
    "4b": dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
               intermediate_size=9216, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128, tie_word_embeddings=True, vocab_size=248320),
    "9b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
               intermediate_size=12288, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
               linear_value_head_dim=128, tie_word_embeddings=False, vocab_size=248320),
    "27b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                intermediate_size=17408, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                linear_value_head_dim=128, tie_word_embeddings=False, vocab_size=248320),
    # Mixture of experts (`model_type` qwen3_5_moe): every layer's MLP routed. The tiny one's experts, heads and
    # widths all shard at tp = 2 and 4, and its top 3 of 8 leaves experts unchosen in a short prompt.
    "tiny-moe": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                     linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8, linear_value_head_dim=8,
                     num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                     shared_expert_intermediate_size=48, tie_word_embeddings=False),
    # FP8 experts (and every other projection) of whole 128 x 128 blocks, kept in FP8 at tp = 1.
    "tiny-moe-fp8": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=128, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
                         linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                         shared_expert_intermediate_size=128, tie_word_embeddings=False),
    "35b-a3b": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                    linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                    shared_expert_intermediate_size=512, tie_word_embeddings=False, vocab_size=248320),
    "122b-a10b": dict(hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2,
                      head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                      linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024,
                      shared_expert_intermediate_size=1024, tie_word_embeddings=False, vocab_size=248320),
    "397b-a17b": dict(hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2,
                      head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
                      linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=1024,
                      shared_expert_intermediate_size=1024, tie_word_embeddings=False, vocab_size=248320),
}

CHAT_TEMPLATE = """{%- for message in messages -%}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if not (enable_thinking if enable_thinking is defined else THINKING_BY_DEFAULT) -%}
<think>

</think>

{% else -%}
<think>
{% endif -%}
{%- endif -%}
"""


def chat_template(thinking: bool) -> str:
    return CHAT_TEMPLATE.replace("THINKING_BY_DEFAULT", "true" if thinking else "false")


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE on the shipped corpus; the special tokens take the ids right after the learned ones."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    text = resources.files("deltaserve.model").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer)
    tok.add_tokens([AddedToken(t, special=t not in PLAIN_ADDED, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def text_config(size: str, vocab_size: int, layers: int | None = None, tied: bool | None = None) -> dict:
    geometry = dict(SIZES[size])
    geometry.setdefault("vocab_size", vocab_size)
    if layers is not None:
        geometry["num_hidden_layers"] = layers
    if tied is not None:
        geometry["tie_word_embeddings"] = tied
    n = geometry["num_hidden_layers"]
    return {
        "model_type": "qwen3_5_moe_text" if "num_experts" in geometry else "qwen3_5_text",
        **geometry,
        "mtp_num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096 if size.startswith("tiny") else 262144,
        "linear_conv_kernel_dim": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "attention_bias": False,
    }


def random_tensors(cfg: dict, seed: int, dtype: torch.dtype, mtp: bool = True):
    """Yield (canonical name, tensor) for every tensor the config needs (weights.random_tensor's init), with mtp
    the multi-token-prediction head's too."""
    mc = ModelConfig.from_dict(cfg)
    gen = torch.Generator().manual_seed(seed)
    for name, shape in model_shapes(mc, mtp).items():
        yield name, random_tensor(name, shape, mc.num_hidden_layers, gen).to(dtype)



def write_checkpoint(
    out_dir: str,
    size: str = "tiny",
    *,
    layers: int | None = None,
    dtype: str = "float32",
    sharded: int = 1,
    layout: str = "wrapper",
    tied: bool | None = None,
    seed: int = 0,
    generation: dict | None = None,
    weights: bool = True,
    mtp: bool = True,
    fp8: bool = False,
    thinking: bool = True,
    experts: str = "split",
) -> str:
    """A random checkpoint in `out_dir` (see the module doc); mtp: with the multi-token-prediction head's tensors
    (`mtp.*`, as Qwen3.5 checkpoints ship them); fp8: in Qwen's block-scaled FP8 format (`FP8_PROJECTIONS`);
    thinking: whether its chat template opens a <think> block unless `enable_thinking` is false; experts (MoE
    sizes): "split", a tensor per expert and projection as the published checkpoints store them, or "fused", the
    two 3-D tensors a layer that transformers' modules hold."""
    if experts not in ("split", "fused"):
        raise ValueError(f"experts must be 'split' or 'fused', got {experts!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if layout not in ("wrapper", "plain"):
        raise ValueError(f"layout must be 'wrapper' or 'plain', got {layout!r}")
    os.makedirs(out_dir, exist_ok=True)
    tok = train_tokenizer()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    vocab = 64 * math.ceil(tok.get_vocab_size() / 64)
    text = text_config(size, vocab, layers, tied)
    text["eos_token_id"] = ids["<|im_end|>"]
    if fp8:
        text["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                       "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                                       "modules_to_not_convert": ["lm_head", "embed_tokens", "in_proj_a", "in_proj_b", "mlp.gate",
                                                                  "shared_expert_gate",
                                                                  "conv1d", "mtp.fc"]}
    moe = "_moe" if "num_experts" in text else ""
    if layout == "wrapper":
        config = {
            "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
            "model_type": f"qwen3_5{moe}",
            "text_config": text,
            "vision_config": {"model_type": f"qwen3_5{moe}_vision", "depth": 1, "hidden_size": 8},
            "tie_word_embeddings": text["tie_word_embeddings"],
        }
        if fp8:  # the published checkpoints keep it at the top level
            config["quantization_config"] = text.pop("quantization_config")
        prefix = "model.language_model."
    else:
        config = {"architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"], **text}
        prefix = "model."
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
           "do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8}
    gen.update(generation or {})
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        # Qwen3.5's own templates think unless told not to; the demo answers in `content` (a random model never
        # closes a <think>, so its answer would all be reasoning, and an agent client would get '').
        f.write(chat_template(thinking))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                   "model_max_length": text["max_position_embeddings"]}, f, indent=2)

    if not weights:  # config and tokenizer only: serve it with load_format="random"
        log.info("wrote a %s config and tokenizer (no weights) to %s", size, out_dir)
        return out_dir
    torch_dtype = getattr(torch, dtype)
    tensors = {}
    for name, t in random_tensors(text, seed, torch_dtype, mtp):
        stored = name if name == "lm_head.weight" or name.startswith(MTP_PREFIX) else prefix + name
        for stored, t in _as_stored(stored, t, experts):
            if fp8 and stored.endswith(FP8_PROJECTIONS) and not name.startswith(MTP_PREFIX + "fc"):
                tensors[stored], tensors[stored + "_scale_inv"] = quantise_fp8(t, FP8_BLOCK)
            else:
                tensors[stored] = t
    if layout == "wrapper":  # a tower the text runtime must skip
        tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, dtype=torch_dtype)
    _save(tensors, out_dir, sharded)
    log.info("wrote a random %s checkpoint (%s, %s layout) to %s", size, dtype, layout, out_dir)
    return out_dir


def _as_stored(name: str, tensor: torch.Tensor, experts: str):
    """(stored name, tensor) pairs of a canonical tensor: an MoE layer's 3-D expert tensors, in the "split" layout,
    as a tensor per expert and projection."""
    if experts == "fused" or not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return [(name, tensor)]
    base, kind = name.rsplit(".", 1)
    if kind == "down_proj":
        return [(f"{base}.{e}.down_proj.weight", t.contiguous()) for e, t in enumerate(tensor)]
    return [(f"{base}.{e}.{proj}.weight", half.contiguous()) for e, t in enumerate(tensor)
            for proj, half in zip(("gate_proj", "up_proj"), t.chunk(2))]


def _save(tensors: dict[str, torch.Tensor], out_dir: str, shards: int) -> None:
    if shards <= 1:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for s in range(shards):
        part = names[s * per : (s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def demo_dir() -> str:
    root = os.environ.get("DELTASERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deltaserve"
    )
    return os.path.join(root, "demo-tiny")


def demo_checkpoint() -> str:
    """The demo checkpoint: a tiny random model made on first use in a cache folder, so the server runs anywhere."""
    path = demo_dir()
    if not os.path.isfile(os.path.join(path, "config.json")):
        log.info("no --model given: making the demo checkpoint (tiny, random weights) in %s", path)
        tmp = path + f".tmp{os.getpid()}"
        write_checkpoint(tmp, "tiny", thinking=False)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.rename(tmp, path)
        except OSError:  # another process made it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    template = os.path.join(path, "chat_template.jinja")
    with open(template) as f:
        stale = f.read() != chat_template(thinking=False)
    if stale:  # made by an earlier version, whose chat opened a <think> the model never closes
        with open(template, "w") as f:
            f.write(chat_template(thinking=False))
    log.info("serving the demo checkpoint at %s (random weights: its text is noise)", path)
    return path
