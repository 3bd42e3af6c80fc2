"""Trainer: data-parallel training that an async program awaits.

How one optimizer step runs (``accumulate_grad_batches`` batches, one by default)::

    event loop thread                                   worker threads, one per device
    next batch from the loader thread (never blocks)
    split along dim 0, one shard per device
    run(train)   ─────────────────────────────────────► forward, backward(loss * weight)
                                                        grads accumulate in flat buckets
    run(reduce)  ─────────────────────────────────────► reduce-scatter: each device sums its
      global norm for clipping, finite check for fp16   chunk of every replica's buckets
    run(apply)   ─────────────────────────────────────► all-gather, clip, optimizer step
    StepEnded event, progress bar, stop() check

The loss weight makes the mean exact over items: device ``i`` with ``n_i`` of a step's ``N``
items backpropagates ``loss_i * n_i / N``, so uneven shards, empty shards and a short last
batch give the gradient one device would get from the whole batch.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import torch
from torch import nn
from tqdm.auto import tqdm

from . import _checkpoint
from ._data import items_in, items_total, pin, split_batch
from ._devices import Device, DeviceSpec, resolve_devices
from ._events import (
    CheckpointSaved,
    DeviceDropped,
    EpochEnded,
    EventHub,
    EventStream,
    FitEnded,
    FitStarted,
    StepEnded,
    StepRetried,
    ValidationEnded,
    WorkerFailed,
)
from ._exceptions import (
    AsyncDDPError,
    ConfigurationError,
    DataError,
    StepOutputError,
    WorkerFailedError,
)
from ._loader import Prefetcher
from ._precision import LossScaler, autocast_dtype
from ._progress import ProgressTracker
from ._replica import (
    Jobs,
    OptimizerFactory,
    Replica,
    SchedulerFactory,
    StepFunction,
    Sums,
    build_replica,
)
from ._scheduler import StepScheduler

__all__ = ["DeviceDroppedWarning", "EpochRecord", "FitResult", "Trainer"]

_log = logging.getLogger("asyncddp")


class DeviceDroppedWarning(RuntimeWarning):
    """A failed device was dropped and training went on without it (``on_failure="drop"``)."""


@dataclass(frozen=True)
class EpochRecord:
    """One epoch of training: means over every item it saw."""

    epoch: int
    train_loss: float
    train_metrics: Mapping[str, float]
    valid_metrics: Mapping[str, float] | None
    items: int
    seconds: float


@dataclass(frozen=True)
class FitResult:
    """What ``fit`` did.

    Attributes:
        history: The epochs this call completed, in order.
        epoch: Epochs completed so far in all (the next epoch's number).
        global_step: Optimizer steps taken so far in all.
        stopped: Whether ``stop()`` ended the fit early.
        stop_reason: The reason given to ``stop()``.
    """

    history: tuple[EpochRecord, ...]
    epoch: int
    global_step: int
    stopped: bool = False
    stop_reason: str | None = None
    items_per_second: float = field(default=0.0)


@dataclass
class _Window:
    """The batches of one optimizer step, kept so that a failed step can be run again."""

    batches: list[list[Any]] = field(default_factory=list)  # per step: 1 batch, or 1 per device
    done: int = 0  # batches whose forward and backward have run
    items: int = 0
    loss: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    device_items: dict[str, int] = field(default_factory=dict)  # by device name


class Trainer:
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
        model: The module to train. It is replicated onto every device; ``trainer.model`` is
            the replica on the first device (the module itself when it already lives there).
        optimizer: A factory ``params -> Optimizer``, called once per replica, for example
            ``functools.partial(torch.optim.AdamW, lr=1e-3)``.
        step: ``step(model, batch) -> loss``, the loss a scalar tensor, the mean over the
            batch's items; or a dict with ``"loss"`` and further metrics (scalar means).
        devices: Anything :func:`resolve_devices` accepts; ``"auto"`` is every GPU, or the CPU.
        valid_step: The step for validation, run under ``torch.no_grad()``; by default ``step``.
        lr_scheduler: A factory ``optimizer -> LRScheduler``, called once per replica.
        lr_scheduler_interval: Step the LR scheduler every ``"epoch"`` or every ``"step"``.
        accumulate_grad_batches: Batches per optimizer step (gradient accumulation).
        gradient_clip_val: Clip the gradients to this global L2 norm (over the averaged
            gradients, as DDP would), or ``None``.
        precision: ``"32"``, ``"bf16"`` (bf16 autocast) or ``"fp16"`` (fp16 autocast with
            dynamic loss scaling). Lightning's names (``"bf16-mixed"``, ...) work too.
        split_batches: ``True`` splits every batch along dim 0 across the devices; ``False``
            gives each device whole batches of its own (``len(devices)`` batches per step).
        step_timeout: Seconds a device may take for one job; see :class:`StepScheduler`.
        on_failure: What a failed step does: ``"raise"`` (default), ``"retry"`` it up to
            ``max_retries`` times, or ``"drop"`` the failed devices and go on with the rest.
        max_retries: Retries per step with ``on_failure="retry"``.
        atomic_steps: Copy parameters and optimizer state before each optimizer step, so that
            a step that fails on any device is undone on every device. Costs one copy of both per
            device; turn off to save memory (a failure in the optimizer step then leaves the
            replicas unusable until ``load_state_dict``).
        checkpoint_dir: Where ``fit`` writes a checkpoint after every epoch; ``None`` for none.
        progress_bar: Show a progress bar (tqdm's, which also renders in notebooks); by default
            when the output is a terminal or a notebook.
        pin_memory: Page-lock batches on the loader thread before they go to a GPU; by default
            when a device is a GPU.
        prefetch: Batches loaded ahead of training, on the loader thread.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        step: StepFunction,
        devices: DeviceSpec = "auto",
        *,
        valid_step: StepFunction | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        lr_scheduler_interval: Literal["epoch", "step"] = "epoch",
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        precision: str = "32",
        split_batches: bool = True,
        step_timeout: float | None = None,
        on_failure: Literal["raise", "retry", "drop"] = "raise",
        max_retries: int = 2,
        atomic_steps: bool = True,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        progress_bar: bool | None = None,
        pin_memory: bool | None = None,
        prefetch: int = 2,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigurationError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigurationError(
                f"{type(model).__name__} has no trainable parameters (none requires grad)"
            )
        if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
            raise ConfigurationError(
                "optimizer must be a factory that makes one optimizer per replica, for example "
                "functools.partial(torch.optim.SGD, lr=0.1), not an optimizer instance"
            )
        if not callable(step):
            raise ConfigurationError("step must be a function step(model, batch) -> loss")
        _check(accumulate_grad_batches >= 1, "accumulate_grad_batches must be >= 1")
        _check(gradient_clip_val is None or gradient_clip_val > 0, "gradient_clip_val must be > 0")
        _check(lr_scheduler_interval in ("epoch", "step"), "lr_scheduler_interval: epoch or step")
        _check(on_failure in ("raise", "retry", "drop"), "on_failure: 'raise', 'retry' or 'drop'")
        _check(max_retries >= 0, "max_retries must be >= 0")
        _check(prefetch >= 1, "prefetch must be >= 1")
        self.devices: tuple[Device, ...] = resolve_devices(devices)
        self._autocast = autocast_dtype(precision)
        self._scaler = LossScaler() if self._autocast is torch.float16 else None
        self.precision = precision
        self._source = model
        self._optimizer_factory = optimizer
        self._scheduler_factory = lr_scheduler
        self._step_fn = step
        self._valid_step_fn = valid_step or step
        self.lr_scheduler_interval = lr_scheduler_interval
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.split_batches = split_batches
        self.step_timeout = step_timeout
        self.on_failure = on_failure
        self.max_retries = max_retries
        self.atomic_steps = atomic_steps
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.progress_bar = progress_bar
        self.pin_memory = any(d.is_cuda for d in self.devices) if pin_memory is None else pin_memory
        self.prefetch = prefetch
        #: Epochs completed so far; the next epoch's number.
        self.epoch = 0
        #: Optimizer steps taken so far.
        self.global_step = 0
        #: Every epoch completed, across fits.
        self.history: list[EpochRecord] = []
        self._batches_done = 0  # batches of the current epoch already trained on
        self._epoch_rng: dict[str, Any] | None = None
        self._replicas: list[Replica] = []
        self._pending_state: dict[str, Any] | None = None
        self._scheduler: StepScheduler | None = None
        self._hub = EventHub()
        self._stop_reason: str | None = None
        self._running = False
        self._grads_dirty = False
        self._consistent = True
        self._step_lock: anyio.Lock | None = None

    # -- public API -------------------------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The trained model: the replica on the first device."""
        return self._replicas[0].model if self._replicas else self._source

    def events(self, maxlen: int = 1000) -> EventStream:
        """A stream of this trainer's events: ``async for event in trainer.events()``.

        The stream ends after the ``FitEnded`` event of the fit in progress (or of the next
        one). It buffers up to ``maxlen`` events; a consumer that falls further behind loses
        the oldest ones (counted in ``stream.dropped``), so it never slows training down.
        """
        if maxlen < 1:
            raise ConfigurationError(f"maxlen must be >= 1, got {maxlen}")
        return self._hub.subscribe(maxlen)

    def stop(self, reason: str = "stop() was called") -> None:
        """End the running ``fit`` at the next optimizer step boundary; it returns normally.

        Safe to call from any task on the event loop, or from an event handler.
        """
        self._stop_reason = reason

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

        Threads: batches are loaded on a loader thread, computed on the devices' worker
        threads; the event loop only dispatches and awaits, and stays free throughout.

        Args:
            train_data: Any iterable of batches (a ``DataLoader``, a list of tensors, ...).
                Iterated once per epoch.
            epochs: Epochs to have completed when ``fit`` returns.
            valid_data: Batches to validate on after every epoch.
            resume: A checkpoint to continue from, or ``"latest"`` for the newest one in
                ``checkpoint_dir``.

        Returns:
            The epochs completed by this call, and whether ``stop()`` ended it.

        Raises:
            WorkerFailedError: a device failed (after any retries); no replica's parameters
                were changed by the failed step.
            StepOutputError: the step returned no scalar loss.
            DataError: the data yields no batch, or a batch cannot be split.
            ConfigurationError: ``epochs < 1``, or ``resume`` without a checkpoint to find.

        Cancellation handling:
            Cancelling the task that awaits ``fit`` stops at once: the running jobs finish
            (an optimizer step in progress completes on every device, or is undone on every
            device), the workers are joined and ``CancelledError`` propagates. The replicas
            stay identical; ``fit`` can be called again and continues from the last completed
            optimizer step.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ConfigurationError(f"epochs must be an int >= 1, got {epochs!r}")
        if self._running:
            raise ConfigurationError("fit or validate is already running on this trainer")
        if resume is not None:
            self.load_state_dict(await self._read_checkpoint(resume))
        self._stop_reason = None
        history: list[EpochRecord] = []
        started = time.perf_counter()
        items_seen = 0
        async with self._session():
            self._hub.publish(
                FitStarted(
                    epochs, self.epoch, tuple(d.name for d in self.devices), items_total(train_data)
                )
            )
            try:
                while self.epoch < epochs:
                    record = await self._train_epoch(train_data, epochs)
                    if record is None:
                        break
                    items_seen += record.items
                    if valid_data is not None:
                        metrics = await self._validate(valid_data, epoch=record.epoch)
                        record = EpochRecord(**{**record.__dict__, "valid_metrics": metrics})
                    if self.lr_scheduler_interval == "epoch" and self._scheduler_factory:
                        await self._run_all(self._jobs().scheduler_step, phase="lr_scheduler")
                    history.append(record)
                    self.history.append(record)
                    if self.checkpoint_dir is not None:
                        await self._save_epoch_checkpoint()
                    if self._stop_requested():
                        break
            except BaseException as error:
                self._hub.publish(
                    FitEnded(self.epoch, self.global_step, False, error=_describe_error(error))
                )
                raise
            stopped = self._stop_requested()
            self._hub.publish(FitEnded(self.epoch, self.global_step, stopped, self._stop_reason))
        seconds = time.perf_counter() - started
        return FitResult(
            tuple(history),
            self.epoch,
            self.global_step,
            stopped,
            self._stop_reason,
            items_seen / seconds if seconds > 0 else 0.0,
        )

    async def validate(self, data: Iterable[Any]) -> dict[str, float]:
        """Average the validation step's loss and metrics over every item of ``data``, exactly.

        Runs ``valid_step`` (by default ``step``) under ``torch.no_grad()`` with the models in
        eval mode, on every device's worker. Cancelling it stops at once and leaves the models
        as they were.
        """
        if self._running:
            raise ConfigurationError("fit or validate is already running on this trainer")
        async with self._session():
            return await self._validate(data, epoch=None)

    async def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write the training state to ``path`` atomically; safe while ``fit`` runs.

        During a fit it waits for the current optimizer step to end, so the checkpoint holds a
        consistent state. The file is written on a thread, not on the event loop.
        """
        if self._running and self._step_lock is not None:
            async with self._step_lock:
                state = await self._snapshot()
        else:
            async with self._session():
                state = await self._snapshot()
        return await anyio.to_thread.run_sync(_checkpoint.save, state, path)

    def state_dict(self) -> dict[str, Any]:
        """The training state: model, optimizer, LR scheduler, loss scale, position, RNG.

        Call it while no fit runs (use :meth:`save_checkpoint` during one).
        """
        first = self._replicas[0] if self._replicas else None
        return {
            "model": _to_cpu_copy(self.model.state_dict()),
            "optimizer": _to_cpu_copy(first.optimizer.state_dict()) if first else None,
            "lr_scheduler": first.scheduler.state_dict() if first and first.scheduler else None,
            **self._position(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or a checkpoint, into every replica."""
        self.epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])
        self._batches_done = int(state["batches_done"])
        self._epoch_rng = state.get("epoch_rng")
        self.history = [EpochRecord(**record) for record in state.get("history", [])]
        if self._scaler is not None and state.get("loss_scaler"):
            self._scaler.load_state_dict(state["loss_scaler"])
        if state.get("rng") is not None:
            _checkpoint.restore_rng(state["rng"])
        self._grads_dirty = True
        if not self._replicas:
            self._source.load_state_dict(state["model"])
            self._pending_state = dict(state)
            return
        for replica in self._replicas:
            replica.model.load_state_dict(state["model"])
            if state.get("optimizer") is not None:
                # A private copy each: replicas must never share optimizer state tensors.
                replica.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
            if replica.scheduler is not None and state.get("lr_scheduler") is not None:
                replica.scheduler.load_state_dict(state["lr_scheduler"])
            replica.grads.attach()

    # -- sessions: workers and replicas ----------------------------------------------------

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[StepScheduler]:
        """Worker threads for one fit or validate call (reused when one is open already)."""
        if self._scheduler is not None:
            yield self._scheduler
            return
        if not self._consistent:
            raise AsyncDDPError(
                "a failed optimizer step left the replicas different from each other "
                "(atomic_steps=False); call load_state_dict() with a saved state first"
            )
        self._running = True
        self._step_lock = anyio.Lock()
        scheduler = StepScheduler(self.devices, step_timeout=self.step_timeout)
        scheduler.start()
        self._scheduler = scheduler
        try:
            if not self._replicas:
                await self._build_replicas()
            if self._grads_dirty:
                await self._run_all(self._jobs().zero_grads, phase="zero_grad")
                self._grads_dirty = False
            yield scheduler
        finally:
            # Dropping a device replaces the scheduler: close whichever one is current.
            current, self._scheduler = self._scheduler, None
            self._running = False
            if current is not None:
                await current.aclose()

    async def _build_replicas(self) -> None:
        source = self._source
        first_param = next(source.parameters())
        parts = len(self.devices)

        def build(ctx: Any, index: int) -> Replica:
            device = self.devices[index]
            use_source = index == 0 and first_param.device == device.torch_device
            replica = build_replica(
                source,
                device,
                use_source=use_source,
                optimizer=self._optimizer_factory,
                scheduler=self._scheduler_factory,
            )
            replica.regroup(parts, index)
            return replica

        scheduler = self._require_scheduler()
        # Copies of one module are made one device at a time from the same source, so the
        # order of deepcopy and .to() cannot race; building happens once per trainer.
        result = await scheduler.run(build, list(range(parts)), items=[0] * parts, phase="setup")
        self._replicas = list(result.outputs)
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            await self._scheduler_run(self._jobs().load, [state] * parts, phase="setup")

    def _jobs(self) -> Jobs:
        return Jobs(self._replicas, self._step_fn, self._valid_step_fn, self._autocast)

    def _require_scheduler(self) -> StepScheduler:
        assert self._scheduler is not None
        return self._scheduler

    async def _scheduler_run(
        self, fn: Any, shards: Sequence[Any], *, phase: str, shield: bool = False
    ) -> Any:
        scheduler = self._require_scheduler()
        return await scheduler.run(
            fn,
            shards,
            items=[0] * len(shards),
            step=self.global_step,
            epoch=self.epoch,
            phase=phase,
            shield=shield,
        )

    async def _run_all(self, fn: Any, *, phase: str, shield: bool = False) -> Any:
        return await self._scheduler_run(fn, [None] * len(self.devices), phase=phase, shield=shield)

    # -- training ---------------------------------------------------------------------------

    async def _train_epoch(self, data: Iterable[Any], epochs: int) -> EpochRecord | None:
        """One epoch (or the rest of one); None when ``stop()`` ended it early."""
        epoch = self.epoch
        total = items_total(data)
        tracker = ProgressTracker(len(self.devices), total)
        tracked = [device.name for device in self.devices]  # a dropped device then adds zeros
        skip = self._batches_done
        resume_rng = None
        if skip and self._epoch_rng is not None:
            # Continue mid-epoch: replay the epoch's start so that the loader yields the same
            # order (a shuffling DataLoader draws its seed in iter()), then skip what was done.
            resume_rng = _checkpoint.capture_rng()
            _checkpoint.restore_rng(self._epoch_rng)
        else:
            self._epoch_rng = _checkpoint.capture_rng()
            skip = 0
        sums = Sums(0, 0.0, {})
        started = time.perf_counter()
        window = _Window()
        batches_per_step = 1 if self.split_batches else len(self.devices)
        pending: list[Any] = []
        seen = 0
        bar = self._progress_bar(epoch, epochs, total)
        transform = pin if self.pin_memory else None
        try:
            async with Prefetcher(
                data, depth=self.prefetch, transform=transform, name="train_data"
            ) as batches:
                async for batch in batches:
                    if resume_rng is not None:
                        _checkpoint.restore_rng(resume_rng)  # the loader has drawn its seed
                        resume_rng = None
                    seen += 1
                    if seen <= skip:
                        continue
                    pending.append(batch)
                    if len(pending) < batches_per_step:
                        continue
                    window.batches.append(self._checked(pending))
                    pending = []
                    if len(window.batches) < self.accumulate_grad_batches:
                        await self._policy(self._forward_backward, window, epoch)
                        continue
                    if not await self._finish_step(window, epoch, tracker, tracked, sums, bar):
                        return None
                    window = _Window()
                if resume_rng is not None:
                    _checkpoint.restore_rng(resume_rng)
                if pending:
                    window.batches.append(self._checked(pending))
                if window.batches and not await self._finish_step(
                    window, epoch, tracker, tracked, sums, bar
                ):
                    return None
        finally:
            bar.close()
        if seen == 0:
            raise DataError("train_data yielded no batches; give at least one batch per epoch")
        self.epoch += 1
        self._batches_done = 0
        self._epoch_rng = None
        seconds = time.perf_counter() - started
        items = max(sums.items, 1)
        record = EpochRecord(
            epoch=epoch,
            train_loss=sums.loss / items,
            train_metrics={k: v / items for k, v in sums.metrics.items()},
            valid_metrics=None,
            items=sums.items,
            seconds=seconds,
        )
        _log.info(
            "epoch %d: train_loss=%.6g over %d items in %.2fs",
            epoch,
            record.train_loss,
            record.items,
            seconds,
        )
        self._hub.publish(
            EpochEnded(epoch, record.train_loss, record.items, seconds, dict(record.train_metrics))
        )
        return record

    async def _finish_step(
        self,
        window: _Window,
        epoch: int,
        tracker: ProgressTracker,
        tracked: list[str],
        sums: Sums,
        bar: Any,
    ) -> bool:
        """Run the window's last forward/backward and the optimizer step; False on stop()."""
        assert self._step_lock is not None
        async with self._step_lock:
            lr = await self._policy(self._forward_backward_and_step, window, epoch)
        self.global_step += 1
        self._batches_done += sum(len(group) for group in window.batches)
        progress = tracker.update([window.device_items.get(name, 0) for name in tracked])
        sums.items += window.items
        sums.loss += window.loss
        for name, value in window.metrics.items():
            sums.metrics[name] = sums.metrics.get(name, 0.0) + value
        items = max(window.items, 1)
        loss = window.loss / items
        bar.update(window.items)
        bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
        self._hub.publish(
            StepEnded(
                epoch,
                self.global_step - 1,
                loss,
                window.items,
                progress,
                {k: v / items for k, v in window.metrics.items()},
                lr,
            )
        )
        return not self._stop_requested()

    def _stop_requested(self) -> bool:
        return self._stop_reason is not None

    @staticmethod
    def _checked(batches: list[Any]) -> list[Any]:
        for batch in batches:
            items_in(batch)  # a clear error, before any work, for a batch that cannot be split
        return batches

    def _shards(self, batches: list[Any]) -> list[Any]:
        """One shard per device: a split batch, or whole batches (None for a device without)."""
        n = len(self.devices)
        if self.split_batches:
            return split_batch(batches[0], n)
        if len(batches) > n:  # devices were dropped since these batches were grouped
            raise AssertionError("more batches than devices")
        return batches + [None] * (n - len(batches))

    async def _policy(self, action: Any, window: _Window, epoch: int) -> Any:
        """Run ``action(window)``; on a device failure, raise, retry or drop as configured."""
        attempt = 0
        while True:
            try:
                return await action(window, epoch)
            except WorkerFailedError as error:
                self._grads_dirty = True
                cause = error.__cause__
                if isinstance(cause, StepOutputError):
                    raise cause from None
                action_name = self._next_action(error, attempt)
                self._hub.publish(
                    WorkerFailed(
                        error.device.name,
                        error.epoch,
                        error.step,
                        error.phase,
                        str(error),
                        action_name,
                    )
                )
                if action_name == "raise":
                    raise
                await self._recover(error, action_name)
                attempt += 1
                self._hub.publish(StepRetried(epoch, self.global_step, attempt))
                window.done, window.items, window.loss = 0, 0, 0.0
                window.metrics, window.device_items = {}, {}

    def _next_action(self, error: WorkerFailedError, attempt: int) -> str:
        if self.on_failure == "retry" and attempt < self.max_retries:
            return "retry"
        if self.on_failure == "drop":
            failed = {error.device.name, *(f.device.name for f in error.other_failures)}
            if len(failed) < len(self.devices):
                return "drop"
        return "raise"

    async def _recover(self, error: WorkerFailedError, action: str) -> None:
        if action == "drop":
            failed = {error.device.name, *(f.device.name for f in error.other_failures)}
            await self._drop_devices(failed)
        else:
            await self._run_all(self._jobs().zero_grads, phase="zero_grad")
        self._grads_dirty = False

    async def _drop_devices(self, failed: set[str]) -> None:
        keep = [i for i, d in enumerate(self.devices) if d.name not in failed]
        remaining = tuple(self.devices[i] for i in keep)
        message = (
            f"dropping failed device(s) {', '.join(sorted(failed))}; training goes on with "
            f"{', '.join(d.name for d in remaining)}"
        )
        warnings.warn(message, DeviceDroppedWarning, stacklevel=4)
        _log.warning(message)
        old = self._require_scheduler()
        self._replicas = [self._replicas[i] for i in keep]
        self.devices = resolve_devices(remaining)
        for replica, device in zip(self._replicas, self.devices, strict=True):
            replica.device = device
        new = StepScheduler(self.devices, step_timeout=self.step_timeout)
        new.start()
        self._scheduler = new  # the session closes it
        with warnings.catch_warnings():
            # A hung device's thread is left behind on purpose: that is why it is dropped.
            warnings.simplefilter("ignore", RuntimeWarning)
            await old.aclose()
        await self._scheduler_run(
            self._jobs().regroup, [len(self.devices)] * len(self.devices), phase="setup"
        )
        await self._run_all(self._jobs().zero_grads, phase="zero_grad")
        for name in sorted(failed):
            self._hub.publish(DeviceDropped(name, tuple(d.name for d in self.devices)))

    async def _forward_backward(self, window: _Window, epoch: int) -> None:
        """Forward and backward for the window's batches not yet run."""
        scale = self._scaler.scale if self._scaler is not None else 1.0
        jobs = self._jobs()
        # Gradients now hold part of a step: if it does not end in an optimizer step (a
        # failure, a cancellation), the next fit starts by zeroing them.
        self._grads_dirty = True
        while window.done < len(window.batches):
            # Split when run, not when loaded: a dropped device changes the split.
            shards = self._shards(window.batches[window.done])
            counts = [_items(shard) for shard in shards]
            total = sum(counts)
            if total:
                if self.accumulate_grad_batches == 1:
                    weights = [scale * n / total for n in counts]
                else:  # the window's item count is known only at its end: divide then
                    weights = [scale * n for n in counts]
                result = await self._require_scheduler().run(
                    jobs.train,
                    list(zip(shards, weights, counts, strict=True)),
                    items=counts,
                    step=self.global_step,
                    epoch=epoch,
                    phase="train",
                )
                sums: Sequence[Sums] = result.outputs
                window.items += total
                window.loss += sum(s.loss for s in sums)
                for device_sums in sums:
                    for name, value in device_sums.metrics.items():
                        window.metrics[name] = window.metrics.get(name, 0.0) + value
                for device, count in zip(self.devices, counts, strict=True):
                    window.device_items[device.name] = (
                        window.device_items.get(device.name, 0) + count
                    )
            window.done += 1

    async def _forward_backward_and_step(self, window: _Window, epoch: int) -> float | None:
        await self._forward_backward(window, epoch)
        return await self._optimizer_step(window)

    async def _optimizer_step(self, window: _Window) -> float | None:
        """Reduce the gradients across devices, clip, and step every replica, all or none."""
        n = len(self.devices)
        jobs = self._jobs()
        if window.items == 0:
            return self._replicas[0].lr()
        scale = 1.0 if self.accumulate_grad_batches == 1 else 1.0 / window.items
        if self._scaler is not None:
            scale /= self._scaler.scale
        want_norm = self.gradient_clip_val is not None
        finite = True
        norm = 0.0
        if n > 1 or scale != 1.0 or want_norm or self._scaler is not None:
            reduced = await self._scheduler_run(
                jobs.reduce, [(scale, want_norm)] * n, phase="reduce"
            )
            norm = math.sqrt(sum(norm_sq for norm_sq, _ in reduced.outputs))
            finite = all(ok for _, ok in reduced.outputs)
        if self._scaler is not None:
            self._scaler.update(finite)
            if not finite:  # skip this step, as GradScaler does, with a smaller scale next time
                await self._run_all(jobs.zero_grads, phase="zero_grad")
                return self._replicas[0].lr()
        coefficient = 1.0
        if self.gradient_clip_val is not None and norm > self.gradient_clip_val:
            coefficient = self.gradient_clip_val / (norm + 1e-6)
        work = (coefficient, self.atomic_steps, self.lr_scheduler_interval == "step")
        try:
            applied = await self._scheduler_run(
                jobs.apply, [work] * n, phase="optimizer", shield=True
            )
        except BaseException:
            # Some replicas may have stepped: undo the step everywhere (shielded, so that it
            # happens even while the fit is being cancelled), then let the error go on.
            self._grads_dirty = True
            if self.atomic_steps:
                await self._run_all(jobs.rollback, phase="rollback", shield=True)
            else:
                self._consistent = False
            raise
        self._grads_dirty = False  # the apply jobs zeroed them
        lr: float | None = applied.outputs[0]
        return lr

    async def _validate(self, data: Iterable[Any], *, epoch: int | None) -> dict[str, float]:
        jobs = self._jobs()
        modes = [replica.model.training for replica in self._replicas]
        for replica in self._replicas:
            replica.model.eval()
        totals: dict[str, float] = {}
        items = 0
        batches_per_step = 1 if self.split_batches else len(self.devices)
        pending: list[Any] = []
        transform = pin if self.pin_memory else None
        try:
            async with Prefetcher(
                data, depth=self.prefetch, transform=transform, name="valid_data"
            ) as batches:
                async for batch in batches:
                    pending.append(batch)
                    if len(pending) == batches_per_step:
                        items += await self._validate_step(jobs, pending, totals, epoch)
                        pending = []
                if pending:
                    items += await self._validate_step(jobs, pending, totals, epoch)
        finally:
            for replica, mode in zip(self._replicas, modes, strict=True):
                replica.model.train(mode)
        if items == 0:
            raise DataError("valid_data yielded no items; give at least one batch")
        metrics = {name: value / items for name, value in totals.items()}
        _log.info("validation: %s over %d items", _format_metrics(metrics), items)
        self._hub.publish(ValidationEnded(epoch, dict(metrics), items))
        return metrics

    async def _validate_step(
        self, jobs: Jobs, batches: list[Any], totals: dict[str, float], epoch: int | None
    ) -> int:
        shards = self._shards(batches)
        counts = [_items(shard) for shard in shards]
        result = await self._require_scheduler().run(
            jobs.validate,
            list(zip(shards, counts, strict=True)),
            items=counts,
            step=self.global_step,
            epoch=epoch,
            phase="valid",
        )
        for sums in result.outputs:
            totals["loss"] = totals.get("loss", 0.0) + sums.loss
            for name, value in sums.metrics.items():
                totals[name] = totals.get(name, 0.0) + value
        return sum(counts)

    # -- checkpoints --------------------------------------------------------------------------

    def _position(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "global_step": self.global_step,
            "batches_done": self._batches_done,
            "epoch_rng": self._epoch_rng,
            "rng": _checkpoint.capture_rng(),
            "history": [
                {
                    **record.__dict__,
                    "train_metrics": dict(record.train_metrics),
                    "valid_metrics": dict(record.valid_metrics)
                    if record.valid_metrics is not None
                    else None,
                }
                for record in self.history
            ],
            "loss_scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "devices": [device.name for device in self.devices],
        }

    async def _snapshot(self) -> dict[str, Any]:
        n = len(self.devices)
        result = await self._scheduler_run(
            self._jobs().snapshot, [True] + [False] * (n - 1), phase="checkpoint"
        )
        state: dict[str, Any] = result.outputs[0]
        state.update(self._position())
        return state

    async def _save_epoch_checkpoint(self) -> None:
        assert self.checkpoint_dir is not None
        path = self.checkpoint_dir / _checkpoint.checkpoint_name(self.epoch, self.global_step)
        state = await self._snapshot()
        await anyio.to_thread.run_sync(_checkpoint.save, state, path)
        _log.info("checkpoint saved: %s", path)
        self._hub.publish(CheckpointSaved(str(path), self.epoch, self.global_step))

    async def _read_checkpoint(self, resume: str | os.PathLike[str]) -> dict[str, Any]:
        if str(resume) == "latest":
            if self.checkpoint_dir is None:
                raise ConfigurationError("resume='latest' needs Trainer(checkpoint_dir=...)")
            path = _checkpoint.latest_checkpoint(self.checkpoint_dir)
            if path is None:
                raise ConfigurationError(
                    f"resume='latest': no checkpoint in {str(self.checkpoint_dir)!r}"
                )
        else:
            path = Path(resume)
        return await anyio.to_thread.run_sync(_checkpoint.load, path)

    # -- display ------------------------------------------------------------------------------

    def _progress_bar(self, epoch: int, epochs: int, total: int | None) -> Any:
        enabled = self.progress_bar if self.progress_bar is not None else _interactive()
        return tqdm(
            total=total,
            desc=f"epoch {epoch + 1}/{epochs}",
            unit="item",
            dynamic_ncols=True,
            leave=True,
            disable=not enabled,
        )


def _items(shard: Any) -> int:
    return 0 if shard is None else items_in(shard)


def _interactive() -> bool:
    if "ipykernel" in sys.modules:
        return True
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


def _describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _format_metrics(metrics: Mapping[str, float]) -> str:
    return ", ".join(f"{name}={value:.6g}" for name, value in metrics.items())


def _to_cpu_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_cpu_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu_copy(item) for item in value]
    return value
