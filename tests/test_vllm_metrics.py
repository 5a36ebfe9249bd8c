"""/metrics under vLLM's names: the queries of vLLM's Grafana dashboard (and the load signals routers read) find
their series, labelled with the served model's name, and they move with the traffic."""

import re

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from test_agents import _serve

# As vLLM's dashboard writes them ($model_name its variable; the rate windows do not matter to a scrape)
DASHBOARD = [
    'sum(vllm:num_requests_running{model_name="$model_name"})',
    'sum(vllm:num_requests_waiting{model_name="$model_name"})',
    'avg(vllm:kv_cache_usage_perc{model_name="$model_name"})',
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'histogram_quantile(0.5, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}'
    '[$__rate_interval])))',
    'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval]) / '
    'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:prefix_cache_hits_total{model_name="$model_name"}[$__rate_interval]) / '
    'rate(vllm:prefix_cache_queries_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
]


def _selectors(query: str) -> list[tuple[str, dict]]:
    """The metric selectors of a PromQL query: (name, {label: value})."""
    out = []
    for name, labels in re.findall(r"(vllm:[a-z_:]+)\{([^}]*)\}", query):
        out.append((name, dict(re.findall(r'(\w+)="([^"]*)"', labels))))
    return out


def test_vllm_dashboard_queries_find_their_series(tiny_ckpt):
    async def body(engine, url):
        async with aiohttp.ClientSession() as s:
            for i in range(3):
                async with s.post(url + "/v1/completions", json={"prompt": "The river runs past the old mill " * 4,
                                                                  "max_tokens": 4, "temperature": 0}) as r:
                    assert r.status == 200
            async with s.get(url + "/metrics") as r:
                return await r.text()

    text = _serve(tiny_ckpt, body)
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    for query in DASHBOARD:
        for name, want in _selectors(query.replace("$model_name", "m")):
            found = [v for labels, v in samples.get(name, []) if want.items() <= labels.items()]
            assert found, f"{query}: no series {name}{want}"
    value = {name: sum(v for _, v in found) for name, found in samples.items()}
    assert value["vllm:prompt_tokens_total"] > 0 and value["vllm:generation_tokens_total"] >= 12
    assert value["vllm:prefix_cache_hits_total"] > 0  # the same prompt three times
    assert [labels["finished_reason"] for labels, v in samples["vllm:request_success_total"] if v] == ["length"]
    assert value["vllm:time_to_first_token_seconds_count"] == 3
