"""One rank of a distributed test: ``python tests/distributed_worker.py SCENARIO OUT_DIR``.

Started by ``tests/test_distributed.py`` with the torchrun environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) set by hand. Writes what it saw to ``OUT_DIR/rank{RANK}.pt``.
``python tests/distributed_worker.py --serve`` is the tests' fork server (:func:`serve`), which
forks ranks that need not import torch again.
"""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import json
import math
import os
import select
import signal
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import asyncddp
import asyncddp.distributed
from asyncddp import _comm

FAIL_AT = 3  # the global step at which the failure scenarios fail


async def outcome(fit: Any) -> Any:
    """How an awaited fit ended: None, "cancelled", or the failed rank and error type."""
    try:
        await fit
    except asyncio.CancelledError:
        return "cancelled"
    except asyncddp.WorkerFailedError as error:
        return (error.rank, error.error_type)
    return None


async def refusal(fit: Any) -> str | None:
    """How an awaited fit ended: None, or the message of the ConfigurationError that refused it."""
    try:
        await fit
    except asyncddp.ConfigurationError as error:
        return str(error)
    return None


async def note_failure(fit: Any, report: dict[str, Any]) -> None:
    """Await a fit and note in ``report`` how it failed: ``error`` (None if it did not), and
    the error's ``error_type``, ``error_rank`` and ``cause``."""
    try:
        await fit
        report["error"] = None
    except asyncddp.AsyncDDPError as error:
        report["error"] = f"{type(error).__name__}: {error}"
        report["error_type"] = getattr(error, "error_type", None)
        report["error_rank"] = getattr(error, "rank", None)
        report["cause"] = f"{type(error.__cause__).__name__}: {error.__cause__}"


def this_step() -> int:
    """The number of the step a step function runs in, as the scheduler numbered it."""
    ctx = asyncddp.current_worker()
    assert ctx is not None
    return ctx.step


