"""Training across processes: real gloo process groups on localhost.

Each test starts its ranks as separate Python processes (``tests/distributed_worker.py``) with
the torchrun environment set by hand, so that killing one rank leaves the others running (under
``torchrun`` its agent would stop them). Every rank writes what it saw; the test compares. The
ranks are forked from one fork server that imported torch once (``ForkServer``), or started as
fresh interpreters with ``ASYNCDDP_TEST_FRESH_RANKS=1``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import HashStore

import asyncddp
import asyncddp.distributed

WORKER = Path(__file__).with_name("distributed_worker.py")
sys.path.insert(0, str(WORKER.parent))
import distributed_worker as worker  # noqa: E402

pytestmark = pytest.mark.distributed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: Start each rank as a fresh interpreter (``python tests/distributed_worker.py``), as a launcher
#: does, instead of forking it from the fork server: ``ASYNCDDP_TEST_FRESH_RANKS=1 pytest ...``.
FRESH_RANKS = os.environ.get("ASYNCDDP_TEST_FRESH_RANKS", "") not in ("", "0")


class ForkServer:
    """The module's fork server (``distributed_worker.serve``): one process that imported
    torch, asyncddp and the scenarios once and made a first optimizer (5-6 s here, nearly all
    of a fresh rank's start to its first step), and forks each rank from there."""

    def __init__(self) -> None:
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (open while the server runs)
        self._process = subprocess.Popen(
            [sys.executable, str(WORKER), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self._changed = threading.Condition()
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._ended = False
        self._reader = threading.Thread(target=self._read, name="fork-server-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            what, pid, *code = line.split()
            with self._changed:
                if what == b"started":
                    self._started.append(int(pid))
                    self._exits.pop(int(pid), None)  # an earlier rank's, whose pid this reuses
                else:
                    self._exits[int(pid)] = int(code[0])
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def _check_alive(self) -> None:
        if self._ended:
            self._log.seek(0)
            output = self._log.read().decode(errors="replace")
            pytest.fail(f"the fork server ended:\n{output}")

    def fork(self, scenario: str, out: Path, env: dict[str, str]) -> int:
        """Fork a rank that runs ``scenario`` with ``env``; its pid."""
        assert self._process.stdin is not None
        request = {"scenario": scenario, "out": str(out), "env": env}
        with self._changed:
            self._process.stdin.write(json.dumps(request).encode() + b"\n")
            self._process.stdin.flush()
            while not self._started:
                self._check_alive()
                self._changed.wait()
            return self._started.pop(0)

    def wait(self, pid: int, timeout: float) -> int | None:
        """``pid``'s exit code, None while it still runs after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while pid not in self._exits:
                self._check_alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(left)
            return self._exits[pid]

    def close(self) -> None:
        """End the server (it ends once its ranks have) and wait for it."""
        assert self._process.stdin is not None
        self._process.stdin.close()
        try:
            self._process.wait(60)
        except subprocess.TimeoutExpired:  # a rank outlived its test: the server waits on it
            self._process.kill()
            self._process.wait()
        self._reader.join(60)
        assert self._process.stdout is not None
        self._process.stdout.close()
        self._log.close()


@functools.cache
def fork_server() -> ForkServer:
    return ForkServer()


@pytest.fixture(scope="module", autouse=True)
def _close_the_fork_server() -> Iterator[None]:
    yield
    if fork_server.cache_info().currsize:
        fork_server().close()
        fork_server.cache_clear()


class Rank:
    """One rank's process, forked by the fork server or started fresh."""

    def __init__(self, scenario: str, out: Path, env: dict[str, str]) -> None:
        self.log = out / f"rank{env['RANK']}.log"
        self._popen: subprocess.Popen[bytes] | None = None
        self._pid = 0
        if FRESH_RANKS:
            with self.log.open("wb") as log:
                self._popen = subprocess.Popen(
                    [sys.executable, str(WORKER), scenario, str(out)],
                    env={**os.environ, **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        else:
            self._pid = fork_server().fork(scenario, out, env)

    def wait(self, timeout: float) -> int | None:
        """The exit code once the rank ended, None if it is still running after ``timeout``."""
        if self._popen is None:
            return fork_server().wait(self._pid, timeout)
        try:
            return self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def pid(self) -> int:
        return self._pid if self._popen is None else self._popen.pid

    def kill(self) -> None:
        if self.wait(0) is None:
            if self._popen is None:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(self._pid, signal.SIGKILL)
            else:
                self._popen.kill()
            self.wait(60)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def stacks(ranks: list[Rank]) -> str:
    """Every rank's output, with the Python stack of each thread of those still running (a
    hang's report: each rank dumps its threads on SIGUSR1, see ``distributed_worker``)."""
    running = [rank for rank, process in enumerate(ranks) if process.wait(0) is None]
    for rank in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(ranks[rank].pid(), signal.SIGUSR1)
    time.sleep(1.0)  # for the dumps to be written
    return "\n".join(
        f"--- rank {rank} ({'still running' if rank in running else 'ended'}):\n{process.output()}"
        for rank, process in enumerate(ranks)
    )


def launch(
    scenario: str,
    out: Path,
    world_size: int = 2,
    timeout: float = 120.0,
    exchange: str = "packed",
) -> tuple[list[dict[str, Any] | None], list[int], float]:
    """Run ``scenario`` on ``world_size`` ranks; their reports (None if a rank wrote none),
    exit codes, and the seconds they took.

    ``exchange``: ``"packed"``, a step's gradients inside its header, as the scenarios' small
    models have them; ``"apart"``, in all-reduces of their own, as larger models have them
    (``_comm.PACK_ELEMENTS`` set to 0 in the ranks).
    """
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ranks = []
    started = time.monotonic()
    try:
        for rank in range(world_size):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                **({"PACK_ELEMENTS": "0"} if exchange == "apart" else {}),
            }
            ranks.append(Rank(scenario, out, env))
        codes = []
        for rank, process in enumerate(ranks):
            code = process.wait(max(1.0, timeout - (time.monotonic() - started)))
            if code is None:
                pytest.fail(f"rank {rank} still ran after {timeout:.0f} s\n{stacks(ranks)}")
            codes.append(code)
    finally:
        for process in ranks:
            process.kill()
    seconds = time.monotonic() - started
    reports: list[dict[str, Any] | None] = []
    for rank in range(world_size):
        path = out / f"rank{rank}.pt"
        reports.append(torch.load(path, weights_only=False) if path.exists() else None)
    for rank, report in enumerate(reports):
        if report is not None and "crash" in report:
            pytest.fail(f"rank {rank} crashed:\n{report['crash']}\n{ranks[rank].output()}")
    return reports, codes, seconds


def one_device_trainer(seed: int = 0, devices: str = "cpu", **options: Any) -> asyncddp.Trainer:
    """One process, one device: the scenarios' model ``worker.model(seed)`` and optimizer."""
    return asyncddp.Trainer(
        worker.model(seed),
        functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9),
        worker.step,
        devices=devices,
        progress_bar=False,
        **options,
    )


def fit_to(trainer: asyncddp.Trainer, epochs: int) -> int:
    """``trainer.fit`` on the scenarios' batches to ``epochs`` (counted from the start of
    training), in an event loop of its own; its global step."""
    import anyio

    async def fit() -> int:
        result = await trainer.fit(worker.batches(), epochs=epochs)
        return result.global_step

    return anyio.run(fit)


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo process group of this process alone, for the block: a trainer made in it joins."""
    torch.distributed.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def merged(data: list[Any]) -> list[Any]:
    """The batches two ranks train on in each step, together: rank ``r`` gets ``r, r + 2, ...``."""
    return [
        tuple(torch.cat(parts) for parts in zip(*data[i : i + 2], strict=True))
        for i in range(0, len(data), 2)
    ]


def reference_params(
    batches: int = 7, seed: int = 0, **options: Any
) -> tuple[list[torch.Tensor], asyncddp.FitResult, Any]:
    """One process, one device, each step given the ranks' batches of that step together,
    from the model ``worker.model(seed)``."""
    import anyio

    trainer = one_device_trainer(seed, **options)

    async def fit() -> tuple[asyncddp.FitResult, dict[str, float]]:
        data = merged(worker.batches(batches))
        result = await trainer.fit(data, epochs=2, valid_data=worker.batches(5, 10))
        return result, await trainer.validate(worker.batches(5, 10))

    result, metrics = anyio.run(fit)
    return [p.detach().clone() for p in trainer.model.parameters()], result, metrics


def both_reports(scenario: str, out: Path, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``scenario`` on 2 ranks that must both exit cleanly; their reports."""
    reports, codes, _ = launch(scenario, out, **options)
    assert codes == [0, 0]
    first, second = reports
    assert first is not None
    assert second is not None
    return first, second


def assert_equal_tensors(mine: list[torch.Tensor], others: list[torch.Tensor]) -> None:
    for a, b in zip(mine, others, strict=True):
        assert torch.equal(a, b)


def assert_end_as_one_device(
    reports: list[dict[str, Any] | None], steps: int, **reference: Any
) -> None:
    """Every rank took ``steps`` steps and ends with ``reference_params(**reference)``."""
    params, result, _ = reference_params(**reference)
    for report in reports:
        assert report is not None
        assert report["global_step"] == result.global_step == steps
        for mine, expected in zip(report["params"], params, strict=True):
            torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)


def gpu_reference(batches: list[Any]) -> tuple[list[torch.Tensor], asyncddp.FitResult]:
    """One process on one GPU given ``batches`` (and the scenarios' validation batches): the
    parameters (on the CPU) and the result."""
    import anyio

    trainer = one_device_trainer(devices="cuda:0")
    fit = functools.partial(trainer.fit, batches, epochs=2, valid_data=worker.batches(5, 10))
    result = anyio.run(fit)
    return [p.detach().cpu() for p in trainer.model.parameters()], result


@pytest.mark.cuda
def test_two_ranks_on_a_gpu_over_gloo_end_with_the_parameters_of_one_gpu(tmp_path: Path) -> None:
    # Gloo reduces on the CPU: every bucket goes from the GPU's stream to the CPU and back.
    reports, codes, _ = launch("exact-gpu", tmp_path)
    assert codes == [0, 0]
    params, result = gpu_reference(merged(worker.batches()))
    for report in reports:
        assert_gpu_rank_like(report, "gloo", 8, params, result)


@pytest.mark.cuda
def test_one_rank_on_nccl_trains_on_its_gpu_like_one_process(tmp_path: Path) -> None:
    # NCCL needs a GPU per rank: with one GPU, one rank. Its exchange runs on NCCL's streams.
    reports, codes, _ = launch("exact-nccl", tmp_path, world_size=1)
    assert codes == [0]
    params, result = gpu_reference(worker.batches())
    (report,) = reports
    assert_gpu_rank_like(report, "nccl", 14, params, result)


def assert_gpu_rank_like(
    report: dict[str, Any] | None,
    backend: str,
    steps: int,
    params: list[torch.Tensor],
    result: asyncddp.FitResult,
) -> None:
    """A rank that trained on cuda:0 over ``backend`` ended as the one-GPU reference fit."""
    assert report is not None
    assert (report["backend"], report["devices"]) == (backend, ["cuda:0"])
    assert report["global_step"] == result.global_step == steps
    for mine, expected in zip(report["params"], params, strict=True):
        torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)
    assert_history_like(report["history"], result)


def assert_history_like(history: list[Any], result: asyncddp.FitResult) -> None:
    """A rank's epochs (loss, items, validation metrics) are the reference fit's."""
    for (loss, items, valid), record in zip(history, result.history, strict=True):
        assert items == record.items == 6 * 12 + 7  # every item once, none repeated
        assert loss == pytest.approx(record.train_loss, abs=1e-6)
        assert valid == pytest.approx(dict(record.valid_metrics or {}), abs=1e-6)
        assert set(valid) == {"loss", "accuracy"}


def test_options_of_one_value_written_apart_are_the_same_on_every_rank(tmp_path: Path) -> None:
    # Compared as strings, a clipping value of 1 assigned on one rank and 1.0 on the other
    # was refused.
    first, second = both_reports("same-options-typed-apart", tmp_path)
    assert first["global_step"] == second["global_step"] == 4 + 2


def test_reduce_lr_on_plateau_steps_on_the_validation_loss_of_every_rank(tmp_path: Path) -> None:
    # Each rank validates on its part of the data; the loss it steps on is the exact mean over
    # every rank's items, the same everywhere, so the ranks halve their rates together.
    import anyio

    reports, codes, _ = launch("plateau", tmp_path)
    assert codes == [0, 0]
    trainer = one_device_trainer(lr_scheduler=worker.PLATEAU, lr_scheduler_monitor="valid_loss")
    lrs: list[float | None] = []

    async def fit() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(worker.step_lrs, trainer.events(), lrs)
            await trainer.fit(merged(worker.batches()), epochs=3, valid_data=worker.batches(5, 10))

    anyio.run(fit)
    assert lrs == [0.2] * 8 + [0.1] * 4  # halved once, after the second epoch
    for report in reports:
        assert report is not None
        assert report["lrs"] == lrs
        assert report["global_step"] == trainer.global_step == 12
        for mine, expected in zip(report["params"], trainer.model.parameters(), strict=True):
            torch.testing.assert_close(mine, expected.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("exchange", ["packed", "apart"])
@pytest.mark.parametrize("devices", [1, 2], ids=["1-device-per-rank", "2-devices-per-rank"])
def test_two_ranks_end_with_the_parameters_of_one_device(
    tmp_path: Path, devices: int, exchange: str
) -> None:
    reports, codes, _ = launch(f"exact{devices}", tmp_path, exchange=exchange)
    assert codes == [0, 0]
    params, result, metrics = reference_params()
    for report in reports:
        assert report is not None
        assert report["packed"] == (exchange == "packed")
        for mine, expected in zip(report["params"], params, strict=True):
            torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)
        assert report["global_step"] == result.global_step == 8  # 4 steps per epoch, 7 batches
        for (loss, train_metrics, valid, items), record in zip(
            report["history"], result.history, strict=True
        ):
            assert items == record.items == 6 * 12 + 7  # every item once, none repeated
            assert loss == pytest.approx(record.train_loss, abs=1e-6)
            assert train_metrics == pytest.approx(dict(record.train_metrics), abs=1e-6)
            # Validation over 5 batches on 2 ranks (3 + 2): exact over all 46 items.
            assert valid == pytest.approx(dict(record.valid_metrics or {}), abs=1e-6)
        assert report["validate"] == pytest.approx(metrics, abs=1e-6)
        # Progress counts this rank's items, to this rank's part of the data, every epoch.
        mine = 3 * 12 + 7 if report["rank"] == 0 else 3 * 12  # batches 0, 2, 4, 6 and 1, 3, 5
        assert report["progress"] == [(mine, mine, 1.0)] * 2


@pytest.mark.parametrize("devices", [1, 2], ids=["1-device-per-rank", "2-devices-per-rank"])
@pytest.mark.parametrize("uneven", [False, True], ids=["even", "uneven"])
def test_a_step_that_counts_its_items_is_the_mean_over_every_ranks_items(
    tmp_path: Path, devices: int, uneven: bool
) -> None:
    # Each device's loss is the mean over its valid tokens ("items"); every step is the mean
    # over the tokens of every device of every rank, as one device given them all. Uneven:
    # 7 batches, so rank 1 has none for the last step and joins it without data.
    reports, codes, _ = launch(f"counted{'-uneven' if uneven else ''}{devices}", tmp_path)
    assert codes == [0, 0]
    model = worker.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    data = worker.token_batches(7 if uneven else 6)
    loss_sum = 0.0
    for i in range(0, len(data), 2):  # a step: rank 0's batch and rank 1's
        inputs, targets, mask = (torch.cat(parts) for parts in zip(*data[i : i + 2], strict=True))
        optimizer.zero_grad()
        losses = torch.nn.functional.cross_entropy(
            model(inputs).transpose(1, 2), targets, reduction="none"
        )
        loss = (losses * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
        loss_sum += float(loss.detach()) * float(mask.sum())
    tokens = int(sum(float(mask.sum()) for _, _, mask in data))
    for report in reports:
        assert report is not None
        assert report["global_step"] == (4 if uneven else 3)
        for mine, expected in zip(report["params"], model.parameters(), strict=True):
            torch.testing.assert_close(mine, expected.detach(), atol=1e-5, rtol=1e-5)
        assert report["epoch"][1] == tokens
        assert report["epoch"][0] == pytest.approx(loss_sum / tokens, rel=1e-5)


@pytest.mark.parametrize("devices", [1, 2], ids=["1-device-per-rank", "2-devices-per-rank"])
def test_a_step_that_counts_items_on_some_micro_steps_only_is_refused_on_every_rank(
    tmp_path: Path, devices: int
) -> None:
    first, second = both_reports(f"counted-micro-steps{devices}", tmp_path)
    for report in (first, second):
        assert "'items' for some shares of one optimizer step" in report["error"]
        assert report["global_step"] == 0


def test_a_step_that_counts_items_on_some_ranks_only_is_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    first, second = both_reports("counted-on-rank-0", tmp_path)
    for report in (first, second):
        assert "returned 'items' on 1 of the 2 processes" in report["error"]
        assert report["global_step"] == 0


@pytest.mark.parametrize("devices", [1, 2], ids=["1-device-per-rank", "2-devices-per-rank"])
def test_a_trainer_that_fit_before_joining_trains_exactly_across_ranks(
    tmp_path: Path, devices: int
) -> None:
    # Its replicas were built and their gradients reduced in one process; once it joins, the
    # same gradient buffers are reduced across ranks (through buffers the in-process
    # all-reduce never needed).
    import anyio

    reports, codes, _ = launch(f"fit-then-join{devices}", tmp_path)
    assert codes == [0, 0]
    data = worker.batches()
    trainer = one_device_trainer()

    async def fit() -> None:
        await trainer.fit(data, epochs=1)  # each rank alone, on every batch
        await trainer.fit(merged(data), epochs=2)  # the ranks together

    anyio.run(fit)
    for report in reports:
        assert report is not None
        assert report["global_step"] == trainer.global_step == 7 + 4
        for mine, expected in zip(report["params"], trainer.model.parameters(), strict=True):
            torch.testing.assert_close(mine, expected.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scenario", ["unseeded", "unseeded-built", "unseeded-built-1"])
def test_every_rank_starts_from_rank_0s_parameters(tmp_path: Path, scenario: str) -> None:
    # Each rank seeds its model differently: training starts from rank 0's weights on every
    # rank (as DDP broadcasts them), so all end as one device would from rank 0's model; also
    # when the replicas (of 2 devices, or of 1) were built before the trainer joined the group.
    reports, codes, _ = launch(scenario, tmp_path)
    assert codes == [0, 0]
    assert_end_as_one_device(reports, 8, seed=100)


@pytest.mark.parametrize(
    ("scenario", "seed"), [("checkpoint-before-fit", 0), ("loaded-differently", 100)]
)
def test_every_rank_takes_rank_0s_model_whatever_it_did_before(
    tmp_path: Path, scenario: str, seed: int
) -> None:
    # 2 devices per rank. Rank 0 alone saved a checkpoint before the first fit (its replicas
    # were built, rank 1's not); or each rank loaded a state of its own: every rank trains rank
    # 0's model, as one device would from it.
    reports, codes, _ = launch(scenario, tmp_path)
    assert codes == [0, 0]
    assert_end_as_one_device(reports, 8, seed=seed)


def test_a_rank_cancelled_while_joining_leaves_the_others_in_step(tmp_path: Path) -> None:
    first, second = both_reports("cancel-in-join", tmp_path, timeout=90)
    assert second["first"] == "cancelled"
    assert first["first"] is not None  # it heard of rank 1's cancellation
    assert first["global_step"] == second["global_step"] == 4  # both fit again, to the end
    assert_equal_tensors(first["params"], second["params"])


def test_ranks_whose_first_calls_differ_are_told_so_at_once(tmp_path: Path) -> None:
    # Rank 0 resumes, rank 1 does not: both raise "out of step" within seconds, instead of
    # meeting different collectives and waiting for the process group's timeout.
    reports, codes, seconds = launch("resume-on-rank-0-only", tmp_path, timeout=60)
    assert codes == [0, 0]
    for report in reports:
        assert report is not None
        assert "out of step" in report["error"]
        # Rank 0 was said to be "at a trainer's first call", and resume= went unnamed.
        assert "taking the checkpoint of fit(resume=...) from rank 0" in report["error"]
        assert "give fit the same resume= on every rank" in report["error"]
    assert seconds < 30


def test_a_checkpoint_saved_while_the_fit_joins_does_not_break_it(tmp_path: Path) -> None:
    for report in both_reports("checkpoint-while-joining", tmp_path, timeout=60):
        assert report["global_step"] == 4


def test_a_distributed_sampler_gets_a_new_order_each_epoch(tmp_path: Path) -> None:
    # A DataLoader with the user's own DistributedSampler is used as it is, and its set_epoch
    # is called before each epoch: each rank sees exactly the sampler's order for that epoch.
    for report in both_reports("distributed-sampler", tmp_path):
        assert report["orders"] == report["expected"]
        assert report["orders"][0] != report["orders"][1]


def test_a_rank_without_any_batch_joins_the_steps_and_does_not_hang(tmp_path: Path) -> None:
    reports, codes, _ = launch("exact-one", tmp_path)  # one batch, two ranks
    assert codes == [0, 0]
    assert_end_as_one_device(reports, 2, batches=1)


@pytest.mark.parametrize("exchange", ["packed", "apart"])
def test_a_rank_that_raises_makes_every_rank_raise_naming_it(tmp_path: Path, exchange: str) -> None:
    reports, codes, seconds = launch("raise", tmp_path, exchange=exchange)
    assert codes == [0, 0]  # no process was left hanging: both wrote their reports and exited
    for report in reports:
        assert report is not None
        assert report["error"] is not None, report
        assert report["error_rank"] == 1
        assert report["error_device"] in ("cpu#0", "cpu#1")
        assert "rank 1" in report["error"]
        assert report["cause"] == "ValueError"
        assert report["cause_message"] == "injected failure on rank 1"
    failed_at = reports[1]["failed_at"]  # type: ignore[index]
    assert reports[0]["raised_at"] - failed_at < 10.0  # type: ignore[index]
    assert seconds < 60


@pytest.mark.parametrize("exchange", ["packed", "apart"])
def test_a_killed_rank_makes_the_others_fail_naming_it(tmp_path: Path, exchange: str) -> None:
    reports, codes, _seconds = launch("kill", tmp_path, world_size=3, exchange=exchange)
    assert codes[1] == -9
    killed_at = float((tmp_path / "killed_at").read_text().split()[0])  # the first device's
    for rank in (0, 2):
        report = reports[rank]
        assert report is not None, f"rank {rank} wrote nothing (exit {codes[rank]})"
        assert report["error"] is not None, report
        assert report["error_rank"] == 1, report
        assert "rank 1" in report["error"]
        assert report["cause"] == "RankLost"
        assert report["raised_at"] - killed_at < 30.0


def test_a_rank_waiting_on_a_survivor_takes_its_roll_calls_verdict(tmp_path: Path) -> None:
    # gloo tells of a dead rank only the ranks that talk to it: rank 2, waiting on rank 0 in
    # a collective while rank 0 called the roll, named rank 0 once rank 0 left (its store gone
    # with it), in about one run in ten of the killed-rank test.
    reports, codes, _ = launch("roll-call", tmp_path, world_size=3, timeout=60)
    assert codes == [0, 0, 0]
    assert reports[0] is not None
    assert reports[0]["lost"] == [1]
    assert reports[2] is not None
    assert reports[2]["lost"] == [1]


def test_stop_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    first, second = both_reports("stop", tmp_path)
    assert first["stopped"]
    assert second["stopped"]
    assert second["reason"] == "rank 1 had enough"
    assert first["reason"] == "stop() was called on another rank"
    assert first["global_step"] == second["global_step"] < 20  # not the 3 epochs of 20 steps
    assert_equal_tensors(first["params"], second["params"])


@pytest.mark.parametrize("exchange", ["packed", "apart"])
def test_the_user_s_own_collectives_during_fit_do_not_meet_asyncddp_s(
    tmp_path: Path, exchange: str
) -> None:
    # Each rank's event consumer all-reduces a figure on the default group at every step, in
    # the event loop, while asyncddp's exchanges run in its collective thread: asyncddp keeps
    # a process group of its own, so neither meets the other's collectives (on one group they
    # did: gloo summed a header with the user's tensor, or aborted on their sizes).
    first, second = both_reports("user-collectives", tmp_path, exchange=exchange)
    assert first["global_step"] == second["global_step"] == 8  # 2 epochs of 7 batches on 2
    assert first["sums"] == second["sums"] == [3.0] * 8  # 1 + 2, at every step, on each rank
    assert_equal_tensors(first["params"], second["params"])


def test_a_rank_waiting_for_one_that_has_not_made_the_call_says_so(tmp_path: Path) -> None:
    # Rank 1 makes its first call and a validate 4 s after rank 0 (as a script that validates
    # on rank 0 alone never does); rank 0 looks in the store after 1 s (NOT_IN_CALL_WAIT here)
    # and logs a warning naming rank 1 each time. Then rank 1 is in the call but its data is
    # slow: no warning. Rank 1 waits for nobody.
    first, second = both_reports("not-in-call", tmp_path)
    assert first["seen"] == [1, 2, 2]
    assert second["records"] == []
    setup, validate = first["records"]
    assert "rank 0 has waited 1 s in fit() for rank(s) 1" in setup
    assert "this trainer's first call" in setup
    assert "rank 0 has waited 1 s in validate() for rank(s) 1, which have not begun it" in validate
    assert "call 2 on this trainer" in validate
    assert "every rank makes" in validate
    assert "run trainer.model in a loop of your own" in validate


def test_rank_0_checkpoints_and_every_rank_resumes(tmp_path: Path) -> None:
    shared = tmp_path / "run"
    launch("checkpoint-first", shared)
    files = sorted(p.name for p in (shared / "checkpoints").glob("*.ckpt"))
    assert len(files) == 1  # rank 0 alone wrote the epoch's checkpoint
    resumed, codes, _ = launch("checkpoint-resume", shared)
    straight, _, _ = launch("checkpoint-straight", tmp_path / "straight")
    assert codes == [0, 0]
    for report, reference in zip(resumed, straight, strict=True):
        assert report is not None
        assert reference is not None
        assert report["global_step"] == reference["global_step"] == 8
        for a, b in zip(report["params"], reference["params"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_an_optimizer_step_that_fails_on_a_rank_is_undone_there(tmp_path: Path) -> None:
    # Rank 1's optimizer raises once it has stepped: every rank raises naming rank 1, and rank
    # 1's parameters are those it had before that step (the undo copy); rank 0 took the step
    # and hears of the failure at the next exchange.
    first, second = both_reports("optimizer-raises", tmp_path)
    assert second["error"] == (1, "optimizer", "RuntimeError")
    assert first["error"] is not None
    assert first["error"][0] == 1
    assert second["global_step"] == worker.FAIL_AT
    for now, before in zip(second["params"], second["before"], strict=True):
        assert torch.equal(now, before)


@pytest.mark.parametrize("exchange", ["packed", "apart"])
def test_a_step_backup_that_fails_on_a_rank_fails_every_rank_within_seconds(
    tmp_path: Path, exchange: str
) -> None:
    # The backup is copied while the step's all-reduces run. When it fails on rank 1, rank 1
    # still joins the rest of the step's exchange (here the broadcast of BatchNorm's
    # statistics), then fails before stepping; rank 0 takes the step and hears of the failure
    # at its next exchange. Neither waits for the process group's timeout (120 s here).
    reports, codes, _ = launch("backup-raises", tmp_path, timeout=100, exchange=exchange)
    assert codes == [0, 0]
    first, second = reports
    assert first is not None
    assert second is not None
    assert second["error"] == (1, "optimizer", "MemoryError")
    assert second["global_step"] == worker.FAIL_AT - 1
    assert first["error"] is not None
    assert (first["error"][0], first["error"][2]) == (1, "MemoryError")
    assert first["global_step"] == worker.FAIL_AT
    for report in (first, second):
        assert report["seconds"] < 30


def test_checkpoints_saved_during_a_fit_hold_the_step_they_count(tmp_path: Path) -> None:
    # A checkpoint saved from another task while the ranks train must hold the parameters of
    # the step it counts, or a fit resumed from it would train a batch twice or not at all.
    first, second = both_reports("mid-fit-checkpoint", tmp_path)
    assert len(first["checkpoints"]) == 15
    assert [same for _, same in first["checkpoints"]] == [True] * 15, first["checkpoints"]
    steps = [at for at, _ in first["checkpoints"]]
    assert steps == sorted(steps)
    assert all(at >= number + 1 for number, at in enumerate(steps))
    assert steps[0] < 10  # saved during the fit: it waited for the steps in flight, no longer
    for report in (first, second):
        assert report["global_step"] == report["resumed_global_step"] == 20
        for a, b in zip(report["params"], report["resumed_params"], strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("exchange", ["packed", "apart"])
def test_metrics_are_those_each_phase_reported(tmp_path: Path, exchange: str) -> None:
    # Training reports "accuracy", validation "error": neither shows up in the other's figures.
    reports, codes, _ = launch("metrics", tmp_path, exchange=exchange)
    assert codes == [0, 0]
    _, result, metrics = reference_params(valid_step=worker.valid_step)
    for report in reports:
        assert report is not None
        for (train_metrics, valid), record in zip(report["history"], result.history, strict=True):
            assert set(train_metrics) == {"accuracy"}
            assert train_metrics == pytest.approx(dict(record.train_metrics), abs=1e-6)
            assert set(valid) == {"loss", "error"}
            assert valid == pytest.approx(dict(record.valid_metrics or {}), abs=1e-6)
        assert report["validate"] == pytest.approx(metrics, abs=1e-6)


def test_a_metric_some_ranks_return_is_its_mean_over_their_items(tmp_path: Path) -> None:
    # Divided by every rank's items, it was 0.5 where it was 1.0 wherever it was returned.
    first, second = both_reports("partial-metrics", tmp_path)
    for report in (first, second):
        train, valid = report["history"]
        assert train == {"rank_0": 1.0}
        assert valid["rank_1"] == 2.0
        assert report["validate"]["rank_1"] == 2.0
        assert report["validate"]["error"] == pytest.approx(valid["error"])


@pytest.mark.parametrize("devices", [1, 2], ids=["1-device-per-rank", "2-devices-per-rank"])
def test_every_rank_takes_rank_0s_batchnorm_statistics(tmp_path: Path, devices: int) -> None:
    # As DDP's broadcast_buffers: each rank's forwards update its own statistics, on its own
    # data; without them following rank 0's, the ranks' models (and validations) would differ.
    first, second = both_reports(f"batchnorm{devices}", tmp_path)
    assert first["state"].keys() == second["state"].keys()
    for name, value in first["state"].items():
        assert torch.equal(value, second["state"][name]), name
    assert first["validate"] == second["validate"]


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        # Their gradient buckets would differ in size and number: the all-reduces would not
        # match.
        ("mixed-devices", "(devices: 2 on rank 1, 1 on rank 0)"),
        # Their replicas would drift apart, as a CPU and a GPU replica do in one process.
        ("mixed-kinds", "rank 0 trains on cpu, rank 1 trains on cuda"),
        # on_failure other than "raise": refused on every rank together, after the ranks meet.
        # Refused on one rank alone before it, the others waited for the group's timeout.
        ("on-failure-both", "on_failure='drop' is not supported across processes yet"),
        ("on-failure-rank-1", "ranks [1] build a different trainer from rank 0"),
        ("on-failure-rank-1", "on_failure: drop on rank 1, raise on rank 0"),
        # Not compared before: the ranks trained apart, reporting the same loss.
        ("optimizer-differs", "optimizer: SGD [{'lr': 0.3, 'momentum': 0.9,"),
        ("scheduler-differs", "lr_scheduler: StepLR {'step_size': 3, "),
        # Not compared before: the first two trained apart; the third trained on.
        ("interval-differs", "lr_scheduler_interval: step on rank 1, epoch on rank 0"),
        # Stepped on each rank's own metric, the ranks' learning rates would part.
        ("monitor-differs", "lr_scheduler_monitor: train_loss on rank 1, valid_loss on rank 0"),
        ("precision-differs", "autocast: bfloat16 on rank 1, off on rank 0"),
        # Each rank's gradients lie in its flat buffers as its weights do: summed element by
        # element, the ranks' models parted silently (0.23 apart, a review's two ranks).
        ("layout-differs", "memory layouts: [(0, (1, 16))] on rank 1, [] on rank 0"),
        # Not compared before: both trained, each on its part of its own batches, rank 1's
        # batches of 8 overlapping rank 0's of 12, some samples trained on by neither.
        ("batch-size-differs", "different train_data: this rank's is a DataLoader of "),
        # Validated before, over rank 1's part of its own part: "exact" means of other samples.
        ("valid-data-differs", "different valid_data: this rank's is a list of"),
        # Assigned on rank 1 alone between calls: compared as the ranks first met, never
        # again, a monitor parted the ranks' learning rates and models without a word.
        (
            "changed-monitor",
            "ranks [1] have trainer options other than rank 0's in this call "
            "(lr_scheduler_monitor: train_loss on rank 1, valid_loss on rank 0): an option "
            "assigned between calls (trainer.lr_scheduler_monitor = ...) must be assigned alike",
        ),
        ("changed-accumulation", "(accumulate_grad_batches: 2 on rank 1, 1 on rank 0)"),
    ],
)
def test_ranks_whose_devices_or_options_differ_are_refused_on_every_rank(
    tmp_path: Path, scenario: str, expected: str
) -> None:
    reports, codes, seconds = launch(scenario, tmp_path, timeout=60)
    assert codes == [0, 0]
    for report in reports:
        assert report is not None
        assert report["error"] is not None
        assert expected in report["error"]
        assert report.get("steps", 0) == 0  # refused before a step is applied
    assert seconds < 30


def test_a_sync_batchnorm_on_two_devices_a_rank_warns_for_one_device_a_process(
    tmp_path: Path,
) -> None:
    # The warning said it normalised each shard alone, as within one process; in a group
    # torch tries to synchronise it from each device's thread (and refuses it on CPUs).
    reports, codes, _ = launch("syncbn-two-devices", tmp_path, timeout=60)
    assert codes == [0, 0]
    for report in reports:
        assert report is not None
        assert any("one device a process" in w for w in report["warnings"])
        assert not any("shard alone" in w for w in report["warnings"])
        assert "SyncBatchNorm expected input tensor to be on GPU" in report["error"]


def test_a_rank_that_dies_before_joining_is_named_by_the_others(tmp_path: Path) -> None:
    # Lost while the trainers meet for the first time: a WorkerFailedError naming the rank, as
    # later in training, not the internal RankLost it was.
    reports, codes, _ = launch("dies-before-joining", tmp_path, timeout=60)
    assert codes[1] == 3
    report = reports[0]
    assert report is not None
    assert report["error"] is not None
    assert (report["error_rank"], report["error_type"]) == (1, "ProcessLost")
    assert "rank 1 stopped answering" in report["error"]
    assert report["seconds"] < 30


@pytest.mark.parametrize("exchange", ["packed", "apart"])
@pytest.mark.parametrize("difference", ["wider", "deeper", "float64"])
def test_ranks_whose_models_differ_are_refused_on_every_rank(
    tmp_path: Path, difference: str, exchange: str
) -> None:
    # Refused by the set-up's check, with what differs, on both ranks: not by gloo, whose
    # all-reduces of different sizes abort a process (a header's size depends on the model:
    # its parameters, and a small model's gradients inside it).
    reports, codes, seconds = launch(
        f"model-differs-{difference}", tmp_path, timeout=60, exchange=exchange
    )
    assert codes == [0, 0]
    for report in reports:
        assert report is not None
        assert "ranks [1] build a different trainer from rank 0" in report["error"]
    assert seconds < 30


def test_a_failure_in_a_second_fit_is_announced_like_the_first(tmp_path: Path) -> None:
    # Both ranks catch the first WorkerFailedError and fit again; rank 1 fails again, and rank
    # 0 must hear of that failure, not of a lost rank (or hang) when rank 1 goes away.
    for report in both_reports("raise-twice", tmp_path, timeout=60):
        assert report["errors"] == [(1, "injected failure on rank 1")] * 2


@pytest.mark.parametrize("exchange", ["packed", "apart"])
@pytest.mark.parametrize("devices", [1, 2], ids=["1-device-per-rank", "2-devices-per-rank"])
def test_a_rank_cancelled_in_an_exchange_keeps_the_step_the_others_took(
    tmp_path: Path, devices: int, exchange: str
) -> None:
    # Rank 1's fit is cancelled while it waits for rank 0 in a step's exchange. Once the
    # exchange is done every rank takes that step: rank 1 too, before the cancellation goes on
    # (else it would be a step behind for good), and the exchange is not left half way (else
    # rank 1's next collectives would meet rank 0's gradients). Both ranks then fit again.
    first, second = both_reports(f"cancel{devices}", tmp_path, timeout=60, exchange=exchange)
    assert second["first"] == "cancelled"
    assert first["first"][0] == 1
    assert "CancelledError" in first["first"][1]
    assert first["first_step"] == second["first_step"] == worker.FAIL_AT + 1
    assert_equal_tensors(first["first_params"], second["first_params"])
    assert first["global_step"] == second["global_step"] == 20
    assert_equal_tensors(first["params"], second["params"])


@pytest.mark.parametrize("call", ["fit", "validate"])
def test_a_rank_cancelled_in_the_last_exchange_of_a_call_tells_nobody(
    tmp_path: Path, call: str
) -> None:
    # Rank 1's fit (or validate) is cancelled while it waits for rank 0 in the call's last
    # exchange. Every rank has ended the call then: rank 1 must not wait a minute for someone
    # to hear of it, nor leave its announcement pending, to meet the ranks' next call.
    first, second = both_reports(f"cancel-at-end-{call}", tmp_path, timeout=40)
    assert first["first"] is None
    assert second["first"] == "cancelled"
    assert second["seconds"] < 10
    assert first["global_step"] == second["global_step"]
    assert first["validate"] == second["validate"]


def test_validate_during_fit_is_refused_on_that_rank_alone(tmp_path: Path) -> None:
    # As on one machine: a ConfigurationError for the caller; the fit goes on on every rank.
    first, second = both_reports("validate-during-fit", tmp_path, timeout=60)
    assert "already running" in second["refused"]
    assert first["global_step"] == second["global_step"] == 20
    assert_equal_tensors(first["params"], second["params"])


@pytest.mark.parametrize("exchange", ["packed", "apart"])
def test_step_timeout_does_not_count_the_wait_for_a_slower_rank(
    tmp_path: Path, exchange: str
) -> None:
    # Rank 0 loads a batch 8 s late; rank 1 (step_timeout=5) waits for it in the exchange. Its
    # device is not slow: no WorkerTimeoutError (whose announcement, while the timed-out job
    # still sat in the exchange, would also have met the others' collectives out of order).
    first, second = both_reports("late-peer", tmp_path, timeout=60, exchange=exchange)
    assert first["global_step"] == second["global_step"] == 20
    assert_equal_tensors(first["params"], second["params"])


def test_a_mid_epoch_state_continues_only_on_as_many_processes(tmp_path: Path) -> None:
    # In mid-epoch each rank has counted its own batches, in the ranks' order: one process
    # would skip half of what was done and train on the rest again (and the other way round).
    import anyio

    trainer = one_device_trainer

    async def stopped_in_mid_epoch() -> None:
        t = trainer()

        async def stop_at_step_2() -> None:
            async for event in t.events():
                if isinstance(event, asyncddp.StepEnded) and event.step == 2:
                    t.stop()

        async with anyio.create_task_group() as group:
            group.start_soon(stop_at_step_2)
            assert (await t.fit(worker.batches(40, 8), epochs=1)).stopped
        await t.save_checkpoint(tmp_path / "one.ckpt")

    anyio.run(stopped_in_mid_epoch)
    reports, codes, _ = launch("resume-other-world", tmp_path, timeout=60)
    assert codes == [0, 0]
    for report in reports:
        assert report is not None
        assert "1 process(es): continue it on as many (not 2)" in report["error"]

    async def resume_on_one() -> None:
        with pytest.raises(asyncddp.ConfigurationError, match=r"2 process\(es\).*\(not 1\)"):
            await trainer().fit(worker.batches(40, 8), epochs=1, resume=tmp_path / "two.ckpt")

    anyio.run(resume_on_one)


@pytest.mark.parametrize("exchange", ["packed", "apart"])
def test_ranks_in_different_exchanges_say_so(tmp_path: Path, exchange: str) -> None:
    # Rank 1's step sends its gradients with the header; rank 0, validating, sends a header
    # alone. Both must learn they are out of step, not meet each other's next collectives.
    reports = both_reports("out-of-step", tmp_path, timeout=40, exchange=exchange)
    for report in reports:
        assert report["error"].startswith("the ranks are out of step")
        assert report["error_type"] == "ConfigurationError"  # not a device's failure
    # Each named, not by internal codes ("exchange 2 here, others elsewhere (3)").
    assert "at the end of a validation" in reports[0]["error"]
    assert "the other rank at a training step (fit)" in reports[0]["error"]


def test_an_option_refused_on_one_rank_makes_every_rank_raise_naming_it(tmp_path: Path) -> None:
    # Checked before joining, the refusal stayed on rank 1: rank 0 waited in the call's first
    # exchange for the process group's timeout.
    started = time.monotonic()
    first, second = both_reports("option-on-one-rank", tmp_path, timeout=60)
    seconds = time.monotonic() - started
    assert second["error"].startswith("ConfigurationError: gradient_clip_val")
    assert first["error_rank"] == 1
    assert first["error_type"].endswith("ConfigurationError")
    assert seconds < 30


def test_a_non_finite_loss_on_one_rank_is_a_non_finite_loss_error_on_every_rank(
    tmp_path: Path,
) -> None:
    # The other rank raised a plain WorkerFailedError (an "except NonFiniteLossError" caught
    # it on one rank only), whose cause read "the loss is the loss is nan": the cause was
    # rebuilt from its message.
    first, second = both_reports("nan-on-rank-1", tmp_path, timeout=60)
    for report in (first, second):
        assert report["error"].startswith("NonFiniteLossError: ")
        assert "the loss is nan (check_finite=True)" in report["error"]
        assert report["error_rank"] == 1
    # No cause, as on the rank it came from (a private _NonFiniteLoss was, on both).
    assert first["cause"] == "NoneType: None"


@pytest.mark.parametrize("exchange", ["packed", "apart"])
def test_ranks_in_different_trainers_calls_say_so(tmp_path: Path, exchange: str) -> None:
    # Rank 0 fits trainer A then B, rank 1 B then A, of one model: each exchange met the
    # other trainer's and was summed with it, and both ranks trained on, silently wrong.
    for report in both_reports("trainers-crossed", tmp_path, timeout=60, exchange=exchange):
        assert len(report["errors"]) == 2
        for error in report["errors"]:
            assert error is not None
            # Raised as it is, not as a device's failure (the step's exchange runs in a job).
            assert error.startswith("ConfigurationError: the ranks are in different trainers'")
        assert report["steps"] == [0, 0]  # no step of either was taken


def test_init_without_the_torchrun_environment_says_how_to_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(asyncddp.ConfigurationError, match="torchrun --nproc-per-node"):
        asyncddp.distributed.init()
    assert asyncddp.distributed.world() is None
    assert not asyncddp.distributed.is_initialized()


def torchrun_env(monkeypatch: pytest.MonkeyPatch, gpus: int, env: dict[str, Any]) -> None:
    """This process as ``env`` describes it (RANK, WORLD_SIZE, LOCAL_*), with ``gpus`` GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))


ONE_MACHINE = {"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2}


@pytest.mark.parametrize(
    ("gpus", "env", "expected"),
    [
        (0, ONE_MACHINE, "gloo"),
        (1, {"RANK": 0, "WORLD_SIZE": 1}, "nccl"),
        (1, {**ONE_MACHINE, "RANK": 0, "LOCAL_RANK": 0}, "gloo"),  # NCCL: one GPU per rank
        (1, ONE_MACHINE, "gloo"),
        (1, {"RANK": 1, "WORLD_SIZE": 2}, "gloo"),  # by hand, no LOCAL_*: one machine
        (1, {"RANK": 0, "WORLD_SIZE": 2}, "gloo"),
        (2, ONE_MACHINE, "nccl"),
        (8, {"RANK": 11, "WORLD_SIZE": 16, "LOCAL_RANK": 3, "LOCAL_WORLD_SIZE": 8}, "nccl"),
    ],
)
def test_the_default_backend_is_nccl_only_with_a_gpu_for_every_local_process(
    monkeypatch: pytest.MonkeyPatch, gpus: int, env: dict[str, int], expected: str
) -> None:
    torchrun_env(monkeypatch, gpus, env)
    assert asyncddp.distributed._backend(None) == expected
    assert asyncddp.distributed._backend("gloo") == "gloo"
    assert asyncddp.distributed._backend("GLOO") == "gloo"  # torch takes any case


@pytest.mark.parametrize("rank", [0, 1])
def test_nccl_without_a_gpu_for_every_process_fails_alike_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    torchrun_env(monkeypatch, 1, {**ONE_MACHINE, "RANK": rank, "LOCAL_RANK": rank})
    with pytest.raises(asyncddp.ConfigurationError, match=r"2 process\(es\) share this machine"):
        asyncddp.distributed._backend("nccl")
    with pytest.raises(asyncddp.ConfigurationError, match="'gloo' or 'nccl'"):
        asyncddp.distributed._backend("mpi")
    # It said "start at most 0 process(es) per machine" where no GPU is visible at all.
    torchrun_env(monkeypatch, 0, {**ONE_MACHINE, "RANK": rank, "LOCAL_RANK": rank})
    with pytest.raises(asyncddp.ConfigurationError, match=r"no GPU is visible here.*'gloo'"):
        asyncddp.distributed._backend("nccl")


def test_across_machines_a_machine_short_of_gpus_is_refused_not_left_on_gloo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 2 machines x 2 processes; this one has 1 GPU. Alone it would take gloo, while the other
    # machine takes NCCL and waits at the first collective: it is refused instead.
    env = {"RANK": 3, "WORLD_SIZE": 4, "LOCAL_RANK": 1, "LOCAL_WORLD_SIZE": 2}
    torchrun_env(monkeypatch, 1, env)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(asyncddp.ConfigurationError, match="init\\('gloo'\\) on every machine"):
        asyncddp.distributed._backend(None)
    with pytest.raises(asyncddp.ConfigurationError, match="init\\('gloo'\\) on every machine"):
        asyncddp.distributed.init()


@pytest.mark.parametrize("rank", [0, 1])
def test_gpus_of_its_own_through_cuda_visible_devices_let_a_process_join_nccl(
    monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    # SLURM's --gpus-per-task: each of 2 processes on a machine sees one GPU, its own, as
    # cuda:0. On one machine asyncddp cannot tell that from 2 processes shown the same GPU, so
    # the default stays gloo, but NCCL is taken when asked for, on cuda:0 for both.
    env = {**ONE_MACHINE, "RANK": rank, "LOCAL_RANK": rank}
    torchrun_env(monkeypatch, 1, env)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(4 + rank))
    assert asyncddp.distributed._backend(None) == "gloo"
    assert asyncddp.distributed._backend("nccl") == "nccl"
    assert asyncddp.distributed._local_gpu() == 0
    # Across machines the default is NCCL, not refused for the GPU count.
    torchrun_env(
        monkeypatch,
        1,
        {"RANK": 2 + rank, "WORLD_SIZE": 4, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": 2},
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", str(rank))
    assert asyncddp.distributed._backend(None) == "nccl"
    assert asyncddp.distributed._local_gpu() == 0
    # Without the variable, the same machine is short of GPUs, and says so.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(asyncddp.ConfigurationError, match="CUDA_VISIBLE_DEVICES"):
        asyncddp.distributed._backend(None)


def test_init_with_nccl_makes_this_processs_gpu_current(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("device", device)))
    monkeypatch.setattr(
        torch.distributed,
        "init_process_group",
        lambda backend, **kwargs: calls.append(("backend", backend)),
    )
    monkeypatch.setattr(asyncddp.distributed, "_current", lambda: None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    # The check that no two ranks share a GPU, alone in its group.
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", HashStore)
    monkeypatch.setattr(asyncddp.distributed, "_gpu_id", lambda index: f"GPU-{index}")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    env = {"RANK": 11, "WORLD_SIZE": 16, "LOCAL_RANK": 3, "LOCAL_WORLD_SIZE": 8}
    torchrun_env(monkeypatch, 8, env)
    asyncddp.distributed.init()
    torchrun_env(monkeypatch, 1, env)  # one GPU of its own, as cuda:0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    asyncddp.distributed.init()
    assert calls == [("device", 3), ("backend", "nccl"), ("device", 0), ("backend", "nccl")]


def test_init_again_asking_for_another_backend_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    # It returned the group already joined, over gloo, without a word of the NCCL asked for.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: "gloo")
    monkeypatch.setattr(asyncddp.distributed, "_current", lambda: "the group joined")
    with pytest.warns(asyncddp.AsyncDDPWarning, match=r"init\(backend='nccl'\): .* over gloo"):
        assert asyncddp.distributed.init("nccl") == "the group joined"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for backend in ("gloo", None):
            assert asyncddp.distributed.init(backend) == "the group joined"
        # A group joined with a backend for each device type has both.
        monkeypatch.setattr(torch.distributed, "get_backend", lambda: "cpu:gloo,cuda:nccl")
        for backend in ("gloo", "nccl"):
            assert asyncddp.distributed.init(backend) == "the group joined"


def test_auto_devices_in_a_group_are_the_gpu_init_made_current(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncddp._trainer import _rank_devices

    monkeypatch.setattr(asyncddp.distributed, "is_initialized", lambda: True)
    torchrun_env(monkeypatch, 2, {"RANK": 3, "WORLD_SIZE": 4, "LOCAL_RANK": 3})
    assert _rank_devices("auto") == "cuda:1" == f"cuda:{asyncddp.distributed._local_gpu()}"
    assert _rank_devices(" AUTO") == "cuda:1"  # read as resolve_devices reads it
    assert _rank_devices("cpu") == "cpu"
    torchrun_env(monkeypatch, 0, {"RANK": 3, "WORLD_SIZE": 4, "LOCAL_RANK": 3})
    assert _rank_devices("auto") == "auto"  # no GPU: resolved as anywhere else


def ranks_check_their_gpus(gpus: list[str]) -> list[BaseException | None]:
    """Each rank's outcome of ``_refuse_shared_gpus``, the ranks as threads on one store."""
    store = HashStore()
    outcomes: list[BaseException | None] = [None] * len(gpus)

    def rank(r: int) -> None:
        try:
            asyncddp.distributed._refuse_shared_gpus(store, r, len(gpus), gpus[r], prefix="t/")
        except BaseException as error:
            outcomes[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(gpus))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return outcomes


def test_ranks_that_share_a_gpu_are_refused_on_every_rank_before_nccl_meets() -> None:
    # CUDA_VISIBLE_DEVICES="0,1" for 4 processes on a machine, asked for NCCL: ranks 0 and 2
    # both get cuda:0. NCCL would refuse them at its first collective ("Duplicate GPU
    # detected"), which the others would see as a rank lost: every rank says so at init.
    assert ranks_check_their_gpus(["GPU-a", "GPU-b", "GPU-c", "GPU-d"]) == [None] * 4
    outcomes = ranks_check_their_gpus(["GPU-a", "GPU-b", "GPU-a", "GPU-b"])
    assert all(isinstance(o, asyncddp.ConfigurationError) for o in outcomes)
    assert "4 of the 4 processes share a GPU" in str(outcomes[0])
    outcomes = ranks_check_their_gpus(["GPU-a", "GPU-b", "GPU-a"])
    assert all(isinstance(o, asyncddp.ConfigurationError) for o in outcomes)
    assert "rank 1: GPU GPU-b, its own" in str(outcomes[1])
    assert "rank 2: GPU GPU-a, shared" in str(outcomes[2])


def test_a_trainer_on_the_cpu_in_an_nccl_group_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncddp._comm import Comm

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda: "nccl")
    with pytest.raises(asyncddp.ConfigurationError, match="first device is cpu#0"):
        Comm(asyncddp.cpu_devices(1), 1, {"model": "model"})


def test_a_small_models_gradients_travel_in_the_header_on_cpus_only() -> None:
    # They are joined to the header on the CPU: a GPU's stay in buckets of their own (gloo
    # takes them where they are), or torch.cat would refuse tensors on two devices.
    from asyncddp._comm import Comm
    from asyncddp._devices import Device

    gpu = Device(index=0, torch_device=torch.device("cuda", 0), name="cuda:0")
    with one_rank_group():
        for devices, packable in ((asyncddp.cpu_devices(1), True), ((gpu,), False)):
            comm = Comm(devices, 2, {"model": "model"})
            comm.layout = [(100, torch.float32), (10, torch.float32)]
            assert comm._packable() is packable


def test_a_rank_joining_a_step_makes_each_zero_bucket_where_the_real_one_is() -> None:
    # A rank that fails, or is out of step, sends zero buckets in the others' exchange. NCCL
    # matches each collective on its GPU's communicator: with several GPUs a rank, each bucket
    # (every device's chunks in turn) goes where that device's is. Gloo matches by order.
    from asyncddp._comm import bucket_devices
    from asyncddp._devices import Device

    gpus = [Device(index=i, torch_device=torch.device("cuda", i), name=f"cuda:{i}") for i in (0, 1)]
    wire = torch.device("cuda", 0)
    assert (
        bucket_devices(4, gpus, wire, "nccl")
        == [gpus[0].torch_device] * 2 + [gpus[1].torch_device] * 2
    )
    assert bucket_devices(2, gpus[:1], wire, "nccl") == [wire] * 2
    assert bucket_devices(4, gpus, torch.device("cpu"), "gloo") == [torch.device("cpu")] * 4


# -- each rank's part of the data, without processes ---------------------------------------------


def _first_column(batches: Any) -> list[int]:
    return [int(value) for inputs, _ in batches for value in inputs[:, 0]]


def test_a_dataloader_is_strided_in_its_batch_sampler() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from asyncddp._ranks import rank_view

    inputs = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    loader = DataLoader(TensorDataset(inputs, torch.zeros(20)), batch_size=4)
    parts = [list(rank_view(loader, rank, 2, seed=0)) for rank in range(2)]
    assert _first_column(parts[0]) == [0, 2, 4, 6, 16, 18, 20, 22, 32, 34, 36, 38]
    assert _first_column(parts[1]) == [8, 10, 12, 14, 24, 26, 28, 30]
    assert len(rank_view(loader, 1, 2, seed=0)) == 2  # type: ignore[arg-type]


def test_a_ranks_view_of_shuffled_data_seeds_no_gpus_generator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The ranks draw their first batches under a shared seed, so that a shuffling sampler
    # orders alike on each: on the CPU's generator, put back after. No GPU's generator is
    # seeded (torch.manual_seed seeds them all, and fork_rng(devices=[]) puts back the CPU's
    # alone): a GPU's dropout would restart its stream at every epoch and differ on a resume.
    from torch.utils.data import DataLoader, TensorDataset

    from asyncddp._ranks import rank_view

    seeded: list[str] = []
    for module, name in (
        (torch.cuda, "manual_seed_all"),
        (torch.mps, "manual_seed"),
        (torch.xpu, "manual_seed_all"),
    ):
        monkeypatch.setattr(
            module, name, lambda seed, where=f"{module.__name__}.{name}": seeded.append(where)
        )
    inputs = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    loader = DataLoader(TensorDataset(inputs, torch.zeros(20)), batch_size=4, shuffle=True)
    parts = [list(rank_view(loader, rank, 2, seed=3, epoch=1)) for rank in range(2)]
    assert seeded == []
    firsts = [_first_column(part) for part in parts]  # still one order, split between them
    assert sorted(firsts[0] + firsts[1]) == list(range(0, 40, 2))
    again = [_first_column(rank_view(loader, rank, 2, seed=3, epoch=1)) for rank in range(2)]
    assert again == firsts


@pytest.mark.cuda
def test_a_ranks_view_of_shuffled_data_leaves_the_gpus_generator_mid_stream() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from asyncddp._ranks import rank_view

    torch.cuda.manual_seed(123)
    torch.rand(3, device="cuda")  # mid-stream, as a checkpoint's restore leaves it
    state = torch.cuda.get_rng_state()
    loader = DataLoader(TensorDataset(torch.zeros(20, 2)), batch_size=4, shuffle=True)
    assert len(list(rank_view(loader, 0, 2, seed=3, epoch=1))) == 3
    assert torch.equal(torch.cuda.get_rng_state(), state)


def test_a_dataloader_without_batching_is_strided_in_its_sampler() -> None:
    # batch_size=None: each of the dataset's items is a batch; the ranks load disjoint items,
    # which together are all of them, each once (a shuffling sampler in the same order).
    from torch.utils.data import DataLoader, TensorDataset

    from asyncddp._ranks import rank_view

    loaded: list[int] = []

    class Counted(TensorDataset):
        def __getitem__(self, index: int) -> Any:
            loaded.append(index)
            return super().__getitem__(index)

    batches = torch.arange(40, dtype=torch.float32).reshape(5, 4, 2)  # 5 batches of 4 items
    dataset = Counted(batches, torch.zeros(5, 4))
    for shuffle in (False, True):
        loader = DataLoader(dataset, batch_size=None, shuffle=shuffle)
        parts = []
        for rank in range(2):
            loaded.clear()
            parts.append(list(rank_view(loader, rank, 2, seed=3, epoch=1)))
            assert len(loaded) == len(parts[-1])  # the other rank's batches are not loaded
        assert [len(part) for part in parts] == [3, 2]
        firsts = [_first_column(part) for part in parts]
        assert sorted(firsts[0] + firsts[1]) == list(range(0, 40, 2))
        if not shuffle:
            assert firsts[0][:4] == [0, 2, 4, 6]  # batch 0, then 2 and 4
        # The other rank's view is drawn from the same order: the two are disjoint.
        assert not set(firsts[0]) & set(firsts[1])


def test_a_strided_dataloader_keeps_the_loaders_settings() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from asyncddp._ranks import rank_view

    dataset = TensorDataset(torch.zeros(20, 2))
    settings: dict[str, Any] = {"num_workers": 1, "timeout": 7.0, "prefetch_factor": 3}
    if "in_order" in DataLoader.__init__.__code__.co_varnames:
        settings["in_order"] = False  # torch 2.6 and newer
    for loader in (
        DataLoader(dataset, batch_size=4, **settings),
        DataLoader(dataset, batch_size=None, **settings),
    ):
        view = rank_view(loader, 1, 2, seed=0)
        assert isinstance(view, DataLoader)
        assert view is not loader
        for name, value in settings.items():
            assert getattr(view, name) == value, name


def test_a_dataloader_subclass_keeps_what_its_iter_does() -> None:
    # Its own __iter__ (here: it scales every batch) runs; each rank keeps its batches of it.
    from torch.utils.data import DataLoader, TensorDataset

    from asyncddp._ranks import rank_view

    class Scaled(DataLoader[Any]):
        def __iter__(self) -> Any:
            for inputs, targets in super().__iter__():
                yield inputs * 10, targets

    inputs = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    loader = Scaled(TensorDataset(inputs, torch.zeros(20)), batch_size=4)
    parts = [list(rank_view(loader, rank, 2, seed=0)) for rank in range(2)]
    assert _first_column(parts[0]) == [0, 20, 40, 60, 160, 180, 200, 220, 320, 340, 360, 380]
    assert _first_column(parts[1]) == [80, 100, 120, 140, 240, 260, 280, 300]


def test_a_distributed_sampler_gets_its_epoch_in_a_one_process_group_too() -> None:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from asyncddp._ranks import rank_view

    dataset = TensorDataset(torch.zeros(8, 2))
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    assert rank_view(loader, 0, 1, seed=0, epoch=3) is loader
    assert sampler.epoch == 3


def test_a_distributed_sampler_that_repeats_samples_warns() -> None:
    # It pads the ranks to equal counts: 301 samples on 2 ranks validated as 302, silently.
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from asyncddp._ranks import rank_view

    padded = TensorDataset(torch.zeros(301, 2))
    loader = DataLoader(padded, batch_size=50, sampler=DistributedSampler(padded, 2, 0))
    with pytest.warns(UserWarning, match="repeats 1 of its 301 samples to give its 2 ranks"):
        rank_view(loader, 0, 2, seed=0)
    even = TensorDataset(torch.zeros(300, 2))
    rank_view(DataLoader(even, sampler=DistributedSampler(even, 2, 0)), 0, 2, seed=0)
    dropped = DistributedSampler(padded, 2, 0, drop_last=True)
    rank_view(DataLoader(padded, sampler=dropped), 0, 2, seed=0)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    ("size", "batch_size", "drop_last"),
    [(20, 4, False), (23, 4, False), (23, 4, True), (5, 8, False)],
)
def test_a_ranks_item_count_is_that_of_the_batches_it_gets(
    world_size: int, size: int, batch_size: int, drop_last: bool
) -> None:
    # What each rank's progress counts to: known without iterating, for a DataLoader (strided
    # in its batch sampler or, for a subclass, iterated whole) and for a list of batches.
    from torch.utils.data import DataLoader, TensorDataset

    from asyncddp._data import items_in
    from asyncddp._ranks import rank_items_total, rank_view

    class Subclass(DataLoader[Any]):
        pass

    dataset = TensorDataset(torch.zeros(size, 2))
    loader = DataLoader(dataset, batch_size=batch_size, drop_last=drop_last)
    listed = list(loader)
    for data in (loader, Subclass(dataset, batch_size=batch_size, drop_last=drop_last), listed):
        counts = []
        for rank in range(world_size):
            expected = sum(items_in(batch) for batch in rank_view(data, rank, world_size, seed=0))
            assert rank_items_total(data, rank, world_size) == expected
            counts.append(expected)
        assert sum(counts) == (size // batch_size * batch_size if drop_last else size)
    assert rank_items_total(iter(listed), 0, world_size) is None  # unknown without iterating


def test_a_step_as_large_as_the_last_takes_no_pass_to_scale_its_reduced_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Across ranks the gradients are weighted before the backward against the last step's
    # global item count, so a step as large as it needs no multiplication after the
    # all-reduce (a pass over every gradient, 2 MB a step on the benchmarks' MLP); a step of
    # another size is scaled to the exact mean. A one-process gloo group, in this process.
    import anyio

    from asyncddp import _sync

    coefficients: list[float] = []
    scale_grads = _sync.scale_grads

    def spy(grads: Any, coefficient: float) -> Any:
        coefficients.append(coefficient)
        return scale_grads(grads, coefficient)

    monkeypatch.setattr(_sync, "scale_grads", spy)
    data = worker.batches(4)  # 12, 12, 12, then 7 items
    with one_rank_group():
        trainer = one_device_trainer(0)  # joins the group
        anyio.run(functools.partial(trainer.fit, data, epochs=1))
    assert coefficients == [1 / 12, 1.0, 1.0, 12 / 7]
    expected = one_device_trainer(0)
    anyio.run(functools.partial(expected.fit, data, epochs=1))
    for mine, theirs in zip(trainer.model.parameters(), expected.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)


def test_a_model_still_wrapped_in_distributed_data_parallel_is_refused() -> None:
    # A half-ported DDP script: DDP's reducer all-reduced on the default group in every
    # backward, beside the trainer's exchange; at a step one rank made without data (an odd
    # batch count) the other waited in DDP's all-reduce until the process group's timeout,
    # with nothing logged (a user's trial, 2 ranks). With an even count, an extra all-reduce a
    # step, silently.
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    with one_rank_group():
        ddp = torch.nn.parallel.DistributedDataParallel(worker.model(0))
        message = r"model is wrapped in DistributedDataParallel: pass the module inside it \("
        with pytest.raises(asyncddp.ConfigurationError, match=message):
            asyncddp.Trainer(ddp, sgd, worker.step, devices="cpu")
        held = torch.nn.Sequential(ddp, torch.nn.Identity())
        with pytest.raises(asyncddp.ConfigurationError, match=r"model\.0 is wrapped in Distr"):
            asyncddp.Trainer(held, sgd, worker.step, devices="cpu")
        asyncddp.Trainer(ddp.module, sgd, worker.step, devices="cpu")  # what it wraps trains


@pytest.mark.parametrize("exchange", ["packed", "apart"])
def test_the_step_backup_is_copied_while_the_gradients_are_exchanged(
    monkeypatch: pytest.MonkeyPatch, exchange: str
) -> None:
    # With one CPU device per rank, the copy that undoes a failed step is taken while the
    # rank waits for the others' gradients (the parameters and optimizer state do not change
    # in the exchange), not after it on the step's own time. A one-process gloo group.
    import anyio

    from asyncddp import _comm, _sync

    if exchange == "apart":
        monkeypatch.setattr(_comm, "PACK_ELEMENTS", 0)
    events: list[str] = []
    issue, capture = _comm.Comm._issue, _sync.StepBackup.capture

    class Work:
        def __init__(self, work: Any) -> None:
            self.work = work

        def wait(self) -> Any:
            events.append("wait")
            return self.work.wait()

    def spied_issue(self: Any, tensors: Any) -> list[Any]:
        events.append("issue")
        return [Work(work) for work in issue(self, tensors)]

    def spied_capture(self: Any, *args: Any, **kwargs: Any) -> None:
        events.append("capture")
        capture(self, *args, **kwargs)

    monkeypatch.setattr(_comm.Comm, "_issue", spied_issue)
    monkeypatch.setattr(_sync.StepBackup, "capture", spied_capture)
    data = worker.batches(4)
    with one_rank_group():
        trainer = one_device_trainer(0)
        anyio.run(functools.partial(trainer.fit, data, epochs=1))
        assert trainer._comm is not None
        assert trainer._comm.packed() == (exchange == "packed")
    at = [i for i, event in enumerate(events) if event == "capture"]
    # One for each of the 4 steps, and one for the exchange after the last batch, where the
    # rank learns that no rank has more (had another one data, that would be a step).
    assert len(at) == 5, " ".join(events)
    for i in at:
        assert events[i - 1 : i + 2] == ["issue", "capture", "wait"], " ".join(events)
    expected = one_device_trainer(0)
    anyio.run(functools.partial(expected.fit, data, epochs=1))
    for mine, theirs in zip(trainer.model.parameters(), expected.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)


def test_a_backup_that_fails_during_the_exchange_fails_the_step_before_it_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The backup is copied while the exchange is in flight; if the copy raises, the exchange
    # still completes (the other ranks are in it), then the step fails in its optimizer phase
    # without being taken: the model is the one the step before it left.
    import anyio

    from asyncddp import _sync

    capture = _sync.StepBackup.capture
    calls = [0]

    def failing(self: Any, *args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("no room for the backup")
        capture(self, *args, **kwargs)

    monkeypatch.setattr(_sync.StepBackup, "capture", failing)
    data = worker.batches(4)
    with one_rank_group():
        trainer = one_device_trainer(0)
        with pytest.raises(asyncddp.WorkerFailedError) as caught:
            anyio.run(functools.partial(trainer.fit, data, epochs=1))
    error = caught.value
    assert (error.rank, error.phase, error.step) == (0, "optimizer", 1)
    assert isinstance(error.__cause__, MemoryError)
    assert trainer.global_step == 1
    expected = one_device_trainer(0)
    anyio.run(functools.partial(expected.fit, data[:1], epochs=1))
    for mine, theirs in zip(trainer.model.parameters(), expected.model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": 1, "WORLD_SIZE": 1}, r"RANK must be from 0 to WORLD_SIZE - 1 \(0\), got 1"),
        ({"RANK": -1, "WORLD_SIZE": 2}, "RANK must be from 0 to WORLD_SIZE - 1"),
        ({"RANK": 0, "WORLD_SIZE": 0}, "WORLD_SIZE must be at least 1, got 0"),
        ({"RANK": "one", "WORLD_SIZE": 2}, "RANK must be a whole number, got 'one'"),
        ({"RANK": 0, "WORLD_SIZE": "2.0"}, "WORLD_SIZE must be a whole number"),
        ({**ONE_MACHINE, "LOCAL_RANK": 2}, "LOCAL_RANK must be from 0 to LOCAL_WORLD_SIZE - 1"),
        ({**ONE_MACHINE, "LOCAL_WORLD_SIZE": 3}, r"LOCAL_WORLD_SIZE must be from 1 to WORLD_SIZE"),
        ({"RANK": 0, "WORLD_SIZE": 2, "LOCAL_RANK": 2}, "LOCAL_RANK must be from 0 to WORLD_SIZE"),
        ({"RANK": 0, "WORLD_SIZE": 1, "MASTER_PORT": 70000}, "MASTER_PORT must be a port number"),
        ({"RANK": 0, "WORLD_SIZE": 1, "MASTER_PORT": "http"}, "MASTER_PORT must be a whole"),
        ({"RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": " "}, "MASTER_ADDR is empty"),
    ],
)
def test_init_refuses_an_environment_that_describes_no_process_group_at_once(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, Any], expected: str
) -> None:
    # RANK=1 with WORLD_SIZE=1 used to wait for a rank 0 that never comes, for the store's
    # 30 minutes; a word where a number goes raised a bare ValueError from int().
    torchrun_env(monkeypatch, 0, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port(), **env})
    with pytest.raises(asyncddp.ConfigurationError, match=expected) as caught:
        asyncddp.distributed.init()
    assert "torchrun sets" in str(caught.value)
    assert not asyncddp.distributed.is_initialized()


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [
        (0, r"timeout must be a positive number of seconds, got 0"),
        (-5, r"got -5"),
        ("60", r"got '60'"),
        (float("inf"), r"timeout must be from 0.001 to 2e\+06 seconds \(None for torch's"),
        (1e15, r"to 2e\+06 seconds .* got 1000000000000000.0"),  # a bare OverflowError
        (1e-7, r"from 0.001 .* got 1e-07"),  # "timed out after 0ms"
    ],
)
def test_init_refuses_a_timeout_that_is_no_time_limit(
    monkeypatch: pytest.MonkeyPatch, timeout: Any, expected: str
) -> None:
    # 0 and -5 reached torch's store as a timeout: "The client socket has timed out after
    # 0ms", a network fault to read, and C++ stack traces on stderr; "60" raised a bare
    # TypeError from timedelta, inf an OverflowError.
    torchrun_env(monkeypatch, 0, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()})
    with pytest.raises(asyncddp.ConfigurationError, match=expected):
        asyncddp.distributed.init(timeout=timeout)
    assert not asyncddp.distributed.is_initialized()


