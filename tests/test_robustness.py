"""Load, concurrency, crashes while writing, and fuzzed input."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import sniffio
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import asyncddp
from asyncddp import Trainer, WorkerFailedError, cpu_devices
from asyncddp._data import items_in, split_batch

ROOT = Path(__file__).resolve().parent.parent

#: Figures for the summary conftest.py prints at the end of the run.
FIGURES: dict[str, str] = {}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))


def make_batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(9, 6, generator=generator), torch.randn(9, 2, generator=generator))
        for _ in range(5)
    ]


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


ADAM = functools.partial(torch.optim.Adam, lr=0.01)


@pytest.mark.anyio
async def test_eight_trainers_at_once_end_as_if_run_one_after_another() -> None:
    async def train(seed: int) -> dict[str, torch.Tensor]:
        trainer = Trainer(make_model(seed), ADAM, mse, devices=cpu_devices(2), progress_bar=False)
        await trainer.fit(make_batches(seed), epochs=3)
        return {k: v.clone() for k, v in trainer.model.state_dict().items()}

    sequential = [await train(seed) for seed in range(8)]
    concurrent: dict[int, dict[str, torch.Tensor]] = {}

    async def run(seed: int) -> None:
        concurrent[seed] = await train(seed)

    async with anyio.create_task_group() as group:
        for seed in range(8):
            group.start_soon(run, seed)
    for seed in range(8):
        for name, value in sequential[seed].items():
            torch.testing.assert_close(concurrent[seed][name], value, rtol=1e-6, atol=1e-6)
    FIGURES["concurrency"] = (
        "8 trainers x 2 workers at once in one loop: parameters equal to 8 runs in turn"
    )


@pytest.mark.anyio
async def test_a_long_run_keeps_threads_and_event_buffers_flat() -> None:
    batches = [(torch.randn(8, 6), torch.randn(8, 2)) for _ in range(500)]
    trainer = Trainer(make_model(0), ADAM, mse, devices=cpu_devices(4), progress_bar=False)
    stream = trainer.events(maxlen=50)  # nobody reads it
    threads_before = len(asyncddp.testing.asyncddp_threads())
    await trainer.fit(batches, epochs=4)  # 2,000 steps
    assert len(asyncddp.testing.asyncddp_threads()) == threads_before
    assert len(stream._queue) == 50
    assert stream.dropped == 2006 - 50  # FitStarted, 2,000 steps, 4 EpochEnded, FitEnded
    FIGURES["load"] = (
        f"2,000 steps on 4 workers: worker threads after {threads_before} -> "
        f"{len(asyncddp.testing.asyncddp_threads())}, unread stream {len(stream._queue)} events "
        f"(maxlen 50), {stream.dropped} dropped"
    )
    del stream


@pytest.mark.anyio
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("ending", ["fit", "failed fit", "failed backward", "validate"])
async def test_a_trainer_let_go_frees_its_model_and_replicas(devices: int, ending: str) -> None:
    # A notebook sweep or a service trains one model after another and keeps none of them: each
    # trainer's replicas and optimizer state (on a GPU, device memory) must go with it.
    model = make_model(0)
    step = mse
    if ending.startswith("failed"):
        where = "backward" if ending == "failed backward" else "forward"
        step = asyncddp.testing.failing_step(mse, device=devices - 1, at=1, where=where)
    trainer = Trainer(model, ADAM, step, devices=cpu_devices(devices), progress_bar=False)
    if ending == "validate":
        await trainer.validate(make_batches(0))
    else:
        with contextlib.nullcontext() if ending == "fit" else pytest.raises(WorkerFailedError):
            await trainer.fit(make_batches(0))
    gone = [weakref.ref(thing) for thing in (trainer, model, *trainer._replicas)]
    assert len(gone) == 2 + devices
    del trainer, model
    gc.collect()
    assert [ref() is None for ref in gone] == [True] * len(gone)


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic garbage collector off (as a service may run, or one that froze its heap):
    only reference counting frees anything."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.anyio
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize(
    "failure",
    [
        "device",
        "bad output",
        "non-finite",
        "validate",
        "bad output in validate",
        "retried then raised",
    ],
)
async def test_a_failed_step_s_tensors_go_once_its_error_is_let_go(
    devices: int, failure: str
) -> None:
    # The error raised from fit or validate was in a reference cycle (error -> traceback ->
    # a frame of the trainer's -> the error in its locals): the failed step's tensors (its
    # inputs, activations, graph: on a GPU, device memory) stayed until the cyclic collector
    # happened to run, 15 MB a failed fit here, never where a service turns it off.
    made: list[weakref.ref[torch.Tensor]] = []

    def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
        big = torch.ones(100_000, requires_grad=True)  # held by the loss's graph too
        made.append(weakref.ref(big))
        loss = mse(model, batch) + 0 * (big * big).sum()
        if failure.startswith("bad output"):
            return {"loss": loss, "items": -1, "held": big}  # the output holds it in validation
        if failure == "non-finite":
            return loss * float("nan")
        raise RuntimeError("the step failed")

    options: dict[str, Any] = {"check_finite": failure == "non-finite"}
    if failure == "retried then raised":
        options.update(on_failure="retry", max_retries=1)
    trainer = Trainer(
        make_model(0), ADAM, step, devices=cpu_devices(devices), progress_bar=False, **options
    )
    with collector_off():
        try:
            if failure.endswith("validate"):
                await trainer.validate(make_batches(0))
            else:
                await trainer.fit(make_batches(0))
        except asyncddp.AsyncDDPError:
            pass
        else:
            raise AssertionError("the step's failure was not raised")
        assert made
        assert [ref() is None for ref in made] == [True] * len(made)


def run_script(
    script: str, *options: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``script`` run by this Python in a process of its own, with interpreter ``options``."""
    return subprocess.run(
        [sys.executable, *options, "-c", script], capture_output=True, text=True, timeout=timeout
    )


