from __future__ import annotations

import re

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
        (["a", "b", "c"], 3),
        ({}, 0),
        (None, 0),
        ("text", 1),
        (7, 1),
    ],
)
def test_count_items(shard: object, items: int) -> None:
    assert count_items(shard) == items


def test_a_batch_whose_tensors_differ_in_dim_0_names_their_sizes_in_order() -> None:
    from asyncddp import DataError
    from asyncddp._data import items_in

    batch = {"x": torch.zeros(64, 8), "y": (torch.zeros(32, 1), torch.tensor(1.0))}
    expected = "got sizes [64, 32] in {'x': tensor of shape (64, 8), 'y': (tensor of shape (32, 1)"
    with pytest.raises(DataError, match=re.escape(expected)):
        items_in(batch)
