"""One device's replica: its model, optimizer, LR scheduler, gradients and backups.

Everything here runs on that device's worker thread, never on the event loop.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import numbers
import operator
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeAlias, cast

import numpy as np
import torch
from torch import nn
from typing_extensions import TypeVar

from ._checks import first_names, warn_user
from ._devices import Device
from ._exceptions import ConfigurationError, StepOutputError
from ._sync import FlatGrads, StepBackup, grad_layout, reachable
from ._worker import current_worker

__all__ = [
    "OptimizerFactory",
    "Replica",
    "SchedulerFactory",
    "StepFunction",
    "build_replica",
    "carry_parameter_extras",
    "check_rebuilt",
    "has_sparse_gradients",
    "lives_on",
    "loss_and_metrics",
    "group_layout",
    "mirror",
    "move_to",
]

#: The class of a trainer's model (``Trainer[MyNet]``); a plain ``Trainer`` is a
#: ``Trainer[nn.Module]``, and takes any trainer.
M = TypeVar("M", bound=nn.Module, default=nn.Module, covariant=True)

StepFunction: TypeAlias = Callable[[M, Any], torch.Tensor | Mapping[str, Any]]
"""What `Trainer` takes as ``step`` (and ``valid_step``): ``step(model, batch)``, called with a
device's replica and its share of the batch, returns the loss (a scalar tensor, the mean over
the share), or a mapping with ``"loss"``, optionally ``"items"`` (how many items the loss is the
mean over) and further metrics. ``StepFunction[MyNet]`` takes a ``MyNet`` (replicas are copies
of the trainer's model, of its class), so a step may be annotated ``def step(model: MyNet,
batch)``; a plain ``StepFunction`` takes any ``nn.Module``."""

OptimizerFactory: TypeAlias = Callable[[Any], torch.optim.Optimizer]
"""What `Trainer` takes as ``optimizer``: called once per replica with the list of that
replica's trainable parameters, it returns the optimizer that steps them, as
``functools.partial(torch.optim.SGD, lr=0.1)`` does."""

SchedulerFactory: TypeAlias = Callable[[torch.optim.Optimizer], Any]
"""What `Trainer` takes as ``lr_scheduler``: called once per replica with its optimizer, it
returns the LR scheduler of that optimizer, as
``functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10)`` does."""


class Replica:
    """A device's model, optimizer, LR scheduler and gradients (`FlatGrads`)."""

    def __init__(
        self,
        device: Device,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
    ) -> None:
        self.device = device
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Every parameter as built, frozen ones too: a parameter added, removed or replaced
        # since cannot be carried over to the other replicas or their optimizers (check_rebuilt).
        self.built_params = tuple(model.parameters())
        self.built_names = tuple(name for name, _ in model.named_parameters())
        self.built_modules = sum(1 for _ in model.modules())
        self.buffer_slots = BufferSlots(model)
        #: The modules' own attributes as the last call left them (the first replica's: what
        #: changed since was the user's doing, `attribute_changes`).
        self.module_attrs = attribute_snapshot(model)
        #: How many times the step ran on this replica (see `settle_snapshots`).
        self.forwards = 0
        self.built_layouts = [_layout(p) for p in self.built_params]
        # How each one's gradient lies in the flat buffers (`grad_layout`), alike on every
        # replica: a memory format changed since on the first alone would sum mismatched
        # elements (check_rebuilt).
        self.built_grad_layouts = [grad_layout(p) for p in self.built_params]
        self.grads = FlatGrads(self.params, 1, 0, loose=True)  # until regroup() says
        self.backup = StepBackup()
        #: The optimizer step (by apply id) this replica took and may have to undo.
        self.stepped_at: int | None = None
        #: Whether an undo found this replica's optimizer step taken and nothing to restore
        #: (``atomic_steps=False``): it holds a step the trainer did not count.
        self.kept_step = False
        #: The learning rate of the last optimizer step, before its LR scheduler stepped.
        self.stepped_lr: float | None = None
        # Buffers (BatchNorm statistics) as the open window found them, slot by slot, to undo
        # its forwards, and that window's number (see TrainWork.opens_window).
        self.buffer_backup: list[torch.Tensor | None] | None = None
        self._backed_up: list[int | None] = []  # id() of the tensors the backup copied
        self.buffers_saved_for: int | None = None
        # Which parameters got a gradient in the open window: one that no device used is left
        # out of the optimizer step, as in a plain loop (where its .grad stays None). The hooks
        # hold the flags alone: a hook holding the replica would make a cycle (parameter, hook,
        # replica, model, parameter) that the garbage collector cannot see through torch's
        # hooks, and every replica, its optimizer state and the model would outlive the trainer.
        self._used = _UsedFlags(len(self.params))
        for index, param in enumerate(self.params):
            hook = functools.partial(_UsedFlags.mark, self._used, index)
            param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The model's buffers as they are now, as ``model.buffers()`` lists them: read again
        each time (as DDP reads them before each broadcast), since a module may assign a new
        tensor to one in its forward (``self.mean = 0.9 * self.mean + 0.1 * x.mean(0)``),
        and a list kept from before would sync and restore a tensor the module no longer
        holds."""
        return self.buffer_slots.tensors()

    def take_buffers(self, first: Replica) -> None:
        """``first``'s buffers into this replica's, slot by slot: copied in place where they
        have the same shape and dtype, else a copy of ``first``'s put in the slot (a cache the
        forward made or grew; on this replica's device, or where ``first``'s is if that is
        not ``first``'s device: a buffer kept on the CPU); ``None`` where ``first`` holds
        none."""
        home, mine = first.device.torch_device, self.device.torch_device
        self.buffer_slots.put(
            first.buffer_slots.read(),
            lambda value: mine if value.device == home else value.device,
        )

    def restore_buffers(self) -> None:
        """Put the buffers back as `open_window` kept them (into the slot's own tensor where it
        is the same shape and dtype, else a copy of the kept one in the slot)."""
        backup = self.buffer_backup
        assert backup is not None
        self.buffer_slots.put(backup, lambda value: value.device)

    @property
    def used(self) -> list[bool]:
        return self._used.flags

    @used.setter
    def used(self, flags: list[bool]) -> None:
        self._used.flags = flags

    def claim_gradients(self) -> int:
        """Take the calling thread (this replica's worker, in a job) as the one whose
        backwards count as this replica's own; returns how many gradients they have
        accumulated into its parameters, ever (see `_UsedFlags`). Forgets a gradient this
        thread put into another replica before (see `stray_gradient`)."""
        self._used.thread = threading.get_ident()
        _strays.params = None
        return self._used.marks

    @property
    def gradients_accumulated(self) -> int:
        """How many gradients this replica's own backwards have accumulated, ever."""
        return self._used.marks

    def regroup(self, parts: int, index: int, *, loose: bool = False) -> None:
        """Re-cut the gradient buffers for ``parts`` replicas, this one at ``index`` (or none,
        ``loose``, for a lone replica in one process: see `FlatGrads`)."""
        self.grads = FlatGrads(self.params, parts, index, loose=loose)

    def open_window(self, window: int) -> None:
        """Before a step's first forward: zero the gradients (the last step left them; a lone
        replica's become ``None``), keep the buffers for window number ``window``, forget which
        params were used."""
        self.grads.attach()
        self.grads.zero_()
        self.used = [False] * len(self.params)
        if not self.buffer_slots:
            return
        self.buffers_saved_for = window
        buffers = self.buffer_slots.read()
        backup = self.buffer_backup
        if backup is None:
            backup = self.buffer_backup = [None] * len(buffers)
            self._backed_up = [None] * len(buffers)
        with torch.no_grad():
            for index, buffer in enumerate(buffers):
                saved = backup[index]
                if (
                    buffer is not None
                    and saved is not None
                    and id(buffer) == self._backed_up[index]
                    and _layout(saved) == _layout(buffer)  # not resized in place
                ):
                    saved.copy_(buffer)  # the same tensor as last time: its copy is at hand
                else:  # the first window, or a buffer the model assigned anew (or None)
                    backup[index] = None if buffer is None else buffer.detach().clone()
                    self._backed_up[index] = None if buffer is None else id(buffer)

    def used_mask(self) -> int:
        """The parameters that got a gradient since `open_window`, as a bit mask."""
        return sum(1 << index for index, used in enumerate(self.used) if used)

    def lr(self) -> float | None:
        groups = self.optimizer.param_groups
        return float(groups[0]["lr"]) if groups and "lr" in groups[0] else None


# Per worker thread: a parameter of another replica that this thread's backward accumulated a
# gradient into, since the job's `Replica.claim_gradients` (see `stray_gradient`).
_strays = threading.local()


def stray_gradient(replicas: list[Replica], own: Replica) -> tuple[Replica, str] | None:
    """The replica of ``replicas`` other than ``own``, and the name of its parameter, that the
    calling worker's backward (in this job) accumulated a gradient into; ``None`` when there
    is none. A model that keeps a function referring to its own parameters or modules
    (``self.act = lambda x: x * self.alpha``; a hook made by a lambda that calls other
    modules) shares that function with its copies, which ``copy.deepcopy`` does not copy: every
    device's forward then uses the first replica's parameters there, and its backward writes
    into that replica's gradients from another thread, racing its own step."""
    strays = getattr(_strays, "params", None)
    if strays is None:
        return None
    _strays.params = None
    for flags, param in strays:
        for replica in replicas:
            # (Not a replica of another trainer given the same module: it holds their hooks.)
            if replica is not own and replica._used is flags:
                for name, mine in replica.model.named_parameters(remove_duplicate=False):
                    if mine is param:
                        return replica, name
    return None


class _UsedFlags:
    """Which parameters of a replica got a gradient since its window opened."""

    __slots__ = ("flags", "marks", "thread")

    def __init__(self, params: int) -> None:
        self.flags = [False] * params
        # Gradients accumulated, ever, by a backward of this replica's own worker (or of
        # autograd's device threads, a GPU's): one the step's own backward() made shows. Not
        # another worker's: a step that uses a model from outside it (trainer.model) writes
        # into the first replica from every device, which says so itself.
        self.marks = 0
        self.thread: int | None = None  # the worker thread running this replica's jobs

    def mark(self, index: int, param: torch.Tensor) -> None:
        self.flags[index] = True
        if threading.get_ident() == self.thread or current_worker() is None:
            self.marks += 1
        else:  # another worker's backward reached this replica (see `stray_gradient`)
            strays = getattr(_strays, "params", None)
            if strays is None:
                strays = _strays.params = []
            strays.append((self, param))


class BufferSlots:
    """Where a model keeps its buffers: every module's named buffer entries (``None`` ones
    too), fixed when the replica is built (`check_rebuilt` refuses a buffer registered or
    deleted since). What they hold is read at each use: a module may put a new tensor in
    one, of another shape even (a cache grown for a longer sequence)."""

    def __init__(self, model: nn.Module) -> None:
        self._slots = slots_of(model)

    def __len__(self) -> int:
        return len(self._slots)

    def names(self) -> list[str]:
        return [name for _, name in self._slots]

    def are(self, slots: list[tuple[nn.Module, str]]) -> bool:
        """Whether ``slots`` (`slots_of` a model now) are these: the same modules, not one
        replaced since (``model[0] = nn.BatchNorm1d(8)``, whose slots are its own)."""
        return len(slots) == len(self._slots) and all(
            module is mine and name == my_name
            for (module, name), (mine, my_name) in zip(slots, self._slots, strict=True)
        )

    def read(self) -> list[torch.Tensor | None]:
        return [module._buffers.get(name) for module, name in self._slots]

    def write(self, index: int, tensor: torch.Tensor | None) -> None:
        module, name = self._slots[index]
        module._buffers[name] = tensor

    def put(
        self,
        values: list[torch.Tensor | None],
        where: Callable[[torch.Tensor], torch.device],
    ) -> None:
        """Make each slot hold the value of ``values`` at its place: copied into the tensor it
        holds where shape and dtype match, else a copy of the value (on ``where(value)``) put
        in the slot (a cache made or grown since); ``None`` empties it."""
        for index, (buffer, value) in enumerate(zip(self.read(), values, strict=True)):
            if value is None:
                if buffer is not None:
                    self.write(index, None)
            elif (
                buffer is not None
                and buffer.shape == value.shape
                and buffer.dtype == value.dtype
                and not buffer.is_inference()  # made under inference_mode: no in-place write
            ):
                buffer.copy_(value, non_blocking=True)
            else:
                self.write(index, value.detach().to(where(value), copy=True))

    def tensors(self) -> list[torch.Tensor]:
        """The buffers held, each once, in the order of ``model.buffers()``."""
        seen: set[int] = set()
        held = []
        for buffer in self.read():
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                held.append(buffer)
        return held


def slots_of(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every module's buffer entries (``None`` ones too), as (module, name), in the order of
    ``model.buffers()``."""
    return [(module, name) for module in model.modules() for name in module._buffers]


def check_rebuilt(first: Replica) -> None:
    """Refuse a ``trainer.model`` (``first``, the first replica) that no longer has the parts
    the replicas were built with; warn of a parameter thawed since.

    Values, ``requires_grad``, train/eval mode and extra state changed on ``trainer.model``
    between calls carry over to every replica (`mirror`), and so does a frozen parameter
    replaced by one of its shape, dtype and device (``module.weight =
    nn.Parameter(pretrained, requires_grad=False)``). A trained parameter replaced, or a
    parameter, module or buffer added or removed (a new layer, ``torch.nn.utils.parametrize``)
    does not: the optimizers hold the parameters they were built with, and the other replicas
    have no place for the new part. Checked on one device too, so that a model that trains on
    one device trains on several.
    """
    now = list(first.model.parameters())
    built = first.built_params
    trained = {id(p) for p in first.params}
    names = {id(p): name for name, p in first.model.named_parameters()}
    now_names = list(names.values())
    renamed = _renamed(first.built_names, now_names)
    if renamed:
        _refuse(renamed)
    moved = [name for name, was in zip(now_names, first.built_names, strict=True) if name != was]
    if moved:  # each device's copy and its optimizer hold them in the order they were built
        _refuse(
            f"its parameters are in another order now ({first_names(moved)} moved: a "
            "parameter deleted and registered again goes last)"
        )
    # (The same names in the same order: as many parameters as built.)
    for param, was, layout, strides in zip(
        now, built, first.built_layouts, first.built_grad_layouts, strict=True
    ):
        if param is was:
            if _layout(param) != layout:  # cast in place: model.double(), .half()
                _refuse(
                    f"{names[id(param)]} was cast or resized in place (model.double(), "
                    ".half(), .to(...)): cast the model before building its Trainer"
                )
            if id(param) in trained and grad_layout(param) != strides:
                _refuse(
                    f"{names[id(param)]} is laid out otherwise in memory, strides "
                    f"{tuple(param.stride())} (model.to(memory_format=torch.channels_last); a "
                    "value set with .data = w.t() or set_(), as torch.nn.utils.parametrize "
                    "does when a parametrized weight is assigned): lay it out as it was "
                    "(param.data = param.data.contiguous() for the default), or set the "
                    "memory format before building its Trainer"
                )
            continue
        if id(was) in trained:
            _refuse(
                f"{names[id(param)]} is another parameter now, in place of one the optimizers "
                "train (a layer replaced: trainer.model[0] = nn.Linear(...))"
            )
        if _layout(param) != layout:
            _refuse(
                f"{names[id(param)]} is another parameter now, of another shape, dtype or device"
            )
    if sum(1 for _ in first.model.modules()) != first.built_modules:
        _refuse("a module was added or removed")
    slots = slots_of(first.model)
    if [name for _, name in slots] != first.buffer_slots.names():
        _refuse("a buffer was registered or deleted")
    if not first.buffer_slots.are(slots):
        # A module replaced by one of the same parts (a frozen pretrained norm layer, say):
        # the buffers are read from the new one, and the other replicas take its values.
        first.buffer_slots = BufferSlots(first.model)
        first.buffer_backup, first.buffers_saved_for = None, None
    thawed = [names[id(p)] for p in now if p.requires_grad and id(p) not in trained]
    if thawed:
        one = len(thawed) == 1
        warn_user(
            f"{first_names(thawed)} of trainer.model "
            f"{'requires' if one else 'require'} grad now but did not when its replicas were "
            f"built, so no optimizer holds {'it' if one else 'them'} and "
            f"{'it is' if one else 'they are'} not trained. To freeze parameters for a first "
            "stage and thaw them later (gradual unfreezing), leave them trainable until the "
            "Trainer has built its replicas (its first fit, validate or save_checkpoint: "
            "await trainer.validate(valid_data) before freezing them), then freeze them: the "
            "optimizers hold every parameter and skip the frozen ones, as a plain loop's "
            "optimizer over model.parameters() does"
        )


def _renamed(built: Sequence[str], now: Sequence[str]) -> str | None:
    """What `check_rebuilt` says of parameters named otherwise than when the replicas were
    built (``None`` if the names are the same ones): which are gone and which are new, where
    comparing by position would name a parameter that did not change (pruning and
    parametrizations register the one they rewrite under a new name, last)."""
    kept = set(built) & set(now)
    gone = [name for name in built if name not in kept]
    new = [name for name in now if name not in kept]
    if not gone and not new:
        return None
    said = []
    if gone:
        said.append(f"{first_names(gone)} {'is' if len(gone) == 1 else 'are'} gone")
    if new:
        said.append(f"{first_names(new)} {'is' if len(new) == 1 else 'are'} new")
    what = " and ".join(said)
    if len(now) != len(built):
        what = f"it had {len(built)} parameters, and has {len(now)} now ({what})"
    rewritten = {name.removesuffix("_orig") for name in new} | {
        name.replace("parametrizations.", "").removesuffix(".original") for name in new
    }
    if rewritten & set(gone):
        what += (
            " (torch.nn.utils.prune renames weight to weight_orig, torch.nn.utils.parametrize "
            "to parametrizations.weight.original): prune or parametrize the model before "
            "building its Trainer"
        )
    return what


def _layout(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return tensor.shape, tensor.dtype, tensor.device


def check_copies(replicas: Sequence[Replica]) -> None:
    """Refuse replicas that are no longer made of the parts each was built with: a module that
    makes a parameter, buffer or submodule in its forward (the first time a batch holds some
    kind of item, or on its first call) makes it on the devices whose share held such an item
    only, and the copies then differ in their parts (the first's is saved and checkpointed; a
    parameter made elsewhere is not reduced); made on every device, the optimizers still
    hold the parts as built. Names only: cheap after a fit's first step, at an epoch's end and
    before each call."""
    changed: list[tuple[Replica, str]] = []
    for replica in replicas:
        if sum(1 for _ in replica.model.parameters()) != len(replica.built_params):
            changed.append((replica, "a parameter"))
        elif sum(1 for _ in replica.model.modules()) != replica.built_modules:
            changed.append((replica, "a module"))
        elif [name for _, name in slots_of(replica.model)] != replica.buffer_slots.names():
            changed.append((replica, "a buffer"))
    if not changed:
        return
    replica, what = changed[0]
    where = (
        f"the model's copy on {replica.device}"
        if len(changed) < len(replicas)
        else "the model (on every device)"
        if len(replicas) > 1
        else "the model"
    )
    raise ConfigurationError(
        f"{where} gained or lost {what} since the Trainer built it: a forward that makes a "
        "part of the model (self.extra = nn.Linear(...), register_buffer(...)) on its first "
        "call, or the first time a batch holds some kind of item (then only on the devices "
        "whose share holds one), leaves the optimizers, the other devices and the "
        "checkpoints without it. Make every part in the module's __init__ (a buffer as "
        "self.register_buffer('name', None) there, assigned in the forward; a flag instead "
        "of a layer made on demand), or run the model once before building the Trainer"
    )


def _refuse(what: str) -> NoReturn:
    raise ConfigurationError(
        f"trainer.model is not made of the parts its replicas were built from: {what}. "
        "Changes to its values, requires_grad, train/eval mode and extra state carry over to "
        "every device, and so does a frozen parameter swapped for one of its shape, dtype and "
        "device; a changed "
        "set of parameters, modules or buffers needs a new Trainer over the changed model "
        "(whose optimizers start afresh)"
    )


#: An attribute deleted from a module of ``trainer.model`` (see `attribute_changes`).
DELETED = object()

#: The hooks a module keeps, by the attribute each lives in (``register_forward_hook``...),
#: and the flag a full backward hook sets beside them.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_FULL_BACKWARD = "_is_full_backward_hook"

#: What every module keeps in its ``__dict__``: torch's machinery (its parameters, buffers,
#: submodules, hooks, mode), not a setting or a state of the module's own.
_INTERNALS = frozenset(vars(nn.Module()))


class _HookIds(tuple):  # type: ignore[type-arg]
    """The ids of a hook dict's hooks, in order (compared by value, unlike attributes)."""


class _Held:
    """An attribute's object as a snapshot holds it: weakly where it can be (an activation
    kept by the forward must not outlive the module's reference to it), else as it is."""

    __slots__ = ("ident", "ref")

    def __init__(self, value: Any) -> None:
        self.ident = id(value)
        try:
            self.ref: Any = weakref.ref(value)
        except TypeError:
            self.ref = value  # numbers, strings, tuples: nothing to keep alive that matters

    def holds(self, value: Any) -> bool:
        """Whether ``value`` is the object held (by identity; a dead weak reference's object is
        gone, so none is)."""
        if isinstance(self.ref, weakref.ref):
            return self.ref() is value
        return self.ref is value


def attribute_snapshot(model: nn.Module) -> list[dict[Any, Any]]:
    """For each module: its own attributes (``vars``, less torch's machinery: a temperature,
    a dropout's ``p``, a recurrent state kept as an attribute, private ones too), as the
    objects they are now (held weakly where they can be); and, under ``(name,)`` keys, the ids
    of the hooks in each of its hook dicts, in order, and its full-backward-hook flag."""
    snapshot: list[dict[Any, Any]] = []
    for module in model.modules():
        entries: dict[Any, Any] = {
            k: _Held(v) for k, v in vars(module).items() if k not in _INTERNALS
        }
        for name in _HOOK_DICTS:
            hooks = getattr(module, name, None)
            if hooks:
                entries[(name,)] = _HookIds(hooks)
        entries[(_FULL_BACKWARD,)] = _Held(getattr(module, _FULL_BACKWARD, None))
        snapshot.append(entries)
    return snapshot


_MISSING = object()


def _same(before: Any, now: Any) -> bool:
    """Whether a snapshot's entry is unchanged: an attribute held that is still the same
    object, or a hook dict's ids, equal."""
    if before is _MISSING or now is _MISSING:
        return before is now
    if isinstance(before, _HookIds):
        return isinstance(now, _HookIds) and tuple(before) == tuple(now)
    return (
        isinstance(before, _Held)
        and isinstance(now, _Held)
        and before.ident == now.ident
        and (before.holds(_object(now)))
    )


def _object(held: _Held) -> Any:
    """The object ``held`` holds (None for a dead weak reference's)."""
    return held.ref() if isinstance(held.ref, weakref.ref) else held.ref


def attribute_changes(first: Replica) -> list[tuple[int, Any, Any]]:
    """What changed on ``trainer.model``'s modules since the last call ended
    (`Replica.module_attrs`): an attribute set (to another object), added or deleted, as
    (module index, name, value or `DELETED`); hooks registered or removed, as (module index,
    (hook dict's name,), the ids it held then). What the user changed between calls, which
    `mirror` gives every replica. One the forward changes (a recurrent state) is each
    device's own during a call; one changed in place (a list appended to) is not seen: assign
    a new value."""
    changes: list[tuple[int, Any, Any]] = []
    modules = list(first.model.modules())
    now = attribute_snapshot(first.model)
    for index, (entries, before) in enumerate(zip(now, first.module_attrs, strict=True)):
        for name in entries.keys() | before.keys():
            was, value = before.get(name, _MISSING), entries.get(name, _MISSING)
            if _same(was, value):
                continue
            if isinstance(name, tuple):  # a hook dict (its ids then), or the flag
                changes.append((index, name, tuple(was) if isinstance(was, _HookIds) else ()))
            else:
                current = modules[index].__dict__.get(name, _MISSING)
                changes.append((index, name, DELETED if current is _MISSING else current))
    return changes


def settle_snapshots(replicas: Sequence[Replica]) -> None:
    """At a call's end, take each replica's snapshot again (`attribute_snapshot`): what the
    forward set during the call is each device's own, and is not carried over. But an
    attribute or hook changed on ``trainer.model`` alone during the call, where every other
    replica ran its step and still holds what the call's start gave it (an event consumer's
    doing: ``trainer.model.temperature = 4.0`` between epochs), keeps its old entry, so that
    the next call carries it over. Where another replica never ran its step in the call (its
    shares were empty), nothing tells the first's forward from a consumer: taken as the
    forward's."""
    first, others = replicas[0], replicas[1:]
    now = attribute_snapshot(first.model)
    theirs = [attribute_snapshot(replica.model) for replica in others]
    every_one_ran = all(replica.forwards for replica in others)
    for index, (entries, before) in enumerate(zip(now, first.module_attrs, strict=True)):
        for name in entries.keys() | before.keys():
            was = before.get(name, _MISSING)
            if _same(was, entries.get(name, _MISSING)):
                continue
            moved = any(
                not _same(
                    replica.module_attrs[index].get(name, _MISSING),
                    mine[index].get(name, _MISSING),
                )
                for replica, mine in zip(others, theirs, strict=True)
            )
            if others and every_one_ran and not moved:  # on trainer.model alone: to carry
                if was is _MISSING:
                    del entries[name]
                else:
                    entries[name] = was
    first.module_attrs = now
    for replica, mine in zip(others, theirs, strict=True):
        replica.module_attrs = mine
    for replica in replicas:
        replica.forwards = 0


def _carried(value: Any, device: torch.device, source: torch.device, memo: dict[int, Any]) -> Any:
    """``value`` for a replica on ``device``: a module, parameter or buffer of
    ``trainer.model`` the replica's own counterpart (``memo``, by id); another tensor copied,
    to ``device`` if it is on the first replica's (``source``), else where it is (lengths for
    ``pack_padded_sequence``, kept on the CPU); another object copied (as the replicas were
    made, its references to the model's parts made the replica's); a number or a string as
    it is."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        return value.detach().to(device if value.device == source else value.device, copy=True)
    if isinstance(value, (int, float, complex, str, bytes, type(None), torch.dtype)):
        return value
    own = dict(memo)
    for item in reachable(value):  # the tensors in it to the replica's device, as one copy each
        if isinstance(item, torch.Tensor) and id(item) not in own and item.device == source:
            own[id(item)] = item.detach().to(device, copy=True)
    try:
        return copy.deepcopy(value, own)  # cycles, shared references, dict keys: as deepcopy
    except Exception:
        return value


def _carry_hooks(mine: dict[int, Any], theirs: dict[int, Any], before: tuple[int, ...]) -> None:
    """Make a replica's hook dict ``mine`` hold what ``theirs`` (its module's of
    ``trainer.model``) holds, in its order: a hook the replica has already is kept as its own
    copy (made with the model, bound to the copy's module); one registered on
    ``trainer.model`` since is added, and one removed there (in ``before``) is removed. A
    hook the replica's own forward registered (in neither) is kept, last."""
    own = [key for key in mine if key not in theirs and key not in before]
    rebuilt = {key: mine.get(key, hook) for key, hook in theirs.items()}
    rebuilt.update((key, mine[key]) for key in own)
    mine.clear()
    mine.update(rebuilt)


def mirror(replica: Replica, first: Replica, changes: Sequence[tuple[int, Any, Any]] = ()) -> None:
    """Make ``replica`` what ``first`` (``trainer.model``) is now: its parameters' and
    buffers' values, which parameters require grad, the parameters' attributes and gradient
    hooks (`carry_parameter_extras`), every module's train/eval mode and extra state
    (``get_extra_state``), its forward and backward hooks (added or removed), and the
    module attributes ``changes`` names (`attribute_changes`).

    Runs on ``replica``'s worker before a fit or a validation, so that what a user changed on
    ``trainer.model`` since the last call (weights loaded, a layer frozen, ``.eval()``) holds
    on every device, as DDP's wrap does for its ranks. A copy from another GPU waits for the
    work queued on both devices' current streams, as ``Tensor.copy_`` across devices does.
    """
    with torch.no_grad():
        pairs = zip(replica.model.parameters(), first.model.parameters(), strict=True)
        for param, first_param in pairs:
            param.copy_(first_param)
            param.requires_grad_(first_param.requires_grad)
        replica.take_buffers(first)
    carry_parameter_extras(replica.model, first.model, replica.device.torch_device)
    modules, sources = list(replica.model.modules()), list(first.model.modules())
    for module, source in zip(modules, sources, strict=True):
        module.training = source.training
        if type(source).get_extra_state is not nn.Module.get_extra_state:
            module.set_extra_state(copy.deepcopy(source.get_extra_state()))
    if not changes:
        return
    memo: dict[int, Any] = {}
    for mine, theirs in (
        (modules, sources),
        (replica.model.parameters(), first.model.parameters()),
        (replica.model.buffers(), first.model.buffers()),
    ):
        memo.update((id(t), m) for m, t in zip(mine, theirs, strict=True))
    for index, name, value in changes:
        module, source = modules[index], sources[index]
        if name == (_FULL_BACKWARD,):
            setattr(module, _FULL_BACKWARD, getattr(source, _FULL_BACKWARD, None))
        elif isinstance(name, tuple):
            _carry_hooks(getattr(module, name[0]), getattr(source, name[0]), value)
        elif value is DELETED:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = _carried(
                value, replica.device.torch_device, first.device.torch_device, memo
            )


def carry_parameter_extras(model: nn.Module, source: nn.Module, device: torch.device) -> None:
    """Give each parameter of ``model`` (a copy of ``source``, for ``device``) what
    ``copy.deepcopy`` leaves behind: its gradient hooks (``register_hook``: a mask on an
    embedding's rows, say), and, where the parameter's type copies with
    ``Parameter.__deepcopy__`` (which copies the values and ``requires_grad`` alone), the
    attributes set on its counterpart (``p._no_weight_decay = True``, which an optimizer factory
    may group by; a tensor among them is copied to ``device``). A subclass that copies itself
    (a quantized weight's state) is left as its own copy made it. The hooks are the
    counterpart's own dict, shared: one removed through its handle is gone on every replica;
    one added to a parameter that had none reaches the others as the next call starts."""
    pairs = zip(model.parameters(), source.parameters(), strict=True)
    for param, theirs in pairs:
        if param is theirs:
            continue
        if type(theirs).__deepcopy__ is nn.Parameter.__deepcopy__:
            attributes = vars(param)
            attributes.clear()
            for name, value in vars(theirs).items():
                if isinstance(value, torch.Tensor):
                    value = value.detach().to(device, copy=True)
                attributes[name] = value
        param._backward_hooks = theirs._backward_hooks


def group_layout(replica: Replica) -> list[list[int]]:
    """Which parameters (by their place in ``model.parameters()``) each of the replica's
    optimizer's groups holds, in order: the same on every replica, or their optimizers step
    differently."""
    place = {id(p): index for index, p in enumerate(replica.model.parameters())}
    return [[place[id(p)] for p in group["params"]] for group in replica.optimizer.param_groups]


def lives_on(model: nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of ``model`` is on ``device``."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return all(tensor.device == device for tensor in tensors)


def move_to(model: nn.Module, device: torch.device) -> nn.Module:
    """``model``, moved to ``device`` in place (``Module.to``) unless it `lives_on` it: a
    module that lives there is left untouched (some refuse ``.to`` altogether, as 8-bit
    quantized models do)."""
    return model if lives_on(model, device) else model.to(device)


def has_sparse_gradients(model: nn.Module) -> bool:
    """Whether a module of ``model`` makes sparse gradients (``nn.Embedding`` or
    ``nn.EmbeddingBag`` with ``sparse=True``). Such a model keeps flat buffers even on one
    device: adding a sparse gradient into a dense buffer makes it dense, as with several
    devices, so that clipping, loss scaling and every optimizer see the same gradients."""
    return any(
        isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
        for module in model.modules()
    )


#: What a factory may raise that is its device's failure, not a mistake in the arguments
#: (``torch.cuda.OutOfMemoryError`` is ``torch.OutOfMemoryError`` where torch has the latter;
#: ``torch.AcceleratorError``, a CUDA error, came with torch 2.8).
DEVICE_FAULTS: tuple[type[BaseException], ...] = (
    torch.cuda.OutOfMemoryError,
    *([torch.AcceleratorError] if hasattr(torch, "AcceleratorError") else []),
)


def build_replica(
    model: nn.Module,
    device: Device,
    *,
    optimizer: OptimizerFactory,
    scheduler: SchedulerFactory | None,
) -> Replica:
    """Give ``model``, on ``device`` already, an optimizer (and an LR scheduler)."""
    opt = _made_by(
        optimizer,
        # A list, not a generator: a factory may read it twice (decay and no-decay groups).
        [p for p in model.parameters() if p.requires_grad],
        "the optimizer factory",
        "Trainer's second argument makes one optimizer per replica from its parameters, such "
        "as functools.partial(torch.optim.SGD, lr=0.1)",
        swapped=" (the step function comes third: Trainer(model, optimizer, step))",
    )
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigurationError(
            f"the optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer; "
            "give a factory such as functools.partial(torch.optim.SGD, lr=0.1)"
        )
    if isinstance(opt, (torch.optim.LBFGS, torch.optim.SparseAdam)):
        raise ConfigurationError(
            f"{type(opt).__name__} cannot train here: "
            + (
                "it steps with a closure that runs the forward and backward again, and a "
                "Trainer's step is one forward and backward a batch"
                if isinstance(opt, torch.optim.LBFGS)
                else "it takes sparse gradients only, and a Trainer reduces gradients as dense "
                "buffers (an Embedding(sparse=True) trains with SGD or Adagrad)"
            )
            + "; give an optimizer that steps on gradients alone, such as torch.optim.AdamW"
        )
    own = {id(p) for p in model.parameters()}
    if any(id(p) not in own for group in opt.param_groups for p in group["params"]):
        raise ConfigurationError(
            "the optimizer factory made an optimizer over parameters that are not those of the "
            "model it was given (a factory that reads the model from outside, say): each "
            "replica's optimizer must hold that replica's own parameters. Build the optimizer, "
            "its parameter groups too, from the factory's argument"
        )
    for group in opt.param_groups:
        for key, value in group.items():
            if key != "params" and isinstance(value, torch.Tensor):
                # A tensor hyperparameter (lr=torch.tensor(0.1) in a partial) is one object
                # in every replica's optimizer: each scheduler would write it in place, and
                # the learning rate would fall once a replica each step.
                group[key] = value.clone()
    made = None
    if scheduler is not None:
        made = _made_by(
            scheduler,
            opt,
            "the lr_scheduler factory",
            "lr_scheduler makes one scheduler per replica from its optimizer, such as "
            "functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10)",
        )
    if scheduler is not None and (
        isinstance(made, torch.optim.Optimizer)
        or not all(callable(getattr(made, m, None)) for m in ("step", "state_dict"))
        or getattr(made, "optimizer", opt) is not opt
    ):
        got = (
            "the optimizer it was given"
            if made is opt
            else "a scheduler of another optimizer"
            if hasattr(made, "step") and hasattr(made, "optimizer")
            else _kind(made) + (" (a function without a return?)" if made is None else "")
        )
        raise ConfigurationError(
            f"the lr_scheduler factory returned {got}, not an LR scheduler of that optimizer; "
            "it makes one scheduler per replica from the optimizer it is given, such as "
            "functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10)"
        )
    return Replica(device, model, opt, made)


def _made_by(
    factory: Callable[[Any], Any], argument: Any, name: str, usage: str, *, swapped: str = ""
) -> Any:
    """``factory(argument)``; what it raises becomes a `ConfigurationError` that says
    what the factory is for (``usage``; and ``swapped`` for a ``TypeError``, the sign of
    arguments given in the wrong order), except a device fault (`DEVICE_FAULTS`)."""
    try:
        return factory(argument)
    except DEVICE_FAULTS:
        raise  # out of memory, a CUDA error: the device's failure, not the arguments'
    except Exception as error:
        # "missing 1 required positional argument: 'batch'": a step given as the factory.
        looks_swapped = isinstance(error, TypeError) and "positional argument" in str(error)
        hint = swapped if looks_swapped else ""
        raise ConfigurationError(
            f"{name} raised {type(error).__name__}: {error}. {usage}{hint}"
        ) from error


def loss_and_metrics(
    output: object, *, training: bool
) -> tuple[torch.Tensor, dict[str, Any], int | None]:
    """Read a step's output: the scalar loss, any further metrics, and the count of items the
    loss is the mean over when the step gives one (``"items"``; ``None`` otherwise)."""
    items = None
    # Validation runs valid_step (by default the step itself): its errors say which ran.
    step = "the step" if training else "the validation step"
    if isinstance(output, torch.Tensor):
        loss, metrics = output, {}
    elif isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
        metrics = {str(k): v for k, v in output.items() if k not in ("loss", "items")}
        if "items" in output:
            items = _item_count(output["items"], step)
    elif isinstance(output, Mapping):
        raise StepOutputError(
            f"{step} returned a dict without a 'loss' entry (its keys: "
            f"{', '.join(map(repr, output)) or 'none'}); put the loss "
            f"{'to train on' if training else 'to validate on'} under 'loss' (a scalar tensor, "
            "the mean over the shard's items), beside any further metrics"
        )
    elif inspect.iscoroutine(output):
        output.close()  # never awaited: no "coroutine was never awaited" warning besides
        raise StepOutputError(
            f"{step} returned a coroutine (is it async?); it runs on each device's worker "
            "thread, outside the event loop, so it must be a plain function that returns the "
            "loss"
        )
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        kinds = ", ".join(type(part).__name__ for part in output)
        raise StepOutputError(
            f"{step} returned a {type(output).__name__} ({kinds}); return the loss alone, or "
            "a dict: {'loss': loss, 'accuracy': accuracy, ...} (a dict of metrics beside the "
            "loss: {'loss': loss, **metrics})"
        )
    else:
        raise StepOutputError(
            f"{step} returned {_kind(output)}; return the loss (a scalar tensor, the mean over "
            "the shard's items), or a dict with a 'loss' entry and further metrics"
        )
    if not isinstance(loss, torch.Tensor):
        raise StepOutputError(f"{step}'s loss is {_kind(loss)}, not a tensor")
    if loss.numel() != 1:
        raise StepOutputError(
            f"{step}'s loss has shape {tuple(loss.shape)}; return a scalar, the mean over the "
            "shard's items (for example loss.mean())"
        )
    if loss.is_complex():  # backward() refuses it ("grad can be implicitly created only
        # for real scalar outputs"), and a mean over items of it is no loss to minimise
        raise StepOutputError(
            f"{step}'s loss is a complex tensor ({loss.dtype}): return a real loss, such as "
            "its magnitude or a norm (loss.abs())"
        )
    if training and not loss.requires_grad:
        if not loss.is_floating_point():
            raise StepOutputError(
                f"the step's loss is a tensor of {loss.dtype}, which has no gradient (a count, "
                "or a comparison's result): return a floating-point loss, such as "
                "F.cross_entropy(logits, targets)"
            )
        ctx = current_worker()
        raise StepOutputError(
            f"the step's loss{f' on {ctx.device.name}' if ctx else ''} does not require grad: "
            "was it computed under torch.no_grad(), or from detached tensors? Or does it "
            "depend on the parameters only through a branch the data decides (if mask.any(): "
            "...), which this share of the batch did not take? Each device's share must give "
            "a loss that depends on them: write the branch as arithmetic (out + p * mask adds "
            "nothing for an all-False mask)"
        )
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise StepOutputError(
                f"{step}'s metric {name!r} has shape {tuple(value.shape)}; metrics are "
                "scalars, means over the shard's items"
            )
        if isinstance(value, torch.Tensor) and value.is_complex():
            raise StepOutputError(
                f"{step}'s metric {name!r} is a complex tensor ({value.dtype}): return a real "
                "number, such as its magnitude (value.abs())"
            )
        if not isinstance(value, torch.Tensor) and not _is_number(value):
            raise StepOutputError(
                f"{step}'s metric {name!r} is {_kind(value)}, not a number (an int, a float, "
                "a NumPy scalar) or a one-element tensor"
            )
    return loss, metrics, items


def _is_number(value: object) -> bool:
    """A real number ``float()`` takes: Python's, NumPy's scalars and bools too (not
    ``np.timedelta64``, which registers as one but has no ``float()``)."""
    if not isinstance(value, (numbers.Real, np.bool_)):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _item_count(value: object, step: str) -> int:
    """A step's ``"items"``: a whole number >= 0 (an int, NumPy's included, or a one-element
    tensor)."""
    number = float("nan")
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        shown = f"a tensor of {value.dtype}"  # a mask's any(), not a count
    elif isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        number = float(value.detach())  # a host-device sync, as the loss's
        shown = f"{number:g} (a tensor)"
    elif _is_integer(value):
        number = float(operator.index(cast(Any, value)))  # Python's or NumPy's integers
        shown = repr(value)
    else:
        shown = repr(value) if isinstance(value, float) else _kind(value)
    if not (number >= 0 and number.is_integer()):
        raise StepOutputError(
            f"{step}'s 'items' is {shown}; it counts the items the loss is the mean over "
            "(tokens, say): a whole number >= 0, as an int (NumPy's included) or a one-element "
            "tensor"
        )
    return int(number)


def _is_integer(value: Any) -> bool:
    """Python's or NumPy's integers, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"
