"""Checkpoints: written atomically, read back with a clear error when they cannot be.

A checkpoint is written to a temporary file in the target folder, flushed to disk, then renamed
over the target (``os.replace`` is atomic on POSIX and Windows), so a process killed while
writing leaves the previous checkpoint whole. It is read with ``torch.load(weights_only=True)``:
tensors, numbers, strings and containers only, no arbitrary code.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import glob
import logging
import os
import pickle
import random
import re
import secrets
import tempfile
import time
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from ._checks import clipped, warn_user
from ._exceptions import CheckpointError, ConfigurationError

_log = logging.getLogger("asyncddp")

__all__ = [
    "capture_loader_rng",
    "capture_rng",
    "check_fits",
    "check_optimizer_fits",
    "checkpoint_name",
    "draws_base_seed",
    "latest_checkpoint",
    "load",
    "restore_loader_rng",
    "restore_rng",
    "save",
]

FORMAT = "asyncddp-checkpoint"
VERSION = 1
_NAME = re.compile(r"^epoch(\d+)-step(\d+)\.ckpt$")


def checkpoint_name(epoch: int, step: int) -> str:
    """The file name fit uses for a checkpoint: ``epoch0003-step000120.ckpt``."""
    return f"epoch{epoch:04d}-step{step:06d}.ckpt"


def save(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``state`` to ``path`` atomically (temporary file, fsync, rename)."""
    target = Path(path).expanduser()
    try:
        if target.is_dir():
            raise CheckpointError(
                f"{str(target)!r} is a folder, and a checkpoint is a file: give the path of a "
                "file to write (none, to write one named for the position into checkpoint_dir)"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries_of(target)
        fd, temporary = _create_temporary(target)
    except OSError as error:
        raise _unwritable(target, error) from error
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save({"format": FORMAT, "version": VERSION, **state}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException as error:
        with contextlib.suppress(OSError):  # a file system gone read-only: the cause stands
            Path(temporary).unlink(missing_ok=True)
        # torch's writer reports a failed write as a RuntimeError ("unexpected pos 64 vs 0",
        # "file write failed"), the file system as an OSError (a full disk): neither named
        # the checkpoint, and neither was an AsyncDDPError.
        if isinstance(error, (OSError, RuntimeError)):
            raise _unwritable(target, error) from error
        raise
    _fsync_folder(target.parent)
    return target


def _unwritable(target: Path, error: BaseException) -> CheckpointError:
    """The checkpoint at ``target`` could not be written (the file before it, if any, is
    left as it was)."""
    reason = f"{type(error).__name__}: {error}"
    if isinstance(error, (FileExistsError, NotADirectoryError)):
        reason += " (a file where a folder of the path should be?)"
    elif _a_failed_write(error) or getattr(error, "errno", None) in (
        errno.ENOSPC,
        errno.EFBIG,
        getattr(errno, "EDQUOT", errno.ENOSPC),  # not on every system
    ):
        reason += " (a full disk, a quota, or a limit on file sizes?)"
    return CheckpointError(
        f"the checkpoint {str(target)!r} could not be written, {reason}; a checkpoint there "
        "before it is left as it was, and so is the training state: save it again once "
        "the cause is mended, or elsewhere"
    )


def _a_failed_write(error: BaseException) -> bool:
    """Whether ``error`` is torch's writer saying a write failed ("unexpected pos 64 vs 0",
    "file write failed"), not some other RuntimeError of ``torch.save`` (a tensor it cannot
    save), for which a full disk is no hint."""
    message = str(error)
    return isinstance(error, RuntimeError) and ("unexpected pos" in message or "write" in message)


def _create_temporary(target: Path) -> tuple[int, str]:
    """A new file beside ``target``, ``.NAME.XXXXXXXX.tmp``, open for writing: created with
    mode 0o666 less the umask, as ``torch.save`` or ``open()`` would (``tempfile.mkstemp``'s
    0o600 would stay the checkpoint's mode through the rename: unreadable by a serving
    process of another user)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    while True:
        temporary = str(target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(temporary, flags, 0o666), temporary
        except FileExistsError:
            continue


def refused_objects(path: str | os.PathLike[str]) -> list[str]:
    """The classes and functions in the checkpoint at ``path`` that ``torch.load(weights_only=
    True)`` refuses, ``load`` with it (a NumPy array in a module's extra state, say): those not
    allowed by torch or by ``torch.serialization.add_safe_globals``. Reads the pickled
    structure only, not the tensors' data."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # a torch without it, or a file it cannot scan: load says
        return []


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by `save`, onto the CPU.

    Raises:
        CheckpointError: the file is missing, truncated, corrupt, or not an asyncddp checkpoint.
    """
    source = Path(path).expanduser()
    if source.is_dir():
        raise CheckpointError(
            f"{str(source)!r} is a folder, not a checkpoint: give a checkpoint file in it, or "
            "resume='latest' for the newest one in the Trainer's checkpoint_dir"
        )
    if not source.is_file():
        raise CheckpointError(f"no checkpoint at {str(source)!r}")
    _check_records(source)
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = refused_objects(source)  # none in a truncated or corrupt file
        if not refused:
            raise _unreadable(source, exc) from exc
        raise CheckpointError(
            f"checkpoint {str(source)!r} holds {', '.join(refused)}, which "
            "torch.load(weights_only=True) does not load (it loads tensors and plain Python "
            "values only). If you trust the file, allow them before resuming: "
            "torch.serialization.add_safe_globals([...]) with those classes and functions "
            "(torch's error, the cause, shows how)"
        ) from exc
    except Exception as exc:
        raise _unreadable(source, exc) from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        weights = (
            isinstance(state, dict)
            and bool(state)
            and all(isinstance(value, torch.Tensor) for value in state.values())
        )
        raise CheckpointError(
            f"{str(source)!r} is not an asyncddp checkpoint"
            + (
                ": it holds a model's weights (a state_dict()), which load with "
                "trainer.model.load_state_dict(torch.load(path)) before the fit"
                if weights
                else ""
            )
        )
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {str(source)!r} has format version {state.get('version')!r}; this "
            f"asyncddp reads version {VERSION}"
        )
    return state


def _check_records(source: Path) -> None:
    """Refuse a checkpoint whose records do not match the CRC-32 torch's writer stored for
    each: torch's reader does not look, and a bit flipped on a disk or in a copy loaded
    without a word (a weight of -0.043687 read as -0.043932, or as -1.49e37, in a trial). A
    file torch wrote without them (``compute_crc32`` off: every one 0) is not checked; one that
    is not a zip archive is left to ``torch.load`` to refuse. About half a load's time more
    (0.08 s for 200 MB read from the page cache, against 0.16 s to load it; from a cold or
    network disk, one more read of the whole file)."""
    try:
        with zipfile.ZipFile(source) as archive:
            if all(info.CRC == 0 for info in archive.infolist()):
                return
            bad = archive.testzip()
    except Exception:  # truncated, not a zip, a header zipfile cannot read (but torch may)
        return  # torch.load's error, if any, says so, named
    if bad is not None:
        raise CheckpointError(
            f"checkpoint {str(source)!r} is corrupt: its record {bad!r} does not match the "
            "CRC-32 written with it (a bit changed on the disk, or in a copy). Resume from an "
            "earlier checkpoint, or copy this one again from where it was written"
        )


def _not_a_state(given: object) -> CheckpointError:
    path = isinstance(given, (str, os.PathLike))
    return CheckpointError(
        f"a trainer state is a dict (from Trainer.state_dict() or a checkpoint), "
        f"not {type(given).__name__}"
        + (
            f" {str(given)!r}: to go on from a checkpoint file, fit(resume=path), or "
            "load_state_dict(torch.load(path))"
            if path
            else ""
        )
    )


def _unreadable(source: Path, exc: Exception) -> CheckpointError:
    """The error for a file ``torch.load`` failed on: not a file ``torch.save`` wrote at all
    (a text file, a Git LFS pointer), or one truncated or corrupt. Torch's own message, often
    many lines (with advice on ``weights_only`` that does not apply), is the cause's alone."""
    try:
        with open(source, "rb") as file:
            head = file.read(64)
    except OSError:
        head = b"PK"
    # torch.save writes a zip archive; torch's legacy format is a pickle (protocol 2 and up).
    # An empty file, or one cut inside the zip's first bytes, is a truncated one.
    if not (b"PK\x03\x04".startswith(head[:4]) or head.startswith(b"\x80")):
        lfs = head.startswith(b"version https://git-lfs")
        return CheckpointError(
            f"{str(source)!r} is not a checkpoint: not a file torch.save wrote (it begins "
            f"{head[:24]!r})"
            + ("; it is a Git LFS pointer: fetch the file itself, git lfs pull" if lfs else "")
        )
    text = str(exc).strip()
    first = clipped(text.splitlines()[0], 160) if text else ""
    return CheckpointError(
        f"checkpoint {str(source)!r} cannot be read; it is truncated or corrupt "
        f"({type(exc).__name__}{': ' + first if first else ''}). Resume from an earlier "
        "checkpoint"
    )


#: The entries resuming reads from every state (``Trainer.state_dict()``, a checkpoint).
REQUIRED = ("model", "epoch", "global_step", "batches_done")


def check_fits(
    state: Mapping[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    make_optimizer: Callable[[Any], Any],
    make_scheduler: Callable[[Any], Any] | None,
) -> None:
    """Refuse, before anything of it is taken, a state that cannot load into this trainer.

    A state lacking an entry every state has, or whose model, optimizer or LR scheduler state
    does not load into this trainer's, raises `CheckpointError` and leaves the trainer
    as it was: a load that failed half way would leave the position of one state and the
    weights of another.

    Each is tried for real, by torch, on a probe with its tensors on the meta device (shapes
    only, no memory): a copy of ``model`` (``trainer.model``), an optimizer the factory builds
    over it, a scheduler the factory builds over that optimizer. So whatever torch's own loads
    accept passes (load hooks that rename keys, lazy modules, extra state, an optimizer that
    wraps another), and what they fail on half way is refused before it touches the trainer.
    Torch takes another kind's state without a word where nothing it reads is missing (Adam's
    into SGD, StepLR's into CosineAnnealingLR): a probe left without a setting the factory gave
    it (a group's ``momentum``, the scheduler's ``T_max``, also in the schedulers a
    SequentialLR holds) is refused too. Once a fit has built ``optimizer`` (the first
    replica's), the state's parameter groups are checked against its groups, which are fixed
    then, and the probe optimizer is built over the parameters it holds (a parameter frozen
    since among them). A model that cannot be copied has only its shapes checked; a factory
    that raises on meta tensors leaves the optimizer's groups to the check at the next session
    start (`check_optimizer_fits`) and the scheduler's state unchecked.
    """
    if not isinstance(state, Mapping):
        raise _not_a_state(state)
    missing = [key for key in REQUIRED if key not in state]
    if missing:
        raise CheckpointError(
            f"the state has no {', '.join(repr(key) for key in missing)}: it is not from "
            "Trainer.state_dict() or an asyncddp checkpoint (a model's own state_dict() "
            "loads with trainer.model.load_state_dict())"
        )
    probe = on_meta(model)
    try:
        if probe is None:
            _check_shapes(state["model"], model)
        else:
            with warnings.catch_warnings():  # "copying ... to a meta parameter is a no-op"
                warnings.simplefilter("ignore", UserWarning)
                probe.load_state_dict(state["model"])
    except Exception as error:
        raise CheckpointError(
            f"the state's model does not load into trainer.model: {error}"
        ) from error
    saved_optimizer = state.get("optimizer")
    saved_scheduler = state.get("lr_scheduler")
    # The user's factories run for a probe only where one is needed.
    needed = saved_optimizer is not None or (
        saved_scheduler is not None and make_scheduler is not None
    )
    probe_optimizer = (
        made(make_optimizer, _optimized(model, probe, optimizer))
        if probe is not None and needed
        else None
    )
    if not isinstance(probe_optimizer, torch.optim.Optimizer):
        probe_optimizer = None
    if saved_optimizer is not None:
        if optimizer is not None:
            check_optimizer_fits(saved_optimizer, optimizer)
        if probe_optimizer is not None:
            factory_settings = [dict(group) for group in probe_optimizer.param_groups]
            _try_load(probe_optimizer, saved_optimizer, "optimizer")
            loaded = probe_optimizer.param_groups
            _check_kind(
                "optimizer",
                {
                    key
                    for mine, theirs in zip(factory_settings, loaded, strict=True)
                    for key in set(mine) - set(theirs)
                },
            )
            _warn_if_settings_differ(
                factory_settings, loaded, scheduled=saved_scheduler is not None
            )
    _warn_if_scheduler_missing(state, saved_scheduler, make_scheduler)
    if saved_scheduler is not None and make_scheduler is not None and probe_optimizer is not None:
        probe_scheduler = made(make_scheduler, probe_optimizer)
        if probe_scheduler is not None:  # load_state_dict may pop entries: a copy (it is small)
            fresh_state = probe_scheduler.state_dict()
            _try_load(probe_scheduler, copy.deepcopy(saved_scheduler), "LR scheduler")
            _check_kind("LR scheduler", _missing_settings(fresh_state, saved_scheduler))


def _warn_if_scheduler_missing(
    state: Mapping[str, Any], saved: Any, make_scheduler: Callable[[Any], Any] | None
) -> None:
    """Warn of a state trained with an LR scheduler loaded by a trainer without one, or the
    other way round: nothing in either is refused, and the learning rates then follow
    another schedule than the saved run's, without a word (a factory forgotten on resume)."""
    if saved is not None and make_scheduler is None:
        warn_user(
            "the state holds an LR scheduler's state, and this trainer has no lr_scheduler: "
            "training goes on at the learning rates the state left, and the saved run's "
            "schedule goes no further. Pass the lr_scheduler the state was trained with"
        )
    elif saved is None and make_scheduler is not None and int(state["global_step"]) > 0:
        warn_user(
            "the state holds no LR scheduler's state (its run had no lr_scheduler), so this "
            f"trainer's lr_scheduler starts its schedule at its beginning from the state's "
            f"step {int(state['global_step'])} (epoch {int(state['epoch'])}) on, as if training "
            "began there"
        )


def _optimized(
    model: nn.Module, probe: nn.Module, optimizer: torch.optim.Optimizer | None
) -> list[torch.Tensor]:
    """The probe's counterparts of the parameters the factory was given: those ``optimizer``
    holds once it is built (a parameter frozen since is still among them), else those that
    train now, in the model's order either way."""
    if optimizer is None:
        return [p for p in probe.parameters() if p.requires_grad]
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    pairs = zip(model.parameters(), probe.parameters(), strict=True)
    return [mine for real, mine in pairs if id(real) in held]


def _missing_settings(fresh: Any, saved: Any) -> set[str]:
    """The public entries of an LR scheduler's fresh ``state_dict()`` that ``saved`` lacks, also
    in the schedulers it holds (SequentialLR's and ChainedScheduler's ``_schedulers``).
    Private attributes come and go between torch versions; public ones name the scheduler's
    own settings (StepLR's ``step_size``, CosineAnnealingLR's ``T_max``)."""
    if not isinstance(fresh, Mapping) or not isinstance(saved, Mapping):
        return set()
    missing = {key for key in fresh if not key.startswith("_") and key not in saved}
    inner, saved_inner = fresh.get("_schedulers"), saved.get("_schedulers")
    if isinstance(inner, list) and isinstance(saved_inner, list):
        if len(inner) != len(saved_inner):
            raise CheckpointError(
                f"the state's LR scheduler does not load into this trainer's: it holds "
                f"{len(saved_inner)} schedulers, this trainer's {len(inner)}. Load a state "
                "saved with the same LR scheduler factory, or build the Trainer with that factory"
            )
        for mine, theirs in zip(inner, saved_inner, strict=True):
            missing |= _missing_settings(mine, theirs)
    return missing


#: Settings an LR scheduler changes as it steps (OneCycleLR and CyclicLR cycle the momentum,
#: and set the learning rate from their own settings): the state's differ from the factory's
#: for that reason alone.
_SCHEDULED = ("lr", "initial_lr", "momentum", "betas")


def _warn_if_settings_differ(
    factory: list[dict[str, Any]], loaded: list[dict[str, Any]], *, scheduled: bool
) -> None:
    """Warn where the state's optimizer settings (its parameter groups' ``lr``,
    ``weight_decay``, ...) differ from those the optimizer factory gives: loading takes the
    state's, as torch's ``Optimizer.load_state_dict`` does, and a user who resumes with another
    learning rate in the factory would otherwise train on with the old one without a word.
    With an LR scheduler in the state, the settings schedulers change are left out."""
    differ: dict[str, tuple[Any, Any]] = {}
    for mine, theirs in zip(factory, loaded, strict=True):
        for key, value in mine.items():
            if key == "params" or key not in theirs or (scheduled and key in _SCHEDULED):
                continue
            if not _same_setting(value, theirs[key]):
                differ.setdefault(key, (theirs[key], value))
    if differ:
        listed = ", ".join(
            f"{key} {saved!r} (the factory's {mine!r})" for key, (saved, mine) in differ.items()
        )
        warn_user(
            "the state's optimizer settings replace those the optimizer factory gives, as "
            f"torch's Optimizer.load_state_dict does: it trains on with {listed}. To train "
            "on with the factory's, set them in the state too before loading it "
            "(state['optimizer']['param_groups'][i][name] = value, then "
            "trainer.load_state_dict(state)); to keep the state's, give them to the factory "
            "as well: either way the two agree, and this warning goes (see training.md, "
            "Resuming with other settings)"
        )


def _same_setting(mine: Any, saved: Any) -> bool:
    try:
        if isinstance(mine, torch.Tensor) or isinstance(saved, torch.Tensor):
            return bool(torch.as_tensor(mine).cpu().eq(torch.as_tensor(saved).cpu()).all())
        return bool(mine == saved)
    except Exception:
        return True  # not comparable: say nothing rather than something wrong


def _check_kind(what: str, missing: set[str]) -> None:
    """Refuse a state that torch loaded without a word but that lacks settings this trainer's
    optimizer (in a parameter group) or LR scheduler has: it was saved by another kind (SGD's
    state into Adam's, StepLR's into CosineAnnealingLR's), and training would fail on them
    later, or go on with the wrong schedule."""
    if missing:
        names = ", ".join(repr(key) for key in sorted(missing))
        raise CheckpointError(
            f"the state's {what} does not load into this trainer's: it has no {names}, which "
            f"this trainer's {what} has, so it was saved with another kind of {what}. Load a "
            f"state saved with the same {what} factory, or build the Trainer with that factory"
        )


def made(factory: Callable[[Any], Any], argument: Any) -> Any:
    """``factory(argument)`` for a probe, or ``None`` where it will not build one."""
    try:
        return factory(argument)
    except Exception:
        return None


def _try_load(probe: Any, saved: Any, what: str) -> None:
    try:
        probe.load_state_dict(saved)
    except Exception as error:
        detail = (
            f"it has no {error} where this trainer's {what} reads one, so it was saved with "
            f"another kind of {what}"
            if isinstance(error, KeyError)
            else str(error)
        )
        raise CheckpointError(
            f"the state's {what} does not load into this trainer's: {detail}"
        ) from error


def _check_shapes(saved: Any, model: nn.Module) -> None:
    """For a model with no meta copy: the state's tensors have the shapes of the model's
    (keys are left to the load, whose hooks may rename them)."""
    own = model.state_dict()
    for key, value in saved.items():
        mine = own.get(key)
        if not isinstance(value, torch.Tensor) or not isinstance(mine, torch.Tensor):
            continue
        if not nn.parameter.is_lazy(mine) and value.shape != mine.shape:
            raise CheckpointError(
                f"the state's model does not load into trainer.model: {key} is "
                f"{tuple(value.shape)} in the state, {tuple(mine.shape)} in the model"
            )


def check_optimizer_fits(saved: Any, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a saved optimizer state whose parameter groups are not ``optimizer``'s, as
    ``Optimizer.load_state_dict`` would (before it changes anything)."""
    try:
        sizes = [len(group["params"]) for group in saved["param_groups"]]
    except (KeyError, TypeError):
        raise CheckpointError(
            "the state's optimizer is not an optimizer's state_dict() (it has no "
            "param_groups, each with its params)"
        ) from None
    mine = [len(group["params"]) for group in optimizer.param_groups]
    if sizes != mine:
        raise CheckpointError(
            f"the state's optimizer does not load into this trainer's: parameter groups of "
            f"{sizes} parameters in the state, {mine} in the trainer's optimizer. Load a state "
            "saved with the same optimizer factory, or build the Trainer with that factory"
        )


def on_meta(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` whose parameters, buffers and tensor attributes are empty tensors
    on the meta device, the parameters with the attributes set on them (as the replicas have
    them, see ``_replica.carry_parameter_extras``); ``None`` for a model that cannot be copied
    (a lock among its attributes, say)."""
    memo: dict[int, Any] = {}
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():  # a plain tensor attribute would be copied for real
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        if id(tensor) in memo or nn.parameter.is_lazy(tensor):
            continue  # a lazy module's has no data to leave behind
        meta = torch.empty_like(tensor, device="meta")
        if isinstance(tensor, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
            vars(meta).update(vars(tensor))  # an optimizer factory may group by them
        memo[id(tensor)] = meta
    try:
        return copy.deepcopy(model, memo)
    except Exception:
        return None


def fresh_states(
    model: nn.Module,
    make_optimizer: Callable[[Any], Any],
    make_scheduler: Callable[[Any], Any] | None,
) -> tuple[Any, Any]:
    """The ``state_dict()`` of the optimizer the factory builds over ``model``'s trainable
    parameters, and of the LR scheduler over that, before any step: what a trainer's state
    holds before its first fit has built them, so that loading it later sets them back to their
    start (Adam's moments emptied, the schedule's first rate). Built over a probe (`on_meta`):
    no memory, the model untouched; an optimizer that makes its state as it is built
    (Adagrad's sums) would hold the probe's empty tensors, so it is built over the model's own
    parameters instead (its state's memory, for a moment; the parameters are not written).
    ``(None, None)`` where they cannot be built (a factory that raises)."""
    probe = on_meta(model)
    if probe is not None:
        states = _fresh_states(probe, make_optimizer, make_scheduler)
        if states is not None and not _holds_meta(states):
            return states
    states = _fresh_states(model, make_optimizer, make_scheduler)
    return states if states is not None else (None, None)


def _fresh_states(
    model: nn.Module,
    make_optimizer: Callable[[Any], Any],
    make_scheduler: Callable[[Any], Any] | None,
) -> tuple[Any, Any] | None:
    optimizer = made(make_optimizer, [p for p in model.parameters() if p.requires_grad])
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    scheduler = made(make_scheduler, optimizer) if make_scheduler is not None else None
    if make_scheduler is not None and scheduler is None:
        return None
    try:
        return (
            copy.deepcopy(optimizer.state_dict()),
            copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
        )
    except Exception:
        return None


def _holds_meta(value: Any) -> bool:
    """Whether ``value`` (a state dict: dicts, lists and tuples) holds a meta tensor."""
    if isinstance(value, torch.Tensor):
        return value.is_meta
    if isinstance(value, Mapping):
        return any(_holds_meta(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_meta(item) for item in value)
    return False


def position_of(path: Path) -> tuple[int, int]:
    """The epochs and optimizer steps done that a checkpoint's name (`checkpoint_name`) says."""
    match = _NAME.match(path.name)
    assert match is not None, path
    return int(match[1]), int(match[2])


def latest_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """The checkpoint in ``folder`` with the highest epoch and step, among those named as
    `checkpoint_name` names them; None where there is none yet, or no folder. A file there is
    refused (`ConfigurationError`)."""
    found: list[tuple[int, int, Path]] = []
    root = Path(folder)
    if not root.is_dir():
        if root.exists():
            raise ConfigurationError(
                f"checkpoint_dir {str(root)!r} is a file, not a folder: give a folder"
            )
        return None
    for entry in root.iterdir():
        match = _NAME.match(entry.name)
        if match and entry.is_file():
            found.append((int(match[1]), int(match[2]), entry))
    return max(found)[2] if found else None


def check_writable(folder: Path) -> None:
    """Make ``folder`` (and its parents) and write a file there, so that a folder checkpoints
    cannot be written to fails before training rather than after an epoch of it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".asyncddp-write-check.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise CheckpointError(
            f"checkpoint_dir {str(folder)!r} cannot be written ({type(exc).__name__}: "
            f"{exc.strerror or exc}): fit writes a checkpoint there after every epoch. Give a "
            "folder you can write to, or checkpoint_dir=None for no checkpoints"
        ) from exc


#: A temporary file `save` writes, ``.NAME.XXXXXXXX.tmp`` (`_create_temporary`'s random part,
#: hex, as ``tempfile.mkstemp``'s in earlier versions, has no dot); a killed process leaves it.
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.\w+\.tmp$")
#: Seconds since its last write after which such a file is taken as left by a killed write: no
#: live writer leaves one unwritten so long (torch.save writes it through, then fsyncs).
STALE_TEMPORARY = 600.0


def _remove_stale_temporaries_of(target: Path) -> None:
    """Remove the temporary files that killed writes of ``target`` left beside it (see
    `STALE_TEMPORARY`): a path of the user's own (``save_checkpoint("now.ckpt")``), which
    `remove_stale_temporaries` does not look for, is written again and again."""
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
            match = _TEMPORARY.match(entry.name)
            if match and match["name"] == target.name:
                _remove_if_stale(entry, now)


def remove_stale_temporaries(folder: Path) -> None:
    """Remove the temporary files of checkpoints fit names (`checkpoint_name`) that killed
    writes left in ``folder``: hidden, and each as large as a checkpoint (see
    `STALE_TEMPORARY`)."""
    now = time.time()
    with contextlib.suppress(OSError):  # a folder that cannot be listed: nothing to tidy
        for entry in folder.iterdir():
            match = _TEMPORARY.match(entry.name)
            if match and _NAME.match(match["name"]):
                _remove_if_stale(entry, now)


def _remove_if_stale(entry: Path, now: float) -> None:
    """Remove ``entry``, a checkpoint's temporary file, if no write touched it for
    `STALE_TEMPORARY` seconds."""
    with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
        if entry.is_file() and now - entry.stat().st_mtime > STALE_TEMPORARY:
            entry.unlink()
            _log.info("removed %s, a checkpoint write a killed process left", entry)


#: Where a loader keeps generators of its own: ``DataLoader(generator=...)`` (which draws the
#: workers' base seed, and which ``shuffle=True`` hands to its ``RandomSampler``), or a sampler's.
_LOADER_GENERATORS = (
    ("generator",),
    ("sampler", "generator"),
    ("batch_sampler", "generator"),
    ("batch_sampler", "sampler", "generator"),
)


def capture_rng(data: object = None) -> dict[str, Any]:
    """The state of every random number generator training may draw from: torch's, Python's
    and NumPy's global ones, and those ``data`` (a loader) owns (see
    `capture_loader_rng`)."""
    numpy_state = cast(tuple[Any, ...], np.random.get_state(legacy=True))
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        # As plain values, so that the checkpoint loads with weights_only=True.
        "numpy": [numpy_state[0], numpy_state[1].tolist(), *numpy_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    if data is not None:
        state["loaders"] = capture_loader_rng(data)
    return state


def restore_rng(state: dict[str, Any], data: object = None) -> None:
    """Put every generator back in the state `capture_rng` saw, ``data``'s own too
    (a state saved without them, by an earlier version, leaves them as they are)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        # One state a GPU that was visible when it was saved: a machine that shows fewer (a
        # resume on another node, another CUDA_VISIBLE_DEVICES) takes those it has, where
        # torch would fail on the first it lacks, and every later CUDA call of the process
        # with it (the call is queued until CUDA starts).
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])
    if data is not None and state.get("loaders"):
        restore_loader_rng(data, state["loaders"])


def capture_loader_rng(data: object) -> dict[str, torch.Tensor]:
    """The states of the ``torch.Generator`` objects ``data`` (a loader) owns, by where they
    are: ``"generator"``, ``"sampler.generator"``, ``"batch_sampler.generator"`` and
    ``"batch_sampler.sampler.generator"``. A shuffling loader given a generator draws its order
    from it, not from torch's global generator."""
    return {
        ".".join(path): generator.get_state()
        for path in _LOADER_GENERATORS
        if isinstance(generator := _find(data, path), torch.Generator)
    }


def restore_loader_rng(data: object, states: dict[str, torch.Tensor]) -> None:
    """Put ``data``'s generators back in the states `capture_loader_rng` saw (by where
    they are; a generator ``data`` has at no saved place is left as it is)."""
    for path in _LOADER_GENERATORS:
        state = states.get(".".join(path))
        generator = _find(data, path)
        if state is not None and isinstance(generator, torch.Generator):
            generator.set_state(state)


def draws_base_seed(data: object) -> bool | None:
    """Whether ``iter(data)`` makes a new ``DataLoader`` iterator, which draws its workers' base
    seed (from the loader's generator, or torch's) before the sampler draws the order; None for
    data that is not a ``DataLoader``. With persistent workers, only the loader's first
    ``iter()`` makes one; later ones reset it and draw only the order."""
    if not isinstance(data, DataLoader):
        return None
    persistent = data.persistent_workers and data.num_workers > 0
    return not (persistent and data._iterator is not None)


def _find(data: object, path: tuple[str, ...]) -> object:
    for name in path:
        data = getattr(data, name, None)
    return data


def _fsync_folder(folder: Path) -> None:
    # Makes the rename itself durable; not possible (nor needed) on every platform.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
