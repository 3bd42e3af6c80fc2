"""Epochs: iterating the data, stepping, validating, and closing each epoch exactly once.

The `Trainer` is built from three parts: ``_steps`` (one optimizer step across the
devices, and the failure policy), this module (epochs and validation), and ``_resume``
(where training is, for checkpoints and resuming). They share the trainer's state.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import torch
from tqdm.auto import tqdm

from . import _checkpoint, _comm
from ._checks import first_names, warn_user
from ._comm import PeerFailed, RankLost
from ._data import check_batch, no_batches, pin
from ._dsteps import DistributedSteps
from ._events import EpochEnded, StepEnded, ValidationEnded
from ._exceptions import (
    AsyncDDPError,
    AsyncDDPRuntimeWarning,
    ConfigurationError,
    StepOutputError,
    WorkerFailedError,
)
from ._jobs import Jobs, Sums, check_counts
from ._loader import ENDED, GAVE_UP, Prefetcher, after_left_behind
from ._progress import ProgressTracker
from ._ranks import batch_count, data_mark, in_memory, rank_items_total_off_loop
from ._replica import Replica, check_copies
from ._scheduler import StepScheduler
from ._steps import Window, shard_items
from ._sync import group_settings, restore_group_settings

__all__ = ["EpochRecord", "Epochs", "check_monitor", "check_monitor_fits"]

_log = logging.getLogger("asyncddp")


@dataclass(frozen=True)
class EpochRecord:
    """One epoch of training: means over every item it saw.

    Attributes:
        epoch: The epoch's number, from 0 (as ``range`` numbers; the progress bar and the
            demo count from 1).
        train_loss: The training loss, the mean over every item of the epoch.
        train_metrics: The step's other metrics, each the mean over every item.
        valid_metrics: Validation's loss and metrics, exact means over every validation item;
            ``None`` without ``valid_data``.
        items: Training items in the epoch.
        seconds: The time the epoch trained (its validation not counted).
    """

    epoch: int
    train_loss: float
    train_metrics: Mapping[str, float]
    valid_metrics: Mapping[str, float] | None
    items: int
    seconds: float

    @property
    def valid_loss(self) -> float | None:
        """Validation's loss, ``valid_metrics["loss"]``, beside ``train_loss``; ``None``
        without ``valid_data``."""
        return None if self.valid_metrics is None else self.valid_metrics["loss"]


class Epochs(DistributedSteps):
    """The epoch loop of `Trainer` (a mixin: the trainer owns the state)."""

    epoch: int
    history: list[EpochRecord]
    prefetch: int
    pin_memory: bool
    progress_bar: bool | None
    checkpoint_dir: Path | None
    check_finite: bool
    _batches_done: int
    _batches_loaded: int | None  # by the epoch's loader when training stopped (None: unknown)
    _loading: Prefetcher | None  # the epoch's loader, while it runs (stop() wakes its wait)
    _left_loading: Prefetcher | None  # the epoch's loader, closed inside a call into the data
    _epoch_rng: dict[str, Any] | None
    _epoch_shared: bool  # another trainer of this process trained as the epoch drew its order
    _warned_frozen: bool
    _warned_thawed: bool
    _loader_rng: dict[str, Any] | None
    _resumed_loader_rng: dict[str, Any] | None
    _epoch_sums: Sums
    _epoch_steps: int  # the optimizer steps of the epoch so far
    _replicas_compared: bool  # after the fit's first step (see _compare_replicas)
    _epoch_items: dict[str, int]
    _epoch_seconds: float
    _epoch_trained: bool
    _valid_rng: dict[str, Any] | None
    _stop_reason: str | None
    _step_lock: anyio.Lock | None
    _window_locked: bool  # the step lock is held for an optimizer step of several micro-steps
    _last_iterator: Callable[[], Any] | None
    _cancelled_in_step: BaseException | None
    _batches_world: int  # how many processes counted _batches_done (each its own)
    _checkpoint_owed: bool  # the last closed epoch's checkpoint is not written yet
    _items_trained: int  # by every step this trainer took, in all its calls

    async def _save_epoch_checkpoint(self) -> None:
        raise NotImplementedError

    def _remember_iterator(self, data: Iterable[Any]) -> None:
        """Note an iterator this epoch reads (see Trainer._check_continued): weakly where its
        type allows, so that it does not outlive its user's references."""
        if not isinstance(data, Iterator):
            self._last_iterator = None
            return
        try:
            self._last_iterator = weakref.ref(data)
        except TypeError:  # list_iterator and others: kept until the epoch ends or a load
            self._last_iterator = lambda: data

    def _unlock_window(self) -> None:
        if self._window_locked:
            assert self._step_lock is not None
            self._window_locked = False
            self._step_lock.release()

    def _prefetcher(
        self, data: Iterable[Any], name: str, source: object, **replay: Any
    ) -> Prefetcher:
        """Batches of ``data`` (``source``, the user's data, or a rank's view of it) loaded on
        a thread, ahead, page-locked when going to a GPU. A list or tuple of batches, with
        nothing to page-lock, is read on the event loop: there is nothing to load, and a
        loader thread would only add a thread wake-up a step. ``replay``: how the epoch's
        start is replayed (see `Prefetcher`)."""
        transform = pin if self.pin_memory else None
        inline = transform is None and in_memory(data)
        return Prefetcher(
            data,
            depth=self.prefetch,
            transform=transform,
            name=name,
            inline=inline,
            source=source,
            **replay,
        )

    async def _used_up(
        self, batches: Prefetcher, view: Iterable[Any], seen: int, skip: int
    ) -> bool:
        """At a stop: whether this rank's part of the epoch is used up: the loader already
        reached the end, or ``seen`` is the data's exact batch count (`batch_count`). In the
        latter case the loader's last ``next()``, the one that ends the iteration, is waited
        for: it may still draw from the loader's generators (``RandomSampler`` draws one more
        permutation as its iterator ends), whose state the epoch's end takes
        (``_loader_rng``). Not while a continued epoch's replay (``skip`` batches) runs, which
        a stop cuts short instead (see `Prefetcher`): the epoch stays unfinished. When neither
        tells, the epoch stays unfinished too, with no wait for the loader, which may be inside
        a long ``next()``: the next fit reads the data again, skips the batches done and,
        finding none left, closes the epoch."""
        ended = batches.used_up()
        if ended is None:
            count = batch_count(view)
            if count is None or seen < count or seen == skip:
                return False
            ended = await batches.next() is ENDED  # a batch more: the count was wrong
        return ended

    def _count_left_loading(self) -> None:
        """Count the batch the epoch's loader thread, left inside a call into the data by a
        stop or a cancellation, went on to load, once it has returned: that batch's draws
        from the generators were made, so a continued epoch's replay loads it too before it
        puts the generators back (see `Prefetcher`)."""
        left = self._left_loading
        if left is not None and not left.left_behind:
            self._left_loading = None
            self._batches_loaded = max(self._batches_loaded or 0, left.loaded)

    async def _after_left_loading(self) -> None:
        """Wait (cancellably) for the epoch's loader thread left inside a call into the data,
        if any, to return, and count what it loaded: a checkpoint then holds the generators
        and the count together."""
        left = self._left_loading
        if left is not None:
            await after_left_behind(left.source)
        self._count_left_loading()

    @staticmethod
    def _warn_replay_shared(data: object, epoch: int, skip: int) -> None:
        """A continued epoch replays an order drawn from torch's global generator, which
        another trainer of this process draws from as well."""
        warn_user(
            f"continuing epoch {epoch} after its first {skip} batch(es) replays its shuffle "
            "order from torch's global generator, and another Trainer of this process "
            "trains meanwhile (or did as the epoch started), which may draw from that "
            "generator too (its dropout, its own shuffling): the order replayed may not be "
            "the interrupted one, training some batches twice and others never, and the "
            "replay's rewind of the generator repeats the other trainer's draws. Give each "
            "trainer's DataLoader a generator of its own: "
            "DataLoader(..., generator=torch.Generator().manual_seed(seed))",
            AsyncDDPRuntimeWarning,
        )

    @staticmethod
    def _warn_shorter(data: object, epoch: int, batches: int, skip: int) -> None:
        """A continued epoch's data ended before the batches it had trained on."""
        warn_user(
            f"train_data ({type(data).__name__}) has {batches} batch(es) in epoch {epoch}, but "
            f"the run this continues stopped in that epoch after {skip}: the epoch ends with "
            "nothing more trained. A mid-epoch stop or checkpoint counts batches, so continue "
            "it with the same data (the same dataset, batch size and sampler); for other "
            "data, continue from a checkpoint written at the end of an epoch"
        )

    async def _train_epoch(self, data: Iterable[Any], epochs: int) -> bool:
        """Train on the epoch's batches (or the rest of them); False when ``stop()`` came first."""
        shared = any(trainer is not self for trainer in _TRAINING)
        _TRAINING.add(self)
        try:
            return await self._run_train_epoch(data, epochs, shared)
        finally:
            _TRAINING.discard(self)

    async def _run_train_epoch(self, data: Iterable[Any], epochs: int, shared: bool) -> bool:
        """`_train_epoch`, ``shared`` telling whether another trainer of this process is
        training meanwhile."""
        # Before the generators are captured or put back below: a loader an earlier call
        # left inside a call into this data may still draw from them; so may the loader of
        # the epoch this continues, whatever data it read (a new DataLoader over the same
        # dataset, a new generator), and the batch it loads counts among those the replay
        # loads.
        await after_left_behind(data)
        await self._after_left_loading()
        epoch, skip, replay = self.epoch, self._batches_done, {}
        rank, world = (self._comm.rank, self._comm.world_size) if self._comm else (0, 1)
        if self._comm is not None:  # the steps' exchanges compare it (every rank's the same)
            self._comm.data = ("train_data", data_mark(data))
        # Progress (and the bar) count this process's devices: its part of the data.
        mine = await rank_items_total_off_loop(data, rank, world)
        if skip and self._epoch_rng is not None and self._batches_world != world:
            # Each rank counts its own batches, in an order of the ranks' own (their seed).
            raise ConfigurationError(
                f"the training state stopped in mid-epoch, after {skip} batches on each of "
                f"{self._batches_world} process(es): continue it on as many (not {world}), or "
                "from a checkpoint written at the end of an epoch"
            )
        self._batches_world = world
        view = self._rank_data(data, epoch)
        if self._epoch_rng is not None:
            # Continue mid-epoch (``skip``): replay the epoch's start so that the loader yields
            # the same order (a shuffling DataLoader draws its seed in iter(), from torch's
            # generator or from one of its own), then skip what was done. Or, the epoch started
            # before and none of its batches was trained on (a fit cancelled in its first step,
            # or a checkpoint from then): start it again as it started, the generators
            # included, whatever the loader of the cancelled start drew since.
            if skip and (shared or self._epoch_shared) and _order_from_global(data):
                self._warn_replay_shared(data, epoch, skip)
            if skip:
                # The loader thread loads as many batches as the interrupted run's had, drawing
                # what it drew (augmentation in the main process), then puts the generators
                # back as they are now, before training on any batch: the step's own draws go
                # on from there too.
                now = _checkpoint.capture_rng()
                replay = {
                    "skip": skip,
                    "replay": self._batches_loaded or skip,  # unknown in older checkpoints
                    "resume": lambda: _checkpoint.restore_rng(now),
                }
            started_new = self._epoch_rng.get("new_iterator")  # absent from older checkpoints
            if started_new is False and _checkpoint.draws_base_seed(view):
                # The epoch's start reset a persistent-workers loader's iterator, which draws
                # no base seed; this loader has none yet. Made now (its workers started), the
                # replay's iter() resets it and draws as the epoch's start did.
                await anyio.to_thread.run_sync(iter, view)
            _checkpoint.restore_rng(self._epoch_rng, data)
            if started_new and _checkpoint.draws_base_seed(view) is False:
                # The epoch's start made the loader's iterator, which drew its workers' base
                # seed before the order; the replay's iter() only resets it: draw the seed's
                # place, from where the loader drew it.
                generator = getattr(view, "generator", None)  # None: torch's
                torch.empty((), dtype=torch.int64).random_(generator=generator)
        else:
            if self._resumed_loader_rng is not None:
                # From a checkpoint written between epochs: a new loader's generators go on
                # from where the saved run's were, as the global generators do.
                _checkpoint.restore_loader_rng(data, self._resumed_loader_rng)
            self._epoch_rng = _checkpoint.capture_rng(data)
            self._epoch_rng["new_iterator"] = _checkpoint.draws_base_seed(view)
            self._epoch_shared = shared
            skip, self._batches_loaded, self._left_loading = 0, None, None
        self._resumed_loader_rng = None
        tracked = [d.name for d in self.devices] + [
            name for name in self._epoch_items if name not in {d.name for d in self.devices}
        ]  # a device dropped earlier in the epoch keeps its count
        tracker = ProgressTracker(
            len(tracked),
            mine,
            start=[self._epoch_items.get(n, 0) for n in tracked],
            steps=self._epoch_steps,  # counts never go back in a continued epoch
        )
        started = time.perf_counter() - self._epoch_seconds
        window, seen, exhausted = Window(), skip, True
        pending: list[Any] = []
        bar = self._progress_bar(epoch, epochs, mine, tracker.progress.items_processed)
        self._last_global = None

        async def step(window: Window) -> None:
            await self._step(window, epoch, True, tracker, tracked, bar)

        self._remember_iterator(data)
        prefetcher = self._prefetcher(view, "train_data", data, **replay)
        # Between optimizer steps, a stop() ends a wait for the loader: the step boundary is
        # now. Not across processes, where a stop takes effect once the ranks agree on it in
        # a step's exchange.
        give_up = None if self._distributed() else self._should_stop
        try:
            async with prefetcher as batches:
                self._loading = prefetcher  # stop() wakes its wait for a batch
                while True:
                    batch = await batches.next(
                        give_up if not window.batches and not pending else None
                    )
                    if batch is ENDED:
                        if prefetcher.loaded < skip:
                            self._warn_shorter(data, epoch, prefetcher.loaded, skip)
                        if pending:
                            window.batches.append(pending)
                        if window.batches:
                            await step(window)
                        if self._distributed():
                            exhausted = await self._drain(step)
                        break
                    if batch is GAVE_UP:  # stop() while waiting for the loader
                        exhausted = await self._used_up(batches, view, seen, skip)
                        break
                    seen += 1
                    # A clear error, before any work, for a batch we cannot split.
                    check_batch(batch, data, "train_data")
                    pending.append(batch)
                    per_step = 1 if self.split_batches else len(self.devices)
                    if len(pending) < per_step:
                        continue
                    window.batches.append(pending[:per_step])
                    pending = pending[per_step:]
                    # >=: a window regrouped for fewer devices after a drop (Window.restart)
                    # may hold as many micro-steps already.
                    final = len(window.batches) >= self.accumulate_grad_batches
                    await self._step(window, epoch, final, tracker, tracked, bar)
                    if final:
                        window = Window()
                        await self._hub.settle()  # a stop() from a StepEnded consumer
                        if self._should_stop():
                            # Stopped: the epoch is over only if the data is used up too,
                            # which is not waited for (see _used_up) but for its end.
                            exhausted = await self._used_up(batches, view, seen, skip)
                            if self._distributed():
                                exhausted = await self._all_exhausted(exhausted)
                            break
        finally:
            self._loading = None
            # A replay cut short kept the count it replayed to: its resume put the generators
            # back as they were then. A thread left inside next() counts its batch once it
            # returns (_count_left_loading).
            self._batches_loaded = max(self._batches_loaded or 0, prefetcher.loaded)
            self._left_loading = prefetcher if prefetcher.left_behind else None
            self._unlock_window()  # left in mid-window (cancelled while it waited for a batch)
            bar.close()
            self._epoch_seconds = time.perf_counter() - started
        if not exhausted:
            return False
        self._loader_rng = _checkpoint.capture_loader_rng(data)  # for a checkpoint from here
        sums = self._epoch_sums  # across ranks: a rank may have no batch of its own
        if sums.items == 0:  # no step taken: its loss would be a mean over nothing
            raise no_batches(
                "train_data",
                data,
                training=True,
                counted=sums.counted,
                batches=seen > 0 or self._distributed(),
            )
        self._epoch_trained = True
        record = self._epoch_record(epoch)
        if not math.isfinite(record.train_loss) and not self.check_finite:
            warn_user(
                f"epoch {epoch}'s training loss is {record.train_loss}: the parameters are "
                "likely non-finite too. Trainer(check_finite=True) stops at the first "
                "non-finite loss and names its device and step",
                AsyncDDPRuntimeWarning,
            )
        _log.info(
            "epoch %d: train_loss=%.6g over %d items in %.2fs",
            epoch,
            record.train_loss,
            record.items,
            record.seconds,
        )
        self._hub.publish(
            EpochEnded(
                epoch, record.train_loss, record.items, record.seconds, dict(record.train_metrics)
            )
        )
        return True

    async def _step(
        self,
        window: Window,
        epoch: int,
        final: bool,
        tracker: ProgressTracker,
        tracked: list[str],
        bar: Any,
    ) -> None:
        """One micro-step of ``window``; with ``final``, the optimizer step and its reports.

        The step lock is held from the window's first micro-step to the end of its last: a
        checkpoint sees either all of an optimizer step or none of it, its accumulating
        micro-steps (their batches, BatchNorm updates and random draws) included."""
        assert self._step_lock is not None
        if not self._window_locked:
            await self._step_lock.acquire()
            self._window_locked = True
        if not final:
            try:
                await self._run_step(window, epoch, final=False)
            except BaseException:
                self._unlock_window()  # the window is undone
                raise
            return  # still held: the window's next micro-step comes
        try:
            lr = await self._run_step(window, epoch, final=True)
            self._batches_done += window.batch_count
            self._epoch_sums.add(window.sums)
            self._items_trained += window.sums.items  # for FitResult.items_per_second
            for name, count in window.device_items.items():
                self._epoch_items[name] = self._epoch_items.get(name, 0) + count
            taken = window.sums.items > 0  # else nothing to learn from: no step was taken
            if taken:
                self.global_step += 1
                self._epoch_steps += 1
                if window.sums.counted or self._distributed() or self._scaler is not None:
                    # What the next steps' counts are weighted against (the same on every
                    # rank); across ranks, a step with as many items as this one then needs
                    # no scaling of its reduced gradients (see _reference_count). Under a
                    # loss scale, a step's share of items, not a first small batch's.
                    self._items_ref = float(window.sums.items)
        finally:
            self._unlock_window()
        # A cancellation that came once the step was taken (see `_apply`) goes on after the
        # step is told of, as the step is counted: progress, the bar and StepEnded.
        cancelled, self._cancelled_in_step = self._cancelled_in_step, None
        # The window's batches are done, whether it made a step or not.
        entries = [window.device_items.get(name, 0) for name in tracked]
        progress = tracker.update(entries, step=taken)
        if not bar.disable:
            bar.update(sum(entries))
        if taken:
            items = window.sums.items
            loss = window.sums.loss / items
            if not bar.disable:
                bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            self._hub.publish(
                StepEnded(
                    epoch,
                    self.global_step - 1,
                    loss,
                    items,
                    progress,
                    window.sums.means(),
                    lr,
                )
            )
        if cancelled is not None:
            raise cancelled
        if taken and not self._replicas_compared:
            self._replicas_compared = True
            self._warn_if_frozen_written()
            await self._compare_replicas("this fit's first step")

    async def _compare_replicas(self, after: str) -> None:
        """Refuse to go on from replicas whose parameters differ (CPU devices only; across
        processes, each process's own: see `Jobs.differs`). A step that writes a parameter in
        place writes each device's copy by that device's share of the batch
        (``nn.Embedding(max_norm=...)`` renormalizing the rows it looks up; a frozen
        parameter the forward updates from the data): the copies drift apart with no error,
        and the model saved is the first's. Their parts are compared on every kind of device
        (`check_copies`)."""
        check_copies(self._replicas)
        self._warn_if_thawed()
        if len(self._replicas) < 2 or any(d.torch_device.type != "cpu" for d in self.devices):
            return
        result = await self._scheduler_run(
            self._jobs().differs, [None] * len(self.devices), phase="check"
        )
        for device, found in zip(self.devices, result.outputs, strict=True):
            if found is not None:
                name, how = found
                raise AsyncDDPError(
                    f"after {after}, parameter {name!r} differs between "
                    f"{self.devices[0].name}'s copy of the model and {device.name}'s ({how}): "
                    "the step "
                    "or the model's forward changed it in place, each device by its own share "
                    "of the batch (nn.Embedding(max_norm=...) renormalizes the rows it looks "
                    "up; a parameter updated from the data), so the copies drift apart. Keep "
                    "state the forward updates in a buffer (register_buffer: the trainer "
                    "takes the first device's after each step, as DDP does), and make in-place "
                    "changes to parameters the same on every device (renormalize every row, "
                    "not those of the batch)"
                    + (
                        ". A frozen parameter the step updates (an EMA or mean teacher's "
                        "weights) also differs where a device's share was empty (the step is "
                        "not called for it) or a failed step was retried (its write is not "
                        "undone): keep such weights as buffers"
                        if not dict(self._replicas[0].model.named_parameters())[name].requires_grad
                        else ""
                    )
                )

    def _warn_if_thawed(self) -> None:
        """Warn, once, of parameters the step thawed (``requires_grad_(True)``) that no
        optimizer holds (frozen when the replicas were built): their gradients are made, and
        never applied. (Thawed between calls, `check_rebuilt` warns.)"""
        thawed = [
            name
            for name, param in self._replicas[0].model.named_parameters()
            if param.requires_grad and id(param) not in self._grad_known
        ]
        if thawed and not self._warned_thawed:
            self._warned_thawed = True
            warn_user(
                f"{first_names(thawed)} of trainer.model require grad now, thawed during the "
                "fit, but were frozen when the Trainer built its replicas: no optimizer holds "
                "them, so their gradients are made and never applied. Have them trainable "
                "when the replicas are built (the first fit, validate or save_checkpoint), and "
                "freeze them after (the optimizers skip parameters without a gradient)",
                AsyncDDPRuntimeWarning,
            )

    def _warn_if_frozen_written(self) -> None:
        """Warn, once, where the fit's first step changed a frozen parameter of
        ``trainer.model`` in place (`Steps._mirror_first` noted their versions): an EMA or mean
        teacher kept as parameters. The backup of a step covers the trained parameters and
        the buffers: a failed step's write to such a one is not undone, and its retry writes
        it again."""
        written = [
            name for name, param, version in self._frozen_versions if param._version != version
        ]
        self._frozen_versions = []
        if written and not self._warned_frozen:
            self._warned_frozen = True
            warn_user(
                "the step changed frozen parameters of trainer.model in place "
                f"({first_names(written)}: an "
                "EMA or mean teacher's weights, say). A failed step's undo restores the trained "
                "parameters and the buffers, not these: a retried step (on_failure='retry', or "
                "fit called again) writes them twice, and a device whose share of a batch is "
                "empty skips the step and its write. Keep such weights as buffers "
                "(register_buffer), which the undo restores and every device takes from the "
                "first after each step",
                AsyncDDPRuntimeWarning,
            )

    def _epoch_record(self, epoch: int) -> EpochRecord:
        sums = self._epoch_sums
        items = max(sums.items, 1)
        return EpochRecord(
            epoch,
            sums.loss / items,
            sums.means(),
            None,
            sums.items,
            self._epoch_seconds,
        )

    async def _finish_streams(self, scheduler: StepScheduler) -> None:
        """Wait for the kernels a lone GPU's last step left running (see
        ``Jobs.train_and_step``) as a step waits for its own (up to ``step_timeout``): closing
        the workers waits at most ``drain_timeout``, and ``trainer.model`` is read once the
        session ends. An error of theirs (an asynchronous CUDA error) raises, as the step's."""
        epoch = self.epoch - 1 if self._batches_done == 0 and self.epoch else self.epoch
        try:
            await scheduler._finish_stream_work(step=max(self.global_step - 1, 0), epoch=epoch)
        except WorkerFailedError as error:
            self._publish_failure(error, "raise")
            raise

    async def _end_epoch(
        self, valid_data: Iterable[Any] | None, train_data: Iterable[Any]
    ) -> EpochRecord:
        """Validate, step the epoch's LR schedulers and close the epoch: once, even if cancelled
        and called again."""
        record = self._epoch_record(self.epoch)
        if self._epoch_steps:  # before the validation: a cancellation after it closes the epoch
            await self._compare_replicas(f"epoch {record.epoch}")
        if valid_data is not None:
            if self._resumed_loader_rng is not None:
                # Resumed from a checkpoint written after the epoch's training, before its end:
                # the new train loader's generators go on from where the saved run's were, now,
                # as the validation may draw from them (one generator for both loaders). Again
                # for a validation run again, until one has run to its end.
                _checkpoint.restore_loader_rng(train_data, self._resumed_loader_rng)
            # A validation cut short (a cancellation before the epoch closed) runs again in
            # the next fit: from the same generators' states, so that what it draws (a
            # DataLoader draws its seed in iter(), from torch's generator or its own) is drawn
            # once, and the next epoch draws as it would have.
            if self._valid_rng is None:
                self._valid_rng = _checkpoint.capture_rng(valid_data)
            else:
                _checkpoint.restore_rng(self._valid_rng, valid_data)
            record = dataclasses.replace(
                record, valid_metrics=await self._validate(valid_data, epoch=record.epoch)
            )
            # Where the epoch ends: the validation's iter() drew its seed from the train
            # loader's generator too, where the loaders share one.
            self._loader_rng = _checkpoint.capture_loader_rng(train_data)
            self._resumed_loader_rng = None  # the generators are where the epoch ends
        # Before the LR step's lock: a monitored metric the epoch lacks raises with nothing
        # stepped, and the next fit validates again and steps then.
        metric = (
            None
            if self.lr_scheduler_monitor is None
            else _monitored(record, self.lr_scheduler_monitor)
        )
        stepping = any(replica.scheduler is not None for replica in self._replicas)
        if stepping and self._scheduler is not None and self.lr_scheduler_interval == "epoch":
            # The epoch's last step may have left its optimizer step queued on a lone GPU: the
            # LR step, on this thread's stream, must not write a hyperparameter that is a
            # tensor on the GPU (a capturable or fused optimizer's) before that step reads it.
            await self._finish_streams(self._scheduler)
        assert self._step_lock is not None
        async with self._step_lock:
            # No await in here: the LR step and the move to the next epoch are one.
            if self.lr_scheduler_interval == "epoch":
                with warnings.catch_warnings():
                    # After a resume between an epoch's last step and its end, no optimizer
                    # step has run in this process yet, and torch would warn about the order.
                    warnings.filterwarnings(
                        "ignore", "Detected call of `lr_scheduler.step", UserWarning
                    )
                    _step_schedulers(self._replicas, metric)
            self.history.append(record)
            self.epoch += 1
            self._batches_done, self._epoch_rng, self._epoch_trained = 0, None, False
            self._valid_rng = None
            self._batches_loaded, self._left_loading = None, None
            self._epoch_sums, self._epoch_items, self._epoch_seconds = Sums(), {}, 0.0
            self._epoch_steps = 0
            # Across ranks, rank 0 writes. Owed until written: a fit cancelled, or a write
            # that failed, leaves it to the next fit, which writes it before it trains.
            self._checkpoint_owed = self.checkpoint_dir is not None and (
                self._comm is None or self._comm.rank == 0
            )
        await self._pay_checkpoint()
        return record

    async def _pay_checkpoint(self) -> None:
        """Write the epoch checkpoint a closed epoch still owes (see `_end_epoch`); none if
        ``checkpoint_dir`` was set to None since. Still owed if the write fails."""
        if self._checkpoint_owed and self.checkpoint_dir is not None:
            await self._save_epoch_checkpoint()
        self._checkpoint_owed = False

    async def _validate(self, data: Iterable[Any], *, epoch: int | None) -> dict[str, float]:
        jobs = self._jobs()
        # Each module's own mode, put back as it was (see _restore_modes).
        modes = [
            [(module, module.training) for module in replica.model.modules()]
            for replica in self._replicas
        ]
        for replica in self._replicas:
            replica.model.eval()
        totals, pending = Sums(), []
        name = "data" if epoch is None else "valid_data"  # validate(data) or fit(valid_data=)
        if self._comm is not None:  # the validation's exchange compares it
            self._comm.data = (name, data_mark(data))
        try:
            async with self._prefetcher(self._rank_data(data, 0), name, data) as batches:
                async for batch in batches:
                    check_batch(batch, data, name)  # before any work of its step
                    pending.append(batch)
                    if len(pending) == (1 if self.split_batches else len(self.devices)):
                        await self._validate_step(jobs, pending, totals, epoch)
                        pending = []
                if pending:
                    await self._validate_step(jobs, pending, totals, epoch)
        finally:
            for replica_modes in modes:
                _restore_modes(replica_modes)
        if self._distributed():  # exact over every rank's items
            result = await self._exchange(
                _comm.VALIDATION,
                totals,
                active=bool(totals.items or totals.counted),
                last=epoch is None,
            )
            if 0 < result.counted < result.active:
                raise StepOutputError(
                    f"the validation step returned 'items' on {result.counted} of the "
                    f"{result.active} processes with data; return it always, or never"
                )
            totals = Sums(
                result.items,
                result.loss,
                dict(result.metrics),
                counted=totals.counted,
                metric_items=dict(result.metric_items),
            )
        items = totals.items  # the shards' sizes, or the counts the step gave ("items")
        if items == 0:
            raise no_batches(name, data, training=False, counted=totals.counted)
        metrics = {"loss": totals.loss / items, **totals.means()}
        _log.info("validation: %s over %d items", _format(metrics), items)
        self._hub.publish(ValidationEnded(epoch, dict(metrics), items))
        return metrics

    async def _validate_step(
        self, jobs: Jobs, batches: list[Any], totals: Sums, epoch: int | None
    ) -> None:
        shards = self._shards(batches)
        counts = [shard_items(shard) for shard in shards]
        try:
            result = await self._require_scheduler().run(
                jobs.validate,
                list(zip(shards, counts, strict=True)),
                items=counts,
                step=self.global_step,
                epoch=epoch,
                phase="valid",
            )
        except WorkerFailedError as error:
            # No policy applies to validation (it changes no state): a failure raises.
            if isinstance(error.__cause__, StepOutputError):
                # A mistake in the step, not a device fault; without the cause's link back
                # to ``error`` (its __context__), no cycle holds the step's output.
                output_error, error.__cause__ = error.__cause__, None
                try:
                    raise output_error from None
                finally:
                    del output_error
            if not isinstance(error.__cause__, (PeerFailed, RankLost)):
                self._publish_failure(error, "raise")
            raise
        check_counts(list(result.outputs), totals, validation=True)
        for sums in result.outputs:
            totals.add(sums)

    def _progress_bar(self, epoch: int, epochs: int, total: int | None, done: int) -> Any:
        enabled = self.progress_bar if self.progress_bar is not None else _interactive()
        enabled = enabled and (self._comm is None or self._comm.rank == 0)  # one bar, rank 0's
        if not enabled:
            # Not tqdm(disable=True): any tqdm starts tqdm's monitor thread, which stays for
            # the process's life (a service with no bar would carry it).
            return _NO_BAR
        return tqdm(
            total=total,
            initial=done,
            desc=f"epoch {epoch + 1}/{epochs}",
            unit="item",
            dynamic_ncols=True,
            leave=True,
        )


