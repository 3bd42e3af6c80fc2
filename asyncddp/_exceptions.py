"""The exceptions asyncddp raises.

Every exception the library raises on purpose derives from `AsyncDDPError`. Bad input
also derives from `ValueError` or `TypeError`, so code that already catches those
keeps working. (A few calls Python itself would refuse raise its own ``TypeError``, as
asyncio's do: an object that should be callable, an exception or an event and is not, a
``with`` for an ``async with``, a ``for`` for an ``async for``; docs/failures.md lists them.)::

    AsyncDDPError
    ├── DeviceError (ValueError)            a device spec that cannot be used
    │   └── DeviceTypeError (TypeError)     a device spec of the wrong type
    ├── ShardError (ValueError)             shards that do not fit the devices
    ├── ConfigurationError (ValueError)     a Trainer or fit argument that cannot work
    ├── DataError (ValueError)              data with no batches, or a batch that cannot be split
    ├── StepOutputError (TypeError)         a step function that returns no scalar loss
    ├── CheckpointError                     a checkpoint that cannot be written, read or loaded
    ├── SchedulerClosedError (RuntimeError) a scheduler used outside ``async with``
    └── WorkerFailedError                   a device's job raised
        ├── WorkerTimeoutError              a device's job did not finish in time
        ├── JobQueuedError                  a shielded job queued behind one that hangs
        └── NonFiniteLossError              a device's loss was NaN or infinite

A `WorkerFailedError` keeps the original exception object as ``__cause__`` (type,
attributes and traceback intact) and stores only numbers, strings and `Device` values
itself, so holding on to it pins no tensor beyond what that traceback holds, and it pickles.
``KeyboardInterrupt`` and ``SystemExit`` raised inside a job are never wrapped: they reach the
caller as they are, so that ``except Exception`` cannot swallow a Ctrl-C.

Every warning the library gives derives from `AsyncDDPWarning` (a ``UserWarning``); those about
something that went wrong while running also from ``RuntimeWarning``::

    AsyncDDPWarning (UserWarning)
    └── AsyncDDPRuntimeWarning (RuntimeWarning)
        └── DeviceDroppedWarning                a failed device dropped (on_failure="drop")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._devices import Device

__all__ = [
    "AsyncDDPError",
    "AsyncDDPRuntimeWarning",
    "AsyncDDPWarning",
    "CheckpointError",
    "ConfigurationError",
    "DataError",
    "DeviceError",
    "DeviceTypeError",
    "NonFiniteLossError",
    "SchedulerClosedError",
    "ShardError",
    "StepOutputError",
    "WorkerFailedError",
    "WorkerTimeoutError",
]


class AsyncDDPError(Exception):
    """The root of every exception asyncddp raises on purpose."""


class AsyncDDPWarning(UserWarning):
    """The root of every warning asyncddp gives.

    Its warnings point at your own line (the ``await trainer.fit(...)`` that led to them), so a
    filter on ``module="asyncddp"`` matches none of them; filter on this category instead::

        warnings.filterwarnings("ignore", category=asyncddp.AsyncDDPWarning)
    """


class AsyncDDPRuntimeWarning(AsyncDDPWarning, RuntimeWarning):
    """A warning about something that went wrong while running (an epoch's loss that is not
    finite, a worker thread left behind, a device dropped); a ``RuntimeWarning`` too."""


class DeviceError(AsyncDDPError, ValueError):
    """A device spec names no device, a device twice, or a device that does not exist; or a
    trainer's devices mix GPUs and the CPU."""


class DeviceTypeError(DeviceError, TypeError):
    """A device spec is of a type asyncddp cannot read (for example a float)."""


class ShardError(AsyncDDPError, ValueError):
    """The shards given for a step do not match the devices (one shard per device)."""


class ConfigurationError(AsyncDDPError, ValueError):
    """An argument to `Trainer` or ``fit`` cannot work (for example ``epochs=0``)."""


class ConfigurationTypeError(ConfigurationError, TypeError):
    """An argument is of a type that cannot work (for example a step that is not callable,
    or ``epochs="3"``): caught by ``except TypeError`` as Python's own, and by ``except
    ConfigurationError`` as every other argument asyncddp refuses."""


class DataError(AsyncDDPError, ValueError):
    """Data yields no batch, or a batch cannot be split into shards.

    A batch is a tensor, or a tuple, list or dict of tensors, that share their size along
    dim 0 (the batch dimension).
    """


class StepOutputError(AsyncDDPError, TypeError):
    """A step function returned something other than a scalar loss tensor.

    A step returns the loss (a scalar tensor, the mean over the shard's items), or a mapping
    with a ``"loss"`` entry, optionally ``"items"`` (how many items the loss is the mean over,
    a whole number), and further metrics (scalars, means over the same items).
    """


class CheckpointError(AsyncDDPError):
    """A checkpoint file cannot be written (a full disk, a path under a file: the cause is
    its ``__cause__``, and a file there before is left whole), or is missing, truncated,
    corrupt, or not an asyncddp checkpoint; or a state (a checkpoint's or
    ``Trainer.state_dict()``'s) does not fit the trainer it is loaded into: another model's,
    another optimizer's parameter groups, another LR scheduler's. A state refused so is not
    taken in part: the trainer stays as it was."""


class SchedulerClosedError(AsyncDDPError, RuntimeError):
    """A `StepScheduler` was used before ``async with`` entered it or after it closed."""


def _restore(cls: type[WorkerFailedError], fields: dict[str, Any]) -> WorkerFailedError:
    return cls(**fields)


