"""Helpers for testing code that uses asyncddp, on any machine, without a GPU.

- `cpu_devices` gives several workers that compute on the CPU, so the real multi-device
  code paths run in CI.
- `fail_on` and `hang_on` wrap a `StepScheduler` job so that it raises, or
  blocks until released, on a chosen device (and step).
- `failing_step`, `hanging_step` and `failing_optimizer` do the same to a
  `Trainer`'s step function or optimizer: a fault in the forward pass, the backward pass,
  a metric, or the optimizer step, on one device, at one step.
- `asyncddp_threads` lists the worker threads still alive, for a leak check.
"""

from __future__ import annotations

import inspect
import numbers
import operator
import threading
import types
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from ._checks import check_bool, check_int, check_positive
from ._devices import cpu_devices
from ._exceptions import ConfigurationError
from ._worker import WorkerContext, current_worker

__all__ = [
    "InjectedFailure",
    "asyncddp_threads",
    "cpu_devices",
    "fail_on",
    "failing_optimizer",
    "failing_step",
    "hang_on",
    "hanging_step",
]

S = TypeVar("S")
T = TypeVar("T")
# A trainer's step, ``step(model, batch) -> output``, kept by the wrappers as they took it.
_Model = TypeVar("_Model")
_Batch = TypeVar("_Batch")
_Output = TypeVar("_Output")


class InjectedFailure(RuntimeError):
    """The error `fail_on` raises unless told otherwise.

    Attributes:
        device_index: The index of the device it was raised on.
        step: The step it was raised at.
    """

    def __init__(self, message: str, *, device_index: int, step: int) -> None:
        super().__init__(message)
        self.device_index = device_index
        self.step = step

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt from its fields, with what else it holds (its notes) as a plain exception's.
        state = {k: v for k, v in vars(self).items() if k not in ("device_index", "step")}
        return (_injected, (str(self), self.device_index, self.step), state or None)


def _injected(message: str, device_index: int, step: int) -> InjectedFailure:
    return InjectedFailure(message, device_index=device_index, step=step)


class _Budget:
    """How many more times a fault fires (``None``: every time it matches); thread-safe, as
    several workers may meet it at once."""

    def __init__(self, times: int | None) -> None:
        self._left: int | None = check_int("times", times, 1, none=True)
        self._lock = threading.Lock()

    def take(self) -> bool:
        """Whether the fault fires now (and one fewer is left)."""
        if self._left is None:
            return True
        with self._lock:
            if self._left == 0:
                return False
            self._left -= 1
            return True


def _check_index(device: object, *, names: bool = False) -> int:
    """``device`` as an index (a NumPy integer too)."""
    if isinstance(device, (bool, np.bool_)) or not isinstance(device, numbers.Integral):
        what = "an index (1) or a name ('cpu#1')" if names else "an index (1)"
        raise TypeError(f"device must be {what}, got {device!r}")
    index = operator.index(device)
    if index < 0:
        raise ConfigurationError(f"device must be an index from 0, got {index}")
    return index


def _check_device(device: object) -> int | str:
    """``device`` as the trainer's helpers compare it: an index or a name."""
    return device if isinstance(device, str) else _check_index(device, names=True)


def _check_callable(name: str, value: object) -> None:
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {value!r}")


def _check_error(error: object) -> None:
    if error is None or isinstance(error, BaseException):
        return
    if isinstance(error, type) and issubclass(error, BaseException):
        return
    raise TypeError(
        f"error must be an exception to raise, such as ValueError('disk full'), or an "
        f"exception class, got {error!r}"
    )


def _check_release(release: object) -> None:
    wait = getattr(release, "wait", None)
    if not callable(wait) or inspect.iscoroutinefunction(wait):
        raise TypeError(
            "release must be a threading.Event: the job blocks its worker thread in "
            f"release.wait() until the test sets it; got {release!r}"
        )


def _check_hang(release: object, limit: object) -> float | None:
    """The checks of a hang's ``release`` and ``limit``; returns the limit as
    ``threading.Event.wait`` takes it (``None``: until released)."""
    _check_release(release)
    seconds: float | None = check_positive("limit", limit, unit="seconds")
    return None if seconds is None else min(seconds, threading.TIMEOUT_MAX)


def _raised(error: BaseException | type[BaseException]) -> BaseException:
    """What to raise for ``error``: a new instance of a class; an instance without the
    traceback of its last raise, which would grow with every one and keep each failed step's
    frames (and their tensors) alive."""
    if isinstance(error, type):
        return error()
    return error.with_traceback(None)


