"""Across processes: asyncddp on 2 ranks against DistributedDataParallel, same work.

Run:  python bench/distributed.py            (a few minutes on 2 cores)
      python bench/distributed.py --quick    (a smoke run)
      python bench/distributed.py --phases   (asyncddp's step on the MLP, phase by phase)
      python bench/distributed.py --exchange (the header and gradients, sizes 100 to 535562)
      python bench/distributed.py --workloads "linear 16-10" --steps 300
                                             (a model whose step is its fixed costs alone)
      python bench/distributed.py --slice-cost  (the workers' long scheduler slice, in turns)
      python bench/distributed.py --loop-turn   (what an event loop's turn of Python a step
                                             costs DDP handed off: between steps, or while
                                             the all-reduce waits; ~6 minutes)
      python bench/distributed.py --calls       (the Python and C calls a step, thread by
                                             thread, of DDP and asyncddp: a count, not a clock)

Both contenders run 2 processes on localhost over gloo, one CPU device each, half the CPU
threads each, the same model (throughput.py's MLP 512-1024-10 and convnet) and the same global
batch of 256 per step: 128 items per rank.

- ddp-gloo-2:      ``DistributedDataParallel``, a plain loop in each process (throughput.py's);
- ddp-gloo-2 handed off: the same, each step handed from an event loop to a worker thread and
                   awaited (throughput.py's ``HandOff``): what DDP would cost an async program
                   that keeps its event loop free, the floor of a design that hands each step
                   to a thread and awaits it, as asyncddp does;
- ddp-gloo-2 handed off + backup: the same, each step first copying the parameters and the
                   optimizer's state (``throughput.StepCopy``), the copy asyncddp's
                   ``atomic_steps`` keeps to undo a failed step: the floor of a design that
                   keeps the event loop free and never leaves a step half-applied, as
                   asyncddp's contract asks;
- asyncddp-2proc:  ``asyncddp.distributed.init()`` and ``Trainer(devices="cpu")`` in each
                   process; the trainer gives each rank every other half-batch of one list;
                   and the same with ``atomic_steps=False`` (no copy of the parameters and
                   optimizer state before each step to undo a failed one: DDP keeps none).

Figures: training samples per second over both ranks (rank 0's clock; every contender timed on
a second pass over the batches, on the threads of the first: see throughput.py), median
of several rounds, the contenders interleaved. Target: asyncddp at least as fast as DDP (>= 1.0x).
Beside them, rank 0's CPU time a step (``time.process_time``, every thread of its process: the
step's own work, the threads' hand-offs, gloo's threads) and, for asyncddp, how much of it ran on
the event loop's thread (``time.thread_time``): with one core per process, CPU a step more than
DDP's is wall time a step more. The CPU a step splits by thread: the thread that trains, gloo's
threads, the event loop's, the rest (``throughput.cpu_by_thread``). Last, rank 0's minor page
faults a step (the median of the rounds; blank where ``getrusage`` is missing): in the runs so
far mostly memory the C allocator handed back to the system and the next step touched afresh
(see docs/benchmarks.md).

``--phases`` times the phases of asyncddp's step on rank 0's worker (the forward and backward,
the exchange with the backup copied while its all-reduces run, the optimizer phase), on the wall
clock and on the thread's CPU clock, then gloo's all-reduce of as many floats as the gradients,
alone.

``--loop-turn`` asks where an event loop's own work a step (its "turn": asyncddp's step results,
counts, reports and the next job) costs least, on DDP handed off (``ddp-gloo-2 handed off``, the
MLP), in turns in one pair of processes: no turn; a turn of ``--turn-us`` of Python CPU between
two steps (the worker waits for it, as asyncddp's does); half of it; and the whole turn run while
the step's all-reduce waits (a DDP communication hook wakes the loop as it starts the
all-reduce; the next step is still handed over after this one ends); and the same with each
step queued behind the running one, by the loop right after the turn (the floor of a design that
queues steps ahead and takes the event loop's turn while the exchange waits). Every variant
does DDP's all-reduce in a Python communication hook (the same in all five), whose completion
callback takes the GIL: in the wait, the all-reduce cannot complete before the turn ends. Rounds
take ~17 s each (the ranks are given 600 s in all: keep ``--rounds`` under ~30).

``--calls`` counts what the interpreter runs a step on rank 0, thread by thread, for DDP and
for asyncddp on the MLP: the Python functions called and the C functions (builtins, torch's
bindings) called from Python, through ``sys.setprofile``. A count, not a clock: it does not move
with the machine's load, as the timings above do, so it shows what asyncddp's own work a step is
beside DDP's and whether a change adds to it. The counter slows every call it sees, so nothing
is timed meanwhile. A coroutine's or generator's resumption counts as a call, and the count
includes the counted fit's start and end (asyncddp's second ``fit``, DDP's second pass).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from phases import timing
from throughput import (
    BATCH,
    MODELS,
    SGD,
    WORKLOADS,
    HandOff,
    cpu_by_thread,
    cpu_spent,
    ddp_gloo,
    make_batches,
    ratio_line,
    run_two_ranks,
    spent_a_step,
    step,
    train,
    worker_slice,
)

import asyncddp
import asyncddp.distributed
from asyncddp import _comm, _jobs, _sched, _sync


def _asyncddp_rank(
    rank: int,
    port: int,
    threads: int,
    workload: str,
    steps: int,
    atomic: bool,
    results: Any,
    destroy: bool = True,
) -> None:
    torch.set_num_threads(threads)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    asyncddp.distributed.init("gloo")
    try:
        make, shape = MODELS[workload]
        # Every half-batch in one list: rank r trains on half-batches r, r + 2, ..., so each
        # step's global batch is the same 256 items that DDP's two ranks share.
        halves = [
            (x[part::2], y[part::2]) for x, y in make_batches(shape, steps) for part in range(2)
        ]

        async def run() -> tuple[float, dict[str, float]]:
            torch.manual_seed(0)
            trainer = asyncddp.Trainer(
                make(), SGD, step, devices="cpu", progress_bar=False, atomic_steps=atomic
            )
            marks: list[dict[str, float]] = []  # CPU clocks as each epoch ends
            events = trainer.events()

            async def mark_epochs() -> None:
                async for event in events:
                    if isinstance(event, asyncddp.EpochEnded):
                        marks.append(cpu_by_thread(main_runs_steps=False))

            async with anyio.create_task_group() as group:
                group.start_soon(mark_epochs)
                # The first epoch is the warm-up: the fit's threads start with it.
                result = await trainer.fit(halves, epochs=2)
            spent = cpu_spent(*marks)
            seconds = result.history[-1].seconds
            return steps * BATCH / seconds, spent_a_step(spent, steps)

        figures = asyncio.run(run())
        if rank == 0:
            results.put(figures)
    finally:
        if destroy:
            asyncddp.distributed.destroy()


#: What ``--phases`` times on rank 0's worker: its label, and (where it is, its name there).
PHASES = {
    "the step's job": (_jobs.Jobs, "distributed_step"),
    "  forward and backward": (_jobs.Jobs, "train"),
    "  exchange (the all-reduces)": (_comm.Comm, "_all_reduce"),
    "    backup, while they run": (_sync.StepBackup, "capture"),
    "  optimizer phase": (_jobs.Jobs, "apply"),
    "    SGD's step": (torch.optim.SGD, "step"),
}


def _phases_rank(
    rank: int, port: int, threads: int, workload: str, steps: int, results: Any
) -> None:
    """asyncddp's rank with each phase of its step timed on both clocks, the wall's and the
    thread's CPU (``--phases``, with phases.py's timers); then gloo's all-reduce of as many
    floats as the gradients, alone."""
    import torch.distributed as dist

    spans: dict[str, list[tuple[float, float]]] = {label: [] for label in PHASES}

    def record(label: str, start: float, end: float, cpu: float) -> None:
        spans[label].append((end - start, cpu))

    timing(PHASES, record)  # this process ends with the run: no undo

    class Collect:
        def put(self, figures: Any) -> None:
            for label in spans:  # the second epoch's steps: the last ones
                spans[label] = spans[label][-steps:]

    _asyncddp_rank(rank, port, threads, workload, steps, True, Collect(), destroy=False)
    try:
        numel = sum(p.numel() for p in MODELS[workload][0]().parameters())
        gradients, alone = torch.zeros(numel), []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(gradients)
            alone.append(time.perf_counter() - start)
    finally:
        asyncddp.distributed.destroy()
    if rank == 0:
        rows = {
            label: tuple(1e3 * statistics.median(column) for column in zip(*values, strict=True))
            for label, values in spans.items()
            if values
        }
        results.put((rows, 1e3 * statistics.median(alone), numel))


def phases(workload: str, steps: int, threads: int) -> None:
    rows, alone, numel = run_two_ranks(
        _phases_rank, max(1, threads // 2), workload, steps, name="asyncddp"
    )
    print(f"\n{workload}: rank 0's worker, median ms a call over the second epoch's {steps} steps")
    print(f"  {'':<34} {'wall':>6} {'CPU':>6}")
    for label, (wall, cpu) in rows.items():
        print(f"  {label:<34} {wall:6.2f} {cpu:6.2f}")
    print(f"  gloo's all-reduce of {numel} floats alone, between the 2 processes: {alone:.2f} ms")


#: ``--exchange``: gradient sizes (elements) to all-reduce three ways.
EXCHANGE_SIZES = (100, 4_000, 16_000, 32_000, 64_000, 128_000, 535_562)


def _exchange_rank(rank: int, port: int, repeats: int, results: Any) -> None:
    """The three ways a step's header (float64) and float32 gradients can cross: the gradients
    alone (the least any design pays), the two all-reduces started together (asyncddp for
    large models), and one float64 all-reduce with the gradients inside the header (asyncddp
    for small models: ``_comm.PACK_ELEMENTS``)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        table = {}
        for numel in EXCHANGE_SIZES:
            gradients = torch.randn(numel)
            header = torch.zeros(_comm._FIXED + 4, dtype=torch.float64)
            times: dict[str, list[float]] = {"alone": [], "together": [], "packed": []}
            ways = list(times)
            for repeat in range(repeats):
                for way in ways[repeat % 3 :] + ways[: repeat % 3]:  # each first in turn
                    spent = times[way]
                    gradients.normal_()  # summed in place: fresh values, never overflowing
                    header.zero_()
                    dist.barrier()
                    start = time.perf_counter()
                    if way == "alone":
                        dist.all_reduce(gradients)
                    elif way == "together":
                        works = [
                            dist.all_reduce(header, async_op=True),
                            dist.all_reduce(gradients, async_op=True),
                        ]
                        for work in works:
                            work.wait()
                    else:
                        packed = torch.cat([header, gradients.to(torch.float64)])
                        dist.all_reduce(packed)
                        header.copy_(packed[: header.numel()])
                        gradients.copy_(packed[header.numel() :])
                    spent.append(time.perf_counter() - start)
            table[numel] = {way: 1e6 * statistics.median(spent) for way, spent in times.items()}
        if rank == 0:
            results.put(table)
    finally:
        dist.destroy_process_group()


