from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import asyncddp
from asyncddp import (
    AsyncDDPError,
    Device,
    DeviceError,
    DeviceTypeError,
    StepScheduler,
    _devices,
    cpu_devices,
    resolve_devices,
)
from asyncddp.testing import asyncddp_threads


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend that two CUDA GPUs are visible (resolution only; nothing runs on them)."""
    monkeypatch.setattr(_devices, "_cuda_device_count", lambda: 2)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_devices, "_cuda_device_count", lambda: 0)


def names(devices: tuple[Device, ...]) -> list[str]:
    return [device.name for device in devices]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_cpu_devices_are_numbered_virtual_cpus(n: int) -> None:
    devices = cpu_devices(n)
    assert names(devices) == [f"cpu#{i}" for i in range(n)]
    assert [device.index for device in devices] == list(range(n))
    assert all(device.torch_device == torch.device("cpu") for device in devices)
    assert resolve_devices(devices) == devices


def test_device_is_frozen() -> None:
    device = cpu_devices(1)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        device.index = 3  # type: ignore[misc]
    assert str(device) == "cpu#0"
    assert device.type == "cpu"
    assert not device.is_cuda


@pytest.mark.usefixtures("no_gpu")
def test_without_cuda() -> None:
    assert names(resolve_devices("auto")) == ["cpu"]
    assert names(resolve_devices("cpu")) == ["cpu"]
    assert names(resolve_devices(torch.device("cpu"))) == ["cpu"]
    # An int asks for that many devices: CPU workers where there is no GPU.
    assert names(resolve_devices(3)) == ["cpu#0", "cpu#1", "cpu#2"]
    assert names(resolve_devices(["cpu#0", "cpu#1"])) == ["cpu#0", "cpu#1"]


@pytest.mark.usefixtures("no_gpu")
def test_cpu_with_an_index_is_the_cpu_as_torch_reads_it() -> None:
    # torch.device("cpu:0") is the CPU, and resolve_devices took the torch.device; the same
    # text was refused as an unknown device.
    assert names(resolve_devices("cpu:0")) == ["cpu"]
    # An index above 0 reads as a count that was meant: it warns, naming cpu_devices.
    with pytest.warns(UserWarning, match=r"'cpu:4' is the CPU, one worker.*cpu_devices\(4\)"):
        assert names(resolve_devices("cpu:4")) == ["cpu"]
    # "cpu:1" said "for 1 CPU workers, pass devices=asyncddp.cpu_devices(1)": what it gave.
    with pytest.warns(UserWarning, match=r"one worker.*cpu_devices\(2\).*'cpu#0', 'cpu#1'"):
        assert names(resolve_devices(" CPU:1 ")) == names(resolve_devices(torch.device("cpu:1")))
    with (
        pytest.warns(UserWarning, match="one worker"),
        pytest.raises(DeviceError, match=r"device cpu is given twice.*cpu_devices"),
    ):
        resolve_devices(["cpu:0", "cpu:1"])


@pytest.mark.usefixtures("no_gpu")
def test_an_unknown_device_s_message_names_every_spelling() -> None:
    with pytest.raises(DeviceError, match="'cuda:N', 'cpu#N' or an int"):
        resolve_devices("gpu:0")


@pytest.mark.usefixtures("two_gpus")
def test_with_cuda() -> None:
    assert names(resolve_devices("auto")) == ["cuda:0", "cuda:1"]
    assert names(resolve_devices("cuda")) == ["cuda:0", "cuda:1"]
    assert names(resolve_devices("cuda:1")) == ["cuda:1"]
    assert names(resolve_devices(" CUDA:1 ")) == ["cuda:1"]
    assert names(resolve_devices(1)) == ["cuda:0"]
    assert names(resolve_devices([1, 0])) == ["cuda:1", "cuda:0"]
    assert names(resolve_devices(torch.device("cuda", 1))) == ["cuda:1"]
    assert names(resolve_devices(["cuda:0", torch.device("cuda", 1)])) == ["cuda:0", "cuda:1"]
    devices = resolve_devices(["cuda:1", "cuda:0"])
    assert [device.index for device in devices] == [0, 1]
    assert devices[0].torch_device == torch.device("cuda", 1)
    assert devices[0].is_cuda


@pytest.mark.usefixtures("two_gpus")
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("cuda:5", "cuda:5 does not exist: 2 CUDA device(s) are visible (cuda:0 to cuda:1)"),
        (torch.device("cuda", 2), "does not exist"),
        ([0, 7], "CUDA index 7 does not exist"),
        (3, "asked for 3 CUDA devices, but only 2 are visible"),
        (["cuda:0", "cuda:0"], "device cuda:0 is given twice"),
        (["cuda:0", 0], "given twice"),
        ([], "no devices"),
        ((), "no devices"),
        (0, "asked for 0 devices"),
        (-1, "asked for -1 devices"),
        ("gpu", "unknown device 'gpu'"),
        ("cuda:x", "unknown device"),
        ("cuda#1", "unknown device"),
        ("mps", "unknown device"),
        (torch.device("meta"), "device type 'meta' is not supported"),
    ],
)
def test_bad_specs_raise_device_error(spec: object, message: str) -> None:
    with pytest.raises(DeviceError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        resolve_devices(spec)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, AsyncDDPError)


@pytest.mark.usefixtures("no_gpu")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", torch.device("cuda"), [0], ["cpu", "cuda:1"]])
def test_any_cuda_spec_fails_without_cuda(spec: object) -> None:
    with pytest.raises(DeviceError, match=r"no CUDA GPU is visible; use asyncddp.cpu_devices\(2\)"):
        resolve_devices(spec)  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_gpu")
def test_duplicate_cpu_points_to_cpu_devices() -> None:
    with pytest.raises(DeviceError, match=r"given twice.*cpu_devices"):
        resolve_devices(["cpu", "cpu"])


@pytest.mark.usefixtures("no_gpu")
@pytest.mark.parametrize("spec", [["cpu", "cpu#0"], ["cpu#1", torch.device("cpu")]])
def test_the_cpu_with_virtual_cpu_devices_points_to_cpu_devices(spec: Any) -> None:
    # ["cpu", "cpu#0"] gave two workers on the CPU, named as if one were all of it.
    with pytest.raises(DeviceError, match=r"'cpu' \(the CPU as one device\).*cpu_devices\(2\)"):
        resolve_devices(spec)


@pytest.mark.parametrize("spec", [1.5, None, True, {"cuda": 0}, [1.0], [None], [["cpu"]], b"cpu"])
def test_wrong_types_raise_device_type_error(spec: object) -> None:
    with pytest.raises(DeviceTypeError, match="cannot read") as info:
        resolve_devices(spec)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, DeviceError)


@pytest.mark.parametrize(
    ("n", "error"),
    [
        (0, DeviceError),
        (-2, DeviceError),
        (1025, DeviceError),  # a thread each: at most 1024
        (10**9, DeviceError),  # not a list of a billion, built before any check
        (2.0, DeviceTypeError),
        ("2", DeviceTypeError),
        (True, DeviceTypeError),
    ],
)
def test_cpu_devices_rejects_bad_counts(n: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        cpu_devices(n)  # type: ignore[arg-type]


@pytest.mark.usefixtures("two_gpus")
def test_bad_devices_fail_before_any_thread_starts() -> None:
    with pytest.raises(DeviceError, match="cuda:5"):
        StepScheduler("cuda:5")
    with pytest.raises(DeviceError, match="given twice"):
        StepScheduler(["cuda:1", "cuda:1"])
    assert asyncddp_threads() == []


def test_device_spec_is_exported() -> None:
    assert asyncddp.DeviceSpec is _devices.DeviceSpec


@pytest.mark.usefixtures("two_gpus")
def test_hand_made_device_values_are_checked_too() -> None:
    with pytest.raises(DeviceError, match="does not exist"):
        resolve_devices([Device(index=0, torch_device=torch.device("cuda", 7), name="cuda:7")])
    with pytest.raises(DeviceError, match="given twice"):
        resolve_devices(
            [
                Device(index=0, torch_device=torch.device("cuda", 1), name="one"),
                Device(index=1, torch_device=torch.device("cuda", 1), name="another"),
            ]
        )


def test_sets_have_no_order_and_are_refused() -> None:
    with pytest.raises(DeviceTypeError, match="no order"):
        resolve_devices({"cpu#0", "cpu#1"})


@pytest.mark.parametrize("spec", ["cuda:\u00b2", "cpu#\u00b3"])
def test_unicode_digits_are_unknown_devices(spec: str) -> None:
    with pytest.raises(DeviceError, match="unknown device"):
        resolve_devices(spec)
