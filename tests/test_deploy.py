"""deploy/'s Kubernetes manifests agree with the server: the container's arguments are a command line
`deltaserve serve` accepts (the KV-events JSON too), the probes ask /health on the served port, and the
InferencePool selects the Deployment's pods on that port, as the HTTPRoute sends to the pool."""

import os

import yaml

from deltaserve.runtime.cli import _Parser, serve_parser
from deltaserve.runtime.kv_events import KvEventsConfig

DEPLOY = os.path.join(os.path.dirname(__file__), "..", "deploy")


def test_the_llm_d_manifests_agree_with_the_server():
    with open(os.path.join(DEPLOY, "llm-d.yaml")) as f:
        docs = {d["kind"]: d for d in yaml.safe_load_all(f)}
    assert set(docs) == {"Deployment", "InferencePool", "HTTPRoute"}
    for doc in docs.values():
        assert doc["apiVersion"] and doc["metadata"]["name"]
    deployment, pool, route = docs["Deployment"], docs["InferencePool"], docs["HTTPRoute"]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["deltaserve"] and container["args"][0] == "serve"
    parser = serve_parser(_Parser(prog="deltaserve serve"))
    ns = parser.parse_args(container["args"][1:])  # a flag the server lacks exits here
    assert KvEventsConfig.parse(ns.kv_events_config).publishes
    port = ns.port
    assert {p["containerPort"] for p in container["ports"]} >= {port, 5557}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port}
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"][0]["kind"] == "InferencePool" and rule["backendRefs"][0]["name"] == \
        pool["metadata"]["name"]
