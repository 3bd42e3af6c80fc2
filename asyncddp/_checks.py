"""Argument checks shared by the public constructors: a wrong type or value raises
:class:`ConfigurationError` naming the argument, before any thread starts."""

from __future__ import annotations

import math
import os
from typing import Any

from ._exceptions import ConfigurationError

#: What ``torch.set_num_threads`` takes (a C int); more is an overflow inside the worker.
MAX_THREADS = 2**31 - 1


def check_int(
    name: str, value: Any, low: int, high: int | None = None, *, none: bool = False
) -> None:
    """``value`` is an int (not a bool) from ``low`` to ``high``, or None when ``none``."""
    if none and value is None:
        return
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        span = f">= {low}" if high is None else f"from {low} to {high}"
        raise ConfigurationError(
            f"{name} must be an int {span}{' or None' if none else ''}, got {value!r}"
        )


def check_positive(name: str, value: Any, *, unit: str = "", none: bool = True) -> None:
    """``value`` is a finite number above 0 (``unit``: what it counts), or None when ``none``."""
    if none and value is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value > 0):
        what = f"a positive number{f' of {unit}' if unit else ''}"
        raise ConfigurationError(
            f"{name} must be {what}{' or None' if none else ''}, got {value!r}"
        )


def check_bool(name: str, value: Any, *, none: bool = False) -> None:
    if not (isinstance(value, bool) or (none and value is None)):
        raise ConfigurationError(
            f"{name} must be True or False{' or None' if none else ''}, got {value!r}"
        )


def check_path(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ConfigurationError(
            f"{name} must be a path (str or os.PathLike) or None, got {value!r}"
        )
