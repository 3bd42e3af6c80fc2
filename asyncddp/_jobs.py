"""The jobs a Trainer runs on its devices' workers, one per device per phase.

Each job finds its replica by ``ctx.device.index`` and runs on that device's worker thread,
never on the event loop. The trainer hands them to `StepScheduler.run`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.parametrize import is_parametrized

from . import _comm
from ._comm import Comm, Global
from ._data import holds_cuda, move_to
from ._exceptions import StepOutputError
from ._exceptions import _NonFiniteLoss as NonFiniteLoss
from ._replica import Replica, StepFunction, loss_and_metrics, mirror, stray_gradient
from ._sync import all_gather, all_reduce_chunk, clip_coefficient, reduce_scatter, scale_grads
from ._worker import WorkerContext, after_job, leave_stream_running

__all__ = [
    "ApplyWork",
    "ExchangeWork",
    "FusedWork",
    "Jobs",
    "Meeting",
    "NonFiniteLoss",
    "PeerLeft",
    "Sums",
    "TrainWork",
    "exchange_gradients",
]


@dataclass
class Sums:
    """Per-device sums over items: ``sum(loss_i * n_i)`` and the same for each metric.

    ``used`` is a bit mask of the parameters that got a gradient (training only). ``counted``:
    the items are the counts the step gave (its ``"items"``), not the shards' sizes.
    ``metric_items``: the items behind each metric's sum, those of the shards whose step
    returned it (a step may return a metric on some shards or steps only); one for every
    metric, by default ``items`` (a shard's metrics, or a checkpoint's saved without them).
    """

    items: int = 0
    loss: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    used: int = 0
    counted: bool = False
    metric_items: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Over every item unless told otherwise: a shard's metrics, and a checkpoint's saved
        # without counts (over the items counted then, not over those counted after).
        for name in self.metrics:
            self.metric_items.setdefault(name, self.items)

    def add(self, other: Sums) -> None:
        for name, count in other.metric_items.items():
            self.metric_items[name] = self.metric_items.get(name, 0) + count
        self.items += other.items
        self.loss += other.loss
        for name, value in other.metrics.items():
            self.metrics[name] = self.metrics.get(name, 0.0) + value
        self.used |= other.used
        self.counted |= other.counted

    def means(self) -> dict[str, float]:
        """Each metric's mean over the items of the shards that returned it (none for a
        metric that only shards of no item returned: a mean over nothing)."""
        return {
            name: total / count
            for name, total in self.metrics.items()
            if (count := self.metric_items[name])
        }


def check_counts(
    sums: list[Sums], earlier: Sums | None = None, *, validation: bool = False
) -> None:
    """Refuse a step whose devices (or its micro-steps: ``earlier``, the window's sums so far;
    in ``validation``, the batches so far) disagree on giving ``"items"``; sums of nothing (a
    device without data, a window with no micro-step yet) count for neither."""
    ran = [s for s in [*sums, earlier] if s is not None and (s.items or s.counted)]
    if any(s.counted for s in ran) and not all(s.counted for s in ran):
        raise StepOutputError(
            "the validation step returned 'items' for some batches (or devices' shares) and "
            "not for others; return it always, or never: the loss and metrics are means over "
            "every item, which cannot add counts to batch sizes"
            if validation
            else "the step returned 'items' for some shares of one optimizer step (the "
            "devices' shares of a batch, or the batches accumulated into it) and not for "
            "others; return it always, or never"
        )


@dataclass(frozen=True)
class TrainWork:
    """What one device's forward-and-backward job gets."""

    shard: Any
    weight: float  # the loss is multiplied by it before backward
    items: int
    # The first forward of an optimizer step opens it: the step's window number (from 1; 0 for
    # a later forward), so that an undo can tell whether this replica's job opened that step.
    opens_window: int
    # With a count from the step (its "items"), the loss is multiplied by this times the count
    # instead (the loss scale over a reference count, the same for every device: so that the
    # weights stay near the loss scale, which fp16 needs), and the sum scaled by the reference
    # over the step's total later; None: a count changes no weight (one device in one
    # process, one batch a step: its mean is the step's).
    per_item: float | None = None


