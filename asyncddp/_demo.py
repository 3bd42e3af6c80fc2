"""The demo: a small MLP learns scikit-learn's handwritten digits, data-parallel.

Run:  asyncddp demo                         (every GPU, or 2 CPU workers without one)
      asyncddp demo --devices 4 --epochs 20
      python -m asyncddp demo --help

The digits ship with scikit-learn (nothing is downloaded). Each batch is split across the
devices; the progress bar shows when stderr is a terminal or in a notebook. This file is also
the example to read: it is what the docs show as the main job.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import asyncddp


def digits_loaders(batch_size: int, seed: int = 0) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """80% of the 1,797 digits to train on (shuffled each epoch), 20% to validate on."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # an optional dependency: only the demo needs it
        raise ImportError(
            "the demo trains on scikit-learn's digits: pip install scikit-learn (or the "
            "extra that has it: pip install 'asyncddp[examples]'; from a clone of the "
            "repository, pip install -e '.[examples]')"
        ) from exc
    digits = load_digits()
    inputs = torch.tensor(digits.data, dtype=torch.float32) / 16.0  # pixels are 0..16
    targets = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(inputs))
    train, valid = order[:cut], order[cut:]
    return (
        DataLoader(
            TensorDataset(inputs[train], targets[train]), batch_size=batch_size, shuffle=True
        ),
        DataLoader(TensorDataset(inputs[valid], targets[valid]), batch_size=256),
    )


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runs on each device's worker: the mean loss and accuracy over this device's shard."""
    inputs, targets = batch
    logits = model(inputs)
    return {
        "loss": F.cross_entropy(logits, targets),
        "accuracy": (logits.argmax(dim=1) == targets).float().mean(),
    }


async def report_epochs(events: asyncddp.EventStream) -> None:
    """Print each epoch's training loss and validation metrics as its validation ends."""
    train_loss = float("nan")
    async for event in events:
        if isinstance(event, asyncddp.EpochEnded):
            train_loss = event.train_loss
        elif isinstance(event, asyncddp.ValidationEnded) and event.epoch is not None:
            print(
                f"epoch {event.epoch + 1:2d}: train loss {train_loss:.4f}, "
                f"valid loss {event.metrics['loss']:.4f}, "
                f"valid accuracy {event.metrics['accuracy']:.2%}",
                flush=True,  # at once into a pipe too (a container's log), not at exit
            )


async def main(
    devices: asyncddp.DeviceSpec,
    epochs: int = 10,
    batch_size: int = 64,
    progress_bar: bool | None = None,
) -> asyncddp.FitResult:
    """Train and print a line per epoch and a summary; returns the fit's result."""
    torch.manual_seed(0)
    # Off the event loop: importing scikit-learn and loading the digits takes a second or two.
    train_loader, valid_loader = await asyncio.to_thread(digits_loaders, batch_size)
    trainer = asyncddp.Trainer(
        make_model(),
        functools.partial(torch.optim.AdamW, lr=3e-3),
        step,
        devices=devices,
        lr_scheduler=functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=epochs),
        progress_bar=progress_bar,
    )
    names = ", ".join(device.name for device in trainer.devices)
    digits = len(train_loader.dataset)  # type: ignore[arg-type]
    print(f"training on {names}: {digits} digits, batch size {batch_size}", flush=True)
    # A line per epoch as it ends, from the trainer's events, read by a task of its own
    # while the fit runs (the stream ends after the fit's FitEnded).
    reporter = asyncio.create_task(report_epochs(trainer.events()))
    started = time.perf_counter()
    try:
        result = await trainer.fit(train_loader, epochs=epochs, valid_data=valid_loader)
    finally:
        await reporter
    seconds = time.perf_counter() - started
    final = result.history[-1].valid_metrics or {}
    count = len(trainer.devices)
    print(
        f"done: {count} device{'s' if count > 1 else ''} ({names}), "
        f"{result.items_per_second:,.0f} items/s, "
        f"{seconds:.1f} s, final train loss {result.history[-1].train_loss:.4f}, "
        f"valid accuracy {final['accuracy']:.2%}"
    )
    return result
