"""One persistent worker thread per device.

A `DeviceWorker` owns a named thread (``asyncddp-worker[cuda:1]``) that runs the jobs put
on its queue, one at a time, in order. On a CUDA device the thread makes its device current and
runs every job on a stream of its own, so two workers never serialise on the default stream;
a job counts as finished only once its stream work has finished (the worker waits for that in
its own thread, never on the event loop, and so an asynchronous CUDA error is charged to the
device that caused it). One kind of job may end before its kernels do
(`leave_stream_running`): the trainer's step on a lone GPU, so that the GPU works through
the step's tail while the event loop takes the step's results.

The caller's grad mode, autocast state and context variables are captured on the event loop
(`CallerState`) and re-entered around each job, as ``torch.nn.parallel.parallel_apply``
does: all three are thread-local, and a worker thread would otherwise run with its own defaults.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

import torch

from . import _sched
from ._devices import Device
from ._exit import watch

__all__ = [
    "CallerState",
    "DeviceWorker",
    "WorkerContext",
    "after_job",
    "cpu_worker_slice",
    "current_worker",
    "leave_stream_running",
]

_log = logging.getLogger("asyncddp")

#: A job: runs in the worker, returns what to call once it is dropped (or None).
Job = Callable[[], "Callable[[], None] | None"]


@dataclass(frozen=True, slots=True)
class WorkerContext:
    """What a job learns about where it runs; passed as the first argument of every job.

    Attributes:
        device: The device this job runs for.
        stream: The worker's CUDA stream (already current in the job), or ``None`` on the CPU.
        step: The step the job belongs to.
        phase: What the step is doing, for example ``"train"``.
    """

    device: Device
    stream: torch.cuda.Stream | None
    step: int
    phase: str | None

    @property
    def torch_device(self) -> torch.device:
        """Where to put this device's tensors."""
        return self.device.torch_device


_running = threading.local()


def current_worker() -> WorkerContext | None:
    """The `WorkerContext` of the job running in this thread, or ``None`` outside one.

    A trainer's step function gets only ``(model, batch)``; this tells it which device and
    step it runs for (``asyncddp.testing`` uses it to inject faults on one device).
    """
    ctx: WorkerContext | None = getattr(_running, "ctx", None)
    return ctx


def after_job(fn: Callable[[], None]) -> None:
    """Run ``fn`` on this worker once the running job has reported its result (and woken
    whoever waits for it), before the worker takes its next job: for work that nobody waits
    for, done while the event loop handles the result. Call only from a job; ``fn`` must not
    raise (an error is logged, as a bug). Outside a worker, ``fn`` runs at once.
    """
    after: list[Callable[[], None]] | None = getattr(_running, "after", None)
    if after is None:
        fn()
    else:
        after.append(fn)


def leave_stream_running() -> None:
    """Let the running job count as finished when it returns, without waiting for the kernels
    it queued on its worker's stream. Call only from a job on a GPU worker (elsewhere it does
    nothing), and only when nobody reads what those kernels write before this worker's next
    job: no other stream (no other device's worker) and no other thread. The next job runs
    behind them on the same stream, and whichever job of this worker next waits for its
    stream (every job does, but one that calls this) also waits for them, and raises an
    asynchronous CUDA error of theirs: charged to this device, in that later job.
    """
    if getattr(_running, "ctx", None) is not None:
        _running.sync = False


def _reset_autocast(kind: str, dtype: torch.dtype) -> None:
    """Put this thread's autocast for device type ``kind`` back as a new thread has it: off,
    its default ``dtype``, no autocast region open (one entered and never exited keeps its
    cache of cast weights, which then go stale as the weights train)."""
    torch.set_autocast_enabled(kind, False)
    torch.set_autocast_dtype(kind, dtype)
    nesting = torch.autocast_increment_nesting() - 1
    for _ in range(nesting + 1):
        torch.autocast_decrement_nesting()
    if nesting > 0:
        torch.clear_autocast_cache()


class CallerState(NamedTuple):
    """The caller's thread-local torch state, to be re-entered in a worker.

    Context variables travel separately: one ``contextvars.Context`` cannot be entered by two
    threads at once, so every job gets its own copy.
    """

    grad_enabled: bool
    autocast_enabled: bool
    autocast_dtype: torch.dtype

    @classmethod
    def capture(cls, device_type: str) -> CallerState:
        """Capture the calling thread's state for jobs on devices of ``device_type``."""
        return cls(
            torch.is_grad_enabled(),
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
        )


