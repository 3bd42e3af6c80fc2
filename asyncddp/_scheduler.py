"""StepScheduler: run one job on every device, gather the results on the event loop.

How a step runs::

    event loop thread                          worker threads (one per device)
    run(fn, shards)
      capture grad mode, autocast, contextvars
      queue one job per worker  ─────────────► fn(ctx, shard) in the caller's state
      await one wake-up         ◄───────────── the last job to finish (or the first to fail)
      outputs in device order                  wakes the loop, once
      or WorkerFailedError for the first failure in time

The loop thread never runs a job and never blocks on a thread: it queues, then awaits.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from threading import BrokenBarrierError
from types import AsyncGeneratorType, CoroutineType, GeneratorType, TracebackType
from typing import Any, Generic, NoReturn, TypeVar, cast

import anyio
import torch

from ._checks import MAX_THREADS, check_bool, check_int, check_seconds, warn_user
from ._data import count_items
from ._devices import Device, DeviceSpec, resolve_devices
from ._exceptions import (
    AsyncDDPRuntimeWarning,
    ConfigurationError,
    SchedulerClosedError,
    ShardError,
    WorkerFailedError,
    WorkerTimeoutError,
)
from ._loop import Waker, current_waker
from ._openmp import release_idle_threads
from ._progress import Progress, ProgressTracker
from ._vml import warm_vector_math
from ._worker import (
    CallerState,
    DeviceWorker,
    WorkerContext,
    cpu_worker_slice,
    current_worker,
    new_threads_count,
)

#: How long `StepScheduler.start` waits at most for the CPU workers' thread counts to settle.
_SETTLE_WAIT = 5.0

_log = logging.getLogger("asyncddp")

__all__ = ["JobQueuedError", "StepResult", "StepScheduler"]

S = TypeVar("S")
T = TypeVar("T")


@dataclass(frozen=True)
class StepResult(Generic[T]):
    """What one step handed back.

    Attributes:
        outputs: What ``fn`` returned on each device, in device order.
        items: How many items each device's shard held, in device order.
        progress: The scheduler's progress after this step.
        step: The step's number.
    """

    outputs: tuple[T, ...]
    items: tuple[int, ...]
    progress: Progress
    step: int


class JobQueuedError(WorkerFailedError):
    """A shielded step's job (``run(shield=True)``) on a device whose worker is still in an
    earlier job that outlived the wait for it (``drain_timeout`` or ``step_timeout``: a step
    that hangs). The job stays queued and runs once that one returns; ``run`` waited for the
    other devices' jobs only; `ran` tells, once the worker's thread has exited, whether it
    ran without raising. ``__cause__`` is ``None``."""

    _step: _Step | None = None

    def ran(self) -> bool:
        """Whether the queued job ran and returned (not dropped, not raised)."""
        step = self._step
        if step is None:  # unpickled: unknown
            return False
        index = self.device.index
        with step.lock:
            failed = any(i == index for i, _ in step.failures)
            return step.finished[index] and not step.cancelled and not failed


def _gone() -> None:
    return None


class _Step:
    """One step's shared state: written by the workers under ``lock``, read by the loop."""

    __slots__ = (
        "cancelled",
        "failures",
        "finished",
        "lock",
        "may_remain",
        "outputs",
        "queued",
        "remaining",
        "running",
        "shielded",
        "unheard",
        "waker",
    )

    def __deepcopy__(self, memo: dict[int, Any]) -> _Step:
        # A copy of a JobQueuedError asks the same step whether its job ran.
        return self

    def __reduce__(self) -> tuple[object, ...]:
        # A JobQueuedError pickled elsewhere cannot ask (locks, jobs): its `ran` is unknown.
        return (_gone, ())

    def __init__(self, size: int, waker: Waker) -> None:
        self.lock = threading.Lock()
        self.waker = waker
        self.outputs: list[Any] = [None] * size
        self.finished = [False] * size
        self.remaining = size
        self.running = 0
        self.cancelled = False
        self.shielded = False  # every job runs, even after a failure or a cancellation
        # (device index, exception), in the order the failures happened.
        self.failures: list[tuple[int, BaseException]] = []
        # Jobs not started yet, by device index: a cancel empties them at once, so that a job
        # stuck in a queue behind a busy worker does not hold the caller's shard meanwhile.
        self.queued: dict[int, _Job] = {}
        # A shielded step waits for no job of a worker still in one that outlived a wait
        # (see StepScheduler._busy): its waiter is woken once no more than these remain.
        self.may_remain = 0
        # The caller has read the step's failures for the last time (see `unheard`): a job
        # that fails after that reaches nobody, so it is logged.
        self.unheard = False

    def cancel(self) -> None:
        """Drop the jobs that have not started yet, and any output (nobody will read it)."""
        with self.lock:
            self.cancel_locked()

    def cancel_locked(self) -> None:
        """`cancel`, for a caller that holds ``lock`` already."""
        self.cancelled = True
        self.outputs = [None] * len(self.outputs)
        for job in self.queued.values():
            job.fn = job.shard = job.context = None  # type: ignore[assignment]
        self.queued.clear()

    def forget_jobs(self) -> None:
        """Break the step -> job -> step cycle once the caller is done with the step."""
        with self.lock:
            self.queued.clear()
            self.unheard = True

    def read_failures_locked(self) -> list[tuple[int, BaseException]]:
        """The failures so far, for the caller's error: one that comes later is logged
        (`unheard`). For a caller that holds ``lock``."""
        self.unheard = True
        return list(self.failures)

    def settled(self) -> bool:
        with self.lock:
            return self.remaining == 0 or bool(self.failures)

    def all_done(self) -> bool:
        with self.lock:
            return self.remaining == 0

    def done_but(self, busy: set[int]) -> bool:
        """Whether every job is done but those of ``busy`` workers."""
        with self.lock:
            return all(done or i in busy for i, done in enumerate(self.finished))

    def idle(self) -> bool:
        with self.lock:
            return self.running == 0


