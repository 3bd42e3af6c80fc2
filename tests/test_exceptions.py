from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch

import asyncddp
import asyncddp.testing
from asyncddp import (
    AsyncDDPError,
    DeviceError,
    DeviceTypeError,
    SchedulerClosedError,
    ShardError,
    WorkerFailedError,
    WorkerTimeoutError,
    cpu_devices,
)

CPU1 = cpu_devices(2)[1]


def test_tree() -> None:
    assert issubclass(asyncddp.ConfigurationTypeError, asyncddp.ConfigurationError)
    assert issubclass(asyncddp.ConfigurationTypeError, TypeError)
    assert issubclass(DeviceError, AsyncDDPError)
    assert issubclass(DeviceError, ValueError)
    assert issubclass(DeviceTypeError, DeviceError)
    assert issubclass(DeviceTypeError, TypeError)
    assert issubclass(ShardError, AsyncDDPError)
    assert issubclass(ShardError, ValueError)
    assert issubclass(SchedulerClosedError, RuntimeError)
    assert issubclass(WorkerFailedError, AsyncDDPError)
    assert issubclass(WorkerTimeoutError, WorkerFailedError)
    # Tracebacks name the public module, not the private one.
    assert WorkerFailedError.__module__ == "asyncddp"


@pytest.mark.parametrize(
    "make",
    [
        lambda: asyncddp.Trainer(42, torch.optim.SGD, _step),  # type: ignore[arg-type]
        lambda: asyncddp.Trainer(torch.nn.Linear(2, 1), None, _step),  # type: ignore[arg-type]
        lambda: asyncddp.Trainer(torch.nn.Linear(2, 1), torch.optim.SGD, 42),  # type: ignore[arg-type]
        lambda: asyncddp.Trainer(torch.nn.Linear(2, 1), torch.optim.SGD, _async_step),
        lambda: asyncddp.Trainer(
            torch.nn.Linear(2, 1), torch.optim.SGD, _step, accumulate_grad_batches="2"
        ),  # type: ignore[arg-type]
        lambda: asyncddp.Trainer(torch.nn.Linear(2, 1), torch.optim.SGD, _step, checkpoint_dir=5),  # type: ignore[arg-type]
        lambda: asyncddp.testing.failing_step(_step, device=0, times="1"),  # type: ignore[arg-type]
    ],
    ids=["model", "optimizer", "step", "async-step", "int-option", "path-option", "helper"],
)
def test_an_argument_of_the_wrong_type_is_a_type_error_and_a_configuration_error(
    make: Any,
) -> None:
    # They were ConfigurationErrors (ValueErrors) alone, while the same mistake elsewhere
    # (cpu_devices("2"), StepScheduler.run(42, ...)) was a TypeError: code catching either
    # missed half of them, and failures.md and faults.md disagreed.
    with pytest.raises(TypeError) as caught:
        make()
    assert isinstance(caught.value, asyncddp.ConfigurationError)
    assert type(caught.value) is asyncddp.ConfigurationTypeError


def _step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(batch).sum()  # type: ignore[no-any-return]


async def _async_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(batch).sum()  # type: ignore[no-any-return]


def test_a_value_out_of_range_stays_a_value_error_alone() -> None:
    with pytest.raises(asyncddp.ConfigurationError) as caught:
        asyncddp.Trainer(torch.nn.Linear(2, 1), torch.optim.SGD, _step, accumulate_grad_batches=0)
    assert not isinstance(caught.value, TypeError)


def test_message_keeps_the_wording_users_search_for() -> None:
    cause = RuntimeError("CUDA out of memory")
    error = WorkerFailedError.from_exception(cause, device=CPU1, step=3, phase="train")
    assert str(error) == (
        "training worker on device cpu#1 failed: RuntimeError: CUDA out of memory "
        "(step 3; phase train)"
    )
    assert error.__cause__ is cause
    assert error.args == (str(error),)


def test_distributed_wording_names_rank_and_device() -> None:
    error = WorkerFailedError(device=CPU1, rank=3, error_type="ValueError", error_message="bad")
    assert (
        str(error)
        == "distributed data parallel worker on rank 3 (device cpu#1) failed: ValueError: bad"
    )


def test_qualified_type_names() -> None:
    class Custom(Exception):
        pass

    error = WorkerFailedError.from_exception(Custom("x"), device=CPU1)
    assert error.error_type.endswith("test_qualified_type_names.<locals>.Custom")
    assert error.error_type.startswith("test_exceptions.") or error.error_type.startswith("tests.")