def cpu_worker_slice() -> float | None:
    """The scheduler slice a CPU worker asks for, in ms (see `._sched`); ``None``: none.

    The one ``ASYNCDDP_WORKER_SLICE_MS`` chooses; else a long one, so that the event loop's
    thread preempts the worker as it wakes, but not in a process group. There each step the
    ranks' workers wait for each other, in processes of their own, and a worker woken behind
    another rank's long-slice worker would wait out that slice. Decided as the worker starts,
    on the thread that starts it: a warning about the variable comes up there, and a process
    that joins a group later keeps the slice its running workers have.
    """
    chosen = _sched.chosen_slice_ms()
    if chosen is not None:
        return chosen or None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return None
    return _sched.WORKER_SLICE_MS


T = TypeVar("T")


def _on_a_new_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, called on a thread started for it and joined."""
    out: list[T] = []
    thread = threading.Thread(
        target=lambda: out.append(fn(*args)), name="asyncddp-threads", daemon=True
    )
    thread.start()
    thread.join()
    return out[0]


def new_threads_count() -> int:
    """The intra-op thread count a thread started now would run with: torch's global (see
    `_set_own_threads`), which the calling thread's own count may differ from."""
    return _on_a_new_thread(torch.get_num_threads)


def _set_own_threads(threads: int, callers: int) -> None:
    """``torch.set_num_threads(threads)`` for this thread alone.

    torch keeps the count last set in a global, besides the calling thread's own, and a thread
    takes the global as its own when it first asks for its count (its first parallel op, or
    ``torch.get_num_threads()``). Left at this worker's share, every thread started later
    would run with it: a thread pool's, an event loop's in a thread, a sync endpoint's. So this
    thread sets its count, takes it as its own, sets it again (another worker may have set the
    global in between), and a thread of no other use puts the global's count from before the
    workers started back (after every worker's set, since each puts it back after its own).
    """
    torch.set_num_threads(threads)
    torch.get_num_threads()
    torch.set_num_threads(threads)
    _on_a_new_thread(torch.set_num_threads, callers)


