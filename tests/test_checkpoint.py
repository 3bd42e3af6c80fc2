"""A state that does not fit the trainer is refused whole, before any of it is taken.

``Trainer.load_state_dict`` and ``fit(resume=...)`` take the position first and the tensors
after; before ``_checkpoint.check_fits``, a state of another model or optimizer raised half
way (torch's own RuntimeError, ValueError or a KeyError), after the epoch, step and history,
and on several devices the first replica's weights, had been replaced: the next fit went on
from another run's position with a mix of two runs' replicas.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asyncddp import (
    AsyncDDPWarning,
    CheckpointError,
    ConfigurationError,
    StepEnded,
    Trainer,
    _checkpoint,
    cpu_devices,
)

pytestmark = pytest.mark.anyio

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=0.01)
Batch = tuple[torch.Tensor, torch.Tensor]


def batches(n: int = 3, out_features: int = 2) -> list[Batch]:
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(6, 4, generator=generator)
    return [(inputs, torch.randn(6, out_features, generator=generator))] * n


def step(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def make_trainer(
    devices: int,
    out_features: int = 2,
    *,
    model: Callable[[], nn.Module] | None = None,
    optimizer: Any = SGD,
    **options: Any,
) -> Trainer:
    torch.manual_seed(0)
    module = model() if model is not None else nn.Linear(4, out_features)
    return Trainer(
        module, optimizer, step, devices=cpu_devices(devices), progress_bar=False, **options
    )


def what_it_holds(trainer: Trainer) -> dict[str, Any]:
    """Everything a load may change: position, weights of every replica, optimizer state."""
    state = trainer.state_dict()
    del state["rng"]  # the generators move on by themselves
    del state["epoch_seconds"]  # and the clock
    state["history"] = [{k: v for k, v in r.items() if k != "seconds"} for r in state["history"]]
    replicas = [r.model.state_dict() for r in trainer._replicas] or [trainer.model.state_dict()]
    return copy.deepcopy({**state, "replicas": replicas})


def assert_same(actual: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected)
        for a, b in zip(actual, expected, strict=True):
            assert_same(a, b)
    else:
        assert actual == expected


def another_model(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "model": {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}}


def missing_bias(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "model": {"weight": state["model"]["weight"]}}


def extra_key(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "model": {**state["model"], "scale": torch.ones(1)}}


def another_optimizer(state: dict[str, Any]) -> dict[str, Any]:
    # One parameter where the trainer's optimizer has two: found before any fit builds one too
    # (the total is checked then; how a state groups them, once the replicas are built).
    optimizer = {"state": {}, "param_groups": [{"params": [0], "lr": 0.1}]}
    return {**state, "optimizer": optimizer}


def adam_s_state(state: dict[str, Any]) -> dict[str, Any]:
    # The same parameters, another kind of optimizer: torch loads it into SGD without a word,
    # and the next step would fail for want of SGD's momentum.
    model = nn.Linear(4, 2)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    adam.step()
    return {**state, "optimizer": adam.state_dict()}


def no_step_count(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in state.items() if key != "global_step"}


def a_model_state(state: dict[str, Any]) -> dict[str, Any]:
    return dict(state["model"])  # a model's own state_dict(), given to the trainer


BAD: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], str]] = {
    "another model": (another_model, r"size mismatch for weight: .* torch\.Size\(\[3, 4\]\)"),
    "missing key": (missing_bias, r'Missing key\(s\) in state_dict: "bias"'),
    "unexpected key": (extra_key, r'Unexpected key\(s\) in state_dict: "scale"'),
    "another optimizer": (another_optimizer, "the state's optimizer does not load"),
    "another kind of optimizer": (adam_s_state, r"it has no 'dampening', 'momentum', which"),
    "no step count": (no_step_count, "the state has no 'global_step'"),
    "a model's own state": (a_model_state, "trainer.model.load_state_dict"),
}


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("built", [True, False], ids=["after-a-fit", "before-any-fit"])
@pytest.mark.parametrize("bad", list(BAD))
async def test_a_state_that_does_not_fit_is_refused_and_nothing_of_it_is_taken(
    bad: str, built: bool, devices: int
) -> None:
    donor = make_trainer(devices)
    await donor.fit(batches(), epochs=1)
    corrupt, message = BAD[bad]
    state = corrupt(donor.state_dict())

    trainer, twin = make_trainer(devices), make_trainer(devices)
    if built:
        for each in (trainer, twin):
            await each.fit(batches(), epochs=2)
    before = what_it_holds(trainer)
    with pytest.raises(CheckpointError, match=message):
        trainer.load_state_dict(state)
    assert_same(what_it_holds(trainer), before)

    # ... and it trains on as the twin that never saw the state.
    for each in (trainer, twin):
        await each.fit(batches(), epochs=3)
    assert_same(what_it_holds(trainer), what_it_holds(twin))


async def test_resuming_from_another_model_s_checkpoint_is_refused_before_fit_moves(
    tmp_path: Path,
) -> None:
    other = make_trainer(2, out_features=3)
    await other.fit(batches(out_features=3), epochs=1)
    path = await other.save_checkpoint(tmp_path / "other.ckpt")
    trainer = make_trainer(2)
    await trainer.fit(batches(), epochs=2)
    before = what_it_holds(trainer)
    with pytest.raises(CheckpointError, match=r"does not load into trainer\.model"):
        await trainer.fit(batches(), epochs=4, resume=path)
    assert_same(what_it_holds(trainer), before)


@pytest.mark.parametrize(
    ("entry", "value"),
    [("global_step", None), ("history", "x"), ("epoch_items", 5), ("epoch_sums", [1])],
)
async def test_a_state_with_an_entry_that_cannot_be_read_is_refused_whole(
    entry: str, value: Any
) -> None:
    # Edited by hand: the position was taken up to that entry, not the weights, and a bare
    # TypeError came up; the next fit then trained from the untouched weights at the position
    # of the other run.
    donor = make_trainer(2)
    await donor.fit(batches(), epochs=2)
    state = {**donor.state_dict(), entry: value}
    trainer = make_trainer(2)
    await trainer.fit(batches(), epochs=1)
    before = what_it_holds(trainer)
    with pytest.raises(CheckpointError, match=rf"the state's '{entry}' entry cannot be read"):
        trainer.load_state_dict(state)
    assert_same(what_it_holds(trainer), before)
    assert (trainer.epoch, trainer.global_step) == (1, 3)


async def test_a_state_whose_generators_cannot_be_read_leaves_them_as_they_were() -> None:
    # Its rng entry's NumPy part failed after torch's and Python's generators were set.
    import random

    donor = make_trainer(2)
    await donor.fit(batches(), epochs=1)
    state = donor.state_dict()
    state["rng"] = {**state["rng"], "numpy": "not a state"}
    trainer = make_trainer(2)
    torch.rand(3), random.random()  # elsewhere than the donor's (seeded alike)
    torch_before, python_before = torch.get_rng_state(), random.getstate()
    with pytest.raises(CheckpointError, match=r"the state's 'rng' entry cannot be read"):
        trainer.load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), torch_before)
    assert random.getstate() == python_before


async def test_a_state_that_fits_still_loads_whole() -> None:
    donor = make_trainer(2)
    await donor.fit(batches(), epochs=2)
    trainer = make_trainer(2)
    await trainer.fit(batches(), epochs=1)
    trainer.load_state_dict(donor.state_dict())
    assert (trainer.epoch, trainer.global_step) == (2, 6)
    assert_same(what_it_holds(trainer)["replicas"], what_it_holds(donor)["replicas"])


async def test_a_state_is_not_loaded_while_a_fit_runs() -> None:
    trainer = make_trainer(2)
    await trainer.fit(batches(), epochs=1)
    state = trainer.state_dict()
    refused: list[BaseException] = []
    stream = trainer.events()

    async def load_during_the_fit() -> None:
        async for event in stream:
            if isinstance(event, StepEnded):
                with pytest.raises(
                    ConfigurationError, match=r"fit\(\) is already running"
                ) as error:
                    trainer.load_state_dict(state)
                refused.append(error.value)
                return

    async with anyio.create_task_group() as group:
        group.start_soon(load_during_the_fit)
        await trainer.fit(batches(), epochs=3)
    assert refused
    assert trainer.epoch == 3


async def regrouped_state() -> tuple[dict[str, Any], dict[str, Any]]:
    """A trainer's state, and the same with its one optimizer group cut in two."""
    donor = make_trainer(1)
    await donor.fit(batches(), epochs=1)
    state = donor.state_dict()
    groups = [{**state["optimizer"]["param_groups"][0], "params": [i]} for i in (0, 1)]
    return state, {**state, "optimizer": {**state["optimizer"], "param_groups": groups}}


