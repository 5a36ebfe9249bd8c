"""Device worker threads: one per rank, each with its command queue (and, on CUDA, its own stream).

The event loop never waits for a device to compute: `WorkerGroup.call` puts one command on every rank's queue and
awaits futures that the worker threads resolve with `loop.call_soon_threadsafe`. (A decode step's hand-off,
`Replica.start_step`, waits at most `LAUNCH_WAIT_S` for the ranks' threads to launch it, never for the GPU to run
it.) Every rank runs the same commands in the same order. A rank that fails, or a step that outlives the
watchdog, poisons the replica: the group refuses every later command, aborts the collectives so no rank waits
forever, and the engine ends every live request with an error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_STOP = object()

# While a launched step's result is held (see DeviceWorker), how often the thread looks whether it is done.
HELD_POLL_S = 1e-4

# A rank handed a step needs the GIL to launch it, while the event loop thread makes the last step's outputs
# (detokenising, waking every stream's consumer). CPython gives a waiting thread the GIL only after its switch
# interval, 5 ms by default: longer than that output pass, so a step could wait for all of it. While any worker
# group runs, the process's interval is at most this (the previous value comes back when the last one stops);
# None leaves it alone.
WORKER_SWITCH_INTERVAL_S: float | None = 2e-4


class _SwitchInterval:
    """Holds the process's switch interval at WORKER_SWITCH_INTERVAL_S while any worker group runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups = 0
        self._before: float | None = None

    def group_started(self) -> None:
        with self._lock:
            self._groups += 1
            if self._groups == 1 and WORKER_SWITCH_INTERVAL_S is not None \
                    and WORKER_SWITCH_INTERVAL_S < sys.getswitchinterval():
                self._before = sys.getswitchinterval()
                sys.setswitchinterval(WORKER_SWITCH_INTERVAL_S)

    def group_stopped(self) -> None:
        with self._lock:
            self._groups -= 1
            if self._groups == 0 and self._before is not None:
                sys.setswitchinterval(self._before)
                self._before = None


_switch_interval = _SwitchInterval()


class ReplicaPoisoned(RuntimeError):
    """A rank failed; this replica serves nothing more."""