class DeviceWorker:
    """A thread that runs one device's jobs, in order.

    A job is a callable taking no arguments; it reports its own result (see ``_scheduler``)
    and may return a callable to run once the job is dropped: the place to wake whoever waits
    for the result. Then the worker does what the job left for after it (`after_job`),
    and waits for its next job. The worker only runs jobs and keeps going, whatever they raise.

    Args:
        device: The device to run jobs for.
        threads: Intra-op threads for this worker's CPU ops (``torch.set_num_threads`` is
            per thread); ``None`` keeps torch's default.
        global_threads: torch's global thread count to put back once the worker has its own
            (`new_threads_count`, read by ``start`` when not given).
    """

    def __init__(
        self, device: Device, *, threads: int | None = None, global_threads: int | None = None
    ) -> None:
        self.device = device
        self.threads = threads
        self.stream: torch.cuda.Stream | None = None
        self._default_stream: torch.cuda.Stream | None = None
        # The last job that started here returned and left GPU work running on the stream
        # (leave_stream_running): read on the event loop, written here.
        self.stream_left_running = False
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._setup_error: BaseException | None = None
        # The autocast dtype a new thread has for the device's type (a job may leave another):
        # read again on the worker's thread as it starts (_main).
        self._autocast = torch.get_autocast_dtype(device.type)
        self._thread = threading.Thread(
            target=self._main, name=f"asyncddp-worker[{device.name}]", daemon=True
        )
        self._slice_ms: float | None = None  # the scheduler slice to ask for (see start)
        self._in_job = False  # in a job or the work it left for after it (see _exit)
        # torch's global thread count to put back once this worker has its own (see start).
        self._global_threads = global_threads
        # Set once the worker's thread count is its own and the global is put back: until
        # then, a thread that first asks for its count takes this worker's share.
        self.threads_settled = threading.Event()

    @property
    def thread(self) -> threading.Thread:
        """The worker's thread."""
        return self._thread

    def start(self, slice_ms: float | Literal["read"] | None = "read") -> None:
        """Start the thread. It sets up its device (and stream) before its first job.

        ``slice_ms``: the scheduler slice a CPU worker asks for, as `cpu_worker_slice` gave
        it to the caller starting several (which reads it once, and warns once of a bad
        ``ASYNCDDP_WORKER_SLICE_MS``); by default read here."""
        if self.device.type == "cpu":
            self._slice_ms = cpu_worker_slice() if isinstance(slice_ms, str) else slice_ms
        if self.threads is not None and self._global_threads is None:
            self._global_threads = new_threads_count()
        # The interpreter's exit waits a while for a job this thread is in (see _exit); it
        # holds this worker weakly.
        worker = weakref.ref(self)
        watch(self._thread, lambda: (alive := worker()) is not None and alive._in_job)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; it runs after every job queued before it. Safe from any thread."""
        self._queue.put(job)

    def stop(self) -> None:
        """Ask the thread to exit once the jobs queued before this call have run."""
        self._queue.put(None)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to exit (blocking). Returns whether it did."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def invoke(
        self,
        state: CallerState,
        context: contextvars.Context,
        fn: Callable[..., Any],
        *args: Any,
    ) -> Any:
        """Run ``fn(*args)`` in the caller's state; call only from this worker's thread."""
        if self._setup_error is not None:
            raise RuntimeError(
                f"could not set up the worker for device {self.device.name}"
            ) from self._setup_error
        # Grad mode and autocast are thread-local; reset them for every job so one job's
        # leftovers never leak into the next (autocast turned on and left on, by
        # torch.set_autocast_enabled or an autocast entered and not exited: a device that
        # went on computing in bfloat16 where the others did not).
        torch.set_grad_enabled(state.grad_enabled)
        kind = self.device.type
        if torch.is_autocast_enabled(kind) or torch.get_autocast_dtype(kind) != self._autocast:
            _reset_autocast(kind, self._autocast)
        _running.ctx = args[0] if args and isinstance(args[0], WorkerContext) else None
        _running.sync = True
        self.stream_left_running = False
        if self.stream is not None and self._default_stream is not None:
            # The job may read what other threads queued on the device's default stream (a
            # batch the loader made on the GPU, trainer.model changed between calls), and this
            # stream does not wait for that one by itself (torch's pool streams are
            # non-blocking): it waits now, on the GPU, with no host sync.
            self.stream.wait_stream(self._default_stream)
        try:
            if state.autocast_enabled:
                with torch.autocast(self.device.type, dtype=state.autocast_dtype):
                    result = context.run(fn, *args)
            else:
                result = context.run(fn, *args)
        except BaseException:
            if self.stream is not None:
                # A failed job is done only when the kernels it queued are too, as a job that
                # returns (the caller may free what they read). Its own error is the one to
                # raise: one of those kernels' (a CUDA error) comes back at the next CUDA call.
                try:
                    self.stream.synchronize()
                except Exception:
                    _log.debug("asyncddp worker for %s: a failed job's stream", self.device)
            raise
        finally:
            _running.ctx = None
        if self.stream is not None:
            if _running.sync:
                # Host-device sync point: the job is done only when its kernels are (unless
                # it said otherwise: leave_stream_running).
                self.stream.synchronize()
            else:
                self.stream_left_running = True
        return result

    def _main(self) -> None:
        self._autocast = torch.get_autocast_dtype(self.device.type)
        if self._slice_ms is not None:
            _sched.prefer_throughput(self._slice_ms)  # never raises
        try:
            if self.threads is not None:
                assert self._global_threads is not None  # read in start()
                try:
                    _set_own_threads(self.threads, self._global_threads)
                finally:
                    self.threads_settled.set()
            if self.device.is_cuda:
                # The current device and the current stream are both per-thread: set them once.
                torch.cuda.set_device(self.device.torch_device)
                self.stream = torch.cuda.Stream(self.device.torch_device)  # type: ignore[no-untyped-call]
                torch.cuda.set_stream(self.stream)
                self._default_stream = torch.cuda.default_stream(self.device.torch_device)
        except BaseException as exc:  # reported by every job, so that no step waits forever
            self._setup_error = exc
        get = self._queue.get
        after: list[Callable[[], None]] = []
        _running.after = after
        while True:
            job = get()
            if job is None:
                return
            self._in_job = True
            try:
                notify = job()
            except BaseException:  # jobs report their own errors; this is a bug in asyncddp
                _log.exception("asyncddp worker for %s: a job failed to report", self.device)
                notify = None
            # Drop the job before blocking on the queue, so that nothing it held stays alive.
            del job
            if notify is not None:
                # Right before this thread waits again (or does the work the job left for
                # after it, in torch ops that let go of the GIL): the thread it wakes needs
                # the GIL at once, and would otherwise wake only to wait.
                notify()
                del notify
            while after:
                try:
                    after.pop(0)()
                except BaseException:  # after_job's functions must not raise
                    _log.exception("asyncddp worker for %s: work after a job failed", self.device)
            self._in_job = False
