"""CPU workers as throughput threads: a longer scheduler slice, on Linux 6.12 and later.

Linux's fair scheduler (EEVDF, since 6.6) lets a thread ask for the length of the slice it
runs before the scheduler may pick another (``sched_setattr``'s ``sched_runtime``, clamped to
0.1-100 ms, since 6.12), and from the same release a waking thread whose slice is shorter than
the running thread's preempts it, provided the waking thread is eligible (it has not run ahead of
its fair share of the CPU). A CPU worker computes for as long as it can: it asks for a long
slice (`WORKER_SLICE_MS`). The threads that wake for short work, the event loop's above all
(and gloo's, a loader's), keep the default slice, and so mostly get a core as they wake instead
of waiting for a worker's slice to end: with every core training, that wait was most of the
event loop's lag (docs/benchmarks.md, "Event-loop lag").

Not in a process group (see ``_worker``): there each step the ranks' workers, in processes of
their own, wait for each other, and a worker that wakes behind another rank's long-slice
worker waits out that slice (asyncddp across 2 processes on 2 cores ran 4-7% slower a step with
it: ``python bench/distributed.py --slice-cost``). In one process no cost was measured
(``python bench/loop_lag.py --slice-cost``; see docs/benchmarks.md).

Only the slice changes. The thread's weight (its nice value), policy and reset-on-fork flag are
kept: a worker gets the share of the CPU it had, so one that holds the GIL is not starved of a
core, as it was under ``SCHED_IDLE`` (tried and reverted: see the same section). Threads and
processes started from the worker inherit the slice (its GNU OpenMP team, and anything a job
starts). Kernels before 6.12 take the request and ignore it; other systems and other
architectures than 64-bit x86 and Arm, RISC-V and LoongArch never see it, and a refusal (a
container's seccomp filter, say) changes nothing. ``ASYNCDDP_WORKER_SLICE_MS`` chooses the slice
for every CPU worker, in a process group too; ``0`` leaves the workers as they are.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import platform
import sys

from ._checks import warn_user
from ._exceptions import AsyncDDPRuntimeWarning

__all__ = [
    "SLICE_VARIABLE",
    "WORKER_SLICE_MS",
    "chosen_slice_ms",
    "prefer_throughput",
    "thread_slice_ns",
]

_log = logging.getLogger("asyncddp")

#: The slice CPU workers ask for, in milliseconds (the kernel's default is about 1.4-1.5 ms on
#: 2 cores: 0.7-0.75 ms, scaled up with the cores up to 8).
WORKER_SLICE_MS = 30.0

#: The environment variable that chooses the slice, in milliseconds (``0``: leave it).
SLICE_VARIABLE = "ASYNCDDP_WORKER_SLICE_MS"

_SCHED_OTHER, _SCHED_BATCH = 0, 3  # the policies whose slice this sets
_SCHED_FLAG_RESET_ON_FORK = 0x01  # the one flag a normal thread's getattr reports
# (sched_setattr, sched_getattr) by machine, for 64-bit processes: x86's own numbers, and the
# generic ones (asm-generic/unistd.h) that Arm, RISC-V and LoongArch use
_SYSCALLS = {
    "x86_64": (314, 315),
    "aarch64": (274, 275),
    "riscv64": (274, 275),
    "loongarch64": (274, 275),
}


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


@functools.cache
def _calls() -> tuple[object, int, int] | None:
    """libc's ``syscall`` and the two calls' numbers; ``None`` where they are not known."""
    if sys.platform != "linux" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None  # (a 32-bit process on a 64-bit kernel has other numbers)
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    return syscall, *numbers


def chosen_slice_ms() -> float | None:
    """The slice ``ASYNCDDP_WORKER_SLICE_MS`` chooses, in milliseconds (``0``: none); ``None``
    when it is not set or empty, or not a finite number (with a warning: the default
    applies)."""
    value = os.environ.get(SLICE_VARIABLE)
    if value is None or not value.strip():
        return None  # unset, or set empty (as CI matrices often do)
    try:
        milliseconds = float(value)
    except ValueError:
        milliseconds = math.nan
    if not math.isfinite(milliseconds):
        warn_user(
            f"{SLICE_VARIABLE}={value!r} is not a number of milliseconds; CPU workers use the "
            f"default ({WORKER_SLICE_MS:g} ms outside a process group)",
            AsyncDDPRuntimeWarning,
        )
        return None
    return max(0.0, milliseconds)


def _get(tid: int) -> _SchedAttr | None:
    calls = _calls()
    if calls is None:
        return None
    syscall, _, getattr_call = calls
    attr = _SchedAttr()
    if syscall(getattr_call, tid, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:  # type: ignore[operator]
        return None
    return attr


def thread_slice_ns(tid: int = 0) -> int | None:
    """The slice of thread ``tid`` (0: the calling thread) in nanoseconds, as the kernel
    reports it (0 before Linux 6.12); ``None`` where it cannot be read. Never raises."""
    try:
        attr = _get(tid)
    except Exception:
        return None
    return None if attr is None else int(attr.sched_runtime)


def prefer_throughput(milliseconds: float = WORKER_SLICE_MS) -> bool:
    """Ask for a slice of ``milliseconds`` for the calling thread (see the module's notes),
    within the kernel's range, 0.1-100 ms; 0 or less asks for nothing. Returns whether the
    kernel took the request (a kernel before 6.12 takes it and ignores it). Never raises."""
    try:
        if not milliseconds > 0:
            return False
        nanoseconds = round(min(max(milliseconds, 0.1), 100.0) * 1_000_000)
        calls = _calls()
        attr = _get(0)
        if calls is None or attr is None or attr.sched_policy not in (_SCHED_OTHER, _SCHED_BATCH):
            return False
        syscall, setattr_call, _ = calls
        wanted = _SchedAttr(
            size=ctypes.sizeof(_SchedAttr),
            sched_policy=attr.sched_policy,
            sched_flags=attr.sched_flags & _SCHED_FLAG_RESET_ON_FORK,
            sched_nice=attr.sched_nice,  # kept: raising a thread's priority needs privileges
            sched_runtime=nanoseconds,
        )
        if syscall(setattr_call, 0, ctypes.byref(wanted), 0) != 0:  # type: ignore[operator]
            _log.debug(
                "asyncddp: the worker's scheduler slice was refused: %s",
                os.strerror(ctypes.get_errno()),
            )
            return False
        return True
    except Exception:  # a scheduling hint is never worth a failed worker
        return False