def exchange(repeats: int) -> None:
    table = run_two_ranks(_exchange_rank, repeats, name="exchange")
    print(
        f"a step's header and float32 gradients between 2 processes (gloo), median us of {repeats}"
    )
    print(f"  {'elements':>9} {'gradients alone':>16} {'two together':>13} {'one, packed':>12}")
    for numel, row in table.items():
        print(
            f"  {numel:>9} {row['alone']:>16.0f} {row['together']:>13.0f} "
            f"{row['packed']:>12.0f}  packed / together {row['packed'] / row['together']:.2f}"
        )
    print(f"  (asyncddp packs up to _comm.PACK_ELEMENTS = {_comm.PACK_ELEMENTS} elements)")


def asyncddp_2proc(
    workload: str, steps: int, threads: int, atomic: bool = True
) -> tuple[float, dict[str, float]]:
    """Samples per second, and rank 0's CPU time a step in ms by kind of thread (see
    ``throughput.cpu_by_thread``) with its minor page faults a step (``"faults"``)."""
    samples_per_second, cpu = run_two_ranks(
        _asyncddp_rank, max(1, threads // 2), workload, steps, atomic, name="asyncddp"
    )
    return float(samples_per_second), cpu


def slice_cost(steps: int, rounds: int) -> None:
    """asyncddp's ranks with their CPU workers at the kernel's default slice (as in a process
    group by default) and at the long slice they ask for outside one (``asyncddp/_sched.py``),
    in turns: what the long slice would cost across processes."""
    long_ms = _sched.WORKER_SLICE_MS
    ms: dict[str, list[float]] = {"default slice": [], f"{long_ms:g} ms slice": []}
    for index in range(rounds):
        order = list(ms) if index % 2 == 0 else list(ms)[::-1]  # reversed every other round
        for name in order:
            with worker_slice("0" if name == "default slice" else f"{long_ms:g}"):
                samples_per_second, _ = asyncddp_2proc(
                    "mlp 512-1024-10", steps, torch.get_num_threads()
                )
            ms[name].append(1e3 * BATCH / samples_per_second)
    print(
        f"asyncddp, 2 processes x 1 CPU device (mlp 512-1024-10), its workers at the default "
        f"and at a {long_ms:g} ms scheduler slice; median of {rounds} rounds x {steps} steps, "
        "in turns"
    )
    for name, values in ms.items():
        print(f"  {name:<16} {statistics.median(values):7.2f} ms/step")
    default, long = ms.values()
    ratios = [b / a for a, b in zip(default, long, strict=True)]
    middle, low, high = _median_quartiles(ratios)
    print(
        f"  the long slice's step over the default's: {middle:.3f}x (the rounds' quartiles "
        f"{low:.3f}..{high:.3f}; slower in {sum(r > 1 for r in ratios)} of {len(ratios)} rounds)"
    )


def _busy(n: int) -> int:
    """Python bytecode for a while, holding the GIL as an event loop's own work does."""
    table: dict[int, int] = {}
    for i in range(n):
        table[i & 63] = i
    return len(table)


def _busy_count(microseconds: float) -> int:
    """How many rounds of :func:`_busy` take ``microseconds`` of this thread's CPU."""
    n = 1000
    while True:
        start = time.thread_time()
        _busy(n)
        spent = time.thread_time() - start
        if spent > 0.005:
            return max(1, round(n * microseconds * 1e-6 / spent))
        n *= 2


#: ``--loop-turn``'s variants: (name, share of the turn, where it runs).
TURNS = (
    ("no turn", 0.0, "between"),
    ("half a turn between steps", 0.5, "between"),
    ("a turn between steps", 1.0, "between"),
    ("a turn while the all-reduce waits", 1.0, "wait"),
    ("the same, steps queued ahead", 1.0, "ahead"),
)


def _loop_turn_rank(
    rank: int, port: int, steps: int, rounds: int, turn_us: float, results: Any
) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        count = torch.tensor([_busy_count(turn_us)])
        dist.broadcast(count, 0)  # both ranks turn alike: rank 0's calibration
        rounds_of_busy = int(count)
        torch.manual_seed(0)
        model = DistributedDataParallel(MODELS["mlp 512-1024-10"][0]())
        optimizer = SGD(model.parameters())
        batches = [(x[rank::2], y[rank::2]) for x, y in make_batches((512,), steps)]
        wake: list[Any] = []  # (loop, callback) while a variant turns in the wait

        # DDP's own all-reduce, and a wake-up. No annotations: DDP checks them, and these
        # would be strings (postponed evaluation), not the classes it wants.
        def hook(_, bucket):  # type: ignore[no-untyped-def]
            future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            if wake and bucket.index() == 0:  # once a step, at its first bucket
                loop, callback = wake[0]
                loop.call_soon_threadsafe(callback)
            return future.then(lambda done: done.value()[0].div_(2))

        model.register_comm_hook(None, hook)

        def one(batch: Any) -> None:
            optimizer.zero_grad()
            step(model, batch).backward()
            optimizer.step()

        async def run(share: float, where: str) -> tuple[float, float]:
            worker = HandOff()
            busy = round(share * rounds_of_busy)
            try:
                pending = iter(batches)
                queued: list[asyncio.Future[Any]] = []

                def turn_and_queue() -> None:  # "ahead": the turn, then the next step queued
                    _busy(busy)
                    batch = next(pending, None)
                    if batch is not None:
                        queued.append(worker.submit(lambda: one(batch)))

                if where in ("wait", "ahead"):
                    callback = turn_and_queue if where == "ahead" else lambda: _busy(busy)
                    wake.append((asyncio.get_running_loop(), callback))
                dist.barrier()
                start, cpu = time.perf_counter(), time.thread_time()
                if where == "ahead":
                    # Each step's hook queues the next one behind it, after the turn; the
                    # wake-up comes before the step's own end in the loop's queue.
                    first = next(pending)
                    queued.append(worker.submit(lambda: one(first)))
                    done = 0
                    while done < len(queued):
                        await queued[done]
                        done += 1
                    assert done == len(batches), "a step's hook did not queue the next one"
                else:
                    for batch in batches:
                        await worker.run(lambda batch=batch: one(batch))
                        if where == "between" and busy:
                            _busy(busy)
                spent = (time.perf_counter() - start, time.thread_time() - cpu)
            finally:
                wake.clear()
                worker.close()
            return 1e3 * spent[0] / len(batches), 1e3 * spent[1] / len(batches)

        async def all_rounds() -> dict[str, list[tuple[float, float]]]:
            figures: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in TURNS}
            await run(0.0, "between")  # warm-up
            for index in range(rounds):
                order = TURNS if index % 2 == 0 else TURNS[::-1]  # reversed every other round
                for name, share, where in order:
                    figures[name].append(await run(share, where))
            return figures

        figures = asyncio.run(all_rounds())
        if rank == 0:
            results.put(figures)
    finally:
        dist.destroy_process_group()


