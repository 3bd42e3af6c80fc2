"""One device's share of data-parallel training: its replica, and the jobs its worker runs.

Everything here runs on a device's worker thread, never on the event loop. The trainer hands
these jobs to :class:`StepScheduler.run`; a job finds its replica by ``ctx.device.index``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._data import move_to
from ._devices import Device
from ._exceptions import StepOutputError
from ._sync import FlatGrads, StepBackup, all_gather, reduce_scatter
from ._worker import WorkerContext

__all__ = ["Replica", "Sums", "StepFunction", "build_replica", "loss_and_metrics"]

#: ``step(model, batch)`` returns the loss, or a mapping with ``"loss"`` and further metrics.
StepFunction = Callable[[nn.Module, Any], "torch.Tensor | Mapping[str, Any]"]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


@dataclass
class Sums:
    """Per-device sums over items: ``sum(loss_i * n_i)`` and the same for each metric."""

    items: int
    loss: float
    metrics: dict[str, float]


class Replica:
    """A device's model, optimizer, LR scheduler and flat gradient buffers."""

    def __init__(
        self,
        device: Device,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
    ) -> None:
        self.device = device
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [
            b for b in model.buffers() if b.is_floating_point() or b.dtype == torch.long
        ]
        self.grads: FlatGrads = FlatGrads(self.params, 1, 0)
        self.backup = StepBackup()

    def regroup(self, parts: int, index: int) -> None:
        """Re-cut the gradient buffers for ``parts`` replicas, this one at ``index``."""
        self.grads = FlatGrads(self.params, parts, index)

    def lr(self) -> float | None:
        groups = self.optimizer.param_groups
        return float(groups[0]["lr"]) if groups and "lr" in groups[0] else None


def build_replica(
    source: nn.Module,
    device: Device,
    *,
    use_source: bool,
    optimizer: OptimizerFactory,
    scheduler: SchedulerFactory | None,
) -> Replica:
    """Copy ``source`` onto ``device`` (or use it as it is) and give it an optimizer."""
    model = source if use_source else copy.deepcopy(source).to(device.torch_device)
    opt = optimizer(p for p in model.parameters() if p.requires_grad)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer"
        )
    return Replica(device, model, opt, scheduler(opt) if scheduler is not None else None)


