"""The examples, the README and the CI script, as a new user meets them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(*args: str) -> str:
    completed = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_quickstart_prints_what_its_comment_says() -> None:
    assert run_example("examples/quickstart.py").strip() == "loss 2.8094 -> 0.000004"


def test_scheduler_quickstart_prints_what_its_comment_says() -> None:
    out = run_example("examples/scheduler_quickstart.py")
    assert out.strip() == "(30.0, 255.0) 10/? items"


def test_scheduler_basics_trains_and_names_the_failed_device() -> None:
    out = run_example("examples/scheduler_basics.py", "--devices", "3", "--epochs", "2")
    assert "training on cpu#0, cpu#1, cpu#2" in out
    losses = [float(loss) for loss in re.findall(r"loss ([0-9.]+)", out)]
    assert len(losses) == 2
    assert losses[-1] < 0.001
    assert "4096/4096 items" in out
    assert "caught: training worker on device cpu#2 failed: " in out


def test_early_stopping_prints_what_the_docs_show() -> None:
    out = run_example("examples/early_stopping.py")
    assert out == (ROOT / "docs" / "img" / "early-stopping-output.txt").read_text()
    assert "stopped after epoch 9; kept epoch 6" in out  # early, and the best epoch's weights


def test_keep_last_keeps_the_newest_checkpoints_across_fits_and_resumes() -> None:
    # The recipe it replaced, in training.md, counted what one fit saved: it kept every
    # checkpoint of a script that fits one epoch at a time or resumes, and one path saved
    # twice (save_checkpoint() at an epoch's end) made it delete a file twice, and raise.
    out = run_example("examples/keep_last.py")
    assert out.strip() == (
        "kept: epoch0002-step000008-best.ckpt, epoch0007-step000028.ckpt, "
        "epoch0008-step000032.ckpt, epoch0009-step000036.ckpt"
    )


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM handlers are POSIX's")
def test_preemption_saves_on_sigterm_exits_0_and_the_next_run_goes_on(tmp_path: Path) -> None:
    # Python's default for SIGTERM (Kubernetes, Slurm, docker stop) ended the process at
    # once, and the epoch in progress was lost; nothing in the docs said what to do.
    import signal
    import time

    command = [sys.executable, "examples/preemption.py", str(tmp_path)]
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as job:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("*.ckpt")) and time.monotonic() < deadline:
            time.sleep(0.02)  # the first epoch's checkpoint: training is under way
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    saved = re.fullmatch(r"stopped at step (\d+): saved (epoch\d+-step(\d+)\.ckpt)\n", out)
    assert saved, out
    assert saved[1] == saved[3].lstrip("0")
    assert (tmp_path / saved[2]).is_file()
    # Run again: it resumes from there and ends where one uninterrupted run would.
    assert run_example("examples/preemption.py", str(tmp_path)) == "done: 20 epochs, step 1280\n"


def test_trio_quickstart_runs_under_trio() -> None:
    assert run_example("examples/trio_quickstart.py").strip() == "(2, 4)"


def test_the_users_test_example_passes() -> None:
    out = run_example(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", "examples/test_with_asyncddp.py"
    )
    assert "2 passed" in out


def test_readme_example_is_the_quickstart_file() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme, re.DOTALL)
    assert block is not None
    quickstart = (ROOT / "examples" / "quickstart.py").read_text()
    assert block.group(1).strip() in quickstart


def test_ci_runs_the_readme_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.DOTALL)
    commands = [line for block in blocks for line in block.splitlines() if line.strip()]
    assert commands, "the README shows no commands"
    for command in commands:
        assert command in ci, f".ci/run does not run the README's {command!r}"


def test_the_gpu_checks_fail_where_no_gpu_is_visible(tmp_path: Path) -> None:
    # Every CUDA test would be skipped there, and a run that passed would say nothing.
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: bash .ci/gpu runs for real there")
    completed = subprocess.run(
        ["bash", ".ci/gpu", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert completed.returncode == 1
    assert "no CUDA GPU visible to torch: nothing to check" in completed.stderr
    assert "every GPU check passed" not in completed.stdout
    assert list(tmp_path.iterdir()) == []  # no stage ran


def test_events_example_prints_what_the_docs_show() -> None:
    out = run_example("examples/events.py")
    assert out == (ROOT / "docs" / "img" / "events-output.txt").read_text()
    assert out.strip().endswith("fit ended: stopped=False, error=None")


def test_distributed_example_runs_under_torchrun_on_two_processes() -> None:
    out = run_example(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "examples/distributed_digits.py",
        "--epochs",
        "2",
    )
    lines = out.strip().splitlines()
    assert lines[0] == "2 ranks x 1 device(s) (cpu each)"  # rank 0 alone prints
    assert len(lines) == 3
    for line in lines[1:]:
        assert "over 1437 digits" in line  # every training digit once, across both ranks
    accuracy = float(re.findall(r"valid accuracy ([0-9.]+)%", lines[-1])[0])
    assert accuracy > 70.0
    # The docs show a 5-epoch run of the same script: its first epochs are these.
    shown = (ROOT / "docs" / "img" / "distributed-output.txt").read_text().splitlines()
    assert lines == shown[:3]
