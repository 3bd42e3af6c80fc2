"""GPU: do two workers on one GPU overlap on their own streams, and how do N GPUs scale?

Run:  python bench/gpu.py            (on a machine with a CUDA GPU)
      python bench/gpu.py --quick    (a smoke run; on a machine without one it runs the same
                                      code on CPU workers, and says so)

1. Overlap: the same batch of matmuls runs on two workers at once, each on its own stream (and,
   on a GPU, on the same device), against the same work done one after the other on one worker.
   ``serial / concurrent`` near 2 means the two streams overlapped fully; near 1, not at all.
   (A single big kernel fills an H100-class GPU alone: overlap shows with kernels that do not.)
2. Scaling: training samples per second of the MLP 512-1024-10 on every visible GPU against one.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from throughput import BATCH, make_batches, mlp, with_asyncddp

import asyncddp
from asyncddp._worker import CallerState, DeviceWorker


def matmuls(size: int, count: int, device: torch.device) -> None:
    x = torch.randn(size, size, device=device)
    for _ in range(count):
        x = torch.tanh(x @ x / size)


async def overlap(device: torch.device, size: int, count: int) -> tuple[float, float]:
    """Seconds for the work on two workers at once, and one after the other on one."""
    devices = [
        asyncddp.Device(index=i, torch_device=device, name=f"{device}#{i}") for i in range(2)
    ]
    workers = [DeviceWorker(d) for d in devices]  # two workers, one device: built by hand
    for worker in workers:
        worker.start()
    loop = asyncio.get_running_loop()

    async def on(worker: DeviceWorker) -> None:
        done: asyncio.Future[None] = loop.create_future()
        state = CallerState.capture(device.type)

        def job() -> None:
            import contextvars

            worker.invoke(state, contextvars.copy_context(), matmuls, size, count, device)
            loop.call_soon_threadsafe(done.set_result, None)

        worker.submit(job)
        await done

    try:
        await on(workers[0])  # warm-up: streams, kernels, allocator
        await on(workers[1])
        start = time.perf_counter()
        await asyncio.gather(on(workers[0]), on(workers[1]))
        concurrent = time.perf_counter() - start
        start = time.perf_counter()
        await on(workers[0])
        await on(workers[0])
        serial = time.perf_counter() - start
    finally:
        for worker in workers:
            worker.stop()
        for worker in workers:
            worker.join()
    return concurrent, serial


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    size, count, steps = (512, 200, 40) if cuda else (256, 40, 10)
    if args.quick:
        count, steps = max(4, count // 10), 4
    if cuda:
        print(f"GPU: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    else:
        print("no CUDA GPU visible: a CPU smoke run of the same code (figures mean nothing)")
    concurrent, serial = await overlap(device, size, count)
    print(
        f"overlap, 2 workers on {device}: concurrent {concurrent * 1e3:.1f} ms, "
        f"serial {serial * 1e3:.1f} ms, serial/concurrent {serial / concurrent:.2f}x"
    )
    batches = make_batches((512,), steps)
    if cuda:
        one = await with_asyncddp(mlp, batches, "cuda:0")
        every = await with_asyncddp(mlp, batches, "cuda")
        n = torch.cuda.device_count()
        print(
            f"MLP, batch {BATCH}: 1 GPU {one:.0f} samples/s, {n} GPU(s) {every:.0f} samples/s, "
            f"{every / one:.2f}x"
        )
    else:
        rate = await with_asyncddp(mlp, batches, 2)
        print(f"MLP, batch {BATCH}, 2 CPU workers: {rate:.0f} samples/s")


if __name__ == "__main__":
    asyncio.run(main())
