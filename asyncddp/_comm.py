"""What the ranks of a ``torch.distributed`` process group tell each other, and when.

Every exchange between ranks starts with one small all-reduce, the *header*: a float64 vector
that every rank fills in the same layout and that sums to the same totals on every rank::

    kind | items | loss | active | failed | stop | new | buckets | counted | trainer |
    used[P] | (sum, reported)[M] | a small model's gradients (see below)

``kind`` says which exchange this is (a step, the end of validation, ...); ``items``, ``loss``
and the metric sums are sums over every device of every rank, which makes the gradient weights,
the step's loss and the validation metrics exact; ``active`` counts the ranks that brought data
(uneven data never hangs: a rank out of data keeps joining with zero items until none is
active); ``failed`` counts the ranks that are raising; ``stop`` the ranks where ``stop()`` was
called; ``counted`` the ranks whose item counts came from their step (its ``"items"``);
``trainer`` a number each rank's trainer took from rank 0's name for it (see `Comm.setup`),
so that an exchange that met another trainer's on some rank says so instead of summing their
figures; ``used[p]`` how many ranks gave parameter ``p`` a gradient; each metric's
``reported`` the items behind its sum, those of the shards that reported it (the registry of
names is shared by training and validation: an exchange's figures hold only the metrics some
rank reported, over some item, in it).

A step's gradient buckets are all-reduced *with* its header, all started at once, so the header
costs no round trip of its own; ``buckets`` counts the ranks that sent them. A rank that sent a
header alone while others sent buckets with theirs (it announces a failure while they are in a
step, or it is out of step with them) joins with zero buckets of the same layout, so every rank
has issued the same collectives in the same order. A small model's gradients (over gloo, up to
``PACK_ELEMENTS``) travel *inside* the header instead, as float64 after its fields: one
all-reduce a step, where two would cost twice the latency. Then every header of that trainer
has room for them (zeros when it carries none), so headers always match, whatever exchange
each rank is in, and nobody joins buckets. The set-up's first header holds the fixed fields
alone: until the ranks have compared their trainers, a header's size must not depend on them.

What follows the header depends on it, and every rank knows the same header:

- ``failed > 0``: every rank gathers the failures (one ``all_gather_object``) and raises. A rank
  whose step raised sends its failure in the header of whatever exchange the others are in, so
  they raise within one collective's latency, not after the process group's timeout.
- ``new names > 0``: some rank's step returned a metric not seen before: every rank gathers the
  names, adds them to its registry in the same order, and sums this exchange's values for them.
- a step with items: rank 0's model buffers (BatchNorm statistics), which every rank takes, as DDP's
  ``broadcast_buffers`` (one broadcast per dtype; none for a model without buffers).

A rank that dies (SIGKILL, out of memory) breaks the collective: gloo fails at once on every
rank that talks to it. The survivors then find out who is gone through the process group's
store (each writes that it is alive; whoever does not within a few seconds is named), and a
rank still waiting in an all-reduce on a survivor (over gloo, 3 or more ranks) answers the roll
call and takes its verdict.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import hashlib
import json
import logging
import math
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ._devices import Device
from ._exceptions import (
    ConfigurationError,
    NonFiniteLossError,
    WorkerFailedError,
    _message,
    _NonFiniteLoss,
    _qualified_name,
)
from ._sync import all_finite, clip_coefficient, squared_norm
from .distributed import _run_id

__all__ = ["Comm", "Failure", "Global", "PeerFailed", "RankLost"]

# Exchange kinds.
STEP, VALIDATION, STOP_CHECK, FIT_END, SETUP, MODEL, RESUME = 1, 2, 3, 4, 5, 6, 7
_EXCHANGES = {
    STEP: "a training step (fit)",
    VALIDATION: "the end of a validation (validate, or fit's valid_data)",
    STOP_CHECK: "an epoch's check for stop() (fit)",
    FIT_END: "the end of fit",
    SETUP: "a trainer's first call",
    MODEL: "taking rank 0's model (a call's start)",
    RESUME: "taking the checkpoint of fit(resume=...) from rank 0",
}
_KIND, _ITEMS, _LOSS, _ACTIVE, _FAILED, _STOP, _NEW, _BUCKETS, _COUNTED, _TRAINER = range(10)
# The data's mark (see `Comm.data`): how many ranks know theirs, its sum, its squares' sum.
_MARKED, _MARK, _MARK_SQUARED = 10, 11, 12
# The options' mark (see `Comm.options`): the same three.
_OPTIONED, _OPTIONS, _OPTIONS_SQUARED = 13, 14, 15
_FIXED = 16

#: Gradient all-reduces are issued in buckets of at most this many bytes (as DDP's 25 MB).
BUCKET_BYTES = 25 * 1024 * 1024

#: Over gloo, gradients of at most this many elements in all travel inside the header (as
#: float64, which holds float32, float16 and bfloat16 values exactly): one all-reduce a step
#: instead of two started together. Small all-reduces are bound by their latency: on 2
#: processes on localhost the packed one took 0.15-0.88x the time of the two up to 16K
#: elements, about the same at 32K, and more above (the doubled bytes cost more than the
#: second collective): ``python bench/distributed.py --exchange``, in docs/benchmarks.md.
PACK_ELEMENTS = 16 * 1024

#: How long survivors wait for each other's sign of life after a collective broke.
ALIVE_WAIT = 5.0

#: With 3 or more ranks, how long a collective waits before its rank looks in the store for a
#: roll call (see `Comm.lost`), and again after each look.
ROLL_CALL_POLL = datetime.timedelta(seconds=1.0)

#: How long the first exchange of a call (fit, validate) waits before its rank looks in the
#: store for ranks that have not made that call (see `Comm.begin_call`), and says so.
NOT_IN_CALL_WAIT = 10.0

_log = logging.getLogger("asyncddp")
_setups = 0  # trainers' set-ups begun in this process: the first call of each (see Comm)


@dataclass(frozen=True)
class Failure:
    """One rank's failure, as the other ranks learn of it (picklable)."""

    rank: int
    device: Device
    error_type: str
    error_message: str
    step: int | None
    epoch: int | None
    phase: str | None
    cause: bytes | None  # the original exception, pickled, when it pickles

    def error(self) -> WorkerFailedError:
        """A `WorkerFailedError` naming this failure's rank and device (a
        `NonFiniteLossError` for a non-finite loss, as the failed rank raises)."""
        cause: BaseException | None = None
        if self.cause is not None:
            try:
                loaded = pickle.loads(self.cause)
            except Exception:
                loaded = None
            cause = loaded if isinstance(loaded, BaseException) else None
        fields: dict[str, Any] = {
            "device": self.device,
            "rank": self.rank,
            "error_type": self.error_type,
            "error_message": self.error_message,
            "step": self.step,
            "epoch": self.epoch,
            "phase": self.phase,
        }
        if isinstance(cause, _NonFiniteLoss):
            return NonFiniteLossError(loss=cause.loss, **fields)  # no cause, as on its rank
        error = WorkerFailedError(**fields)
        error.__cause__ = cause if cause is not None else RemoteError(self)
        return error


