from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import math
import re
import sys
import threading
import time
import types
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import asyncddp
from asyncddp import (
    CheckpointSaved,
    ConfigurationError,
    DataError,
    EpochEnded,
    FitEnded,
    FitStarted,
    StepEnded,
    StepOutputError,
    Trainer,
    ValidationEnded,
    WorkerContext,
    WorkerFailedError,
    cpu_devices,
)
from asyncddp._jobs import Meeting, PeerLeft
from asyncddp.testing import failing_optimizer

pytestmark = pytest.mark.anyio

FEATURES = 6


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 3))


def make_batches(sizes: list[int], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, FEATURES, generator=generator),
            torch.randint(0, 3, (size,), generator=generator),
        )
        for size in sizes
    ]


def loss_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


def metric_step(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    logits = model(inputs)
    return {
        "loss": F.cross_entropy(logits, targets),
        "accuracy": (logits.argmax(1) == targets).float().mean(),
    }


SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAMW = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.01)


def reference(
    batches: list[Any],
    epochs: int,
    optimizer: Callable[..., torch.optim.Optimizer],
    *,
    clip: float | None = None,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """One device given each whole batch: the plain PyTorch loop asyncddp must match."""
    model = make_model().to(dtype)
    opt = optimizer(model.parameters())
    sched = scheduler(opt) if scheduler else None
    for _ in range(epochs):
        for batch in batches:
            opt.zero_grad()
            loss_step(model, batch).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        if sched is not None:
            sched.step()
    return model


async def fit_until_stopped(
    trainer: Trainer, data: Any, *, epochs: int, at_step: int, reason: str = "stopped"
) -> asyncddp.FitResult:
    """``fit``, with an event consumer that calls ``stop(reason)`` once step ``at_step`` ends."""
    stream = trainer.events()

    async def stopper() -> None:
        async for event in stream:
            if isinstance(event, StepEnded) and event.step == at_step:
                trainer.stop(reason)

    async with anyio.create_task_group() as group:
        group.start_soon(stopper)
        return await trainer.fit(data, epochs=epochs)


def join(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Several batches as one."""
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def assert_close(actual: nn.Module, expected: nn.Module, tol: float = 1e-5) -> None:
    for (name, a), b in zip(
        actual.state_dict().items(), expected.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"parameter {name} differs")


def assert_replicas_identical(trainer: Trainer) -> None:
    first = trainer._replicas[0].model.state_dict()
    for replica in trainer._replicas[1:]:
        for name, value in replica.model.state_dict().items():
            assert torch.equal(value, first[name]), f"replica on {replica.device} differs in {name}"


class ParamRecorder:
    """A step that records each replica's parameters as it starts, keyed by batch number."""

    def __init__(self, batch_of_item: dict[int, int]) -> None:
        self.batch_of_item = batch_of_item
        self.seen: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.lock = threading.Lock()

    def __call__(
        self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        inputs, targets, ids = batch
        flat = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
        key = (self.batch_of_item[int(ids[0])], len(self.seen))
        with self.lock:
            self.seen.setdefault((key[0], 0), []).append(flat)
        return F.cross_entropy(model(inputs), targets)


@pytest.mark.parametrize("devices", [1, 2, 3])
@pytest.mark.parametrize("optimizer", [SGD, ADAMW], ids=["sgd-momentum", "adamw"])
async def test_n_devices_match_one_device_given_the_whole_batch(
    devices: int, optimizer: Callable[..., torch.optim.Optimizer]
) -> None:
    # 7 items split across 2 or 3 devices never divide evenly; the last batch (2 items) is
    # smaller than 3 devices, so one device gets nothing at that step.
    sizes = [7, 7, 5, 2]
    batches = make_batches(sizes)
    expected = reference(batches, 2, optimizer)
    trainer = Trainer(
        make_model(), optimizer, loss_step, devices=cpu_devices(devices), progress_bar=False
    )
    result = await trainer.fit(batches, epochs=2)
    assert result.epoch == 2
    assert result.global_step == 2 * len(sizes)
    assert_close(trainer.model, expected)
    assert_replicas_identical(trainer)


async def test_replicas_are_bitwise_identical_before_every_step() -> None:
    sizes = [5, 4, 3, 2, 1]
    raw = make_batches(sizes)
    batches, batch_of_item, start = [], {}, 0
    for number, (inputs, targets) in enumerate(raw):
        ids = torch.arange(start, start + len(inputs))
        batch_of_item.update({int(i): number for i in ids})
        batches.append((inputs, targets, ids))
        start += len(inputs)
    recorder = ParamRecorder(batch_of_item)
    trainer = Trainer(make_model(), ADAMW, recorder, devices=cpu_devices(3), progress_bar=False)
    await trainer.fit(batches, epochs=1)
    assert set(recorder.seen) == {(n, 0) for n in range(len(sizes))}
    for (number, _), flats in recorder.seen.items():
        expected_devices = min(sizes[number], 3)
        assert len(flats) == expected_devices
        assert all(torch.equal(flat, flats[0]) for flat in flats), (
            f"replicas differ at step {number}"
        )
    assert_replicas_identical(trainer)


async def test_the_model_passed_in_is_the_trained_model_when_it_lives_on_the_first_device() -> None:
    model = make_model()
    trainer = Trainer(model, SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    assert trainer.model is model
    await trainer.fit(make_batches([4, 4]), epochs=1)
    assert trainer.model is model
    assert trainer._replicas[1].model is not model


class Recording(nn.Sequential):
    """A model that notes when it is copied."""

    log: ClassVar[list[str]] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> Recording:
        Recording.log.append("copied")
        copied = Recording(*(copy.deepcopy(module, memo) for module in self))
        copied.__dict__["copy_of"] = self  # not a submodule: the original is no part of it
        return copied


async def test_the_model_passed_in_moves_to_the_first_device_after_the_others_copied_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every device but the first trains a copy; the first trains the module passed in, moved
    # there in place (on a GPU it stayed where it was, untrained, and trainer.model was a
    # copy). The copies are made before it moves, never from a module half moved.
    move_to = asyncddp._trainer.move_to

    def recording_move_to(model: nn.Module, device: torch.device) -> nn.Module:
        Recording.log.append(f"moved to {device}")
        return move_to(model, device)

    monkeypatch.setattr(asyncddp._trainer, "move_to", recording_move_to)
    torch.manual_seed(0)
    model = Recording(nn.Linear(FEATURES, 4), nn.ReLU(), nn.Linear(4, 3))
    Recording.log.clear()
    trainer = Trainer(model, SGD, loss_step, devices=cpu_devices(3), progress_bar=False)
    await trainer.fit(make_batches([4, 4]), epochs=1)
    assert trainer.model is model
    assert Recording.log == ["copied", "copied", "moved to cpu"]
    assert all(replica.model.copy_of is model for replica in trainer._replicas[1:])


class RefusesTo(nn.Sequential):
    """A model that refuses ``.to`` (as 8-bit quantized models do)."""

    def to(self, *args: Any, **kwargs: Any) -> RefusesTo:
        raise ValueError(".to is not supported for this model")


async def test_a_model_on_the_first_device_already_is_not_moved() -> None:
    # It was moved whether or not it was there, and a model that refuses .to failed to start.
    torch.manual_seed(0)
    model = RefusesTo(nn.Linear(FEATURES, 4), nn.ReLU(), nn.Linear(4, 3))
    trainer = Trainer(model, SGD, loss_step, devices="cpu", progress_bar=False)
    result = await trainer.fit(make_batches([4, 4]), epochs=1)
    assert result.global_step == 2
    assert trainer.model is model


async def test_a_checkpoint_dir_that_is_a_file_is_refused_before_any_step(tmp_path: Any) -> None:
    # resume="latest" found no checkpoint in it, trained an epoch, then failed to write one.
    (tmp_path / "run.ckpt").write_bytes(b"")
    trainer = checkpointing_trainer(tmp_path / "run.ckpt")
    with pytest.raises(ConfigurationError, match="is a file, not a folder"):
        await trainer.fit(make_batches([4, 4]), epochs=1, resume="latest")
    assert trainer.global_step == 0


@pytest.mark.parametrize("devices", [1, 2])
async def test_gradient_accumulation_averages_over_every_item_of_the_window(devices: int) -> None:
    batches = make_batches([6, 4, 5])
    # Accumulating two batches equals one step on both batches joined (item-weighted mean).
    joined = [join(batches[:2]), batches[2]]
    expected = reference(joined, 1, SGD)
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(devices),
        accumulate_grad_batches=2,
        progress_bar=False,
    )
    result = await trainer.fit(batches, epochs=1)
    assert result.global_step == 2
    assert_close(trainer.model, expected)


async def test_whole_batches_per_device_average_over_items() -> None:
    batches = make_batches([6, 4, 5])
    joined = [join(batches[:2]), batches[2]]
    expected = reference(joined, 1, SGD)
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        split_batches=False,
        progress_bar=False,
    )
    await trainer.fit(batches, epochs=1)
    assert_close(trainer.model, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("devices", [1, 3])
async def test_gradient_clipping_uses_the_global_norm_of_the_averaged_gradients(
    devices: int, dtype: torch.dtype
) -> None:
    batches = [(x.to(dtype), y) for x, y in make_batches([8, 8, 8])]
    expected = reference(batches, 2, SGD, clip=0.05, dtype=dtype)
    trainer = Trainer(
        make_model().to(dtype),
        SGD,
        loss_step,
        devices=cpu_devices(devices),
        gradient_clip_val=0.05,
        progress_bar=False,
    )
    await trainer.fit(batches, epochs=2)
    assert_close(trainer.model, expected)


class SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(20, 4, sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(1))


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_model_with_sparse_gradients_trains_with_adamw_and_clipping(devices: int) -> None:
    # nn.Embedding(sparse=True) makes sparse gradients, which AdamW and the norm refuse: they
    # are made dense (added into the flat buffers), on one device as on several.
    generator = torch.Generator().manual_seed(2)
    batches = [
        (torch.randint(0, 20, (8, 5), generator=generator), torch.randint(0, 3, (8,)))
        for _ in range(4)
    ]
    expected = SparseBag()
    opt = ADAMW(expected.parameters())
    for batch in batches:
        opt.zero_grad()
        loss_step(expected, batch).backward()
        for param in expected.parameters():  # what AdamW can take: dense gradients
            if param.grad is not None and param.grad.is_sparse:
                param.grad = param.grad.to_dense()
        torch.nn.utils.clip_grad_norm_(expected.parameters(), 0.05)
        opt.step()
    trainer = Trainer(
        SparseBag(),
        ADAMW,
        loss_step,
        devices=cpu_devices(devices),
        gradient_clip_val=0.05,
        progress_bar=False,
    )
    await trainer.fit(batches, epochs=1)
    assert_close(trainer.model, expected)


@pytest.mark.parametrize("interval", ["epoch", "step"])
async def test_lr_scheduler_steps_like_the_plain_loop(interval: str) -> None:
    batches = make_batches([4, 4])
    schedule = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    model = make_model()
    opt = SGD(model.parameters())
    sched = schedule(opt)
    for _ in range(2):
        for batch in batches:
            opt.zero_grad()
            loss_step(model, batch).backward()
            opt.step()
            if interval == "step":
                sched.step()
        if interval == "epoch":
            sched.step()
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        lr_scheduler=schedule,
        lr_scheduler_interval=interval,  # type: ignore[arg-type]
        progress_bar=False,
    )
    await trainer.fit(batches, epochs=2)
    assert_close(trainer.model, model)
    assert trainer._replicas[1].optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


# Halves the learning rate after any epoch whose metric is not better than half the best: so
# a decision no rounding of the epoch's mean can turn.
PLATEAU = functools.partial(
    torch.optim.lr_scheduler.ReduceLROnPlateau, factor=0.5, patience=0, threshold=0.5
)


@pytest.mark.parametrize(
    ("monitor", "mode"),
    [("valid_loss", "min"), ("train_loss", "min"), ("valid_accuracy", "max")],
)
async def test_reduce_lr_on_plateau_steps_on_the_monitored_metric_like_the_plain_loop(
    monitor: str, mode: str
) -> None:
    # Refused before, as it steps on a metric: now stepped on the epoch's exact mean.
    train, valid = make_batches([4, 6, 4, 2]), make_batches([5, 3], seed=2)
    schedule = functools.partial(PLATEAU, mode=mode)
    model = make_model()
    opt = SGD(model.parameters())
    sched = schedule(opt)
    lrs = []
    for _ in range(3):
        losses = []
        for batch in train:
            opt.zero_grad()
            loss = loss_step(model, batch)
            loss.backward()
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            losses.append((loss.item(), len(batch[0])))
        with torch.no_grad():
            metrics = [(metric_step(model, batch), len(batch[0])) for batch in valid]
        if monitor == "train_loss":
            value = sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
        else:
            name = monitor.removeprefix("valid_")
            value = sum(m[name].item() * n for m, n in metrics) / sum(n for _, n in metrics)
        sched.step(value)
    assert lrs[-1] < lrs[0]  # the schedule halved the rate: there is something to compare
    trainer = Trainer(
        make_model(),
        SGD,
        metric_step,
        devices=cpu_devices(2),
        lr_scheduler=schedule,
        lr_scheduler_monitor=monitor,
        progress_bar=False,
    )
    seen: list[float | None] = []

    async def watch(stream: asyncddp.EventStream) -> None:
        async for event in stream:
            if isinstance(event, StepEnded):
                seen.append(event.lr)

    async with anyio.create_task_group() as group:
        group.start_soon(watch, trainer.events())
        await trainer.fit(train, valid_data=valid, epochs=3)
    assert seen == lrs
    assert_close(trainer.model, model)
    # A fit with nothing left to train needs no valid_data for its monitor.
    with pytest.warns(asyncddp.AsyncDDPWarning, match="trains nothing"):
        await trainer.fit(train, epochs=3)
    expected = sched.state_dict()
    for replica in trainer._replicas:
        state = replica.scheduler.state_dict()  # the best metric, as summed on two devices
        assert state.pop("best") == pytest.approx(expected["best"], abs=1e-6)
        assert state == {k: v for k, v in expected.items() if k != "best"}


@pytest.mark.parametrize(
    ("options", "valid", "expected"),
    [
        (
            {"lr_scheduler": PLATEAU, "lr_scheduler_monitor": "valid_loss"},
            False,
            "lr_scheduler_monitor='valid_loss' is a validation metric, and this fit has no "
            "valid_data",
        ),
        (
            {
                "lr_scheduler": functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1),
                "lr_scheduler_monitor": "train_loss",
            },
            True,
            "this trainer has StepLR, which steps on no metric",
        ),
        ({"lr_scheduler_monitor": "train_loss"}, True, "this trainer has no lr_scheduler"),
        (
            {"lr_scheduler": PLATEAU, "lr_scheduler_interval": "step"},
            True,
            "lr_scheduler_monitor=...), 'valid_loss' (validation's loss, with valid_data), "
            "'train_loss', or 'valid_<name>' / 'train_<name>' for a metric the step returns, "
            "and leave lr_scheduler_interval 'epoch' (not 'step')",
        ),
    ],
)
async def test_a_monitor_that_does_not_fit_the_scheduler_or_the_fit_is_refused_before_a_step(
    options: dict[str, Any], valid: bool, expected: str
) -> None:
    # Taken without a word, the monitor would do nothing, or fail after a whole epoch.
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    trainer = Trainer(model, SGD, loss_step, devices=cpu_devices(2), progress_bar=False, **options)
    data = make_batches([4, 4])
    with pytest.raises(ConfigurationError, match=re.escape(expected)):
        await trainer.fit(data, valid_data=data if valid else None, epochs=1)
    assert trainer.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"lr_scheduler_monitor": "val_loss"}, "lr_scheduler_monitor must be 'valid_loss'"),
        ({"lr_scheduler_monitor": "train_"}, "for a metric the step returns, not 'train_'"),
        ({"lr_scheduler_monitor": 5}, "'train_<name>' for a metric the step returns, not 5"),
        (
            {"lr_scheduler_monitor": "valid_loss", "lr_scheduler_interval": "step"},
            "once an epoch, but lr_scheduler_interval is 'step'",
        ),
    ],
)
def test_a_monitor_that_names_no_epoch_metric_is_refused_as_the_trainer_is_built(
    options: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(expected)):
        Trainer(make_model(), SGD, loss_step, devices="cpu", lr_scheduler=PLATEAU, **options)


async def test_a_monitored_metric_the_step_does_not_return_is_named_and_the_next_fit_goes_on() -> (
    None
):
    # Known only once the epoch has run: nothing is stepped, the epoch stays open, and a fit
    # with the monitor put right validates again and closes it, once.
    trainer = Trainer(
        make_model(),
        SGD,
        metric_step,
        devices=cpu_devices(2),
        lr_scheduler=PLATEAU,
        lr_scheduler_monitor="valid_acc",
        progress_bar=False,
    )
    data = make_batches([4, 4])
    with pytest.raises(ConfigurationError) as raised:
        await trainer.fit(data, valid_data=data, epochs=1)
    assert str(raised.value) == (
        "lr_scheduler_monitor='valid_acc': epoch 0 has no such metric (its validation "
        "metrics: 'valid_loss', 'valid_accuracy'); name one of these, or return it as a dict "
        "entry ({'loss': ..., 'acc': ...}) from the step (from valid_step, where the trainer "
        "has one)"
    )
    assert (trainer.epoch, trainer.global_step, trainer.history) == (0, 2, [])
    trainer.lr_scheduler_monitor = "valid_accuracy"
    result = await trainer.fit(data, valid_data=data, epochs=1)
    assert (trainer.epoch, trainer.global_step, len(result.history)) == (1, 2, 1)
    assert trainer._replicas[0].scheduler.best == result.history[0].valid_metrics["accuracy"]


async def test_an_epochs_lr_step_comes_after_the_kernels_its_last_step_left_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On a lone GPU the epoch's last step may report with its optimizer step still queued,
    # reading the learning rate; a tensor one on the GPU (a capturable or fused optimizer's) is
    # written in place by the LR step, on the event loop's stream: after those kernels end.
    # (tests/test_cuda.py has this on a GPU; here, the order of the two.)
    order: list[str] = []
    finish = Trainer._finish_streams

    async def finishing(self: Trainer, scheduler: Any) -> None:
        order.append("finish")
        await finish(self, scheduler)

    monkeypatch.setattr(Trainer, "_finish_streams", finishing)

    def schedule(optimizer: torch.optim.Optimizer) -> Any:
        class Noted(torch.optim.lr_scheduler.StepLR):
            def step(self, epoch: Any = None) -> None:
                order.append("lr" if self.last_epoch >= 0 else "made")  # made: its first
                super().step()

        return Noted(optimizer, step_size=1, gamma=0.5)

    trainer = Trainer(
        make_model(), SGD, loss_step, devices="cpu", lr_scheduler=schedule, progress_bar=False
    )
    await trainer.fit(make_batches([4, 4]), epochs=2)
    assert order == ["made", "finish", "lr", "finish", "lr", "finish"]  # the last: the session's


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
async def test_mixed_precision_trains(precision: str) -> None:
    batches = make_batches([16] * 6)
    trainer = Trainer(
        make_model(),
        ADAMW,
        metric_step,
        devices=cpu_devices(2),
        precision=precision,
        progress_bar=False,
    )
    result = await trainer.fit(batches, epochs=4)
    assert result.history[-1].train_loss < result.history[0].train_loss
    assert_replicas_identical(trainer)


@pytest.mark.parametrize("devices", [1, 2])
async def test_fp16_skips_a_step_whose_gradients_overflow_as_grad_scaler_does(
    devices: int,
) -> None:
    # At step 2 every device's gradients come back infinite (the loss stays finite): that step
    # changes no parameter, and the next ones train on.
    seen: dict[int, list[torch.Tensor]] = {}

    def overflowing(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        worker = asyncddp.current_worker()
        assert worker is not None
        if worker.device.index == 0:
            seen[worker.step] = [p.detach().clone() for p in model.parameters()]
        inputs, targets = batch
        logits = model(inputs)
        if worker.step == 2:
            logits.register_hook(lambda grad: grad * float("inf"))
        return F.cross_entropy(logits.float(), targets)

    trainer = Trainer(
        make_model(),
        SGD,
        overflowing,
        devices=cpu_devices(devices),
        precision="fp16",
        progress_bar=False,
    )
    await trainer.fit(make_batches([8] * 5), epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(seen[2], seen[3], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(seen[3], seen[4], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(seen[1], seen[2], strict=True))
    assert all(p.isfinite().all() for p in trainer.model.parameters())
    assert_replicas_identical(trainer)


@pytest.mark.parametrize("devices", [1, 2])
async def test_fp16_with_accumulation_scales_as_grad_scaler_does(devices: int) -> None:
    # Each micro-step's loss is weighted by its share of the optimizer step's items, as in the
    # plain loop below: weighted by its item count instead (256 times GradScaler's), the fp16
    # gradients overflowed at every step, and the trainer skipped all of them.
    batches = make_batches([256] * 8)
    model = make_model()
    opt = SGD(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    for first in range(0, len(batches), 2):
        window = batches[first : first + 2]
        total = sum(len(targets) for _, targets in window)
        opt.zero_grad()
        for batch in window:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_step(model, batch) * len(batch[1]) / total
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0**16  # no step skipped
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(devices),
        precision="fp16",
        accumulate_grad_batches=2,
        progress_bar=False,
    )
    result = await trainer.fit(batches, epochs=1)
    assert result.global_step == 4
    assert trainer._scaler is not None
    assert trainer._scaler.scale == 2.0**16
    # One device runs the loop's very ops; two add up halves' fp16 gradients instead.
    assert_close(trainer.model, model, tol=1e-5 if devices == 1 else 1e-2)
    assert_replicas_identical(trainer)


class WithAnEmptyParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.empty = nn.Parameter(torch.empty(0))  # gets a gradient of size 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.body(inputs) + self.empty.sum()


@pytest.mark.parametrize("devices", [1, 2])
async def test_fp16_checks_gradients_of_a_parameter_of_size_0(devices: int) -> None:
    # Its gradient has no largest value to check: it is finite, and the step goes on.
    trainer = Trainer(
        WithAnEmptyParameter(),
        SGD,
        loss_step,
        devices=cpu_devices(devices),
        precision="fp16",
        progress_bar=False,
    )
    result = await trainer.fit(make_batches([8] * 3), epochs=1)
    assert result.global_step == 3
    assert_replicas_identical(trainer)


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_metric_returned_on_some_shards_is_its_mean_over_their_items(
    devices: int,
) -> None:
    # "first" is returned by the shards that hold class-0 items (on two devices, the first
    # half of each batch), "later" by the second batch's steps only. Divided by every item,
    # they were 0.5 on two devices (1.0 on one) and 0.6 (not 3.0).
    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
        out: dict[str, Any] = {"loss": loss_step(model, batch)}
        if (batch[1] == 0).any():
            out["first"] = 1.0
        if len(batch[1]) in (6, 3):  # the second batch, whole or split
            out["later"] = 3.0
        return out

    inputs = torch.randn(10, FEATURES)
    targets = torch.tensor([0, 0, 1, 1, 0, 0, 0, 1, 1, 1])
    batches = [(inputs[:4], targets[:4]), (inputs[4:], targets[4:])]
    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(devices), progress_bar=False)
    stream = trainer.events()
    result = await trainer.fit(batches, epochs=1)
    assert dict(result.history[0].train_metrics) == {"first": 1.0, "later": 3.0}
    steps = [event async for event in stream if isinstance(event, StepEnded)]
    assert [dict(event.metrics) for event in steps] == [
        {"first": 1.0},
        {"first": 1.0, "later": 3.0},
    ]
    metrics = await trainer.validate(batches)
    assert (metrics["first"], metrics["later"]) == (1.0, 3.0)


async def test_validate_averages_exactly_over_items() -> None:
    batches = make_batches([5, 3, 1])
    model = make_model()
    with torch.no_grad():
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        logits = model(inputs)
        expected_loss = float(F.cross_entropy(logits, targets))
        expected_accuracy = float((logits.argmax(1) == targets).float().mean())
    trainer = Trainer(model, SGD, metric_step, devices=cpu_devices(3), progress_bar=False)
    metrics = await trainer.validate(batches)
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert metrics["accuracy"] == pytest.approx(expected_accuracy, rel=1e-6)
    assert model.training  # validation put the model back in training mode


async def test_a_numpy_metric_is_a_number() -> None:
    # np.float32 was refused as "not a number or tensor".
    def step(model: nn.Module, batch: Any) -> dict[str, Any]:
        return {
            "loss": loss_step(model, batch),
            "half": np.float32(0.5),
            "one": np.int64(1),
            "yes": np.True_,
        }

    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(2), progress_bar=False)
    result = await trainer.fit(make_batches([4, 3]), epochs=1)
    assert dict(result.history[0].train_metrics) == {"half": 0.5, "one": 1.0, "yes": 1.0}

    def timedelta(model: nn.Module, batch: Any) -> dict[str, Any]:  # NumPy calls it a Real
        return {"loss": loss_step(model, batch), "days": np.timedelta64(3, "D")}

    trainer = Trainer(make_model(), SGD, timedelta, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(StepOutputError, match="'days' is a timedelta64, not a number"):
        await trainer.fit(make_batches([4, 3]), epochs=1)


async def test_reading_buffered_events_is_a_cancellation_point() -> None:
    # A consumer ran through every buffered event (up to maxlen) without noticing that it
    # was cancelled: trio's rule is that every await on a library call can be cancelled.
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    stream = trainer.events()
    await trainer.fit(make_batches([4, 4]), epochs=1)
    read: list[Any] = []
    with anyio.CancelScope() as scope:
        scope.cancel()
        async for event in stream:
            read.append(event)
    assert scope.cancelled_caught
    assert read == []


async def test_fit_returns_history_with_validation_metrics() -> None:
    batches = make_batches([8, 8, 8])
    trainer = Trainer(make_model(), ADAMW, metric_step, devices=cpu_devices(2), progress_bar=False)
    result = await trainer.fit(batches, epochs=3, valid_data=batches[:1])
    assert [record.epoch for record in result.history] == [0, 1, 2]
    assert all(record.items == 24 for record in result.history)
    assert all(set(record.valid_metrics or {}) == {"loss", "accuracy"} for record in result.history)
    assert set(result.history[0].train_metrics) == {"accuracy"}
    assert result.history[-1].train_loss < result.history[0].train_loss
    assert trainer.history == list(result.history)
    last = result.history[-1]
    assert last.valid_loss == (last.valid_metrics or {})["loss"]  # beside train_loss
    unvalidated = await trainer.fit(batches, epochs=4)
    assert unvalidated.history[0].valid_loss is None


async def test_a_training_metric_that_requires_grad_is_read_without_a_warning() -> None:
    # A metric computed from the model's output is part of its graph; float() of it warns
    # (an error under this suite's filterwarnings), so the trainer detaches it first.
    def step(model: nn.Module, batch: Any) -> dict[str, Any]:
        inputs, targets = batch
        logits = model(inputs)
        return {"loss": F.cross_entropy(logits, targets), "mean_logit": logits.mean()}

    batches = make_batches([8, 8])
    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(2), progress_bar=False)
    warned_once = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # torch warns of it once a process: not only in the first test
    try:
        result = await trainer.fit(batches, epochs=1, valid_data=batches)
    finally:
        torch.set_warn_always(warned_once)
    assert set(result.history[0].train_metrics) == {"mean_logit"}
    assert math.isfinite(result.history[0].train_metrics["mean_logit"])


async def test_pin_memory_without_a_gpu_warns_and_trains_as_without_it() -> None:
    # Page-locking needs a GPU's driver: on CPU devices the batches were pinned anyway, and
    # where no GPU was visible every batch failed on the loader thread.
    batches = make_batches([4, 4])
    expected = reference(batches, 1, SGD)
    with pytest.warns(UserWarning, match=r"pin_memory=True does nothing when no device is a GPU"):
        trainer = Trainer(
            make_model(),
            SGD,
            loss_step,
            devices=cpu_devices(2),
            pin_memory=True,
            progress_bar=False,
        )
    assert trainer.pin_memory is False
    await trainer.fit(batches, epochs=1)
    assert_close(trainer.model, expected)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("interval", ["step", "epoch"])
async def test_each_step_reports_the_learning_rate_it_took(devices: int, interval: str) -> None:
    halve = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(devices),
        lr_scheduler=halve,
        lr_scheduler_interval=interval,
        progress_bar=False,
    )
    stream = trainer.events()
    await trainer.fit(make_batches([4, 4, 4]), epochs=2)
    lrs = [event.lr async for event in stream if isinstance(event, StepEnded)]
    lr = SGD.keywords["lr"]
    if interval == "step":
        assert lrs == pytest.approx([lr * 0.5**i for i in range(6)])
    else:
        assert lrs == pytest.approx([lr] * 3 + [lr / 2] * 3)


