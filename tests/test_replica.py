"""What a user changes on ``trainer.model`` between calls holds on every device.

``trainer.model`` is the first device's replica. Weights loaded into it, a layer frozen or
thawed, ``.eval()``: each must reach the other replicas before the next fit or validation, or
the replicas train apart (each test here failed before ``_replica.mirror``: the second device
kept its own weights, flags and modes).
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune
from torch import nn

import asyncddp
from asyncddp import AsyncDDPWarning, ConfigurationError, Trainer, cpu_devices, current_worker

pytestmark = pytest.mark.anyio

FEATURES = 6
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
Batch = tuple[torch.Tensor, torch.Tensor]


def make_model(seed: int = 0, *, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3))


def make_batches(sizes: list[int], seed: int = 1) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, FEATURES, generator=generator),
            torch.randint(0, 3, (n,), generator=generator),
        )
        for n in sizes
    ]


def loss_step(model: nn.Module, batch: Batch) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


def plain_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Batch]) -> None:
    for batch in batches:
        optimizer.zero_grad()
        loss_step(model, batch).backward()
        optimizer.step()


def assert_matches(trainer: Trainer, expected: nn.Module) -> None:
    """Every replica equals ``expected`` (float tolerance: the batch is split across devices)."""
    want = expected.state_dict()
    for replica in trainer._replicas:
        for name, value in replica.model.state_dict().items():
            torch.testing.assert_close(
                value, want[name], rtol=1e-5, atol=1e-6, msg=f"{name} on {replica.device}"
            )


def trainer_on(devices: int, model: nn.Module) -> Trainer:
    return Trainer(model, SGD, loss_step, devices=cpu_devices(devices), progress_bar=False)


@pytest.mark.parametrize("devices", [1, 2, 3])
async def test_weights_loaded_into_trainer_model_between_fits_train_on_every_device(
    devices: int,
) -> None:
    batches = make_batches([7, 6, 5])
    loaded = make_model(seed=5).state_dict()
    expected = make_model()
    optimizer = SGD(expected.parameters())
    plain_epoch(expected, optimizer, batches)
    expected.load_state_dict(loaded)
    plain_epoch(expected, optimizer, batches)

    trainer = trainer_on(devices, make_model())
    await trainer.fit(batches, epochs=1)
    trainer.model.load_state_dict(loaded)
    await trainer.fit(batches, epochs=2)
    assert_matches(trainer, expected)


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_layer_frozen_between_fits_stays_frozen_on_every_device(devices: int) -> None:
    batches = make_batches([7, 6, 5])
    expected = make_model()
    optimizer = SGD(expected.parameters())
    plain_epoch(expected, optimizer, batches)
    expected[0].requires_grad_(False)
    plain_epoch(expected, optimizer, batches)  # SGD skips a parameter whose .grad is None

    trainer = trainer_on(devices, make_model())
    await trainer.fit(batches, epochs=1)
    trainer.model[0].requires_grad_(False)
    frozen = trainer.model[0].weight.detach().clone()
    await trainer.fit(batches, epochs=2)
    assert torch.equal(trainer.model[0].weight, frozen)
    assert_matches(trainer, expected)
    assert all(not r.model[0].weight.requires_grad for r in trainer._replicas)


async def test_eval_mode_set_between_fits_holds_on_every_device() -> None:
    batches = make_batches([8, 8])
    seen: list[bool] = []
    lock = threading.Lock()

    def step(model: nn.Module, batch: Batch) -> torch.Tensor:
        with lock:
            seen.append(model[2].training)
        return loss_step(model, batch)

    trainer = Trainer(
        make_model(dropout=0.5), SGD, step, devices=cpu_devices(2), progress_bar=False
    )
    await trainer.fit(batches, epochs=1)
    assert seen == [True] * 4
    seen.clear()
    trainer.model.eval()  # as a plain loop may train with dropout off
    with pytest.warns(AsyncDDPWarning, match=r"the model is in eval mode .* dropout off"):
        await trainer.fit(batches, epochs=2)
    assert seen == [False] * 4, "a device trained with dropout on"
    await trainer.validate(batches)  # validation puts back the modes it found
    assert [r.model.training for r in trainer._replicas] == [False, False]


@pytest.mark.parametrize("devices", [1, 2])
async def test_validation_keeps_a_submodule_frozen_in_eval_mode_frozen(devices: int) -> None:
    # Fine-tuning with a BatchNorm frozen: validation must put back each module's own mode,
    # not train() the whole model (which set the BatchNorm training again, silently).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
    model[1].eval()
    batches = make_batches([8, 8])
    trainer = trainer_on(devices, model)
    await trainer.fit(batches, epochs=1, valid_data=batches)
    await trainer.validate(batches)
    for replica in trainer._replicas:
        assert [m.training for m in replica.model] == [True, False, True], replica.device
    stats = model[1].running_mean.clone()
    await trainer.fit(batches, epochs=2)
    assert torch.equal(trainer.model[1].running_mean, stats)  # a frozen BatchNorm learns none


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_sync_batchnorm_on_several_devices_of_one_process_warns_it_syncs_nothing(
    devices: int,
) -> None:
    # A DDP user's convert_sync_batchnorm model trained with no word that its statistics were
    # each shard's alone (torch syncs over a process group only).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.SyncBatchNorm(16), nn.Linear(16, 3))
    trainer = trainer_on(devices, model)
    batches = make_batches([8, 8])
    if devices == 1:  # one device normalises the whole batch: nothing to say
        await trainer.fit(batches, epochs=1)
        return
    with pytest.warns(AsyncDDPWarning, match="SyncBatchNorm.* normalises each device's shard"):
        await trainer.fit(batches, epochs=1)
    await trainer.fit(batches, epochs=2)  # said once, as the replicas are built


class Merging(nn.Linear):
    """A layer whose own ``train()`` does work, as a LoRA layer merges its adapter into the
    weight on ``train(False)`` and takes it out again on ``train(True)``."""

    merged = False

    def train(self, mode: bool = True) -> Merging:
        super().train(mode)
        self.merged = not mode
        return self


@pytest.mark.parametrize("devices", [1, 2])
async def test_validation_puts_modes_back_through_each_module_s_own_train(devices: int) -> None:
    # Setting the training flags back skipped a module's own train(): the LoRA layer stayed
    # merged in training mode, and its adapter no longer trained.
    torch.manual_seed(0)
    model = nn.Sequential(Merging(FEATURES, 16), nn.Tanh(), nn.Linear(16, 3))
    batches = make_batches([8])
    trainer = trainer_on(devices, model)
    await trainer.validate(batches)
    for replica in trainer._replicas:
        assert replica.model.training
        assert not replica.model[0].merged, replica.device


async def test_validation_after_weights_are_loaded_scores_those_weights_on_every_device() -> None:
    batches = make_batches([7, 6])
    trainer = trainer_on(3, make_model())
    await trainer.fit(batches, epochs=1)
    other = make_model(seed=9)
    trainer.model.load_state_dict(other.state_dict())
    with torch.no_grad():
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        expected = F.cross_entropy(other(inputs), targets).item()
    result = await trainer.validate(batches)
    assert result["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_parameter_replaced_between_fits_is_refused_before_any_step(devices: int) -> None:
    batches = make_batches([4])
    trainer = trainer_on(devices, make_model())
    await trainer.fit(batches, epochs=1)
    original = trainer.model[3]
    trainer.model[3] = nn.Linear(16, 3)  # no optimizer holds its parameters
    with pytest.raises(
        ConfigurationError,
        match=r"3\.weight is another parameter now, in place of one the optimizers train",
    ):
        await trainer.fit(batches, epochs=2)
    assert trainer.global_step == 1
    trainer.model[3] = original
    await trainer.fit(batches, epochs=2)
    assert trainer.global_step == 2


async def test_a_parameter_thawed_after_the_first_fit_warns_that_it_is_not_trained() -> None:
    batches = make_batches([4])
    model = make_model()
    model[0].requires_grad_(False)
    trainer = trainer_on(2, model)
    await trainer.fit(batches, epochs=1)
    trainer.model[0].requires_grad_(True)
    with pytest.warns(
        UserWarning,
        match=r"0\.weight, 0\.bias of trainer.model require grad .* no optimizer holds them",
    ) as seen:
        await trainer.fit(batches, epochs=2)
    assert seen[0].filename == __file__  # this line, not one of asyncddp's
    assert len(seen) == 1  # not told again as thawed by the step


@pytest.mark.parametrize("devices", [1, 2])
async def test_gradual_unfreezing_as_the_warning_says_trains_as_a_plain_loop(devices: int) -> None:
    # The warning's advice was to unfreeze before the first fit (which trains the layer from
    # the start) or to build a new Trainer (whose state load was refused: the optimizer's
    # groups differed in size). Replicas built with every parameter trainable hold them all.
    batches = make_batches([4, 4])
    optimizer = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    trainer = Trainer(
        make_model(), optimizer, loss_step, devices=cpu_devices(devices), progress_bar=False
    )
    await trainer.validate(batches)  # builds the replicas, every parameter trainable
    trainer.model[0].requires_grad_(False)
    await trainer.fit(batches, epochs=2)
    trainer.model[0].requires_grad_(True)
    await trainer.fit(batches, epochs=4)
    expected = make_model()
    plain = optimizer(expected.parameters())
    expected[0].requires_grad_(False)
    for epoch in range(4):
        if epoch == 2:
            expected[0].requires_grad_(True)
        plain_epoch(expected, plain, batches)
    assert_matches(trainer, expected)


async def test_buffers_reset_between_calls_are_reset_on_every_device() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    trainer = trainer_on(2, model)
    await trainer.fit(make_batches([8, 8]), epochs=1)
    trainer.model[1].reset_running_stats()
    await trainer.validate(make_batches([8]))  # eval mode: the statistics stay as they are
    for replica in trainer._replicas:
        norm = replica.model[1]
        assert torch.equal(norm.running_mean, torch.zeros(8)), replica.device
        assert int(norm.num_batches_tracked) == 0, replica.device


class Tagged(nn.Linear):
    """A layer with extra state of its own (what get_extra_state saves)."""

    tag = "built"

    def get_extra_state(self) -> str:
        return self.tag

    def set_extra_state(self, state: str) -> None:
        self.tag = state


async def test_extra_state_loaded_between_calls_reaches_every_device() -> None:
    torch.manual_seed(0)
    trainer = trainer_on(2, nn.Sequential(Tagged(FEATURES, 3)))
    await trainer.fit(make_batches([4]), epochs=1)
    state = trainer.model.state_dict()
    state["0._extra_state"] = "loaded"
    trainer.model.load_state_dict(state)
    await trainer.validate(make_batches([4]))
    assert [r.model[0].tag for r in trainer._replicas] == ["loaded", "loaded"]


async def test_a_module_added_between_fits_is_refused_with_a_configuration_error() -> None:
    trainer = trainer_on(2, make_model())
    await trainer.fit(make_batches([4]), epochs=1)
    trainer.model.append(nn.Tanh())  # no parameter of its own
    with pytest.raises(ConfigurationError, match="a module was added or removed"):
        await trainer.fit(make_batches([4]), epochs=2)


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_frozen_parameter_swapped_for_one_of_its_shape_reaches_every_device(
    devices: int,
) -> None:
    model = make_model()
    model[0].requires_grad_(False)
    trainer = trainer_on(devices, model)
    await trainer.fit(make_batches([4]), epochs=1)
    pretrained = torch.full((16, FEATURES), 0.25)
    trainer.model[0].weight = nn.Parameter(pretrained.clone(), requires_grad=False)
    await trainer.fit(make_batches([4]), epochs=2)
    for replica in trainer._replicas:
        assert torch.equal(replica.model[0].weight, pretrained), replica.device
    trainer.model[0].weight = nn.Parameter(torch.zeros(16, 2), requires_grad=False)
    with pytest.raises(
        ConfigurationError, match=r"0\.weight is another parameter now, of another shape"
    ):
        await trainer.fit(make_batches([4]), epochs=3)


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_model_cast_in_place_between_fits_is_refused_before_any_step(devices: int) -> None:
    # .double() keeps each Parameter object and swaps its data: on two devices the second
    # replica trained on in float32 while trainer.model was float64, and the replicas parted.
    batches = make_batches([4])
    trainer = trainer_on(devices, make_model())
    await trainer.fit(batches, epochs=1)
    trainer.model.double()
    with pytest.raises(ConfigurationError, match=r"0\.weight was cast or resized in place"):
        await trainer.fit(batches, epochs=2)
    assert trainer.global_step == 1
    trainer.model.float()
    # The round trip set the data of the first replica's .grad tensors (Module._apply), which
    # were views into the flat buffers: its backward wrote where the reduction did not read,
    # and the replicas parted (0.02 apart, silently, before the replicas were compared).
    await trainer.fit(batches, epochs=2)
    assert trainer.global_step == 2
    for replica in trainer._replicas[1:]:
        for mine, first in zip(
            replica.model.parameters(), trainer._replicas[0].model.parameters(), strict=True
        ):
            assert torch.equal(mine, first)


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_memory_format_changed_between_fits_is_refused_before_any_step(
    devices: int,
) -> None:
    # The first replica's gradients then lay in the flat buffers channels-last, the others'
    # not, and the reduction summed mismatched elements (0.03 from a plain loop; on GPUs,
    # which compare no replicas, silently).
    def convnet() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 3))

    generator = torch.Generator().manual_seed(1)
    images = [
        (torch.randn(8, 3, 6, 6, generator=generator), torch.randint(0, 3, (8,))) for _ in range(2)
    ]
    trainer = trainer_on(devices, convnet())
    await trainer.fit(images, epochs=1)
    trainer.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match=r"0\.weight is laid out otherwise in memory"):
        await trainer.fit(images, epochs=2)
    assert trainer.global_step == 2
    trainer.model.to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
    await trainer.fit(images, epochs=2)
    assert trainer.global_step == 4


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_buffer_registered_between_fits_is_refused_on_any_number_of_devices(
    devices: int,
) -> None:
    trainer = trainer_on(devices, make_model())
    await trainer.fit(make_batches([4]), epochs=1)
    trainer.model[0].register_buffer("scale", torch.ones(16))
    with pytest.raises(ConfigurationError, match="a buffer was registered"):
        await trainer.fit(make_batches([4]), epochs=2)


def mask_rows(grad: torch.Tensor) -> torch.Tensor:
    """A gradient hook that trains the first layer's last 8 rows only."""
    mask = torch.zeros_like(grad)
    mask[8:] = 1
    return grad * mask


