"""A job that a container orchestrator may stop: SIGTERM saves where training is and exits 0,
and the next run goes on from there.

Run:  python examples/preemption.py CHECKPOINT_DIR     (send it SIGTERM; run it again)

Kubernetes, Slurm and `docker stop` send SIGTERM, then SIGKILL after a grace period (30 s by
default on Kubernetes). Python's default for SIGTERM ends the process at once: the epoch in
progress is lost. Here SIGTERM calls `trainer.stop()`, which ends the fit after the step in
progress, on every rank under torchrun; the checkpoint is written mid-epoch, and
`fit(resume="latest")` goes on from it, the epoch's remaining batches included.
"""

import asyncio
import functools
import signal
import sys

import torch
import torch.nn.functional as F

import asyncddp


def step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


async def main(checkpoint_dir: str) -> None:
    torch.manual_seed(0)
    inputs = torch.randn(4096, 32)
    targets = inputs.sum(dim=1, keepdim=True)
    batches = [(inputs[i : i + 64], targets[i : i + 64]) for i in range(0, 4096, 64)]
    trainer = asyncddp.Trainer(
        torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)),
        functools.partial(torch.optim.SGD, lr=0.01),
        step,
        devices=asyncddp.cpu_devices(2),
        checkpoint_dir=checkpoint_dir,
        progress_bar=False,
    )
    # --8<-- [start:preemption]
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, trainer.stop, "SIGTERM")  # not on Windows
    result = await trainer.fit(batches, epochs=20, resume="latest")
    if result.stopped:  # by SIGTERM: save where it stopped, within the grace period
        path = await trainer.save_checkpoint()
        print(f"stopped at step {trainer.global_step}: saved {path.name}", flush=True)
    else:
        print(f"done: {trainer.epoch} epochs, step {trainer.global_step}", flush=True)
    # --8<-- [end:preemption]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} CHECKPOINT_DIR")
    asyncio.run(main(sys.argv[1]))