class WorkerFailedError(AsyncDDPError):
    """The job of one device raised; the step's first failure in time.

    The message reads ``training worker on device cpu#1 failed: ValueError: ...`` (across
    processes: ``distributed data parallel worker on rank 3 (device cuda:1) failed: ...``), and
    the exception the job raised is this error's ``__cause__``.

    Attributes:
        device: The device whose job failed.
        rank: The process rank under ``torch.distributed``; ``None`` within one process.
        step: The step the job belonged to (counted from 0), when known.
        epoch: The epoch, when the step was part of a fit.
        phase: What the step was doing, for example ``"train"`` or ``"valid"``.
        error_type: The qualified name of the original exception's type; ``""`` where there
            is none (a `WorkerTimeoutError`, a `NonFiniteLossError`).
        error_message: ``str()`` of the original exception, or what happened where there is
            none (``"did not finish within step_timeout=5 s"``).
        other_failures: Failures of other devices in the same step, in the order they happened.
            Each is a `WorkerFailedError` with its own ``__cause__``.
    """

    def __init__(
        self,
        *,
        device: Device,
        error_type: str,
        error_message: str,
        rank: int | None = None,
        step: int | None = None,
        epoch: int | None = None,
        phase: str | None = None,
        other_failures: Sequence[WorkerFailedError] = (),
    ) -> None:
        self.device = device
        self.error_type = error_type
        self.error_message = error_message
        self.rank = rank
        self.step = step
        self.epoch = epoch
        self.phase = phase
        self.other_failures: tuple[WorkerFailedError, ...] = tuple(other_failures)
        super().__init__(str(self))

    @classmethod
    def from_exception(
        cls,
        exc: BaseException,
        *,
        device: Device,
        rank: int | None = None,
        step: int | None = None,
        epoch: int | None = None,
        phase: str | None = None,
    ) -> WorkerFailedError:
        """Wrap ``exc``, raised by the job on ``device``, keeping it as ``__cause__``."""
        error = cls(
            device=device,
            error_type=_qualified_name(type(exc)),
            error_message=_message(exc),
            rank=rank,
            step=step,
            epoch=epoch,
            phase=phase,
        )
        error.__cause__ = exc
        return error

    def _fields(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "error_type": self.error_type,
            "error_message": self.error_message,
            "rank": self.rank,
            "step": self.step,
            "epoch": self.epoch,
            "phase": self.phase,
            "other_failures": self.other_failures,
        }

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle through ``args`` by default, which would drop every field. The cause
        # is not pickled (it may hold tensors or unpicklable state); its type and message are.
        # What else the instance holds goes as a plain exception's would: its notes, and
        # attributes a user's handler attached.
        fields = self._fields()
        state = {key: value for key, value in vars(self).items() if key not in fields}
        if "__notes__" in state:
            state["__notes__"] = list(state["__notes__"])
        return (_restore, (type(self), fields), state or None)

    def __str__(self) -> str:
        if self.rank is None:
            who = f"training worker on device {self.device.name}"
        else:
            who = (
                f"distributed data parallel worker on rank {self.rank} (device {self.device.name})"
            )
        parts = [part for part in (self.error_type, self.error_message) if part]
        what = ": ".join(parts)
        context = [f"{key} {value}" for key, value in self._context() if value is not None]
        if self.other_failures:
            names = ", ".join(
                f"rank {failure.rank} {failure.device.name}"
                if failure.rank is not None
                else failure.device.name
                for failure in self.other_failures
            )
            context.append(f"also failed: {names}")
        suffix = f" ({'; '.join(context)})" if context else ""
        return f"{who} failed: {what}{suffix}"

    def _context(self) -> list[tuple[str, object]]:
        return [("epoch", self.epoch), ("step", self.step), ("phase", self.phase)]

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(device={self.device.name!r}, rank={self.rank!r}, "
            f"step={self.step!r}, epoch={self.epoch!r}, phase={self.phase!r}, "
            f"error_type={self.error_type!r})"
        )


class WorkerTimeoutError(WorkerFailedError):
    """A device's job did not finish within ``step_timeout`` seconds.

    The job cannot be interrupted (Python threads cannot be killed): it keeps its worker busy
    until it returns, and that device's later jobs queue behind it. ``__cause__`` is ``None``.

    Attributes:
        timeout: The ``step_timeout`` that ran out, in seconds.
    """

    def __init__(self, *, timeout: float, **fields: Any) -> None:
        self.timeout = timeout
        fields.setdefault("error_type", "")
        fields.setdefault("error_message", f"did not finish within step_timeout={timeout:g} s")
        super().__init__(**fields)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "timeout": self.timeout}


class NonFiniteLossError(WorkerFailedError):
    """A device's loss was NaN or infinite, with ``Trainer(check_finite=True)``.

    Raised before that device's backward pass (on a lone GPU, once the backward is queued:
    see the docs' concepts, "Workers"), and always before the optimizer step: the step changed
    no parameter on any replica. ``__cause__`` is ``None``, on every rank.

    Attributes:
        loss: The loss value the device computed.
    """

    def __init__(self, *, loss: float, **fields: Any) -> None:
        self.loss = loss
        fields.setdefault("error_type", "")
        fields.setdefault("error_message", f"the loss is {loss} (check_finite=True)")
        super().__init__(**fields)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "loss": self.loss}


class _NonFiniteLoss(Exception):
    """Raised in a worker for a NaN or infinite loss; the trainer makes it a
    `NonFiniteLossError` (and so do the other ranks, which get it pickled)."""

    def __init__(self, loss: float) -> None:
        super().__init__(f"the loss is {loss}")
        self.loss = loss

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt from its loss, not its message ("the loss is the loss is nan").
        return (type(self), (self.loss,))


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a user's __str__ that raises must not hide the failure itself
        return f"<unprintable {type(exc).__name__} object>"


def _qualified_name(cls: type[BaseException]) -> str:
    module = cls.__module__
    if module in {"builtins", "__main__"}:
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"