@dataclass(frozen=True)
class ApplyWork:
    """What every device's optimizer-step job gets."""

    coefficient: float  # gradient clipping
    atomic: bool  # back up before stepping
    scheduler_step: bool  # step the LR scheduler too
    apply_id: int  # tells this step from earlier ones when undoing
    unused: tuple[int, ...]  # parameters no device used in this step


class PeerLeft(threading.BrokenBarrierError):
    """Raised at a `Meeting` in a device's job when another device's job failed: a barrier
    broken by a peer (which the scheduler does not log as news; see ``_Job``)."""


class Meeting:
    """Where the jobs of one step on several devices wait for each other between its phases,
    and pass on what the next phase needs: the devices' squared norms.

    A job that fails calls `leave`: every job waiting in a round not yet complete, or
    coming to a later one, raises `PeerLeft` instead of waiting for it. A round that
    is complete stays so (unlike ``threading.Barrier.abort``, which also breaks the parties a
    last arrival has released but that have not woken yet): once every job has passed the last
    meeting, every one steps.
    """

    def __init__(self, parties: int) -> None:
        self._parties = parties
        self._ready = threading.Condition()
        self._arrived = 0
        self._round = 0
        self._left = False
        self._norms = [0.0] * parties
        self._shared: list[Any] = [None] * parties

    def wait(self, ctx: WorkerContext) -> None:
        """Wait for every job, once this device's work so far is done (its stream's too: the
        others read what it wrote, on streams of their own)."""
        if ctx.stream is not None:
            ctx.stream.synchronize()
        with self._ready:
            if self._left:
                raise PeerLeft
            this = self._round
            self._arrived += 1
            if self._arrived == self._parties:
                self._arrived, self._round = 0, this + 1
                self._ready.notify_all()
                return
            self._ready.wait_for(lambda: self._round != this or self._left)
            if self._round == this:
                raise PeerLeft

    def share(self, ctx: WorkerContext, value: Any) -> list[Any]:
        """`wait`, handing ``value`` to every device; every device's, in device order."""
        self._shared[ctx.device.index] = value
        self.wait(ctx)
        return list(self._shared)

    def total_norm_sq(self, ctx: WorkerContext, norm_sq: float) -> float:
        """Wait for every device's squared norm; their sum, in device order (as the event
        loop sums them when the phases run as jobs apart)."""
        self._norms[ctx.device.index] = norm_sq
        self.wait(ctx)
        return sum(self._norms)

    def leave(self) -> None:
        with self._ready:
            self._left = True
            self._ready.notify_all()


@dataclass(frozen=True)
class FusedWork:
    """One device's whole optimizer step in one job: forward, backward, the reduce and the
    optimizer step. With several devices their jobs meet between the phases (``meeting``)."""

    train: TrainWork  # the window's last forward and backward
    scale: float  # applied to the gradients before the step (accumulation)
    clip: float | None  # gradient_clip_val
    apply: ApplyWork  # its coefficient and unused parameters are worked out in the job
    meeting: Meeting | None = None  # None for a single device
    earlier: Sums = field(default_factory=Sums)  # the window's earlier micro-steps
    ref: float = 1.0  # with counts, gradients are weighted by count / ref (see TrainWork)


@dataclass(frozen=True)
class ExchangeWork:
    """What a step's exchange needs, from the event loop."""

    active: bool  # this rank brought data to this step
    clip: float | None
    loss_scale: float | None  # fp16: the loss scale to undo, and check finiteness
    stop: Callable[[], bool]  # read when the exchange starts
    ref: float = 1.0  # the gradients were weighted by items / ref (see TrainWork.per_item)


