"""One optimizer step across the devices, and what happens when a device fails in it.

A step is a *window* of one or more batches (``accumulate_grad_batches``):

1. forward and backward of each batch on every device (``train`` jobs), gradients accumulating
   into each replica's flat buckets (one device alone: into its ``.grad``, nothing to reduce);
2. all-reduce of the buckets (``reduce`` jobs: each device sums its chunk of every replica's
   buckets into every replica): global norm, finite check;
3. clipping and the optimizer step on every device (``apply`` jobs, shielded: all run to the
   end).

The window's last micro-step runs the three phases in one job a device (``train_and_step``),
the devices' jobs meeting between them (`Meeting`): one hand-off a step
instead of three (measured: 6.80 to 6.27 ms a step, 2 CPU workers on the benchmarks' MLP,
``python bench/ab.py HEAD --contender asyncddp-2`` on the change before it was committed). Not
with loss scaling, whose finite check decides on the event loop whether to step, nor with
several devices and a ``step_timeout`` (see `Steps._fusable`).

A failure anywhere makes the window *abandoned* on every device (``abandon`` jobs): an optimizer
step already taken is undone from its backup, the buffers go back to what the window found, the
gradients are zeroed (or set to ``None``). Then the failure policy raises, retries the window, or
drops the failed devices and retries on the rest. No step is ever half-applied.
"""

from __future__ import annotations

import logging
import math
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ._checks import warn_user
from ._comm import PeerFailed, RankLost
from ._data import items_in, split_batch
from ._devices import Device, resolve_devices
from ._events import DeviceDropped, EventHub, StepRetried, WorkerFailed
from ._exceptions import (
    AsyncDDPRuntimeWarning,
    NonFiniteLossError,
    StepOutputError,
    WorkerFailedError,
    WorkerTimeoutError,
)
from ._jobs import (
    ApplyWork,
    FusedWork,
    Jobs,
    Meeting,
    NonFiniteLoss,
    Sums,
    TrainWork,
    check_counts,
)
from ._precision import LossScaler
from ._replica import (
    OptimizerFactory,
    Replica,
    SchedulerFactory,
    attribute_changes,
    attribute_snapshot,
    check_copies,
    check_rebuilt,
    lives_on,
    move_to,
)
from ._scheduler import JobQueuedError, StepScheduler
from ._sync import clip_coefficient
from ._worker import WorkerContext

__all__ = ["DeviceDroppedWarning", "Steps", "Window"]

_log = logging.getLogger("asyncddp")


class DeviceDroppedWarning(AsyncDDPRuntimeWarning):
    """A failed device was dropped and training went on without it (``on_failure="drop"``)."""


@dataclass
class Window:
    """The batches of one optimizer step, kept so that a failed step can run again."""

    batches: list[list[Any]] = field(default_factory=list)  # per micro-step: 1, or 1 per device
    done: int = 0  # micro-steps whose forward and backward have run
    ref: float = 1.0  # the reference count of counted items (see TrainWork.per_item)
    sums: Sums = field(default_factory=Sums)
    device_items: dict[str, int] = field(default_factory=dict)  # by device name

    def restart(self, devices: int, split_batches: bool) -> None:
        """Forget the work done, to run the window again (on ``devices`` devices)."""
        self.done, self.sums, self.device_items = 0, Sums(), {}
        if not split_batches:  # whole batches per device: regroup for the devices left
            flat = [batch for group in self.batches for batch in group]
            self.batches = [flat[i : i + devices] for i in range(0, len(flat), devices)]

    @property
    def batch_count(self) -> int:
        return sum(len(group) for group in self.batches)


def shard_items(shard: Any) -> int:
    return 0 if shard is None else items_in(shard)


def phase_from_jobs(error: BaseException) -> None:
    """Name the phase each failure of a job that runs several phases happened in (the job
    tags its exception: ``_asyncddp_phase``), rather than the job's."""
    if isinstance(error, WorkerFailedError):
        for failure in (error, *error.other_failures):
            failure.phase = getattr(failure.__cause__, "_asyncddp_phase", failure.phase)
        error.args = (str(error),)