async def test_a_tensor_learning_rate_in_the_factory_decays_once_a_step_on_every_device() -> None:
    # The partial's one lr tensor was every replica's: each scheduler decayed it in place.
    batches = make_batches([4, 4, 4])
    sgd = functools.partial(torch.optim.SGD, lr=torch.tensor(0.1))
    decay = functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=0.5)
    expected = reference(
        batches, 2, functools.partial(torch.optim.SGD, lr=torch.tensor(0.1)), scheduler=decay
    )
    trainer = Trainer(
        make_model(),
        sgd,
        loss_step,
        devices=cpu_devices(2),
        lr_scheduler=decay,
        progress_bar=False,
    )
    await trainer.fit(batches, epochs=2)
    lrs = [float(r.optimizer.param_groups[0]["lr"]) for r in trainer._replicas]
    assert lrs == pytest.approx([0.025] * 2)  # 0.1 halved twice, not four times
    assert_close(trainer.model, expected)
    assert_replicas_identical(trainer)


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("tensor_lr", [False, True])
async def test_a_per_epoch_lr_scheduler_that_raises_leaves_every_replica_as_it_was(
    devices: int, tensor_lr: bool
) -> None:
    # torch's step() counts the epoch before it computes the rates: the first replica's
    # scheduler had moved on, and each next fit stepped it again, so the devices' learning
    # rates parted (on one device too, a schedule one epoch ahead).
    factors = [1.0]  # too short: the first epoch's end raises IndexError

    def schedule(optimizer: torch.optim.Optimizer) -> Any:
        # The StepLR has changed the rate when the MultiplicativeLR raises.
        return torch.optim.lr_scheduler.ChainedScheduler(
            [
                torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
                torch.optim.lr_scheduler.MultiplicativeLR(optimizer, lambda e: factors[e]),
            ]
        )

    batches = make_batches([4, 4])
    # A tensor lr is changed in place: putting back the group's entry put back the changed one.
    lr = torch.tensor(0.1) if tensor_lr else 0.1
    sgd = functools.partial(torch.optim.SGD, lr=lr, momentum=0.9)
    trainer = Trainer(
        make_model(),
        sgd,
        loss_step,
        devices=cpu_devices(devices),
        lr_scheduler=schedule,
        progress_bar=False,
    )
    with pytest.raises(IndexError):
        await trainer.fit(batches, epochs=3)
    for replica in trainer._replicas:
        assert [inner.last_epoch for inner in replica.scheduler._schedulers] == [0, 0]
    rates = [float(r.optimizer.param_groups[0]["lr"]) for r in trainer._replicas]
    assert rates == pytest.approx([0.1] * devices)
    factors.extend([0.5, 0.25, 0.125])  # the cause is gone
    await trainer.fit(batches, epochs=3)
    assert_close(trainer.model, reference(batches, 3, SGD, scheduler=schedule))
    assert_replicas_identical(trainer)


async def test_an_undone_step_puts_back_a_tensor_learning_rate_its_scheduler_changed() -> None:
    # The step's backup kept the group's lr entry, the very tensor the scheduler's fill_
    # changed: the device that had stepped kept the decayed rate once the step was undone.
    decay = functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=0.5)
    failures = [RuntimeError("once")]

    def sgd(params: Any) -> torch.optim.Optimizer:  # fails once, at step 1, after its update
        optimizer = torch.optim.SGD(params, lr=torch.tensor(0.1))
        original = optimizer.step

        def step(self: torch.optim.Optimizer) -> None:
            original()
            context = asyncddp.current_worker()
            assert context is not None
            if context.device.index == 1 and context.step == 1 and failures:
                raise failures.pop()

        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        return optimizer

    trainer = Trainer(
        make_model(),
        sgd,
        loss_step,
        devices=cpu_devices(2),
        lr_scheduler=decay,
        lr_scheduler_interval="step",
        on_failure="retry",
        progress_bar=False,
    )
    await trainer.fit(make_batches([4, 4, 4]), epochs=1)
    rates = [float(r.optimizer.param_groups[0]["lr"]) for r in trainer._replicas]
    assert rates == pytest.approx([0.1 / 8] * 2)  # three steps taken, the retried one once
    assert_replicas_identical(trainer)


async def test_an_optimizer_factory_may_read_its_parameters_twice() -> None:
    # Decay and no-decay groups: the factory got a generator, and the second group was empty.
    def grouped(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=0.1,
        )

    batches = make_batches([4, 4])
    expected = reference(batches, 1, lambda params: grouped(list(params)))
    trainer = Trainer(make_model(), grouped, loss_step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(batches, epochs=1)
    assert [len(g["params"]) for g in trainer._replicas[1].optimizer.param_groups] == [2, 2]
    assert_close(trainer.model, expected)


async def test_an_optimizer_factory_over_the_outer_model_is_refused() -> None:
    # Every replica's optimizer stepped the first replica's parameters, and they drifted.
    model = make_model()

    def outer(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1)

    trainer = Trainer(model, outer, loss_step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(asyncddp.ConfigurationError, match="not those of the model it was given"):
        await trainer.fit(make_batches([4]), epochs=1)


@pytest.mark.parametrize(
    ("optimizer", "scheduler", "expected"),
    [
        (torch.optim.LBFGS, None, "LBFGS cannot train here: it steps with a closure"),
        (torch.optim.SparseAdam, None, "SparseAdam cannot train here: it takes sparse"),
        (SGD, torch.optim.lr_scheduler.ReduceLROnPlateau, "ReduceLROnPlateau steps on a metric"),
        # Both were taken without a word: no schedule at all, and the optimizer stepped again
        # at each epoch's end as if it were the scheduler.
        (SGD, lambda opt: None, r"returned None \(a function without a return\?\), not an LR"),
        (SGD, lambda opt: opt, "returned the optimizer it was given, not an LR scheduler"),
        (SGD, lambda opt: 5, "returned an int, not an LR scheduler"),  # "a int"
        (
            SGD,
            lambda opt: torch.optim.lr_scheduler.StepLR(SGD(make_model().parameters()), 1),
            "returned a scheduler of another optimizer",
        ),
    ],
)
async def test_an_optimizer_or_scheduler_that_cannot_train_here_is_refused_before_any_step(
    optimizer: Any, scheduler: Any, expected: str
) -> None:
    # They were taken, and failed at the first step as a device's fault (retried with
    # on_failure="retry"), or, ReduceLROnPlateau, with a bare TypeError after a whole epoch.
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(
        model,
        optimizer,
        loss_step,
        devices=cpu_devices(2),
        lr_scheduler=scheduler,
        on_failure="retry",
        progress_bar=False,
    )
    with pytest.raises(asyncddp.ConfigurationError, match=expected):
        await trainer.fit(make_batches([4, 4]), epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


async def test_a_call_while_a_fit_runs_is_refused_saying_which_and_what_to_do() -> None:
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    stream = trainer.events()
    refused: dict[str, str] = {}

    async def during_the_fit() -> None:
        async for event in stream:
            if isinstance(event, asyncddp.StepEnded):
                for call, attempt in [
                    ("validate", lambda: trainer.validate(make_batches([4]))),
                    ("fit", lambda: trainer.fit(make_batches([4]))),
                ]:
                    with pytest.raises(ConfigurationError) as caught:
                        await attempt()
                    refused[call] = str(caught.value)
                # Between steps (the fit waits for this consumer) the state is whole.
                assert trainer.state_dict()["global_step"] == event.progress.steps
                return

    async with anyio.create_task_group() as group:
        group.start_soon(during_the_fit)
        await trainer.fit(make_batches([4, 4, 4]), epochs=1)
    assert refused["validate"] == (
        "validate() cannot start while fit() is already running on this trainer: await that "
        "fit() first (to validate as a fit goes, pass valid_data= to fit)"
    )
    assert refused["fit"] == (
        "fit() cannot start while fit() is already running on this trainer: await that fit() "
        "first (or end it at its next optimizer step with stop())"
    )


async def test_a_second_fit_before_the_first_s_session_leaves_the_first_and_its_streams(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first fit was still before its session (looking at checkpoint_dir): the second
    # went on, was refused only as its own session began, and published its FitEnded to the
    # first fit's streams, which ended there; it had also cleared the first one's stop().
    looking, go_on = anyio.Event(), anyio.Event()
    check = Trainer._check_checkpoint_dir

    async def held_check(self: Trainer) -> None:
        if not looking.is_set():  # the first fit's
            looking.set()
            await go_on.wait()
        await check(self)

    monkeypatch.setattr(Trainer, "_check_checkpoint_dir", held_check)
    trainer = checkpointing_trainer(tmp_path)
    stream = trainer.events()
    async with anyio.create_task_group() as group:
        group.start_soon(functools.partial(trainer.fit, make_batches([4, 4, 4]), epochs=1))
        await looking.wait()
        assert trainer._session_kind is None  # the first fit is before its session
        for call in (
            lambda: trainer.fit(make_batches([4])),
            lambda: trainer.validate(make_batches([4])),
        ):
            with pytest.raises(ConfigurationError, match="already running on this trainer"):
                await call()
        go_on.set()
    kinds = [type(event).__name__ async for event in stream]
    assert kinds == [
        "FitStarted", "StepEnded", "StepEnded", "StepEnded", "EpochEnded", "CheckpointSaved",
        "FitEnded",
    ]  # fmt: skip
    assert trainer.global_step == 3


async def test_state_dict_is_refused_while_a_step_is_in_progress() -> None:
    # It read an optimizer state half stepped.
    inside, release = threading.Event(), threading.Event()

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        inside.set()
        release.wait(10)
        return loss_step(model, batch)

    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(2), progress_bar=False)

    async def during_the_step() -> None:
        await anyio.to_thread.run_sync(inside.wait, 10)
        try:
            with pytest.raises(ConfigurationError, match=r"while a step of fit\(\) is in prog"):
                trainer.state_dict()
        finally:
            release.set()

    async with anyio.create_task_group() as group:
        group.start_soon(during_the_step)
        await trainer.fit(make_batches([4]), epochs=1)
    assert trainer.state_dict()["global_step"] == 1


@pytest.mark.parametrize(("devices", "accumulate"), [(1, 1), (2, 1), (2, 2)])
async def test_a_step_that_calls_backward_itself_is_a_step_output_error(
    devices: int, accumulate: int
) -> None:
    # torch's "Trying to backward through the graph a second time ... Specify
    # retain_graph=True", whose advice would count every gradient twice.
    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        loss = loss_step(model, batch)
        loss.backward()
        return loss

    trainer = Trainer(
        make_model(),
        SGD,
        step,
        devices=cpu_devices(devices),
        progress_bar=False,
        accumulate_grad_batches=accumulate,
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(
        StepOutputError, match=r"the step called backward\(\) itself .*return the loss"
    ):
        await trainer.fit(make_batches([4, 4]), epochs=1)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def adversarial_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """The tutorials' FGSM: backward for the inputs' gradient, zero the model's, train on the
    perturbed inputs."""
    inputs = batch[0].clone().requires_grad_(True)
    F.cross_entropy(model(inputs), batch[1]).backward()
    perturbed = (inputs + 0.1 * inputs.grad.sign()).detach()
    model.zero_grad()
    return F.cross_entropy(model(perturbed), batch[1])


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_step_that_clears_the_gradients_its_backward_left_trains_as_a_plain_loop(
    devices: int,
) -> None:
    batches = make_batches([4, 4])
    expected = make_model()
    optimizer = SGD(expected.parameters())
    for batch in batches:
        optimizer.zero_grad()
        adversarial_step(expected, batch).backward()
        optimizer.step()
    trainer = Trainer(
        make_model(), SGD, adversarial_step, devices=cpu_devices(devices), progress_bar=False
    )
    await trainer.fit(batches, epochs=1)
    assert_close(trainer.model, expected)


async def test_gradients_a_step_takes_with_autograd_grad_are_not_a_backward() -> None:
    # A gradient penalty (torch.autograd.grad) accumulates into no parameter's .grad.
    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        inputs = batch[0].requires_grad_(True)
        loss = F.cross_entropy(model(inputs), batch[1])
        (grad,) = torch.autograd.grad(loss, inputs, create_graph=True)
        return loss + 0.1 * grad.pow(2).sum()

    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(2), progress_bar=False)
    result = await trainer.fit(make_batches([4, 4]), epochs=1)
    assert result.global_step == 2


async def test_a_fit_called_from_inside_a_step_says_so() -> None:
    # "await it first": the step cannot.
    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        asyncio.run(trainer.fit(make_batches([4])))
        return loss_step(model, batch)

    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(WorkerFailedError) as caught:
        await trainer.fit(make_batches([4]))
    assert isinstance(caught.value.__cause__, ConfigurationError)
    assert re.match(
        r"fit\(\) was called from inside a step, on cpu#\d's worker thread, while fit\(\) is",
        str(caught.value.__cause__),
    )


@pytest.mark.parametrize("call", ["save_checkpoint()", "state_dict()"])
async def test_a_checkpoint_or_state_asked_for_from_inside_a_step_says_so(
    call: str, tmp_path: Any
) -> None:
    # save_checkpoint() waited for the step lock, which the calling step holds: every worker
    # and the event loop stood still for good. state_dict() read the replicas mid-step.
    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        if call == "state_dict()":
            trainer.state_dict()
        else:
            asyncio.run(trainer.save_checkpoint(tmp_path / "from-a-step.ckpt"))
        return loss_step(model, batch)

    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(2), progress_bar=False)
    with anyio.fail_after(60), pytest.raises(WorkerFailedError) as caught:
        await trainer.fit(make_batches([4]))
    assert isinstance(caught.value.__cause__, ConfigurationError)
    assert re.match(
        rf"{re.escape(call)} was called from inside a step, on cpu#\d's worker thread, while "
        rf"fit\(\) is already running on this trainer: a step only computes the loss of "
        rf"\(model, batch\); call {re.escape(call)} from your async code, not from a step, "
        r"even through the event loop \(run_coroutine_threadsafe\)",
        str(caught.value.__cause__),
    )
    assert not (tmp_path / "from-a-step.ckpt").exists()


def lightning_step(model: nn.Module, batch: Any, batch_idx: int) -> torch.Tensor:
    return loss_step(model, batch)


def batch_only(batch: Any) -> torch.Tensor:
    return batch[0].sum()


class LightningStyle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = make_model()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return loss_step(self.layer, batch)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        # Each was found at the first fit, under the worker's frames, or not at all.
        (
            {"model": nn.Linear},
            r"got the class Linear: pass an instance, Linear\(\.\.\.\)",
        ),
        (
            {"step": lightning_step},
            r"step lightning_step\(model, batch, batch_idx\) cannot be called as "
            r"step\(model, batch\) \(missing a required argument: 'batch_idx'\)",
        ),
        ({"step": batch_only}, r"step batch_only\(batch\) cannot .* \(too many positional"),
        (
            # Bound, it binds as step(model, batch): the model went in as its batch.
            {"step": LightningStyle().training_step},
            r"step LightningStyle.training_step\(batch, batch_idx\) is a LightningModule-style "
            r"hook: .* with the model as its batch",
        ),
        (
            {"valid_step": lightning_step},
            r"valid_step lightning_step.*cannot be called as valid_step\(model, batch\)",
        ),
        (
            {"step": functools.partial(torch.optim.SGD, lr=0.1)},
            r"step is functools.partial\(SGD, ...\), an optimizer factory",
        ),
        ({"step": torch.optim.Adam}, r"step is the class Adam, an optimizer factory"),
        (
            {"lr_scheduler": "instance"},
            r"lr_scheduler must be a factory .*, not a StepLR instance, the scheduler of one",
        ),
        ({"lr_scheduler": 5}, r"lr_scheduler must be a factory .*, not 5$"),
    ],
    ids=[
        "model-class",
        "lightning-step",
        "batch-only-step",
        "lightning-bound-step",
        "lightning-valid-step",
        "optimizer-as-step",
        "optimizer-class-as-step",
        "scheduler-instance",
        "scheduler-int",
    ],
)
def test_arguments_of_the_wrong_kind_are_refused_as_the_trainer_is_built(
    arguments: dict[str, Any], message: str
) -> None:
    options: dict[str, Any] = {"model": make_model(), "optimizer": SGD, "step": loss_step}
    options.update(arguments)
    if options.get("lr_scheduler") == "instance":
        optimizer = torch.optim.SGD(make_model().parameters(), lr=0.1)
        options["lr_scheduler"] = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with pytest.raises(ConfigurationError, match=message):
        Trainer(**options, progress_bar=False)


