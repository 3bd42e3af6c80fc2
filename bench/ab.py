"""A/B: one throughput contender, this checkout against an earlier commit, interleaved.

Run:  python bench/ab.py 4953c32                      (asyncddp-1 on the MLP, 21 rounds)
      python bench/ab.py 4953c32 --contender asyncddp-2 --workload "convnet 32x32"
      python bench/ab.py HEAD --quick                 (a smoke run)

The machines here drift by 10% and more between runs, so a change of a few percent shows only
when both versions run many times, in turns. Each round runs ``throughput.py --measure`` in a
fresh process: once for the plain loop, once with the earlier commit's asyncddp (a git worktree
of it, put first on ``sys.path`` ahead of the installed package), once with this checkout's.
Prints the median ms a step of each and their ratio to the plain loop's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# Runs throughput.py with the package at sys.argv[1] imported instead of the installed one (an
# editable install's import hook would otherwise win over sys.path).
BOOTSTRAP = """
import runpy, sys
root = sys.argv.pop(1)
if root:
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, root)
import asyncddp
assert not root or asyncddp.__file__.startswith(root), asyncddp.__file__
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
"""


def measure(root: str, contender: str, workload: str, steps: int) -> float:
    """ms a step of one contender, in a fresh process, with asyncddp from ``root`` ("" for
    this checkout)."""
    script = str(HERE / "throughput.py")
    command = [sys.executable, "-c", BOOTSTRAP, root, script, "--measure", contender, workload]
    completed = subprocess.run(
        [*command, "--steps", str(steps)], capture_output=True, text=True, check=True, cwd=HERE
    )
    samples_per_second = float(completed.stdout.strip().splitlines()[-1])
    return 1e3 * 256 / samples_per_second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the earlier commit")
    parser.add_argument("--contender", default="asyncddp-1", help="asyncddp-1, asyncddp-2, ...")
    parser.add_argument("--workload", default="mlp 512-1024-10")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per measurement")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 8
    with tempfile.TemporaryDirectory() as tmp:
        base = str(Path(tmp) / "base")
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", base, args.base],
            check=True,
        )
        try:
            times: dict[str, list[float]] = {"plain": [], args.base: [], "this checkout": []}
            for _ in range(args.rounds):
                times["plain"].append(measure("", "plain", args.workload, args.steps))
                times[args.base].append(measure(base, args.contender, args.workload, args.steps))
                times["this checkout"].append(
                    measure("", args.contender, args.workload, args.steps)
                )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", base], check=True
            )
    print(
        f"{args.contender} on {args.workload}: median of {args.rounds} rounds x {args.steps} "
        "steps, the three in turns, each in a fresh process"
    )
    plain = statistics.median(times["plain"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<14} {median:6.3f} ms/step  {median / plain - 1:+6.1%} vs plain")


if __name__ == "__main__":
    main()
