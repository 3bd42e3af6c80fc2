"""What a Trainer reports while it trains: typed events, and the bounded streams that carry them.

Events hold numbers and strings only, never tensors. Each ``trainer.events()`` call makes a
stream of its own with a bounded buffer: a consumer that falls behind loses the *oldest* events
(counted in ``EventStream.dropped``), so it can never slow training down or grow memory without
bound. A stream ends after the ``FitEnded`` event of the fit it saw.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import anyio
import anyio.lowlevel

from ._loop import running_loop
from ._progress import Progress

__all__ = [
    "CheckpointSaved",
    "DeviceDropped",
    "EpochEnded",
    "Event",
    "EventHub",
    "EventStream",
    "FitEnded",
    "FitStarted",
    "StepEnded",
    "StepRetried",
    "ValidationEnded",
    "WorkerFailed",
]


@dataclass(frozen=True)
class Event:
    """The base of every trainer event."""


@dataclass(frozen=True)
class FitStarted(Event):
    """``fit`` has started (after a resume, at the epoch it resumes from). ``start_epoch``
    counts the epochs already done: the first epoch this fit trains has that number in
    `StepEnded` and `EpochEnded`."""

    epochs: int
    start_epoch: int
    devices: tuple[str, ...]
    items_total: int | None


@dataclass(frozen=True)
class StepEnded(Event):
    """An optimizer step is done. ``loss`` and ``metrics`` are means over its items.
    ``epoch`` and ``step`` number from 0: the first step of a fit from the start is step 0.
    ``lr`` is the learning rate the step took (the first parameter group's), read before the
    LR scheduler stepped; ``None`` for an optimizer without one."""

    epoch: int
    step: int
    loss: float
    items: int
    progress: Progress
    metrics: Mapping[str, float] = field(default_factory=dict)
    lr: float | None = None


@dataclass(frozen=True)
class EpochEnded(Event):
    """A training epoch is done. ``train_loss`` is the mean over every item of the epoch.
    ``epoch`` numbers from 0, as `EpochRecord.epoch` does."""

    epoch: int
    train_loss: float
    items: int
    seconds: float
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ValidationEnded(Event):
    """Validation is done; ``metrics`` are exact means over every validation item."""

    epoch: int | None
    metrics: Mapping[str, float]
    items: int


@dataclass(frozen=True)
class CheckpointSaved(Event):
    """A checkpoint was written (atomically) to ``path``. ``epoch`` and ``step`` count the
    epochs and optimizer steps done when it was written, as its file name does
    (``epoch0004-step000120.ckpt``: 4 and 120)."""

    path: str
    epoch: int
    step: int


@dataclass(frozen=True)
class WorkerFailed(Event):
    """A device's job failed. ``action`` says what the trainer does next."""

    device: str
    epoch: int | None
    step: int | None
    phase: str | None
    error: str
    action: str


@dataclass(frozen=True)
class StepRetried(Event):
    """A failed step is being run again (``attempt`` counts from 1)."""

    epoch: int
    step: int
    attempt: int


@dataclass(frozen=True)
class DeviceDropped(Event):
    """A failed device was removed; training goes on with ``remaining``."""

    device: str
    remaining: tuple[str, ...]


@dataclass(frozen=True)
class FitEnded(Event):
    """``fit`` has returned or raised. ``stopped`` is True after ``stop()``. ``epoch`` and
    ``step`` count the epochs and optimizer steps done (`Trainer.epoch`,
    `Trainer.global_step`)."""

    epoch: int
    step: int
    stopped: bool
    reason: str | None = None
    error: str | None = None


class EventStream:
    """One consumer's view of a trainer's events: ``async for event in stream``.

    It ends after the ``FitEnded`` of the fit it saw, or when closed (`close`, or leaving
    ``async with stream:``); a stream nobody holds any more is dropped by the trainer. Tasks
    that read one stream together share its events (each goes to one of them), and all end
    with it; for every event in each, give each its own ``trainer.events()``.

    Attributes:
        dropped: Events lost because this consumer fell more than ``maxlen`` behind.
    """

    def __init__(self, hub: EventHub, maxlen: int) -> None:
        self._hub = hub
        self._queue: collections.deque[Event] = collections.deque(maxlen=maxlen)
        self._waiters: list[_Waiter] = []  # the consumers waiting for the next event
        self._ended = False
        self.dropped = 0

    def _push(self, event: Event) -> None:
        if len(self._queue) == self._queue.maxlen:
            self.dropped += 1
        self._queue.append(event)
        if isinstance(event, FitEnded):
            # Its last event, however far behind its consumer is: the next fit's are not its.
            self._ended = True
            self._hub.unsubscribe(self)
        self._wake()

    def _wake(self) -> None:
        for waiter in tuple(self._waiters):
            waiter.wake()

    def __aiter__(self) -> EventStream:
        return self

    def __iter__(self) -> NoReturn:
        raise TypeError(
            "an EventStream is read with 'async for event in stream:', inside an async "
            "function, beside the fit (a task of its own, or the fit's): events come as the "
            "fit runs, and a plain for would block the event loop the fit needs"
        )

    async def __anext__(self) -> Event:
        # A cancellation point even when events are buffered (no loop turn: see settle).
        await anyio.lowlevel.checkpoint_if_cancelled()
        while not self._queue:
            if self._ended:
                raise StopAsyncIteration
            # Each waiting task has a wakeup of its own, on its own loop: the fit may publish
            # from another thread's loop (a UI's loop reading a fit run in a thread), or a
            # wakeup left by a consumer cancelled in an earlier loop would be another loop's.
            waiter = _Waiter()
            # Held while a consumer waits here: a task nobody keeps (create_task's result
            # dropped) is held by what it waits on alone, this stream.
            self._waiters.append(waiter)
            self._hub._waiting.add(self)
            try:
                # Looked at again once the wakeup is in place: an event published from
                # another thread between the look above and now wakes nobody.
                if not self._queue and not self._ended:
                    await waiter.event.wait()
            finally:
                self._waiters.remove(waiter)
                if not self._waiters:
                    self._hub._waiting.discard(self)
        return self._queue.popleft()  # after a FitEnded nothing more comes in (see _push)

    def close(self) -> None:
        """Stop receiving events; the iteration ends once the buffer is read. May be called
        from any thread."""
        self._ended = True
        self._hub.unsubscribe(self)
        self._wake()

    async def aclose(self) -> None:
        """`close`, for ``contextlib.aclosing`` and other async resource helpers."""
        self.close()

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class _Waiter:
    """One consumer's wait for the next event, on the event loop it runs in: woken from that
    loop's thread directly, from any other thread through the loop (an ``anyio.Event`` may be
    set on its own loop's thread only), never waiting for that loop to run it."""

    __slots__ = ("_loop", "_woken", "event")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self._loop: Any = running_loop()  # the asyncio loop, or trio's token for its run
        self._woken = False

    def wake(self) -> None:
        if self._woken:  # once: a loop stopped meanwhile would pile up a callback an event
            return
        self._woken = True
        loop = self._loop
        if running_loop() is loop:
            self.event.set()
            return
        # Another thread's loop, or one that has ended (its consumer left in it when it was
        # closed): it has nobody left to wake then.
        schedule: Callable[[Callable[[], Any]], Any] = (
            loop.call_soon_threadsafe
            if isinstance(loop, asyncio.AbstractEventLoop)
            else loop.run_sync_soon
        )
        with contextlib.suppress(Exception):
            schedule(self.event.set)


class EventHub:
    """Fans each event out to every open stream; lives on the event loop thread.

    It holds its streams weakly, but for those whose consumer is waiting for the next event: a
    stream its consumer let go of (a loop left with ``break``, a client that disconnected) is
    not kept, filled and published to for the trainer's life.
    """

    def __init__(self, maxlen: int = 1000) -> None:
        self._maxlen = maxlen
        self._streams: weakref.WeakSet[EventStream] = weakref.WeakSet()
        self._waiting: set[EventStream] = set()  # consumers waiting in __anext__
        self._woke = False  # a publish woke a waiting consumer that has not run yet
        # Streams may be opened and closed on other threads' loops while a fit publishes.
        self._lock = threading.Lock()

    def subscribe(self, maxlen: int | None = None) -> EventStream:
        stream = EventStream(self, maxlen or self._maxlen)
        with self._lock:
            self._streams.add(stream)
        return stream

    def unsubscribe(self, stream: EventStream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def publish(self, event: Event) -> None:
        with self._lock:
            streams = tuple(self._streams)
        for stream in streams:
            stream._push(event)
        if self._waiting:
            self._woke = True

    async def settle(self) -> None:
        """Let the consumers the last events woke run up to their next ``await``, so that a
        ``stop()`` called straight from one (``if event.loss < 0.1: trainer.stop()``) is seen
        at the step boundary it was meant for. Never waits on a consumer: two turns of the
        loop (two, as trio may run the two woken tasks in either order), and none when no
        consumer was woken. Not a cancellation point."""
        if self._woke:
            self._woke = False
            await anyio.lowlevel.cancel_shielded_checkpoint()
            await anyio.lowlevel.cancel_shielded_checkpoint()
