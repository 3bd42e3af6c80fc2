"""StepBackup: the copy that undoes a failed optimizer step, and the copy made ahead of it."""

from __future__ import annotations

import collections
import copy
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


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies of the parameters and of every optimizer state value, to compare with."""
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in enumerate(optimizer.state.values())
        },
    }


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert len(got["params"]) == len(want["params"])
    for a, b in zip(got["params"], want["params"], strict=True):
        assert torch.equal(a, b)
    assert got["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        assert got["state"][i].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(got["state"][i][key]), torch.as_tensor(value))


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
    before = snapshot(model, optimizer)
    backup.capture(params, optimizer, None)
    train_step(model, optimizer)
    backup.restore(params, optimizer, None)
    assert_same(snapshot(model, optimizer), before)


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
        before = snapshot(model, optimizer)
        backup.capture(params, optimizer, None)
        train_step(model, optimizer)
        backup.prepare(params, optimizer)
        backup.restore(params, optimizer, None)
        assert_same(snapshot(model, optimizer), before)


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


class Odd(nn.Module):
    """Parameters of every shape a backup in parts has to cut: a matrix, a vector, a scalar,
    and one that is not contiguous (no flat slices: it goes whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 4))
        self.bias = nn.Parameter(torch.randn(5))
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.transposed = nn.Parameter(torch.randn(4, 3).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x @ self.weight.t() + self.bias) * self.scale)[:, :3] @ self.transposed


def replicas(parts: int, *, stepped: bool) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """``parts`` identical replicas with AdamW (a step count and two moments a parameter)."""
    made = []
    for _ in range(parts):
        torch.manual_seed(0)
        model = Odd()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        if stepped:
            torch.manual_seed(1)
            optimizer.zero_grad()
            model(torch.randn(6, 4)).square().sum().backward()
            optimizer.step()
        made.append((model, optimizer))
    return made


@pytest.mark.parametrize("parts", [2, 3, 40])
@pytest.mark.parametrize("stepped", [True, False], ids=["with-state", "first-step"])
def test_a_backup_in_parts_restores_every_replica_whole(parts: int, stepped: bool) -> None:
    # Each replica copies only its part of the elements (40 parts: more than some tensors
    # hold, so some parts are empty); each restore takes every part from its peer.
    group = replicas(parts, stepped=stepped)
    before = snapshot(*group[0])
    backups = [StepBackup() for _ in group]
    for backup, (model, optimizer) in zip(backups, group, strict=True):
        backup.capture(list(model.parameters()), optimizer, None, peers=backups)
    for seed, (model, optimizer) in enumerate(group):  # every replica steps differently
        torch.manual_seed(10 + seed)
        optimizer.zero_grad()
        model(torch.randn(6, 4)).square().sum().backward()
        optimizer.step()
    for backup, (model, optimizer) in zip(backups, group, strict=True):
        backup.restore(list(model.parameters()), optimizer, None)
        assert_same(snapshot(model, optimizer), before)
    assert not group[0][0].transposed.is_contiguous()


def test_a_backup_in_parts_copies_only_its_part() -> None:
    # A whole capture first fills the buffers; after every tensor changes, a capture in parts
    # writes only this replica's share of the elements: the rest still holds the old values.
    model, optimizer = replicas(1, stepped=True)[0]
    backups = [StepBackup(), StepBackup()]
    params = list(model.parameters())

    def flat() -> torch.Tensor:
        live = [p.detach() for p in params]
        for state in optimizer.state.values():
            live.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return torch.cat([t.reshape(-1) for t in live])

    def saved() -> torch.Tensor:
        assert backups[1]._saved is not None
        tensors = _sync._saved_tensors(backups[1]._saved.tensors)
        return torch.cat([t.reshape(-1) for t in tensors])

    backups[1].capture(params, optimizer, None)
    old = flat()
    with torch.no_grad():
        for tensor in [*params, *(v for s in optimizer.state.values() for v in s.values())]:
            tensor.add_(1)
    backups[1].capture(params, optimizer, None, peers=backups)
    new, got = flat(), saved()
    start, stop = _sync.chunk_bounds(new.numel(), 2, 1)
    assert torch.equal(got[start:stop], new[start:stop])
    # Part 0's elements are not copied (the non-contiguous parameter's included: parts are
    # slices in row-major order, whatever the layout).
    assert torch.equal(got[:start], old[:start])
    assert torch.equal(got[stop:], old[stop:])


