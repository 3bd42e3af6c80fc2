"""Progress counts, and the pure aggregator that keeps them exact and monotonic.

Counting is kept apart from showing (a progress bar or an event stream reads a
`Progress`; it never counts): `ProgressTracker` adds each step's per-device item
counts, so a device that runs out of data simply adds zeros and no total ever goes backwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._checks import check_int
from ._exceptions import ConfigurationError

__all__ = ["Progress", "ProgressTracker"]


@dataclass(frozen=True)
class Progress:
    """How many items have been processed, in all and per device.

    Attributes:
        items_processed: Items processed so far, each counted once. Only ever grows between
            two resets: a `Trainer` counts each epoch (and each validation) from 0, and
            `StepScheduler.reset_progress` starts the count again.
        items_total: Items expected in all, or ``None`` when unknown.
        device_items: Items processed so far by each device, in device order; they sum to
            ``items_processed``. A `Trainer`'s hold its devices' counts, then those of devices
            that trained earlier in the epoch and are gone (dropped by ``on_failure="drop"``,
            or named in a checkpoint resumed in mid-epoch on fewer devices).
        steps: Steps completed since the last reset.
    """

    items_processed: int
    items_total: int | None
    device_items: tuple[int, ...]
    steps: int = 0

    @property
    def fraction(self) -> float | None:
        """``items_processed / items_total``, or ``None`` when the total is unknown or zero."""
        if not self.items_total:
            return None
        return self.items_processed / self.items_total

    def __str__(self) -> str:
        total = "?" if self.items_total is None else str(self.items_total)
        return f"{self.items_processed}/{total} items"


class ProgressTracker:
    """Adds up per-device item counts, step by step.

    Not thread-safe: it belongs to the event loop thread, which alone updates it.

    Args:
        num_devices: How many devices report counts.
        items_total: Items expected in all, when known.
        start: Items already counted per device (a run continued in mid-epoch).
        steps: Steps already counted (the same run's).
    """

    def __init__(
        self,
        num_devices: int,
        items_total: int | None = None,
        *,
        start: Sequence[int] | None = None,
        steps: int = 0,
    ) -> None:
        num_devices = check_int("num_devices", num_devices, 1)
        items_total = check_int("items_total", items_total, 0, none=True)
        if start is not None and (len(start) != num_devices or any(c < 0 for c in start)):
            raise ConfigurationError(
                f"start must hold {num_devices} counts >= 0, got {list(start)}"
            )
        # ``start``: counts carried over, for example from before a resume in mid-epoch.
        self._device_items = list(start) if start is not None else [0] * num_devices
        self._items_total = items_total
        self._steps = check_int("steps", steps, 0)

    def update(self, step_items: Sequence[int], *, step: bool = True) -> Progress:
        """Add one step's item counts (one per device, zero for a device that had none);
        ``step=False`` for items that made no step (there was nothing to learn from)."""
        if len(step_items) != len(self._device_items):
            raise ConfigurationError(
                f"expected {len(self._device_items)} item counts (one per device), "
                f"got {len(step_items)}"
            )
        for count in step_items:
            if count < 0:
                raise ConfigurationError(f"item counts cannot be negative, got {list(step_items)}")
        for i, count in enumerate(step_items):
            self._device_items[i] += count
        self._steps += step
        return self.progress

    @property
    def progress(self) -> Progress:
        """The counts so far."""
        return Progress(
            items_processed=sum(self._device_items),
            items_total=self._items_total,
            device_items=tuple(self._device_items),
            steps=self._steps,
        )
