"""Event-loop lag while training: a 1 ms ticker on the same loop as ``fit``.

Run:  python bench/loop_lag.py            (about half a minute)
      python bench/loop_lag.py --quick

A task sleeps 1 ms in a loop and records how late each wake-up is. It runs beside:

- asyncddp: ``await trainer.fit(...)`` on ``cpu_devices(2)`` (the MLP 512-1024-10, batch 256),
  which keeps every core busy;
- asyncddp, a core free: the same on one worker with one thread, leaving a core to the loop;
- asyncddp, default slice: the first row with the workers left at the kernel's default
  scheduler slice (``ASYNCDDP_WORKER_SLICE_MS=0``; see ``asyncddp/_sched.py``), as before they
  asked for a long one: on Linux 6.12 and later what the long slice changes, elsewhere nothing;
- blocking: the same training as a plain loop called from a coroutine, which is what a
  training library without async support does to an event loop.

Target: p99 lag at most 2 ms beside asyncddp.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import torch
from throughput import SGD, make_batches, mlp, step, train

import asyncddp

SLICE_VARIABLE = "ASYNCDDP_WORKER_SLICE_MS"  # read by each worker as it starts


async def ticker(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        before = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - before - 0.001)


async def beside(train: object, steps: int) -> list[float]:
    lags: list[float] = []
    stop = asyncio.Event()
    task = asyncio.create_task(ticker(lags, stop))
    await asyncio.sleep(0.05)  # the ticker's own baseline
    lags.clear()
    await train  # type: ignore[misc]
    stop.set()
    await task
    return lags


async def train_asyncddp(
    batches: list[object], epochs: int, devices: int = 2, threads: int | None = None
) -> None:
    torch.manual_seed(0)
    trainer = asyncddp.Trainer(
        mlp(),
        SGD,
        step,
        devices=asyncddp.cpu_devices(devices),
        progress_bar=False,
        threads_per_worker=threads,
    )
    await trainer.fit(batches, epochs=epochs)


async def train_default_slice(batches: list[object], epochs: int) -> None:
    """The same training, its workers at the kernel's default slice (read as they start)."""
    saved = os.environ.get(SLICE_VARIABLE)
    os.environ[SLICE_VARIABLE] = "0"
    try:
        await train_asyncddp(batches, epochs)
    finally:
        if saved is None:
            del os.environ[SLICE_VARIABLE]
        else:
            os.environ[SLICE_VARIABLE] = saved


async def train_blocking(batches: list[object], epochs: int) -> None:
    torch.manual_seed(0)
    model = mlp()
    optimizer = SGD(model.parameters())
    for _ in range(epochs):
        train(model, optimizer, batches)  # no await: the loop is blocked for the whole run


def describe(name: str, lags: list[float]) -> str:
    ordered = sorted(lags)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (
        f"  {name:<13} ticks {len(lags):>5}   p50 {1e3 * statistics.median(ordered):7.3f} ms   "
        f"p99 {1e3 * p99:8.3f} ms   max {1e3 * ordered[-1]:8.3f} ms"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="batches per epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.epochs = 10, 1
    # The first optimizer a process builds imports torch._dynamo, holding the GIL for up to
    # ~130 ms at a time (see docs/services.md): pay it before measuring, as a service would.
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters())
    batches = make_batches((512,), args.steps)
    print(f"lag of a 1 ms ticker, {args.epochs} epochs x {args.steps} steps of the MLP, batch 256")
    ours = await beside(train_asyncddp(batches, args.epochs), args.steps)
    spare = await beside(train_asyncddp(batches, args.epochs, devices=1, threads=1), args.steps)
    default = await beside(train_default_slice(batches, args.epochs), args.steps)
    blocked = await beside(train_blocking(batches, args.epochs), args.steps)
    print(describe("asyncddp", ours))
    print(describe("1 core free", spare))
    print(describe("default slice", default))
    print(describe("blocking", blocked))
    ordered = sorted(ours)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    print(f"  asyncddp p99 {1e3 * p99:.3f} ms (target <= 2 ms)")


if __name__ == "__main__":
    asyncio.run(main())
