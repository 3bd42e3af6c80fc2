"""Trainer: data-parallel training that an async program awaits.

How one optimizer step runs (``accumulate_grad_batches`` batches, one by default)::

    event loop thread                                   worker threads, one per device
    next batch from the loader thread (never blocks; a list's, read in place)
    split along dim 0, one shard per device
    run(train)   ─────────────────────────────────────► forward, backward(loss * weight)
                                                        grads accumulate in flat buckets
                                                        (one device alone: in .grad, as a
                                                        plain loop; nothing to reduce)
    run(reduce)  ─────────────────────────────────────► all-reduce: each device sums its chunk
      global norm for clipping, finite check for fp16   of every replica's buckets into every
                                                        replica's
    run(apply)   ─────────────────────────────────────► clip, optimizer step
    StepEnded event, progress bar, stop() check

The loss weight makes the mean exact over items: device ``i`` with ``n_i`` of a step's ``N``
items backpropagates ``loss_i * n_i / N``, so uneven shards, empty shards and a short last
batch give the gradient one device would get from the whole batch.

The trainer is assembled from mixins that share its state: ``_steps`` (one optimizer step
across the devices, and the failure policy), ``_epochs`` (epochs and validation), ``_resume``
(position, checkpoints, resuming). This module holds the public API and the sessions.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import itertools
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, Never, cast

import anyio
import torch
from torch import nn
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from . import _checkpoint, _comm, _devices, distributed
from ._checks import (
    MAX_THREADS,
    check_bool,
    check_int,
    check_path,
    check_positive,
    check_seconds,
    first_names,
    warn_user,
)
from ._data import empty_up_front, no_batches
from ._devices import CPU_HINT, Device, DeviceSpec, resolve_devices
from ._dsteps import for_other_trainers_call
from ._epochs import EpochRecord, check_monitor, check_monitor_fits
from ._events import (
    EventHub,
    EventStream,
    FitEnded,
    FitStarted,
)
from ._exceptions import (
    AsyncDDPError,
    AsyncDDPWarning,
    ConfigurationError,
    ConfigurationTypeError,
    DataError,
    DeviceError,
    WorkerFailedError,
)
from ._jobs import Jobs, Sums, load_into, to_cpu
from ._loader import Prefetcher
from ._loop import current_waker, loop_ended, running_loop
from ._precision import LossScaler, Precision, autocast_dtype
from ._ranks import rank_items_total_off_loop
from ._replica import (
    M,
    OptimizerFactory,
    Replica,
    SchedulerFactory,
    StepFunction,
    attribute_snapshot,
    build_replica,
    carry_parameter_extras,
    group_layout,
    has_sparse_gradients,
    move_to,
    settle_snapshots,
)
from ._resume import Resumable
from ._scheduler import JobQueuedError, StepScheduler
from ._steps import DeviceDroppedWarning
from ._worker import CallerState, current_worker

__all__ = ["DeviceDroppedWarning", "EpochRecord", "FitResult", "Trainer"]

_log = logging.getLogger("asyncddp")

# Each module given to a Trainer, and the last trainer to start a call (fit, validate,
# save_checkpoint) on it: while that call runs, or a thread it left behind does, it is in use.
_LAST_CALLER: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Trainer]] = (
    weakref.WeakKeyDictionary()
)


def _as_path(value: object) -> object:
    """A path (a ``str`` too) as a ``Path`` with ``~`` expanded; anything else as given, for
    `Trainer._check_options` to refuse as the trainer is built or the next call starts, as
    other options assigned between calls."""
    if isinstance(value, (str, os.PathLike)):
        return Path(value).expanduser()
    return value


@dataclass(frozen=True)
class FitResult:
    """What ``fit`` did.

    Attributes:
        history: The epochs this call completed, in order.
        epoch: Epochs completed so far in all (the next epoch's number).
        global_step: Optimizer steps taken so far in all.
        stopped: Whether ``stop()`` ended the fit early.
        stop_reason: The reason given to ``stop()``.
        items_per_second: The items this call trained on, over the whole call's time
            (validation, checkpoints and the call's start included), whether or not it
            completed an epoch: of an epoch begun by an earlier call, this call's part.
    """

    history: tuple[EpochRecord, ...]
    epoch: int
    global_step: int
    stopped: bool = False
    stop_reason: str | None = None
    items_per_second: float = field(default=0.0)


class Trainer(Resumable, Generic[M]):
    """Data-parallel training on several devices, awaited from async code.

    The model is replicated onto every device; each step splits the batch across them, runs
    ``step(model, shard)`` on every device's worker thread, averages the gradients (weighted by
    items) and takes the same optimizer step on every replica::

        trainer = asyncddp.Trainer(
            model,
            functools.partial(torch.optim.SGD, lr=0.1),
            lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
            devices=asyncddp.cpu_devices(2),
        )
        result = await trainer.fit(train_loader, epochs=5, valid_data=valid_loader)

    Args:
        model: The module to train. The first call that needs the devices (``fit``,
            ``validate``, ``save_checkpoint``) moves it to the first device in place, as
            ``model.to(device)`` does, and trains it there; the other devices train copies.
            So ``model`` is ``trainer.model``, the trained model, on a GPU as on the CPU
            (until ``on_failure="drop"`` drops the first device).
        optimizer: A factory ``params -> Optimizer``, called once per replica, for example
            ``functools.partial(torch.optim.AdamW, lr=1e-3)``.
        step: ``step(model, batch) -> loss``, the loss a scalar tensor, the mean over the
            batch's items; or a dict with ``"loss"`` and further metrics (scalar means; one
            returned on some shards only is averaged over theirs), and
            optionally ``"items"``: how many items the loss is the mean over when they are not
            the batch's entries (valid tokens, say); the devices are then weighted by it.
        devices: Anything `resolve_devices` accepts; ``"auto"`` is every GPU, or the CPU.
            All of one kind: GPUs and the CPU mixed are a `DeviceError`.
        valid_step: The step for validation, run under ``torch.no_grad()``; by default ``step``.
        lr_scheduler: A factory ``optimizer -> LRScheduler``, called once per replica.
        lr_scheduler_interval: Step the LR scheduler every ``"epoch"`` or every ``"step"``.
        lr_scheduler_monitor: The metric a ``ReduceLROnPlateau`` steps on at each epoch's
            end: ``"valid_loss"`` (with ``valid_data``), ``"train_loss"``, or
            ``"valid_<name>"`` / ``"train_<name>"`` for a metric the step returns. The
            epoch's exact mean over every item, the same on every device and rank. ``None``
            (the default) for a scheduler that steps on its own.
        accumulate_grad_batches: Batches per optimizer step (gradient accumulation).
        gradient_clip_val: Clip the gradients to this global L2 norm (over the averaged
            gradients, as DDP would), or ``None``.
        precision: ``"32"``, ``"bf16"`` (bf16 autocast) or ``"fp16"`` (fp16 autocast with
            dynamic loss scaling); also Lightning's ``"32-true"``, ``"bf16-mixed"``,
            ``"16-mixed"``, ``"16"``, ``16`` and ``32``.
        split_batches: ``True`` splits every batch along dim 0 across the devices; ``False``
            gives each device whole batches of its own (``len(devices)`` batches per step).
        step_timeout: Seconds a device may take for one job; see `StepScheduler`. The
            set-up of a fit (building the replicas, copying the model or a loaded state into
            them) is not timed. Across processes, waiting for the other ranks in an exchange
            does not count. On one CPU device with ``atomic_steps``, a step's time includes
            the backup copied ahead of it.
        on_failure: What a failed training step does: ``"raise"`` (default), ``"retry"`` it up
            to ``max_retries`` times, or ``"drop"`` the failed devices and go on with the rest.
            A failure in validation, and a non-finite loss with ``check_finite``, raise.
        max_retries: Retries per step with ``on_failure="retry"``.
        atomic_steps: Copy parameters and optimizer state before each optimizer step, so that
            a step that fails on any device is undone on every device. Costs one copy of both per
            device (one between the CPU workers of a process, each copying its part of it); two
            for one CPU device in one process (there the next step's copy is made
            ahead, while the event loop handles a step's results, so the step does not wait for
            it). Across processes with one CPU device each, the copy is made while the rank
            waits for the others' gradients (not with a ``step_timeout`` or loss scaling,
            whose exchange runs apart). Turn off to save memory (a failure in the
            optimizer step, or a job that takes its optimizer step after its
            ``step_timeout``, then leaves the replicas unusable until ``load_state_dict``).
        checkpoint_dir: Where ``fit`` writes a checkpoint after every epoch; ``None`` for none.
        progress_bar: Show a progress bar (tqdm's, which also renders in notebooks); by default
            when stderr (where the bar goes) is a terminal, or in a notebook.
        pin_memory: Page-lock batches on the loader thread before they go to a GPU; by default
            when a device is a GPU. ``True`` with no GPU among the devices warns and does
            nothing.
        prefetch: Batches loaded ahead of training, on the loader thread (a list of batches
            with nothing to page-lock, read in place, needs none). 0 reads none ahead: the
            next batch is read once the step before has ended, for a loader that fills one
            buffer again for every batch, or data whose next batch depends on the last step
            (with ``split_batches=True``: otherwise a step reads a batch for each device).
        threads_per_worker: Intra-op threads for each CPU worker; by default the process's
            ``torch.get_num_threads()`` shared out among the CPU workers.
        check_finite: Raise `NonFiniteLossError`, naming the device and step, when a
            device's loss is NaN or infinite, before the optimizer step. On the CPU this costs
            nothing. On a lone GPU the loss, read behind the forward, is checked once the
            backward is queued; on several GPUs it is read before the backward's kernels are
            launched, and the GPU waits for those launches (measured on an H200: see
            docs/benchmarks.md, GPU). An ``"items"`` count given as a GPU tensor is read
            before the backward too.

    Attributes:
        devices: The devices it trains on, as `resolve_devices` read them.
        epoch: Epochs completed, over every ``fit`` (and resumed from a checkpoint).
        global_step: Optimizer steps taken, over every ``fit``.
        history: An `EpochRecord` per completed epoch, over every ``fit``.
    """

    _checkpoint_dir: object  # as assigned; a Path or None once checked (see checkpoint_dir)

    def __init__(
        self,
        model: M,
        optimizer: OptimizerFactory,
        step: StepFunction[M],
        devices: DeviceSpec = "auto",
        *,
        valid_step: StepFunction[M] | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        lr_scheduler_interval: Literal["epoch", "step"] = "epoch",
        lr_scheduler_monitor: str | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        precision: Precision = "32",
        split_batches: bool = True,
        step_timeout: float | None = None,
        on_failure: Literal["raise", "retry", "drop"] = "raise",
        max_retries: int = 2,
        atomic_steps: bool = True,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        progress_bar: bool | None = None,
        pin_memory: bool | None = None,
        prefetch: int = 2,
        threads_per_worker: int | None = None,
        check_finite: bool = False,
    ) -> None:
        given: object = model  # as the types do not promise
        if isinstance(given, type) and issubclass(given, nn.Module):
            raise ConfigurationTypeError(
                f"model must be a torch.nn.Module, got the class {given.__name__}: pass an "
                f"instance, {given.__name__}(...)"
            )
        if not isinstance(given, nn.Module):
            raise ConfigurationTypeError(
                f"model must be a torch.nn.Module, got {type(given).__name__}"
            )
        _check_unwrapped(model)
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigurationError(
                f"{type(model).__name__} has no trainable parameters (none requires grad)"
            )
        if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
            raise ConfigurationTypeError(
                "optimizer must be a factory that makes one optimizer per replica, for example "
                "functools.partial(torch.optim.SGD, lr=0.1), not "
                + (
                    "an optimizer instance"
                    if isinstance(optimizer, torch.optim.Optimizer)
                    else f"{type(optimizer).__name__} {optimizer!r}"
                )
            )
        if not callable(step):
            raise ConfigurationTypeError(
                f"step must be a function step(model, batch) -> loss, got {_shown(step)}"
            )
        if valid_step is not None and not callable(valid_step):
            raise ConfigurationTypeError(
                f"valid_step must be a function valid_step(model, batch), got {_shown(valid_step)}"
            )
        for name, function in (("step", step), ("valid_step", valid_step)):
            if function is None:
                continue
            if inspect.iscoroutinefunction(function):
                raise ConfigurationTypeError(
                    f"{name} is an async function; it runs on each device's worker thread, "
                    "outside the event loop, so it must be a plain def (what you await is "
                    "fit())"
                )
            if _makes_optimizers(function):
                raise ConfigurationTypeError(
                    f"{name} is {_shown(function)}, an optimizer factory; the arguments go "
                    "Trainer(model, optimizer, step), the step a function step(model, batch) "
                    "-> loss"
                )
            _check_takes_model_and_batch(name, function)
        if lr_scheduler is not None and (
            isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler)
            or not callable(lr_scheduler)
        ):
            raise ConfigurationTypeError(
                "lr_scheduler must be a factory that makes one LR scheduler per replica from its "
                "optimizer, for example functools.partial(torch.optim.lr_scheduler.StepLR, "
                f"step_size=10), not {_shown(lr_scheduler)}"
            )
        pin_memory = check_bool("pin_memory", pin_memory, none=True)
        self.devices: tuple[Device, ...] = resolve_devices(_rank_devices(devices))
        kinds = sorted({device.type for device in self.devices})
        if len(kinds) > 1:
            # The CPU's and CUDA's optimizer kernels round differently: replicas on both would
            # not stay identical (AdamW, measured on an H200: 3e-8 apart after 80 steps).
            raise DeviceError(
                f"a trainer's devices must be of one kind, but {', '.join(map(str, self.devices))} "
                f"mix {' and '.join(kinds)}: replicas on both would drift apart. Train on the "
                f"GPUs alone, or on the CPU ({CPU_HINT})"
            )
        self._autocast = autocast_dtype(precision)
        self._scaler = LossScaler() if self._autocast is torch.float16 else None
        self._precision = str(precision)  # Lightning's numbers as their names, 16 as "16"
        self._source = model
        self._sparse_grads = has_sparse_gradients(model)
        self._optimizer_factory = optimizer
        self._scheduler_factory = lr_scheduler
        # The jobs call them with replicas of the model, of its class M.
        self._step_fn = cast(StepFunction, step)
        self._valid_step_fn = cast(StepFunction, valid_step or step)
        self.lr_scheduler_interval = lr_scheduler_interval
        self.lr_scheduler_monitor = lr_scheduler_monitor
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.split_batches = split_batches
        self.step_timeout = step_timeout
        self.on_failure = on_failure
        self.max_retries = max_retries
        self.atomic_steps = atomic_steps
        # Set past the property: a subclass's class attribute of that name would hide it.
        self._checkpoint_dir = _as_path(checkpoint_dir)
        self.progress_bar = progress_bar
        on_gpus = any(d.is_cuda for d in self.devices)
        if pin_memory and not on_gpus:
            # As DataLoader(pin_memory=True) where there is no GPU: a warning, not an error
            # (page-locking needs a GPU's driver, and a batch for a CPU device gains nothing).
            warnings.warn(
                "pin_memory=True does nothing when no device is a GPU "
                f"({', '.join(d.name for d in self.devices)}): batches are not page-locked",
                AsyncDDPWarning,
                stacklevel=2,
            )
            pin_memory = False
        self.pin_memory = on_gpus if pin_memory is None else pin_memory
        self.prefetch = prefetch
        self.threads_per_worker = threads_per_worker
        self.check_finite = check_finite
        self._check_options()
        #: Epochs completed so far; the next epoch's number.
        self.epoch = 0
        #: Optimizer steps taken so far.
        self.global_step = 0
        #: Every epoch completed, across fits.
        self.history: list[EpochRecord] = []
        # Where training is inside the current epoch; saved in checkpoints.
        self._batches_done = 0  # batches of the epoch already trained on
        self._batches_loaded: int | None = None  # by the epoch's loader (see Prefetcher)
        self._loading: Prefetcher | None = None  # while an epoch trains (see stop())
        self._left_loading: Prefetcher | None = None  # closed inside next() (see _epochs)
        self._epoch_rng: dict[str, Any] | None = None  # the RNG state the epoch started with
        # Whether another trainer of this process was training as this epoch drew its order
        # (the replay of a continued epoch may then draw another: `_train_epoch`).
        self._epoch_shared = False
        # The states of the loader's own generators when the last epoch ended (saved in
        # checkpoints), and those a checkpoint loaded, put into the loader the next epoch starts.
        self._loader_rng: dict[str, Any] | None = None
        self._resumed_loader_rng: dict[str, Any] | None = None
        self._epoch_sums = Sums()  # loss and metric sums of the epoch so far
        self._epoch_steps = 0  # and its optimizer steps
        self._items_ref: float | None = None  # see _reference_count
        self._epoch_items: dict[str, int] = {}  # items of the epoch so far, by device
        self._epoch_seconds = 0.0
        self._epoch_trained = False  # all batches done; validation and the epoch's end pending
        self._valid_rng: dict[str, Any] | None = None  # what the epoch's validation started from
        self._checkpoint_owed = False  # the epoch closed, its checkpoint not written yet
        self._items_trained = 0  # by every step taken, in all calls (items_per_second)
        self._replicas_compared = False
        self._replicas: list[Replica] = []
        self._pending_state: dict[str, Any] | None = None
        # Worker threads an earlier call left behind in a job (see _session).
        self._stragglers: list[threading.Thread] = []
        # The iterator an unfinished epoch was read from, if any (_check_continued).
        self._last_iterator: Callable[[], Any] | None = None
        self._scheduler: StepScheduler | None = None
        self._hub = EventHub()
        self._stop_reason: str | None = None
        self._attributes_carried = False  # this call carried module attributes over
        self._frozen_versions: list[tuple[str, torch.Tensor, int]] = []
        self._warned_frozen = False  # the step writes frozen parameters: told once
        self._warned_thawed = False  # the step thaws parameters no optimizer holds: told once
        self._grad_known: set[int] = set()  # may require grad without a word (this call)
        self._session_kind: str | None = None  # "fit", "validate" or "checkpoint" while open
        self._session_done: anyio.Event | None = None
        self._window_open = False  # a step has begun on the devices and not ended
        self._consistent = True
        self._apply_id = 0
        self._window = 0
        self._step_lock: anyio.Lock | None = None
        self._window_locked = False
        # Across processes (asyncddp.distributed): the process group, once joined.
        self._comm: _comm.Comm | None = None
        self._last_global: _comm.Global | None = None  # the last exchange's sums
        self._stop_agreed = False  # every rank knows of a stop() (only then do they stop)
        self._data_seed: int | None = None  # how the ranks shuffle alike
        self._warned_alone = False  # see DistributedSteps._join
        self._running_call: str | None = None  # see _begin_call
        # The thread whose event loop runs the call or the session (see _refuse_other_loop).
        self._loop_thread: int | None = None
        self._call_loop: object | None = None  # the loop that runs the call (running_loop)
        self._queued_undos: list[JobQueuedError] = []  # see _check_queued_undos
        self._from_rank_0 = False  # across ranks: whether rank 0's model was taken yet
        self._cancelled_in_step: BaseException | None = None  # raised once the step is counted
        self._batches_world = 1  # how many processes counted _batches_done (each its own)

    def __repr__(self) -> str:
        names = ", ".join(device.name for device in self.devices)
        return (
            f"<Trainer {type(self._source).__name__} on {names}: epoch {self.epoch}, "
            f"step {self.global_step}{', running' if self._session_kind else ''}>"
        )

    # -- public API -------------------------------------------------------------------------

    @property
    def model(self) -> M:
        """The trained model: the module passed in, on the first device once a call moved it
        there (the other devices train copies of it).

        Between calls it is yours to change as a plain loop's model (load weights into it,
        freeze a layer, ``eval()``): each ``fit`` and ``validate`` copies it to the other
        devices as it starts. Its set of parameters, modules and buffers stays as the first
        call built the replicas (see docs/training.md).
        """
        return cast(M, self._replicas[0].model if self._replicas else self._source)

    def events(self, maxlen: int = 1000) -> EventStream:
        """A stream of this trainer's events: ``async for event in trainer.events()``.

        The stream ends after the ``FitEnded`` event of the fit in progress (or of the next
        one). It buffers up to ``maxlen`` events; a consumer that falls further behind loses
        the oldest ones (counted in ``stream.dropped``), so it never slows training down. The
        trainer holds its streams weakly: one its consumer let go of (a loop left with
        ``break``) is not kept; ``async with trainer.events() as stream:`` closes it on exit.
        """
        return self._hub.subscribe(check_int("maxlen", maxlen, 1))

    def _stopping(self) -> bool:
        return self._should_stop()

    def _source_model(self) -> nn.Module:
        return self._source

    def stop(self, reason: str = "stop() was called") -> None:
        """End the running ``fit`` at the next optimizer step boundary; it returns normally.

        It does not wait for the data: a fit waiting for the loader between two steps returns
        at once, and one that cannot tell, without reading on, whether the epoch's data is used
        up leaves the epoch open for the next fit to close (see docs/cancellation.md). The one
        wait: at an epoch's last batch, of data whose batch count is known (a list; a
        ``DataLoader`` with torch's own samplers), for the loader's call that ends the epoch,
        where a ``RandomSampler`` draws from its generator.

        Safe to call from any task on the event loop, or from an event consumer: called from
        the consumer of a ``StepEnded``, ``EpochEnded`` or ``ValidationEnded`` before its first
        ``await``, it takes effect before any further step (across processes, after the next
        step, in whose exchange the ranks agree on it). It is for the
        fit running now: a ``fit`` clears any earlier stop when it starts, so a stop called
        before a fit's task has begun to run (just after ``asyncio.create_task(fit(...))``,
        say) is lost; stop it once it runs (after its ``FitStarted`` event, for example).

        Raises:
            TypeError: ``reason`` is not a string (it becomes ``FitResult.stop_reason``).
        """
        if not isinstance(reason, str):
            raise TypeError(
                f"reason must be a string, the FitResult's stop_reason, got {type(reason).__name__}"
                f" {reason!r}"
            )
        self._stop_reason = reason
        if self._loading is not None:
            self._loading.wake()  # a fit waiting for the loader between steps stops now

    async def fit(
        self,
        train_data: Iterable[Any],
        *,
        epochs: int = 1,
        valid_data: Iterable[Any] | None = None,
        resume: str | os.PathLike[str] | None = None,
    ) -> FitResult:
        """Train until ``epochs`` epochs are complete in all.

        ``epochs`` counts from the start of training, as Lightning's ``max_epochs``: calling
        ``fit`` again continues where the last call stopped (in the middle of an epoch, after
        the batches already trained on) and trains until ``epochs`` are complete.

        Threads: batches are loaded on a loader thread (a list or tuple of batches, which
        holds them already, is read in place when nothing is to be page-locked for a GPU),
        computed on the devices' worker threads; the event loop only dispatches and awaits,
        and stays free throughout.

        Args:
            train_data: Any iterable of batches (a ``DataLoader``, a list of tensors, ...),
                not a map-style ``Dataset`` (its items are samples). Iterated once per epoch.
            epochs: Epochs to have completed when ``fit`` returns.
            valid_data: Batches to validate on after every epoch.
            resume: A checkpoint to continue from, or ``"latest"`` for the newest one in
                ``checkpoint_dir`` by the counts in its name (those ``fit`` and
                ``save_checkpoint()`` write there; none yet: a warning, and nothing is
                resumed).

        Returns:
            The epochs completed by this call, and whether ``stop()`` ended it.

        Raises:
            WorkerFailedError: a device failed (after any retries); no replica's parameters
                were changed by the failed step.
            StepOutputError: the step returned no scalar loss, or, on several CPU devices,
                a backward wrote into another device's copy of the model.
            AsyncDDPError: on several CPU devices, the copies' parameters differ after the
                fit's first step or at an epoch's end (a forward writing a parameter in
                place, by each device's share); or a failed step's optimizer step could not
                be undone (``atomic_steps=False``).
            DataError: the data yields no batch, or a batch cannot be split, or it is an
                iterator (a generator, say), which can be read once, and more than one epoch
                is to run, or a map-style ``Dataset`` (pass a ``DataLoader`` over it).
            CheckpointError: ``resume`` names a checkpoint that cannot be read, or
                ``checkpoint_dir`` cannot be made or written (a path under a file, no
                permission; before any step).
            ConfigurationError: ``epochs < 1``, or ``checkpoint_dir`` is a file, or
                ``resume="latest"`` without a ``checkpoint_dir``, or the optimizer or LR scheduler
                factory raised (its error is the cause); across processes, another Trainer's
                call is running in this process.

        Warns:
            UserWarning: ``epochs`` are complete already, so the call trains nothing; or
                ``resume="latest"`` found no checkpoint in ``checkpoint_dir`` yet, so nothing
                is resumed (a resumable script's first run starts from scratch); or, without
                ``resume``, ``checkpoint_dir`` holds a checkpoint further on than this trainer
                (another run's: this fit's would be written beside and over its files).

        Cancellation handling:
            Cancelling the task that awaits ``fit`` stops at once: the running jobs finish
            (an optimizer step in progress completes on every device, or is undone on every
            device), the workers are joined and ``CancelledError`` propagates. The replicas
            stay identical; ``fit`` can be called again and continues from the last completed
            optimizer step. Across processes (`asyncddp.distributed`) an exchange with
            the other ranks in progress is finished first; a step it completed was taken on
            every rank, so it is kept and counted here too. The other ranks raise
            `WorkerFailedError` naming this one at their next exchange. A ``next()``
            in progress on the loader thread is not waited for: it finishes in the background,
            and the next call over the same data waits for it before reading that data.
        """
        # First, before any await (see _begin_call). Refused for another trainer's call, this
        # one's streams end; refused for this trainer's own, that call's streams stay open.
        try:
            self._begin_call("fit()")
        except ConfigurationError as error:
            if for_other_trainers_call(error):
                self._hub.publish(
                    FitEnded(self.epoch, self.global_step, False, error=_describe(error))
                )
            raise
        try:
            await self._wait_for_checkpoint_session()
            self._stop_reason = None
            self._stop_agreed = False
            self._replicas_compared = False  # after this fit's first step (_compare_replicas)
            history: list[EpochRecord] = []
            started, items_before = time.perf_counter(), self._items_trained
        except BaseException as error:  # nothing between this and the try below, which ends
            # the call. Cancelled in the wait, before joining: its streams end here, and no
            # other rank hears of it (none has seen this call yet).
            self._hub.publish(FitEnded(self.epoch, self.global_step, False, error=_describe(error)))
            self._end_call()
            raise
        try:
            # Joined first: every rank counts the call (Comm.begin_call), also one that a
            # check below fails on this rank alone (an option assigned on one rank), and the
            # others hear of it.
            await _optimizers_importable()
            await self._join("fit()")
            self._check_options()
            epochs = check_int("epochs", epochs, 1)  # NumPy's too: a sweep's from an array
            check_path("resume", resume)
            self._refuse_shared_checkpoint_dir()  # before its files are read or warned of
            state = await self._resume_state(resume) if resume is not None else None
            if resume is None:
                await self._warn_if_checkpoints_ahead()
            await self._check_checkpoint_dir()
            # A checkpoint may have begun while joining, reading or looking at checkpoint_dir:
            # it snapshots the position, so the state is taken once it has ended (nothing
            # awaits from here to the session, which would refuse to start beside it).
            await self._wait_for_checkpoint_session()
            if state is not None:
                self._adopt(state)
            elif resume is not None:  # "latest", and no checkpoint yet (on rank 0)
                warn_user(
                    f"resume='latest': no checkpoint in {str(self.checkpoint_dir)!r} yet, so "
                    "nothing is resumed: training goes on from this trainer's own state (the "
                    "start, for a new trainer)",
                    AsyncDDPWarning,
                )
            if self.epoch >= epochs:
                done = f"{self.epoch} epoch{'' if self.epoch == 1 else 's'}"
                warn_user(
                    f"fit(epochs={epochs}) trains nothing: the trainer has completed {done} "
                    "already, and epochs counts from the start of training (as Lightning's "
                    f"max_epochs); epochs={self.epoch + epochs} trains until "
                    f"{self.epoch + epochs} are complete",
                    AsyncDDPWarning,
                )
            passes = epochs - self.epoch - (1 if self._epoch_trained else 0)
            if passes > 0 and not self.model.training:
                # As a plain loop's model, it trains in its mode; but a model left in eval
                # mode by an evaluation, or loaded so (Hugging Face's from_pretrained), is
                # more often a slip than a choice (Lightning's users reported it as a bug).
                warn_user(
                    "the model is in eval mode (trainer.model.training is False: after an "
                    "evaluation of your own, or loaded so, as from_pretrained() loads), and "
                    "fit() trains it as it is, with dropout off and BatchNorm's statistics "
                    "frozen. Call trainer.model.train() before fit(): asyncddp never switches "
                    "modes for you (a submodule put in eval mode, a frozen BatchNorm, stays "
                    "so; the root in eval mode warns)",
                    AsyncDDPWarning,
                )
            _check_data(train_data, "train_data", passes)
            self._check_continued(train_data, passes)
            if valid_data is not None:
                _check_data(valid_data, "valid_data", epochs - self.epoch)
            async with self._session("fit"):
                # The replicas are built now, their schedulers with them.
                check_monitor_fits(
                    self._replicas,
                    self.lr_scheduler_monitor,
                    self.lr_scheduler_interval,
                    valid_data,
                    trains=self.epoch < epochs,
                )
                total = await rank_items_total_off_loop(train_data, 0, 1)  # all of the data
                self._hub.publish(
                    FitStarted(epochs, self.epoch, tuple(d.name for d in self.devices), total)
                )
                await self._pay_checkpoint()  # the last fit's write failed, or was cut short
                while self.epoch < epochs:
                    if not self._epoch_trained and not await self._train_epoch(train_data, epochs):
                        break  # stop() in mid-epoch
                    history.append(await self._end_epoch(valid_data, train_data))
                    await self._hub.settle()  # a stop() from an EpochEnded consumer, say
                    if self._stopping():
                        break
                if self._comm is not None:  # the ranks end together; a late failure is heard
                    await self._exchange(_comm.FIT_END, last=True)
        except BaseException as error:
            self._quiet_if_closed_without_its_loop()
            if not self._batches_done:
                self._last_iterator = None
            raised = await self._across_ranks(error)
            ended = FitEnded(self.epoch, self.global_step, False, error=_describe(raised))
            self._hub.publish(ended)
            try:
                if raised is not error:
                    raise raised from raised.__cause__
                raise
            finally:
                del raised  # no cycle through this frame (see _steps._on_failure)
        finally:
            self._end_call()
        if not self._batches_done:  # no epoch left unfinished: let the iterator go
            self._last_iterator = None
        stopped = self._stopping()
        self._hub.publish(FitEnded(self.epoch, self.global_step, stopped, self._stop_reason))
        seconds = time.perf_counter() - started
        items = self._items_trained - items_before  # an epoch begun earlier: this call's part
        return FitResult(
            tuple(history),
            self.epoch,
            self.global_step,
            stopped,
            self._stop_reason,
            items / seconds if seconds > 0 else 0.0,
        )

    async def validate(self, data: Iterable[Any]) -> dict[str, float]:
        """Average the validation step's loss and metrics over every item of ``data``, exactly.

        Runs ``valid_step`` (by default ``step``) under ``torch.no_grad()`` with the models in
        eval mode, on every device's worker. Cancelling it stops at once and leaves the models
        as they were.

        Args:
            data: The validation batches, as ``fit``'s ``valid_data``: a ``DataLoader``, a list,
                any iterable read once. Across processes each rank validates its part.

        Returns:
            ``"loss"`` and each metric the step returns, each the mean over every item (over
            every rank's, across processes). The items counted are in the `ValidationEnded`
            event.

        Raises:
            WorkerFailedError: A device's step raised (its cause); the models are left in the
                modes they had.
            DataError: ``data`` holds no batch, or a batch that cannot be split.
            ConfigurationError: Another call (``fit``, ``validate``) is running on this
                trainer (across processes, on any trainer of this process), or an option
                assigned on it cannot work.
        """
        self._begin_call("validate()")  # before any await: see fit
        try:
            await self._wait_for_checkpoint_session()
        except BaseException:
            self._end_call()
            raise
        try:
            await _optimizers_importable()
            await self._join("validate()")
            self._check_options()
            _check_data(data, "data", 1)
            await self._wait_for_checkpoint_session()  # one may have begun while joining
            async with self._session("validate"):
                return await self._validate(data, epoch=None)
        except BaseException as error:
            self._quiet_if_closed_without_its_loop()
            raised = await self._across_ranks(error)
            try:
                if raised is not error:
                    raise raised from raised.__cause__
                raise
            finally:
                del raised  # no cycle through this frame (see _steps._on_failure)
        finally:
            self._end_call()

    def _check_continued(self, data: Iterable[Any], passes: int) -> None:
        """Refuse to continue an epoch with an iterator that was read before: continuing
        reads the data from its start and skips the batches already trained on, and such an
        iterator cannot start over (the fit that read it also read ahead of where it
        stopped). A new iterator over the whole epoch is fine."""
        if isinstance(data, Iterator):
            last = self._last_iterator() if self._last_iterator is not None else None
            read = data is last or (
                inspect.isgenerator(data) and inspect.getgeneratorstate(data) != inspect.GEN_CREATED
            )
            # Continuing the epoch reads it again; an epoch that trained reads nothing, but
            # any epoch after it does (``passes``: the epochs still to train).
            unfinished = self._batches_done and not self._epoch_trained
            if read and (unfinished or (self._epoch_trained and passes >= 1)):
                why = (
                    f"this epoch stopped after {self._batches_done} batches, and continuing "
                    "it reads train_data from its start, skipping those"
                    if unfinished
                    else "the next epoch reads train_data from its start"
                )
                raise DataError(
                    f"train_data is an iterator ({type(data).__name__}) that was read before: "
                    f"{why}; an iterator cannot start over. Pass a new iterator over the whole "
                    "epoch, or data that starts over each time it is iterated (a list of "
                    "batches, a DataLoader)"
                )

    async def save_checkpoint(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Write the training state to ``path`` atomically; safe while ``fit`` runs.

        During a fit it waits for the current optimizer step to end, so the checkpoint holds a
        consistent state. The file is written on a thread, not on the event loop.

        Args:
            path: The file to write. By default a file in ``checkpoint_dir`` named as ``fit``
                names its own (``epoch0004-step000130.ckpt``: the epochs and steps done), which
                ``fit(resume="latest")`` finds: the way to save before a preemption.

        Returns:
            The path written.

        Raises:
            ConfigurationError: no ``path``, and the trainer has no ``checkpoint_dir``; or a
                call of this trainer runs in another thread's event loop (call it there), or
                runs while this is called from inside a step (on a worker thread).
            CheckpointError: the file could not be written (a full disk, a path under a file;
                the cause is its ``__cause__``); a file there before is left whole.
        """
        self._refuse_other_loop("save_checkpoint()")
        check_path("path", path)
        if path is None and self.checkpoint_dir is None:
            raise ConfigurationError(
                "save_checkpoint() without a path writes into checkpoint_dir, and this "
                "Trainer has none: give a path, or build the Trainer with checkpoint_dir=..."
            )
        while True:
            while self._scheduler is None and self._session_kind is not None:
                assert self._session_done is not None  # a fit or validate closing its session:
                await self._session_done.wait()  # the checkpoint holds the state it ends with
            lock, done = self._step_lock, self._session_done
            if self._scheduler is None or lock is None:
                async with self._session("checkpoint"):
                    state = await self._snapshot()
                break
            async with lock:
                current = self._scheduler is not None and lock is self._step_lock
                if current and not self._window_open:
                    state = await self._snapshot()
                    break
            # The fit ended while this waited for its step, leaving the step half done if it
            # was cancelled between the step's micro-steps: wait for its session to close; a
            # session of this checkpoint's own then undoes that half step before the snapshot.
            assert done is not None
            await done.wait()
        if path is None:  # named for the position the state holds
            assert self.checkpoint_dir is not None
            name = _checkpoint.checkpoint_name(state["epoch"], state["global_step"])
            path = self.checkpoint_dir / name
        return await self._write_checkpoint(state, path)

    def state_dict(self) -> dict[str, Any]:
        """The training state: model, optimizer, LR scheduler, loss scale, position, RNG.

        Call it while no step runs: between calls, or from an event consumer during a fit
        before it awaits anything (the fit waits for it between steps); `save_checkpoint`
        writes the state at any time, off the event loop. During a fit it holds the loader
        thread between two batches, as a checkpoint does, so that the batches loaded ahead and
        the random number generators they drew from are taken together: if that thread is
        inside a ``next()``, it waits for it, on the event loop, up to 0.25 s.

        Raises:
            ConfigurationError: a step of a fit is in progress (its optimizer step may be
                half done), or, before the first fit, the model has parameters not made yet (a
                lazy module's: run one forward first, as ``fit`` says) or tensors on the meta
                device; or a call of this
                trainer runs in another thread's event loop (call it there), or runs while
                this is called from inside a step (on a worker thread).
            AsyncDDPError: a failed step's optimizer step could not be undone
                (``atomic_steps=False``): the state would hold a step not counted.

        Warns:
            AsyncDDPWarning: during a fit, the loader thread was still inside a ``next()``
                after 0.25 s: a resume from this state may draw the random numbers of the
                batches loaded ahead otherwise than the fit did (`save_checkpoint` waits, off
                the event loop).
        """
        self._refuse_other_loop("state_dict()", waits=False)
        self._refuse_if_inconsistent()  # a state that puts it a step on, unsaid
        if self._session_kind is not None and self._window_open:
            raise ConfigurationError(
                "state_dict() cannot read the state while a step of fit() is in progress (its "
                "optimizer step may be half done): call it from an event consumer before it "
                "awaits anything, or await save_checkpoint(), which waits for the step"
            )
        for replica in self._replicas:
            if replica.device.is_cuda:  # the workers' streams may still be stepping
                torch.cuda.synchronize(replica.device.torch_device)
        first = self._replicas[0] if self._replicas else None
        if first is None and self._pending_state is not None:
            # Loaded before any fit built the replicas: the loaded optimizer and LR scheduler.
            pending = self._pending_state
            optimizer, scheduler = pending.get("optimizer"), pending.get("lr_scheduler")
        elif first is None:
            # Not built yet: as the factories build them, so that this state, loaded after
            # a fit, sets them back to their start too (which needs the parameters made).
            _check_made(self._source)
            optimizer, scheduler = to_cpu(
                _checkpoint.fresh_states(
                    self._source, self._optimizer_factory, self._scheduler_factory
                )
            )
        else:
            optimizer = to_cpu(first.optimizer.state_dict())
            scheduler = first.scheduler.state_dict() if first.scheduler else None
        return {
            "model": to_cpu(self.model.state_dict()),
            "optimizer": optimizer,
            "lr_scheduler": scheduler,
            **self._held_position(),
        }

    def _held_position(self) -> dict[str, Any]:
        """`_position`, for `state_dict`: with a running epoch's loader thread held between two
        batches (as `_snapshot` holds it), or, if it is still inside a ``next()`` after
        0.25 s (the event loop waits meanwhile), as it is, with a warning."""
        loading = self._loading
        if loading is None:
            return self._position()
        if loading.hold(timeout=0.25):
            try:
                return self._position(loading.loaded)
            finally:
                loading.release()
        warn_user(
            "state_dict() during a fit: the loader thread was still reading a batch after 0.25 s, "
            "so the state holds the random number generators as they were while it drew; a "
            "resume from it may shuffle or augment the batches loaded ahead otherwise than this "
            "fit did. await save_checkpoint() instead, which waits for that batch off the "
            "event loop",
            AsyncDDPWarning,
        )
        return self._position()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load a state from `state_dict` or a checkpoint, into every replica.

        Call it while no fit, validation or checkpoint runs.

        Raises:
            CheckpointError: the state does not fit this trainer (another model's keys or
                shapes, another optimizer's parameter groups, or not a trainer's state at
                all), or one of its entries cannot be read (a state edited by hand). Nothing
                of it is taken: the position, weights and optimizer stay.
            ConfigurationError: a fit, validation or checkpoint is running.
        """
        self._refuse_if_running("load_state_dict()")
        self._adopt(state)
        if self._replicas:
            pending, self._pending_state = self._pending_state, None
            for replica in self._replicas:
                load_into(replica, pending or state)

    # -- sessions: workers and replicas ----------------------------------------------------

    def _refuse_shared_checkpoint_dir(self) -> None:
        """Refuse a fit into the ``checkpoint_dir`` of another trainer of this process that is
        fitting: both would write checkpoints of the same names into it, each over the other's
        (a sweep's trials given one folder), and ``resume="latest"`` would load another
        trial's model."""
        if self.checkpoint_dir is None or (self._comm is not None and self._comm.rank != 0):
            return
        mine = self.checkpoint_dir.resolve()
        for ref in list(_LAST_CALLER.values()):
            other = ref()
            if (
                other is None
                or other is self
                or other._session_kind != "fit"
                or other.checkpoint_dir is None
                or (other._comm is not None and other._comm.rank != 0)
            ):
                continue
            if other.checkpoint_dir.resolve() == mine:
                raise ConfigurationError(
                    f"checkpoint_dir {str(self.checkpoint_dir)!r} is that of another Trainer "
                    "fitting in this process: both would write checkpoints of the same names "
                    "into it, each over the other's, and resume='latest' would load the other "
                    "one's model. Give each trainer a checkpoint_dir of its own (a sweep: one "
                    "folder a trial, checkpoint_dir=f'checkpoints/trial{i}')"
                )

    @contextlib.asynccontextmanager
    async def _session(self, kind: str) -> AsyncIterator[StepScheduler]:
        """Worker threads for one fit, validate or checkpoint call."""
        self._refuse_if_running(
            "save_checkpoint()" if kind == "checkpoint" else f"{kind}()", calls=False
        )
        self._stragglers = [thread for thread in self._stragglers if thread.is_alive()]
        if self._stragglers:
            names = ", ".join(thread.name for thread in self._stragglers)
            error = AsyncDDPError(
                f"{names} is still running a job that did not finish in time (left behind "
                "when the last call closed its workers): it writes into this trainer's "
                "replicas, its model among them, when it returns, and would corrupt the next "
                "steps. Call again once it has returned (the error's .threads: join them on a "
                "thread, e.g. await anyio.to_thread.run_sync(thread.join)), or train a new "
                "Trainer on a new model loaded from a checkpoint"
            )
            error.threads = list(self._stragglers)  # type: ignore[attr-defined]
            raise error
        self._check_queued_undos()  # their threads have exited
        self._refuse_if_inconsistent()
        last = _LAST_CALLER.get(self._source)
        other = last() if last is not None else None
        if other is not None and other is not self and other._uses_its_model():
            raise ConfigurationError(
                "this trainer's model is in use by another Trainer ("
                + (
                    f"in a {other._session_kind})"
                    if other._session_kind is not None
                    else "a thread its last call left behind still writes into it)"
                )
                + ": trainers given one module train that one module, and at once they would "
                "write into each other's steps. Give each trainer its own copy "
                "(copy.deepcopy(model)), or await the other call first"
            )
        if kind == "fit":  # looked at before, and again now that nothing awaits till it opens
            self._refuse_shared_checkpoint_dir()
        scheduler = self._new_scheduler()
        _LAST_CALLER[self._source] = weakref.ref(self)
        self._session_kind = kind
        self._loop_thread, self._call_loop = threading.get_ident(), running_loop()
        self._session_done = anyio.Event()
        ended = False
        # fast_acquire: an uncontended step need not yield to the loop (the step awaits anyway)
        lock = self._step_lock = anyio.Lock(fast_acquire=True)
        # Held before the scheduler is seen: a checkpoint waits until the replicas are ready.
        # (An acquire yields to the loop first in a cancelled scope, where a checkpoint
        # waiting to run took the lock of a trainer with no replicas yet, and failed.)
        lock.acquire_nowait()
        self._window_locked = False
        try:
            scheduler.start()
        except BaseException:
            lock.release()
            self._session_kind = None  # no session after all: nobody waits for its end
            self._session_done.set()
            raise
        self._scheduler = scheduler
        try:
            with _releasing(lock):
                if not self._replicas:
                    await self._build_replicas()
                elif self._replicas[0].grads.loose != self._lone():  # joined a process group
                    await self._regroup()
                for replica in self._replicas:  # changed through .data since? (no worker runs)
                    replica.backup.forget_ahead()
                    if not self.atomic_steps:  # turned off since a backup was taken
                        replica.backup.forget()
                if self._pending_state is not None:
                    # Loaded before the replicas were built: only now is there an optimizer to
                    # check the state's parameter groups against (the position is taken).
                    saved = self._pending_state.get("optimizer")
                    if saved is not None:
                        _checkpoint.check_optimizer_fits(saved, self._replicas[0].optimizer)
                    state, self._pending_state = self._pending_state, None
                    await self._scheduler_run(
                        self._jobs().load, [state] * len(self.devices), phase="setup"
                    )
                if self._window_open:  # a step cancelled or failed last time: undo it first
                    await self._abandon()
                if kind in ("fit", "validate"):  # every rank is in these, none in a checkpoint
                    await self._mirror_first()  # what the user changed on trainer.model since
                    await self._take_rank_0s_model()
                    self._note_frozen_versions()
            yield scheduler
            ended = True
        finally:
            # Dropping a device replaces the scheduler: close whichever one is current.
            current, self._scheduler = self._scheduler, None
            try:
                if current is not None:
                    try:
                        if ended:  # else closing bounds the wait: drain_timeout
                            await self._finish_streams(current)
                    finally:
                        try:
                            await current.aclose()
                        finally:
                            self._stragglers += current._left_behind
            finally:
                if self._attributes_carried:
                    # What the forward set on the modules in this call (a recurrent state) is
                    # each device's own; what an event consumer set on trainer.model alone is
                    # carried over by the next call (_mirror_first).
                    self._attributes_carried = False
                    try:
                        settle_snapshots(self._replicas)
                    except Exception:  # never leave the session open over it
                        _log.exception("asyncddp could not take the modules' attributes")
                        for replica in self._replicas:
                            replica.module_attrs = attribute_snapshot(replica.model)
                self._session_kind = None
                self._session_done.set()

    def _uses_its_model(self) -> bool:
        """Whether a call of this trainer runs, or a thread one left behind does."""
        return self._session_kind is not None or any(t.is_alive() for t in self._stragglers)

    def _refuse_if_inconsistent(self) -> None:
        """Refuse to go on from, or to save, replicas that hold a step not undone."""
        if not self._consistent or any(replica.kept_step for replica in self._replicas):
            self._consistent = False
            raise AsyncDDPError(
                "a failed or timed-out step's optimizer step could not be undone on some "
                "replicas (atomic_steps=False keeps no copy to undo it with, or its undo "
                "failed): they hold a step that global_step does not count, and may differ "
                "from each other; call load_state_dict() with a state saved after an earlier "
                "step (a checkpoint, or state_dict() from before the failure) first"
            )

    def _check_queued_undos(self) -> None:
        """Once the threads left behind have exited: did the undos queued behind their hung
        jobs (see `JobQueuedError`) all run, and succeed? If not, a replica may differ from the
        others (an optimizer step not undone)."""
        for error in self._queued_undos:
            if not error.ran():
                self._consistent = False
        self._queued_undos.clear()

    @property
    def precision(self) -> str:
        """The precision the Trainer was built with (``"32"``, ``"bf16"``, ``"fp16"``...)."""
        return self._precision

    @precision.setter
    def precision(self, value: Never) -> None:  # so that type checkers refuse it too
        raise AttributeError(
            f"precision is fixed as the Trainer is built (autocast and the loss scaler are set "
            f"up then): make a new Trainer(..., precision={value!r}) and give it this one's "
            "state, new.load_state_dict(trainer.state_dict())"
        )

    def _check_options(self) -> None:
        """Check the options a user may change between calls by assigning them on the trainer
        (``trainer.checkpoint_dir = None``), as it is built and again as each call starts, and
        keep each as it is used (an ``int`` for NumPy's, a ``Path`` with ``~`` expanded)."""
        self.accumulate_grad_batches = check_int(
            "accumulate_grad_batches", self.accumulate_grad_batches, 1
        )
        self.gradient_clip_val = check_positive("gradient_clip_val", self.gradient_clip_val)
        _check(
            self.lr_scheduler_interval in ("epoch", "step"),
            f"lr_scheduler_interval must be 'epoch' or 'step', not {self.lr_scheduler_interval!r}",
        )
        check_monitor(self.lr_scheduler_monitor, self.lr_scheduler_interval)
        _check(
            self.on_failure in ("raise", "retry", "drop"),
            f"on_failure must be 'raise', 'retry' or 'drop', not {self.on_failure!r}",
        )
        self.max_retries = check_int("max_retries", self.max_retries, 0)
        self.prefetch = check_int("prefetch", self.prefetch, 0)
        self.step_timeout = check_seconds("step_timeout", self.step_timeout)
        self.threads_per_worker = check_int(
            "threads_per_worker", self.threads_per_worker, 1, MAX_THREADS, none=True
        )
        self.split_batches = check_bool("split_batches", self.split_batches)
        self.atomic_steps = check_bool("atomic_steps", self.atomic_steps)
        self.check_finite = check_bool("check_finite", self.check_finite)
        self.progress_bar = check_bool("progress_bar", self.progress_bar, none=True)
        self.pin_memory = check_bool("pin_memory", self.pin_memory)
        check_path("checkpoint_dir", self._checkpoint_dir)  # a path is a Path already

    @property
    def checkpoint_dir(self) -> Path | None:
        """Where ``fit`` writes a checkpoint after every epoch (``None``: nowhere); assign a
        path (a ``str`` too) or ``None`` between calls."""
        return cast(Path | None, self._checkpoint_dir)

    @checkpoint_dir.setter
    def checkpoint_dir(self, value: str | os.PathLike[str] | None) -> None:
        check_path("checkpoint_dir", value)  # here: save_checkpoint() checks no options
        self._checkpoint_dir = _as_path(value)

    def _begin_call(self, call: str) -> None:
        """Note ``call`` (``"fit()"``, ``"validate()"``) as running on this trainer, from its
        first line to its end (`_end_call`), or refuse it: while another call runs on this
        trainer (one still joining or waiting for a checkpoint, before its session, too: both
        went on, and the refused one, refused only as its session began, published its
        FitEnded to the running fit's streams), or, in a process group, another trainer's
        (`_claim_group`). Called before the call's first await; a checkpoint being written
        is waited for after it."""
        self._refuse_if_running(call, sessions=False)
        self._claim_group(call)
        self._running_call = call
        self._loop_thread, self._call_loop = threading.get_ident(), running_loop()

    def _end_call(self) -> None:
        self._release_group()
        self._running_call = None

    def _session_call(self) -> str | None:
        """The call the running session is for, as messages name it (None: no session)."""
        kind = self._session_kind
        if kind is None:
            return None
        return "save_checkpoint()" if kind == "checkpoint" else f"{kind}()"

    def _refuse_other_loop(self, call: str, *, waits: bool = True) -> None:
        """Refuse ``call`` from another thread than the one whose event loop runs this
        trainer's call or session: their locks and events belong to that loop, and a wait on
        them from another loop never ends (it deadlocked both). A call that ``waits`` for that
        loop is refused from another loop on its thread too, and while it is pending in a loop
        that has ended (`state_dict()` waits for nothing: it reads the state between steps)."""
        running = self._running_call or self._session_call()
        if running is None:
            return
        # A step (this trainer's or another's) that waited for this trainer's step lock or
        # read its replicas would wait, or read, mid-step.
        self._refuse_from_step(
            call,
            running,
            f"call {call} from your async code, not from a step, even through the event "
            "loop (run_coroutine_threadsafe): the step holds what it waits for",
        )
        if waits:
            self._refuse_if_loop_ended(call, running)
        elif self._call_loop is not None and loop_ended(self._call_loop):
            return  # nothing runs there any more, its thread maybe gone: read between steps
        if self._loop_thread not in (None, threading.get_ident()):
            raise ConfigurationError(
                f"{call} was called on another thread than the one whose event loop runs "
                f"{running} on this trainer: its calls share that loop. Call it from there "
                "(asyncio.run_coroutine_threadsafe(..., loop) or anyio.from_thread.run from "
                "another thread)"
            )
        here = running_loop() if waits else None
        if here is not None and self._call_loop is not None and here is not self._call_loop:
            # On the thread of that loop, which is not running while this one runs: a wait
            # for that call would wait for good (it froze both).
            raise ConfigurationError(
                f"{call} was called in another event loop than the one that runs {running} on "
                "this trainer, on the same thread, where that loop cannot run meanwhile: "
                "call it in that loop (loop.run_until_complete), or once that call has ended"
            )

    def _quiet_if_closed_without_its_loop(self) -> None:
        """In a call's ``except``: end the call quietly if its own event loop does not run it,
        as when its coroutine, left pending in a loop that has ended since (a Ctrl-C out of
        ``run_until_complete``, then the loop closed or the script ended), is closed by the
        garbage collector with no loop running (with another loop running, a clean-up that
        suspends before this point still fails the close). Its clean-up needs its loop and
        fails; Python printed that failure ("Exception ignored in: <coroutine object
        Trainer.fit>": "asyncddp needs a running asyncio or trio event loop (use 'await' in
        one)"), which the user, who did await it, could do nothing with. The worker threads
        stop as their scheduler is collected."""
        if running_loop() is not self._call_loop:
            raise GeneratorExit from None  # what closing a coroutine expects back, quietly

    def _refuse_if_loop_ended(self, call: str, running: str) -> None:
        """Refuse ``call`` while ``running`` is pending in an event loop that has ended."""
        if self._call_loop is None or not loop_ended(self._call_loop):
            return
        raise ConfigurationError(
            f"{call} cannot run: {running} is still pending on this trainer in an event loop "
            "that has ended since (closed, or its run finished: a KeyboardInterrupt out of "
            "loop.run_until_complete, say, then loop.close()). Nothing can run it again, so "
            "this trainer's calls would wait for it for good. trainer.model holds the weights "
            f"it left (global_step {self.global_step}; a step it was in may be half applied): "
            "build a new Trainer on it"
        )

    @staticmethod
    def _refuse_from_step(call: str, running: str, what_to_do: str) -> None:
        """Refuse ``call`` on a worker thread, inside a step, while ``running`` runs."""
        worker = current_worker()
        if worker is not None:
            raise ConfigurationError(
                f"{call} was called from inside a step, on {worker.device.name}'s worker "
                f"thread, while {running} is already running on this trainer: a step only "
                f"computes the loss of (model, batch); {what_to_do}"
            )

    def _refuse_if_running(self, call: str, *, sessions: bool = True, calls: bool = True) -> None:
        """Refuse ``call`` (``"fit()"``, say) while, ``sessions``, a fit, validation or
        checkpoint session runs, or, ``calls``, a fit or validate call (see `_begin_call`)."""
        if sessions and self._session_kind is not None:
            running = self._session_call()
        elif calls and self._running_call is not None:
            running = self._running_call
        else:
            return
        assert running is not None  # a session runs
        self._refuse_from_step(
            call, running, f"call {call} from your async code once {running} has returned"
        )
        self._refuse_if_loop_ended(call, running)
        hint = {
            "validate()": " (to validate as a fit goes, pass valid_data= to fit)",
            "state_dict()": " (during a fit, save_checkpoint() writes the state between steps)",
        }.get(call, "")
        if running == "fit()" and not hint:
            # A fit nobody awaits any more (one left running by a Ctrl-C in IPython's
            # terminal, which leaves the awaited task pending on its loop) can still be ended.
            hint = " (or end it at its next optimizer step with stop())"
        raise ConfigurationError(
            f"{call} cannot start while {running} is already running on this trainer: await "
            f"that {running} first{hint}"
        )

    async def _wait_for_checkpoint_session(self) -> None:
        while self._session_kind == "checkpoint" and self._session_done is not None:
            await self._session_done.wait()  # then check again: another may have begun

    async def _build_replicas(self) -> None:
        source = self._source
        parts = len(self.devices)
        lone = self._lone()

        # The first device trains the module passed in, moved there in place as Module.to
        # moves a module (Lightning and Accelerate move it so too): the caller's own model is
        # the trained one on a GPU as on the CPU. The other devices train copies of it, each
        # made on its own worker before the module moves (the first job), never from a module
        # half moved.
        _check_made(source)
        if parts > 1 and any(isinstance(m, nn.SyncBatchNorm) for m in source.modules()):
            warn_user(
                f"the model has a SyncBatchNorm, which torch supports with one device a "
                f"process: in a process group, each of this process's {parts} devices would "
                "run its collectives at once from its own thread (on CPUs torch refuses it), "
                "so give each process one device there (torchrun, on GPUs)"
                if distributed.is_initialized() and torch.distributed.get_world_size() > 1
                else f"the model has a SyncBatchNorm, which synchronises its statistics over "
                f"torch.distributed's process group only: between this process's {parts} "
                "devices it normalises each device's shard alone, as BatchNorm does (see "
                "training.md). Across processes (torchrun, on GPUs, one device a process) "
                "torch synchronises it"
            )

        def copy_source(ctx: Any, _: None) -> nn.Module | None:
            if ctx.device.index == 0:
                return None
            try:
                model = copy.deepcopy(source, _detached_attributes(source))
            except Exception as error:
                raise ConfigurationError(
                    f"trainer.model cannot be copied for the devices past the first, which "
                    f"train copies of it: copy.deepcopy raised {_describe(error)}. Usual "
                    "causes: a tensor that autograd made kept on a module (an output saved "
                    "in forward: keep it .detach()ed; a view of a parameter made in __init__, "
                    "self.w_t = self.weight.t(): make it in forward), a lock or an open file "
                    "among its attributes"
                ) from error
            # Before the optimizer factory groups them.
            carry_parameter_extras(model, source, ctx.device.torch_device)
            return model.to(ctx.device.torch_device)

        def build(ctx: Any, model: nn.Module | None) -> Replica:
            device = self.devices[ctx.device.index]
            if model is None:
                model = move_to(source, device.torch_device)
            replica = build_replica(
                model, device, optimizer=self._optimizer_factory, scheduler=self._scheduler_factory
            )
            replica.regroup(parts, device.index, loose=lone)
            return replica

        try:  # not timed, as every set-up job (see _scheduler_run)
            models: list[nn.Module | None] = [None]  # the first device's: the source
            if parts > 1:
                models += (await self._run_all(copy_source, phase="setup")).outputs[1:]
            result = await self._scheduler_run(build, models, phase="setup")
        except WorkerFailedError as error:
            cause = error.__cause__
            if isinstance(cause, ConfigurationError):
                # A mistake in the arguments, not a device fault; what the factory raised stays.
                raise cause from cause.__cause__
            raise
        replicas: list[Replica] = list(result.outputs)
        layouts = [group_layout(replica) for replica in replicas]
        for replica, layout in zip(replicas[1:], layouts[1:], strict=True):
            if layout != layouts[0]:
                raise ConfigurationError(
                    "the optimizer factory grouped the parameters of "
                    f"{replica.device.name}'s copy of the model otherwise than those of "
                    f"{replicas[0].device.name}'s (groups of {[len(g) for g in layout]} and "
                    f"{[len(g) for g in layouts[0]]} parameters), so their optimizers would "
                    "step differently. Group the parameters the factory is given by what "
                    "every copy's have: their shape (p.ndim < 2 for biases and norms) or an "
                    "attribute set on them (copied to each replica), not by membership in a "
                    "set of trainer.model's own parameters, which no copy's are"
                )
        self._replicas = replicas

    def _new_scheduler(self) -> StepScheduler:
        scheduler = StepScheduler(
            self.devices, step_timeout=self.step_timeout, threads_per_worker=self.threads_per_worker
        )
        # Every job in grad mode, autocast off (`precision` turns it on in the step), whatever
        # the event loop's thread is in: its grad mode and autocast are every task's on the
        # loop, and another task's `with torch.autocast(...)` or `with torch.no_grad()` open
        # across an await (a service's inference) would reach this trainer's steps.
        scheduler._job_state = {
            device.type: CallerState(True, False, torch.get_autocast_dtype(device.type))
            for device in self.devices
        }
        return scheduler

    def _jobs(self) -> Jobs:
        return Jobs(
            self._replicas,
            self._step_fn,
            self._valid_step_fn,
            self._autocast,
            self.check_finite,
            across_ranks=self._distributed(),
        )


def _rank_devices(devices: DeviceSpec) -> DeviceSpec:
    """``"auto"`` in a process group with GPUs: this process's GPU, ``cuda:LOCAL_RANK`` (modulo
    the visible GPUs)."""
    auto = isinstance(devices, str) and devices.strip().lower() == "auto"  # as _devices reads it
    # (The GPU count is looked up in _devices, so that tests can fake GPUs.)
    if auto and distributed.is_initialized() and _devices._cuda_device_count():
        return f"cuda:{distributed._local_gpu()}"  # the GPU init() made current
    return devices


def _makes_optimizers(function: Any) -> bool:
    """Whether ``function`` is an optimizer class, or a ``functools.partial`` of one."""
    while isinstance(function, functools.partial):
        function = function.func
    return isinstance(function, type) and issubclass(function, torch.optim.Optimizer)


def _shown(value: Any) -> str:
    if isinstance(value, functools.partial):
        return f"functools.partial({getattr(value.func, '__name__', value.func)!s}, ...)"
    if isinstance(value, type):
        return f"the class {value.__name__}"
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        return f"a {type(value).__name__} instance, the scheduler of one optimizer"
    return repr(value)


def _check_takes_model_and_batch(name: str, function: Any) -> None:
    """Refuse a step that cannot be called as ``step(model, batch)`` (``step(batch)``, or one
    with a third argument, as Lightning's ``training_step(batch, batch_idx)`` has), before any
    thread starts, and a bound ``training_step(self, batch, batch_idx)`` of a LightningModule
    (it binds, with the model as its batch). One whose signature cannot be read is let through,
    and so is one that a decorator's own signature lets through (``functools.wraps`` shows the
    wrapped one, and the decorator may supply an argument)."""
    error: TypeError | None = None
    signatures = []
    for follow in (True, False):
        try:
            signature = inspect.signature(function, follow_wrapped=follow)
        except (TypeError, ValueError):
            return
        try:
            signature.bind(None, None)
        except TypeError as refused:
            error = error or refused
            signatures.append(signature)
            continue
        names = [p.name for p in signature.parameters.values()][:2]
        if names == ["batch", "batch_idx"]:  # Lightning's hook, bound: model would be its batch
            shown = getattr(function, "__qualname__", None) or repr(function)
            raise ConfigurationTypeError(
                f"{name} {shown}(batch, batch_idx) is a LightningModule-style hook: the trainer "
                f"would call it as {name}(model, batch), with the model as its batch. Write "
                f"def {name}(model, batch): return loss, calling the model yourself (Lightning's "
                "training_step body, with self replaced by model)"
            )
        return
    shown = getattr(function, "__qualname__", None) or repr(function)
    plain = signatures[0].replace(
        parameters=[
            p.replace(annotation=inspect.Parameter.empty) for p in signatures[0].parameters.values()
        ],
        return_annotation=inspect.Signature.empty,
    )
    raise ConfigurationTypeError(
        f"{name} {shown}{plain} cannot be called as {name}(model, batch) ({error}): the "
        f"trainer calls it with the device's model and its share of the batch, as "
        f"def {name}(model, batch): return loss"
    )


async def _optimizers_importable() -> None:
    """Import ``torch._dynamo`` off the event loop, once a process: the first optimizer a
    process builds imports it (torch wraps optimizers' methods to keep dynamo out), 1 to 3 s
    of imports, which held the loop where a call builds one on it: a distributed fit's first
    join compares the ranks' optimizers, a resume checks the state against one. (The workers
    build the replicas' own, off the loop too.) On a thread of its own, which ends with the
    import (an executor's would stay, idle, after the call); a cancellation leaves the import
    to end there."""
    if "torch._dynamo" in sys.modules:
        return
    waker = current_waker()
    done: list[bool] = []

    def target() -> None:
        try:
            importlib.import_module("torch._dynamo")
        except BaseException:  # an optimizer's build raises it again, where it matters
            pass
        finally:
            done.append(True)
            waker.wake_threadsafe()

    threading.Thread(target=target, name="asyncddp-import", daemon=True).start()
    while not done:
        await waker.wait(None)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


@contextlib.contextmanager
def _releasing(lock: anyio.Lock) -> Iterator[None]:
    """Release ``lock``, held already, at the block's end."""
    try:
        yield
    finally:
        lock.release()


def _check_unwrapped(model: nn.Module) -> None:
    """Refuse a model that is, or holds, a ``DistributedDataParallel`` or ``DataParallel``
    wrapper: its reducer would run collectives of its own in every backward (on the default
    process group, behind the trainer's back), and hang at a step that one rank makes
    without data."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            where = "model is" if not name else f"model.{name} is"
            raise ConfigurationError(
                f"{where} wrapped in {type(module).__name__}: pass the module inside it "
                f"({'model' if not name else f'model.{name}'}.module). The trainer does the "
                "data parallelism itself, across its devices and ranks; the wrapper's own "
                "gradient reduction would run beside it in every backward"
            )


def _check_made(model: nn.Module) -> None:
    """Refuse a model whose parameters are not made yet (a lazy module's, before a forward), or
    whose parameters or buffers hold no values (on the meta device)."""
    lazy = [name for name, p in model.named_parameters() if nn.parameter.is_lazy(p)]
    if lazy:
        raise ConfigurationError(
            f"trainer.model has parameters not made yet ({first_names(lazy)}: a lazy module, "
            "LazyLinear say): run one "
            "forward on a batch first (model(inputs)), so that they have their shapes, as "
            "DistributedDataParallel requires too"
        )
    meta = [
        name
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers())
        if tensor.is_meta
    ]
    if meta:
        raise ConfigurationError(
            f"trainer.model has tensors on the meta device, which hold no values "
            f"({first_names(meta)}: a model built under "
            "torch.device('meta')): give them storage and values first, "
            "model.to_empty(device='cpu') then each module's reset_parameters() (or "
            "load_state_dict(state, assign=True))"
        )


def _detached_attributes(model: nn.Module) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo that copies detached each weight torch's own rewrites keep as a
    plain attribute with a graph and remake before every forward, by a forward pre-hook
    (``torch.nn.utils.prune``'s ``weight``, the legacy ``weight_norm`` and ``spectral_norm``'s):
    ``copy.deepcopy`` refuses a tensor autograd made, and a copy's own forward remakes it
    from the copy's parameters. Any other such tensor is left to be refused: detached, one
    that the forward uses (``self.w_t = self.weight.t()``) would be a constant on the copies."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if isinstance(hook, _REMAKERS):
                name = getattr(hook, "_tensor_name", None) or getattr(hook, "name", None)
                value = module.__dict__.get(name) if isinstance(name, str) else None
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    memo[id(value)] = value.detach().clone()
    return memo


#: The forward pre-hooks that remake a module's weight attribute before every forward.
_REMAKERS = (BasePruningMethod, WeightNorm, SpectralNorm)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _check_data(data: Iterable[Any], name: str, passes: int) -> None:
    """Refuse, before any work, a map-style ``Dataset`` iterated through ``__getitem__`` (its
    items are samples, not batches: a sample of features and a class label would pass for a
    batch of as many items as there are features; one with an ``__iter__`` of its own is taken
    as it is), an iterator that would have to be read ``passes`` > 1 times (its second epoch
    would find it used up), and data known to be empty (``name`` "train_data" is trained on,
    the others validated on)."""
    if empty_up_front(data):  # before any work: an empty validation set failed after an epoch
        raise no_batches(name, data, training=name == "train_data")
    if not hasattr(data, "__iter__") and hasattr(data, "__aiter__"):
        raise DataError(
            f"{name} is an async iterable ({type(data).__name__}): the trainer reads its data "
            "with iter() and next() on a loader thread, so that reading never holds up the "
            "event loop. Pass a plain iterable: the batches in a list, or a generator that "
            "reads them from a queue.Queue your async code fills"
        )
    if not hasattr(data, "__iter__") and not hasattr(data, "__getitem__"):
        called = (
            f" (a generator function: pass {getattr(data, '__name__', name)}() to iterate what "
            "it yields, and for several epochs an object whose __iter__ calls it)"
            if inspect.isgeneratorfunction(data)
            else ""
        )
        raise DataError(
            f"{name} is not iterable: {type(data).__name__} {data!r}{called}. Pass an iterable "
            "of batches: a list of them, or a DataLoader"
        )
    if isinstance(data, torch.Tensor):
        raise DataError(
            f"{name} is a tensor of shape {tuple(data.shape)}: iterated, it gives its rows, "
            "one sample each, not batches. Pass a list of batches, or "
            "torch.utils.data.DataLoader(TensorDataset(inputs, targets), batch_size=...)"
        )
    if isinstance(data, (Mapping, str, bytes)):  # iterated, its keys or characters
        what = ", a mapping" if isinstance(data, Mapping) else ""
        raise DataError(
            f"{name} is a {type(data).__name__}{what}: iterated, it gives its "
            f"{'keys' if isinstance(data, Mapping) else 'characters'}, not batches. Pass a "
            "list of batches (a batch may be a dict of tensors), or a DataLoader"
        )
    if (
        isinstance(data, (list, tuple))
        and type(data) in (list, tuple)  # a subclass may load as it iterates: not read here
        and data
        and all(
            isinstance(part, (torch.utils.data.DataLoader, torch.utils.data.Dataset))
            for part in data
        )
    ):
        # Several evaluation sets, as Lightning's val_dataloaders or Hugging Face's
        # eval_dataset dict take them: read as batches, the first failed after the epoch.
        kinds = ", ".join(sorted({type(part).__name__ for part in data}))
        raise DataError(
            f"{name} is a {type(data).__name__} of {len(data)} {kinds}: the trainer takes one "
            "iterable of batches. Pass one DataLoader"
            + (
                ", and score the others with await trainer.validate(loader) between fits "
                "(fit(..., epochs=epoch + 1) in a loop, to score them after every epoch)"
                if name != "train_data"
                else " (torch.utils.data.ConcatDataset joins datasets into one)"
            )
        )
    kind: type = type(data)  # a type, not narrowed: mypy finds Iterable and Dataset at odds
    if issubclass(kind, torch.utils.data.Dataset) and getattr(kind, "__iter__", None) is None:
        raise DataError(
            f"{name} is a {type(data).__name__}, a Dataset: its items are single samples, not "
            f"batches. Pass torch.utils.data.DataLoader({name}, batch_size=...), or "
            f"DataLoader({name}, batch_size=None) if its items are batches already"
        )
    if passes > 1 and isinstance(data, Iterator):
        raise DataError(
            f"{name} is an iterator ({type(data).__name__}): it can be read once, and {passes} "
            "epochs are to run. Pass something that starts over each time it is iterated: a "
            "list of batches, a DataLoader, or an object whose __iter__ makes a new generator"
        )