def _execute(
    worker: DeviceWorker,
    state: CallerState,
    context: contextvars.Context,
    fn: Callable[..., Any],
    ctx: object,
    shard: object,
) -> tuple[bool, Any]:
    # A failure's traceback starts in this frame, whose locals hold no reference to the step.
    try:
        value = worker.invoke(state, context, fn, ctx, shard)
    except BaseException as exc:
        return False, exc
    if isinstance(value, (CoroutineType, AsyncGeneratorType, GeneratorType)):
        return False, _awaitable_returned(fn, value)
    return True, value


def _awaitable_returned(fn: Callable[..., Any], value: Any) -> TypeError:
    """The error for a job that returned a coroutine or an async generator (a plain function
    that called an ``async def`` without awaiting it), or a generator (a ``def`` with a
    ``yield``, whose body would run wherever its output is read: on the event loop): closed
    here, so that no "never awaited" warning comes later, from wherever the collector runs."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    if isinstance(value, GeneratorType):
        value.close()
        return TypeError(
            f"the job {name} returned a generator, whose body runs only as it is read, on the "
            "event loop: a job runs on each device's worker thread and must compute its "
            "result there (return a list, not yield)"
        )
    kind = "an async generator"
    if isinstance(value, CoroutineType):
        kind = "a coroutine"
        value.close()
    return TypeError(
        f"the job {name} returned {kind}, which nothing will await: a job runs on each "
        "device's worker thread, outside the event loop, so it must compute its result "
        "itself (did it call an async function without awaiting it?)"
    )


class _Job:
    __slots__ = ("context", "fn", "index", "number", "phase", "shard", "state", "step", "worker")

    def __init__(
        self,
        step: _Step,
        index: int,
        worker: DeviceWorker,
        fn: Callable[..., Any],
        shard: object,
        state: CallerState,
        number: int,
        phase: str | None,
    ) -> None:
        self.step = step
        self.index = index
        self.worker = worker
        self.fn = fn
        self.shard = shard
        self.state = state
        self.context = contextvars.copy_context()
        self.number = number
        self.phase = phase

    def __call__(self) -> Callable[[], None] | None:
        step = self.step
        with step.lock:
            step.queued.pop(self.index, None)
            run = not step.cancelled
            if run:
                step.running += 1
        ok, value = True, cast(Any, None)
        if run:
            ctx = WorkerContext(self.worker.device, self.worker.stream, self.number, self.phase)
            ok, value = _execute(self.worker, self.state, self.context, self.fn, ctx, self.shard)
        # Let go of the caller's shard and function before the step can settle: once it has,
        # the caller may drop them and expect them freed.
        self.fn = self.shard = self.context = None  # type: ignore[assignment]
        with step.lock:
            if run:
                step.running -= 1
            step.remaining -= 1
            step.finished[self.index] = True
            if ok:
                if not step.cancelled:
                    step.outputs[self.index] = value
            else:
                step.failures.append((self.index, value))
            # A job released by a peer's failure or a cancellation (a broken barrier) is
            # a consequence, not news.
            unheard = step.unheard and not ok and not isinstance(value, BrokenBarrierError)
            wake = (
                step.remaining <= step.may_remain
                or (not ok and len(step.failures) == 1 and not step.shielded)
                or (step.cancelled and step.running == 0)
            )
        notify = step.waker.wake_threadsafe if wake else None
        if unheard:  # the step's error reported what had failed when it was made
            _log.warning(
                "the job of step %s on %s, which outlived the wait for it, failed: %s: %s",
                self.number,
                self.worker.device.name,
                type(value).__qualname__,
                value,
                exc_info=value,
            )
        # A failure's traceback reaches this frame too (through _execute's f_back), and the
        # step holds that failure: drop every reference to the step, so that no reference
        # cycle keeps what the job made alive once the caller drops the error.
        self.step = None  # type: ignore[assignment]
        del step, value
        return notify


def _is_async(fn: object) -> bool:
    """Whether calling ``fn`` makes a coroutine or an async generator: an ``async def``
    (through ``functools.partial`` too), or an object whose ``__call__`` is one."""
    call = fn if inspect.isroutine(fn) or not callable(fn) else type(fn).__call__
    for candidate in (fn, call):
        if inspect.iscoroutinefunction(candidate) or inspect.isasyncgenfunction(candidate):
            return True
    return False


def _call_on_cancel(on_cancel: Callable[[], None] | None) -> None:
    """Call a step's ``on_cancel``. One that raises is logged: the step's jobs are still
    awaited, and the caller gets the step's own error or cancellation, not this one."""
    if on_cancel is None:
        return
    try:
        on_cancel()
    except Exception:
        _log.error(
            "on_cancel %r raised (it must not); the step's running jobs are awaited anyway",
            on_cancel,
            exc_info=True,
        )