@pytest.mark.anyio
async def test_a_fit_under_torchrun_without_init_warns_that_each_process_trains_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every process trained the whole data on its own, and wrote the same checkpoints.
    def trainer() -> asyncddp.Trainer:
        return asyncddp.Trainer(worker.model(0), torch.optim.SGD, worker.step, progress_bar=False)

    data = worker.batches(2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    await trainer().fit(data, epochs=1)  # one process of one: nothing to say
    monkeypatch.setenv("WORLD_SIZE", "2")
    alone = trainer()
    with pytest.warns(RuntimeWarning, match=r"WORLD_SIZE=2 .*asyncddp\.distributed\.init\(\)"):
        await alone.fit(data, epochs=1)
    await alone.fit(data, epochs=2)  # once a trainer


def test_settings_compared_across_ranks_leave_out_object_addresses() -> None:
    # A parameter group or LR scheduler holding an object without a repr of its own shows its
    # address, which differs between processes running the same code: not a difference.
    from asyncddp._dsteps import _same_everywhere

    class Rule:
        pass

    first, second = (_same_everywhere(repr([{"lr": 0.1, "rule": Rule()}])) for _ in range(2))
    assert first == second
    assert "0x" not in first
    # A set's order follows its items' hashes, which differ between processes: sorted.
    from asyncddp._dsteps import _plain

    assert _plain({"tags": {"b", "a"}, "lrs": (torch.tensor(0.5), [{"c"}])}) == {
        "tags": ["a", "b"],
        "lrs": (0.5, [["c"]]),
    }


def test_a_lost_rank_s_error_says_why_a_rank_may_stop_answering() -> None:
    # A rank that finished its script without making the call ends its process too: the
    # error does not say it died. A timeout is a rank that hangs or is not in the call.
    from asyncddp import _comm

    reset = _comm._lost_message(1, "Read error: Connection reset by peer")
    assert reset.startswith("rank 1 stopped answering")
    assert "finished without making this call" in reset
    timeout = _comm._lost_message(1, "Timed out waiting 1800000ms for recv operation")
    assert "did not answer within the process group's timeout" in timeout
    assert "not making this call" in timeout


def test_a_failure_without_a_cause_reaches_the_other_ranks_naming_its_rank() -> None:
    # A step timeout has no cause: the error itself goes to the other ranks as the cause of
    # theirs. It went with rank=None, so rank 0's error named rank 1 and its cause named none.
    from asyncddp import _comm

    device = asyncddp.cpu_devices(2)[1]
    timeout = asyncddp.WorkerTimeoutError(device=device, step=3, timeout=5.0)
    error = _comm.describe(timeout, 1, device, step=3, epoch=0).error()
    assert (error.rank, error.device, type(error.__cause__)) == (
        1,
        device,
        asyncddp.WorkerTimeoutError,
    )
    assert isinstance(error.__cause__, asyncddp.WorkerTimeoutError)
    assert (error.__cause__.rank, error.__cause__.device) == (1, device)
    assert timeout.rank is None  # this rank's own error is named where it is raised


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_a_step_raised_reaches_the_other_ranks_naming_its_device_and_phase(
    kind: type[BaseException],
) -> None:
    # It goes up as it is, not as a WorkerFailedError: the other ranks were told of the rank's
    # first device (cpu#0 for one raised on cpu#1, in a fuzzer's runs) and of no phase.
    import anyio

    from asyncddp import _comm

    def step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if asyncddp.current_worker().device.index == 1:
            raise kind("from the step")
        return model(batch).sum()

    trainer = asyncddp.Trainer(
        torch.nn.Linear(3, 1),
        functools.partial(torch.optim.SGD, lr=0.1),
        step,
        devices=asyncddp.cpu_devices(2),
        progress_bar=False,
    )
    with pytest.raises(kind) as caught:
        anyio.run(functools.partial(trainer.fit, [torch.zeros(4, 3)], epochs=1))
    failure = _comm.describe(caught.value, 1, trainer.devices[0], step=0, epoch=0)
    error = failure.error()
    assert (error.rank, error.device.name, error.phase) == (1, "cpu#1", "train")


def fit_in(group: Any, trainer: asyncddp.Trainer) -> Any:
    """Start ``trainer.fit`` (2 epochs of the scenarios' batches) in the task group ``group``;
    an ``anyio.Event`` set once its first step has ended."""
    import anyio

    stepped = anyio.Event()
    stream = trainer.events()

    async def note_a_step() -> None:
        async for event in stream:
            if isinstance(event, asyncddp.StepEnded):
                stepped.set()
                return

    group.start_soon(note_a_step)
    group.start_soon(functools.partial(trainer.fit, worker.batches(), epochs=2))
    return stepped


def test_a_second_trainer_s_call_in_a_process_group_is_refused_while_one_runs() -> None:
    # Every trainer's collectives share asyncddp's group: two calls at once met each other's
    # on the other ranks (summed into the wrong model, or a gloo abort), silently. Refused on
    # every rank alike, before joining; the running call goes on, and then the other may run.
    import anyio

    first, second = one_device_trainer(), one_device_trainer()
    reference = one_device_trainer()

    async def run() -> None:
        async with anyio.create_task_group() as group:
            await fit_in(group, first).wait()
            for call, name in (
                (functools.partial(second.fit, worker.batches(), epochs=1), "fit()"),
                (functools.partial(second.validate, worker.batches()), "validate()"),
            ):
                with pytest.raises(
                    asyncddp.ConfigurationError,
                    match=rf"{re.escape(name)} cannot start while another Trainer's fit\(\) runs",
                ) as refused:
                    await call()
                # Named so in the traceback, not by a private subclass (OtherTrainersCall was).
                assert type(refused.value) is asyncddp.ConfigurationError
        assert first.global_step == 14  # undisturbed
        assert second._comm is None  # refused before joining
        await second.fit(worker.batches(), epochs=1)  # once the other call has ended
        await reference.fit(worker.batches(), epochs=1)
        assert_equal_tensors(list(second.model.parameters()), list(reference.model.parameters()))

    with one_rank_group():
        anyio.run(run)


def test_a_second_call_of_the_same_trainer_in_a_process_group_leaves_the_first_s_claim() -> None:
    # A second fit of one trainer, started while the first was still joining, passed the
    # refusal of a running session and was refused only as its own session began; its end
    # then let go of the first fit's claim, and another trainer's call was let in beside it.
    import anyio

    first, second = one_device_trainer(), one_device_trainer()

    async def run() -> None:
        with anyio.fail_after(60):  # before the fix, the second fit ran beside the first
            await both()

    async def both() -> None:
        async with anyio.create_task_group() as group:
            stepped = fit_in(group, first)
            await anyio.lowlevel.checkpoint()  # the fit has begun: it is joining
            with pytest.raises(asyncddp.ConfigurationError, match="already running on this"):
                await first.fit(worker.batches(), epochs=2)
            await stepped.wait()
            with pytest.raises(asyncddp.ConfigurationError, match="another Trainer's fit"):
                await second.validate(worker.batches())
        assert first.global_step == 14

    with one_rank_group():
        anyio.run(run)


def test_a_call_waiting_for_a_checkpoint_holds_off_another_trainer_s(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A fit waits for a checkpoint of its trainer being written: another trainer's call that
    # came meanwhile was let in first (the fit noted its call only after that wait), so where
    # the checkpoint was written on one rank only, the ranks ran different trainers' calls.
    import anyio

    first, second = one_device_trainer(), one_device_trainer()
    snapshot = asyncddp.Trainer._snapshot

    async def slow_snapshot(self: asyncddp.Trainer) -> Any:
        await anyio.sleep(0.3)
        return await snapshot(self)

    async def run() -> None:
        await first.fit(worker.batches(), epochs=1)
        monkeypatch.setattr(asyncddp.Trainer, "_snapshot", slow_snapshot)
        async with anyio.create_task_group() as group:
            group.start_soon(first.save_checkpoint, tmp_path / "a.ckpt")
            await anyio.sleep(0.05)  # the checkpoint's session runs
            group.start_soon(functools.partial(first.fit, worker.batches(), epochs=2))
            await anyio.lowlevel.checkpoint()  # the fit waits for the checkpoint
            with pytest.raises(asyncddp.ConfigurationError, match="another Trainer's fit"):
                await second.fit(worker.batches(), epochs=1)
        assert first.global_step == 14

    with one_rank_group():
        anyio.run(run)


def test_a_trainer_joins_a_new_process_group_made_after_its_last_call() -> None:
    # A trainer fitted in one process group, which was then destroyed and made anew, joins the
    # new one at its next call (it went on with the destroyed group's collectives, which fail).
    trainer = one_device_trainer()
    with one_rank_group():
        assert fit_to(trainer, 1) == 7
        first = trainer._comm
        assert first is not None
    with one_rank_group():
        assert fit_to(trainer, 2) == 14
        assert trainer._comm is not None
        assert trainer._comm is not first
    assert fit_to(trainer, 3) == 21  # no group now: it trains alone
    assert trainer._comm is None


def test_a_trainer_keeps_no_process_group_alive_once_destroyed() -> None:
    # destroy_process_group tears a group down as its last reference goes. One a trainer (or
    # asyncddp's own group) kept was torn down in the interpreter's exit instead, where gloo's
    # threads now and then aborted the process ("terminate called without an active
    # exception", a torchrun script's rank failing after a finished fit).
    import weakref

    from asyncddp import _comm

    trainer = one_device_trainer()
    with one_rank_group():
        assert fit_to(trainer, 1) == 7
        assert trainer._comm is not None
        own = trainer._comm._group
        assert own is not None
        assert own is not torch.distributed.group.WORLD  # asyncddp's own
        groups = [weakref.ref(torch.distributed.group.WORLD), weakref.ref(own)]
        del own
    assert trainer._comm is not None  # the trainer lives on, and so does its Comm
    assert [group() for group in groups] == [None, None]
    assert _comm.own_group(make=False, device=torch.device("cpu")) is None


def test_a_trainer_whose_own_group_was_destroyed_alone_joins_afresh() -> None:
    # destroy_process_group(group) on asyncddp's own group, the default group kept: the
    # trainer's collectives went to the default group instead, silently.
    trainer = one_device_trainer()
    with one_rank_group():
        assert fit_to(trainer, 1) == 7
        first = trainer._comm
        assert first is not None
        torch.distributed.destroy_process_group(first._group)
        assert not first.current()
        assert fit_to(trainer, 2) == 14
        again = trainer._comm
        assert again is not None
        assert again is not first
        assert again._group is not None


def test_trainers_seeded_alike_keep_their_store_keys_apart() -> None:
    # A seeded script that builds a trainer per run draws the same data seed each time (so
    # that its shuffles repeat); the store keys of a lost rank's roll call were named by that
    # seed, so a later trainer could read an earlier one's verdict and name the wrong ranks.
    from asyncddp._comm import Comm

    with one_rank_group():
        comms = []
        for _ in range(2):
            torch.manual_seed(0)
            comm = Comm(asyncddp.cpu_devices(1), 1, {"test": "keys"})
            comm.setup()
            comms.append(comm)
        first, second = comms
        assert first.data_seed == second.data_seed
        assert first._key("verdict", 1) != second._key("verdict", 1)
        assert first._call_key(0) != second._call_key(0)
