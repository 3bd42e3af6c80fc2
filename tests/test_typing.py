"""The package's types as a typed program meets them: ``mypy --strict`` over asyncddp and over
tests/typing_usage.py, user code that must type-check and mistakes that must not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_the_package_and_typed_user_code_pass_mypy_strict(tmp_path: Path) -> None:
    # One run for both (mypy reads torch's stubs once: about 30 s cold on 2 cores). The
    # package's settings are pyproject.toml's; the usage file's mistakes each carry an ignore
    # that --strict reports as unused once mypy no longer catches the mistake.
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--cache-dir",
            str(tmp_path / "mypy"),
            "asyncddp",
            "tests/typing_usage.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
