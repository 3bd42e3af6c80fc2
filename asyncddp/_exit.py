"""At interpreter exit, a while for the threads asyncddp left running to end.

asyncddp leaves a thread behind rather than hang a call on it: a worker whose job outlived
``drain_timeout``, the loader thread inside a ``next()`` of a cancelled or stopped fit. Such
threads are daemons, so that a job that never returns cannot keep the process alive. But on
Python before 3.14 a daemon thread that takes the GIL back once the interpreter has begun to
finalize exits through ``pthread_exit``, and where that unwinds through torch's C++ (a torch
op releases the GIL while it computes) the process aborts: "terminate called without an
active exception", exit status 134, after a script that caught a ``WorkerTimeoutError`` and
ended, say.

So the threads left behind are noted here (`wait_at_exit`), and ``threading``'s own exit hooks
(those ``concurrent.futures`` uses, run before the interpreter finalizes) wait for them: up to
`EXIT_WAIT` seconds, or the ``drain_timeout`` of the call that left them if longer, with a
warning on the ``asyncddp`` logger that says what it waits for. Ctrl-C ends the wait at once.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["EXIT_WAIT", "wait_at_exit"]

_log = logging.getLogger("asyncddp")

#: The least time, in seconds, the interpreter's exit waits for the threads left behind.
EXIT_WAIT = 10.0

_lock = threading.Lock()
_pending: dict[threading.Thread, float] = {}  # a thread left behind: how long to wait for it
_hooked = False


def wait_at_exit(thread: threading.Thread, seconds: float | None = None) -> None:
    """Have the interpreter's exit wait for ``thread``, up to `EXIT_WAIT` seconds or
    ``seconds`` if longer (from when the exit begins)."""
    global _hooked
    with _lock:
        for other in [t for t in _pending if not t.is_alive()]:
            del _pending[other]
        _pending[thread] = max(EXIT_WAIT, seconds or 0.0)
        if not _hooked:
            try:
                threading._register_atexit(_wait)  # type: ignore[attr-defined]
            except RuntimeError:  # the interpreter is exiting already: nothing to wait in
                return
            _hooked = True


def _wait() -> None:
    with _lock:
        threads = {thread: s for thread, s in _pending.items() if thread.is_alive()}
        _pending.clear()
    if not threads:
        return
    seconds = max(threads.values())
    names = ", ".join(sorted(thread.name for thread in threads))
    _log.warning(
        "waiting up to %g s for %s, left running by asyncddp, to end before the interpreter "
        "exits (it may abort the process under a thread in torch's code); Ctrl-C stops waiting",
        seconds,
        names,
    )
    deadline = time.monotonic() + seconds
    try:
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    except KeyboardInterrupt:
        return
    late = sorted(thread.name for thread in threads if thread.is_alive())
    if late:
        _log.warning(
            "%s still running after %g s: exiting under it (the process may abort)",
            ", ".join(late),
            seconds,
        )