def _stop_all(workers: Sequence[DeviceWorker]) -> None:
    for worker in workers:
        worker.stop()


class StepScheduler:
    """Runs one job on every device at once and awaits them all.

    Each device gets one persistent worker thread, started by ``async with`` and reused by
    every step; closing joins them all::

        async with asyncddp.StepScheduler(asyncddp.cpu_devices(2)) as scheduler:
            result = await scheduler.run(fn, [shard0, shard1])

    Args:
        devices: Where to run: anything `resolve_devices` accepts. Checked here, before
            any thread starts.
        step_timeout: Seconds a device may take for one job before `run` raises
            `WorkerTimeoutError`, counted from when the job is queued (so it includes
            work an earlier job deferred to after it and, on a GPU, the kernels an earlier
            job left running on the stream); ``None`` waits as long as it takes.
        drain_timeout: After a failure or a cancellation, how many seconds to wait for the
            other devices' jobs that are already running, before raising anyway (they finish
            on their own; that device's next job waits for them). ``None`` waits for them.
            After a failure, no longer than ``step_timeout`` allows the step: a job still
            running then is named in the error's ``other_failures`` (`WorkerTimeoutError`).
        threads_per_worker: Intra-op threads for each CPU worker's ops. By default the
            caller's ``torch.get_num_threads()`` is shared out among the CPU workers (at least
            one each), so that several CPU workers use the same cores in all as one would,
            rather than each starting a full thread pool and oversubscribing the machine.
            Before CPU workers of more than one thread start, the calling thread lets go of
            its idle OpenMP threads (GNU OpenMP on Linux), which would otherwise slow the
            workers' ops (see "The caller's idle OpenMP threads" in the docs' concepts).
    """

    def __init__(
        self,
        devices: DeviceSpec,
        *,
        step_timeout: float | None = None,
        drain_timeout: float | None = 10.0,
        threads_per_worker: int | None = None,
    ) -> None:
        threads_per_worker = check_int(
            "threads_per_worker", threads_per_worker, 1, MAX_THREADS, none=True
        )
        step_timeout = check_seconds("step_timeout", step_timeout)
        drain_timeout = check_seconds("drain_timeout", drain_timeout)
        self.devices: tuple[Device, ...] = resolve_devices(devices)
        self._device_types = frozenset(device.type for device in self.devices)
        self.step_timeout = step_timeout
        self.drain_timeout = drain_timeout
        self.threads_per_worker = threads_per_worker
        self._workers: tuple[DeviceWorker, ...] = ()
        # Worker threads closing left behind, still in a job (see _close_workers).
        self._left_behind: list[threading.Thread] = []
        # By worker index: the ``finished`` flags of a step whose job there outlived a wait
        # for it (drain_timeout, step_timeout): see _busy.
        self._outlived: dict[int, list[bool]] = {}
        self._state = "new"
        self._next_step = 0
        self._tracker = ProgressTracker(len(self.devices))
        self._closed: anyio.Event | None = None
        # The state every job runs in, by device type, instead of the caller's (see _dispatch):
        # a Trainer's, whose jobs must not take another task's modes.
        self._job_state: dict[str, CallerState] | None = None

    def __repr__(self) -> str:
        names = ", ".join(device.name for device in self.devices)
        return f"<StepScheduler [{names}] {self._state}>"

    @property
    def progress(self) -> Progress:
        """Items processed by the steps that returned since the start or the last reset (and by
        shielded steps cancelled once every job had run: see ``run``'s ``shield``)."""
        return self._tracker.progress

    def reset_progress(self, items_total: int | None = None) -> None:
        """Start counting items afresh, for example at the start of an epoch."""
        self._tracker = ProgressTracker(len(self.devices), items_total)

    def __enter__(self) -> NoReturn:
        raise TypeError(
            "StepScheduler is an async context manager: 'async with StepScheduler(...) as "
            "scheduler:', inside an async function (its run() is awaited too)"
        )

    def __exit__(self, *exc_info: object) -> None:  # pragma: no cover - __enter__ raises
        return None

    async def __aenter__(self) -> StepScheduler:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._aclose()

    def start(self) -> None:
        """Start the worker threads (``async with`` does this for you)."""
        if self._state != "new":
            raise SchedulerClosedError(f"{self!r} was started already; make a new one")
        cpu_workers = sum(not device.is_cuda for device in self.devices)
        share = self.threads_per_worker or max(1, torch.get_num_threads() // max(cpu_workers, 1))
        if cpu_workers and share > 1:
            # The workers' OpenMP teams would otherwise join an idle one of this thread's, and
            # their threads together outnumber the cores: libgomp then stops busy-waiting
            # between ops, and every op of a step waits for its threads to wake (see _openmp).
            release_idle_threads()
        if cpu_workers:
            # oneMKL's vector-math kernels are picked at each function's first call, and first
            # calls made together can run a low-accuracy one: made here, alone, before the
            # workers make theirs together (see _vml).
            warm_vector_math()
        # Read once for them all: what the CPU workers put back in torch's global count.
        count = new_threads_count() if cpu_workers else None
        workers = tuple(
            DeviceWorker(device, threads=None if device.is_cuda else share, global_threads=count)
            for device in self.devices
        )
        slice_ms = cpu_worker_slice() if cpu_workers else None  # read (and warned of) once
        started: list[DeviceWorker] = []
        try:
            for worker in workers:
                worker.start(slice_ms)
                started.append(worker)
        except BaseException:
            _stop_all(started)
            raise
        for worker in workers:
            if worker.threads is not None:
                # A few set_num_threads calls and a helper thread each, well under a
                # millisecond: until they are done, torch's global count is a worker's share,
                # and a thread started at once (a service's thread pool) kept it for good
                # (7 of 30 such threads in a scheduler trial).
                worker.threads_settled.wait(_SETTLE_WAIT)
        self._workers = workers
        self._closed = anyio.Event()
        self._state = "open"
        # A scheduler dropped without being closed still stops its threads.
        weakref.finalize(self, _stop_all, self._workers)

    async def aclose(self) -> None:
        """Finish the queued jobs, stop the worker threads and join them.

        Waits on the event loop, never blocking it. A worker still busy after
        ``drain_timeout`` seconds (a job that hangs) is left behind with a ``RuntimeWarning``;
        its thread is a daemon and exits once its job returns.

        Cancellation handling: closing is shielded. It completes, and a cancellation that
        arrives meanwhile is delivered afterwards.
        """
        await self._aclose()

    async def _aclose(self) -> None:
        # Below both aclose and __aexit__: a warning of _close_workers names the line of their
        # caller (warn_user), the user's ``async with`` or ``aclose()``.
        if self._state == "closed":
            if self._closed is not None:
                await self._closed.wait()  # another task is closing it: wait for the joins
            return
        self._state = "closed"
        if not self._workers:
            return
        try:
            cancellation = await self._close_workers()
        finally:
            assert self._closed is not None
            self._closed.set()
        if cancellation is not None:
            raise cancellation

    async def _finish_stream_work(
        self, *, step: int | None = None, epoch: int | None = None, phase: str | None = "train"
    ) -> None:
        """Wait for the GPU work that jobs left running on their workers' streams
        (`leave_stream_running`), where every worker's last job did
        and none has started since; otherwise nothing. Closing waits for a job at most
        ``drain_timeout``; this waits as a job does: up to ``step_timeout``, and cancellable
        (closing then bounds what is left).

        Raises:
            WorkerFailedError: that work failed (an asynchronous CUDA error), named with
                ``step``, ``epoch`` and ``phase``.
        """
        workers = self._workers
        if self._state != "open" or not workers:
            return
        if not all(worker.stream_left_running for worker in workers):
            return
        await self.run(
            _noop,
            [None] * len(workers),
            items=[0] * len(workers),
            step=step,
            epoch=epoch,
            phase=phase,
        )

    async def _close_workers(self) -> BaseException | None:
        waker = current_waker()
        step = self._dispatch(waker, _noop, [None] * len(self._workers), -1, "close")
        _stop_all(self._workers)
        deadline = None if self.drain_timeout is None else time.monotonic() + self.drain_timeout
        cancellation: BaseException | None = None
        while not step.all_done():
            try:
                woken, cancelled = await waker.wait_shielded(deadline)
            except BaseException:  # a second Ctrl-C: the workers still in a job stay behind
                for worker, done in zip(self._workers, step.finished, strict=True):
                    if not done:
                        self._left_behind.append(worker.thread)
                raise
            cancellation = cancellation or cancelled
            if not woken:
                break
        for worker, done in zip(self._workers, step.finished, strict=True):
            if done:
                worker.join()  # its last job has run: the thread is returning
            else:
                self._left_behind.append(worker.thread)
                warn_user(
                    f"{worker.thread.name} is still running a job (or the work one left for "
                    f"after it) after drain_timeout="
                    f"{self.drain_timeout} s; left behind, it exits once the job returns",
                    AsyncDDPRuntimeWarning,
                )
        return cancellation

    async def run(
        self,
        fn: Callable[[WorkerContext, S], T],
        shards: Sequence[S],
        *,
        items: Sequence[int] | None = None,
        step: int | None = None,
        epoch: int | None = None,
        phase: str | None = "train",
        shield: bool = False,
        on_cancel: Callable[[], None] | None = None,
    ) -> StepResult[T]:
        """Run ``fn(ctx, shard)`` on every device's worker, one shard per device.

        The event loop thread only queues the jobs and awaits them; each worker runs its job
        in the caller's grad mode, autocast state and context variables, and on a GPU on its
        own stream, waiting for the stream before the job counts as done (unless the job left
        its kernels running, as the trainer's last step on a lone GPU does: then its worker's
        next job waits for them).

        Args:
            fn: The job. Gets a `WorkerContext` and that device's shard.
            shards: One shard per device, in device order.
            items: Items in each shard, for progress; by default the size of the shard's first
                tensor along dim 0 (depth first through tuples, lists and dicts); with no
                tensor in it, a tuple, list or dict counts its length, ``None`` 0 and anything
                else 1.
            step: The step's number, for errors; by default the count of earlier steps.
            epoch: The epoch, for errors.
            phase: What the step does, for errors (``"train"``, ``"valid"``, ...).
            shield: Run every job of the step to its end, whatever happens: no job is dropped
                after a failure, a cancellation or ``step_timeout`` (which raises for the jobs
                still running, and leaves them to finish; one that had not started, behind
                another task's step, stays queued). For steps that must happen on every
                device or on none, such as an optimizer step. A
                device whose worker is still in an earlier job that outlived the wait for it
                (``drain_timeout`` or ``step_timeout``: it hangs) is not waited for: its job
                stays queued, to run once that one returns, and the call raises
                `WorkerFailedError` for it once the others' jobs are done.
            on_cancel: Called on the event loop when the step is given up (a job failed, the
                call was cancelled, or a job timed out), once the jobs not yet started are
                dropped and before the running ones are awaited: for jobs that wait for each
                other, which it must release (a ``threading.Barrier``'s ``abort``, say). It
                must not block; one that raises is logged (the ``asyncddp`` logger) and the
                step ends as it would have. Not called with ``shield=True``.

        Returns:
            The outputs in device order, the item counts and the progress so far.

        Raises:
            WorkerFailedError: A job raised. Names the first device to fail; the exception the
                job raised is ``__cause__``; later failures of this step are in
                ``other_failures``. Jobs not yet started are dropped and running ones are
                awaited (up to ``drain_timeout``), so the scheduler is ready for the next step.
            WorkerTimeoutError: A job did not finish within ``step_timeout``.
            KeyboardInterrupt, SystemExit: raised by a job, re-raised here as they are.
            ShardError: ``shards`` or ``items`` does not hold one entry per device.
            TypeError: ``fn`` is an ``async def`` function or not callable, or ``on_cancel``
                is not callable.
            ConfigurationError: ``shield`` is not True or False (a NumPy bool, 0 or 1 too);
                or ``run()`` was called from inside one of this scheduler's jobs.
            SchedulerClosedError: The scheduler is not open.

        Cancellation handling:
            When the awaiting task is cancelled, jobs not yet started are dropped, and the
            call waits (shielded, up to ``drain_timeout``) for the jobs already running before
            the cancellation goes on; the event loop keeps running meanwhile, and the
            scheduler stays usable. With ``shield=True`` every job runs to its end first.
        """
        if self._state != "open":
            raise SchedulerClosedError(
                f"{self!r} is closed (its 'async with' block ended, or aclose() was called): "
                "run steps inside the block, or make a new scheduler"
                if self._state == "closed"
                else f"{self!r} is not started; use 'async with StepScheduler(...) as scheduler:'"
            )
        inside = current_worker()
        if inside is not None and any(
            w.thread is threading.current_thread() for w in self._workers
        ):
            # Its jobs would queue behind the job that waits for them, for good.
            raise ConfigurationError(
                f"run() was called from inside a job of this scheduler, on "
                f"{inside.device.name}'s worker thread: the step's jobs would wait behind that "
                "job, which waits for them, for good. A job computes one device's part of a "
                "step; await run() from your async code, not from a job, even through the "
                "event loop (run_coroutine_threadsafe)"
            )
        if _is_async(fn):  # it would return a coroutine nobody awaits
            raise TypeError(
                f"{getattr(fn, '__name__', fn)!r} is an async function; a job runs on each "
                "device's worker thread, outside the event loop, so it must be a plain def "
                "(what you await is run())"
            )
        if not callable(fn):  # it would fail on every worker, as if each device had failed
            raise TypeError(f"fn must be a callable job(ctx, shard), got {fn!r}")
        if on_cancel is not None and not callable(on_cancel):
            raise TypeError(f"on_cancel must be a callable taking no argument, got {on_cancel!r}")
        shield = check_bool("shield", shield)
        shards = self._check_shards(shards)
        counts = self._check_items(items, shards)
        number = self._next_step if step is None else step
        self._next_step += 1
        waker = current_waker()
        deadline = None if self.step_timeout is None else time.monotonic() + self.step_timeout
        busy = self._busy() if shield else set()
        state = self._dispatch(waker, fn, shards, number, phase, shield=shield)
        state.may_remain = len(busy)
        cancellation: BaseException | None = None
        queued = False  # jobs left queued behind hung ones, to run once those return
        if shield:
            try:
                cancellation = await self._wait_all_shielded(state, waker, deadline, busy)
            except BaseException:  # a second Ctrl-C: the jobs still running are given up on
                self._outlive(state)
                raise
            if not state.done_but(busy):  # step_timeout: a job runs late, or waits behind one
                # Noted whether or not another job failed, so that the next shielded step
                # queues its job behind it instead of waiting (and timing out) for it.
                self._outlive(state)
            settled = state.settled()
            if not settled and state.done_but(busy):
                settled = queued = True
        else:
            try:
                settled = await self._wait_settled(state, waker, deadline)
            except BaseException:
                state.cancel()
                _call_on_cancel(on_cancel)
                await self._drain(state, waker)
                state.forget_jobs()
                del state, shards, fn
                raise
        timeout = None if settled else self._timeout_error(state, number, epoch, phase)
        error: BaseException | None = None
        if timeout is not None:
            if not shield:
                _call_on_cancel(on_cancel)
            error = timeout
        elif state.failures:
            running: list[int] = []
            if not shield:
                with state.lock:  # the jobs started; the cancel drops the others at once
                    running = [i for i, started in self._late_locked(state) if started]
                    state.cancel_locked()
                _call_on_cancel(on_cancel)
                # No longer than step_timeout allows the step (a job still running past it
                # was waited for drain_timeout, 10 s by default, and not named).
                cancellation = await self._drain(state, waker, until=deadline)
            error = self._failure_error(state, number, epoch, phase)
            if isinstance(error, WorkerFailedError):
                # Jobs still running past step_timeout are named too.
                past = deadline is not None and time.monotonic() >= deadline
                with state.lock:
                    if shield:
                        late = [(i, on) for i, on in self._late_locked(state) if i not in busy]
                    else:
                        late = [(i, True) for i in running if past and not state.finished[i]]
                others = self._late_errors(state, late, number, epoch, phase) if late else []
                # Jobs queued behind a hung one run later: named, as without the failure
                # (the error said nothing of them, and half of an all-or-none step ran later).
                queued_error = self._queued_error(state, busy, number, epoch, phase)
                if queued_error is not None:
                    others += [queued_error, *queued_error.other_failures]
                    queued_error.other_failures = ()
                if others:
                    error.other_failures += tuple(others)
                    error.args = (str(error),)
            if cancellation is not None and isinstance(error, Exception):
                cancellation.__cause__ = error
                error = cancellation
        elif cancellation is not None:
            if state.all_done():  # a shielded step that ran to its end everywhere counts, as
                self._tracker.update(counts)  # under a cancel scope, which it outlives
            error = cancellation
        elif queued:
            error = self._queued_error(state, busy, number, epoch, phase)
            if error is None and state.failures:  # they returned, and failed, meanwhile
                error = self._failure_error(state, number, epoch, phase)
        state.forget_jobs()
        if error is None:
            return StepResult(
                outputs=tuple(state.outputs),
                items=counts,
                progress=self._tracker.update(counts),
                step=number,
            )
        try:
            raise error
        finally:
            # The traceback holds this frame: break the error -> frame -> error cycle, and
            # let the shards and outputs go while the caller holds the error.
            del error, state, shards, fn, cancellation, on_cancel

    def _dispatch(
        self,
        waker: Waker,
        fn: Callable[..., Any],
        shards: Sequence[object],
        number: int,
        phase: str | None,
        *,
        shield: bool = False,
    ) -> _Step:
        state = _Step(len(self._workers), waker)
        state.shielded = shield
        caller = self._job_state or {kind: CallerState.capture(kind) for kind in self._device_types}
        jobs = [
            _Job(state, index, worker, fn, shard, caller[worker.device.type], number, phase)
            for index, (worker, shard) in enumerate(zip(self._workers, shards, strict=True))
        ]
        state.queued = dict(enumerate(jobs))
        # Queue them in one tight loop: a woken worker waits for the GIL until this thread
        # reaches the event loop's poll, so nothing slow may stand between the puts and there.
        for worker, job in zip(self._workers, jobs, strict=True):
            worker.submit(job)
        return state

    @staticmethod
    async def _wait_settled(state: _Step, waker: Waker, deadline: float | None) -> bool:
        while not state.settled():
            if not await waker.wait(deadline):
                return state.settled()
        return True

    @staticmethod
    async def _wait_all_shielded(
        state: _Step, waker: Waker, deadline: float | None, busy: set[int]
    ) -> BaseException | None:
        """Wait, shielded, for every job but those of ``busy`` workers (see `_busy`);
        returns a cancellation that came meanwhile."""
        cancellation: BaseException | None = None
        while not state.done_but(busy):
            woken, cancelled = await waker.wait_shielded(deadline)
            cancellation = cancellation or cancelled
            if not woken:
                break
        return cancellation

    async def _drain(
        self, state: _Step, waker: Waker, until: float | None = None
    ) -> BaseException | None:
        """Wait, shielded, for the step's running jobs, up to ``drain_timeout`` and no later
        than ``until`` (a ``time.monotonic()``); returns a cancellation that came."""
        deadline = None if self.drain_timeout is None else time.monotonic() + self.drain_timeout
        if until is not None:
            deadline = until if deadline is None else min(deadline, until)
        cancellation: BaseException | None = None
        while not state.idle():
            try:
                woken, cancelled = await waker.wait_shielded(deadline)
            except BaseException:
                # A second Ctrl-C, which raises at once: the jobs still running are given up
                # on as if the wait had run out, so that no later shielded wait (the step's
                # undo) waits for one of them without end.
                self._outlive(state)
                raise
            cancellation = cancellation or cancelled
            if not woken:
                self._outlive(state)
                break
        return cancellation

    def _outlive(self, state: _Step) -> None:
        """Note the workers whose job in ``state`` outlived the wait for it."""
        with state.lock:
            for index, done in enumerate(state.finished):
                if not done:
                    self._outlived[index] = state.finished

    def _busy(self) -> set[int]:
        """The workers still in a job that outlived a wait for it (a hung step): a shielded
        step queues its job there, to run once that one returns, but waits only for the
        others. (Closing waits for them once more, up to ``drain_timeout``: a slow job that
        returns meanwhile leaves no thread behind.)"""
        for index, finished in list(self._outlived.items()):
            if finished[index]:
                del self._outlived[index]
        return set(self._outlived)

    def _queued_error(
        self, state: _Step, busy: set[int], number: int, epoch: int | None, phase: str | None
    ) -> WorkerFailedError | None:
        """A shielded step's jobs left queued behind a hung job: `JobQueuedError`."""
        with state.lock:
            late = [i for i in sorted(busy) if not state.finished[i]]
            if late:  # a failure of theirs comes later: logged
                state.unheard = True
        if not late:  # they returned meanwhile: the step settled after all
            return None
        why = "its worker is still in an earlier job that outlived the wait for it"
        errors = [self._job_queued(state, index, why, number, epoch, phase) for index in late]
        errors[0].other_failures = tuple(errors[1:])
        return errors[0]

    def _job_queued(
        self,
        state: _Step,
        index: int,
        why: str,
        number: int,
        epoch: int | None,
        phase: str | None,
    ) -> JobQueuedError:
        """`JobQueuedError` for device ``index``'s job of ``state``, not started because
        ``why``."""
        error = JobQueuedError(
            device=self.devices[index],
            step=number,
            epoch=epoch,
            phase=phase,
            error_type="",
            error_message=f"{why}; this job runs once that one returns",
        )
        error._step = state
        return error

    def _failure_error(
        self, state: _Step, number: int, epoch: int | None, phase: str | None
    ) -> BaseException:
        with state.lock:
            failures = state.read_failures_locked()
        for index, exc in failures:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                exc.add_note(f"raised by the job on device {self.devices[index].name}")
                with contextlib.suppress(Exception):  # for the other ranks (`_comm.describe`)
                    exc._asyncddp_device = self.devices[index]  # type: ignore[union-attr]
                    if phase is not None and not hasattr(exc, "_asyncddp_phase"):
                        exc._asyncddp_phase = phase  # type: ignore[union-attr]
                return exc
        errors = [
            WorkerFailedError.from_exception(
                exc, device=self.devices[index], step=number, epoch=epoch, phase=phase
            )
            for index, exc in failures
        ]
        first = errors[0]
        first.other_failures = tuple(errors[1:])
        first.args = (str(first),)
        return first

    def _timeout_error(
        self, state: _Step, number: int, epoch: int | None, phase: str | None
    ) -> WorkerFailedError | None:
        with state.lock:  # one look: a job that finishes meanwhile is either late or not
            if state.remaining == 0 or state.failures:
                return None  # it settled after the wait gave up: report what happened
            if not state.shielded:
                state.cancel_locked()
            late = self._late_locked(state)
            state.unheard = True
        self._outlive(state)
        errors = self._late_errors(state, late, number, epoch, phase)
        first = errors[0]
        first.other_failures = tuple(errors[1:])
        first.args = (str(first),)
        return first

    @staticmethod
    def _late_locked(state: _Step) -> list[tuple[int, bool]]:
        """The step's unfinished jobs, each with whether it has started; under ``lock``."""
        return [
            (index, index not in state.queued)
            for index, done in enumerate(state.finished)
            if not done
        ]

    def _late_errors(
        self,
        state: _Step,
        late: list[tuple[int, bool]],
        number: int,
        epoch: int | None,
        phase: str | None,
    ) -> list[WorkerFailedError]:
        """The ``late`` jobs (`_late_locked`), past ``step_timeout``: each a
        `WorkerTimeoutError`, or a `JobQueuedError` for a shielded step's job that had not
        started (a shielded step drops no job: every device or none; it runs once the job
        before it, another task's step say, returns)."""
        assert self.step_timeout is not None
        errors: list[WorkerFailedError] = []
        for index, started in late:
            if not started:
                why = (
                    f"not started within step_timeout={self.step_timeout:g} s, its worker "
                    "still in an earlier job"
                )
                errors.append(self._job_queued(state, index, why, number, epoch, phase))
            else:
                errors.append(
                    WorkerTimeoutError(
                        timeout=self.step_timeout,
                        device=self.devices[index],
                        step=number,
                        epoch=epoch,
                        phase=phase,
                    )
                )
        return errors

    def _check_shards(self, shards: Sequence[S]) -> Sequence[S]:
        if not isinstance(shards, Sequence) or isinstance(shards, (str, bytes)):
            raise ShardError(
                f"shards must be a sequence with one shard per device, got {type(shards).__name__}"
            )
        if len(shards) != len(self.devices):
            raise ShardError(
                f"got {len(shards)} shard{'s' * (len(shards) != 1)} for {len(self.devices)} "
                f"device{'s' * (len(self.devices) != 1)}; give one shard per "
                "device (an empty one for a device with no data)"
            )
        return shards

    def _check_items(
        self, items: Sequence[int] | None, shards: Sequence[object]
    ) -> tuple[int, ...]:
        if items is None:
            return tuple(count_items(shard) for shard in shards)
        try:  # ints, NumPy's too (a count from an array's shape)
            counts = tuple(check_int("items", c, 0) for c in items)
        except (ConfigurationError, TypeError):
            counts = ()
        if len(counts) != len(self.devices):
            raise ShardError(
                f"items must hold one int count >= 0 per device ({len(self.devices)}), "
                f"got {items!r}"
            )
        return counts


def _noop(ctx: WorkerContext, shard: object) -> None:
    return None