@pytest.mark.parametrize("devices", [1, 2, 3])
async def test_a_parameter_s_gradient_hook_holds_on_every_device(devices: int) -> None:
    # copy.deepcopy (how the other devices' replicas are made) drops a parameter's hooks: the
    # second device's gradient went unmasked into the average, and rows 0-7 moved by 0.05.
    batches = make_batches([7, 6, 5])
    expected = make_model()
    handle = expected[0].weight.register_hook(mask_rows)
    plain_epoch(expected, SGD(expected.parameters()), batches)
    model = make_model()
    start = model[0].weight.detach().clone()
    hook = model[0].weight.register_hook(mask_rows)
    trainer = trainer_on(devices, model)
    await trainer.fit(batches, epochs=1)
    assert torch.equal(trainer.model[0].weight[:8], start[:8])
    assert_matches(trainer, expected)
    # A hook removed through its handle, between fits, is gone on every device too.
    handle.remove()
    hook.remove()
    plain_epoch(expected, SGD(expected.parameters()), batches)  # momentum restarts: compare rows
    before = trainer.model[0].weight.detach().clone()
    await trainer.fit(batches, epochs=2)
    moved = (trainer.model[0].weight[:8] - before[:8]).abs().amax(dim=1)
    assert bool((moved > 0).all())
    for replica in trainer._replicas[1:]:
        torch.testing.assert_close(replica.model[0].weight, trainer.model[0].weight)


