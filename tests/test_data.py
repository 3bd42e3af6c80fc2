from __future__ import annotations

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