async def test_an_async_step_is_refused_with_what_to_do() -> None:
    # An async def step returned a coroutine on the worker thread: "the step returned a
    # coroutine", and Python's "coroutine ... was never awaited" warning besides.
    async def step(model: nn.Module, batch: Any) -> torch.Tensor:
        return loss_step(model, batch)

    for option in ("step", "valid_step"):
        steps = {"step": step} if option == "step" else {"step": loss_step, "valid_step": step}
        with pytest.raises(ConfigurationError, match=f"^{option} is an async function; .*plain"):
            Trainer(make_model(), SGD, **steps, progress_bar=False)  # type: ignore[arg-type]

    class AsyncCall:  # not a coroutine function itself: its calls return coroutines
        async def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
            return loss_step(model, batch)

    trainer = Trainer(make_model(), SGD, AsyncCall(), devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(StepOutputError, match=r"returned a coroutine \(is it async\?\)"):
        await trainer.fit(make_batches([4]), epochs=1)


def test_an_optimizer_that_is_not_a_factory_is_named_in_the_error() -> None:
    with pytest.raises(ConfigurationError, match="not an optimizer instance"):
        Trainer(make_model(), SGD(make_model().parameters()), loss_step)
    with pytest.raises(ConfigurationError, match=r"lr=0.1\), not str 'adam'$"):
        Trainer(make_model(), "adam", loss_step)  # type: ignore[arg-type]


async def test_two_trainers_given_one_module_are_refused_a_call_at_the_same_time() -> None:
    # They both trained into it at once, and each ended with replicas that differed.
    model = make_model()
    first = Trainer(model, SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    second = Trainer(model, SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    outcomes: dict[str, Any] = {}

    async def fit(name: str, trainer: Trainer) -> None:
        try:
            outcomes[name] = await trainer.fit(make_batches([4] * 6), epochs=1)
        except ConfigurationError as error:
            outcomes[name] = error

    async with anyio.create_task_group() as group:
        group.start_soon(fit, "first", first)
        group.start_soon(fit, "second", second)
    refused = [name for name, outcome in outcomes.items() if isinstance(outcome, Exception)]
    assert len(refused) == 1  # whichever started second
    error = outcomes[refused[0]]
    assert "model is in use by another Trainer (in a fit)" in str(error)
    assert "copy.deepcopy(model)" in str(error)
    trained, waited = (second, first) if refused == ["first"] else (first, second)
    assert_replicas_identical(trained)
    await waited.fit(make_batches([4] * 6), epochs=1)  # one after the other: as before
    assert_replicas_identical(waited)


async def test_fit_again_continues_training() -> None:
    batches = make_batches([4, 4])
    expected = reference(batches, 3, SGD)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(batches, epochs=1)
    again = await trainer.fit(batches, epochs=3)
    assert [record.epoch for record in again.history] == [1, 2]
    assert_close(trainer.model, expected)
    with pytest.warns(UserWarning, match="trains nothing"):
        done = await trainer.fit(batches, epochs=3)  # nothing left to do
    assert done.history == ()


async def test_stop_ends_fit_at_the_next_step_and_fit_continues_from_there() -> None:
    batches = make_batches([3, 3, 3, 3, 3])
    expected = reference(batches, 2, SGD)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    first = await fit_until_stopped(trainer, batches, epochs=2, at_step=2, reason="enough for now")
    assert first.stopped
    assert first.stop_reason == "enough for now"
    assert first.global_step == 3  # stop() from the consumer of step 2's StepEnded: no step 3
    assert_replicas_identical(trainer)
    rest = await trainer.fit(batches, epochs=2)
    assert not rest.stopped
    assert rest.global_step == 10
    assert_close(trainer.model, expected)


async def fitting(group: Any, trainer: Trainer) -> None:
    """Start ``trainer`` fitting (until stopped) in ``group``; return once a step has ended."""
    stream = trainer.events()
    group.start_soon(functools.partial(trainer.fit, make_batches([4] * 50), epochs=1000))
    async for event in stream:
        if isinstance(event, StepEnded):
            return


async def test_a_fit_into_the_checkpoint_dir_of_another_trainer_fitting_is_refused(
    tmp_path: Any,
) -> None:
    # A sweep's trials given one folder wrote checkpoints of the same names over each other
    # without a word, and a trial's resume="latest" then loaded another trial's model.
    first = Trainer(
        make_model(), SGD, loss_step, checkpoint_dir=tmp_path / "shared", progress_bar=False
    )
    second = Trainer(
        make_model(1), SGD, loss_step, checkpoint_dir=tmp_path / "." / "shared", progress_bar=False
    )
    own = Trainer(
        make_model(2), SGD, loss_step, checkpoint_dir=tmp_path / "own", progress_bar=False
    )
    async with anyio.create_task_group() as group:
        await fitting(group, first)
        with pytest.raises(
            ConfigurationError, match=r"checkpoint_dir .* of another Trainer fitting"
        ):
            await second.fit(make_batches([4]), epochs=1)
        await own.fit(make_batches([4]), epochs=1)
        first.stop()
    assert second.global_step == 0
    second.checkpoint_dir = tmp_path / "second"
    await second.fit(make_batches([4]), epochs=1)


@pytest.mark.parametrize("own_generator", [False, True])
async def test_continuing_an_epoch_beside_another_trainer_warns_if_its_order_is_the_global_ones(
    own_generator: bool,
) -> None:
    # The replay rewinds torch's global generator and redraws the order from it, while the
    # other trainer's dropout draws from it too: the continued epoch trained 11 to 19 of 64
    # samples twice and as many never, in 7 of 12 cuts (a trial), without a word. A loader
    # with a generator of its own replays exactly.
    from torch.utils.data import DataLoader, TensorDataset

    inputs, targets = make_batches([32])[0]
    generator = torch.Generator().manual_seed(0) if own_generator else None
    loader = DataLoader(
        TensorDataset(inputs, targets), batch_size=4, shuffle=True, generator=generator
    )
    other = Trainer(
        nn.Sequential(nn.Linear(FEATURES, 8), nn.Dropout(0.5), nn.Linear(8, 3)),
        SGD,
        loss_step,
        progress_bar=False,
    )
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    async with anyio.create_task_group() as group:
        await fitting(group, other)
        assert (await fit_until_stopped(trainer, loader, epochs=1, at_step=2)).stopped
        if own_generator:
            await trainer.fit(loader, epochs=1)
        else:
            with pytest.warns(asyncddp.AsyncDDPRuntimeWarning, match="another Trainer") as seen:
                await trainer.fit(loader, epochs=1)
            assert "generator=torch.Generator()" in str(seen[0].message)
        other.stop()
    assert trainer.epoch == 1
    alone = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=4, shuffle=True)
    assert (await fit_until_stopped(alone, loader, epochs=1, at_step=2)).stopped
    await alone.fit(loader, epochs=1)  # the global generator's order, alone: no warning


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("on", [EpochEnded, ValidationEnded])
async def test_stop_from_an_epoch_end_consumer_runs_no_step_of_the_next_epoch(
    devices: int, on: type
) -> None:
    # Early stopping on an event: the returned model is the one validated, and no step of the
    # next epoch ran (it did: the consumer ran only once the next step was under way).
    batches = make_batches([3] * 5)
    trainer = Trainer(
        make_model(), SGD, loss_step, devices=cpu_devices(devices), progress_bar=False
    )
    stream = trainer.events()
    seen: list[float] = []

    async def early_stopping() -> None:
        async for event in stream:
            if isinstance(event, on):
                seen.append(event.metrics["loss"] if on is ValidationEnded else 0.0)
                trainer.stop("early stopping")  # no await before it

    async with anyio.create_task_group() as group:
        group.start_soon(early_stopping)
        result = await trainer.fit(batches, epochs=3, valid_data=batches)
    assert (result.epoch, result.global_step, result.stopped) == (1, 5, True)
    if on is ValidationEnded:
        assert (await trainer.validate(batches))["loss"] == seen[0]


def test_a_stop_reason_that_is_no_string_is_refused() -> None:
    # stop(123) was taken, and FitResult.stop_reason, a str, came back as the int 123.
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(1), progress_bar=False)
    with pytest.raises(TypeError, match=r"reason must be a string, .* got int 123"):
        trainer.stop(123)  # type: ignore[arg-type]
    trainer.stop("a reason")


async def test_items_per_second_counts_the_items_this_call_trained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It counted the items of the epochs the call completed: 0 for a fit stopped in mid-epoch
    # however long it trained, and the whole epoch for one that finished an epoch begun before.
    class Clock:  # each call of fit takes 1 s by this clock
        now = 0.0

        @classmethod
        def perf_counter(cls) -> float:
            cls.now += 1.0
            return cls.now

    monkeypatch.setattr(asyncddp._trainer, "time", Clock)
    batches = make_batches([3] * 5)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    stopped = await fit_until_stopped(trainer, batches, epochs=1, at_step=1)
    assert (stopped.global_step, stopped.items_per_second) == (2, 6.0)
    rest = await trainer.fit(batches, epochs=1)
    assert (rest.history[0].items, rest.items_per_second) == (15, 9.0)


@pytest.mark.parametrize("devices", [1, 2])
async def test_cancelling_fit_leaves_a_trainer_that_continues_exactly(devices: int) -> None:
    batches = make_batches([3] * 40)
    expected = reference(batches, 1, ADAMW)
    trainer = Trainer(
        make_model(), ADAMW, loss_step, devices=cpu_devices(devices), progress_bar=False
    )
    steps_seen = anyio.Event()
    stream = trainer.events()

    async def watch() -> None:
        async for event in stream:
            if isinstance(event, StepEnded) and event.step >= 5:
                steps_seen.set()

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        with anyio.CancelScope() as scope:
            group.start_soon(lambda: trainer.fit(batches, epochs=1))  # type: ignore[arg-type,return-value]
            await steps_seen.wait()
            scope.cancel()
            group.cancel_scope.cancel()
    assert 5 <= trainer.global_step < 40
    assert_replicas_identical(trainer)
    await trainer.fit(batches, epochs=1)
    assert trainer.global_step == 40
    assert_close(trainer.model, expected)


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_fit_cancelled_in_an_epoch_s_first_step_keeps_the_epoch_s_shuffle(
    devices: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A shuffling DataLoader draws its order's seed from torch's RNG when the epoch starts.
    # Cancelled before the epoch's first step is done, the next fit must give the epoch the
    # same order, as an uninterrupted run does (an earlier version drew a fresh one).
    data = make_batches([3] * 8)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(
            torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
        ),
        batch_size=4,
        shuffle=True,
    )
    torch.manual_seed(5)
    uninterrupted = Trainer(
        make_model(), SGD, loss_step, devices=cpu_devices(devices), progress_bar=False
    )
    await uninterrupted.fit(loader, epochs=2)

    # The first step's job on the last device is held back before it starts, and the fit is
    # cancelled meanwhile: that job is dropped, and the step is undone.
    run, held = asyncddp._scheduler._Job.__call__, threading.Event()

    def held_back(job: Any) -> Any:
        if job.index == devices - 1 and job.phase == "train" and job.number == 0:
            held.set()
            time.sleep(0.3)
        return run(job)

    monkeypatch.setattr(asyncddp._scheduler._Job, "__call__", held_back)
    torch.manual_seed(5)
    trainer = Trainer(
        make_model(), SGD, loss_step, devices=cpu_devices(devices), progress_bar=False
    )
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: trainer.fit(loader, epochs=2))  # type: ignore[arg-type,return-value]
            assert await anyio.to_thread.run_sync(held.wait, 10.0)  # set on a worker thread
            scope.cancel()
    monkeypatch.undo()
    assert trainer.global_step == 0  # the epoch's first step did not finish
    await trainer.fit(loader, epochs=2)
    assert trainer.global_step == uninterrupted.global_step
    assert_close(trainer.model, uninterrupted.model)


