"""Prefix caching for the hybrid state: KV pages shared by content, and snapshots of the recurrent state.

A request may skip the prefill of a prompt prefix only if it has both the prefix's KV (for the attention layers)
and the GDN and conv state after exactly that prefix (the recurrence cannot be resumed anywhere else). So:

- Every full page of prompt (16 tokens) is keyed by a chain hash of its tokens and its parent's key. A page is
  held by the requests that use it (reference counts); once none does, a keyed page stays cached, and is evicted
  least recently used when a fresh page is needed. A shared page is never written: a request resumes after it.
- A snapshot is a copy of one request's recurrent state (every GDN layer's state and conv window, per rank) in a
  pool of its own, taken at the end of a prefill chunk: at the end of each prompt, at page-aligned chunk ends of
  long prompts, and at branch points. It is found by the key of the page-aligned prefix below its position (its
  anchor) and the tokens from there (its tail, shorter than a page). A snapshot whose position is not
  page-aligned holds the page with its tail's KV, which a request resuming from it copies into a page of its own.
- A prompt's usable prefix is the longest one with both: its full pages cached and a snapshot at its end, at
  most the prompt less one token (the last prompt token's logits are what the request samples first), or the
  whole prompt where a prefill's snapshot at its end also kept that token's hidden state (`Snapshot.logits`):
  the request then computes only lm_head over it (a repeated prompt, best-of-n sent as separate requests).

Plain Python, no torch: the scheduler decides, the ranks copy (`devices.commands`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ROOT_KEY = b""  # the key of the empty prefix


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a prefix: its parent's key and the tokens after it."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def page_keys(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """The keys of the prompt's full pages: keys[i] names the prefix token_ids[: (i + 1) * page_size]."""
    keys, parent = [], ROOT_KEY
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = chain_key(parent, token_ids[start : start + page_size])
        keys.append(parent)
    return keys


