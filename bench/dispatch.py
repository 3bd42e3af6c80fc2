"""Per-step dispatch overhead of StepScheduler.run, beside two baselines in the same run.

Run:  python bench/dispatch.py            (about a minute on 2 cores)
      python bench/dispatch.py --quick    (a smoke run)

Each step runs a no-op job on every device, so what is timed is the cost of fanning out and
gathering, nothing else:

- asyncddp:        await scheduler.run(noop, shards)
- run_in_executor: one loop.run_in_executor per device inside an asyncio.TaskGroup
- blocking:        concurrent.futures submit() per device, then result() on each (blocks the
                   caller: the floor for thread hand-off without an event loop)

The three are interleaved in rounds and each figure is the median over rounds, since shared
machines are noisy. Ratios below 1.0 mean asyncddp is cheaper. Targets at 2 devices:
asyncddp / run_in_executor <= 0.5 and asyncddp / blocking <= 1.0.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import asyncddp


def noop(*args: object) -> None:
    return None


async def time_asyncddp(scheduler: asyncddp.StepScheduler, shards: list[None], steps: int) -> float:
    run = scheduler.run
    start = time.perf_counter()
    for _ in range(steps):
        await run(noop, shards)
    return (time.perf_counter() - start) / steps


async def time_run_in_executor(executor: ThreadPoolExecutor, devices: int, steps: int) -> float:
    loop = asyncio.get_running_loop()

    async def one() -> None:
        await loop.run_in_executor(executor, noop)

    start = time.perf_counter()
    for _ in range(steps):
        async with asyncio.TaskGroup() as group:
            for _ in range(devices):
                group.create_task(one())
    return (time.perf_counter() - start) / steps


def time_blocking(executor: ThreadPoolExecutor, devices: int, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        futures = [executor.submit(noop) for _ in range(devices)]
        for future in futures:
            future.result()
    return (time.perf_counter() - start) / steps


async def measure(devices: int, steps: int, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"asyncddp": [], "run_in_executor": [], "blocking": []}
    with ThreadPoolExecutor(max_workers=devices) as executor:
        async with asyncddp.StepScheduler(asyncddp.cpu_devices(devices)) as scheduler:
            shards: list[None] = [None] * devices
            # Warm up: start the pool's threads, fill caches.
            await time_asyncddp(scheduler, shards, steps // 10 + 1)
            await time_run_in_executor(executor, devices, steps // 10 + 1)
            time_blocking(executor, devices, steps // 10 + 1)
            for _ in range(rounds):
                times["asyncddp"].append(await time_asyncddp(scheduler, shards, steps))
                times["run_in_executor"].append(
                    await time_run_in_executor(executor, devices, steps)
                )
                times["blocking"].append(time_blocking(executor, devices, steps))
    return {name: statistics.median(values) for name, values in times.items()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=2000, help="steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 200, 3
    print(f"no-op step, median of {args.rounds} rounds x {args.steps} steps; times in us/step")
    header = (
        f"{'devices':>7}  {'asyncddp':>9}  {'run_in_executor':>15}  {'blocking':>9}"
        f"  {'vs executor':>11}  {'vs blocking':>11}"
    )
    print(header)
    for devices in args.devices:
        result = await measure(devices, args.steps, args.rounds)
        ours = result["asyncddp"]
        print(
            f"{devices:>7}  {ours * 1e6:>9.1f}  {result['run_in_executor'] * 1e6:>15.1f}"
            f"  {result['blocking'] * 1e6:>9.1f}  {ours / result['run_in_executor']:>10.2f}x"
            f"  {ours / result['blocking']:>10.2f}x"
        )


if __name__ == "__main__":
    asyncio.run(main())
