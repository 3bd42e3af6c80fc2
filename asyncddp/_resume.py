"""Where training is: the position within an epoch, RNG states, checkpoints and resuming.

A checkpoint holds the first replica's model, optimizer and LR scheduler state, and the
*position*: epoch, step, batches done in the epoch, the epoch's loss sums and item counts, the
RNG state at the epoch's start (the generators the loader owns included) and now, and the
states of the loader's generators when the last epoch ended, and how many batches the epoch's
loader had loaded. Resuming in mid-epoch replays the epoch's start, so a shuffling
``DataLoader`` draws the same order, skips the batches already trained on, and puts the
generators back as they were once the loader has loaded as many batches as it had (see
`Prefetcher`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import torch
from torch import nn

from . import _checkpoint
from ._checks import clipped, warn_user
from ._dsteps import collective
from ._epochs import EpochRecord, Epochs
from ._events import CheckpointSaved
from ._exceptions import CheckpointError, ConfigurationError
from ._jobs import Sums
from ._precision import LossScaler
from ._replica import OptimizerFactory, SchedulerFactory

__all__ = ["Resumable"]

_log = logging.getLogger("asyncddp")

#: How long a cancellation waits for a checkpoint being written, in seconds, before it is
#: raised with the write left to end in its thread (see `Resumable._write_checkpoint`).
CHECKPOINT_CANCEL_WAIT = 10.0


class Resumable(Epochs):
    """Position, checkpoints and resuming for `Trainer` (a mixin)."""

    _source: nn.Module
    _optimizer_factory: OptimizerFactory
    _scheduler_factory: SchedulerFactory | None
    _pending_state: dict[str, Any] | None
    _window: int
    _last_iterator: Callable[[], Any] | None
    _scaler: LossScaler | None
    _warned_unloadable = False  # a checkpoint resuming cannot load was warned of

    def _position(self, loaded: int | None = None) -> dict[str, Any]:
        """Where training is; ``loaded``: the batches the running epoch's loader has loaded,
        counted while it is held (see `_snapshot`)."""
        self._count_left_loading()
        return {
            "epoch": self.epoch,
            "global_step": self.global_step,
            "batches_done": self._batches_done,
            "batches_loaded": loaded if loaded is not None else self._batches_loaded,
            "epoch_rng": self._epoch_rng,
            "loader_rng": self._loader_rng,
            "epoch_trained": self._epoch_trained,
            "valid_rng": self._valid_rng,
            "epoch_sums": _sums_dict(self._epoch_sums),
            "epoch_items": dict(self._epoch_items),
            "epoch_steps": self._epoch_steps,
            "epoch_seconds": self._epoch_seconds,
            "rng": _checkpoint.capture_rng(),
            "history": [_record_dict(record) for record in self.history],
            "loss_scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "devices": [device.name for device in self.devices],
            "data_seed": self._data_seed,
            "world_size": self._batches_world,
            # What the next step's counted items are weighted against: the rounding of its
            # gradients' scaling, so a resume's step rounds as the uninterrupted run's did.
            "items_ref": self._items_ref,
        }

    def _adopt(self, state: Mapping[str, Any]) -> None:
        """Take a saved state's position and RNG now; its tensors at the next session start.
        A state that does not fit is refused first, with nothing of it taken."""
        first = self._replicas[0] if self._replicas else None
        _checkpoint.check_fits(
            state,
            first.model if first else self._source,
            first.optimizer if first else None,
            self._optimizer_factory,
            self._scheduler_factory,
        )
        # Every entry read before any is taken: one that cannot be read leaves the trainer as
        # it was (it took the position up to that entry, and not the weights, before).
        epoch = _entry(state, "epoch", int, required=True)
        global_step = _entry(state, "global_step", int, required=True)
        batches_done = _entry(state, "batches_done", int, required=True)
        # Absent from the checkpoints of earlier versions: batches_loaded, loader_rng,
        # valid_rng, epoch_steps, items_ref.
        batches_loaded = _entry(state, "batches_loaded", int)
        epoch_sums = _entry(state, "epoch_sums", lambda sums: Sums(**sums), default=Sums())
        epoch_items = _entry(state, "epoch_items", dict, default={})
        epoch_steps = _entry(state, "epoch_steps", int, default=0)
        epoch_seconds = _entry(state, "epoch_seconds", float, default=0.0)
        history = _entry(
            state, "history", lambda records: [EpochRecord(**r) for r in records], default=[]
        )
        data_seed = _entry(state, "data_seed", int)
        world = _entry(state, "world_size", int, default=1)
        items_ref = _entry(state, "items_ref", float)
        # The loss scale and the generators are taken whole or not at all: a state whose rng
        # entry fails half way (its NumPy part) had set torch's and Python's generators.
        scale = self._scaler.state_dict() if self._scaler is not None else None
        generators = _checkpoint.capture_rng()
        try:
            if self._scaler is not None and state.get("loss_scaler"):
                _entry(state, "loss_scaler", self._scaler.load_state_dict)
            if state.get("rng") is not None:
                _entry(state, "rng", _checkpoint.restore_rng)
        except CheckpointError:
            _checkpoint.restore_rng(generators)
            if self._scaler is not None and scale is not None:
                self._scaler.load_state_dict(scale)
            raise
        if not self._replicas:
            self._source.load_state_dict(state["model"])
            # The replicas are copied from the source: loading the model again as they are
            # built would undo what the user changes on trainer.model meanwhile.
            state = {**state, "model": None}
        self.epoch, self.global_step, self._batches_done = epoch, global_step, batches_done
        self._batches_loaded = batches_loaded
        self._left_loading = None  # a loader left behind counts for the position it replaces
        self._epoch_rng = state.get("epoch_rng")
        # The loader's generators stay as the loader has them without one.
        self._loader_rng = self._resumed_loader_rng = state.get("loader_rng")
        self._epoch_trained = bool(state.get("epoch_trained", False))
        self._valid_rng = state.get("valid_rng")
        self._checkpoint_owed = False  # of the state this one replaces
        self._epoch_sums, self._epoch_items = epoch_sums, epoch_items
        self._epoch_steps, self._epoch_seconds = epoch_steps, epoch_seconds
        self.history = history
        if data_seed is not None:
            self._data_seed = data_seed
        self._batches_world = world
        self._items_ref = items_ref
        self._window_open = True  # whatever was half done is undone at the next session start
        # ... but not with the buffers the replicas saved before it: the loaded state's
        # buffers replace them (a new window number matches no replica's saved copy).
        self._window += 1
        self._last_iterator = None  # the loaded position is not that iterator's
        self._pending_state = dict(state)
        if state.get("optimizer") is not None:
            # Every replica will have the same parameters and optimizer state (load_state_dict
            # loads them now; a resume, as its session starts), none a step not undone.
            self._consistent = True
            for replica in self._replicas:
                replica.kept_step = False

    async def _snapshot(self) -> dict[str, Any]:
        n = len(self.devices)
        result = await self._scheduler_run(
            self._jobs().snapshot, [True] + [False] * (n - 1), phase="checkpoint"
        )
        state: dict[str, Any] = result.outputs[0]
        loading = self._loading
        if loading is None:
            # A loader thread a stop or a cancellation left inside next() may still draw
            # random numbers: its batch and the generators are taken once it has returned.
            await self._after_left_loading()
            state.update(self._position())
            return state
        # The loader thread may be drawing random numbers for a batch ahead: held between two
        # batches, its count and the generators' state are taken together.
        async with loading.paused() as loaded:
            state.update(self._position(loaded))
        return state

    async def _save_epoch_checkpoint(self) -> None:
        assert self.checkpoint_dir is not None
        assert self._step_lock is not None
        path = self.checkpoint_dir / _checkpoint.checkpoint_name(self.epoch, self.global_step)
        async with self._step_lock:
            state = await self._snapshot()
        await self._write_checkpoint(state, path, then=self._paid)

    def _paid(self) -> None:
        self._checkpoint_owed = False

    async def _write_checkpoint(
        self,
        state: dict[str, Any],
        path: str | os.PathLike[str],
        *,
        then: Callable[[], None] | None = None,
    ) -> Path:
        """Write ``state`` to ``path`` (atomically, on a thread), then say so: a log record and
        `CheckpointSaved`, with the epoch and step the state holds; then ``then()``.

        A cancellation meanwhile waits for the write, which is said as any other, and is
        raised after it: anyio's thread gave up on a plain ``task.cancel()`` at once, and the
        file appeared later with no `CheckpointSaved`, the caller told it was not written.
        It waits `CHECKPOINT_CANCEL_WAIT` seconds at most (a write stalled on a network disk):
        a notebook's stop button cancels once, and the cell would wait for the write without
        end."""
        (written, refused), cancellation = await collective(
            _save_and_scan,
            state,
            path,
            device=torch.device("cpu"),
            name="asyncddp-checkpoint",
            after_cancel=CHECKPOINT_CANCEL_WAIT,
        )
        if refused and not self._warned_unloadable:
            self._warned_unloadable = True  # each epoch's would say it again
            warn_user(
                f"checkpoint {str(written)!r} holds {', '.join(refused)}, which "
                "torch.load(weights_only=True) does not load, so resuming from it fails (it "
                "loads tensors and plain Python values only): hold such state as tensors "
                "(return torch.as_tensor(array) from a module's get_extra_state, say), or, to "
                "resume, allow them first with torch.serialization.add_safe_globals"
            )
        _log.info("checkpoint saved: %s", written)
        self._hub.publish(CheckpointSaved(str(written), state["epoch"], state["global_step"]))
        if then is not None:
            then()
        if cancellation is not None:
            raise cancellation
        return written

    async def _resume_state(self, resume: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The state to resume from: across ranks, rank 0 reads it and sends it to every rank.
        None for ``"latest"`` with no checkpoint written yet (a fresh start)."""
        comm = self._comm
        if comm is None:
            return await self._read_checkpoint(resume)
        state = await self._read_checkpoint(resume) if comm.rank == 0 else None
        shared: dict[str, Any] | None
        shared, cancellation = await collective(comm.share, state, device=comm.device)
        if cancellation is not None:
            raise cancellation
        return shared

    async def _read_checkpoint(self, resume: str | os.PathLike[str]) -> dict[str, Any] | None:
        if str(resume) == "latest":
            if self.checkpoint_dir is None:
                raise ConfigurationError("resume='latest' needs Trainer(checkpoint_dir=...)")
            path = await anyio.to_thread.run_sync(
                _checkpoint.latest_checkpoint, self.checkpoint_dir
            )
            if path is None:
                # Not an error: a script that always resumes from the latest checkpoint must
                # be able to run the first time, before it wrote one (as Lightning's
                # ckpt_path="last"). fit warns.
                return None
        else:
            path = Path(resume)
            if str(resume) in ("last", "last.ckpt") and not path.exists():
                raise CheckpointError(
                    f"no checkpoint at {str(resume)!r}: for the newest checkpoint in "
                    "checkpoint_dir, pass resume='latest'"
                )
        return await anyio.to_thread.run_sync(_checkpoint.load, path)

    async def _check_checkpoint_dir(self) -> None:
        """Refuse a ``checkpoint_dir`` that cannot be written, before a fit trains (on rank 0,
        which writes the checkpoints), and remove what killed writes left there."""
        if self.checkpoint_dir is None or (self._comm is not None and self._comm.rank != 0):
            return
        await anyio.to_thread.run_sync(self._prepare_checkpoint_dir, self.checkpoint_dir)

    @staticmethod
    def _prepare_checkpoint_dir(folder: Path) -> None:
        _checkpoint.check_writable(folder)
        _checkpoint.remove_stale_temporaries(folder)

    async def _warn_if_checkpoints_ahead(self) -> None:
        """Warn where ``checkpoint_dir`` holds a checkpoint further on than this trainer, in a
        fit that does not resume: another run's, whose files this one would write beside and
        over, and which ``resume="latest"`` would later pick."""
        if self.checkpoint_dir is None or (self._comm is not None and self._comm.rank != 0):
            return  # across ranks, rank 0 writes the checkpoints
        newest = await anyio.to_thread.run_sync(_checkpoint.latest_checkpoint, self.checkpoint_dir)
        if newest is None:
            return
        epochs, steps = _checkpoint.position_of(newest)
        if (epochs, steps) <= (self.epoch, self.global_step):
            return
        warn_user(
            f"checkpoint_dir {str(self.checkpoint_dir)!r} holds a checkpoint further on than "
            f"this trainer ({newest.name}: {epochs} epoch{'' if epochs == 1 else 's'} and "
            f"{steps} step{'' if steps == 1 else 's'} done), from "
            "another run, most likely: this fit writes its checkpoints beside it, replacing "
            "those of the same name, and resume='latest' would later pick that one. Pass "
            "resume='latest' to go on from it, or give this run a checkpoint_dir of its own",
        )