class RemoteError(Exception):
    """Stands for an exception raised on another rank that could not be sent (unpicklable)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"{failure.error_type}: {failure.error_message} (on rank {failure.rank})")


class PeerFailed(Exception):
    """Raised on every rank of an exchange in which some rank announced a failure."""

    def __init__(self, failures: Sequence[Failure]) -> None:
        self.failures = tuple(failures)
        super().__init__("; ".join(f"rank {f.rank}: {f.error_type}" for f in self.failures))


class RankLost(Exception):
    """A collective broke because a rank is gone (killed, crashed, or its host lost)."""

    def __init__(self, ranks: Sequence[int], devices: Sequence[Device], reason: str) -> None:
        self.ranks = tuple(ranks)
        self.devices = tuple(devices)
        self.reason = reason
        who = ", ".join(str(rank) for rank in self.ranks) or "unknown"
        super().__init__(f"lost rank {who}: {reason}")


@dataclass
class Global:
    """An exchange's header, summed over every rank."""

    items: int = 0
    loss: float = 0.0
    active: int = 0
    stop: int = 0
    counted: int = 0  # the ranks whose items are counts their step gave ("items")
    used: list[bool] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    metric_items: dict[str, int] = field(default_factory=dict)  # the items behind each

    @property
    def unused(self) -> tuple[int, ...]:
        """The parameters no device of any rank gave a gradient (the step leaves them out)."""
        return tuple(i for i, used in enumerate(self.used) if not used)


def describe(error: BaseException, rank: int, device: Device, **where: Any) -> Failure:
    """What this rank tells the others about ``error``."""
    cause: BaseException = error
    if isinstance(error, WorkerFailedError):
        device = error.device
        where = {"step": error.step, "epoch": error.epoch, "phase": error.phase}
        cause = error.__cause__ if error.__cause__ is not None else error
        if isinstance(error, NonFiniteLossError):  # raised without a cause: its loss goes
            cause = _NonFiniteLoss(error.loss)
        elif cause is error and error.rank is None:  # a timeout: the error itself goes, named
            cause = copy.copy(error)
            cause.rank = rank
        error_type, message = error.error_type, error.error_message
    else:
        # A KeyboardInterrupt or SystemExit a step raised goes up as it is, tagged with its
        # device and phase (`StepScheduler._failure_error`, `Jobs.train`).
        device = getattr(error, "_asyncddp_device", device)
        if "phase" not in where and hasattr(error, "_asyncddp_phase"):
            where = {**where, "phase": error._asyncddp_phase}
        error_type = _qualified_name(type(error))
        message = _message(error) or ("the fit was cancelled" if _cancelled(error) else "")
    pickled: bytes | None
    try:
        pickled = pickle.dumps(cause)
        pickle.loads(pickled)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        pickled = None
    return Failure(
        rank,
        device,
        error_type,
        message,
        where.get("step"),
        where.get("epoch"),
        where.get("phase"),
        pickled,
    )


_GROUP_LOCK = threading.Lock()
#: asyncddp's own group over every rank, and the default group it was made in (see
#: `own_group`), both held weakly: torch's registry holds them until ``destroy_process_group``.
_GROUP: tuple[weakref.ref[Any], weakref.ref[Any]] | None = None


def own_group(*, make: bool, device: torch.device) -> Any:
    """asyncddp's own process group: every rank of the default group, made once a process.

    asyncddp's collectives run in a thread of their own while the event loop runs the user's
    code, which may call ``torch.distributed`` too (an event consumer that all-reduces a
    figure, a ``dist.barrier()`` around a file write). On one group their collectives would
    meet each other's in whatever order each rank issued them: gloo would sum a header with
    the user's tensor, or abort on their sizes. On a group of their own they never meet.

    ``make``: make it if this process has none for the default group yet (a collective call
    on every rank, in the same order, as ``dist.new_group`` is); else None until then, which
    stands for the default group. It takes the default group's timeout. A new default group
    (``destroy_process_group`` and a new ``init``) gets a new one.

    asyncddp holds process groups weakly (here and in `Comm`), so that
    ``destroy_process_group`` tears them down as it returns, as torch expects: one kept alive
    would be torn down in the interpreter's exit, where gloo's threads may abort the process
    ("terminate called without an active exception").
    """
    global _GROUP
    world = dist.group.WORLD
    with _GROUP_LOCK:
        if _GROUP is not None and _GROUP[0]() is world:
            group = _GROUP[1]()
            if group is not None:
                return group
        if not make:
            return None
        timeout = None
        with contextlib.suppress(Exception):  # torch keeps no public getter for it
            timeout = world._get_backend(device).options._timeout  # type: ignore[union-attr]
        group = dist.new_group(timeout=timeout)
        _GROUP = (weakref.ref(world), weakref.ref(group))
        return group


