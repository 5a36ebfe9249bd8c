"""KV-cache events in vLLM's format over ZMQ: a subscriber's view of the stream, under churn (shared prefixes hit,
prompts evicting others, requests cancelled), is the prefix cache's own: exactly the pages some snapshot's prefix
needs, each block named by vLLM's sha256_cbor hash of its tokens, every announced snapshot prefix resumable; the
replay socket gives the same batches again."""

import asyncio
import errno
import hashlib
import json
import random
import socket

import msgpack
import pytest
import zmq

from deltaserve.runtime import AsyncEngine, EngineArgs, SamplingParams
from deltaserve.runtime.kv_events import KvEventsConfig, VllmBlockHashes


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_event_stream_is_the_prefix_cache_s_resumable_prefixes(tiny_ckpt):
    pub, replay = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
                         "replay_endpoint": replay, "topic": "kv", "buffer_steps": 100_000})
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    received = []

    def drain():
        while sub.poll(50):
            received.append(sub.recv_multipart())

    async def main():
        args = EngineArgs(model=tiny_ckpt, max_model_len=512, max_batch=8, cpu_memory_bytes=6 << 20,
                          kv_events_config=config)
        async with AsyncEngine(args) as engine:
            sub.connect(pub)
            await asyncio.sleep(0.3)  # a SUB socket misses what is sent before it is connected
            rng = random.Random(0)
            systems = [[rng.randrange(3, 500) for _ in range(48 + 16 * i)] for i in range(4)]
            for wave in range(6):
                streams = []
                for j in range(8):
                    prompt = systems[rng.randrange(4)] + [rng.randrange(3, 500) for _ in range(rng.randrange(5, 90))]
                    streams.append(engine.generate(prompt, SamplingParams(max_tokens=rng.randrange(1, 24),
                                                                          temperature=0.0)))
                outs = []
                for k, s in enumerate(streams):
                    if k % 5 == 4:  # cancelled after its first output
                        async for _ in s:
                            break
                        await s.aclose()
                    else:
                        async for out in s:
                            pass
                        outs.append(out)
                await asyncio.sleep(0.05)
                drain()
            await asyncio.sleep(0.3)
            drain()
            cache = engine.scheduler.cache
            live = {snap.index: snap for snap in cache.snapshots.lru.values()}
            wire = {key: VllmBlockHashes.wire(d) for key, d in engine.kv_events._hashes.digests.items()}
            resumable = {i: [wire[k] for k in keys] for i, keys in cache.resumable.chains.items()}
            page_of = {wire[k] for k in cache.pages.page_of if k in wire}
            page_size = cache.page_size
            matches = {}
            for index, keys in resumable.items():
                snap = live[index]
                tokens = _tokens(keys, stored_tokens(received))
                full = tokens + list(snap.tail) + [7]
                matches[index] = cache.match(full, cache.keys(full)).position
            return live, resumable, page_of, page_size, matches, await asyncio.to_thread(ask_replay)

    def ask_replay():  # every kept batch, from the first
        dealer = context.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while dealer.poll(5000):
            frames = dealer.recv_multipart()
            if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                break
            got.append(frames[-2:])
        dealer.close(linger=0)
        return got

    try:
        live, resumable, page_of, page_size, matches, replayed = asyncio.run(main())
    finally:
        sub.close(linger=0)
        context.term()

    seqs = [int.from_bytes(m[1], "big") for m in received]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # numbered in order, none lost
    reference, stored, kinds = VllmBlockHashes(), {}, []
    for topic, _, payload in received:
        ts, events = msgpack.unpackb(payload)
        assert topic == b"kv" and ts > 0
        for e in events:
            kinds.append(e[0])
            if e[0] == "BlockStored":
                hashes, parent, tokens, block_size = e[1:5]
                assert block_size == page_size and len(tokens) == len(hashes) * page_size
                digest = reference.root if parent is None else stored[parent]
                for i, h in enumerate(hashes):  # each hash is vLLM's: its page's tokens chained on its parent's
                    digest = reference.digest(digest, tokens[i * page_size:(i + 1) * page_size])
                    assert VllmBlockHashes.wire(digest) == h
                    stored[h] = digest
            elif e[0] == "BlockRemoved":
                for h in e[1]:
                    stored.pop(h)  # KeyError: a block removed that was never stored
            else:
                stored.clear()
    assert kinds.count("BlockStored") >= 8 and "BlockRemoved" in kinds  # churn: stored, evicted, stored again
    # the stream's view is the cache's: the pages some live snapshot's prefix needs, every one still cached
    needed = {k for keys in resumable.values() for k in keys}
    assert set(stored) == needed and needed <= page_of
    # every announced snapshot prefix is resumed (a request with its tokens starts at least at its anchor)
    for index, keys in resumable.items():
        assert matches[index] >= len(keys) * page_size
    assert [m[-2:] for m in received] == replayed[-len(received):]  # the replay socket's copy