def real_devices_only(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if params[0].device.type == "meta":
        raise RuntimeError("this optimizer runs on real devices only")
    return SGD(params)


async def test_a_state_grouped_otherwise_is_refused_before_any_fit_built_an_optimizer() -> None:
    _, regrouped = await regrouped_state()
    trainer = make_trainer(2)
    before = what_it_holds(trainer)
    with pytest.raises(CheckpointError, match="different number of parameter groups"):
        trainer.load_state_dict(regrouped)
    assert_same(what_it_holds(trainer), before)


async def test_an_optimizer_that_builds_on_real_devices_only_is_checked_as_the_fit_starts() -> None:
    # The check builds a probe optimizer over meta tensors; a factory that refuses them is
    # checked once the fit has built the real one, before any step, naming the state.
    state, regrouped = await regrouped_state()
    torch.manual_seed(0)
    trainer = Trainer(
        nn.Linear(4, 2), real_devices_only, step, devices=cpu_devices(2), progress_bar=False
    )
    trainer.load_state_dict(regrouped)
    for _ in range(2):  # and again: the state is not dropped half taken
        with pytest.raises(CheckpointError, match=r"\[1, 1\] parameters in the state, \[2\]"):
            await trainer.fit(batches(), epochs=2)
    assert trainer.global_step == 3  # the state's position; no step was trained
    trainer.load_state_dict(state)
    await trainer.fit(batches(), epochs=2)
    assert trainer.global_step == 6


def subset_factory(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return SGD([p for p in params if p.ndim > 1])  # the weights only: biases stay as built


@pytest.mark.parametrize(
    ("case", "built"),
    [
        ("optimizer over some parameters", True),
        ("optimizer over some parameters", False),
        ("no num_batches_tracked", True),
        ("no num_batches_tracked", False),
        ("lazy module", False),  # a lazy module's shapes come from the state: it cannot train
    ],
)
async def test_states_that_torch_loads_still_load(case: str, built: bool) -> None:
    # The check tries the load as torch does (on meta tensors): load hooks, lazy modules and
    # optimizers over part of the model pass as they did before it.
    def model(lazy: bool = False) -> nn.Module:
        torch.manual_seed(0)
        if case == "no num_batches_tracked":
            return nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2))
        return nn.Sequential(nn.LazyLinear(2) if lazy else nn.Linear(4, 2))

    factory = subset_factory if case == "optimizer over some parameters" else SGD
    donor = Trainer(model(), factory, step, devices=cpu_devices(2), progress_bar=False)
    await donor.fit(batches(), epochs=1)
    state = donor.state_dict()
    if case == "no num_batches_tracked":  # as BatchNorm states from before torch 0.4.1
        del state["model"]["1.num_batches_tracked"]
    lazy = case == "lazy module"
    trainer = Trainer(model(lazy), factory, step, devices=cpu_devices(2), progress_bar=False)
    if built:
        await trainer.fit(batches(), epochs=1)
    trainer.load_state_dict(state)
    await trainer.fit(batches(), epochs=2)
    assert trainer.global_step == 6