def _weakly(group: Any) -> weakref.ref[Any] | None:
    return None if group is None else weakref.ref(group)


def bucket_devices(
    count: int, devices: Sequence[Device], wire: torch.device, backend: str
) -> list[torch.device]:
    """Where each of a step's ``count`` gradient buckets lives (see `bucket_layout`: each
    device's chunks in turn): NCCL matches a collective on each GPU's communicator, so a rank
    joining with zero buckets makes each where the real one is; gloo matches by order alone,
    and takes them on ``wire``."""
    if backend != "nccl" or len(devices) == 1:
        return [wire] * count
    per = count // len(devices)
    return [devices[index // per].torch_device for index in range(count)]


class Comm:
    """This process's view of the process group, for one trainer (whose collectives run on
    asyncddp's own group, `own_group`).

    Args:
        devices: This rank's devices.
        params: How many trainable parameters the model has (the header's ``used`` part).
        fingerprint: What must be the same on every rank (model shapes, options); checked once.
        call: The call that sets it up (``"fit()"``, ``"validate()"``), for `begin_call`'s
            warning.
    """

    def __init__(
        self,
        devices: Sequence[Device],
        params: int,
        fingerprint: Mapping[str, str],
        *,
        call: str = "fit() or validate()",
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigurationError("no torch.distributed process group is initialized")
        # The default group joined (see current()), held weakly (see own_group).
        self._world = _weakly(dist.group.WORLD)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = str(dist.get_backend())
        self.devices = tuple(devices)
        self.params = params
        self.names: list[str] = []  # metric names, in the same order on every rank
        self.rank_devices: list[tuple[Device, ...]] = []
        self.data_seed = 0
        self.name = ""  # rank 0's name for this trainer, once set up
        self.tag = 0  # a number from that name, in every header (see header): 0 until then
        self.announced = False
        #: The data this rank's steps and validation now read: its name (``"train_data"``) and
        #: its `data_mark`, sent in their headers, where the ranks compare it.
        self.data: tuple[str, tuple[int, str] | None] | None = None
        self.options = {}  # see options
        #: The sizes and dtypes of a step's gradient buckets (a failing rank sends zeros alike).
        self.layout: list[tuple[int, torch.dtype]] = []
        # Where collectives' tensors live: NCCL needs them on this process's GPU.
        self._wire = self.devices[0].torch_device if self.backend == "nccl" else torch.device("cpu")
        if self._wire.type != "cuda" and self.backend == "nccl":
            raise ConfigurationError(
                f"the process group runs NCCL, which reduces on GPUs, but this trainer's first "
                f"device is {self.devices[0].name}; train on the GPU (devices='auto'), or join "
                "with asyncddp.distributed.init('gloo') to train on CPUs"
            )
        self._incident = 0
        # A survivor's verdict on the next incident, taken while a collective waited (_wait).
        self._verdict: tuple[int, RankLost] | None = None
        self._fingerprint = fingerprint
        # Whether setup() found every rank's trainer alike. Until then a header holds its
        # fixed fields alone: its size must not depend on what the ranks may disagree about
        # (the parameters, the packing), or the first collective would fail in gloo, not here.
        self._agreed = False
        self._packed = False  # see packed(): decided once the ranks agreed
        # The group of asyncddp's collectives (see own_group), held weakly: None, the default
        # group, for a process's first trainer until its set-up's first header (made then).
        self._group_ref = _weakly(own_group(make=False, device=self._wire))
        # Which call on the trainer this rank is in, for the others to see (begin_call).
        global _setups
        _setups += 1
        self._call = call
        self._run = _run_id()  # keys of this run of torchrun's workers only
        self._scope, self._calls = "setup", _setups  # the set-up's first call: trainers set up
        self._first_exchange = True  # whether the call's first exchange is still to come
        self._note_lock = threading.Lock()
        self._note_soon()

    # -- set-up ------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where the collectives' tensors live: the process's GPU with NCCL, else the CPU."""
        return self._wire

    def setup(self) -> None:
        """Learn every rank's devices, agree on a data seed, check the ranks agree (blocking)."""
        # Every rank's first exchange for this trainer. Its header holds the fixed fields alone
        # (see __init__): a rank that meets it from another exchange, of a trainer that joined
        # earlier, sends a longer header, which gloo refuses by aborting a process (a trainer
        # rebuilt on one rank only; see docs/distributed.md's limits).
        self.header(SETUP)
        # Made once every rank is here: ranks waiting in new_group for one that died before it
        # would wait out the process group's timeout, where a broken header fails at once.
        try:
            self._group_ref = _weakly(own_group(make=True, device=self._wire))
        except RuntimeError as error:
            raise self.lost(error) from error
        packable = self._packable()
        fingerprint = {**self._fingerprint, "packed": str(packable)}
        # The data seed draws from torch's generator (a seeded run shuffles alike every time);
        # the name, from the OS: trainers seeded alike still keep their store keys apart.
        seed, name = int(torch.randint(0, 2**62, ()).item()), os.urandom(8).hex()
        mine = (self.devices, fingerprint, seed, name)
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, mine, group=self._group)
        except RuntimeError as error:
            raise self.lost(error) from error
        self.rank_devices = [tuple(devices) for devices, *_ in gathered]
        self.data_seed = int(gathered[0][2])
        self.name = str(gathered[0][3])  # rank 0's: this trainer's store keys (_key)
        kinds = [{device.type for device in devices} for devices in self.rank_devices]
        if any(kind != kinds[0] for kind in kinds):
            raise ConfigurationError(
                "every rank's devices must be of one kind (replicas on the CPU and on GPUs would "
                "drift apart), but "
                + ", ".join(
                    f"rank {r} trains on {' and '.join(sorted(kind))}"
                    for r, kind in enumerate(kinds)
                )
                + ": train on GPUs on every rank, or on the CPU on every rank"
            )
        different, differ = _apart([fp for _, fp, *_ in gathered])
        if different:
            raise ConfigurationError(
                f"ranks {different} build a different trainer from rank 0 ({differ}); every "
                "rank must run the same model, optimizer and Trainer arguments"
            )
        self._agreed = True
        self._packed = packable  # every rank's, as the fingerprints agree
        self._scope, self._calls = self.name, 1  # this trainer's calls, from here
        # From here this trainer's headers carry it; sums of float64 hold it exactly.
        self.tag = int(self.name[:6], 16) + 1
        self._note()

    def current(self) -> bool:
        """Whether the default group it joined is still the process's (not destroyed and made
        anew since, maybe with other ranks)."""
        if self._group_ref is not None and self._group_ref() is None:
            return False  # asyncddp's own group destroyed alone: joined afresh, on a new one
        return (
            dist.is_initialized() and self._world is not None and dist.group.WORLD is self._world()
        )

    @property
    def _group(self) -> Any:
        """The group of this trainer's collectives: asyncddp's own (see `own_group`), or None,
        the default group."""
        return None if self._group_ref is None else self._group_ref()

    # -- which call each rank is in ------------------------------------------------------------

    def begin_call(self, name: str) -> None:
        """Note in the store that this rank makes its next call (``name``: ``"fit()"``,
        ``"validate()"``) on this trainer.

        Every rank must make the same calls. A rank that makes one the others do not (validate
        on rank 0 alone, as a DDP script evaluates) waits in its first exchange for the process
        group's timeout (10 to 30 minutes): after `NOT_IN_CALL_WAIT` it looks in the store for
        ranks that have not made the call and logs a warning that names them and says what to
        do. Only says so: a collective cannot be left while it runs (see `_wait`).
        """
        self._call = name
        self._calls += 1
        self._first_exchange = True
        self._note_soon()

    def _note_soon(self) -> None:
        # From a thread: a store that is gone with rank 0 must not hold the event loop.
        threading.Thread(target=self._note, name="asyncddp-note-call", daemon=True).start()

    def _call_key(self, rank: int) -> str:
        return f"asyncddp/calls/{self._run}/{self._scope}/{rank}"

    def _note(self) -> None:
        with self._note_lock, contextlib.suppress(Exception):  # a hint only: never fails a call
            store = dist.distributed_c10d._get_default_store()
            store.set(self._call_key(self.rank), str(self._calls))

    def _watch_call(self) -> threading.Timer | None:
        """At the first exchange of a call: a timer that looks for ranks not in it (see
        `begin_call`), to cancel once the exchange ends."""
        if not self._first_exchange:
            return None
        self._first_exchange = False
        timer = threading.Timer(NOT_IN_CALL_WAIT, self._look_for_absent, (self._scope, self._calls))
        timer.daemon = True
        timer.name = "asyncddp-watch-call"
        timer.start()
        return timer

    def _look_for_absent(self, scope: str, calls: int) -> None:
        if scope != self._scope or calls != self._calls:
            return  # the call ended meanwhile
        behind = []
        with contextlib.suppress(Exception):
            store = dist.distributed_c10d._get_default_store()
            for rank in range(self.world_size):
                key = self._call_key(rank)
                made = int(store.get(key)) if store.check([key]) else 0
                if made < calls:
                    behind.append(rank)
        if not behind:
            return  # every rank is in this call: one is slow (a long step, its data)
        ranks = ", ".join(str(r) for r in behind)
        what = "this trainer's first call" if scope == "setup" else f"call {calls} on this trainer"
        _log.warning(
            "rank %d has waited %.0f s in %s for rank(s) %s, which have not begun it (%s): "
            "they are late to it, or do not make it. fit() and validate() are calls that "
            "every rank makes, in the same order, and this one waits for them up to the "
            "process group's timeout. To evaluate on one rank alone, run trainer.model in a "
            "loop of your own there (see the docs' distributed page, 'Every rank makes every "
            "call').",
            self.rank,
            NOT_IN_CALL_WAIT,
            self._call,
            ranks,
            what,
        )

    # -- the header --------------------------------------------------------------------------

    def header(
        self,
        kind: int,
        *,
        items: int = 0,
        loss: float = 0.0,
        metrics: dict[str, float] | None = None,
        metric_items: Mapping[str, int] | None = None,
        active: bool = False,
        stop: bool = False,
        used: Sequence[bool] | None = None,
        buckets: Sequence[torch.Tensor] = (),
        counted: bool = False,
        meanwhile: Callable[[], None] | None = None,
    ) -> Global:
        """One exchange's header (blocking). Raises `PeerFailed` if a rank failed.

        ``buckets`` (a step's gradients, laid out as `layout`) are summed over the ranks
        in place at the same time, so the header costs no round trip of its own; when a rank
        failed their sums are meaningless, and dropped.

        ``meanwhile`` is called once the all-reduces are started, before waiting for them
        (work that needs neither their result nor the tensors they write). It must not raise:
        the ranks' later collectives (this exchange's and the step's) must still meet, so a
        failure in it is for the caller to keep and raise once they are done. If it raises
        anyway, the all-reduces are waited for before its error goes on.
        """
        counts = metric_items or {}
        # Each metric's (sum, the items behind it): every item, unless told otherwise.
        pairs = {
            name: (float(value), float(counts.get(name, items)))
            for name, value in (metrics or {}).items()
        }
        new = [name for name in pairs if name not in self.names]
        row = self._fill(kind, items, loss, pairs, active, stop, used, failed=False, new=new)
        row[_BUCKETS] = float(bool(buckets))  # sent with the header
        row[_COUNTED] = float(counted)
        size = len(row)
        values = self._header_tensor(row, buckets)
        if self.packed():
            self._all_reduce(values, meanwhile=meanwhile)
            offset = size
            for bucket in buckets:
                bucket.view(-1).copy_(values[offset : offset + bucket.numel()])
                offset += bucket.numel()
        else:
            self._all_reduce(values, buckets, meanwhile=meanwhile)
        # Read back once, as Python floats: each read of a tensor element is a torch call.
        row = values[:size].tolist()
        if row[_BUCKETS] > 0 and not buckets and not self.packed():
            self._join_buckets(None)  # others sent a step's buckets: out of step, or failed
        if row[_FAILED] > 0:
            raise PeerFailed(self._gather_failures(None))
        if round(row[_TRAINER]) != self.tag * self.world_size:
            # Another trainer's exchange, on some rank: its figures (and a step's gradients,
            # summed into this one's) are not this trainer's.
            raise _disagreement(
                "the ranks are in different trainers' calls: this rank's exchange met another "
                "trainer's on some rank. Every rank must make its trainers' calls in the same "
                "order, one at a time (across processes a trainer's call is refused while "
                "another's runs in the same process)"
            )
        got = round(row[_KIND])
        if got != kind * self.world_size:
            other = got - kind  # the other rank's, when there are two
            there = (
                f"the other rank at {_EXCHANGES[other]}"
                if self.world_size == 2 and other in _EXCHANGES
                else "another rank elsewhere"
            )
            resume = RESUME in (kind, other) and self.world_size == 2
            raise _disagreement(
                f"the ranks are out of step: this rank is at {_EXCHANGES[kind]}, {there}; "
                "every rank must make the same calls on its trainer (fit, validate), in the "
                "same order and with the same arguments"
                + (
                    ": give fit the same resume= on every rank (rank 0 reads the checkpoint "
                    "and sends it to the others, which need no file)"
                    if resume
                    else ""
                )
            )
        # The ranks' marks are all the same when the sum of their squares, times the ranks,
        # is their sum squared (each side an integer float64 holds, or rounded alike).
        marked = round(row[_MARKED]) == self.world_size
        if marked and self.world_size * row[_MARK_SQUARED] != row[_MARK] * row[_MARK]:
            assert self.data is not None  # this rank's mark was sent
            name, mark = self.data
            assert mark is not None
            raise _disagreement(
                f"the ranks were given different {name}: this rank's is {mark[1]}, and another "
                "rank's differs. Give every rank the same data: asyncddp takes each rank's "
                "part of it (batches rank, rank + world_size, ...), so parts that differ "
                "would overlap or leave samples out"
            )
        if (
            round(row[_OPTIONED]) == self.world_size
            and self.world_size * row[_OPTIONS_SQUARED] != row[_OPTIONS] * row[_OPTIONS]
        ):
            raise _disagreement(self._options_differ())
        if row[_NEW] > 0:
            row += self._register(new, pairs)
        n = self.params if self._agreed else 0
        sums = row[_FIXED + n :]
        return Global(
            items=round(row[_ITEMS]),
            loss=row[_LOSS],
            active=round(row[_ACTIVE]),
            stop=round(row[_STOP]),
            counted=round(row[_COUNTED]),
            used=[v > 0 for v in row[_FIXED : _FIXED + n]],
            metrics={name: sums[2 * i] for i, name in enumerate(self.names) if sums[2 * i + 1] > 0},
            metric_items={
                name: round(sums[2 * i + 1])
                for i, name in enumerate(self.names)
                if sums[2 * i + 1] > 0
            },
        )

    def packed(self) -> bool:
        """Whether a step's gradients travel inside its header (see `PACK_ELEMENTS`):
        then every header has room for them (zeros when it carries none), so that a rank that
        announces a failure sends what the others' exchange has, whichever it is. Only once
        `setup` found every rank alike."""
        return self._packed

    def _packable(self) -> bool:
        # The gradients are joined to the header on the CPU: not a GPU's (gloo takes them
        # where they are, in buckets of their own), as the ranks' devices are of one kind.
        return (
            self._wire.type == "cpu"
            and all(device.type == "cpu" for device in self.devices)
            and bool(self.layout)
            and sum(n for n, _ in self.layout) <= PACK_ELEMENTS
            and all(dtype.is_floating_point for _, dtype in self.layout)
        )

    def _header_tensor(
        self, row: list[float], buckets: Sequence[torch.Tensor] = ()
    ) -> torch.Tensor:
        """The header to all-reduce: ``row``, followed when `packed` by the step's
        gradients ``buckets`` (zeros without them); on the CPU."""
        header = torch.tensor(row, dtype=torch.float64)
        if not self.packed():
            return header
        if not buckets:
            buckets = [torch.zeros(sum(n for n, _ in self.layout), dtype=torch.float64)]
        # One op: torch.cat promotes every bucket's dtype to the header's float64.
        return torch.cat([header, *(bucket.view(-1) for bucket in buckets)])

    def _fill(
        self,
        kind: int,
        items: int,
        loss: float,
        metrics: Mapping[str, tuple[float, float]],
        active: bool,
        stop: bool,
        used: Sequence[bool] | None,
        *,
        failed: bool,
        new: Sequence[str],
    ) -> list[float]:
        """A header's row, in the fixed layout every rank shares (made in Python and turned
        into a tensor once: a torch call per element costs more than the whole row)."""
        row = [float(kind), float(items), float(loss), float(active), float(failed)]
        row += [float(stop), float(bool(new)), 0.0, 0.0]  # _BUCKETS, _COUNTED: the caller's
        row.append(float(self.tag))
        mark = self.data[1] if self.data is not None and kind in (STEP, VALIDATION) else None
        row += [1.0, float(mark[0]), float(mark[0]) ** 2] if mark else [0.0, 0.0, 0.0]
        if not self._agreed:  # setup's header: the fixed fields alone (see __init__)
            row += [0.0, 0.0, 0.0]  # the options too: setup compares them itself
            return row
        row += [1.0, self._options_mark, self._options_mark**2]
        row += [float(u) for u in used] if used is not None else [0.0] * self.params
        for name in self.names:
            row += metrics.get(name, (0.0, 0.0))
        return row

    @property
    def options(self) -> Mapping[str, str]:
        """The trainer's options a user may assign between calls (``accumulate_grad_batches``,
        ``lr_scheduler_monitor``...), as this rank's call has them: compared in every header
        after the set-up (which compares them with the rest of the trainer)."""
        return self._options

    @options.setter
    def options(self, options: Mapping[str, str]) -> None:
        self._options = dict(options)
        self._options_mark = float(_options_mark(self._options))

    def _options_differ(self) -> str:
        """What a header that found the ranks' `options` apart raises with (every rank found
        it in the same exchange, so every rank is here): the options that differ, and where."""
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, dict(self.options), group=self._group)
        except RuntimeError as error:
            raise self.lost(error) from error
        different, differ = _apart(gathered)
        return (
            f"ranks {different} have trainer options other than rank 0's in this call "
            f"({differ}): an option assigned between calls (trainer.{differ.split(':')[0]} = "
            "...) must be assigned alike on every rank, or the ranks would train apart"
        )

    def _register(self, new: list[str], metrics: Mapping[str, tuple[float, float]]) -> list[float]:
        """Add the metric names some rank saw first; returns their (sum, items) pairs for
        this exchange."""
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, new, group=self._group)
        except RuntimeError as error:
            raise self.lost(error) from error
        added = sorted({name for names in gathered for name in names} - set(self.names))
        extra = torch.tensor(
            [v for name in added for v in metrics.get(name, (0.0, 0.0))],
            dtype=torch.float64,
        )
        if added:
            self._all_reduce(extra)
        self.names.extend(added)
        return extra.tolist()

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` (the checkpoint of ``fit(resume=...)``), on every rank
        (blocking)."""
        self.header(RESUME)  # if rank 0 failed to read it, every rank hears of it here
        box = [value]
        try:
            dist.broadcast_object_list(box, src=0, group=self._group)
        except RuntimeError as error:
            raise self.lost(error) from error
        return box[0]

    # -- gradients ---------------------------------------------------------------------------

    def broadcast_from_rank_0(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0's ``tensors`` into this rank's, in place, from a thread of its own: on a GPU
        it waits for the copies, so that every stream sees them (blocking). A header comes
        first, so that a rank that failed before (or was cancelled while joining) is heard of
        here, as in `share` (under a kind of its own: a rank in `share`, which
        another fit's ``resume`` calls, is out of step with it)."""
        self.header(MODEL)
        self.broadcast_buffers(tensors)
        if self._wire.type == "cuda":
            torch.cuda.synchronize(self._wire)

    def broadcast_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Rank 0's ``buffers`` (BatchNorm statistics) into this rank's, in place, as DDP's
        ``broadcast_buffers``: one broadcast per dtype (blocking). Called in a step's job,
        whose stream orders the copies before the step's later work."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in buffers:
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
        try:
            for group in by_dtype.values():
                flat = torch.cat([buffer.detach().reshape(-1).to(self._wire) for buffer in group])
                dist.broadcast(flat, src=0, group=self._group)
                parts = torch.split(flat, [buffer.numel() for buffer in group])
                with torch.no_grad():
                    for buffer, part in zip(group, parts, strict=True):
                        buffer.copy_(part.view_as(buffer))
        except RuntimeError as error:
            raise self.lost(error) from error

    # -- failures ----------------------------------------------------------------------------

    def announce(self, failure: Failure, timeout: float) -> list[Failure]:
        """Tell the others this rank is raising; returns every rank's failure (blocking).

        The others meet it in whatever exchange they are in. If none comes within ``timeout``
        seconds (they have all finished), gives up and returns this rank's failure alone.
        """
        self.announced = True
        wait = datetime.timedelta(seconds=timeout)
        row = self._fill(0, 0, 0.0, {}, False, False, None, failed=True, new=())
        try:
            sent = self._header_tensor(row).to(self._wire)
            for work in self._issue([sent]):
                work.wait(timeout=wait)
            values = sent.cpu()
            if values[_BUCKETS] > 0 and not self.packed():
                # The others are in a step's exchange: they sum their gradients with the
                # header, so this rank joins with buckets of the same layout.
                self._join_buckets(wait)
            return self._gather_failures(failure)
        except RuntimeError:
            return [failure]

    def _join_buckets(self, wait: datetime.timedelta | None) -> None:
        """All-reduce zero buckets of a step's layout, with the ranks that sent theirs."""
        places = bucket_devices(len(self.layout), self.devices, self._wire, self.backend)
        dummies = [
            torch.zeros(n, dtype=t, device=place)
            for (n, t), place in zip(self.layout, places, strict=True)
        ]
        try:
            for work in self._issue(dummies):
                if wait is None:
                    work.wait()
                else:
                    work.wait(timeout=wait)
        except RuntimeError as error:
            if wait is not None:
                raise  # announce() gives up on its own
            raise self.lost(error) from error

    def _gather_failures(self, mine: Failure | None) -> list[Failure]:
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, mine, group=self._group)
        except RuntimeError as error:
            raise self.lost(error) from error
        return [f for f in gathered if isinstance(f, Failure)]

    def _all_reduce(
        self,
        values: torch.Tensor,
        buckets: Sequence[torch.Tensor] = (),
        *,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Sum ``values`` (a header, on the CPU) and ``buckets`` over the ranks, in place.

        ``meanwhile`` runs between starting the all-reduces and waiting for them (see
        `header`).
        """
        sent = values.to(self._wire)  # the tensor itself when it is there already (gloo)
        timer = self._watch_call()  # the call's first exchange: are the others in the call?
        try:
            self._reduce(sent, buckets, meanwhile)
            if sent is not values:
                values.copy_(sent.cpu())
            # NCCL runs on streams of its own, and a work's wait() only holds this thread's
            # current stream on each device for it: the workers read the sums on streams of
            # their own, on every device a bucket is on (several GPUs in one process), not only
            # the first. (With NCCL, this thread blocks here, not in the waits: the watch too.)
            for device in {t.device for t in (sent, *buckets) if t.is_cuda}:
                torch.cuda.synchronize(device)
        finally:
            if timer is not None:
                timer.cancel()

    def _reduce(
        self,
        sent: torch.Tensor,
        buckets: Sequence[torch.Tensor],
        meanwhile: Callable[[], None] | None,
    ) -> None:
        try:
            works = self._issue([sent, *buckets])
            try:
                if meanwhile is not None:
                    meanwhile()
            finally:  # never leave the collectives writing into tensors the caller reuses
                for work in works:
                    self._wait(work)
        except RuntimeError as error:
            raise self.lost(error) from error

    def _issue(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """Start the all-reduces of ``tensors`` (in pieces of at most ``BUCKET_BYTES``), all at
        once; returns their works, to wait for."""
        works = []
        group = self._group
        for tensor in tensors:
            per = max(1, BUCKET_BYTES // tensor.element_size())
            pieces = [tensor] if tensor.numel() <= per else torch.split(tensor, per)
            for piece in pieces:
                works.append(dist.all_reduce(piece, group=group, async_op=True))
        return works

    def _wait(self, work: Any) -> None:
        """Wait for ``work``, one of an exchange's collectives.

        With 3 or more ranks over gloo, gloo tells of a dead rank only the ranks that talk to
        it at that moment. A rank that waits on a survivor instead, itself in `lost`
        waiting for signs of life, would hear of nothing until that survivor had given up,
        named this rank among the lost, and exited; and it would then name that survivor, its
        store gone with it. So a long wait answers a survivor's roll call and keeps its
        verdict, for `lost` to give once the collective breaks (as it does when that
        survivor leaves): a collective is never left running, as the group could not be left
        while it runs. The all-reduces of headers and gradients wait so, where the ranks spend
        their exchanges; the rarer collectives (gathering failures or metric names,
        broadcasting buffers) wait plainly.
        """
        if (
            self.world_size <= 2
            or self.backend != "gloo"  # NCCL's timed wait blocks, and aborts on its timeout
            or not self._agreed  # the store's keys tell trainers apart once they agreed
            or self._verdict is not None
        ):
            work.wait()
            return
        while True:
            try:
                work.wait(ROLL_CALL_POLL)
                return
            except RuntimeError:
                if work.is_completed():  # failed, or ended right after the wait timed out
                    work.wait()
                    return
            verdict = self._answer_roll_call()
            if verdict is not None:
                self._verdict = (self._incident + 1, verdict)
                work.wait()
                self._verdict = None  # it ended after all: nobody was lost
                return

    def _key(self, what: str, incident: int) -> str:
        # The name tells one trainer's exchanges from another's in the same group.
        return f"asyncddp/{self.name}/{what}/{incident}"

    def lost(self, error: BaseException) -> RankLost:
        """Find out which ranks are gone, after ``error`` broke a collective (blocking).

        With 3 or more ranks, a roll call in the process group's store: each survivor that
        finds a collective broken says it is alive and waits up to ``ALIVE_WAIT`` for the
        others; ranks still waiting in a collective answer it too (see `_wait`) and take
        the verdict of the first survivor that gave one.
        """
        self._incident += 1
        if self.world_size == 2:
            other = 1 - self.rank
            return RankLost([other], self.rank_devices_of(other), _message(error))
        incident = self._incident
        if self._verdict is not None and self._verdict[0] == incident:
            lost, self._verdict = self._verdict[1], None
            return lost
        missing = [0]  # until the store answers: it lives in rank 0's process (see below)
        try:
            store = dist.distributed_c10d._get_default_store()
            if store.check([self._key("verdict", incident)]):  # a survivor gave one already
                return self._verdict_of(store, incident)
            store.set(self._key("call", incident), "1")
            store.set(self._key("alive", incident) + f"/{self.rank}", "1")
            deadline = time.monotonic() + ALIVE_WAIT
            alive = self._key("alive", incident)
            waiting = list(range(self.world_size))
            while waiting and time.monotonic() < deadline:
                waiting = [r for r in waiting if not store.check([f"{alive}/{r}"])]
                missing = waiting
                time.sleep(0.05)
            verdict = json.dumps({"missing": missing, "reason": _message(error)})
            store.compare_set(self._key("verdict", incident), "", verdict)  # the first stays
            return self._verdict_of(store, incident)  # every survivor names the same ranks
        except Exception:
            # The store lives in rank 0's process when the group was started without torchrun.
            # Gone before it answered: rank 0 is what was lost. Gone after: rank 0 answered
            # the roll call, gave its verdict first and went on (its process ended), and the
            # ranks that had not answered by then are the lost ones.
            pass
        return self._rank_lost(missing, _message(error))

    def _answer_roll_call(self) -> RankLost | None:
        """While a collective waits: if a survivor called the roll (`lost`), answer it
        and return its verdict; None if none called it."""
        incident = self._incident + 1
        try:
            store = dist.distributed_c10d._get_default_store()
            if not store.check([self._key("call", incident)]):
                return None
            store.set(self._key("alive", incident) + f"/{self.rank}", "1")
            store.wait([self._key("verdict", incident)], datetime.timedelta(seconds=2 * ALIVE_WAIT))
            return self._verdict_of(store, incident)
        except Exception:
            return None  # no store to ask (rank 0 is gone): the collective breaks by itself

    def _verdict_of(self, store: Any, incident: int) -> RankLost:
        """The verdict a survivor gave on ``incident`` (the first, if several did)."""
        verdict = json.loads(store.get(self._key("verdict", incident)))
        return self._rank_lost([int(rank) for rank in verdict["missing"]], str(verdict["reason"]))

    def _rank_lost(self, missing: Sequence[int], reason: str) -> RankLost:
        devices = [d for r in missing for d in self.rank_devices_of(r)[:1]]
        return RankLost(missing, devices, reason)

    def rank_devices_of(self, rank: int) -> tuple[Device, ...]:
        if rank < len(self.rank_devices) and self.rank_devices[rank]:
            return self.rank_devices[rank]
        return (Device(index=0, torch_device=torch.device("cpu"), name="unknown"),)

    def lost_error(self, lost: RankLost, **where: Any) -> WorkerFailedError:
        rank = lost.ranks[0] if lost.ranks else -1
        device = lost.devices[0] if lost.devices else self.rank_devices_of(rank)[0]
        error = WorkerFailedError(
            device=device,
            rank=rank,
            error_type="ProcessLost",
            error_message=_lost_message(rank, lost.reason),
            **where,
        )
        error.__cause__ = lost
        return error


def _lost_message(rank: int, reason: str) -> str:
    """What a lost rank's error says: why a rank may stop answering, ``reason`` torch's."""
    if "timed out" in reason.lower() or "timeout" in reason.lower():
        return (
            f"rank {rank} did not answer within the process group's timeout (it hung, or it "
            "is not making this call: every rank makes every fit() and validate(), in the "
            f"same order): {reason}"
        )
    return (
        f"rank {rank} stopped answering (its process ended: it died, or finished without "
        f"making this call, which every rank makes; or its host is unreachable): {reason}"
    )


def _apart(settings: list[Mapping[str, str]]) -> tuple[list[int], str]:
    """The ranks whose ``settings`` (one mapping a rank) differ from rank 0's, and how the first
    of them differs (``"name: theirs on rank r, rank 0's on rank 0; ..."``); ``([], "")``
    where all agree."""
    first = settings[0]
    different = [rank for rank, mine in enumerate(settings) if mine != first]
    if not different:
        return [], ""
    theirs = settings[different[0]]
    differ = "; ".join(
        f"{name}: {theirs.get(name)} on rank {different[0]}, {first.get(name)} on rank 0"
        for name in {**first, **theirs}
        if first.get(name) != theirs.get(name)
    )
    return different, differ


def _options_mark(options: Mapping[str, str]) -> int:
    """A number from 1 to 65536 for ``options``, the same on every rank for the same options:
    small enough that a world's sum of its squares is exact in float64."""
    digest = hashlib.blake2b(repr(sorted(options.items())).encode(), digest_size=2).digest()
    return int.from_bytes(digest, "big") + 1


def _disagreement(message: str) -> ConfigurationError:
    """A `ConfigurationError` that every rank raises in the same exchange, which found the
    ranks' calls do not match (see `disagreement`)."""
    error = ConfigurationError(message)
    error.ranks_disagree = True  # type: ignore[attr-defined]
    return error


def disagreement(error: BaseException) -> ConfigurationError | None:
    """The `_disagreement` that ``error`` is or was caused by (raised in a worker's job, a
    step's exchange comes wrapped in a `WorkerFailedError`): the error to raise, on every
    rank, as no device failed."""
    found = find(error, ConfigurationError)
    return found if getattr(found, "ranks_disagree", False) else None


def find(error: BaseException, kind: type[BaseException]) -> Any:
    """``error`` or its cause, if either is a ``kind``."""
    if isinstance(error, kind):
        return error
    if isinstance(error.__cause__, kind):
        return error.__cause__
    return None


def _cancelled(error: BaseException) -> bool:
    return not isinstance(error, Exception)


def clip_and_scale(
    tensors: Sequence[torch.Tensor], scale: float, clip: float | None, want_finite: bool
) -> tuple[float, bool]:
    """The reduced gradients' coefficient (``scale`` times the clipping) and finiteness."""
    coefficient, finite = scale, True
    if clip is not None:
        norm_sq = squared_norm(tensors)
        norm = math.sqrt(norm_sq) * scale
        finite = math.isfinite(norm)
        if finite:
            coefficient = scale * clip_coefficient(norm, clip)
    elif want_finite:
        finite = all_finite(tensors)
    return coefficient, finite
