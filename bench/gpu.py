"""GPU: do two workers on one GPU overlap on their own streams, what does a step cost, and N GPUs?

Run:  python bench/gpu.py [--trace DIR]   (on a machine with a CUDA GPU; about a minute)
      python bench/gpu.py --quick          (a smoke run; on a machine without one it runs the
                                            same code on CPU workers, and says so)

1. Overlap: the same work on two workers at once, each on its own stream of the same GPU,
   against that work done one after the other on one worker. ``serial / concurrent`` near 2
   means the two streams ran side by side; near 1, not at all. Two kinds of work:
   - ``sleep``: ``torch.cuda._sleep`` kernels, each of which spins one GPU thread for a fixed
     count of cycles: they overlap if, and only if, the streams are concurrent;
   - ``matmul``: 512x512 matmuls and tanh, real kernels too small to fill the GPU alone (one
     big kernel fills an H100-class GPU by itself: overlap shows with kernels that do not).
   With ``--trace DIR``: a ``torch.profiler`` trace of the concurrent matmul run, and a plot of
   its kernels on each stream (``DIR/gpu-streams.json``, ``DIR/gpu-streams.png``).
2. One GPU: milliseconds per training step, the plain PyTorch loop against ``Trainer`` on the
   same GPU, same model, SGD and data (pinned CPU batches, copied to the GPU each step):
   - the MLP 512-1024-10, batch 256: about 0.1 ms of GPU work a step, so the host's Python is
     the step's time (dispatch-bound);
   - a wide MLP 4096-4096-4096-10, batch 1024: the GPU's work is the step's time.
   The plain loop reads its loss every step (``loss.item()``, as a loop that logs or checks
   its loss does), and, as ``ahead``, never: then the GPU runs behind the host, which can
   queue the next steps' kernels while it waits. asyncddp reads each step's loss once the
   forward is done, and reports the step with its backward and optimizer step still queued
   on the GPU (the next step's kernels queue behind them); ``synced`` is asyncddp as it was
   before that change: the loss read once the backward is queued (waiting for it), and each
   step reporting once its stream has finished, so that the GPU idles while the event loop
   takes the step's results. A fit's epoch time, from which asyncddp's figures come, ends
   when its last step reports, before that step's GPU work does (one step in 50 or 200);
   ``noatomic`` is asyncddp without its step backup (``atomic_steps=False``: no copy of the
   parameters and optimizer state on the GPU before each step, which a plain loop does not
   keep either), ``finite`` with ``check_finite=True`` (the loss checked once the
   backward is queued, before the optimizer step).
3. Event-loop lag: a 1 ms ticker on the event loop beside 2 epochs of the wide MLP on the GPU,
   with ``Trainer`` and with the plain loop called from a coroutine (bench/loop_lag.py's measure).
4. Scaling: the MLP's samples per second on every visible GPU against one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from throughput import BATCH, SGD, make_batches, mlp, step, with_asyncddp
from torch import nn

import asyncddp
import asyncddp._jobs
from asyncddp._worker import CallerState, DeviceWorker

Work = Callable[[torch.device], None]


def matmuls(size: int, count: int) -> Work:
    def work(device: torch.device) -> None:
        x = torch.randn(size, size, device=device)
        for _ in range(count):
            x = torch.tanh(x @ x / size)

    return work


def sleeps(cycles: int, count: int) -> Work:
    def work(device: torch.device) -> None:
        for _ in range(count):
            torch.cuda._sleep(cycles)

    return work


async def overlap(
    device: torch.device, work: Work, trace: Path | None = None
) -> tuple[float, float]:
    """Seconds for ``work`` on two workers at once, and one after the other on one."""
    devices = [
        asyncddp.Device(index=i, torch_device=device, name=f"{device}#{i}") for i in range(2)
    ]
    workers = [DeviceWorker(d) for d in devices]  # two workers, one device: built by hand
    for worker in workers:
        worker.start()
    loop = asyncio.get_running_loop()

    async def on(worker: DeviceWorker) -> None:
        done: asyncio.Future[None] = loop.create_future()
        state = CallerState.capture(device.type)

        def job() -> None:
            worker.invoke(state, contextvars.copy_context(), work, device)
            loop.call_soon_threadsafe(done.set_result, None)

        worker.submit(job)
        await done

    try:
        await on(workers[0])  # warm-up: streams, kernels, allocator
        await on(workers[1])
        start = time.perf_counter()
        await asyncio.gather(on(workers[0]), on(workers[1]))
        concurrent = time.perf_counter() - start
        start = time.perf_counter()
        await on(workers[0])
        await on(workers[0])
        serial = time.perf_counter() - start
        if trace is not None:
            await traced(lambda: asyncio.gather(on(workers[0]), on(workers[1])), trace)
    finally:
        for worker in workers:
            worker.stop()
        for worker in workers:
            worker.join()
    return concurrent, serial


async def traced(run: Callable[[], Any], directory: Path) -> None:
    """Profile ``run()``'s kernels; write the trace and a plot of them on each stream."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*Profiler clears events", UserWarning)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            await run()
            torch.cuda.synchronize()
    write_trace(prof, directory)