def _median_quartiles(values: list[float]) -> tuple[float, float, float]:
    """The median of ``values`` and their first and third quartiles (one value: itself)."""
    low, _, high = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return statistics.median(values), low, high


def loop_turn(steps: int, rounds: int, turn_us: float) -> None:
    figures = run_two_ranks(_loop_turn_rank, steps, rounds, turn_us, name="loop-turn")
    print(
        f"DDP handed off (mlp 512-1024-10, 2 processes x 1 thread, gloo), an event loop's turn "
        f"of {turn_us:.0f} us of Python CPU a step; median of {rounds} rounds x {steps} steps, "
        "in turns"
    )
    print(f"  {'':<34} {'ms/step':>8} {'loop CPU ms/step':>17} {'over no turn, ms':>17}")
    base = [wall for wall, _ in figures["no turn"]]
    for name, rows in figures.items():
        wall = statistics.median(w for w, _ in rows)
        cpu = statistics.median(c for _, c in rows)
        extra = ""
        if name != "no turn":
            over = [w - b for (w, _), b in zip(rows, base, strict=True)]
            middle, low, high = _median_quartiles(over)
            extra = f"{middle:+.3f} ({low:+.3f}..{high:+.3f})"
        print(f"  {name:<34} {wall:>8.2f} {cpu:>17.3f} {extra:>17}")
    between = figures["a turn between steps"]
    for name, label in (
        ("a turn while the all-reduce waits", "the turn in the wait"),
        ("the same, steps queued ahead", "the turn in the wait, steps queued ahead,"),
    ):
        saved = [b - w for (b, _), (w, _) in zip(between, figures[name], strict=True)]
        middle, low, high = _median_quartiles(saved)
        print(
            f"  {label} instead of between steps saves {middle:+.3f} "
            f"ms a step (the rounds' quartiles {low:+.3f}..{high:+.3f}; faster in "
            f"{sum(d > 0 for d in saved)} of {len(saved)} rounds)"
        )


