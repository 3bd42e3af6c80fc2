"""Event-loop lag while training: a 1 ms ticker on the same loop as ``fit``.

Run:  python bench/loop_lag.py            (about half a minute)
      python bench/loop_lag.py --quick
      python bench/loop_lag.py --slice-cost   (what the workers' long scheduler slice costs
                                             training in one process, in turns; ~2 minutes)

A task sleeps 1 ms in a loop and records how late each wake-up is. It runs beside:

- asyncddp: ``await trainer.fit(...)`` on ``cpu_devices(2)`` (the MLP 512-1024-10, batch 256),
  which keeps every core busy;
- asyncddp, one device: the same on one CPU device with every thread (``devices="cpu"``, what
  ``"auto"`` gives without a GPU): every core busy, as in the first row, but one worker thread
  running Python beside the loop instead of two;
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
from throughput import SGD, make_batches, mlp, step, train, worker_slice

import asyncddp


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
) -> asyncddp.FitResult:
    torch.manual_seed(0)
    trainer = asyncddp.Trainer(
        mlp(),
        SGD,
        step,
        devices=asyncddp.cpu_devices(devices),
        progress_bar=False,
        threads_per_worker=threads,
    )
    return await trainer.fit(batches, epochs=epochs)


async def train_default_slice(batches: list[object], epochs: int) -> None:
    """The same training, its workers at the kernel's default slice (read as they start)."""
    with worker_slice("0"):
        await train_asyncddp(batches, epochs)


#: ``--slice-cost``'s set-ups: (name, CPU workers, threads per worker, fits side by side).
SLICE_SETUPS = (
    ("2 workers x 1 thread", 2, 1, 1),
    ("1 worker x 2 threads", 1, 2, 1),
    ("2 workers x 2 threads", 2, 2, 1),
    ("two fits of 2 x 1 at once", 2, 1, 2),
)


async def samples_per_second(batches: list[object], devices: int, threads: int, fits: int) -> float:
    """Samples per second of ``fits`` fits side by side, each 2 epochs on ``devices`` CPU
    workers (the second epoch timed: the threads warm)."""

    async def one() -> float:
        result = await train_asyncddp(batches, 2, devices, threads)
        return len(batches) * 256 / result.history[-1].seconds

    return sum(await asyncio.gather(*(one() for _ in range(fits))))


async def slice_cost(batches: list[object], rounds: int) -> None:
    """Training speed with the workers' long slice over the kernel's default, in turns."""
    speed: dict[tuple[str, bool], list[float]] = {}
    for index in range(rounds):
        for long in (True, False) if index % 2 == 0 else (False, True):
            # asyncddp's default (the long slice, outside a process group), or the kernel's
            with worker_slice(None if long else "0"):
                for name, devices, threads, fits in SLICE_SETUPS:
                    figure = await samples_per_second(batches, devices, threads, fits)
                    speed.setdefault((name, long), []).append(figure)
    print(
        f"samples/s with the CPU workers' long scheduler slice over the kernel's default, the "
        f"MLP, in turns, median of {rounds} rounds ({os.cpu_count()} CPUs)"
    )
    for name, *_ in SLICE_SETUPS:
        ratios = [a / b for a, b in zip(speed[(name, True)], speed[(name, False)], strict=True)]
        low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(
            f"  {name:<26} {statistics.median(ratios):.3f}x (the rounds' quartiles "
            f"{low:.3f}..{high:.3f}; faster in {sum(r > 1 for r in ratios)} of {len(ratios)})"
        )


async def train_blocking(batches: list[object], epochs: int) -> None:
    torch.manual_seed(0)
    model = mlp()
    optimizer = SGD(model.parameters())
    for _ in range(epochs):
        train(model, optimizer, batches)  # no await: the loop is blocked for the whole run


def p99_of(lags: list[float]) -> float:
    ordered = sorted(lags)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def describe(name: str, lags: list[float]) -> str:
    ordered, p99 = sorted(lags), p99_of(lags)
    return (
        f"  {name:<13} ticks {len(lags):>5}   p50 {1e3 * statistics.median(ordered):7.3f} ms   "
        f"p99 {1e3 * p99:8.3f} ms   max {1e3 * ordered[-1]:8.3f} ms"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="batches per epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--slice-cost",
        action="store_true",
        help="training speed with the workers' long scheduler slice and without, in turns",
    )
    parser.add_argument("--rounds", type=int, default=8, help="--slice-cost's rounds")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.epochs, args.rounds = 10, 1, 1
    # The first optimizer a process builds imports torch._dynamo, holding the GIL for up to
    # ~130 ms at a time (see docs/services.md): pay it before measuring, as a service would.
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters())
    batches = make_batches((512,), args.steps)
    if args.slice_cost:
        await slice_cost(batches, args.rounds)
        return
    print(f"lag of a 1 ms ticker, {args.epochs} epochs x {args.steps} steps of the MLP, batch 256")
    ours = await beside(train_asyncddp(batches, args.epochs), args.steps)
    whole = await beside(train_asyncddp(batches, args.epochs, devices=1), args.steps)
    spare = await beside(train_asyncddp(batches, args.epochs, devices=1, threads=1), args.steps)
    default = await beside(train_default_slice(batches, args.epochs), args.steps)
    blocked = await beside(train_blocking(batches, args.epochs), args.steps)
    print(describe("asyncddp", ours))
    print(describe("one device", whole))
    print(describe("1 core free", spare))
    print(describe("default slice", default))
    print(describe("blocking", blocked))
    print(f"  asyncddp (2 CPU workers) p99 {1e3 * p99_of(ours):.3f} ms (target <= 2 ms)")
    print(f"  one device (every core) p99 {1e3 * p99_of(whole):.3f} ms (target <= 2 ms)")


if __name__ == "__main__":
    asyncio.run(main())
