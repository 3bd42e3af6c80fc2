"""asyncddp under trio: the same scheduler, the same code.

Run:  python examples/trio_quickstart.py
"""

import trio

import asyncddp


async def main() -> None:
    async with asyncddp.StepScheduler(asyncddp.cpu_devices(2)) as scheduler:
        result = await scheduler.run(lambda ctx, shard: shard * 2, [1, 2])
        print(result.outputs)  # (2, 4)


trio.run(main)
