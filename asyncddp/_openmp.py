"""Letting go of the calling thread's idle OpenMP threads before CPU workers start their own.

PyTorch's CPU ops run on OpenMP: the first parallel op on a thread starts a team of helper
threads for it, which stay, idle, for the thread's lifetime. GNU OpenMP (libgomp, which the
PyTorch wheels for Linux ship) counts the helper threads of every team in the process, and once
they outnumber the cores it all but stops busy-waiting between parallel ops (100 spins, not
300,000): every op then wakes its team from sleep, and the ops of a step slow down. A program
whose main thread ran one parallel op (a model's set-up, a dataset turned into tensors) holds
such a team. A CPU worker's own team then takes the count over the cores (measured: one CPU
device on 2 cores, the MLP of ``bench/throughput.py``, 20-35% slower a step, its threads
sleeping a fifth of the time), while the same loop on the main thread alone runs at full speed.

`release_idle_threads` lets the calling thread's idle team go (OpenMP 5.0's
``omp_pause_resource_all``, which libgomp implements for the calling thread only: other threads'
teams, such as other workers', are untouched; inside a parallel region it refuses). A later
parallel op on that thread starts a new team, in about a tenth of a millisecond. Anything else
(another OpenMP runtime, no OpenMP, a platform without ``/proc``) is left as it is, and so is a
process forked from one that had a team: libgomp keeps no record of the fork, and in the child
the pause would wait forever for helper threads that were not copied (the child's workers start
teams of their own, as before).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from collections.abc import Callable

import torch

__all__ = ["release_idle_threads"]

# libgomp.so.1, or torch.libs' libgomp-a34b3233.so.1; not its offloading plugins
_LIBGOMP = re.compile(r"libgomp(-[0-9a-f]+)?\.so")
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the runtime's state may be kept, its threads not
_forked = False  # this process is a fork's child: its teams' helper threads are not here


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def release_idle_threads() -> bool:
    """Let the calling thread's idle OpenMP threads go (GNU OpenMP on Linux only).

    Returns whether the runtime did (it refuses inside a parallel region); False where there
    is nothing to do it with. Never raises.
    """
    if _forked:
        return False
    pause = _pause()
    return pause is not None and pause() == 0


@functools.cache
def _pause() -> Callable[[], int] | None:
    path = _loaded_libgomp()
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path)  # already loaded (by torch): the same copy, not another
        # OpenMP 5.0, GCC 9 and later. Not omp_pause_resource: naming the host device by
        # omp_get_initial_device() makes a recent libgomp look for offloading plugins.
        pause = library.omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return lambda: int(pause(_OMP_PAUSE_SOFT))


def _loaded_libgomps() -> set[str]:
    """The paths of every libgomp this process has loaded (none where there is no ``/proc``)."""
    try:
        with open("/proc/self/maps") as maps:
            return {
                path
                for line in maps
                if "/libgomp" in line
                and _LIBGOMP.match(os.path.basename(path := line.split(maxsplit=5)[-1].strip()))
            }
    except OSError:
        return set()


def _loaded_libgomp() -> str | None:
    """The path of the libgomp torch runs on, among those this process has loaded: the one
    torch ships (other packages, scikit-learn's for one, ship copies of their own), or the
    only one loaded."""
    paths = _loaded_libgomps()
    package = os.path.realpath(os.path.dirname(torch.__file__))  # the maps' paths are real
    torchs = {path for path in paths if path.startswith((package + os.sep, package + ".libs"))}
    for found in (torchs, paths):
        if len(found) == 1:
            return found.pop()
    return None
