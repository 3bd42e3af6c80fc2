"""Early stopping: train one epoch at a time, and stop once validation stops improving.

Run:  python examples/early_stopping.py

`fit(epochs=N)` trains until N epochs are complete in all, so a loop that asks for one more
epoch each time decides between epochs, with the trainer idle: nothing of the next epoch has
run when it stops. The best epoch's weights are kept and put back at the end.
"""

import asyncio
import copy
import functools

import torch
import torch.nn.functional as F

import asyncddp


def step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


async def main() -> None:
    torch.manual_seed(0)
    # 64 noisy samples to train on: too few for this model, which overfits them in time.
    inputs = torch.randn(64 + 256, 16)
    targets = inputs[:, :1] + 0.5 * torch.randn(64 + 256, 1)
    train = [(inputs[i : i + 16], targets[i : i + 16]) for i in range(0, 64, 16)]
    valid = [(inputs[64:], targets[64:])]
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    trainer = asyncddp.Trainer(
        model,
        functools.partial(torch.optim.Adam, lr=0.01),
        step,
        devices=asyncddp.cpu_devices(2),
        progress_bar=False,
    )
    best, best_epoch, best_weights = float("inf"), 0, None
    patience = 3  # epochs without a better validation loss before stopping
    for epoch in range(1, 101):
        result = await trainer.fit(train, epochs=epoch, valid_data=valid)  # one epoch more
        valid_loss = result.history[-1].valid_loss
        assert valid_loss is not None  # None only for an epoch without valid_data
        print(f"epoch {epoch:2d}: valid loss {valid_loss:.4f}")
        if valid_loss < best:
            best, best_epoch = valid_loss, epoch
            best_weights = copy.deepcopy(trainer.model.state_dict())
        elif epoch - best_epoch == patience:
            break
    assert best_weights is not None
    trainer.model.load_state_dict(best_weights)  # back to the best epoch's weights
    print(f"stopped after epoch {epoch}; kept epoch {best_epoch} (valid loss {best:.4f})")


asyncio.run(main())
