"""Engine arguments: one table (`OPTIONS`) gives each its group, default, valid values, help and command-line
flags. `EngineArgs` (the embedded API) is validated by it when made, and `deltaserve serve` builds its engine flags
from it (`runtime.cli`), so a value means the same and is refused with the same words everywhere: a bad one raises
ValueError naming the field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deltaserve.kernels.config import KernelConfig

MAX_SPECULATIVE_TOKENS = 8
GROUPS = ("model", "parallel", "cache", "scheduler", "speculative", "kernels", "runtime")  # the help's sections


@dataclass(frozen=True)
class Option:
    """One engine argument. Valid values: `kind` (bool, int, float, str), None where `optional`, one of `choices`,
    and within [low, high] (`above`: low itself excluded; `zero_off`: 0 valid too, meaning off). `flags`: its
    command-line spellings, vLLM's first (none: not a flag); `help`: what the flag's help says."""

    name: str
    group: str
    kind: type
    help: str
    flags: tuple[str, ...] = ()
    optional: bool = False
    choices: tuple | None = None
    low: float | None = None
    high: float | None = None
    above: bool = False
    zero_off: bool = False
    metavar: str | None = None

    @property
    def valid(self) -> str:
        """What a valid value is, in words (the end of an error message)."""
        if self.kind is bool:
            what = "True or False"
        elif self.choices:
            what = "one of " + ", ".join(map(repr, self.choices))
        else:
            noun = {int: "an integer", float: "a number", str: "a string"}.get(self.kind, f"a {self.kind.__name__}")
            if self.low is not None and self.high is not None:
                what = f"{noun} in {'(' if self.above else '['}{self.low}, {self.high}]"
            elif self.low is not None:
                what = f"{noun} {'above' if self.above else '>='} {self.low}"
            else:
                what = noun
            if self.zero_off:
                what += ", or 0 (off)"
        return what + (", or None" if self.optional else "")

    def check(self, value) -> None:
        """Raise ValueError naming the field unless `value` is valid."""
        if value is None and self.optional:
            return
        ok = isinstance(value, self.kind) and not (self.kind is not bool and isinstance(value, bool))
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if ok and self.choices is not None:
            ok = value in self.choices
        if ok and self.kind in (int, float) and not (self.zero_off and value == 0):
            ok = value == value and (self.low is None or (value > self.low if self.above else value >= self.low)) \
                and (self.high is None or value <= self.high)
        if not ok:
            raise ValueError(f"{self.name} must be {self.valid}, got {value!r}")


def _option(name: str, group: str, kind: type, help: str, *flags: str, **limits) -> Option:
    return Option(name, group, kind, help, flags, **limits)


# The engine arguments a user may set, by group. Defaults are EngineArgs' own (below); a field whose command line
# is not a plain flag (the checkpoint, the dtype's "auto", the graphs' inverted switch, speculation's two
# spellings, the warm-up switch) is parsed by runtime.cli and checked here all the same.
OPTIONS: dict[str, Option] = {o.name: o for o in (
    _option("model", "model", str, "checkpoint folder (config.json, *.safetensors, tokenizer.json); by default a "
            "tiny demo checkpoint", optional=True),
    _option("load_format", "model", str, "'random': random weights of the checkpoint's shapes, made on the device "
            "(benchmarks at real sizes; the folder needs only config.json and the tokenizer)", "--load-format",
            choices=("safetensors", "random")),
    _option("dtype", "model", str, "weights and activations; auto: bfloat16 on cuda, float32 on cpu", optional=True,
            choices=("float32", "bfloat16", "float16")),
    _option("max_model_len", "model", int, "context length (prompt + output); default: the checkpoint's limit, at "
            "most 32768", "--max-model-len", optional=True, low=2, metavar="N"),
    _option("served_model_name", "model", str, "the model name clients send and see (default: the checkpoint "
            "folder's name)", "--served-model-name", optional=True),
    _option("chat_template", "model", str, "a chat template (a file, or the template itself) instead of the "
            "checkpoint's", "--chat-template", optional=True, metavar="FILE"),
    _option("generation_config", "model", str, "where requests' unset sampling fields come from: 'auto', the "
            "checkpoint's generation_config.json; 'vllm', none (temperature 1, no top-k or top-p); or a folder "
            "holding a generation_config.json", "--generation-config", metavar="auto|vllm|FOLDER"),
    _option("max_logprobs", "model", int, "the most log-probs a request may ask for a token (OpenAI's "
            "top_logprobs, the completions API's logprobs)", "--max-logprobs", low=0, high=20, metavar="N"),
    _option("fp8_kernels", "model", bool, "FP8 checkpoints: keep the block-scaled FP8 weights in FP8 and run the "
            "FP8 projections (half the bytes a decode step reads; the default); --no-fp8-kernels dequantises them "
            "to --dtype as they are read", "--fp8-kernels"),
    _option("device", "parallel", str, "where the model runs; auto: cuda when a GPU is visible, else cpu",
            "--device", choices=("auto", "cpu", "cuda")),
    _option("tp", "parallel", int, "tensor-parallel ranks (one GPU each)", "--tensor-parallel-size", "-tp", "--tp",
            low=1, metavar="N"),
    _option("enable_expert_parallel", "parallel", bool, "MoE: each rank holds 1/tp of the experts whole, instead of "
            "1/tp of every expert's width (the attention, GDN and shared expert stay tensor-parallel)",
            "--enable-expert-parallel"),
    _option("use_nccl", "parallel", bool, "cuda: None = NCCL when tp > 1; True forces a communicator at tp = 1",
            optional=True),
    _option("memory_fraction", "cache", float, "fraction of the GPU's free memory (after weights) for state and KV "
            "pages", "--gpu-memory-utilization", low=0.0, high=1.0, above=True, metavar="FRACTION"),
    _option("cpu_memory_bytes", "cache", int, "state budget (slots and KV pages) of the cpu device", low=1),
    _option("enable_prefix_caching", "cache", bool, "share cached prompt prefixes at any 16-token page boundary "
            "(KV pages and recurrent-state snapshots)", "--enable-prefix-caching"),
    _option("prefix_cache_state_gib", "cache", float, "memory per GPU for the prefix cache's recurrent-state "
            "snapshots (default: a tenth of what the weights leave)", "--prefix-cache-state-gib", optional=True,
            low=0.0, metavar="GIB"),
    _option("kv_events_config", "cache", str, "publish the prefix cache's resumable prefixes as vLLM's KV events "
            "(its JSON: enable_kv_cache_events, publisher 'zmq', endpoint, replay_endpoint, topic, buffer_steps), "
            "for cache-aware routers", "--kv-events-config", optional=True, metavar="JSON"),
    _option("max_batch", "scheduler", int, "requests decoding at once (lowered if memory is short)",
            "--max-num-seqs", "--max-batch", low=1, high=4096, metavar="N"),
    _option("prefill_token_budget", "scheduler", int, "prompt tokens prefilled per step at most; default 8192, "
            "halved down to 2048 where its prefill activations would take more than an eighth of the GPU memory "
            "left after the weights", "--max-num-batched-tokens", optional=True, low=1, metavar="N"),
    _option("step_latency_ratio", "scheduler", float, "a step that prefills beside running requests takes at most "
            "R times a decode-only step, its prompt tokens' share widened by the requests waiting for a first "
            "token over those decoding: this bounds ITL p99 (0: always up to --max-num-batched-tokens)",
            "--step-latency-ratio", low=1.0, above=True, zero_off=True, metavar="R"),
    _option("prefill_slots", "scheduler", int, "requests prefilling at once", low=1),
    _option("max_waiting", "scheduler", int, "requests queued before new ones get 503 with Retry-After",
            "--max-waiting", low=1, metavar="N"),
    _option("async_scheduling", "scheduler", bool, "launch each step before the last one's tokens are back "
            "(overlap scheduling)", "--async-scheduling"),
    _option("seed", "scheduler", int, "seed of the step randomness for requests without their own seed", "--seed",
            low=0, high=2**63 - 1, metavar="N"),
    _option("speculative_tokens", "speculative", int, "speculative decoding: K tokens drafted a step by the "
            "checkpoint's MTP head and verified in one forward (default 0: off)", low=0,
            high=MAX_SPECULATIVE_TOKENS, metavar="K"),
    _option("speculative_max_batch", "speculative", int, "with speculation: a decode step whose batch (padded to "
            "its graph bucket) is above N decodes one token a request (default: no limit)",
            "--speculative-max-batch", optional=True, low=0, metavar="N"),
    _option("speculative_adaptive", "speculative", bool, "with speculation: each batch size speculates only while "
            "its steps are measured to give tokens faster than one-token steps (--no-speculative-adaptive: always)",
            "--speculative-adaptive"),
    _option("speculative_draft_vocab", "speculative", int, "with speculation: the head drafts among the first N "
            "token ids only, reading N rows of lm_head a draft instead of all (outputs do not change; 0: the whole "
            "vocabulary)", "--speculative-draft-vocab", low=0, metavar="N"),
    _option("speculative_fp8_draft_head", "speculative", bool, "with speculation: the drafts read an FP8 copy of "
            "lm_head, half the bytes a draft reads (the default; outputs do not change, verification reads the "
            "model's lm_head)", "--speculative-fp8-draft-head"),
    _option("cuda_graph", "kernels", bool, "replay CUDA graphs of the steps (--enforce-eager: launch them)"),
    _option("prefill_graph_tokens", "kernels", int, "prefill steps of up to N tokens replay CUDA graphs captured "
            "at 16, 32, 64, 128, every 64 tokens to 512, then every 128, instead of launching ~450 kernels from "
            "Python (0: none)", "--prefill-graph-tokens", low=0, metavar="N"),
    _option("fused_mixed_steps", "kernels", bool, "a step carrying prompt chunks beside decode rows runs both in "
            "one forward, reading the weights once, replayed from CUDA graphs; such a step does not speculate "
            "(default: on with CUDA and prefill graphs; off: the decode rows' forward then the chunks')",
            "--fused-mixed-steps", optional=True),
    _option("buckets", "kernels", list, "decode batch buckets (a graph is captured per bucket)", optional=True),
    _option("kernel_config", "kernels", KernelConfig, "cuda: the Triton ops' launch choices (None: the defaults)",
            optional=True),
    _option("warmup", "runtime", bool, "serve warm-up requests before \"engine ready\" (None: on cuda, to compile "
            "kernels)", optional=True),
    _option("stats_interval_s", "runtime", float, "seconds between throughput/usage log lines while busy (0: none)",
            "--stats-interval", low=0.0, metavar="SECONDS"),
    _option("step_timeout_s", "runtime", float, "seconds a step may take before the engine is declared failed",
            low=0.0, above=True),
    _option("capture_timeout_s", "runtime", float, "watchdog over the start-up graph capture sweep", low=0.0,
            above=True),
)}

# The server's own options (`deltaserve serve`, `runtime.server.ServerOptions`): checked by the same rules.
SERVER_OPTIONS: dict[str, Option] = {o.name: o for o in (
    _option("port", "server", int, "TCP port", "--port", low=1, high=65535, metavar="PORT"),
    _option("shutdown_timeout", "server", float, "seconds a SIGTERM/SIGINT gives live requests before they are "
            "aborted", "--shutdown-timeout", low=0.0, metavar="S"),
    _option("header_timeout_s", "server", float, "seconds a client has to send a request's headers",
            "--header-timeout", low=0.0, above=True, metavar="S"),
    _option("body_timeout_s", "server", float, "seconds a client has to send a request's body", "--body-timeout",
            low=0.0, above=True, metavar="S"),
    _option("keep_alive_timeout_s", "server", float, "seconds an idle keep-alive connection stays open",
            "--keep-alive-timeout", low=0.0, metavar="S"),
)}


@dataclass(frozen=True)
class EngineArgs:
    """The engine's arguments, frozen and validated when made (`OPTIONS`), flat as vLLM's `EngineArgs` (each
    field's group is its row's: the help lists the flags by group)."""

    model: str | None = None  # checkpoint folder; None serves the demo checkpoint (made on first use)
    device: str = "auto"  # "cpu" | "cuda" | "auto" (cuda when one is visible), as the CLI
    tp: int = 1
    enable_expert_parallel: bool = False
    dtype: str | None = None  # default: bfloat16 on cuda, float32 on cpu
    max_batch: int = 32  # decode rows (lowered at start-up if memory is short)
    max_model_len: int | None = None  # default: min(config max_position_embeddings, 32768)
    cuda_graph: bool = True
    # With graphs, prefill steps of up to this many tokens replay a graph (captured at 16, 32, 64, 128, every 64
    # tokens to 512, then every 128): a 512-token prefill's TTFT fell from 29.8 to 12.4 ms (H100, when prefill
    # graphs were added; README); 0: none.
    prefill_graph_tokens: int = 2048
    # A step carrying prompt chunks beside decode rows runs them as one forward (each projection reads the weights
    # once, not once for the rows' forward and again for the chunks'), replayed from a graph per decode bucket and
    # bucket of prompt tokens. With speculation such a step does not speculate (its decode rows take one token, as
    # in the one-token steps). None: on where those graphs are captured (CUDA with prefill graphs): at c64 on an
    # H100 6374 against 5802 tok/s apart, ITL p99 2.0x against 2.1x p50, for ~13 s more capture at start-up.
    # Eager (forced on without graphs) its launches made a mixed step host-bound (22 ms against 12.9 apart).
    fused_mixed_steps: bool | None = None
    seed: int = 0
    # Prompt tokens a step carries at most (chunked prefill). None: 8192 (vLLM's and SGLang's), halved down to 2048
    # where its prefill activations would take more than an eighth of the GPU memory left after the weights
    # (`devices.capacity.default_prefill_token_budget`; at 8192 they take 2.3 GiB at 4B, 4.1 GiB at 27B): an 8k
    # prompt in one step had TTFT 128.1 against 132.5 ms in 2048-token chunks, c64 6178 against 5883 tok/s (4B,
    # H100), but a bf16 27B on an 80 GB GPU would lose room for several long requests' KV.
    prefill_token_budget: int | None = None
    # A step carrying prompt tokens beside decode rows takes at most this many times a decode-only step, the
    # chunk's part scaled by 1 + waiting / decoding requests (`runtime.step_budget`); 0: every step carries up to
    # prefill_token_budget.
    step_latency_ratio: float = 2.0
    prefill_slots: int = 4  # requests prefilling at once
    buckets: list[int] | None = None  # decode batch buckets (graphs are captured per bucket)
    memory_fraction: float = 0.90  # of the GPU's free memory after weights
    cpu_memory_bytes: int = 256 << 20  # state budget (slots + KV pages) of the cpu device
    max_waiting: int = 1024  # queued requests before new ones are refused
    served_model_name: str | None = None
    chat_template: str | None = None  # a file, or the template itself; None: the checkpoint's
    generation_config: str = "auto"  # "auto": the checkpoint's defaults, "vllm": none, or a folder holding them
    max_logprobs: int = 20
    step_timeout_s: float = 600.0
    capture_timeout_s: float = 900.0  # watchdog over the start-up graph capture sweep
    use_nccl: bool | None = None  # cuda: None = NCCL when tp > 1; True forces a communicator even at tp = 1
    load_format: str = "safetensors"  # "random": random weights made on the device (benchmarks at real sizes)
    kernel_config: KernelConfig | None = None  # cuda: the Triton ops' launch choices (None: the defaults)
    enable_prefix_caching: bool = True  # share cached prompt prefixes (KV pages and recurrent-state snapshots)
    prefix_cache_state_gib: float | None = None  # per rank, for the snapshots; None: a tenth of what the weights leave
    kv_events_config: str | None = None  # vLLM's KV-events JSON (runtime.kv_events.KvEventsConfig); None: none
    async_scheduling: bool = True  # launch each step before the last one's tokens are back (overlap)
    # Speculative decoding with the checkpoint's MTP head: k tokens drafted and verified a step (0: off).
    speculative_tokens: int = 0
    # Decode steps of more rows than this decode one token a row (a verify step's k + 1 rows a request grow
    # costlier with the batch); None: no limit.
    speculative_max_batch: int | None = None
    # Each decode bucket speculates only while its steps are measured to give tokens faster than one-token steps
    # (`runtime.speculation`); False: every step up to speculative_max_batch speculates (tests, benchmarks).
    speculative_adaptive: bool = True
    # The head drafts among the first N token ids only (BPE ids run from frequent to rare): each draft reads N
    # rows of lm_head instead of all. Outputs do not change, only which drafts are proposed; 0: the whole
    # vocabulary.
    speculative_draft_vocab: int = 0
    # The drafts read an FP8 copy of lm_head (or of its first speculative_draft_vocab rows): half the bytes of each
    # of the k drafts' reads, for a copy of V x H bytes. A draft needs only an argmax and verification reads the
    # model's own lm_head, so outputs do not change, only (rarely, at near-ties) which drafts are proposed.
    speculative_fp8_draft_head: bool = True
    # FP8 checkpoints (block-scaled, Qwen's format): keep those weights in FP8 and run the FP8 projections
    # (`kernels.fp8`: half the bytes a decode step reads; the 27B step at batch 1 took 11.6 ms against 17.6 bf16,
    # H100); False: dequantise them to `dtype` as they are read. Nothing changes for other checkpoints.
    fp8_kernels: bool = True
    warmup: bool | None = None  # serve warm-up requests before "engine ready" (None: on cuda, to compile kernels)
    stats_interval_s: float = 10.0  # a throughput and usage log line this often while busy (0: never)

    def __post_init__(self) -> None:
        for option in OPTIONS.values():
            option.check(getattr(self, option.name))
        if self.buckets is not None and (
                not self.buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.buckets)):
            raise ValueError(f"buckets must be a non-empty list of positive integers, got {self.buckets!r}")
        # Resolved here, once, so every part reads the same values.
        if self.device == "auto":
            from deltaserve.devices.backend import default_device  # imports torch: only when asked to look

            object.__setattr__(self, "device", default_device())
        if self.dtype is None:
            object.__setattr__(self, "dtype", "bfloat16" if self.device == "cuda" else "float32")

    def replace(self, **changes) -> "EngineArgs":
        """A copy with `changes`, validated as a new one."""
        return dataclasses.replace(self, **changes)


# The table has a row for every field, and no other.
assert {f.name for f in dataclasses.fields(EngineArgs)} == set(OPTIONS)