def fail_on(
    job: Callable[[WorkerContext, S], T],
    *,
    device: int,
    step: int | None = None,
    error: BaseException | type[BaseException] | None = None,
    times: int | None = None,
) -> Callable[[WorkerContext, S], T]:
    """Wrap ``job`` so that it raises on device ``device`` (an index), at ``step`` or always.

    Args:
        job: The job to wrap.
        device: The index of the device whose job fails.
        step: The step at which it fails; ``None`` fails at every step.
        error: What to raise: an exception (raised each time without the traceback of the
            last raise), or an exception class (a new one each time); by default an
            `InjectedFailure`.
        times: How many times it fails, then runs as usual; ``None``: every time.

    Raises:
        TypeError: ``job`` is not callable, ``device`` is not an index, or ``error`` is not
            an exception.
        ConfigurationError: ``device`` is below 0, ``step`` is not an int from 0, or ``times`` not
            one from 1.
    """
    _check_callable("job", job)
    device = _check_index(device)
    step = check_int("step", step, 0, none=True)
    _check_error(error)
    budget = _Budget(times)

    def failing(ctx: WorkerContext, shard: S) -> T:
        if ctx.device.index == device and (step is None or ctx.step == step) and budget.take():
            if error is not None:
                raise _raised(error)
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
    limit: float | None = 60.0,
    times: int | None = None,
) -> Callable[[WorkerContext, S], T]:
    """Wrap ``job`` so that it blocks on device ``device`` until ``release`` is set.

    The job blocks for ``limit`` seconds at most, so that a test that forgets to release it
    still ends (and its worker thread with it). After the release the job runs as usual.
    ``times``: how many times it blocks, then runs as usual (``None``: every time).

    Raises:
        TypeError: ``job`` is not callable, ``device`` is not an index, or ``release`` is
            not a ``threading.Event`` (an ``asyncio.Event``'s ``wait`` cannot block a thread).
        ConfigurationError: ``device`` is below 0, ``step`` is not an int from 0, ``limit`` is not
            above 0 (``None``: until released), or ``times`` not an int from 1.
    """
    _check_callable("job", job)
    device = _check_index(device)
    step = check_int("step", step, 0, none=True)
    seconds = _check_hang(release, limit)
    budget = _Budget(times)

    def hanging(ctx: WorkerContext, shard: S) -> T:
        if ctx.device.index == device and (step is None or ctx.step == step) and budget.take():
            release.wait(seconds)
        return job(ctx, shard)

    return hanging


def _here(device: int | str, step: int | None, *, training: bool = False) -> WorkerContext | None:
    """The running job's context if it is on ``device`` (index or name) at ``step``; with
    ``training``, a given ``step`` matches training only: a trainer's step function also runs
    in validation, whose jobs carry the number of the next optimizer step (``at=8`` fired in
    the validation after step 7, where a backward fault never fires and no retry applies)."""
    ctx = current_worker()
    if ctx is None:
        return None
    on_device = ctx.device.index == device if isinstance(device, int) else ctx.device.name == device
    at_step = step is None or (ctx.step == step and not (training and ctx.phase == "valid"))
    return ctx if on_device and at_step else None


def _injected_failure(ctx: WorkerContext, where: str) -> InjectedFailure:
    return InjectedFailure(
        f"injected failure in the {where} on {ctx.device.name} at step {ctx.step}",
        device_index=ctx.device.index,
        step=ctx.step,
    )


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, error: BaseException) -> torch.Tensor:
        ctx.error = error
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Let go of it first: the error's traceback holds the loss, whose graph holds this
        # context, a cycle through torch's autograd that the garbage collector cannot see
        # (the model and every replica were kept for good).
        error, ctx.error = ctx.error, None
        try:
            raise error
        finally:
            del error  # nor one through this frame (see failing_step)


