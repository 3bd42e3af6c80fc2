"""StepBackup: the copy that undoes a failed optimizer step, and the copy made ahead of it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from asyncddp import _sync
from asyncddp._sync import StepBackup, all_finite, squared_norm


def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()


def state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = list(model.parameters())
    momentum = [optimizer.state[p]["momentum_buffer"] for p in params]
    return [t.detach().clone() for t in params + momentum]


def assert_state(model: nn.Module, optimizer: torch.optim.Optimizer, expected: Any) -> None:
    for got, want in zip(state(model, optimizer), expected, strict=True):
        assert torch.equal(got, want)


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the copies a backup makes."""
    made: list[int] = []
    original = _sync._copy_tensors

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_sync, "_copy_tensors", counting)
    return made


def assert_undone_to_the_capture(change: Callable[[nn.Module, Any, StepBackup], None]) -> None:
    """A copy made ahead, then ``change``, then the capture and a step: undoing the step gives
    back the state as it was at the capture."""
    model, optimizer = model_and_optimizer()
    params = list(model.parameters())
    backup = StepBackup()
    train_step(model, optimizer)
    backup.prepare(params, optimizer)
    change(model, optimizer, backup)
    before = state(model, optimizer)
    backup.capture(params, optimizer, None)
    train_step(model, optimizer)
    backup.restore(params, optimizer, None)
    assert_state(model, optimizer, before)


def test_a_copy_made_ahead_is_the_backup_while_nothing_changed(copies: list[int]) -> None:
    assert_undone_to_the_capture(lambda model, optimizer, backup: None)
    assert len(copies) == 1  # the capture kept the copy made ahead


def test_a_copy_made_ahead_of_a_change_is_not_the_backup(copies: list[int]) -> None:
    def change(model: nn.Module, optimizer: Any, backup: StepBackup) -> None:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # after the copy: its version counter moves

    assert_undone_to_the_capture(change)
    assert len(copies) == 2  # copied again


def test_optimizer_state_loaded_after_the_copy_ahead_is_copied_again(copies: list[int]) -> None:
    other_model, other = model_and_optimizer()
    train_step(other_model, other)
    train_step(other_model, other)

    def change(model: nn.Module, optimizer: Any, backup: StepBackup) -> None:
        optimizer.load_state_dict(other.state_dict())  # new momentum tensors, same parameters

    assert_undone_to_the_capture(change)
    assert len(copies) == 2


def test_the_last_backup_still_restores_once_the_next_is_copied_ahead() -> None:
    # A step undone after it ended (a cancellation that came as it reported) goes back to the
    # state before it, though the copy for the next step was made meanwhile.
    model, optimizer = model_and_optimizer()
    params = list(model.parameters())
    backup = StepBackup()
    for _ in range(3):  # so that both sets of buffers have been used
        train_step(model, optimizer)
        backup.prepare(params, optimizer)
        before = state(model, optimizer)
        backup.capture(params, optimizer, None)
        train_step(model, optimizer)
        backup.prepare(params, optimizer)
        backup.restore(params, optimizer, None)
        assert_state(model, optimizer, before)


def test_a_copy_made_ahead_is_forgotten_when_asked(copies: list[int]) -> None:
    # A change through .data leaves no version behind: a call that starts forgets the copy.
    def change(model: nn.Module, optimizer: Any, backup: StepBackup) -> None:
        next(model.parameters()).data.mul_(2.0)
        backup.forget_ahead()

    assert_undone_to_the_capture(change)
    assert len(copies) == 2


def test_a_backup_lets_go_of_optimizer_state_that_was_replaced() -> None:
    # After load_state_dict (a resume does one), the old state must be freed, not kept alive by
    # the backup until the next step.
    model, optimizer = model_and_optimizer()
    params = list(model.parameters())
    other_model, other = model_and_optimizer()
    train_step(other_model, other)
    backup = StepBackup()
    train_step(model, optimizer)
    backup.prepare(params, optimizer)  # a copy made ahead, kept by the capture
    backup.capture(params, optimizer, None)
    train_step(model, optimizer)
    backup.prepare(params, optimizer)  # and one made ahead of the next step
    old = [weakref.ref(optimizer.state[p]["momentum_buffer"]) for p in params]
    optimizer.load_state_dict(other.state_dict())
    backup.forget_ahead()  # as load_into does
    gc.collect()
    assert [ref() for ref in old] == [None] * len(old)


def test_squared_norm_mixes_dtypes() -> None:
    tensors = [
        torch.full((4,), 300.0, dtype=torch.float16),  # 300^2 * 4 overflows float16
        torch.full((2,), 1e3, dtype=torch.float32),
        torch.full((3,), 2.0, dtype=torch.float64),  # torch refuses its norm in float32
    ]
    expected = 4 * 300.0**2 + 2 * 1e6 + 3 * 4.0
    assert squared_norm(tensors) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("bad", "finite"), [(None, True), (float("inf"), False), (float("nan"), False)]
)
def test_all_finite_over_dtypes_and_empty_tensors(bad: float | None, finite: bool) -> None:
    # An empty gradient (a parameter of size 0, or a device's empty chunk) has no largest
    # value: it is finite, and must not make the check raise.
    last = torch.ones(3, dtype=torch.float16)
    if bad is not None:
        last[1] = bad
    tensors = [torch.empty(0), torch.ones(2, dtype=torch.float64), last]
    assert all_finite(tensors) is finite