def error_in_optimizer(error: BaseException) -> bool:
    return isinstance(error, WorkerFailedError) and error.phase == "optimizer"


class Steps:
    """The step machinery of `Trainer` (a mixin: the trainer owns the state)."""

    devices: tuple[Device, ...]
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    split_batches: bool
    atomic_steps: bool
    on_failure: Literal["raise", "retry", "drop"]
    max_retries: int
    lr_scheduler_interval: Literal["epoch", "step"]
    lr_scheduler_monitor: str | None
    step_timeout: float | None
    global_step: int
    _replicas: list[Replica]
    _attributes_carried: bool  # a call carried module attributes over (see _mirror_first)
    _frozen_versions: list[tuple[str, torch.Tensor, int]]
    _grad_known: set[int]  # see _note_frozen_versions
    _queued_undos: list[JobQueuedError]
    _optimizer_factory: OptimizerFactory
    _scheduler_factory: SchedulerFactory | None
    _scaler: LossScaler | None
    _autocast: torch.dtype | None
    _scheduler: StepScheduler | None
    _hub: EventHub
    _window_open: bool
    _consistent: bool
    _apply_id: int
    _window: int  # the number of the last optimizer step opened (see TrainWork.opens_window)
    _sparse_grads: bool  # the model makes sparse gradients (see has_sparse_gradients)
    _items_ref: float | None  # see _reference_count
    _cancelled_in_step: BaseException | None  # raised once the step is counted

    def _jobs(self) -> Jobs:
        raise NotImplementedError

    def _distributed(self) -> bool:
        return False

    def _lone(self) -> bool:
        """One device in one process, and dense gradients: they need no buffers (see
        ``FlatGrads``; sparse ones are made dense by adding them into one)."""
        return len(self.devices) == 1 and not self._distributed() and not self._sparse_grads

    async def _regroup(self) -> None:
        """Re-cut every replica's gradients for the devices (and process group) there are now."""
        await self._run_all(self._jobs().regroup, (len(self.devices), self._lone()), phase="setup")

    async def _mirror_first(self) -> None:
        """Carry what was changed on ``trainer.model`` (the first replica) since the last call
        over to the other replicas (see ``_replica.mirror``), after moving it back to its
        device if it was moved off (``model.cpu()`` to save it, say; Lightning's fit moves it
        back too); refuse a changed set of parameters, modules or buffers
        (``_replica.check_rebuilt``). Before each fit and validation."""
        first = self._replicas[0]
        device = first.device.torch_device
        if not lives_on(first.model, device):  # model.cpu() between calls, say

            def move_back(ctx: Any, _: None) -> None:
                if ctx.device.index == 0:
                    move_to(first.model, device)

            await self._run_all(move_back, phase="setup")
        check_rebuilt(first)
        check_copies(self._replicas)  # a forward that made a part on some devices only
        first.grads.rebind()  # a cast in place since (model.double() then .float()) broke them
        if len(self._replicas) > 1:
            changes = attribute_changes(first)
            await self._run_all(self._jobs().mirror, changes, phase="setup")
            for replica in self._replicas:
                replica.module_attrs = attribute_snapshot(replica.model)
                replica.forwards = 0
            self._attributes_carried = True  # the call's end settles them (settle_snapshots)

    def _note_frozen_versions(self) -> None:
        """Note the versions of ``trainer.model``'s frozen parameters as a call's steps begin
        (after rank 0's model is taken, which writes every one): a step that writes one is told
        of (`_warn_if_frozen_written`)."""
        first = self._replicas[0]
        trained = {id(p) for p in first.params}  # thawed by the step (a GAN's toggle): stepped
        self._frozen_versions = [
            (name, param, param._version)
            for name, param in first.model.named_parameters()
            if not param.requires_grad and id(param) not in trained
        ]
        # Parameters that may require grad without a word: those the optimizers hold, and
        # those thawed before the call (check_rebuilt warned of them).
        self._grad_known = trained | {id(p) for p in first.model.parameters() if p.requires_grad}

    def _apply_work(self, coefficient: float = 1.0, unused: tuple[int, ...] = ()) -> ApplyWork:
        """The next optimizer step's work, under a new apply id."""
        self._apply_id += 1
        return ApplyWork(
            coefficient,
            self.atomic_steps,
            self.lr_scheduler_interval == "step",
            self._apply_id,
            unused,
        )

    async def _distributed_step(self, window: Window, epoch: int) -> float | None:
        raise NotImplementedError

    def _new_scheduler(self) -> StepScheduler:
        raise NotImplementedError

    def _require_scheduler(self) -> StepScheduler:
        assert self._scheduler is not None, "no session is open"
        return self._scheduler

    async def _scheduler_run(
        self,
        fn: Any,
        shards: Sequence[Any],
        *,
        phase: str,
        epoch: int | None = None,
        shield: bool = False,
    ) -> Any:
        scheduler = self._require_scheduler()
        # The set-up of a fit (building the replicas, copying the model or a checkpoint's state
        # into them) is not a step: step_timeout does not bound it. The first optimizer a
        # process builds imports torch._dynamo, about a second, and a big model's copy takes
        # what it takes: a timeout set for the steps failed every first fit. The scheduler is
        # this trainer's own; a session's set-up jobs run one after another, and another
        # call's job meanwhile (a checkpoint's) only reads the timeout, as its run starts.
        setup = phase == "setup"
        timeout = scheduler.step_timeout
        if setup:
            scheduler.step_timeout = None
        try:
            return await scheduler.run(
                fn,
                shards,
                items=[0] * len(shards),
                step=self.global_step,
                epoch=epoch,
                phase=phase,
                shield=shield,
            )
        finally:
            if setup:
                scheduler.step_timeout = timeout

    async def _run_all(self, fn: Any, work: Any = None, *, phase: str, shield: bool = False) -> Any:
        return await self._scheduler_run(fn, [work] * len(self.devices), phase=phase, shield=shield)

    def _shards(self, batches: list[Any]) -> list[Any]:
        """One shard per device: a split batch, or whole batches (None for a device without)."""
        n = len(self.devices)
        if not batches:  # a rank out of data, joining a step of the others
            return [None] * n
        if self.split_batches:
            return split_batch(batches[0], n)
        return batches + [None] * (n - len(batches))

    # -- one step, with the failure policy ---------------------------------------------------

    async def _run_step(self, window: Window, epoch: int, *, final: bool) -> float | None:
        """Forward and backward for the window's batches not yet run; with ``final``, also the
        optimizer step. Applies the failure policy. Returns the learning rate after the step."""
        attempt, last = 0, None
        while True:
            try:
                if final and self._distributed():
                    return await self._distributed_step(window, epoch)
                if final and self._fusable(window):
                    return await self._fused_step(window, epoch)
                await self._forward_backward(window, epoch)
                return await self._optimizer_step(window) if final else None
            except WorkerFailedError as error:
                await self._on_failure(error, window, epoch, attempt, last)
                attempt, last = attempt + 1, error.error_type
            except BaseException:
                # Cancelled (or interrupted) in mid-step: undo it now, shielded, so that the
                # trainer is consistent the moment the cancellation arrives.
                if self._window_open:
                    await self._abandon()
                raise

    async def _on_failure(
        self,
        error: WorkerFailedError,
        window: Window,
        epoch: int,
        attempt: int,
        last: str | None = None,
    ) -> None:
        """Apply the failure policy: raise, or undo and get ``window`` ready to run again.
        ``last``: the error type of this window's last failed attempt, if any."""
        try:
            if isinstance(error.__cause__, (PeerFailed, RankLost)):
                await self._abandon_quietly()
                raise error  # another rank's failure: the trainer names it
            if isinstance(error.__cause__, StepOutputError):
                await self._abandon_quietly()
                # A mistake in the step, not a device fault. Raised here, it takes ``error`` (the
                # exception being handled) as its __context__: without the cause's link back,
                # no cycle holds the step's output (and its graph) until the collector runs.
                output_error, error.__cause__ = error.__cause__, None
                try:
                    raise output_error from None
                finally:
                    del output_error
            if isinstance(error.__cause__, NonFiniteLoss):
                await self._abandon_quietly()
                nonfinite = NonFiniteLossError(
                    loss=error.__cause__.loss,
                    device=error.device,
                    step=error.step,
                    epoch=error.epoch,
                    phase=error.phase,
                )
                self._publish_failure(nonfinite, "raise")
                try:
                    # No cause, as documented: the loss is the error's own field, and the
                    # worker's private record of it only showed asyncddp's lines above it.
                    raise nonfinite from None
                finally:
                    del nonfinite  # this frame is in its traceback: no cycle through it
            failed = {error.device.name, *(f.device.name for f in error.other_failures)}
            action = self._next_action(failed, attempt)
            if action == "drop" and error.error_type == last:
                # The same error again, on a device the batch went to once the last one was
                # dropped: it follows the batch (bad data, a bug in the step), and dropping every
                # device in turn would not mend it.
                action = "raise"
                error.add_note(
                    f"on_failure='drop' dropped a device for this error ({last}) in this step "
                    "already: it follows the batch (its data, or the step), not a device"
                )
            timed_out = isinstance(error, WorkerTimeoutError)
            if action == "retry" and not self.atomic_steps and timed_out:
                # Its late job may take its optimizer step when it returns, with no backup to
                # undo it: the retry would go on from a step that global_step does not count.
                action = "raise"
                error.add_note(
                    "on_failure='retry' does not retry a step that timed out with "
                    "atomic_steps=False: its job may still take its optimizer step when it "
                    "returns, which nothing could undo"
                )
            if action == "raise" and self.on_failure == "retry" and attempt:
                error.add_note(
                    f"on_failure='retry': this step failed {attempt + 1} times, its "
                    f"max_retries={self.max_retries} retries used up"
                )
            if action == "raise" and self.on_failure == "drop" and len(failed) == len(self.devices):
                error.add_note(
                    "on_failure='drop' drops only some devices: "
                    + (
                        "this trainer's one device failed"
                        if len(self.devices) == 1
                        else f"all {len(self.devices)} devices failed in this step"
                    )
                    + ", and none would be left to go on with"
                )
            self._publish_failure(error, action)
            if action == "raise":
                if not timed_out:  # a hung device cannot undo
                    await self._abandon_quietly()
                raise error
            if action == "drop":
                await self._drop_devices(failed, error)
            if await self._abandon() or not self._consistent:
                self._consistent = False
                raise error
            window.restart(len(self.devices), self.split_batches)
            if action == "retry" and _log.isEnabledFor(logging.WARNING):
                # Else seen by an event stream only: an operator's log showed no sign of a
                # device failing now and then, nor the failure's traceback. As text, not the
                # error or exc_info: a handler that keeps its records (pytest's, a
                # MemoryHandler) would keep the failed step's tensors with them.
                cause = error.__cause__ or error
                _log.warning(
                    "%s; retrying the step (retry %d of max_retries=%d)\n%s",
                    str(error),
                    attempt + 1,
                    self.max_retries,
                    "".join(traceback.format_exception(cause)).rstrip(),
                )
                del cause
            self._hub.publish(StepRetried(epoch, self.global_step, attempt + 1))
        finally:
            # The traceback of what this raises holds this frame: without the error in it,
            # no error -> traceback -> frame -> error cycle keeps the failed step's tensors
            # (its inputs, activations, graph) alive until the cyclic collector runs.
            del error

    def _publish_failure(self, error: WorkerFailedError, action: str) -> None:
        """Tell the event streams that a device of this process failed, and what comes next."""
        self._hub.publish(
            WorkerFailed(
                error.device.name, error.epoch, error.step, error.phase, str(error), action
            )
        )

    def _next_action(self, failed: set[str], attempt: int) -> str:
        if not self._consistent:
            return "raise"
        if self.on_failure == "retry" and attempt < self.max_retries:
            return "retry"
        if self.on_failure == "drop" and len(failed) < len(self.devices):
            return "drop"
        return "raise"

    async def _abandon(self, apply_id: int | None = None) -> set[str]:
        """Undo the open window on every device; returns the devices that could not."""
        try:
            await self._run_all(
                self._jobs().abandon, (apply_id, self._window), phase="abandon", shield=True
            )
        except WorkerFailedError as error:
            failures = (error, *error.other_failures)
            # Queued behind a hung job, the undo runs once it returns, before the worker's
            # thread exits; no later call starts before, and the next one checks it ran
            # (Trainer._check_queued_undos).
            self._queued_undos += [f for f in failures if isinstance(f, JobQueuedError)]
            failed = {f.device.name for f in failures if not isinstance(f, JobQueuedError)}
            if failed:
                return failed
        self._window_open = False
        return set()

    async def _abandon_quietly(self) -> None:
        # If it cannot be undone now, the next session undoes it before anything else.
        await self._abandon()

    # -- the three phases ---------------------------------------------------------------------

    async def _forward_backward(self, window: Window, epoch: int) -> None:
        scale = self._scaler.scale if self._scaler is not None else 1.0
        jobs = self._jobs()
        while window.done < len(window.batches):
            # Split when run, not when loaded: a dropped device changes the split.
            shards = self._shards(window.batches[window.done])
            counts = [shard_items(shard) for shard in shards]
            total = sum(counts)
            opens = window.done == 0
            if opens:
                window.ref = self._reference_count(total)
                self._window += 1
            if not self._accumulates(window) and not self._distributed():
                weights = [scale * n / total if total else 0.0 for n in counts]
            elif not self._distributed() and self._scaler is None:
                weights = [float(n) for n in counts]  # the step's items are known at its end
            else:
                # Over a reference count: across ranks, one every rank shares; under a loss
                # scale (fp16), as GradScaler's n / N, since a sum of items times the scale
                # overflows fp16's gradients where the mean does not.
                weights = [scale * n / window.ref for n in counts]
            per_item = scale / window.ref if self._per_item_weights(window) else None
            if opens:
                self._window_open = True
            if total or opens:
                work = [
                    TrainWork(shard, weight, n, self._window if opens else 0, per_item)
                    for shard, weight, n in zip(shards, weights, counts, strict=True)
                ]
                result = await self._require_scheduler().run(
                    jobs.train,
                    work,
                    items=counts,
                    step=self.global_step,
                    epoch=epoch,
                    phase="train",
                )
                check_counts(list(result.outputs), window.sums)
                for device, count, sums in zip(self.devices, counts, result.outputs, strict=True):
                    window.sums.add(sums)
                    window.device_items[device.name] = (
                        window.device_items.get(device.name, 0) + count
                    )
            window.done += 1

    def _accumulates(self, window: Window) -> bool:
        """Whether the window's gradients add up over several micro-steps (accumulation, or a
        retried window regrouped for fewer devices), to be scaled to a mean at its end."""
        return self.accumulate_grad_batches != 1 or len(window.batches) > 1

    def _per_item_weights(self, window: Window) -> bool:
        """Whether a count the step gives (its ``"items"``) weights the gradients: always but
        for one device in one process with one batch a step, whose mean is the step's."""
        return self._accumulates(window) or self._distributed() or len(self.devices) > 1

    def _reference_count(self, items: int) -> float:
        """What a step's items are weighted against (see ``TrainWork.per_item``): the last
        counted (or loss-scaled) step's total, else this micro-step's items times
        ``accumulate_grad_batches`` (the step's total, with even batches; across ranks, the
        last step's global total, else 1: every rank must use the same). The reduced
        gradients are multiplied by this over the step's total, so across ranks a step as
        large as the last one (every step, with even data) skips that pass over the gradients.
        """
        if self._items_ref is not None:
            return self._items_ref
        if self._distributed():
            return 1.0
        # An optimizer step of even batches holds this many items.
        return float(max(items, 1) * self.accumulate_grad_batches)

    def _fusable(self, window: Window) -> bool:
        """The window's last micro-step, without loss scaling, runs as one job a device:
        forward, backward, the reduce and the optimizer step (several devices' jobs meet
        between the phases). Not with several devices and a ``step_timeout``, which bounds a
        device's own work: waiting at a meeting for a slower device is not, so the phases
        then run as jobs apart, each timed on its own."""
        return (
            self._scaler is None
            and window.done == len(window.batches) - 1
            and (len(self.devices) == 1 or self.step_timeout is None)
        )

    async def _fused_step(self, window: Window, epoch: int) -> float | None:
        """The window's last micro-step and the optimizer step, as one job a device.

        On several devices, a failure or a cancellation releases the jobs waiting at a
        meeting, as it drops those not started yet: none steps unless every one passed the
        last meeting, and then every one does. A step that every device took before a
        cancellation came counts, and the cancellation goes on right after it (as across
        ranks); one that failed on a device is undone on every device.
        """
        n = len(self.devices)
        shards = self._shards(window.batches[window.done])
        counts = [shard_items(shard) for shard in shards]
        total = sum(counts)
        items = window.sums.items + total
        if not items:  # nothing to learn from: the ordinary path skips the step
            await self._forward_backward(window, epoch)
            return await self._optimizer_step(window)
        opens = window.done == 0
        if opens:
            window.ref = self._reference_count(total)
            self._window += 1
        self._window_open = True
        k_scale = self._accumulates(window)  # see _forward_backward
        weights = [float(c) if k_scale else (c / total if total else 0.0) for c in counts]
        apply = self._apply_work()  # its coefficient and unused parameters: found in the job
        meeting = Meeting(n) if n > 1 else None
        per_item = 1.0 / window.ref if self._per_item_weights(window) else None
        work = [
            FusedWork(
                TrainWork(shard, weight, count, self._window if opens else 0, per_item),
                1.0 / items if k_scale else 1.0,
                self.gradient_clip_val,
                apply,
                meeting,
                window.sums,
                window.ref,
            )
            for shard, weight, count in zip(shards, weights, counts, strict=True)
        ]
        jobs = self._jobs()
        outcomes: list[tuple[Sums, float | None] | None] = [None] * n  # even if cancelled

        def job(ctx: WorkerContext, work: FusedWork) -> tuple[Sums, float | None] | None:
            outcomes[ctx.device.index] = outcome = jobs.train_and_step(ctx, work)
            return outcome

        try:
            await self._require_scheduler().run(
                job,
                work,
                items=counts,
                step=self.global_step,
                epoch=epoch,
                phase="train",
                on_cancel=meeting.leave if meeting is not None else None,
            )
        except BaseException as error:
            if all(outcome is not None for outcome in outcomes) and not isinstance(
                error, Exception
            ):
                # Cancelled once every device had stepped: the step counts, and the
                # cancellation goes on right after it.
                self._cancelled_in_step = error
            else:
                phase_from_jobs(error)
                # The optimizer step may have been taken on some devices (one failed in it, or
                # a cancellation came while some had stepped): undo it (shielded), then go on.
                # Without a backup a step that was taken cannot be undone.
                stepped = any(r.stepped_at == self._apply_id for r in self._replicas)
                undone = not await self._abandon(self._apply_id)
                if not undone or (not self.atomic_steps and (stepped or error_in_optimizer(error))):
                    self._consistent = False
                raise
        lrs = []
        for device, count, outcome in zip(self.devices, counts, outcomes, strict=True):
            assert outcome is not None, "a device's job left the step without a failure"
            sums, lr = outcome
            window.sums.add(sums)
            window.device_items[device.name] = window.device_items.get(device.name, 0) + count
            lrs.append(lr)
        window.done += 1
        if window.sums.items == 0:
            # Counts from the step, every one 0: no step was taken; undo the forwards (model
            # buffers) as the ordinary path does.
            await self._abandon()
            return lrs[0]
        self._window_open = False
        return lrs[0]

    async def _optimizer_step(self, window: Window) -> float | None:
        """Reduce the gradients across devices, clip, and step every replica, all or none."""
        n = len(self.devices)
        jobs = self._jobs()
        if window.sums.items == 0:  # nothing to learn from: no step is taken or counted
            await self._abandon()
            return None
        # Weighted by items (see _forward_backward): the sum becomes the mean here.
        scale = 1.0
        if window.sums.counted and self._per_item_weights(window):
            scale = window.ref / window.sums.items
        elif self._accumulates(window):
            scale = (1.0 if self._scaler is None else window.ref) / window.sums.items
        if self._scaler is not None:
            scale /= self._scaler.scale
        want_norm = self.gradient_clip_val is not None
        finite, norm = True, 0.0
        if n > 1 or scale != 1.0 or want_norm or self._scaler is not None:
            checks = (scale, want_norm, self._scaler is not None)
            reduced = await self._run_all(jobs.reduce, checks, phase="reduce")
            norm = math.sqrt(sum(norm_sq for norm_sq, _ in reduced.outputs))
            finite = all(ok for _, ok in reduced.outputs)
        if self._scaler is not None:
            self._scaler.update(finite)
            if not finite:  # skip this step, as GradScaler does, with a smaller scale next time
                await self._abandon()
                return self._replicas[0].lr()
        coefficient = 1.0
        if self.gradient_clip_val is not None:
            coefficient = clip_coefficient(norm, self.gradient_clip_val)
        unused = tuple(
            i for i in range(len(self._replicas[0].params)) if not window.sums.used >> i & 1
        )
        return await self._apply(self._apply_work(coefficient, unused))

    async def _apply(self, work: ApplyWork) -> float | None:
        """Every replica's optimizer step, shielded (every device runs it to the end), all or
        none: a step that failed on a device is undone on every device (or the trainer is
        marked inconsistent without a backup); one that every device took before a
        cancellation came counts, and the cancellation goes on right after it."""
        jobs = self._jobs()
        stepped: list[float | None] = []  # the replicas that stepped, even if cancelled

        def apply(ctx: WorkerContext, work: ApplyWork) -> float | None:
            lr = jobs.apply(ctx, work)
            stepped.append(lr)
            return lr

        try:
            applied = await self._run_all(apply, work, phase="optimizer", shield=True)
            lr: float | None = applied.outputs[0]
        except BaseException as error:
            if len(stepped) < len(self.devices) or isinstance(error, Exception):
                if not self.atomic_steps or await self._abandon(self._apply_id):
                    self._consistent = False
                raise
            self._cancelled_in_step = self._cancelled_in_step or error
            lr = self._replicas[0].stepped_lr
        self._window_open = False
        return lr

    # -- dropping devices ---------------------------------------------------------------------

    async def _drop_devices(self, failed: set[str], error: WorkerFailedError) -> None:
        keep = [i for i, device in enumerate(self.devices) if device.name not in failed]
        remaining = tuple(self.devices[i] for i in keep)
        where = f"epoch {error.epoch}, step {error.step}" if error.epoch is not None else ""
        why = f"{error.error_type or type(error).__name__}: {error.error_message}"
        message = (
            f"dropping failed device(s) {', '.join(sorted(failed))} after {why}"
            f"{f' ({where})' if where else ''}; training goes on with "
            f"{', '.join(d.name for d in remaining)}"
        )
        warn_user(message, DeviceDroppedWarning)
        old = self._require_scheduler()
        self._replicas = [self._replicas[i] for i in keep]
        self.devices = resolve_devices(remaining)
        for replica, device in zip(self._replicas, self.devices, strict=True):
            replica.device = device
        new = self._new_scheduler()
        new.start()
        self._scheduler = new  # the session closes it
        with warnings.catch_warnings():
            # A hung device's thread is left behind on purpose: that is why it is dropped.
            warnings.simplefilter("ignore", RuntimeWarning)
            await old.aclose()
        await self._regroup()
        for name in sorted(failed):
            self._hub.publish(DeviceDropped(name, tuple(d.name for d in self.devices)))
