"""CPU workers as throughput threads: a longer scheduler slice, on Linux 6.12 and later.

Linux's fair scheduler (EEVDF, since 6.6) lets a thread ask for the length of the slice it
runs before the scheduler may pick another (``sched_setattr``'s ``sched_runtime``, clamped to
0.1-100 ms, since 6.12), and from the same release a waking thread whose slice is shorter than
the running thread's preempts it at once. A CPU worker computes for as long as it can: it asks
for a long slice (:data:`WORKER_SLICE_MS`). The threads that wake for short work, the event
loop's above all (and gloo's, a loader's), keep the default slice and so get a core the moment
they wake, instead of waiting for a worker's slice to end: with every core training, that wait
was most of the event loop's lag (docs/benchmarks.md, "Event-loop lag").

Not in a process group (see ``_worker``): there each step the ranks' workers, in processes of
their own, wait for each other, and a worker that wakes behind another rank's long-slice
worker waits out that slice (asyncddp across 2 processes on 2 cores ran 4% slower a step with
it, slower in 7 of 8 rounds; 7% in another run). In one process no cost was measured (one fit
of 2 workers, of 1, or two fits side by side: 1.01x, 1.02x, 0.99x).

Only the slice changes. The thread's weight (its nice value) and policy are kept: a worker gets
the share of the CPU it had, so one that holds the GIL is never starved of a core, as it was
under ``SCHED_IDLE`` (tried and reverted: see the same section). Threads the worker starts
later (its OpenMP team) inherit the slice. Kernels before 6.12 ignore ``sched_runtime`` for
normal threads, and elsewhere (another OS, another policy, a refusal) nothing changes.
``ASYNCDDP_WORKER_SLICE_MS`` chooses the slice, for every CPU worker, in a process group too;
``0`` leaves the workers as they are.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

__all__ = ["WORKER_SLICE_MS", "prefer_throughput", "slice_chosen", "thread_slice_ns"]

#: The slice CPU workers ask for, in milliseconds (the kernel's default: 0.7 ms, scaled up with
#: the cores, 1.4 ms on 2).
WORKER_SLICE_MS = 30.0

_SCHED_OTHER, _SCHED_BATCH = 0, 3  # the policies whose slice this sets
# (sched_setattr, sched_getattr) by machine: Linux's generic numbers, and x86's own
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275), "arm64": (274, 275)}


class _SchedAttr(ctypes.Structure):
    """``struct sched_attr``, its first published layout (``SCHED_ATTR_SIZE_VER0``)."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
    ]


def _calls() -> tuple[ctypes.CDLL, int, int] | None:
    numbers = _SYSCALLS.get(platform.machine()) if sys.platform == "linux" else None
    if numbers is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc, *numbers
    except (OSError, AttributeError):
        return None


def slice_chosen() -> bool:
    """Whether ``ASYNCDDP_WORKER_SLICE_MS`` is set: the slice is the user's choice."""
    return "ASYNCDDP_WORKER_SLICE_MS" in os.environ


def _slice_ms() -> float:
    value = os.environ.get("ASYNCDDP_WORKER_SLICE_MS")
    if value is None:
        return WORKER_SLICE_MS
    try:
        return max(0.0, float(value))
    except ValueError:
        return WORKER_SLICE_MS


def _get(calls: tuple[ctypes.CDLL, int, int], tid: int) -> _SchedAttr | None:
    libc, _, getattr_call = calls
    attr = _SchedAttr()
    if libc.syscall(getattr_call, tid, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        return None
    return attr


def thread_slice_ns(tid: int = 0) -> int | None:
    """The slice of thread ``tid`` (0: the calling thread) in nanoseconds, as the kernel
    reports it; ``None`` where it cannot be read."""
    calls = _calls()
    attr = _get(calls, tid) if calls is not None else None
    return None if attr is None else int(attr.sched_runtime)


def prefer_throughput() -> bool:
    """Ask for a long slice for the calling thread (see the module's notes). Returns whether
    the kernel took the request (a kernel before 6.12 takes it and ignores it). Never raises."""
    milliseconds = _slice_ms()
    calls = _calls()
    if calls is None or milliseconds <= 0:
        return False
    try:
        attr = _get(calls, 0)
        if attr is None or attr.sched_policy not in (_SCHED_OTHER, _SCHED_BATCH):
            return False
        libc, setattr_call, _ = calls
        wanted = _SchedAttr(
            size=ctypes.sizeof(_SchedAttr),
            sched_policy=attr.sched_policy,
            sched_nice=attr.sched_nice,  # kept: raising a thread's priority needs privileges
            sched_runtime=int(milliseconds * 1_000_000),
        )
        return bool(libc.syscall(setattr_call, 0, ctypes.byref(wanted), 0) == 0)
    except Exception:  # a scheduling hint is never worth a failed worker
        return False
