"""Continuing an epoch: after stop(), after a cancellation, or from a checkpoint in a new
trainer, a run must end as the uninterrupted run does, every sample trained once an epoch."""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler

from asyncddp import EpochEnded, FitStarted, StepEnded, Trainer, cpu_devices

pytestmark = pytest.mark.anyio

SAMPLES = 16
FEATURES = 4
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


class Numbered(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """Fixed samples that carry their index, so that a step can tell which it trained on."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(42)
        self.inputs = torch.randn(SAMPLES, FEATURES, generator=generator)
        self.targets = self.inputs.sum(1, keepdim=True)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index], torch.tensor(index)


class Recorder:
    """The training step, noting the samples of each epoch in the order trained."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.seen: dict[int, list[int]] = collections.defaultdict(list)
        self.hook: Callable[[int], None] | None = None  # called with the step, as it runs

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        assert self.trainer is not None
        if self.hook is not None:
            self.hook(self.trainer.global_step)
        inputs, targets, indices = batch
        self.seen[self.trainer.epoch].extend(indices.tolist())
        return F.mse_loss(model(inputs), targets)


def make_trainer(recorder: Recorder, devices: int = 1) -> Trainer:
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    trainer = Trainer(model, SGD, recorder, devices=cpu_devices(devices), progress_bar=False)
    recorder.trainer = trainer
    return trainer


def parameters(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


async def fit_until_stopped(trainer: Trainer, data: Any, *, epochs: int, at_step: int) -> None:
    """``fit``, stopped once step ``at_step`` ends."""
    stream = trainer.events()

    async def stopper() -> None:
        async for event in stream:
            if isinstance(event, StepEnded) and event.step == at_step:
                trainer.stop("test")

    async with anyio.create_task_group() as group:
        group.start_soon(stopper)
        result = await trainer.fit(data, epochs=epochs)
    assert result.stopped


def each_once(seen: dict[int, list[int]], epochs: int) -> bool:
    return all(sorted(seen[epoch]) == list(range(SAMPLES)) for epoch in range(epochs))


# -- set_epoch ---------------------------------------------------------------------------------


class EpochSampler(Sampler[int]):
    """A sampler whose order depends on the epoch it is told (as DistributedSampler's does)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.calls: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.calls.append(epoch)
        self.epoch = epoch

    def __len__(self) -> int:
        return SAMPLES

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(self.epoch))
        return iter(order.tolist())


class EpochBatchSampler(BatchSampler):
    def __init__(self, sampler: Sampler[int]) -> None:
        super().__init__(sampler, batch_size=4, drop_last=False)
        self.calls: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.calls.append(epoch)


async def test_a_sampler_s_set_epoch_is_called_before_each_epoch_in_one_process() -> None:
    sampler = EpochSampler()
    recorder = Recorder()
    trainer = make_trainer(recorder)
    await trainer.fit(DataLoader(Numbered(), batch_size=4, sampler=sampler), epochs=3)
    assert sampler.calls == [0, 1, 2]
    for epoch in range(3):
        sampler.epoch = epoch
        assert recorder.seen[epoch] == list(sampler)
    assert recorder.seen[0] != recorder.seen[1]


async def test_a_batch_sampler_and_its_sampler_each_get_the_epoch_once() -> None:
    sampler = EpochSampler()
    batches = EpochBatchSampler(sampler)
    trainer = make_trainer(Recorder())
    await trainer.fit(DataLoader(Numbered(), batch_sampler=batches), epochs=2)
    assert batches.calls == [0, 1]
    assert sampler.calls == [0, 1]


async def test_a_continued_epoch_gets_the_same_epoch_number_and_order() -> None:
    sampler = EpochSampler()
    loader = DataLoader(Numbered(), batch_size=4, sampler=sampler)
    uninterrupted = make_trainer(Recorder())
    await uninterrupted.fit(loader, epochs=2)
    sampler.calls.clear()

    recorder = Recorder()
    trainer = make_trainer(recorder)
    await fit_until_stopped(trainer, loader, epochs=2, at_step=5)  # in epoch 1, of 4 steps
    await trainer.fit(loader, epochs=2)
    assert sampler.calls == [0, 1, 1]
    assert each_once(recorder.seen, 2)
    torch.testing.assert_close(parameters(trainer), parameters(uninterrupted))


@pytest.mark.parametrize("kind", ["list", "DataLoader"])
async def test_an_epoch_continued_over_fewer_batches_than_it_trained_warns(kind: str) -> None:
    # It skipped all 2 batches and ended the epoch without a word.
    def data(batches: int) -> Any:
        loader = DataLoader(torch.utils.data.Subset(Numbered(), range(4 * batches)), batch_size=4)
        return list(loader) if kind == "list" else loader

    trainer = make_trainer(Recorder())
    await fit_until_stopped(trainer, data(4), epochs=2, at_step=2)  # 3 batches of epoch 0
    with pytest.warns(
        UserWarning,
        match=rf"^train_data \({kind}\) has 2 batch\(es\) in epoch 0, but the run this "
        r"continues stopped in that epoch after 3: the epoch ends with nothing more trained",
    ) as caught:
        await trainer.fit(data(2), epochs=2)
    assert caught[0].filename == __file__
    # The same data, or as many batches as it had trained on: no warning.
    for batches in (4, 3):
        trainer = make_trainer(Recorder())
        await fit_until_stopped(trainer, data(4), epochs=2, at_step=2)
        await trainer.fit(data(batches), epochs=2)


# -- a loader's own generator ------------------------------------------------------------------


def generator_loader(kind: str) -> DataLoader[Any]:
    """A shuffling loader that draws from a generator of its own, not from torch's global one:
    the loader's (the PyTorch reproducibility recipe), or its sampler's."""
    generator = torch.Generator().manual_seed(7)
    if kind == "loader":
        return DataLoader(Numbered(), batch_size=2, shuffle=True, generator=generator)
    sampler = RandomSampler(Numbered(), generator=generator)
    return DataLoader(Numbered(), batch_size=2, sampler=sampler)


@pytest.mark.parametrize("kind", ["loader", "sampler"])
async def test_an_epoch_continued_with_a_loader_s_own_generator_keeps_its_order(
    kind: str,
) -> None:
    uninterrupted = make_trainer(Recorder())
    await uninterrupted.fit(generator_loader(kind), epochs=2)

    recorder = Recorder()
    trainer = make_trainer(recorder)
    loader = generator_loader(kind)
    await fit_until_stopped(trainer, loader, epochs=2, at_step=11)  # in epoch 1, of 8 steps
    await trainer.fit(loader, epochs=2)
    assert each_once(recorder.seen, 2)
    torch.testing.assert_close(parameters(trainer), parameters(uninterrupted))


@pytest.mark.parametrize("kind", ["loader", "sampler"])
@pytest.mark.parametrize("at_step", [11, 7])  # in mid-epoch 1; at the end of epoch 0
async def test_a_checkpoint_resumes_a_loader_s_own_generator_where_it_was(
    kind: str, at_step: int, tmp_path: Any
) -> None:
    uninterrupted = make_trainer(Recorder())
    await uninterrupted.fit(generator_loader(kind), epochs=3)

    first = make_trainer(Recorder())
    await fit_until_stopped(first, generator_loader(kind), epochs=3, at_step=at_step)
    path = await first.save_checkpoint(tmp_path / "stopped.ckpt")
    recorder = Recorder()
    resumed = make_trainer(recorder)  # with a new loader, its generator seeded as at the start
    await resumed.fit(generator_loader(kind), epochs=3, resume=path)
    torch.testing.assert_close(parameters(resumed), parameters(uninterrupted))
    assert sorted(recorder.seen[2]) == list(range(SAMPLES))


async def test_a_stop_at_an_epoch_s_last_step_keeps_the_sampler_s_draw_at_its_end(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # RandomSampler draws one more permutation from its generator as its iterator ends, in
    # the loader's next() after the epoch's last batch. A stop at the epoch's last step closed
    # the epoch by the batch count and took the generator's state before the loader thread
    # (late, on a loaded machine) made that draw: the later epochs were shuffled otherwise.
    uninterrupted = make_trainer(Recorder())
    await uninterrupted.fit(generator_loader("sampler"), epochs=3)

    plain = RandomSampler.__iter__

    def late_end(self: RandomSampler) -> Iterator[int]:
        indices = plain(self)
        yield from itertools.islice(indices, len(self))
        time.sleep(0.3)  # the loader thread is late for the iterator's end: the stop is first
        yield from indices

    first = make_trainer(Recorder())
    with monkeypatch.context() as patch:
        patch.setattr(RandomSampler, "__iter__", late_end)
        await fit_until_stopped(first, generator_loader("sampler"), epochs=3, at_step=7)
    assert first.epoch == 1  # the stop closed epoch 0
    path = await first.save_checkpoint(tmp_path / "stopped.ckpt")
    resumed = make_trainer(Recorder())
    await resumed.fit(generator_loader("sampler"), epochs=3, resume=path)
    torch.testing.assert_close(parameters(resumed), parameters(uninterrupted))


class Gated(Numbered):
    """`Numbered`, whose ``__getitem__`` waits for ``gate`` while ``hold`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hold, self.gate = False, threading.Event()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.hold:
            assert self.gate.wait(60.0)
        return super().__getitem__(index)


async def test_a_stop_while_a_continued_epoch_replays_leaves_it_open_at_once() -> None:
    # An epoch whose every batch was trained but that a cancellation left open: the next fit
    # replays its loads before anything else. A stop() during that replay closed the epoch
    # and took the loader's generators mid-replay; for a while it waited for the whole replay
    # (each of the epoch's loads) instead. It leaves the epoch open, and the fit after closes it.
    uninterrupted = make_trainer(Recorder())
    await uninterrupted.fit(DataLoader(Numbered(), batch_size=2, shuffle=True), epochs=2)

    recorder = Recorder()
    trainer = make_trainer(recorder)
    data = Gated()
    loader = DataLoader(data, batch_size=2, shuffle=True)
    running, cancelled = threading.Event(), threading.Event()

    def hold_last_step(step: int) -> None:
        if step == SAMPLES // 2 - 1:  # the epoch's last step: cancelled as it runs
            running.set()
            assert cancelled.wait(60.0)

    recorder.hook = hold_last_step
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:

            async def cancel() -> None:
                await anyio.to_thread.run_sync(running.wait)
                scope.cancel()
                cancelled.set()

            group.start_soon(cancel)
            await trainer.fit(loader, epochs=2)
    assert scope.cancelled_caught
    assert (trainer.epoch, trainer.global_step) == (0, 8)  # every batch trained; epoch open
    recorder.hook = None

    data.hold = True  # the replay's loads wait
    stream = trainer.events()

    async def stop_at_start() -> None:
        async for event in stream:
            if isinstance(event, FitStarted):
                trainer.stop("test")
                return

    with anyio.fail_after(30):  # the loads wait 60 s
        async with anyio.create_task_group() as group:
            group.start_soon(stop_at_start)
            result = await trainer.fit(loader, epochs=2)
    assert result.stopped
    assert trainer.epoch == 0  # left open
    data.hold = False
    data.gate.set()
    result = await trainer.fit(loader, epochs=2)
    assert result.epoch == 2
    assert sorted(recorder.seen[1]) == list(range(SAMPLES))
    torch.testing.assert_close(parameters(trainer), parameters(uninterrupted))


async def test_a_checkpoint_without_loader_generator_states_still_resumes(tmp_path: Any) -> None:
    # As written by earlier versions, which kept only the global generators.
    first = make_trainer(Recorder())
    await fit_until_stopped(first, generator_loader("loader"), epochs=2, at_step=11)
    path = await first.save_checkpoint(tmp_path / "stopped.ckpt")
    state = torch.load(path, weights_only=True)
    state["epoch_rng"].pop("loaders", None)
    state.pop("loader_rng", None)
    torch.save(state, path)
    resumed = make_trainer(Recorder())
    result = await resumed.fit(generator_loader("loader"), epochs=2, resume=path)
    assert result.epoch == 2


# -- persistent workers ------------------------------------------------------------------------


def persistent_loader() -> DataLoader[Any]:
    return DataLoader(
        Numbered(), batch_size=2, shuffle=True, num_workers=1, persistent_workers=True
    )


async def test_an_epoch_continued_with_persistent_workers_trains_each_sample_once() -> None:
    # The loader's first iter() draws its workers' base seed before the order's seed; a later
    # one only the order's: the epoch's replay must draw as the epoch's start did.
    torch.manual_seed(3)
    uninterrupted = make_trainer(Recorder())
    await uninterrupted.fit(persistent_loader(), epochs=2)

    torch.manual_seed(3)
    recorder = Recorder()
    trainer = make_trainer(recorder)
    loader = persistent_loader()
    await fit_until_stopped(trainer, loader, epochs=2, at_step=3)  # in epoch 0, of 8 steps
    await trainer.fit(loader, epochs=2)
    assert each_once(recorder.seen, 2)
    torch.testing.assert_close(parameters(trainer), parameters(uninterrupted))


async def test_a_checkpoint_resumes_persistent_workers_with_the_epoch_s_order(
    tmp_path: Any,
) -> None:
    # Stopped in epoch 1, whose iter() drew no base seed; resumed with a new loader, whose
    # first iter() draws one.
    torch.manual_seed(3)
    uninterrupted = make_trainer(Recorder())
    await uninterrupted.fit(persistent_loader(), epochs=2)

    torch.manual_seed(3)
    before = Recorder()
    first = make_trainer(before)
    await fit_until_stopped(first, persistent_loader(), epochs=2, at_step=11)
    path = await first.save_checkpoint(tmp_path / "stopped.ckpt")
    torch.manual_seed(999)
    after = Recorder()
    resumed = make_trainer(after)
    await resumed.fit(persistent_loader(), epochs=2, resume=path)
    assert sorted(before.seen[1] + after.seen[1]) == list(range(SAMPLES))
    torch.testing.assert_close(parameters(resumed), parameters(uninterrupted))


# -- random draws in the loader and in the step ------------------------------------------------


class Augmented(Numbered):
    """Noise drawn from torch's global generator in ``__getitem__``: with ``num_workers=0``, on
    the loader thread, ahead of training."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs, targets, number = super().__getitem__(index)
        return inputs + 0.1 * torch.randn(FEATURES), targets, number


def augmented_loader() -> DataLoader[Any]:
    return DataLoader(Augmented(), batch_size=2, shuffle=True)


async def uninterrupted_augmented(epochs: int) -> torch.Tensor:
    torch.manual_seed(3)
    trainer = make_trainer(Recorder())
    await trainer.fit(augmented_loader(), epochs=epochs)
    return parameters(trainer)


@pytest.mark.parametrize("at_step", [3, 11])
async def test_an_epoch_continued_with_random_draws_in_the_loader_ends_exactly(
    at_step: int,
) -> None:
    expected = await uninterrupted_augmented(2)
    torch.manual_seed(3)
    recorder = Recorder()
    trainer = make_trainer(recorder)
    loader = augmented_loader()
    await fit_until_stopped(trainer, loader, epochs=2, at_step=at_step)
    await trainer.fit(loader, epochs=2)
    assert each_once(recorder.seen, 2)
    torch.testing.assert_close(parameters(trainer), expected, rtol=0, atol=0)


async def test_a_checkpoint_resumes_random_draws_in_the_loader_exactly(tmp_path: Any) -> None:
    expected = await uninterrupted_augmented(2)
    torch.manual_seed(3)
    first = make_trainer(Recorder())
    await fit_until_stopped(first, augmented_loader(), epochs=2, at_step=11)
    path = await first.save_checkpoint(tmp_path / "stopped.ckpt")
    torch.manual_seed(999)
    resumed = make_trainer(Recorder())
    await resumed.fit(augmented_loader(), epochs=2, resume=path)
    torch.testing.assert_close(parameters(resumed), expected, rtol=0, atol=0)


async def test_a_checkpoint_written_while_the_loader_draws_ahead_resumes_exactly(
    tmp_path: Any,
) -> None:
    expected = await uninterrupted_augmented(2)
    torch.manual_seed(3)
    trainer = make_trainer(Recorder())
    stream = trainer.events()
    path = tmp_path / "during.ckpt"

    async def checkpointer() -> None:
        async for event in stream:
            if isinstance(event, StepEnded) and event.step == 10:
                await trainer.save_checkpoint(path)  # the fit goes on meanwhile

    async with anyio.create_task_group() as group:
        group.start_soon(checkpointer)
        await trainer.fit(augmented_loader(), epochs=2)
    torch.testing.assert_close(parameters(trainer), expected, rtol=0, atol=0)
    torch.manual_seed(999)
    resumed = make_trainer(Recorder())
    await resumed.fit(augmented_loader(), epochs=2, resume=path)
    torch.testing.assert_close(parameters(resumed), expected, rtol=0, atol=0)


def dropout_step(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets, _ = batch
    return F.mse_loss(model(F.dropout(inputs, 0.5)), targets)


async def test_an_epoch_continued_with_dropout_in_the_step_ends_exactly() -> None:
    # The loader draws only its order: the step's draws go on from where they were.
    def dropout_trainer() -> Trainer:
        torch.manual_seed(0)
        model = nn.Linear(FEATURES, 1)
        return Trainer(model, SGD, dropout_step, devices=cpu_devices(1), progress_bar=False)

    loader = DataLoader(Numbered(), batch_size=2, shuffle=True)
    torch.manual_seed(3)
    uninterrupted = dropout_trainer()
    await uninterrupted.fit(loader, epochs=2)
    torch.manual_seed(3)
    trainer = dropout_trainer()
    await fit_until_stopped(trainer, loader, epochs=2, at_step=11)
    await trainer.fit(loader, epochs=2)
    torch.testing.assert_close(parameters(trainer), parameters(uninterrupted), rtol=0, atol=0)


# -- a loader thread left inside next() by a stop or a cancellation ------------------------------


class HeldAugmented(Augmented):
    """:class:`Augmented` whose ``at``-th item (counted from 1, the first time only) draws part
    of its noise, waits for ``gate`` (after setting ``inside``), then draws the rest: a stop or
    a cancellation meanwhile leaves the loader thread inside ``next()``, in mid-draw."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0
        self.inside, self.gate = threading.Event(), threading.Event()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.calls += 1
        if self.calls != self.at:
            return super().__getitem__(index)
        inputs, targets, number = Numbered.__getitem__(self, index)
        first = torch.randn(FEATURES // 2)
        self.inside.set()
        assert self.gate.wait(60.0)
        noise = torch.cat([first, torch.randn(FEATURES - FEATURES // 2)])
        return inputs + 0.1 * noise, targets, number


async def interrupt_inside_next(trainer: Trainer, data: HeldAugmented, how: str) -> None:
    """``fit`` until it waits for the batch the loader thread is held inside; then stop it, or
    cancel it, leaving that thread inside ``next()``."""
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:

            async def interrupt() -> None:
                await anyio.to_thread.run_sync(data.inside.wait)
                await anyio.sleep(0.5)  # training catches up with the loader and waits for it
                assert not data.gate.is_set()
                if how == "stop":
                    trainer.stop("test")
                else:
                    scope.cancel()

            group.start_soon(interrupt)
            result = await trainer.fit(DataLoader(data, batch_size=2, shuffle=True), epochs=2)
            assert result.stopped
    assert scope.cancelled_caught == (how == "cancel")
    assert not data.gate.is_set(), "fit waited for the loader"


@pytest.mark.parametrize("how", ["stop", "cancel"])
async def test_an_epoch_continued_after_the_loader_was_left_inside_next_ends_exactly(
    how: str,
) -> None:
    # The batch the thread left behind went on to load drew from the generators after the
    # fit returned: the next fit waits for it, and its replay loads that batch too before it
    # puts the generators back. It used to load one batch fewer, and that batch was drawn
    # again from where the generators were after it.
    expected = await uninterrupted_augmented(2)
    torch.manual_seed(3)
    trainer = make_trainer(Recorder())
    data = HeldAugmented(at=11)
    await interrupt_inside_next(trainer, data, how)
    data.gate.set()
    await trainer.fit(DataLoader(data, batch_size=2, shuffle=True), epochs=2)
    torch.testing.assert_close(parameters(trainer), expected, rtol=0, atol=0)


async def test_a_checkpoint_after_the_loader_was_left_inside_next_resumes_exactly(
    tmp_path: Any,
) -> None:
    # save_checkpoint waits for the call left running, then takes the count of batches loaded
    # and the generators together. It used to take them while that call was in mid-draw.
    expected = await uninterrupted_augmented(2)
    torch.manual_seed(3)
    trainer = make_trainer(Recorder())
    data = HeldAugmented(at=11)
    await interrupt_inside_next(trainer, data, "stop")
    async with anyio.create_task_group() as group:

        async def release() -> None:
            await anyio.sleep(0.3)
            data.gate.set()

        group.start_soon(release)
        path = await trainer.save_checkpoint(tmp_path / "left.ckpt")
        assert data.gate.is_set(), "the checkpoint did not wait for the call left running"
    torch.manual_seed(999)
    resumed = make_trainer(Recorder())
    await resumed.fit(augmented_loader(), epochs=2, resume=path)
    torch.testing.assert_close(parameters(resumed), expected, rtol=0, atol=0)


def test_epoch_sums_saved_without_metric_counts_keep_them_over_the_items_so_far() -> None:
    # A metric over every item so far is saved without its count; loaded, its count followed
    # the items counted after it, and a metric the later steps did not return was diluted.
    from asyncddp._jobs import Sums
    from asyncddp._resume import _sums_dict

    sums = Sums(8, 7.0, {"m": 8.0}, metric_items={"m": 8})
    state = _sums_dict(sums)
    assert "metric_items" not in state  # readable by versions without them
    loaded = Sums(**state)
    loaded.add(Sums(8, 7.0, {}))
    assert loaded.means() == {"m": 1.0}


# -- a validation cut short --------------------------------------------------------------------


VALIDATING = threading.Event()  # set by valid_step: a validation runs


def valid_step(model: nn.Module, batch: Any) -> torch.Tensor:
    VALIDATING.set()
    time.sleep(0.05)  # long enough for a consumer of EpochEnded to cancel the fit meanwhile
    inputs, targets, _ = batch
    return F.mse_loss(model(inputs), targets)


def validating_trainer(recorder: Recorder) -> Trainer:
    torch.manual_seed(0)
    trainer = Trainer(
        nn.Linear(FEATURES, 1),
        SGD,
        recorder,
        valid_step=valid_step,
        devices=cpu_devices(1),  # one worker: the order of the recorded samples is the order
        progress_bar=False,
    )
    recorder.trainer = trainer
    return trainer


def shuffled_and_valid(generators: str = "global") -> tuple[DataLoader[Any], DataLoader[Any]]:
    """Iterating either DataLoader draws its seed from torch's generator (``"global"``: neither
    has its own); the train loader's order from a generator of its own (``"train"``); or
    both from one generator they share (``"shared"``, a reproducibility recipe)."""
    if generators == "global":
        return (
            DataLoader(Numbered(), batch_size=4, shuffle=True),
            DataLoader(Numbered(), batch_size=8),
        )
    generator = torch.Generator().manual_seed(11)
    return (
        DataLoader(Numbered(), batch_size=4, shuffle=True, generator=generator),
        DataLoader(
            Numbered(), batch_size=8, generator=generator if generators == "shared" else None
        ),
    )


async def fit_cancelled_in_validation(
    trainer: Trainer, *, epochs: int, generators: str = "global"
) -> None:
    """``fit``, cancelled from the consumer of epoch 0's ``EpochEnded``: in its validation."""
    train, valid = shuffled_and_valid(generators)
    stream = trainer.events()
    with anyio.CancelScope() as scope:

        async def canceller() -> None:
            async for event in stream:
                if isinstance(event, EpochEnded) and event.epoch == 0:
                    scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(canceller)
            await trainer.fit(train, epochs=epochs, valid_data=valid)
    assert scope.cancelled_caught
    assert (trainer.epoch, trainer._epoch_trained) == (0, True)  # validation and close pending


async def uninterrupted_with_validation(
    epochs: int, generators: str = "global"
) -> tuple[torch.Tensor, list[int]]:
    torch.manual_seed(3)
    recorder = Recorder()
    trainer = validating_trainer(recorder)
    train, valid = shuffled_and_valid(generators)
    await trainer.fit(train, epochs=epochs, valid_data=valid)
    return parameters(trainer), recorder.seen[1]


async def resumed_with_validation(
    resume: Any, generators: str, checkpoint_dir: Any = None
) -> tuple[Trainer, list[int]]:
    """A new trainer (seeded otherwise) fitted to 2 epochs from ``resume`` on new loaders (a
    new process's: seeded as at the start); it, and the samples of its epoch 1 in order."""
    torch.manual_seed(999)
    recorder = Recorder()
    resumed = validating_trainer(recorder)
    resumed.checkpoint_dir = checkpoint_dir
    train, valid = shuffled_and_valid(generators)
    await resumed.fit(train, epochs=2, valid_data=valid, resume=resume)
    return resumed, recorder.seen[1]


async def test_a_validation_cut_short_runs_again_as_if_once() -> None:
    # The next fit validates again before it closes the epoch: from the generators' states the
    # first validation began with, or the next epoch's shuffle comes out another order.
    expected, order = await uninterrupted_with_validation(2)
    torch.manual_seed(3)
    recorder = Recorder()
    trainer = validating_trainer(recorder)
    await fit_cancelled_in_validation(trainer, epochs=2)
    train, valid = shuffled_and_valid()
    await trainer.fit(train, epochs=2, valid_data=valid)
    assert recorder.seen[1] == order
    torch.testing.assert_close(parameters(trainer), expected, rtol=0, atol=0)


async def test_a_checkpoint_taken_after_a_validation_cut_short_resumes_as_if_once(
    tmp_path: Any,
) -> None:
    expected, order = await uninterrupted_with_validation(2)
    torch.manual_seed(3)
    first = validating_trainer(Recorder())
    await fit_cancelled_in_validation(first, epochs=2)
    path = await first.save_checkpoint(tmp_path / "cut-short.ckpt")
    resumed, seen = await resumed_with_validation(path, "global")
    assert seen == order
    torch.testing.assert_close(parameters(resumed), expected, rtol=0, atol=0)


async def test_an_epoch_end_checkpoint_resumes_loaders_that_share_a_generator(
    tmp_path: Any,
) -> None:
    # The validation loader's iter() draws its seed from the generator it shares with the
    # train loader. The checkpoint held that generator's state from before the validation,
    # so the resumed run's next epoch was shuffled in another order than an uninterrupted one.
    expected, order = await uninterrupted_with_validation(2, generators="shared")
    torch.manual_seed(3)
    first = validating_trainer(Recorder())
    first.checkpoint_dir = tmp_path
    train, valid = shuffled_and_valid("shared")
    await first.fit(train, epochs=1, valid_data=valid)
    resumed, seen = await resumed_with_validation("latest", "shared", checkpoint_dir=tmp_path)
    assert seen == order
    torch.testing.assert_close(parameters(resumed), expected, rtol=0, atol=0)


async def test_a_checkpoint_in_a_validation_cut_short_resumes_loaders_that_share_a_generator(
    tmp_path: Any,
) -> None:
    # Resumed before the epoch's end: the train loader's generator is put back before the
    # validation runs again (it draws from it), not after, over the validation's draw.
    expected, order = await uninterrupted_with_validation(2, generators="shared")
    torch.manual_seed(3)
    first = validating_trainer(Recorder())
    await fit_cancelled_in_validation(first, epochs=2, generators="shared")
    path = await first.save_checkpoint(tmp_path / "cut-short.ckpt")
    resumed, seen = await resumed_with_validation(path, "shared")
    assert seen == order
    torch.testing.assert_close(parameters(resumed), expected, rtol=0, atol=0)


@pytest.mark.parametrize("generators", ["global", "train", "shared"])
async def test_a_resume_cut_short_in_its_validation_again_still_puts_the_generators_back(
    tmp_path: Any, generators: str
) -> None:
    # Resumed before the epoch's end, the train loader's generators were put back as the
    # validation began, and the saved states forgotten then: cut short there again, the
    # next fit's new loaders were not put back, and the next epoch shuffled otherwise.
    expected, order = await uninterrupted_with_validation(2, generators=generators)
    torch.manual_seed(3)
    first = validating_trainer(Recorder())
    await fit_cancelled_in_validation(first, epochs=2, generators=generators)
    path = await first.save_checkpoint(tmp_path / "cut-short.ckpt")
    torch.manual_seed(999)
    recorder = Recorder()
    resumed = validating_trainer(recorder)
    train, valid = shuffled_and_valid(generators)
    VALIDATING.clear()
    with anyio.CancelScope() as scope:

        async def cancel_in_the_validation() -> None:
            assert await anyio.to_thread.run_sync(VALIDATING.wait, 30.0)
            scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(cancel_in_the_validation)
            await resumed.fit(train, epochs=2, valid_data=valid, resume=path)
    assert (resumed.epoch, resumed._epoch_trained) == (0, True)
    train, valid = shuffled_and_valid(generators)  # new loaders, seeded as at the start
    await resumed.fit(train, epochs=2, valid_data=valid)
    assert recorder.seen[1] == order
    torch.testing.assert_close(parameters(resumed), expected, rtol=0, atol=0)


class NoisySamples(Numbered):
    """Each sample drawn with noise from torch's generator; ``slow``, slowly, so that the
    loader thread is almost always inside a ``next()``, drawing, while the steps run."""

    def __init__(self, slow: bool) -> None:
        super().__init__()
        self.slow = slow

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.slow:
            time.sleep(0.01)
        inputs, targets, number = super().__getitem__(index)
        return inputs + 0.1 * torch.randn(FEATURES), targets, number


@pytest.mark.parametrize("slow", [False, True], ids=["loaded-ahead", "loading"])
async def test_a_state_dict_taken_by_an_event_consumer_mid_fit_resumes_exactly(
    slow: bool,
) -> None:
    # It read the generators while the loader thread drew from them, and without the count of
    # the batches loaded ahead: resumed, the run ended 0.027 away from an uninterrupted one.
    # Now it holds the loader thread between two batches, as save_checkpoint does.
    def loader() -> DataLoader[Any]:
        return DataLoader(NoisySamples(slow), batch_size=2, shuffle=True)

    torch.manual_seed(5)
    uninterrupted = make_trainer(Recorder(), devices=2)
    await uninterrupted.fit(loader(), epochs=2)

    torch.manual_seed(5)
    recorder = Recorder()
    first = make_trainer(recorder, devices=2)
    taken: list[dict[str, Any]] = []
    stream = first.events()

    async def take_at_step_3() -> None:
        async for event in stream:
            if isinstance(event, StepEnded) and event.step == 3:
                taken.append(first.state_dict())  # before any await: between two steps

    async with anyio.create_task_group() as group:
        group.start_soon(take_at_step_3)
        await first.fit(loader(), epochs=2)
    assert taken[0]["batches_loaded"] is not None  # the loader's count, taken held
    torch.manual_seed(999)
    resumed = make_trainer(Recorder(), devices=2)
    resumed.load_state_dict(taken[0])
    await resumed.fit(loader(), epochs=2)
    torch.testing.assert_close(parameters(resumed), parameters(uninterrupted), rtol=0, atol=0)


async def test_a_state_dict_mid_fit_whose_loader_thread_stays_in_a_next_warns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The loader thread still inside a next() after the wait (a slow or blocked batch): the
    # state is taken as it is, and the user is told it may not resume exactly.
    from asyncddp import AsyncDDPWarning
    from asyncddp._loader import Prefetcher

    monkeypatch.setattr(Prefetcher, "hold", lambda self, timeout: False)
    trainer = make_trainer(Recorder(), devices=2)
    stream = trainer.events()
    taken: list[dict[str, Any]] = []

    async def take_at_step_1() -> None:
        async for event in stream:
            if isinstance(event, StepEnded) and event.step == 1:
                with pytest.warns(AsyncDDPWarning, match="still reading a batch") as warned:
                    taken.append(trainer.state_dict())
                assert [w.filename for w in warned] == [__file__]

    async with anyio.create_task_group() as group:
        group.start_soon(take_at_step_1)
        await trainer.fit(DataLoader(NoisySamples(False), batch_size=2, shuffle=True), epochs=1)
    assert taken[0]["global_step"] == 2


def counting_step(model: nn.Module, batch: Any) -> dict[str, Any]:
    """A loss whose "items" count varies from shard to shard, as a count of tokens does."""
    inputs, targets, indices = batch
    return {"loss": F.mse_loss(model(inputs), targets), "items": int(indices.sum()) % 5 + 1}


@pytest.mark.parametrize("at_step", [2, 3])  # mid-epoch; at an epoch's end (4 steps an epoch)
async def test_a_state_with_counted_items_resumes_exactly(at_step: int) -> None:
    # The count the next step's items are weighted against was not saved: resumed, the first
    # step scaled its gradients by another ratio, which rounds otherwise, and the run ended
    # 3e-8 away from the uninterrupted one.
    def trainer() -> Trainer:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))
        adamw = functools.partial(torch.optim.AdamW, lr=0.01)
        return Trainer(model, adamw, counting_step, devices=cpu_devices(2), progress_bar=False)

    data = DataLoader(Numbered(), batch_size=SAMPLES // 4)
    uninterrupted = trainer()
    await uninterrupted.fit(data, epochs=3)
    first = trainer()
    await fit_until_stopped(first, data, epochs=3, at_step=at_step)
    resumed = trainer()
    resumed.load_state_dict(first.state_dict())
    await resumed.fit(data, epochs=3)
    assert resumed.global_step == uninterrupted.global_step == 12
    torch.testing.assert_close(parameters(resumed), parameters(uninterrupted), rtol=0, atol=0)
