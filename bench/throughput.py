"""Training throughput: asyncddp against a plain loop and DistributedDataParallel, same work.

Run:  python bench/throughput.py            (about 20-35 minutes on 2 cores)
      python bench/throughput.py --quick    (a smoke run)
      python bench/throughput.py --workloads "mlp 512-1024-10" --rounds 21 \
          --contenders plain handoff-1 asyncddp-1 asyncddp-1-noatomic    (some, more rounds)
      python bench/throughput.py --copy-cost   (what the step backup's copy costs a plain loop)

Every contender trains the same model on the same global batch (256) with SGD, using the same
number of CPU threads in all (``torch.get_num_threads()``, all cores by default):

- plain:      a single-process PyTorch loop (zero_grad, forward, backward, step);
- handoff-1:  the same loop's steps, each handed from an event loop to one persistent worker
              thread and awaited (a queue and a future, nothing else): the floor of a design
              that keeps the event loop free by handing each step to a thread and awaiting it,
              as asyncddp does;
- handoff-1-backup: handoff-1, each step also copying the parameters and optimizer state
              before its optimizer step (``StepCopy``: the memory traffic of asyncddp's
              ``atomic_steps``, none of its logic): nearly the floor of a free event loop and
              steps that can be undone, asyncddp-1's contract (it copies in the step, where
              asyncddp-1 copies ahead, while the event loop takes its turn);
- asyncddp-1: ``Trainer`` on one device (its worker gets every thread): the overhead target;
- asyncddp-1-noatomic: the same with ``atomic_steps=False``: no copy of the parameters and
              optimizer state before each step (a plain loop, Lightning and DDP keep none);
- asyncddp-1-first-epoch: asyncddp-1's first epoch of a fit, its worker threads just started
              (every other figure is a step on warm threads, see below);
- asyncddp-1-main-team: asyncddp-1 in a program whose main thread ran a parallel op first (set
              up a model or data with torch), and so holds an idle OpenMP team: the case of
              most real programs (see asyncddp/_openmp.py);
- asyncddp-N: ``Trainer`` on ``cpu_devices(N)``, the threads shared among the workers;
  asyncddp-2-noatomic the same on 2 without the step backup;
- halves-2:   the compute alone of a 2-way data-parallel step: two threads, one intra-op thread
              each, the forward and backward of half the batch each (contiguous halves, as
              asyncddp splits a batch), in step (a barrier a step),
              no reduction and no optimizer step: no data-parallel design on these cores does
              less, so halves-2 / plain bounds asyncddp-2 / plain from above (in expectation:
              within one run's noise, as on the convnet, such figures need not come in order);
- by-hand-2:  asyncddp's 2-way data-parallel step written by hand, with no library around
              it: halves-2, then the same one-pass all-reduce after the backward (each
              thread sums its half of both replicas' flat gradients and writes the sum into
              the other's), a barrier, and each thread's own optimizer step on a whole
              replica; no event loop, no backup, no failure handling (a step could do less:
              overlap the all-reduce with the backward, or shard the optimizer step);
- by-hand-2-handoff: the same steps, each handed from the event loop to the two threads and
              awaited (``HandOffAll``: a queue each, one counter, one loop wake-up): the floor
              of a design that hands each step to its workers and awaits it, as asyncddp does;
- by-hand-2-handoff-backup: the same, each thread also copying its half of its replica's
              parameters and optimizer state before the optimizer step (cut as asyncddp's
              backup in parts on 2 CPU workers cuts them): the hand-off floor plus the
              contract's copy, though not a floor asyncddp-2 can be read against (its copy
              and asyncddp's backup have measured each above the other: docs/benchmarks.md);
- ddp-gloo-2: ``DistributedDataParallel`` over gloo, 2 processes on localhost, half the batch
              and half the threads each.

Run only when named in ``--contenders`` (a design asyncddp does not take, measured for the docs):

- handoff-1-ahead, by-hand-2-ahead: handoff-1 and by-hand-2-handoff with each step queued behind
              the running one (two steps in flight), so that a worker finishing a step finds
              the next one waiting instead of waiting for the event loop to hand it over: the
              floor of a design that queues steps ahead of the one running.
- plain-backup: the plain loop copying the backup as handoff-1-backup does: the copy's cost
              without a hand-off (``--copy-cost`` times the same in one process, steadier).

Each contender first trains one untimed pass over the same batches on the very threads it is
then timed on, so that every figure is a step in steady state. A thread's first steps are slow
(measured on the MLP, one device: the first 20 steps of a fit 4.7 ms a job, the next ones 3.65),
and a fit starts worker threads of its own: timed from its first step, a fit's first epoch of
60 steps ran 0.3-1.1 ms a step slower than its later epochs. That cost, paid once a fit, is a
figure of its own (``asyncddp-1-first-epoch``).
Each figure is the median of several rounds of training samples per second, rounds interleaved.
Every measurement runs in a fresh process of its own, and a real program runs one of them, not
both: a loop on one thread leaves an idle OpenMP team behind, and GNU OpenMP slows every team of
the process once their threads outnumber the cores (asyncddp/_openmp.py; before asyncddp let the
caller's idle team go, it ran 30-90% slower after a plain loop in the same process).
Targets: asyncddp-2 >= 0.95x plain and >= 1.5x ddp-gloo-2; asyncddp-1 at most 3% slower than plain.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import multiprocessing
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
import unittest.mock
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

import torch
import torch.nn.functional as F
from torch import nn

import asyncddp
from asyncddp._data import split_batch
from asyncddp._sched import SLICE_VARIABLE
from asyncddp._sync import _copy_part

BATCH = 256


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10))


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )  # fmt: skip


def linear() -> nn.Module:
    return nn.Linear(16, 10)


#: The issue's workloads, run by default.
WORKLOADS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp 512-1024-10": (mlp, (512,)),
    "convnet 32x32": (convnet, (3, 32, 32)),
}
#: Every workload, by name: the issue's, and a model so small that a step is its fixed costs
#: (hand-offs, collectives' latency), not its arithmetic; run it with ``--workloads``.
MODELS = {**WORKLOADS, "linear 16-10": (linear, (16,))}


def make_batches(shape: tuple[int, ...], steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(BATCH, *shape, generator=generator),
            torch.randint(0, 10, (BATCH,), generator=generator),
        )
        for _ in range(steps)
    ]


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


SGD = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)


@contextlib.contextmanager
def worker_slice(value: str | None) -> Iterator[None]:
    """``ASYNCDDP_WORKER_SLICE_MS`` set to ``value`` (``None``: unset, asyncddp's default) for
    the block, for the CPU workers that start in it (and processes spawned in it); the
    environment is restored after it (``unittest.mock.patch.dict``)."""
    with unittest.mock.patch.dict(os.environ):
        if value is None:
            os.environ.pop(SLICE_VARIABLE, None)
        else:
            os.environ[SLICE_VARIABLE] = value
        yield


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Any],
    backup: StepCopy | None = None,
) -> None:
    """The plain PyTorch loop; with ``backup``, each step copies the parameters and the
    optimizer's state first, as asyncddp's ``atomic_steps`` does to undo a failed step."""
    for batch in batches:
        optimizer.zero_grad()
        step(model, batch).backward()
        if backup is not None:
            backup.copy(optimizer)
        optimizer.step()


class StepCopy:
    """A copy of an optimizer's parameters and state tensors into buffers kept between steps:
    the memory traffic of asyncddp's step backup (``atomic_steps``), with none of its logic.
    With ``part=(i, n)``, only the ``i``-th of ``n`` near-equal slices of all the tensors'
    elements taken end to end, as each of n CPU workers copies its share of identical replicas
    (asyncddp's own ``_copy_part``, which its backup in parts uses)."""

    def __init__(self, part: tuple[int, int] = (0, 1)) -> None:
        self._part = part
        self._buffers: list[torch.Tensor] = []

    def copy(self, optimizer: torch.optim.Optimizer) -> None:
        sources = [p.detach() for group in optimizer.param_groups for p in group["params"]]
        sources += [
            value
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        if [b.shape for b in self._buffers] != [s.shape for s in sources]:
            self._buffers = [torch.empty_like(s) for s in sources]
        if self._part[1] > 1:
            _copy_part(self._buffers, sources, self._part)  # its slice of whole-size buffers
        else:
            torch._foreach_copy_(self._buffers, sources)


async def plain(make: Callable[[], nn.Module], batches: list[Any], backup: bool = False) -> float:
    """The plain loop in this thread (no hand-off): a warm-up pass, then a timed one; with
    ``backup``, each step copies the parameters and optimizer state first (:class:`StepCopy`)."""
    torch.manual_seed(0)
    model = make()
    optimizer = SGD(model.parameters())
    seconds, _ = await _timed_pass(model, optimizer, batches, False, lambda: None, backup=backup)
    return len(batches) * BATCH / seconds


class HandOff:
    """One persistent worker thread that runs what the event loop hands it, one at a time:
    ``await worker.run(fn)``. The least any design pays that keeps the event loop free while
    a step runs (asyncddp pays it too): a queue put, a thread wake-up, a loop wake-up."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="handoff-worker", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future, loop = job
            try:
                loop.call_soon_threadsafe(_settle, future, fn(), None)
            except BaseException as error:
                loop.call_soon_threadsafe(_settle, future, None, error)

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Queue ``fn`` behind the jobs queued before it; the future settles when it has run."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((fn, future, loop))
        return future

    async def run(self, fn: Callable[[], Any]) -> Any:
        return await self.submit(fn)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


class HandOffAll:
    """One persistent thread per device; ``await workers.run(fns)`` runs ``fns[i]`` on thread
    ``i`` and wakes the event loop once, when the last one is done (a queue per thread, one
    counter, one future): what a design pays that hands each step to its workers and awaits
    it, as asyncddp does (bench/dispatch.py times the same floor on no-op jobs)."""

    def __init__(self, devices: int) -> None:
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(devices)]
        self._threads = [
            threading.Thread(target=self._main, args=(jobs,), name=f"handoff-worker-{i}")
            for i, jobs in enumerate(self._queues)
        ]
        for thread in self._threads:
            thread.start()

    def _main(self, jobs: queue.SimpleQueue[Any]) -> None:
        while (job := jobs.get()) is not None:
            fn, done, errors, future, loop = job
            try:
                fn()
            except BaseException as error:
                errors.append(error)
            if next(done) == len(self._queues):  # the last thread to finish wakes the loop
                loop.call_soon_threadsafe(_settle, future, None, errors[0] if errors else None)

    def submit(self, fns: list[Callable[[], Any]]) -> asyncio.Future[None]:
        """Queue ``fns[i]`` on thread ``i``; the future settles when every one has run."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        done, errors = itertools.count(1), list[BaseException]()
        for jobs, fn in zip(self._queues, fns, strict=True):
            jobs.put((fn, done, errors, future, loop))
        return future

    async def run(self, fns: list[Callable[[], Any]]) -> None:
        await self.submit(fns)

    def close(self) -> None:
        for jobs in self._queues:
            jobs.put(None)
        for thread in self._threads:
            thread.join()


async def in_turn(
    submit: Callable[[Any], asyncio.Future[Any]], steps: list[Any], ahead: bool
) -> None:
    """``submit`` each step and await it before the next; with ``ahead``, the next step is
    submitted before the running one is awaited (two in flight, the worker never idle)."""
    running: asyncio.Future[Any] | None = None
    for one in steps:
        queued = submit(one)
        if running is not None:
            await running
        if ahead:
            running = queued
        else:
            await queued
    if running is not None:
        await running


def halved(batches: list[Any]) -> list[list[Any]]:
    """Each batch split for 2 devices as the trainer splits it (``split_batch``: contiguous
    halves, views): the shards of thread 0, then of thread 1."""
    pairs = [split_batch(batch, 2) for batch in batches]
    return [[pair[i] for pair in pairs] for i in range(2)]


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if not future.cancelled():
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)


async def handed_off(
    make: Callable[[], nn.Module], batches: list[Any], ahead: bool = False, backup: bool = False
) -> float:
    """The plain loop's steps on a worker thread, awaited on the event loop one by one (with
    ``ahead``, each queued behind the running one; with ``backup``, each copying the parameters
    and optimizer state before its optimizer step, as ``atomic_steps`` does)."""
    torch.manual_seed(0)
    model = make()
    optimizer = SGD(model.parameters())
    seconds, _ = await _timed_pass(model, optimizer, batches, True, lambda: None, ahead, backup)
    return len(batches) * BATCH / seconds


def halves(make: Callable[[], nn.Module], batches: list[Any]) -> float:
    """Samples per second of the compute alone of a 2-way data-parallel step (see above)."""
    torch.manual_seed(0)
    models = [make() for _ in range(2)]
    barrier = threading.Barrier(2, timeout=60)  # a thread that fails breaks it for the other

    def one_step(i: int, batch: Any) -> None:
        models[i].zero_grad()
        step(models[i], batch).backward()
        barrier.wait()

    return len(batches) * BATCH / _on_two_threads(one_step, halved(batches), barrier)


def _on_two_threads(
    one_step: Callable[[int, Any], None], shards: list[list[Any]], barrier: threading.Barrier
) -> float:
    """Seconds of a pass of ``one_step(i, batch)`` over ``shards[i]`` on thread ``i`` of two
    (one intra-op thread each, as asyncddp's CPU workers), after an untimed pass on the same
    threads: the slower thread's."""
    seconds = [0.0, 0.0]

    def run(i: int) -> None:
        torch.set_num_threads(1)  # per thread
        for batch in shards[i]:  # warm-up: the same pass, untimed
            one_step(i, batch)
        barrier.wait()
        start = time.perf_counter()
        for batch in shards[i]:
            one_step(i, batch)
        seconds[i] = time.perf_counter() - start

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return max(seconds)


async def by_hand(
    make: Callable[[], nn.Module],
    batches: list[Any],
    handoff: bool,
    ahead: bool = False,
    backup: bool = False,
) -> float:
    """Samples per second of a whole 2-way data-parallel step written by hand (see above); with
    ``handoff``, each step handed from the event loop to the two threads and awaited (with
    ``ahead``, each queued behind the running one; with ``backup``, each thread copying its
    half of its replica's parameters and optimizer state before the optimizer step, as
    asyncddp's ``atomic_steps`` does on 2 CPU workers)."""
    torch.manual_seed(0)
    models = [make() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [SGD(model.parameters()) for model in models]
    flats = []
    for model in models:  # each replica's gradients: views of one flat buffer, as asyncddp's
        params = list(model.parameters())
        flat = torch.zeros(sum(p.numel() for p in params))
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        flats.append(flat)
    half = flats[0].numel() // 2
    chunks = [slice(0, half), slice(half, None)]
    shards = halved(batches)
    barrier = threading.Barrier(2, timeout=60)  # a thread that fails breaks it for the other
    copies = [StepCopy((i, 2)) for i in range(2)] if backup else None

    def one_step(i: int, batch: Any) -> None:
        flats[i].zero_()
        (step(models[i], batch) * 0.5).backward()  # each half's mean, weighted: the sum is the mean
        barrier.wait()
        mine, other = flats[i][chunks[i]], flats[1 - i][chunks[i]]
        mine.add_(other)  # thread i sums chunk i of both replicas ...
        other.copy_(mine)  # ... and writes the sum into the other's
        if copies is not None:
            copies[i].copy(optimizers[i])
        barrier.wait()
        optimizers[i].step()

    def check() -> None:
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(a, b), "the replicas of the step by hand differ"

    if handoff:
        workers = HandOffAll(2)
        try:  # one intra-op thread each, as asyncddp's CPU workers
            await workers.run([functools.partial(torch.set_num_threads, 1)] * 2)

            def submit(pair: tuple[Any, ...]) -> asyncio.Future[None]:
                return workers.submit([functools.partial(one_step, i, pair[i]) for i in range(2)])

            async def run() -> None:
                await in_turn(submit, list(zip(*shards, strict=True)), ahead)

            await run()  # warm-up: the same pass, untimed
            start = time.perf_counter()
            await run()
            elapsed = time.perf_counter() - start
        finally:
            workers.close()
        check()
        return len(batches) * BATCH / elapsed

    seconds = _on_two_threads(one_step, shards, barrier)
    check()
    return len(batches) * BATCH / seconds


async def with_asyncddp(
    make: Callable[[], nn.Module],
    batches: list[Any],
    devices: asyncddp.DeviceSpec,
    *,
    atomic_steps: bool = True,
    first_epoch: bool = False,
) -> float:
    """Samples per second of a fit's second epoch (its threads warm, as the other contenders'
    are), or with ``first_epoch`` of its first one (threads just started); an int is that many
    CPU workers, anything else a device spec."""
    torch.manual_seed(0)
    spec = asyncddp.cpu_devices(devices) if isinstance(devices, int) else devices
    trainer = asyncddp.Trainer(
        make(), SGD, step, devices=spec, atomic_steps=atomic_steps, progress_bar=False
    )
    result = await trainer.fit(batches, epochs=2)  # the first epoch is the warm-up
    # An epoch's own time: the loop over the batches, without the session's start and end.
    return len(batches) * BATCH / result.history[0 if first_epoch else -1].seconds


def _ddp_rank(
    rank: int,
    port: int,
    threads: int,
    shape: tuple[int, ...],
    workload: str,
    steps: int,
    handoff: bool,
    backup: bool,
    results: Any,
) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(MODELS[workload][0]())
        optimizer = SGD(model.parameters())
        batches = [(x[rank::2], y[rank::2]) for x, y in make_batches(shape, steps)]
        seconds, cpu = asyncio.run(
            _timed_pass(model, optimizer, batches, handoff, dist.barrier, backup=backup)
        )
        if rank == 0:
            results.put((len(batches) * BATCH / seconds, spent_a_step(cpu, len(batches))))
    finally:
        dist.destroy_process_group()


def cpu_by_thread(main_runs_steps: bool) -> dict[str, float]:
    """This process's CPU seconds so far: ``"all"`` (every thread's, ended ones included), and
    each live thread's (Linux: ``/proc/self/task/*/schedstat``, in ns) under ``"kind:tid"``,
    the kind being what it does: ``step``, the thread that trains (asyncddp's worker, the
    hand-off's worker, or the main thread where ``main_runs_steps``); ``loop``, the event
    loop's (the main thread otherwise); ``gloo``, gloo's threads (named ``gloo...`` or
    ``pt_gloo...`` by torch); ``other``, the rest. See :func:`cpu_spent`. Beside them,
    ``"faults"``: the process's minor page faults so far (``getrusage``, where there is one)."""
    clocks = {"all": time.process_time()}
    if resource is not None:
        clocks["faults"] = float(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return clocks
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().native_id
    for task in tasks.iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            nanoseconds = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile, or no schedstat
        tid = int(task.name)
        name = names.get(tid, "")
        if name.startswith(("asyncddp-worker", "handoff-worker")):
            kind = "step"
        elif tid == main:
            kind = "step" if main_runs_steps else "loop"
        elif "gloo" in comm:
            kind = "gloo"
        else:
            kind = "other"
        clocks[f"{kind}:{tid}"] = nanoseconds / 1e9
    return clocks


CPU_KINDS = ("all", "step", "gloo", "loop", "other")


def spent_a_step(spent: dict[str, float], steps: int) -> dict[str, float]:
    """:func:`cpu_spent`'s figures a step: CPU in ms, faults as counts."""
    return {
        kind: (1.0 if kind == "faults" else 1e3) * value / steps for kind, value in spent.items()
    }


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds between two :func:`cpu_by_thread` calls: ``"all"``, and by kind the threads
    alive at both; what threads that started or ended in between took goes to ``"other"``;
    ``"faults"``, the minor page faults in between (where both calls counted them)."""
    spent = dict.fromkeys(CPU_KINDS, 0.0)
    for key in ("all", "faults"):
        if key in before and key in after:
            spent[key] = after[key] - before[key]
    for key, seconds in after.items():
        if ":" in key and key in before:
            spent[key.partition(":")[0]] += seconds - before[key]
    spent["other"] = spent["all"] - spent["step"] - spent["gloo"] - spent["loop"]
    return spent


async def _timed_pass(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[Any],
    handoff: bool,
    barrier: Callable[[], Any],
    ahead: bool = False,
    backup: bool = False,
) -> tuple[float, dict[str, float]]:
    """One untimed pass over ``batches`` (the warm-up), then one timed between ``barrier()``
    calls (the ranks', if any): seconds, and this process's CPU seconds by kind of thread
    (:func:`cpu_by_thread`; ``"all"``: every thread's). With ``handoff`` each step
    is handed from the event loop to a worker thread (the same one both times) and awaited;
    without, the loop trains in the event loop's thread, blocking it, as a plain script does.
    With ``backup``, each step copies the parameters and optimizer state first (:class:`StepCopy`)."""
    worker = HandOff() if handoff else None
    copy = StepCopy() if backup else None

    async def run() -> None:
        if worker is None:
            train(model, optimizer, batches, copy)
            return
        await in_turn(
            lambda batch: worker.submit(functools.partial(train, model, optimizer, [batch], copy)),
            batches,
            ahead,
        )

    try:
        await run()
        barrier()
        start, cpu = time.perf_counter(), cpu_by_thread(not handoff)
        await run()
        spent = cpu_spent(cpu, cpu_by_thread(not handoff))  # before the barrier: not the step's
        barrier()
        return time.perf_counter() - start, spent
    finally:
        if worker is not None:
            worker.close()


def ddp_gloo(
    workload: str,
    shape: tuple[int, ...],
    steps: int,
    threads: int,
    handoff: bool = False,
    backup: bool = False,
) -> tuple[float, dict[str, float]]:
    """DDP's samples per second, and rank 0's CPU time a step in ms by kind of thread
    (:func:`cpu_by_thread`; ``"all"``: every thread of its process) with its minor page faults
    a step (``"faults"``); with ``handoff``, each
    rank's steps run on a worker thread, handed over from an event loop (:class:`HandOff`);
    with ``backup``, each step copies the parameters and optimizer state first. A
    run whose gloo rank aborts (seen once here: "terminate called without an active
    exception" at shutdown) is run again, up to three times."""
    for attempt in range(3):
        try:
            return run_two_ranks(
                _ddp_rank,
                max(1, threads // 2),
                shape,
                workload,
                steps,
                handoff,
                backup,
                name="DDP",
            )
        except RuntimeError as error:
            print(f"  (ddp-gloo-2 run {attempt + 1} failed: {error}; running it again)")
    raise RuntimeError("ddp-gloo-2 failed three times")


def run_two_ranks(target: Callable[..., None], *args: Any, name: str) -> Any:
    """Run ``target(rank, port, *args, results)`` in 2 spawned processes on a free localhost
    port; returns what rank 0 put in ``results``.

    A rank that aborts after its measurement, in torch's gloo teardown at exit ("terminate
    called without an active exception", pytorch/pytorch#179291), is reported, not fatal.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=target, args=(rank, port, *args, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=600)
    codes = [process.exitcode for process in ranks]
    if any(code not in (0, -6) for code in codes) or results.empty():
        raise RuntimeError(f"a {name} rank failed: exit codes {codes}")
    if -6 in codes:
        print(f"  ({name}: a rank aborted in gloo's teardown after measuring; figure kept)")
    return results.get(timeout=10)


def measure_alone(contender: str, workload: str, steps: int) -> float:
    """Samples per second of one contender, measured in a fresh process."""
    completed = subprocess.run(
        [sys.executable, __file__, "--measure", contender, workload, "--steps", str(steps)],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(completed.stdout.strip().splitlines()[-1])


async def measure(contender: str, workload: str, steps: int) -> float:
    make, shape = MODELS[workload]
    batches = make_batches(shape, steps)
    if contender in ("plain", PLAIN_BACKUP):
        return await plain(make, batches, backup=contender == PLAIN_BACKUP)
    if contender in ("handoff-1", HANDOFF_AHEAD, HANDOFF_BACKUP):
        return await handed_off(
            make, batches, ahead=contender == HANDOFF_AHEAD, backup=contender == HANDOFF_BACKUP
        )
    if contender == "halves-2":
        return halves(make, batches)
    if contender in (BY_HAND, BY_HAND_HANDOFF, BY_HAND_AHEAD, BY_HAND_BACKUP):
        return await by_hand(
            make,
            batches,
            handoff=contender != BY_HAND,
            ahead=contender == BY_HAND_AHEAD,
            backup=contender == BY_HAND_BACKUP,
        )
    if contender.endswith("-noatomic"):
        return await with_asyncddp(make, batches, int(contender.split("-")[1]), atomic_steps=False)
    if contender == FIRST_EPOCH:
        return await with_asyncddp(make, batches, 1, first_epoch=True)
    if contender == MAIN_TEAM:
        torch.ones(1 << 22).add_(1)  # a parallel op: the main thread's OpenMP team starts
        return await with_asyncddp(make, batches, 1)
    return await with_asyncddp(make, batches, int(contender.rsplit("-", 1)[1]))


FIRST_EPOCH = "asyncddp-1-first-epoch"
BY_HAND = "by-hand-2"
BY_HAND_HANDOFF = "by-hand-2-handoff"
MAIN_TEAM = "asyncddp-1-main-team"
HANDOFF_AHEAD = "handoff-1-ahead"
BY_HAND_AHEAD = "by-hand-2-ahead"
PLAIN_BACKUP = "plain-backup"
HANDOFF_BACKUP = "handoff-1-backup"
BY_HAND_BACKUP = "by-hand-2-handoff-backup"
OPT_IN = (HANDOFF_AHEAD, BY_HAND_AHEAD, PLAIN_BACKUP)  # run only when named in --contenders
CONTENDERS = (
    "plain",
    PLAIN_BACKUP,
    "handoff-1",
    HANDOFF_BACKUP,
    "asyncddp-1",
    "asyncddp-1-noatomic",
    FIRST_EPOCH,
    MAIN_TEAM,
    "asyncddp-2",
    "asyncddp-2-noatomic",
    "halves-2",
    BY_HAND,
    BY_HAND_HANDOFF,
    BY_HAND_BACKUP,
    "ddp-gloo-2",
    HANDOFF_AHEAD,
    BY_HAND_AHEAD,
)

# What is printed under the figures: (contender, baseline, per_step, note): the ratio of their
# samples per second, or with per_step, how much slower a step of the contender is.
RATIOS = (
    ("asyncddp-2", "plain", False, "(target >= 0.95x)"),
    ("halves-2", "plain", False, "(the compute alone: the most a 2-way split can reach)"),
    (BY_HAND, "plain", False, "(asyncddp's step by hand: no event loop, no backup)"),
    (BY_HAND_HANDOFF, "plain", False, "(the same, each step handed off and awaited)"),
    ("asyncddp-2", BY_HAND_HANDOFF, False, "(asyncddp-2 against that floor)"),
    ("asyncddp-2-noatomic", BY_HAND_HANDOFF, False, "(without the step backup, as the floor)"),
    (BY_HAND_BACKUP, "plain", False, "(the same, each thread copying its half of the backup)"),
    ("asyncddp-2", BY_HAND_BACKUP, False, "(asyncddp-2 against the same with the copy)"),
    ("asyncddp-2", "ddp-gloo-2", False, "(target >= 1.5x)"),
    (BY_HAND, "ddp-gloo-2", False, "(the step by hand against DDP)"),
    ("asyncddp-1", "plain", True, "(target <= +3%)"),
    ("asyncddp-1-noatomic", "plain", True, "(no step backup, as the plain loop)"),
    ("handoff-1", "plain", True, "(the floor of a free event loop)"),
    (HANDOFF_BACKUP, "plain", True, "(the hand-off floor copying the step backup in the step)"),
    ("asyncddp-1", HANDOFF_BACKUP, True, "(asyncddp-1, which copies ahead, against it)"),
    (PLAIN_BACKUP, "plain", True, "(the step backup's copy alone, in the plain loop)"),
    (HANDOFF_AHEAD, "handoff-1", True, "(a step queued ahead, against one at a time)"),
    (BY_HAND_AHEAD, BY_HAND_HANDOFF, False, "(a step queued ahead, against one at a time)"),
    (FIRST_EPOCH, "asyncddp-1", True, "(a fit's first epoch: its threads just started)"),
    (MAIN_TEAM, "asyncddp-1", True, "(the main thread ran a parallel op first)"),
)


def copy_cost_alone(workload: str, quick: bool, steps: int) -> str:
    """:func:`copy_cost` in a fresh process (its loop leaves an OpenMP team behind)."""
    command = [sys.executable, __file__, "--copy-cost", "--workloads", workload]
    command += ["--quick"] if quick else ["--steps", str(steps)]
    completed = subprocess.run(command, capture_output=True, text=True, check=True)
    return completed.stdout.strip().splitlines()[-1]


def copy_cost(workload: str, blocks: int, steps: int = 60) -> str:
    """The plain loop's step with and without the step backup's copy (:class:`StepCopy`), in
    one thread of one process, blocks of ``steps`` steps (the contenders' batches) of each in
    turns, which goes first alternating: a steadier figure than two processes' (the same
    threads, the same allocator, the VM's drift shared)."""
    torch.manual_seed(0)
    model = MODELS[workload][0]()
    optimizer = SGD(model.parameters())
    batches = make_batches(MODELS[workload][1], steps)
    copy = StepCopy()

    def block(backup: StepCopy | None) -> float:
        start = time.perf_counter()
        train(model, optimizer, batches, backup)
        return (time.perf_counter() - start) / steps

    block(None)  # warm-up: threads, allocations, the optimizer's state
    block(copy)
    plain_s, copied_s = [], []
    for turn in range(blocks):
        if turn % 2:
            copied_s.append(block(copy))
            plain_s.append(block(None))
        else:
            plain_s.append(block(None))
            copied_s.append(block(copy))
    start = time.perf_counter()
    for _ in range(steps):
        copy.copy(optimizer)
    alone = (time.perf_counter() - start) / steps
    ratios = [c / p - 1 for p, c in zip(plain_s, copied_s, strict=True)]
    low, _, high = statistics.quantiles(ratios, n=4)
    mb = sum(b.numel() * b.element_size() for b in copy._buffers) / 1e6
    plain_ms, copied_ms = 1e3 * statistics.median(plain_s), 1e3 * statistics.median(copied_s)
    return (
        f"{workload}: the plain loop {plain_ms:.3f} ms a step, with the backup's copy "
        f"({mb:.3g} MB) {copied_ms:.3f} ms ({copied_ms - plain_ms:+.3f} ms): "
        f"{statistics.median(ratios):+.1%} a step by the blocks' ratios (quartiles "
        f"{low:+.1%}..{high:+.1%}); the copy alone, repeated: {1e3 * alone:.3f} ms"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--measure", nargs=2, metavar=("CONTENDER", "WORKLOAD"), help=argparse.SUPPRESS
    )
    parser.add_argument("--steps", type=int, default=60, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP baseline")
    parser.add_argument(
        "--contenders",
        nargs="+",
        choices=CONTENDERS,
        default=[c for c in CONTENDERS if c not in OPT_IN],
        help="which to run",
    )
    parser.add_argument("--workloads", nargs="+", choices=list(MODELS), default=list(WORKLOADS))
    parser.add_argument(
        "--copy-cost",
        action="store_true",
        help="time the step backup's copy in the plain loop, in one process, and exit",
    )
    args = parser.parse_args()
    if args.copy_cost:
        for name in args.workloads:
            print(copy_cost(name, 4, 8) if args.quick else copy_cost(name, 20, args.steps))
        return
    if args.measure:
        print(await measure(*args.measure, args.steps))
        return
    if args.quick:
        args.steps, args.rounds = 8, 1
    contenders = [c for c in CONTENDERS if c in args.contenders]
    if args.no_ddp and "ddp-gloo-2" in contenders:
        contenders.remove("ddp-gloo-2")
    threads = torch.get_num_threads()
    print(
        f"samples/s, global batch {BATCH}, {threads} CPU threads in all, median of {args.rounds} "
        f"rounds x {args.steps} steps (torch {torch.__version__}, {os.cpu_count()} CPUs)"
    )
    for name in args.workloads:
        shape = MODELS[name][1]
        figures: dict[str, list[float]] = {contender: [] for contender in contenders}
        for _ in range(args.rounds):
            for contender in contenders:
                if contender == "ddp-gloo-2":
                    figures[contender].append(ddp_gloo(name, shape, args.steps, threads)[0])
                else:
                    figures[contender].append(measure_alone(contender, name, args.steps))
        median = {key: statistics.median(values) for key, values in figures.items()}
        print(f"\n{name}")
        for key, value in median.items():
            print(f"  {key:<24} {value:>9.0f} samples/s  ({1e3 * BATCH / value:6.2f} ms/step)")
        for top, bottom, per_step, note in RATIOS:
            if top not in median or bottom not in median:
                continue
            print(f"  {ratio_line(top, bottom, figures[top], figures[bottom], per_step)}  {note}")
        if "plain" in contenders:
            print(f"  {copy_cost_alone(name, args.quick, args.steps)}")


def ratio_line(
    top: str, bottom: str, tops: list[float], bottoms: list[float], per_step: bool
) -> str:
    """``top`` against ``bottom`` (samples per second of the same rounds), as the median of the
    rounds' own ratios (a round runs every contender once, back to back: the VM's slow drift
    cancels out), with the spread of those ratios (their quartiles, from 4 rounds on)."""
    if per_step:  # how much slower a step of top is
        ratios = [b / t - 1 for t, b in zip(tops, bottoms, strict=True)]
        text = f"{top} per step vs {bottom}: {statistics.median(ratios):+.1%}"
        spread = "{:+.1%}..{:+.1%}"
    else:
        ratios = [t / b for t, b in zip(tops, bottoms, strict=True)]
        text = f"{top} / {bottom}  {statistics.median(ratios):.2f}x"
        spread = "{:.2f}..{:.2f}x"
    if len(ratios) >= 4:
        low, _, high = statistics.quantiles(ratios, n=4)
        text += f" (rounds' quartiles {spread.format(low, high)})"
    return text


if __name__ == "__main__":
    asyncio.run(main())
