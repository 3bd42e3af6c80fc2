"""The ``asyncddp`` command (also ``python -m asyncddp``).

asyncddp demo      train the digits demo on every GPU, or on 2 CPU workers without one
asyncddp devices   show which devices a spec resolves to
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import warnings
from collections.abc import Sequence

import torch

from ._devices import CPU_HINT, Device, DeviceSpec, cpu_devices, resolve_devices
from ._exceptions import AsyncDDPError, AsyncDDPWarning

__all__ = ["main"]


def parse_devices(text: str) -> DeviceSpec:
    """Read ``--devices``: ``auto`` (every GPU, or 2 CPU workers), a count, or names."""
    parts = [part.strip() for part in text.split(",")]
    if "," in text and len([part for part in parts if part]) > 1:
        # A list, as in the Python API: a number is a CUDA index there ([0, 2]).
        return [_number_or_name(part) for part in parts if part]
    text = next((part for part in parts if part), "")
    if text.lower() == "auto":
        return "cuda" if torch.cuda.is_available() else cpu_devices(2)
    return _number_or_name(text)


def _resolved(spec: DeviceSpec, command: str) -> tuple[Device, ...]:
    """``spec``'s devices; what resolving it warns of is printed as the command's own line,
    its hint in the command line's terms (the warning names the Python API)."""
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", AsyncDDPWarning)
            return resolve_devices(spec)
    finally:  # a spec that warns and then fails (cpu:1,cpu:2) shows both
        _print_warnings(caught, command)


def _print_warnings(caught: list[warnings.WarningMessage], command: str) -> None:
    for warning in caught:
        if not issubclass(warning.category, AsyncDDPWarning):
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
            continue
        message = _in_command_terms(str(warning.message), command)
        print(f"asyncddp {command}: warning: {message}", file=sys.stderr)


def _in_command_terms(message: str, command: str) -> str:
    """An error's or warning's hint, which names the Python API, as the command's option."""
    option = "--devices " if command == "demo" else ""
    message = message.replace(CPU_HINT, f"give {option}cpu#0,cpu#1 for two CPU workers")
    return re.sub(
        r"pass devices=asyncddp\.cpu_devices\((\d+)\) \(on the command line, --devices \d+\)",
        rf"give {option}\1",
        message,
    )


def _number_or_name(text: str) -> int | str:
    """A whole number (a sign allowed, so that -1 is refused as a count) as an int."""
    digits = text[1:] if text[:1] in "+-" else text
    return int(text) if digits.isascii() and digits.isdecimal() else text


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="asyncddp",
        description="Data-parallel PyTorch training that async code can await.",
    )
    parser.add_argument("--version", action="version", version=f"asyncddp {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    devices_help = (
        "'auto' (every GPU, or 2 CPU workers without one), a count, 'cpu', 'cuda', "
        "'cuda:1', or a comma-separated list such as 'cuda:0,cuda:2' (default: auto)"
    )
    demo = commands.add_parser(
        "demo",
        help="train a small MLP on scikit-learn's digits, data-parallel",
        description="Train a small MLP on scikit-learn's handwritten digits (they ship with "
        "scikit-learn; nothing is downloaded), data-parallel across the devices, then print "
        "a summary: devices, items/s, final loss and accuracy.",
    )
    demo.add_argument("--devices", default="auto", help=devices_help)
    demo.add_argument("--epochs", type=int, default=10, help="epochs to train (default: 10)")
    demo.add_argument("--batch-size", type=int, default=64, help="items per batch (default: 64)")
    demo.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (default: when stderr is a terminal)",
    )
    show = commands.add_parser("devices", help="show which devices a spec resolves to")
    show.add_argument("spec", nargs="?", default="auto", help=devices_help)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        spec = parse_devices(args.devices if args.command == "demo" else args.spec)
        devices = _resolved(spec, args.command)
        if args.command == "devices":
            for device in devices:
                print(f"{device.index}: {device.name} ({device.torch_device})")
            if len({device.type for device in devices}) > 1:
                print(
                    "note: a Trainer refuses GPUs and the CPU together (its replicas would drift "
                    "apart); a StepScheduler runs on both",
                    file=sys.stderr,
                )
            return 0
        for flag, value in (("--epochs", args.epochs), ("--batch-size", args.batch_size)):
            if value < 1:
                print(f"asyncddp demo: {flag} must be at least 1, got {value}", file=sys.stderr)
                return 2
        from ._demo import main as demo

        asyncio.run(demo(devices, args.epochs, args.batch_size, args.progress))
    except (AsyncDDPError, ImportError) as error:
        message = _in_command_terms(str(error), args.command)
        print(f"asyncddp {args.command}: {message}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
