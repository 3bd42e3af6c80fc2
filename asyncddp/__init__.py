"""asyncddp: an asyncio-native, multi-device step scheduler for PyTorch.

Layers, bottom up (each module uses only those above it in this list):

- ``_exceptions``: the exception tree, rooted at ``AsyncDDPError``.
- ``_devices``: ``Device``, ``resolve_devices``, ``cpu_devices``.
- ``_progress``: ``Progress`` and its pure aggregator.
- ``_data``: counting the items in a shard.
- ``_loop``: waking an asyncio or trio task from a worker thread.
- ``_worker``: ``DeviceWorker``, one persistent thread per device.
- ``_scheduler``: ``StepScheduler``, fan out one job per device, gather in device order.
- ``_loader``: iterating the user's data on a thread, ahead of training.
- ``_sync``: flat gradient buckets, the in-process all-reduce, step backups.
- ``_precision``: autocast dtypes and fp16 loss scaling.
- ``_replica``: one device's replica and the jobs its worker runs.
- ``_events``: typed events and bounded event streams.
- ``_checkpoint``: atomic checkpoints and RNG state.
- ``distributed``: joining a ``torch.distributed`` process group (public, ``asyncddp.distributed``).
- ``_comm``: what the ranks of a process group exchange, and how a failed rank is heard of.
- ``_ranks``: each rank's part of the data.
- ``_trainer``: ``Trainer``: fit, validate, stop, events, checkpoints.
- ``testing``: helpers for users' own tests (public, imported as ``asyncddp.testing``).
"""

from __future__ import annotations

from ._devices import Device as Device
from ._devices import DeviceSpec as DeviceSpec
from ._devices import cpu_devices as cpu_devices
from ._devices import resolve_devices as resolve_devices
from ._events import CheckpointSaved as CheckpointSaved
from ._events import DeviceDropped as DeviceDropped
from ._events import EpochEnded as EpochEnded
from ._events import Event as Event
from ._events import EventStream as EventStream
from ._events import FitEnded as FitEnded
from ._events import FitStarted as FitStarted
from ._events import StepEnded as StepEnded
from ._events import StepRetried as StepRetried
from ._events import ValidationEnded as ValidationEnded
from ._events import WorkerFailed as WorkerFailed
from ._exceptions import AsyncDDPError as AsyncDDPError
from ._exceptions import AsyncDDPRuntimeWarning as AsyncDDPRuntimeWarning
from ._exceptions import AsyncDDPWarning as AsyncDDPWarning
from ._exceptions import CheckpointError as CheckpointError
from ._exceptions import ConfigurationError as ConfigurationError
from ._exceptions import ConfigurationTypeError as ConfigurationTypeError
from ._exceptions import DataError as DataError
from ._exceptions import DeviceError as DeviceError
from ._exceptions import DeviceTypeError as DeviceTypeError
from ._exceptions import NonFiniteLossError as NonFiniteLossError
from ._exceptions import SchedulerClosedError as SchedulerClosedError
from ._exceptions import ShardError as ShardError
from ._exceptions import StepOutputError as StepOutputError
from ._exceptions import WorkerFailedError as WorkerFailedError
from ._exceptions import WorkerTimeoutError as WorkerTimeoutError
from ._precision import Precision as Precision
from ._progress import Progress as Progress
from ._progress import ProgressTracker as ProgressTracker
from ._replica import OptimizerFactory as OptimizerFactory
from ._replica import SchedulerFactory as SchedulerFactory
from ._replica import StepFunction as StepFunction
from ._scheduler import JobQueuedError as JobQueuedError
from ._scheduler import StepResult as StepResult
from ._scheduler import StepScheduler as StepScheduler
from ._trainer import DeviceDroppedWarning as DeviceDroppedWarning
from ._trainer import EpochRecord as EpochRecord
from ._trainer import FitResult as FitResult
from ._trainer import Trainer as Trainer
from ._worker import WorkerContext as WorkerContext
from ._worker import current_worker as current_worker

__version__ = "0.1.0.dev0"

__all__ = [
    "AsyncDDPError",
    "AsyncDDPRuntimeWarning",
    "AsyncDDPWarning",
    "CheckpointError",
    "CheckpointSaved",
    "ConfigurationError",
    "ConfigurationTypeError",
    "DataError",
    "Device",
    "DeviceDropped",
    "DeviceDroppedWarning",
    "DeviceError",
    "DeviceSpec",
    "DeviceTypeError",
    "EpochEnded",
    "EpochRecord",
    "Event",
    "EventStream",
    "FitEnded",
    "FitResult",
    "FitStarted",
    "JobQueuedError",
    "NonFiniteLossError",
    "OptimizerFactory",
    "Precision",
    "Progress",
    "ProgressTracker",
    "SchedulerClosedError",
    "SchedulerFactory",
    "ShardError",
    "StepEnded",
    "StepFunction",
    "StepOutputError",
    "StepResult",
    "StepRetried",
    "StepScheduler",
    "Trainer",
    "ValidationEnded",
    "WorkerContext",
    "WorkerFailed",
    "WorkerFailedError",
    "WorkerTimeoutError",
    "__version__",
    "cpu_devices",
    "current_worker",
    "resolve_devices",
]

# Tracebacks and reprs print ``asyncddp.WorkerFailedError``, not the private module it lives in.
for _name in __all__:
    _value = globals()[_name]
    if isinstance(_value, type) and _value.__module__.startswith("asyncddp._"):
        _value.__module__ = __name__
del _name, _value
