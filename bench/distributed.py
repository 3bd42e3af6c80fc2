"""Across processes: asyncddp on 2 ranks against DistributedDataParallel, same work.

Run:  python bench/distributed.py            (a few minutes on 2 cores)
      python bench/distributed.py --quick    (a smoke run)

Both contenders run 2 processes on localhost over gloo, one CPU device each, half the CPU
threads each, the same model (throughput.py's MLP 512-1024-10 and convnet) and the same global
batch of 256 per step: 128 items per rank.

- ddp-gloo-2:      ``DistributedDataParallel``, a plain loop in each process (throughput.py's);
- asyncddp-2proc:  ``asyncddp.distributed.init()`` and ``Trainer(devices="cpu")`` in each
                   process; the trainer gives each rank every other half-batch of one list;
                   and the same with ``atomic_steps=False`` (no copy of the parameters and
                   optimizer state before each step to undo a failed one: DDP keeps none).

Figures: training samples per second over both ranks (rank 0's clock, after a warm-up), median
of several rounds, the contenders interleaved. Target: asyncddp at least as fast as DDP (>= 1.0x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from typing import Any

import torch
from throughput import BATCH, SGD, WORKLOADS, ddp_gloo, make_batches, run_two_ranks, step

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

        async def run() -> float:
            torch.manual_seed(0)
            trainer = asyncddp.Trainer(
                make(), SGD, step, devices="cpu", progress_bar=False, atomic_steps=atomic
            )
            await trainer.fit(halves[:6], epochs=1)  # warm-up: threads, replica, first steps
            result = await trainer.fit(halves, epochs=2)
            return steps * BATCH / result.history[-1].seconds

        samples_per_second = asyncio.run(run())
        if rank == 0:
            results.put(samples_per_second)
    finally:
        asyncddp.distributed.destroy()


def asyncddp_2proc(workload: str, steps: int, threads: int, atomic: bool = True) -> float:
    return run_two_ranks(
        _asyncddp_rank, max(1, threads // 2), workload, steps, atomic, name="asyncddp"
    )


NO_BACKUP = "asyncddp-2proc atomic_steps=False"


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
        figures: dict[str, list[float]] = {"ddp-gloo-2": [], "asyncddp-2proc": [], NO_BACKUP: []}
        for _ in range(args.rounds):
            figures["ddp-gloo-2"].append(ddp_gloo(name, shape, args.steps, threads))
            figures["asyncddp-2proc"].append(asyncddp_2proc(name, args.steps, threads))
            figures[NO_BACKUP].append(asyncddp_2proc(name, args.steps, threads, atomic=False))
        median = {key: statistics.median(values) for key, values in figures.items()}
        print(f"\n{name}")
        for key, value in median.items():
            print(f"  {key:<31} {value:>7.0f} samples/s  ({1e3 * BATCH / value:6.2f} ms/step)")
        ratio = median["asyncddp-2proc"] / median["ddp-gloo-2"]
        print(f"  asyncddp-2proc / ddp-gloo-2  {ratio:.2f}x  (target >= 1.0x)")
        ratio = median[NO_BACKUP] / median["ddp-gloo-2"]
        print(f"  {NO_BACKUP} / ddp-gloo-2  {ratio:.2f}x  (no undo, as DDP)")


if __name__ == "__main__":
    main()
