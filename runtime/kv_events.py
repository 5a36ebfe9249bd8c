"""KV-cache events as vLLM publishes them, so its routers (llm-d's endpoint picker, vllm-router's cache-aware
policy) can tell which replica holds a prompt's prefix: `--kv-events-config` as vLLM spells it.

A step's events (`prefix_cache.ResumablePrefixes`: only prefixes a request could resume, up to a state snapshot)
go out as one batch on a ZMQ PUB socket, a multipart message (topic, sequence number as 8 big-endian bytes, the
batch in msgpack: [timestamp, [event, ...]], each event an array led by its type's name, as vLLM's msgspec tagged
structs encode). The last `buffer_steps` batches are kept for a replay socket (ROUTER): a client sends the first
sequence number it lacks and gets every kept batch from there, then an end marker (sequence -1, no payload).
A thread of its own does the sockets and the block hashes: the event loop only hands it each step's events.

Blocks are named as vLLM names them with `--prefix-caching-hash-algo sha256_cbor` (`VllmBlockHashes`), the one
scheme a router in another language recomputes from a prompt's tokens (llm-d's precise prefix scorer does): the
same seed (PYTHONHASHSEED, else vLLM's default) and block size (16) on both sides, and a router's predicted hit is
a hit here.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

from .prefix_cache import AllBlocksCleared, BlockRemoved, BlockStored

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed for a cryptographic hash where PYTHONHASHSEED is unset


class VllmBlockHashes:
    """vLLM's sha256_cbor block hashes: a block's digest is SHA-256 over canonical CBOR of [parent digest, its
    token ids, None] (the first block's parent: SHA-256 of the seed string's CBOR), published as the digest's low
    64 bits (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, vLLM's default). The cache names pages by its own keys;
    this keeps each announced page's digest (the next page's parent) until the page is removed."""

    def __init__(self, seed: str | None = None) -> None:
        import cbor2  # the CBOR vLLM hashes; imported by a server that publishes only

        self._cbor = cbor2.dumps
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_SEED) if seed is None else seed
        self.root = hashlib.sha256(self._cbor(seed, canonical=True)).digest()
        self.digests: dict[bytes, bytes] = {}  # announced page key -> its digest

    def digest(self, parent: bytes, tokens: list[int]) -> bytes:
        return hashlib.sha256(self._cbor([parent, tokens, None], canonical=True)).digest()

    @staticmethod
    def wire(digest: bytes) -> int:
        return int.from_bytes(digest[-8:], "big")

    def stored(self, e: BlockStored) -> list:
        parent = self.root if e.parent_block_hash is None else self.digests[e.parent_block_hash]
        wire_parent = None if e.parent_block_hash is None else self.wire(parent)
        names, ps = [], e.block_size
        for i, key in enumerate(e.block_hashes):
            parent = self.digests[key] = self.digest(parent, e.token_ids[i * ps : (i + 1) * ps])
            names.append(self.wire(parent))
        return ["BlockStored", names, wire_parent, e.token_ids, e.block_size, None, "GPU"]

    def removed(self, e: BlockRemoved) -> list:
        return ["BlockRemoved", [self.wire(self.digests.pop(key)) for key in e.block_hashes], "GPU"]


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's KVEventsConfig fields (the ones a ZMQ publisher reads)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> "KvEventsConfig":
        """From `--kv-events-config`'s JSON; a ValueError naming what is wrong."""
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kv_events_config is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ValueError("kv_events_config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown field(s) {unknown}; known: {sorted(known)}")
        config = cls(**fields)
        if config.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {config.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(config, name)
            tcp = isinstance(value, str) and value.startswith("tcp://") and value.rpartition(":")[2].isdigit()
            if not (tcp or (isinstance(value, str) and value.startswith(("ipc://", "inproc://")))
                    or (value is None and name == "replay_endpoint")):
                raise ValueError(f"kv_events_config.{name} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME, "
                                 f"got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be a positive integer, got {value!r}")
        return config

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_replica(self, index: int) -> "KvEventsConfig":
        """Replica `index`'s config when several share a host: endpoints bound here get their port offset by
        `index` (as vLLM's data-parallel ranks offset theirs), an IPC path the suffix `.index`. An endpoint
        elsewhere would merge the replicas' streams under one topic: refused for any replica but the first."""

        def offset(endpoint: str | None) -> str | None:
            if endpoint is None or index == 0 or endpoint.startswith("inproc://"):
                return endpoint
            if endpoint.startswith("ipc://"):
                return f"{endpoint}.{index}"
            host, _, port = endpoint.rpartition(":")
            if host.removeprefix("tcp://") not in ("*", "0.0.0.0", "[::]", "::", "localhost") \
                    and not host.startswith("tcp://127."):
                raise ValueError(f"kv_events_config.endpoint {endpoint!r} is not bound here: replicas sending to "
                                 f"one subscriber elsewhere would share a topic; give each server its own")
            return f"{host}:{int(port) + index}"

        return dataclasses.replace(self, endpoint=offset(self.endpoint), replay_endpoint=offset(self.replay_endpoint))


def encode(events: list, ts: float, hashes: VllmBlockHashes) -> bytes:
    """A batch as vLLM's KVEventBatch encodes it (msgspec, array-like, tagged by type name), blocks named by
    `hashes` (which follows the stream: events must come to it in order)."""
    import msgpack

    def one(e):
        if isinstance(e, BlockStored):
            return hashes.stored(e)
        if isinstance(e, BlockRemoved):
            return hashes.removed(e)
        if isinstance(e, AllBlocksCleared):
            hashes.digests.clear()
            return ["AllBlocksCleared"]
        raise TypeError(f"not a KV event: {e!r}")

    return msgpack.packb([ts, [one(e) for e in events]], use_bin_type=True)


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig) -> None:
        import zmq  # only a server that publishes needs it

        self.config = config
        self._hashes = VllmBlockHashes()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        bound = True
        try:
            self._pub.bind(config.endpoint)
        except zmq.ZMQError as exc:
            if exc.errno not in (errno.EADDRNOTAVAIL, errno.ENODEV):
                raise
            # Not an address of this host: a subscriber there binds it (llm-d's endpoint picker gathers every
            # replica's events on one socket), so the replica connects, as vLLM's publisher does.
            self._pub.connect(config.endpoint)
            bound = False
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("KV events %s %s (replay: %s, topic %r)", "on" if bound else "sent to", config.endpoint,
                 config.replay_endpoint or "none", config.topic)

    def publish(self, events: list) -> None:
        """One step's events (the event loop's call: never waits)."""
        if not events:
            return
        try:
            self._queue.put_nowait((events, time.time()))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                log.warning("KV event queue full: %d batches dropped", self._dropped)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        topic = self.config.topic.encode()
        while not self._stop.is_set():
            try:
                events, ts = self._queue.get(timeout=0.01)
            except queue.Empty:
                events = None
            if events is not None:
                payload, seq = encode(events, ts, self._hashes), self._seq
                self._seq += 1
                self._pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
                self._kept.append((seq, payload))
            if self._replay is not None and poller.poll(0):
                self._answer_replay()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        identity, start = frames[0], int.from_bytes(frames[-1], "big") if len(frames[-1]) == 8 else 0
        for seq, payload in list(self._kept):
            if seq >= start:
                self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([identity, b"", END_OF_REPLAY, b""])

    def close(self) -> None:
        """The events handed over so far go out, then the sockets close."""
        deadline = time.monotonic() + 2.0
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.005)
        self._stop.set()
        self._thread.join(timeout=5)
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()
