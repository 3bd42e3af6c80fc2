"""A training service: several training jobs at once, inside one FastAPI event loop.

Run:  pip install -e ".[service]"
      uvicorn app:app --app-dir examples/service --timeout-graceful-shutdown 5
      (or: python examples/service/app.py)

    POST   /jobs               {"epochs": 5, "devices": 2}  start a job    -> {"id": "...", ...}
    GET    /jobs                                           list the jobs
    GET    /jobs/{id}                                      one job
    GET    /jobs/{id}/events                               its events, as server-sent events,
                                                           from the start until the job ends
    DELETE /jobs/{id}                                      cancel it
    GET    /health                                         answers at once, while jobs train

Each job is an asyncio task awaiting ``trainer.fit()`` on CPU workers of its own; the event loop
only dispatches, so the service keeps answering while the jobs train.

On shutdown uvicorn waits for open connections before the lifespan cancels the jobs, and an
event stream stays open until its job ends: ``--timeout-graceful-shutdown`` bounds that wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
from collections.abc import AsyncIterable, AsyncIterator
from typing import Annotated, Any

import torch
import torch.nn.functional as F
from fastapi import Depends, FastAPI, HTTPException
from fastapi.sse import EventSourceResponse, ServerSentEvent
from pydantic import BaseModel, Field, model_validator

import asyncddp


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    # The first optimizer a process builds makes torch import torch._dynamo: about a second
    # in which torch holds the GIL for up to ~130 ms at a time, stalling every thread, the event
    # loop included. Pay that once here, before the service answers anyone.
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())
    yield
    for job in JOBS.values():  # shutting down: cancel what still trains, join its workers
        if job.task is not None and not job.task.done():
            job.task.cancel()
    await asyncio.gather(*(job.task for job in JOBS.values() if job.task), return_exceptions=True)


app = FastAPI(title="asyncddp training service", lifespan=lifespan)


class JobRequest(BaseModel):
    epochs: int = Field(default=3, ge=1, le=1000)
    devices: int = Field(default=2, ge=1, le=8, description="CPU workers for this job")
    batches: int = Field(default=20, ge=1, le=10_000, description="batches per epoch")
    batch_size: int = Field(default=64, ge=1, le=4096)

    @model_validator(mode="after")
    def bounded(self) -> JobRequest:
        # A job's log keeps every event (about 2 KB a step) for its streams to replay.
        if self.epochs * self.batches > MAX_STEPS:
            raise ValueError(f"epochs * batches is at most {MAX_STEPS:,} steps a job")
        return self


class Job:
    """One training job: its task, and the log of its events that streams replay."""

    _ids = itertools.count(1)

    def __init__(self, request: JobRequest) -> None:
        self.id = f"job-{next(self._ids)}"
        self.request = request
        self.status = "running"
        self.error: str | None = None
        self.log: list[dict[str, Any]] = []
        self.steps = 0
        self.last_loss: float | None = None
        self._changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def record(self, event: asyncddp.Event) -> None:
        self.log.append({"type": type(event).__name__, **dataclasses.asdict(event)})
        if isinstance(event, asyncddp.StepEnded):
            self.steps, self.last_loss = self.steps + 1, event.loss
        self._changed.set()

    def end_unstarted(self) -> None:
        """A task cancelled before it first ran (a DELETE right after the POST, the server's
        shutdown) never reached train()'s own ending: the job ends here, or it would be
        "running" for ever, and its event streams open."""
        if self.status == "running":
            self.status = "cancelled"
            self._changed.set()

    async def changed(self) -> None:
        await self._changed.wait()
        self._changed.clear()

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status,
            "error": self.error,
            "request": self.request.model_dump(),
            "steps": self.steps,
            "last_loss": self.last_loss,
        }


JOBS: dict[str, Job] = {}  # in the order they started
MAX_STEPS = 20_000
KEEP_ENDED = 100  # jobs that ended, kept for GET /jobs and their streams; older ones are dropped


def make_batches(count: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic data: 3 classes told apart by the sign pattern of 16 features."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(count * size, 16, generator=generator)
    targets = (inputs[:, 0] > 0).long() + (inputs[:, 1] > 0).long()
    return list(zip(torch.split(inputs, size), torch.split(targets, size), strict=True))


def step(
    model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> dict[str, torch.Tensor]:
    inputs, targets = batch
    logits = model(inputs)
    return {
        "loss": F.cross_entropy(logits, targets),
        "accuracy": (logits.argmax(1) == targets).float().mean(),
    }


async def train(job: Job) -> None:
    request = job.request
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    trainer = asyncddp.Trainer(
        model,
        functools.partial(torch.optim.AdamW, lr=1e-2),
        step,
        devices=asyncddp.cpu_devices(request.devices),
        progress_bar=False,
    )
    stream = trainer.events(maxlen=100_000)

    async def pump() -> None:  # a task of its own, so that it outlives a cancelled fit
        async for event in stream:
            job.record(event)

    pumping = asyncio.create_task(pump())
    status, message = "failed", None  # unless the fit returns, is cancelled, or says why
    try:
        await trainer.fit(
            make_batches(request.batches, request.batch_size, seed=0), epochs=request.epochs
        )
        status = "done"
    except asyncio.CancelledError:
        status = "cancelled"
        raise
    except Exception as error:  # reported to clients, not raised into the server
        message = f"{type(error).__name__}: {error}"
    finally:
        try:
            await asyncio.shield(pumping)  # FitEnded was published: the pump ends by itself
        finally:
            # Only now, with every event in the log (or a second cancellation): a stream that
            # sees the job ended has them all.
            job.status, job.error = status, message
            job._changed.set()


@app.post("/jobs", status_code=201)
async def start_job(request: JobRequest) -> dict[str, Any]:
    ended = [job_id for job_id, job in JOBS.items() if job.status != "running"]
    for job_id in ended[: max(len(ended) - KEEP_ENDED + 1, 0)]:
        del JOBS[job_id]
    job = Job(request)
    JOBS[job.id] = job
    job.task = asyncio.create_task(train(job), name=job.id)
    job.task.add_done_callback(lambda _: job.end_unstarted())
    return job.summary()


@app.get("/jobs")
async def list_jobs() -> list[dict[str, Any]]:
    return [job.summary() for job in JOBS.values()]


def find(job_id: str) -> Job:
    try:
        return JOBS[job_id]
    except KeyError:
        raise HTTPException(status_code=404, detail=f"no job {job_id!r}") from None


@app.get("/jobs/{job_id}")
async def get_job(job_id: str) -> dict[str, Any]:
    return find(job_id).summary()


@app.delete("/jobs/{job_id}")
async def cancel_job(job_id: str) -> dict[str, Any]:
    job = find(job_id)
    if job.task is not None and not job.task.done():
        job.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await job.task  # fit stops at once; its workers are joined before this returns
    return job.summary()


@app.get("/jobs/{job_id}/events", response_class=EventSourceResponse)
async def job_events(job: Annotated[Job, Depends(find)]) -> AsyncIterable[ServerSentEvent]:
    # The job is looked up as a dependency, before the stream starts: an unknown id is a 404,
    # not a stream that breaks off once its 200 is sent.
    sent = 0
    while True:
        while sent < len(job.log):
            event = job.log[sent]
            yield ServerSentEvent(data=event, event=event["type"], id=str(sent))
            sent += 1
        if job.status != "running" and sent == len(job.log):
            return
        await job.changed()


@app.get("/health")
async def health() -> dict[str, Any]:
    return {"ok": True, "jobs_running": sum(job.status == "running" for job in JOBS.values())}


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=8000, timeout_graceful_shutdown=5)