def test_a_fit_without_a_progress_bar_leaves_no_thread_behind() -> None:
    # tqdm(disable=True) still started tqdm's monitor thread, there for the process's life. In
    # a process of its own: the suite's other tests show bars.
    script = textwrap.dedent(
        """
        import asyncio, functools, threading, torch, asyncddp
        sgd = functools.partial(torch.optim.SGD, lr=0.1)
        trainer = asyncddp.Trainer(torch.nn.Linear(2, 1), sgd, lambda m, b: m(b).pow(2).mean(),
                                   devices=asyncddp.cpu_devices(2), progress_bar=False)
        asyncio.run(trainer.fit([torch.ones(4, 2)] * 3))
        print(sorted(t.name for t in threading.enumerate()))
        """
    )
    done = run_script(script)
    done.check_returncode()
    assert done.stdout.strip() == "['MainThread']"


def test_the_first_fit_under_asyncio_imports_nothing_of_anyio_on_the_loop() -> None:
    # anyio imported its asyncio backend at its first call under asyncio: ~40-140 ms of
    # imports on the event loop's thread, inside the first fit. asyncddp's import pays it.
    # In a process of its own: the suite has long imported the backend.
    script = textwrap.dedent(
        """
        import asyncio, functools, sys, torch, asyncddp
        before = set(sys.modules)
        sgd = functools.partial(torch.optim.SGD, lr=0.1)
        trainer = asyncddp.Trainer(torch.nn.Linear(2, 1), sgd, lambda m, b: m(b).pow(2).mean(),
                                   devices=asyncddp.cpu_devices(2), progress_bar=False)
        asyncio.run(trainer.fit([torch.ones(4, 2)] * 3))
        print(sorted(m for m in set(sys.modules) - before if m.split(".")[0] == "anyio"))
        """
    )
    done = run_script(script)
    done.check_returncode()
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("call", ["resume", "distributed"])
def test_the_first_optimizer_a_call_builds_on_the_loop_imports_nothing_there(
    call: str, tmp_path: Path
) -> None:
    # The first optimizer a process builds imports torch._dynamo: 1-3 s of imports, on the
    # event loop's thread where a fit resumed from a checkpoint checks it against one, and
    # where a distributed fit's first join compares the ranks' (the loop blocked 2.6-3.0 s in
    # a torchrun of the digits example under PYTHONDEVMODE). In a process of its own.
    script = textwrap.dedent(
        """
        import asyncio, functools, sys, threading, torch, asyncddp
        from torch.distributed import HashStore
        assert "torch._dynamo" not in sys.modules
        importers = []

        class Watch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch._dynamo":
                    importers.append(threading.current_thread() is threading.main_thread())

        sys.meta_path.insert(0, Watch())
        sgd = functools.partial(torch.optim.SGD, lr=0.1)
        trainer = asyncddp.Trainer(torch.nn.Linear(2, 1), sgd, lambda m, b: m(b).pow(2).mean(),
                                   devices="cpu", progress_bar=False)
        if CALL == "distributed":
            torch.distributed.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
            asyncio.run(trainer.fit([torch.ones(4, 2)] * 3))
            torch.distributed.destroy_process_group()
        else:
            asyncio.run(trainer.fit([torch.ones(4, 2)] * 3, epochs=2, resume=PATH))
        print(importers)
        """
    )
    path = tmp_path / "first.ckpt"
    if call == "resume":
        sgd = functools.partial(torch.optim.SGD, lr=0.1)
        trainer = Trainer(
            torch.nn.Linear(2, 1),
            sgd,
            lambda m, b: m(b).pow(2).mean(),
            devices="cpu",
            progress_bar=False,
        )
        anyio.run(functools.partial(trainer.fit, [torch.ones(4, 2)] * 3))
        anyio.run(trainer.save_checkpoint, path)
    done = run_script(f"CALL = {call!r}; PATH = {str(path)!r}\n" + script)
    done.check_returncode()
    assert done.stdout.strip() == "[False]"  # imported once, on another thread


#: A slow piece of work in torch's own code (a torch op releases the GIL as it computes).
SLOW_TORCH = """
def slow_torch(seconds):
    end, a = time.monotonic() + seconds, torch.randn(128, 128)
    while time.monotonic() < end:
        a = torch.tanh(a @ a.T)
"""