def write_trace(prof: Any, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "gpu-streams.json"
    prof.export_chrome_trace(str(path))
    kernels = [
        event
        for event in json.loads(path.read_text()).get("traceEvents", [])
        if event.get("cat") == "kernel" and "stream" in event.get("args", {})
    ]
    if not kernels:
        print(f"trace: no kernel events in {path}")
        return
    streams = sorted({event["args"]["stream"] for event in kernels})
    print(f"trace: {len(kernels)} kernels on streams {streams}, written to {path}")
    plot_streams(kernels, streams, directory / "gpu-streams.png")


def plot_streams(kernels: list[dict[str, Any]], streams: list[int], png: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("plot: skipped, matplotlib is not installed")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(event["ts"] for event in kernels)
    fig, ax = plt.subplots(figsize=(9, 1.0 + 0.6 * len(streams)))
    for row, stream in enumerate(streams):
        spans = [
            ((event["ts"] - start) / 1e3, max(event["dur"], 1) / 1e3)
            for event in kernels
            if event["args"]["stream"] == stream
        ]
        ax.broken_barh(spans, (row - 0.35, 0.7), color=f"C{row}")
    ax.set_yticks(range(len(streams)), [f"stream {s}" for s in streams])
    ax.set_xlabel("ms")
    ax.set_title("Two asyncddp workers on one GPU: their kernels on each worker's stream")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"plot: {png}")


def wide_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)
    )


def pinned_batches(features: int, batch: int, steps: int) -> list[tuple[torch.Tensor, ...]]:
    """Batches in page-locked memory (in ordinary memory where no GPU is visible)."""
    generator = torch.Generator().manual_seed(0)
    pin = torch.cuda.is_available()
    return [
        tuple(
            t.pin_memory() if pin else t
            for t in (
                torch.randn(batch, features, generator=generator),
                torch.randint(0, 10, (batch,), generator=generator),
            )
        )
        for _ in range(steps)
    ]


def plain_step_ms(
    make: Callable[[], nn.Module], batches: list[Any], device: torch.device, read_loss: bool
) -> float:
    """The plain loop on ``device``: ms per step of a timed pass after a warm-up pass."""
    torch.manual_seed(0)
    model = make().to(device)
    optimizer = SGD(model.parameters())

    def one_pass() -> None:
        for inputs, targets in batches:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = step(model, (inputs, targets))
            loss.backward()
            optimizer.step()
            if read_loss:
                loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    one_pass()
    start = time.perf_counter()
    one_pass()
    return (time.perf_counter() - start) * 1e3 / len(batches)


async def asyncddp_step_ms(
    make: Callable[[], nn.Module],
    batches: list[Any],
    device: torch.device,
    synced: bool = False,
    **options: Any,
) -> float:
    """``Trainer`` on ``device``: ms per step of a fit's second epoch (the first warms up);
    with ``synced``, every step waits for its stream before it reports."""
    torch.manual_seed(0)
    trainer = asyncddp.Trainer(make(), SGD, step, devices=device, progress_bar=False, **options)
    jobs = asyncddp._jobs
    leave, behind_forward = jobs.leave_stream_running, vars(jobs._OnHost)["behind_forward"]
    if synced:  # as before: the loss read after the backward, every job waiting for its stream
        jobs.leave_stream_running = lambda: None  # type: ignore[assignment]
        jobs._OnHost.behind_forward = classmethod(lambda *args: None)  # type: ignore[assignment]
    try:
        result = await trainer.fit(batches, epochs=2)
    finally:
        jobs.leave_stream_running = leave  # type: ignore[assignment]
        jobs._OnHost.behind_forward = behind_forward  # type: ignore[assignment]
    return result.history[-1].seconds * 1e3 / len(batches)