async def test_changes_to_trainer_model_after_a_load_before_any_fit_are_kept() -> None:
    donor = make_trainer(2)
    await donor.fit(batches(), epochs=1)
    trainer = make_trainer(2)
    trainer.load_state_dict(donor.state_dict())
    with torch.no_grad():
        trainer.model.weight.zero_()  # the pending state no longer loads over this
    await trainer.validate(batches())
    for replica in trainer._replicas:
        assert torch.equal(replica.model.weight, torch.zeros(2, 4)), replica.device


async def test_a_trainer_s_own_state_loads_after_a_layer_was_frozen_between_fits() -> None:
    # The optimizers were built over every parameter: the state is checked against them,
    # not against what the factory would build over the parameters that train now.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    trainer = Trainer(model, SGD, step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(batches(), epochs=1)
    trainer.model[0].requires_grad_(False)
    await trainer.fit(batches(), epochs=2)
    trainer.load_state_dict(trainer.state_dict())
    await trainer.fit(batches(), epochs=3)
    assert trainer.global_step == 9


async def test_a_state_grouped_otherwise_is_refused_after_a_fit_whatever_the_factory() -> None:
    _, regrouped = await regrouped_state()
    torch.manual_seed(0)
    trainer = Trainer(
        nn.Linear(4, 2), real_devices_only, step, devices=cpu_devices(2), progress_bar=False
    )
    await trainer.fit(batches(), epochs=2)
    before = what_it_holds(trainer)
    with pytest.raises(CheckpointError, match=r"\[1, 1\] parameters in the state, \[2\]"):
        trainer.load_state_dict(regrouped)
    assert_same(what_it_holds(trainer), before)


@pytest.mark.parametrize("built", [True, False], ids=["after-a-fit", "before-any-fit"])
async def test_sgd_s_state_into_an_adam_trainer_is_refused_and_nothing_of_it_is_taken(
    built: bool,
) -> None:
    # torch's own load fails half way here (Adam reads each parameter's 'step'), after the
    # weights would have been taken.
    donor = make_trainer(2)
    await donor.fit(batches(), epochs=1)
    trainer = make_trainer(2, optimizer=ADAM)
    if built:
        await trainer.fit(batches(), epochs=2)
    before = what_it_holds(trainer)
    with pytest.raises(CheckpointError, match="saved with another kind of optimizer"):
        trainer.load_state_dict(donor.state_dict())
    assert_same(what_it_holds(trainer), before)
    await trainer.fit(batches(), epochs=3)  # and it still trains


# torch's SequentialLR steps its schedulers with an epoch at each milestone, and warns of it
# itself up to torch 2.8 (pytorch/pytorch#116776): not asyncddp's warning to keep.
TORCHS_SEQUENTIAL_LR_WARNING = pytest.mark.filterwarnings(
    r"ignore:The epoch parameter in `scheduler\.step\(\)` was not necessary:UserWarning"
)