class _CallCounter:
    """A ``sys.setprofile`` function that counts calls by the kind of thread making them:
    ``step`` (the thread that trains), ``loop`` (the event loop's), ``other``."""

    def __init__(self, main_kind: str) -> None:
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self.functions: collections.Counter[tuple[str, str]] = collections.Counter()
        self.counting = False
        self._main_kind = main_kind

    def _kind(self) -> str:
        thread = threading.current_thread()
        if thread is threading.main_thread():
            return self._main_kind
        return "step" if thread.name.startswith("asyncddp-worker") else "other"

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.counting:
            return
        if event == "call":
            kind = self._kind()
            self.calls[kind, "Python"] += 1
            code = frame.f_code
            self.functions[kind, f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        elif event == "c_call":
            self.calls[self._kind(), "C"] += 1

    def install(self) -> None:
        """On this thread, and on every thread started from now on."""
        sys.setprofile(self)
        threading.setprofile(self)

    def remove(self) -> None:
        self.counting = False
        sys.setprofile(None)
        threading.setprofile(None)  # not on threads started meanwhile: `counting` stops those


CALLS_CONTENDERS = ("ddp-gloo-2", "asyncddp-2proc", "asyncddp-2proc atomic_steps=False")


def _calls_rank(
    rank: int, port: int, contender: str, workload: str, steps: int, results: Any
) -> None:
    torch.set_num_threads(1)
    make, shape = MODELS[workload]
    counter = _CallCounter("step" if contender == "ddp-gloo-2" else "loop")
    if contender == "ddp-gloo-2":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2
        )
        try:
            torch.manual_seed(0)
            model = DistributedDataParallel(make())
            optimizer = SGD(model.parameters())
            batches = [(x[rank::2], y[rank::2]) for x, y in make_batches(shape, steps)]
            train(model, optimizer, batches)  # the warm-up, as the timed contenders' first pass
            counter.install()
            counter.counting = True
            train(model, optimizer, batches)
            counter.remove()
        finally:
            dist.destroy_process_group()
    else:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
        asyncddp.distributed.init("gloo")
        try:
            halves = [
                (x[part::2], y[part::2]) for x, y in make_batches(shape, steps) for part in range(2)
            ]

            async def run() -> None:
                torch.manual_seed(0)
                trainer = asyncddp.Trainer(
                    make(),
                    SGD,
                    step,
                    devices="cpu",
                    progress_bar=False,
                    atomic_steps=contender == "asyncddp-2proc",
                )
                counter.install()  # before the worker starts, in the first fit
                await trainer.fit(halves, epochs=1)  # the warm-up
                counter.counting = True
                await trainer.fit(halves, epochs=2)
                counter.remove()

            asyncio.run(run())
        finally:
            asyncddp.distributed.destroy()
    if rank == 0:
        results.put((dict(counter.calls), dict(counter.functions)))