class _OnHost:
    """A GPU step's loss and tensor metrics, copied to page-locked host memory behind the
    kernels queued so far (the forward), to be read without waiting for those queued after
    them (the backward): ``float(loss)`` would wait for the whole stream. So a metric is read
    as the forward left it (one that the backward writes, through a hook, is read before)."""

    __slots__ = ("_copied", "loss", "metrics")

    def __init__(self, stream: torch.cuda.Stream, loss: torch.Tensor, metrics: dict[str, Any]):
        self.loss = _pinned_copy(loss)
        self.metrics = {
            name: _pinned_copy(value) if isinstance(value, torch.Tensor) else value
            for name, value in metrics.items()
        }
        self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._copied.record(stream)

    @classmethod
    def behind_forward(
        cls, ctx: WorkerContext, loss: torch.Tensor, metrics: dict[str, Any]
    ) -> _OnHost | None:
        """The copies, or ``None`` where a tensor is on another GPU, whose copy would be
        queued on that GPU's stream, which the event does not cover: read after the backward
        then, as without ``early_read``."""
        assert ctx.stream is not None
        tensors = [loss, *(v for v in metrics.values() if isinstance(v, torch.Tensor))]
        if any(t.is_cuda and t.device != ctx.torch_device for t in tensors):
            return None
        return cls(ctx.stream, loss, metrics)

    def read(self) -> tuple[float, dict[str, Any]]:
        """Wait for the copies (and what was queued before them); the loss and the metrics."""
        self._copied.synchronize()
        return float(self.loss), self.metrics


def _number(value: torch.Tensor | float) -> float:
    """A metric as a float: a tensor detached first (a metric computed from the model's
    output requires grad, and ``float()`` of it warns)."""
    return float(value.detach() if isinstance(value, torch.Tensor) else value)


