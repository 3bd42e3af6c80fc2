"""Across processes: asyncddp on 2 ranks against DistributedDataParallel, same work.

Run:  python bench/distributed.py            (a few minutes on 2 cores)
      python bench/distributed.py --quick    (a smoke run)

Both contenders run 2 processes on localhost over gloo, one CPU device each, half the CPU
threads each, the same model (throughput.py's MLP 512-1024-10 and convnet) and the same global
batch of 256 per step: 128 items per rank.

- ddp-gloo-2:      ``DistributedDataParallel``, a plain loop in each process (throughput.py's);
- ddp-gloo-2 handed off: the same, each step handed from an event loop to a worker thread and
                   awaited (throughput.py's ``HandOff``): what DDP would cost an async program
                   that keeps its event loop free, the floor of a design that hands each step
                   to a thread and awaits it, as asyncddp does;
- asyncddp-2proc:  ``asyncddp.distributed.init()`` and ``Trainer(devices="cpu")`` in each
                   process; the trainer gives each rank every other half-batch of one list;
                   and the same with ``atomic_steps=False`` (no copy of the parameters and
                   optimizer state before each step to undo a failed one: DDP keeps none).

Figures: training samples per second over both ranks (rank 0's clock; every contender timed on
a second pass over the batches, on the threads of the first: see throughput.py), median
of several rounds, the contenders interleaved. Target: asyncddp at least as fast as DDP (>= 1.0x).
Beside them, rank 0's CPU time a step (``time.process_time``, every thread of its process: the
step's own work, the threads' hand-offs, gloo's threads) and, for asyncddp, how much of it ran on
the event loop's thread (``time.thread_time``): with one core per process, CPU a step more than
DDP's is wall time a step more.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import anyio
import torch
from throughput import (
    BATCH,
    SGD,
    WORKLOADS,
    ddp_gloo,
    make_batches,
    ratio_line,
    run_two_ranks,
    step,
)

import asyncddp
import asyncddp.distributed


def _asyncddp_rank(
    rank: int, port: int, threads: int, workload: str, steps: int, atomic: bool, results: Any
) -> None:
    torch.set_num_threads(threads)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    asyncddp.distributed.init("gloo")
    try:
        make, shape = WORKLOADS[workload]
        # Every half-batch in one list: rank r trains on half-batches r, r + 2, ..., so each
        # step's global batch is the same 256 items that DDP's two ranks share.
        halves = [
            (x[part::2], y[part::2]) for x, y in make_batches(shape, steps) for part in range(2)
        ]

        async def run() -> tuple[float, float, float]:
            torch.manual_seed(0)
            trainer = asyncddp.Trainer(
                make(), SGD, step, devices="cpu", progress_bar=False, atomic_steps=atomic
            )
            marks: list[tuple[float, float]] = []  # CPU clocks as each epoch ends
            events = trainer.events()

            async def mark_epochs() -> None:
                async for event in events:
                    if isinstance(event, asyncddp.EpochEnded):
                        marks.append((time.process_time(), time.thread_time()))

            async with anyio.create_task_group() as group:
                group.start_soon(mark_epochs)
                # The first epoch is the warm-up: the fit's threads start with it.
                result = await trainer.fit(halves, epochs=2)
            (cpu0, loop0), (cpu1, loop1) = marks
            seconds = result.history[-1].seconds
            return (
                steps * BATCH / seconds,
                1e3 * (cpu1 - cpu0) / steps,
                1e3 * (loop1 - loop0) / steps,
            )

        figures = asyncio.run(run())
        if rank == 0:
            results.put(figures)
    finally:
        asyncddp.distributed.destroy()


def asyncddp_2proc(
    workload: str, steps: int, threads: int, atomic: bool = True
) -> tuple[float, float, float]:
    """Samples per second, and rank 0's CPU time a step in ms: its whole process's, and its
    event loop thread's."""
    samples_per_second, cpu, loop = run_two_ranks(
        _asyncddp_rank, max(1, threads // 2), workload, steps, atomic, name="asyncddp"
    )
    return float(samples_per_second), float(cpu), float(loop)


NO_BACKUP = "asyncddp-2proc atomic_steps=False"
HANDED_OFF = "ddp-gloo-2 handed off"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 8, 1
    threads = torch.get_num_threads()
    print(
        f"samples/s over 2 processes x 1 CPU device (gloo), global batch {BATCH}, "
        f"{max(1, threads // 2)} threads per process, median of {args.rounds} rounds x "
        f"{args.steps} steps (torch {torch.__version__}, {os.cpu_count()} CPUs)"
    )
    for name, (_, shape) in WORKLOADS.items():
        figures: dict[str, list[tuple[float, ...]]] = {
            "ddp-gloo-2": [],
            HANDED_OFF: [],
            "asyncddp-2proc": [],
            NO_BACKUP: [],
        }
        for _ in range(args.rounds):
            figures["ddp-gloo-2"].append(ddp_gloo(name, shape, args.steps, threads))
            figures[HANDED_OFF].append(ddp_gloo(name, shape, args.steps, threads, handoff=True))
            figures["asyncddp-2proc"].append(asyncddp_2proc(name, args.steps, threads))
            figures[NO_BACKUP].append(asyncddp_2proc(name, args.steps, threads, atomic=False))
        median = {
            key: [statistics.median(column) for column in zip(*rows, strict=True)]
            for key, rows in figures.items()
        }
        print(f"\n{name}")
        print(f"  {'':<33} {'samples/s':>9} {'ms/step':>8} {'CPU ms/step':>12} {'of it, loop':>12}")
        for key, (value, cpu, *loop) in median.items():
            looped = f"{loop[0]:>12.2f}" if loop else f"{'':>12}"
            print(f"  {key:<33} {value:>9.0f} {1e3 * BATCH / value:>8.2f} {cpu:>12.2f} {looped}")
        ours, ddp = median["asyncddp-2proc"], median["ddp-gloo-2"]
        rates = {key: [row[0] for row in rows] for key, rows in figures.items()}
        for top, note in (
            ("asyncddp-2proc", "(target >= 1.0x)"),
            (NO_BACKUP, "(no undo, as DDP)"),
            (HANDED_OFF, "(the floor of a free event loop)"),
        ):
            line = ratio_line(top, "ddp-gloo-2", rates[top], rates["ddp-gloo-2"], False)
            print(f"  {line}  {note}")
        print(f"  CPU a step, asyncddp over DDP: {ours[1] - ddp[1]:+.2f} ms (rank 0's process)")


if __name__ == "__main__":
    main()