async def test_a_hook_registered_between_fits_holds_on_every_device() -> None:
    batches = make_batches([7, 6, 5])
    expected = make_model()
    optimizer = SGD(expected.parameters())
    plain_epoch(expected, optimizer, batches)
    expected[0].weight.register_hook(mask_rows)
    plain_epoch(expected, optimizer, batches)
    trainer = trainer_on(2, make_model())
    await trainer.fit(batches, epochs=1)
    trainer.model[0].weight.register_hook(mask_rows)
    await trainer.fit(batches, epochs=2)
    assert_matches(trainer, expected)


def decay_by_flag(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Parameter groups by an attribute set on the parameters (Mamba's ``_no_weight_decay``)."""
    plain = [p for p in params if getattr(p, "_no_weight_decay", False)]
    decayed = [p for p in params if not getattr(p, "_no_weight_decay", False)]
    return torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.5}, {"params": plain, "weight_decay": 0.0}],
        lr=0.05,
    )


def flagged_model() -> nn.Sequential:
    model = make_model()
    for name, param in model.named_parameters():
        if name.endswith("bias") or name.startswith("0."):
            param._no_weight_decay = True  # type: ignore[attr-defined]
    return model


@pytest.mark.parametrize("devices", [2, 3])
async def test_an_optimizer_grouped_by_parameter_attributes_groups_alike_on_every_device(
    devices: int,
) -> None:
    # The copies' parameters lost the flag: one device decayed every parameter, and the
    # replicas drifted apart without a word.
    batches = make_batches([7, 6, 5])
    expected = flagged_model()
    plain_epoch(expected, decay_by_flag(list(expected.parameters())), batches)
    trainer = Trainer(
        flagged_model(), decay_by_flag, loss_step, devices=cpu_devices(devices), progress_bar=False
    )
    await trainer.fit(batches, epochs=1)
    assert_matches(trainer, expected)
    sizes = [[len(g["params"]) for g in r.optimizer.param_groups] for r in trainer._replicas]
    assert sizes == [[1, 3]] * devices


