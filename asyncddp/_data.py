"""Batches and shards: counting items, splitting batches across devices, moving them there.

A batch is a tensor, or a tuple, list or dict of them (nested), with the items along dim 0, as
``torch.utils.data.default_collate`` makes them. Tensors with a batch dimension are split, and
so are per-item fields (a list or tuple of one entry an item holding no tensor, as
``default_collate`` makes of strings); other values (numbers, strings, 0-dim tensors) are
handed to every shard as they are.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import UserDict
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sized
from typing import Any, cast

import numpy as np
import torch

from ._exceptions import DataError

__all__ = ["count_items", "items_in", "items_total", "move_to", "pin", "split_batch"]


def count_items(shard: object) -> int:
    """How many items ``shard`` holds.

    - a tensor: its size along dim 0 (a 0-dim tensor is one item);
    - a tuple, list or dict: the dim 0 size of the first tensor in it that has one, depth
      first (0-dim tensors, which `split_batch` hands to every shard whole, are passed over);
      with only 0-dim tensors in it, one item; with no tensor in it, its length;
    - ``None``: no items; anything else: one item.
    """
    if isinstance(shard, torch.Tensor):
        return int(shard.shape[0]) if shard.dim() else 1
    found = _first_tensor_count(shard)
    if found is not None:
        return found
    if shard is None:
        return 0
    if isinstance(shard, (tuple, list, Mapping)):
        return 1 if _holds_tensor(shard) else len(shard)  # 0-dim tensors alone: one item
    return 1


def _children(value: object) -> list[object] | tuple[object, ...] | None:
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (tuple, list)):
        return value
    return None


def _first_tensor_count(value: object) -> int | None:
    """The dim 0 size of the first tensor in ``value`` that has a dim 0, depth first."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else None
    for child in _children(value) or ():
        found = _first_tensor_count(child)
        if found is not None:
            return found
    return None


