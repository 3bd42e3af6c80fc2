"""Run every benchmark and write its output into docs/benchmarks.md.

Run:  python bench/report.py            (the full runs: about 30-45 minutes on 2 cores)
      python bench/report.py --quick    (smoke runs; does not touch the docs)

Each benchmark's output replaces the block between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->`` in docs/benchmarks.md, so the figures there are always what the
command printed, with the command beside them.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs" / "benchmarks.md"
BENCHMARKS = [
    "dispatch",
    "throughput",
    "phases",
    "loop_lag",
    "allreduce",
    "scaling",
    "gpu",
    "distributed",
    "soak",
]


def run(name: str, quick: bool) -> str:
    command = [sys.executable, str(HERE / f"{name}.py"), *(["--quick"] if quick else [])]
    print(f"$ python bench/{name}.py{' --quick' if quick else ''}", flush=True)
    completed = subprocess.run(command, cwd=HERE, capture_output=True, text=True, check=False)
    if completed.returncode:
        raise SystemExit(f"bench/{name}.py failed:\n{completed.stdout}\n{completed.stderr}")
    print(completed.stdout, flush=True)
    return completed.stdout


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke runs; the docs stay as they are"
    )
    parser.add_argument("names", nargs="*", default=BENCHMARKS, help="which benchmarks")
    args = parser.parse_args()
    text = DOCS.read_text()
    for name in args.names:
        if name == "gpu" and not args.quick and not _cuda():
            # Its block holds a run on a GPU (bash .ci/gpu): a CPU run would replace it.
            print("$ python bench/gpu.py: skipped, no CUDA GPU visible (the docs keep the GPU run)")
            continue
        output = run(name, args.quick)
        if args.quick:
            continue
        block = f"<!-- bench:{name} -->\n```text\n$ python bench/{name}.py\n{output.rstrip()}\n```\n<!-- /bench:{name} -->"
        if name == "soak":  # docs/faults.md shows this run too
            (DOCS.parent / "img" / "soak-output.txt").write_text(output)
        pattern = re.compile(rf"<!-- bench:{name} -->.*?<!-- /bench:{name} -->", re.DOTALL)
        if not pattern.search(text):
            raise SystemExit(f"docs/benchmarks.md has no <!-- bench:{name} --> block")
        text = pattern.sub(lambda _, block=block: block, text)
    if not args.quick:
        DOCS.write_text(text)
        print(f"wrote {DOCS.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