def loss_and_metrics(output: object, *, training: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    """Read a step's output: the scalar loss, and any further metrics."""
    if isinstance(output, torch.Tensor):
        loss, metrics = output, {}
    elif isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
        metrics = {str(k): v for k, v in output.items() if k != "loss"}
    else:
        raise StepOutputError(
            f"the step returned {_kind(output)}; return the loss (a scalar tensor, the mean over "
            "the shard's items), or a dict with a 'loss' entry and further metrics"
        )
    if not isinstance(loss, torch.Tensor):
        raise StepOutputError(f"the step's loss is {_kind(loss)}, not a tensor")
    if loss.numel() != 1:
        raise StepOutputError(
            f"the step's loss has shape {tuple(loss.shape)}; return a scalar, the mean over the "
            "shard's items (for example loss.mean())"
        )
    if training and not loss.requires_grad:
        raise StepOutputError(
            "the step's loss does not require grad: was it computed under torch.no_grad(), or "
            "from detached tensors?"
        )
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise StepOutputError(
                f"metric {name!r} has shape {tuple(value.shape)}; metrics are scalars, means "
                "over the shard's items"
            )
        if not isinstance(value, (torch.Tensor, int, float)):
            raise StepOutputError(f"metric {name!r} is {_kind(value)}, not a number or tensor")
    return loss, metrics


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return "None" if value is None else f"a {type(value).__name__}"


class Jobs:
    """The jobs one trainer runs on its devices' workers, bound to its replicas and config."""

    def __init__(
        self,
        replicas: list[Replica],
        step: StepFunction,
        valid_step: StepFunction,
        autocast: torch.dtype | None,
    ) -> None:
        self.replicas = replicas
        self.step = step
        self.valid_step = valid_step
        self.autocast = autocast

    def _forward(self, fn: StepFunction, replica: Replica, shard: Any, ctx: WorkerContext) -> Any:
        batch = move_to(shard, ctx.torch_device, non_blocking=True)
        if self.autocast is None:
            return fn(replica.model, batch)
        with torch.autocast(ctx.device.type, dtype=self.autocast):
            return fn(replica.model, batch)

    def train(self, ctx: WorkerContext, work: tuple[Any, float, int]) -> Sums:
        """Forward and backward on one shard; gradients accumulate into the flat buffers."""
        shard, weight, items = work
        replica = self.replicas[ctx.device.index]
        if items == 0:
            return Sums(0, 0.0, {})
        loss, metrics = loss_and_metrics(
            self._forward(self.step, replica, shard, ctx), training=True
        )
        (loss * weight if weight != 1.0 else loss).backward()  # type: ignore[no-untyped-call]
        replica.grads.attach()  # in case the step replaced a .grad
        # Host-device sync point: the loss comes back as a Python float.
        return Sums(
            items, float(loss.detach()) * items, {k: float(v) * items for k, v in metrics.items()}
        )

    def validate(self, ctx: WorkerContext, work: tuple[Any, int]) -> Sums:
        shard, items = work
        replica = self.replicas[ctx.device.index]
        if items == 0:
            return Sums(0, 0.0, {})
        with torch.no_grad():
            loss, metrics = loss_and_metrics(
                self._forward(self.valid_step, replica, shard, ctx), training=False
            )
        return Sums(items, float(loss) * items, {k: float(v) * items for k, v in metrics.items()})

    def reduce(self, ctx: WorkerContext, work: tuple[float, bool]) -> tuple[float, bool]:
        scale, want_norm = work
        grads = [replica.grads for replica in self.replicas]
        return reduce_scatter(grads, ctx.device.index, scale, want_norm=want_norm)

    def apply(self, ctx: WorkerContext, work: tuple[float, bool, bool]) -> float | None:
        """All-gather the reduced gradients, then take the optimizer step."""
        coefficient, atomic, scheduler_step = work
        index = ctx.device.index
        replica = self.replicas[index]
        all_gather([r.grads for r in self.replicas], index, coefficient)
        if atomic:
            replica.backup.capture(replica.params, replica.optimizer, replica.scheduler)
        replica.optimizer.step()
        if scheduler_step and replica.scheduler is not None:
            replica.scheduler.step()
        replica.grads.zero_()
        if index:
            # Buffers (BatchNorm statistics) follow the first replica, as DDP's
            # broadcast_buffers: the first replica's buffers are not written in this step.
            with torch.no_grad():
                for mine, first in zip(replica.buffers, self.replicas[0].buffers, strict=True):
                    mine.copy_(first, non_blocking=True)
        return replica.lr()

    def rollback(self, ctx: WorkerContext, _: object) -> None:
        replica = self.replicas[ctx.device.index]
        replica.backup.restore(replica.params, replica.optimizer, replica.scheduler)
        replica.grads.zero_()

    def zero_grads(self, ctx: WorkerContext, _: object) -> None:
        self.replicas[ctx.device.index].grads.zero_()

    def scheduler_step(self, ctx: WorkerContext, _: object) -> float | None:
        replica = self.replicas[ctx.device.index]
        if replica.scheduler is not None:
            replica.scheduler.step()
        return replica.lr()

    def regroup(self, ctx: WorkerContext, parts: int) -> None:
        self.replicas[ctx.device.index].regroup(parts, ctx.device.index)

    def snapshot(self, ctx: WorkerContext, wanted: bool) -> dict[str, Any] | None:
        """The first replica's state on the CPU (copied, so training may go on)."""
        if not wanted:
            return None
        replica = self.replicas[ctx.device.index]
        return {
            "model": _to_cpu(replica.model.state_dict()),
            "optimizer": _to_cpu(replica.optimizer.state_dict()),
            "lr_scheduler": replica.scheduler.state_dict() if replica.scheduler else None,
        }

    def load(self, ctx: WorkerContext, state: Mapping[str, Any]) -> None:
        replica = self.replicas[ctx.device.index]
        replica.model.load_state_dict(state["model"])
        # A private copy: Optimizer.load_state_dict keeps tensors that already match the
        # parameters' device and dtype, and replicas must never share optimizer state.
        replica.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        if replica.scheduler is not None and state.get("lr_scheduler") is not None:
            replica.scheduler.load_state_dict(state["lr_scheduler"])
        replica.grads.attach()
        replica.grads.zero_()


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_cpu(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu(item) for item in value)
    return value
