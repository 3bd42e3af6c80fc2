"""Run every benchmark and write its output into docs/benchmarks.md.

Run:  python bench/report.py            (the full runs: about 30-45 minutes on 2 cores)
      python bench/report.py --quick    (smoke runs; does not touch the docs)

Each benchmark's output replaces the block between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->`` in docs/benchmarks.md, so the figures there are always what the
command printed, with the command beside them. Then the table between ``<!-- bench:summary -->``
and ``<!-- /bench:summary -->`` is rewritten from every line of those blocks that states a target
(``... 0.76x ... (target >= 0.95x)``): met or missed is computed, not written by hand.

      python bench/report.py --summary   (only that table, from the blocks as they stand)
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
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


# A figure's number: not the tail of a name ("ddp-gloo-2") or of another number.
_NUMBER = r"(?<![\w.-])[-+]?\d+(?:\.\d+)?"
_UNIT = r"x|%|ms"
# "(target >= 0.95x)", "(target <= +3%)", "(target <= 2 ms)", "(target within 1.05)"
_TARGET = re.compile(
    rf"\(target (?P<op><=|>=|within) (?P<goal>{_NUMBER})(?: ?(?P<unit>{_UNIT}))?\)"
)
_FIGURE = re.compile(rf"(?P<value>{_NUMBER})(?: ?(?P<unit>{_UNIT}))?$")
_NOTES = re.compile(r"(?:\s*\([^()]*\))+$")  # "(rounds' quartiles 0.57..0.91x)" after it
_NAME = re.compile(r"[\w.-]+(?: [\w.-]+){0,2}")
_BLOCK = re.compile(
    r"<!-- bench:(?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /bench:(?P=name) -->", re.DOTALL
)
_OUTPUT = re.compile(r"```text\n\$ [^\n]*\n(?P<output>.*)```", re.DOTALL)


@dataclass(frozen=True)
class Target:
    """One printed line that states a target, and whether its printed figure meets it."""

    bench: str
    context: str  # the workload the line belongs to ("mlp 512-1024-10"), or ""
    what: str
    printed: str  # the figure as printed: "0.76x", "+3.4%", "2.328 ms"
    note: str  # what the line says between the figure and the target: "rounds' quartiles ..."
    value: float
    op: str  # ">=", "<=" or "within" (a ratio within goal of 1, either way)
    goal: str  # as printed: "0.95x", "+3%", "2 ms", "1.05"
    goal_value: float

    @property
    def met(self) -> bool:
        if self.op == ">=":
            return self.value >= self.goal_value
        if self.op == "<=":
            return self.value <= self.goal_value
        return 1 / self.goal_value <= self.value <= self.goal_value


def targets(bench: str, output: str) -> list[Target]:
    """Every line of a benchmark's ``output`` that states a target. The figure is the number
    just before the target, past any notes in parentheses: "0.76x (rounds' quartiles
    0.57..0.91x) (target >= 0.95x)" gives 0.76x, in the target's unit. A line's context is the
    last line above it that is a name alone, unindented, of at most three words ("mlp
    512-1024-10", "convnet 32x32"): the benchmarks print their workloads' names that way.
    A target this cannot read is an error, not a row left out."""
    found, context = [], ""
    for number, line in enumerate(output.splitlines()):
        match = _TARGET.search(line)
        if match is None:
            if "(target" in line:
                raise ValueError(
                    f"bench/{bench}.py: an unreadable target in {line!r}: write it as "
                    "(target >= 0.95x), (target <= +3%), (target <= 2 ms) or (target within 1.05)"
                )
            if number > 0 and _NAME.fullmatch(line):
                context = line  # a workload's name: "mlp 512-1024-10"
            continue
        head = line[: match.start()].rstrip()
        notes = _NOTES.search(head)
        body = head[: notes.start()] if notes else head
        figure = _FIGURE.search(body)
        if figure is None:
            raise ValueError(f"bench/{bench}.py: no figure before the target in {line!r}")
        unit, goal_unit = figure["unit"] or "", match["unit"] or ""
        if unit != goal_unit:
            raise ValueError(
                f"bench/{bench}.py: the figure is in {unit or 'no unit'} and the target in "
                f"{goal_unit or 'no unit'} in {line!r}"
            )
        goal = float(match["goal"])
        if match["op"] == "within" and (unit not in ("", "x") or goal <= 1):
            raise ValueError(f"bench/{bench}.py: 'within' takes a ratio above 1 in {line!r}")
        note = notes.group().strip()[1:-1].replace(")  (", "; ") if notes else ""
        found.append(
            Target(
                bench,
                context,
                body[: figure.start()].strip().rstrip(":").strip(),
                figure.group(),
                note,
                float(figure["value"]),
                match["op"],
                match.group("goal") + (f" {goal_unit}" if goal_unit == "ms" else goal_unit),
                goal,
            )
        )
    return found


def summary(text: str) -> str:
    """The targets table for docs/benchmarks.md, from the page's benchmark blocks."""
    rows = [
        "| benchmark | what | printed | beside it | target | |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for block in _BLOCK.finditer(text):
        if block["name"] == "summary":
            continue
        output = _OUTPUT.search(block["body"])  # a fence, the command, the output, a fence
        if output is None:
            continue  # a benchmark's block not filled in yet
        for target in targets(block["name"], output["output"]):
            where = f"`{target.bench}`" + (f" ({target.context})" if target.context else "")
            verdict = "met" if target.met else "**missed**"
            rows.append(
                f"| {where} | {target.what} | {target.printed} | {target.note} "
                f"| {target.op} {target.goal} | {verdict} |"
            )
    return "\n".join(rows)


def write_summary(text: str) -> str:
    pattern = re.compile(r"<!-- bench:summary -->.*?<!-- /bench:summary -->", re.DOTALL)
    if not pattern.search(text):
        raise SystemExit("docs/benchmarks.md has no <!-- bench:summary --> block")
    block = f"<!-- bench:summary -->\n{summary(text)}\n<!-- /bench:summary -->"
    return pattern.sub(lambda _: block, text)


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
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--quick", action="store_true", help="smoke runs; the docs stay as they are")
    only.add_argument(
        "--summary",
        action="store_true",
        help="run nothing: rewrite the targets table from the page's blocks as they stand",
    )
    parser.add_argument("names", nargs="*", default=BENCHMARKS, help="which benchmarks")
    args = parser.parse_args()
    text = DOCS.read_text()
    if args.summary:
        DOCS.write_text(write_summary(text))
        print(f"wrote the targets table of {DOCS.relative_to(HERE.parent)}")
        return
    for name in args.names:
        if name == "gpu" and not args.quick and not _cuda():
            # Its block holds a run on a GPU (bash .ci/gpu): a CPU run would replace it.
            print("$ python bench/gpu.py: skipped, no CUDA GPU visible (the docs keep the GPU run)")
            continue
        output = run(name, args.quick)
        if args.quick:
            targets(name, output)  # CI's smoke run: every line that states a target reads
            continue
        block = f"<!-- bench:{name} -->\n```text\n$ python bench/{name}.py\n{output.rstrip()}\n```\n<!-- /bench:{name} -->"
        if name == "soak":  # docs/faults.md shows this run too
            (DOCS.parent / "img" / "soak-output.txt").write_text(output)
        pattern = re.compile(rf"<!-- bench:{name} -->.*?<!-- /bench:{name} -->", re.DOTALL)
        if not pattern.search(text):
            raise SystemExit(f"docs/benchmarks.md has no <!-- bench:{name} --> block")
        text = pattern.sub(lambda _, block=block: block, text)
    if not args.quick:
        DOCS.write_text(text)  # the runs first: a target line the table cannot read loses none
        DOCS.write_text(write_summary(text))
        print(f"wrote {DOCS.relative_to(HERE.parent)}")


if __name__ == "__main__":
    main()
