"""Devices: which devices a scheduler runs on, checked before any thread starts.

A `Device` is one worker's device. Several workers may compute on the same physical
device: `cpu_devices` makes ``n`` virtual CPU devices (``cpu#0`` ... ``cpu#{n-1}``), which
is how tests, CI and notebooks without a GPU run the real multi-device code paths.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

import torch

from ._checks import warn_user
from ._exceptions import DeviceError, DeviceTypeError

__all__ = ["Device", "DeviceSpec", "cpu_devices", "resolve_devices"]


@dataclass(frozen=True)
class Device:
    """One worker's device.

    Attributes:
        index: The device's position among the scheduler's workers (0, 1, ...).
        torch_device: Where the worker computes, for example ``torch.device("cuda", 1)``.
        name: How messages, thread names and events call it: ``"cuda:1"``, ``"cpu"``, or
            ``"cpu#0"`` for the first of several virtual CPU devices.
    """

    index: int
    torch_device: torch.device
    name: str

    @property
    def type(self) -> str:
        """``"cuda"`` or ``"cpu"``, as in ``torch.device.type``."""
        return self.torch_device.type

    @property
    def is_cuda(self) -> bool:
        """Whether the worker computes on a CUDA GPU."""
        return self.torch_device.type == "cuda"

    def __str__(self) -> str:
        return self.name


# A union, not a string: a user's own annotations with it resolve (typing.get_type_hints).
DeviceSpec: TypeAlias = (
    str | int | torch.device | Device | Iterable[str | int | torch.device | Device]
)
"""What ``devices=`` takes (`Trainer`, `StepScheduler`): a string (``"auto"``, ``"cpu"``,
``"cuda:1"``), an int (that many devices), a ``torch.device``, a `Device`, or a sequence of these
(``asyncddp.cpu_devices(2)``, ``["cuda:0", "cuda:1"]``); `resolve_devices` says what each
means."""

CPU_HINT = "use asyncddp.cpu_devices(2) for two CPU workers"


def _cuda_device_count() -> int:
    # One place to ask, so that tests can pretend to have GPUs.
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cpu_devices(n: int) -> tuple[Device, ...]:
    """Make ``n`` virtual CPU devices: ``n`` workers that all compute on the CPU.

    Args:
        n: How many workers, at least 1.

    Returns:
        Devices named ``cpu#0`` ... ``cpu#{n-1}``.

    Raises:
        DeviceTypeError: ``n`` is not an int.
        DeviceError: ``n`` is smaller than 1, or larger than 1024 (each device is a
            thread).
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise DeviceTypeError(f"cpu_devices(n) takes an int, got {type(n).__name__} {n!r}")
    if n < 1:
        raise DeviceError(f"cpu_devices(n) needs n >= 1, got {n}")
    _check_cpu_count(n)
    cpu = torch.device("cpu")
    return tuple(Device(index=i, torch_device=cpu, name=f"cpu#{i}") for i in range(n))


def resolve_devices(spec: DeviceSpec) -> tuple[Device, ...]:
    """Turn a device spec into the devices a scheduler or trainer runs on.

    Accepted specs:

    - ``"auto"``: every visible CUDA GPU, or the CPU when there is none.
    - ``"cuda"``: every visible CUDA GPU. ``"cpu"``: the CPU, one worker.
    - ``"cuda:N"``, ``torch.device("cuda", N)``: that GPU. ``"cpu#N"``: a virtual CPU device.
      ``"cpu:N"`` is the CPU, as torch reads it.
    - an int ``n``: ``n`` devices: the first ``n`` GPUs, or ``n`` virtual CPU devices (at most
      1024) when no GPU is visible, so that a script written for GPUs also runs on a laptop.
    - a sequence of the above, where an int means a CUDA index (``[0, 2]`` is ``cuda:0`` and
      ``cuda:2``), as in Lightning.
    - `Device` values, for example from `cpu_devices`.

    Args:
        spec: The devices to use.

    Returns:
        The devices, with ``index`` numbered by position.

    Raises:
        DeviceTypeError: ``spec`` or one of its items is of a type asyncddp cannot read.
        DeviceError: no devices, a device given twice, an unknown string, or a CUDA device
            that does not exist (or any CUDA device where CUDA is missing).
    """
    if isinstance(spec, (str, int, torch.device, Device)):
        found = _resolve_one(spec, top_level=True)
    elif isinstance(spec, Iterable) and not isinstance(
        spec, (bytes, bytearray, Mapping, set, frozenset)
    ):
        found = []
        for item in spec:
            if not isinstance(item, (str, int, torch.device, Device)):
                raise DeviceTypeError(
                    f"cannot read {type(item).__name__} {item!r} as a device; "
                    "give a string such as 'cuda:0', an int, a torch.device or an asyncddp.Device"
                )
            found.extend(_resolve_one(item, top_level=False))
    elif isinstance(spec, (set, frozenset)):
        raise DeviceTypeError(
            f"devices cannot be a {type(spec).__name__}: it has no order, and every process "
            "must number the devices alike; give a list"
        )
    else:
        raise DeviceTypeError(
            f"cannot read {type(spec).__name__} {spec!r} as devices; give 'auto', 'cuda', "
            "'cpu', 'cuda:N', an int, a torch.device, or a list of these"
        )
    if not found:
        raise DeviceError(f"no devices in {spec!r}; give at least one, or 'auto'")
    seen: set[str] = set()
    for _torch_device, name in found:
        if name in seen:
            raise DeviceError(
                f"device {name} is given twice in {spec!r}; each device gets one worker. "
                f"For several workers on the CPU, {CPU_HINT}"
            )
        seen.add(name)
    if "cpu" in seen and any(name.startswith("cpu#") for name in seen):
        # Two workers on one CPU, named as if one were the whole CPU and the other a share.
        raise DeviceError(
            f"'cpu' (the CPU as one device) is given with virtual CPU devices ('cpu#N') in "
            f"{spec!r}; for several workers on the CPU, {CPU_HINT}"
        )
    return tuple(
        Device(index=i, torch_device=torch_device, name=name)
        for i, (torch_device, name) in enumerate(found)
    )


