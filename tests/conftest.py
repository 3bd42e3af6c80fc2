from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
import torch

from asyncddp.testing import asyncddp_threads


# --8<-- [start:warm_up]
@pytest.fixture(scope="session", autouse=True)
def torch_warmed_up() -> None:
    """Pay torch's one-time cost of the first optimizer (it imports torch._dynamo, ~1 s) before
    any test: tests that cancel after a fraction of a second then behave alike, run alone or
    after others."""
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)


# --8<-- [end:warm_up]


# --8<-- [start:backends]
@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs under asyncio and under trio (through anyio's pytest plugin)."""
    return str(request.param)


# --8<-- [end:backends]


# --8<-- [start:no_leaked_worker_threads]
@pytest.fixture(autouse=True)
def no_leaked_worker_threads() -> Iterator[None]:
    """Fail any test that leaves an asyncddp worker thread alive."""
    before = set(asyncddp_threads())
    yield
    leaked = [thread for thread in asyncddp_threads() if thread not in before]
    for thread in leaked:
        thread.join(timeout=2.0)  # a thread that is on its way out gets a moment to finish
    alive = [thread.name for thread in leaked if thread.is_alive()]
    assert not alive, f"worker threads left alive: {alive}"


# --8<-- [end:no_leaked_worker_threads]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """An event that a hanging job waits for; set at the end of the test in any case."""
    event = threading.Event()
    yield event
    event.set()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The robustness figures: faults tried, concurrency, load, crashes while writing."""
    faults = sys.modules.get("test_faults") or sys.modules.get("tests.test_faults")
    tried = getattr(faults, "TRIED", [])
    if tried:
        kinds = sorted({entry.split("/")[0] for entry in tried})
        terminalreporter.write_line(
            f"asyncddp fault injection: {len(tried)} faults tried and recovered from "
            f"({', '.join(kinds)}); no worker thread left behind"
        )
    robustness = sys.modules.get("test_robustness") or sys.modules.get("tests.test_robustness")
    for name, figure in getattr(robustness, "FIGURES", {}).items():
        terminalreporter.write_line(f"asyncddp {name}: {figure}")