class _NoBar:
    """The progress bar where none is shown."""

    disable = True

    def close(self) -> None:
        pass


_NO_BAR = _NoBar()

#: The trainers of this process in a training epoch (see `_train_epoch`).
_TRAINING: weakref.WeakSet[Any] = weakref.WeakSet()


def _order_from_global(data: object) -> bool:
    """Whether ``data`` is a ``DataLoader`` whose sampler draws its order from torch's global
    generator: a ``RandomSampler`` (or another that takes a ``generator``) given none."""
    if not isinstance(data, torch.utils.data.DataLoader):
        return False
    sampler = getattr(data.batch_sampler, "sampler", None)
    if sampler is None:
        sampler = data.sampler
    return hasattr(sampler, "generator") and sampler.generator is None


def _interactive() -> bool:
    """Whether a bar is wanted by default: in a notebook (a running Jupyter kernel), or where
    stderr, which tqdm writes, is a terminal."""
    return _in_a_kernel() or bool(getattr(sys.stderr, "isatty", lambda: False)())


def _in_a_kernel() -> bool:
    """Whether this process is a running Jupyter kernel, not one that imported ipykernel (a
    script did, and its log got the bar)."""
    if "ipykernel" not in sys.modules:
        return False
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    shell = get_ipython() if callable(get_ipython) else None
    return getattr(shell, "kernel", None) is not None