def _resolve_one(
    spec: str | int | torch.device | Device, *, top_level: bool
) -> list[tuple[torch.device, str]]:
    if isinstance(spec, Device):
        # Checked like any other spec: a Device can be built by hand.
        if spec.torch_device.type == "cpu":
            return [(spec.torch_device, spec.name)]
        return _resolve_one(spec.torch_device, top_level=False)
    if isinstance(spec, bool):
        raise DeviceTypeError(f"cannot read bool {spec!r} as a device")
    if isinstance(spec, int):
        if top_level:
            return _count(spec)
        return [_cuda(spec, f"CUDA index {spec}")]
    if isinstance(spec, torch.device):
        if spec.type == "cpu":
            return [(torch.device("cpu"), "cpu")]
        if spec.type == "cuda":
            index = spec.index if spec.index is not None else 0
            return [_cuda(index, str(spec))]
        raise DeviceError(f"device type {spec.type!r} is not supported; use 'cuda' or 'cpu'")
    return _parse(spec)


def _parse(text: str) -> list[tuple[torch.device, str]]:
    spec = text.strip().lower()
    if spec == "auto":
        count = _cuda_device_count()
        return _all_cuda(count) if count else [(torch.device("cpu"), "cpu")]
    if spec == "cpu":
        return [(torch.device("cpu"), "cpu")]
    if spec == "cuda":
        count = _cuda_device_count()
        if not count:
            raise DeviceError(f"'cuda' was asked for, but no CUDA GPU is visible; {CPU_HINT}")
        return _all_cuda(count)
    kind, sep, number = spec.partition(":" if ":" in spec else "#")
    if sep and number.isascii() and number.isdecimal():
        if kind == "cuda" and sep == ":":
            return [_cuda(int(number), text)]
        if kind == "cpu" and sep == "#":
            return [(torch.device("cpu"), f"cpu#{int(number)}")]
        if kind == "cpu":  # torch reads "cpu:N" as the CPU, as it reads torch.device("cpu", N)
            if int(number) > 0:
                # Meant as a count ("cpu:4") or as a worker's name ("cpu:1" for cpu#1): both.
                count = max(int(number), 2)
                warn_user(
                    f"{text!r} is the CPU, one worker, as torch reads it (a CPU has no index); "
                    f"for {count} CPU workers, pass devices=asyncddp.cpu_devices({count}) (on "
                    f"the command line, --devices {count}), whose workers are named 'cpu#0', "
                    f"'cpu#1', ..."
                )
            return [(torch.device("cpu"), "cpu")]
    raise DeviceError(
        f"unknown device {text!r}; give 'auto', 'cuda', 'cpu', 'cuda:N', 'cpu#N' or an int. "
        f"For several workers on the CPU, {CPU_HINT}"
    )


def _count(n: int) -> list[tuple[torch.device, str]]:
    if n < 1:
        raise DeviceError(f"asked for {n} devices; give at least 1")
    count = _cuda_device_count()
    if not count:
        _check_cpu_count(n)
        cpu = torch.device("cpu")
        return [(cpu, f"cpu#{i}") for i in range(n)]
    if n > count:
        raise DeviceError(
            f"asked for {n} CUDA devices, but only {count} are visible; give devices={count}"
        )
    return _all_cuda(n)


_MAX_CPU_DEVICES = 1024
"""The most virtual CPU devices asked for by a count: each is a thread of its own."""


def _check_cpu_count(n: int) -> None:
    if n > _MAX_CPU_DEVICES:
        raise DeviceError(
            f"asked for {n} CPU devices; at most {_MAX_CPU_DEVICES}, each a worker thread "
            f"(this machine has {os.cpu_count() or 'an unknown number of'} cores)"
        )


def _all_cuda(count: int) -> list[tuple[torch.device, str]]:
    return [(torch.device("cuda", i), f"cuda:{i}") for i in range(count)]


def _cuda(index: int, asked: str) -> tuple[torch.device, str]:
    count = _cuda_device_count()
    if not count:
        raise DeviceError(f"{asked} was asked for, but no CUDA GPU is visible; {CPU_HINT}")
    if not 0 <= index < count:
        visible = f"cuda:0 to cuda:{count - 1}" if count > 1 else "cuda:0"
        raise DeviceError(
            f"{asked} does not exist: {count} CUDA device(s) are visible ({visible}); "
            "check CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", index), f"cuda:{index}"
