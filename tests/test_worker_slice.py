"""CPU workers ask Linux for a long scheduler slice (``asyncddp._sched``), and only that."""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest
import torch
from torch.distributed import HashStore

from asyncddp import Device, StepScheduler, WorkerContext, _sched, cpu_devices
from asyncddp._worker import DeviceWorker

pytestmark = pytest.mark.anyio


def _why_no_custom_slices() -> str | None:
    """Why this machine cannot show a custom slice; ``None`` when it can."""
    if _sched._calls() is None:
        return f"needs Linux on a 64-bit x86, Arm, RISC-V or LoongArch CPU (this: {sys.platform})"
    reported = _sched.thread_slice_ns()
    if reported is None:
        return "needs sched_getattr, which this system refused"
    if reported == 0:
        return "needs Linux 6.12 or later (custom scheduler slices); this kernel reports none"
    return None


custom_slices = pytest.mark.skipif(
    _why_no_custom_slices() is not None, reason=str(_why_no_custom_slices())
)

WORKER_SLICE_NS = int(_sched.WORKER_SLICE_MS * 1_000_000)


@pytest.fixture(autouse=True)
def no_slice_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a user who never set the variable (a shell may have)."""
    monkeypatch.delenv(_sched.SLICE_VARIABLE, raising=False)


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread of its own (a thread's slice is its own): its value, or its error."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def own_slice(ctx: WorkerContext, shard: object) -> int | None:
    return _sched.thread_slice_ns()


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The slices workers ask for (recorded, not asked: this runs on any kernel)."""
    record: list[float] = []

    def prefer_throughput(milliseconds: float = _sched.WORKER_SLICE_MS) -> bool:
        record.append(milliseconds)
        return True

    monkeypatch.setattr(_sched, "prefer_throughput", prefer_throughput)
    return record


@pytest.fixture
def process_group() -> Iterator[None]:
    torch.distributed.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


# -- what a worker asks for (any kernel) -------------------------------------------------------


async def test_each_cpu_worker_asks_for_the_long_slice(asked: list[float]) -> None:
    async with StepScheduler(cpu_devices(2)) as scheduler:
        await scheduler.run(own_slice, [None, None])
    assert asked == [_sched.WORKER_SLICE_MS] * 2


@pytest.mark.usefixtures("process_group")
async def test_in_a_process_group_a_worker_asks_for_nothing(asked: list[float]) -> None:
    async with StepScheduler(cpu_devices(1)) as scheduler:
        await scheduler.run(own_slice, [None])
    assert asked == []