async def one_gpu(device: torch.device, rounds: int, steps: int, wide: bool = True) -> None:
    workloads = [("mlp 512-1024-10, batch 256", mlp, pinned_batches(512, BATCH, steps))]
    if wide:
        workloads.append(
            ("mlp 4096-4096-4096-10, batch 1024", wide_mlp, pinned_batches(4096, 1024, steps // 4))
        )
    print(
        f"one GPU: ms per step, median of {rounds} rounds (plain: loss.item() every step; "
        "ahead: never; synced: asyncddp waiting for its stream before each step reports; "
        "noatomic: asyncddp with atomic_steps=False; finite: with check_finite=True)"
    )
    print(
        f"  {'workload':34} {'plain':>6} {'ahead':>6} {'asyncddp':>8} {'synced':>6} "
        f"{'noatomic':>8} {'finite':>6}  asyncddp vs plain, vs ahead, vs synced"
    )
    options: dict[str, dict[str, Any]] = {
        "asyncddp": {},
        "synced": {"synced": True},
        "noatomic": {"atomic_steps": False},
        "finite": {"check_finite": True},
    }
    overheads = []
    for name, make, batches in workloads:
        times: dict[str, list[float]] = {"plain": [], "ahead": []}
        times.update({contender: [] for contender in options})
        for _ in range(rounds):  # interleaved, so that a slow moment hits every contender
            times["plain"].append(plain_step_ms(make, batches, device, read_loss=True))
            times["ahead"].append(plain_step_ms(make, batches, device, read_loss=False))
            for contender, given in options.items():
                times[contender].append(await asyncddp_step_ms(make, batches, device, **given))
        plain, ahead, ours, synced, noatomic, finite = (statistics.median(times[k]) for k in times)
        print(
            f"  {name:34} {plain:6.3f} {ahead:6.3f} {ours:8.3f} {synced:6.3f} {noatomic:8.3f} "
            f"{finite:6.3f}  {ours / plain - 1:+7.1%}, {ours / ahead - 1:+7.1%}, "
            f"{ours / synced - 1:+7.1%}"
        )
        overheads.append((name, ours / plain - 1))
    for name, overhead in overheads:
        print(f"  {name}: asyncddp per step vs plain {overhead:+.1%}  (target <= +3%)")


async def lag(device: torch.device, steps: int) -> None:
    """Event-loop lag of a 1 ms ticker beside training on the GPU (bench/loop_lag.py's)."""
    from loop_lag import beside, describe, p99_of

    batches = pinned_batches(4096, 1024, steps)
    model = wide_mlp()  # built before the ticker starts: 0.1-0.2 s of the loop thread's time

    async def with_asyncddp() -> None:
        trainer = asyncddp.Trainer(model, SGD, step, devices=device, progress_bar=False)
        await trainer.fit(batches, epochs=2)

    async def blocking() -> None:
        plain_step_ms(wide_mlp, batches, device, read_loss=True)  # two passes, no await

    print(f"lag of a 1 ms ticker beside 2 epochs x {steps} steps of the wide MLP on the GPU")
    ours = await beside(with_asyncddp(), steps)
    print(describe("asyncddp", ours))
    print(describe("blocking", await beside(blocking(), steps)))
    print(f"  asyncddp p99 {1e3 * p99_of(ours):.3f} ms (target <= 2 ms)")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trace", type=Path, help="write a kernel trace and its plot here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        name = torch.cuda.get_device_name(0)
        print(f"{torch.cuda.device_count()} x {name}, torch {torch.__version__}")
    else:
        print("no CUDA GPU visible: a CPU smoke run of the same code (figures mean nothing)")
    count, rounds, steps = (200, 5, 200) if cuda else (40, 1, 10)
    if args.quick:
        count, rounds, steps = max(4, count // 10), 1, 8
    works = [("matmul", matmuls(512, count))]
    if cuda:
        works.insert(0, ("sleep", sleeps(1_000_000, 20)))  # ~0.5 ms each at ~2 GHz
    for label, work in works:
        trace = args.trace if label == "matmul" and cuda else None
        concurrent, serial = await overlap(device, work, trace)
        print(
            f"overlap ({label}), 2 workers on {device}: concurrent {concurrent * 1e3:.1f} ms, "
            f"serial {serial * 1e3:.1f} ms, serial/concurrent {serial / concurrent:.2f}x"
        )
    if not cuda:
        await one_gpu(device, rounds, steps, wide=False)  # the step table's code, on the CPU
        rate = await with_asyncddp(mlp, make_batches((512,), steps), 2)
        print(f"MLP, batch {BATCH}, 2 CPU workers: {rate:.0f} samples/s")
        return
    await one_gpu(device, rounds, steps)
    await lag(device, steps)
    n = torch.cuda.device_count()
    if n == 1:
        print("1 GPU visible: samples/s on N GPUs against one not measured")
        return
    batches = make_batches((512,), steps)
    one = await with_asyncddp(mlp, batches, "cuda:0")
    every = await with_asyncddp(mlp, batches, "cuda")
    print(
        f"MLP, batch {BATCH}: 1 GPU {one:.0f} samples/s, {n} GPUs {every:.0f} samples/s, "
        f"{every / one:.2f}x"
    )


if __name__ == "__main__":
    asyncio.run(main())
