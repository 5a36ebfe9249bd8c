"""deploy/'s Kubernetes manifests agree with the server: the container's arguments are a command line
`deltaserve serve` accepts (the KV-events JSON too), the probes ask /health on the served port, the
InferencePool selects the Deployment's pods on that port, as the HTTPRoute sends to the pool, and the endpoint
picker's prefix scorer reads the pods' KV events with their block size and hash seed."""

import os

import yaml

from deltaserve.model.state import PAGE_SIZE
from deltaserve.runtime.cli import _Parser, serve_parser
from deltaserve.runtime.kv_events import KvEventsConfig

DEPLOY = os.path.join(os.path.dirname(__file__), "..", "deploy")


def test_the_llm_d_manifests_agree_with_the_server():
    with open(os.path.join(DEPLOY, "llm-d.yaml")) as f:
        docs = {d["kind"]: d for d in yaml.safe_load_all(f)}
    assert set(docs) == {"Deployment", "InferencePool", "HTTPRoute", "ConfigMap"}
    for doc in docs.values():
        assert doc["apiVersion"] and doc["metadata"]["name"]
    deployment, pool, route = docs["Deployment"], docs["InferencePool"], docs["HTTPRoute"]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["deltaserve"] and container["args"][0] == "serve"
    parser = serve_parser(_Parser(prog="deltaserve serve"))
    ns = parser.parse_args(container["args"][1:])  # a flag the server lacks exits here
    events = KvEventsConfig.parse(ns.kv_events_config)
    assert events.publishes
    port = ns.port
    assert {p["containerPort"] for p in container["ports"]} == {port}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port}
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [port]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"][0]["kind"] == "InferencePool" and rule["backendRefs"][0]["name"] == \
        pool["metadata"]["name"]

    # the endpoint picker binds the port the pods send to, takes their topics, and hashes with their seed and size
    (config,) = docs["ConfigMap"]["data"].values()
    plugins = {p["type"]: p.get("parameters", {}) for p in yaml.safe_load(config)["plugins"]}
    scorer = plugins["precise-prefix-cache-scorer"]
    assert scorer["kvEventsConfig"]["zmqEndpoint"] == "tcp://*:" + events.endpoint.rpartition(":")[2]
    assert events.endpoint.startswith("tcp://" + pool["spec"]["endpointPickerRef"]["name"] + ":")
    assert events.topic.startswith(scorer["kvEventsConfig"]["topicFilter"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    tokens = scorer["indexerConfig"]["tokenProcessorConfig"]
    assert tokens == {"blockSize": PAGE_SIZE, "hashSeed": env["PYTHONHASHSEED"]} and "POD_IP" in env
