from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncddp import Progress, ProgressTracker

# Per-step item counts for a fixed number of devices; a device that ran out of data reports 0.
steps_strategy = st.integers(min_value=1, max_value=8).flatmap(
    lambda devices: st.tuples(
        st.just(devices),
        st.lists(st.lists(st.integers(0, 1000), min_size=devices, max_size=devices), max_size=50),
    )
)


@given(steps_strategy)
def test_counts_are_exact_and_never_go_backwards(case: tuple[int, list[list[int]]]) -> None:
    devices, steps = case
    total = sum(map(sum, steps))
    tracker = ProgressTracker(devices, items_total=total)
    previous = tracker.progress
    assert previous.items_processed == 0
    for step in steps:
        progress = tracker.update(step)
        assert progress.items_processed >= previous.items_processed
        assert all(
            now >= before
            for now, before in zip(progress.device_items, previous.device_items, strict=True)
        )
        assert progress.items_processed == sum(progress.device_items)
        assert progress.steps == previous.steps + 1
        previous = progress
    assert previous.items_processed == total
    assert previous.device_items == tuple(map(sum, zip(*steps, strict=True))) if steps else True
    if total:
        assert previous.fraction == 1.0


@given(st.lists(st.integers(0, 50), min_size=2, max_size=6), st.integers(1, 64))
def test_uneven_shards_that_run_out_keep_counting(shard_sizes: list[int], batch: int) -> None:
    """Burn's counts went backwards once a shard ran out; here a finished shard adds zeros."""
    tracker = ProgressTracker(len(shard_sizes), items_total=sum(shard_sizes))
    left = list(shard_sizes)
    seen = [0]
    while any(left):
        step = [min(batch, remaining) for remaining in left]
        left = [remaining - taken for remaining, taken in zip(left, step, strict=True)]
        seen.append(tracker.update(step).items_processed)
    assert seen == sorted(seen)
    assert seen[-1] == sum(shard_sizes)


def test_rejects_bad_counts() -> None:
    tracker = ProgressTracker(2)
    with pytest.raises(ValueError, match="expected 2 item counts"):
        tracker.update([1])
    with pytest.raises(ValueError, match="cannot be negative"):
        tracker.update([1, -1])
    assert tracker.progress.items_processed == 0  # a rejected update changes nothing
    with pytest.raises(ValueError, match="num_devices"):
        ProgressTracker(0)
    with pytest.raises(ValueError, match="num_devices must be an int >= 1, got '2'"):
        ProgressTracker("2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="items_total"):
        ProgressTracker(1, items_total=-1)
    with pytest.raises(ValueError, match="steps"):
        ProgressTracker(1, steps=-1)


def test_a_continued_count_carries_on_from_its_items_and_steps() -> None:
    tracker = ProgressTracker(2, 20, start=[4, 3], steps=2)
    assert (tracker.progress.items_processed, tracker.progress.steps) == (7, 2)
    progress = tracker.update([2, 1])
    assert (progress.items_processed, progress.device_items, progress.steps) == (10, (6, 4), 3)


def test_progress_reads_well() -> None:
    assert str(Progress(3, 10, (1, 2))) == "3/10 items"
    assert str(Progress(3, None, (3,))) == "3/? items"
    assert Progress(3, None, (3,)).fraction is None
    assert Progress(0, 0, (0,)).fraction is None
    assert Progress(5, 10, (5,)).fraction == 0.5
