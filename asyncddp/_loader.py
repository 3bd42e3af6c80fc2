"""Iterating the user's data on a thread of its own, a few batches ahead of training.

A ``DataLoader`` may block for a long time in ``next()`` (disk, decoding, worker processes):
on the event loop that would freeze every other task. `Prefetcher` calls ``iter()`` and
``next()`` on a named thread (``asyncddp-loader``) and hands batches to the loop through a
small bounded buffer, so the next batch loads while the devices compute the current one. Data
that cannot block (batches in a list) is read in place instead (``inline``): a thread would
only add a wake-up a batch.

Closing never waits for a call into the data: a thread inside ``iter()`` or ``next()`` (a slow
disk, a stream waiting for data) is left to finish that call, drops what it returns, releases
its iterator and exits. Until it has, a new `Prefetcher` over the same data waits for it
(`after_left_behind`): two threads must not read one iterator (an iterator's ``iter()`` is
itself, a ``DataLoader`` with ``persistent_workers`` hands out the same one), and the call left
running may still draw from the random number generators that the next reader puts back.

Continuing an epoch, the loader thread replays its start: it loads (``replay``) as many batches
as the interrupted run's loader had loaded, keeping those after the first ``skip`` (already
trained on), and only then calls ``resume`` (which puts the random number generators back as
the interrupted run left them), before it hands any batch over. A loader that draws random
numbers itself (augmentation in ``__getitem__`` with ``num_workers=0``) then draws what it drew
in the interrupted run, and training goes on from the generators' state then. `loaded`
counts the batches loaded so far, a batch a thread left behind finishes loading included (its
draws were made); `paused` holds the thread between two batches, so that a checkpoint sees
the count and the generators together. A replay cut short by closing stops after the batch it
is loading, then still calls ``resume``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

import anyio

from ._exit import wait_at_exit
from ._loop import Waker, current_waker

__all__ = ["ENDED", "GAVE_UP", "Prefetcher", "after_left_behind"]

#: What `Prefetcher.next` returns at the end of the data, and when it gave up waiting.
ENDED, GAVE_UP = object(), object()

#: Guards every Prefetcher's hand-over between its thread and the loop, and ``_left_behind``.
_lock = threading.Lock()
#: Prefetchers closed while their thread was inside a call into the data, by ``id()`` of that
#: data's source (see `after_left_behind`); each thread removes itself as it exits, and
#: until then holds the source, so its ``id()`` is not reused meanwhile.
_left_behind: dict[int, list[Prefetcher]] = {}


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


async def after_left_behind(source: object) -> None:
    """Wait for the loader threads that closed Prefetchers over ``source`` left inside a call
    into it, if any, to return from that call and exit. Cancellable."""
    while True:
        waker = None
        with _lock:
            for prefetcher in _left_behind.get(id(source), ()):
                waker = waker or current_waker()
                prefetcher._followers.append(waker)  # woken as it exits
        if waker is None:
            return
        await waker.wait(None)


class Prefetcher:
    """Iterates ``data`` on a thread, ``depth`` batches ahead (or in place, ``inline``);
    ``async for`` over it.

    Args:
        data: Any iterable of batches.
        depth: How many batches may wait, loaded, for the loop to take them. 0: none is
            read ahead: the next batch's ``next()`` is called once the loop asks for it,
            after it is done with the one before (for data that reuses one buffer for every
            batch, or whose next batch depends on the step before).
        transform: Applied to each batch where it is read (the loader thread, for example
            pinning memory; or the loop, ``inline``).
        name: What the data is called in errors.
        inline: Iterate ``data`` on the event loop's thread, with no loader thread: for data
            whose ``next()`` never blocks (batches in a list, in memory already), where a
            thread would only add a wake-up a batch.
        source: The user's object that ``data`` reads (by default ``data`` itself; a rank's
            view of it, say): what a Prefetcher left behind is found by (see
            `after_left_behind`).
        skip: How many of the first batches to load and drop (trained on already).
        replay: How many batches to load before handing any over (at least ``skip``).
        resume: Called once those are loaded (or closing cut that short), before any batch is
            handed over.
    """

    def __init__(
        self,
        data: Iterable[Any],
        *,
        depth: int = 2,
        transform: Callable[[Any], Any] | None = None,
        name: str = "data",
        inline: bool = False,
        source: object = None,
        skip: int = 0,
        replay: int = 0,
        resume: Callable[[], None] | None = None,
    ) -> None:
        self._data = data
        self._skip = skip
        self._replay = max(replay, skip)
        self._resume = resume
        #: Batches loaded so far (dropped, waiting or handed over).
        self.loaded = 0
        self._drawing = threading.Lock()  # held by the loader thread while it loads a batch
        self._source = data if source is None else source
        self._inline: Iterator[Any] | None = None
        self._inline_wanted = inline
        self._transform = transform
        self._name = name
        self._buffer: collections.deque[Any] = collections.deque()
        # With depth 0, the one slot is given back as the loop asks for the next batch, not
        # as it takes one (_owed).
        self._slots = threading.Semaphore(max(depth, 1))
        self._lazy = depth == 0
        self._owed = False
        # Set, and read, under _lock: whether the loop closed this Prefetcher; whether the
        # thread is inside a call into the data (iter(), next() or the transform); tasks to
        # wake as it exits.
        self._closed = threading.Event()
        self._in_call = True  # from its start: the thread's first call is iter()
        self._followers: list[Waker] = []
        self._finished = threading.Event()
        self._waker: Waker | None = None
        self._thread = threading.Thread(target=self._main, name="asyncddp-loader", daemon=True)

    async def __aenter__(self) -> Prefetcher:
        if self._inline_wanted:
            self._inline = iter(self._data)
            # Batches in memory draw no random numbers: drop those done, then resume.
            self.loaded = len(list(itertools.islice(self._inline, self._skip)))
            if self._resume is not None:
                self._resume()
            return self
        await after_left_behind(self._source)
        self._waker = current_waker()
        self._thread.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> Prefetcher:
        return self

    async def __anext__(self) -> Any:
        batch = await self.next()
        if batch is ENDED:
            raise StopAsyncIteration
        return batch

    async def next(self, give_up: Callable[[], bool] | None = None) -> Any:
        """The next batch, or `ENDED` at the end of the data.

        ``give_up``: while no batch is loaded, return `GAVE_UP` instead of waiting once
        it is true; checked again after every `wake`. Never for ``inline`` data, which has
        its batches at hand.
        """
        if self._inline is not None:
            try:
                batch = next(self._inline)
            except StopIteration:
                return ENDED
            except Exception as failure:
                failure.add_note(f"raised while iterating {self._name}")
                raise
            self.loaded += 1
            return self._transform(batch) if self._transform is not None else batch
        waker = self._waker
        assert waker is not None, "use 'async with Prefetcher(...)'"
        if self._owed:  # depth 0: done with the batch before, so the thread may read on
            self._owed = False
            self._slots.release()
        while not self._buffer:
            if give_up is not None and give_up():
                return GAVE_UP
            await waker.wait(None)
        item = self._buffer.popleft()
        if self._lazy and item is not ENDED and not isinstance(item, _Failed):
            self._owed = True
        else:
            self._slots.release()
        if item is ENDED:
            self._buffer.appendleft(ENDED)  # every later call ends too
            return ENDED
        if isinstance(item, _Failed):
            error = item.error
            del item
            error.add_note(f"raised while iterating {self._name} (on the asyncddp-loader thread)")
            try:
                raise error
            finally:
                del error
        return item

    def wake(self) -> None:
        """Wake a `next` waiting for a batch, to check its ``give_up`` again."""
        if self._waker is not None:
            self._waker.wake_threadsafe()

    @property
    def source(self) -> object:
        """The user's object this reads (see `after_left_behind`)."""
        return self._source

    @property
    def left_behind(self) -> bool:
        """Whether closing left the thread inside a call into the data, still running: its
        `loaded` may still grow by the batch it is loading."""
        with _lock:
            return self._closed.is_set() and not self._finished.is_set()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[int]:
        """Hold the loader thread between two batches (waiting, on a thread, for one it is
        loading, also once a thread closing left behind: its batch counts); yields
        `loaded`. A cancellation is taken within 50 ms, even while a slow ``next()``
        goes on."""
        while not await anyio.to_thread.run_sync(self._drawing.acquire, True, 0.05):
            pass
        try:
            yield self.loaded
        finally:
            self._drawing.release()

    def hold(self, timeout: float) -> bool:
        """`paused`, from the event loop's thread, blocking it up to ``timeout`` seconds for a
        batch being loaded; whether the thread is held (then `release` it)."""
        return self._drawing.acquire(True, timeout)

    def release(self) -> None:
        """End a `hold`."""
        self._drawing.release()

    def used_up(self) -> bool | None:
        """Whether the data has no batch left, where that is known without waiting for the
        loader thread: True once it reached the end, False while a batch (or a failure) waits
        in the buffer, None while the thread is still reading (and always ``inline``)."""
        if not self._buffer:
            return None
        return self._buffer[0] is ENDED

    async def aclose(self) -> None:
        """Stop loading. A thread inside a call into the data (``iter()``, ``next()``) is not
        waited for: it finishes that call in the background, drops what it returns, releases
        its iterator and exits, and a Prefetcher over the same source waits for it to (see
        `after_left_behind`). A thread outside one is waited for (shielded): it only has
        to release its iterator (for a ``DataLoader``'s, that shuts its worker processes down).
        """
        if self._inline is not None:
            self._inline = iter(())  # closed: nothing more
            return
        if self._thread.ident is None or self._waker is None:
            return
        with _lock:
            self._closed.set()
            left = self._in_call and not self._finished.is_set()
            if left:
                _left_behind.setdefault(id(self._source), []).append(self)
                wait_at_exit(self._thread)
        self._slots.release()  # a thread waiting for room wakes up and sees the close
        self._buffer.clear()
        if left:
            return
        cancellation: BaseException | None = None
        while not self._finished.is_set():
            _, cancelled = await self._waker.wait_shielded(None)
            cancellation = cancellation or cancelled
        self._thread.join()
        if cancellation is not None:
            raise cancellation

    def _main(self) -> None:
        waker = self._waker
        assert waker is not None
        try:
            self._load(waker)  # returns having dropped the iterator: it lived in _load's frame
        finally:
            with _lock:
                self._in_call = False
                self._finished.set()
                followers, self._followers = self._followers, []
                waiting = _left_behind.get(id(self._source), [])
                if self in waiting:
                    waiting.remove(self)
                    if not waiting:
                        del _left_behind[id(self._source)]
            waker.wake_threadsafe()
            for follower in followers:
                follower.wake_threadsafe()

    def _load(self, waker: Waker) -> None:
        item: Any
        try:
            iterator = iter(self._data)
            held, ended = self._replay_start(iterator)
            if ended:
                held.append(ENDED)
            while held:  # the replay's batches after the first ``skip``
                with _lock:
                    self._in_call = False
                self._slots.acquire()
                with _lock:
                    if self._closed.is_set():
                        return
                    item = held.pop(0)
                    self._buffer.append(item)
                if item is ENDED:
                    return
                del item
                waker.wake_threadsafe()
            while True:
                with _lock:
                    self._in_call = False
                self._slots.acquire()
                # Between two batches a checkpoint may hold the thread (paused()); a thread
                # waiting for it is not inside a call, and closing joins it.
                with self._drawing:
                    with _lock:
                        if self._closed.is_set():
                            return
                        self._in_call = True
                    try:
                        item = next(iterator)
                    except StopIteration:
                        item = ENDED
                    else:
                        self.loaded += 1  # left behind too: its draws were made
                if item is not ENDED and self._transform is not None:
                    item = self._transform(item)
                with _lock:
                    if self._closed.is_set():  # nobody takes it
                        return
                    self._buffer.append(item)
                if item is ENDED:
                    return
                del item
                waker.wake_threadsafe()
        except BaseException as error:  # handed to the loop, raised there
            with _lock:
                if not self._closed.is_set():
                    self._buffer.append(_Failed(error))

    def _replay_start(self, iterator: Iterator[Any]) -> tuple[list[Any], bool]:
        """Load the first ``replay`` batches, dropping the first ``skip``, then ``resume`` (also
        when loading raised, or closing cut it short): the batches kept, and whether the data
        ended among them. Inside a call into the data throughout."""
        held: list[Any] = []
        ended = False
        with self._drawing:
            try:
                while self.loaded < self._replay and not self._closed.is_set():
                    try:
                        item = next(iterator)
                    except StopIteration:
                        ended = True
                        break
                    self.loaded += 1
                    if self.loaded > self._skip:
                        transform = self._transform
                        held.append(transform(item) if transform is not None else item)
                    del item
            finally:
                if self._resume is not None:
                    self._resume()
        return held, ended
