"""Argument checks shared by the public constructors: a wrong type or value raises
`ConfigurationError` naming the argument, before any thread starts. What passes comes
back as a plain Python value (a NumPy int as an ``int``, say)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import numbers
import operator
import os
import sys
import threading
import warnings
from typing import Any

import numpy as np

from ._exceptions import AsyncDDPWarning, ConfigurationError, ConfigurationTypeError

#: What ``torch.set_num_threads`` takes (a C int); more is an overflow inside the worker.
MAX_THREADS = 2**31 - 1


def check_int(
    name: str, value: Any, low: int, high: int | None = None, *, none: bool = False
) -> Any:
    """An integer (Python's or NumPy's, not a bool) from ``low`` to ``high``, or None when
    ``none``; returns it as an ``int``."""
    if none and value is None:
        return None
    integral = isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
    number = operator.index(value) if integral else None
    if number is None or number < low or (high is not None and number > high):
        span = f">= {low}" if high is None else f"from {low} to {high}"
        raise (ConfigurationError if integral else ConfigurationTypeError)(
            f"{name} must be an int {span}{' or None' if none else ''}, got {value!r}"
        )
    return number


def check_positive(name: str, value: Any, *, unit: str = "", none: bool = True) -> Any:
    """A real number above 0 (infinity included; ``unit``: what it counts), or None when
    ``none``; returns it as a ``float``."""
    if none and value is None:
        return None
    real = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if not (real and not math.isnan(value) and value > 0):
        what = f"a positive number{f' of {unit}' if unit else ''}"
        raise (ConfigurationError if real else ConfigurationTypeError)(
            f"{name} must be {what}{' or None' if none else ''}, got {value!r}"
        )
    return float(value)


def check_seconds(name: str, value: Any) -> float | None:
    """A time limit: a positive number of seconds, or None for none. Infinity is no limit
    either, returned as None (what the code paths without a limit test for)."""
    seconds = check_positive(name, value, unit="seconds")
    return None if seconds == math.inf else seconds


def check_bool(name: str, value: Any, *, none: bool = False) -> Any:
    """True or False (a NumPy bool, 0 or 1 too), or None when ``none``; returns a ``bool``."""
    if none and value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or (
        isinstance(value, numbers.Integral) and value in (0, 1)
    ):
        return bool(value)
    raise (ConfigurationError if isinstance(value, numbers.Integral) else ConfigurationTypeError)(
        f"{name} must be True or False{' or None' if none else ''}, got {value!r}"
    )


def check_path(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigurationTypeError(
            f"{name} must be a path (str or os.PathLike) or None, got {value!r}"
        )


def first_names(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names``, comma-separated, ``...`` after them if there are more
    (for a message naming parameters)."""
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def clipped(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, ending ``...`` where it was cut."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def warn_user(message: str, category: type[AsyncDDPWarning] = AsyncDDPWarning) -> None:
    """``warnings.warn`` at the user's line that called into asyncddp (``await trainer.fit(...)``;
    a coroutine's caller is its frame's ``f_back`` while it runs), however deep in the library
    the warning is raised: the first frame outside asyncddp and the machinery between
    (``contextlib``, the event loop's libraries, threads). A fit started as a task of its own
    has no caller but the event loop's: the warning goes to the line that runs the loop
    (``asyncio.run(main())``), or, where the stack holds nothing else, the first frame past
    asyncddp's own."""
    machinery = _machinery()
    frame = sys._getframe(1)  # the caller of warn_user: stacklevel=2
    level, fallback = 2, None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_PACKAGE):
            if not path.startswith(machinery):
                break
            fallback = level if fallback is None else fallback
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else fallback or 2)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _machinery() -> tuple[str, ...]:
    """The files and folders of the machinery between the user's code and asyncddp's."""
    folders = [
        os.path.dirname(os.path.abspath(module.__file__)) + os.sep
        for module in (
            asyncio,
            concurrent.futures,
            sys.modules.get("anyio"),
            sys.modules.get("trio"),
        )
        if module is not None and module.__file__ is not None
    ]
    return (os.path.abspath(contextlib.__file__), os.path.abspath(threading.__file__), *folders)