def _holds_tensor(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return any(_holds_tensor(child) for child in _children(value) or ())


def items_in(batch: object) -> int:
    """The batch size of ``batch``: the common dim-0 size of its tensors.

    Raises:
        DataError: ``batch`` holds no tensor with a batch dimension, or tensors whose dim 0
            sizes differ.
    """
    sizes: set[int] = set()
    stack = [batch]  # a walk without generators: this runs several times a step
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.dim() > 0:
                sizes.add(int(value.shape[0]))
        elif isinstance(value, (tuple, list)):
            stack.extend(value)
        elif isinstance(value, Mapping):
            stack.extend(value.values())
    if not sizes:
        raise DataError(
            f"a batch must hold at least one tensor with a batch dimension (dim 0); got "
            f"{_describe(batch)}. Batches are tensors, or tuples, lists and dicts of tensors"
            + (
                ": make the numbers (or arrays) tensors in the collate_fn, padding sequences of "
                "different lengths to one (torch.nn.utils.rnn.pad_sequence(..., batch_first=True))"
                if _holds_numbers(batch)
                else ": make a dataclass a dict of its fields in the collate_fn ({f.name: "
                "getattr(batch, f.name) for f in dataclasses.fields(batch)}; "
                "dataclasses.asdict would copy every tensor)"
                if dataclasses.is_dataclass(batch)
                else ": give an object of your own as a dict of its tensors (asyncddp splits, "
                "moves and counts the tensors it can see)"
                if _of_its_own(batch)
                else ""
            )
        )
    if len(sizes) > 1:
        shared = (
            "If a tensor in it is shared by every item, not a row for each (class weights, a "
            "(T, T) attention mask, position ids of shape (1, T)), make it in the step, or "
            "expand it to the batch size in the collate_fn"
        )
        if _holds_item_dicts(batch):
            hint = (
                ". If a tuple or list in it holds a dict of tensors for each item (detection "
                "targets, each image's boxes and labels, as torchvision's collate_fn=lambda "
                "items: tuple(zip(*items)) makes), it has no batch dimension, and asyncddp "
                "splits and counts a batch along dim 0: pad each item's tensors to one size "
                "and stack them (torch.nn.utils.rnn.pad_sequence(..., batch_first=True)), "
                "with a count or a mask of each item's valid rows"
            )
        elif (run := _longest_tensor_run(batch)) > 2:
            hint = (
                ". If a tuple or list in it holds one tensor per item (as collate_fn=lambda "
                "items: tuple(zip(*items)) makes), it has no batch dimension: stack the items "
                "into tensors, padding sequences of different lengths to one "
                "(torch.nn.utils.rnn.pad_sequence)" + (f". {shared}" if run <= 4 else "")
                # A few tensors are as likely a batch's fields, one of them shared.
            )
        else:
            hint = (
                ". If it is one sample, not a batch (from a dataset iterated directly, or a "
                "DataLoader with batch_size=None), batch the samples: DataLoader(dataset, "
                f"batch_size=...). {shared}"
            )
        in_order = _sizes_in_order(batch)
        shown = ", ".join(map(str, in_order[:8])) + (
            f", ... {len(in_order)} in all" if len(in_order) > 8 else ""
        )
        raise DataError(
            f"the tensors of a batch must share their size along dim 0 (the batch dimension); "
            f"got sizes [{shown}] in {_describe(batch)}{hint}"
        )
    return sizes.pop()


def _longest_tensor_run(value: object) -> int:
    """The length of the longest tuple or list of tensors alone in ``value`` (0 for none): a
    batch's fields are rarely more than two, items often are."""
    if isinstance(value, Mapping):
        return max((_longest_tensor_run(item) for item in value.values()), default=0)
    if isinstance(value, (tuple, list)):
        own = len(value) if value and all(isinstance(v, torch.Tensor) for v in value) else 0
        return max([own, *(_longest_tensor_run(item) for item in value)])
    return 0


def _of_its_own(value: object) -> bool:
    """Whether ``value`` is an object of a user's own class (a batch class with ``.to()``),
    not a container, tensor or plain value."""
    return not isinstance(value, (torch.Tensor, tuple, list, Mapping, *_PLAIN)) and (
        type(value).__module__ != "builtins"
    )


def _holds_item_dicts(value: object) -> bool:
    """Whether ``value`` is or holds a tuple or list of more than one mapping, each holding
    a tensor: one dict of tensors an item (torchvision's detection targets)."""
    if isinstance(value, Mapping):
        return any(_holds_item_dicts(item) for item in value.values())
    if isinstance(value, (tuple, list)):
        if len(value) > 1 and all(
            isinstance(item, Mapping) and _holds_tensor(item) for item in value
        ):
            return True
        return any(_holds_item_dicts(item) for item in value)
    return False


def check_batch(batch: object, data: object, name: str) -> int:
    """`items_in` for a batch of ``data`` (the argument called ``name``), with a hint when
    ``data`` is a ``Dataset``: it yields single samples, which are rarely batches."""
    try:
        return items_in(batch)
    except DataError as error:
        if not isinstance(data, torch.utils.data.Dataset):
            raise
        raise DataError(
            f"{error}. {name} is a {type(data).__name__}, a Dataset: if its items are single "
            f"samples rather than batches, pass torch.utils.data.DataLoader({name}, "
            "batch_size=...)"
        ) from None


def split_batch(batch: Any, parts: int) -> list[Any]:
    """Split ``batch`` along dim 0 into ``parts`` shards, as even as can be.

    Shard sizes differ by one at most; when the batch has fewer items than ``parts``, the last
    shards are empty (0 items). The shards are views (a sparse COO tensor's are copies). A
    sparse tensor of another layout is refused (`DataError`). A list or tuple as long as the
    batch that holds no tensor, and not numbers and ``None`` alone, is split with it: one entry
    per item (strings, as ``default_collate`` makes of a text field, some of them ``None``;
    each item's words; see `_per_item`). Other lists, tuples and dicts are looked into; any
    other value goes whole to every shard.
    """
    if parts == 1:
        return [batch]  # the one shard is the batch itself (its callers have checked it)
    size = items_in(batch)
    # Item counts that differ by at most one, the larger first, as tensor_split makes them.
    counts = [size // parts + (1 if i < size % parts else 0) for i in range(parts)]
    starts = [sum(counts[:i]) for i in range(parts)]
    return [
        _slice(batch, start, start + count, size)
        for start, count in zip(starts, counts, strict=True)
    ]


def _slice(value: Any, start: int, stop: int, size: int) -> Any:
    if isinstance(value, torch.Tensor):
        if not _splittable(value):
            return value
        if value.layout == torch.strided:
            return value[start:stop]
        if value.layout == torch.sparse_coo:  # no views of a sparse tensor: a copy
            return value.narrow_copy(0, start, stop - start)
        raise DataError(
            f"a tensor of layout {value.layout} in the batch cannot be split along dim 0 "
            "across the devices: make it a sparse COO tensor (.to_sparse()) or a dense one, "
            "or give each device whole batches (split_batches=False)"
        )
    if isinstance(value, Mapping):
        return _same_mapping(value, {k: _slice(v, start, stop, size) for k, v in value.items()})
    if isinstance(value, (tuple, list)) and _per_item(value, size):
        return value[start:stop]
    if isinstance(value, tuple):
        sliced = [_slice(item, start, stop, size) for item in value]
        return type(value)(*sliced) if hasattr(value, "_fields") else tuple(sliced)
    if isinstance(value, list):
        return [_slice(item, start, stop, size) for item in value]
    return value


def _same_mapping(value: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    """A mapping of ``value``'s type holding ``items``: built from them, or else (a
    ``defaultdict``, whose first argument is its factory) a copy of ``value`` updated with
    them, as torch's ``pin_memory`` rebuilds one; a plain dict where neither works. (Not a
    copy first: one that shares its entries with ``value``, a mapping over an inner dict,
    would write every shard into the caller's batch.)"""
    try:
        return type(value)(items)  # type: ignore[call-arg]
    except TypeError:
        pass
    if isinstance(value, MutableMapping):
        try:
            clone = copy.copy(value)
            clone.update(items)
            return clone
        except TypeError:
            pass
    return items


def _per_item(value: list[Any] | tuple[Any, ...], size: int) -> bool:
    """Whether ``value`` holds one entry per item of a batch of ``size`` items: a plain list or
    tuple of that many entries, with no tensor in them at any depth (a text field, as
    ``default_collate`` makes of strings; a field that is ``None`` for some items; each item's
    list of words; each item's dict of metadata; each item's own tuple). Not numbers and
    ``None`` alone (a (height, width) pair, a crop of (224, None): ``default_collate`` would
    have made per-item numbers a tensor), nor lists or tuples each as long as the batch, not
    of numbers alone (`_a_field`): ``default_collate``'s fields of samples holding a pair of
    texts, ``[premises, hypotheses]`` (a list of tuples), or ``zip(*items)``'s, which are
    split one by one instead. That reading wins where the two meet, a batch of 2 items each
    with its own pair of texts (or of n with n words each): ``default_collate`` is every
    ``DataLoader``'s default."""
    return (
        type(value) in (list, tuple)
        and len(value) == size
        and not _numbers_alone(value)
        and not all(_a_field(item, size) for item in value)
        and not _holds_tensor(value)
    )


def _a_field(value: object, size: int) -> bool:
    """Whether ``value`` may be one of ``default_collate``'s fields (or ``zip(*items)``'s) of
    a batch of ``size`` items: a list or tuple of that many entries, not numbers and ``None``
    alone, which ``default_collate`` would have made a tensor (an item's (height, width), its
    box's (x, y, w, h), from a collate_fn of one's own)."""
    if type(value) not in (list, tuple):
        return False
    entries = cast("list[Any] | tuple[Any, ...]", value)
    return len(entries) == size and not _numbers_alone(entries)


def _numbers_alone(entries: list[Any] | tuple[Any, ...]) -> bool:
    """Whether every entry is a number or ``None``: what ``default_collate`` would have made a
    tensor (a (height, width) pair, a crop of (224, None))."""
    return all(isinstance(entry, _NUMBERS) or entry is None for entry in entries)


#: Numbers, Python's and NumPy's (bools too).
_NUMBERS = (int, float, complex, np.number, np.bool_)


def move_to(value: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """Move every tensor in ``value`` to ``device``, keeping the structure. Containers are new
    ones (a mapping rebuilt by `_same_mapping`), so that a step that pops an entry (``labels =
    batch.pop("labels")``) changes neither the data nor the batch a retry runs again; a
    ``UserDict`` (a tokenizer's ``BatchEncoding``) is a copy of itself holding the moved
    entries, so that what it keeps besides them (its encodings) stays with it."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if isinstance(value, Mapping):
        items = {k: move_to(v, device, non_blocking=non_blocking) for k, v in value.items()}
        if isinstance(value, UserDict):
            clone = copy.copy(value)
            clone.__dict__["data"] = items  # as UserDict's own copy sets it: no descriptor
            return clone
        return _same_mapping(value, items)
    if isinstance(value, tuple):
        moved = [move_to(item, device, non_blocking=non_blocking) for item in value]
        if all(a is b for a, b in zip(moved, value, strict=True)):
            return value  # nothing in it moved or was copied: itself, of its own type
        return type(value)(*moved) if hasattr(value, "_fields") else tuple(moved)
    if isinstance(value, list):
        return [move_to(item, device, non_blocking=non_blocking) for item in value]
    return value


def holds_cuda(value: Any) -> bool:
    """Whether ``value`` may hold a tensor on a GPU: a tensor on one, in the containers
    `move_to` walks, or any other object (a dataclass, a graph library's batch), whose tensors
    it cannot see. Plain values (numbers, strings, bytes, ``None``, NumPy's) hold none."""
    if isinstance(value, torch.Tensor):
        return value.is_cuda
    if isinstance(value, Mapping):
        return any(holds_cuda(item) for item in value.values())
    if isinstance(value, (tuple, list)):
        return any(holds_cuda(item) for item in value)
    return not isinstance(value, _PLAIN)


#: Values that hold no tensor (NumPy's arrays and scalars live on the host).
_PLAIN = (int, float, complex, str, bytes, type(None), np.ndarray, np.generic)


def pin(value: Any) -> Any:
    """Page-lock every CPU tensor in ``value``, for fast, asynchronous copies to a GPU."""
    if isinstance(value, torch.Tensor):
        return value.pin_memory() if value.device.type == "cpu" else value
    if isinstance(value, Mapping):
        return _same_mapping(value, {key: pin(item) for key, item in value.items()})
    if isinstance(value, tuple):
        pinned = [pin(item) for item in value]
        return type(value)(*pinned) if hasattr(value, "_fields") else tuple(pinned)
    if isinstance(value, list):
        return [pin(item) for item in value]
    return value


def no_batches(
    name: str, data: object, *, training: bool, counted: bool = False, batches: bool = False
) -> DataError:
    """The error for data that yielded nothing to train or validate on, with the likely cause:
    a ``DataLoader`` whose ``drop_last`` dropped its only, short batch. ``batches``: training
    got batches (on some rank), but no item in them."""
    why = " (the step's 'items' were all 0)" if counted else ""
    if training and batches:
        message = (
            f"{name}'s batches held no items in this epoch{why or ' (every batch empty)'}, "
            "so no optimizer step was taken; give at least one item per epoch"
        )
    elif training:
        message = f"{name} yielded no batches; give at least one batch per epoch"
    else:
        message = f"{name} yielded no items; give at least one batch{why}"
    if isinstance(data, Iterator) and not batches:
        message += (
            f" ({name} is an iterator, such as a generator, which an earlier epoch or call may "
            "have used up: give data that can be read again, a list or a DataLoader)"
        )

    if isinstance(data, torch.utils.data.DataLoader) and data.drop_last:
        dataset = data.dataset
        size = len(dataset) if isinstance(dataset, Sized) else None
        if size is not None and data.batch_size is not None and size < data.batch_size:
            message += (
                f" (its dataset has {size} items, fewer than batch_size={data.batch_size}, and "
                "drop_last=True drops that batch: a smaller batch_size, or drop_last=False)"
            )
    return DataError(message)


def empty_up_front(data: object) -> bool:
    """Whether ``data`` says, without being read, that it holds no batch: an empty list or
    tuple, or a ``DataLoader`` whose ``len()`` is 0. (Other data is only known empty once
    read.)"""
    if isinstance(data, (list, tuple)):
        return not data
    if isinstance(data, torch.utils.data.DataLoader):
        try:
            return len(data) == 0
        except TypeError:  # an IterableDataset without a length
            return False
    return False


def is_batch_list(data: object) -> bool:
    """Whether ``data`` is a list or tuple iterated as one (a subclass may iterate otherwise,
    lazily): batches in memory already, which can be read, and counted, without blocking."""
    return getattr(type(data), "__iter__", None) in (list.__iter__, tuple.__iter__)


def items_total(data: Iterable[Any]) -> int | None:
    """How many items one pass over ``data`` yields, when that can be known without iterating.

    Knows ``torch.utils.data.DataLoader`` (with its ``drop_last``) over a sized dataset, with
    a sized sampler (an iterable dataset's own length counts), and sequences of batches (each
    batch counted). ``None`` otherwise.
    """
    dataset = getattr(data, "dataset", None)
    batch_size = getattr(data, "batch_size", None)
    if dataset is not None and batch_size and hasattr(dataset, "__len__"):
        sampler = getattr(data, "sampler", None)
        if isinstance(dataset, torch.utils.data.IterableDataset):
            if getattr(data, "drop_last", False) and getattr(data, "num_workers", 0) > 1:
                # Each worker batches its own part and drops its own last, short batch: how
                # many items go is the workers' split's to say (32 of 44, in a trial, not 40).
                return None
            size = len(cast("Sized", dataset))
        elif isinstance(sampler, Sized):
            size = len(sampler)
        else:  # a sampler that may draw any number of the dataset's samples
            return None
        if getattr(data, "drop_last", False):
            size = size // batch_size * batch_size
        return size
    if is_batch_list(data):
        try:
            return sum(items_in(batch) for batch in data)
        except DataError:
            return None
    return None


def _splittable(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _sizes_in_order(value: object) -> list[int]:
    """The dim 0 sizes of the tensors in ``value``, in the order `_describe` lists them."""
    if isinstance(value, torch.Tensor):
        return [int(value.shape[0])] if value.dim() > 0 else []
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [size for item in value for size in _sizes_in_order(item)]
    return []


def _describe(value: object, depth: int = 0) -> str:
    """What ``value`` holds, for an error: its tensors' shapes and its other values' types; a
    long sequence shows its first entries and its length, and nesting stops at a depth (a
    batch of 64 lists of 200 token ids came to 58,000 characters)."""
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    if depth > 3 and isinstance(value, (Mapping, tuple, list)):
        return f"{type(value).__name__} of {len(value)}"
    if isinstance(value, Mapping):
        first = itertools.islice(value.items(), 8)
        entries = [f"{k!r}: {_describe(v, depth + 1)}" for k, v in first]
        if len(value) > 8:
            entries.append(f"... {len(value)} in all")
        return "{" + ", ".join(entries) + "}"
    if isinstance(value, (tuple, list)):
        shown = [_describe(item, depth + 1) for item in value[:3]]
        if len(value) > 4:
            shown.append(f"... {len(value)} in all")
        elif len(value) == 4:
            shown.append(_describe(value[3], depth + 1))
        inner = ", ".join(shown)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return type(value).__name__


def _holds_numbers(value: object, depth: int = 0) -> bool:
    """Whether ``value`` holds numbers in a list or tuple (token ids, or NumPy arrays, not
    yet tensors), looking a few levels down."""
    if isinstance(value, np.ndarray):
        return True
    if depth > 3:
        return False
    if isinstance(value, (tuple, list)):
        return any(
            (isinstance(item, (int, float, np.number)) and not isinstance(item, bool))
            or _holds_numbers(item, depth + 1)
            for item in value[:8]
        )
    if isinstance(value, Mapping):
        return any(_holds_numbers(item, depth + 1) for item in itertools.islice(value.values(), 8))
    return False
