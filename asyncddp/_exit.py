"""At interpreter exit, a while for the threads asyncddp left running to end.

asyncddp leaves a thread behind rather than hang a call on it: a worker whose job outlived
``drain_timeout``, the loader thread inside a ``next()`` of a cancelled or stopped fit. Such
threads are daemons, so that a job that never returns cannot keep the process alive. But on
Python before 3.14 a daemon thread that takes the GIL back once the interpreter has begun to
finalize exits through ``pthread_exit``, and where that unwinds through torch's C++ (a torch
op releases the GIL while it computes) the process aborts: "terminate called without an
active exception", exit status 134, after a script that caught a ``WorkerTimeoutError`` and
ended, say. (Python 3.14 hangs such a thread instead, CPython gh-87135: nothing to wait for.)

So the loader threads left behind are noted here (`wait_at_exit`), and so is every worker as it
starts, with whether it is in a job (`watch`): one left behind is still in its job, and a
program that leaves its event loop on a ``KeyboardInterrupt`` out of
``loop.run_until_complete`` leaves them inside a step. An ``atexit`` hook, which runs before
the interpreter finalizes, waits until none is busy: `EXIT_WAIT` seconds at most in all
(``ASYNCDDP_EXIT_WAIT`` chooses, ``0`` waits not at all), with a warning on the ``asyncddp``
logger that names them once the wait has lasted a second (most end within milliseconds). Ctrl-C
ends the wait at once. A thread blocked in a Python lock (a ``queue.Queue.get``, an
``Event.wait``: a live feed's generator, say) is not waited for: it is in the lock's C code,
not in torch's, and stays there as the interpreter finalizes; but a worker waiting for the
other devices of its step is, as their arrival releases it.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["EXIT_WAIT", "EXIT_WAIT_VARIABLE", "wait_at_exit", "watch"]

_log = logging.getLogger("asyncddp")

#: How long, in seconds, the interpreter's exit waits at most for the threads left behind.
EXIT_WAIT = 10.0

#: The environment variable that chooses it, in seconds (``0``: no wait).
EXIT_WAIT_VARIABLE = "ASYNCDDP_EXIT_WAIT"

#: Where the innermost frame of a thread waiting in a Python lock is.
_LOCK_WAITS = frozenset({threading.__file__, queue.__file__})

#: asyncddp's own meeting of a step's devices (`_jobs.Meeting`): a worker waiting there is in
#: a step, released as the other devices arrive, and goes back into torch's ops then.
_MEETING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_jobs.py")

_lock = threading.Lock()
#: Each thread watched, and what tells whether it is busy (None: while it lives).
_pending: dict[threading.Thread, Callable[[], bool] | None] = {}
_hooked = False


def wait_at_exit(thread: threading.Thread) -> None:
    """Have the interpreter's exit wait a while for ``thread`` to end (see the module)."""
    watch(thread)


def watch(thread: threading.Thread, busy: Callable[[], bool] | None = None) -> None:
    """Have the interpreter's exit wait a while for ``thread`` while ``busy()`` is true, or,
    without ``busy``, until it ends. Never raises: it only makes the exit safer."""
    global _hooked
    if sys.version_info >= (3, 14):
        return
    try:
        with _lock:
            for gone in [t for t in _pending if t.ident is not None and not t.is_alive()]:
                del _pending[gone]
            if busy is not None or thread not in _pending:
                _pending[thread] = busy
            if not _hooked:
                atexit.register(_wait)
                _hooked = True
    except Exception:  # pragma: no cover - an interpreter tearing down, say
        _log.debug("could not have the exit wait for %s", thread.name, exc_info=True)