def test_a_backup_in_parts_survives_a_step_that_changes_a_tensors_layout() -> None:
    # An optimizer may replace a state tensor with one laid out otherwise (here: transposed
    # memory, then contiguous). Capture and restore must cut the parts alike, or a restore
    # reads elements no peer copied.
    parts = 3
    group = []
    for _ in range(parts):
        torch.manual_seed(0)
        model = nn.Linear(7, 5)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for param in model.parameters():  # a state tensor laid out column-major
            state = torch.randn(param.shape[::-1], generator=torch.Generator().manual_seed(1))
            optimizer.state[param]["buf"] = state.t() if param.dim() == 2 else state
        group.append((model, optimizer))
    assert not group[0][1].state[group[0][0].weight]["buf"].is_contiguous()
    before = snapshot(*group[0])
    backups = [StepBackup() for _ in group]
    for backup, (model, optimizer) in zip(backups, group, strict=True):
        backup.capture(list(model.parameters()), optimizer, None, peers=backups)
    for model, optimizer in group:  # the "step": new values, contiguous tensors
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1)
                state = optimizer.state[param]
                state["buf"] = (state["buf"] * 2 + 1).contiguous()
    for backup, (model, optimizer) in zip(backups, group, strict=True):
        backup.restore(list(model.parameters()), optimizer, None)
        assert_same(snapshot(model, optimizer), before)


@pytest.mark.anyio
async def test_a_dropped_trainer_frees_its_backups_in_parts_without_the_cycle_collector() -> None:
    # The backups of a step's replicas held each other (each capture in parts kept every
    # peer's backup): a trainer let go of kept its copies until a full collection ran, which
    # a program making few Python objects may not reach (2.2 GB after a sweep of 6 trainers).
    import asyncddp

    def step(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).square().mean()

    trainer = asyncddp.Trainer(
        nn.Linear(64, 64),
        torch.optim.Adam,
        step,
        devices=asyncddp.cpu_devices(2),
        progress_bar=False,
    )
    await trainer.fit([torch.randn(8, 64) for _ in range(3)], epochs=1)
    backups = [weakref.ref(replica.backup) for replica in trainer._replicas]
    assert all(ref() is not None and ref()._saved is not None for ref in backups)  # type: ignore[union-attr]
    gc.collect()
    gc.disable()
    try:
        del trainer
        assert [ref() for ref in backups] == [None, None]
    finally:
        gc.enable()


class StatsSGD(torch.optim.Optimizer):
    """SGD whose state holds what torch's own optimizers never do: a list of tensors and a
    list of floats per parameter, changed in place, and a count under a key that is not a
    parameter (torch's state_dict saves both)."""

    def __init__(self, params: Any, lr: float = 0.1, owner: Any = None) -> None:
        super().__init__(params, {"lr": lr, "owner": owner})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        shared = self.state["global"]
        shared["t"] = shared.get("t", 0) + 1
        shared["owner"] = self.param_groups[0]["owner"]  # a module the state refers to
        shared.setdefault("sums", collections.deque()).append(
            self.param_groups[0]["params"][0].grad.sum()
        )
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                stats = state.setdefault("stats", [torch.zeros_like(p)])
                stats[0].mul_(0.5).add_(p.grad)
                state.setdefault("norms", []).append(float(p.grad.norm()))
                p.add_(stats[0], alpha=-group["lr"] * shared["t"])