class DeviceWorker:
    """A thread that runs each command's fn(), in order, inside the rank's device context.

    A pipelined command (a step handed over before the one before it is awaited: overlap scheduling) may return a
    deferred result, an object with `ready()` and `finish()`: the step is queued on the device and its result not
    read yet. The thread holds it and runs the next command first if one arrives before the step is done, so the
    device gets step k+1 before the host waits for step k's tokens; the futures still resolve in command order."""

    def __init__(self, rank: int, name: str, on_error: Callable[[BaseException], None] = lambda exc: None) -> None:
        self.rank = rank
        self._on_error = on_error  # at once, from this thread: another rank may wait for this one in a collective
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop, pipelined: bool = False) -> asyncio.Future:
        future = loop.create_future()
        future.add_done_callback(_retrieved)  # a failed step the engine no longer awaits: its cause is logged already
        self._queue.put((fn, future, loop, pipelined))
        return future

    def _run(self) -> None:
        held = None  # (deferred, future, loop): a pipelined step launched, its result not taken yet
        while True:
            item = self._next(held)
            if item is None:  # nothing came while the held step ran to its end
                self._finish(*held)
                held = None
                continue
            if item is _STOP:
                if held is not None:
                    self._finish(*held)
                return
            fn, future, loop, pipelined = item
            if held is not None and not pipelined:
                self._finish(*held)
                held = None
            try:
                result, error = fn(), None
            except BaseException as exc:  # reported to the loop, never swallowed
                result, error = None, exc
                self._on_error(exc)
            if held is not None:
                self._finish(*held)
                held = None
            if pipelined and error is None and hasattr(result, "finish"):
                held = (result, future, loop)
            else:
                loop.call_soon_threadsafe(_resolve, future, result, error)
            # A launched step refers to its rank's runtime: held here into the next command (the teardown), it
            # kept the state alive past the teardown's hand-back of cached memory.
            item = fn = future = result = error = None

    def _next(self, held):
        """The next command; None when a step is held and done before one comes."""
        if held is None:
            return self._queue.get()
        timeout = 0.0
        while True:
            try:
                return self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()
            except queue.Empty:
                if held[0].ready():
                    return None
                timeout = HELD_POLL_S

    def _finish(self, deferred, future, loop) -> None:
        try:
            result, error = deferred.finish(), None
        except BaseException as exc:
            result, error = None, exc
            self._on_error(exc)
        loop.call_soon_threadsafe(_resolve, future, result, error)

    def stop(self, timeout: float) -> bool:
        self._queue.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class WorkerGroup:
    """The ranks of one replica. `call(fn)` runs fn(rank) on every rank and returns the list of results."""

    def __init__(self, world_size: int, step_timeout_s: float = 600.0, on_abort: Callable[[], None] | None = None):
        self.world_size = world_size
        self.step_timeout_s = step_timeout_s
        # A rank's failure poisons the group from its own thread: the engine may be awaiting an earlier step,
        # while the other ranks wait for the failed one in a collective of a later one.
        self.workers = [DeviceWorker(r, f"device-rank{r}", on_error=self.poison) for r in range(world_size)]
        self.poisoned: BaseException | None = None
        self._poison_lock = threading.Lock()
        self._on_abort = on_abort  # breaks collectives so surviving ranks stop waiting
        self._running = True
        _switch_interval.group_started()

    async def call(self, fn: Callable[[int], Any], timeout_s: float | None = None) -> list[Any]:
        return await self.gather(self.submit(fn), timeout_s)

    def submit(self, fn: Callable[[int], Any], pipelined: bool = False) -> list[asyncio.Future]:
        """Put fn(rank) on every rank's queue now (the ranks start at once); `gather` awaits the results.
        `pipelined`: fn may return a deferred result (see DeviceWorker)."""
        if self.poisoned is not None:
            raise ReplicaPoisoned(f"replica is poisoned: {self.poisoned}") from self.poisoned
        loop = asyncio.get_running_loop()
        return [w.submit(lambda r=w.rank: fn(r), loop, pipelined) for w in self.workers]

    async def gather(self, futures: list[asyncio.Future], timeout_s: float | None = None) -> list[Any]:
        try:
            done, pending = await asyncio.wait(futures, timeout=timeout_s or self.step_timeout_s,
                                               return_when=asyncio.FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                self.poison(failed[0].exception())
                # Surviving ranks are now released from any collective; collect them so nothing is left behind.
                await asyncio.wait(futures, timeout=30)
                for f in futures:
                    if f.done():
                        f.exception()  # retrieved: their errors follow from the first
                raise ReplicaPoisoned(f"a rank failed: {self.poisoned!r}") from self.poisoned
            if pending:
                self.poison(TimeoutError(f"a step did not finish within {timeout_s or self.step_timeout_s:.0f} s"))
                raise ReplicaPoisoned(str(self.poisoned))
            return [f.result() for f in futures]
        except asyncio.CancelledError:
            # The caller gave up mid-step: the ranks may be anywhere, so this replica cannot be trusted.
            self.poison(RuntimeError("a step was cancelled while the devices ran it"))
            raise

    def poison(self, error: BaseException) -> None:
        with self._poison_lock:
            if self.poisoned is not None:
                return
            self.poisoned = error
        log.error("replica poisoned: %r", error, exc_info=error)  # the one record of the cause
        if self._on_abort is not None:
            self._on_abort()

    def stop(self, timeout: float = 30.0) -> None:
        for w in self.workers:
            if not w.stop(timeout):
                log.error("rank %d did not stop within %.0f s", w.rank, timeout)
        if self._running:
            self._running = False
            _switch_interval.group_stopped()
