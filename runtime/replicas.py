"""`deltaserve serve ... --data-parallel-size N`: N servers of the same flags, each a process on its own GPUs and
port (the public port + 1 + i), behind a router on the public port (`--router vllm` or `sglang`: vllm-router or
the SGLang model gateway, from PyPI, each with its cache-aware policy; `none`: the replicas alone, for a router of
the user's). Replicas listen on 127.0.0.1 only: the router is the
way in. A replica that dies is started again (the router stops sending to it meanwhile: its health check fails);
a signal stops the router, then drains the replicas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
import urllib.request

log = logging.getLogger("deltaserve.replicas")

# Flags that are the supervisor's own: a replica gets the rest of the command line as it is.
OWN_FLAGS = {"--data-parallel-size": 1, "-dp": 1, "--router": 1, "--port": 1, "--host": 1}
RESTART_DELAY_S = 2.0  # a replica that keeps failing at start-up is not restarted in a tight loop
ROUTERS = {"vllm": ["vllm-router"], "sglang": ["sglang-router", "launch"]}  # the two speak the same flags


def require_router(kind: str) -> None:
    """A ValueError naming the package where router `kind` is not installed."""
    if shutil.which(ROUTERS[kind][0]) is None:
        raise ValueError(f"--router {kind} needs {ROUTERS[kind][0]} (pip install {kind}-router), or --router none")


def router_command(kind: str, host: str, port: int, urls: list[str], metrics_port: int,
                   policy: str = "cache_aware") -> list[str]:
    """The command line of router `kind` on host:port over `urls`. A replica's first failed request opens its
    circuit, so the router's retry goes to another: a replica that dies loses only the requests it had started
    (cache-aware routing would retry the same one). Cache-aware routing turns to the least loaded replica once
    one has 2 requests and 1.1x more in flight than another (the routers' defaults: 64 and 1.5): a popular prefix
    is then served, and cached, by several replicas. Modelled, 8 replicas under Zipf-distributed tenants keep
    0.94-0.99x a lone replica's throughput each this way (median of 4 runs 0.976x), 0.71x with the defaults
    (`tools/lab/replica_study.py`, docs/benchmarks/log/replicas-2026-12-08.md)."""
    require_router(kind)
    return [*ROUTERS[kind], "--host", host, "--port", str(port), "--policy", policy, "--worker-urls", *urls,
            "--health-check-interval-secs", "2", "--cb-failure-threshold", "1", "--prometheus-port",
            str(metrics_port), "--balance-abs-threshold", "2", "--balance-rel-threshold", "1.1"]


def replica_argv(argv: list[str]) -> list[str]:
    """The serve command line without the supervisor's own flags (`--flag value` or `--flag=value`)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in OWN_FLAGS:
            skip = 0 if "=" in arg else OWN_FLAGS[name]
            continue
        out.append(arg)
    return out


def with_kv_events_of(argv: list[str], index: int) -> list[str]:
    """Replica `index`'s command line: its `--kv-events-config` endpoints its own (`KvEventsConfig.for_replica`:
    one host's replicas cannot share a port; a router subscribes to each). A ValueError names what is wrong."""
    from .kv_events import KvEventsConfig

    out, i = list(argv), 0
    while i < len(out):
        name, eq, value = out[i].partition("=")
        if name == "--kv-events-config":
            if not eq:
                if i + 1 >= len(out):
                    raise ValueError("--kv-events-config needs a value")
                value = out.pop(i + 1)
            config = KvEventsConfig.parse(value).for_replica(index)
            out[i] = "--kv-events-config=" + json.dumps(dataclasses.asdict(config))
        i += 1
    return out


def gpu_groups(replicas: int, tp: int, device: str) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES (None on the CPU): consecutive groups of tp of the visible GPUs."""
    if device == "cpu":
        return [None] * replicas
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [g for g in visible.split(",") if g.strip()]
    else:  # the driver lists each GPU of the host (the runtime imports no torch to count them)
        gpus = "/proc/driver/nvidia/gpus"
        ids = [str(i) for i in range(len(os.listdir(gpus)))] if os.path.isdir(gpus) else []
    if device == "auto" and not ids:
        return [None] * replicas
    if replicas * tp > len(ids):
        raise ValueError(f"--data-parallel-size {replicas} x --tensor-parallel-size {tp} needs {replicas * tp} "
                         f"GPUs; {len(ids)} are visible")
    return [",".join(ids[i * tp:(i + 1) * tp]) for i in range(replicas)]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def _port_free(host: str, port: int) -> bool:
    try:
        with socket.create_server((host, port)):
            return True
    except OSError:
        return False


class Replicas:
    def __init__(self, serve_argv: list[str], count: int, host: str, port: int, router: str, tp: int,
                 device: str, startup_timeout_s: float = 3600.0) -> None:
        self.argv, self.host, self.port, self.router_kind = replica_argv(serve_argv), host, port, router
        self.ports = [port + 1 + i for i in range(count)]
        self.router_metrics_port = port + 1 + count  # the router's own Prometheus exporter
        taken = [p for p in self.ports + [self.router_metrics_port] if not _port_free("127.0.0.1", p)]
        if taken:
            raise ValueError(f"ports {taken} are taken (replica i listens on --port + 1 + i, the router's metrics "
                             f"on --port + 1 + N)")
        if router != "none":
            require_router(router)
        self.gpus = gpu_groups(count, tp, device)
        self.argvs = [with_kv_events_of(self.argv, i) for i in range(count)]  # a bad config is refused here
        self.startup_timeout_s = startup_timeout_s
        self.processes: list[asyncio.subprocess.Process | None] = [None] * count
        self.router: asyncio.subprocess.Process | None = None
        self.stopping = False

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    async def _start(self, i: int) -> None:
        env = dict(os.environ)
        if self.gpus[i] is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[i]
        # Out of the terminal's process group: its Ctrl-C reaches the supervisor alone, which drains each replica once
        self.processes[i] = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "deltaserve.runtime.serve", *self.argvs[i], "--host", "127.0.0.1",
            "--port", str(self.ports[i]), env=env, start_new_session=True)
        log.info("replica %d: pid %d on port %d%s", i, self.processes[i].pid, self.ports[i],
                 f", GPUs {self.gpus[i]}" if self.gpus[i] else "")

    async def _wait_healthy(self, i: int) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.processes[i].returncode is not None:
                return False
            if await asyncio.to_thread(_healthy, self.urls[i]):
                return True
            await asyncio.sleep(0.2)
        return False

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until `stop` (0); 2 where the replicas never came up, 1 where the router failed."""
        for i in range(len(self.ports)):
            await self._start(i)
        if not all(await asyncio.gather(*(self._wait_healthy(i) for i in range(len(self.ports))))):
            log.error("cannot start: a replica did not come up (its log is above)")
            await self._stop_all()
            return 2
        watchers = [asyncio.ensure_future(self._watch(i)) for i in range(len(self.ports))]
        if self.router_kind != "none":
            self.router = await asyncio.create_subprocess_exec(
                *router_command(self.router_kind, self.host, self.port, self.urls, self.router_metrics_port),
                start_new_session=True)
            log.info("%s-router (cache-aware) on %s:%d over %d replicas", self.router_kind, self.host, self.port,
                     len(self.ports))
            watchers.append(asyncio.ensure_future(self.router.wait()))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([stopped, *watchers[len(self.ports):]], return_when=asyncio.FIRST_COMPLETED)
        failed = not stopped.done()
        if failed:
            log.error("the router exited with status %s: stopping the replicas", self.router.returncode)
        self.stopping = True
        for w in [stopped, *watchers]:
            w.cancel()
        await self._stop_all()
        return 1 if failed else 0

    async def _watch(self, i: int) -> None:
        """Start replica i again whenever it exits (the cause is in its log lines)."""
        while True:
            code = await self.processes[i].wait()
            if self.stopping:
                return
            log.error("replica %d exited with status %d: starting it again", i, code)
            await asyncio.sleep(RESTART_DELAY_S)
            await self._start(i)

    async def _stop_all(self) -> None:
        """The router first (no new requests reach a replica), then each replica drains (SIGTERM)."""
        self.stopping = True
        for process in [self.router, *self.processes]:
            if process is not None and process.returncode is None:
                process.send_signal(signal.SIGTERM)
                if process is self.router:
                    await process.wait()
        for process in self.processes:
            if process is not None:
                await process.wait()
