"""Data-parallel training across processes: scikit-learn's digits on 2 ranks.

Run:  torchrun --nproc-per-node 2 examples/distributed_digits.py
      torchrun --nproc-per-node 2 examples/distributed_digits.py --devices 2   (2 CPU workers
                                                                               per process)

Every rank runs this same script with the same data; the trainer gives each rank every other
batch, averages the gradients over all of them, and reports the loss and validation metrics
over every rank's items. Rank 0 prints. On a machine with GPUs, NCCL and one GPU per process.
"""

import argparse
import asyncio
import functools

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import asyncddp
import asyncddp.distributed


def loaders() -> tuple[DataLoader[tuple[torch.Tensor, ...]], DataLoader[tuple[torch.Tensor, ...]]]:
    digits = load_digits()  # ships with scikit-learn: nothing is downloaded
    inputs = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    targets = torch.tensor(digits.target)
    cut = int(0.8 * len(inputs))
    train = TensorDataset(inputs[:cut], targets[:cut])
    valid = TensorDataset(inputs[cut:], targets[cut:])
    return DataLoader(train, batch_size=32, shuffle=True), DataLoader(valid, batch_size=128)


def step(
    model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    logits = model(inputs)
    return {
        "loss": F.cross_entropy(logits, targets),
        "accuracy": (logits.argmax(dim=1) == targets).float().mean(),
    }


async def main(epochs: int, devices: int) -> None:
    world = asyncddp.distributed.init()  # reads RANK, WORLD_SIZE, ... set by torchrun
    torch.manual_seed(0)  # reproducible runs (rank 0's weights go to every rank anyway)
    train, valid = loaders()
    trainer = asyncddp.Trainer(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)),
        functools.partial(torch.optim.AdamW, lr=3e-3),
        step,
        devices=asyncddp.cpu_devices(devices) if devices > 1 else "auto",
    )
    try:
        result = await trainer.fit(train, epochs=epochs, valid_data=valid)
    finally:
        asyncddp.distributed.destroy()  # leave the group on the way out, failed or not
    if world.is_main:
        names = ", ".join(device.name for device in trainer.devices)
        print(f"{world.world_size} ranks x {len(trainer.devices)} device(s) ({names} each)")
        for record in result.history:
            valid_metrics = record.valid_metrics or {}
            print(
                f"epoch {record.epoch + 1}: train loss {record.train_loss:.4f} "
                f"over {record.items} digits, valid accuracy {valid_metrics['accuracy']:.2%}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--devices", type=int, default=1, help="CPU workers per process")
    args = parser.parse_args()
    asyncio.run(main(args.epochs, args.devices))