async def test_an_optimizer_grouped_by_trainer_model_s_own_parameters_is_refused() -> None:
    # A set of the model's parameters made outside the factory holds none of a copy's: the
    # other devices' optimizers put every parameter in the second group.
    model = make_model()
    biases = {p for name, p in model.named_parameters() if name.endswith("bias")}

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            [
                {"params": [p for p in params if p in biases], "weight_decay": 0.0},
                {"params": [p for p in params if p not in biases]},
            ]
        )

    trainer = Trainer(model, factory, loss_step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(ConfigurationError, match=r"grouped the parameters of cpu#1's copy"):
        await trainer.fit(make_batches([4]), epochs=1)
    # On one device there is no copy, and nothing to refuse.
    one = Trainer(make_model(), factory, loss_step, devices=cpu_devices(1), progress_bar=False)
    await one.fit(make_batches([4]), epochs=1)


class RunningMean(nn.Module):
    """Subtracts a running mean of its inputs, kept in a buffer updated in place or assigned
    anew (``self.mean = ...``), as hand-written normalisers do."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.register_buffer("mean", torch.zeros(FEATURES))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.training:
            update = inputs.detach().mean(dim=0)
            if self.in_place:
                self.mean.mul_(0.5).add_(update, alpha=0.5)
            else:
                self.mean = 0.5 * self.mean + 0.5 * update
        return inputs - self.mean


@pytest.mark.parametrize("options", [{}, {"step_timeout": 30.0}], ids=["fused", "jobs-apart"])
async def test_a_buffer_assigned_anew_in_the_forward_follows_the_first_device(
    options: dict[str, float],
) -> None:
    # The buffers synced after each step were a list kept from when the replicas were built:
    # a buffer the forward assigned anew was never synced (the second device's mean went its
    # own way, 0.6 off after 3 steps) and the weights trained apart from in-place updates'.
    results = []
    for in_place in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(RunningMean(in_place), nn.Linear(FEATURES, 3))
        trainer = Trainer(
            model, SGD, loss_step, devices=cpu_devices(2), progress_bar=False, **options
        )
        await trainer.fit(make_batches([8, 6, 8]), epochs=2)
        first, second = (replica.model for replica in trainer._replicas)
        assert torch.equal(first[0].mean, second[0].mean)
        assert torch.equal(first[1].weight, second[1].weight)
        results.append(trainer.model.state_dict())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_step_retried_puts_back_a_buffer_assigned_anew_in_its_forward(
    devices: int,
) -> None:
    # Undoing a failed step's forwards copied the saved values into the tensor the buffer
    # held before the forward, not the one the module holds now.
    results = []
    for in_place in (True, False):
        failed: list[bool] = []

        def flaky(model: nn.Module, batch: Batch, failed: list[bool] = failed) -> torch.Tensor:
            loss = loss_step(model, batch)  # the forward updates the mean first
            if batch[0].shape[0] in (6, 12) and not failed:  # the second batch
                failed.append(True)
                raise RuntimeError("flaky device")
            return loss

        torch.manual_seed(0)
        model = nn.Sequential(RunningMean(in_place), nn.Linear(FEATURES, 3))
        trainer = Trainer(
            model, SGD, flaky, devices=cpu_devices(devices), progress_bar=False, on_failure="retry"
        )
        await trainer.fit(make_batches([8, 12, 8]), epochs=1)
        assert failed
        results.append(trainer.model.state_dict())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


class LazyCache(nn.Module):
    """Builds a buffer registered as None in its first forward, and grows it for longer
    inputs (as rotary-embedding tables are built and grown), then a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", None, persistent=False)
        self.layer = nn.Linear(1, 3)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        width = inputs.shape[1]
        if self.table is None or len(self.table) < width:
            self.table = torch.linspace(0.5, 1.5, width)
        return self.layer((inputs * self.table[:width]).sum(dim=1, keepdim=True))


def wide_batches(width: int, sizes: list[int]) -> list[Batch]:
    generator = torch.Generator().manual_seed(width)
    return [
        (torch.randn(n, width, generator=generator), torch.randint(0, 3, (n,), generator=generator))
        for n in sizes
    ]


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_buffer_made_or_grown_in_the_forward_trains_and_undoes(devices: int) -> None:
    # Buffers read from their slots: a failed step's undo found one more buffer than it had
    # kept (zip() argument 2 is shorter) once the forward had made the table; a table grown
    # for longer inputs was refused at the next fit ("a buffer was ... reshaped").
    failed: list[bool] = []

    def flaky(model: nn.Module, batch: Batch) -> torch.Tensor:
        loss = loss_step(model, batch)
        if not failed:
            failed.append(True)
            raise RuntimeError("flaky device")
        return loss

    torch.manual_seed(0)
    trainer = Trainer(
        LazyCache(),
        SGD,
        flaky,
        devices=cpu_devices(devices),
        progress_bar=False,
        on_failure="retry",
    )
    await trainer.fit(wide_batches(4, [6, 6]), epochs=1)
    assert failed
    await trainer.fit(wide_batches(6, [6, 6]), epochs=2)  # grows the table
    await trainer.fit(wide_batches(6, [6, 6]), epochs=3)
    await trainer.validate(wide_batches(6, [6]))
    for replica in trainer._replicas:
        assert torch.equal(replica.model.table, torch.linspace(0.5, 1.5, 6))
    torch.manual_seed(0)
    expected = LazyCache()
    optimizer = SGD(expected.parameters())
    for batches in (wide_batches(4, [6, 6]), wide_batches(6, [6, 6]), wide_batches(6, [6, 6])):
        plain_epoch(expected, optimizer, batches)
    assert_matches(trainer, expected)


class ScaledParameter(nn.Parameter):
    """A parameter type that copies state of its own (as quantized weights keep theirs)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> ScaledParameter:
        copied = ScaledParameter(self.data.clone(), self.requires_grad)
        copied.scale = self.scale.clone()  # type: ignore[attr-defined]
        memo[id(self)] = copied
        return copied


async def test_a_parameter_s_own_copy_is_kept_and_tensor_attributes_are_not_shared() -> None:
    # Carrying the attributes replaced what a subclass's own __deepcopy__ made with the first
    # replica's objects, and shared tensor attributes (on a GPU, the first device's).
    model = make_model()
    weight = ScaledParameter(model[0].weight.detach().clone())
    weight.scale = torch.ones(1)  # type: ignore[attr-defined]
    model[0].weight = weight
    model[3].weight.mask = torch.ones(3, 16)  # type: ignore[attr-defined]
    trainer = trainer_on(2, model)
    await trainer.fit(make_batches([4]), epochs=1)
    await trainer.fit(make_batches([4]), epochs=2)  # carried again as the call starts
    first, second = (replica.model for replica in trainer._replicas)
    assert isinstance(second[0].weight, ScaledParameter)
    assert second[0].weight.scale is not first[0].weight.scale
    assert torch.equal(second[3].weight.mask, first[3].weight.mask)
    assert second[3].weight.mask is not first[3].weight.mask


class GrownInPlace(nn.Module):
    """A cache grown in place, keeping the tensor's identity (``.data =``, ``resize_``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("table", torch.zeros(2))
        self.layer = nn.Linear(FEATURES, 3)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.shape[0]
        if self.table.numel() < rows:
            if self.how == "data":
                self.table.data = torch.arange(float(rows))
            else:
                self.table.resize_(rows).copy_(torch.arange(float(rows)))
        return self.layer(inputs) + 0 * self.table[:rows, None]


@pytest.mark.parametrize("how", ["data", "resize_"])
@pytest.mark.parametrize("devices", [1, 2])
async def test_a_buffer_grown_in_place_is_backed_up_anew(how: str, devices: int) -> None:
    # The same tensor, another shape: copying it into the last step's backup raised "The size
    # of tensor a (2) must match the size of tensor b (4)".
    trainer = trainer_on(devices, GrownInPlace(how))
    result = await trainer.fit(make_batches([4, 8, 8]), epochs=2)
    assert result.global_step == 6


class Shift(nn.Module):
    def __init__(self, mean: float) -> None:
        super().__init__()
        self.register_buffer("mean", torch.full((FEATURES,), mean))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs - self.mean


async def test_a_module_replaced_between_fits_has_its_buffers_on_every_device() -> None:
    # The slots held the replaced module: the other devices kept its mean of 0.
    torch.manual_seed(0)
    model = nn.Sequential(Shift(0.0), nn.Linear(FEATURES, 3))
    trainer = trainer_on(2, model)
    await trainer.fit(make_batches([4]), epochs=1)
    trainer.model[0] = Shift(5.0)
    await trainer.fit(make_batches([4]), epochs=2)
    for replica in trainer._replicas:
        assert torch.equal(replica.model[0].mean, torch.full((FEATURES,), 5.0)), replica.device


class GrowsOnOutliers(nn.Module):
    """Makes a layer (or a buffer) the first time a batch holds an outlier: on the devices
    whose share holds one only."""

    def __init__(self, part: str) -> None:
        super().__init__()
        self.part = part
        self.layer = nn.Linear(FEATURES, 3)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if bool((inputs[:, 0] > 50).any()) and not hasattr(self, "extra"):
            if self.part == "parameter":
                self.extra = nn.Linear(FEATURES, 3)
            else:
                self.register_buffer("extra", torch.ones(1))
        return self.layer(inputs)


@pytest.mark.parametrize("part", ["parameter", "buffer"])
async def test_a_part_made_in_the_forward_on_some_devices_only_is_refused_naming_the_device(
    part: str,
) -> None:
    # The copy on cpu#1 alone made it: a buffer was lost from trainer.model and every
    # checkpoint without a word, and a parameter failed the epoch-end compare with "zip()
    # argument 2 is longer than argument 1", as did every later fit.
    batches = make_batches([8, 8])
    batches[1][0][6, 0] = 100.0  # in cpu#1's half of the second batch
    trainer = trainer_on(2, GrowsOnOutliers(part))
    for _ in range(2):  # the fit that made it, and the next, before any step
        with pytest.raises(ConfigurationError, match=f"copy on cpu#1 gained or lost a {part}"):
            await trainer.fit(batches, epochs=1)


class Tempered(nn.Module):
    """Logits divided by a temperature, a plain attribute; and the last input's mean kept as
    an attribute, each device its own (as a recurrent state is)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(FEATURES, 3)
        self.temperature = 1.0
        self.last: torch.Tensor | None = None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        worker = current_worker()
        LAST_SEEN.append((worker.device.name if worker else "", self.last))
        self.last = inputs.mean().detach()
        return self.layer(inputs) / self.temperature


#: (device, the attribute ``last`` as each forward of a `Tempered` found it).
LAST_SEEN: list[tuple[str, torch.Tensor | None]] = []


async def test_module_attributes_and_hooks_changed_between_fits_reach_every_device() -> None:
    # trainer.model.temperature = 4.0, a dropout's p = 0.0, a forward hook registered between
    # fits: device 0 alone took them (parameters 0.09 off a plain loop's, without a word).
    batches = make_batches([4, 4])
    torch.manual_seed(0)
    trainer = trainer_on(2, Tempered())
    await trainer.fit(batches, epochs=1)
    trainer.model.temperature = 4.0
    seen: list[str] = []
    handle = trainer.model.layer.register_forward_hook(
        lambda module, args, out: seen.append(str(module.weight.device))
    )
    await trainer.fit(batches, epochs=2)
    assert len(seen) == 4  # both devices, both steps
    handle.remove()
    await trainer.fit(batches, epochs=3)
    assert len(seen) == 4  # removed on every device
    torch.manual_seed(0)
    expected = Tempered()
    optimizer = SGD(expected.parameters())
    for epoch in range(3):
        expected.temperature = 1.0 if epoch == 0 else 4.0
        plain_epoch(expected, optimizer, batches)
    assert_matches(trainer, expected)
    assert [r.model.temperature for r in trainer._replicas] == [4.0, 4.0]


async def test_an_attribute_the_forward_sets_stays_each_device_s_own_across_calls() -> None:
    # Only what the user changes between calls is carried over: the forward's own (a
    # recurrent state) must not be overwritten by the first device's at the next call.
    batches = make_batches([4])
    trainer = trainer_on(2, Tempered())
    await trainer.fit(batches, epochs=1)
    own = [r.model.last for r in trainer._replicas]
    assert own[0] is not None
    assert own[1] is not None
    assert not torch.equal(own[0], own[1])
    await trainer.validate(batches)
    after = [r.model.last for r in trainer._replicas]
    assert not torch.equal(after[0], after[1])  # each its own share's, not device 0's
    trainer.model.last = None  # reset between calls, as a plain loop resets its state
    LAST_SEEN.clear()
    await trainer.validate(batches)
    assert sorted(LAST_SEEN, key=lambda seen: seen[0]) == [("cpu#0", None), ("cpu#1", None)]


@pytest.mark.parametrize("devices", [1, 2])
async def test_a_part_made_in_the_forward_on_every_device_is_refused_as_the_model_s(
    devices: int,
) -> None:
    # Every device's share holds an outlier: the message named one device's copy and blamed
    # the share, where every copy (or the one) had made it.
    batches = make_batches([8])
    batches[0][0][1, 0] = batches[0][0][6, 0] = 100.0  # in both halves
    trainer = trainer_on(devices, GrowsOnOutliers("buffer"))
    where = "the model (on every device)" if devices > 1 else "the model"
    with pytest.raises(ConfigurationError, match=re.escape(f"{where} gained or lost a buffer")):
        await trainer.fit(batches, epochs=1)


async def test_a_step_that_writes_a_frozen_parameter_warns_that_an_undo_misses_it() -> None:
    # A mean teacher kept as frozen parameters, updated in the step: a retried step wrote it
    # twice (the undo covers trained parameters and buffers), silently (8.6e-3 off a plain
    # loop's teacher after one retry).
    model = make_model()
    teacher = nn.Linear(FEATURES, 3).requires_grad_(False)
    holder = nn.ModuleDict({"student": model, "teacher": teacher})

    def step(module: nn.Module, batch: Batch) -> torch.Tensor:
        with torch.no_grad():
            for mine, theirs in zip(
                module["teacher"].parameters(), module["student"][0].parameters(), strict=False
            ):
                mine.mul_(0.9).add_(theirs[:3], alpha=0.1)  # the rows it has
        return loss_step(module["student"], batch)

    trainer = Trainer(holder, SGD, step, devices=cpu_devices(2), progress_bar=False)
    with pytest.warns(
        asyncddp.AsyncDDPRuntimeWarning, match=r"frozen parameters .*teacher\.weight"
    ):
        await trainer.fit(make_batches([4, 4]), epochs=1)
    await trainer.fit(make_batches([4, 4]), epochs=2)  # told once


async def test_an_attribute_referring_to_the_model_s_parts_refers_to_each_copy_s_own() -> None:
    # A list of submodules assigned between calls: a plain deep copy gave the second device
    # copies of the first device's modules, with their weights as they were then.
    trainer = trainer_on(2, make_model())
    await trainer.fit(make_batches([4]), epochs=1)
    trainer.model.pair = [trainer.model[0], trainer.model[0].weight, "tag"]
    await trainer.validate(make_batches([4]))
    for replica in trainer._replicas:
        layer, weight, tag = replica.model.pair
        assert layer is replica.model[0]
        assert weight is replica.model[0].weight
        assert tag == "tag"


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # inputs need none
async def test_hooks_and_private_attributes_carried_keep_their_kind_and_order() -> None:
    # A full backward hook registered between fits never ran on the second device (its flag
    # was not carried); a hook registered with prepend=True ran last there; a private setting
    # (trainer.model._scale) stayed as built.
    trainer = trainer_on(2, Tempered())
    order: list[str] = []
    trainer.model.layer.register_forward_hook(lambda *args: order.append("second"))
    await trainer.fit(make_batches([4]), epochs=1)
    order.clear()
    calls: list[str] = []
    trainer.model.layer.register_full_backward_hook(
        lambda module, grad_in, grad_out: calls.append("full")
    )
    trainer.model.layer.register_forward_hook(lambda *args: order.append("first"), prepend=True)
    trainer.model._private = 3.0
    await trainer.fit(make_batches([4]), epochs=2)
    assert calls == ["full", "full"]  # one step, two devices
    assert order == ["first", "second"] * 2
    assert [r.model._private for r in trainer._replicas] == [3.0, 3.0]


class HooksItself(nn.Module):
    """Registers a hook on its layer in its first forward, bound to itself: each copy its own."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(FEATURES, 3)
        self.seen = 0

    def count(self, module: nn.Module, args: Any, output: Any) -> None:
        self.seen += 1

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if not self.layer._forward_hooks:
            self.layer.register_forward_hook(self.count)
        return self.layer(inputs)


async def test_a_hook_a_copy_s_forward_registered_stays_that_copy_s() -> None:
    # The next call made each copy's hooks those of trainer.model: the second device's was
    # swapped for the first's, bound to trainer.model, which it then wrote from its thread.
    trainer = trainer_on(2, HooksItself())
    await trainer.fit(make_batches([4]), epochs=1)
    await trainer.fit(make_batches([4]), epochs=2)
    assert [r.model.seen for r in trainer._replicas] == [2, 2]


async def test_an_attribute_an_event_consumer_sets_during_a_fit_reaches_every_device_next() -> None:
    # Set on trainer.model between two epochs of a fit, the call's end took it for the
    # forward's own and no later call carried it over: [4.0, 1.0].
    trainer = trainer_on(2, Tempered())
    stream = trainer.events()

    async def anneal() -> None:
        async for event in stream:
            if isinstance(event, asyncddp.EpochEnded):
                trainer.model.temperature = 4.0

    async with anyio.create_task_group() as group:
        group.start_soon(anneal)
        await trainer.fit(make_batches([4]), epochs=1)
        stream.close()
    await trainer.validate(make_batches([4]))
    assert [r.model.temperature for r in trainer._replicas] == [4.0, 4.0]


class InferenceMean(nn.Module):
    """A running mean of its inputs, assigned anew in the forward under inference_mode."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(FEATURES, 3)
        self.register_buffer("mean", torch.zeros(FEATURES))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            self.mean = 0.9 * self.mean + 0.1 * inputs.mean(0)
        return self.layer(inputs)


async def test_a_buffer_made_under_inference_mode_is_taken_by_every_device() -> None:
    # Copying the first device's into it in place failed on the second ("Inplace update to
    # inference tensor outside InferenceMode"), in phase optimizer.
    trainer = trainer_on(2, InferenceMean())
    await trainer.fit(make_batches([4, 4]), epochs=1)
    first, second = (r.model.mean for r in trainer._replicas)
    assert torch.equal(first, second)


async def test_the_step_s_freezing_and_thawing_is_told_only_where_nothing_trains_the_part() -> None:
    # A GAN's toggle left the generator frozen at a fit's end: the next fit warned that the
    # step wrote frozen parameters (the optimizer's own steps). A part frozen when the
    # replicas were built and thawed by the step trained never, without a word.
    def toggling(model: nn.Module, batch: Batch) -> torch.Tensor:
        step = asyncddp.current_worker().step  # type: ignore[union-attr]
        model[0].requires_grad_(step % 2 == 0)
        return loss_step(model, batch)

    trainer = Trainer(make_model(), SGD, toggling, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(make_batches([4]), epochs=1)  # ends with layer 0 thawed
    trainer.model[0].requires_grad_(False)  # as an odd number of steps would leave it
    await trainer.fit(make_batches([4, 4]), epochs=2)  # no warning
    model = make_model()
    model[0].requires_grad_(False)

    def thawing(model: nn.Module, batch: Batch) -> torch.Tensor:
        model[0].requires_grad_(True)
        return loss_step(model, batch)

    frozen_at_build = Trainer(model, SGD, thawing, devices=cpu_devices(2), progress_bar=False)
    with pytest.warns(asyncddp.AsyncDDPRuntimeWarning, match=r"0\.weight, 0\.bias .*thawed during"):
        await frozen_at_build.fit(make_batches([4]), epochs=1)


class KeepsPairs(nn.Module):
    """Keeps a recurrent state as a tuple of tensors (an LSTM's (h, c)), the forward's own."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(FEATURES, 3)
        self.state: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        out = self.layer(inputs)
        self.state = (out.detach(), out.detach() * 2)
        return out


async def test_a_tuple_of_tensors_the_forward_keeps_does_not_wedge_the_trainer() -> None:
    # Comparing the tuples with == raised "Boolean value of Tensor ... is ambiguous" at the
    # call's end, before the session was closed: every later call was refused as running.
    trainer = trainer_on(2, KeepsPairs())
    for epochs in (1, 2, 3):
        await trainer.fit(make_batches([4]), epochs=epochs)
    assert trainer.global_step == 3


async def test_a_hook_the_first_copy_s_forward_made_alone_is_not_carried() -> None:
    # Where the other device ran no step (every share of a one-item batch empty), the first's
    # forward's hook was taken for the user's and carried, bound to trainer.model.
    trainer = trainer_on(2, HooksItself())
    await trainer.fit(make_batches([1]), epochs=1)  # cpu#1's share is empty
    await trainer.fit(make_batches([4]), epochs=2)
    second = trainer._replicas[1].model
    assert [hook.__self__ for hook in second.layer._forward_hooks.values()] == [second]


async def test_a_carried_container_keeps_its_cycles_shared_references_and_keys() -> None:
    # Copied item by item, a dict holding itself recursed without end (the fit failed), a
    # module as a key stayed trainer.model's, and a tensor held twice became two.
    trainer = trainer_on(2, make_model())
    await trainer.fit(make_batches([4]), epochs=1)
    shared = torch.ones(3)
    config: dict[Any, Any] = {"pair": [shared, shared], trainer.model[0]: 2.0}
    config["self"] = config
    trainer.model.config = config
    await trainer.validate(make_batches([4]))
    second = trainer._replicas[1].model
    assert second.config["self"] is second.config
    assert second.config["pair"][0] is second.config["pair"][1]
    assert second.config[second[0]] == 2.0


# -- models torch rewrites: pruning, legacy weight_norm and spectral_norm, parametrizations ----


def _pruned(model: nn.Sequential) -> nn.Sequential:
    torch.nn.utils.prune.l1_unstructured(model[0], "weight", amount=0.5)
    return model


def _legacy_spectral(model: nn.Sequential) -> nn.Sequential:
    torch.nn.utils.spectral_norm(model[3])
    with torch.no_grad():  # its weight, made by a forward: one in eval mode still makes it
        model.eval()(torch.zeros(1, FEATURES))
    model.train()
    model(torch.zeros(2, FEATURES))  # a forward in training: its weight has a graph now
    return model


def _legacy_weight_norm(model: nn.Sequential) -> nn.Sequential:
    with pytest.warns(FutureWarning):  # torch deprecates it
        torch.nn.utils.weight_norm(model[0])
    return model


@pytest.mark.parametrize("rewrite", [_pruned, _legacy_spectral, _legacy_weight_norm])
@pytest.mark.parametrize("devices", [1, 2])
async def test_models_whose_weight_a_forward_pre_hook_remakes_train_as_the_plain_loop(
    rewrite: Any, devices: int
) -> None:
    # Pruning keeps weight = weight_orig * weight_mask as a plain attribute with a graph, and
    # the legacy weight_norm and spectral_norm keep theirs so: copy.deepcopy refuses such a
    # tensor, and the copies for the devices past the first failed to be made (a
    # ConfigurationError that blamed the legacy weight_norm), where one device trained. Each
    # copy's pre-hook remakes it from the copy's own parameters before every forward.
    batches = make_batches([6, 8, 4])
    model = rewrite(make_model())
    expected = rewrite(make_model())
    trainer = trainer_on(devices, model)
    await trainer.fit(batches, epochs=2)
    optimizer = SGD(expected.parameters())
    for _ in range(2):
        plain_epoch(expected, optimizer, batches)
    assert_matches(trainer, expected)
    assert trainer.model is model


async def test_pruning_between_fits_is_refused_naming_the_renamed_parameter() -> None:
    # Pruning registers weight_orig last: compared by position, the message named 0.bias,
    # which did not change, as "another parameter now ... a layer replaced".
    batches = make_batches([4])
    trainer = trainer_on(2, make_model())
    await trainer.fit(batches, epochs=1)
    torch.nn.utils.prune.l1_unstructured(trainer.model[0], "weight", amount=0.5)
    with pytest.raises(ConfigurationError) as caught:
        await trainer.fit(batches, epochs=2)
    message = str(caught.value)
    assert "0.weight is gone and 0.weight_orig is new" in message
    assert "torch.nn.utils.prune renames weight to weight_orig" in message
    assert "0.bias" not in message
    assert trainer.global_step == 1
    # As the message says: a new Trainer over the pruned model trains it, on 2 devices too.
    again = trainer_on(2, trainer.model)
    await again.fit(batches, epochs=1)
    assert again.global_step == 1


async def test_a_weight_assigned_through_a_parametrization_is_refused_with_its_layout() -> None:
    # torch stores the value with set_(), which here lays the original out transposed: the
    # message blamed channels_last alone, and gave no way to lay it out as it was.
    model = make_model()
    torch.nn.utils.parametrizations.orthogonal(model[0])
    batches = make_batches([6])
    trainer = trainer_on(2, model)
    await trainer.fit(batches, epochs=1)
    original = model[0].parametrizations.weight.original
    with torch.no_grad():
        model[0].weight = torch.linalg.qr(torch.randn(16, FEATURES))[0]
    assert not original.is_contiguous()
    with pytest.raises(
        ConfigurationError,
        match=r"0\.parametrizations\.weight\.original is laid out otherwise in memory, "
        r"strides \(1, 16\) .*parametrize does when a parametrized weight is assigned.*"
        r"param\.data = param\.data\.contiguous\(\)",
    ):
        await trainer.fit(batches, epochs=2)
    original.data = original.data.contiguous()
    await trainer.fit(batches, epochs=2)
    assert trainer.global_step == 2


async def test_parametrize_cached_in_the_step_is_named_in_the_error() -> None:
    # Its cache is keyed by trainer.model's module, which each copy's property names: under
    # it every device reads the first's weight, and its backward writes there.
    turns = threading.Barrier(2, timeout=10)
    unit = torch.ones(FEATURES, 16)

    def cached_step(model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        worker = current_worker()
        assert worker is not None
        with torch.nn.utils.parametrize.cached():
            if worker.device.index == 0:
                _ = model[0].weight  # cached, under the key of trainer.model's module
                turns.wait()  # the other device reads it now
                turns.wait()
                return loss_step(nn.Sequential(*model[1:]), (inputs @ unit, targets))
            turns.wait()
            loss = loss_step(model, batch)  # with the first device's weight
            turns.wait()
            return loss

    model = make_model()
    torch.nn.utils.parametrizations.orthogonal(model[0])
    trainer = Trainer(model, SGD, cached_step, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(asyncddp.StepOutputError, match=r"parametrize\.cached\(\) does so too"):
        await trainer.fit(make_batches([6]), epochs=1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (  # tying: a parameter gone, and no word of pruning
            lambda model: setattr(model[3], "weight", model[0].weight),
            None,
        ),
        (  # a layer added
            lambda model: model.append(nn.Linear(3, 3)),
            r"it had 4 parameters, and has 6 now \(4\.weight, 4\.bias are new\)\. ",
        ),
        (  # the same parameter deleted and registered again: it goes last
            lambda model: model[0].register_parameter("weight", model[0]._parameters.pop("weight")),
            r"its parameters are in another order now \(0\.bias, 0\.weight moved: a parameter "
            r"deleted and registered again goes last\)",
        ),
    ],
)
async def test_parameters_tied_added_or_moved_between_fits_are_named_as_they_changed(
    change: Any, message: str | None
) -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Identity(), nn.Linear(3, 3))
    batches = [(torch.randn(4, 3), torch.randint(0, 3, (4,)))]
    trainer = Trainer(model, SGD, loss_step, devices=cpu_devices(2), progress_bar=False)
    await trainer.fit(batches, epochs=1)
    change(trainer.model)
    with pytest.raises(ConfigurationError) as caught:
        await trainer.fit(batches, epochs=2)
    said = str(caught.value)
    assert "prune" not in said
    if message is None:
        assert "it had 4 parameters, and has 3 now (3.weight is gone)" in said
    else:
        assert re.search(message, said), said
