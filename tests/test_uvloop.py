"""asyncddp under uvloop, the event loop that ``uvicorn[standard]`` (FastAPI's usual server)
runs: training, failures, cancellation, ``stop()`` and events, as under asyncio's own loop."""

from __future__ import annotations

import asyncio
import functools

import anyio
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import asyncddp
from asyncddp import EpochEnded, FitEnded, StepEnded, WorkerFailedError, cpu_devices

uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed (no Windows build)")

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


def regression_batches(count: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(128 * count, 8, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True)
    return [(inputs[i : i + 128], targets[i : i + 128]) for i in range(0, len(inputs), 128)]


def mse_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


def trainer(step: object = mse_step) -> asyncddp.Trainer:
    torch.manual_seed(0)
    return asyncddp.Trainer(
        nn.Linear(8, 1),
        functools.partial(torch.optim.SGD, lr=0.1),
        step,  # type: ignore[arg-type]
        devices=cpu_devices(2),
        progress_bar=False,
    )


async def test_the_loop_is_uvloop_and_fit_trains_while_it_stays_free() -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    result = await trainer().fit(regression_batches(), epochs=5)
    ticking.cancel()
    assert result.history[-1].train_loss < 1e-3 < result.history[0].train_loss
    assert result.global_step == 5 * 8
    assert ticks > 0  # the ticker ran during fit: the loop was not blocked


async def test_a_raising_step_names_its_device_and_keeps_the_cause() -> None:
    def bad_step(model: nn.Module, batch: object) -> torch.Tensor:
        raise ValueError("bad batch")

    with pytest.raises(WorkerFailedError) as caught:
        await trainer(bad_step).fit(regression_batches(2), epochs=1)
    assert caught.value.device.name in {"cpu#0", "cpu#1"}
    assert isinstance(caught.value.__cause__, ValueError)
    assert "bad batch" in str(caught.value)


async def test_cancelling_fit_stops_it_and_fit_continues_the_epoch() -> None:
    training = trainer()
    data = regression_batches() * 10
    stream = training.events()
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:

            async def cancel_after_step_5() -> None:
                async for event in stream:
                    if isinstance(event, StepEnded) and event.step == 5:
                        scope.cancel()

            group.start_soon(cancel_after_step_5)
            await training.fit(data, epochs=1)
    assert scope.cancelled_caught
    steps = training.global_step
    assert 6 <= steps < len(data)
    # The epoch goes on from the step it was cancelled after, to its end.
    result = await training.fit(data, epochs=1)
    assert result.global_step == len(data)


async def test_stop_and_events_from_other_tasks() -> None:
    training = trainer()
    stream = training.events()
    seen: list[object] = []

    async def watch() -> None:
        async for event in stream:
            seen.append(event)
            if isinstance(event, StepEnded) and event.step == 2:
                training.stop()
            if isinstance(event, FitEnded):
                return

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        result = await training.fit(regression_batches(), epochs=3)
    assert result.stopped
    steps = [e.step for e in seen if isinstance(e, StepEnded)]
    assert steps == list(range(len(steps)))
    assert 3 <= len(steps) < 8  # stopped at a step's end within the first epoch
    assert not any(isinstance(e, EpochEnded) for e in seen)
    ended = seen[-1]
    assert isinstance(ended, FitEnded)
    assert (ended.stopped, ended.step) == (True, len(steps))


async def test_a_step_scheduler_runs_and_fails_as_under_asyncio() -> None:
    async with asyncddp.StepScheduler(cpu_devices(2)) as scheduler:
        result = await scheduler.run(lambda context, shard: shard * 2, [1, 2])
        assert tuple(result.outputs) == (2, 4)

        def fails_on_cpu_1(context: asyncddp.WorkerContext, shard: int) -> int:
            if context.device.name == "cpu#1":
                raise RuntimeError("device broke")
            return shard

        with pytest.raises(WorkerFailedError, match="cpu#1") as caught:
            await scheduler.run(fails_on_cpu_1, [1, 2])
        assert isinstance(caught.value.__cause__, RuntimeError)
