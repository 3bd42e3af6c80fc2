"""Fault injection over the Trainer: every failure becomes a clear error naming its device and
step, nothing hangs or leaks, no step is half-applied, and the trainer works afterwards.

Each case injects one fault (with the helpers in ``asyncddp.testing``) at one step on some of
the devices, checks the error, checks that the parameters are exactly those of a plain loop run
up to the step before, then disarms the fault and checks that the same trainer finishes the run
with the same parameters as a plain loop that never failed. The autouse fixture in conftest.py
fails any case that leaves a worker thread alive.
"""

from __future__ import annotations

import functools
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import asyncddp
from asyncddp import NonFiniteLossError, Trainer, WorkerFailedError, WorkerTimeoutError, cpu_devices
from asyncddp.testing import InjectedFailure, failing_optimizer, failing_step, hanging_step

pytestmark = pytest.mark.anyio

FEATURES = 5
STEPS = 6
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)

#: Every fault tried, for the summary conftest.py prints at the end of the run.
TRIED: list[str] = []


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 3))


def make_batches(count: int, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(size, FEATURES, generator=generator),
            torch.randint(0, 3, (size,), generator=generator),
        )
        for _ in range(count)
    ]


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    logits = model(inputs)
    return {
        "loss": F.cross_entropy(logits, targets),
        "accuracy": (logits.argmax(1) == targets).float().mean(),
    }


