"""Helpers for testing code that uses asyncddp, on any machine, without a GPU.

- :func:`cpu_devices` gives several workers that compute on the CPU, so the real multi-device
  code paths run in CI.
- :func:`fail_on` wraps a job so that it raises on a chosen device (and step).
- :func:`hang_on` wraps a job so that it blocks on a chosen device until released, to test
  ``step_timeout`` and cancellation.
- :func:`asyncddp_threads` lists the worker threads still alive, for a leak check.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from ._devices import cpu_devices
from ._worker import WorkerContext

__all__ = ["InjectedFailure", "asyncddp_threads", "cpu_devices", "fail_on", "hang_on"]

S = TypeVar("S")
T = TypeVar("T")


class InjectedFailure(RuntimeError):
    """The error :func:`fail_on` raises unless told otherwise.

    Attributes:
        device_index: The index of the device it was raised on.
        step: The step it was raised at.
    """

    def __init__(self, message: str, *, device_index: int, step: int) -> None:
        super().__init__(message)
        self.device_index = device_index
        self.step = step

    def __reduce__(self) -> tuple[object, ...]:
        return (_injected, (str(self), self.device_index, self.step))


def _injected(message: str, device_index: int, step: int) -> InjectedFailure:
    return InjectedFailure(message, device_index=device_index, step=step)


def fail_on(
    job: Callable[[WorkerContext, S], T],
    *,
    device: int,
    step: int | None = None,
    error: BaseException | None = None,
) -> Callable[[WorkerContext, S], T]:
    """Wrap ``job`` so that it raises on device ``device`` (an index), at ``step`` or always.

    Args:
        job: The job to wrap.
        device: The index of the device whose job fails.
        step: The step at which it fails; ``None`` fails at every step.
        error: What to raise; by default an :class:`InjectedFailure`.
    """

    def failing(ctx: WorkerContext, shard: S) -> T:
        if ctx.device.index == device and (step is None or ctx.step == step):
            if error is not None:
                raise error
            raise InjectedFailure(
                f"injected failure on {ctx.device.name} at step {ctx.step}",
                device_index=ctx.device.index,
                step=ctx.step,
            )
        return job(ctx, shard)

    return failing


def hang_on(
    job: Callable[[WorkerContext, S], T],
    *,
    device: int,
    release: threading.Event,
    step: int | None = None,
    limit: float = 60.0,
) -> Callable[[WorkerContext, S], T]:
    """Wrap ``job`` so that it blocks on device ``device`` until ``release`` is set.

    The job blocks for ``limit`` seconds at most, so that a test that forgets to release it
    still ends (and its worker thread with it). After the release the job runs as usual.
    """

    def hanging(ctx: WorkerContext, shard: S) -> T:
        if ctx.device.index == device and (step is None or ctx.step == step):
            release.wait(limit)
        return job(ctx, shard)

    return hanging


def asyncddp_threads() -> list[threading.Thread]:
    """The asyncddp worker threads alive in this process."""
    return [
        thread
        for thread in threading.enumerate()
        if thread.name.startswith("asyncddp-") and thread.is_alive()
    ]