def stored_tokens(received) -> dict:
    out = {}
    for _, _, payload in received:
        for e in msgpack.unpackb(payload)[1]:
            if e[0] == "BlockStored":
                ps = e[4]
                for i, h in enumerate(e[1]):
                    out[h] = e[3][i * ps:(i + 1) * ps]
    return out


def _tokens(keys, tokens_of) -> list[int]:
    return [t for k in keys for t in tokens_of[k]]


def test_an_endpoint_on_another_host_is_connected_to(monkeypatch):
    """llm-d's endpoint picker binds one socket and every replica's publisher connects to it: an endpoint that is
    not an address of this host (here: one whose bind is refused as such) is connected to, not bound."""
    from deltaserve.runtime import prefix_cache as pc
    from deltaserve.runtime.kv_events import KvEventPublisher

    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    remote = f"tcp://127.0.0.1:{port}"
    bind = zmq.Socket.bind

    def refuse(self, addr):
        if addr == remote:
            raise zmq.ZMQError(errno.EADDRNOTAVAIL)
        return bind(self, addr)

    monkeypatch.setattr(zmq.Socket, "bind", refuse)
    publisher = KvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=remote,
                                                topic="kv@10.0.0.7@qwen"))
    try:
        got = None
        for _ in range(50):  # a PUB socket drops what it sends before the connection is made
            publisher.publish([pc.BlockStored([bytes(16)], None, list(range(16)), 16)])
            if sub.poll(100):
                got = sub.recv_multipart()
                break
        assert got is not None and got[0] == b"kv@10.0.0.7@qwen"
        assert msgpack.unpackb(got[2])[1][0][0] == "BlockStored"
    finally:
        publisher.close()
        sub.close(linger=0)
        context.term()


def test_bad_kv_events_configs_are_refused_by_name():
    for bad, word in (("{", "JSON"), ("[]", "object"), ('{"endpont": "x"}', "endpont"),
                      ('{"publisher": "kafka"}', "publisher"), ('{"buffer_steps": 0}', "buffer_steps"),
                      ('{"endpoint": "localhost:5557"}', "endpoint"), ('{"replay_endpoint": "tcp://*"}', "replay")):
        with pytest.raises(ValueError, match=word):
            KvEventsConfig.parse(bad)


def test_block_hashes_are_vllm_s_sha256_cbor_ones():
    """Published vectors of vLLM's scheme (PYTHONHASHSEED=0, block size 16): the seed's digest, then two chained
    blocks' digests and the 64-bit names the events carry."""
    hashes = VllmBlockHashes(seed="0")
    assert hashes.root.hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    first = hashes.digest(hashes.root, list(range(101, 1617, 101)))
    assert first.hex() == "d450abdaf2c9ebdd0e0cbfbc4e24a5c07ff71dcab37be7426d4fa0e5fdb93342"
    assert hashes.wire(first) == 7876691182959014722
    assert hashes.wire(hashes.digest(first, list(range(1717, 3233, 101)))) == 8769878286166771163
    assert VllmBlockHashes().root == hashlib.sha256(bytes.fromhex("6e") + b"vllm-none-hash").digest()


def test_vllm_s_own_decoder_reads_a_batch():
    """vLLM's subscribers decode with msgspec structs (array-like, tagged by type name): the same shapes here."""
    from typing import Any

    import msgspec

    from deltaserve.runtime import prefix_cache as pc
    from deltaserve.runtime.kv_events import encode

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    a, b = bytes(range(16)), bytes(range(16, 32))  # the cache's page keys; the wire carries vLLM's names
    hashes = VllmBlockHashes(seed="0")
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(encode(
        [pc.BlockStored([a, b], None, list(range(32)), 16), pc.BlockRemoved([b]), pc.AllBlocksCleared()], 1.5,
         hashes))
    first = hashes.digest(hashes.root, list(range(16)))
    names = [hashes.wire(first), hashes.wire(hashes.digest(first, list(range(16, 32))))]
    assert batch.ts == 1.5 and [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved",
                                                                             "AllBlocksCleared"]
    stored = batch.events[0]
    assert stored.block_hashes == names and stored.parent_block_hash is None and stored.token_ids == list(range(32))
    assert stored.block_size == 16 and stored.medium == "GPU" and batch.events[1].block_hashes == names[1:]
    assert hashes.digests == {}  # cleared with the cache
