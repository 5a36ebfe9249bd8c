"""Prometheus metrics of one engine (its own registry, so several engines in a process do not collide), exported
under our names and again under vLLM's (`vllm:...`, labelled `model_name` and `engine`), so vLLM's dashboards and
the routers and schedulers that read vLLM's load signals (llm-d's, vllm-router's) see this server as a vLLM one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)


# Our metric (an EngineMetrics attribute) -> vLLM's name for what it measures, and the label vLLM gives ours
VLLM_NAMES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_usage": "vllm:kv_cache_usage_perc",
    "prefix_queries": "vllm:prefix_cache_queries",
    "prefix_hits": "vllm:prefix_cache_hits",
    "ttft": "vllm:time_to_first_token_seconds",
    "itl": "vllm:inter_token_latency_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "queue_time": "vllm:request_queue_time_seconds",
    "prefill_time": "vllm:request_prefill_time_seconds",
    "prompt_tokens": "vllm:prompt_tokens",
    "generation_tokens": "vllm:generation_tokens",
    "finished": "vllm:request_success",
    "spec_drafts": "vllm:spec_decode_num_draft_tokens",
    "spec_accepted": "vllm:spec_decode_num_accepted_tokens",
    "spec_accepted_at": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
VLLM_LABELS = {"finish_reason": "finished_reason"}


class _VllmNames(Collector):
    """Our metrics' samples again, renamed and labelled as vLLM's, read at each scrape (nothing is counted twice)."""

    def __init__(self, metrics: "EngineMetrics") -> None:
        self.metrics = metrics

    def collect(self):
        labels = {"model_name": self.metrics.model_name, "engine": "0"}
        for ours, theirs in VLLM_NAMES.items():
            for family in getattr(self.metrics, ours).collect():
                renamed = Metric(theirs, family.documentation, family.type)
                for sample in family.samples:
                    renamed.add_sample(theirs + sample.name[len(family.name):],
                                       {**{VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}, **labels},
                                       sample.value, sample.timestamp)
                yield renamed


class EngineMetrics:
    def __init__(self, model_name: str = "") -> None:
        """model_name: the served name, vLLM's `model_name` label (the engine sets it once the checkpoint is read)."""
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        self.running = Gauge("deltaserve_requests_running", "Requests holding a slot", registry=r)
        self.waiting = Gauge("deltaserve_requests_waiting", "Requests queued for admission", registry=r)
        self.ttft = Histogram("deltaserve_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("deltaserve_inter_token_latency_seconds", "Time between tokens of a request",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("deltaserve_e2e_request_latency_seconds", "Arrival to finish", registry=r,
                             buckets=_LATENCY_BUCKETS)
        # TTFT split at the hand-off of the prompt's first chunk: waiting for admission and the step budget, then
        # the prefill steps (vLLM's request queue and prefill times).
        self.queue_time = Histogram("deltaserve_request_queue_time_seconds",
                                    "Arrival to the prompt's first chunk handed to the devices", registry=r,
                                    buckets=_LATENCY_BUCKETS)
        self.prefill_time = Histogram("deltaserve_request_prefill_time_seconds",
                                      "The prompt's first chunk handed over to the first token", registry=r,
                                      buckets=_LATENCY_BUCKETS)
        self.prompt_tokens = Counter("deltaserve_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("deltaserve_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("deltaserve_requests_finished", "Finished requests", ["finish_reason"], registry=r)
        self.kv_usage = Gauge("deltaserve_kv_pages_usage_ratio", "Fraction of KV pages reserved", registry=r)
        self.slot_usage = Gauge("deltaserve_decode_slots_usage_ratio", "Fraction of decode slots in use", registry=r)
        self.prefix_queries = Counter("deltaserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("deltaserve_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=r)
        self.snapshot_usage = Gauge("deltaserve_prefix_cache_snapshots_usage_ratio",
                                    "Fraction of the prefix cache's state snapshots in use", registry=r)
        self.spec_drafts = Counter("deltaserve_spec_decode_num_draft_tokens", "Tokens drafted by speculation",
                                   registry=r)
        self.spec_accepted = Counter("deltaserve_spec_decode_num_accepted_tokens", "Drafted tokens accepted",
                                     registry=r)
        self.spec_accepted_at = Counter("deltaserve_spec_decode_num_accepted_tokens_per_pos",
                                        "Drafted tokens accepted, by draft position (0: the first)", ["position"],
                                        registry=r)
        self.step_seconds = Histogram("deltaserve_step_seconds", "Device step time", registry=r,
                                      buckets=_LATENCY_BUCKETS)
        self.healthy = Gauge("deltaserve_healthy", "1 while the engine serves, 0 once poisoned", registry=r)
        self.healthy.set(1)
        r.register(_VllmNames(self))
        self.prompt_token_count = 0  # the two counters' values, for the engine's periodic stats line
        self.generation_token_count = 0

    def reset(self) -> None:
        """Every metric back to zero, in this object (the step loop and the server hold it): a fresh registry."""
        self.__init__(self.model_name)

    def count_tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.prompt_token_count += prompt
        self.generation_token_count += generated

    def count_prefix(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)

    def count_kept(self, counts: list[int], k: int) -> None:
        """A speculative step's rows: each kept `counts[i]` tokens of 1 + k (the drafts kept, by position)."""
        self.count_tokens(0, sum(counts))
        self.spec_drafts.inc(k * len(counts))
        self.spec_accepted.inc(sum(counts) - len(counts))
        for position in range(max(counts, default=1) - 1):
            self.spec_accepted_at.labels(str(position)).inc(sum(1 for c in counts if c > position + 1))

    def observe_token(self, arrival: float, prefill_start: float | None, since_last: float | None,
                      now: float) -> None:
        """A request's token: its first gives TTFT (and the prefill's part of it), the others ITL."""
        if since_last is None:
            self.ttft.observe(now - arrival)
            if prefill_start is not None:
                self.prefill_time.observe(now - prefill_start)
        else:
            self.itl.observe(since_last)

    def show(self, scheduler) -> None:
        """The gauges, from the scheduler's state (`runtime.scheduler.Scheduler`)."""
        s = scheduler
        self.running.set(s.num_running)
        self.waiting.set(len(s.waiting))
        self.kv_usage.set(s.held_pages / s.num_pages)
        snapshots = s.cache.snapshots
        self.snapshot_usage.set(len(snapshots) / snapshots.capacity if snapshots.capacity else 0.0)
        self.slot_usage.set(len(s.decode_slots) / s.max_batch)

    def render(self) -> bytes:
        return generate_latest(self.registry)