@TORCHS_SEQUENTIAL_LR_WARNING
@pytest.mark.parametrize("built", [True, False], ids=["after-a-fit", "before-any-fit"])
@pytest.mark.parametrize("kind", ["sequential", "cosine", "inside a sequential"])
async def test_another_lr_scheduler_s_state_is_refused_and_nothing_of_it_is_taken(
    built: bool, kind: str
) -> None:
    step_lr = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1)

    # SequentialLR's own load fails on StepLR's state; CosineAnnealingLR's takes it without a
    # word, and would go on with StepLR's settings beside its own; so does a SequentialLR's
    # inner scheduler, whose state its load applies as it is.
    cosine = functools.partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=4)

    def then(second: Any) -> Callable[[torch.optim.Optimizer], Any]:
        def make(optimizer: torch.optim.Optimizer) -> Any:
            first = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=0.5, total_iters=1)
            return torch.optim.lr_scheduler.SequentialLR(optimizer, [first, second(optimizer)], [1])

        return make

    donor_scheduler = then(step_lr) if kind == "inside a sequential" else step_lr
    scheduler = {"sequential": then(step_lr), "cosine": cosine}.get(kind) or then(cosine)
    message = {
        "sequential": "the state's LR scheduler does not load",
        "cosine": r"LR scheduler does not load .* it has no 'T_max', 'eta_min'",
        "inside a sequential": r"LR scheduler does not load .* it has no 'T_max', 'eta_min'",
    }[kind]

    donor = make_trainer(2, lr_scheduler=donor_scheduler)
    await donor.fit(batches(), epochs=1)
    trainer = make_trainer(2, lr_scheduler=scheduler)
    if built:
        await trainer.fit(batches(), epochs=2)
    before = what_it_holds(trainer)
    with pytest.raises(CheckpointError, match=message):
        trainer.load_state_dict(donor.state_dict())
    assert_same(what_it_holds(trainer), before)


async def test_another_kind_of_optimizer_s_state_is_refused_after_a_layer_was_frozen() -> None:
    # The probe is built over the parameters the optimizer holds, not those that train now:
    # built over those, it was left out, and Adam's state was merged into SGD's groups.
    def two_layers() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))

    trainer = make_trainer(2, model=two_layers)
    await trainer.fit(batches(), epochs=1)
    trainer.model[0].requires_grad_(False)
    adam = make_trainer(2, model=two_layers, optimizer=ADAM)
    await adam.fit(batches(), epochs=1)
    before = what_it_holds(trainer)
    with pytest.raises(CheckpointError, match="saved with another kind of optimizer"):
        trainer.load_state_dict(adam.state_dict())
    assert_same(what_it_holds(trainer), before)


@TORCHS_SEQUENTIAL_LR_WARNING
async def test_a_sequential_lr_of_other_length_is_refused() -> None:
    def sequential(count: int) -> Callable[[torch.optim.Optimizer], Any]:
        def make(optimizer: torch.optim.Optimizer) -> Any:
            inner = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1) for _ in range(count)]
            milestones = list(range(1, count))
            return torch.optim.lr_scheduler.SequentialLR(optimizer, inner, milestones)

        return make

    donor = make_trainer(2, lr_scheduler=sequential(2))
    await donor.fit(batches(), epochs=1)
    with pytest.raises(CheckpointError, match="it holds 2 schedulers, this trainer's 3"):
        make_trainer(2, lr_scheduler=sequential(3)).load_state_dict(donor.state_dict())


def migrating_sgd(params: Any) -> torch.optim.Optimizer:
    """SGD with momentum whose load gives a state saved without momentum this run's."""

    def migrate(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        for group in state["param_groups"]:
            group.setdefault("momentum", 0.9)
            group.setdefault("dampening", 0.0)
        return state

    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    optimizer.register_load_state_dict_pre_hook(migrate)  # type: ignore[no-untyped-call]
    return optimizer


@pytest.mark.parametrize("built", [True, False], ids=["after-a-fit", "before-any-fit"])
async def test_what_the_optimizer_s_own_load_hooks_accept_loads(built: bool) -> None:
    donor = make_trainer(2)
    await donor.fit(batches(), epochs=1)
    state = copy.deepcopy(donor.state_dict())
    for group in state["optimizer"]["param_groups"]:  # as a plain SGD's state, say
        del group["momentum"], group["dampening"]
    trainer = make_trainer(2, optimizer=migrating_sgd)
    if built:
        await trainer.fit(batches(), epochs=1)
    trainer.load_state_dict(state)
    await trainer.fit(batches(), epochs=2)
    assert trainer._replicas[1].optimizer.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize("built", [True, False], ids=["after-a-fit", "before-any-fit"])
async def test_a_state_saved_without_an_lr_scheduler_loads_into_a_trainer_with_one(
    built: bool,
) -> None:
    # The scheduler's settings in the optimizer's groups (OneCycleLR's max_lr) stay: torch's
    # load dropped them, and the next step failed with a KeyError. Before: refused after a fit
    # as "another kind of optimizer", or taken and failed in the fit after it.
    donor = make_trainer(2)
    await donor.fit(batches(), epochs=1)
    one_cycle = functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.5, total_steps=100)
    trainer = make_trainer(2, lr_scheduler=one_cycle, lr_scheduler_interval="step")
    if built:
        await trainer.fit(batches(), epochs=1)
    with pytest.warns(AsyncDDPWarning, match="holds no LR scheduler's state .* from the state's"):
        trainer.load_state_dict(donor.state_dict())
    await trainer.fit(batches(), epochs=2)
    assert trainer._replicas[1].optimizer.param_groups[0]["max_lr"] == 0.5


async def test_a_state_with_an_lr_scheduler_loaded_by_a_trainer_without_one_warns() -> None:
    # A factory forgotten on resume: the learning rate stayed at the state's 0.00125, where the
    # saved schedule went on down, without a word.
    step_lr = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    donor = make_trainer(2, lr_scheduler=step_lr)
    await donor.fit(batches(), epochs=2)
    trainer = make_trainer(2)
    with pytest.warns(AsyncDDPWarning, match="holds an LR scheduler's state, and this trainer"):
        trainer.load_state_dict(donor.state_dict())


