"""One rank of a distributed test: ``python tests/distributed_worker.py SCENARIO OUT_DIR``.

Started by ``tests/test_distributed.py`` with the torchrun environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) set by hand. Writes what it saw to ``OUT_DIR/rank{RANK}.pt``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import asyncddp
import asyncddp.distributed

FAIL_AT = 3  # the global step at which the failure scenarios fail


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(count: int = 7, size: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of ``size`` items, the last one shorter (uneven on purpose)."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for i in range(count):
        n = size if i < count - 1 else size // 2 + 1
        inputs = torch.randn(n, 6, generator=generator)
        out.append((inputs, torch.randint(0, 3, (n,), generator=generator)))
    return out


def step(model: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    logits = model(inputs)
    return {
        "loss": F.cross_entropy(logits, targets),
        "accuracy": (logits.argmax(1) == targets).float().mean(),
    }


def trainer(devices: int, **options: Any) -> asyncddp.Trainer:
    return asyncddp.Trainer(
        model(),
        functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9),
        step,
        devices=asyncddp.cpu_devices(devices),
        progress_bar=False,
        **options,
    )


async def run(scenario: str, out: Path, rank: int) -> dict[str, Any]:
    report: dict[str, Any] = {"rank": rank}
    if scenario.startswith("exact"):  # exact1, exact2: devices per rank; exact-one: 1 batch
        t = trainer(1 if scenario == "exact-one" else int(scenario[-1]))
        data = batches(1) if scenario == "exact-one" else batches()
        result = await t.fit(data, epochs=2, valid_data=batches(5, 10))
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
        report["history"] = [
            (r.train_loss, dict(r.train_metrics), dict(r.valid_metrics or {}), r.items)
            for r in result.history
        ]
        report["global_step"] = result.global_step
        report["validate"] = await t.validate(batches(5, 10))
    elif scenario in ("raise", "kill"):

        def failing(model: torch.nn.Module, batch: Any) -> Any:
            if rank == 1 and t.global_step == FAIL_AT:
                if scenario == "kill":
                    (out / "killed_at").write_text(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                report["failed_at"] = time.time()
                raise ValueError("injected failure on rank 1")
            return step(model, batch)

        t = asyncddp.Trainer(
            model(),
            functools.partial(torch.optim.SGD, lr=0.1),
            failing,
            devices=asyncddp.cpu_devices(2),
            progress_bar=False,
        )
        try:
            await t.fit(batches(40, 8), epochs=1)
            report["error"] = None
        except asyncddp.WorkerFailedError as error:
            report["raised_at"] = time.time()
            report["error"] = str(error)
            report["error_rank"] = error.rank
            report["error_device"] = error.device.name
            report["cause"] = type(error.__cause__).__name__
            report["cause_message"] = str(error.__cause__)
            report["global_step"] = t.global_step
    elif scenario == "stop":
        t = trainer(1)

        async def stopper() -> None:
            async for event in t.events():
                if rank == 1 and isinstance(event, asyncddp.StepEnded) and event.step == 2:
                    t.stop("rank 1 had enough")

        async with asyncio.TaskGroup() as group:
            group.create_task(stopper())
            result = await t.fit(batches(40, 8), epochs=3)
        report.update(
            stopped=result.stopped,
            reason=result.stop_reason,
            global_step=result.global_step,
            params=[p.detach().clone() for p in t.model.parameters()],
        )
    elif scenario.startswith("checkpoint"):  # checkpoint-first, checkpoint-resume, -straight
        directory = out / "checkpoints"
        t = trainer(1, checkpoint_dir=directory)
        if scenario == "checkpoint-first":
            await t.fit(batches(), epochs=1)
        elif scenario == "checkpoint-resume":
            await t.fit(batches(), epochs=2, resume="latest")
        else:
            t.checkpoint_dir = None
            await t.fit(batches(), epochs=2)
        report["params"] = [p.detach().clone() for p in t.model.parameters()]
        report["global_step"] = t.global_step
        report["files"] = sorted(p.name for p in directory.glob("*")) if directory.exists() else []
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    return report


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    world = asyncddp.distributed.init("gloo", timeout=120)
    try:
        report = asyncio.run(run(scenario, out, world.rank))
    except BaseException as error:
        report = {"rank": world.rank, "crash": traceback.format_exc(), "type": type(error).__name__}
    torch.save(report, out / f"rank{world.rank}.pt")
    asyncddp.distributed.destroy()


if __name__ == "__main__":
    main()
