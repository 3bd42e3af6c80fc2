"""Mixed precision: which autocast dtype, and the loss scale that keeps fp16 gradients finite.

``torch.amp.GradScaler`` keeps per-optimizer state and checks each optimizer's gradients on its
own; here every replica has an optimizer but they must all agree, so the scale lives on the
event loop and the finite check runs once, over the *reduced* gradients. The policy is
GradScaler's: start at 2**16, halve and skip the step on inf/NaN, double after 2,000 finite
steps in a row.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import torch

from ._exceptions import ConfigurationError

__all__ = ["LossScaler", "Precision", "autocast_dtype"]

Precision: TypeAlias = Literal[
    "32", "32-true", "bf16", "bf16-mixed", "16", "16-mixed", "fp16", 16, 32
]
"""What `Trainer` takes as ``precision``: ``"32"``, ``"bf16"``, ``"fp16"``, and Lightning's
names and numbers. A setting read as a ``str`` (from a command line, a config file) is passed
as ``cast(asyncddp.Precision, text)``; the Trainer refuses an unknown one as it is built."""

_PRECISIONS: dict[str, torch.dtype | None] = {
    "32": None,
    "32-true": None,
    "bf16": torch.bfloat16,
    "bf16-mixed": torch.bfloat16,
    "16": torch.float16,
    "16-mixed": torch.float16,
    "fp16": torch.float16,
}


def autocast_dtype(precision: Precision | str) -> torch.dtype | None:
    """The autocast dtype for a precision name (Lightning's names work too); None for fp32."""
    try:
        return _PRECISIONS[str(precision)]
    except KeyError:
        names = ", ".join(repr(name) for name in _PRECISIONS)
        raise ConfigurationError(f"unknown precision {precision!r}; use one of {names}") from None


class LossScaler:
    """Dynamic loss scaling for fp16, shared by every replica."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.scale = init_scale
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._good_steps = 0

    def update(self, finite: bool) -> None:
        """Record one step: back off after inf/NaN, grow after enough finite steps."""
        if not finite:
            self.scale *= self.backoff_factor
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