def _count_cell(value: float | None, width: int) -> str:
    return f"{value:>{width}.0f}" if value is not None else f"{'-':>{width}}"


def calls(workload: str, steps: int, top: int) -> None:
    print(
        f"calls a step on rank 0, by thread ({workload}, 2 processes x 1 CPU device, gloo, "
        f"{steps} steps counted; Python: functions, a coroutine's resumption included; C: "
        "builtins and torch's bindings called from Python)"
    )
    print(
        f"  {'':<34} {'the thread that trains':>22} {'the event loop':>16} {'other':>8}"
        f" {'all':>7}\n  {'':<34} {'Python':>11} {'C':>10} {'Python':>8} {'C':>7} {'':>8}"
    )
    rows = {}
    for contender in CALLS_CONTENDERS:
        counted, functions = run_two_ranks(
            _calls_rank, contender, workload, steps, name=f"{contender} (calls)"
        )
        rows[contender] = functions
        a_step = {key: value / steps for key, value in counted.items()}
        cells = [
            _count_cell(a_step.get((kind, language)), width)
            for kind, language, width in (
                ("step", "Python", 11),
                ("step", "C", 10),
                ("loop", "Python", 8),
                ("loop", "C", 7),
            )
        ]
        other = a_step.get(("other", "Python"), 0.0) + a_step.get(("other", "C"), 0.0)
        print(f"  {contender:<34} {' '.join(cells)} {other:>8.0f} {sum(a_step.values()):>7.0f}")
    functions = rows["asyncddp-2proc"]
    for kind, label in (("step", "the thread that trains"), ("loop", "the event loop")):
        mine = sorted(
            ((count, name) for (where, name), count in functions.items() if where == kind),
            reverse=True,
        )[:top]
        listed = ", ".join(f"{name} {count / steps:.0f}" for count, name in mine)
        print(f"  asyncddp-2proc, {label}, its {top} most called a step: {listed}")


