"""Soak: 10,000 steps on cpu_devices(4): memory, threads and event buffers stay flat.

Run:  python bench/soak.py            (about a minute)
      python bench/soak.py --quick

A small model trains for 10,000 optimizer steps (100 epochs of 100 batches) on 4 CPU workers,
with an event stream nobody reads. After a warm-up epoch the script samples, after every epoch:
resident memory (from /proc/self/statm), the process's OS threads (/proc/self/status) and the
unread stream's length. Targets: resident memory within 5% of the first sample, no thread growth,
the stream bounded at its maxlen (the oldest events dropped, counted).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import resource

import torch
import torch.nn.functional as F

import asyncddp


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def os_threads() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return -1


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.batches = 5, 20
    torch.manual_seed(0)
    batches = [(torch.randn(32, 16), torch.randn(32, 1)) for _ in range(args.batches)]
    trainer = asyncddp.Trainer(
        torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)),
        functools.partial(torch.optim.Adam, lr=1e-3),
        lambda model, batch: F.mse_loss(model(batch[0]), batch[1]),
        devices=asyncddp.cpu_devices(4),
        progress_bar=False,
    )
    unread = trainer.events(maxlen=1000)
    await trainer.fit(batches, epochs=1)  # warm-up: allocator, threads, first optimizer
    samples = []
    for epoch in range(2, args.epochs + 1):
        await trainer.fit(batches, epochs=epoch)
        samples.append((trainer.global_step, rss_mb(), os_threads(), len(unread._queue)))
    first, last = samples[0], samples[-1]
    peak = max(sample[1] for sample in samples)
    print(f"{trainer.global_step} steps on cpu_devices(4), {len(samples)} samples after warm-up")
    print(f"  resident memory: first {first[1]:.1f} MB, last {last[1]:.1f} MB, peak {peak:.1f} MB")
    print(f"  resident memory last/first  {last[1] / first[1]:.3f}x  (target <= 1.05x)")
    print(
        f"  OS threads: first {first[2]}, last {last[2]}, max {max(s[2] for s in samples)} "
        f"(pid {os.getpid()})"
    )
    print(
        f"  unread event stream: {last[3]} events buffered (maxlen 1000), {unread.dropped} dropped"
    )


if __name__ == "__main__":
    asyncio.run(main())