def _format(metrics: Mapping[str, float]) -> str:
    return ", ".join(f"{name}={value:.6g}" for name, value in metrics.items())


def _restore_modes(modes: list[tuple[torch.nn.Module, bool]]) -> None:
    """Put each module back in its mode, through ``train()``, as it was. Not ``train(mode)``
    on the root alone, which would also put back in training a submodule frozen with
    ``eval()`` (a fine-tuned BatchNorm); nor the ``training`` flags alone, which would skip a
    module's own ``train()`` (a LoRA layer unmerges its adapter there). In ``modules()`` order,
    parents first: a child whose mode differs from its parent's is put back after it."""
    for module, mode in modes:
        if module.training != mode:
            module.train(mode)


def _step_schedulers(replicas: list[Replica], metric: float | None = None) -> None:
    """Step every replica's per-epoch LR scheduler, or none: one that raises (a ``LambdaLR``
    whose function fails) would leave the replicas' schedules, and so their learning rates,
    apart. torch's ``step()`` counts the epoch before it computes the rates, so the ones
    stepped, the failed one included, are put back as they were, their optimizers' rates too.
    ``metric``: what a ``ReduceLROnPlateau`` steps on (``lr_scheduler_monitor``'s value).
    Plain Python on floats: no tensor work."""
    stepped: list[tuple[Any, dict[str, Any], list[dict[str, Any]]]] = []
    try:
        for replica in replicas:
            scheduler = replica.scheduler
            if scheduler is not None:
                settings = [group_settings(group) for group in replica.optimizer.param_groups]
                stepped.append((replica, scheduler.state_dict(), settings))
                if metric is None:
                    scheduler.step()
                else:
                    scheduler.step(metric)
    except BaseException:
        for replica, state, settings in stepped:
            replica.scheduler.load_state_dict(state)
            for group, saved in zip(replica.optimizer.param_groups, settings, strict=True):
                restore_group_settings(group, saved)
        raise