NO_BACKUP = "asyncddp-2proc atomic_steps=False"
HANDED_OFF = "ddp-gloo-2 handed off"
BACKED_UP = "ddp-gloo-2 handed off + backup"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--phases", action="store_true", help="time the phases of asyncddp's step on the MLP"
    )
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=list(MODELS),
        default=list(WORKLOADS),
        help='the models (default: the issue\'s two; "linear 16-10": a step of fixed costs alone)',
    )
    parser.add_argument(
        "--exchange",
        action="store_true",
        help="time a step's header and gradients crossing alone, together, packed in one",
    )
    parser.add_argument(
        "--loop-turn",
        action="store_true",
        help="what an event loop's turn a step costs DDP handed off, between steps or in the wait",
    )
    parser.add_argument(
        "--slice-cost",
        action="store_true",
        help="asyncddp's ranks with their workers at the default and at the long scheduler slice",
    )
    parser.add_argument(
        "--calls",
        action="store_true",
        help="count the Python and C calls a step, thread by thread, of DDP and asyncddp",
    )
    parser.add_argument(
        "--turn-us",
        type=float,
        default=370.0,
        help="--loop-turn's turn, us of CPU, on top of the hand-off's own (default: about "
        "asyncddp's event loop's whole CPU a step in the runs of docs/benchmarks.md)",
    )
    args = parser.parse_args()
    if args.loop_turn:  # at least 20 rounds of 300 steps (unless --quick)
        steps, rounds = (8, 1) if args.quick else (max(args.steps, 300), max(args.rounds, 20))
        loop_turn(steps, rounds, args.turn_us)
        return
    if args.slice_cost:  # at least 8 rounds of 300 steps (unless --quick)
        steps, rounds = (8, 1) if args.quick else (max(args.steps, 300), max(args.rounds, 8))
        slice_cost(steps, rounds)
        return
    if args.calls:  # 100 steps unless --steps says more (or --quick less)
        calls("mlp 512-1024-10", 8 if args.quick else max(args.steps, 100), top=8)
        return
    if args.quick:
        args.steps, args.rounds = 8, 1
    if args.exchange:
        exchange(5 if args.quick else 100)
        return
    if args.phases:  # 300 steps unless --steps says more (or --quick less)
        steps = args.steps if args.quick else max(args.steps, 300)
        phases("mlp 512-1024-10", steps, torch.get_num_threads())
        return
    threads = torch.get_num_threads()
    print(
        f"samples/s over 2 processes x 1 CPU device (gloo), global batch {BATCH}, "
        f"{max(1, threads // 2)} threads per process, median of {args.rounds} rounds x "
        f"{args.steps} steps (torch {torch.__version__}, {os.cpu_count()} CPUs)"
    )
    for name in args.workloads:
        shape = MODELS[name][1]
        figures: dict[str, list[tuple[float, dict[str, float]]]] = {
            "ddp-gloo-2": [],
            HANDED_OFF: [],
            BACKED_UP: [],
            "asyncddp-2proc": [],
            NO_BACKUP: [],
        }
        for _ in range(args.rounds):
            figures["ddp-gloo-2"].append(ddp_gloo(name, shape, args.steps, threads))
            figures[HANDED_OFF].append(ddp_gloo(name, shape, args.steps, threads, handoff=True))
            figures[BACKED_UP].append(
                ddp_gloo(name, shape, args.steps, threads, handoff=True, backup=True)
            )
            figures["asyncddp-2proc"].append(asyncddp_2proc(name, args.steps, threads))
            figures[NO_BACKUP].append(asyncddp_2proc(name, args.steps, threads, atomic=False))
        # Samples/s, the median of the rounds; the CPU a step split by thread, of the round
        # whose CPU a step is the median (a split of one round adds up; medians would not).
        median = {
            key: (
                statistics.median(rate for rate, _ in rows),
                sorted((cpu for _, cpu in rows), key=lambda cpu: cpu["all"])[len(rows) // 2],
            )
            for key, rows in figures.items()
        }
        # Rank 0's minor page faults a step, the median of the rounds.
        faults = {
            key: (
                f"{statistics.median(cpu['faults'] for _, cpu in rows):11.1f}"
                if all("faults" in cpu for _, cpu in rows)
                else ""
            )
            for key, rows in figures.items()
        }
        print(f"\n{name}")
        print(
            f"  {'':<33} {'samples/s':>9} {'ms/step':>8} {'CPU ms/step':>12}"
            "  of it: step  gloo  loop  other  faults/step"
        )
        for key, (value, cpu) in median.items():
            loop = "     " if key == "ddp-gloo-2" else f"{cpu['loop']:5.2f}"
            print(
                f"  {key:<33} {value:>9.0f} {1e3 * BATCH / value:>8.2f} {cpu['all']:>12.2f}"
                f"  {cpu['step']:>10.2f} {cpu['gloo']:5.2f} {loop} {cpu['other']:6.2f}"
                f"  {faults[key]}"
            )
        ours, ddp = median["asyncddp-2proc"][1], median["ddp-gloo-2"][1]
        rates = {key: [row[0] for row in rows] for key, rows in figures.items()}
        for top, note in (
            ("asyncddp-2proc", "(target >= 1.0x)"),
            (NO_BACKUP, "(no undo, as DDP)"),
            (HANDED_OFF, "(the floor of a free event loop)"),
            (BACKED_UP, "(the floor of a free event loop and atomic steps)"),
        ):
            line = ratio_line(top, "ddp-gloo-2", rates[top], rates["ddp-gloo-2"], False)
            print(f"  {line}  {note}")
        print(
            f"  CPU a step, asyncddp over DDP: {ours['all'] - ddp['all']:+.2f} ms (rank 0's "
            f"process; the thread that trains {ours['step'] - ddp['step']:+.2f} ms, gloo's "
            f"{ours['gloo'] - ddp['gloo']:+.2f} ms, the event loop's {ours['loop']:+.2f} ms)"
        )


if __name__ == "__main__":
    main()
