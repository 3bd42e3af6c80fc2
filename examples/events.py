"""Watch a fit's events from another task: progress, epochs, the end.

Run:  python examples/events.py
"""

import asyncio
import functools

import torch
import torch.nn.functional as F

import asyncddp


async def watch(stream: asyncddp.EventStream) -> None:
    async for event in stream:
        match event:
            case asyncddp.StepEnded(step=step, loss=loss, progress=progress) if step % 4 == 3:
                print(f"step {step:2d}: loss {loss:.3f}, {progress}")
            case asyncddp.EpochEnded(epoch=epoch, train_loss=loss, items=items):
                print(f"epoch {epoch} done: mean loss {loss:.3f} over {items} items")
            case asyncddp.FitEnded(stopped=stopped, error=error):
                print(f"fit ended: stopped={stopped}, error={error}")


async def main() -> None:
    torch.manual_seed(0)
    inputs = torch.randn(400, 8)
    targets = inputs.sum(dim=1, keepdim=True)
    batches = [(inputs[i : i + 50], targets[i : i + 50]) for i in range(0, 400, 50)]
    trainer = asyncddp.Trainer(
        torch.nn.Linear(8, 1),
        functools.partial(torch.optim.SGD, lr=0.05),
        lambda model, batch: F.mse_loss(model(batch[0]), batch[1]),
        devices=asyncddp.cpu_devices(2),
        progress_bar=False,
    )
    watcher = asyncio.create_task(watch(trainer.events()))
    await trainer.fit(batches, epochs=2)
    await watcher  # the stream ends after FitEnded


asyncio.run(main())