LEFT_BEHIND = {
    # A step that outlived step_timeout and drain_timeout: the script caught the timeout and
    # ended, its worker thread still in the step.
    "worker": """
        async def main():
            async with asyncddp.StepScheduler(
                asyncddp.cpu_devices(1), step_timeout=0.1, drain_timeout=0.1
            ) as scheduler:
                try:
                    await scheduler.run(lambda ctx, shard: slow_torch(2.5), [None])
                except asyncddp.WorkerTimeoutError:
                    print("timed out")
    """,
    # A fit cancelled while its loader thread was inside a slow next().
    "loader": """
        def batches():
            for i in range(100):
                if i == 3:
                    slow_torch(3.0)
                yield torch.randn(8, 4), torch.randn(8, 1)

        async def main():
            trainer = asyncddp.Trainer(
                torch.nn.Linear(4, 1), functools.partial(torch.optim.SGD, lr=0.1),
                lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                devices=asyncddp.cpu_devices(1), progress_bar=False,
            )
            async with anyio.create_task_group() as group:
                async def cancel_at_step_2():
                    async for event in trainer.events():
                        if isinstance(event, asyncddp.StepEnded) and event.step >= 2:
                            await anyio.sleep(0.3)  # the loader is in the slow next() by then
                            group.cancel_scope.cancel()
                group.start_soon(cancel_at_step_2)
                await trainer.fit(batches(), epochs=1)
            print("cancelled at step", trainer.global_step)
    """,
}


