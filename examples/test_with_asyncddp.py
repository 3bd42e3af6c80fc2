"""Testing your own code with asyncddp.testing, on any machine, without a GPU.

Run:  pytest examples/test_with_asyncddp.py      (needs the anyio pytest plugin: anyio ships it)
"""

import threading

import pytest

import asyncddp
from asyncddp.testing import fail_on, hang_on


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_failure_names_the_device() -> None:
    async with asyncddp.StepScheduler(asyncddp.cpu_devices(2)) as scheduler:
        with pytest.raises(asyncddp.WorkerFailedError) as info:
            await scheduler.run(fail_on(lambda ctx, shard: shard, device=1), [0, 1])
    assert info.value.device.name == "cpu#1"


@pytest.mark.anyio
async def test_a_hang_times_out() -> None:
    release = threading.Event()
    async with asyncddp.StepScheduler(asyncddp.cpu_devices(2), step_timeout=0.1) as scheduler:
        with pytest.raises(asyncddp.WorkerTimeoutError):
            await scheduler.run(
                hang_on(lambda ctx, shard: shard, device=0, release=release), [0, 1]
            )
        release.set()  # let the worker go, so that closing joins it
