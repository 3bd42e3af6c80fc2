"""The little the scheduler needs from an event loop, for asyncio and for trio.

A `Waker` lets worker threads wake the one task that waits for a step. Waking is
level-triggered (a wake that comes before the task waits is not lost) and cheap: one
thread-safe call per wake, no task or thread per device. anyio's public API offers no
non-blocking "call soon from a thread", which is what a worker needs, so the two backends are
spelled out here; everything else in asyncddp is backend-neutral.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
import time
from typing import Any, Protocol

import anyio

__all__ = ["Waker", "current_waker", "loop_ended", "running_loop"]

# anyio imports the backend of the running event loop library at its first call under it,
# on the event loop's own thread: under asyncio ~40-140 ms of imports, during the first fit,
# with the loop blocked. Paid here instead, at import, where a loop is rarely running yet
# (asyncio is in the standard library; trio's backend is left to anyio, as trio may be
# absent).
with contextlib.suppress(ImportError):  # a private module, in anyio 3 and 4 alike
    importlib.import_module("anyio._backends._asyncio")


class Waker(Protocol):
    """Wakes one waiting task from any thread."""

    def wake_threadsafe(self) -> None:
        """Wake the waiting task (or the next one to wait). Safe from any thread."""

    async def wait(self, deadline: float | None) -> bool:
        """Wait for a wake until ``deadline`` (``time.monotonic()``); False if it passed.

        A wake may be spurious (one meant for an earlier wait): callers check again what
        they wait for. Cancellable: a cancellation of the waiting task propagates.
        """

    async def wait_shielded(self, deadline: float | None) -> tuple[bool, BaseException | None]:
        """Like `wait`, but a cancellation neither interrupts nor is lost.

        Returns:
            ``(woken, cancellation)``. Under asyncio, ``cancellation`` is the first
            ``CancelledError`` that arrived while waiting (a plain ``task.cancel()``), which the
            caller must re-raise, as that very object: anyio recognises its own cancellations
            by it. Cancellations from anyio or trio cancel scopes are held off by a shielding
            scope and come back, level-triggered, at the next checkpoint; then it is None.
        """


def _tick_seconds() -> float | None:
    """How often a wait wakes the loop by itself: under ipykernel, every 0.25 s, else never.

    ipykernel's SIGINT handler (the notebook's stop button) queues its cancellation with
    tornado's ``add_callback``, a plain ``call_soon`` on the loop's own thread, which does not
    wake the selector, and sets no wakeup fd: a loop asleep in a wait for a step that runs
    long (or hangs) ran it only once the step returned, so the stop button did nothing. A
    timer while the wait lasts lets it run within 0.25 s."""
    return 0.25 if "ipykernel" in sys.modules else None


class _AsyncioWaker:
    __slots__ = ("_future", "_loop", "_pending", "_tick", "_ticker")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._future: asyncio.Future[None] | None = None
        self._pending = False
        self._tick = _tick_seconds()
        self._ticker: asyncio.TimerHandle | None = None

    def _on_tick(self) -> None:  # the loop is awake: nothing else to do but come again
        assert self._tick is not None
        self._ticker = self._loop.call_later(self._tick, self._on_tick)

    def wake_threadsafe(self) -> None:
        self._pending = True
        if self._future is None and _GIL:
            # Nobody waits: the next wait() sees the flag, and no loop wake-up is spent (a
            # loader hands over a batch while the loop waits for the step, not for it).
            # wait() sets _future before it reads the flag again; this reads _future after
            # setting the flag: under the GIL one of the two sees the other's write.
            return
        try:  # noqa: SIM105 (once per step: no context manager on this path)
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:
            pass  # the loop has closed: nobody is waiting any more

    def _wake(self) -> None:
        self._pending = True
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)

    async def wait(self, deadline: float | None) -> bool:
        if not self._pending:
            future = self._future = self._loop.create_future()
            timer = None
            if deadline is not None:
                timer = self._loop.call_at(deadline, _resolve, future)
            if self._tick is not None:
                self._ticker = self._loop.call_later(self._tick, self._on_tick)
            try:
                if not self._pending:  # a wake between the check and _future: see above
                    await future
            finally:
                self._future = None
                if timer is not None:
                    timer.cancel()
                if self._ticker is not None:
                    self._ticker.cancel()
                    self._ticker = None
        woken = self._pending
        self._pending = False
        return woken

    async def wait_shielded(self, deadline: float | None) -> tuple[bool, BaseException | None]:
        cancellation: BaseException | None = None
        # Without the shield, an anyio cancel scope would cancel this task again on every
        # loop pass, and this loop would spin until the wait ended.
        with anyio.CancelScope(shield=True):
            while True:
                try:
                    woken = await self.wait(deadline)
                    break
                except asyncio.CancelledError as exc:
                    cancellation = cancellation or exc
        return woken, cancellation


#: Whether the GIL orders _AsyncioWaker's flag and future hand-off (a free-threaded build
#: without it always takes the loop's thread-safe call).
_GIL: bool = getattr(sys, "_is_gil_enabled", lambda: True)()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _TrioWaker:
    __slots__ = ("_event", "_token", "_trio")

    def __init__(self, trio: Any, token: Any) -> None:
        self._trio = trio
        self._token = token  # the run's, from running_loop
        self._event = trio.Event()

    def wake_threadsafe(self) -> None:
        with contextlib.suppress(self._trio.RunFinishedError):
            self._token.run_sync_soon(self._event.set)

    async def wait(self, deadline: float | None) -> bool:
        if not self._event.is_set():
            delay = float("inf") if deadline is None else deadline - time.monotonic()
            with self._trio.move_on_after(max(delay, 0.0)):
                await self._event.wait()
        woken: bool = self._event.is_set()
        if woken:
            self._event = self._trio.Event()
        return woken

    async def wait_shielded(self, deadline: float | None) -> tuple[bool, BaseException | None]:
        # trio delivers Ctrl-C to the main task as KeyboardInterrupt, shield or not: the first
        # is held off as a cancellation is, and returned for the caller to raise once its wait
        # is over; a second raises at once (the way out of a wait that hangs, as asyncio's
        # runner gives a second Ctrl-C). A wait made while the task unwinds from a first one
        # (the drain of a step it interrupted) raises at the next: that is the second.
        interrupt: BaseException | None = None
        unwinding = _from_interrupt(sys.exc_info()[1])
        with self._trio.CancelScope(shield=True):
            while True:
                try:
                    return await self.wait(deadline), interrupt
                except KeyboardInterrupt as exc:
                    if interrupt is not None or unwinding:
                        raise
                    interrupt = exc


def _from_interrupt(error: BaseException | None) -> bool:
    """Whether ``error``, the exception being handled, is or comes from a KeyboardInterrupt."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, KeyboardInterrupt):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def running_loop() -> object | None:
    """The event loop running in this thread: the asyncio loop, or the token of trio's run;
    ``None`` outside either."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return loop
    trio = sys.modules.get("trio")
    if trio is not None and trio.lowlevel.in_trio_run():
        token: object = trio.lowlevel.current_trio_token()
        return token
    return None


def loop_ended(loop: object) -> bool:
    """Whether ``loop`` (from `running_loop`) has ended: an asyncio loop closed, or a trio
    run finished. Nothing can run a task left pending in it again."""
    if isinstance(loop, asyncio.AbstractEventLoop):
        return loop.is_closed()
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        loop.run_sync_soon(lambda: None)  # type: ignore[attr-defined]  # a no-op, if it runs
    except trio.RunFinishedError:
        return True
    return False


def current_waker() -> Waker:
    """A waker for the task that calls it, under asyncio or trio.

    Raises:
        RuntimeError: Called outside a running asyncio or trio event loop.
    """
    loop = running_loop()
    if isinstance(loop, asyncio.AbstractEventLoop):
        # asyncio's loop.time() is time.monotonic(), the clock deadlines use.
        return _AsyncioWaker(loop)
    if loop is not None:  # trio's token
        return _TrioWaker(sys.modules["trio"], loop)
    raise RuntimeError("asyncddp needs a running asyncio or trio event loop (use 'await' in one)")