def this_device() -> int:
    """The index of the device a step function runs on."""
    ctx = asyncddp.current_worker()
    assert ctx is not None
    return ctx.device.index


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(count: int = 7, size: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of ``size`` items, the last one shorter (uneven on purpose)."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for i in range(count):
        n = size if i < count - 1 else size // 2 + 1
        inputs = torch.randn(n, 6, generator=generator)
        out.append((inputs, torch.randint(0, 3, (n,), generator=generator)))
    return out


def step(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    logits = model(inputs)
    return {
        "loss": F.cross_entropy(logits, targets),
        "accuracy": (logits.argmax(1) == targets).float().mean(),
    }


def token_batches(count: int = 6, size: int = 8) -> list[tuple[torch.Tensor, ...]]:
    """Sequences of 5 positions, each with its own number of valid tokens (0 to 5)."""
    generator = torch.Generator().manual_seed(2)
    out = []
    for _ in range(count):
        inputs = torch.randn(size, 5, 6, generator=generator)
        targets = torch.randint(0, 3, (size, 5), generator=generator)
        lengths = torch.randint(0, 6, (size,), generator=generator)
        out.append((inputs, targets, (torch.arange(5) < lengths[:, None]).float()))
    return out


def token_step(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """The mean over the shard's valid tokens, and how many there are (``"items"``)."""
    inputs, targets, mask = batch
    losses = F.cross_entropy(model(inputs).transpose(1, 2), targets, reduction="none")
    tokens = mask.sum()
    return {"loss": (losses * mask).sum() / tokens.clamp(min=1), "items": tokens}


def valid_step(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    logits = model(inputs)
    return {
        "loss": F.cross_entropy(logits, targets),
        "error": (logits.argmax(1) != targets).float().mean(),
    }


def rank_0_metric_step(model: torch.nn.Module, batch: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"loss": step(model, batch)["loss"]}
    if torch.distributed.get_rank() == 0:
        out["rank_0"] = 1.0
    return out


def rank_1_metric_step(model: torch.nn.Module, batch: Any) -> dict[str, Any]:
    out = valid_step(model, batch)
    if torch.distributed.get_rank() == 1:
        out["rank_1"] = 2.0
    return out


def trainer(
    devices: int,
    step: Any = step,
    optimizer: Any = torch.optim.SGD,
    seed: int = 0,
    **options: Any,
) -> asyncddp.Trainer:
    """The scenarios' trainer: ``model(seed)``, ``optimizer`` with lr 0.2 and momentum 0.9."""
    return asyncddp.Trainer(
        model(seed),
        functools.partial(optimizer, lr=0.2, momentum=0.9),
        step,
        devices=asyncddp.cpu_devices(devices),
        progress_bar=False,
        **options,
    )


# Halves the learning rate after any epoch whose validation loss is not below half the best:
# after the second epoch here, whatever the last digits of the loss.
PLATEAU = functools.partial(
    torch.optim.lr_scheduler.ReduceLROnPlateau, factor=0.5, patience=0, threshold=0.5
)


async def step_lrs(stream: asyncddp.EventStream, lrs: list[float | None]) -> None:
    """Append each step's learning rate (``StepEnded.lr``) to ``lrs`` until the fit ends."""
    async for event in stream:
        if isinstance(event, asyncddp.StepEnded):
            lrs.append(event.lr)


def batchnorm_trainer(devices: int) -> asyncddp.Trainer:
    """The scenarios' trainer for a model with buffers (BatchNorm's running statistics)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3)
    )
    return asyncddp.Trainer(
        net,
        functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9),
        step,
        devices=asyncddp.cpu_devices(devices),
        progress_bar=False,
    )


async def run(scenario: str, out: Path, rank: int) -> dict[str, Any]:
    report: dict[str, Any] = {"rank": rank}
    if scenario in ("exact-gpu", "exact-nccl"):  # on cuda:0: 2 ranks over gloo, 1 over NCCL
        t = asyncddp.Trainer(
            model(),
            functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9),
            step,
            devices="cuda:0" if scenario == "exact-gpu" else "auto",  # auto: cuda:LOCAL_RANK
            progress_bar=False,
        )
        result = await t.fit(batches(), epochs=2, valid_data=batches(5, 10))
        world = asyncddp.distributed.world()
        assert world is not None
        report["backend"] = world.backend
        report["devices"] = [device.name for device in t.devices]
        report["params"] = [p.detach().cpu() for p in t.model.parameters()]
        report["global_step"] = result.global_step
        report["history"] = [
            (r.train_loss, r.items, dict(r.valid_metrics or {})) for r in result.history
        ]
    elif scenario.startswith("exact"):  # exact1, exact2: devices per rank; exact-one: 1 batch
        t = trainer(1 if scenario == "exact-one" else int(scenario[-1]))
        data = batches(1) if scenario == "exact-one" else batches()

        async def last_progress(stream: asyncddp.EventStream) -> list[Any]:
            ends: dict[int, Any] = {}  # each epoch's last StepEnded.progress
            async for event in stream:
                if isinstance(event, asyncddp.StepEnded):
                    ends[event.epoch] = event.progress
            return [ends[epoch] for epoch in sorted(ends)]

        watcher = asyncio.create_task(last_progress(t.events()))
        result = await t.fit(data, epochs=2, valid_data=batches(5, 10))
        report["progress"] = [(p.items_processed, p.items_total, p.fraction) for p in await watcher]
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
        report["history"] = [
            (r.train_loss, dict(r.train_metrics), dict(r.valid_metrics or {}), r.items)
            for r in result.history
        ]
        report["global_step"] = result.global_step
        report["validate"] = await t.validate(batches(5, 10))
        report["packed"] = t._comm is not None and t._comm.packed()
    elif scenario == "counted-on-rank-0":  # rank 1's step gives no "items": refused on both

        def entries(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
            return {"loss": token_step(model, batch)["loss"]}

        t = trainer(1, step=token_step if rank == 0 else entries)
        try:
            await t.fit(token_batches(), epochs=1)
        except asyncddp.StepOutputError as error:
            report["error"] = str(error)
        report["global_step"] = t.global_step
    elif scenario.startswith("counted-micro-steps"):  # a window's 2nd micro-step gives no count
        calls: dict[int, int] = {}

        def first_only(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
            output = token_step(model, batch)
            index = this_device()
            calls[index] = calls.get(index, 0) + 1
            if calls[index] % 2 == 0:
                del output["items"]
            return output

        t = trainer(int(scenario[-1]), step=first_only, accumulate_grad_batches=2)
        try:
            await t.fit(token_batches(), epochs=1)
        except asyncddp.StepOutputError as error:
            report["error"] = str(error)
        report["global_step"] = t.global_step
    elif scenario.startswith("counted"):  # counted1, counted2, counted-uneven1, ...: devices
        t = trainer(int(scenario[-1]), step=token_step)  # per rank; uneven: 7 batches, not 6
        result = await t.fit(token_batches(7 if "uneven" in scenario else 6), epochs=1)
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
        report["global_step"] = result.global_step
        report["epoch"] = (result.history[0].train_loss, result.history[0].items)
    elif scenario.startswith("fit-then-join"):  # fit-then-join1, 2: devices per rank
        # A fit in one process first (no group yet: the gradients are reduced in process, and
        # every rank trains on every batch), then the trainer joins the group: the same
        # replicas' gradients are then reduced across ranks.
        t = trainer(int(scenario[-1]))
        await t.fit(batches(), epochs=1)
        asyncddp.distributed.init("gloo", timeout=120)
        result = await t.fit(batches(), epochs=2)
        report["global_step"] = result.global_step
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
    elif scenario.startswith("unseeded"):  # each rank's model starts from other weights
        # "unseeded-built": 2 devices per rank, their replicas built (by a checkpoint) before
        # the trainer joins the group; "unseeded-built-1": the same with 1 device per rank,
        # whose replica was built for one process (no gradient buffers to exchange).
        built = scenario.startswith("unseeded-built")
        t = trainer(2 if scenario == "unseeded-built" else 1, seed=100 + rank)
        if built:
            await t.save_checkpoint(out / f"before-{rank}.ckpt")
        result = await t.fit(batches(), epochs=2, valid_data=batches(5, 10))
        report["global_step"] = result.global_step
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
    elif scenario == "optimizer-raises":  # rank 1's optimizer step fails once it has stepped
        seen: dict[int, list[torch.Tensor]] = {}

        class Failing(torch.optim.SGD):
            def step(self, closure: Any = None) -> Any:
                result = super().step(closure)
                if rank == 1 and this_step() == FAIL_AT:
                    raise RuntimeError("injected optimizer failure on rank 1")
                return result

        def recording(model: torch.nn.Module, batch: Any) -> Any:
            seen[this_step()] = [p.detach().clone() for p in model.parameters()]
            return step(model, batch)

        t = trainer(1, step=recording, optimizer=Failing)
        try:
            await t.fit(batches(40, 8), epochs=1)
            report["error"] = None
        except asyncddp.WorkerFailedError as error:
            report["error"] = (error.rank, error.phase, error.error_type)
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
        report["before"] = seen[FAIL_AT]
        report["global_step"] = t.global_step
    elif scenario == "backup-raises":  # rank 1's step backup fails, in the step's exchange
        # A model with buffers: the exchange ends with their broadcast, a collective that the
        # failing rank must still join, or the others wait in it.
        from asyncddp import _sync

        capture, calls = _sync.StepBackup.capture, [0]

        def failing(self: Any, *args: Any, **kwargs: Any) -> None:
            calls[0] += 1
            if rank == 1 and calls[0] == FAIL_AT:
                raise MemoryError("injected: no room for the step's backup on rank 1")
            capture(self, *args, **kwargs)

        _sync.StepBackup.capture = failing  # type: ignore[method-assign]
        t = batchnorm_trainer(1)
        started = time.monotonic()
        try:
            await t.fit(batches(40, 8), epochs=1)
            report["error"] = None
        except asyncddp.WorkerFailedError as error:
            report["error"] = (error.rank, error.phase, error.error_type)
        report["seconds"] = time.monotonic() - started
        report["global_step"] = t.global_step
    elif scenario == "cancel-in-join":
        # Rank 1's first fit is cancelled while it waits for rank 0 (late) to join; then both
        # ranks fit again, to the end. (Found by review: the cancelled rank used to skip the
        # join's next collective, and both hung.)
        t = trainer(1)
        if rank == 0:
            await asyncio.sleep(1.0)  # late to the join
        fit = asyncio.ensure_future(t.fit(batches(), epochs=1))
        if rank == 1:
            asyncio.get_running_loop().call_later(0.3, fit.cancel)
        report["first"] = await outcome(fit)
        result = await t.fit(batches(), epochs=1)
        report["global_step"] = result.global_step
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
    elif scenario in ("checkpoint-before-fit", "loaded-differently"):
        # Before the first fit, 2 devices a rank: rank 0 alone saves a checkpoint (which builds
        # its replicas, not rank 1's); or each rank loads a state of its own, from a model of
        # its own seed. Every rank still trains rank 0's one model. (Found by review.)
        t = trainer(2)
        if scenario == "checkpoint-before-fit" and rank == 0:
            await t.save_checkpoint(out / "before.ckpt")
        if scenario == "loaded-differently":
            t.load_state_dict(trainer(1, seed=100 + rank).state_dict())
        result = await t.fit(batches(), epochs=2, valid_data=batches(5, 10))
        report["global_step"] = result.global_step
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
    elif scenario == "resume-on-rank-0-only":  # a mistake: the ranks' first calls differ
        if rank == 0:
            await trainer(1).save_checkpoint(out / "start.ckpt")
        t = trainer(1)
        try:
            if rank == 0:
                await t.fit(batches(), epochs=1, resume=out / "start.ckpt")
            else:
                await t.fit(batches(), epochs=1)
            report["error"] = None
        except asyncddp.AsyncDDPError as error:
            report["error"] = str(error)
    elif scenario == "checkpoint-while-joining":  # rank 0 saves one while its fit joins
        t = trainer(1)
        snapshot = t._snapshot

        async def slow_snapshot() -> dict[str, Any]:  # the checkpoint outlasts the join
            await asyncio.sleep(1.5)
            return await snapshot()

        t._snapshot = slow_snapshot  # type: ignore[method-assign]
        if rank == 1:
            await asyncio.sleep(1.0)  # late to the join
        fit = asyncio.ensure_future(t.fit(batches(), epochs=1))
        if rank == 0:
            await asyncio.sleep(0.3)  # rank 0's fit is joining
            await t.save_checkpoint(out / "during-join.ckpt")
        result = await fit
        report["global_step"] = result.global_step
    elif scenario == "distributed-sampler":  # the user's own DistributedSampler, shuffling
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        inputs = torch.randn(64, 6, generator=torch.Generator().manual_seed(3))
        inputs[:, 0] = torch.arange(64, dtype=torch.float32)  # each sample's index
        dataset = TensorDataset(inputs, torch.randint(0, 3, (64,)))
        loader = DataLoader(dataset, batch_size=8, sampler=DistributedSampler(dataset, seed=5))
        orders: dict[int, list[int]] = {}

        def recording(model: torch.nn.Module, batch: Any) -> Any:
            orders.setdefault(t.epoch, []).extend(int(i) for i in batch[0][:, 0])
            return step(model, batch)

        t = trainer(1, step=recording)
        await t.fit(loader, epochs=2)
        report["orders"] = orders
        expected = {}
        for epoch in range(2):
            sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, seed=5)
            sampler.set_epoch(epoch)
            expected[epoch] = list(sampler)
        report["expected"] = expected
    elif scenario in ("raise", "kill"):

        def failing(model: torch.nn.Module, batch: Any) -> Any:
            if rank == 1 and this_step() == FAIL_AT:
                if scenario == "kill":
                    # Both of this rank's devices get here: append (a second open must not
                    # truncate what the first wrote before its kill lands), one line each.
                    with (out / "killed_at").open("a") as marker:
                        marker.write(f"{time.time()!r}\n")
                    os.kill(os.getpid(), signal.SIGKILL)
                report["failed_at"] = time.time()
                raise ValueError("injected failure on rank 1")
            return step(model, batch)

        t = asyncddp.Trainer(
            model(),
            functools.partial(torch.optim.SGD, lr=0.1),
            failing,
            devices=asyncddp.cpu_devices(2),
            progress_bar=False,
        )
        try:
            await t.fit(batches(40, 8), epochs=1)
            report["error"] = None
        except asyncddp.WorkerFailedError as error:
            report["raised_at"] = time.time()
            report["error"] = str(error)
            report["error_rank"] = error.rank
            report["error_device"] = error.device.name
            report["cause"] = type(error.__cause__).__name__
            report["cause_message"] = str(error.__cause__)
            report["global_step"] = t.global_step
    elif scenario == "stop":
        t = trainer(1)

        async def stopper() -> None:
            async for event in t.events():
                if rank == 1 and isinstance(event, asyncddp.StepEnded) and event.step == 2:
                    t.stop("rank 1 had enough")

        async with asyncio.TaskGroup() as group:
            group.create_task(stopper())
            result = await t.fit(batches(40, 8), epochs=3)
        report.update(
            stopped=result.stopped,
            reason=result.stop_reason,
            global_step=result.global_step,
            params=[p.detach().clone() for p in t.model.parameters()],
        )
    elif scenario.startswith("checkpoint"):  # checkpoint-first, checkpoint-resume, -straight
        directory = out / "checkpoints"
        t = trainer(1, checkpoint_dir=directory)
        if scenario == "checkpoint-first":
            await t.fit(batches(), epochs=1)
        elif scenario == "checkpoint-resume":
            await t.fit(batches(), epochs=2, resume="latest")
        else:
            t.checkpoint_dir = None
            await t.fit(batches(), epochs=2)
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
        report["global_step"] = t.global_step
        report["files"] = sorted(p.name for p in directory.glob("*")) if directory.exists() else []
    elif scenario == "metrics":  # validation reports a metric that training does not
        t = trainer(1, valid_step=valid_step)
        result = await t.fit(batches(), epochs=2, valid_data=batches(5, 10))
        report["history"] = [
            (dict(r.train_metrics), dict(r.valid_metrics or {})) for r in result.history
        ]
        report["validate"] = await t.validate(batches(5, 10))
    elif scenario == "partial-metrics":  # a metric that one rank's steps return, not the other's
        t = trainer(1, step=rank_0_metric_step, valid_step=rank_1_metric_step)
        result = await t.fit(batches(), epochs=1, valid_data=batches(5, 10))
        record = result.history[0]
        report["history"] = (dict(record.train_metrics), dict(record.valid_metrics or {}))
        report["validate"] = await t.validate(batches(5, 10))
    elif scenario.startswith("batchnorm"):  # batchnorm1, batchnorm2: devices per rank
        t = batchnorm_trainer(int(scenario[-1]))
        await t.fit(batches(), epochs=1)
        report["state"] = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
        report["validate"] = await t.validate(batches(5, 10))
    elif scenario == "mixed-devices":  # rank 0 has one device, rank 1 two
        t = trainer(1 + rank)
        report["error"] = await refusal(t.fit(batches(), epochs=1))
    elif scenario.startswith("on-failure-"):  # "drop" on rank 1, or on both ranks
        both = scenario == "on-failure-both"
        t = trainer(1, on_failure="drop" if rank == 1 or both else "raise")
        report["error"] = await refusal(t.fit(batches(), epochs=1))
    elif scenario == "optimizer-differs":  # rank 1's learning rate, from its environment say
        lr = 0.3 if rank == 1 else 0.2
        t = asyncddp.Trainer(
            model(0),
            functools.partial(torch.optim.SGD, lr=lr, momentum=0.9),
            step,
            devices=asyncddp.cpu_devices(1),
            lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2),
            progress_bar=False,
        )
        report["error"] = await refusal(t.fit(batches(), epochs=1))
    elif scenario == "scheduler-differs":  # rank 1 steps its learning rate every 3 epochs
        t = trainer(
            1,
            lr_scheduler=functools.partial(
                torch.optim.lr_scheduler.StepLR, step_size=3 if rank == 1 else 2
            ),
        )
        report["error"] = await refusal(t.fit(batches(), epochs=1))
    elif scenario == "interval-differs":  # rank 1 steps its learning rate each step
        t = trainer(
            1,
            lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2),
            lr_scheduler_interval="step" if rank == 1 else "epoch",
        )
        report["error"] = await refusal(t.fit(batches(), epochs=1))
    elif scenario == "monitor-differs":  # rank 1's ReduceLROnPlateau watches its train loss
        t = trainer(
            1,
            lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau,
            lr_scheduler_monitor="train_loss" if rank == 1 else "valid_loss",
        )
        report["error"] = await refusal(t.fit(batches(), valid_data=batches(5, 10), epochs=1))
    elif scenario == "same-options-typed-apart":  # 1 and 1.0, 2 and NumPy's 2: the same
        t = trainer(1)
        await t.fit(batches(), epochs=1)
        # Assigned between calls: compared before the call's own checks make them numbers.
        t.accumulate_grad_batches = 2 if rank == 0 else np.int64(2)
        t.gradient_clip_val = 1 if rank == 0 else 1.0
        await t.fit(batches(), epochs=2)
        report["global_step"] = t.global_step
    elif scenario.startswith("changed-"):  # an option assigned on rank 1 alone, after a fit
        t = trainer(
            1,
            lr_scheduler=PLATEAU,
            lr_scheduler_monitor="valid_loss",
        )
        await t.fit(batches(), valid_data=batches(5, 10), epochs=1)
        steps = t.global_step
        if rank == 1:
            if scenario == "changed-monitor":
                t.lr_scheduler_monitor = "train_loss"
            else:
                t.accumulate_grad_batches = 2
        report["error"] = await refusal(t.fit(batches(), valid_data=batches(5, 10), epochs=2))
        report["steps"] = t.global_step - steps
    elif scenario == "plateau":  # ReduceLROnPlateau on the validation loss, over every rank
        t = trainer(1, lr_scheduler=PLATEAU, lr_scheduler_monitor="valid_loss")
        lrs: list[float | None] = []
        watcher = asyncio.create_task(step_lrs(t.events(), lrs))
        result = await t.fit(batches(), epochs=3, valid_data=batches(5, 10))
        await watcher
        report["lrs"] = lrs
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
        report["global_step"] = result.global_step
    elif scenario == "layout-differs":  # rank 1's first weight laid out column-major
        t = trainer(1)
        if rank == 1:
            linear = t.model[0]
            linear.weight = torch.nn.Parameter(linear.weight.detach().t().contiguous().t())
        report["error"] = await refusal(t.fit(batches(), epochs=1))
    elif scenario == "precision-differs":  # rank 1 under bf16 autocast
        t = trainer(1, precision="bf16" if rank == 1 else "32")
        report["error"] = await refusal(t.fit(batches(), epochs=1))
    elif scenario == "batch-size-differs":  # the same dataset, batched otherwise on rank 1
        inputs, targets = (torch.cat(parts) for parts in zip(*batches(), strict=True))
        data = torch.utils.data.TensorDataset(inputs, targets)
        loader = torch.utils.data.DataLoader(data, batch_size=8 if rank == 1 else 12)
        t = trainer(1)
        report["error"] = await refusal(t.fit(loader, epochs=1))
        report["steps"] = t.global_step
    elif scenario == "valid-data-differs":  # rank 1 validates on a part it split by hand
        t = trainer(1)
        valid = batches()[1::2] if rank == 1 else batches()
        report["error"] = await refusal(t.fit(batches(), valid_data=valid, epochs=1))
    elif scenario == "syncbn-two-devices":  # SyncBatchNorm, 2 devices a rank
        net = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.SyncBatchNorm(16), torch.nn.Linear(16, 3)
        )
        t = asyncddp.Trainer(
            net,
            functools.partial(torch.optim.SGD, lr=0.1),
            step,
            devices=asyncddp.cpu_devices(2),
            progress_bar=False,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                await t.fit(batches(), epochs=1)
                report["error"] = None
            except asyncddp.WorkerFailedError as error:  # torch refuses it on CPUs
                report["error"] = str(error)
        report["warnings"] = [str(w.message) for w in caught]
    elif scenario == "dies-before-joining":  # rank 1 dies building its model, say
        if rank == 1:
            os._exit(3)
        t = trainer(1)
        started = time.monotonic()
        try:
            await t.fit(batches(), epochs=1)
            report["error"] = None
        except asyncddp.WorkerFailedError as error:
            report["error"] = str(error)
            report["error_rank"] = error.rank
            report["error_type"] = error.error_type
            report["seconds"] = time.monotonic() - started
    elif scenario.startswith("model-differs-"):  # rank 1's model: wider, deeper, or float64
        net = model()
        if rank == 1 and scenario.endswith("wider"):
            net = torch.nn.Sequential(
                torch.nn.Linear(6, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3)
            )
        elif rank == 1 and scenario.endswith("deeper"):
            net = torch.nn.Sequential(net, torch.nn.Linear(3, 3))
        elif rank == 1 and scenario.endswith("float64"):
            net = net.double()
        t = asyncddp.Trainer(
            net, functools.partial(torch.optim.SGD, lr=0.1), step, devices="cpu", progress_bar=False
        )
        data = (
            [(x.double(), y) for x, y in batches()] if scenario.endswith("float64") else batches()
        )
        report["error"] = await refusal(t.fit(data if rank == 1 else batches(), epochs=1))
    elif scenario == "mixed-kinds":  # rank 1 trains on a GPU (pretended: refused before use)
        if rank == 1:
            asyncddp._devices._cuda_device_count = lambda: 1  # type: ignore[attr-defined]
        t = asyncddp.Trainer(
            model(),
            functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9),
            step,
            devices="cuda:0" if rank == 1 else "cpu",
            progress_bar=False,
            pin_memory=False,
        )
        report["error"] = await refusal(t.fit(batches(), epochs=1))
    elif scenario == "raise-twice":  # both ranks fit again after a failure; it comes again

        def fails(model: torch.nn.Module, batch: Any) -> Any:
            if rank == 1 and this_step() == FAIL_AT:
                raise ValueError("injected failure on rank 1")
            return step(model, batch)

        t = trainer(1, step=fails)
        report["errors"] = []
        for _ in range(2):
            try:
                await t.fit(batches(40, 8), epochs=1)
            except asyncddp.WorkerFailedError as error:
                report["errors"].append((error.rank, error.error_message))
    elif scenario in ("cancel1", "cancel2"):  # devices per rank
        # Rank 1's fit is cancelled while it waits in a step's exchange for rank 0, which is
        # late; then both ranks fit again, to the end.
        loop = asyncio.get_running_loop()
        once = threading.Lock()  # one device of the rank is late, or cancels

        def late(model: torch.nn.Module, batch: Any) -> Any:
            if this_step() == FAIL_AT and "first" not in report and once.acquire(False):
                if rank == 0:
                    time.sleep(1.0)
                else:
                    loop.call_soon_threadsafe(loop.call_later, 0.3, fit.cancel)
            return step(model, batch)

        t = trainer(int(scenario[-1]), step=late)
        fit = asyncio.ensure_future(t.fit(batches(40, 8), epochs=1))
        report["first"] = await outcome(fit)
        report["first_step"] = t.global_step
        report["first_params"] = [p.detach().clone() for p in t.model.parameters()]
        result = await t.fit(batches(40, 8), epochs=1)
        report["global_step"] = result.global_step
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
    elif scenario == "validate-during-fit":  # refused on rank 1; the fit goes on

        async def validate_in_fit() -> None:
            async for event in t.events():
                if rank == 1 and isinstance(event, asyncddp.StepEnded) and event.step == 2:
                    try:
                        await t.validate(batches(5, 10))
                    except asyncddp.ConfigurationError as error:
                        report["refused"] = str(error)

        t = trainer(1)
        async with asyncio.TaskGroup() as group:
            group.create_task(validate_in_fit())
            result = await t.fit(batches(40, 8), epochs=1)
        report["global_step"] = result.global_step
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
    elif scenario.startswith("cancel-at-end"):  # cancel-at-end-fit, cancel-at-end-validate
        # Rank 1's call is cancelled while it waits for rank 0 (late) in the call's last
        # exchange; then both ranks validate again.
        loop = asyncio.get_running_loop()

        def slow_lr(epoch: int) -> float:  # rank 0 is late to the end of the fit
            if rank == 0 and epoch == 1:
                time.sleep(1.0)
            return 1.0

        def slow_valid(model: torch.nn.Module, batch: Any) -> Any:  # late to validation's end
            if "first" not in report and not report.get("late"):
                report["late"] = True
                if rank == 0:
                    time.sleep(1.0)
                else:
                    loop.call_soon_threadsafe(loop.call_later, 0.3, call.cancel)
            return step(model, batch)

        async def cancel_at_end() -> None:
            async for event in t.events():
                if rank == 1 and isinstance(event, asyncddp.EpochEnded):
                    loop.call_later(0.3, call.cancel)

        t = trainer(
            1,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, slow_lr),
            valid_step=slow_valid,
        )
        started = time.monotonic()
        if scenario.endswith("fit"):
            call = asyncio.ensure_future(t.fit(batches(), epochs=1))
            watcher = asyncio.ensure_future(cancel_at_end())
        else:
            call = asyncio.ensure_future(t.validate(batches(5, 10)))
        try:
            await call
            report["first"] = None
        except asyncio.CancelledError:
            report["first"] = "cancelled"
        except asyncddp.WorkerFailedError as error:
            report["first"] = (error.rank, error.error_type)
        report["seconds"] = time.monotonic() - started
        if scenario.endswith("fit"):
            await watcher
        report["global_step"] = t.global_step
        report["validate"] = await t.validate(batches(5, 10))
    elif scenario == "resume-other-world":  # mid-epoch states of another number of processes
        t = trainer(1)  # refused: stopped in mid-epoch by one process (the test's)
        report["error"] = await refusal(t.fit(batches(40, 8), epochs=1, resume=out / "one.ckpt"))
        t = trainer(1)

        async def stop_at_step_2() -> None:
            async for event in t.events():
                if isinstance(event, asyncddp.StepEnded) and event.step == 2:
                    t.stop()

        async with asyncio.TaskGroup() as group:
            group.create_task(stop_at_step_2())
            await t.fit(batches(40, 8), epochs=1)
        if rank == 0:  # for the test to continue with one process
            await t.save_checkpoint(out / "two.ckpt")
    elif scenario == "mid-fit-checkpoint":
        # Rank 0 saves a checkpoint from another task after every step while the fit runs.
        # Each must hold the parameters of the step it counts: those a step function sees
        # when that many steps are done.
        seen: dict[int, list[torch.Tensor]] = {}

        def recording(model: torch.nn.Module, batch: Any) -> Any:
            seen[this_step()] = [p.detach().clone() for p in model.parameters()]
            return step(model, batch)

        t = trainer(1, step=recording)
        saved: list[Path] = []

        async def save_in_fit() -> None:
            async for event in t.events():
                if rank == 0 and isinstance(event, asyncddp.StepEnded) and event.step < 15:
                    saved.append(await t.save_checkpoint(out / f"step{event.step}.ckpt"))

        async with asyncio.TaskGroup() as group:
            group.create_task(save_in_fit())
            result = await t.fit(batches(40, 8), epochs=1)
        report["global_step"] = result.global_step
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
        report["checkpoints"] = []
        for path in saved:
            state = torch.load(path, weights_only=False)
            at = state["global_step"]
            params = [state["model"][name] for name, _ in t.model.named_parameters()]
            expected = seen[at] if at in seen else report["params"]
            same = all(torch.equal(a, b) for a, b in zip(params, expected, strict=True))
            report["checkpoints"].append((at, same))
        resumed = trainer(1)
        middle = out / "step4.ckpt"
        result = await resumed.fit(batches(40, 8), epochs=1, resume=middle)
        report["resumed_global_step"] = result.global_step
        report["resumed_params"] = [p.detach().clone() for p in resumed.model.parameters()]
    elif scenario == "late-peer":  # rank 0 loads a batch late; rank 1 waits longer than
        # step_timeout for it in the step's exchange: its device is not what is slow

        class Late:
            def __iter__(self) -> Any:
                for index, batch in enumerate(batches(40, 8)):
                    if rank == 0 and index == 2 * FAIL_AT:
                        time.sleep(8.0)
                    yield batch

        # The timeout is generous for a loaded machine's set-up and steps; the wait is longer.
        t = trainer(1, step_timeout=5.0)
        result = await t.fit(Late(), epochs=1)
        report["global_step"] = result.global_step
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
    elif scenario == "roll-call":  # 3 ranks: rank 0 finds a collective broken while rank 2
        # waits on it in one, and rank 1 says nothing; rank 0 then leaves, which breaks rank 2's
        devices = asyncddp.cpu_devices(1)
        comm = _comm.Comm(devices, 1, {"scenario": "roll-call"})
        comm.setup()
        if rank == 0:
            await asyncio.sleep(0.5)  # rank 2 is in its collective
            lost = comm.lost(RuntimeError("injected: a collective broke"))
            report["lost"] = list(lost.ranks)
        elif rank == 1:
            await asyncio.sleep(_comm.ALIVE_WAIT + 5.0)  # silent past rank 0's roll call and exit
        else:
            try:
                comm._all_reduce(torch.zeros(8))
            except _comm.RankLost as error:
                report["lost"] = list(error.ranks)
    elif scenario == "out-of-step":  # rank 0 validates while rank 1 fits
        t = trainer(1)
        try:
            if rank == 0:
                await t.validate(batches(5, 10))
            else:
                await t.fit(batches(), epochs=1)
            report["error"] = None
        except asyncddp.AsyncDDPError as error:
            report["error"] = str(error)
            report["error_type"] = type(error).__name__
    elif scenario == "nan-on-rank-1":  # rank 1's loss is NaN at its third step

        def nan_at_2(model: Any, batch: Any) -> Any:
            out = step(model, batch)
            if rank == 1 and this_step() == 2:
                out = (
                    {**out, "loss": out["loss"] * math.nan}
                    if isinstance(out, dict)
                    else out * math.nan
                )
            return out

        t = trainer(1, step=nan_at_2, check_finite=True)
        await note_failure(t.fit(batches(), epochs=1), report)
    elif scenario == "option-on-one-rank":  # rank 1 assigns an option that cannot work
        t = trainer(1)
        await t.fit(batches(), epochs=1)
        if rank == 1:
            t.gradient_clip_val = -1.0
        await note_failure(t.fit(batches(), epochs=2), report)
    elif scenario == "trainers-crossed":  # rank 1 calls its two trainers in the other order
        first, second = trainer(1), trainer(1)
        for t in (first, second):  # each joins, in the same order on every rank
            await t.validate(batches(5, 10))
        errors = []
        for t in (first, second) if rank == 0 else (second, first):
            try:
                await t.fit(batches(), epochs=1)
                errors.append(None)
            except asyncddp.AsyncDDPError as error:
                errors.append(f"{type(error).__name__}: {error}")
        report["errors"] = errors
        report["steps"] = [first.global_step, second.global_step]
    elif scenario == "user-collectives":  # the user's own collectives during fit
        # An event consumer sums a figure over the ranks with torch.distributed on the default
        # group, in the event loop, while asyncddp's collectives run in a thread of their own.
        import torch.distributed as dist

        t = trainer(1)

        async def reduce_each_step(stream: asyncddp.EventStream) -> list[float]:
            sums = []
            async for event in stream:
                if isinstance(event, asyncddp.StepEnded):
                    # Some async work of its own first (a log written, say), which takes each
                    # rank its own time: asyncddp's next exchange may start meanwhile.
                    await asyncio.sleep(0.02 * rank)
                    figure = torch.tensor([float(rank + 1)])
                    dist.all_reduce(figure)
                    sums.append(figure.item())
            return sums

        watcher = asyncio.create_task(reduce_each_step(t.events()))
        result = await t.fit(batches(), epochs=2, valid_data=batches(5, 10))
        report["sums"] = await watcher
        dist.barrier()
        report["global_step"] = result.global_step
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
    elif scenario == "not-in-call":  # rank 1 makes its calls late, or is slow in one
        import logging

        _comm.NOT_IN_CALL_WAIT = 1.0
        records: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record.getMessage())

        logging.getLogger("asyncddp").addHandler(Keep())
        t = trainer(1)
        seen = []

        async def late(call: Any) -> Any:  # rank 1 makes the call 4 s after rank 0
            if rank == 1:
                await asyncio.sleep(4.0)  # the ranks' starts may be 3 s apart on a loaded CI
            return await call

        await late(t.fit(batches(), epochs=1))  # the first call: the trainer's set-up
        seen.append(len(records))
        await late(t.validate(batches(5, 10)))  # validate on rank 0 alone, for 4 s
        seen.append(len(records))

        class Slow:  # in the call, but its first batch takes 2.5 s on rank 1
            def __iter__(self) -> Any:
                if rank == 1:
                    time.sleep(2.5)
                return iter(batches(5, 10))

        await t.validate(Slow())
        seen.append(len(records))
        report["records"] = records
        report["seen"] = seen
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    return report


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        run_rank(sys.argv[1], sys.argv[2])


def serve() -> None:
    """The tests' fork server: this process imported torch, asyncddp and the scenarios once;
    it forks a rank for each request and says when each ends. It starts no thread and joins no
    process group, so a forked rank starts as a fresh interpreter would, without its 5-6 s of
    imports and first optimizer.

    Reads one JSON request a line on stdin, ``{"scenario": ..., "out": ..., "env": {...}}``,
    and answers ``started PID`` to each; writes ``exited PID CODE`` as each rank ends (``CODE``
    as ``subprocess`` gives it: minus the signal's number for a rank a signal ended). Ends when
    stdin closes.
    """
    # torch's one-time cost of a first optimizer (2-3 s here: it imports torch._dynamo), paid
    # once for every rank; it starts no thread.
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    pending = b""
    ranks: set[int] = set()
    open_ = True
    while open_ or ranks:
        readable, _, _ = select.select([0] if open_ else [], [], [], 0.02)
        if readable:
            chunk = os.read(0, 65536)
            open_ = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    try:  # forked_rank exits by itself, with its rank's code
                        forked_rank(request["scenario"], request["out"], request["env"])
                    except BaseException:  # as an uncaught exception ends an interpreter
                        traceback.print_exc()
                        sys.stdout.flush()
                        sys.stderr.flush()
                    os._exit(1)
                ranks.add(pid)
                os.write(1, f"started {pid}\n".encode())
        for pid in list(ranks):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                ranks.discard(pid)
                os.write(1, f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def forked_rank(scenario: str, out: str, env: dict[str, str]) -> None:
    """A rank forked by :func:`serve`: ``env`` is the torchrun environment, set here as a
    launcher would set it; the rank's output goes to ``OUT_DIR/rank{RANK}.log``."""
    os.environ.update(env)
    # The fork server imported torch before this rank's environment existed, so torch read no
    # OMP_NUM_THREADS: size the intra-op pool as a fresh process with it would be.
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    torch.seed()  # every rank would start from the server's random state, not one of its own
    log = os.open(Path(out) / f"rank{env['RANK']}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the server's requests are not the rank's
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    run_rank(scenario, out)


def run_rank(scenario: str, out_dir: str) -> None:
    """Run ``scenario`` as the rank the environment names; write its report and exit."""
    out = Path(out_dir)
    rank = int(os.environ["RANK"])
    # A rank that outlives its test's timeout is sent SIGUSR1 first: it writes every thread's
    # stack to its log, which the failure shows.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if "PACK_ELEMENTS" in os.environ:  # the test's choice of exchange: see _comm.PACK_ELEMENTS
        _comm.PACK_ELEMENTS = int(os.environ["PACK_ELEMENTS"])
    if scenario == "exact-nccl":
        asyncddp.distributed.init(timeout=120)  # the default backend: NCCL on a GPU
    elif not scenario.startswith("fit-then-join"):  # that one joins after a fit of its own
        asyncddp.distributed.init("gloo", timeout=120)
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)  # torch's one-time import cost
    try:
        report = asyncio.run(run(scenario, out, rank))
    except BaseException as error:
        report = {"rank": rank, "crash": traceback.format_exc(), "type": type(error).__name__}
    torch.save(report, out / f"rank{rank}.pt")
    asyncddp.distributed.destroy()
    # Skip the interpreter's teardown: torch's gloo threads now and then abort the process
    # there ("terminate called without an active exception", about one run in five of this
    # file; pytorch/pytorch#179291 describes the teardown race). The report is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