@pytest.mark.parametrize("thread", sorted(LEFT_BEHIND))
def test_a_script_that_ends_with_a_thread_left_behind_in_torch_exits_cleanly(
    thread: str,
) -> None:
    # The thread, a daemon, took the GIL back as the interpreter finalized, and exited through
    # pthread_exit inside torch's C++: "terminate called without an active exception", exit
    # status 134 (SIGABRT), in every run of both scripts.
    script = "\n".join(
        [
            "import asyncio, functools, time, warnings, anyio, torch, asyncddp",
            "warnings.simplefilter('ignore')",
            textwrap.dedent(SLOW_TORCH),
            textwrap.dedent(LEFT_BEHIND[thread]),
            "asyncio.run(main())",
            "print('exiting', flush=True)",
        ]
    )
    done = run_script(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "exiting"
    assert re.search(rf"waiting up to [89]\.\d s more for asyncddp-{thread}", done.stderr)
    assert "terminate called" not in done.stderr


def test_a_thread_left_behind_that_ends_at_once_is_waited_for_without_a_word() -> None:
    # A loader thread finishing its next() a few milliseconds after a failed fit (the usual
    # case) printed "waiting up to 10 s ... (it may abort the process ...)" after a plain
    # mistake in the step, as if the library were at fault.
    script = "\n".join(
        [
            "import asyncio, functools, time, warnings, anyio, torch, asyncddp",
            "warnings.simplefilter('ignore')",
            textwrap.dedent(SLOW_TORCH),
            textwrap.dedent(LEFT_BEHIND["loader"]).replace("slow_torch(3.0)", "slow_torch(0.45)"),
            "asyncio.run(main())",
            "print('exiting', flush=True)",
        ]
    )
    done = run_script(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "exiting"
    assert "waiting up to" not in done.stderr
    assert "terminate called" not in done.stderr


def test_a_thread_left_behind_in_a_python_lock_does_not_hold_the_exit() -> None:
    # A live feed (a generator reading a queue.Queue) stopped with stop(): its loader thread
    # waits in the queue's lock, C code that never returns into torch's as the interpreter
    # finalizes, so the exit need not wait for it (a first version waited its 10 s).
    script = textwrap.dedent(
        """
        import asyncio, functools, os, queue, time, torch, asyncddp
        os.environ["ASYNCDDP_EXIT_WAIT"] = "60"  # a wait, if any, far above an exit's time
        feed = queue.Queue()
        for _ in range(3):
            feed.put((torch.randn(8, 4), torch.randn(8, 1)))

        def live():
            while True:
                yield feed.get()  # the producer has stopped

        async def main():
            trainer = asyncddp.Trainer(
                torch.nn.Linear(4, 1), functools.partial(torch.optim.SGD, lr=0.1),
                lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                devices=asyncddp.cpu_devices(1), progress_bar=False,
            )
            async def stop_at_step_2():
                async for event in trainer.events():
                    if isinstance(event, asyncddp.StepEnded) and event.step >= 2:
                        await asyncio.sleep(0.3)  # the loader waits in feed.get() by then
                        trainer.stop("the producer has stopped")
            watcher = asyncio.create_task(stop_at_step_2())
            result = await trainer.fit(live(), epochs=1)
            await watcher
            print("stopped", result.stopped, flush=True)

        asyncio.run(main())
        print("exiting", time.monotonic(), flush=True)
        """
    )
    done = run_script(script, timeout=180)
    ended = time.monotonic()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "stopped True"
    assert "waiting up to" not in done.stderr
    exiting = float(done.stdout.splitlines()[-1].split()[1])  # the same clock: CLOCK_MONOTONIC
    assert ended - exiting < 30.0  # not the exit's wait, set to 60 s


@pytest.mark.anyio
async def test_a_stream_its_consumer_let_go_of_is_not_kept() -> None:
    # A consumer that leaves its loop (a client that disconnected) left its stream subscribed,
    # filled with every later event, for the trainer's life.
    trainer = Trainer(make_model(0), ADAM, mse, devices=cpu_devices(2), progress_bar=False)
    streams: list[weakref.ref[asyncddp.EventStream]] = []

    async def first_step_only() -> None:
        stream = trainer.events()
        streams.append(weakref.ref(stream))
        async for event in stream:
            if isinstance(event, asyncddp.StepEnded):
                break

    for epochs in (1, 2):
        async with anyio.create_task_group() as group:
            group.start_soon(first_step_only)
            await trainer.fit(make_batches(0), epochs=epochs)
    async with trainer.events() as closed:  # closed on leaving the block
        pass
    gc.collect()
    assert [ref() for ref in streams] == [None, None]
    assert len(trainer._hub._streams) == 0
    assert closed._ended


@pytest.mark.anyio
async def test_a_consumer_task_nobody_keeps_still_sees_every_event() -> None:
    # asyncio keeps tasks weakly: a consumer task whose create_task result is dropped is held
    # by the stream it waits on alone, which the trainer holds while it waits.
    seen: list[str] = []

    async def watch(stream: asyncddp.EventStream) -> None:
        async for event in stream:
            seen.append(type(event).__name__)

    def collecting_step(model: nn.Module, batch: Any) -> torch.Tensor:
        gc.collect()  # as the collector may run at any time in a long fit
        return mse(model, batch)

    trainer = Trainer(
        make_model(0), ADAM, collecting_step, devices=cpu_devices(1), progress_bar=False
    )
    async with anyio.create_task_group() as group:  # on trio: a nursery holds it anyway
        if sniffio.current_async_library() == "asyncio":
            asyncio.get_running_loop().create_task(watch(trainer.events()))
        else:
            group.start_soon(watch, trainer.events())
        await anyio.lowlevel.checkpoint()
        await trainer.fit(make_batches(0)[:3])
        await anyio.sleep(0.05)
    assert seen == ["FitStarted", *["StepEnded"] * 3, "EpochEnded", "FitEnded"]


WRITER = textwrap.dedent(
    """
    import asyncio, functools, sys, torch, asyncddp
    path = sys.argv[1]
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])  # ~50 MB
    trainer = asyncddp.Trainer(model, functools.partial(torch.optim.SGD, lr=0.1),
                               lambda m, b: m(b).sum(), devices=asyncddp.cpu_devices(1),
                               progress_bar=False)
    async def main():
        while True:
            print("writing", flush=True)
            await trainer.save_checkpoint(path)
    asyncio.run(main())
    """
)


def test_a_process_killed_while_writing_leaves_the_previous_checkpoint_whole(
    tmp_path: Path,
) -> None:
    path = tmp_path / "model.ckpt"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    killed_mid_write = 0
    for attempt in range(3):
        with subprocess.Popen(
            [sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True
        ) as process:
            assert process.stdout is not None
            writes = 0
            while writes < 2 + attempt:  # let it finish a checkpoint, then start another
                line = process.stdout.readline()
                assert line, "the writer died on its own"
                writes += line.startswith("writing")
            if attempt:  # inside the next write: once its temporary file is there
                deadline = time.monotonic() + 10.0
                while time.monotonic() < deadline and not any(
                    p.name.endswith(".tmp") for p in tmp_path.iterdir()
                ):
                    time.sleep(0.001)
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
        killed_mid_write += any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
        state = asyncddp._checkpoint.load(path)  # whole and loadable, whatever was cut short
        assert state["format"] == "asyncddp-checkpoint"
        assert len(state["model"]) == 24
    assert killed_mid_write >= 1, "no kill landed inside a write; the test proved nothing"
    FIGURES["crash"] = (
        f"3 SIGKILLs of a checkpoint writer, {killed_mid_write} inside a write: "
        "the checkpoint on disk whole and loadable every time"
    )


def test_a_truncated_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    path = asyncddp._checkpoint.save({"model": {"w": torch.zeros(1000)}}, tmp_path / "a.ckpt")
    data = path.read_bytes()
    for cut in (0, 10, len(data) // 3, len(data) - 1):
        (tmp_path / "cut.ckpt").write_bytes(data[:cut])
        with pytest.raises(asyncddp.CheckpointError, match="truncated or corrupt"):
            asyncddp._checkpoint.load(tmp_path / "cut.ckpt")


# -- fuzzed batch splitting ------------------------------------------------------------------

leaves = st.sampled_from(
    [
        "tensor",
        "scalar",
        "string",
        "texts",
        "none",
        "mixed",
        "words",
        "numbers",
        "pair",
        "nested",
        "fields",
        "field-lists",
        "crop",
        "nplabels",
        "pairs",
        "sizes",
    ]
)


@st.composite
def batches(draw: Any) -> tuple[Any, int, dict[int, tuple[Any, bool]]]:
    """A batch of ``size`` items, and by the id of each leaf that is a list or tuple, the leaf
    and whether it is a per-item field, which ``split_batch`` splits with the items (told by
    its kind, apart from the rule; every other leaf goes whole to every shard, or is looked
    into)."""
    size = draw(st.integers(0, 40))
    per_item: dict[int, tuple[Any, bool]] = {}

    def leaf(kind: str) -> Any:
        if kind == "tensor":
            width = draw(st.integers(1, 3))
            return torch.arange(size * width, dtype=torch.float32).reshape(size, width)
        value: Any
        if kind == "texts":  # a text field, one string an item, as default_collate makes it
            value = [f"item {i}" for i in range(size)]
        elif kind == "mixed":  # a field some items lack
            value = [None if i % 3 == 0 else f"ref {i}" for i in range(size)]
        elif kind == "words":  # each item's words; item 1 has as many as the batch has items
            value = [[f"w{j}" for j in range(size if i == 1 else i % 3)] for i in range(size)]
        elif kind == "numbers":  # ids of a collate_fn's own: whole, as a (height, width) pair
            value = list(range(size))
        elif kind == "pair":
            value = (224, 224)
        elif kind == "nested":  # a tag and a list as long as the batch: not one entry an item
            value = ["tag", [f"x{i}" for i in range(size)]]
        elif kind == "fields":  # default_collate's of samples holding a pair of texts
            value = [tuple(f"p{i}" for i in range(size)), tuple(f"h{i}" for i in range(size))]
        elif kind == "field-lists":  # the same as lists
            value = [[f"p{i}" for i in range(size)], [f"h{i}" for i in range(size)]]
        elif kind == "pairs":  # each item's own pair, from a collate_fn of one's own
            value = [(f"q{i}", f"a{i}") for i in range(size)]
        elif kind == "sizes":  # each item's (height, width): numbers, never default_collate's
            value = [(i, 2 * i) for i in range(size)]
        elif kind == "crop":  # a setting for the whole batch, numbers and None
            value = (224, None)
        elif kind == "nplabels":  # NumPy's numbers alone, as Python's: whole
            value = [np.int64(i) for i in range(size)]
        else:
            return {"scalar": torch.tensor(3.0), "string": "meta", "none": None}[kind]
        per_item[id(value)] = (
            value,
            bool(size)
            and len(value) == size
            and kind not in ("numbers", "pair", "crop", "nplabels")
            # in a batch of two, read as default_collate's fields: one entry a field
            and not (kind in ("fields", "field-lists", "pairs") and size == 2)
            and not (kind == "mixed" and size == 1),  # [None]: as a crop's None, whole
        )
        return value

    shape = draw(
        st.recursive(
            leaves,
            lambda inner: (
                st.lists(inner, min_size=1, max_size=3)
                | st.dictionaries(st.sampled_from("abc"), inner, min_size=1)
            ),
            max_leaves=6,
        )
    )
    first = [True]

    def build(node: Any) -> Any:
        if isinstance(node, list):
            return tuple(build(child) for child in node)
        if isinstance(node, dict):
            return {key: build(child) for key, child in node.items()}
        if first[0]:
            first[0] = False
            return leaf("tensor")  # at least one tensor with a batch dimension
        return leaf(node)

    return build(shape), size, per_item


def holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (tuple, list)) and any(map(holds_tensor, value))


def one_entry_an_item(value: Any, size: int) -> bool:
    """The documented rule (training.md, Data): a list or tuple as long as the batch that holds
    no tensor, not numbers and None alone, nor lists or tuples each as long as the batch and
    not of numbers alone (fields)."""
    return (
        isinstance(value, (tuple, list))
        and len(value) == size > 0
        and not all(isinstance(entry, (int, float, np.number)) or entry is None for entry in value)
        and not all(
            type(entry) in (list, tuple)
            and len(entry) == size
            and not all(isinstance(e, (int, float, np.number)) or e is None for e in entry)
            for entry in value
        )
        and not holds_tensor(value)
    )


def paired_leaves(batch: Any, shards: list[Any], size: int) -> Iterator[tuple[Any, list[Any]]]:
    """Each leaf of a batch (a per-item field is one) with what each shard holds in its
    place."""
    if isinstance(batch, dict):
        for key in batch:
            yield from paired_leaves(batch[key], [shard[key] for shard in shards], size)
    elif isinstance(batch, (tuple, list)) and not one_entry_an_item(batch, size):
        for index, child in enumerate(batch):
            yield from paired_leaves(child, [shard[index] for shard in shards], size)
    else:
        yield batch, shards


@settings(max_examples=300, deadline=None)
@given(batches(), st.integers(1, 9))
def test_splitting_any_batch_keeps_every_item_once(
    case: tuple[Any, int, dict[int, tuple[Any, bool]]], parts: int
) -> None:
    # A per-item field with a None in it, or holding each item's words, went whole to every
    # device (and a word list as long as the batch was cut across them); a first fix sent
    # default_collate's pair of text fields ([premises, hypotheses]) whole.
    batch, size, per_item = case
    shards = split_batch(batch, parts)
    counts = [items_in(shard) for shard in shards]
    assert sum(counts) == size
    assert max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)  # the larger shards first, as tensor_split
    for value, expected in per_item.values():  # the generator's own account of its leaves
        assert one_entry_an_item(value, size) == expected, value
    for original, pieces in paired_leaves(batch, shards, size):
        if isinstance(original, torch.Tensor) and original.dim() > 0:
            assert torch.equal(torch.cat(pieces), original)
        elif one_entry_an_item(original, size) and parts > 1:  # split with the items
            assert [len(piece) for piece in pieces] == counts
            assert [entry for piece in pieces for entry in piece] == list(original)
        elif parts > 1:
            assert all(piece is original for piece in pieces)  # handed to every shard as is


# -- misuse across the public API: each one a clear error, before any work -------------------

MODEL = functools.partial(make_model, 0)


def _trainer(**kwargs: Any) -> Trainer:
    return Trainer(MODEL(), ADAM, mse, devices=cpu_devices(1), progress_bar=False, **kwargs)


MISUSES: list[tuple[str, Any, type[BaseException], str]] = [
    ("no devices", lambda: asyncddp.resolve_devices([]), asyncddp.DeviceError, "no devices"),
    (
        "a device twice",
        lambda: asyncddp.resolve_devices(["cpu#0", "cpu#0"]),
        asyncddp.DeviceError,
        "given twice",
    ),
    (
        "an unknown device",
        lambda: asyncddp.resolve_devices("tpu"),
        asyncddp.DeviceError,
        "unknown device",
    ),
    (
        "a device of the wrong type",
        lambda: asyncddp.resolve_devices(1.5),
        asyncddp.DeviceTypeError,
        "cannot read",
    ),
    ("cpu_devices(0)", lambda: cpu_devices(0), asyncddp.DeviceError, "n >= 1"),
    (
        "step_timeout=0",
        lambda: asyncddp.StepScheduler(cpu_devices(1), step_timeout=0),
        ValueError,
        "step_timeout",
    ),
    (
        "threads_per_worker=0",
        lambda: asyncddp.StepScheduler(cpu_devices(1), threads_per_worker=0),
        ValueError,
        "threads_per_worker",
    ),
    (
        "a model with nothing to train",
        lambda: Trainer(nn.Linear(2, 2).requires_grad_(False), ADAM, mse),
        asyncddp.ConfigurationError,
        "no trainable parameters",
    ),
    (
        "an optimizer instead of a factory",
        lambda: Trainer(MODEL(), torch.optim.SGD(MODEL().parameters(), lr=1), mse),
        asyncddp.ConfigurationError,
        "factory",
    ),
    (
        "a step that is not callable",
        lambda: Trainer(MODEL(), ADAM, "step"),
        asyncddp.ConfigurationError,
        "step must be a function",
    ),
    (
        "accumulate_grad_batches=0",
        lambda: _trainer(accumulate_grad_batches=0),
        asyncddp.ConfigurationError,
        "accumulate_grad_batches",
    ),
    (
        "gradient_clip_val=0",
        lambda: _trainer(gradient_clip_val=0),
        asyncddp.ConfigurationError,
        "gradient_clip_val",
    ),
    (
        "an unknown precision",
        lambda: _trainer(precision="fp8"),
        asyncddp.ConfigurationError,
        "unknown precision",
    ),
    (
        "an unknown failure policy",
        lambda: _trainer(on_failure="ignore"),
        asyncddp.ConfigurationError,
        "on_failure",
    ),
    (
        "an unknown LR interval",
        lambda: _trainer(lr_scheduler_interval="batch"),
        asyncddp.ConfigurationError,
        "lr_scheduler_interval",
    ),
    (
        "events(maxlen=0)",
        lambda: _trainer().events(maxlen=0),
        asyncddp.ConfigurationError,
        "maxlen",
    ),
    (
        "a negative item count",
        lambda: asyncddp.ProgressTracker(2).update([1, -1]),
        ValueError,
        "negative",
    ),
]


@pytest.mark.parametrize(
    ("misuse", "call", "error", "message"), MISUSES, ids=[m[0] for m in MISUSES]
)
def test_misuse_is_a_clear_error(
    misuse: str, call: Any, error: type[BaseException], message: str
) -> None:
    with pytest.raises(error, match=message):
        call()


ASYNC_MISUSES: list[tuple[str, Any, type[BaseException], str]] = [
    ("fit(epochs=0)", lambda t: t.fit([], epochs=0), asyncddp.ConfigurationError, "epochs"),
    ("data with no batches", lambda t: t.fit([], epochs=1), asyncddp.DataError, "no batches"),
    (
        "a batch with no tensor",
        lambda t: t.fit([["a", "b"]], epochs=1),
        asyncddp.DataError,
        "at least one tensor",
    ),
    ("validation data with no items", lambda t: t.validate([]), asyncddp.DataError, "no items"),
    (
        "resume='latest' without a checkpoint_dir",
        lambda t: t.fit([], epochs=1, resume="latest"),
        asyncddp.ConfigurationError,
        "checkpoint_dir",
    ),
    (
        "resume from a missing file",
        lambda t: t.fit([], epochs=1, resume="/no/such.ckpt"),
        asyncddp.CheckpointError,
        "no checkpoint",
    ),
    (
        "a step that returns no loss",
        lambda t: Trainer(
            MODEL(), ADAM, lambda m, b: None, devices=cpu_devices(1), progress_bar=False
        ).fit(make_batches(0), epochs=1),
        asyncddp.StepOutputError,
        "returned None",
    ),
]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("misuse", "call", "error", "message"), ASYNC_MISUSES, ids=[m[0] for m in ASYNC_MISUSES]
)
async def test_async_misuse_is_a_clear_error(
    misuse: str, call: Any, error: type[BaseException], message: str
) -> None:
    trainer = _trainer()
    with pytest.raises(error, match=message):
        await call(trainer)
    assert trainer.global_step == 0


def _held_trainer(release: threading.Event) -> Trainer:
    """A trainer whose steps wait for ``release``: its fit is surely running meanwhile."""

    def held(model: nn.Module, batch: Any) -> torch.Tensor:
        release.wait(10)
        return mse(model, batch)

    return Trainer(MODEL(), ADAM, held, devices=cpu_devices(1), progress_bar=False)


@pytest.mark.anyio
async def test_an_optimizer_factory_that_returns_no_optimizer_is_a_clear_error() -> None:
    trainer = Trainer(MODEL(), lambda params: None, mse, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(asyncddp.ConfigurationError, match="returned NoneType"):
        await trainer.fit(make_batches(0), epochs=1)


@pytest.mark.anyio
async def test_an_optimizer_factory_that_raises_is_a_mistake_in_the_arguments() -> None:
    # A common slip: the step function and the optimizer swapped. An optimizer factory given
    # as the step is refused as the Trainer is built (it failed at the first fit); a step
    # given as the factory raises as the fit builds the optimizers, the factory's error kept
    # as the cause, the message naming the argument, not a device fault.
    with pytest.raises(
        asyncddp.ConfigurationError,
        match=r"step is functools.partial\(Adam, ...\), an optimizer factory; the arguments go "
        r"Trainer\(model, optimizer, step\)",
    ):
        Trainer(MODEL(), mse, ADAM, devices=cpu_devices(2), progress_bar=False)  # type: ignore[arg-type]
    trainer = Trainer(MODEL(), mse, mse, devices=cpu_devices(2), progress_bar=False)  # type: ignore[arg-type]
    with pytest.raises(asyncddp.ConfigurationError) as caught:
        await trainer.fit(make_batches(0), epochs=1)
    assert re.search(
        r"optimizer factory raised TypeError: .*Trainer\(model, optimizer, step\)",
        str(caught.value),
    )
    assert isinstance(caught.value.__cause__, TypeError)
    # A factory's own TypeError (a misspelt option) gets no such hint.
    misspelt = functools.partial(torch.optim.SGD, learning_rate=0.1)
    trainer = Trainer(MODEL(), misspelt, mse, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(asyncddp.ConfigurationError, match="learning_rate") as caught:
        await trainer.fit(make_batches(0), epochs=1)
    assert "comes third" not in str(caught.value)


@pytest.mark.anyio
async def test_an_lr_scheduler_factory_that_raises_is_a_mistake_in_the_arguments() -> None:
    def scheduler(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(optimizer)  # type: ignore[call-arg]

    trainer = Trainer(
        MODEL(), ADAM, mse, lr_scheduler=scheduler, devices=cpu_devices(2), progress_bar=False
    )
    with pytest.raises(
        asyncddp.ConfigurationError, match="lr_scheduler factory raised TypeError"
    ) as caught:
        await trainer.fit(make_batches(0), epochs=1)
    assert isinstance(caught.value.__cause__, TypeError)


@pytest.mark.anyio
async def test_torchs_own_argument_checks_in_a_factory_are_mistakes_in_the_arguments() -> None:
    # torch checks some optimizer options with a RuntimeError: still the arguments' fault.
    adam = functools.partial(torch.optim.Adam, fused=True, foreach=True)
    trainer = Trainer(MODEL(), adam, mse, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(asyncddp.ConfigurationError, match="optimizer factory raised RuntimeError"):
        await trainer.fit(make_batches(0), epochs=1)


@pytest.mark.anyio
async def test_a_device_fault_in_the_optimizer_factory_stays_a_device_fault() -> None:
    # Some optimizers allocate on the device as they are made: running out of memory there is
    # the device's failure, named as such, not a mistake in the arguments.
    def factory(params: Any) -> torch.optim.Optimizer:
        raise torch.OutOfMemoryError("out of memory making the optimizer's state")

    trainer = Trainer(MODEL(), factory, mse, devices=cpu_devices(2), progress_bar=False)
    with pytest.raises(asyncddp.WorkerFailedError, match="out of memory") as caught:
        await trainer.fit(make_batches(0), epochs=1)
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert caught.value.phase == "setup"


@pytest.mark.anyio
async def test_a_refused_second_fit_leaves_the_running_fits_events_alone() -> None:
    release = threading.Event()
    trainer = _held_trainer(release)
    stream = trainer.events()
    seen: list[str] = []

    async def watch() -> None:
        async for event in stream:
            seen.append(type(event).__name__)

    async with anyio.create_task_group() as group:
        group.start_soon(watch)
        group.start_soon(lambda: trainer.fit(make_batches(0), epochs=1))  # type: ignore[arg-type,return-value]
        await anyio.sleep(0.05)
        try:
            with pytest.raises(asyncddp.ConfigurationError, match="already running"):
                await trainer.fit(make_batches(0), epochs=1)
        finally:
            release.set()
    assert seen.count("FitEnded") == 1
    assert seen[-1] == "FitEnded"


@pytest.mark.anyio
async def test_fit_with_bad_epochs_still_ends_event_streams() -> None:
    trainer = _trainer()
    stream = trainer.events()
    with pytest.raises(asyncddp.ConfigurationError, match="epochs"):
        await trainer.fit(make_batches(0), epochs=0)
    assert [type(event).__name__ async for event in stream] == ["FitEnded"]


@pytest.mark.parametrize("interrupts", [2, 3])
def test_quick_ctrl_cs_under_trio_during_a_hung_step_end_the_program(interrupts: int) -> None:
    # Each of trio's waits held its own first KeyboardInterrupt: the second Ctrl-C was held
    # by the drain of the step the first had interrupted, the third raised out of it before
    # the hung job was given up on, and the step's undo then waited for that job for ever.
    script = textwrap.dedent(
        f"""
        import functools, os, signal, sys, threading, time
        import torch, trio, asyncddp
        from asyncddp.testing import hanging_step

        hangs = threading.Event()

        def ctrl_c():
            hangs.wait(120)
            time.sleep(0.2)  # into the hang
            print("first Ctrl-C at", time.time(), file=sys.stderr, flush=True)
            for _ in range({interrupts}):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)

        async def main():
            hanging = hanging_step(
                lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                device=1, release=threading.Event(), at=2, limit=None,
            )

            def step(model, batch):
                ctx = asyncddp.current_worker()
                if (ctx.device.index, ctx.step) == (1, 2):
                    hangs.set()
                return hanging(model, batch)

            trainer = asyncddp.Trainer(
                torch.nn.Linear(4, 1), functools.partial(torch.optim.SGD, lr=0.1), step,
                devices=asyncddp.cpu_devices(2), progress_bar=False,
            )
            threading.Thread(target=ctrl_c, daemon=True).start()
            await trainer.fit([(torch.randn(8, 4), torch.randn(8, 1))] * 8, epochs=5)

        trio.run(main)
        """
    )
    done = run_script(script, "-W", "ignore", timeout=150)
    ended = time.time()
    assert "KeyboardInterrupt" in done.stderr
    assert done.returncode != 0
    first = float(re.search(r"first Ctrl-C at (\S+)", done.stderr)[1])  # type: ignore[index]
    # The second raises out of the step's drain (at 0.5 s; it waited 2 x drain_timeout,
    # ending at 20 s), then closing the workers waits its drain_timeout (10 s) for the hung
    # one; a third ends that wait too (at 1 s; it never ended).
    assert ended - first < (17 if interrupts == 2 else 8)


def test_ctrl_c_out_of_run_until_complete_mid_step_exits_without_an_abort() -> None:
    # loop.run_until_complete (IPython's terminal autoawait drives fits so) lets a Ctrl-C out
    # at once, leaving the fit's task pending and both workers inside a step's torch ops:
    # the interpreter finalized under them and aborted, exit status 134, in 3 runs of 3.
    script = textwrap.dedent(
        """
        import asyncio, functools, os, signal, threading, time, torch, asyncddp

        def ctrl_c():
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGINT)

        async def main():
            x = torch.randn(2048, 512)
            data = [(x[i:i + 1024], x[i:i + 1024, :1]) for i in range(0, 2048, 1024)]
            model = torch.nn.Sequential(
                torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)
            )
            trainer = asyncddp.Trainer(
                model, functools.partial(torch.optim.SGD, lr=1e-3),
                lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                devices=asyncddp.cpu_devices(2), progress_bar=False,
            )
            await trainer.fit(data, epochs=1)  # the workers started
            threading.Thread(target=ctrl_c, daemon=True).start()
            await trainer.fit(data, epochs=10_000)

        asyncio.new_event_loop().run_until_complete(main())
        """
    )
    done = run_script(script, "-W", "ignore")
    assert "KeyboardInterrupt" in done.stderr
    assert "terminate called" not in done.stderr
    assert done.returncode != -signal.SIGABRT, done.stderr


def test_the_exit_waits_for_a_worker_at_its_steps_meeting_while_another_works() -> None:
    # A Ctrl-C out of run_until_complete left one worker at the meeting of a step's devices:
    # skipped as "in a lock", it was released by the other's arrival as the interpreter
    # finalized, and the process aborted (4 runs of 37 in an operations trial). It is waited
    # for while another device works, or once released; not where every other device waits
    # in a lock (a hung step), nothing then to release it.
    import queue
    import threading
    import types

    from asyncddp import _exit
    from asyncddp._jobs import Meeting

    def device(index: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(stream=None, device=types.SimpleNamespace(index=index))

    meeting, feed, done = Meeting(2), queue.Queue[None](), []

    def work() -> None:  # computing, as a device still in its step's ops
        while not done:
            sum(range(10_000))

    at_meeting = threading.Thread(target=meeting.share, args=(device(0), 1.0), daemon=True)
    in_a_queue = threading.Thread(target=feed.get, daemon=True)
    at_work = threading.Thread(target=work)
    for thread in (at_meeting, in_a_queue, at_work):
        thread.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
            _exit._in_a_lock(in_a_queue) and _exit._at_meeting(at_meeting) is False
        ):
            time.sleep(0.01)
        busy = lambda: True  # noqa: E731  # in a job, as the workers' checks say
        assert _exit._busy({at_meeting: busy, in_a_queue: None, at_work: busy}) == [
            at_meeting,
            at_work,
        ]
        assert _exit._busy({at_meeting: busy, in_a_queue: None}) == []  # a hung step
        with meeting._ready:  # released, not yet woken: it runs on into the step
            meeting._round += 1
        assert _exit._busy({at_meeting: busy, in_a_queue: None}) == [at_meeting]
        with meeting._ready:
            meeting._round -= 1
    finally:
        done.append(True)
        meeting.share(device(1), 2.0)  # the other device arrives
        feed.put(None)
        for thread in (at_meeting, in_a_queue, at_work):
            thread.join(10)