class FailOnce:
    """A step that raises once, on one device, at one step (counted per device)."""

    def __init__(self, device_name: str, call: int, where: str = "forward") -> None:
        self.device_name = device_name
        self.call = call
        self.where = where
        self.calls = 0
        self.fired = False

    def __call__(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        worker = asyncddp.current_worker()  # in training only (validation: no grad)
        mine = worker.device.name if worker is not None and torch.is_grad_enabled() else None
        if mine == self.device_name:
            self.calls += 1
            if self.calls == self.call and not self.fired:
                self.fired = True
                if self.where == "forward":
                    raise ValueError("bad shard")
                return F.cross_entropy(_FailInBackward.apply(model(inputs)), targets)
        return F.cross_entropy(model(inputs), targets)


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward blew up")


@pytest.mark.parametrize("where", ["forward", "backward"])
async def test_a_failure_names_the_device_and_changes_no_parameter(where: str) -> None:
    batches = make_batches([4] * 5)
    expected = reference(batches, 1, SGD)
    trainer = Trainer(
        make_model(), SGD, FailOnce("cpu#1", 3, where), devices=cpu_devices(2), progress_bar=False
    )
    await trainer.validate(batches[:1])  # builds the replicas
    stream = trainer.events()
    with pytest.raises(WorkerFailedError) as info:
        await trainer.fit(batches, epochs=1)
    error = info.value
    assert error.device.name == "cpu#1"
    assert (error.epoch, error.step, error.phase) == (0, 2, "train")
    assert isinstance(error.__cause__, ValueError if where == "forward" else RuntimeError)
    assert trainer.global_step == 2
    assert_replicas_identical(trainer)
    events = [event async for event in stream]
    assert [type(event).__name__ for event in events[-2:]] == ["WorkerFailed", "FitEnded"]
    assert events[-2].action == "raise"
    assert events[-1].error is not None
    assert "cpu#1" in events[-1].error
    # Continue once the cause is gone: the same parameters as a run that never failed.
    await trainer.fit(batches, epochs=1)
    assert_close(trainer.model, expected)


class FailingSGD(torch.optim.SGD):
    """An SGD that updates its parameters, then raises, once, on a chosen replica."""

    armed: ClassVar[dict[str, int]] = {}

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        result = super().step(closure)
        name = getattr(self, "name", None)
        if name is not None and FailingSGD.armed.get(name) == 1:
            FailingSGD.armed[name] = 0
            raise RuntimeError("optimizer failed half way")
        if name is not None and name in FailingSGD.armed and FailingSGD.armed[name] > 1:
            FailingSGD.armed[name] -= 1
        return result


async def test_a_failure_in_the_optimizer_step_is_undone_on_every_replica() -> None:
    batches = make_batches([4] * 5)
    expected = reference(batches, 1, SGD)
    trainer = Trainer(
        make_model(),
        functools.partial(FailingSGD, lr=0.1, momentum=0.9),
        loss_step,
        devices=cpu_devices(3),
        progress_bar=False,
    )
    await trainer.validate(batches[:1])
    for replica in trainer._replicas:
        replica.optimizer.name = replica.device.name  # type: ignore[attr-defined]
    FailingSGD.armed = {"cpu#2": 3}  # fails in its third step, after updating its parameters
    with pytest.raises(WorkerFailedError) as info:
        await trainer.fit(batches, epochs=1)
    assert info.value.device.name == "cpu#2"
    assert info.value.phase == "optimizer"
    assert trainer.global_step == 2
    assert_replicas_identical(trainer)
    await trainer.fit(batches, epochs=1)
    assert_close(trainer.model, expected)


async def test_retry_policy_runs_the_step_again(caplog: pytest.LogCaptureFixture) -> None:
    batches = make_batches([4] * 4)
    expected = reference(batches, 1, SGD)
    trainer = Trainer(
        make_model(),
        SGD,
        FailOnce("cpu#0", 2),
        devices=cpu_devices(2),
        on_failure="retry",
        progress_bar=False,
    )
    await trainer.validate(batches[:1])
    stream = trainer.events()
    await trainer.fit(batches, epochs=1)
    assert_close(trainer.model, expected)
    kinds = [type(event).__name__ async for event in stream]
    assert "WorkerFailed" in kinds
    assert "StepRetried" in kinds
    # The log says so too, with the original traceback (it said nothing of a retry).
    [record] = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert record.name == "asyncddp"
    assert record.levelname == "WARNING"
    first, *rest = record.getMessage().splitlines()
    assert first == (
        "training worker on device cpu#0 failed: ValueError: bad shard (epoch 0; step 1; phase "
        "train); retrying the step (retry 1 of max_retries=2)"
    )
    assert rest[0] == "Traceback (most recent call last):"
    assert rest[-1] == "ValueError: bad shard"  # the cause's, as text: no frames kept
    assert record.exc_info is None
    assert all(isinstance(arg, (str, int)) for arg in record.args)  # nor the error


async def test_batchnorm_on_a_one_item_shard_says_why_and_what_to_do() -> None:
    # 67 items in batches of 32: a last batch of 3 leaves one device 1 item, and torch's
    # "Expected more than 1 value per channel when training" said nothing of the split.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    trainer = Trainer(model, SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(WorkerFailedError, match="more than 1 value per channel") as caught:
        await trainer.fit(make_batches([4, 3]), epochs=1)
    assert "held 1 item" in "\n".join(caught.value.__cause__.__notes__)
    assert "drop_last=True" in "\n".join(caught.value.__cause__.__notes__)


async def test_retries_used_up_say_so_in_the_error() -> None:
    def always(model: nn.Module, batch: Any) -> torch.Tensor:
        raise RuntimeError("broken for good")

    trainer = Trainer(
        make_model(),
        SGD,
        always,
        devices=cpu_devices(2),
        on_failure="retry",
        max_retries=2,
        progress_bar=False,
    )
    with pytest.raises(WorkerFailedError, match="broken for good") as caught:
        await trainer.fit(make_batches([4]), epochs=1)
    assert "this step failed 3 times, its max_retries=2 retries used up" in "\n".join(
        caught.value.__notes__
    )


async def test_drop_policy_goes_on_without_the_failed_device() -> None:
    batches = make_batches([6] * 4)

    def broken_on_cpu1(model: nn.Module, batch: Any) -> torch.Tensor:
        worker = asyncddp.current_worker()
        if worker is not None and worker.device.name == "cpu#1" and torch.is_grad_enabled():
            raise RuntimeError("device lost")
        return loss_step(model, batch)

    trainer = Trainer(
        make_model(),
        SGD,
        broken_on_cpu1,
        devices=cpu_devices(3),
        on_failure="drop",
        progress_bar=False,
    )
    await trainer.validate(batches[:1])
    stream = trainer.events()
    with pytest.warns(
        asyncddp.DeviceDroppedWarning,
        match=r"dropping failed device\(s\) cpu#1 after RuntimeError: device lost \(epoch 0, step",
    ) as seen:
        result = await trainer.fit(batches, epochs=1)
    assert seen[0].filename == __file__  # the fit's line, not one of asyncddp's
    assert result.global_step == 4
    assert [d.name for d in trainer.devices] == ["cpu#0", "cpu#2"]
    assert_replicas_identical(trainer)
    expected = reference(batches, 1, SGD)
    assert_close(trainer.model, expected)
    events = [event async for event in stream]
    dropped = [e for e in events if isinstance(e, asyncddp.DeviceDropped)]
    assert [(e.device, e.remaining) for e in dropped] == [("cpu#1", ("cpu#0", "cpu#2"))]


async def test_drop_raises_an_error_that_follows_its_batch_instead_of_dropping_every_device() -> (
    None
):
    # A label out of range in the second batch: its shard failed on cpu#1, which was dropped;
    # re-split, it failed on cpu#0, dropped too, and the trainer was left on cpu#2 alone.
    batches = make_batches([6, 6])
    batches[1][1][2] = 99  # the third item: cpu#1's shard of three devices, cpu#0's of two
    trainer = Trainer(
        make_model(), SGD, loss_step, devices=cpu_devices(3), on_failure="drop", progress_bar=False
    )
    with (
        pytest.warns(asyncddp.DeviceDroppedWarning, match="cpu#1"),
        pytest.raises(WorkerFailedError, match="out of bounds") as caught,
    ):
        await trainer.fit(batches, epochs=1)
    assert caught.value.device.name == "cpu#0"
    assert "it follows the batch" in "\n".join(caught.value.__notes__)
    assert [d.name for d in trainer.devices] == ["cpu#0", "cpu#2"]
    assert trainer.global_step == 1


class _CenteredFromData(nn.Module):
    """Keeps a frozen parameter that the forward moves toward the data (an EMA centre)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.center = nn.Parameter(torch.zeros(FEATURES), requires_grad=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.center.mul_(0.9).add_(inputs.mean(0), alpha=0.1)
        return self.body(inputs - self.center)  # type: ignore[no-any-return]


def _renormed_embedding() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, FEATURES, max_norm=0.5), nn.Flatten(), nn.Linear(12, 3))


@pytest.mark.parametrize(
    ("build", "parameter", "batches"),
    [
        (_CenteredFromData, "center", lambda: make_batches([8, 8])),
        (
            _renormed_embedding,
            "0.weight",
            lambda: [(torch.arange(8).view(4, 2) + k, torch.arange(4) % 3) for k in range(2)],
        ),
    ],
)
async def test_a_parameter_written_in_place_by_each_device_s_share_is_an_error(
    build: Callable[[], nn.Module], parameter: str, batches: Callable[[], Any]
) -> None:
    # Each device wrote its copy by its own share: the replicas drifted apart, with no error,
    # and the model saved was the first's (nn.Embedding(max_norm=...) 1.9 from a plain loop in
    # a user's trial). Told after the fit's first step, naming the parameter.
    trainer = Trainer(build(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    message = rf"after this fit's first step, parameter '{re.escape(parameter)}' differs"

    def frozen_written() -> Any:  # a frozen parameter written by the step is told of too
        if parameter != "center":
            return contextlib.nullcontext()
        return pytest.warns(asyncddp.AsyncDDPRuntimeWarning, match="frozen parameters")

    with frozen_written(), pytest.raises(asyncddp.AsyncDDPError, match=message + r".*\(register"):
        await trainer.fit(batches(), epochs=1)
    alone = Trainer(build(), SGD, loss_step, devices="cpu", progress_bar=False)
    with frozen_written():
        await alone.fit(batches(), epochs=1)  # one device: nothing to drift apart
    assert alone.global_step == 2


async def test_replicas_that_part_after_the_first_step_are_told_at_the_epoch_s_end() -> None:
    def parts_at_step_1(model: nn.Module, batch: Any) -> torch.Tensor:
        ctx = asyncddp.current_worker()
        if ctx is not None and ctx.step == 1:  # each device its own way, after the first step
            with torch.no_grad():
                model[0].bias[0] += ctx.device.index
        return loss_step(model, batch)

    trainer = Trainer(
        make_model(), SGD, parts_at_step_1, devices=cpu_devices(2), progress_bar=False
    )
    with pytest.raises(
        asyncddp.AsyncDDPError,
        match=r"after epoch 0, parameter '0\.bias' differs between cpu#0's copy of the model "
        r"and cpu#1's \(1 of 16 elements, by up to 1\):",
    ):
        await trainer.fit(make_batches([8, 8, 8]), epochs=1, valid_data=make_batches([8]))
    assert trainer.epoch == 0  # not closed: the next fit compares again


async def test_a_parameter_written_in_place_alike_on_every_device_trains() -> None:
    # Clamping every weight in the step (a WGAN critic's clipping) writes each copy alike.
    def clamped_step(model: nn.Module, batch: Any) -> torch.Tensor:
        with torch.no_grad():
            for param in model.parameters():
                param.clamp_(-0.1, 0.1)
        return loss_step(model, batch)

    trainer = Trainer(make_model(), SGD, clamped_step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(make_batches([8, 8]), epochs=2)
    assert trainer.global_step == 4
    assert_replicas_identical(trainer)


async def test_a_channels_last_model_s_gradients_are_laid_out_as_its_weights() -> None:
    # Each .grad was a contiguous view into the flat buffers: on several devices torch warned
    # that the gradient layout contract was broken ("may impair performance"), every step.
    def build() -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 1))
        return net.to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(24, 3, 6, 6, generator=generator)
    inputs = inputs.contiguous(memory_format=torch.channels_last)
    targets = torch.randn(24, 1, generator=generator)
    batches = [(inputs[i : i + 6], targets[i : i + 6]) for i in range(0, 24, 6)]

    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        return F.mse_loss(model(batch[0]), batch[1])

    expected = build()
    opt = SGD(expected.parameters())
    for batch in batches:
        opt.zero_grad()
        step(expected, batch).backward()
        opt.step()
    trainer = Trainer(build(), SGD, step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(batches, epochs=1)  # the warning is an error in this suite
    assert_close(trainer.model, expected)
    for replica in trainer._replicas:
        weight = replica.model[0].weight
        assert weight.stride() == (27, 1, 9, 3)
        assert weight.grad is not None
        assert weight.grad.stride() == weight.stride()


@pytest.mark.parametrize("devices", [1, 2])
async def test_drop_says_why_it_raised_when_no_device_would_be_left(devices: int) -> None:
    # It raised with no note: with the WorkerFailed event's action "raise", the user could not
    # tell on_failure="drop" had been passed over, where the other two reasons say so.
    started = threading.Barrier(devices, timeout=10)

    def fails(model: nn.Module, batch: Any) -> torch.Tensor:
        started.wait()  # both running: neither's job is dropped for the other's failure
        raise RuntimeError("every device fails")

    trainer = Trainer(
        make_model(),
        SGD,
        fails,
        devices=cpu_devices(devices),
        on_failure="drop",
        progress_bar=False,
    )
    with pytest.raises(WorkerFailedError, match="every device fails") as caught:
        await trainer.fit(make_batches([6]), epochs=1)
    which = "this trainer's one device" if devices == 1 else "all 2 devices failed in this step"
    notes = "\n".join(caught.value.__notes__)
    assert "on_failure='drop' drops only some devices: " + which in notes
    assert "none would be left" in notes


@pytest.mark.parametrize("long", [False, True], ids=["short-list", "long-list"])
async def test_a_long_list_of_batches_is_counted_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch, long: bool
) -> None:
    # Progress needs every batch of a list counted at the fit's and each epoch's start: a walk
    # over all of them (0.14 s for 100,000 small batches here), which must not stall the
    # event loop. Past a length (10,000; 4 here) it runs on a thread; the counts are the same.
    from asyncddp import _ranks

    monkeypatch.setattr(_ranks, "COUNT_ON_THREAD", 4 if long else 100)
    threads: list[threading.Thread] = []
    count = _ranks.rank_items_total
    counting, released = threading.Event(), threading.Event()

    def spy(data: Any, rank: int, world_size: int) -> int | None:
        threads.append(threading.current_thread())
        if long:  # the event loop must run meanwhile: a task on it lets the count go on
            released.clear()
            counting.set()
            assert released.wait(10), "the event loop was blocked while the list was counted"
        return count(data, rank, world_size)

    async def release() -> None:
        while True:
            if counting.is_set():
                counting.clear()
                released.set()
            await anyio.sleep(0.001)

    monkeypatch.setattr(_ranks, "rank_items_total", spy)
    batches = make_batches([5, 5, 3, 4, 2, 6])
    trainer = Trainer(make_model(), SGD, loss_step, devices="cpu", progress_bar=False)
    stream = trainer.events()
    async with anyio.create_task_group() as group:
        group.start_soon(release)
        await trainer.fit(batches, epochs=2)
        group.cancel_scope.cancel()
    events = [event async for event in stream]
    assert isinstance(events[0], FitStarted)
    assert events[0].items_total == 25
    steps = [e for e in events if isinstance(e, StepEnded)]
    assert [e.progress.items_total for e in steps] == [25] * 12
    assert [e.progress.items_processed for e in steps[-6:]] == [5, 10, 13, 17, 19, 25]
    assert len(threads) == 3  # the fit's start, each epoch's start
    loop_thread = threading.current_thread()
    assert all((thread is not loop_thread) == long for thread in threads)


async def test_events_come_in_order_with_exact_monotonic_progress(tmp_path: Any) -> None:
    batches = make_batches([5, 5, 3])
    trainer = Trainer(
        make_model(),
        SGD,
        metric_step,
        devices=cpu_devices(2),
        checkpoint_dir=tmp_path,
        progress_bar=False,
    )
    stream = trainer.events()
    await trainer.fit(batches, epochs=2, valid_data=batches[:1])
    events = [event async for event in stream]
    assert isinstance(events[0], FitStarted)
    assert events[0].items_total == 13
    assert isinstance(events[-1], FitEnded)
    assert not events[-1].stopped
    kinds = [type(e).__name__ for e in events[1:-1]]
    per_epoch = ["StepEnded"] * 3 + ["EpochEnded", "ValidationEnded", "CheckpointSaved"]
    assert kinds == per_epoch * 2
    steps = [e for e in events if isinstance(e, StepEnded)]
    assert [e.step for e in steps] == list(range(6))
    for epoch in (0, 1):
        processed = [e.progress.items_processed for e in steps if e.epoch == epoch]
        assert processed == [5, 10, 13]
        assert all(e.progress.items_total == 13 for e in steps if e.epoch == epoch)
    assert all("accuracy" in e.metrics for e in steps)
    assert all(isinstance(e.loss, float) for e in steps)
    epoch_ends = [e for e in events if isinstance(e, EpochEnded)]
    assert [e.items for e in epoch_ends] == [13, 13]
    assert next(e.metrics.keys() for e in events if isinstance(e, ValidationEnded)) == {
        "loss",
        "accuracy",
    }
    saved = [e for e in events if isinstance(e, CheckpointSaved)]
    assert [e.epoch for e in saved] == [1, 2]


async def test_save_checkpoint_publishes_checkpoint_saved_with_the_step_it_holds(
    tmp_path: Any,
) -> None:
    from asyncddp import _checkpoint

    # A fit long enough that the save lands in it, then stopped: in one of 8 steps, a save
    # late under load (its task not run until then) came after the fit, in no stream of it.
    batches = make_batches([2] * 200)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    stream = trainer.events()
    paths = [await trainer.save_checkpoint(tmp_path / "before.ckpt")]  # no fit running

    async def save_during_the_fit() -> None:
        async for event in trainer.events():
            if isinstance(event, StepEnded) and event.step == 2:
                paths.append(await trainer.save_checkpoint(tmp_path / "during.ckpt"))
                trainer.stop()

    async with anyio.create_task_group() as group:
        group.start_soon(save_during_the_fit)
        await anyio.lowlevel.checkpoint()  # its stream opens before the fit starts
        await trainer.fit(batches, epochs=1)
    saved = [e for e in [event async for event in stream] if isinstance(e, CheckpointSaved)]
    assert [e.path for e in saved] == [str(path) for path in paths]
    for event, path in zip(saved, paths, strict=True):
        state = _checkpoint.load(path)
        assert (event.epoch, event.step) == (state["epoch"], state["global_step"])
    assert saved[0].step == 0
    assert 3 <= saved[1].step <= trainer.global_step < 200  # after step 2 ended, in the fit


async def test_progress_counts_carry_on_in_an_epoch_continued_or_resumed(tmp_path: Any) -> None:
    # Items carried on where an epoch was continued (after a stop, or from a checkpoint), but
    # Progress.steps began at 1 again: it went back, 3 then 1.
    batches = make_batches([4] * 6)

    async def told(trainer: Trainer, fit: Callable[[], Awaitable[Any]]) -> list[tuple[int, int]]:
        stream = trainer.events()
        await fit()
        return [
            (e.progress.items_processed, e.progress.steps)
            async for e in stream
            if isinstance(e, StepEnded)
        ]

    def make() -> Trainer:
        return Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)

    uninterrupted = make()
    expected = await told(uninterrupted, lambda: uninterrupted.fit(batches, epochs=1))
    assert expected == [(4 * n, n) for n in range(1, 7)]
    stopped = make()
    first = await told(stopped, lambda: fit_until_stopped(stopped, batches, epochs=1, at_step=2))
    path = await stopped.save_checkpoint(tmp_path / "stopped.ckpt")
    assert first + await told(stopped, lambda: stopped.fit(batches, epochs=1)) == expected
    resumed = make()
    rest = await told(resumed, lambda: resumed.fit(batches, epochs=1, resume=path))
    assert first + rest == expected


async def test_a_slow_event_consumer_never_holds_training_back() -> None:
    batches = make_batches([2] * 30)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    stream = trainer.events(maxlen=5)
    await trainer.fit(batches, epochs=1)  # nobody reads the stream meanwhile
    events = [event async for event in stream]
    assert len(events) == 5
    assert stream.dropped == 33 - 5  # FitStarted, 30 StepEnded, EpochEnded, FitEnded
    assert isinstance(events[-1], FitEnded)


async def test_a_stream_behind_its_fit_ends_at_that_fit_s_end_not_in_the_next() -> None:
    # The stream closed as its consumer read FitEnded: one still behind went on receiving,
    # and read the next fit's events after the first's end (182 of them in a helper's script).
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    stream = trainer.events()
    await trainer.fit(make_batches([2] * 3), epochs=1)  # nobody reads the stream meanwhile
    await trainer.fit(make_batches([2] * 3), epochs=2)
    events = [event async for event in stream]
    assert [type(event).__name__ for event in events] == [
        "FitStarted",
        "StepEnded",
        "StepEnded",
        "StepEnded",
        "EpochEnded",
        "FitEnded",
    ]
    assert events[-1].epoch == 1  # type: ignore[attr-defined]
    assert stream.dropped == 0


async def test_tasks_reading_one_stream_together_share_its_events_and_all_end() -> None:
    # Each waiting reader replaced the stream's one wake-up: the first waited on one nobody
    # would set, for ever, after the fit had ended.
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    stream = trainer.events()
    seen: list[list[str]] = [[], []]

    async def read(into: list[str]) -> None:
        async for event in stream:
            into.append(type(event).__name__)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(read, seen[0])
            group.start_soon(read, seen[1])
            await anyio.sleep(0.05)  # both wait in the empty stream
            await trainer.fit(make_batches([2] * 3), epochs=1)
    assert sorted(seen[0] + seen[1]) == sorted(
        ["FitStarted", "StepEnded", "StepEnded", "StepEnded", "EpochEnded", "FitEnded"]
    )


@pytest.mark.parametrize(
    ("fit_backend", "reader_backend"),
    [("asyncio", "asyncio"), ("asyncio", "trio"), ("trio", "asyncio")],
)
def test_events_read_on_another_threads_loop_come_as_the_fit_publishes(
    fit_backend: str, reader_backend: str
) -> None:
    # A UI's or a server's loop showing a fit run on a thread's loop: the fit set the reader's
    # wake-up from its own thread, which asyncio does not see (every event came at the
    # reader's next timeout, or never), asyncio's debug mode and trio refuse (the fit died).
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    stream = trainer.events()
    waiting = threading.Event()
    outcome: dict[str, Any] = {}

    def train() -> None:
        waiting.wait(10)
        try:
            fit = functools.partial(trainer.fit, make_batches([4] * 6), epochs=2)
            anyio.run(fit, backend=fit_backend)
            outcome["ended"] = time.monotonic()
        except BaseException as error:  # reported below
            outcome["error"] = error

    async def read() -> list[tuple[str, float]]:
        got = []
        with anyio.fail_after(60):  # the reader's loop has nothing else to wake it
            waiting.set()
            async for event in stream:
                got.append((type(event).__name__, time.monotonic()))
        return got

    thread = threading.Thread(target=train)
    thread.start()
    try:
        got = anyio.run(read, backend=reader_backend)
    finally:
        waiting.set()
        thread.join(60)
    assert "error" not in outcome, outcome
    assert [name for name, _ in got].count("StepEnded") == 12
    assert got[-1][0] == "FitEnded"
    assert got[-1][1] - outcome["ended"] < 5  # as it came, not at a timeout of the reader's


def test_a_reader_waiting_in_a_stopped_loop_is_woken_once_not_once_an_event() -> None:
    # Each event scheduled one more wake-up on the stopped loop (46.7 MB for 200,000 events).
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    stream = trainer.events()
    loop = asyncio.new_event_loop()
    reader = loop.create_task(stream.__anext__())
    loop.run_until_complete(asyncio.sleep(0.01))  # it waits; its loop stops, not closed
    asyncio.run(trainer.fit(make_batches([2] * 20), epochs=2))  # in another loop: 40 steps
    assert len(loop._ready) <= 1  # type: ignore[attr-defined]
    assert isinstance(loop.run_until_complete(reader), asyncddp.FitStarted)  # woken when it runs
    loop.close()


def test_a_fit_run_as_a_task_warns_at_the_line_that_runs_the_loop() -> None:
    # fit's own warnings pointed into asyncio (asyncio/events.py) when it ran as a task, and
    # so Python's default filter showed each once a process, whoever's line led to it.
    from asyncddp import AsyncDDPWarning

    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)

    async def main() -> None:
        await trainer.fit(make_batches([4]), epochs=1)
        trainer.model.eval()
        await asyncio.create_task(trainer.fit(make_batches([4]), epochs=2))  # in eval mode
        await asyncio.create_task(trainer.fit(make_batches([4]), epochs=2))  # trains nothing

    with pytest.warns(AsyncDDPWarning) as seen:
        asyncio.run(main())
    assert [str(w.message)[:25] for w in seen] == [
        "the model is in eval mode",
        "fit(epochs=2) trains noth",
    ]
    assert [w.filename for w in seen] == [__file__, __file__]  # asyncio.run(main()), above


def test_a_stream_left_waiting_in_an_earlier_loop_is_read_in_a_later_one() -> None:
    # A reader cancelled while it waited left the stream's wake-up, bound to its loop, for the
    # next reader: "bound to a different event loop" in a later asyncio.run. A reader left
    # waiting in a loop closed under it failed the next fit: "Event loop is closed".
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    stream, abandoned = trainer.events(), trainer.events()

    async def wait_briefly() -> None:
        with anyio.move_on_after(0.05):
            await stream.__anext__()

    asyncio.run(wait_briefly())
    loop = asyncio.new_event_loop()
    reader = loop.create_task(abandoned.__anext__())
    loop.run_until_complete(asyncio.sleep(0.05))  # it waits, and is left waiting
    loop.close()

    async def fit_and_read() -> list[str]:
        names: list[str] = []

        async def read() -> None:
            async for event in stream:
                names.append(type(event).__name__)

        async with anyio.create_task_group() as group:
            group.start_soon(read)
            await trainer.fit(make_batches([4] * 2), epochs=1)
        return names

    assert asyncio.run(fit_and_read()) == [
        "FitStarted",
        "StepEnded",
        "StepEnded",
        "EpochEnded",
        "FitEnded",
    ]
    assert not reader.done()  # its loop is gone: nobody runs it
    reader._log_destroy_pending = False  # type: ignore[attr-defined]  # asyncio's log, as it goes


async def test_progress_bar_renders(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=True)
    await trainer.fit(make_batches([4, 4]), epochs=1)
    err = capsys.readouterr().err
    assert "epoch 1/1" in err
    assert "8/8" in err


async def test_no_bar_by_default_into_a_log_though_ipykernel_was_imported(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A script that imported ipykernel (no kernel running) wrote the bar into its log: any
    # ipykernel in sys.modules counted as a notebook.
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2))
    await trainer.fit(make_batches([4, 4]), epochs=1)
    assert "epoch 1/1" not in capsys.readouterr().err  # pytest's stderr is no terminal
    # A running kernel has the bar (IPython's shell holds its kernel).
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: types.SimpleNamespace(kernel=object())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    await trainer.fit(make_batches([4, 4]), epochs=2)
    assert "epoch 2/2" in capsys.readouterr().err


# -- checkpoints -------------------------------------------------------------------------------


async def test_resuming_from_a_checkpoint_ends_like_an_uninterrupted_run(tmp_path: Any) -> None:
    data = make_batches([3] * 8)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(
            torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
        ),
        batch_size=5,
        shuffle=True,
    )

    def fresh() -> Trainer:
        return Trainer(make_model(), ADAMW, loss_step, devices=cpu_devices(2), progress_bar=False)

    torch.manual_seed(123)
    uninterrupted = fresh()
    await uninterrupted.fit(loader, epochs=3)

    torch.manual_seed(123)
    first = fresh()
    stopped = await fit_until_stopped(first, loader, epochs=3, at_step=6)  # in epoch 1
    assert stopped.stopped
    path = await first.save_checkpoint(tmp_path / "mid.ckpt")
    assert path.exists()
    torch.manual_seed(999)  # the checkpoint carries the RNG state: this must not matter
    resumed = fresh()
    await resumed.fit(loader, epochs=3, resume=path)
    assert resumed.global_step == uninterrupted.global_step
    assert_close(resumed.model, uninterrupted.model)


def checkpointing_trainer(folder: Any, seed: int = 0) -> Trainer:
    """Two CPU devices, writing a checkpoint to ``folder`` after every epoch."""
    return Trainer(
        make_model(seed),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        checkpoint_dir=folder,
        progress_bar=False,
    )


async def test_resume_latest_from_the_checkpoint_dir(tmp_path: Any) -> None:
    batches = make_batches([4, 4])
    trainer = checkpointing_trainer(tmp_path)
    await trainer.fit(batches, epochs=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch0001-step000002.ckpt",
        "epoch0002-step000004.ckpt",
    ]
    again = checkpointing_trainer(tmp_path, seed=5)
    result = await again.fit(batches, epochs=3, resume="latest")
    assert [r.epoch for r in result.history] == [2]
    assert [r.epoch for r in again.history] == [0, 1, 2]
    assert_close(again.model, reference(batches, 3, SGD))


async def test_an_epoch_checkpoint_a_fit_failed_to_write_is_written_by_the_next_fit(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The epoch was closed before its checkpoint was written: a failed write (a full disk)
    # or a cancellation there lost it for good, and resume="latest" went back an epoch.
    batches = make_batches([4, 4])
    save = asyncddp._checkpoint.save
    failures = [OSError(28, "No space left on device")]

    def failing_save(state: Any, path: Any) -> Any:
        if failures:
            raise failures.pop()
        return save(state, path)

    monkeypatch.setattr(asyncddp._checkpoint, "save", failing_save)
    trainer = checkpointing_trainer(tmp_path)
    with pytest.raises(OSError, match="No space left"):
        await trainer.fit(batches, epochs=2)
    assert (trainer.epoch, list(tmp_path.iterdir())) == (1, [])
    stream = trainer.events()  # the next fit's (a stream ends with the fit it saw)
    with pytest.warns(UserWarning, match="trains nothing"):
        result = await trainer.fit(batches, epochs=1)  # it still writes the one owed
    assert result.global_step == 2
    assert [p.name for p in tmp_path.iterdir()] == ["epoch0001-step000002.ckpt"]
    saved = [e async for e in stream if isinstance(e, CheckpointSaved)]
    assert [(e.epoch, e.step) for e in saved] == [(1, 2)]
    await trainer.fit(batches, epochs=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch0001-step000002.ckpt",
        "epoch0002-step000004.ckpt",
    ]
    again = checkpointing_trainer(tmp_path, seed=5)
    await again.fit(batches, epochs=2, resume=tmp_path / "epoch0001-step000002.ckpt")
    assert_close(again.model, reference(batches, 2, SGD))


async def test_an_owed_checkpoint_is_forgotten_once_checkpoints_are_turned_off(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every later fit raised a bare AssertionError (no folder to write the owed one to).
    def full_disk(state: Any, path: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(asyncddp._checkpoint, "save", full_disk)
    trainer = checkpointing_trainer(tmp_path)
    with pytest.raises(OSError, match="No space left"):
        await trainer.fit(make_batches([4, 4]), epochs=2)
    trainer.checkpoint_dir = None
    result = await trainer.fit(make_batches([4, 4]), epochs=2)
    assert result.global_step == 4


async def test_an_epoch_checkpoint_a_cancelled_fit_did_not_write_is_written_by_the_next(
    tmp_path: Any,
) -> None:
    batches = make_batches([4, 4])
    trainer = checkpointing_trainer(tmp_path)
    stream = trainer.events()
    async with anyio.create_task_group() as group:
        with anyio.CancelScope() as scope:

            async def cancel_at_validation_end() -> None:
                async for event in stream:
                    if isinstance(event, ValidationEnded):
                        scope.cancel()  # the fit goes on to close the epoch and write

            group.start_soon(cancel_at_validation_end)
            await trainer.fit(batches, epochs=2, valid_data=batches)
    assert trainer.epoch == 1
    await trainer.fit(batches, epochs=2, valid_data=batches)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch0001-step000002.ckpt",
        "epoch0002-step000004.ckpt",
    ]


async def test_resume_latest_with_no_checkpoint_yet_warns_and_starts_from_scratch(
    tmp_path: Any,
) -> None:
    # The resumable script's first run: resume="latest" is set once and for all, as with
    # Lightning's ckpt_path="last"; it raised a ConfigurationError before any checkpoint was
    # written, so the script could never make its first one.
    batches = make_batches([4, 4])
    trainer = checkpointing_trainer(tmp_path / "checkpoints")
    with pytest.warns(UserWarning, match="no checkpoint in .*checkpoints.* yet, so nothing"):
        result = await trainer.fit(batches, epochs=2, resume="latest")
    assert result.epoch == 2
    assert_close(trainer.model, reference(batches, 2, SGD))
    again = checkpointing_trainer(tmp_path / "checkpoints", seed=5)
    result = await again.fit(batches, epochs=3, resume="latest")  # the second run resumes
    assert [r.epoch for r in result.history] == [2]
    assert_close(again.model, reference(batches, 3, SGD))


async def test_save_checkpoint_without_a_path_is_the_one_resume_latest_takes(
    tmp_path: Any,
) -> None:
    # Saved before a preemption, in mid-epoch: a checkpoint saved by a name of its own was
    # passed over by resume="latest", which went back to the last epoch's end.
    batches = make_batches([4] * 8)
    trainer = checkpointing_trainer(tmp_path)
    await trainer.fit(batches, epochs=1)
    await fit_until_stopped(trainer, batches, epochs=2, at_step=9)
    assert trainer.epoch == 1  # in mid-epoch
    assert 10 <= trainer.global_step < 16
    path = await trainer.save_checkpoint()
    assert path == tmp_path / f"epoch0001-step{trainer.global_step:06d}.ckpt"
    again = checkpointing_trainer(tmp_path, seed=5)
    result = await again.fit(batches, epochs=2, resume="latest")
    assert result.history[0].items == 8 * 4  # the whole epoch, the part before the stop too
    assert again.global_step == 16
    assert_close(again.model, reference(batches, 2, SGD))

    bare = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(1), progress_bar=False)
    with pytest.raises(ConfigurationError, match="give a path, or build the Trainer with"):
        await bare.save_checkpoint()


async def test_a_fit_into_a_folder_of_checkpoints_further_on_warns(tmp_path: Any) -> None:
    # Another run's checkpoints, left in the folder: a new run that does not resume wrote its
    # own beside them without a word, and resume="latest" later went on from the old run's.
    batches = make_batches([4, 4])
    await checkpointing_trainer(tmp_path).fit(batches, epochs=2)
    fresh = checkpointing_trainer(tmp_path)
    with pytest.warns(UserWarning, match=r"further on than this trainer \(epoch0002-step000004"):
        await fresh.fit(batches, epochs=1)
    # Not where the trainer goes on from there: resumed, or loaded, or its own checkpoints.
    await checkpointing_trainer(tmp_path).fit(batches, epochs=3, resume="latest")
    loaded = checkpointing_trainer(tmp_path)
    loaded.load_state_dict(torch.load(tmp_path / "epoch0003-step000006.ckpt"))
    await loaded.fit(batches, epochs=4)
    await loaded.fit(batches, epochs=5)


async def test_resume_last_points_to_latest(tmp_path: Any) -> None:
    trainer = checkpointing_trainer(tmp_path)
    with pytest.raises(
        asyncddp.CheckpointError, match=r"no checkpoint at 'last': .* resume='latest'"
    ):
        await trainer.fit(make_batches([4]), resume="last")


async def test_fit_to_epochs_already_complete_warns_and_trains_nothing() -> None:
    # epochs counts from the start of training (Lightning's max_epochs); a second
    # fit(epochs=2) after two epochs returned an empty history without a word, and a
    # script reading result.history[-1] then failed with an IndexError.
    batches = make_batches([4, 4])
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(batches, epochs=2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.warns(UserWarning, match=r"epochs=2.*2 epochs.*epochs=4 trains until 4"):
        result = await trainer.fit(batches, epochs=2)
    assert result.history == ()
    assert (result.epoch, trainer.global_step) == (2, 4)
    for old, new in zip(before, trainer.model.parameters(), strict=True):
        assert torch.equal(old, new)
    result = await trainer.fit(batches, epochs=3)  # one more: no warning
    assert [r.epoch for r in result.history] == [2]


async def test_save_checkpoint_while_a_fit_ends_waits_for_the_end(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A checkpoint asked for while the fit closes its session (its workers are being joined,
    # the fit has not returned) waits for the fit's end and holds its final state, instead of
    # being refused as if the caller had started a second fit.
    closing = anyio.Event()
    close = asyncddp.StepScheduler.aclose

    async def slow_close(self: asyncddp.StepScheduler) -> None:
        closing.set()
        await anyio.sleep(0.2)
        await close(self)

    monkeypatch.setattr(asyncddp.StepScheduler, "aclose", slow_close)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(1), progress_bar=False)
    saved: list[Any] = []

    async def save_when_closing() -> None:
        await closing.wait()
        saved.append(await trainer.save_checkpoint(tmp_path / "end.ckpt"))

    async with anyio.create_task_group() as group:
        group.start_soon(save_when_closing)
        result = await trainer.fit(make_batches([4, 4, 4]), epochs=1)
    state = torch.load(saved[0], weights_only=False)
    assert state["global_step"] == result.global_step == 3
    for name, param in trainer.model.named_parameters():
        assert torch.equal(state["model"][name], param.detach())


async def test_save_checkpoint_while_a_fit_looks_at_checkpoint_dir_leaves_the_fit_running(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fit() looks at checkpoint_dir (on a thread) after it waited for any checkpoint to end:
    # one that began meanwhile made the fit's session refuse to start, "fit() cannot start
    # while save_checkpoint() is already running", in 9 of 12 tries of a script.
    looking, snapshotting = anyio.Event(), anyio.Event()
    armed = False
    check, snapshot = Trainer._check_checkpoint_dir, Trainer._snapshot

    async def slow_check(self: Trainer) -> None:
        await check(self)
        if armed:  # the second fit's: it goes on once the checkpoint's session has begun
            looking.set()
            await snapshotting.wait()

    async def slow_snapshot(self: Trainer) -> dict[str, Any]:
        if armed and not snapshotting.is_set():  # the save_checkpoint's, in its own session
            snapshotting.set()
            await anyio.sleep(0.2)
        return await snapshot(self)

    monkeypatch.setattr(Trainer, "_check_checkpoint_dir", slow_check)
    monkeypatch.setattr(Trainer, "_snapshot", slow_snapshot)
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(1),
        progress_bar=False,
        checkpoint_dir=tmp_path / "run",
    )
    await trainer.fit(make_batches([4, 4, 4]), epochs=1)
    armed = True
    saved: list[Any] = []

    async def save_while_looking() -> None:
        await looking.wait()
        saved.append(await trainer.save_checkpoint(tmp_path / "start.ckpt"))

    async with anyio.create_task_group() as group:
        group.start_soon(save_while_looking)
        result = await trainer.fit(make_batches([4, 4, 4]), epochs=2)
    assert result.global_step == 6
    assert torch.load(saved[0], weights_only=False)["global_step"] == 3  # the fit's start


async def test_a_session_that_cannot_start_leaves_no_session_behind(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The workers fail to start: fit raises, and the trainer is not left "running" (a
    # checkpoint would wait for that session's end for ever; found by review).
    start = asyncddp.StepScheduler.start
    calls = []

    def failing_start(self: asyncddp.StepScheduler) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("no threads today")
        start(self)

    monkeypatch.setattr(asyncddp.StepScheduler, "start", failing_start)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(1), progress_bar=False)
    with pytest.raises(RuntimeError, match="no threads today"):
        await trainer.fit(make_batches([4]), epochs=1)
    with anyio.fail_after(10):
        path = await trainer.save_checkpoint(tmp_path / "after.ckpt")
    assert path.exists()
    result = await trainer.fit(make_batches([4]), epochs=1)
    assert result.global_step == 1


async def test_a_corrupt_checkpoint_raises_a_clear_error(tmp_path: Any) -> None:
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(1), progress_bar=False)
    path = await trainer.save_checkpoint(tmp_path / "good.ckpt")
    data = path.read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(asyncddp.CheckpointError, match="truncated or corrupt"):
        await trainer.fit(make_batches([2]), resume=tmp_path / "cut.ckpt")
    with pytest.raises(asyncddp.CheckpointError, match="no checkpoint at"):
        await trainer.fit(make_batches([2]), resume=tmp_path / "missing.ckpt")
    # Not a file torch.save wrote: said so, without torch's advice on weights_only=False
    # (unsafe, and not asyncddp's to set) pasted in as "truncated or corrupt".
    (tmp_path / "notes.ckpt").write_text("version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(asyncddp.CheckpointError, match=r"not a file torch.save wrote") as caught:
        await trainer.fit(make_batches([2]), resume=tmp_path / "notes.ckpt")
    assert "git lfs pull" in str(caught.value)
    assert "weights_only" not in str(caught.value)
    torch.save({"something": 1}, tmp_path / "other.ckpt")
    with pytest.raises(asyncddp.CheckpointError, match=r"not an asyncddp checkpoint$"):
        await trainer.fit(make_batches([2]), resume=tmp_path / "other.ckpt")
    # A model's own weights, saved by hand, and a path given where a state goes: each says
    # how to load what it is.
    torch.save(trainer.model.state_dict(), tmp_path / "weights.pt")
    with pytest.raises(
        asyncddp.CheckpointError,
        match=r"not an asyncddp checkpoint: it holds a model's weights .* "
        r"trainer\.model\.load_state_dict\(torch\.load\(path\)\)",
    ):
        await trainer.fit(make_batches([2]), resume=tmp_path / "weights.pt")
    with pytest.raises(asyncddp.CheckpointError, match=r"not PosixPath .*fit\(resume=path\)"):
        trainer.load_state_dict(path)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="checkpoint_dir"):
        await trainer.fit(make_batches([2]), resume="latest")


@pytest.mark.parametrize("resume", [None, "latest"])
async def test_a_checkpoint_dir_that_cannot_be_written_fails_before_any_step(
    tmp_path: Any, resume: str | None
) -> None:
    # It failed once the first epoch had trained, with a bare NotADirectoryError.
    (tmp_path / "a-file").write_text("")
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        progress_bar=False,
        checkpoint_dir=tmp_path / "a-file" / "checkpoints",
    )
    with pytest.raises(asyncddp.CheckpointError, match=r"checkpoint_dir .* cannot be written"):
        await trainer.fit(make_batches([4, 4]), epochs=1, resume=resume)
    assert trainer.global_step == 0
    trainer.checkpoint_dir = tmp_path / "checkpoints"
    if resume is not None:
        with pytest.warns(UserWarning, match="no checkpoint in"):
            await trainer.fit(make_batches([4, 4]), epochs=1, resume=resume)
    else:
        await trainer.fit(make_batches([4, 4]), epochs=1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["epoch0001-step000002.ckpt"]


async def test_checkpoint_paths_a_user_would_type_do_what_they_mean(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # where a "~" taken literally would go
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(1),
        progress_bar=False,
        checkpoint_dir="~/runs",  # a folder named "~" in the working directory, before
    )
    await trainer.fit(make_batches([4]), epochs=1)
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["epoch0001-step000001.ckpt"]
    path = await trainer.save_checkpoint("~/now.ckpt")
    assert path == tmp_path / "now.ckpt"
    # A folder where a file is meant: a bare IsADirectoryError, and "no checkpoint at".
    with pytest.raises(asyncddp.CheckpointError, match=r"is a folder, and a checkpoint is a file"):
        await trainer.save_checkpoint(tmp_path / "runs")
    with pytest.raises(asyncddp.CheckpointError, match=r"is a folder, not a checkpoint.*'latest'"):
        await trainer.fit(make_batches([4]), epochs=2, resume="~/runs")
    result = await trainer.fit(make_batches([4]), epochs=2, resume="~/now.ckpt")
    assert result.global_step == 2


class NumpyExtraState(nn.Linear):
    """A module that keeps a NumPy array as extra state (an input normaliser's mean, say)."""

    def __init__(self) -> None:
        super().__init__(FEATURES, 3)
        self.mean = np.zeros(FEATURES)

    def get_extra_state(self) -> Any:
        return {"mean": self.mean}

    def set_extra_state(self, state: Any) -> None:
        self.mean = state["mean"]


async def test_a_checkpoint_that_resuming_cannot_load_warns_as_it_is_written(
    tmp_path: Any,
) -> None:
    # torch.load(weights_only=True) refuses the NumPy array: without the warning, every
    # checkpoint was written without a word and each resume said it was "truncated or corrupt".
    trainer = Trainer(
        NumpyExtraState(),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        progress_bar=False,
        checkpoint_dir=tmp_path,
    )
    with pytest.warns(UserWarning, match=r"holds .*numpy\.ndarray.*resuming from it fails") as seen:
        await trainer.fit(make_batches([4]), epochs=3)
    assert seen[0].filename == __file__  # the user's await, not a line of asyncddp's
    assert len(seen) == 1  # once, not once an epoch
    resumed = Trainer(
        NumpyExtraState(),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        progress_bar=False,
        checkpoint_dir=tmp_path,
    )
    with pytest.raises(
        asyncddp.CheckpointError, match=r"holds .*numpy\.ndarray.*add_safe_globals"
    ) as info:
        await resumed.fit(make_batches([4]), epochs=4, resume="latest")
    assert "corrupt" not in str(info.value)
    assert resumed.global_step == 0
    # Allowed as the error says, the same file resumes.
    with torch.serialization.safe_globals(
        [np.ndarray, np.dtype, type(np.dtype(np.float64)), np._core.multiarray._reconstruct]
    ):
        result = await resumed.fit(make_batches([4]), epochs=4, resume="latest")
    assert result.global_step == 4
    # State a resume loads writes without a word (filterwarnings = error).
    await Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        progress_bar=False,
        checkpoint_dir=tmp_path / "plain",
    ).fit(make_batches([4]), epochs=1)


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (lambda model, batch: None, "the step returned None"),
        (lambda model, batch: 1.5, "the step returned a float"),
        (  # Lightning-style (loss, logs): "the step returned a tuple", no way out said
            lambda model, batch: (F.cross_entropy(model(batch[0]), batch[1]), {"acc": 1.0}),
            r"returned a tuple \(Tensor, dict\); return .* \{'loss': loss, \*\*metrics\}",
        ),
        (
            lambda model, batch: F.cross_entropy(model(batch[0]), batch[1], reduction="none"),
            "has shape",
        ),
        (
            lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]).detach(),
            "does not require grad",
        ),
        (  # "computed under torch.no_grad()?", before
            lambda model, batch: (model(batch[0]).argmax(1) == batch[1]).sum(),
            r"a tensor of torch.int64, which has no gradient \(a count",
        ),
        (
            lambda model, batch: {"accuracy": torch.tensor(1.0)},
            r"a dict without a 'loss' entry \(its keys: 'accuracy'\)",
        ),
        (  # a WorkerFailedError with torch's "grad can be implicitly created only for real"
            lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]) * (1 + 1j),
            r"the step's loss is a complex tensor \(torch.complex64\): return a real loss",
        ),
        (  # a WorkerFailedError, "value cannot be converted to type double without overflow",
            # retried with on_failure="retry"
            lambda model, batch: {
                "loss": F.cross_entropy(model(batch[0]), batch[1]),
                "error": model(batch[0]).mean() * 1j,
            },
            r"the step's metric 'error' is a complex tensor \(torch.complex64\)",
        ),
    ],
)
async def test_a_step_that_returns_no_scalar_loss_is_a_clear_error(step: Any, message: str) -> None:
    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(StepOutputError, match=message):
        await trainer.fit(make_batches([4]), epochs=1)
    assert trainer.global_step == 0


