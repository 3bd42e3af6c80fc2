"""The smallest asyncddp training run: a linear model, data-parallel on two workers.

Run:  python examples/quickstart.py
"""

import asyncio
import functools

import torch
import torch.nn.functional as F

import asyncddp


def step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)  # the mean over this device's share of the batch


async def main() -> None:
    torch.manual_seed(0)
    inputs = torch.randn(1024, 8)
    targets = inputs.sum(dim=1, keepdim=True)
    batches = [(inputs[i : i + 128], targets[i : i + 128]) for i in range(0, 1024, 128)]
    trainer = asyncddp.Trainer(
        torch.nn.Linear(8, 1),
        functools.partial(torch.optim.SGD, lr=0.1),
        step,
        devices=asyncddp.cpu_devices(2),  # or "auto": every GPU, else one CPU worker
    )
    result = await trainer.fit(batches, epochs=5)  # the event loop stays free meanwhile
    print(f"loss {result.history[0].train_loss:.4f} -> {result.history[-1].train_loss:.6f}")
    # loss 2.8094 -> 0.000004


asyncio.run(main())