def failing_step(
    step: Callable[[_Model, _Batch], _Output],
    *,
    device: int | str,
    at: int | None = None,
    where: Literal["forward", "backward", "metric"] = "forward",
    error: BaseException | type[BaseException] | None = None,
    times: int | None = None,
) -> Callable[[_Model, _Batch], _Output]:
    """Wrap a trainer's ``step(model, batch)`` so that it fails on one device.

    Args:
        step: The step to wrap.
        device: The device, by index (``1``) or name (``"cpu#1"``). An index is a position
            among the trainer's devices: after ``on_failure="drop"`` dropped one, another
            device's; a name stays with its device.
        at: The optimizer step at which it fails, in training (the step function also runs
            in validation, whose calls ``at`` does not match); ``None`` fails every call,
            validation's too.
        where: ``"forward"`` raises before returning; ``"backward"`` returns a loss whose
            backward pass raises; ``"metric"`` raises while computing a metric, after the loss.
        error: What to raise: an exception (raised each time without the traceback of the
            last raise), or an exception class (a new one each time); by default an
            `InjectedFailure`.
        times: How many times it fails, then runs as usual; ``None``: every time. A failed
            step is taken again under the same number (by ``on_failure="retry"``, or by the
            next ``fit``), so ``at=3`` alone fails that step every time it is tried;
            ``times=1`` lets the run go on after it.

    Raises:
        ConfigurationError: ``where`` is not one of the three, ``device`` is below 0, ``at``
            is not an int from 0, or ``times`` is not an int from 1.
        TypeError: ``step`` is not callable, ``device`` is neither an index nor a name, or
            ``error`` is not an exception.
    """
    if where not in ("forward", "backward", "metric"):
        raise ConfigurationError(f"where must be 'forward', 'backward' or 'metric', got {where!r}")
    _check_callable("step", step)
    device = _check_device(device)
    at = check_int("at", at, 0, none=True)
    _check_error(error)
    budget = _Budget(times)

    def failing(model: _Model, batch: _Batch) -> Any:
        ctx = _here(device, at, training=True)
        if ctx is None or not budget.take():
            return step(model, batch)
        failure = _raised(error) if error is not None else _injected_failure(ctx, where)
        try:
            if where == "forward":
                raise failure
            output = step(model, batch)
            if where == "backward":
                loss = output["loss"] if isinstance(output, dict) else output
                # Untyped up to torch 2.13; Any from 2.14 (a C function): both pass.
                loss = _FailInBackward.apply(loss, failure)  # type: ignore[no-untyped-call,unused-ignore]
                return {**output, "loss": loss} if isinstance(output, dict) else loss
            raise failure  # "metric": the loss was computed, a metric was not
        finally:
            # Raised, it holds this frame in its traceback: without it in the frame's locals,
            # no cycle keeps the frame (and the model, the batch) once the error is let go.
            del failure

    return failing


def hanging_step(
    step: Callable[[_Model, _Batch], _Output],
    *,
    device: int | str,
    release: threading.Event,
    at: int | None = None,
    limit: float | None = 60.0,
    times: int | None = None,
) -> Callable[[_Model, _Batch], _Output]:
    """Wrap a trainer's step so that it blocks on one device until ``release`` is set.

    It blocks for ``limit`` seconds at most, so that a test that forgets to release it ends.
    ``device``, ``at`` and ``times`` as for `failing_step`.

    Raises:
        TypeError: ``step`` is not callable, ``device`` is neither an index nor a name, or
            ``release`` is not a ``threading.Event``.
        ConfigurationError: ``device`` is below 0, ``at`` is not an int from 0, ``limit`` is not
            above 0 (``None``: until released), or ``times`` not an int from 1.
    """
    _check_callable("step", step)
    device = _check_device(device)
    at = check_int("at", at, 0, none=True)
    seconds = _check_hang(release, limit)
    budget = _Budget(times)

    def hanging(model: _Model, batch: _Batch) -> _Output:
        if _here(device, at, training=True) is not None and budget.take():
            release.wait(seconds)
        return step(model, batch)

    return hanging


def failing_optimizer(
    factory: Callable[[Any], torch.optim.Optimizer],
    *,
    device: int | str,
    at: int | None = None,
    after_update: bool = True,
    error: BaseException | type[BaseException] | None = None,
    times: int | None = None,
) -> Callable[[Any], torch.optim.Optimizer]:
    """Wrap an optimizer factory so that ``step()`` fails on one device, at one step.

    With ``after_update`` (the default) the optimizer first updates the parameters, then
    raises: the worst case, a half-done step that must be undone. ``times``: how many times it
    fails, then steps as usual (``None``: every time; see `failing_step`). The count is shared
    by every optimizer the factory makes.

    Raises:
        TypeError: ``factory`` is not callable (an optimizer already built, say), ``device``
            is neither an index nor a name, or ``error`` is not an exception.
        ConfigurationError: ``device`` is below 0, ``at`` is not an int from 0, ``times``
            is not an int from 1, or ``after_update`` is not True or False.
    """
    after_update = check_bool("after_update", after_update)
    if isinstance(factory, torch.optim.Optimizer):
        raise TypeError(
            f"factory must make an optimizer from parameters, such as functools.partial("
            f"torch.optim.SGD, lr=0.1); got an optimizer already built: {type(factory).__name__}"
        )
    _check_callable("factory", factory)
    device = _check_device(device)
    at = check_int("at", at, 0, none=True)
    _check_error(error)
    budget = _Budget(times)

    def make(params: Any) -> torch.optim.Optimizer:
        optimizer = factory(params)
        original = optimizer.step

        def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            ctx = _here(device, at)
            if ctx is None or not budget.take():
                return original(*args, **kwargs)
            if after_update:
                original(*args, **kwargs)
            raise _raised(error) if error is not None else _injected_failure(ctx, "optimizer step")

        # A bound method, as torch's LR schedulers wrap optimizer.step through its __func__.
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        return optimizer

    return make


def asyncddp_threads() -> list[threading.Thread]:
    """The threads asyncddp runs that are alive in this process: the workers, the data
    loader's and a collective's (``asyncddp-*``), for a leak check."""
    return [
        thread
        for thread in threading.enumerate()
        if thread.name.startswith("asyncddp-") and thread.is_alive()
    ]