@pytest.mark.usefixtures("process_group")
async def test_a_chosen_slice_applies_in_a_process_group_too(
    asked: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(_sched.SLICE_VARIABLE, "20")
    async with StepScheduler(cpu_devices(1)) as scheduler:
        await scheduler.run(own_slice, [None])
    assert asked == [20.0]


def test_a_gpu_worker_asks_for_nothing(asked: list[float]) -> None:
    # Its set-up fails without a GPU (and is reported by its jobs); the slice comes before.
    worker = DeviceWorker(Device(0, torch.device("cuda", 0), "cuda:0"))
    worker.start()
    worker.stop()
    assert worker.join(timeout=10)
    assert asked == []


async def test_a_refused_request_leaves_the_worker_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused(number: int, *args: Any) -> int:
        return -1 if number == 314 else 0  # sched_setattr refused, sched_getattr answered

    monkeypatch.setattr(_sched, "_calls", lambda: (refused, 314, 315))
    assert in_thread(_sched.prefer_throughput) is False
    async with StepScheduler(cpu_devices(1)) as scheduler:
        assert (await scheduler.run(lambda ctx, shard: shard + 1, [1])).outputs == (2,)


def test_a_call_that_raises_is_no_request(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> int:
        raise OSError("no such call")

    monkeypatch.setattr(_sched, "_calls", lambda: (broken, 314, 315))
    assert in_thread(_sched.prefer_throughput) is False
    assert in_thread(_sched.thread_slice_ns) is None
    assert in_thread(lambda: _sched.prefer_throughput("30")) is False  # type: ignore[arg-type]


def test_elsewhere_nothing_happens_and_nothing_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sched, "_calls", lambda: None)
    assert in_thread(_sched.prefer_throughput) is False
    assert in_thread(_sched.thread_slice_ns) is None


@pytest.mark.parametrize(
    ("value", "chosen"),
    [("12.5", 12.5), ("0", 0.0), ("-5", 0.0), (" 7 ", 7.0), ("", None), ("  ", None)],
)
def test_the_variable_chooses_the_slice(
    monkeypatch: pytest.MonkeyPatch, value: str, chosen: float | None
) -> None:
    monkeypatch.setenv(_sched.SLICE_VARIABLE, value)
    assert _sched.chosen_slice_ms() == chosen


@pytest.mark.parametrize("value", ["fast", "inf", "nan"])
def test_a_variable_that_is_no_number_warns_and_chooses_nothing(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(_sched.SLICE_VARIABLE, value)
    with pytest.warns(RuntimeWarning, match="not a number of milliseconds"):
        assert _sched.chosen_slice_ms() is None


async def test_a_variable_that_is_no_number_warns_where_the_workers_start(
    monkeypatch: pytest.MonkeyPatch, asked: list[float]
) -> None:
    monkeypatch.setenv(_sched.SLICE_VARIABLE, "fast")
    with pytest.warns(RuntimeWarning, match="not a number of milliseconds") as seen:
        async with StepScheduler(cpu_devices(2)) as scheduler:
            result = await scheduler.run(lambda ctx, shard: shard + 1, [1, 2])
    assert result.outputs == (2, 3)
    assert asked == [_sched.WORKER_SLICE_MS] * 2
    assert len(seen) == 1  # once, not once a worker
    assert seen[0].filename == __file__


async def test_with_warnings_as_errors_a_bad_variable_raises_and_no_step_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Raised on the thread that starts the workers: a worker thread that raised it instead
    # would die before its first job, and the step would wait for it forever.
    monkeypatch.setenv(_sched.SLICE_VARIABLE, "fast")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with anyio.fail_after(30), pytest.raises(RuntimeWarning, match="not a number"):
            async with StepScheduler(cpu_devices(2)) as scheduler:
                await scheduler.run(lambda ctx, shard: shard, [1, 2])


def test_a_slice_of_zero_asks_for_nothing() -> None:
    assert in_thread(lambda: _sched.prefer_throughput(0)) is False


# -- what the kernel makes of it (Linux 6.12 and later) ----------------------------------------


@custom_slices
async def test_cpu_workers_run_with_the_long_slice_and_the_event_loop_keeps_its_own() -> None:
    loop_slice = _sched.thread_slice_ns()
    async with StepScheduler(cpu_devices(2)) as scheduler:
        result = await scheduler.run(own_slice, [None, None])
    assert result.outputs == (WORKER_SLICE_NS, WORKER_SLICE_NS)
    assert loop_slice != WORKER_SLICE_NS
    assert _sched.thread_slice_ns() == loop_slice


@custom_slices
@pytest.mark.parametrize("value", ["0", "20"])
async def test_the_variable_sets_the_workers_slice_or_leaves_it(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(_sched.SLICE_VARIABLE, value)
    default = in_thread(_sched.thread_slice_ns)
    async with StepScheduler(cpu_devices(1)) as scheduler:
        result = await scheduler.run(own_slice, [None])
    assert result.outputs == ((default,) if value == "0" else (20_000_000,))
    assert default not in (20_000_000, WORKER_SLICE_NS)


@custom_slices
@pytest.mark.usefixtures("process_group")
async def test_in_a_process_group_workers_keep_the_default_slice() -> None:
    default = in_thread(_sched.thread_slice_ns)
    async with StepScheduler(cpu_devices(1)) as scheduler:
        result = await scheduler.run(own_slice, [None])
    assert result.outputs == (default,)
    assert default != WORKER_SLICE_NS


@custom_slices
@pytest.mark.parametrize(("asked_ms", "got_ns"), [(1e30, 100_000_000), (1e-7, 100_000)])
def test_a_slice_out_of_the_kernels_range_is_brought_into_it(asked_ms: float, got_ns: int) -> None:
    def ask() -> int | None:
        assert _sched.prefer_throughput(asked_ms)
        return _sched.thread_slice_ns()

    assert in_thread(ask) == got_ns


@custom_slices
def test_threads_a_worker_starts_inherit_its_slice() -> None:
    def worker() -> int | None:
        assert _sched.prefer_throughput()
        return in_thread(_sched.thread_slice_ns)  # as a GNU OpenMP team's threads start

    assert in_thread(worker) == WORKER_SLICE_NS


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
def test_the_thread_keeps_its_nice_value() -> None:
    def niced() -> tuple[bool, int, int]:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + 3)
        before = os.getpriority(os.PRIO_PROCESS, tid)
        took = _sched.prefer_throughput()
        return took, before, os.getpriority(os.PRIO_PROCESS, tid)

    took, before, after = in_thread(niced)
    assert after == before  # never raised back (as root it could be, silently)
    if _sched.thread_slice_ns() is not None:
        assert took
