"""One optimizer step across the ranks of a process group (``asyncddp.distributed``).

Within a rank a step runs forward and backward on every device and sums their gradients (a
reduce-scatter into each device's scratch buffer, as the exchanged chunks must not be live
gradients, see `._sync`); then one exchange with the other ranks (`._comm`): the header,
whose sums give every rank the step's global item count, loss, metrics, ``stop()`` requests and
failures, then the gradient buckets. The gradients are summed over items (each device's loss is
multiplied by its item count), so dividing the all-reduced sum by the global item count gives
the mean over every item of every rank, however unevenly they were spread.

With one device per rank (the usual ``torchrun`` set-up), and no loss scaling, the whole step is
one job on the device's worker: forward, backward, the exchange, the optimizer step. Not with a
``step_timeout``, which bounds a device's own work: waiting in the exchange for a slower rank is
not, so the exchange then runs apart, on a thread of its own, as with several devices.

Cancellation: a collective cannot be left half way (the other ranks are in it, and a rank that
went on would issue its next collectives while these still run), so a cancellation waits for
the exchange in progress. Once a step's exchange is done every rank takes that step, so a
cancelled rank takes and counts it too, and the cancellation goes on right after it: the
ranks stay identical, and the others hear of the cancellation at their next exchange.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import torch
from torch import nn

from . import _checkpoint, _comm, distributed
from ._checks import warn_user
from ._comm import Comm, Global
from ._exceptions import AsyncDDPRuntimeWarning, ConfigurationError, WorkerFailedError
from ._exit import wait_at_exit
from ._jobs import ExchangeWork, Sums, TrainWork, exchange_gradients
from ._loop import current_waker
from ._ranks import rank_view, set_sampler_epoch
from ._steps import Steps, Window, phase_from_jobs, shard_items
from ._sync import bucket_layout, grad_layout
from ._worker import WorkerContext

__all__ = ["DistributedSteps", "collective", "for_other_trainers_call"]

#: How long a failing rank waits for the others to hear of it before it raises anyway.
ANNOUNCE_TIMEOUT = 60.0

T = TypeVar("T")

#: The trainer whose fit or validate runs in this process's process group (see
#: `DistributedSteps._claim_group`), held weakly.
_GROUP_CALL: weakref.ref[Any] | None = None


def for_other_trainers_call(error: BaseException) -> bool:
    """Whether ``error`` is `DistributedSteps._claim_group`'s refusal for another trainer's
    call (this trainer has none running, so its event streams end: see ``Trainer.fit``). A
    plain `ConfigurationError`, marked: a subclass of its own showed its private name in the
    user's traceback."""
    return getattr(error, "for_other_trainers_call", False) is True


async def collective(
    fn: Callable[..., T],
    *args: Any,
    device: torch.device,
    name: str = "asyncddp-collective",
    after_cancel: float | None = None,
) -> tuple[T, BaseException | None]:
    """``fn(*args)``, which talks to the other ranks, on a thread of its own, awaited to its end
    even if the caller is cancelled meanwhile (``anyio.to_thread`` gives up on a plain
    ``task.cancel()`` and leaves the collective running). ``device`` is where the collectives'
    tensors live (`Comm.device`): a GPU is made the thread's current device, as NCCL's object
    collectives (``all_gather_object``, ``broadcast_object_list``) put their data on it; a new
    thread's is ``cuda:0``, another rank's GPU on all but one process a machine.

    ``name`` names the thread (a checkpoint's write uses it too: see
    ``Resumable._write_checkpoint``).

    Returns ``fn``'s value and the asyncio cancellation that came meanwhile, which the caller
    must re-raise, as that very object; a cancel scope's (trio, anyio) is held off and comes
    back by itself at the next checkpoint. If ``fn`` raised, so does this: with a cancellation,
    the cancellation, caused by ``fn``'s error (as `StepScheduler.run`).

    With ``after_cancel``, a cancellation (a task's, or a cancel scope's) waits that many
    seconds at most for ``fn``: then it is raised (`CollectiveLeft` its cause), and ``fn``
    goes on in its thread,
    which the interpreter's exit waits for a while. A notebook's stop button cancels once,
    and never raises the ``KeyboardInterrupt`` that ends a wait in a script.
    """
    waker = current_waker()
    outcome: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            outcome.append((True, fn(*args)))
        except BaseException as error:
            outcome.append((False, error))
        waker.wake_threadsafe()

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    cancellation: BaseException | None = None
    deadline: float | None = None
    while not outcome:
        # With after_cancel, a look every 0.25 s: a shielded wait tells of a cancellation
        # only once it returns, and of a cancel scope's (anyio, trio) not at all.
        wake = None if after_cancel is None else time.monotonic() + 0.25
        _, cancelled = await waker.wait_shielded(wake)
        if after_cancel is not None and deadline is None:
            scope = anyio.current_effective_deadline() == -math.inf  # its scope is cancelled
            if cancelled is not None or scope:
                deadline = time.monotonic() + after_cancel
        cancellation = cancellation or cancelled
        if not outcome and deadline is not None and time.monotonic() >= deadline:
            wait_at_exit(thread)
            left = CollectiveLeft(name, after_cancel or 0.0)
            if cancellation is not None:
                cancellation.__cause__ = left
                raise cancellation
            try:
                await anyio.lowlevel.checkpoint()  # raises the scope's cancellation
            except BaseException as error:
                error.__cause__ = left
                raise
    ok, value = outcome[0]
    if not ok:
        if cancellation is not None and isinstance(value, Exception):
            cancellation.__cause__ = value
            raise cancellation
        raise value
    return value, cancellation


