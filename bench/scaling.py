"""Scaling: steps per second against the number of devices, for a fixed global batch.

Run:  python bench/scaling.py            (about a minute; writes docs/img/scaling.png)
      python bench/scaling.py --quick

The MLP 512-1024-10 with a global batch of 256 trains on ``cpu_devices(n)`` for n in 1, 2, 4, 8
(the machine's threads shared among the workers), beside the dispatch cost of a no-op step on
the same n (from ``bench/dispatch.py``): how much each added device costs before any compute.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from dispatch import time_asyncddp
from throughput import BATCH, make_batches, mlp, with_asyncddp

import asyncddp

PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "scaling.png"


async def dispatch_us(devices: int, steps: int) -> float:
    async with asyncddp.StepScheduler(asyncddp.cpu_devices(devices)) as scheduler:
        await time_asyncddp(scheduler, [None] * devices, steps // 10 + 1)
        return 1e6 * statistics.median(
            [await time_asyncddp(scheduler, [None] * devices, steps) for _ in range(3)]
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.devices, args.steps, args.rounds, args.no_plot = [1, 2], 6, 1, True
    batches = make_batches((512,), args.steps)
    print(
        f"MLP 512-1024-10, global batch {BATCH}, median of {args.rounds} rounds x {args.steps} steps"
    )
    print(
        f"{'devices':>7} {'steps/s':>9} {'vs 1':>6} {'no-op dispatch us':>18} {'per device us':>14}"
    )
    rows = []
    for devices in args.devices:
        rate = (
            statistics.median(
                [await with_asyncddp(mlp, batches, devices) for _ in range(args.rounds)]
            )
            / BATCH
        )
        dispatch = await dispatch_us(devices, 10 * args.steps)
        rows.append((devices, rate, dispatch))
        print(
            f"{devices:>7} {rate:>9.1f} {rate / rows[0][1]:>5.2f}x {dispatch:>18.1f} "
            f"{dispatch / devices:>14.1f}"
        )
    if not args.no_plot:
        figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
        left.plot([r[0] for r in rows], [r[1] for r in rows], marker="o")
        left.set(xlabel="devices (CPU workers)", ylabel="steps / s", title="MLP, global batch 256")
        right.plot([r[0] for r in rows], [r[2] for r in rows], marker="o", color="tab:orange")
        right.set(xlabel="devices (CPU workers)", ylabel="us / step", title="no-op step dispatch")
        for axis in (left, right):
            axis.set_xticks([r[0] for r in rows])
            axis.grid(alpha=0.3)
        figure.tight_layout()
        PLOT.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(PLOT, dpi=100)
        print(f"plot: {PLOT.relative_to(PLOT.parent.parent.parent)}")


if __name__ == "__main__":
    asyncio.run(main())