def _entry(
    state: Mapping[str, Any],
    name: str,
    read: Callable[[Any], Any],
    *,
    default: Any = None,
    required: bool = False,
) -> Any:
    """``read(state[name])``, or ``default`` where the entry is absent or ``None`` (unless
    ``required``); a `CheckpointError` naming the entry where ``read`` cannot take it (a
    state edited by hand, ``state["global_step"] = None``)."""
    value = state[name] if required else state.get(name)
    if value is None and not required:
        return default
    try:
        return read(value)
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as error:
        shown = clipped(repr(value), 60)
        raise CheckpointError(
            f"the state's {name!r} entry cannot be read ({type(error).__name__}: {error}): it "
            f"holds {shown}. The trainer's position, weights and optimizer are as they were"
        ) from error


def _sums_dict(sums: Sums) -> dict[str, Any]:
    state = dataclasses.asdict(sums)
    if not sums.counted:
        del state["counted"]  # as before counts existed: readable by versions without them
    if all(count == sums.items for count in sums.metric_items.values()):
        del state["metric_items"]  # every metric over every item: as before, likewise
    return state


def _record_dict(record: EpochRecord) -> dict[str, Any]:
    return {
        **dataclasses.asdict(record),
        "train_metrics": dict(record.train_metrics),
        "valid_metrics": dict(record.valid_metrics) if record.valid_metrics is not None else None,
    }


def _save_and_scan(state: dict[str, Any], path: str | os.PathLike[str]) -> tuple[Path, list[str]]:
    """Write the checkpoint, then name what in it a resume's ``torch.load(weights_only=True)``
    would refuse (cheap: the pickled structure only)."""
    written = _checkpoint.save(state, path)
    return written, _checkpoint.refused_objects(written)