def _forget() -> None:
    """In a forked child: the parent's threads are not there, and the lock may be held."""
    global _lock
    _lock = threading.Lock()
    _pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def exit_wait() -> float:
    """`EXIT_WAIT`, or what ``ASYNCDDP_EXIT_WAIT`` says (a number of seconds from 0)."""
    text = os.environ.get(EXIT_WAIT_VARIABLE)
    if text is None or not text.strip():
        return EXIT_WAIT
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if math.isnan(seconds) or seconds < 0:
        _log.warning(
            "%s=%r is not a number of seconds from 0: waiting %g s at exit",
            EXIT_WAIT_VARIABLE,
            text,
            EXIT_WAIT,
        )
        return EXIT_WAIT
    return min(seconds, threading.TIMEOUT_MAX)


def _in_a_lock(thread: threading.Thread) -> bool:
    """Whether ``thread`` waits in a Python lock (its innermost frame is in one's code)."""
    frame = sys._current_frames().get(thread.ident or 0)
    return frame is not None and frame.f_code.co_filename in _LOCK_WAITS


def _at_meeting(thread: threading.Thread) -> bool | None:
    """For a thread waiting at the meeting of a step's devices (`_jobs.Meeting.wait`),
    whether the meeting has released it already (it runs on into torch's ops); None for a
    thread not waiting there."""
    frame = sys._current_frames().get(thread.ident or 0)
    if frame is None or frame.f_code.co_filename not in _LOCK_WAITS:
        return None
    while frame is not None:
        if frame.f_code.co_name == "wait" and os.path.abspath(frame.f_code.co_filename) == _MEETING:
            meeting, this = frame.f_locals.get("self"), frame.f_locals.get("this")
            return getattr(meeting, "_round", this) != this or bool(getattr(meeting, "_left", 0))
        frame = frame.f_back
    return None


def _busy(watched: dict[threading.Thread, Callable[[], bool] | None]) -> list[threading.Thread]:
    """The threads of ``watched`` the exit must still wait for: those in a job (by their
    check) but not blocked in a Python lock; and a worker waiting for the other devices of
    its step while another is still at work (whose arrival releases it into torch's ops: the
    process aborted when it did so as the interpreter finalized), or once released. A worker
    whose step's other devices all wait in locks (a hung step) is not waited for."""
    running: list[threading.Thread] = []
    meeting: list[threading.Thread] = []
    for thread, check in watched.items():
        if not thread.is_alive() or (check is not None and not check()):
            continue
        released = _at_meeting(thread)
        if released is None and _in_a_lock(thread):
            continue
        (running if released is None or released else meeting).append(thread)
    busy = running + meeting if running else []
    return sorted(busy, key=lambda t: t.name)


#: How long the exit waits without a word (see `_wait`).
_QUIET_SECONDS = 1.0


def _wait() -> None:
    with _lock:
        watched = dict(_pending)
        _pending.clear()
    threads = _busy(watched)
    seconds = exit_wait()
    if not threads or seconds <= 0:
        return
    deadline = time.monotonic() + seconds
    # Most such threads end within milliseconds (a loader in a next(), a worker finishing its
    # job after a step failed elsewhere): only a wait that outlasts this is told of.
    quiet = time.monotonic() + min(_QUIET_SECONDS, seconds)
    told = False
    try:
        while threads and time.monotonic() < deadline:
            if not told and time.monotonic() >= quiet:
                told = True
                _log.warning(
                    "waiting up to %.1f s more for %s, left running by asyncddp, to end before "
                    "the interpreter exits (it may abort the process under a thread in torch's "
                    "code); Ctrl-C stops waiting, %s=0 does not wait",
                    deadline - time.monotonic(),
                    ", ".join(thread.name for thread in threads),
                    EXIT_WAIT_VARIABLE,
                )
            # A worker ends its job and waits for the next (which never comes): it does not
            # end, so this looks at them again rather than join them.
            threads[0].join(min(0.02, max(0.0, deadline - time.monotonic())))
            threads = _busy({thread: watched[thread] for thread in threads})
    except KeyboardInterrupt:
        return
    late = [thread.name for thread in threads]
    if late:
        _log.warning(
            "%s still running after %g s: exiting under it (the process may abort)",
            ", ".join(late),
            seconds,
        )
