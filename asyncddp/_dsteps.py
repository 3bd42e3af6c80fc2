"""One optimizer step across the ranks of a process group (``asyncddp.distributed``).

Within a rank a step runs as on one machine (forward and backward on every device, the
in-process reduce-scatter); then one exchange with the other ranks (:mod:`._comm`): the header,
whose sums give every rank the step's global item count, loss, metrics, ``stop()`` requests and
failures, then the gradient buckets. The gradients are summed over items (each device's loss is
multiplied by its item count), so dividing the all-reduced sum by the global item count gives
the mean over every item of every rank, however unevenly they were spread.

With one device per rank (the usual ``torchrun`` set-up), and no loss scaling, the whole step is
one job on the device's worker: forward, backward, the exchange, the optimizer step.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import anyio

from . import _comm, distributed
from ._comm import Comm, Global
from ._exceptions import ConfigurationError, WorkerFailedError
from ._jobs import ApplyWork, ExchangeWork, Sums, TrainWork, exchange_gradients
from ._ranks import rank_view
from ._steps import Steps, Window, shard_items
from ._worker import WorkerContext

__all__ = ["DistributedSteps"]

#: How long a failing rank waits for the others to hear of it before it raises anyway.
ANNOUNCE_TIMEOUT = 60.0


class DistributedSteps(Steps):
    """The cross-rank step of :class:`Trainer` (a mixin: the trainer owns the state)."""

    _comm: Comm | None
    _last_global: Global | None
    _stop_agreed: bool
    _stop_reason: str | None
    _data_seed: int | None
    epoch: int

    def _distributed(self) -> bool:
        return self._comm is not None

    def _should_stop(self) -> bool:
        """Whether to stop after this step: across ranks, only once every rank agreed."""
        return self._stop_agreed if self._comm is not None else self._stop_reason is not None

    async def _drain(self, step: Callable[[Window], Awaitable[None]]) -> bool:
        """After this rank's last batch: join the others' steps with no data until no rank has
        any. Returns whether every rank's data is used up (False after an agreed stop)."""
        while True:
            last = self._last_global
            if self._stop_agreed:
                return await self._all_exhausted(True)
            if last is not None and last.active == 0:
                return True
            await step(Window(batches=[[]]))

    async def _all_exhausted(self, exhausted: bool) -> bool:
        """After an agreed stop: whether every rank's data is used up (the epoch is over)."""
        result = await self._exchange(_comm.STOP_CHECK, active=not exhausted)
        return result.active == 0

    # -- joining -------------------------------------------------------------------------------

    async def _join(self) -> None:
        """Join the process group's training, once, if this process is in one."""
        if self._comm is not None or not distributed.is_initialized():
            return
        if self.on_failure != "raise":
            raise ConfigurationError(
                f"on_failure={self.on_failure!r} is not supported across processes yet: a "
                "failed rank makes every rank raise (on_failure='raise')"
            )
        model = self._source_model()
        params = [p for p in model.parameters() if p.requires_grad]
        fingerprint = (
            f"params={[tuple(p.shape) for p in params]} "
            f"accumulate={self.accumulate_grad_batches} split={self.split_batches} "
            f"clip={self.gradient_clip_val} scaler={self._scaler is not None}"
        )
        comm = Comm(self.devices, len(params), fingerprint)
        await anyio.to_thread.run_sync(comm.setup)
        self._comm = comm
        if self._data_seed is None:
            self._data_seed = comm.data_seed

    async def _across_ranks(self, error: BaseException) -> BaseException:
        """What to raise for ``error`` in a process group, after the other ranks know of it.

        Another rank's failure becomes a :class:`WorkerFailedError` naming that rank and its
        device (its original exception as the cause, when it could be sent); a lost rank, one
        naming the lost rank. This rank's own failure (or cancellation) is announced to the
        others first, then raised as it is, with the rank filled in.
        """
        comm = self._comm
        if comm is None:
            return error
        where = {"step": self.global_step, "epoch": self.epoch}
        lost = _comm.find(error, _comm.RankLost)
        if lost is not None:
            return comm.lost_error(lost, **where)
        peer = _comm.find(error, _comm.PeerFailed)
        if peer is not None:
            errors = [failure.error() for failure in peer.failures]
            first: WorkerFailedError = errors[0]
            first.other_failures = tuple(errors[1:])
            return first
        if comm.announced:
            return error
        failure = _comm.describe(error, comm.rank, self.devices[0], **where)
        with anyio.CancelScope(shield=True):
            failures = await anyio.to_thread.run_sync(comm.announce, failure, ANNOUNCE_TIMEOUT)
        if isinstance(error, WorkerFailedError):
            error.rank = comm.rank
            others = [f.error() for f in failures if f.rank != comm.rank]
            error.other_failures = (*error.other_failures, *others)
        return error

    def _source_model(self) -> Any:
        raise NotImplementedError

    def _rank_data(self, data: Iterable[Any], epoch: int) -> Iterable[Any]:
        """This rank's part of ``data`` (all of it outside a process group)."""
        comm = self._comm
        if comm is None:
            return data
        seed = (self._data_seed or 0) + epoch
        return rank_view(data, comm.rank, comm.world_size, seed)

    async def _exchange(self, kind: int, sums: Sums | None = None, active: bool = False) -> Global:
        """A header-only exchange (validation's end, the stop check, the fit's end)."""
        comm = self._comm
        assert comm is not None
        sums = sums or Sums()
        stop = self._stop_reason is not None

        def run() -> Global:
            return comm.header(
                kind,
                items=sums.items,
                loss=sums.loss,
                metrics=sums.metrics,
                active=active,
                stop=stop,
            )

        result = await anyio.to_thread.run_sync(run)
        self._agree_on_stop(result)
        return result

    def _agree_on_stop(self, result: Global) -> None:
        if result.stop and not self._stop_agreed:
            self._stop_agreed = True
            if self._stop_reason is None:
                self._stop_reason = "stop() was called on another rank"

    # -- a step --------------------------------------------------------------------------------

    async def _distributed_step(self, window: Window, epoch: int) -> float | None:
        """Forward and backward for the window's batches not yet run, then the exchange and
        the optimizer step. Sets ``window.sums`` to the sums over every rank."""
        if self._fusable(window):
            return await self._distributed_fused_step(window, epoch)
        await self._forward_backward(window, epoch)
        return await self._distributed_optimizer_step(window)

    def _exchange_work(self, window: Window) -> ExchangeWork:
        return ExchangeWork(
            active=window.batch_count > 0,
            clip=self.gradient_clip_val,
            loss_scale=self._scaler.scale if self._scaler is not None else None,
            stop=lambda: self._stop_reason is not None,
        )

    def _settle(self, window: Window, result: Global) -> None:
        """Make the window's sums the global ones (what the step's reports show)."""
        self._last_global = result
        window.sums = Sums(
            result.items,
            result.loss,
            dict(result.metrics),
            sum(1 << i for i, used in enumerate(result.used) if used),
        )
        self._agree_on_stop(result)

    async def _distributed_fused_step(self, window: Window, epoch: int) -> float | None:
        shards = self._shards(window.batches[window.done])
        counts = [shard_items(shard) for shard in shards]
        opens = window.done == 0
        self._window_open = True
        self._apply_id += 1
        apply = ApplyWork(
            1.0, self.atomic_steps, self.lr_scheduler_interval == "step", self._apply_id, ()
        )
        train = TrainWork(shards[0], float(counts[0]), counts[0], opens)
        exchange = self._exchange_work(window)
        comm = self._comm
        assert comm is not None
        earlier = window.sums

        def job(ctx: WorkerContext, _: Any) -> tuple[Global, float | None]:
            return self._jobs().distributed_step(ctx, train, earlier, apply, exchange, comm)

        try:
            result = await self._require_scheduler().run(
                job, [None], items=counts, step=self.global_step, epoch=epoch, phase="train"
            )
        except BaseException as error:
            if isinstance(error, WorkerFailedError):
                error.phase = getattr(error.__cause__, "_asyncddp_phase", error.phase)
            stepped = self._replicas[0].stepped_at == self._apply_id
            undone = not await self._abandon(self._apply_id)
            if not undone or (not self.atomic_steps and stepped):
                self._consistent = False
            raise
        result_global, lr = result.outputs[0]
        name = self.devices[0].name
        window.device_items[name] = window.device_items.get(name, 0) + counts[0]
        window.done += 1
        self._settle(window, result_global)
        self._window_open = False
        return lr

    async def _distributed_optimizer_step(self, window: Window) -> float | None:
        """The exchange, on a thread of its own, between the in-process reduce and the step."""
        comm = self._comm
        assert comm is not None
        n = len(self.devices)
        jobs = self._jobs()
        if n > 1:  # sum the devices' buckets into each owner's chunk; the scale comes later
            await self._run_all(jobs.reduce, (1.0, False, False), phase="reduce")
        buckets = [
            tensor
            for replica in self._replicas
            for tensor in (replica.grads.scratch if n > 1 else replica.grads.buffers)
        ]
        used = [bool(window.sums.used >> i & 1) for i in range(comm.params)]
        exchange = self._exchange_work(window)
        local = window.sums

        def run() -> tuple[Global, float, bool]:
            return exchange_gradients(comm, local, used, buckets, exchange)

        result, coefficient, finite = await anyio.to_thread.run_sync(run)
        self._settle(window, result)
        if result.items == 0:  # no rank had data: no step is taken or counted
            await self._abandon()
            return None
        if self._scaler is not None:
            self._scaler.update(finite)
            if not finite:  # every rank sees the same sums: all skip this step together
                await self._abandon()
                return self._replicas[0].lr()
        self._apply_id += 1
        unused = tuple(i for i, used_anywhere in enumerate(result.used) if not used_anywhere)
        work = ApplyWork(
            coefficient,
            self.atomic_steps,
            self.lr_scheduler_interval == "step",
            self._apply_id,
            unused,
        )
        try:
            applied = await self._run_all(jobs.apply, work, phase="optimizer", shield=True)
        except BaseException:
            if not self.atomic_steps or await self._abandon(self._apply_id):
                self._consistent = False
            raise
        self._window_open = False
        lr: float | None = applied.outputs[0]
        return lr