async def test_a_loss_that_one_device_s_share_leaves_constant_names_the_device_and_the_branch() -> (
    None
):
    # A data-dependent branch (if flagged.any(): ...) that one device's share did not take
    # gave a loss with no gradient there, and the error asked about torch.no_grad() alone,
    # naming no device, while a plain loop on the whole batch trained.
    def branchy(model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        flagged = targets == 0
        if flagged.any():
            return F.cross_entropy(model(inputs[flagged]), targets[flagged])
        return F.mse_loss(inputs, inputs)  # nothing to learn: no parameter in it

    inputs = torch.randn(4, FEATURES, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([0, 0, 1, 2])  # cpu#1's half holds no 0
    trainer = Trainer(make_model(), SGD, branchy, devices=cpu_devices(2), progress_bar=False)
    message = r"loss on cpu#1 does not require grad: .* a branch the data decides"
    with pytest.raises(StepOutputError, match=message):
        await trainer.fit([(inputs, targets)], epochs=1)


async def test_a_validation_step_that_returns_no_loss_says_it_is_the_validation_step() -> None:
    def accuracy_only(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        inputs, targets = batch
        return {"accuracy": (model(inputs).argmax(1) == targets).float().mean()}

    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        valid_step=accuracy_only,
        progress_bar=False,
    )
    message = r"the validation step returned a dict without a 'loss' entry .* to validate on"
    with pytest.raises(StepOutputError, match=message):
        await trainer.validate(make_batches([4]))


@pytest.mark.parametrize("first_is_slow", [False, True])
async def test_a_step_that_trains_a_model_from_outside_it_is_a_clear_error(
    first_is_slow: bool,
) -> None:
    # A common slip: the step closes over the user's model instead of using its argument.
    # Every device would then train the first replica, and the others none: no error, wrong
    # numbers. The devices whose replica got no gradient say so. (With the first device still
    # in its forward as the second's backward wrote into its replica, the first said "the step
    # called backward() itself", wrongly, about 1 run in 10.)
    model = make_model()

    def on_device(index: int) -> bool:
        worker = asyncddp.current_worker()
        return first_is_slow and worker is not None and worker.device.index == index

    def step(replica: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        if on_device(0):  # in its forward while the second device's backward runs
            time.sleep(0.3)
        return F.cross_entropy(model(inputs), targets)  # not replica(inputs)

    def slow_last_gradient(param: torch.Tensor) -> None:
        if on_device(1):  # the second device's own check comes after the first's
            time.sleep(1.0)

    model[0].weight.register_post_accumulate_grad_hook(slow_last_gradient)

    trainer = Trainer(model, SGD, step, devices=cpu_devices(2), progress_bar=False)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(StepOutputError, match=r"on cpu#1 got a gradient.*step\(model, batch\)"):
        await trainer.fit(make_batches([4]), epochs=1)
    assert trainer.global_step == 0
    for param, old in zip(trainer.model.parameters(), before, strict=True):
        assert torch.equal(param, old)


class _ScaledBySelf(nn.Module):
    """Keeps a lambda that closes over the module itself (research code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.alpha = nn.Parameter(torch.ones(3))
        self.scale = lambda logits: logits * self.alpha

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.scale(self.body(inputs))  # type: ignore[no-any-return]


def _with_adapter_hook() -> nn.Module:
    """An adapter added by a forward hook made by a lambda that calls another module."""
    model = _WithAdapter()
    adapter = model.adapter
    model.body.register_forward_hook(lambda module, args, out: out + adapter(args[0]))
    return model


class _WithAdapter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = make_model()
        self.adapter = nn.Linear(FEATURES, 3)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.body(inputs)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("build", "parameter"), [(_ScaledBySelf, "'alpha'"), (_with_adapter_hook, "'adapter")]
)
async def test_a_model_keeping_a_function_over_its_own_parameters_is_a_clear_error(
    build: Callable[[], nn.Module], parameter: str
) -> None:
    # copy.deepcopy shares functions with the copy: every device's forward ran the first
    # replica's parameters there, and its backward wrote into that replica's gradients from
    # another thread, racing the first device's own step: silently wrong parameters, different
    # each run (off by 0.06 to 0.59 from a plain loop in a user's trial), no error.
    trainer = Trainer(build(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    message = rf"backward on cpu#1 wrote a gradient into cpu#0's copy .*parameter {parameter}"
    with pytest.raises(StepOutputError, match=message):
        await trainer.fit(make_batches([8, 8]), epochs=1)
    assert trainer.global_step == 0
    for param, old in zip(trainer.model.parameters(), before, strict=True):
        assert torch.equal(param, old)
    # On one device there is nothing to share, and it trains.
    alone = Trainer(build(), SGD, loss_step, devices="cpu", progress_bar=False)
    await alone.fit(make_batches([8, 8]), epochs=1)
    assert alone.global_step == 2


async def test_a_stray_gradient_is_seen_past_another_trainer_s_hooks_on_the_module() -> None:
    # Another trainer given the same module holds hooks on its parameters too: its mark
    # overwrote the stray this trainer's check looks for, and the race went unseen.
    model = _ScaledBySelf()
    first = Trainer(model, SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    second = Trainer(model, SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    await first.validate(make_batches([8]))
    await second.validate(make_batches([8]))  # its hooks come after the first's
    with pytest.raises(StepOutputError, match=r"wrote a gradient into cpu#0's copy"):
        await first.fit(make_batches([8, 8]), epochs=1)


async def test_a_step_that_uses_a_module_of_the_model_from_outside_is_told_so() -> None:
    model = make_model()
    head = model[2]  # kept by the script

    def step(replica: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(head(replica[1](replica[0](inputs))), targets)

    trainer = Trainer(model, SGD, step, devices=cpu_devices(2), progress_bar=False)
    message = r"the step uses a module of trainer\.model from outside it"
    with pytest.raises(StepOutputError, match=message):
        await trainer.fit(make_batches([8, 8]), epochs=1)


async def async_batches() -> Any:
    for batch in make_batches([4]):
        yield batch


def generate_batches() -> Any:
    yield from make_batches([4])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "yielded no batches"),
        ([["a", "b"]], "at least one tensor with a batch dimension"),
        ([(torch.zeros(3, FEATURES), torch.zeros(2))], "share their size along dim 0"),
        # One sample of 6 features and its label, from DataLoader(dataset, batch_size=None).
        (
            torch.utils.data.DataLoader(
                torch.utils.data.TensorDataset(torch.zeros(4, FEATURES), torch.zeros(4, 1)),
                batch_size=None,
            ),
            r"sizes \[6, 1\] .*one sample, not a batch .*DataLoader\(dataset, batch_size=",
        ),
        # fit returned an epoch of train_loss 0.0 from no step at all, and no word.
        (make_batches([0, 0]), r"batches held no items in this epoch \(every batch empty\)"),
        # Its rows were taken for batches: a device failure, "too many values to unpack".
        (torch.zeros(8, FEATURES), r"tensor of shape \(8, 6\): iterated, it gives its rows"),
        # The generator an earlier call used up.
        (iter([]), r"yielded no batches.*an iterator, such as a generator"),
        # TypeError: 'async_generator' object is not iterable, from the loader thread.
        (async_batches(), r"train_data is an async iterable \(async_generator\).*queue\.Queue"),
        # TypeError: 'function' object is not iterable, from the loader thread.
        (generate_batches, r"not iterable: function .*function: pass generate_batches\(\)"),
        (5, r"train_data is not iterable: int 5\. Pass an iterable of batches"),
        # "a batch must hold at least one tensor ...; got str": its keys were taken for batches.
        (
            {"inputs": torch.zeros(8, FEATURES), "targets": torch.zeros(8, 1)},
            r"train_data is a dict, a mapping: iterated, it gives its keys, not batches\. Pass a "
            r"list of batches \(a batch may be a dict of tensors\)",
        ),
        ("batches.pt", r"train_data is a str: iterated, it gives its characters"),
    ],
)
async def test_bad_data_is_a_clear_error(data: Any, message: str) -> None:
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(DataError, match=message):
        await trainer.fit(data, epochs=1)


async def test_an_epoch_whose_steps_count_no_item_is_a_clear_error() -> None:
    def padding_only(model: nn.Module, batch: Any) -> dict[str, Any]:
        return {"loss": loss_step(model, batch), "items": 0}

    trainer = Trainer(make_model(), SGD, padding_only, progress_bar=False)
    with pytest.raises(DataError, match=r"no items in this epoch \(the step's 'items' were all 0"):
        await trainer.fit(make_batches([4, 4]), epochs=1)
    assert trainer.global_step == 0


@pytest.mark.parametrize("where", ["train_data", "valid_data"])
async def test_a_list_of_data_loaders_is_refused_before_any_step_naming_the_argument(
    where: str,
) -> None:
    # Several evaluation sets, as Lightning and Hugging Face take them: valid_data failed
    # after a whole epoch had trained, with train_data's message ("a batch must hold at least
    # one tensor ...; got DataLoader").
    dataset = torch.utils.data.TensorDataset(
        torch.zeros(8, FEATURES), torch.zeros(8, dtype=torch.long)
    )
    loaders = [torch.utils.data.DataLoader(dataset, batch_size=4) for _ in range(2)]
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    data = {"train_data": make_batches([4]), "valid_data": make_batches([4]), where: loaders}
    hint = "trainer.validate" if where == "valid_data" else "ConcatDataset"
    with pytest.raises(DataError, match=rf"^{where} is a list of 2 DataLoader: .*{hint}"):
        await trainer.fit(data["train_data"], epochs=1, valid_data=data["valid_data"])
    assert trainer.global_step == 0


@pytest.mark.parametrize("where", ["train_data", "valid_data", "validate"])
async def test_an_empty_data_loader_is_refused_before_any_step_with_its_cause(where: str) -> None:
    # drop_last=True with fewer items than batch_size: len(loader) == 0. An empty validation
    # loader was found only once a whole epoch had trained.
    dataset = torch.utils.data.TensorDataset(
        torch.zeros(10, FEATURES), torch.zeros(10, dtype=torch.long)
    )
    empty = torch.utils.data.DataLoader(dataset, batch_size=16, drop_last=True)
    steps: list[int] = []

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        steps.append(1)
        return loss_step(model, batch)

    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(2), progress_bar=False)
    calls = {
        "train_data": lambda: trainer.fit(empty, epochs=1),
        "valid_data": lambda: trainer.fit(make_batches([4, 4]), epochs=1, valid_data=empty),
        "validate": lambda: trainer.validate(empty),
    }
    with pytest.raises(DataError, match=r"10 items, fewer than batch_size=16, and drop_last=True"):
        await calls[where]()
    assert steps == []
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    "targets",
    [
        pytest.param(torch.zeros(8, dtype=torch.long), id="labels"),  # a sample passes for a batch
        pytest.param(torch.zeros(8, 1), id="columns"),  # a sample's tensors differ in dim 0
    ],
)
async def test_a_dataset_given_for_batches_is_a_clear_error(targets: torch.Tensor) -> None:
    # A common slip: the Dataset itself instead of a DataLoader over it. Its items are single
    # samples: features and a class label would pass for a batch of FEATURES items.
    dataset = torch.utils.data.TensorDataset(torch.zeros(8, FEATURES), targets)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    pattern = r"train_data is a TensorDataset.*DataLoader\(train_data, batch_size=\.\.\.\)"
    with pytest.raises(DataError, match=pattern):
        await trainer.fit(dataset, epochs=1)
    with pytest.raises(DataError, match=r"valid_data is a TensorDataset.*DataLoader\(valid_data"):
        await trainer.fit(make_batches([4]), valid_data=dataset, epochs=1)
    with pytest.raises(DataError, match=r"data is a TensorDataset.*DataLoader\(data, batch"):
        await trainer.validate(dataset)
    with pytest.raises(DataError, match=r"^data yielded no items"):
        await trainer.validate([])
    assert trainer.global_step == 0


async def test_a_dataset_that_iterates_batches_itself_is_taken_as_it_is() -> None:
    # A Dataset subclass with an __iter__ of its own (a common way to stream batches) yields
    # what its __iter__ yields: batches, trained on as they are.
    class Batches(torch.utils.data.Dataset[Any]):
        def __init__(self) -> None:
            self.batches = make_batches([4, 4])

        def __getitem__(self, index: int) -> Any:
            return self.batches[index]

        def __iter__(self) -> Iterator[Any]:
            return iter(self.batches)

    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    result = await trainer.fit(Batches(), epochs=1)
    assert result.history[-1].items == 8


async def test_an_iterable_dataset_of_samples_gets_a_hint() -> None:
    # An IterableDataset may yield batches, and is taken as it is; when its items turn out to
    # be samples whose tensors differ in dim 0, the error says what was likely meant.
    class Samples(torch.utils.data.IterableDataset[Any]):
        def __iter__(self) -> Iterator[Any]:
            for _ in range(4):
                yield torch.zeros(FEATURES), torch.zeros(1)

    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(DataError, match=r"dim 0.*train_data is a Samples, a Dataset: if its"):
        await trainer.fit(Samples(), epochs=1)
    with pytest.raises(DataError, match=r"dim 0.*\. data is a Samples, a Dataset: if its"):
        await trainer.validate(Samples())


async def test_a_dataloader_without_batching_takes_a_datasets_items_as_batches() -> None:
    # The way out that the Dataset error names: batch_size=None hands over each item as it is.
    batches = make_batches([4, 4])
    inputs, targets = (torch.stack([batch[i] for batch in batches]) for i in range(2))
    dataset = torch.utils.data.TensorDataset(inputs, targets)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    result = await trainer.fit(loader, epochs=1)
    assert result.history[-1].items == 8


async def test_a_constant_loss_that_requires_grad_is_not_taken_for_another_models() -> None:
    # A step may return a constant (a leaf that requires grad) for a batch with nothing to
    # learn, as a plain loop allows: it comes from no model, so no "other model" error.
    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        if not batch[0].any():  # the blank batches
            return torch.zeros((), requires_grad=True)
        return loss_step(model, batch)

    batches = make_batches([4, 4, 4, 4])
    for blank in batches[::2]:
        blank[0].zero_()
    for options in ({}, {"accumulate_grad_batches": 2}):
        trainer = Trainer(
            make_model(), SGD, step, devices=cpu_devices(2), progress_bar=False, **options
        )
        result = await trainer.fit(batches, epochs=1)
        assert result.global_step == 4 // options.get("accumulate_grad_batches", 1)


async def test_an_iterator_for_more_than_one_epoch_is_refused_before_any_work() -> None:
    batches = make_batches([4, 4])
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(DataError, match=r"train_data is an iterator \(generator\).* 2 epochs"):
        await trainer.fit((batch for batch in batches), epochs=2)
    with pytest.raises(DataError, match=r"valid_data is an iterator \(list_iterator\)"):
        await trainer.fit(batches, epochs=2, valid_data=iter(batches))
    assert trainer.global_step == 0
    # For one epoch, or the last one, an iterator is read once: that is fine.
    await trainer.fit((batch for batch in batches), epochs=1, valid_data=iter(batches))
    await trainer.fit(iter(batches), epochs=2)
    assert trainer.global_step == 4


@pytest.mark.parametrize("devices", [["cpu", "cuda:0"], ["cuda:0", "cpu#1"]])
def test_a_trainer_on_gpus_and_the_cpu_at_once_is_refused(
    monkeypatch: pytest.MonkeyPatch, devices: list[str]
) -> None:
    # Measured on an H200: under AdamW a CPU and a GPU replica ended 3e-8 apart (their
    # optimizer kernels round differently), where replicas must stay bitwise identical.
    monkeypatch.setattr(asyncddp._devices, "_cuda_device_count", lambda: 1)
    with pytest.raises(asyncddp.DeviceError, match=r"must be of one kind.*mix cpu and cuda"):
        Trainer(make_model(), ADAMW, loss_step, devices=devices, progress_bar=False)


@pytest.mark.parametrize(("devices", "accumulate", "expected"), [(1, 1, 6), (1, 2, 3), (2, 1, 0)])
async def test_only_a_lone_devices_optimizer_steps_leave_its_stream_running(
    monkeypatch: pytest.MonkeyPatch, devices: int, accumulate: int, expected: int
) -> None:
    # On a GPU such a job reports before its kernels end (the next job of the same stream runs
    # behind them); with several devices another stream reads each replica, so never then,
    # nor for any job but a step's last (fused) one: validation, checkpoints and the
    # session's end wait for the stream.
    left: list[tuple[str, str | None]] = []

    def record() -> None:
        ctx = asyncddp.current_worker()
        assert ctx is not None, "called outside a job"
        # Once the optimizer step is taken (only the kernels of a step may be left running).
        assert trainer._replicas[0].stepped_at == trainer._apply_id
        left.append((ctx.device.name, ctx.phase))

    monkeypatch.setattr(asyncddp._jobs, "leave_stream_running", record)
    batches = make_batches([8] * 6)
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(devices),
        accumulate_grad_batches=accumulate,
        split_batches=True,
        progress_bar=False,
    )
    await trainer.fit(batches, epochs=1, valid_data=batches[:2])
    assert left == [("cpu#0", "train")] * expected


@pytest.mark.parametrize("fails", [None, "wait", "step"])
async def test_a_session_waits_for_the_streams_left_running_then_closes(
    monkeypatch: pytest.MonkeyPatch, fails: str | None
) -> None:
    calls: list[str] = []
    finish, close = asyncddp.StepScheduler._finish_stream_work, asyncddp.StepScheduler.aclose

    async def finish_stream_work(self: asyncddp.StepScheduler, **details: Any) -> None:
        calls.append("finish")
        await finish(self, **details)
        if fails == "wait":
            raise RuntimeError("an asynchronous CUDA error, say")

    async def aclose(self: asyncddp.StepScheduler) -> None:
        calls.append("close")
        await close(self)

    monkeypatch.setattr(asyncddp.StepScheduler, "_finish_stream_work", finish_stream_work)
    monkeypatch.setattr(asyncddp.StepScheduler, "aclose", aclose)
    step = loss_step
    if fails == "step":
        step = asyncddp.testing.failing_step(loss_step, device=0, at=1)
    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(1), progress_bar=False)
    expected: Any = contextlib.nullcontext()  # raised, once the workers are closed:
    if fails == "wait":
        expected = pytest.raises(RuntimeError, match="an asynchronous CUDA error")
    elif fails == "step":
        expected = pytest.raises(WorkerFailedError, match="injected failure")
    with expected:
        await trainer.fit(make_batches([8, 8]), epochs=1)
    # A failing session skips the wait: closing bounds it (drain_timeout).
    assert calls == (["close"] if fails == "step" else ["finish", "close"])
    assert asyncddp.testing.asyncddp_threads() == []


def test_bad_configuration_fails_at_construction() -> None:
    frozen = make_model()
    frozen.requires_grad_(False)
    with pytest.raises(ConfigurationError, match="no trainable parameters"):
        Trainer(frozen, SGD, loss_step, devices=cpu_devices(1))
    model = make_model()
    with pytest.raises(ConfigurationError, match="factory"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_step)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="accumulate_grad_batches"):
        Trainer(model, SGD, loss_step, accumulate_grad_batches=0)
    with pytest.raises(ValueError, match="unknown precision"):
        Trainer(model, SGD, loss_step, precision="fp8")
    with pytest.raises(ConfigurationError, match=r"must be a torch\.nn\.Module"):
        Trainer("model", SGD, loss_step)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="'raise', 'retry' or 'drop', not 'skip'"):
        Trainer(model, SGD, loss_step, on_failure="skip")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="'epoch' or 'step', not 'batch'"):
        Trainer(model, SGD, loss_step, lr_scheduler_interval="batch")  # type: ignore[arg-type]


class KeepsAnOutput(nn.Module):
    """Keeps a tensor autograd made (an output of its own layer) as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(FEATURES, 3)
        self.last = self.layer(torch.ones(1, FEATURES))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.layer(inputs)


async def test_a_model_that_cannot_be_copied_is_a_configuration_error_saying_why() -> None:
    # It was the second device's WorkerFailedError in "phase setup", as if the device failed.
    trainer = Trainer(KeepsAnOutput(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(ConfigurationError, match=r"cannot be copied .* keep it \.detach\(\)ed"):
        await trainer.fit(make_batches([4]), epochs=1)
    trainer.model.last = trainer.model.last.detach()
    result = await trainer.fit(make_batches([4]), epochs=1)
    assert result.global_step == 1


class KeepsAView(nn.Module):
    """Keeps a view of its weight, made in __init__ under grad, and trains through it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, FEATURES))
        self.w_t = self.weight.t()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs @ self.w_t


async def test_a_view_of_a_parameter_kept_as_an_attribute_is_refused_not_copied_detached() -> None:
    # Copied detached, the view was a constant on the other devices: they sent no gradient
    # through it, and 2 devices ended 0.42 from one, without a word (from a review).
    trainer = Trainer(KeepsAView(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(
        ConfigurationError,
        match=r"cannot be copied .*self\.w_t = self\.weight\.t\(\): make it in forward",
    ):
        await trainer.fit(make_batches([4]), epochs=1)


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_lazy_module_not_run_yet_is_a_configuration_error(devices: int) -> None:
    model = nn.Sequential(nn.LazyLinear(3))
    trainer = Trainer(model, SGD, loss_step, devices=cpu_devices(devices), progress_bar=False)
    with pytest.raises(ConfigurationError, match=r"0\.weight, 0\.bias: a lazy module.*forward"):
        await trainer.fit(make_batches([4]), epochs=1)
    # state_dict() before the first fit builds the optimizer's fresh state: it raised torch's
    # "Attempted to use an uninitialized parameter" ValueError, with no word of what to do.
    with pytest.raises(ConfigurationError, match=r"0\.weight, 0\.bias: a lazy module.*forward"):
        trainer.state_dict()
    model(make_batches([1])[0][0])  # as the error says
    start = trainer.state_dict()
    result = await trainer.fit(make_batches([4]), epochs=1)
    assert result.global_step == 1
    trainer.load_state_dict(start)
    assert trainer.global_step == 0


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_model_on_the_meta_device_is_a_configuration_error_that_says_how_to_fill_it(
    devices: int,
) -> None:
    # It was a WorkerFailedError in "phase setup" with torch's "Cannot copy out of meta
    # tensor" (retried with on_failure="retry"), and state_dict() a bare NotImplementedError.
    with torch.device("meta"):
        model = make_model()
    trainer = Trainer(model, SGD, loss_step, devices=cpu_devices(devices), progress_bar=False)
    with pytest.raises(ConfigurationError, match=r"meta device.*0\.weight, 0\.bias, 2\.weight"):
        await trainer.fit(make_batches([4]), epochs=1)
    with pytest.raises(ConfigurationError, match=r"to_empty\(device='cpu'\) then"):
        trainer.state_dict()
    model.to_empty(device="cpu")  # as the error says
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    assert (await trainer.fit(make_batches([4]), epochs=1)).global_step == 1


class RefilledBuffer:
    """A loader that fills the same tensors for every batch (as ring-buffer and pinned-staging
    loaders do): a batch is good until the next ``next()``."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        inputs, targets = (torch.empty_like(t) for t in self.batches[0])
        for batch_inputs, batch_targets in self.batches:
            inputs.copy_(batch_inputs)
            targets.copy_(batch_targets)
            yield inputs, targets


@pytest.mark.parametrize("accumulate", [1, 2])
async def test_prefetch_0_reads_a_batch_only_once_the_step_before_is_done(accumulate: int) -> None:
    # Read ahead, the next batch overwrote the one being trained on: samples were lost and
    # others trained on twice (65 of 80 seen), with no error, and prefetch=0 was refused.
    batches = make_batches([8] * 8)
    expected = make_model()
    optimizer = SGD(expected.parameters())
    for start in range(0, len(batches), accumulate):
        optimizer.zero_grad()
        window = batches[start : start + accumulate]
        inputs, targets = (torch.cat(parts) for parts in zip(*window, strict=True))
        F.cross_entropy(expected(inputs), targets).backward()
        optimizer.step()
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        progress_bar=False,
        prefetch=0,
        accumulate_grad_batches=accumulate,
    )
    await trainer.fit(RefilledBuffer(batches), epochs=1)
    assert_close(trainer.model, expected)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("accumulate_grad_batches", "2"),
        ("accumulate_grad_batches", 1.5),
        ("accumulate_grad_batches", None),
        ("gradient_clip_val", "1"),
        ("gradient_clip_val", float("nan")),
        ("step_timeout", "5"),
        ("step_timeout", 0),
        ("max_retries", None),
        ("max_retries", 1.5),
        ("prefetch", None),
        ("prefetch", 1.5),
        ("prefetch", -1),
        ("threads_per_worker", "2"),
        ("threads_per_worker", 1.5),
        ("threads_per_worker", 2**31),  # more than torch.set_num_threads takes
        ("threads_per_worker", True),
        ("split_batches", "no"),
        ("atomic_steps", 2),
        ("check_finite", "yes"),
        ("progress_bar", "on"),
        ("pin_memory", "no"),
        ("checkpoint_dir", 5),
        ("valid_step", 5),
    ],
)
def test_a_wrong_type_or_value_of_an_option_is_a_configuration_error_naming_it(
    option: str, value: Any
) -> None:
    with pytest.raises(ConfigurationError, match=option):
        Trainer(make_model(), SGD, loss_step, devices=cpu_devices(1), **{option: value})


async def test_a_checkpoint_path_of_the_wrong_type_is_a_configuration_error_naming_it(
    tmp_path: Any,
) -> None:
    # fit(resume=5) and save_checkpoint(5) raised pathlib's bare TypeError ("expected str,
    # bytes or os.PathLike object, not int"), naming neither.
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(1), progress_bar=False)
    with pytest.raises(ConfigurationError, match="resume must be a path"):
        await trainer.fit(make_batches([4]), epochs=1, resume=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="path must be a path"):
        await trainer.save_checkpoint(5)  # type: ignore[arg-type]
    await trainer.fit(make_batches([4]), epochs=1)  # the trainer still works
    assert (await trainer.save_checkpoint(tmp_path / "a.ckpt")).exists()


def test_a_subclass_may_name_checkpoint_dir_in_its_class_body(tmp_path: Any) -> None:
    # A class attribute of that name hides the property: building one failed with an
    # AttributeError ('_checkpoint_dir') once checkpoint_dir became a property.
    class Mine(Trainer):
        checkpoint_dir = None

    mine = Mine(make_model(), SGD, loss_step, devices=cpu_devices(1), checkpoint_dir=tmp_path)
    assert mine.precision == "32"
    numbered = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(1), precision=16)
    assert numbered.precision == "16"  # Lightning's number, as its name