class PagePool:
    """KV pages: free, held (reference counted), or cached (keyed, held by nobody, evictable: oldest first)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self.refs = [0] * num_pages
        self.key_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.on_evict: Callable[[bytes], None] | None = None  # a cached prefix's page taken for another

    @property
    def available(self) -> int:
        """Pages a request could take now: the free ones and the cached ones nobody holds."""
        return len(self.free) + len(self.evictable)

    @property
    def cached(self) -> int:
        return len(self.key_of)

    def take(self, n: int) -> list[int]:
        """n fresh pages, each held once: free ones first, then the least recently used cached ones."""
        if n > self.available:
            raise AssertionError(f"{n} pages asked for, {self.available} available")
        pages = []
        for _ in range(n):
            if self.free:
                page = self.free.pop()
            else:
                page, _ = self.evictable.popitem(last=False)
                key = self.key_of.pop(page)
                del self.page_of[key]
                if self.on_evict is not None:
                    self.on_evict(key)
            self.refs[page] = 1
            pages.append(page)
        return pages

    def hold(self, page: int) -> None:
        """One more holder of a page that is held or cached."""
        if self.refs[page] == 0:
            del self.evictable[page]  # KeyError for a free page: nobody may hold one without `take`
        self.refs[page] += 1

    def drop(self, page: int) -> None:
        """One holder fewer; a page nobody holds is cached if it is keyed, else free."""
        if self.refs[page] <= 0:
            raise AssertionError(f"page {page} dropped more often than held")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            if page in self.key_of:
                self.evictable[page] = None
            else:
                self.free.append(page)

    def lookup(self, key: bytes) -> int | None:
        return self.page_of.get(key)

    def register(self, page: int, key: bytes) -> None:
        """A held page now holds the full prefix `key`. If another page holds it already, this one stays private."""
        if key not in self.page_of and page not in self.key_of:
            self.page_of[key], self.key_of[page] = page, key

    def forget_keys(self) -> None:
        """No page holds a prefix any more: the cached ones are free."""
        self.free.extend(reversed(self.evictable))
        self.evictable.clear()
        self.key_of.clear()
        self.page_of.clear()

    def check(self) -> None:
        held = {p for p in range(self.num_pages) if self.refs[p] > 0}
        free, evictable = set(self.free), set(self.evictable)
        assert len(free) == len(self.free), "a page is free twice"
        assert not held & free and not held & evictable and not free & evictable, "a page is in two states"
        assert len(held) + len(free) + len(evictable) == self.num_pages, "a page leaked"
        assert evictable <= set(self.key_of), "an unkeyed page is cached"
        assert all(self.page_of[k] == p for p, k in self.key_of.items()) and len(self.page_of) == len(self.key_of)
        assert all(r >= 0 for r in self.refs)


@dataclass
class Snapshot:
    index: int  # the snapshot slot, the same on every rank
    anchor: bytes  # the key of the page-aligned prefix below `position`
    tail: tuple[int, ...]  # the tokens from the anchor to `position` (shorter than a page)
    position: int  # prompt tokens the state has consumed
    tail_page: int | None  # holds the tail's KV (held by the snapshot) when the tail is not empty
    logits: bool = False  # it holds the hidden state of its last token too (taken at a prefill chunk's end)


class SnapshotPool:
    """`capacity` snapshot slots; the least recently used snapshot gives its slot to a new one."""

    def __init__(self, capacity: int, pages: PagePool) -> None:
        self.capacity, self.pages = capacity, pages
        self.free: list[int] = list(range(capacity - 1, -1, -1))
        self.by_anchor: dict[bytes, dict[tuple[int, ...], Snapshot]] = {}
        self.lru: OrderedDict[int, Snapshot] = OrderedDict()  # oldest first
        self.on_forget: Callable[[Snapshot], None] | None = None  # a snapshot evicted

    def __len__(self) -> int:
        return len(self.lru)

    def find(self, anchor: bytes, after: Sequence[int]) -> Snapshot | None:
        """The snapshot under `anchor` with the longest tail that `after` (the tokens from the anchor on, at most
        a page less one) starts with."""
        entries = self.by_anchor.get(anchor)
        if not entries:
            return None
        for n in range(len(after), -1, -1):
            snap = entries.get(tuple(after[:n]))
            if snap is not None:
                return snap
        return None

    def add(self, anchor: bytes, tail: tuple[int, ...], position: int, tail_page: int | None,
            logits: bool = False) -> Snapshot | None:
        """A slot for a new snapshot (the caller copies the state into it), or None when that prefix has one
        already or the pool has no slots. The snapshot holds `tail_page`."""
        if self.capacity == 0 or tail in self.by_anchor.get(anchor, {}):
            return None
        if self.free:
            index = self.free.pop()
        else:
            _, oldest = self.lru.popitem(last=False)
            self._forget(oldest)
            index = oldest.index
        snap = Snapshot(index, anchor, tail, position, tail_page, logits)
        if tail_page is not None:
            self.pages.hold(tail_page)
        self.by_anchor.setdefault(anchor, {})[tail] = snap
        self.lru[index] = snap
        return snap

    @property
    def held_pages(self) -> int:
        """KV pages the snapshots hold (their tails'; a request's end-of-prompt and end-of-answer snapshots may
        share one)."""
        return len({snap.tail_page for snap in self.lru.values() if snap.tail_page is not None})

    def touch(self, snap: Snapshot) -> None:
        self.lru.move_to_end(snap.index)

    def evict_all(self) -> None:
        for snap in list(self.lru.values()):
            self._forget(snap)
            self.free.append(snap.index)
        self.lru.clear()

    def _forget(self, snap: Snapshot) -> None:
        if self.on_forget is not None:
            self.on_forget(snap)
        entries = self.by_anchor[snap.anchor]
        del entries[snap.tail]
        if not entries:
            del self.by_anchor[snap.anchor]
        if snap.tail_page is not None:
            self.pages.drop(snap.tail_page)

    def check(self) -> None:
        assert len(self.free) + len(self.lru) == self.capacity, "a snapshot slot leaked"
        assert not set(self.free) & set(self.lru)
        assert sum(map(len, self.by_anchor.values())) == len(self.lru)
        for snap in self.lru.values():
            assert self.by_anchor[snap.anchor][snap.tail] is snap
            assert (snap.tail_page is not None) == bool(snap.tail)
            if snap.tail_page is not None:
                assert self.pages.refs[snap.tail_page] > 0


@dataclass
class PrefixMatch:
    position: int  # prompt tokens the request skips (0: none)
    pages: list[int]  # the cached full pages below `position`, in order
    snapshot: Snapshot | None  # the state at `position`
    branch: int  # a page boundary past `position` up to which cached pages match: snapshot there (0: none)


@dataclass(frozen=True)
class BlockStored:
    """Pages a request could now resume after (vLLM's KV event of the name): consecutive full pages of a prefix,
    each named by its key, the first's parent key (None: the prompt's start), and their tokens."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


