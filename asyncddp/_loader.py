"""Iterating the user's data on a thread of its own, a few batches ahead of training.

A ``DataLoader`` may block for a long time in ``next()`` (disk, decoding, worker processes):
on the event loop that would freeze every other task. :class:`Prefetcher` calls ``iter()`` and
``next()`` on a named thread (``asyncddp-loader``) and hands batches to the loop through a
small bounded buffer, so the next batch loads while the devices compute the current one. Data
that cannot block (batches in a list) is read in place instead (``inline``): a thread would
only add a wake-up a batch.

Continuing an epoch, the loader thread replays its start: it loads (``replay``) as many batches
as the interrupted run's loader had loaded, keeping those after the first ``skip`` (already
trained on), and only then calls ``resume`` (which puts the random number generators back as
the interrupted run left them), before it hands any batch over. A loader that draws random
numbers itself (augmentation in ``__getitem__`` with ``num_workers=0``) then draws what it drew
in the interrupted run, and training goes on from the generators' state then. :attr:`loaded`
counts the batches loaded so far; :meth:`paused` holds the thread between two batches, so that
a checkpoint sees the count and the generators together.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

import anyio

from ._loop import Waker, current_waker

__all__ = ["Prefetcher"]

_DONE = object()


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    """Iterates ``data`` on a thread, ``depth`` batches ahead (or in place, ``inline``);
    ``async for`` over it.

    Args:
        data: Any iterable of batches.
        depth: How many batches may wait, loaded, for the loop to take them.
        transform: Applied to each batch where it is read (the loader thread, for example
            pinning memory; or the loop, ``inline``).
        name: What the data is called in errors.
        close_timeout: How long closing waits for a ``next()`` call in progress.
        inline: Iterate ``data`` on the event loop's thread, with no loader thread: for data
            whose ``next()`` never blocks (batches in a list, in memory already), where a
            thread would only add a wake-up a batch.
        skip: How many of the first batches to load and drop (trained on already).
        replay: How many batches to load before handing any over (at least ``skip``).
        resume: Called once those are loaded, before any batch is handed over.
    """

    def __init__(
        self,
        data: Iterable[Any],
        *,
        depth: int = 2,
        transform: Callable[[Any], Any] | None = None,
        name: str = "data",
        close_timeout: float = 30.0,
        inline: bool = False,
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
        self._inline: Iterator[Any] | None = None
        self._inline_wanted = inline
        self._transform = transform
        self._name = name
        self._close_timeout = close_timeout
        self._buffer: collections.deque[Any] = collections.deque()
        self._slots = threading.Semaphore(depth)
        self._stop = threading.Event()
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
        if self._inline is not None:
            try:
                batch = next(self._inline)
            except StopIteration:
                raise StopAsyncIteration from None
            except Exception as failure:
                failure.add_note(f"raised while iterating {self._name}")
                raise
            self.loaded += 1
            return self._transform(batch) if self._transform is not None else batch
        waker = self._waker
        assert waker is not None, "use 'async with Prefetcher(...)'"
        while not self._buffer:
            await waker.wait(None)
        item = self._buffer.popleft()
        self._slots.release()
        if item is _DONE:
            self._buffer.appendleft(_DONE)  # every later call ends too
            raise StopAsyncIteration
        if isinstance(item, _Failed):
            error = item.error
            del item
            error.add_note(f"raised while iterating {self._name} (on the asyncddp-loader thread)")
            try:
                raise error
            finally:
                del error
        return item

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[int]:
        """Hold the loader thread between two batches (waiting, on a thread, for one it is
        loading); yields :attr:`loaded`. A cancellation is taken within 50 ms, even while a
        slow ``next()`` goes on."""
        while not await anyio.to_thread.run_sync(self._drawing.acquire, True, 0.05):
            pass
        try:
            yield self.loaded
        finally:
            self._drawing.release()

    async def aclose(self) -> None:
        """Stop loading and wait (shielded, up to ``close_timeout``) for the thread to exit."""
        if self._inline is not None:
            self._inline = iter(())  # closed: nothing more
            return
        if self._thread.ident is None or self._waker is None:
            return
        self._stop.set()
        self._slots.release()  # a thread waiting for room wakes up and sees the stop
        deadline = time.monotonic() + self._close_timeout
        cancellation: BaseException | None = None
        while not self._finished.is_set():
            woken, cancelled = await self._waker.wait_shielded(deadline)
            cancellation = cancellation or cancelled
            if not woken:
                break
        if self._finished.is_set():
            self._thread.join()
        else:
            warnings.warn(
                f"the asyncddp-loader thread is still inside next() on {self._name} after "
                f"{self._close_timeout} s; left behind, it exits once that call returns",
                RuntimeWarning,
                stacklevel=2,
            )
        self._buffer.clear()
        if cancellation is not None:
            raise cancellation

    def _main(self) -> None:
        waker = self._waker
        assert waker is not None
        try:
            iterator = iter(self._data)
            held, ended = self._replay_start(iterator)
            if ended:
                held.append(_DONE)
            while held:
                self._slots.acquire()
                if self._stop.is_set():
                    return
                self._buffer.append(held.pop(0))
                waker.wake_threadsafe()
            if ended:
                return
            while True:
                self._slots.acquire()
                if self._stop.is_set():
                    return
                with self._drawing:
                    try:
                        item = next(iterator)
                    except StopIteration:
                        self._buffer.append(_DONE)
                        return
                    self.loaded += 1
                if self._transform is not None:
                    item = self._transform(item)
                self._buffer.append(item)
                del item
                waker.wake_threadsafe()
        except BaseException as error:  # handed to the loop, raised there
            self._buffer.append(_Failed(error))
        finally:
            self._finished.set()
            waker.wake_threadsafe()

    def _replay_start(self, iterator: Iterator[Any]) -> tuple[list[Any], bool]:
        """Load the first ``replay`` batches, dropping the first ``skip``, then ``resume`` (also
        when loading raised): the batches kept, and whether the data ended among them."""
        held: list[Any] = []
        ended = False
        with self._drawing:
            try:
                while self.loaded < self._replay and not self._stop.is_set():
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