async def test_step_timeout_does_not_bound_building_the_replicas() -> None:
    # The first optimizer a process builds takes about a second (torch imports
    # torch._dynamo): an earlier version timed the build as a step and failed the first fit.
    def slow_sgd(params: Any) -> torch.optim.Optimizer:
        time.sleep(0.5)
        return SGD(params)

    trainer = Trainer(
        make_model(),
        slow_sgd,
        loss_step,
        devices=cpu_devices(2),
        step_timeout=0.2,
        progress_bar=False,
    )
    result = await trainer.fit(make_batches([4, 4]), epochs=1)
    assert result.global_step == 2


async def test_step_timeout_does_not_bound_copying_the_model_in_as_a_fit_starts() -> None:
    # Copying the model into the replicas as a fit starts was timed as a step: a big model's
    # copy failed the fit with a WorkerTimeoutError in phase "setup", where the docs say that
    # the set-up of a fit is not timed.
    class SlowToCopy(nn.Sequential):
        def get_extra_state(self) -> Any:
            return {}

        def set_extra_state(self, state: Any) -> None:
            time.sleep(0.5)  # a big model's copy

    model = SlowToCopy(make_model())
    trainer = Trainer(model, SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(make_batches([4, 4]), epochs=1)
    trainer.step_timeout = 0.2
    result = await trainer.fit(make_batches([4, 4]), epochs=2)  # copies the model in again
    assert result.global_step == 4


def test_numpy_numbers_infinity_and_0_or_1_flags_are_taken_as_python_values() -> None:
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(1),
        accumulate_grad_batches=np.int64(2),
        gradient_clip_val=math.inf,  # the norm, unclipped
        step_timeout=np.float32(5.0),
        prefetch=np.int32(3),
        threads_per_worker=np.int64(1),
        split_batches=np.bool_(True),
        check_finite=1,
    )
    assert (trainer.accumulate_grad_batches, trainer.prefetch, trainer.threads_per_worker) == (
        2,
        3,
        1,
    )
    assert type(trainer.accumulate_grad_batches) is int
    assert (trainer.gradient_clip_val, trainer.step_timeout) == (math.inf, 5.0)
    unlimited = Trainer(make_model(), SGD, loss_step, step_timeout=math.inf)
    assert unlimited.step_timeout is None  # no limit, as None (the fused step needs None)
    assert trainer.split_batches is True
    assert trainer.check_finite is True


@pytest.mark.parametrize("epochs", [0, -1, 1.5, True, np.int64(0), np.bool_(True)])
async def test_epochs_must_be_positive(epochs: Any) -> None:
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(1), progress_bar=False)
    with pytest.raises(ConfigurationError, match="epochs"):
        await trainer.fit(make_batches([2]), epochs=epochs)


async def test_epochs_may_be_a_numpy_integer() -> None:
    # Refused, as "epochs must be an int >= 1, got np.int64(2)": a sweep's from an array.
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(1), progress_bar=False)
    result = await trainer.fit(make_batches([2]), epochs=np.int64(2))
    assert (result.epoch, type(result.epoch)) == (2, int)


def _iter(batches: list[Any]) -> Iterator[Any]:
    yield from batches


async def test_an_iterator_is_not_refused_where_nothing_is_left_to_read_or_it_was_not_read(
    tmp_path: Any,
) -> None:
    batches = make_batches([4] * 6)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    await fit_until_stopped(trainer, batches, epochs=1, at_step=1)  # a list: mid-epoch now
    fresh = _iter(batches)
    with pytest.raises(DataError, match="Dataset"):  # refused before anything reads train_data
        await trainer.fit(fresh, epochs=1, valid_data=torch.utils.data.TensorDataset(batches[0][0]))
    await trainer.fit(fresh, epochs=1)  # not read: it continues the epoch
    assert trainer.global_step == 6
    # Every batch of the epoch trained, then validation raised: finishing the epoch reads no
    # training data, so the same, used-up iterator is fine (for that epoch alone).
    broken = {"validation": True}

    def valid_step(model: nn.Module, batch: Any) -> torch.Tensor:
        if broken["validation"]:
            raise RuntimeError("validation broke")
        return loss_step(model, batch)

    other = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        valid_step=valid_step,
        progress_bar=False,
    )
    data = iter(batches)
    with pytest.raises(WorkerFailedError):
        await other.fit(data, epochs=1, valid_data=batches)
    assert other.global_step == 6  # every batch trained; the epoch is not closed
    assert other.epoch == 0
    broken["validation"] = False
    with pytest.raises(DataError, match="the next epoch reads train_data"):
        await other.fit(data, epochs=2, valid_data=batches)  # epoch 1 would read it again
    result = await other.fit(data, epochs=1, valid_data=batches)
    assert result.epoch == 1


@pytest.mark.parametrize("make", [_iter, iter], ids=["generator", "list_iterator"])
async def test_continuing_an_epoch_with_an_iterator_read_before_is_refused(
    make: Callable[[list[Any]], Iterator[Any]],
) -> None:
    # Continuing reads the data from its start and skips what was trained on: an iterator
    # that a stopped fit read (ahead of where it stopped, too) would lose batches silently.
    batches = make_batches([4] * 10)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    data = make(batches)
    result = await fit_until_stopped(trainer, data, epochs=1, at_step=2)
    assert result.stopped
    done = trainer.global_step
    with pytest.raises(DataError, match=r"iterator .* that was read before"):
        await trainer.fit(data, epochs=1)
    assert trainer.global_step == done  # nothing trained, nothing skipped
    # A new iterator over the whole epoch continues it exactly.
    await trainer.fit(make(batches), epochs=1)
    assert trainer.global_step == 10
    assert_close(trainer.model, reference(batches, 1, SGD))


# -- reading the data ----------------------------------------------------------------------------


def _threads_seen_by(step: Callable[..., Any], seen: list[set[str]]) -> Callable[..., Any]:
    def recording(model: nn.Module, batch: Any) -> Any:
        seen.append({thread.name for thread in threading.enumerate()})
        return step(model, batch)

    return recording


class _Reiterable:
    """Batches given by a generator made anew by each iter(), as a dataset object would."""

    def __init__(self, batches: list[Any], on_next: Callable[[], None] = lambda: None) -> None:
        self.batches = batches
        self.on_next = on_next
        self.threads: set[str] = set()

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            self.on_next()
            self.threads.add(threading.current_thread().name)
            yield batch


async def test_batches_in_a_list_are_read_on_the_event_loop_and_others_on_a_loader_thread() -> None:
    # A list holds its batches already: reading it cannot block, so no loader thread wakes for
    # it each step. Any other iterable (a DataLoader, a generator) is read on a thread.
    seen: list[set[str]] = []
    step = _threads_seen_by(loss_step, seen)
    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(make_batches([4, 4, 4, 4]), epochs=1)
    assert seen
    assert all("asyncddp-loader" not in names for names in seen)
    seen.clear()
    data = _Reiterable(make_batches([4, 4, 4, 4]))
    await trainer.fit(data, epochs=2)
    # The loader thread reads ahead, and ends with the data: it runs beside the first steps.
    assert "asyncddp-loader" in seen[0]
    assert data.threads == {"asyncddp-loader"}


async def test_a_list_whose_iteration_is_its_own_is_read_on_the_loader_thread() -> None:
    # A list subclass may load each item as it iterates: it may block, so it is not read on the
    # event loop.
    threads: set[str] = set()

    class Lazy(list):  # type: ignore[type-arg]
        def __iter__(self) -> Iterator[Any]:
            for batch in super().__iter__():
                threads.add(threading.current_thread().name)
                yield batch

    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(Lazy(make_batches([4, 4])), epochs=1)
    assert threads == {"asyncddp-loader"}


async def test_data_whose_next_blocks_leaves_the_event_loop_free() -> None:
    # Each next() waits until a task on the event loop lets it go: were the data read on the
    # loop's thread, that task could never run (the wait would end at its timeout, and fail).
    released = threading.Event()

    def wait_for_the_loop() -> None:
        assert released.wait(10), "the event loop did not run while the data was read"
        released.clear()

    data = _Reiterable(make_batches([4, 4, 4]), on_next=wait_for_the_loop)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    done = False

    async def release_each_batch() -> None:
        while not done:
            released.set()
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as group:
        group.start_soon(release_each_batch)
        result = await trainer.fit(data, epochs=1)
        done = True
    assert result.history[-1].items == 12


async def test_an_error_raised_by_the_data_says_where_it_came_from() -> None:
    class Broken(_Reiterable):
        def __iter__(self) -> Iterator[Any]:
            yield self.batches[0]
            raise KeyError("sample 7 is missing")

    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(KeyError, match="sample 7") as caught:
        await trainer.fit(Broken(make_batches([4, 4])), epochs=1)
    assert "raised while iterating train_data (on the asyncddp-loader thread)" in (
        caught.value.__notes__
    )


