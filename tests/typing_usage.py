"""User code as a typed program writes it, checked by ``mypy --strict`` (tests/test_typing.py);
never run. Each ``# type: ignore[...]`` marks a mistake mypy must catch: with
``warn_unused_ignores`` (part of ``--strict``), one it stops catching fails the check."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, assert_type, cast

import torch
from torch import nn

import asyncddp
from asyncddp.testing import failing_step, hanging_step


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer(batch)
        return out.pow(2).mean()


def step(model: Net, batch: torch.Tensor) -> torch.Tensor:
    return model.loss(batch)  # a method of the user's class, on a replica of it


def any_step(model: nn.Module, batch: Any) -> dict[str, Any]:
    return {"loss": model(batch).sum(), "items": len(batch)}


def takes_any_trainer(trainer: asyncddp.Trainer) -> nn.Module:
    return trainer.model


async def main() -> None:
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    trainer = asyncddp.Trainer(Net(), sgd, step, valid_step=step)
    assert_type(trainer, asyncddp.Trainer[Net])
    assert_type(trainer.model, Net)  # the model's own class, not nn.Module
    takes_any_trainer(trainer)  # a plain Trainer takes any trainer

    general: asyncddp.Trainer = asyncddp.Trainer(nn.Linear(4, 1), sgd, any_step)
    assert_type(general.model, nn.Module)
    stepper: asyncddp.StepFunction = any_step
    asyncddp.Trainer(Net(), sgd, stepper)  # a step for any module trains a Net too

    # The testing helpers keep the step's type.
    asyncddp.Trainer(Net(), sgd, failing_step(step, device=1, at=3))
    kept = Callable[[Net, torch.Tensor], torch.Tensor]
    assert_type(failing_step(step, device=1), kept)
    assert_type(hanging_step(step, device=0, release=threading.Event()), kept)

    result = await trainer.fit([torch.randn(8, 4)], epochs=1)
    assert_type(result.history[-1].valid_loss, float | None)

    # Options assigned between calls, as training.md shows.
    trainer.checkpoint_dir = "runs/b"  # a str, as Trainer(checkpoint_dir=...) takes
    assert_type(trainer.checkpoint_dir, Path | None)
    trainer.on_failure = "retry"
    asyncddp.Trainer(Net(), sgd, step, precision="bf16-mixed")
    from_cli: str = "bf16"  # a setting read as text: cast to the public alias
    asyncddp.Trainer(Net(), sgd, step, precision=cast(asyncddp.Precision, from_cli))
    assert_type(trainer.precision, str)

    # Mistakes mypy catches:
    trainer.precision = "bf16"  # type: ignore[assignment]  # fixed as the trainer is built
    trainer.on_failure = "skip"  # type: ignore[assignment]
    trainer.lr_scheduler_interval = "batch"  # type: ignore[assignment]
    asyncddp.Trainer(Net(), sgd, step, precision="fp8")  # type: ignore[arg-type]
    asyncddp.Trainer(nn.Linear(4, 1), sgd, step)  # type: ignore[arg-type]  # a Net's step
    asyncddp.Trainer(Net(), step, sgd)  # type: ignore[arg-type]  # the two swapped
    asyncddp.Trainer(Net(), sgd, step, on_failure="skip")  # type: ignore[arg-type]
    await trainer.fit([], epoch=1)  # type: ignore[call-arg]