class CollectiveLeft(Exception):
    """The cause of a cancellation that stopped waiting for a `collective` call still running
    in its thread (``after_cancel``)."""

    def __init__(self, name: str, seconds: float) -> None:
        super().__init__(
            f"{name} still running {seconds:g} s after the cancellation: it goes on in its "
            "thread, and this call ends without it"
        )


class DistributedSteps(Steps):
    """The cross-rank step of `Trainer` (a mixin: the trainer owns the state)."""

    _comm: Comm | None
    _from_rank_0: bool  # whether this rank has taken rank 0's model since joining
    _last_global: Global | None
    _stop_agreed: bool
    _stop_reason: str | None
    _data_seed: int | None
    _warned_alone: bool
    _cancelled_in_step: BaseException | None
    _running_call: str | None  # the fit() or validate() running (see Trainer._begin_call)
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

    def _claim_group(self, call: str) -> None:
        """In a process group, refuse ``call`` (``"fit()"``, ``"validate()"``) while another
        trainer's call runs in this process (`for_other_trainers_call`); else note this one's, until
        `_release_group`.

        Every trainer's collectives run on asyncddp's one group (`_comm.own_group`). Two
        trainers' calls at once would issue theirs in whatever order their threads reach
        them, and each rank's would meet another trainer's on the others: summed into the
        wrong model when the sizes match, else gloo aborts a process. Called before the
        call's first await (``Trainer._begin_call``), so that every rank, making the same calls
        in the same order, refuses the same one (no rank is left waiting for it).
        """
        global _GROUP_CALL
        if not distributed.is_initialized():
            return
        other = _GROUP_CALL() if _GROUP_CALL is not None else None
        if other is not None and other is not self:
            running = getattr(other, "_running_call", None) or "a call"
            error = ConfigurationError(
                f"{call} cannot start while another Trainer's {running} runs in this process: "
                "across processes one trainer's call runs at a time (the trainers' collectives "
                "share the process group, and would meet another trainer's on the other "
                f"ranks). Await that {running} first, and make the trainers' calls in the same "
                "order on every rank"
            )
            error.for_other_trainers_call = True  # type: ignore[attr-defined]
            raise error
        _GROUP_CALL = weakref.ref(self)

    def _release_group(self) -> None:
        """The end of the call `_claim_group` noted (if it noted one)."""
        global _GROUP_CALL
        if _GROUP_CALL is not None and _GROUP_CALL() is self:
            _GROUP_CALL = None

    def _call_options(self) -> dict[str, str]:
        """The options every rank must share that a user may assign between calls
        (``trainer.accumulate_grad_batches = 2``): compared as the ranks first meet, with the
        rest of the trainer, and in every later call's exchanges (`Comm.options`)."""
        return {
            "accumulate_grad_batches": _as_number(self.accumulate_grad_batches),
            "split_batches": str(bool(self.split_batches)),
            "gradient_clip_val": _as_number(self.gradient_clip_val, real=True),
            # Stepped per step on some ranks and per epoch on others, the ranks' learning
            # rates, and so their models, drift apart without a word.
            "lr_scheduler_interval": str(self.lr_scheduler_interval),
            # Stepped on another metric, or on none, the same.
            "lr_scheduler_monitor": str(self.lr_scheduler_monitor),
            "on_failure": str(self.on_failure),
        }

    async def _join(self, call: str) -> None:
        """Join the process group's training, once, if this process is in one; ``call`` is
        the call that joins or comes after (``"fit()"``, ``"validate()"``)."""
        if self._comm is not None and not self._comm.current():
            # Its process group was destroyed since (and maybe made anew): joined afresh, as
            # a trainer that trained alone joins a group made after its last call.
            self._comm = None
        if self._comm is not None:
            self._comm.announced = False  # a failure of an earlier call was announced then
            self._comm.options = self._call_options()  # as assigned since: compared again
            self._comm.begin_call(call)
            return
        if not distributed.is_initialized():
            world = os.environ.get("WORLD_SIZE", "1")
            if world.isdigit() and int(world) > 1 and not self._warned_alone:
                self._warned_alone = True
                warn_user(
                    f"WORLD_SIZE={world} is set (launched by torchrun?), but this process joined "
                    "no process group: each process trains alone, on all of its data. Call "
                    "asyncddp.distributed.init() before fit() to train across the processes",
                    AsyncDDPRuntimeWarning,
                )
            return
        model = self._source_model()
        params = [p for p in model.parameters() if p.requires_grad]
        frozen = [(tuple(p.shape), p.dtype) for p in model.parameters() if not p.requires_grad]
        options = self._call_options()
        fingerprint = {
            "params": str([(tuple(p.shape), p.dtype) for p in params]),
            "devices": str(len(self.devices)),
            **options,
            "loss scaling": str(self._scaler is not None),
            # Under autocast on some ranks only, their gradients' rounding differs from the
            # others'. Compared by dtype: Lightning's names ("bf16-mixed") are the same.
            "autocast": str(self._autocast or "off").removeprefix("torch."),
            "buffers": str([(tuple(b.shape), b.dtype) for b in model.buffers()]),
            "frozen": str(frozen),
            # A weight laid out otherwise on some rank (channels_last) orders its gradient so
            # in the flat buffers, which the ranks sum element by element.
            "memory layouts": str(
                [(i, s) for i, p in enumerate(params) if (s := grad_layout(p)) is not None]
            ),
            **self._optimizer_settings(model),
        }
        comm = Comm(self.devices, len(params), fingerprint, call=call)
        comm.options = options
        comm.layout = bucket_layout(params, len(self.devices))
        try:
            _, cancellation = await collective(comm.setup, device=comm.device)
        except BaseException as error:
            lost = _comm.find(error, _comm.RankLost)
            if lost is None:
                raise
            # A rank gone before it joined (it died building its model, say): named, as a
            # rank lost later is (see _across_ranks, which needs the joined self._comm).
            raise comm.lost_error(lost, step=self.global_step, epoch=self.epoch) from lost
        if self.on_failure != "raise":
            # Refused after the set-up, which every rank reaches (and which refuses ranks that
            # differ in it): refused before it on some ranks only, the others would wait in it
            # for the process group's timeout.
            raise ConfigurationError(
                f"on_failure={self.on_failure!r} is not supported across processes yet: a "
                "failed rank makes every rank raise (on_failure='raise')"
            )
        self._comm = comm
        self._from_rank_0 = False  # the first fit or validate session takes rank 0's model
        self._items_ref = None  # every rank must weight counted items alike: from 1 again
        if self._data_seed is None:
            self._data_seed = comm.data_seed
        if cancellation is not None:
            raise cancellation

    def _optimizer_settings(self, model: nn.Module) -> dict[str, str]:
        """The optimizer's kind and its groups' settings, and the LR scheduler's kind and
        settings, for the ranks to compare: different ones (a learning rate read from a
        rank's environment, say) would train the ranks' models apart without a word. Read
        from the first replica's, else from ones the factories build over a meta-device copy
        of the model (as a checkpoint's check does); left out where they cannot be built."""
        optimizer = scheduler = None
        if self._replicas:
            optimizer, scheduler = self._replicas[0].optimizer, self._replicas[0].scheduler
        else:
            probe = _checkpoint.on_meta(model)
            if probe is not None:
                params = [p for p in probe.parameters() if p.requires_grad]
                optimizer = _checkpoint.made(self._optimizer_factory, params)
                if isinstance(optimizer, torch.optim.Optimizer) and self._scheduler_factory:
                    scheduler = _checkpoint.made(self._scheduler_factory, optimizer)
        if not isinstance(optimizer, torch.optim.Optimizer):
            return {}
        groups = [
            {k: _plain(v) for k, v in group.items() if k != "params"}
            | {"params": len(group["params"])}
            for group in optimizer.param_groups
        ]
        settings = {"optimizer": _same_everywhere(f"{type(optimizer).__name__} {groups}")}
        if scheduler is not None:
            state = {
                k: _plain(v) for k, v in scheduler.state_dict().items() if not k.startswith("_")
            }
            settings["lr_scheduler"] = _same_everywhere(f"{type(scheduler).__name__} {state}")
        return settings

    async def _take_rank_0s_model(self) -> None:
        """In the first fit or validate session after joining (every rank is in it), once the
        replicas are built and a loaded state is in them: every rank takes rank 0's
        parameters and buffers, as DDP does when it wraps a model, so that ranks seeded or
        loaded differently train one model. Sent into the first replica, loaded into the
        others by the load job a resume uses (on each device's worker and stream); a
        cancellation meanwhile waits for it (every rank takes part)."""
        comm = self._comm
        if comm is None or self._from_rank_0:
            return
        first = self._replicas[0].model
        tensors = [*first.parameters(), *first.buffers()]
        _, cancellation = await collective(comm.broadcast_from_rank_0, tensors, device=comm.device)
        if len(self._replicas) > 1:
            await self._run_all(self._jobs().load, {"model": first.state_dict()}, phase="setup")
        self._from_rank_0 = True
        if cancellation is not None:
            raise cancellation

    async def _across_ranks(self, error: BaseException) -> BaseException:
        """What to raise for ``error`` in a process group, after the other ranks know of it.

        Another rank's failure becomes a `WorkerFailedError` naming that rank and its
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
        with anyio.CancelScope(shield=True):  # this rank is raising already
            failures, interrupted = await collective(
                comm.announce, failure, ANNOUNCE_TIMEOUT, device=comm.device
            )
        if isinstance(interrupted, KeyboardInterrupt):  # trio's Ctrl-C, held off meanwhile
            interrupted.__context__ = error
            return interrupted
        disagreement = _comm.disagreement(error)
        if disagreement is not None:  # every rank found it in the same exchange
            return disagreement
        if isinstance(error, WorkerFailedError):
            error.rank = comm.rank
            others = [f.error() for f in failures if f.rank != comm.rank]
            error.other_failures = (*error.other_failures, *others)
        return error

    def _source_model(self) -> Any:
        raise NotImplementedError

    def _rank_data(self, data: Iterable[Any], epoch: int) -> Iterable[Any]:
        """This rank's part of ``data`` (all of it outside a process group), its samplers told
        the epoch."""
        comm = self._comm
        if comm is None:
            set_sampler_epoch(data, epoch)
            return data
        seed = (self._data_seed or 0) + epoch
        return rank_view(data, comm.rank, comm.world_size, seed, epoch)

    async def _exchange(
        self, kind: int, sums: Sums | None = None, active: bool = False, last: bool = False
    ) -> Global:
        """A header-only exchange (validation's end, the stop check, the fit's end).

        ``last``: the call's last exchange. Once it is done every rank has ended the call, so a
        cancellation that came meanwhile is not announced: no rank would hear of it, and the
        announcement would meet their next call's exchanges instead.
        """
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
                metric_items=sums.metric_items,
                active=active,
                stop=stop,
                counted=sums.counted,
            )

        result, cancellation = await collective(run, device=comm.device)
        self._agree_on_stop(result)
        if cancellation is not None:
            if last:
                comm.announced = True  # nothing to tell: see above
            raise cancellation
        return result

    def _agree_on_stop(self, result: Global) -> None:
        if result.stop and not self._stop_agreed:
            self._stop_agreed = True
            if self._stop_reason is None:
                self._stop_reason = "stop() was called on another rank"

    # -- a step --------------------------------------------------------------------------------

    async def _distributed_step(self, window: Window, epoch: int) -> float | None:
        """Forward and backward for the window's batches not yet run, then the exchange and
        the optimizer step. Sets ``window.sums`` to the sums over every rank.

        A cancellation that comes once the exchange is done is kept in ``_cancelled_in_step``:
        the step is taken here as on every rank, and the caller raises it once it is counted.
        """
        self._cancelled_in_step = None
        if len(self.devices) == 1 and self._fusable(window) and self.step_timeout is None:
            return await self._distributed_fused_step(window, epoch)
        await self._forward_backward(window, epoch)
        return await self._distributed_optimizer_step(window)

    def _exchange_work(self, window: Window) -> ExchangeWork:
        return ExchangeWork(
            active=window.batch_count > 0,
            clip=self.gradient_clip_val,
            loss_scale=self._scaler.scale if self._scaler is not None else None,
            stop=lambda: self._stop_reason is not None,
            ref=window.ref,
        )

    def _settle(self, window: Window, result: Global) -> None:
        """Make the window's sums the global ones (what the step's reports show)."""
        self._last_global = result
        window.sums = Sums(
            result.items,
            result.loss,
            dict(result.metrics),
            sum(1 << i for i, used in enumerate(result.used) if used),
            result.counted > 0,
            dict(result.metric_items),
        )
        self._agree_on_stop(result)

    async def _distributed_fused_step(self, window: Window, epoch: int) -> float | None:
        shards = self._shards(window.batches[window.done])
        counts = [shard_items(shard) for shard in shards]
        opens = window.done == 0
        self._window_open = True
        apply = self._apply_work()  # its coefficient and unused parameters: found in the job
        if opens:
            window.ref = self._reference_count(counts[0])
            self._window += 1
        train = TrainWork(
            shards[0],
            counts[0] / window.ref,
            counts[0],
            self._window if opens else 0,
            per_item=1.0 / window.ref,
        )
        exchange = self._exchange_work(window)
        comm = self._comm
        assert comm is not None
        earlier = window.sums
        done: list[tuple[Global, float | None]] = []  # the job's outcome, even if cancelled

        def job(ctx: WorkerContext, _: Any) -> tuple[Global, float | None]:
            outcome = self._jobs().distributed_step(ctx, train, earlier, apply, exchange, comm)
            done.append(outcome)
            return outcome

        try:
            # Shielded: the job's exchange cannot be left half way (see the module's notes).
            result = await self._require_scheduler().run(
                job,
                [None],
                items=counts,
                step=self.global_step,
                epoch=epoch,
                phase="train",
                shield=True,
            )
            result_global, lr = result.outputs[0]
        except BaseException as error:
            if done and not isinstance(error, Exception):
                # Cancelled, but every rank took this step: so does this one.
                result_global, lr = done[0]
                self._cancelled_in_step = error
            else:
                phase_from_jobs(error)
                stepped = self._replicas[0].stepped_at == self._apply_id
                undone = not await self._abandon(self._apply_id)
                if not undone or (not self.atomic_steps and stepped):
                    self._consistent = False
                raise
        name = self.devices[0].name
        window.device_items[name] = window.device_items.get(name, 0) + counts[0]
        window.done += 1
        self._settle(window, result_global)
        if window.sums.counted and window.sums.items == 0:
            # Counts from the step, every one 0: no rank stepped; undo the forwards (model
            # buffers) as the ordinary path does.
            await self._abandon()
            return lr
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
        assert not self._replicas[0].grads.loose, "a process group exchanges flat buffers"
        buckets = [
            tensor
            for replica in self._replicas
            for tensor in (replica.grads.scratch if n > 1 else replica.grads.buffers)
        ]
        used = [bool(window.sums.used >> i & 1) for i in range(comm.params)]
        exchange = self._exchange_work(window)
        local = window.sums
        buffers = self._replicas[0].buffers

        def run() -> tuple[Global, float, bool]:
            return exchange_gradients(comm, local, used, buckets, buffers, exchange)

        outcome, self._cancelled_in_step = await collective(run, device=comm.device)
        result, coefficient, finite = outcome
        self._settle(window, result)
        if result.items == 0:  # no rank had data: no step is taken or counted
            await self._abandon()
            return None
        if self._scaler is not None:
            self._scaler.update(finite)
            if not finite:  # every rank sees the same sums: all skip this step together
                await self._abandon()
                return self._replicas[0].lr()
        # A cancellation once the exchange is done (kept in _cancelled_in_step): every rank
        # takes this step, so does this one.
        return await self._apply(self._apply_work(coefficient, result.unused))


def _same_everywhere(text: str) -> str:
    """A setting's repr without what differs between processes running the same code: the
    addresses of objects (a function's, an instance's without a repr of its own)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _plain(value: Any) -> Any:
    """A setting as every rank writes it alike: a tensor's values, not its device; a set in
    order, not in its hashes' (which differ between processes); inside containers too."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(item) for item in value), key=repr)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _as_number(value: object, *, real: bool = False) -> str:
    """An option's number as every rank writes it, whatever its type: ``1``, ``1.0`` and
    NumPy's ``int64(1)`` alike (as `float` with ``real``); anything else as it is, for the
    option's own check to refuse."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    number = float(value)
    return str(number if real or not number.is_integer() else int(number))
