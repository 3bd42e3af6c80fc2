"""The asyncddp command, run as a user runs it: a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import asyncddp
from asyncddp._cli import main, parse_devices


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncddp", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_demo_reaches_over_90_percent_on_two_cpu_workers_and_summarises() -> None:
    completed = run("demo", "--epochs", "6", "--devices", "2")
    assert completed.returncode == 0, completed.stderr
    out = completed.stdout
    assert "training on cpu#0, cpu#1: 1437 digits" in out
    epochs = [line.split(":")[0] for line in out.splitlines() if line.startswith("epoch")]
    assert epochs == [f"epoch {n:2d}" for n in range(1, 7)]  # one line an epoch, in order
    summary = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"done: 2 devices \(cpu#0, cpu#1\), [0-9,]+ items/s, [0-9.]+ s, final train loss [0-9.]+, "
        r"valid accuracy [0-9.]+%",
        summary,
    ), summary
    accuracy = float(summary.rsplit(" ", 1)[1].rstrip("%"))
    assert accuracy > 90.0


def test_demo_lines_reach_a_pipe_as_each_epoch_ends() -> None:
    # Into a pipe (a container's log), stdout is block-buffered: every line came at once at
    # exit, and none if the process was killed first (an operations trial's SIGTERM after
    # 15 s). Flushed, the first line comes before the training, the last after it.
    import os
    import time

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    command = [sys.executable, "-m", "asyncddp", "demo", "--epochs", "5", "--devices", "2"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as demo:
        assert demo.stdout is not None
        arrived = [(time.monotonic(), line) for line in demo.stdout]
    assert demo.returncode == 0
    assert arrived[0][1].startswith("training on cpu#0, cpu#1")
    assert arrived[-1][1].startswith("done: 2 devices")
    # Five epochs of training lie between them (seconds); unflushed, both came in one write.
    assert arrived[-1][0] - arrived[0][0] > 0.2, arrived


def test_demo_on_one_device_says_device(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(asyncddp._devices, "_cuda_device_count", lambda: 0)  # 1: one CPU worker
    assert main(["demo", "--epochs", "1", "--devices", "1"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("done: 1 device (cpu#0), "), summary


def test_help_and_version() -> None:
    completed = run("--help")
    assert completed.returncode == 0
    assert "demo" in completed.stdout
    assert "devices" in completed.stdout
    assert run("--version").stdout.strip() == f"asyncddp {asyncddp.__version__}"
    assert "--epochs" in run("demo", "--help").stdout


def test_bad_devices_are_a_clear_error_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--devices", "gpu7"]) == 2
    error = capsys.readouterr().err
    assert "unknown device 'gpu7'" in error
    # The hint is the command line's, not the Python API's.
    assert "give --devices cpu#0,cpu#1 for two CPU workers" in error
    assert "asyncddp.cpu_devices" not in error
    assert main(["devices", "cpu,cpu"]) == 2
    assert "give cpu#0,cpu#1 for two CPU workers" in capsys.readouterr().err
    assert main(["demo", "--epochs", "0"]) == 2
    assert "--epochs must be at least 1, got 0" in capsys.readouterr().err  # which one
    assert main(["demo", "--batch-size", "-3"]) == 2
    assert "--batch-size must be at least 1, got -3" in capsys.readouterr().err


def test_a_spec_s_warning_is_the_command_s_own_line_in_its_terms(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # It came as a raw Python warning ("/.../bin/asyncddp:6: AsyncDDPWarning: ..." and the
    # source line), with the demo's "--devices 2" as the hint of `asyncddp devices`, which
    # takes the spec alone.
    assert main(["devices", "cpu:1"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("asyncddp devices: warning: 'cpu:1' is the CPU, one worker")
    assert "for 2 CPU workers, give 2," in err
    assert "asyncddp.cpu_devices" not in err
    assert "--devices" not in err
    assert main(["devices", "cpu:1,cpu:2"]) == 2  # it warns, then fails: both shown
    err = capsys.readouterr().err
    assert "asyncddp devices: warning: 'cpu:1' is the CPU" in err
    assert "device cpu is given twice" in err


def test_devices_command_lists_what_a_spec_resolves_to(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices", "3"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "0: cpu#0 (cpu)",
        "1: cpu#1 (cpu)",
        "2: cpu#2 (cpu)",
    ]


def test_devices_command_says_a_trainer_refuses_gpus_and_the_cpu_together(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(asyncddp._devices, "_cuda_device_count", lambda: 1)
    assert main(["devices", "cpu,cuda:0"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == ["0: cpu (cpu)", "1: cuda:0 (cuda:0)"]
    assert "a Trainer refuses GPUs and the CPU together" in err
    assert main(["devices", "cuda:0"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3", 3),
        ("cpu", "cpu"),
        ("cuda:0,cuda:2", ["cuda:0", "cuda:2"]),
        (" cuda ", "cuda"),
        ("0,2", [0, 2]),  # CUDA indices, as devices=[0, 2] in Python
        ("-1", -1),  # a count, refused as one
        ("cpu#1,", "cpu#1"),  # a list of one is its one item
        ("\u0663", "\u0663"),  # an Arabic-Indic three: ASCII digits only, as in 'cpu#N'
    ],
)
def test_parse_devices(text: str, expected: object) -> None:
    assert parse_devices(text) == expected


@pytest.mark.parametrize("text", ["auto", "AUTO", " Auto ", "auto,"])
def test_auto_is_two_cpu_workers_without_a_gpu(text: str) -> None:
    # In any case, as every other name: AUTO used to be read as 'cpu', one worker.
    spec = parse_devices(text)
    if isinstance(spec, str):
        assert spec == "cuda"
    else:
        assert [d.name for d in asyncddp.resolve_devices(spec)] == ["cpu#0", "cpu#1"]


def test_a_count_below_one_or_past_the_cpu_limit_is_a_clear_error_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["devices", "-1"]) == 2
    assert "asked for -1 devices; give at least 1" in capsys.readouterr().err
    # It used to build a list of a billion devices, and end in a MemoryError.
    assert main(["devices", "1000000000"]) == 2
    assert "asked for 1000000000 CPU devices; at most 1024" in capsys.readouterr().err


def test_the_demo_without_scikit_learn_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncddp._demo import digits_loaders

    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import fails, as uninstalled
    with pytest.raises(ImportError, match=r"pip install scikit-learn") as caught:
        digits_loaders(64)
    assert "pip install -e '.[examples]'" in str(caught.value)
    assert isinstance(caught.value.__cause__, ImportError)
