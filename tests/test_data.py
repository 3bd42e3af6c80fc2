from __future__ import annotations

import collections
import functools
import re
import threading
from collections import UserDict, defaultdict
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from asyncddp._data import count_items


@pytest.mark.parametrize(
    ("shard", "items"),
    [
        (torch.zeros(5, 3), 5),
        (torch.zeros(0, 3), 0),
        (torch.tensor(1.0), 1),
        ((torch.zeros(4, 2), torch.zeros(4)), 4),
        ({"x": torch.zeros(3, 2), "y": torch.zeros(3)}, 3),
        ({"meta": {"ids": [1, 2]}, "x": torch.zeros(6)}, 6),
        ([[torch.zeros(2)], torch.zeros(9)], 2),
        # A 0-dim tensor is handed to every shard whole (split_batch): not a count of items.
        ({"temperature": torch.tensor(0.7), "x": torch.zeros(3, 2)}, 3),
        ((torch.tensor(2), [torch.zeros(0, 4)]), 0),
        ((torch.tensor(0.5), torch.tensor(0.7)), 1),
        (["a", "b", "c"], 3),
        ({}, 0),
        (None, 0),
        ("text", 1),
        (7, 1),
    ],
)
def test_count_items(shard: object, items: int) -> None:
    assert count_items(shard) == items


def test_per_item_fields_are_split_with_their_items_whatever_their_entries() -> None:
    # A reference list with a None in it went whole to every device, beside its share of
    # the tensors (a step zipping ids and references paired them wrongly); each item's word
    # list went whole too, and one as long as the batch was cut across the devices.
    from asyncddp._data import split_batch

    batch = {
        "ids": torch.arange(4),
        "refs": ["r0", None, "r2", 3],
        "words": [["a", "b"], ["w0", "w1", "w2", "w3"], ["c"], ["d", "e", "f"]],
        "meta": [{"source": "x"}, {}, {"source": "y"}, {}],
        "size": (224, 224, 3, 3),  # numbers alone: whole, though as long as the batch
        "labels": [np.int64(i) for i in range(4)],  # NumPy's numbers alone too
        "tags": ["train", ["a", "b", "c", "d"]],  # not one entry an item: looked into
        # default_collate's of samples holding a pair of texts: each field split
        "pair": [["p0", "p1", "p2", "p3"], ["h0", "h1", "h2", "h3"]],
    }
    first, second = split_batch(batch, 2)
    assert second["ids"].tolist() == [2, 3]
    assert second["refs"] == ["r2", 3]
    assert second["words"] == [["c"], ["d", "e", "f"]]
    assert first["words"] == [["a", "b"], ["w0", "w1", "w2", "w3"]]
    assert second["meta"] == [{"source": "y"}, {}]
    assert first["size"] == second["size"] == batch["size"]  # whole, on each device
    assert first["labels"] == second["labels"] == batch["labels"]
    assert second["tags"] == ["train", ["c", "d"]]
    assert second["pair"] == [["p2", "p3"], ["h2", "h3"]]
    # A batch of two: a pair of fields, each one entry an item, is not taken for per-item
    # entries, as lists or as the tuples default_collate makes; a setting of numbers and None
    # is not cut; each item's own pair, in a dict, stays the item's, and so does each item's
    # (height, width) pair of numbers, which default_collate would have made a tensor.
    pairs = [
        torch.arange(2),
        [["p0", "p1"], ["h0", "h1"]],
        (224, None),
        [("p0", "p1"), ("h0", "h1")],
        [{"pair": ("q0", "a0")}, {"pair": ("q1", "a1")}],
        [(480, 640), (300, None)],
    ]
    first, second = split_batch(pairs, 2)
    assert second[1] == [["p1"], ["h1"]]
    assert first[2] == second[2] == pairs[2]
    assert second[3] == [("p1",), ("h1",)]
    assert second[4] == [{"pair": ("q1", "a1")}]
    assert (first[5], second[5]) == ([(480, 640)], [(300, None)])


