"""The smallest asyncddp program: one job on every device, awaited together.

Run:  python examples/scheduler_quickstart.py
"""

import asyncio

import torch

import asyncddp


def square_sum(ctx: asyncddp.WorkerContext, shard: torch.Tensor) -> float:
    x = shard.to(ctx.torch_device)  # runs on this device's worker thread
    return (x * x).sum().item()


async def main() -> None:
    devices = asyncddp.cpu_devices(2)  # or "auto": every GPU, else one CPU worker
    async with asyncddp.StepScheduler(devices, step_timeout=60) as scheduler:
        batch = torch.arange(10.0)
        result = await scheduler.run(square_sum, batch.tensor_split(len(devices)))
        # Each device's output, in device order, and the progress so far: 10 items, of a
        # total nobody told the scheduler ("?").
        print(result.outputs, result.progress)  # (30.0, 255.0) 10/? items


asyncio.run(main())