def _pinned_copy(value: torch.Tensor) -> torch.Tensor:
    value = value.detach()
    if not value.is_cuda:
        return value
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    return host.copy_(value, non_blocking=True)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values, NaN where the other has NaN (a model that
    trained on a NaN loss is the same on every device)."""
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(
        a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    )


def _difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """How two tensors of one shape differ, for a message: in how many elements, by how much
    at most (a rounding difference, 1e-7 of float32 values, or a drift of its own)."""
    if not (a.is_floating_point() or a.is_complex()):
        return f"{int((a != b).sum())} of {a.numel()} elements"
    apart = ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
    gap = (a - b)[apart].abs()
    largest = float(gap.max()) if gap.numel() else 0.0
    return f"{int(apart.sum())} of {a.numel()} elements, by up to {largest:.3g}"


class Jobs:
    """The jobs of one trainer, bound to its replicas, step functions and precision."""

    def __init__(
        self,
        replicas: list[Replica],
        step: StepFunction,
        valid_step: StepFunction,
        autocast: torch.dtype | None,
        check_finite: bool = False,
        *,
        across_ranks: bool = False,
    ) -> None:
        self.replicas = replicas
        self.step = step
        self.valid_step = valid_step
        self.autocast = autocast
        self.check_finite = check_finite
        # In a process group, the reduced chunks go through scratch buffers that the ranks
        # exchange before the replicas take them (see asyncddp/_sync.py).
        self.across_ranks = across_ranks

    def _forward(self, fn: StepFunction, replica: Replica, shard: Any, ctx: WorkerContext) -> Any:
        replica.forwards += 1  # see _replica.settle_snapshots
        batch = move_to(shard, ctx.torch_device, non_blocking=True)
        if self.autocast is None:
            return fn(replica.model, batch)
        with torch.autocast(ctx.device.type, dtype=self.autocast):
            return fn(replica.model, batch)

    def train(self, ctx: WorkerContext, work: TrainWork, *, early_read: bool = False) -> Sums:
        """Forward and backward on one shard; gradients accumulate into the flat buffers (a
        lone replica's into its ``.grad``). With ``early_read``, on a GPU, the loss and metrics
        are copied to the host behind the forward and read without waiting for the backward
        (see `_OnHost`): for a job that does not wait for its stream at its end."""
        replica = self.replicas[ctx.device.index]
        if work.opens_window:
            replica.open_window(work.opens_window)
        if work.items == 0:
            return Sums()
        accumulated = replica.claim_gradients()
        try:
            output = self._forward(self.step, replica, work.shard, ctx)
        except ValueError as error:
            if work.items == 1 and "more than 1 value per channel" in str(error):
                error.add_note(
                    f"{ctx.device.name}'s share of this batch held 1 item (a batch split "
                    "across the devices), and BatchNorm needs 2 in training: drop the last, "
                    "smaller batch (DataLoader(..., drop_last=True)), or use batch sizes of 2 "
                    "items or more per device"
                )
            raise
        if replica.gradients_accumulated != accumulated and _holds_gradients(replica):
            # (A step that cleared what its backward left, model.zero_grad() after an
            # adversarial example's input gradient, passes this check; with
            # accumulate_grad_batches it also clears the earlier micro-steps' gradients, so the
            # message does not offer it.)
            raise StepOutputError(
                "the step called backward() itself and left gradients in the model's "
                "parameters: return the loss, and the trainer runs the backward, weighting "
                "each device's gradients by its items before they are averaged (a backward "
                "in the step too would count them twice). For gradients of the inputs, use "
                "torch.autograd.grad(loss, inputs), or loss.backward(inputs=[inputs]), which "
                "leaves the parameters' gradients alone"
            )
        loss, metrics, counted = loss_and_metrics(output, training=True)
        if counted == 0:
            # Nothing to average over (every token of the shard is padding): the shard adds no
            # gradient, and its loss (a mean over nothing, often NaN) counts for nothing.
            return Sums(0, 0.0, dict.fromkeys(metrics, 0.0), counted=True)
        on_host = None
        if early_read and ctx.stream is not None:
            on_host = _OnHost.behind_forward(ctx, loss, metrics)
        if on_host is None and self.check_finite:
            # Host-device sync point before backward: a non-finite loss adds no gradient.
            value = float(loss.detach())
            if not math.isfinite(value):
                raise NonFiniteLoss(value)
        weight = work.weight
        if counted is not None and work.per_item is not None:
            weight = work.per_item * counted
        (loss * weight if weight != 1.0 else loss).backward()  # type: ignore[no-untyped-call]
        if on_host is not None:
            # Host-device sync point, once the backward is queued, waiting for the forward
            # only: the GPU goes on with the backward while the job goes on. A non-finite
            # loss raises before the optimizer step, and the step's gradients are dropped
            # with the rest of it (the trainer undoes the failed step).
            value, metrics = on_host.read()
            if self.check_finite and not math.isfinite(value):
                raise NonFiniteLoss(value)
        elif not self.check_finite:
            value = float(loss.detach())
        stray = stray_gradient(self.replicas, replica) if len(self.replicas) > 1 else None
        if replica.params and not any(replica.used) and loss.grad_fn is not None:
            # (A leaf loss, a constant that requires grad, comes from no model at all.)
            raise StepOutputError(
                f"no parameter of the model given to the step on {ctx.device.name} got a "
                "gradient: the loss was computed with another model. Use the step's model "
                "argument, step(model, batch), not a model from outside the step (each device "
                "trains its own replica), and see that the model keeps no function that refers "
                "to its own modules or parameters (a lambda kept as an attribute, a hook made "
                "by a lambda): each device's copy of the model would call the first one's"
            )
        if stray is not None:
            owner, name = stray
            raise StepOutputError(
                f"the backward on {ctx.device.name} wrote a gradient into {owner.device.name}'s "
                f"copy of the model (parameter {name!r}): the step uses a module of "
                "trainer.model from outside it (head = net.head, kept by the script: use "
                "model.head of the step's model), or the model keeps a function that "
                "refers to its own modules or parameters (a lambda kept as an attribute, "
                "self.act = lambda x: x * self.alpha; a hook made by a lambda that calls "
                "other modules), which each device's copy of the model (copy.deepcopy) shares, "
                "so it uses the first copy's parameters. Make it a method or a module of its "
                "own (a method, bound to its module, is copied with it), or pass what it needs "
                "as arguments"
                + (
                    ". torch.nn.utils.parametrize.cached() does so too: its cache is keyed by "
                    "trainer.model's modules, which each copy's parametrized weights name, so "
                    "under it every device reads the first's weights. Train without it"
                    if any(is_parametrized(m) for m in replica.model.modules())
                    else ""
                )
            )
        replica.grads.attach()  # in case the step replaced a .grad
        items = work.items if counted is None else counted
        return Sums(
            items,
            value * items,
            {k: _number(v) * items for k, v in metrics.items()},
            replica.used_mask(),
            counted is not None,
        )

    def validate(self, ctx: WorkerContext, work: tuple[Any, int]) -> Sums:
        shard, items = work
        replica = self.replicas[ctx.device.index]
        if items == 0:
            return Sums()
        with torch.no_grad():
            output = self._forward(self.valid_step, replica, shard, ctx)
            loss, metrics, counted = loss_and_metrics(output, training=False)
        if counted == 0:  # every item of the shard padding: its loss (often NaN) counts for
            return Sums(0, 0.0, dict.fromkeys(metrics, 0.0), counted=True)  # nothing, as in train
        if counted is not None:
            items = counted
        return Sums(
            items,
            float(loss) * items,
            {k: _number(v) * items for k, v in metrics.items()},
            counted=counted is not None,
        )

    def reduce(self, ctx: WorkerContext, work: tuple[float, bool, bool]) -> tuple[float, bool]:
        """This device's chunk of the all-reduce: into every replica (in one process), or into
        its scratch buffer for the ranks to exchange (in a process group)."""
        scale, want_norm, want_finite = work
        grads = [replica.grads for replica in self.replicas]
        reduce = reduce_scatter if self.across_ranks else all_reduce_chunk
        return reduce(grads, ctx.device.index, scale, want_norm=want_norm, want_finite=want_finite)

    def apply(self, ctx: WorkerContext, work: ApplyWork) -> float | None:
        """Take the reduced gradients (clipped), then the optimizer step. Every device's
        reduce must be done: in a process group this gathers the exchanged chunks."""
        index = ctx.device.index
        replica = self.replicas[index]
        if self.across_ranks:
            all_gather([r.grads for r in self.replicas], index, work.coefficient)
        else:
            scale_grads(replica.grads, work.coefficient)
        if work.atomic:
            replica.backup.capture(replica.params, replica.optimizer, replica.scheduler)
        for unused in work.unused:
            replica.params[unused].grad = None  # no device used it: the optimizer skips it
        replica.stepped_at = work.apply_id  # from here on, a failure must be undone
        lr = replica.stepped_lr = replica.lr()  # the rate this step takes, not the next one's
        replica.optimizer.step()
        if work.scheduler_step and replica.scheduler is not None:
            replica.scheduler.step()
        # The gradients stay until the next step opens (zeroed; None for a lone replica).
        replica.grads.attach()
        if work.atomic and replica.grads.loose and replica.device.type == "cpu":
            # One CPU device in one process: the next step's backup, copied while the event
            # loop handles this step's results, on a core that is idle meanwhile. Not with
            # several workers or ranks, whose cores are busy then (measured: no gain, and it
            # costs a second copy's memory), nor on a GPU (the copy is the device's work).
            after_job(functools.partial(replica.backup.prepare, replica.params, replica.optimizer))
        if index:
            # Buffers (BatchNorm statistics) follow the first replica, as DDP's
            # broadcast_buffers: the first replica's buffers are not written in this step.
            with torch.no_grad():
                replica.take_buffers(self.replicas[0])
        return lr

    def train_and_step(
        self, ctx: WorkerContext, work: FusedWork
    ) -> tuple[Sums, float | None] | None:
        """Forward, backward, the reduce and the optimizer step in one job: one hand-off per
        step, in one process. With several devices, the jobs meet once every device's
        gradients are in (then each reduces its chunk into every replica) and once every chunk
        is reduced (then each steps).

        Returns ``None`` if another device's job failed before the step: that one reports.
        A failure is tagged with its phase (``_asyncddp_phase``) for the trainer.
        """
        assert not self.across_ranks, "a step across ranks runs as distributed_step"
        meeting = work.meeting
        index = ctx.device.index
        replica = self.replicas[index]
        phase = "train"
        # One GPU in one process: the step may report while its stream still runs the
        # backward's tail and the optimizer step (see below). Not with a batch that is on a GPU
        # already: its tensors come from elsewhere (another stream, another allocator, a
        # buffer the loader fills again), and the tail reads them; nor with one that may be
        # (an object whose tensors move_to does not see).
        early = meeting is None and not holds_cuda(work.train.shard)  # (on a CPU: no stream)
        try:
            sums = self.train(ctx, work.train, early_read=early)
            phase = "reduce"
            everyone = [sums]
            if meeting is None:
                grads, own, used = [replica.grads], 0, replica.used
            else:
                everyone = meeting.share(ctx, sums)  # every device's gradients are in
                grads, own = [r.grads for r in self.replicas], index
                used = [any(flags) for flags in zip(*(r.used for r in self.replicas), strict=True)]
            scale = work.scale
            if any(s.counted for s in [*everyone, work.earlier]):
                # Weighted by the step's own counts: the mean over all of them.
                phase = "train"
                check_counts(everyone, work.earlier)
                phase = "reduce"
                total = work.earlier.items + sum(s.items for s in everyone)
                if not total:  # no item to learn from: no step (the trainer undoes the window)
                    return sums, replica.lr()
                if work.train.per_item is not None:
                    scale = work.ref / total
            want_norm = work.clip is not None
            norm_sq, _ = all_reduce_chunk(grads, own, scale, want_norm=want_norm)
            apply = work.apply
            if meeting is not None and apply.atomic and self._backup_in_parts():
                phase = "optimizer"
                # Every replica is as the others before the step: each backs up its part, and
                # a restore takes each part from its peer (one copy between them, not one each).
                peers = [r.backup for r in self.replicas]
                replica.backup.capture(
                    replica.params, replica.optimizer, replica.scheduler, peers=peers
                )
                apply = dataclasses.replace(apply, atomic=False)  # backed up
            if meeting is not None:
                # Every chunk is reduced into every replica: from here on none is written but
                # by its own worker (an optimizer may write .grad in place).
                norm_sq = meeting.total_norm_sq(ctx, norm_sq)
            coefficient = 1.0
            if work.clip is not None:
                coefficient = clip_coefficient(math.sqrt(norm_sq), work.clip)
            unused = tuple(i for i, flag in enumerate(used) if not flag)
            phase = "optimizer"
            lr = self.apply(ctx, dataclasses.replace(apply, coefficient=coefficient, unused=unused))
            if early:
                # The step reports while its stream still runs the backward's tail and the
                # optimizer step, so the GPU works through them while the event loop takes the
                # results and hands over the next step (queued behind them on the same
                # stream). No other stream or thread reads this replica before this worker's
                # next job; every other job, and the end of the session, waits for the stream.
                leave_stream_running()
        except PeerLeft:
            return None
        except BaseException as exc:
            if meeting is not None:
                meeting.leave()
            with contextlib.suppress(Exception):  # tells the trainer which phase failed
                exc._asyncddp_phase = phase  # type: ignore[attr-defined]
            raise
        return sums, lr

    def distributed_step(
        self,
        ctx: WorkerContext,
        train: TrainWork,
        earlier: Sums,
        apply: ApplyWork,
        exchange: ExchangeWork,
        comm: Comm,
    ) -> tuple[Global, float | None]:
        """One device per rank: forward, backward, the exchange and the step in one job."""
        local = Sums()
        local.add(earlier)
        this = self.train(ctx, train)
        check_counts([this], earlier)
        local.add(this)
        replica = self.replicas[ctx.device.index]
        assert not replica.grads.loose, "a replica in a process group exchanges flat buffers"
        used = [bool(local.used >> i & 1) for i in range(len(replica.params))]
        back_up = None
        failed: list[BaseException] = []  # the backup's error
        if apply.atomic and replica.device.type == "cpu":
            # The backup, copied while this rank waits for the others' gradients: the
            # parameters and the optimizer's state are as they will be when it steps (the
            # exchange writes gradients and buffers only), and the core would idle meanwhile.
            # Not on a GPU, where the copy is the device's work and would come before the
            # header's read. A step that no rank takes leaves it unused: the backup is only
            # restored when this step is undone.
            def back_up() -> None:
                try:
                    replica.backup.capture(replica.params, replica.optimizer, replica.scheduler)
                except BaseException as exc:  # raised once the step's exchange is done
                    failed.append(exc)

            # Backed up in the exchange (which calls back_up, or raises before any step).
            apply = dataclasses.replace(apply, atomic=False)
        result, coefficient, _ = exchange_gradients(
            comm, local, used, replica.grads.buffers, replica.buffers, exchange, back_up
        )
        if result.items == 0 and not failed:  # no rank had data: no step
            return result, replica.lr()
        try:
            if failed:
                # Every collective of the step is done (the header's, the buffers'
                # broadcast), so the ranks stay in step: the others take this step, this one
                # fails before it, and they hear of it at their next exchange (as of an
                # optimizer step that fails).
                raise failed[0]
            lr = self.apply(
                ctx, dataclasses.replace(apply, coefficient=coefficient, unused=result.unused)
            )
        except BaseException as exc:
            with contextlib.suppress(Exception):  # tells the trainer which phase failed
                exc._asyncddp_phase = "optimizer"  # type: ignore[attr-defined]
            raise
        return result, lr

    def _backup_in_parts(self) -> bool:
        """Whether the replicas of a fused step back up in parts: on CPU workers, where every
        backup is in the same memory. On GPUs a restore would copy across devices, a path no
        test has run."""
        return all(replica.device.type == "cpu" for replica in self.replicas)

    def abandon(self, ctx: WorkerContext, work: tuple[int | None, int]) -> None:
        """Undo an unfinished step: its optimizer step (if taken), its forwards, its gradients.
        ``work``: the step's apply id (if it got as far) and its window number."""
        apply_id, window = work
        replica = self.replicas[ctx.device.index]
        if (
            apply_id is not None
            and replica.stepped_at == apply_id
            and not replica.backup.restore(replica.params, replica.optimizer, replica.scheduler)
        ):
            # atomic_steps=False: the step stays taken (a job that stepped after its
            # step_timeout, say), and the trainer refuses to go on (Trainer._session).
            replica.kept_step = True
        replica.stepped_at = None
        replica.grads.attach()
        replica.grads.zero_()
        if replica.buffer_backup is not None and replica.buffers_saved_for == window:
            # Only if this replica's job opened the step: a job dropped before it started
            # left the buffers as the last step did, and the copy is from before that step.
            with torch.no_grad():
                replica.restore_buffers()
        replica.used = [False] * len(replica.params)

    def differs(self, ctx: WorkerContext, _: None) -> tuple[str, str] | None:
        """The first parameter of this replica whose values are not the first replica's, or
        ``None`` (the first's job compares nothing): its name, how many of its elements
        differ and by how much at most. CPU replicas only: no job writes a parameter
        meanwhile, and the first's are read here as they are."""
        if not ctx.device.index:
            return None
        first = self.replicas[0].model.named_parameters()
        mine = self.replicas[ctx.device.index].model.parameters()
        for (name, theirs), own in zip(first, mine, strict=True):
            if not _same(own.detach(), theirs.detach()):
                return name, _difference(own.detach(), theirs.detach())
        return None

    def regroup(self, ctx: WorkerContext, work: tuple[int, bool]) -> None:
        parts, loose = work
        self.replicas[ctx.device.index].regroup(parts, ctx.device.index, loose=loose)

    def mirror(self, ctx: WorkerContext, changes: Sequence[tuple[int, Any, Any]]) -> None:
        """The first replica's values, ``requires_grad`` flags, modes, extra state, hooks and
        changed module attributes, into this one (see ``_replica.mirror``)."""
        if ctx.device.index:
            mirror(self.replicas[ctx.device.index], self.replicas[0], changes)

    def snapshot(self, ctx: WorkerContext, wanted: bool) -> dict[str, Any] | None:
        """The first replica's state on the CPU (copied, so training may go on)."""
        if not wanted:
            return None
        replica = self.replicas[ctx.device.index]
        return {
            "model": to_cpu(replica.model.state_dict()),
            "optimizer": to_cpu(replica.optimizer.state_dict()),
            "lr_scheduler": replica.scheduler.state_dict() if replica.scheduler else None,
        }

    def load(self, ctx: WorkerContext, state: Mapping[str, Any]) -> None:
        load_into(self.replicas[ctx.device.index], state)


def load_into(replica: Replica, state: Mapping[str, Any]) -> None:
    """Load a trainer state's model (unless ``None``: loaded into the model the replicas were
    copied from), optimizer and LR scheduler into one replica."""
    if state.get("model") is not None:
        replica.model.load_state_dict(state["model"])
    if state.get("optimizer") is not None:
        own = [dict(group) for group in replica.optimizer.param_groups]
        # A private copy: Optimizer.load_state_dict keeps tensors that already match the
        # parameters' device and dtype, and replicas must never share optimizer state.
        replica.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        # Settings the LR scheduler put in the groups (OneCycleLR's max_lr), which a state
        # saved without it lacks: torch's load would drop them, and the scheduler's next step
        # fail. Not the optimizer's own (its defaults): another kind's state is refused
        # before, and where it could not be checked, fails as torch's load would.
        mine = replica.optimizer.defaults
        for group, before in zip(replica.optimizer.param_groups, own, strict=True):
            for key, value in before.items():
                if key not in mine and key != "params":
                    group.setdefault(key, value)
    if replica.scheduler is not None and state.get("lr_scheduler") is not None:
        # A copy for each replica: some schedulers' loads take entries out (CyclicLR's).
        replica.scheduler.load_state_dict(copy.deepcopy(state["lr_scheduler"]))
    replica.grads.attach()
    replica.grads.zero_()
    replica.backup.forget_ahead()


def to_cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor on the CPU (safe to keep while training goes on)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [to_cpu(item) for item in value]
    if isinstance(value, tuple):
        return tuple(to_cpu(item) for item in value)
    return value


def _holds_gradients(replica: Replica) -> bool:
    """Whether any of the replica's parameters holds a gradient that is not all zeros."""
    return any(p.grad is not None and bool(p.grad.any()) for p in replica.params)


def exchange_gradients(
    comm: Comm,
    local: Sums,
    used: list[bool],
    buckets: list[torch.Tensor],
    buffers: list[torch.Tensor],
    work: ExchangeWork,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[Global, float, bool]:
    """The step's exchange (blocking): the header and the gradients together, then rank 0's
    model ``buffers`` if any rank had data (the first replica's; the others copy them in the
    step). ``meanwhile`` runs while the header's all-reduces are in flight (see
    `Comm.header`).

    Returns the global sums, the coefficient to multiply the summed gradients by (the mean
    over items, the loss scale undone, clipping), and whether they are all finite.
    """
    result = comm.header(
        _comm.STEP,
        items=local.items,
        loss=local.loss,
        metrics=local.metrics,
        metric_items=local.metric_items,
        active=work.active,
        stop=work.stop(),
        used=used,
        buckets=buckets,  # summed at the same time as the header
        counted=local.counted,
        meanwhile=meanwhile,
    )
    if 0 < result.counted < result.active:
        raise StepOutputError(
            f"the step returned 'items' on {result.counted} of the {result.active} processes "
            "with data in this optimizer step; return it always, or never"
        )
    if result.items == 0:
        return result, 1.0, True
    comm.broadcast_buffers(buffers)
    scale = work.ref / result.items
    if work.loss_scale is not None:
        scale /= work.loss_scale
    coefficient, finite = _comm.clip_and_scale(
        buckets, scale, work.clip, want_finite=work.loss_scale is not None
    )
    return result, coefficient, finite