class ResumablePrefixes:
    """Which full pages a request can resume after, told as events a router reads (`runtime.kv_events`). A page
    counts only on the way to a snapshot (the recurrent state must be resumed exactly there): each snapshot
    announces the pages from the prompt's start to its anchor, and a page is announced while some snapshot whose
    pages are all still cached needs it. A page evicted retracts every snapshot needing it (it is not announced
    again until a snapshot is taken anew on it): the events may tell of fewer prefixes than the cache could resume,
    never more."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.needed: dict[bytes, set[int]] = {}  # announced page key -> the snapshots (by index) that need it
        self.chains: dict[int, list[bytes]] = {}  # snapshot index -> the page keys it announced
        self.events: list = []  # not yet published (`take`)

    def snapshot_taken(self, snap: Snapshot, keys: list[bytes], tokens: Sequence[int]) -> None:
        """`keys`: the page keys from the start to the snapshot's anchor; `tokens`: the tokens they hold."""
        ps, fresh = self.page_size, []
        for i, key in enumerate(keys):
            holders = self.needed.setdefault(key, set())
            if not holders:
                fresh.append(i)
            holders.add(snap.index)
        self.chains[snap.index] = list(keys)
        runs = []  # consecutive fresh pages, one event each
        for i in fresh:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self.events.append(BlockStored([keys[i] for i in run], keys[first - 1] if first else None,
                                           list(tokens[first * ps : (last + 1) * ps]), ps))

    def snapshot_gone(self, snap: Snapshot) -> None:
        self._retract(snap.index)

    def page_evicted(self, key: bytes) -> None:
        for index in list(self.needed.get(key, ())):
            self._retract(index)

    def _retract(self, index: int) -> None:
        """A snapshot's pages are no longer announced on its behalf: those no other snapshot needs are removed."""
        removed = []
        for key in self.chains.pop(index, ()):
            holders = self.needed.get(key)
            if holders is not None:
                holders.discard(index)
                if not holders:
                    del self.needed[key]
                    removed.append(key)
        if removed:
            self.events.append(BlockRemoved(removed))

    def cleared(self) -> None:
        self.needed.clear()
        self.chains.clear()
        self.events.append(AllBlocksCleared())

    def take(self) -> list:
        events, self.events = self.events, []
        return events


class PrefixCache:
    def __init__(self, num_pages: int, page_size: int, snapshots: int, enabled: bool = True,
                 announce: bool = False) -> None:
        """announce: keep `resumable` (KV events for routers)."""
        self.page_size, self.enabled = page_size, enabled
        self.pages = PagePool(num_pages)
        self.snapshots = SnapshotPool(snapshots if enabled else 0, self.pages)
        self.resumable = ResumablePrefixes(page_size) if announce and enabled else None
        if self.resumable is not None:
            self.pages.on_evict = self.resumable.page_evicted
            self.snapshots.on_forget = self.resumable.snapshot_gone

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        return page_keys(token_ids, self.page_size) if self.enabled else []

    def match(self, token_ids: Sequence[int], keys: list[bytes]) -> PrefixMatch:
        """The longest usable prefix of a prompt (`keys`: its `page_keys`)."""
        if not self.enabled:
            return PrefixMatch(0, [], None, 0)
        ps, limit = self.page_size, len(token_ids) - 1
        matched = 0  # leading full pages cached
        while matched < len(keys) and keys[matched] in self.pages.page_of:
            matched += 1
        full = len(token_ids) // ps
        if matched >= full:  # the whole prompt, from a snapshot that kept its last token's hidden state
            anchor = keys[full - 1] if full else ROOT_KEY
            snap = self.snapshots.by_anchor.get(anchor, {}).get(tuple(token_ids[full * ps :]))
            if snap is not None and snap.logits:
                return PrefixMatch(len(token_ids), [self.pages.page_of[k] for k in keys[:full]], snap, 0)
        top = min(matched, limit // ps)
        for j in range(top, -1, -1):
            anchor = keys[j - 1] if j else ROOT_KEY
            snap = self.snapshots.find(anchor, token_ids[j * ps : min((j + 1) * ps - 1, limit)])
            if snap is not None:
                pages = [self.pages.page_of[k] for k in keys[:j]]
                position = j * ps + len(snap.tail)
                return PrefixMatch(position, pages, snap, top * ps if top * ps > position else 0)
        return PrefixMatch(0, [], None, top * ps)

    def clear(self) -> None:
        """Forget every cached prefix (pages still held stay with their holders, unkeyed)."""
        if self.resumable is not None:  # first: one AllBlocksCleared, not a BlockRemoved for each snapshot before it
            self.resumable.cleared()
        self.snapshots.evict_all()
        self.pages.forget_keys()

    def check(self) -> None:
        self.pages.check()
        self.snapshots.check()
