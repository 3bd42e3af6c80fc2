"""Keep only the newest few of fit's checkpoints, across fits and resumes.

Run:  python examples/keep_last.py

`fit` writes one checkpoint per epoch into `checkpoint_dir` and deletes none. `keep_last` deletes
the older ones as each is saved, looking at the folder, not at what one fit saved: a script that
calls `fit` again (once per epoch, or after a preemption with `resume="latest"`) sees every
checkpoint of the runs before, and a path saved twice (`save_checkpoint()` at an epoch's end
writes the epoch's own file again) is one file.
"""

import asyncio
import functools
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import asyncddp

# --8<-- [start:keep_last]
FIT_NAME = re.compile(r"epoch(\d+)-step(\d+)\.ckpt")  # the names fit gives its checkpoints


def _prune(folder: Path, keep: int) -> None:
    """Delete all but the newest `keep` of fit's checkpoints in `folder` (by their counts);
    files of other names (a copy of the best, another library's) are left alone."""
    saved = [
        (tuple(int(count) for count in match.groups()), path)
        for path in folder.iterdir()
        if (match := FIT_NAME.fullmatch(path.name)) and path.is_file()
    ]
    saved.sort()
    for _, path in saved[: max(len(saved) - keep, 0)]:
        path.unlink(missing_ok=True)


async def keep_last(trainer: asyncddp.Trainer, events: asyncddp.EventStream, keep: int) -> None:
    async for event in events:  # the stream ends with the fit's FitEnded
        folder = trainer.checkpoint_dir
        # save_checkpoint("now.ckpt") says CheckpointSaved too: only checkpoint_dir is pruned.
        if isinstance(event, asyncddp.CheckpointSaved) and Path(event.path).parent == folder:
            await asyncio.to_thread(_prune, folder, keep)


async def fit_keeping_the_last(
    trainer: asyncddp.Trainer, data: Iterable[Any], keep: int = 3, **fit_args: Any
) -> asyncddp.FitResult:
    async with asyncio.TaskGroup() as tg:
        tg.create_task(keep_last(trainer, trainer.events(), keep))  # the stream opens now
        return await trainer.fit(data, **fit_args)


# --8<-- [end:keep_last]


def step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


def make_trainer(folder: str) -> asyncddp.Trainer:
    torch.manual_seed(0)
    return asyncddp.Trainer(
        torch.nn.Linear(4, 1),
        functools.partial(torch.optim.SGD, lr=0.1),
        step,
        devices=asyncddp.cpu_devices(2),
        checkpoint_dir=folder,
        progress_bar=False,
    )


async def main() -> None:
    torch.manual_seed(0)
    inputs = torch.randn(32, 4)
    data = [(inputs[i : i + 8], inputs[i : i + 8].sum(1, keepdim=True)) for i in range(0, 32, 8)]
    with tempfile.TemporaryDirectory() as folder:
        best = Path(folder) / "epoch0002-step000008-best.ckpt"  # a file of the user's: kept
        await asyncio.to_thread(best.write_bytes, b"")
        # A first run of 4 epochs, then a run resumed from it to 7 (as after a preemption).
        await fit_keeping_the_last(make_trainer(folder), data, epochs=4)
        resumed = make_trainer(folder)
        await fit_keeping_the_last(resumed, data, epochs=7, resume="latest")
        # One epoch at a time, with an extra save at each epoch's end (the same file again).
        for epoch in range(8, 10):
            await fit_keeping_the_last(resumed, data, epochs=epoch)
            await resumed.save_checkpoint()
        print("kept:", ", ".join(sorted(await asyncio.to_thread(os.listdir, folder))))


if __name__ == "__main__":
    asyncio.run(main())
