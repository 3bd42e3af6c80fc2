"""Data-parallel training by hand with StepScheduler, then a failure that names its device.

Run:  python examples/scheduler_basics.py                 (every GPU, or 2 CPU workers)
      python examples/scheduler_basics.py --devices 4     (4 workers: GPUs, or CPU workers)

Each step splits the batch across the devices; every device's worker computes the gradient of
its shard on its own replica; the event loop averages the gradients (weighted by shard size)
and every replica takes the same SGD step. asyncddp's Trainer does all of this for you; this
example shows the scheduler underneath it.
"""

from __future__ import annotations

import argparse
import asyncio

import torch

import asyncddp
from asyncddp.testing import fail_on


def make_data(n: int = 4096, features: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=generator)
    true_w = torch.randn(features, 1, generator=generator)
    y = x @ true_w + 0.01 * torch.randn(n, 1, generator=generator)
    return x, y


async def main(devices: asyncddp.DeviceSpec, epochs: int, batch_size: int) -> None:
    devices = asyncddp.resolve_devices(devices)
    x, y = make_data()
    # One replica per device, identical to start with.
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], 1)
    replicas = [torch.nn.Linear(x.shape[1], 1).to(d.torch_device) for d in devices]
    for replica in replicas:
        replica.load_state_dict(model.state_dict())

    def gradient(
        ctx: asyncddp.WorkerContext, shard: tuple[torch.Tensor, torch.Tensor]
    ) -> list[torch.Tensor]:
        """Runs on the device's worker thread: the gradient of the mean loss over the shard."""
        replica = replicas[ctx.device.index]
        inputs, targets = (t.to(ctx.torch_device, non_blocking=True) for t in shard)
        replica.zero_grad()
        if len(inputs):
            torch.autograd.backward(torch.nn.functional.mse_loss(replica(inputs), targets))
        return [
            p.grad.cpu() if p.grad is not None else torch.zeros_like(p).cpu()
            for p in replica.parameters()
        ]

    async with asyncddp.StepScheduler(devices, step_timeout=30) as scheduler:
        print(f"training on {', '.join(d.name for d in devices)}")
        for epoch in range(epochs):
            scheduler.reset_progress(items_total=len(x))
            for start in range(0, len(x), batch_size):
                batch = (x[start : start + batch_size], y[start : start + batch_size])
                shards = list(zip(*(t.tensor_split(len(devices)) for t in batch), strict=True))
                result = await scheduler.run(gradient, shards)
                # Average the gradients, weighted by how many items each shard held.
                weights = [n / sum(result.items) for n in result.items]
                averaged = [
                    torch.stack(
                        [w * g[i] for w, g in zip(weights, result.outputs, strict=True)]
                    ).sum(0)
                    for i in range(2)
                ]
                for replica in replicas:
                    with torch.no_grad():
                        for param, grad in zip(replica.parameters(), averaged, strict=True):
                            param.sub_(0.1 * grad.to(param.device))
            with torch.no_grad():
                first = devices[0].torch_device
                loss = torch.nn.functional.mse_loss(replicas[0](x.to(first)), y.to(first)).item()
            print(f"epoch {epoch}: loss {loss:.5f}, {result.progress}")

        # A failure on one device becomes a WorkerFailedError that names it.
        try:
            await scheduler.run(fail_on(gradient, device=len(devices) - 1), shards)
        except asyncddp.WorkerFailedError as error:
            print(f"caught: {error}")
            print(f"  device={error.device.name} step={error.step} cause={error.__cause__!r}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices", default=None, help="'auto', 'cpu', 'cuda', 'cuda:N' or a count"
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    spec: asyncddp.DeviceSpec
    if args.devices is None:
        spec = "cuda" if torch.cuda.is_available() else asyncddp.cpu_devices(2)
    else:
        spec = int(args.devices) if args.devices.isdigit() else args.devices
    asyncio.run(main(spec, args.epochs, args.batch_size))
