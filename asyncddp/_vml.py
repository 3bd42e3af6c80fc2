"""Resolving oneMKL's vector-math dispatch once, on one thread, before CPU workers start.

PyTorch's CPU float unary ops on contiguous tensors (``sqrt``, ``exp``, ``log``, ``tanh``, ...)
call oneMKL's VML (``vmsSqrt(n, x, y, VML_HA | ...)``). oneMKL picks each VML function's kernel
(instruction set and accuracy) lazily, at that function's first call in the process; with the
oneMKL the PyTorch wheels ship (2024.2), first calls made at the same time from several threads
can run the low-accuracy kernel (AVX2, ``VML_EP``: about 12 correct bits) on one of them, for
that one call (pytorch/pytorch#188792, open; oneMKL 2025.0 and later do not show it). CPU
workers make such first calls together: the first optimizer step of a fresh process runs
``exp_avg_sq.sqrt()`` (Adam, AdamW, RMSprop, Adagrad) on every worker at once, and one replica's
first parameter then took a slightly different step (up to 2.8e-4 of the update, 10-80 ulp of
the parameter): the replicas parted, and the fit failed its first-step comparison (caught in 2
of about 1,200 fresh processes of 4 CPU workers; the bad replica's step matched, bit for bit,
Adam with ``sqrt(v) = v * rsqrt_ps(v)``, the low-accuracy kernel's arithmetic).

`warm_vector_math` makes each of those first calls on the calling thread, before any worker
runs, so that the dispatch is resolved when the workers come to it. Once per process; about 4 ms
the first time (oneMKL's own set-up); outputs are unchanged (the same kernels run afterwards).
"""

from __future__ import annotations

import logging
import threading

import torch

__all__ = ["warm_vector_math"]

_log = logging.getLogger("asyncddp")

# The unary ops ATen routes to VML (aten/src/ATen/cpu/vml.h), and a few neighbours: a call that
# does not reach VML costs nothing. Arguments in (0, 1): inside every one's domain.
_OPS = (
    "sqrt", "rsqrt", "exp", "expm1", "log", "log10", "log1p", "log2", "sin", "cos", "tan",
    "asin", "acos", "atan", "sinh", "cosh", "tanh", "erf", "erfc", "erfinv", "lgamma",
    "abs", "trunc", "reciprocal", "sigmoid",
)  # fmt: skip
_DTYPES = (torch.float32, torch.float64)

_lock = threading.Lock()
_warmed = False


def warm_vector_math() -> None:
    """Call each VML-backed unary op once per dtype on this thread (once per process; a fork's
    child inherits the resolved dispatch). Never raises."""
    global _warmed
    with _lock:
        if _warmed:
            return
        _warmed = True
        try:
            with torch.no_grad():
                for dtype in _DTYPES:
                    x = torch.full((16,), 0.5, dtype=dtype)
                    for name in _OPS:
                        getattr(torch, name)(x)
        except Exception:  # a warm-up is never worth a failed start
            _log.debug("asyncddp: warming the vector-math kernels failed", exc_info=True)
