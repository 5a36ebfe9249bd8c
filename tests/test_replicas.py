"""`deltaserve serve --data-parallel-size N`: the replicas' command lines and GPU groups, and on the CPU two replicas
behind vllm-router on the public port: served, a killed replica started again while the other serves, a signal
stopping them all."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from test_server import free_port

from deltaserve.runtime.kv_events import KvEventsConfig
from deltaserve.runtime.replicas import gpu_groups, replica_argv, with_kv_events_of


def test_a_replica_gets_the_command_line_less_the_supervisor_s_flags():
    argv = ["CKPT", "--data-parallel-size", "2", "-tp", "2", "--port=9000", "--router", "none", "--host", "0.0.0.0",
            "--max-num-seqs", "8", "-dp=2"]
    assert replica_argv(argv) == ["CKPT", "-tp", "2", "--max-num-seqs", "8"]


def test_each_replica_publishes_kv_events_on_its_own_ports():
    config = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", ' \
             '"replay_endpoint": "tcp://*:5600", "topic": "kv"}'
    for argv in (["CKPT", "--kv-events-config", config, "-tp", "2"],
                 ["CKPT", f"--kv-events-config={config}", "-tp", "2"]):
        third = with_kv_events_of(argv, 2)
        assert third[0] == "CKPT" and third[-2:] == ["-tp", "2"] and len(third) == 4
        got = KvEventsConfig.parse(third[1].partition("=")[2])
        assert (got.endpoint, got.replay_endpoint, got.topic, got.publishes) == ("tcp://*:5559", "tcp://*:5602", "kv",
                                                                                 True)
    assert with_kv_events_of(["CKPT"], 1) == ["CKPT"]
    ipc = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="ipc:///tmp/kv").for_replica(1)
    assert ipc.endpoint == "ipc:///tmp/kv.1"
    elsewhere = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://epp.ns.svc:5557"}'
    assert with_kv_events_of(["--kv-events-config", elsewhere], 0) == ["--kv-events-config=" + json.dumps(
        dataclasses.asdict(KvEventsConfig.parse(elsewhere)))]
    with pytest.raises(ValueError, match="share a topic"):
        with_kv_events_of(["--kv-events-config", elsewhere], 1)
    with pytest.raises(ValueError, match="endpoint"):
        with_kv_events_of(["--kv-events-config", '{"endpoint": "tcp://*:port"}'], 1)


def test_each_replica_gets_its_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5,6")
    assert gpu_groups(2, 2, "cuda") == ["3,4", "5,6"] and gpu_groups(4, 1, "cuda") == ["3", "4", "5", "6"]
    with pytest.raises(ValueError, match="needs 6 GPUs; 4 are visible"):
        gpu_groups(3, 2, "cuda")
    assert gpu_groups(3, 2, "cpu") == [None] * 3


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except OSError:
        return 0


def _complete(url: str) -> int:
    request = urllib.request.Request(url + "/v1/completions", data=b'{"prompt": "hello", "max_tokens": 3}',
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except OSError:
        return 0


def _until(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.skipif(shutil.which("vllm-router") is None, reason="vllm-router is not installed")
def test_two_cpu_replicas_behind_the_router_serve_restart_and_stop(tiny_ckpt):
    port = free_port()
    while not all(_get(f"http://127.0.0.1:{p}/health", 0.2) == 0 for p in (port + 1, port + 2)):
        port = free_port()
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "deltaserve.runtime.serve", tiny_ckpt, "--device", "cpu", "--data-parallel-size",
         "2", "--port", str(port), "--max-model-len", "256", "--disable-access-log", "--stats-interval", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert _until(lambda: _get(url + "/health") == 200, 120), "the router did not come up"
        assert [_complete(url) for _ in range(4)] == [200] * 4
        # replica 0 dies: the other serves meanwhile, and the supervisor starts it again
        pid = int(subprocess.run(["pgrep", "-f", f"deltaserve.runtime.serve.*--port {port + 1}"],
                                 capture_output=True, text=True).stdout.split()[0])
        os.kill(pid, signal.SIGKILL)
        assert _until(lambda: _get(f"http://127.0.0.1:{port + 1}/health", 0.5) == 0, 10)
        assert [_complete(url) for _ in range(4)] == [200] * 4
        assert _until(lambda: _get(f"http://127.0.0.1:{port + 1}/health") == 200, 120), "not started again"
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=60) == 0
        assert _get(url + "/health", 0.5) == 0 and _get(f"http://127.0.0.1:{port + 2}/health", 0.5) == 0
        assert "exited with status" in supervisor.stderr.read()  # the restart was said
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
        subprocess.run(["pkill", "-f", f"deltaserve.runtime.serve.*--port ({port + 1}|{port + 2})"])
