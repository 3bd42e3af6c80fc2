"""In-process gradient reduction: asyncddp's all-reduce of n replicas, against ``copy_``.

Run:  python bench/allreduce.py            (about a minute)
      python bench/allreduce.py --quick

For n replicas on ``cpu_devices(n)`` holding ``size`` MB of float32 gradients each, one
all-reduce is what the Trainer runs in one process: every worker sums its chunk of every
replica and writes the sum into every replica (``all_reduce_chunk``), one scheduler step timed
end to end, its hand-offs included. The figure is *algorithm bandwidth*:
the gradient bytes of one replica over the time, as NCCL reports it. The baseline is
``dst.copy_(src)`` of the same bytes in the same process (torch's own threads), the cheapest
possible pass over them. Target: at least 0.5x the copy bandwidth.

On one memory system that target can only hold for 2 replicas: an all-reduce of n replicas must
read all n buffers and write all n, at least n times the bytes of one copy, so its algorithm
bandwidth is at most 1/n of the copy's. The last column says how close to that bound each run
gets.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
from torch import nn

import asyncddp
from asyncddp._sync import FlatGrads, all_reduce_chunk


async def reduce_time(replicas: int, megabytes: int, repeats: int) -> float:
    numel = megabytes * 2**20 // 4
    devices = asyncddp.cpu_devices(replicas)
    grads = [
        FlatGrads([nn.Parameter(torch.zeros(numel))], replicas, index) for index in range(replicas)
    ]
    for replica in grads:
        replica.buffers[0].normal_()

    def reduce(ctx: asyncddp.WorkerContext, _: None) -> None:
        # Scale 1.0: the trainer weights the loss before backward, so the sum is the mean.
        all_reduce_chunk(grads, ctx.device.index, 1.0, want_norm=False)

    times = []
    async with asyncddp.StepScheduler(devices) as scheduler:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            await scheduler.run(reduce, [None] * replicas)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def copy_time(megabytes: int, repeats: int) -> float:
    source = torch.randn(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 50, 100], help="MB")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.replicas, args.repeats = [10], [2], 2
    print(
        f"algorithm bandwidth in GB/s, median of {args.repeats}; {torch.get_num_threads()} threads"
    )
    print(
        f"{'MB':>5} {'copy_':>8}"
        + "".join(f" {f'{n} replicas':>12} {'ratio':>6} {'of 1/n':>6}" for n in args.replicas)
    )
    ratios = []
    for megabytes in args.sizes:
        gigabytes = megabytes * 2**20 / 1e9
        copy = gigabytes / copy_time(megabytes, args.repeats)
        row = f"{megabytes:>5} {copy:>8.2f}"
        for replicas in args.replicas:
            ours = gigabytes / await reduce_time(replicas, megabytes, args.repeats)
            row += f" {ours:>12.2f} {ours / copy:>5.2f}x {ours / copy * replicas:>6.2f}"
            ratios.append((replicas, megabytes, ours / copy))
        print(row)
    for replicas, megabytes, ratio in sorted(ratios):
        print(
            f"  {replicas} replicas, {megabytes} MB / copy_  {ratio:.2f}x"
            f"  (at most {1 / replicas:.3g}x in one memory)  (target >= 0.5x)"
        )


if __name__ == "__main__":
    asyncio.run(main())
