"""Where a training step's time goes: each phase of asyncddp's step, timed on the workers.

Run:  python bench/phases.py            (about half a minute on 2 cores)
      python bench/phases.py --quick

Trains the MLP 512-1024-10 (global batch 256, SGD with momentum) on ``cpu_devices(1)``, on
``cpu_devices(2)``, and on 2 without the step backup (``atomic_steps=False``), with timers
wrapped around the pieces of a step's job on each worker: forward and backward, the waits at
the devices' meetings, the all-reduce (each worker's chunk), the backup of the parameters and
optimizer state (``atomic_steps``; one device copies it ahead, after its job has
reported, while the event loop handles the results), the optimizer step, and the whole job.
What is left of the step's wall time is the time between two steps' jobs: the hand-off to the
workers and back, the event loop's own work on the step's results, and a copy made ahead that
outlasts it.

Everything is timed in the second epoch of a fit, the first one warming up the threads the fit
started (see throughput.py). Each piece is the median over the steps of its time on any worker,
in ms; so is the time between two steps' jobs (from the last job of one step to end to the first
of the next to start). The step's wall time is the epoch's time over its steps in the same run, timers
included (they cost a few microseconds each); it is a mean, so it also carries the slow steps
that medians leave out. Last, the event loop thread's CPU time a step (``time.thread_time()``
read as each epoch ends): what the loop's own work costs, which the workers wait for between
two steps' jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import torch
from throughput import BATCH, SGD, make_batches, mlp, step

import asyncddp
from asyncddp import _jobs, _sync

PIECES = {  # what is timed: (where it is, its name there)
    "forward+backward": (_jobs.Jobs, "train"),
    "meetings": (_jobs.Meeting, "wait"),
    "all-reduce": (_jobs, "all_reduce_chunk"),
    "backup": (_sync.StepBackup, "capture"),
    "backup made ahead": (_sync.StepBackup, "prepare"),
    "optimizer step": (torch.optim.SGD, "step"),
    "whole job": (_jobs.Jobs, "train_and_step"),
}


def timing(
    pieces: Mapping[str, tuple[Any, str]], record: Callable[[str, float, float, float], None]
) -> Callable[[], None]:
    """Wrap every piece, ``(where it is, its name there)``, with a timer that calls
    ``record(piece, start, end, cpu)`` as each call returns (wall clock, and the CPU seconds of
    the thread that made the call); returns the undo."""
    undo = []
    for piece, (owner, name) in pieces.items():
        original = getattr(owner, name)

        def timed(*args: Any, _piece: str = piece, _fn: Any = original, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return _fn(*args, **kwargs)
            finally:
                record(_piece, start, time.perf_counter(), time.thread_time() - cpu)

        setattr(owner, name, timed)
        undo.append((owner, name, original))

    def restore() -> None:
        for owner, name, original in undo:
            setattr(owner, name, original)

    return restore


def per_thread(recorded: list[tuple[str, float, float]]) -> list[list[tuple[float, float]]]:
    """The (start, end) spans of each worker thread, in the order they ran."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for thread, start, end in recorded:
        spans.setdefault(thread, []).append((start, end))
    return list(spans.values())


async def measure(devices: int, steps: int, atomic: bool = True) -> dict[str, float]:
    """The median ms of each piece, per step and worker, the step's wall time, and the event
    loop thread's CPU time a step."""
    spans: dict[str, list[tuple[str, float, float]]] = {piece: [] for piece in PIECES}
    batches = make_batches((512,), steps)
    torch.manual_seed(0)
    trainer = asyncddp.Trainer(
        mlp(),
        SGD,
        step,
        devices=asyncddp.cpu_devices(devices),
        progress_bar=False,
        atomic_steps=atomic,
    )
    loop_cpu: list[float] = []  # the event loop thread's CPU clock as each epoch ends
    events = trainer.events()

    async def mark_epochs() -> None:
        async for event in events:
            if isinstance(event, asyncddp.EpochEnded):
                loop_cpu.append(time.thread_time())

    def record(piece: str, start: float, end: float, cpu: float) -> None:
        spans[piece].append((threading.current_thread().name, start, end))

    restore = timing(PIECES, record)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(mark_epochs)
            # The first epoch warms the threads up.
            result = await trainer.fit(batches, epochs=2)
    finally:
        restore()
    for recorded in spans.values():  # the second epoch's: the later half, each epoch
        recorded.sort(key=lambda span: span[1])  # recording as many of every piece
        del recorded[: len(recorded) // 2]
    figures = {}
    for piece, recorded in spans.items():
        if piece == "meetings":  # two a step on each worker: their sum, step by step
            totals = [
                sum(end - start for start, end in spans[i : i + 2])
                for spans in per_thread(recorded)
                for i in range(0, len(spans), 2)
            ]
        else:
            totals = [end - start for _, start, end in recorded]
        figures[piece] = 1e3 * statistics.median(totals) if totals else 0.0
    figures["step (wall)"] = 1e3 * result.history[-1].seconds / steps
    # From the last job of a step to end to the first of the next one to start.
    jobs = list(zip(*per_thread(spans["whole job"]), strict=True))  # a step: one job a worker
    gaps = [
        min(start for start, _ in jobs[i + 1]) - max(end for _, end in jobs[i])
        for i in range(len(jobs) - 1)
    ]
    figures["between two steps' jobs"] = 1e3 * statistics.median(gaps)
    figures["event loop's CPU"] = 1e3 * (loop_cpu[1] - loop_cpu[0]) / steps
    return figures


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    steps = 10 if args.quick else args.steps
    print(
        f"ms a step, MLP 512-1024-10, global batch {BATCH}, SGD with momentum, median of "
        f"{steps} steps; {torch.get_num_threads()} CPU threads in all (torch {torch.__version__})"
    )
    runs = {
        "1 device": await measure(1, steps),
        "2 devices": await measure(2, steps),
        "2, no backup": await measure(2, steps, atomic=False),
    }
    print(f"\n  {'':<24}" + "".join(f"{name:>14}" for name in runs))
    for piece in [*PIECES, "between two steps' jobs", "step (wall)", "event loop's CPU"]:
        row = "".join(f"{runs[name][piece]:>14.3f}" for name in runs)
        print(f"  {piece:<24}{row}")


if __name__ == "__main__":
    asyncio.run(main())