def stats_state(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Every value the state and settings hold, tensors as lists, to compare with ``==``."""

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, (list, collections.deque)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, nn.Module):
            return f"{type(value).__name__} module"  # its identity is checked apart
        return value

    keys = sorted(optimizer.state, key=lambda key: str(key) if isinstance(key, str) else "")
    return [
        [plain(optimizer.state[key]) for key in keys],
        [plain({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups],
    ]


@pytest.mark.parametrize("ahead", [False, True], ids=["captured", "copied-ahead"])
def test_a_restore_puts_back_state_held_in_lists_and_under_other_keys(ahead: bool) -> None:
    # A custom optimizer's lists changed in place, and its entry under "global", were kept by
    # reference or not at all: an undone step left its updates in them (a retry counted the
    # step twice and the parameters ended 3e-3 off a plain loop's).
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    optimizer = StatsSGD(model.parameters(), owner=model)
    params = list(model.parameters())
    backup = StepBackup()
    train_step(model, optimizer)
    if ahead:
        backup.prepare(params, optimizer)
    before = copy.deepcopy(stats_state(optimizer))
    backup.capture(params, optimizer, None)
    weights = [p.detach().clone() for p in params]
    train_step(model, optimizer)
    assert stats_state(optimizer) != before
    assert backup.restore(params, optimizer, None)
    assert stats_state(optimizer) == before
    assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))
    # A module the state or a group refers to stays that module (a copy, after a first
    # version's restore).
    assert optimizer.state["global"]["owner"] is model
    assert optimizer.param_groups[0]["owner"] is model
    train_step(model, optimizer)  # the restored lists are copies: the backup stays as it was
    assert backup.restore(params, optimizer, None)
    assert stats_state(optimizer) == before


def test_a_restore_drops_an_entry_the_failed_step_added_under_another_key() -> None:
    model, optimizer = model_and_optimizer()
    params = list(model.parameters())
    backup = StepBackup()
    train_step(model, optimizer)
    backup.capture(params, optimizer, None)
    optimizer.state["added"] = {"t": 1}
    backup.restore(params, optimizer, None)
    assert "added" not in optimizer.state


def test_a_restore_keeps_the_kind_and_cycles_of_state_it_copies() -> None:
    # Copied item by item, a list holding itself recursed without end, and a deque's subclass
    # came back a plain deque.
    class Window(collections.deque):  # type: ignore[type-arg]
        pass

    model, optimizer = model_and_optimizer()
    params = list(model.parameters())
    cyclic: list[Any] = [1]
    cyclic.append(cyclic)
    optimizer.state["extra"] = {"cyclic": cyclic, "window": Window([1, 2], maxlen=4)}
    backup = StepBackup()
    train_step(model, optimizer)
    backup.capture(params, optimizer, None)
    optimizer.state["extra"]["window"].append(3)
    backup.restore(params, optimizer, None)
    restored = optimizer.state["extra"]
    assert restored["cyclic"][1] is restored["cyclic"]
    assert type(restored["window"]) is Window
    assert list(restored["window"]) == [1, 2]


def test_a_backups_buffers_are_one_block_a_dtype_so_a_part_leaves_the_rest_unbacked() -> None:
    # A backup in parts writes only its part of whole-size buffers, and the pages of the rest
    # stay unbacked only where the buffers are one fresh block: a buffer each, under glibc's
    # 32 MB threshold, reused freed memory, resident already (a resources trial: 4 CPU devices
    # of a model of 16 MB weights kept 2.8 backups' worth, not 1).
    model, optimizer = replicas(1, stepped=True)[0]
    model.extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))  # another dtype, its own
    optimizer.add_param_group({"params": [model.extra]})
    backup = StepBackup()
    params = list(model.parameters())
    backup.capture(params, optimizer, None, peers=[backup, StepBackup()])
    assert backup._saved is not None
    tensors = _sync._saved_tensors(backup._saved.tensors)
    blocks = {(t.dtype, t.untyped_storage().data_ptr()) for t in tensors}
    assert {dtype for dtype, _ in blocks} == {torch.float32, torch.float64}
    assert len(blocks) == 2, blocks
    assert all(t.is_contiguous() for t in tensors)


class _Changing(torch.optim.Optimizer):
    """A custom optimizer whose first parameter's state changes length each step, and whose
    parameter ``k`` gets its first state at step ``k`` (an embedding first used then)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {})
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        params = self.param_groups[0]["params"]
        self.state[params[0]]["history"] = torch.zeros(1000 + self.steps)
        if self.steps + 1 < len(params):
            self.state[params[self.steps + 1]]["m"] = torch.zeros(10)
        self.steps += 1


@pytest.mark.parametrize("switch", ["shape", "dtype"])
def test_a_backups_blocks_do_not_keep_the_buffers_it_replaced(switch: str) -> None:
    # A block kept for the buffers that still fit kept the replaced ones' slots too: 7.6 MB
    # more a step for a state changing shape each step (a review), one dead copy of a state
    # that changed dtype once.
    params = [nn.Parameter(torch.zeros(10)) for _ in range(12)]
    optimizer: torch.optim.Optimizer = (
        _Changing(params) if switch == "shape" else torch.optim.Adam(params, lr=0.1)
    )
    backup = StepBackup()

    def held() -> int:
        assert backup._saved is not None
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in _sync._saved_tensors(backup._saved.tensors)
        }
        return sum(storages.values())

    for step in range(10):
        backup.capture(params, optimizer, None)
        live = sum(t.nbytes for t in _sync._saved_tensors(backup._saved.tensors))  # type: ignore[union-attr]
        assert held() == live, (step, held(), live)
        for param in params:
            param.grad = torch.ones_like(param)
        optimizer.step()
        if switch == "dtype" and step == 3:
            for state in optimizer.state.values():  # exp_avg stays, in the old block
                state["exp_avg_sq"] = state["exp_avg_sq"].double()