@pytest.mark.anyio
@pytest.mark.parametrize("size", [2, 3, 4])
async def test_default_collates_pair_of_texts_reaches_each_device_with_its_items(
    size: int,
) -> None:
    # default_collate makes a sample's pair of texts [premises, hypotheses], a list of two
    # tuples: in a batch of two, each tuple was taken for one item's pair, and one device got
    # both premises, the other both hypotheses, beside one item's tensors each, without a word.
    import asyncddp

    samples = [
        {"id": torch.tensor(i), "x": torch.randn(4), "pair": (f"premise{i}", f"hypothesis{i}")}
        for i in range(size)
    ]
    loader = torch.utils.data.DataLoader(samples, batch_size=size)
    seen: list[tuple[list[int], Any]] = []

    def step(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        seen.append((batch["id"].tolist(), batch["pair"]))
        return model(batch["x"]).square().mean()

    trainer = asyncddp.Trainer(
        torch.nn.Linear(4, 1),
        functools.partial(torch.optim.SGD, lr=0.1),
        step,
        devices=asyncddp.cpu_devices(2),
        progress_bar=False,
    )
    await trainer.fit(loader, epochs=1)
    assert len(seen) == 2
    for ids, (premises, hypotheses) in seen:
        assert list(premises) == [f"premise{i}" for i in ids]
        assert list(hypotheses) == [f"hypothesis{i}" for i in ids]


class Encoded(UserDict[str, Any]):
    """A tokenizer's batch (as ``BatchEncoding``): entries, and encodings beside them."""

    def __init__(self, data: dict[str, Any] | None = None, encodings: Any = None) -> None:
        super().__init__(data)
        self.encodings = encodings


class ReadOnlyDict(dict[str, Any]):
    """A dict that refuses writes once built (as PyPI's ``frozendict``)."""

    def __setitem__(self, key: str, value: Any) -> None:
        raise TypeError("read-only")

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("read-only")


class OwnMapping(MutableMapping[str, Any]):
    """A batch class of one's own over a dict of its own."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._data[key] = value

    def __delitem__(self, key: str) -> None:
        del self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["encoded", "dict", "own mapping", "read-only", "counter"])
async def test_a_batch_reaches_the_step_as_its_own_type_and_a_pop_changes_no_data(
    kind: str,
) -> None:
    # On one CPU device a batch needs no split and no move, yet it was rebuilt from its
    # entries: a BatchEncoding's encodings were dropped (word_ids() then blamed the
    # tokenizer). Each job still gets new containers, so that a step popping an entry finds
    # it again in the next epoch and in a retry, a read-only dict is no write's target, and a
    # Counter's counts are not added to themselves (a first fix broke these three).
    import asyncddp
    from asyncddp.testing import failing_step

    def entries() -> dict[str, Any]:
        return {"x": torch.randn(4, 3), "y": torch.randn(4, 1), "meta": {"source": "a"}}

    batch: Any = {
        "encoded": Encoded(entries(), encodings=["e0", "e1"]),
        "dict": entries(),
        "own mapping": OwnMapping(entries()),
        "read-only": ReadOnlyDict(entries()),
        "counter": {**entries(), "counts": collections.Counter({"a": 1})},
    }[kind]
    seen: list[Any] = []

    def step(model: torch.nn.Module, shard: Any) -> torch.Tensor:
        seen.append(shard)
        assert type(shard) is type(batch)
        if kind == "encoded":
            assert shard.encodings == ["e0", "e1"]
        if kind == "counter":
            assert shard["counts"] == {"a": 1}
        shard["meta"]["source"] = "b"
        if kind != "read-only":
            shard.pop("y")  # a step that takes its targets out, as Hugging Face's do
        return model(shard["x"]).square().mean()

    trainer = asyncddp.Trainer(
        torch.nn.Linear(3, 1),
        functools.partial(torch.optim.SGD, lr=0.1),
        # The first step fails once the step has run, and is retried.
        failing_step(step, device=0, at=0, where="metric", times=1),
        devices="cpu",
        on_failure="retry",
        progress_bar=False,
    )
    await trainer.fit([batch], epochs=2)
    assert len(seen) == 3
    assert {"x", "y", "meta"} <= set(batch)
    assert batch["meta"] == {"source": "a"}


def test_a_batch_whose_tensors_differ_in_dim_0_names_their_sizes_in_order() -> None:
    from asyncddp import DataError
    from asyncddp._data import items_in

    batch = {"x": torch.zeros(64, 8), "y": (torch.zeros(32, 1), torch.tensor(1.0))}
    expected = "got sizes [64, 32] in {'x': tensor of shape (64, 8), 'y': (tensor of shape (32, 1)"
    with pytest.raises(DataError, match=re.escape(expected)):
        items_in(batch)


def test_a_batch_of_per_item_tensors_is_told_to_stack_them() -> None:
    from asyncddp import DataError
    from asyncddp._data import items_in

    images = tuple(torch.zeros(3, 8, 8) for _ in range(4))  # collate_fn=tuple(zip(*items))
    labels = tuple(torch.zeros(1) for _ in range(4))
    with pytest.raises(DataError, match=r"one tensor per item .* stack the items into tensors"):
        items_in((images, labels))
    with pytest.raises(DataError) as caught:
        items_in((torch.zeros(4, 2), torch.zeros(3)))  # fields, not items: no hint
    assert "per item" not in str(caught.value)


def test_a_batch_with_class_weights_or_detection_targets_is_told_what_to_do_with_them() -> None:
    # Three tensors read as items only: the class weights beside the inputs and targets were
    # never named as the tensor to make in the step. Each image's dict of boxes and labels was
    # told of "one sample, not a batch" and of attention masks.
    from asyncddp import DataError
    from asyncddp._data import items_in

    weights = torch.tensor([1.0, 2.0, 0.5])
    with pytest.raises(
        DataError, match=r"shared by every item, not a row for each \(class weights"
    ):
        items_in((torch.zeros(8, 4), torch.zeros(8), weights))
    targets = [{"boxes": torch.zeros(n, 4), "labels": torch.zeros(n)} for n in (1, 2, 3, 1)]
    with pytest.raises(DataError) as caught:
        items_in((torch.zeros(4, 3, 8, 8), targets))
    assert "holds a dict of tensors for each item (detection targets" in str(caught.value)
    assert "one sample, not a batch" not in str(caught.value)


def test_a_dataclass_or_an_object_of_ones_own_as_a_batch_is_told_to_be_a_dict() -> None:
    # Refused as "Batches are tensors, or tuples, lists and dicts of tensors" and no more:
    # Lightning and Accelerate take them (they move what has a .to(), and split nothing).
    import dataclasses

    from asyncddp import DataError
    from asyncddp._data import items_in

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor

    class Moved:
        def __init__(self) -> None:
            self.x = torch.zeros(4)

        def to(self, device: torch.device) -> Moved:
            return self

    with pytest.raises(DataError, match=re.escape("for f in dataclasses.fields(batch)}")):
        items_in(Batch(torch.zeros(4)))
    with pytest.raises(DataError, match="give an object of your own as a dict of its tensors"):
        items_in(Moved())
    with pytest.raises(DataError) as caught:
        items_in("text")
    assert "of your own" not in str(caught.value)


def test_a_batch_of_token_lists_is_told_to_pad_them_in_few_words() -> None:
    # 64 lists of about 200 token ids: a message of 58,000 characters ("int, int, ..."),
    # which did not say to pad.
    from asyncddp import DataError
    from asyncddp._data import items_in

    ragged = [list(range(150 + i % 5)) for i in range(64)]
    with pytest.raises(DataError) as caught:
        items_in(ragged)
    message = str(caught.value)
    assert len(message) < 600
    assert "[[int, int, int, ... 150 in all], [int, int, int, ... 151 in all]" in message
    assert "... 64 in all]" in message
    assert "pad_sequence" in message
    tensors = [torch.zeros(100 + i) for i in range(64)]  # 64 ragged tensors
    with pytest.raises(DataError) as caught:
        items_in({"input_ids": tensors, "labels": torch.zeros(64)})
    message = str(caught.value)
    assert len(message) < 700
    assert "got sizes [100, 101, 102, 103, 104, 105, 106, 107, ... 65 in all]" in message
    assert "pad_sequence" in message


def test_a_batch_described_in_an_error_stays_short_whatever_its_shape() -> None:
    # A dict of 5,000 entries made a 104,000-character message; lists nested past the
    # interpreter's recursion limit raised RecursionError while the message was made.
    from asyncddp import DataError
    from asyncddp._data import items_in

    with pytest.raises(DataError) as caught:
        items_in({f"feature{i}": 1.0 for i in range(5000)})
    assert len(str(caught.value)) < 600
    assert "... 5000 in all}" in str(caught.value)
    deep: list[Any] = [1]
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(DataError):
        items_in(deep)
    with pytest.raises(DataError, match="make the numbers \\(or arrays\\) tensors"):
        items_in([np.zeros(3), np.zeros(4)])


def test_a_tensor_shared_by_every_item_is_told_to_be_made_in_the_step() -> None:
    # A (T, T) causal mask beside the batch was told it was one sample, not a batch.
    from asyncddp import DataError
    from asyncddp._data import items_in

    batch = {"input_ids": torch.zeros(4, 6), "mask": torch.ones(6, 6)}
    with pytest.raises(DataError, match=r"shared by every item, .* make it in the step"):
        items_in(batch)


def test_a_sparse_coo_tensor_in_a_batch_is_split_and_other_sparse_layouts_are_refused() -> None:
    from asyncddp import DataError
    from asyncddp._data import split_batch

    dense = torch.eye(5)
    shards = split_batch((torch.arange(5), dense.to_sparse()), 2)
    assert [shard[1].to_dense().tolist() for shard in shards] == [
        dense[:3].tolist(),
        dense[3:].tolist(),
    ]
    with pytest.warns(UserWarning, match="Sparse CSR tensor support is in beta"):
        csr = dense.to_sparse_csr()  # torch's own warning
    with pytest.raises(DataError, match=r"layout torch.sparse_csr .*split_batches=False"):
        split_batch((torch.arange(5), csr), 2)


class _FrozenMapping(Mapping):  # type: ignore[type-arg]
    """A read-only mapping that cannot be built from a dict."""

    def __init__(self, **items: object) -> None:
        self._items = items

    def __getitem__(self, key: str) -> object:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class _InnerDict(MutableMapping):  # type: ignore[type-arg]
    """A mapping over a dict of its own (a shallow copy shares it)."""

    def __init__(self, items: dict[str, object] | None = None, **more: object) -> None:
        self.data = {**(items or {}), **more}

    def __getitem__(self, key: str) -> object:
        return self.data[key]

    def __setitem__(self, key: str, value: object) -> None:
        self.data[key] = value

    def __delitem__(self, key: str) -> None:
        del self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


def test_mapping_batches_keep_their_type_where_it_can_be_rebuilt() -> None:
    # A defaultdict (a collate_fn's) takes its factory first, not a dict: it is copied and
    # updated, keeping the factory, as torch's pin_memory does; a mapping that can be neither
    # copied and updated nor built from a dict becomes a plain dict.
    from asyncddp._data import move_to, split_batch

    batch = defaultdict(list, x=torch.arange(4), ids=["a", "b", "c", "d"])
    shards = split_batch(batch, 2)
    assert [type(shard) for shard in shards] == [defaultdict, defaultdict]
    assert shards[1]["x"].tolist() == [2, 3]
    assert shards[1]["ids"] == ["c", "d"]
    assert shards[1].default_factory is list
    assert batch["x"].tolist() == [0, 1, 2, 3]  # the batch itself is left as it was
    moved = move_to(shards[0], torch.device("meta"))
    assert type(moved) is defaultdict
    assert moved["x"].device.type == "meta"
    assert move_to(batch, torch.device("meta"))["missing"] == []
    shards = split_batch(_FrozenMapping(x=torch.arange(4)), 2)
    assert [type(shard) for shard in shards] == [dict, dict]
    assert shards[1]["x"].tolist() == [2, 3]
    # One that keeps its entries in an inner dict, which a copy shares: built anew, not
    # copied and updated, which wrote every shard into the caller's batch.
    inner = _InnerDict(x=torch.arange(4))
    shards = split_batch(inner, 2)
    assert [shard["x"].tolist() for shard in shards] == [[0, 1], [2, 3]]
    assert inner["x"].tolist() == [0, 1, 2, 3]


# -- where the data is read ----------------------------------------------------------------------


class _LazyList(list):  # type: ignore[type-arg]
    """A list whose iteration is its own (it might load each item as it goes)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from super().__iter__()


class _PlainList(list):  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize(
    ("data", "inline"),
    [
        ([1, 2], True),
        ((1, 2), True),
        (_PlainList([1, 2]), True),  # iterated as a list is
        (_LazyList([1, 2]), False),  # its own __iter__ may block
        (iter([1, 2]), False),
        (range(2), False),
        (torch.utils.data.DataLoader([1, 2]), False),
    ],
)
def test_only_lists_and_tuples_iterated_as_such_are_read_in_place(
    data: object, inline: bool
) -> None:
    from asyncddp._ranks import in_memory, rank_view

    assert in_memory(data) is inline  # type: ignore[arg-type]
    if not isinstance(data, torch.utils.data.DataLoader):
        assert in_memory(rank_view(data, 1, 2, seed=0)) is inline  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_prefetcher_read_in_place_transforms_notes_errors_and_closes() -> None:
    from asyncddp._loader import Prefetcher

    def numbers() -> object:
        yield 1
        yield 2
        raise KeyError("item 3")

    async with Prefetcher(numbers(), transform=lambda x: x * 10, name="nums", inline=True) as p:
        assert [await p.__anext__(), await p.__anext__()] == [10, 20]
        with pytest.raises(KeyError, match="item 3") as caught:
            await p.__anext__()
        assert caught.value.__notes__ == ["raised while iterating nums"]
    closed = Prefetcher([1, 2, 3], inline=True)
    async with closed:
        assert await closed.__anext__() == 1
    with pytest.raises(StopAsyncIteration):
        await closed.__anext__()  # once closed, nothing more


class _Evens(torch.utils.data.Sampler[int]):
    """A sampler with no length: the even indices of ``size``."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[int]:
        return iter(range(0, self.size, 2))


class _Stream(torch.utils.data.IterableDataset[torch.Tensor]):
    def __len__(self) -> int:
        return 10

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.zeros(10, 2))


def test_items_total_is_unknown_for_a_sampler_of_no_length() -> None:
    from asyncddp._data import items_total

    data = torch.utils.data.TensorDataset(torch.zeros(20, 2))
    loader = torch.utils.data.DataLoader
    # It used to count the dataset: progress then ended at 10 of 20.
    assert items_total(loader(data, batch_size=4, sampler=_Evens(20))) is None
    assert items_total(loader(data, batch_size=4, sampler=range(0, 20, 2))) == 10
    assert items_total(loader(data, batch_size=4, sampler=range(0, 20, 2), drop_last=True)) == 8
    assert items_total(loader(data, batch_size=4, shuffle=True)) == 20
    assert items_total(loader(_Stream(), batch_size=4)) == 10  # an iterable dataset's own length
    assert items_total(loader(_Stream(), batch_size=4, drop_last=True)) == 8
    # Each of 2 workers drops its own short batch: 32 of 44 items went in a trial, progress
    # said 40. (The loader is not iterated: no worker starts.)
    assert items_total(loader(_Stream(), batch_size=4, num_workers=2, drop_last=True)) is None
    assert items_total(loader(data, batch_sampler=[[0, 1], [2]])) is None


class _SharedIterator:
    """Data whose every iter() is one iterator, as a ``DataLoader`` with ``persistent_workers``
    hands out; its second next() waits for ``gate``. Counts the threads inside next() at once."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate
        self.given = 0
        self.inside = 0
        self.most_inside = 0
        self.lock = threading.Lock()
        self.waiting = threading.Event()

    def __iter__(self) -> _SharedIterator:
        return self

    def __next__(self) -> int:
        with self.lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            if self.given == 1:
                self.waiting.set()
                assert self.gate.wait(60.0)
            self.given += 1
            return self.given
        finally:
            with self.lock:
                self.inside -= 1


@pytest.mark.anyio
async def test_a_prefetcher_closed_inside_next_returns_and_the_next_one_waits_for_that_call(
    release: threading.Event,
) -> None:
    from asyncddp._loader import Prefetcher

    data = _SharedIterator(release)
    timer = threading.Timer(5.0, release.set)  # ends a wait for the gate all the same
    timer.start()
    try:
        async with Prefetcher(data, depth=1) as first:
            assert await first.__anext__() == 1  # its thread goes on into next(), and waits
            assert await anyio.to_thread.run_sync(data.waiting.wait, 10.0)
        assert not release.is_set()  # closing did not wait for that next()
    finally:
        timer.cancel()
    got: list[int] = []

    async def read_again() -> None:
        async with Prefetcher(data, depth=1) as second:
            got.append(await second.__anext__())

    async with anyio.create_task_group() as group:
        group.start_soon(read_again)
        await anyio.sleep(0.2)
        assert data.most_inside == 1  # the second waits for the first one's call to end
        release.set()
    assert got == [3]  # the 2nd item went to the first one's thread, and was dropped
    assert data.most_inside == 1


def test_a_batch_count_is_given_only_where_it_is_exact() -> None:
    # A stopped fit closes the epoch when this count says its data is used up: a guess would
    # skip batches.
    from torch.utils.data import DataLoader, Sampler, TensorDataset

    from asyncddp._ranks import batch_count, rank_view

    class Evens(Sampler[int]):  # a sampler of the user's own: its len() is theirs
        def __iter__(self) -> Iterator[int]:
            return iter(range(0, 10, 2))

        def __len__(self) -> int:
            return 5

    dataset = TensorDataset(torch.zeros(10, 2))
    assert batch_count([1, 2, 3]) == 3
    assert batch_count(rank_view([1, 2, 3], 1, 2, seed=0)) == 1
    assert batch_count(DataLoader(dataset, batch_size=4, shuffle=True)) == 3
    assert batch_count(rank_view(DataLoader(dataset, batch_size=4), 1, 2, seed=0)) == 1
    assert batch_count(DataLoader(dataset, batch_size=4, sampler=Evens())) is None
    assert batch_count(iter([1, 2])) is None


def test_the_mark_ranks_compare_tells_batchings_of_one_dataset_apart() -> None:
    # Ranks given other data (another batch size, a part split by hand) each trained on their
    # part of their own, overlapping and leaving samples out: the ranks compare this mark.
    from torch.utils.data import DataLoader, TensorDataset

    from asyncddp._ranks import data_mark

    dataset = TensorDataset(torch.zeros(10, 2))
    mark = data_mark(DataLoader(dataset, batch_size=4, shuffle=True))
    assert mark is not None
    assert mark[1] == "a DataLoader of 3 batches (batch_size 4) over 10 samples"
    assert data_mark(DataLoader(dataset, batch_size=4)) == mark  # a new loader, shuffled or not
    others = [
        DataLoader(dataset, batch_size=5),
        DataLoader(dataset, batch_size=4, drop_last=True),
        DataLoader(TensorDataset(torch.zeros(9, 2)), batch_size=4),
    ]
    assert len({mark[0], *(data_mark(other)[0] for other in others)}) == 4  # type: ignore[index]
    assert data_mark([1, 2, 3]) == (data_mark([4, 5, 6])[0], "a list of 3 batches")  # type: ignore[index]
    assert data_mark([1, 2, 3]) != data_mark([1, 2])
    assert data_mark(iter([1, 2])) is None  # nothing known without iterating: not compared


def test_a_batch_may_hold_a_gpu_tensor_unless_every_part_of_it_is_seen() -> None:
    # On a lone GPU a step reports with its backward still queued, unless its batch is on a
    # GPU already (the backward reads tensors another stream made): a batch whose tensors
    # asyncddp cannot see (a dataclass, a graph library's batch) may be, so it is not early.
    import dataclasses

    from asyncddp._data import holds_cuda

    @dataclasses.dataclass
    class Batch:
        inputs: torch.Tensor

    cpu = torch.zeros(2, 3)
    assert not holds_cuda((cpu, {"mask": cpu, "note": "text", "n": 2, "w": 0.5}, [None, b""]))
    assert not holds_cuda({"ids": np.arange(3), "count": np.int64(3)})
    assert holds_cuda(Batch(cpu))
    assert holds_cuda((cpu, Batch(cpu)))
    assert holds_cuda({"graph": object()})
