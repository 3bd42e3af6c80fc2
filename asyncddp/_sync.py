"""Gradient reduction across replicas, in flat buckets, and step backups.

Every replica keeps its gradients in flat buffers (one per dtype), each parameter's ``.grad``
a view into it, so autograd accumulates straight into the buckets and reducing them is a few
large operations rather than one per parameter (as DDP's ``gradient_as_bucket_view``).

A lone replica (one device, one process: nothing to reduce) keeps no buffers: its gradients
are set to ``None`` when a step opens, as ``optimizer.zero_grad()`` does, so that autograd
hands over the gradients it computed instead of adding them into zeroed buffers (with the
backup copied ahead, one device went from +26.5% to +14.7% of a plain loop on the benchmarks'
MLP: ``python bench/ab.py 4953c32``, in docs/benchmarks.md).

The in-process all-reduce runs on the devices' own workers, every device at once, in one pass
(`all_reduce_chunk`): worker ``i`` sums chunk ``i`` of every replica's buffer, scales it
(item weighting, loss-scale undo), writes the sum into chunk ``i`` of every replica, and
reports its squared norm and whether it is finite. With 2 replicas each chunk is read once from
each and written once into each: the bytes of 2 copies, the least an all-reduce of 2 buffers in
one memory can move (each further replica adds a pass over the owner's chunk, which sums them).
The workers then meet (or the step's jobs end) before any optimizer step: optimizers may write
``.grad`` in place (SGD with Nesterov momentum does, with ``foreach``), so no worker may touch a
peer's buffer once that peer steps. Within the pass the workers write disjoint chunks, so it
needs no locks. (A first in-place version, in which each owner summed into its own chunk and the
peers read it from there before stepping, raced with exactly that in-place write.)

Across processes a reduced chunk is exchanged with the other ranks before the replicas take it,
and so the two steps are apart there: `reduce_scatter` sums each chunk into a scratch
buffer of its owner, the ranks all-reduce the scratch buffers, and `all_gather` copies
every scratch chunk into each replica's buffer (peers read scratch buffers, never a live
``.grad``).
"""

from __future__ import annotations

import collections
import copy
import math
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

__all__ = [
    "FlatGrads",
    "StepBackup",
    "all_finite",
    "all_gather",
    "all_reduce_chunk",
    "bucket_layout",
    "chunk_bounds",
    "clip_coefficient",
    "group_settings",
    "reduce_scatter",
    "restore_group_settings",
    "scale_grads",
    "squared_norm",
]