def plain_loop(groups: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> nn.Module:
    """One device given each step's whole data (one batch, or the batches of every device)."""
    model = make_model()
    optimizer = SGD(model.parameters())
    for group in groups:
        inputs = torch.cat([b[0] for b in group])
        targets = torch.cat([b[1] for b in group])
        optimizer.zero_grad()
        step(model, (inputs, targets))["loss"].backward()
        optimizer.step()
    return model


def assert_params(trainer: Trainer, expected: nn.Module) -> None:
    for replica in trainer._replicas:
        for (name, value), want in zip(
            replica.model.state_dict().items(), expected.state_dict().values(), strict=True
        ):
            torch.testing.assert_close(
                value, want, rtol=1e-5, atol=1e-5, msg=f"{name} on {replica.device}"
            )


def close_without_waiting(
    trainer: Trainer, monkeypatch: pytest.MonkeyPatch, drain_timeout: float = 0.05
) -> None:
    """Make the trainer's schedulers give up on a hung job at once when they close (instead
    of waiting drain_timeout, 10 s): its thread is left behind."""
    new_scheduler = trainer._new_scheduler

    def scheduler_that_waits_little() -> asyncddp.StepScheduler:
        scheduler = new_scheduler()
        scheduler.drain_timeout = drain_timeout
        return scheduler

    monkeypatch.setattr(trainer, "_new_scheduler", scheduler_that_waits_little)


def join_stragglers(trainer: Trainer) -> None:
    """Wait for the threads the trainer's calls left behind (their hung jobs released)."""
    for thread in trainer._stragglers:
        thread.join(timeout=30.0)


async def trains_on_exactly_once_returned(trainer: Trainer, batches: list[Any]) -> None:
    """Once the left-behind threads have returned, the next fit ends the epoch exactly as an
    uninterrupted one."""
    join_stragglers(trainer)
    await trainer.fit(batches, epochs=1)
    assert trainer.global_step == STEPS
    assert_params(trainer, plain_loop([[b] for b in batches]))


class Armed:
    """Calls the faulty function until disarmed, then the clean one."""

    def __init__(self, faulty: Callable[..., Any], clean: Callable[..., Any]) -> None:
        self.faulty, self.clean, self.armed = faulty, clean, True

    def __call__(self, *args: Any) -> Any:
        return (self.faulty if self.armed else self.clean)(*args)


def inject(fn: Callable[..., Any], devices: list[int], **kwargs: Any) -> Callable[..., Any]:
    for device in devices:
        fn = failing_step(fn, device=device, **kwargs)
    return fn


WHERE = ["forward", "backward", "metric", "optimizer", "data", "validation"]
WHEN = {"first": 0, "middle": 3}
WHICH = {"1 of 1": (1, [0]), "1 of 2": (2, [1]), "1 of 8": (8, [5]), "all of 2": (2, [0, 1])}


@pytest.mark.parametrize("which", list(WHICH))
@pytest.mark.parametrize("when", list(WHEN))
@pytest.mark.parametrize("where", WHERE)
async def test_fault(where: str, when: str, which: str) -> None:
    count, failing = WHICH[which]
    at = WHEN[when]
    split = where != "data"  # a bad data shard: each device gets whole batches of its own
    batches = make_batches(STEPS if split else STEPS * count)
    groups = (
        [[b] for b in batches]
        if split
        else [batches[i : i + count] for i in range(0, len(batches), count)]
    )
    step_fn: Callable[..., Any] = step
    valid_step: Callable[..., Any] | None = None
    optimizer: Callable[..., Any] = SGD
    data: list[Any] = batches
    if where in ("forward", "backward", "metric"):
        step_fn = Armed(inject(step, failing, at=at, where=where), step)
    elif where == "optimizer":
        faulty = SGD
        for device in failing:
            faulty = failing_optimizer(faulty, device=device, at=at)
        optimizer = faulty
    elif where == "data":
        data = list(batches)
        for device in failing:  # a shard the model cannot take: wrong feature count
            bad = at * count + device
            data[bad] = (torch.randn(16, FEATURES + 1), data[bad][1])
    elif where == "validation":
        valid_step = Armed(inject(step, failing), step)
    trainer = Trainer(
        make_model(),
        optimizer,
        step_fn,
        devices=cpu_devices(count),
        valid_step=valid_step,
        split_batches=split,
        progress_bar=False,
    )
    with pytest.raises(WorkerFailedError) as info:
        await trainer.fit(data, epochs=1, valid_data=batches[:2] if where == "validation" else None)
    error = info.value
    expected_names = {f"cpu#{d}" for d in failing}
    assert error.device.name in expected_names
    assert {error.device.name, *(f.device.name for f in error.other_failures)} <= expected_names
    if where == "validation":
        assert error.phase == "valid"
        done = STEPS  # validation runs after the epoch's last step
    else:
        assert error.phase == ("optimizer" if where == "optimizer" else "train")
        assert error.step == at
        done = at
    if where not in ("data",):
        assert isinstance(error.__cause__, InjectedFailure)
    assert trainer.global_step == done
    assert_params(trainer, plain_loop(groups[:done]))  # nothing of the failed step remains
    # The cause gone, the same trainer finishes the run as if nothing had failed.
    if isinstance(step_fn, Armed):
        step_fn.armed = False
    if isinstance(valid_step, Armed):
        valid_step.armed = False
    if where == "optimizer":
        for replica in trainer._replicas:
            replica.optimizer.step = functools.partial(torch.optim.SGD.step, replica.optimizer)  # type: ignore[method-assign]
    await trainer.fit(batches, epochs=1, valid_data=batches[:2] if where == "validation" else None)
    assert trainer.epoch == 1
    assert_params(trainer, plain_loop(groups))
    TRIED.append(f"{where}/{when}/{which}")


async def test_a_hung_device_times_out_and_the_trainer_recovers() -> None:
    release = threading.Event()
    batches = make_batches(STEPS)
    # The hung job lets go after 1 s, within the 10 s that closing waits for running jobs.
    hang = Armed(hanging_step(step, device=1, at=2, release=release, limit=1.0), step)
    trainer = Trainer(
        make_model(), SGD, hang, devices=cpu_devices(2), step_timeout=0.3, progress_bar=False
    )
    try:
        with pytest.raises(WorkerTimeoutError) as info:
            await trainer.fit(batches, epochs=1)
    finally:
        release.set()
    assert info.value.device.name == "cpu#1"
    assert info.value.step == 2
    assert trainer.global_step == 2
    hang.armed = False
    await trainer.fit(batches, epochs=1)
    assert_params(trainer, plain_loop([[b] for b in batches]))
    TRIED.append("hang/middle/1 of 2")


async def test_a_device_hung_in_its_reduce_is_dropped_and_its_late_writes_change_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device hangs in the middle of the all-reduce (phases as jobs apart: a step_timeout),
    after its peers wrote their sums into its replica and before it writes its own into
    theirs. It is dropped; its thread, left behind, then writes its sums into the replicas of
    the devices that went on, while they train a later step. Those writes must land in
    buffers nobody reads any more: the rest trains exactly as one device would."""
    batches = make_batches(STEPS)
    hung, late_done = threading.Event(), threading.Event()
    release = threading.Event()
    original = asyncddp._jobs.all_reduce_chunk
    calls = {"count": 0}

    def reduce(grads: Any, index: int, *args: Any, **kwargs: Any) -> Any:
        if index == 2:
            calls["count"] += 1
            if calls["count"] == 3:  # device cpu#2, step 2
                hung.set()
                release.wait(timeout=10.0)
                try:
                    return original(grads, index, *args, **kwargs)  # the late writes
                finally:
                    late_done.set()
        return original(grads, index, *args, **kwargs)

    monkeypatch.setattr(asyncddp._jobs, "all_reduce_chunk", reduce)

    def step_releasing_the_hung_thread(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        ctx = asyncddp.current_worker()
        assert ctx is not None
        if ctx.step == 4 and ctx.device.name == "cpu#0" and hung.is_set() and not release.is_set():
            release.set()  # the left-behind thread writes now, in the middle of step 4
            assert late_done.wait(timeout=10.0)
        return step(model, batch)

    trainer = Trainer(
        make_model(),
        SGD,
        step_releasing_the_hung_thread,
        devices=cpu_devices(3),
        step_timeout=0.3,
        on_failure="drop",
        progress_bar=False,
    )
    # Closing the old scheduler would wait 10 s for the hung job: make it give up at once, so
    # that the thread is left behind while the others train.
    close_without_waiting(trainer, monkeypatch)
    try:
        with pytest.warns(asyncddp.DeviceDroppedWarning, match="cpu#2"):
            await trainer.fit(batches, epochs=1)
    finally:
        release.set()
    assert late_done.is_set(), "the hung reduce never wrote: the test did not test anything"
    assert [d.name for d in trainer.devices] == ["cpu#0", "cpu#1"]
    assert trainer.global_step == STEPS
    assert_params(trainer, plain_loop([[b] for b in batches]))
    TRIED.append("hang in the all-reduce/middle/1 of 3, dropped")


async def test_a_job_left_behind_by_a_timeout_blocks_the_next_call_until_it_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step times out and closing its workers leaves the hung one behind. Its job writes
    into the replicas when it returns: an earlier version let the next fit start meanwhile,
    and the late writes changed that fit's results. Now every call on the trainer refuses,
    naming the thread, until it has returned; then training goes on exactly."""
    batches = make_batches(STEPS)
    hung, release = threading.Event(), threading.Event()

    def hangs_once(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        ctx = asyncddp.current_worker()
        assert ctx is not None
        if ctx.step == 2 and ctx.device.name == "cpu#1" and not hung.is_set():
            hung.set()
            release.wait(timeout=10.0)
        return step(model, batch)

    trainer = Trainer(
        make_model(),
        SGD,
        hangs_once,
        devices=cpu_devices(2),
        step_timeout=0.3,
        progress_bar=False,
    )
    close_without_waiting(trainer, monkeypatch)  # the hung job's thread is left behind
    try:
        with (
            pytest.raises(WorkerTimeoutError),
            pytest.warns(RuntimeWarning, match=r"asyncddp-worker\[cpu#1\].*left behind") as warned,
        ):
            await trainer.fit(batches, epochs=1)
        assert [w.filename for w in warned] == [__file__]  # the user's line, not asyncddp's
        assert trainer.global_step == 2
        for call in (trainer.fit(batches, epochs=1), trainer.validate(batches)):
            with pytest.raises(
                asyncddp.AsyncDDPError, match=r"asyncddp-worker\[cpu#1\] is still"
            ) as refused:
                await call
            assert [t.name for t in refused.value.threads] == ["asyncddp-worker[cpu#1]"]  # type: ignore[attr-defined]
    finally:
        release.set()
    await trains_on_exactly_once_returned(trainer, batches)
    TRIED.append("hang past the drain, left behind/middle/1 of 2")


@pytest.mark.parametrize(
    ("devices", "ends_by"), [(1, "cancel"), (2, "cancel"), (2, "failure on another device")]
)
async def test_a_hung_step_holds_a_cancellation_or_a_failure_up_to_drain_timeout_only(
    devices: int, ends_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 2 hangs on the last device. The step's undo, queued behind the hung job (a job
    run on every device), was waited for without a limit: a cancelled fit, or one whose other
    device failed, returned only once the hung job did, however long after drain_timeout.
    Now the undo stays queued, to run once the hung job returns, and the call ends after
    drain_timeout; the next call waits for the thread, then trains on exactly."""
    batches = make_batches(STEPS)
    hung, release, returned = threading.Event(), threading.Event(), threading.Event()
    last = f"cpu#{devices - 1}"

    def hangs_once(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        ctx = asyncddp.current_worker()
        assert ctx is not None
        if ctx.step == 2 and not release.is_set():
            if ctx.device.name == last:
                hung.set()
                release.wait(timeout=30.0)
                returned.set()
            elif ends_by != "cancel":
                assert hung.wait(timeout=10.0)
                raise RuntimeError("cpu#0 broke")
        return step(model, batch)

    trainer = Trainer(
        make_model(), SGD, hangs_once, devices=cpu_devices(devices), progress_bar=False
    )
    close_without_waiting(trainer, monkeypatch, drain_timeout=0.5)  # and drain briefly

    async def fit_until_hung_then_end() -> None:
        async def fit() -> None:
            if ends_by == "cancel":
                await trainer.fit(batches, epochs=1)
            with pytest.raises(WorkerFailedError, match="cpu#0 broke"):
                await trainer.fit(batches, epochs=1)

        async with anyio.create_task_group() as group:
            group.start_soon(fit)
            await anyio.to_thread.run_sync(hung.wait, 10.0)
            if ends_by == "cancel":
                group.cancel_scope.cancel()

    try:
        with pytest.warns(RuntimeWarning, match=rf"asyncddp-worker\[{last}\].*left behind"):
            await fit_until_hung_then_end()
        assert not returned.is_set(), "the call waited for the hung job"
        assert trainer.global_step == 2
    finally:
        release.set()
    await trains_on_exactly_once_returned(trainer, batches)
    TRIED.append(f"hang, then {ends_by}/middle/1 of {devices}")


async def test_an_undo_left_queued_behind_a_hung_job_that_fails_is_not_taken_for_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cpu#1's optimizer step hangs past step_timeout; the undo queued behind it fails once
    it runs (a broken device's would). It was taken for done, and the next fit trained on
    replicas that differed; the next call now finds it failed and refuses."""
    hung, release, undo_failed = threading.Event(), threading.Event(), threading.Event()

    class HangingSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            ctx = asyncddp.current_worker()
            if ctx is not None and ctx.device.index == 1 and ctx.step == 2 and not hung.is_set():
                hung.set()
                release.wait(10)
            return super().step(closure)

    abandon = asyncddp._jobs.Jobs.abandon

    def failing_undo(self: Any, ctx: asyncddp.WorkerContext, work: Any) -> None:
        if ctx.device.index == 1 and release.is_set() and not undo_failed.is_set():
            undo_failed.set()
            raise RuntimeError("injected: the undo failed on cpu#1")
        abandon(self, ctx, work)

    monkeypatch.setattr(asyncddp._jobs.Jobs, "abandon", failing_undo)
    trainer = Trainer(
        make_model(),
        functools.partial(HangingSGD, lr=0.1, momentum=0.9),
        step,
        devices=cpu_devices(2),
        step_timeout=0.3,
        progress_bar=False,
    )
    close_without_waiting(trainer, monkeypatch)
    try:
        with (
            pytest.raises(WorkerTimeoutError),
            pytest.warns(RuntimeWarning, match=r"asyncddp-worker\[cpu#1\].*left behind"),
        ):
            await trainer.fit(make_batches(STEPS), epochs=1)
    finally:
        release.set()
    join_stragglers(trainer)
    assert undo_failed.is_set()
    with pytest.raises(asyncddp.AsyncDDPError, match="or its undo failed"):
        await trainer.fit(make_batches(STEPS), epochs=1)


async def test_a_thread_left_behind_in_a_shared_module_holds_off_its_other_trainers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Trainer A's job hangs on cpu#0, whose replica is the module itself, and is left behind;
    # trainer B, given the same module, trained meanwhile while the hung job could write.
    model, release = make_model(), threading.Event()

    def hangs(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        ctx = asyncddp.current_worker()
        if ctx is not None and ctx.step == 2 and ctx.device.index == 0 and not release.is_set():
            release.wait(10)
        return step(model, batch)

    first = Trainer(model, SGD, hangs, devices=cpu_devices(2), step_timeout=0.3, progress_bar=False)
    close_without_waiting(first, monkeypatch)
    second = Trainer(model, SGD, step, devices=cpu_devices(2), progress_bar=False)
    try:
        with (
            pytest.raises(WorkerTimeoutError),
            pytest.warns(RuntimeWarning, match="left behind"),
        ):
            await first.fit(make_batches(STEPS), epochs=1)
        with pytest.raises(asyncddp.ConfigurationError, match="a thread its last call left"):
            await second.fit(make_batches(STEPS), epochs=1)
    finally:
        release.set()
    join_stragglers(first)
    await second.fit(make_batches(STEPS), epochs=1)  # once it has returned
    assert second.global_step == STEPS


async def test_keyboard_interrupt_in_a_worker_reaches_the_caller() -> None:
    batches = make_batches(STEPS)
    interrupt = Armed(failing_step(step, device=0, at=3, error=KeyboardInterrupt()), step)
    trainer = Trainer(make_model(), SGD, interrupt, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(KeyboardInterrupt):
        await trainer.fit(batches, epochs=1)
    assert trainer.global_step == 3
    assert_params(trainer, plain_loop([[b] for b in batches[:3]]))
    interrupt.armed = False
    await trainer.fit(batches, epochs=1)
    assert_params(trainer, plain_loop([[b] for b in batches]))
    TRIED.append("KeyboardInterrupt/middle/1 of 2")


async def test_a_non_finite_loss_names_its_device_and_step() -> None:
    batches = make_batches(STEPS)

    def nan_on_cpu1_at_4(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        output = step(model, batch)
        ctx = asyncddp.current_worker()
        if ctx is not None and ctx.device.name == "cpu#1" and ctx.step == 4:
            output["loss"] = output["loss"] * float("nan")
        return output

    trainer = Trainer(
        make_model(),
        SGD,
        nan_on_cpu1_at_4,
        devices=cpu_devices(2),
        check_finite=True,
        progress_bar=False,
    )
    stream = trainer.events()
    with pytest.raises(NonFiniteLossError) as info:
        await trainer.fit(batches, epochs=1)
    assert info.value.device.name == "cpu#1"
    assert info.value.step == 4
    assert str(info.value).startswith("training worker on device cpu#1 failed: the loss is nan")
    assert info.value.error_type == ""
    assert info.value.__cause__ is None  # as documented (a private _NonFiniteLoss was)
    failed = [e async for e in stream if isinstance(e, asyncddp.WorkerFailed)]
    assert [(e.device, e.step, e.phase, e.action) for e in failed] == [
        ("cpu#1", 4, "train", "raise")
    ]
    assert failed[0].error == str(info.value)
    assert trainer.global_step == 4
    assert_params(trainer, plain_loop([[b] for b in batches[:4]]))
    TRIED.append("non-finite loss/middle/1 of 2")


@pytest.mark.parametrize("where", ["forward", "backward"])
async def test_failing_step_at_a_step_fails_that_training_step_not_the_validation_before_it(
    where: str,
) -> None:
    # Validation runs the step function too (no valid_step), its jobs numbered as the next
    # optimizer step: at=2 fired in the first epoch's validation, where a backward fault never
    # fires (its times=1 used up, the retry this test was for never happened) and a forward
    # fault raised whatever the policy.
    trainer = Trainer(
        make_model(),
        SGD,
        failing_step(lambda m, b: step(m, b)["loss"], device=1, at=2, where=where, times=1),
        devices=cpu_devices(2),
        on_failure="retry",
        progress_bar=False,
    )
    stream = trainer.events()
    await trainer.fit(make_batches(2), epochs=2, valid_data=make_batches(1))
    failed = [e async for e in stream if isinstance(e, asyncddp.WorkerFailed)]
    assert [(e.device, e.step, e.phase, e.action) for e in failed] == [
        ("cpu#1", 2, "train", "retry")
    ]
    assert trainer.global_step == 4


@pytest.mark.parametrize("policy", ["raise", "retry", "drop"])
async def test_a_device_that_fails_in_validation_raises_whatever_the_policy(policy: str) -> None:
    # The failure policy is for training steps; validation changes no state, and a failure in it
    # raises at once, with a WorkerFailed event that says so.
    trainer = Trainer(
        make_model(),
        SGD,
        lambda m, b: step(m, b)["loss"],
        valid_step=failing_step(lambda m, b: step(m, b)["loss"], device=1),
        devices=cpu_devices(2),
        on_failure=policy,
        progress_bar=False,
    )
    stream = trainer.events()
    with pytest.raises(WorkerFailedError, match="phase valid") as info:
        await trainer.fit(make_batches(2), epochs=2, valid_data=make_batches(1))
    assert isinstance(info.value.__cause__, InjectedFailure)
    assert trainer.global_step == 2  # the first epoch trained; its validation failed
    events = [e async for e in stream]
    failed = [e for e in events if isinstance(e, asyncddp.WorkerFailed)]
    assert [(e.device, e.phase, e.action) for e in failed] == [("cpu#1", "valid", "raise")]
    assert not [e for e in events if isinstance(e, (asyncddp.StepRetried, asyncddp.DeviceDropped))]


async def test_a_valid_step_that_returns_no_loss_raises_step_output_error_itself() -> None:
    trainer = Trainer(
        make_model(),
        SGD,
        lambda m, b: step(m, b)["loss"],
        valid_step=lambda m, b: None,
        devices=cpu_devices(2),
        progress_bar=False,
    )
    with pytest.raises(asyncddp.StepOutputError, match="the validation step returned None"):
        await trainer.validate(make_batches(1))


async def test_without_check_finite_a_nan_loss_trains_on() -> None:
    trainer = Trainer(
        make_model(),
        SGD,
        lambda m, b: step(m, b)["loss"] * float("nan"),
        devices=cpu_devices(2),
        progress_bar=False,
    )
    with pytest.warns(RuntimeWarning, match=r"epoch 0's training loss is nan.*check_finite=True"):
        result = await trainer.fit(make_batches(2), epochs=1)  # as a plain loop would
    assert result.global_step == 2


@pytest.mark.parametrize(
    ("devices", "groups"),
    [(2, [[0, 1], [2, 3], [4], [5]]), (3, [[0, 1, 2], [3, 4, 5]])],
    ids=["2-to-1", "3-to-2"],
)
async def test_a_step_retried_on_fewer_devices_with_whole_batches_is_one_mean(
    devices: int, groups: list[list[int]]
) -> None:
    # split_batches=False: each device trains whole batches of its own. When one is dropped,
    # the failed step's batches are regrouped for the devices left, into micro-steps of one
    # step: the step is still the mean over all their items, not the sum of the micro-steps'
    # means. The steps after it take a batch per device left.
    batches = make_batches(6)
    trainer = Trainer(
        make_model(),
        SGD,
        # By name: by index, after the drop the failure moved to cpu#2 (index 1 then), which
        # was dropped as well.
        failing_step(lambda m, b: step(m, b)["loss"], device="cpu#1", at=1),
        devices=cpu_devices(devices),
        split_batches=False,
        on_failure="drop",
        progress_bar=False,
    )
    with pytest.warns(asyncddp.DeviceDroppedWarning):
        result = await trainer.fit(batches, epochs=1)
    assert result.global_step == len(groups)
    assert_params(trainer, plain_loop([[batches[i] for i in group] for group in groups]))


class WarmupSGD(torch.optim.Optimizer):
    """A hand-written optimizer of a kind torch has none of: its step count lies in the state
    under a key that is not a parameter, and each step's rate grows with it."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        count = self.state["global"]
        count["t"] = count.get("t", 0) + 1
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * min(1.0, count["t"] / 10))


@pytest.mark.parametrize("after_update", [True, False])
async def test_a_retried_step_undoes_optimizer_state_under_a_key_that_is_not_a_parameter(
    after_update: bool,
) -> None:
    # That entry was not backed up: a retried step counted twice (parameters 3e-3 off a
    # plain loop's), and where cpu#1 failed before its update while cpu#0 had taken its own,
    # the copies' counts differed (5 and 4) and the replica compare refused the trainer,
    # blaming the model's forward.
    batches = make_batches(STEPS)
    trainer = Trainer(
        make_model(),
        failing_optimizer(WarmupSGD, device=1, at=3, after_update=after_update, times=1),
        step,
        devices=cpu_devices(2),
        on_failure="retry",
        progress_bar=False,
    )
    await trainer.fit(batches, epochs=1)
    model = make_model()
    optimizer = WarmupSGD(model.parameters())
    for inputs, targets in batches:
        optimizer.zero_grad()
        step(model, (inputs, targets))["loss"].backward()
        optimizer.step()
    assert_params(trainer, model)
    assert [r.optimizer.state["global"] for r in trainer._replicas] == [{"t": STEPS}] * 2


# -- the helpers' own options -------------------------------------------------------------------


async def test_a_fault_for_a_number_of_times_lets_the_next_fit_recover() -> None:
    # A failed step is taken again under its number: times=1 fails it once, and the same
    # trainer's next fit ends as a run that never failed (docs/faults.md's recovery test).
    batches = make_batches(STEPS)
    faulty = failing_step(step, device=1, at=3, times=1)
    trainer = Trainer(
        make_model(),
        failing_optimizer(SGD, device=0, at=4, times=1),
        faulty,
        devices=cpu_devices(2),
        progress_bar=False,
    )
    for failed_at, phase in ((3, "train"), (4, "optimizer")):
        with pytest.raises(WorkerFailedError) as caught:
            await trainer.fit(batches, epochs=1)
        assert (caught.value.step, caught.value.phase) == (failed_at, phase)
    await trainer.fit(batches, epochs=1)
    assert trainer.global_step == STEPS
    assert_params(trainer, plain_loop([[b] for b in batches]))


def test_a_fault_that_could_never_fire_is_refused_where_it_is_made() -> None:
    # A typo must not make a test that expects a failure pass by another way, or fail with
    # pytest's "DID NOT RAISE" and no hint.
    from asyncddp.testing import fail_on

    # Each an AsyncDDPError, as the docs promise of a refusal: a ConfigurationError (also a
    # ValueError), or Python's TypeError for an argument of the wrong type.
    with pytest.raises(asyncddp.ConfigurationError, match="where must be"):
        failing_step(step, device=1, where="Backward")  # type: ignore[arg-type]
    with pytest.raises(asyncddp.ConfigurationError, match="device must be an index from 0"):
        failing_step(step, device=-1)
    for bad in (True, 1.0):
        with pytest.raises(TypeError, match="device must be"):
            failing_step(step, device=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device must be an index"):
        fail_on(lambda ctx, shard: None, device="cpu#1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="times must be an int >= 1"):
        failing_optimizer(SGD, device=0, times=0)
    with pytest.raises(ValueError, match="after_update must be True or False, got 'no'"):
        failing_optimizer(SGD, device=0, after_update="no")  # type: ignore[arg-type]


def test_every_helper_refuses_arguments_that_could_never_fire_where_it_is_made() -> None:
    # hang_on and hanging_step checked nothing: device="cpu#1" or -1 never hung, and a test
    # of a hang passed without one; an error, a release or a job of the wrong kind failed
    # later, inside a worker, as a device's WorkerFailedError that pytest.raises took.
    from asyncddp.testing import fail_on, hang_on

    release = threading.Event()

    def job(ctx: Any, shard: Any) -> None:
        return None

    wrong: list[tuple[type[Exception], str, Callable[[], object]]] = [
        (
            TypeError,
            "device must be an index",
            lambda: hang_on(job, device="cpu#1", release=release),
        ),  # type: ignore[arg-type]
        (
            ValueError,
            "device must be an index from 0",
            lambda: hang_on(job, device=-1, release=release),
        ),
        (TypeError, "device must be", lambda: hanging_step(step, device=1.5, release=release)),  # type: ignore[arg-type]
        (
            ValueError,
            "device must be an index from 0",
            lambda: hanging_step(step, device=-1, release=release),
        ),
        (
            TypeError,
            "release must be a threading.Event",
            lambda: hang_on(job, device=0, release=None),
        ),  # type: ignore[arg-type]
        (
            TypeError,
            "release must be a threading.Event",
            lambda: hanging_step(step, device=0, release=anyio.Event()),
        ),  # type: ignore[arg-type]
        (
            ValueError,
            "limit must be a positive number",
            lambda: hang_on(job, device=0, release=release, limit=-1),
        ),
        (
            ValueError,
            "times must be an int >= 1",
            lambda: hanging_step(step, device=0, release=release, times=0),
        ),
        (ValueError, "step must be an int >= 0", lambda: fail_on(job, device=0, step=-1)),
        (
            ValueError,
            "step must be an int >= 0",
            lambda: hang_on(job, device=0, release=release, step="3"),
        ),  # type: ignore[arg-type]
        (ValueError, "at must be an int >= 0", lambda: failing_step(step, device=0, at=-1)),
        (ValueError, "at must be an int >= 0", lambda: failing_optimizer(SGD, device=0, at=2.0)),  # type: ignore[arg-type]
        (
            TypeError,
            "error must be an exception to raise",
            lambda: fail_on(job, device=0, error="disk full"),
        ),  # type: ignore[arg-type]
        (
            TypeError,
            "or an exception class",
            lambda: failing_step(step, device=0, error="disk full"),
        ),  # type: ignore[arg-type]
        (TypeError, "error must be", lambda: failing_optimizer(SGD, device=0, error=1)),  # type: ignore[arg-type]
        (TypeError, "job must be callable", lambda: fail_on(None, device=0)),  # type: ignore[arg-type]
        (TypeError, "step must be callable", lambda: hanging_step(None, device=0, release=release)),  # type: ignore[arg-type]
        (
            TypeError,
            "an optimizer already built",
            lambda: failing_optimizer(SGD(nn.Linear(2, 1).parameters()), device=0),
        ),  # type: ignore[arg-type]
    ]
    for kind, message, make in wrong:
        with pytest.raises(kind, match=message):
            make()
    # What worked before the checks still does: a NumPy index, no limit, an exception class,
    # any release with a blocking wait(timeout), a NumPy step.
    hang_on(job, device=np.int64(1), release=threading.Event(), limit=None, step=np.int64(2))
    hanging_step(step, device=np.int64(0), release=multiprocessing.Event(), at=np.int32(1))
    fail_on(job, device=0, error=ValueError)
    failing_optimizer(SGD, device="cpu#1", error=RuntimeError)


async def test_an_error_class_given_to_a_helper_is_raised_as_a_new_error_each_time() -> None:
    from asyncddp.testing import fail_on

    job = fail_on(lambda ctx, shard: shard, device=np.int64(1), error=ValueError)
    causes = []
    async with asyncddp.StepScheduler(cpu_devices(2)) as scheduler:
        for _ in range(2):
            with pytest.raises(WorkerFailedError) as caught:
                await scheduler.run(job, [0, 0])
            causes.append(caught.value.__cause__)
    assert all(type(cause) is ValueError for cause in causes)
    assert causes[0] is not causes[1]


async def test_an_error_given_to_a_helper_is_raised_without_its_earlier_tracebacks() -> None:
    # The same instance raised at every failure: its traceback grew by a raise each time,
    # and kept every failed step's frames, and so its shards, alive.
    from asyncddp.testing import fail_on

    error = ValueError("disk full")
    job = fail_on(lambda ctx, shard: shard, device=1, error=error)
    lengths = []
    async with asyncddp.StepScheduler(cpu_devices(2)) as scheduler:
        for _ in range(5):
            with pytest.raises(WorkerFailedError) as caught:
                await scheduler.run(job, [torch.zeros(4), torch.zeros(4)])
            assert caught.value.__cause__ is error
            depth, tb = 0, error.__traceback__
            while tb is not None:
                depth, tb = depth + 1, tb.tb_next
            lengths.append(depth)
    assert len(set(lengths)) == 1, lengths


async def test_a_hang_for_a_number_of_times_then_runs_as_usual() -> None:
    release = threading.Event()
    trainer = Trainer(
        make_model(),
        SGD,
        # Past step_timeout, and back (at its limit) within the drain that follows it.
        hanging_step(step, device=1, release=release, limit=1.5, times=1),
        devices=cpu_devices(2),
        progress_bar=False,
        step_timeout=1.0,  # far above an ordinary step of this model, on a loaded machine too
    )
    batches = make_batches(STEPS)
    with pytest.raises(WorkerTimeoutError):
        await trainer.fit(batches, epochs=1)
    await trainer.fit(batches, epochs=1)  # the fault has fired its one time
    assert trainer.global_step == STEPS


@pytest.mark.parametrize("where", ["forward", "backward", "metric"])
async def test_a_failing_step_s_failure_keeps_nothing_alive_once_let_go(where: str) -> None:
    # The wrapper kept its failure in its frame's locals, and the failure, raised, kept that
    # frame in its traceback: a cycle that held the model and the batch until the cyclic
    # collector ran (never, where a service turns it off).
    import gc
    import weakref

    async def fail_once() -> weakref.ref[nn.Module]:
        faulty = failing_step(step, device=0, at=1, where=where)  # type: ignore[arg-type]
        trainer = Trainer(make_model(), SGD, faulty, devices=cpu_devices(2), progress_bar=False)
        with pytest.raises(WorkerFailedError):
            await trainer.fit(make_batches(STEPS), epochs=1)
        return weakref.ref(trainer.model)

    await fail_once()  # the first failure in a process imports parts of torch: garbage of its own
    gc.collect()
    gc.disable()
    try:
        model = await fail_once()
        assert model() is None
    finally:
        gc.enable()
