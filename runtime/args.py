"""Engine arguments, validated when made: a bad value raises ValueError naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.kernels.config import KernelConfig

_DTYPES = ("float32", "bfloat16", "float16")
MAX_SPECULATIVE_TOKENS = 8


@dataclass
class EngineArgs:
    model: str | None = None  # checkpoint folder; None serves the demo checkpoint (made on first use)
    device: str = "auto"  # "cpu" | "cuda" | "auto" (cuda when one is visible), as the CLI
    tp: int = 1
    dtype: str | None = None  # default: bfloat16 on cuda, float32 on cpu
    max_batch: int = 32  # decode rows (lowered at start-up if memory is short)
    max_model_len: int | None = None  # default: min(config max_position_embeddings, 32768)
    cuda_graph: bool = True
    # With graphs, prefill steps of up to this many tokens replay a graph (captured at 16, 32, 64, 128, every 64
    # tokens to 512, then every 128): a 512-token prefill's TTFT fell from 29.8 to 12.4 ms (H100, when prefill
    # graphs were added; README); 0: none.
    prefill_graph_tokens: int = 2048
    # A step carrying prompt chunks beside decode rows runs them as one forward (each projection reads the weights
    # once, not once for the decode graph and again for the prefill), replayed from a graph per decode bucket and
    # bucket of prompt tokens; off: the decode graph, then the prefill. With speculation such a step does not
    # speculate (its decode rows take one token, as in the one-token steps). None: on where
    # those graphs are captured (CUDA with prefill graphs): at c64 on an H100 6374 against 5802 tok/s apart, ITL
    # p99 2.0x against 2.1x p50, for ~13 s more capture at start-up. Eager (forced on without graphs) its launches
    # made a mixed step host-bound (22 ms against 12.9 apart).
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
    step_timeout_s: float = 600.0
    capture_timeout_s: float = 900.0  # watchdog over the start-up graph capture sweep
    use_nccl: bool | None = None  # cuda: None = NCCL when tp > 1; True forces a communicator even at tp = 1
    load_format: str = "safetensors"  # "random": random weights made on the device (benchmarks at real sizes)
    kernel_config: KernelConfig | None = None  # cuda: the Triton ops' launch choices (None: the defaults)
    enable_prefix_caching: bool = True  # share cached prompt prefixes (KV pages and recurrent-state snapshots)
    prefix_cache_state_gib: float | None = None  # per rank, for the snapshots; None: a tenth of what the weights leave
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
        if self.device == "auto":
            from deltaserve.devices.backend import default_device  # imports torch: only when asked to look

            self.device = default_device()
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        if self.dtype is None:
            self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for name in ("tp", "max_batch", "prefill_token_budget", "prefill_slots", "max_waiting", "cpu_memory_bytes"):
            value = getattr(self, name)
            if value is None and name == "prefill_token_budget":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.buckets is not None and (
            not self.buckets or any(not isinstance(b, int) or b < 1 for b in self.buckets)
        ):
            raise ValueError(f"buckets must be a non-empty list of positive integers, got {self.buckets!r}")
        if self.load_format not in ("safetensors", "random"):
            raise ValueError(f"load_format must be 'safetensors' or 'random', got {self.load_format!r}")
        if not isinstance(self.step_latency_ratio, (int, float)) or isinstance(self.step_latency_ratio, bool) or \
                not (self.step_latency_ratio == 0 or self.step_latency_ratio > 1):
            raise ValueError(f"step_latency_ratio must be above 1, or 0 (off), got {self.step_latency_ratio!r}")
        if self.prefix_cache_state_gib is not None and not (
                isinstance(self.prefix_cache_state_gib, (int, float)) and self.prefix_cache_state_gib >= 0):
            raise ValueError(f"prefix_cache_state_gib must be a number >= 0, got {self.prefix_cache_state_gib!r}")
        if isinstance(self.prefill_graph_tokens, bool) or not isinstance(self.prefill_graph_tokens, int) or \
                self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be an integer >= 0, got {self.prefill_graph_tokens!r}")
        if isinstance(self.speculative_tokens, bool) or not isinstance(self.speculative_tokens, int) or \
                not 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], got "
                             f"{self.speculative_tokens!r}")
        if self.speculative_max_batch is not None and (
                isinstance(self.speculative_max_batch, bool) or not isinstance(self.speculative_max_batch, int)
                or self.speculative_max_batch < 0):
            raise ValueError(f"speculative_max_batch must be an integer >= 0, got {self.speculative_max_batch!r}")
        if isinstance(self.speculative_draft_vocab, bool) or not isinstance(self.speculative_draft_vocab, int) or \
                self.speculative_draft_vocab < 0:
            raise ValueError(f"speculative_draft_vocab must be an integer >= 0, got {self.speculative_draft_vocab!r}")
        if self.fused_mixed_steps is not None and not isinstance(self.fused_mixed_steps, bool):
            raise ValueError(f"fused_mixed_steps must be True, False or None, got {self.fused_mixed_steps!r}")
        if not isinstance(self.fp8_kernels, bool):
            raise ValueError(f"fp8_kernels must be True or False, got {self.fp8_kernels!r}")
        if not isinstance(self.speculative_fp8_draft_head, bool):
            raise ValueError(f"speculative_fp8_draft_head must be True or False, got "
                             f"{self.speculative_fp8_draft_head!r}")
        if not isinstance(self.speculative_adaptive, bool):
            raise ValueError(f"speculative_adaptive must be True or False, got {self.speculative_adaptive!r}")
        if self.step_timeout_s <= 0:
            raise ValueError("step_timeout_s must be positive")