def test_pickle_round_trip_keeps_fields() -> None:
    other = WorkerFailedError.from_exception(ValueError("second"), device=cpu_devices(1)[0], step=2)
    error = WorkerFailedError(
        device=CPU1,
        error_type="RuntimeError",
        error_message="first",
        rank=1,
        step=2,
        epoch=0,
        phase="valid",
        other_failures=[other],
    )
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is WorkerFailedError
    assert str(copy) == str(error)
    assert (copy.device, copy.rank, copy.step, copy.epoch, copy.phase) == (CPU1, 1, 2, 0, "valid")
    assert copy.other_failures[0].error_message == "second"

    timeout = WorkerTimeoutError(timeout=0.5, device=CPU1, step=7)
    copy_timeout = pickle.loads(pickle.dumps(timeout))
    assert type(copy_timeout) is WorkerTimeoutError
    assert copy_timeout.timeout == 0.5
    assert str(copy_timeout) == (
        "training worker on device cpu#1 failed: did not finish within step_timeout=0.5 s (step 7)"
    )


def test_other_failures_across_ranks_are_named_with_their_ranks() -> None:
    # "also failed: cpu, cpu" said which devices, not which ranks (each rank's is "cpu").
    cpu = asyncddp.resolve_devices("cpu")[0]
    others = [
        WorkerFailedError.from_exception(ValueError(str(rank)), device=cpu, rank=rank)
        for rank in (1, 2)
    ]
    error = WorkerFailedError.from_exception(ValueError("0"), device=cpu, rank=0, step=2)
    error.other_failures = tuple(others)
    assert str(error).endswith("(step 2; also failed: rank 1 cpu, rank 2 cpu)")


def test_repr_is_short_and_holds_no_objects() -> None:
    error = WorkerFailedError.from_exception(KeyError("k"), device=CPU1, step=1)
    assert repr(error) == (
        "WorkerFailedError(device='cpu#1', rank=None, step=1, epoch=None, phase=None, "
        "error_type='KeyError')"
    )


@pytest.mark.parametrize("name", asyncddp.__all__)
def test_public_classes_live_in_the_public_module(name: str) -> None:
    value = getattr(asyncddp, name)
    if isinstance(value, type):
        assert value.__module__ == "asyncddp"


def test_notes_survive_pickling() -> None:
    error = WorkerFailedError(device=CPU1, error_type="E", error_message="m")
    error.add_note("while training the digits model")
    copy = pickle.loads(pickle.dumps(error))
    assert copy.__notes__ == ["while training the digits model"]


@pytest.mark.parametrize(
    "error",
    [
        WorkerFailedError(device=CPU1, error_type="E", error_message="m"),
        WorkerTimeoutError(timeout=0.5, device=CPU1),
        asyncddp.testing.InjectedFailure("injected", device_index=1, step=3),
    ],
    ids=type,
)
def test_what_a_handler_attached_survives_pickling_and_copies(error: Exception) -> None:
    # As a plain exception's would: a WorkerFailedError dropped the attributes a user's handler
    # set, and InjectedFailure its notes too.
    error.job_id = "abc"  # type: ignore[attr-defined]
    error.add_note("seen on rank 0")
    for twin in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(twin) is type(error)
        assert str(twin) == str(error)
        assert twin.job_id == "abc"  # type: ignore[attr-defined]
        assert twin.__notes__ == ["seen on rank 0"]


def test_warnings_tree() -> None:
    assert issubclass(asyncddp.AsyncDDPWarning, UserWarning)
    assert issubclass(asyncddp.AsyncDDPRuntimeWarning, asyncddp.AsyncDDPWarning)
    assert issubclass(asyncddp.AsyncDDPRuntimeWarning, RuntimeWarning)
    assert issubclass(asyncddp.DeviceDroppedWarning, asyncddp.AsyncDDPRuntimeWarning)
    assert asyncddp.AsyncDDPWarning.__module__ == "asyncddp"


def test_every_warning_the_library_gives_is_an_asyncddp_warning() -> None:
    # Its warnings point at the user's line, so filterwarnings(module="asyncddp") matched none
    # of them, and some were plain UserWarnings: there was no filter for them all.
    import ast
    import importlib
    from pathlib import Path

    calls = 0
    for path in sorted(Path(asyncddp.__file__).parent.glob("*.py")):
        module = importlib.import_module(
            f"asyncddp.{path.stem}" if path.stem != "__init__" else "asyncddp"
        )
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            if name not in ("warnings.warn", "warn_user"):
                continue
            calls += 1
            given = [k.value for k in node.keywords if k.arg == "category"] + node.args[1:2]
            if not given and name == "warn_user":
                continue  # the default, AsyncDDPWarning
            if name == "warnings.warn" and given and ast.unparse(given[0]) == "category":
                continue  # warn_user's own call
            assert given, f"{path.name}:{node.lineno}: warnings.warn() without a category"
            category = getattr(module, ast.unparse(given[0]))
            assert issubclass(category, asyncddp.AsyncDDPWarning), f"{path.name}:{node.lineno}"
    assert calls > 10


def test_one_filter_silences_the_library_s_warnings() -> None:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncddp.resolve_devices("cpu:2")  # one worker: "'cpu:2' is the CPU, one worker"
        assert [w.category for w in caught] == [asyncddp.AsyncDDPWarning]
        caught.clear()
        warnings.filterwarnings("ignore", category=asyncddp.AsyncDDPWarning)
        asyncddp.resolve_devices("cpu:2")
    assert caught == []