def chunk_bounds(numel: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` near-equal slices of ``range(numel)``."""
    return numel * index // parts, numel * (index + 1) // parts


def clip_coefficient(norm: float, clip: float) -> float:
    """What to multiply gradients of global L2 ``norm`` by to clip them to ``clip`` (as
    ``torch.nn.utils.clip_grad_norm_``); 1.0 when they are within it."""
    return clip / (norm + 1e-6) if norm > clip else 1.0


def bucket_layout(params: Sequence[nn.Parameter], parts: int) -> list[tuple[int, torch.dtype]]:
    """The sizes and dtypes of the tensors a process all-reduces across ranks each step:
    every replica's reduced chunk of each flat buffer (with ``parts`` replicas), or the whole
    buffers of a single replica, in the order `FlatGrads` builds them."""
    sizes: dict[torch.dtype, int] = {}
    for param in params:
        sizes[param.dtype] = sizes.get(param.dtype, 0) + param.numel()
    if parts == 1:
        return [(numel, dtype) for dtype, numel in sizes.items()]
    layout = []
    for index in range(parts):
        for dtype, numel in sizes.items():
            start, stop = chunk_bounds(numel, parts, index)
            layout.append((stop - start, dtype))
    return layout


class FlatGrads:
    """One replica's gradients, in flat buffers with each ``.grad`` a view into them.

    Args:
        params: The replica's trainable parameters, in a fixed order shared by all replicas.
        parts: How many replicas reduce together (the number of chunks per buffer).
        index: This replica's position, which chunk it owns.
        loose: A lone replica that nothing reads from (``parts`` must be 1): no buffers, each
            ``.grad`` a tensor of its own, ``None`` after `zero_`, as in a plain loop.
    """

    def __init__(
        self, params: Sequence[nn.Parameter], parts: int, index: int, *, loose: bool = False
    ) -> None:
        if loose and parts != 1:
            raise ValueError(f"only a lone replica keeps loose gradients, not one of {parts}")
        self.params = list(params)
        self.parts = parts
        self.index = index
        self.loose = loose
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for param in self.params:
            by_dtype.setdefault(param.dtype, []).append(param)
        self.buffers: list[torch.Tensor] = []
        self._places: list[tuple[nn.Parameter, torch.Tensor]] = []  # each one's flat slice
        for dtype, group in by_dtype.items() if not loose else ():
            buffer = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=group[0].device)
            offset = 0
            for param in group:
                self._places.append((param, buffer[offset : offset + param.numel()]))
                offset += param.numel()
            self.buffers.append(buffer)
        self._views = self._made_views()
        # This replica's reduced chunks across processes (see reduce_scatter): made there.
        self.scratch: list[torch.Tensor] = []
        self.attach()

    def _made_views(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        return [(param, _grad_view(flat, param)) for param, flat in self._places]

    def rebind(self) -> None:
        """Make each ``.grad`` view into the buffers anew. A cast in place of the model,
        ``model.double()`` then ``.float()``, sets the data of the ``.grad`` tensor itself
        (torch's ``Module._apply``: ``param.grad.data = ...``): the view object stays
        ``param.grad`` but no longer lies in the buffer, the backward wrote where the
        reduction did not read, and that replica parted from the others. The new views are the
        ``.grad`` of their parameters; the values the old ones held (the last step's reduced
        gradients) are not kept: the next step's window zeroes them as it opens, and no window
        is open as a call starts."""
        self._views = self._made_views()
        for param, view in self._views:
            param.grad = view

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def tensors(self) -> list[torch.Tensor]:
        """What holds the gradients: the buffers, or a loose replica's ``.grad`` tensors."""
        if not self.loose:
            return self.buffers
        return [param.grad for param in self.params if param.grad is not None]

    def attach(self) -> None:
        """Make every ``.grad`` a view into the buffers again (keeping its values); nothing
        to do for a loose replica."""
        for param, view in self._views:
            grad = param.grad
            if grad is view:
                continue
            if grad is not None:
                view.copy_(grad)
            param.grad = view

    def zero_(self) -> None:
        """Zero the gradients (a loose replica's become ``None``)."""
        if self.loose:
            for param in self.params:
                param.grad = None
        for buffer in self.buffers:
            buffer.zero_()

    def own_scratch(self) -> list[torch.Tensor]:
        """The scratch buffers for this replica's reduced chunks, made on first use."""
        if not self.scratch and self.parts > 1:
            self.scratch = [
                torch.empty_like(self.chunk(b, self.index)) for b in range(len(self.buffers))
            ]
        return self.scratch

    def chunk(self, buffer: int, owner: int) -> torch.Tensor:
        start, stop = chunk_bounds(self.buffers[buffer].numel(), self.parts, owner)
        return self.buffers[buffer][start:stop]


def _grad_view(flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``flat`` (``param.numel()`` elements) as ``param``'s gradient, laid out as ``param`` is
    where that layout is dense (a ``channels_last`` convolution's weight), as autograd lays
    out a gradient and as DDP's buckets do: a contiguous ``.grad`` of a channels-last weight
    made torch warn that the gradient layout contract was broken, in every step."""
    strides = grad_layout(param)
    return flat.view_as(param) if strides is None else flat.as_strided(param.size(), strides)


def grad_layout(param: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of ``param``'s gradient in the flat buffers, where they are not the
    row-major ones: across processes every rank's must be the same, as the ranks sum the
    buffers element by element (see `Comm.setup`'s fingerprint)."""
    if param.is_contiguous() or not _dense(param):
        return None
    return tuple(param.stride())


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill a block of memory once each, in some order of its
    dimensions (as ``torch.empty_like`` keeps such a layout)."""
    expected = 1
    for stride, size in sorted(
        (st, sz) for st, sz in zip(tensor.stride(), tensor.shape, strict=True) if sz != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _async_copy(source: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether a copy between two devices' tensors may be asynchronous: between GPUs, where the
    worker's stream orders it and the meeting's stream sync ends it. Not when either side is
    the CPU: a CPU worker has no stream to wait on (and a copy from a GPU into pageable CPU
    memory could be read before it lands)."""
    return source.device.type == "cuda" and target.device.type == "cuda"


def _on(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` on ``like``'s device (itself when it is there already)."""
    return tensor.to(like.device, non_blocking=_async_copy(tensor, like))


def _checks(
    reduced: Sequence[torch.Tensor], want_norm: bool, want_finite: bool
) -> tuple[float, bool]:
    """The squared norm of ``reduced`` (0.0 unless ``want_norm``) and whether it is all finite
    (True unless ``want_finite``): each is one more pass over it, so only what clipping or
    loss scaling needs is computed."""
    if want_norm:
        norm_sq = squared_norm(reduced)
        return norm_sq, math.isfinite(norm_sq)  # an inf or NaN anywhere makes the norm one
    return 0.0, all_finite(reduced) if want_finite else True


def all_reduce_chunk(
    replicas: Sequence[FlatGrads],
    index: int,
    scale: float,
    *,
    want_norm: bool,
    want_finite: bool = False,
) -> tuple[float, bool]:
    """Worker ``index``'s share of the in-process all-reduce: sum chunk ``index`` of every
    replica's buffers, scale it, and write it into chunk ``index`` of every replica.

    The sum is made in this worker's own replica's chunk (its own value first, then the
    others' in replica order) and copied into the others'. Every worker must be done before
    any replica steps (see the module's notes). Returns the reduced chunk's squared norm and
    whether it is finite (see `_checks`); the checks cover all of it, as each chunk has
    one owner.
    """
    own = replicas[index]
    if len(replicas) == 1:  # no peers: it scales its own gradients in place
        return _checks(scale_grads(own, scale), want_norm, want_finite)
    others = [replica for replica in replicas if replica is not own]
    reduced = []
    for b in range(len(own.buffers)):
        total = own.chunk(b, index)
        for other in others:
            total.add_(_on(other.chunk(b, index), total))
        if scale != 1.0:
            total.mul_(scale)
        for other in others:
            chunk = other.chunk(b, index)
            chunk.copy_(total, non_blocking=_async_copy(total, chunk))
        reduced.append(total)
    return _checks(reduced, want_norm, want_finite)


def scale_grads(grads: FlatGrads, coefficient: float) -> list[torch.Tensor]:
    """Multiply a replica's gradients by ``coefficient`` in place (a loose replica's: one
    tensor a parameter, one fused op); returns the tensors that hold them."""
    tensors = grads.tensors()
    if coefficient != 1.0 and tensors:
        torch._foreach_mul_(tensors, coefficient)
    return tensors


def reduce_scatter(
    replicas: Sequence[FlatGrads],
    index: int,
    scale: float,
    *,
    want_norm: bool,
    want_finite: bool = False,
) -> tuple[float, bool]:
    """Across processes, step 1 on worker ``index``: sum chunk ``index`` of every replica into
    a scratch buffer of this replica's (see `FlatGrads.own_scratch`), for the ranks to
    exchange and the replicas to take in `all_gather`.

    The sum goes to a scratch buffer that peers read in the all-gather, while each owner may
    already be stepping its optimizer: optimizers may write ``.grad`` in place (SGD with
    Nesterov momentum does, with ``foreach``), so peers must never read another replica's live
    ``.grad`` in that step. A single replica scales its own gradients in place. Returns what
    `_checks` does for the reduced chunk.
    """
    own = replicas[index]
    if len(replicas) == 1:
        reduced = scale_grads(own, scale)
    else:
        reduced = own.own_scratch()
        for b, scratch in enumerate(reduced):
            # Each chunk moved to this device only when it is added (one at a time on a GPU).
            chunks = (_on(replica.chunk(b, index), scratch) for replica in replicas)
            torch.add(next(chunks), next(chunks), out=scratch)
            for chunk in chunks:
                scratch.add_(chunk)
            if scale != 1.0:
                scratch.mul_(scale)
    return _checks(reduced, want_norm, want_finite)


def _by_device(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by device (the reduced tensors of several devices' replicas may
    come together), so that each group is one sync."""
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return list(groups.values())


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every value of ``tensors`` is finite: the largest magnitude of each, one sync a
    device. An empty tensor has no largest value (torch refuses it) and is finite."""
    for group in _by_device(t for t in tensors if t.numel()):
        largest = torch._foreach_norm(group, math.inf)
        if not bool(torch.isfinite(torch.stack(largest)).all()):
            return False
    return True


def squared_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The squared L2 norm of ``tensors`` together: one sync a device (the tensors of several
    devices' replicas may come together here). 16-bit floats are summed in float32, where
    their squares cannot overflow; wider ones in their own dtype (torch refuses a float32 norm
    of float64 tensors). The square is taken in Python, in double precision."""
    total = 0.0
    for group in _by_device(tensors):
        norms = [
            torch.linalg.vector_norm(t, dtype=torch.float32) for t in group if t.element_size() < 4
        ]
        wide = [t for t in group if t.element_size() >= 4]
        if wide:
            norms.extend(torch._foreach_norm(wide, 2))
        norm = float(torch.linalg.vector_norm(torch.stack(norms)))
        total += norm * norm
    return total


def all_gather(replicas: Sequence[FlatGrads], index: int, coefficient: float) -> None:
    """Across processes, step 2 on worker ``index``: fill its buffers from every owner's
    scratch (exchanged with the other ranks since `reduce_scatter`), scaled."""
    own = replicas[index]
    if len(replicas) == 1:
        scale_grads(own, coefficient)
        return
    for b in range(len(own.buffers)):
        for owner, replica in enumerate(replicas):
            target = own.chunk(b, owner)
            source = _on(replica.scratch[b], target)
            if coefficient != 1.0:
                torch.mul(source, coefficient, out=target)
            else:
                target.copy_(source)


_PLAIN = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device)
#: Values a backup keeps as they are (see `_snapshot`); where `reachable` stops.
_KEPT = (*_PLAIN, nn.Module, nn.Parameter)


def reachable(value: Any, limit: int = 100_000) -> Iterator[Any]:
    """The objects ``value`` holds, itself first, depth first, each once: through lists,
    tuples, sets, deques, dicts (keys and values) and objects' ``__dict__``, not into
    tensors or modules (``limit`` objects at most)."""
    seen: set[int] = set()
    stack = [value]
    while stack and len(seen) < limit:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        if isinstance(item, (torch.Tensor, *_KEPT)):
            continue
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(item)
        else:
            stack.extend(getattr(item, "__dict__", {}).values())


def _snapshot(value: Any, params: Sequence[torch.Tensor]) -> Any:
    """A copy of an optimizer state's value that is not a tensor, for a backup: a number or a
    string as it is (nothing changes it in place); anything else (a custom optimizer's list or
    deque of statistics, changed in place by a step) copied deeply, as ``copy.deepcopy``
    copies (cycles, shared references and subclasses kept), the parameters and modules it
    refers to kept as themselves (and a value that cannot be copied kept as it is)."""
    if isinstance(value, _KEPT):
        return value
    memo: dict[int, Any] = {id(p): p for p in params}
    memo.update((id(x), x) for x in reachable(value) if isinstance(x, (nn.Module, nn.Parameter)))
    try:
        return copy.deepcopy(value, memo)
    except Exception:
        return value


@dataclass
class _Copy:
    """Copies of parameters and optimizer state tensors, and what they were copied from."""

    params: list[torch.Tensor]
    state: list[dict[str, Any] | None]  # per parameter; tensors copied, other values as they were
    # Each copied tensor and its version counter when copied: a copy made ahead of a step is
    # still good if every one is the same tensor, unchanged.
    sources: list[tuple[torch.Tensor, int]]
    # How many of the parameters had an entry in the optimizer's state: one with more
    # entries holds some under other keys (`_extra_state`).
    present: int = 0

    def still_current(
        self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer
    ) -> bool:
        if len(self.params) != len(params):
            return False
        live: list[torch.Tensor] = list(params)
        for param, state in zip(params, self.state, strict=True):
            now = optimizer.state.get(param)
            if not now:
                if state is not None:
                    return False
                continue
            if state is None or now.keys() != state.keys():
                return False
            live.extend(v for v in now.values() if isinstance(v, torch.Tensor))
        return len(live) == len(self.sources) and all(
            tensor is source and tensor._version == version
            for tensor, (source, version) in zip(live, self.sources, strict=True)
        )

    def refresh(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Take the state's non-tensor values (a step count, a list of statistics) as they
        are now."""
        for param, state in zip(params, self.state, strict=True):
            if state is not None:
                for key, value in optimizer.state[param].items():
                    if not isinstance(value, torch.Tensor):
                        state[key] = _snapshot(value, params)


def _fits(buffer: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``buffer`` can hold a copy of ``value``."""
    return (
        buffer.shape == value.shape
        and buffer.dtype == value.dtype
        and buffer.device == value.device
    )


def _copy_part(
    targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], part: tuple[int, int]
) -> None:
    """Copy part ``index`` of ``parts`` of ``sources`` into ``targets`` (contiguous): near-equal
    slices of all their elements in row-major order, taken end to end. Where the parts fall
    depends on the tensors' sizes only, never on their memory layout, so a capture and a
    restore cut them alike even if a step changed a tensor's layout."""
    index, parts = part
    total = sum(t.numel() for t in targets)
    start, stop = chunk_bounds(total, parts, index)
    into, froms = [], []
    offset = 0
    for target, source in zip(targets, sources, strict=True):
        size = target.numel()
        low, high = max(start, offset), min(stop, offset + size)
        if low < high:
            into.append(target.view(-1)[low - offset : high - offset])
            # A view of a contiguous source; a copy of a source laid out otherwise.
            froms.append(source.reshape(-1)[low - offset : high - offset])
        offset += size
    if into:
        torch._foreach_copy_(into, froms)


def _copy_tensors(
    params: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    reuse: _Copy | None,
    *,
    track: bool = False,
    part: tuple[int, int] | None = None,
) -> _Copy:
    """Copy ``params`` and the optimizer's state for them, into ``reuse``'s buffers if every
    one fits (so that after the first steps a copy allocates nothing), else into new ones
    (`_fresh`). With ``track``, keep each
    source and its version counter as it was before the copy (a copy made ahead); otherwise
    keep no reference to them (a replaced optimizer state must be let go). With ``part``
    (index, parts), copy only that part of the tensors' elements (`_copy_part`): the
    buffers are whole, the rest of them stale."""
    sources = [(p, p._version) for p in params] if track else []
    values = [p.detach() for p in params]
    fitting: list[torch.Tensor | None] = (
        list(reuse.params)
        if reuse is not None and len(reuse.params) == len(params)
        else [None] * len(params)
    )
    slots: list[tuple[dict[str, Any], str]] = []  # where each state tensor's buffer goes
    states: list[dict[str, Any] | None] = []
    present = 0
    for i, param in enumerate(params):
        state = optimizer.state.get(param)
        if state is not None:
            present += 1
        if not state:
            states.append(None)
            continue
        previous = reuse.state[i] if reuse is not None and i < len(reuse.state) else None
        kept: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if track:
                    sources.append((value, value._version))
                buffer = previous.get(key) if previous else None
                fits = isinstance(buffer, torch.Tensor) and _fits(buffer, value)
                fitting.append(buffer if fits else None)
                values.append(value.detach())
                slots.append((kept, key))
                kept[key] = None  # its place among the keys: the order the tensors are copied in
            else:
                kept[key] = _snapshot(value, params)
        states.append(kept)
    # The old buffers are reused only if every one fits and none is left over; else all are
    # made anew: a block kept for the buffers that still fit would keep the slots of those
    # replaced or dropped too, and, where another buffer then needed a block of its own at each
    # step, one more block each step (a state changing shape each step, as a review measured:
    # 7.6 MB more a step).
    whole = (
        reuse is not None
        and all(buffer is not None for buffer in fitting)
        and len(fitting) == len(_saved_tensors(reuse))
    )
    buffers = cast(list[torch.Tensor], fitting) if whole else _fresh(values)
    for (kept, key), buffer in zip(slots, buffers[len(params) :], strict=True):
        kept[key] = buffer
    if part is None:
        torch._foreach_copy_(buffers, values)
    else:
        _copy_part(buffers, values, part)
    return _Copy(buffers[: len(params)], states, sources, present)


def _fresh(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous buffers shaped as ``values``, in their order: views into one block a dtype
    and device. A backup in parts writes only its part of them (see `StepBackup.capture`),
    and the pages of the rest stay unbacked only in a block of its own: a buffer each, under
    glibc's 32 MB threshold, reused freed memory, which is resident already (a resources
    trial: 4 CPU devices of a model of 16 MB weights kept 2.8 backups' worth, not 1)."""
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for value in values:
        if _plain(value):
            where = value.dtype, value.device
            sizes[where] = sizes.get(where, 0) + value.numel()
    blocks = {where: torch.empty(n, dtype=where[0], device=where[1]) for where, n in sizes.items()}
    offsets = dict.fromkeys(blocks, 0)
    made = []
    for value in values:
        if not _plain(value):  # a subclass, sparse or quantized: a buffer of its own kind
            made.append(torch.empty_like(value, memory_format=torch.contiguous_format))
            continue
        where = value.dtype, value.device
        start = offsets[where]
        offsets[where] = start + value.numel()
        made.append(blocks[where][start : start + value.numel()].view(value.shape))
    return made


def _plain(value: torch.Tensor) -> bool:
    """Whether ``value`` is a dense CPU tensor of torch's own classes, whose buffer is a view
    into a shared block. (On a GPU the backup is whole, and a block would only be one more
    large allocation for the caching allocator to fit.)"""
    return (
        type(value) in (torch.Tensor, nn.Parameter)
        and value.layout == torch.strided
        and not value.is_quantized
        and value.device.type == "cpu"
    )


def _saved_tensors(copy: _Copy) -> list[torch.Tensor]:
    """A copy's tensors in the order `_copy_tensors` copied them."""
    tensors = list(copy.params)
    for state in copy.state:
        if state is not None:
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


@dataclass
class _Saved:
    tensors: _Copy
    groups: list[dict[str, Any]]
    scheduler: dict[str, Any] | None
    # The optimizer state's entries under keys that are not these parameters (a custom
    # optimizer's global step count, say; torch's state_dict saves them too), copied.
    extra: dict[Any, Any]
    # A capture in parts (see StepBackup.capture): every part's backup, this one's included,
    # held weakly: held so, the backups of a step's replicas kept each other in a cycle that
    # outlived their trainer until the cycle collector ran (GBs of copies in a sweep of
    # trainers). The trainer holds every replica's backup while it may restore one.
    peers: tuple[weakref.ref[StepBackup], ...] = ()


class StepBackup:
    """A copy of parameters and optimizer state taken before a step, to undo a failed one.

    Buffers are kept between steps, so after the first step a backup allocates nothing.

    `prepare` copies the tensors ahead, once the previous step has reported (for one
    CPU device in one process, where the copy takes the worker's own time, while the event
    loop handles that step's results); `capture` then keeps that copy if every tensor
    is still the one it was copied from, unchanged (by its version counter), and copies afresh
    otherwise. A copy made ahead goes into buffers of its own, as the last capture may still
    have to be restored (a cancellation that comes as the step ends undoes it): with it, a
    backup holds two copies. Changes made through ``.data`` leave no version behind; a copy
    made ahead is dropped when a fit, validate or checkpoint call starts (`forget_ahead`).
    """

    def __init__(self) -> None:
        self._saved: _Saved | None = None  # what restore() goes back to
        self._ahead: _Copy | None = None  # made by prepare(), for the next capture()
        self._spare: _Copy | None = None  # buffers for the next prepare()

    def prepare(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Copy the tensors now, for the next `capture`. Never raises: without the copy,
        the capture copies."""
        reuse, self._ahead, self._spare = self._ahead or self._spare, None, None
        try:
            self._ahead = _copy_tensors(params, optimizer, reuse, track=True)
        except Exception:
            self._spare = reuse

    def forget(self) -> None:
        """Drop every copy: with ``atomic_steps`` turned off since, an undo must not find a
        backup of an earlier step and put the model a step back."""
        self._saved = self._ahead = self._spare = None

    def forget_ahead(self) -> None:
        """Drop a copy made ahead (the tensors may change in ways it cannot tell)."""
        if self._ahead is not None:
            self._ahead.sources = []
            self._spare, self._ahead = self._ahead, None

    def capture(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
        *,
        peers: Sequence[StepBackup] = (),
    ) -> None:
        """Back up ``params``, the optimizer's state for them, its hyperparameters and the LR
        scheduler's state.

        With ``peers`` (the backups of every replica of a step, this one among them, at its
        index), each replica copies only its part of the tensors' elements, and a restore
        takes each part from its peer: for replicas that are identical before the step, one
        copy between them instead of one each. Every peer must capture before any replica
        steps (the trainer's replicas meet in between), and only whole captures are restored
        from alone.
        """
        ahead, self._ahead = self._ahead, None
        old = self._saved.tensors if self._saved is not None else None
        part = (list(map(id, peers)).index(id(self)), len(peers)) if peers else None
        if ahead is not None and part is None and ahead.still_current(params, optimizer):
            ahead.refresh(params, optimizer)
            tensors, self._spare = ahead, old
        else:
            tensors = _copy_tensors(params, optimizer, old, part=part)
            self._spare = ahead or self._spare
        tensors.sources = []  # from here on only restored from, never checked
        if self._spare is not None:
            self._spare.sources = []
        groups = [group_settings(group) for group in optimizer.param_groups]
        self._saved = _Saved(
            tensors,
            groups,
            scheduler.state_dict() if scheduler is not None else None,
            {key: _snapshot(value, params) for key, value in _extra_state(optimizer)}
            if len(optimizer.state) > tensors.present
            else {},
            tuple(map(weakref.ref, peers)),
        )

    @staticmethod
    def _restore_parts(
        refs: Sequence[weakref.ref[StepBackup]], targets: list[torch.Tensor]
    ) -> None:
        """Fill ``targets`` from a backup in parts: each part from the peer that copied it.
        A target laid out otherwise than contiguously is filled through a contiguous buffer
        (parts are slices in row-major order, see `_copy_part`)."""
        flat = [
            t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
            for t in targets
        ]
        for index, ref in enumerate(refs):
            peer = ref()
            assert peer is not None, "a backup in parts restored after a peer's replica went"
            assert peer._saved is not None, "a backup in parts restored before its capture"
            _copy_part(flat, _saved_tensors(peer._saved.tensors), (index, len(refs)))
        for target, buffer in zip(targets, flat, strict=True):
            if buffer is not target:
                target.copy_(buffer)

    def restore(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
    ) -> bool:
        """Put the parameters, optimizer state, group settings and LR scheduler back as the
        capture saved them; returns whether there was one (none with ``atomic_steps=False``)."""
        saved = self._saved
        if saved is None:
            return False
        self.forget_ahead()
        targets = [p.detach() for p in params]
        for param, state in zip(params, saved.tensors.state, strict=True):
            if state is None:
                optimizer.state.pop(param, None)
                continue
            live = optimizer.state.setdefault(param, {})
            for key in list(live):
                if key not in state:
                    del live[key]
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    live[key] = _snapshot(value, params)  # the saved copy stays as it was
                    continue
                target = live.get(key)
                if not isinstance(target, torch.Tensor) or not _fits(target, value):
                    live[key] = target = torch.empty_like(value)
                targets.append(target)
        with torch.no_grad():
            if not saved.peers:
                torch._foreach_copy_(targets, _saved_tensors(saved.tensors))
            else:
                self._restore_parts(saved.peers, targets)
        for key, _ in _extra_state(optimizer):
            if key not in saved.extra:
                del optimizer.state[key]
        for key, value in saved.extra.items():
            optimizer.state[key] = _snapshot(value, params)
        for group, hyper in zip(optimizer.param_groups, saved.groups, strict=True):
            restore_group_settings(group, hyper)
        if scheduler is not None and saved.scheduler is not None:
            scheduler.load_state_dict(saved.scheduler)
        return True


def _extra_state(optimizer: torch.optim.Optimizer) -> list[tuple[Any, Any]]:
    """The optimizer state's entries under keys that are not tensors (none in torch's own
    optimizers; a custom one's ``self.state["global"]``), which torch's ``state_dict`` saves
    as they are."""
    return [
        (key, value) for key, value in optimizer.state.items() if not isinstance(key, torch.Tensor)
    ]


def group_settings(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings, which an optimizer or LR scheduler step may change (``lr``;
    ``momentum`` or ``betas`` in a cycle), with tensors copied: a tensor ``lr`` is changed in
    place (``fill_``)."""
    return {
        key: value.clone() if isinstance(value, torch.Tensor) else value
        for key, value in group.items()
        if key != "params"
    }


def restore_group_settings(group: dict[str, Any], saved: dict[str, Any]) -> None:
    """Put back what `group_settings` saved: a tensor in place, as the optimizer and its
    scheduler share it."""
    for key, value in saved.items():
        current = group.get(key)
        if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
            current.copy_(value)
        else:
            group[key] = value