async def test_a_cyclic_lr_state_loads_into_every_device(tmp_path: Path) -> None:
    # CyclicLR's load takes an entry out of the state it is given: every device's scheduler
    # after the first failed on the same dict.
    def cyclic(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.CyclicLR(optimizer, 0.01, 0.1, step_size_up=2)

    await make_trainer(2, lr_scheduler=cyclic, checkpoint_dir=tmp_path).fit(batches(), epochs=1)
    resumed = make_trainer(2, lr_scheduler=cyclic, checkpoint_dir=tmp_path)
    await resumed.fit(batches(), epochs=2, resume="latest")
    lrs = [r.optimizer.param_groups[0]["lr"] for r in resumed._replicas]
    assert lrs[0] == lrs[1]


async def test_a_reduce_lr_on_plateau_resumed_from_a_checkpoint_goes_on_as_one_fit(
    tmp_path: Path,
) -> None:
    # Its best metric and count of bad epochs travel in the checkpoint: resumed, it halves the
    # rate where the uninterrupted fit does.
    plateau = functools.partial(
        torch.optim.lr_scheduler.ReduceLROnPlateau, factor=0.5, patience=1, threshold=0.5
    )
    options: dict[str, Any] = {"lr_scheduler": plateau, "lr_scheduler_monitor": "train_loss"}
    whole = make_trainer(2, **options)
    await whole.fit(batches(), epochs=4)
    # Checkpointed after the third epoch, its first bad one: a fresh schedule would take the
    # fourth for an improvement on no best at all.
    await make_trainer(2, checkpoint_dir=tmp_path, **options).fit(batches(), epochs=3)
    resumed = make_trainer(2, checkpoint_dir=tmp_path, **options)
    await resumed.fit(batches(), epochs=4, resume="latest")
    lrs = [r.optimizer.param_groups[0]["lr"] for r in (*whole._replicas, *resumed._replicas)]
    assert lrs == [0.05] * 4  # halved once, after the fourth epoch (two bad, patience 1)
    assert resumed._replicas[0].scheduler.state_dict() == whole._replicas[0].scheduler.state_dict()
    assert_same(resumed.model.state_dict(), whole.model.state_dict())


class Locked(nn.Linear):
    """A layer holding a lock: it cannot be deep-copied, so the check has no meta copy."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.lock = threading.Lock()


async def test_a_model_that_cannot_be_copied_still_loads_and_is_shape_checked() -> None:
    torch.manual_seed(0)
    trainer = Trainer(Locked(4, 2), SGD, step, devices=cpu_devices(1), progress_bar=False)
    await trainer.fit(batches(), epochs=1)
    state = trainer.state_dict()
    trainer.load_state_dict(state)
    with pytest.raises(CheckpointError, match=r"weight is \(3, 4\) in the state, \(2, 4\)"):
        trainer.load_state_dict(another_model(state))


async def test_the_check_changes_nothing_outside_its_probe() -> None:
    # A state holding live parameters (state_dict(keep_vars=True)) keeps them as they are.
    donor = make_trainer(1)
    await donor.fit(batches(), epochs=1)
    state = donor.state_dict()
    state["model"] = donor.model.state_dict(keep_vars=True)
    state["optimizer"] = None  # the model alone: the trainer's optimizer holds the bias only
    trainer = make_trainer(2)
    trainer.model.weight.requires_grad_(False)
    trainer.load_state_dict(state)
    assert donor.model.weight.requires_grad
    # ... and the copy it loads into holds no real memory, tensor attributes included.
    model = nn.Linear(4, 2)
    model.table = torch.ones(1000)
    probe = _checkpoint.on_meta(model)
    assert probe is not None
    assert {t.device.type for t in (probe.weight, probe.bias, probe.table)} == {"meta"}


def flagged(module: nn.Module) -> nn.Module:
    """``module`` with its biases flagged to take no weight decay (Mamba's attribute)."""
    for name, param in module.named_parameters():
        if name.endswith("bias"):
            param._no_weight_decay = True  # type: ignore[attr-defined]
    return module


def decay_by_flag(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    flags = [getattr(p, "_no_weight_decay", False) for p in params]
    return torch.optim.AdamW(
        [
            {"params": [p for p, flag in zip(params, flags, strict=True) if not flag]},
            {
                "params": [p for p, flag in zip(params, flags, strict=True) if flag],
                "weight_decay": 0,
            },
        ]
    )


@pytest.mark.parametrize("built", [False, True], ids=["new-trainer", "after-a-fit"])
async def test_a_state_of_an_optimizer_grouped_by_parameter_attributes_loads(built: bool) -> None:
    # The probe the state is checked on is a copy of the model whose parameters had lost
    # their attributes: the factory put every parameter in one group, and the trainer's own
    # state was refused ("doesn't match the size of optimizer's group").
    donor = make_trainer(2, model=lambda: flagged(nn.Linear(4, 2)), optimizer=decay_by_flag)
    await donor.fit(batches(), epochs=1)
    trainer = make_trainer(2, model=lambda: flagged(nn.Linear(4, 2)), optimizer=decay_by_flag)
    if built:
        await trainer.fit(batches(), epochs=1)
    trainer.load_state_dict(donor.state_dict())
    result = await trainer.fit(batches(), epochs=2)
    assert result.global_step == 6


async def test_a_state_whose_optimizer_settings_differ_from_the_factory_s_warns() -> None:
    # Loading takes the state's settings (torch's load_state_dict): resuming with a lower
    # learning rate in the factory trained on with the old one, without a word.
    donor = make_trainer(2, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    await donor.fit(batches(), epochs=1)
    state = donor.state_dict()
    trainer = make_trainer(2, optimizer=functools.partial(torch.optim.SGD, lr=0.01))
    with pytest.warns(UserWarning, match=r"trains on with lr 0\.1 \(the factory's 0\.01\)") as seen:
        trainer.load_state_dict(state)
    assert seen[0].filename == __file__
    await trainer.fit(batches(), epochs=2)
    assert [r.optimizer.param_groups[0]["lr"] for r in trainer._replicas] == [0.1, 0.1]
    # As the warning says: the setting put into the state first is the one trained with.
    for group in state["optimizer"]["param_groups"]:
        group["lr"] = 0.01
    again = make_trainer(2, optimizer=functools.partial(torch.optim.SGD, lr=0.01))
    again.load_state_dict(state)  # no warning (filterwarnings = error)
    await again.fit(batches(), epochs=2)
    assert [r.optimizer.param_groups[0]["lr"] for r in again._replicas] == [0.01, 0.01]


async def test_adam_and_adamw_states_swapped_warn_of_the_settings_they_bring() -> None:
    # The two have the same settings (AdamW is Adam with decoupled_weight_decay, since torch
    # 2.7 or so; Adam has no such setting before): neither state is refused, and each brought
    # its own weight decay without a word.
    adamw = functools.partial(torch.optim.AdamW, lr=0.01)
    decoupled = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters
    for saved, factory, brought in [
        (ADAM, adamw, r"weight_decay 0 \(the factory's 0\.01\)"),
        (
            adamw,
            ADAM,
            r"weight_decay 0\.01 \(the factory's 0\)"
            + (r".*decoupled_weight_decay True" if decoupled else ""),
        ),
    ]:
        donor = make_trainer(1, optimizer=saved)
        await donor.fit(batches(), epochs=1)
        trainer = make_trainer(1, optimizer=factory)
        with pytest.warns(UserWarning, match=brought):
            trainer.load_state_dict(donor.state_dict())


async def test_a_state_with_an_lr_scheduler_loads_without_a_word_on_settings() -> None:
    # The scheduler set the state's learning rate (OneCycleLR from its own max_lr, and it
    # cycles the momentum): not a setting the user changed.
    cycle = functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.5, total_steps=20)
    donor = make_trainer(2, lr_scheduler=cycle, lr_scheduler_interval="step")
    await donor.fit(batches(), epochs=2)
    trainer = make_trainer(2, lr_scheduler=cycle, lr_scheduler_interval="step")
    trainer.load_state_dict(donor.state_dict())  # no warning (filterwarnings = error)
    await trainer.fit(batches(), epochs=3)


async def test_fit_removes_the_temporary_files_of_checkpoint_writes_a_killed_process_left(
    tmp_path: Path,
) -> None:
    # A write killed by SIGKILL leaves its hidden temporary file, as large as a checkpoint;
    # preempted again and again, a run filled its disk with them. The next fit removes those
    # not written to for STALE_TEMPORARY seconds; a fresh one (a live writer's) and files of
    # other names stay.
    import os

    from asyncddp import _checkpoint

    left = tmp_path / ".epoch0001-step000007.ckpt.k2j4x9_a.tmp"
    fresh = tmp_path / ".epoch0001-step000014.ckpt.abcdefgh.tmp"
    other = tmp_path / ".notes.txt.abcdefgh.tmp"
    for path in (left, fresh, other):
        path.write_bytes(b"partial")
    old = os.stat(left).st_mtime - _checkpoint.STALE_TEMPORARY - 60
    os.utime(left, (old, old))
    os.utime(other, (old, old))
    await make_trainer(1, checkpoint_dir=tmp_path).fit(batches(), epochs=1)
    assert not left.exists()
    assert fresh.exists()
    assert other.exists()


async def test_saving_to_a_path_removes_the_temporary_files_killed_writes_of_it_left(
    tmp_path: Path,
) -> None:
    # Only fit's own names were tidied: 8 kills of save_checkpoint("manual.ckpt") writes left
    # 828 MB of temporary files that stayed for good.
    import os

    left = tmp_path / ".manual.ckpt.0badf00d.tmp"
    fresh = tmp_path / ".manual.ckpt.abcdefgh.tmp"  # a live writer's
    other = tmp_path / ".other.ckpt.0badf00d.tmp"  # another path's, tidied when it is saved
    for path in (left, fresh, other):
        path.write_bytes(b"partial")
    old = os.stat(left).st_mtime - _checkpoint.STALE_TEMPORARY - 60
    os.utime(left, (old, old))
    os.utime(other, (old, old))
    await make_trainer(1).save_checkpoint(tmp_path / "manual.ckpt")
    assert not left.exists()
    assert fresh.exists()
    assert other.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file modes")
@pytest.mark.parametrize("umask", [0o022, 0o077])
async def test_a_checkpoint_file_takes_the_mode_the_umask_gives_as_torch_save_s(
    tmp_path: Path, umask: int
) -> None:
    # Written through tempfile.mkstemp, a checkpoint kept its 0o600 through the rename: a
    # serving process of another user could not read it, where torch.save's file could.
    import os

    before = os.umask(umask)
    try:
        trainer = make_trainer(1, checkpoint_dir=tmp_path / "run")
        await trainer.fit(batches(), epochs=1)
        saved = await trainer.save_checkpoint(tmp_path / "now.ckpt")
        torch.save({}, tmp_path / "plain.pt")
    finally:
        os.umask(before)
    (written,) = (tmp_path / "run").glob("*.ckpt")
    expected = 0o666 & ~umask
    assert os.stat(tmp_path / "plain.pt").st_mode & 0o777 == expected  # torch.save's
    assert os.stat(saved).st_mode & 0o777 == expected
    assert os.stat(written).st_mode & 0o777 == expected


def test_a_checkpoint_from_a_machine_with_more_gpus_restores_the_generators_of_those_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A checkpoint holds one generator state a visible GPU. Resumed where fewer are visible
    # (another node, another CUDA_VISIBLE_DEVICES), torch's set_rng_state_all fails on the
    # first it lacks, and, queued until CUDA starts, every later CUDA call of the process.
    from asyncddp import _checkpoint

    restored: list[list[torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: restored.append(states))
    state = _checkpoint.capture_rng()
    saved = [torch.full((16,), 1, dtype=torch.uint8), torch.full((16,), 2, dtype=torch.uint8)]
    _checkpoint.restore_rng({**state, "cuda": saved})
    assert len(restored) == 1
    assert [s.tolist() for s in restored[0]] == [saved[0].tolist()]


@pytest.mark.parametrize(
    ("failure", "a_full_disk"),
    [
        # A full disk as the file system says it, and as torch's writer does (the same
        # RuntimeError a file size limit gave in a trial): neither named the checkpoint.
        (OSError(28, "No space left on device"), True),
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"), True),
        (RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"), True),
        # Another of torch.save's RuntimeErrors is named too, without the disk's hint.
        (RuntimeError("Cannot save a tensor of this kind"), False),
    ],
)
async def test_a_checkpoint_that_cannot_be_written_is_a_checkpoint_error_naming_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, failure: Exception, a_full_disk: bool
) -> None:
    trainer = make_trainer(2)
    await trainer.fit(batches(), epochs=1)
    target = tmp_path / "now.ckpt"
    await trainer.save_checkpoint(target)
    before = target.read_bytes()
    save = torch.save

    def failing_save(obj: Any, file: Any) -> None:
        file.write(b"PK\x03\x04 part of a checkpoint")
        raise failure

    monkeypatch.setattr(torch, "save", failing_save)
    written = f"the checkpoint '{target}' could not be written"
    with pytest.raises(CheckpointError, match=written) as raised:
        await trainer.save_checkpoint(target)
    assert raised.value.__cause__ is failure
    assert ("a full disk, a quota, or a limit on file sizes" in str(raised.value)) is a_full_disk
    assert target.read_bytes() == before  # the one there is left whole
    assert [p.name for p in tmp_path.iterdir()] == ["now.ckpt"]  # no temporary file left
    monkeypatch.setattr(torch, "save", save)
    await trainer.save_checkpoint(target)  # once mended


async def test_a_checkpoint_path_under_a_file_is_a_checkpoint_error_naming_it(
    tmp_path: Any,
) -> None:
    # It raised FileExistsError naming the file in the way, not the checkpoint.
    (tmp_path / "file.txt").write_text("not a folder")
    trainer = make_trainer(1)
    target = tmp_path / "file.txt" / "ckpts" / "now.ckpt"
    in_the_way = "a file where a folder of the path should be"
    with pytest.raises(CheckpointError, match=in_the_way) as raised:
        await trainer.save_checkpoint(target)
    assert str(target) in str(raised.value)
    assert isinstance(raised.value.__cause__, OSError)


def test_a_save_cancelled_as_it_writes_waits_for_the_write_and_says_so(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A plain task.cancel() returned at once while the thread went on writing: the file came
    # later, with no CheckpointSaved, its caller told it was not written.
    import asyncio
    import time

    save, began = _checkpoint.save, []

    def slow_save(state: Any, path: Any) -> Any:
        began[0]()  # the write has begun
        time.sleep(0.3)
        return save(state, path)

    monkeypatch.setattr(_checkpoint, "save", slow_save)
    trainer = make_trainer(2)
    target = tmp_path / "now.ckpt"

    async def main() -> list[str]:
        stream = trainer.events()
        writing = asyncio.Event()
        loop = asyncio.get_running_loop()
        began.append(lambda: loop.call_soon_threadsafe(writing.set))
        task = asyncio.create_task(trainer.save_checkpoint(target))
        # In the write: the replicas are built first, which a loaded machine took more than
        # the 0.1 s this waited once for (the save was then cancelled before it wrote).
        await writing.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert target.exists()  # written whole before the cancellation came back
        stream.close()
        return [type(e).__name__ async for e in stream]

    assert asyncio.run(main()) == ["CheckpointSaved"]
    assert _checkpoint.load(target)["global_step"] == 0


def stall_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """Make every checkpoint write stall (up to 30 s) until the first event returned is set,
    the second set once a write has begun; a cancellation waits 0.3 s for a write."""
    import threading

    from asyncddp import _resume

    save, stalled, writing = _checkpoint.save, threading.Event(), threading.Event()

    def stalled_save(state: Any, path: Any) -> Any:
        writing.set()
        stalled.wait(30)
        return save(state, path)

    monkeypatch.setattr(_checkpoint, "save", stalled_save)
    monkeypatch.setattr(_resume, "CHECKPOINT_CANCEL_WAIT", 0.3)
    return stalled, writing


def join_checkpoint_threads() -> None:
    """Wait for the checkpoint writes a cancellation left running (see `collective`)."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "asyncddp-checkpoint":
            thread.join(10)


def test_a_save_cancelled_as_a_stalled_write_runs_gives_up_on_it_after_a_while(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A notebook's stop button cancels once (later presses do nothing, and no
    # KeyboardInterrupt comes): a write stalled on a network disk held the cell for as long as
    # the write took, without end for one that never returns.
    import asyncio
    import time

    from asyncddp._dsteps import CollectiveLeft

    stalled, writing = stall_writes(monkeypatch)
    trainer = make_trainer(2)
    target = tmp_path / "now.ckpt"

    async def main() -> float:
        task = asyncio.create_task(trainer.save_checkpoint(target))
        assert await asyncio.to_thread(writing.wait, 10)  # in the write
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError) as cancelled:
            await task
        assert isinstance(cancelled.value.__cause__, CollectiveLeft)
        return time.monotonic() - started

    try:
        assert asyncio.run(main()) < 5.0  # the write stalls for 30 s
        assert not target.exists()
    finally:
        stalled.set()
    join_checkpoint_threads()
    assert _checkpoint.load(target)["global_step"] == 0  # the write went on, whole


async def test_a_cancel_scope_gives_up_on_a_stalled_write_after_a_while_too(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under anyio's and trio's cancel scopes (anyio.fail_after, a task group's cancellation)
    # the bound did not apply: the wait lasted as long as the stalled write.
    import time

    stalled, _ = stall_writes(monkeypatch)
    trainer = make_trainer(2)
    target = tmp_path / "now.ckpt"
    started = time.monotonic()
    try:
        with anyio.move_on_after(0.2) as scope:
            await trainer.save_checkpoint(target)
        assert scope.cancelled_caught
        assert time.monotonic() - started < 10.0  # the write stalls for 30 s
    finally:
        stalled.set()
    await anyio.to_thread.run_sync(join_checkpoint_threads)
    assert _checkpoint.load(target)["global_step"] == 0


async def test_a_checkpoint_with_a_bit_changed_is_refused_as_corrupt(tmp_path: Any) -> None:
    # torch's reader does not check the records' CRC-32s: a flipped bit in a weight loaded,
    # and training went on from the wrong weight, without a word.
    data = [(torch.randn(6, 400), torch.randn(6, 2))]
    trainer = make_trainer(2, model=lambda: nn.Linear(400, 2))
    await trainer.fit(data, epochs=1)
    path = await trainer.save_checkpoint(tmp_path / "good.ckpt")
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0x01  # inside the weights' record
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(bytes(content))
    resumed = make_trainer(2, model=lambda: nn.Linear(400, 2))
    with pytest.raises(CheckpointError, match=r"is corrupt: its record .* does not match the CRC"):
        await resumed.fit(data, epochs=2, resume=bad)
    assert resumed.global_step == 0
    await resumed.fit(data, epochs=2, resume=path)
    assert resumed.global_step == 2


def test_a_checkpoint_torch_wrote_without_crcs_still_loads(tmp_path: Any) -> None:
    serialization = pytest.importorskip("torch.utils.serialization")
    config = serialization.config

    state = {"model": {}, "epoch": 0, "global_step": 0, "batches_done": 0}
    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        path = _checkpoint.save(state, tmp_path / "plain.ckpt")
    finally:
        config.save.compute_crc32 = before
    assert _checkpoint.load(path)["global_step"] == 0


async def test_a_checkpoint_whose_zip_header_zipfile_cannot_read_is_left_to_torch(
    tmp_path: Any,
) -> None:
    # The records' check let zipfile's NotImplementedError out of load ("zip file version
    # 25.5"), where torch, which does not read that field, loads the file.
    trainer = make_trainer(1)
    path = await trainer.save_checkpoint(tmp_path / "now.ckpt")
    content = bytearray(path.read_bytes())
    entry = content.index(b"PK\x01\x02")  # the first record's central directory entry
    content[entry + 6] = 0xFF  # the version needed to extract it
    path.write_bytes(bytes(content))
    assert _checkpoint.load(path)["global_step"] == 0
