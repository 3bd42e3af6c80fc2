"""bench/report.py's targets table: the lines that state a target, and met or missed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


report = _load_report()

THROUGHPUT = """\
samples/s, global batch 256, 2 CPU threads in all, median of 9 rounds x 60 steps
mlp 512-1024-10
  plain                        39971 samples/s  (  6.40 ms/step)
  asyncddp-2 / plain  0.76x (rounds' quartiles 0.57..0.91x)  (target >= 0.95x)
  halves-2 / plain  1.14x (rounds' quartiles 0.97..1.36x)  (the compute alone)
  asyncddp-1 per step vs plain: +3.4% (rounds' quartiles -20.8%..+16.8%)  (target <= +3%)
convnet 32x32
  asyncddp-2 / plain  1.06x (rounds' quartiles 0.93..1.19x)  (target >= 0.95x)
  asyncddp-1 per step vs plain: -6.7% (rounds' quartiles -12.2%..+4.8%)  (target <= +3%)
"""


def test_every_target_line_is_read_with_its_workload_and_figure() -> None:
    found = report.targets("throughput", THROUGHPUT)
    assert [(t.context, t.what, t.printed, t.op, t.goal, t.met) for t in found] == [
        ("mlp 512-1024-10", "asyncddp-2 / plain", "0.76x", ">=", "0.95x", False),
        ("mlp 512-1024-10", "asyncddp-1 per step vs plain", "+3.4%", "<=", "+3%", False),
        ("convnet 32x32", "asyncddp-2 / plain", "1.06x", ">=", "0.95x", True),
        ("convnet 32x32", "asyncddp-1 per step vs plain", "-6.7%", "<=", "+3%", True),
    ]
    assert found[0].note == "rounds' quartiles 0.57..0.91x"


@pytest.mark.parametrize(
    ("line", "printed", "met"),
    [
        ("  asyncddp (2 CPU workers) p99 2.328 ms (target <= 2 ms)", "2.328 ms", False),
        ("  asyncddp (2 CPU workers) p99 2.000 ms (target <= 2 ms)", "2.000 ms", True),
        ("  asyncddp-2proc / ddp-gloo-2  1.00x  (target >= 1.0x)", "1.00x", True),
        ("  asyncddp-2proc / ddp-gloo-2  0.99x  (target >= 1.0x)", "0.99x", False),
        ("  2 devices, asyncddp / blocking  1.50x  (target <= 1.0x)", "1.50x", False),
        (
            "  2 replicas, 10 MB / copy_  0.51x  (at most 0.5x in one memory)  (target >= 0.5x)",
            "0.51x",
            True,
        ),
        ("  memory: first 310.1 MB, last/first 1.003 (target within 1.05)", "1.003", True),
        ("  memory: first 310.1 MB, last/first 1.060 (target within 1.05)", "1.060", False),
        ("  memory: first 310.1 MB, last/first 0.940 (target within 1.05)", "0.940", False),
        # A number with a unit earlier on the line, or in a note, is not the figure.
        ("  a 0.5 ms step: 1.20x (quartiles 1.0..1.3x)  (target >= 1.0x)", "1.20x", True),
        ("  a 0.5 ms step: 0.90x (quartiles 1.0..1.3x)  (target >= 1.0x)", "0.90x", False),
    ],
)
def test_the_figure_is_compared_with_the_target(line: str, printed: str, met: bool) -> None:
    (target,) = report.targets("some", f"description\n{line}\n")
    assert (target.printed, target.met) == (printed, met)
    assert "target" not in target.note


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("  asyncddp is fast (target >= 1.0x)", "no figure before the target"),
        # The name's last digit is not a figure.
        ("  asyncddp-2proc / ddp-gloo-2 (target >= 1.0x)", "no figure before the target"),
        ("  asyncddp-2 / plain  0.76x  (target > 0.95x)", "an unreadable target"),
        ("  asyncddp p99 1.2 ms (target <= 2 s)", "an unreadable target"),
        ("  asyncddp-1 vs plain: +3.4%  (target <= 3x)", "the figure is in % and the target in x"),
        ("  asyncddp p99 1.2 ms (target <= 2)", "the figure is in ms and the target in no unit"),
        ("  memory last/first 1.01 (target within 0.95)", "'within' takes a ratio above 1"),
        ("  memory: +1.0% (target within 5%)", "'within' takes a ratio above 1"),
    ],
)
def test_a_target_line_it_cannot_read_is_an_error(line: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        report.targets("some", f"description\n{line}\n")


def test_the_table_is_built_from_the_blocks_alone() -> None:
    page = (
        "prose (target >= 9x) is not a block\n"
        "<!-- bench:summary -->\nstale\n<!-- /bench:summary -->\n"
        "<!-- bench:new -->\n<!-- /bench:new -->\n"  # a block not filled in yet
        "<!-- bench:throughput -->\n```text\n$ python bench/throughput.py\n"
        f"{THROUGHPUT}```\n<!-- /bench:throughput -->\n"
    )
    written = report.write_summary(page)
    table = written.split("<!-- bench:summary -->\n")[1].split("\n<!-- /bench:summary -->")[0]
    rows = table.splitlines()
    assert rows[2] == (
        "| `throughput` (mlp 512-1024-10) | asyncddp-2 / plain | 0.76x "
        "| rounds' quartiles 0.57..0.91x | >= 0.95x | **missed** |"
    )
    assert rows[5] == (
        "| `throughput` (convnet 32x32) | asyncddp-1 per step vs plain | -6.7% "
        "| rounds' quartiles -12.2%..+4.8% | <= +3% | met |"
    )
    assert len(rows) == 6  # the header, its rule and the four target lines; no prose, no stale


def test_the_docs_table_is_what_the_docs_blocks_print() -> None:
    """Fails when a block was rerun, or the table edited, without ``bench/report.py --summary``."""
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert report.write_summary(page) == page, "run: python bench/report.py --summary"
