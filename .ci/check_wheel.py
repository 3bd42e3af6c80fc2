"""Run inside a fresh virtual environment where only the built wheel (and its declared
dependencies) is installed: the package must import, work and ship its type marker."""

import asyncio
import functools
import importlib.metadata
import importlib.resources
import importlib.util

import torch

import asyncddp

assert importlib.resources.files("asyncddp").joinpath("py.typed").is_file(), "py.typed missing"
assert asyncddp.__version__ == importlib.metadata.version("asyncddp")
meta = importlib.metadata.metadata("asyncddp")
assert "Typing :: Typed" in meta.get_all("Classifier")
# 2.4 however new the hatchling that built it (pyproject's core-metadata-version): 2.5 is
# refused by upload tools of a year before, and License-Expression needs 2.4.
assert meta["Metadata-Version"] == "2.4", meta["Metadata-Version"]
assert meta["License-Expression"] == "BSD-3-Clause", meta["License-Expression"]
extras = set(meta.get_all("Provides-Extra"))
assert {"examples", "service", "notebook", "test", "docs"} <= extras, extras
for optional in ("sklearn", "fastapi", "ipykernel", "pytest"):
    assert importlib.util.find_spec(optional) is None, f"{optional} came with the core install"


async def main() -> None:
    torch.manual_seed(0)
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
    trainer = asyncddp.Trainer(
        torch.nn.Linear(4, 1),
        functools.partial(torch.optim.SGD, lr=0.1),
        lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]),
        devices=asyncddp.cpu_devices(2),
        progress_bar=False,
    )
    result = await trainer.fit(batches, epochs=2)
    assert result.global_step == 8


asyncio.run(main())
print(f"wheel ok: asyncddp {asyncddp.__version__}, extras {sorted(extras)}")
