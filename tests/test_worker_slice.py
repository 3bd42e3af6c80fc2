"""CPU workers ask Linux for a long scheduler slice (``asyncddp._sched``), and only that."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed import HashStore

from asyncddp import StepScheduler, WorkerContext, _sched, cpu_devices

pytestmark = pytest.mark.anyio

#: The kernel reports a fair thread's slice (Linux 6.12 and later); before, it reports none.
custom_slices = pytest.mark.skipif(
    not (_sched.thread_slice_ns() or 0),
    reason="needs Linux 6.12 or later (custom scheduler slices); this kernel reports none",
)

WORKER_SLICE_NS = int(_sched.WORKER_SLICE_MS * 1_000_000)


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread of its own (a thread's slice is its own); its value."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def own_slice(ctx: WorkerContext, shard: object) -> int | None:
    return _sched.thread_slice_ns()


@custom_slices
async def test_cpu_workers_run_with_the_long_slice_and_the_event_loop_keeps_its_own() -> None:
    loop_slice = _sched.thread_slice_ns()
    async with StepScheduler(cpu_devices(2)) as scheduler:
        result = await scheduler.run(own_slice, [None, None])
    assert result.outputs == (WORKER_SLICE_NS, WORKER_SLICE_NS)
    assert loop_slice != WORKER_SLICE_NS
    assert _sched.thread_slice_ns() == loop_slice


@custom_slices
async def test_the_slice_can_be_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCDDP_WORKER_SLICE_MS", "0")
    default = in_thread(_sched.thread_slice_ns)
    async with StepScheduler(cpu_devices(1)) as scheduler:
        result = await scheduler.run(own_slice, [None])
    assert result.outputs == (default,)
    assert default != WORKER_SLICE_NS


@custom_slices
@pytest.mark.parametrize("chosen", [None, "30"])
async def test_in_a_process_group_workers_keep_the_default_slice_unless_one_is_chosen(
    monkeypatch: pytest.MonkeyPatch, chosen: str | None
) -> None:
    if chosen is not None:
        monkeypatch.setenv("ASYNCDDP_WORKER_SLICE_MS", chosen)
    default = in_thread(_sched.thread_slice_ns)
    torch.distributed.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        async with StepScheduler(cpu_devices(1)) as scheduler:
            result = await scheduler.run(own_slice, [None])
    finally:
        torch.distributed.destroy_process_group()
    assert result.outputs == ((default,) if chosen is None else (30_000_000,))
    assert default != 30_000_000


@custom_slices
def test_threads_a_worker_starts_inherit_its_slice() -> None:
    def worker() -> int | None:
        assert _sched.prefer_throughput()
        return in_thread(_sched.thread_slice_ns)  # as an OpenMP team's threads start

    assert in_thread(worker) == WORKER_SLICE_NS


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="needs os.setpriority (Unix)")
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


def test_elsewhere_nothing_happens_and_nothing_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_sched.platform, "machine", lambda: "an unknown machine")
    assert in_thread(_sched.prefer_throughput) is False
    assert in_thread(_sched.thread_slice_ns) is None


@pytest.mark.parametrize("value", ["0", "-5", "not a number"])
def test_a_slice_of_zero_or_nonsense_changes_nothing_or_falls_back(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("ASYNCDDP_WORKER_SLICE_MS", value)
    if value == "not a number":
        assert _sched._slice_ms() == _sched.WORKER_SLICE_MS
    else:
        assert _sched._slice_ms() == 0.0
        assert in_thread(_sched.prefer_throughput) is False
