"""Batches and shards: how many items a shard holds.

A batch is a tensor, or a tuple, list or dict of them (nested), with the items along dim 0, as
``torch.utils.data.default_collate`` makes them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["count_items"]


def count_items(shard: object) -> int:
    """How many items ``shard`` holds.

    - a tensor: its size along dim 0 (a 0-dim tensor is one item);
    - a tuple, list or dict: the count of the first tensor in it, depth first; with no tensor
      in it, its length;
    - ``None``: no items; anything else: one item.
    """
    found = _first_tensor_count(shard)
    if found is not None:
        return found
    if shard is None:
        return 0
    if isinstance(shard, (tuple, list, Mapping)):
        return len(shard)
    return 1


def _first_tensor_count(value: object) -> int | None:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 1
    if isinstance(value, Mapping):
        children: list[object] | tuple[object, ...] = list(value.values())
    elif isinstance(value, (tuple, list)):
        children = value
    else:
        return None
    for child in children:
        found = _first_tensor_count(child)
        if found is not None:
            return found
    return None
