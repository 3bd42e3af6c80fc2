"""Per-step dispatch overhead of StepScheduler.run, beside two baselines in the same run.

Run:  python bench/dispatch.py            (about a minute on 2 cores)
      python bench/dispatch.py --quick    (a smoke run)

Each step runs a no-op job on every device, so what is timed is the cost of fanning out and
gathering, nothing else:

- asyncddp:        await scheduler.run(noop, shards)
- run_in_executor: one loop.run_in_executor per device inside an asyncio.TaskGroup
- blocking:        concurrent.futures submit() per device, then result() on each (blocks the
                   caller). Its pool shares one queue, so one thread may run every no-op.
- hand-off floor:  what any design with one thread per device pays: a bare queue per thread,
                   one counter and one loop wake-up per step, none of asyncddp's bookkeeping
                   (context capture, failure handling, progress). Printed to show where the
                   time goes: asyncddp minus this is asyncddp's own overhead.

The three are interleaved in rounds and each figure is the median over rounds, since shared
machines are noisy. Ratios below 1.0 mean asyncddp is cheaper. Targets at 2 devices:
asyncddp / run_in_executor <= 0.5 and asyncddp / blocking <= 1.0.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import queue
import statistics
import threading
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


class HandOffFloor:
    """One thread per device, a bare queue each, one loop wake-up per step."""

    def __init__(self, devices: int, loop: asyncio.AbstractEventLoop) -> None:
        self.devices = devices
        self.loop = loop
        self.queues: list[
            queue.SimpleQueue[tuple[itertools.count[int], asyncio.Future[None]] | None]
        ]
        self.queues = [queue.SimpleQueue() for _ in range(devices)]
        self.threads = [threading.Thread(target=self._work, args=(q,)) for q in self.queues]
        for thread in self.threads:
            thread.start()

    def _work(
        self, jobs: queue.SimpleQueue[tuple[itertools.count[int], asyncio.Future[None]] | None]
    ) -> None:
        while (job := jobs.get()) is not None:
            done, future = job
            noop()
            if next(done) == self.devices:  # the last device to finish wakes the loop
                self.loop.call_soon_threadsafe(future.set_result, None)

    async def time(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            job = (itertools.count(1), self.loop.create_future())
            for jobs in self.queues:
                jobs.put(job)
            await job[1]
        return (time.perf_counter() - start) / steps

    def close(self) -> None:
        for jobs in self.queues:
            jobs.put(None)
        for thread in self.threads:
            thread.join()


async def measure(devices: int, steps: int, rounds: int) -> dict[str, float]:
    names = ("asyncddp", "run_in_executor", "blocking", "floor")
    times: dict[str, list[float]] = {name: [] for name in names}
    floor = HandOffFloor(devices, asyncio.get_running_loop())
    try:
        with ThreadPoolExecutor(max_workers=devices) as executor:
            async with asyncddp.StepScheduler(asyncddp.cpu_devices(devices)) as scheduler:
                shards: list[None] = [None] * devices
                # Warm up: start the pool's threads, fill caches.
                warmup = steps // 10 + 1
                await time_asyncddp(scheduler, shards, warmup)
                await time_run_in_executor(executor, devices, warmup)
                time_blocking(executor, devices, warmup)
                await floor.time(warmup)
                for _ in range(rounds):
                    times["asyncddp"].append(await time_asyncddp(scheduler, shards, steps))
                    times["run_in_executor"].append(
                        await time_run_in_executor(executor, devices, steps)
                    )
                    times["blocking"].append(time_blocking(executor, devices, steps))
                    times["floor"].append(await floor.time(steps))
    finally:
        floor.close()
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
        f"  {'vs executor':>11}  {'vs blocking':>11}  {'hand-off floor':>14}  {'own overhead':>12}"
    )
    print(header)
    at_two = None
    for devices in args.devices:
        result = await measure(devices, args.steps, args.rounds)
        ours = result["asyncddp"]
        if devices == 2:
            at_two = (ours / result["run_in_executor"], ours / result["blocking"])
        print(
            f"{devices:>7}  {ours * 1e6:>9.1f}  {result['run_in_executor'] * 1e6:>15.1f}"
            f"  {result['blocking'] * 1e6:>9.1f}  {ours / result['run_in_executor']:>10.2f}x"
            f"  {ours / result['blocking']:>10.2f}x  {result['floor'] * 1e6:>14.1f}"
            f"  {(ours - result['floor']) * 1e6:>12.1f}"
        )
    if at_two is not None:
        print(f"  2 devices, asyncddp / run_in_executor  {at_two[0]:.2f}x  (target <= 0.5x)")
        print(f"  2 devices, asyncddp / blocking  {at_two[1]:.2f}x  (target <= 1.0x)")


if __name__ == "__main__":
    asyncio.run(main())