_MONITOR_FORM = (
    "'valid_loss' (validation's loss, with valid_data), 'train_loss', or 'valid_<name>' / "
    "'train_<name>' for a metric the step returns"
)


def check_monitor(monitor: object, interval: str) -> None:
    """Refuse an ``lr_scheduler_monitor`` that names no metric of an `EpochRecord`, or one
    given with ``lr_scheduler_interval="step"`` (a metric is known once an epoch)."""
    if monitor is None:
        return
    if (
        not isinstance(monitor, str)
        or monitor in ("train_", "valid_")
        or not monitor.startswith(("train_", "valid_"))
    ):
        raise ConfigurationError(f"lr_scheduler_monitor must be {_MONITOR_FORM}, not {monitor!r}")
    if interval != "epoch":
        raise ConfigurationError(
            f"lr_scheduler_monitor={monitor!r} steps the LR scheduler on an epoch's metric, "
            f"once an epoch, but lr_scheduler_interval is {interval!r}: leave it 'epoch'"
        )


def check_monitor_fits(
    replicas: list[Replica],
    monitor: str | None,
    interval: str,
    valid_data: Iterable[Any] | None,
    *,
    trains: bool,
) -> None:
    """As a fit starts, its replicas built: a ``ReduceLROnPlateau`` needs a monitored
    metric (and steps once an epoch), a scheduler that steps on its own takes none, and
    ``valid_...`` needs ``valid_data`` if the fit ``trains`` an epoch."""
    scheduler = replicas[0].scheduler if replicas else None
    plateau = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if plateau and monitor is None:
        raise ConfigurationError(
            "ReduceLROnPlateau steps on a metric, once an epoch: name the one it watches with "
            f"Trainer(..., lr_scheduler_monitor=...), {_MONITOR_FORM}"
            + (
                f", and leave lr_scheduler_interval 'epoch' (not {interval!r})"
                if interval != "epoch"
                else ""
            )
        )
    if monitor is not None and not plateau:
        got = "no lr_scheduler" if scheduler is None else type(scheduler).__name__
        raise ConfigurationError(
            f"lr_scheduler_monitor={monitor!r} names the metric a ReduceLROnPlateau steps on, "
            f"and this trainer has {got}, which steps on no metric: leave "
            "lr_scheduler_monitor None"
        )
    if monitor is not None and monitor.startswith("valid_") and valid_data is None and trains:
        raise ConfigurationError(
            f"lr_scheduler_monitor={monitor!r} is a validation metric, and this fit has no "
            "valid_data: pass fit(..., valid_data=...), or monitor 'train_loss'"
        )


def _monitored(record: EpochRecord, monitor: str) -> float:
    """The value of ``monitor`` (``lr_scheduler_monitor``) in the epoch's record."""
    split, name = monitor.split("_", 1)
    metrics: Mapping[str, float] | None
    if split == "train":
        metrics = {"loss": record.train_loss, **record.train_metrics}
    else:
        metrics = record.valid_metrics
    if metrics is None or name not in metrics:
        known = ", ".join(repr(f"{split}_{key}") for key in metrics or {}) or "none"
        raise ConfigurationError(
            f"lr_scheduler_monitor={monitor!r}: epoch {record.epoch} has no such metric "
            f"(its {'training' if split == 'train' else 'validation'} metrics: {known}); "
            f"name one of these, or return it as a dict entry ({{'loss': ..., {name!r}: ...}}) "
            "from the step"
            + (" (from valid_step, where the trainer has one)" if split == "valid" else "")
        )
    return metrics[name]