async def test_any_iterable_of_nested_batches_works() -> None:
    batches = make_batches([4, 4])

    def dict_step(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return F.cross_entropy(model(batch["inputs"]["x"]), batch["targets"])

    dict_batches = [{"inputs": {"x": x}, "targets": y, "tag": "train"} for x, y in batches]
    trainer = Trainer(make_model(), SGD, dict_step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(_iter(dict_batches), epochs=1)
    assert_close(trainer.model, reference(batches, 1, SGD))


# -- regressions found in review -----------------------------------------------------------------


class Branchy(nn.Module):
    """A model with a branch that only some batches use (odd-sized ones)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(FEATURES, 3)
        self.extra = nn.Linear(FEATURES, 3)

    def forward(self, inputs: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = self.body(inputs)
        return out + self.extra(inputs) if use_extra else out


def branchy_step(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    inputs, targets, flag = batch
    return F.cross_entropy(model(inputs, bool(flag[0])), targets)


async def test_a_parameter_no_device_used_is_not_stepped_like_in_a_plain_loop() -> None:
    raw = make_batches([6, 6, 6, 6])
    batches = [(x, y, torch.full((len(x),), i % 2 == 0)) for i, (x, y) in enumerate(raw)]
    model = Branchy()
    opt = SGD(model.parameters())
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        branchy_step(model, batch).backward()
        opt.step()  # momentum moves .extra only when it has a .grad
    trainer = Trainer(Branchy(), SGD, branchy_step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(batches, epochs=1)
    assert_close(trainer.model, model)
    assert_replicas_identical(trainer)


async def test_cancelling_during_validation_still_steps_the_epoch_lr_schedule_once() -> None:
    train, valid = make_batches([8, 8]), make_batches([4], seed=5)
    schedule = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    expected = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        lr_scheduler=schedule,
        progress_bar=False,
    )
    await expected.fit(train, epochs=3, valid_data=valid)
    started = threading.Event()

    def slow_valid(model: nn.Module, batch: Any) -> torch.Tensor:
        started.set()
        time.sleep(0.3)
        return loss_step(model, batch)

    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        lr_scheduler=schedule,
        valid_step=slow_valid,
        progress_bar=False,
    )
    with anyio.move_on_after(0.15):
        await trainer.fit(train, epochs=3, valid_data=valid)
    assert started.is_set()
    assert (trainer.epoch, len(trainer.history)) == (0, 0)  # the epoch's end had not happened
    await trainer.fit(train, epochs=3, valid_data=valid)
    assert trainer._replicas[0].lr() == expected._replicas[0].lr()
    assert_close(trainer.model, expected.model)


async def test_a_failure_before_the_backup_is_taken_does_not_roll_that_replica_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncddp import _sync

    batches = make_batches([6, 9, 7, 8])
    expected = reference(batches, 2, SGD)
    original = _sync.StepBackup.capture
    calls = {"n": 0}

    def out_of_memory_once(self: Any, *args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name.endswith("#1]"):
            calls["n"] += 1
            if calls["n"] == 3:
                raise MemoryError("out of memory while taking the backup")
        original(self, *args, **kwargs)

    monkeypatch.setattr(_sync.StepBackup, "capture", out_of_memory_once)
    trainer = Trainer(
        make_model(), SGD, loss_step, devices=cpu_devices(3), on_failure="retry", progress_bar=False
    )
    await trainer.fit(batches, epochs=2)
    assert calls["n"] > 3
    assert_replicas_identical(trainer)
    assert_close(trainer.model, expected)


@pytest.mark.parametrize("fused", [True, False], ids=["one-job", "phases-apart"])
async def test_a_reduce_that_fails_after_writing_into_its_peers_is_retried_exactly(
    monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    # The in-process all-reduce writes each device's summed chunk into every replica; a device
    # that fails once it has done so leaves its peers' gradients summed. The retry must start
    # the step from zeroed gradients on every replica, not add to those sums.
    from asyncddp import _jobs

    batches = make_batches([8, 8, 8, 5])
    expected = reference(batches, 2, SGD)
    reduce = _jobs.all_reduce_chunk
    calls = {"n": 0}

    def fails_once_after_writing(replicas: Any, index: int, *args: Any, **kwargs: Any) -> Any:
        result = reduce(replicas, index, *args, **kwargs)
        if index == 2:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("failed after writing into the peers")
        return result

    monkeypatch.setattr(_jobs, "all_reduce_chunk", fails_once_after_writing)
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(3),
        on_failure="retry",
        progress_bar=False,
        step_timeout=None if fused else 60.0,
    )
    await trainer.fit(batches, epochs=2)
    assert calls["n"] > 3
    assert trainer.global_step == 8
    assert_replicas_identical(trainer)
    assert_close(trainer.model, expected)


class FailAfterUpdateWhenArmed(torch.optim.SGD):
    armed = False

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        result = super().step(closure)
        if FailAfterUpdateWhenArmed.armed:
            FailAfterUpdateWhenArmed.armed = False
            raise RuntimeError("failed after the update")
        return result


async def test_a_change_through_data_between_fits_is_what_a_failed_step_goes_back_to() -> None:
    # The backup of a CPU step is copied ahead, once the step before it has reported; a change
    # made through .data (no version counter moves) between two fits must not be lost when the
    # next fit's first step fails and is retried.
    batches = make_batches([6, 6, 6])
    optimizer = functools.partial(FailAfterUpdateWhenArmed, lr=0.1, momentum=0.9)
    trainers = [
        Trainer(make_model(), optimizer, loss_step, on_failure="retry", progress_bar=False)
        for _ in range(2)
    ]
    for index, trainer in enumerate(trainers):
        await trainer.fit(batches, epochs=1)
        for param in trainer.model.parameters():
            param.data.mul_(0.5)
        FailAfterUpdateWhenArmed.armed = index == 1  # the second trainer's next step fails once
        await trainer.fit(batches, epochs=2)
        assert not FailAfterUpdateWhenArmed.armed
    assert_close(trainers[1].model, trainers[0].model)


class FailBeforeUpdate(torch.optim.SGD):
    fired = False

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if threading.current_thread().name.endswith("#1]") and not FailBeforeUpdate.fired:
            FailBeforeUpdate.fired = True
            raise RuntimeError("failed before the update")
        return super().step(closure)


@pytest.mark.parametrize("policy", ["retry", "drop"])
async def test_without_atomic_steps_a_failed_optimizer_step_is_not_retried(policy: str) -> None:
    FailBeforeUpdate.fired = True  # not yet
    trainer = Trainer(
        make_model(),
        functools.partial(FailBeforeUpdate, lr=0.1),
        loss_step,
        devices=cpu_devices(3),
        atomic_steps=False,
        on_failure=policy,
        progress_bar=False,  # type: ignore[arg-type]
    )
    await trainer.fit(make_batches([6, 6]), epochs=1)
    saved = trainer.state_dict()
    FailBeforeUpdate.fired = False
    with pytest.raises(WorkerFailedError, match="failed before the update"):
        await trainer.fit(make_batches([6, 6]), epochs=2)
    with pytest.raises(asyncddp.AsyncDDPError, match="atomic_steps=False"):
        await trainer.fit(make_batches([6, 6]), epochs=2)
    # As the error says: a saved state loaded into every replica makes the trainer usable again.
    trainer.load_state_dict(saved)
    result = await trainer.fit(make_batches([6, 6]), epochs=2)
    assert result.global_step == 4
    assert_replicas_identical(trainer)


@pytest.mark.parametrize("how", ["off", "turned-off", "retry"])
async def test_without_atomic_steps_a_late_job_s_optimizer_step_is_not_gone_on_from(
    tmp_path: Any, how: str
) -> None:
    # One device runs a step as one job: the job that outlived its step_timeout took its
    # optimizer step on returning, with no copy to undo it with, and the next fit went on
    # from parameters a step ahead of global_step, silently (0.165 from an uninterrupted run,
    # found by a cancellation fuzzer). With atomic_steps turned off between fits, the undo
    # found the backup of an earlier fit's step and put the model a step back; with
    # on_failure="retry", the same fit retried and went on from the late step.
    never = threading.Event()
    hangs = asyncddp.testing.hanging_step(
        loss_step, device=0, release=never, at=1, limit=0.6, times=1
    )
    batches = make_batches([4] * 3)
    trainer = Trainer(
        make_model(),
        SGD,
        hangs,
        devices=cpu_devices(1),
        atomic_steps=how == "turned-off",
        step_timeout=0.2,
        on_failure="retry" if how == "retry" else "raise",
        checkpoint_dir=tmp_path,
        progress_bar=False,
    )
    await trainer.fit(batches[:1], epochs=1)
    trainer.atomic_steps = False
    with pytest.raises(asyncddp.WorkerTimeoutError) as caught:
        await trainer.fit(batches, epochs=2)  # returns once the job has, 0.6 s in
    assert trainer.global_step == 1
    if how == "retry":
        assert "does not retry a step that timed out with atomic_steps=False" in "\n".join(
            caught.value.__notes__
        )
    with pytest.raises(asyncddp.AsyncDDPError, match=r"could not be undone.*atomic_steps=False"):
        await trainer.fit(batches, epochs=2)
    with pytest.raises(asyncddp.AsyncDDPError, match=r"could not be undone"):
        trainer.state_dict()  # it gave that state without a word, to be loaded back
    # The way out the error names: a state saved before, here the epoch's checkpoint. (The
    # hang is spent: no timeout left for a loaded machine's ordinary step to outlive.)
    trainer.step_timeout = None
    await trainer.fit(batches, epochs=2, resume="latest")
    assert trainer.global_step == 4
    expected = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(1), progress_bar=False)
    await expected.fit(batches[:1], epochs=1)
    await expected.fit(batches, epochs=2)
    assert_close(trainer.model, expected.model)


async def test_dropping_a_device_with_whole_batches_per_device_regroups_them() -> None:
    batches = make_batches([5] * 7)

    def broken_on_cpu1(model: nn.Module, batch: Any) -> torch.Tensor:
        if threading.current_thread().name.endswith("cpu#1]"):
            raise RuntimeError("device lost")
        return loss_step(model, batch)

    trainer = Trainer(
        make_model(),
        SGD,
        broken_on_cpu1,
        devices=cpu_devices(3),
        split_batches=False,
        on_failure="drop",
        progress_bar=False,
    )
    with pytest.warns(asyncddp.DeviceDroppedWarning):
        result = await trainer.fit(batches, epochs=1)
    assert result.history[0].items == 35  # every item trained on once
    assert [d.name for d in trainer.devices] == ["cpu#0", "cpu#2"]
    assert_replicas_identical(trainer)


async def test_fit_ends_its_event_streams_when_it_fails_before_training() -> None:
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    stream = trainer.events()
    with pytest.raises(asyncddp.CheckpointError):
        await trainer.fit(make_batches([4]), resume="/nonexistent/asyncddp.ckpt")
    events = [event async for event in stream]
    assert [type(event).__name__ for event in events] == ["FitEnded"]
    assert "CheckpointError" in (events[0].error or "")
    # Also when an option assigned on the trainer is refused: it was checked before the
    # part of fit that publishes FitEnded, and a consumer waited for it for ever.
    trainer.gradient_clip_val = -1.0
    stream = trainer.events()
    with pytest.raises(asyncddp.ConfigurationError, match="gradient_clip_val"):
        await trainer.fit(make_batches([4]), epochs=1)
    with anyio.fail_after(5):
        events = [event async for event in stream]
    assert [type(event).__name__ for event in events] == ["FitEnded"]
    assert "ConfigurationError" in (events[0].error or "")


async def test_a_fit_cancelled_while_it_waits_for_a_checkpoint_ends_its_event_streams(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fit waits for a running save_checkpoint() before it starts; cancelled in that wait,
    # it published no FitEnded, and a consumer of its events waited for ever.
    snapshotting, release = anyio.Event(), anyio.Event()
    snapshot = Trainer._snapshot

    async def held_snapshot(self: Trainer) -> dict[str, Any]:
        snapshotting.set()
        await release.wait()
        return await snapshot(self)

    monkeypatch.setattr(Trainer, "_snapshot", held_snapshot)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(make_batches([4, 4]), epochs=1)
    stream = trainer.events()
    async with anyio.create_task_group() as group:
        group.start_soon(trainer.save_checkpoint, tmp_path / "held.ckpt")
        await snapshotting.wait()
        with anyio.move_on_after(0.2) as scope:  # the fit waits for the checkpoint's end
            await trainer.fit(make_batches([4, 4]), epochs=2)
        assert scope.cancelled_caught
        with anyio.fail_after(5):
            events = [event async for event in stream]
        release.set()
    assert [type(event).__name__ for event in events] == ["FitEnded"]
    assert "Cancel" in (events[0].error or "")
    assert (events[0].epoch, events[0].step, events[0].stopped) == (1, 2, False)
    # The call ended: the trainer takes the next one.
    await trainer.fit(make_batches([4, 4]), epochs=2)
    assert trainer.global_step == 4


async def test_a_state_taken_before_any_fit_loads_into_another_trainer() -> None:
    state = Trainer(
        make_model(seed=3), SGD, loss_step, devices=cpu_devices(2), progress_bar=False
    ).state_dict()
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    trainer.load_state_dict(state)
    await trainer.fit(make_batches([4, 4]), epochs=1)
    assert trainer.global_step == 2


@pytest.mark.parametrize("kind", ["Adam", "Adagrad"])  # Adagrad makes its state as it is built
async def test_a_state_taken_before_any_fit_sets_the_optimizer_and_schedule_back_to_start(
    kind: str,
) -> None:
    # It held no optimizer or LR scheduler (none built yet), so loading it after a fit left
    # Adam's moments and the decayed rate: the next epoch went 0.19 away from a new trainer's.
    def make() -> Trainer:
        return Trainer(
            make_model(),
            functools.partial(getattr(torch.optim, kind), lr=0.05),
            loss_step,
            devices=cpu_devices(2),
            progress_bar=False,
            lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.1),
        )

    batches = make_batches([4, 4, 4])
    fresh = make()
    await fresh.fit(batches, epochs=1)
    trainer = make()
    start = trainer.state_dict()
    assert start["optimizer"] is not None
    assert start["lr_scheduler"]["last_epoch"] == 0
    await trainer.fit(batches, epochs=2)
    trainer.load_state_dict(start)
    await trainer.fit(batches, epochs=1)
    for name, param in fresh.model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], param), name


def batchnorm_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


async def test_batchnorm_buffers_are_undone_with_a_cancelled_step() -> None:
    batches = make_batches([6, 9, 7, 8, 6, 9, 7])
    expected = Trainer(
        batchnorm_model(), SGD, loss_step, devices=cpu_devices(3), progress_bar=False
    )
    await expected.fit(batches, epochs=1)
    calls = {"n": 0}

    def slow_fourth(model: nn.Module, batch: Any) -> torch.Tensor:
        if threading.current_thread().name.endswith("#1]"):
            calls["n"] += 1
            if calls["n"] == 4:
                time.sleep(0.4)
        return loss_step(model, batch)

    trainer = Trainer(
        batchnorm_model(), SGD, slow_fourth, devices=cpu_devices(3), progress_bar=False
    )
    with anyio.move_on_after(0.2):
        await trainer.fit(batches, epochs=1)
    assert trainer.global_step == 3
    assert_replicas_identical(trainer)  # buffers included, right after the cancellation
    await trainer.fit(batches, epochs=1)
    assert_close(trainer.model, expected.model)


async def test_batchnorm_buffers_stay_when_a_device_s_job_is_dropped_before_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The cancellation reaches step 3 while its job on cpu#1 is still queued: that job never
    # runs, so cpu#1 never opened the step. Undoing the step must leave cpu#1's buffers as
    # step 2 left them, not as they were before step 2 (an earlier version restored the
    # buffers its last opened step had saved, losing step 2's BatchNorm update there).
    batches = make_batches([6, 9, 7, 8, 6, 9, 7])
    expected = Trainer(
        batchnorm_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False
    )
    await expected.fit(batches, epochs=1)
    run, held = asyncddp._scheduler._Job.__call__, threading.Event()

    def held_back(job: Any) -> Any:
        if job.index == 1 and job.phase == "train" and job.number == 3:
            held.set()
            time.sleep(0.4)  # still queued, as far as the step is concerned
        return run(job)

    monkeypatch.setattr(asyncddp._scheduler._Job, "__call__", held_back)
    trainer = Trainer(batchnorm_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: trainer.fit(batches, epochs=1))  # type: ignore[arg-type,return-value]
            assert await anyio.to_thread.run_sync(held.wait, 10.0)  # set on a worker thread
            scope.cancel()
    assert trainer.global_step == 3
    assert_replicas_identical(trainer)  # buffers included, right after the cancellation
    monkeypatch.undo()
    await trainer.fit(batches, epochs=1)
    assert_close(trainer.model, expected.model)


async def test_a_checkpoint_asked_for_inside_an_accumulation_window_waits_for_its_end(
    tmp_path: Any,
) -> None:
    # With accumulate_grad_batches=2 an optimizer step is two micro-steps. A checkpoint asked
    # for after step 1 must not catch the next step's first micro-step half done (its
    # BatchNorm update saved, its batch counted as not yet trained): the resumed run would
    # train on that batch again.
    batches = make_batches([6, 9, 7, 8, 6, 9, 7, 8])

    def fresh() -> Trainer:
        return Trainer(
            batchnorm_model(),
            SGD,
            loss_step,
            devices=cpu_devices(2),
            accumulate_grad_batches=2,
            progress_bar=False,
        )

    uninterrupted = fresh()
    await uninterrupted.fit(batches, epochs=1)
    trainer = fresh()
    stream = trainer.events()
    saved: list[Any] = []

    async def checkpoint_after_step_1() -> None:
        async for event in stream:
            if isinstance(event, StepEnded) and event.step == 1:
                saved.append(await trainer.save_checkpoint(tmp_path / "mid.ckpt"))

    async with anyio.create_task_group() as group:
        group.start_soon(checkpoint_after_step_1)
        await trainer.fit(batches, epochs=1)
    assert saved
    resumed = fresh()
    await resumed.fit(batches, epochs=1, resume=saved[0])
    assert resumed.global_step == uninterrupted.global_step == 4
    assert_close(resumed.model, uninterrupted.model)


@pytest.mark.parametrize("devices", [1, 2])
async def test_loading_a_state_into_a_trainer_that_trained_keeps_the_state_s_buffers(
    devices: int,
) -> None:
    # An earlier version undid "whatever was half done" after the load with the buffers each
    # replica had saved before its last step: the loaded BatchNorm statistics were lost.
    batches = make_batches([6, 9, 7, 8])
    trainer = Trainer(
        batchnorm_model(), SGD, loss_step, devices=cpu_devices(devices), progress_bar=False
    )
    await trainer.fit(batches, epochs=1)
    state = trainer.state_dict()
    trainer.load_state_dict(state)
    await trainer.validate(batches)  # a session: the load reaches the replicas
    after = trainer.state_dict()["model"]
    for name, value in state["model"].items():
        assert torch.equal(after[name], value), f"{name} changed"
    assert_replicas_identical(trainer)


async def test_state_dict_before_any_fit_gives_back_what_was_loaded() -> None:
    def fresh() -> Trainer:
        return Trainer(
            make_model(),
            SGD,
            loss_step,
            devices=cpu_devices(2),
            lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=2),
            lr_scheduler_interval="step",
            progress_bar=False,
        )

    batches = make_batches([4] * 6)
    trained = fresh()
    await trained.fit(batches, epochs=1)
    state = trained.state_dict()
    loaded = fresh()
    loaded.load_state_dict(state)
    again = loaded.state_dict()  # no fit yet: the replicas are not built
    assert again["optimizer"] is not None
    assert again["lr_scheduler"] == state["lr_scheduler"]
    relayed = fresh()
    relayed.load_state_dict(again)  # the momentum and the LR schedule go along
    await relayed.fit(batches, epochs=2)
    await trained.fit(batches, epochs=2)
    assert_close(relayed.model, trained.model)


async def test_a_checkpoint_waiting_for_a_window_of_a_fit_cancelled_meanwhile_is_written(
    tmp_path: Any,
) -> None:
    # The checkpoint waits for the optimizer step in progress (two micro-steps here) while the
    # fit waits for a late batch; the fit is cancelled before the step ends. The checkpoint
    # then takes a session of its own, which undoes the half step (an earlier version failed
    # with "no session is open"), and holds the state after step 0.
    batches = make_batches([6, 8, 13, 8, 6, 8, 6, 8])  # 13: shards of 7 and 6, 7 in no other
    in_step_1, release = threading.Event(), threading.Event()

    class LateFourthBatch:
        def __iter__(self) -> Iterator[Any]:
            for index, batch in enumerate(batches):
                if index == 3:  # step 1's second micro-step
                    release.wait(10.0)
                yield batch

    def noting_step_1(model: nn.Module, batch: Any) -> torch.Tensor:
        if len(batch[0]) == 7:  # step 1's first micro-step: its window holds the step lock
            in_step_1.set()
        return loss_step(model, batch)

    def fresh(step: Any = loss_step) -> Trainer:
        return Trainer(
            batchnorm_model(),
            SGD,
            step,
            devices=cpu_devices(2),
            accumulate_grad_batches=2,
            progress_bar=False,
        )

    trainer = fresh(noting_step_1)
    saved: list[Any] = []

    async def checkpoint() -> None:
        saved.append(await trainer.save_checkpoint(tmp_path / "mid.ckpt"))

    try:
        async with anyio.create_task_group() as group:
            with anyio.CancelScope() as fitting:
                async with anyio.create_task_group() as fit_group:
                    fit_group.start_soon(lambda: trainer.fit(LateFourthBatch(), epochs=1))  # type: ignore[arg-type,return-value]
                    assert await anyio.to_thread.run_sync(in_step_1.wait, 10.0)
                    group.start_soon(checkpoint)
                    await anyio.wait_all_tasks_blocked()  # the checkpoint waits for the lock
                    fitting.cancel()
                    release.set()  # the loader's thread: let it end (the fit has stopped)
    finally:
        release.set()
    assert trainer.global_step == 1
    assert asyncddp._checkpoint.load(saved[0])["global_step"] == 1
    resumed, uninterrupted = fresh(), fresh()
    await resumed.fit(batches, epochs=1, resume=saved[0])
    await uninterrupted.fit(batches, epochs=1)
    assert_close(resumed.model, uninterrupted.model)


async def test_a_checkpoint_waiting_for_a_step_that_times_out_holds_the_step_before(
    tmp_path: Any,
) -> None:
    # Step 1's second micro-step times out while a checkpoint waits for the step: the fit's
    # session closes its (threaded) loader before it ends, and an earlier version snapshot
    # the replicas then, with step 1's first micro-step in their BatchNorm statistics.
    batches = make_batches([6, 8, 13, 8, 6, 8, 6, 8])  # 13: shards of 7 and 6
    in_step_1, calls = threading.Event(), {"cpu#1": 0}

    def hangs_in_step_1(model: nn.Module, batch: Any) -> torch.Tensor:
        ctx = asyncddp.current_worker()
        assert ctx is not None
        if ctx.step == 1 and ctx.device.name == "cpu#1" and not in_step_1.is_set():
            calls["cpu#1"] += 1
            if calls["cpu#1"] == 2:  # step 1's second micro-step
                in_step_1.set()
                time.sleep(0.6)
        return loss_step(model, batch)

    class Threaded:  # not a list: read on a loader thread
        def __iter__(self) -> Iterator[Any]:
            return iter(batches)

    trainer = Trainer(
        batchnorm_model(),
        SGD,
        hangs_in_step_1,
        devices=cpu_devices(2),
        accumulate_grad_batches=2,
        step_timeout=0.3,
        progress_bar=False,
    )
    saved: list[Any] = []

    async def fit() -> None:
        with pytest.raises(asyncddp.WorkerTimeoutError):
            await trainer.fit(Threaded(), epochs=1)

    async def checkpoint() -> None:
        assert await anyio.to_thread.run_sync(in_step_1.wait, 10.0)
        saved.append(await trainer.save_checkpoint(tmp_path / "half.ckpt"))

    async with anyio.create_task_group() as group:
        group.start_soon(fit)
        group.start_soon(checkpoint)
    state = asyncddp._checkpoint.load(saved[0])
    assert state["global_step"] == 1
    after_step_0 = Trainer(
        batchnorm_model(),
        SGD,
        loss_step,
        devices=cpu_devices(2),
        accumulate_grad_batches=2,
        progress_bar=False,
    )
    await after_step_0.fit(batches[:2], epochs=1)
    for name, value in after_step_0.model.state_dict().items():
        torch.testing.assert_close(state["model"][name], value, msg=f"{name} differs")


async def test_dropping_a_device_in_an_accumulating_step_keeps_the_steps_coming() -> None:
    # With whole batches a device (split_batches=False), the step's batches are regrouped for
    # the devices left: an earlier version then never closed another window, and the rest of
    # the epoch became one optimizer step.
    batches = make_batches([4] * 12)
    trainer = Trainer(
        make_model(),
        SGD,
        asyncddp.testing.failing_step(loss_step, device=1, at=0),
        devices=cpu_devices(2),
        accumulate_grad_batches=2,
        split_batches=False,
        on_failure="drop",
        progress_bar=False,
    )
    stream = trainer.events()
    with pytest.warns(asyncddp.DeviceDroppedWarning):
        result = await trainer.fit(batches, epochs=1)
    items = [e.items async for e in stream if isinstance(e, StepEnded)]
    assert sum(items) == 48
    assert result.global_step == len(items) >= 5
    assert max(items) <= 12  # at most the regrouped window's three batches


async def test_stop_at_the_last_step_of_an_epoch_still_closes_the_epoch() -> None:
    batches = make_batches([4, 4, 4])
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    result = await fit_until_stopped(trainer, batches, epochs=2, at_step=2)  # the epoch's last
    assert result.stopped
    assert result.epoch == 1
    assert [record.items for record in result.history] == [12]


class Gated:
    """Batches made anew by each iter(), the one at ``index`` (or, at ``len(batches)``, the end)
    held back until ``gate`` opens: a slow disk, or a stream waiting for data. ``waiting`` is
    set once the loader waits there."""

    def __init__(self, batches: list[Any], index: int, gate: threading.Event) -> None:
        self.batches, self.index, self.gate = batches, index, gate
        self.waiting = threading.Event()

    def __iter__(self) -> Iterator[Any]:
        for position in range(len(self.batches) + 1):
            if position == self.index:
                self.waiting.set()
                assert self.gate.wait(60.0)
            if position < len(self.batches):
                yield self.batches[position]


@contextlib.contextmanager
def opened_after(gate: threading.Event, seconds: float) -> Iterator[None]:
    """Open ``gate`` after ``seconds``, so that code that waits for it ends all the same: a test
    that asserts the gate is still shut has then seen it ended without waiting."""
    timer = threading.Timer(seconds, gate.set)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


async def test_stop_returns_at_the_step_boundary_while_the_loader_waits_for_a_batch(
    release: threading.Event,
) -> None:
    # The loader waits at the fourth batch. fit used to read one more batch after a stop (to
    # see whether the epoch was over), and to wait for the loader's next() as it closed.
    batches = make_batches([4] * 6)
    data = Gated(batches, 3, release)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    with opened_after(release, 5.0):
        first = await fit_until_stopped(trainer, data, epochs=1, at_step=0)
        assert not release.is_set()  # fit returned while the loader still waited
    assert first.stopped
    assert 1 <= first.global_step <= 3
    assert first.history == ()  # the epoch is not over: the next fit continues it
    release.set()
    stream = trainer.events()
    rest = await trainer.fit(data, epochs=1)  # the same data: after the loader left behind
    steps = [e.step async for e in stream if isinstance(e, StepEnded)]
    assert steps == list(range(first.global_step, 6))
    assert [record.items for record in rest.history] == [24]
    assert_close(trainer.model, reference(batches, 1, SGD))


async def test_stop_at_the_last_step_with_a_loader_not_yet_at_the_end_closes_the_epoch_next_fit(
    release: threading.Event,
) -> None:
    # A stream that has not said it is over: fit cannot know that the epoch is, and does not
    # wait to learn it. The epoch stays open; the next fit finds no batch left and closes it.
    batches = make_batches([4] * 3)
    data = Gated(batches, 3, release)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    with opened_after(release, 5.0):
        first = await fit_until_stopped(trainer, data, epochs=2, at_step=2)  # the epoch's last
        assert not release.is_set()
    assert first.stopped
    assert (first.epoch, first.global_step, first.history) == (0, 3, ())
    release.set()
    stream = trainer.events()
    rest = await trainer.fit(data, epochs=1)
    events = [e async for e in stream]
    assert not any(isinstance(e, StepEnded) for e in events)  # nothing left to train on
    assert [type(e).__name__ for e in events] == ["FitStarted", "EpochEnded", "FitEnded"]
    assert (rest.epoch, rest.global_step) == (1, 3)
    assert [record.items for record in rest.history] == [12]
    assert_close(trainer.model, reference(batches, 1, SGD))


async def test_cancelling_fit_does_not_wait_for_the_loader_s_next(
    release: threading.Event,
) -> None:
    # The loader waits at the third batch; fit is cancelled while it waits for that batch.
    batches = make_batches([4] * 5)
    data = Gated(batches, 2, release)
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    stream = trainer.events()
    with opened_after(release, 5.0):
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: trainer.fit(data, epochs=1))  # type: ignore[arg-type,return-value]
            async for event in stream:
                if isinstance(event, StepEnded) and event.step == 1:
                    break
            await anyio.to_thread.run_sync(data.waiting.wait, 10.0)
            group.cancel_scope.cancel()
        assert not release.is_set()  # cancelled while the loader still waited
    assert trainer.global_step == 2
    assert_replicas_identical(trainer)
    release.set()
    await trainer.fit(data, epochs=1)  # the same data: after the loader left behind
    assert trainer.global_step == 5
    assert_close(trainer.model, reference(batches, 1, SGD))


async def test_progress_after_a_mid_epoch_resume_reaches_the_total(tmp_path: Any) -> None:
    batches = make_batches([4] * 6)
    first = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    await fit_until_stopped(first, batches, epochs=1, at_step=2)
    path = await first.save_checkpoint(tmp_path / "mid.ckpt")
    resumed = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    resumed_stream = resumed.events()
    result = await resumed.fit(batches, epochs=1, resume=path)
    steps = [e async for e in resumed_stream if isinstance(e, StepEnded)]
    done_before = 4 * first.global_step
    assert steps[0].step == first.global_step
    assert steps[0].progress.items_processed == done_before + 4  # counting on, not from zero
    assert steps[-1].progress.items_processed == steps[-1].progress.items_total == 24
    assert result.history[0].items == 24  # the epoch's record covers every item, both runs
    assert_close(resumed.model, reference(batches, 1, SGD))


async def test_an_empty_batch_is_skipped_and_not_counted() -> None:
    batches = make_batches([4, 0, 4])
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    result = await trainer.fit(batches, epochs=1)
    assert result.global_step == 2
    assert_close(trainer.model, reference([batches[0], batches[2]], 1, SGD))


async def test_a_checkpoint_asked_for_as_fit_starts_waits_for_the_replicas(tmp_path: Any) -> None:
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: trainer.fit(make_batches([4] * 5), epochs=1))  # type: ignore[arg-type,return-value]
        await anyio.lowlevel.checkpoint()
        path = await trainer.save_checkpoint(tmp_path / "early.ckpt")
    assert asyncddp._checkpoint.load(path)["epoch"] in (0, 1)
    assert trainer.global_step == 5


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_checkpoint_waiting_as_a_cancelled_first_fit_starts_is_written(
    tmp_path: Any, devices: int
) -> None:
    # The fit, cancelled as it starts, published its scheduler and then took its step lock;
    # anyio's acquire yields to the loop first in a cancelled scope, and the checkpoint waiting
    # to run took the lock of a trainer with no replicas yet: a WorkerFailedError on cpu#0
    # (phase "checkpoint", an IndexError), found by a cancellation fuzzer.
    trainer = Trainer(
        make_model(), SGD, loss_step, devices=cpu_devices(devices), progress_bar=False
    )
    saved: list[Any] = []

    async def save() -> None:
        saved.append(await trainer.save_checkpoint(tmp_path / "early.ckpt"))

    async with anyio.create_task_group() as group:
        group.start_soon(save)  # runs at the fit's first yield
        with anyio.CancelScope() as scope:
            scope.cancel()
            await trainer.fit(make_batches([4] * 2), epochs=1)
    assert scope.cancelled_caught
    assert asyncddp._checkpoint.load(saved[0])["global_step"] == 0
    await trainer.fit(make_batches([4] * 2), epochs=1)
    assert trainer.global_step == 2


async def test_one_device_unused_parameters_and_cancellation_stay_exact() -> None:
    # One device runs each step as one job: the same guarantees as several devices.
    raw = make_batches([6, 6, 6, 6])
    batches = [(x, y, torch.full((len(x),), i % 2 == 0)) for i, (x, y) in enumerate(raw)]
    model = Branchy()
    opt = SGD(model.parameters())
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        branchy_step(model, batch).backward()
        opt.step()
    trainer = Trainer(Branchy(), SGD, branchy_step, devices=cpu_devices(1), progress_bar=False)
    await trainer.fit(batches, epochs=1)
    assert_close(trainer.model, model)


def test_repr_says_where_training_stands() -> None:
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2))
    assert repr(trainer) == "<Trainer Sequential on cpu#0, cpu#1: epoch 0, step 0>"


@pytest.mark.parametrize("fused", [True, False], ids=["one-job", "phases-apart"])
async def test_an_optimizer_that_writes_grad_in_place_cannot_race_the_reduce(
    monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    # SGD with Nesterov momentum and foreach writes .grad in place during step(); a peer still
    # writing its reduced chunk into that replica must be done by then. Slow one device's
    # reduce down to open the window wide. The phases run as jobs apart with a step_timeout.
    from asyncddp import _jobs

    reduce = _jobs.all_reduce_chunk

    def slow_on_cpu0(replicas: Any, index: int, *args: Any, **kwargs: Any) -> Any:
        if index == 0:
            time.sleep(0.05)
        return reduce(replicas, index, *args, **kwargs)

    monkeypatch.setattr(_jobs, "all_reduce_chunk", slow_on_cpu0)
    nesterov = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True, foreach=True)
    batches = make_batches([8, 8, 8])
    trainer = Trainer(
        make_model(),
        nesterov,
        loss_step,
        devices=cpu_devices(2),
        progress_bar=False,
        step_timeout=None if fused else 60.0,
    )
    await trainer.fit(batches, epochs=1)
    assert_replicas_identical(trainer)
    assert_close(trainer.model, reference(batches, 1, nesterov))


class SlowSGD(torch.optim.SGD):
    """An SGD that updates, says so, then takes a while: a cancellation lands after the update."""

    updated = threading.Event()

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        result = super().step(closure)
        SlowSGD.updated.set()
        time.sleep(0.3)
        return result


def slow_sgd_trainer(devices: int, **options: Any) -> Trainer:
    """A trainer whose optimizer takes a while after its update (:class:`SlowSGD`)."""
    SlowSGD.updated.clear()
    return Trainer(
        make_model(),
        functools.partial(SlowSGD, lr=0.1),
        loss_step,
        devices=cpu_devices(devices),
        progress_bar=False,
        **options,
    )


@pytest.mark.parametrize("atomic_steps", [True, False], ids=["atomic", "not-atomic"])
@pytest.mark.parametrize(
    ("devices", "step_timeout"),
    [(1, None), (2, None), (2, 60.0)],
    ids=["1-device", "2-devices-one-job", "2-devices-phases-apart"],
)
async def test_a_step_cancelled_after_every_device_updated_counts(
    devices: int, step_timeout: float | None, atomic_steps: bool
) -> None:
    # Once every device has taken its optimizer step, a cancellation lets the step count, and
    # training goes on from there (as across ranks): under asyncio and trio, with a backup or
    # without one, whether the phases run as one job a device or as jobs apart.
    # The step is told of as it counts: its StepEnded and its progress came before (they
    # were left out, the cancellation raised first).
    batches = make_batches([4, 4])
    trainer = slow_sgd_trainer(devices, atomic_steps=atomic_steps, step_timeout=step_timeout)
    stream = trainer.events()
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: trainer.fit(batches, epochs=1))  # type: ignore[arg-type,return-value]
        while not SlowSGD.updated.is_set():  # noqa: ASYNC110 (a worker thread sets it)
            await anyio.sleep(0.01)
        group.cancel_scope.cancel()
    assert trainer.global_step == 1
    told = [event async for event in stream if isinstance(event, StepEnded)]
    assert [(event.step, event.progress.items_processed) for event in told] == [(0, 4)]
    assert_replicas_identical(trainer)
    await trainer.fit(batches, epochs=1)
    assert trainer.global_step == 2
    assert_close(trainer.model, reference(batches, 1, functools.partial(torch.optim.SGD, lr=0.1)))


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_plain_task_cancel_after_every_device_updated_counts_the_step() -> None:
    # asyncio's own task.cancel() (not a cancel scope) is delivered through the shielded
    # optimizer step: the step still counts.
    batches = make_batches([4, 4])
    trainer = slow_sgd_trainer(2)
    import asyncio

    task = asyncio.ensure_future(trainer.fit(batches, epochs=1))
    while not SlowSGD.updated.is_set():  # noqa: ASYNC110 (a worker thread sets it)
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert trainer.global_step == 1
    assert_replicas_identical(trainer)


async def test_failures_in_the_optimizer_step_of_two_devices_both_name_that_phase() -> None:
    failing = failing_optimizer(failing_optimizer(SGD, device=1, at=1), device=2, at=1)
    trainer = Trainer(make_model(), failing, loss_step, devices=cpu_devices(3), progress_bar=False)
    with pytest.raises(WorkerFailedError) as info:
        await trainer.fit(make_batches([6, 6, 6]), epochs=1)
    failures = [info.value, *info.value.other_failures]
    assert sorted(f.device.name for f in failures) == ["cpu#1", "cpu#2"]
    assert [f.phase for f in failures] == ["optimizer", "optimizer"]
    assert "phase optimizer" in str(info.value)
    assert trainer.global_step == 1
    assert_replicas_identical(trainer)


def waiting(meeting: Meeting, devices: int) -> tuple[list[threading.Thread], list[str]]:
    """Threads for all but the last of ``devices``, waiting at ``meeting``; what each met."""
    ctx = [WorkerContext(device, None, 0, "train") for device in cpu_devices(devices)]
    outcomes: list[str] = []

    def wait(i: int) -> None:
        try:
            meeting.wait(ctx[i])
            outcomes.append("passed")
        except PeerLeft:
            outcomes.append("left")

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(devices - 1)]
    for thread in threads:
        thread.start()
    while meeting._arrived < devices - 1:  # every one of them waits in the round
        time.sleep(0.0001)
    return threads, outcomes


def test_a_meeting_left_after_a_round_is_complete_releases_that_round() -> None:
    # The last job to arrive completes the round and fails at once: the jobs it released must
    # go on (they all step), even if they have not woken yet when it leaves.
    last = WorkerContext(cpu_devices(3)[2], None, 0, "train")
    for _ in range(200):
        meeting = Meeting(3)
        threads, outcomes = waiting(meeting, 3)
        meeting.wait(last)  # completes the round...
        meeting.leave()  # ...and fails right after
        for thread in threads:
            thread.join(5)
        assert outcomes == ["passed", "passed"]
        with pytest.raises(PeerLeft):  # the next round is broken
            meeting.wait(last)


def test_a_meeting_left_in_a_round_releases_its_waiters() -> None:
    meeting = Meeting(3)
    threads, outcomes = waiting(meeting, 3)
    meeting.leave()
    for thread in threads:
        thread.join(5)
    assert outcomes == ["left", "left"]


@pytest.mark.parametrize("step_timeout", [None, 30.0])
async def test_a_step_on_several_devices_is_one_job_a_device_without_a_step_timeout(
    monkeypatch: pytest.MonkeyPatch, step_timeout: float | None
) -> None:
    # One hand-off a step: forward, backward, reduce and optimizer step in one job a device,
    # meeting between the phases. A step_timeout bounds each phase's job on its own.
    phases: list[str | None] = []
    run = asyncddp.StepScheduler.run

    async def recording(self: Any, fn: Any, shards: Any, **kwargs: Any) -> Any:
        phases.append(kwargs.get("phase"))
        return await run(self, fn, shards, **kwargs)

    monkeypatch.setattr(asyncddp.StepScheduler, "run", recording)
    batches = make_batches([6, 9, 7])
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        devices=cpu_devices(3),
        step_timeout=step_timeout,
        gradient_clip_val=0.5,
        progress_bar=False,
    )
    await trainer.fit(batches, epochs=1)
    steps = [phase for phase in phases if phase in ("train", "reduce", "optimizer")]
    if step_timeout is None:
        assert steps == ["train"] * 3
    else:
        assert steps == ["train", "reduce", "optimizer"] * 3
    assert_close(trainer.model, reference(batches, 1, SGD, clip=0.5))


# -- a step that counts its own items ("items": tokens, say) ---------------------------------------


def token_batches(sizes: list[int], seed: int = 3) -> list[tuple[torch.Tensor, ...]]:
    """Sequences of 5 positions, each item with its own number of valid tokens (0 to 5)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for size in sizes:
        inputs = torch.randn(size, 5, FEATURES, generator=generator)
        targets = torch.randint(0, 3, (size, 5), generator=generator)
        lengths = torch.randint(0, 6, (size,), generator=generator)
        mask = (torch.arange(5) < lengths[:, None]).float()
        out.append((inputs, targets, mask))
    return out


def token_step(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """The mean over the shard's valid tokens, and how many there are."""
    inputs, targets, mask = batch
    losses = F.cross_entropy(model(inputs).transpose(1, 2), targets, reduction="none")
    tokens = mask.sum()
    loss = (losses * mask).sum() / tokens.clamp(min=1)
    hits = ((model(inputs).argmax(-1) == targets).float() * mask).sum() / tokens.clamp(min=1)
    return {"loss": loss, "items": tokens, "accuracy": hits}


def token_reference(windows: list[list[tuple[torch.Tensor, ...]]]) -> tuple[nn.Module, float]:
    """A plain loop: each optimizer step the mean over every valid token of its batches; and
    the epoch's loss, the mean over every token of the steps' losses."""
    model = make_model()
    opt = SGD(model.parameters())
    loss_sum, tokens_sum = 0.0, 0.0
    for window in windows:
        inputs, targets, mask = (torch.cat(parts) for parts in zip(*window, strict=True))
        opt.zero_grad()
        losses = F.cross_entropy(model(inputs).transpose(1, 2), targets, reduction="none")
        loss = (losses * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        loss_sum += float(loss.detach()) * float(mask.sum())
        tokens_sum += float(mask.sum())
    return model, loss_sum / tokens_sum


@pytest.mark.parametrize(
    ("devices", "options"),
    [
        (1, {}),
        (2, {}),  # one job a device a step, the devices meeting
        (3, {}),  # 7 items on 3 devices: uneven shards
        (2, {"step_timeout": 30.0}),  # the phases as jobs apart
        (2, {"accumulate_grad_batches": 2}),
        (1, {"accumulate_grad_batches": 2}),
    ],
    ids=["1-device", "2-devices", "3-devices", "jobs-apart", "accumulate", "1-device-accumulate"],
)
async def test_a_step_that_counts_its_items_is_the_mean_over_all_of_them(
    devices: int, options: dict[str, Any]
) -> None:
    # Each device's loss is the mean over its own valid tokens; the step's must be the mean
    # over every device's tokens, not the mean of the devices' means (what averaging the
    # devices' gradients gives when their token counts differ).
    batches = token_batches([7, 8, 6, 7])
    trainer = Trainer(
        make_model(), SGD, token_step, devices=cpu_devices(devices), progress_bar=False, **options
    )
    stream = trainer.events()
    result = await trainer.fit(batches, epochs=1)
    per_step = options.get("accumulate_grad_batches", 1)
    windows = [batches[i : i + per_step] for i in range(0, len(batches), per_step)]
    expected, loss = token_reference(windows)
    assert_close(trainer.model, expected)
    tokens = int(sum(float(mask.sum()) for _, _, mask in batches))
    record = result.history[0]
    assert record.items == tokens  # the counts the step gave, not the 28 sequences
    assert record.train_loss == pytest.approx(loss, rel=1e-5)
    assert "items" not in record.train_metrics
    steps = [e async for e in stream if isinstance(e, StepEnded)]
    assert steps[-1].progress.items_processed == 28  # progress counts the sequences
    valid = await trainer.validate(batches)
    inputs, targets, mask = (torch.cat(parts) for parts in zip(*batches, strict=True))
    with torch.no_grad():
        losses = F.cross_entropy(expected(inputs).transpose(1, 2), targets, reduction="none")
    assert valid["loss"] == pytest.approx(float((losses * mask).sum() / mask.sum()), rel=1e-5)


@pytest.mark.parametrize("kind", [int, np.int64, np.int32], ids=["int", "np.int64", "np.int32"])
async def test_a_count_of_items_may_be_a_python_or_numpy_integer(kind: Any) -> None:
    # A count made with NumPy (a mask summed as an array, say) counts as the int it holds.
    def step(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        output = token_step(model, batch)
        return {**output, "items": kind(int(output["items"]))}

    batches = token_batches([7, 8, 6, 7])
    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(2), progress_bar=False)
    result = await trainer.fit(batches, epochs=1)
    expected, loss = token_reference([[batch] for batch in batches])
    assert_close(trainer.model, expected)
    assert result.history[0].items == int(sum(float(mask.sum()) for _, _, mask in batches))
    assert result.history[0].train_loss == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize(
    ("devices", "options"),
    [(1, {}), (2, {}), (2, {"step_timeout": 30.0})],
    ids=["1-device", "2-devices", "jobs-apart"],
)
async def test_a_step_whose_tokens_are_all_padding_takes_no_optimizer_step(
    devices: int, options: dict[str, Any]
) -> None:
    # With SGD's momentum, a step taken on zero gradients would still move the parameters.
    batches = token_batches([4, 4, 4])
    batches[1][2].zero_()  # the middle batch: padding only
    trainer = Trainer(
        make_model(), SGD, token_step, devices=cpu_devices(devices), progress_bar=False, **options
    )
    stream = trainer.events()
    result = await trainer.fit(batches, epochs=1)
    assert result.global_step == 2
    expected, _ = token_reference([batches[:1], batches[2:]])
    assert_close(trainer.model, expected)
    steps = [e async for e in stream if isinstance(e, StepEnded)]
    assert [e.progress.items_processed for e in steps] == [4, 12]  # the skipped batch counts
    assert [e.progress.steps for e in steps] == [1, 2]  # as items, not as a step


async def test_a_validation_step_that_counts_items_on_some_batches_only_is_a_clear_error() -> None:
    def first_only(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        output = token_step(model, batch)
        if batch[0].shape[0] != 4:  # the batches of 4 items give a count; the others not
            del output["items"]
        return output

    trainer = Trainer(
        make_model(),
        SGD,
        token_step,
        valid_step=first_only,
        devices=cpu_devices(1),
        progress_bar=False,
    )
    # It said "on some devices and not on others in the same optimizer step": on one device,
    # in a validation.
    with pytest.raises(StepOutputError, match="validation step returned 'items' for some batch"):
        await trainer.validate(token_batches([4, 5]))


async def test_a_device_whose_shard_is_all_padding_adds_nothing_even_if_its_loss_is_nan() -> None:
    # A mean over no token is NaN (0 / 0) on the device whose shard is all padding; the step is
    # the mean over the other device's tokens, and no NaN reaches the gradients or the reports.
    def unclamped(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        inputs, targets, mask = batch
        losses = F.cross_entropy(model(inputs).transpose(1, 2), targets, reduction="none")
        return {"loss": (losses * mask).sum() / mask.sum(), "items": mask.sum()}

    batches = token_batches([4, 4])
    for _, _, mask in batches:
        mask[2:] = 0  # the second half of each batch, device 1's shard: padding only
    for options in ({}, {"step_timeout": 30.0}):
        trainer = Trainer(
            make_model(),
            SGD,
            unclamped,
            devices=cpu_devices(2),
            check_finite=True,
            progress_bar=False,
            **options,
        )
        result = await trainer.fit(batches, epochs=1)
        expected, loss = token_reference([[batch] for batch in batches])
        assert_close(trainer.model, expected)
        assert result.history[0].train_loss == pytest.approx(loss, rel=1e-5)
        # Validation too: it was NaN on two devices (the NaN loss times 0 items), and right
        # on one, where no shard is all padding.
        inputs, targets, mask = (torch.cat(parts) for parts in zip(*batches, strict=True))
        with torch.no_grad():
            losses = F.cross_entropy(
                trainer.model(inputs).transpose(1, 2), targets, reduction="none"
            )
        valid = await trainer.validate(batches)
        assert valid["loss"] == pytest.approx(float((losses * mask).sum() / mask.sum()), rel=1e-5)


async def test_items_on_some_micro_steps_only_is_a_clear_error() -> None:
    calls: dict[int, int] = {}

    def first_only(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        output = token_step(model, batch)
        ctx = asyncddp.current_worker()
        assert ctx is not None
        calls[ctx.device.index] = calls.get(ctx.device.index, 0) + 1
        if calls[ctx.device.index] % 2 == 0:  # a window's second micro-step gives no count
            del output["items"]
        return output

    batches = token_batches([7, 8])
    for devices, options in [(1, {}), (2, {}), (2, {"step_timeout": 30.0})]:
        calls.clear()
        trainer = Trainer(
            make_model(),
            SGD,
            first_only,
            devices=cpu_devices(devices),
            accumulate_grad_batches=2,
            progress_bar=False,
            **options,
        )
        with pytest.raises(
            StepOutputError,
            match=r"'items' for some shares of one optimizer step \(.* the batches accumulated",
        ):
            await trainer.fit(batches, epochs=1)
        assert trainer.global_step == 0


async def test_a_step_that_counts_items_on_some_devices_only_is_a_clear_error() -> None:
    def sometimes(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, Any]:
        output = token_step(model, batch)
        ctx = asyncddp.current_worker()
        if ctx is not None and ctx.device.index == 1:
            del output["items"]
        return output

    for options in ({}, {"step_timeout": 30.0}):
        trainer = Trainer(
            make_model(), SGD, sometimes, devices=cpu_devices(2), progress_bar=False, **options
        )
        with pytest.raises(StepOutputError, match="'items' for some shares of one optimizer step"):
            await trainer.fit(token_batches([4]), epochs=1)
        assert trainer.global_step == 0


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (2.5, "'items' is 2.5;"),
        (-1, "'items' is -1;"),
        (torch.tensor(1.5), r"'items' is 1.5 \(a tensor\)"),
        (torch.ones(2), "'items' is a tensor of shape \\(2,\\)"),
        ("3", "'items' is a str"),
        (True, "'items' is a bool"),
        (np.True_, "'items' is a bool"),
        (torch.tensor(True), r"'items' is a tensor of torch.bool"),  # was taken as 1 item
        (np.float64(3.0), r"'items' is np.float64\(3.0\);"),
    ],
)
async def test_a_count_of_items_that_is_not_a_whole_number_is_a_clear_error(
    items: Any, message: str
) -> None:
    def step(model: nn.Module, batch: Any) -> dict[str, Any]:
        return {"loss": loss_step(model, batch), "items": items}

    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(StepOutputError, match=message):
        await trainer.fit(make_batches([4]), epochs=1)


async def test_fp16_accumulation_weighs_a_small_first_batch_by_the_last_steps_total() -> None:
    # Micro-batches of 1 then 255 items: weighted against the first one's items times the
    # accumulation, each 255-item one came 128 times GradScaler's weight, and 3 steps of 4
    # overflowed. Against the last step's total, only the first step's may.
    trainer = Trainer(
        make_model(),
        SGD,
        loss_step,
        precision="fp16",
        accumulate_grad_batches=2,
        progress_bar=False,
    )
    result = await trainer.fit(make_batches([1, 255] * 6), epochs=1)
    assert result.global_step == 6
    assert trainer._scaler is not None
    assert trainer._scaler.scale >= 2.0**15  # at most the first step skipped


async def test_options_changed_between_calls_are_checked_as_the_next_call_starts(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # accumulate_grad_batches = 0 went unchecked into the epoch: ZeroDivisionError.
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    for name, value, message in [
        ("accumulate_grad_batches", 0, "accumulate_grad_batches must be an int >= 1, got 0"),
        ("on_failure", "ignore", "on_failure must be 'raise', 'retry' or 'drop', not 'ignore'"),
        ("step_timeout", 0, "step_timeout"),
        ("prefetch", 1.5, "prefetch"),
    ]:
        good = getattr(trainer, name)
        setattr(trainer, name, value)
        with pytest.raises(ConfigurationError, match=re.escape(message)):
            await trainer.fit(make_batches([4, 4]), epochs=1)
        with pytest.raises(ConfigurationError, match=re.escape(message)):
            await trainer.validate(make_batches([4]))
        setattr(trainer, name, good)
    assert trainer.global_step == 0
    # Refused as it is assigned: save_checkpoint() checks no options, and it raised a bare
    # TypeError (int / str) after taking the whole state.
    with pytest.raises(ConfigurationError, match=r"checkpoint_dir must be a path .* got 5"):
        trainer.checkpoint_dir = 5  # type: ignore[assignment]
    assert trainer.checkpoint_dir is None
    monkeypatch.setenv("HOME", str(tmp_path))
    trainer.checkpoint_dir = "~/checkpoints"
    await trainer.fit(make_batches([4, 4]), epochs=1)
    assert trainer.checkpoint_dir == tmp_path / "checkpoints"
    assert [p.name for p in trainer.checkpoint_dir.iterdir()] == ["epoch0001-step000002.ckpt"]


def test_precision_cannot_be_changed_on_a_built_trainer() -> None:
    # It was a label only: autocast and the loss scaler are set up as the Trainer is built.
    trainer = Trainer(make_model(), SGD, loss_step, progress_bar=False)
    with pytest.raises(
        AttributeError, match=r"precision is fixed .* Trainer\(\.\.\., precision='bf16'\)"
    ):
        trainer.precision = "bf16"
    assert trainer.precision == "32"


def test_device_spec_is_a_type_a_user_s_annotations_can_use() -> None:
    # It was a string: typing.get_type_hints() of a function annotated with it raised
    # NameError ('torch' is not defined).
    import typing

    def make(devices: asyncddp.DeviceSpec = "auto") -> None: ...

    hints = typing.get_type_hints(make)
    assert torch.device in typing.get_args(hints["devices"])


def test_an_event_stream_s_maxlen_must_be_a_count() -> None:
    # "5" raised TypeError: '<' not supported between instances of 'str' and 'int'.
    trainer = Trainer(make_model(), SGD, loss_step, progress_bar=False)
    for value in ("5", 0, 2.5):
        with pytest.raises(ConfigurationError, match=r"^maxlen must be an int >= 1, got"):
            trainer.events(value)  # type: ignore[arg-type]


async def test_a_checkpoint_or_state_from_another_thread_s_loop_during_a_fit_is_refused(
    tmp_path: Any,
) -> None:
    # The trainer's step lock belongs to the fit's event loop: save_checkpoint() awaited in
    # another thread's loop waited on it, and both loops stood still for good; state_dict()
    # from there read the replicas in the middle of a step.
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    batches = make_batches([2] * 4)
    errors: list[BaseException] = []

    def from_another_thread() -> None:
        async def save() -> None:
            await trainer.save_checkpoint(tmp_path / "other.ckpt")

        for call in (lambda: asyncio.run(save()), trainer.state_dict):
            try:
                call()
            except BaseException as error:  # looked at below
                errors.append(error)

    async def meanwhile() -> None:
        async for event in trainer.events():
            if isinstance(event, asyncddp.StepEnded) and event.step == 2:
                # Given up on if it never returns (what it did): the test fails, not hangs.
                await anyio.to_thread.run_sync(from_another_thread, abandon_on_cancel=True)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(meanwhile)
            await trainer.fit(batches, epochs=3)
    assert len(errors) == 2
    for error in errors:
        assert isinstance(error, ConfigurationError)
        assert "another thread than the one whose event loop runs fit()" in str(error)
    assert trainer.global_step == 12
    assert not (tmp_path / "other.ckpt").exists()
    trainer.state_dict()  # between calls, from anywhere


def _fit_left_pending(trainer: Trainer, batches: Any) -> tuple[asyncio.AbstractEventLoop, Any]:
    """A fit left pending in a loop that stopped running mid-fit (as a Ctrl-C out of
    run_until_complete leaves it: IPython's terminal, a hand-made loop): the loop, the task."""
    loop = asyncio.new_event_loop()
    stream = trainer.events()
    task = loop.create_task(trainer.fit(batches, epochs=1000))

    async def until_step_2() -> None:
        async for event in stream:
            if isinstance(event, StepEnded) and event.step == 2:
                return

    loop.run_until_complete(until_step_2())
    return loop, task


def test_a_call_from_another_loop_on_the_thread_of_a_fit_left_pending_is_refused(
    tmp_path: Any,
) -> None:
    # save_checkpoint() from a new loop on the same thread waited for the step lock of a fit
    # whose loop could not run meanwhile: for good.
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    loop, task = _fit_left_pending(trainer, make_batches([2] * 4))

    async def save() -> None:
        with anyio.fail_after(20):
            await trainer.save_checkpoint(tmp_path / "other.ckpt")

    with pytest.raises(ConfigurationError, match="in another event loop than the one that runs"):
        asyncio.run(save())
    trainer.stop()  # that loop runs the fit on to its end
    result = loop.run_until_complete(task)
    loop.close()
    assert result.stopped
    asyncio.run(save())  # once it has ended, from any loop


def test_a_fit_left_pending_in_a_closed_loop_is_named_and_refuses_every_call(
    tmp_path: Any,
) -> None:
    # The fit said "already running: await that fit() first", which nobody can, and
    # save_checkpoint() waited for good.
    trainer = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    batches = make_batches([2] * 4)
    loop, task = _fit_left_pending(trainer, batches)
    loop.close()
    ended = re.escape("fit() is still pending on this trainer in an event loop that has ended")

    async def save() -> None:
        with anyio.fail_after(20):
            await trainer.save_checkpoint(tmp_path / "other.ckpt")

    for call in (save, functools.partial(trainer.fit, batches, epochs=1)):
        with pytest.raises(ConfigurationError, match=ended):
            asyncio.run(call())
    # It waits for nothing: the state, where the fit was left between two steps, from this
    # thread or another (it said "call it from" the fit's thread, which may be gone).
    for where in ("here", "another thread"):
        got: list[Any] = []

        def read(into: list[Any] = got) -> None:
            try:
                into.append(trainer.state_dict())
            except ConfigurationError as error:
                into.append(error)

        if where == "here":
            read()
        else:
            thread = threading.Thread(target=read)
            thread.start()
            thread.join(10)
        if trainer._window_open:
            assert "while a step of fit() is in progress" in str(got[0]), where
        else:
            assert got[0]["global_step"] == trainer.global_step, where
    assert not (tmp_path / "other.ckpt").exists()
    # The fit's coroutine, closed as the collector closes it (at exit, say): quietly, where
    # its clean-up, with no loop to run it, raised "asyncddp needs a running asyncio or trio
    # event loop", which Python printed as "Exception ignored in: <coroutine ...>". Its
    # workers are stopped by hand here, as collecting its scheduler would.
    scheduler = trainer._scheduler
    assert scheduler is not None
    task._log_destroy_pending = False

    task.get_coro().close()
    for worker in scheduler._workers:
        worker.stop()


# -- another task's thread-local modes -------------------------------------------------------


async def _fit_beside(mode: Callable[[], Any], devices: int) -> tuple[Trainer, list[torch.dtype]]:
    """Fit while another task on the loop holds ``mode()`` open across its awaits (a service's
    inference under no_grad or autocast); the dtypes of the fit's forwards."""
    dtypes: list[torch.dtype] = []

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits = model(batch[0])
        dtypes.append(logits.dtype)
        return F.cross_entropy(logits.float(), batch[1])

    trainer = Trainer(make_model(), SGD, step, devices=cpu_devices(devices), progress_bar=False)
    batches = make_batches([8, 8, 8])  # made under inference_mode, they would be its tensors
    entered, done = anyio.Event(), anyio.Event()

    async def other_task() -> None:
        with mode():
            entered.set()
            await done.wait()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(other_task)
        await entered.wait()
        try:
            await trainer.fit(batches, epochs=1)
        finally:
            done.set()
    return trainer, dtypes


@pytest.mark.parametrize("devices", [1, 2])
async def test_another_tasks_autocast_does_not_reach_a_running_fit(devices: int) -> None:
    # The loop thread's autocast is every task's: a fit took it at every step, and trained in
    # bfloat16 beside a task validating another model under torch.autocast, without a word.
    trainer, dtypes = await _fit_beside(
        lambda: torch.autocast("cpu", dtype=torch.bfloat16), devices
    )
    assert set(dtypes) == {torch.float32}
    alone = Trainer(make_model(), SGD, loss_step, devices=cpu_devices(devices), progress_bar=False)
    await alone.fit(make_batches([8, 8, 8]), epochs=1)
    assert_close(trainer.model, alone.model, tol=0)


@pytest.mark.parametrize("devices", [1, 2])
async def test_another_tasks_no_grad_does_not_reach_a_running_fit(devices: int) -> None:
    # It failed the fit with "the step's loss does not require grad", blaming the step.
    for mode in (torch.no_grad, torch.inference_mode):
        trainer, _ = await _fit_beside(mode, devices)
        assert trainer.global_step == 3
