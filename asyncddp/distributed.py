"""Training across processes and machines on ``torch.distributed``, launched with ``torchrun``.

Call `init` once per process, then use the same `Trainer` as on one
machine: it sees the process group and trains across every device of every rank::

    # torchrun --nproc-per-node 2 train.py
    import asyncddp.distributed

    world = asyncddp.distributed.init()  # NCCL with a GPU per process, else gloo
    trainer = asyncddp.Trainer(model, optimizer, step)  # devices="auto": cuda:LOCAL_RANK or CPU
    await trainer.fit(loader, epochs=5)  # the same loader on every rank: each trains on its part

What the trainer does across ranks:

- **Data.** Every rank gets the same data; rank ``r`` of ``W`` trains on batches ``r``,
  ``r + W``, ``r + 2W``, ... (a ``DataLoader``'s skipped batches are never loaded; a shuffling
  one draws the same order on every rank). No batch is repeated or dropped: a rank out of data
  joins the remaining steps with none, so uneven counts never hang. Validation metrics are
  exact over the whole set.
- **Gradients.** Reduced among the process's devices first, then across ranks, one all-reduce
  per bucket of at most 25 MB, weighted by items over every device of every rank: the step is
  the one a single device would take on all the ranks' batches together.
- **Failures.** A rank that raises tells the others in the next exchange; every rank raises
  `WorkerFailedError` naming the failed rank and device, within a collective's
  latency. A rank that dies breaks the collective; the others name it within seconds.
- **stop() and checkpoints.** ``stop()`` on any rank stops every rank after the same step. Rank
  0 writes the checkpoints; ``resume=`` reads them on rank 0 and sends the state to every rank.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _devices
from ._checks import check_positive, warn_user
from ._exceptions import ConfigurationError

__all__ = ["World", "destroy", "init", "is_initialized", "world"]

_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class World:
    """Where this process stands in the process group.

    Attributes:
        rank: This process's rank, ``0 <= rank < world_size``.
        world_size: How many processes train together.
        local_rank: This process's rank on its machine (``torchrun``'s ``LOCAL_RANK``).
        local_world_size: How many processes train on this machine.
        backend: ``"gloo"`` or ``"nccl"``.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the one that writes checkpoints and logs."""
        return self.rank == 0


#: The longest ``init(timeout=...)``, in seconds: torch's store takes it in milliseconds, as a
#: C int (``1e15`` overflowed there).
_LONGEST_TIMEOUT = 2e6


def init(backend: str | None = None, *, timeout: float | None = None) -> World:
    """Join the process group described by the ``torchrun`` environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by
    ``torchrun``, or by hand). Calling it again returns the group already joined (with a
    warning if it asks for another ``backend``).

    Args:
        backend: ``"gloo"`` or ``"nccl"``; by default NCCL when every process of this machine
            has a GPU of its own (``LOCAL_WORLD_SIZE`` GPUs or more), else gloo, with which
            processes may share a GPU. Across machines the default is NCCL wherever a GPU is
            visible (every machine must agree): give ``"gloo"`` on every machine to train on
            CPUs or on shared GPUs. With NCCL the process's current GPU becomes
            ``cuda:LOCAL_RANK``, or, where ``CUDA_VISIBLE_DEVICES`` shows each process fewer
            GPUs than its machine has processes (a launcher that gives each its own, as
            SLURM's ``--gpus-per-task``), ``LOCAL_RANK`` modulo the visible count: on one
            machine NCCL is then taken only when asked for. With NCCL the processes compare
            their GPUs before any collective, and all refuse to go on if two share one.
        timeout: Seconds a collective may wait for the other ranks before it fails (torch's
            default when ``None``: 10 minutes for NCCL, 30 for gloo), from 0.001 to 2e6 (23
            days: torch counts it in milliseconds, as a C int). Failures of a rank are
            reported much sooner: see the module's description.

    Raises:
        ConfigurationError: ``timeout`` is not a number of seconds from 0.001 to 2e6; the
            environment variables are missing (not launched by
            ``torchrun``) or do not describe a process group (``RANK`` not below
            ``WORLD_SIZE``, a value that is not a number), ``backend`` is unknown, or NCCL
            is asked for and this process has no GPU of its own (fewer GPUs than processes
            on its machine and no ``CUDA_VISIBLE_DEVICES``, or another process has the same
            GPU).
    """
    if timeout is not None:
        timeout = check_positive("timeout", timeout, unit="seconds", none=False)
        if not 0.001 <= timeout <= _LONGEST_TIMEOUT:  # torch counts it in whole milliseconds
            raise ConfigurationError(
                f"timeout must be from 0.001 to {_LONGEST_TIMEOUT:.0e} seconds (None for "
                f"torch's default: 10 minutes for NCCL, 30 for gloo), got {timeout!r}"
            )
    if dist.is_initialized():
        joined = str(dist.get_backend())  # "gloo", or a device's own, "cpu:gloo,cuda:nccl"
        parts = {part.rpartition(":")[2] for part in joined.split(",")}
        if backend is not None and _backend_name(backend) not in parts:
            warn_user(
                f"asyncddp.distributed.init(backend={backend!r}): this process has joined a "
                f"process group over {joined} already, which is returned as it is. To join "
                "anew over another backend, call asyncddp.distributed.destroy() first"
            )
        return _current()
    missing = [name for name in _REQUIRED if name not in os.environ]
    if missing:
        raise ConfigurationError(
            f"asyncddp.distributed.init() needs the torchrun environment; {', '.join(missing)} "
            "not set. Launch with `torchrun --nproc-per-node 2 your_script.py`, or set RANK, "
            "WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself"
        )
    _check_environment()
    global _joins
    backend = _backend(backend)
    if backend == "nccl":
        torch.cuda.set_device(_local_gpu())
    dist.init_process_group(
        backend,
        init_method="env://",
        timeout=None if timeout is None else datetime.timedelta(seconds=timeout),
    )
    _joins += 1
    if backend == "nccl":
        try:
            # torchrun's store outlives a restart of the workers: keys of this run only.
            run = _run_id()
            _refuse_shared_gpus(
                dist.distributed_c10d._get_default_store(),
                dist.get_rank(),
                dist.get_world_size(),
                _gpu_id(_local_gpu()),
                prefix=f"asyncddp/gpus/{run}/{_joins}/",
            )
        except BaseException:
            dist.destroy_process_group()
            raise
    return _current()


_joins = 0  # process groups joined by this process: a fresh key prefix for each
_RUN = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def _run_id() -> str:
    """This run of torchrun's workers, for keys in its store: torchrun's store outlives a
    restart of the workers (empty parts where not launched by torchrun)."""
    return "/".join(os.environ.get(name, "") for name in _RUN)


def _gpu_id(index: int) -> str:
    """What tells this GPU from every other: its UUID (its PCI address on this host where
    torch gives no UUID)."""
    properties = torch.cuda.get_device_properties(index)
    uuid = getattr(properties, "uuid", None)
    if uuid is not None:
        return str(uuid)
    bus = ":".join(
        str(getattr(properties, name, "?"))
        for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")
    )
    return f"{socket.gethostname()}/{bus}"


def _refuse_shared_gpus(store: Any, rank: int, size: int, gpu: str, *, prefix: str) -> None:
    """Raise `ConfigurationError` on every rank if two ranks have the same GPU.

    NCCL refuses them only at the first collective ("Duplicate GPU detected"), which the
    other ranks would meet as a rank lost. This is checked through the process group's store,
    before any NCCL communicator exists: each rank counts itself under its GPU, and once every
    rank has, the ranks that share one say so.
    """
    store.add(prefix + "gpu/" + gpu, 1)
    _store_barrier(store, prefix + "counted", size)
    shared_here = store.add(prefix + "gpu/" + gpu, 0) > 1
    if shared_here:
        store.add(prefix + "sharing", 1)
    _store_barrier(store, prefix + "checked", size)
    sharing = store.add(prefix + "sharing", 0)
    if sharing:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigurationError(
            f"{sharing} of the {size} processes share a GPU with another (rank {rank}: GPU "
            f"{gpu}, {'shared' if shared_here else 'its own'}; CUDA_VISIBLE_DEVICES="
            f"{visible!r}), and NCCL needs a GPU of its own for each process; give each "
            "process its own GPUs, or join with asyncddp.distributed.init('gloo') on every "
            "machine"
        )


def _store_barrier(store: Any, key: str, size: int) -> None:
    """Wait until ``size`` ranks have come here (through ``store``, no collective)."""
    if store.add(key, 1) == size:
        store.set(key + "/all", "1")
    store.wait([key + "/all"])


def _check_environment() -> None:
    """Refuse a torchrun environment that cannot describe a process group, before joining:
    with a rank outside the group, say, the process would wait for the others until the
    store's timeout (30 minutes by default) instead."""
    values: dict[str, int] = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        text = os.environ.get(name)
        if text is None:
            continue
        try:
            values[name] = int(text)
        except ValueError:
            raise ConfigurationError(
                f"{name} must be a whole number, got {text!r}; torchrun sets it for each "
                "process it starts"
            ) from None
    rank, size = values["RANK"], values["WORLD_SIZE"]
    problems = []
    if size < 1:
        problems.append(f"WORLD_SIZE must be at least 1, got {size}")
    elif not 0 <= rank < size:
        problems.append(
            f"RANK must be from 0 to WORLD_SIZE - 1 ({size - 1}), got {rank}: give each of "
            f"the {size} process(es) a different RANK in that range"
        )
    local_size = values.get("LOCAL_WORLD_SIZE")
    if local_size is not None and not 1 <= local_size <= max(size, 1):
        problems.append(f"LOCAL_WORLD_SIZE must be from 1 to WORLD_SIZE ({size}), got {local_size}")
    local_rank = values.get("LOCAL_RANK")
    if local_rank is not None and not 0 <= local_rank < (local_size or max(size, 1)):
        of = "LOCAL_WORLD_SIZE" if local_size is not None else "WORLD_SIZE"
        problems.append(f"LOCAL_RANK must be from 0 to {of} - 1, got {local_rank}")
    port = values["MASTER_PORT"]
    if not 1 <= port <= 65535:
        problems.append(f"MASTER_PORT must be a port number from 1 to 65535, got {port}")
    if not os.environ["MASTER_ADDR"].strip():
        problems.append("MASTER_ADDR is empty: give rank 0's host name or address")
    if problems:
        raise ConfigurationError(
            "the torchrun environment does not describe a process group: "
            + "; ".join(problems)
            + ". torchrun sets these variables for each process it starts; set by hand, they"
            " must agree"
        )


def _local_rank() -> int:
    """This process's rank on its machine: ``LOCAL_RANK``, else ``RANK`` (one machine)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def _local_gpu() -> int:
    """This process's GPU: ``LOCAL_RANK`` among the visible ones, modulo their count (where
    ``CUDA_VISIBLE_DEVICES`` shows each process only its own GPUs, one of those)."""
    return _local_rank() % max(_devices._cuda_device_count(), 1)


def _backend(asked: str | None) -> str:
    """The backend to join with: ``asked``, checked, or the default for this machine."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    gpus = _devices._cuda_device_count()
    needed = max(local_size, _local_rank() + 1)
    # CUDA_VISIBLE_DEVICES may show each process GPUs of its own (SLURM's --gpus-per-task,
    # say), or the same ones to all: this process cannot tell which, so fewer GPUs than
    # processes is no reason to refuse NCCL then (init() refuses ranks that share a GPU, once
    # they have compared their GPUs: _refuse_shared_gpus).
    own_gpus = gpus > 0 and bool(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if asked is None:
        if gpus == 0 or not dist.is_nccl_available():
            return "gloo"
        if gpus < needed and size == local_size:
            # One machine, fewer GPUs than processes (NCCL refuses two ranks on one GPU):
            # gloo, the processes sharing the GPUs and reducing through the CPU.
            return "gloo"
        # NCCL; across machines wherever there are GPUs, since a machine that took gloo on
        # its own would leave the others waiting at the first collective: one with too few
        # GPUs is refused below, on every process of it.
        asked = "nccl"
    asked = _backend_name(asked)
    if asked == "nccl" and gpus == 0:
        raise ConfigurationError(
            "NCCL needs a GPU for each process, and no GPU is visible here: join with "
            "asyncddp.distributed.init('gloo') on every machine, or run where GPUs are"
        )
    if asked == "nccl" and gpus < needed and not own_gpus:
        raise ConfigurationError(
            f"NCCL needs a GPU for each process, but {local_size} process(es) share this "
            f"machine (LOCAL_RANK {_local_rank()}) and {gpus} GPU(s) {'is' if gpus == 1 else 'are'}"
            f" visible; start at most {gpus} process(es) per machine, or join with "
            "asyncddp.distributed.init('gloo') on every machine (or give each process GPUs of "
            "its own with CUDA_VISIBLE_DEVICES)"
        )
    return asked


def _backend_name(asked: object) -> str:
    """``asked`` as torch takes a backend's name (``"GLOO"``: ``"gloo"``), or refused."""
    if isinstance(asked, str) and asked.lower() in ("gloo", "nccl"):
        return asked.lower()
    raise ConfigurationError(f"backend must be 'gloo' or 'nccl', got {asked!r}")


def is_initialized() -> bool:
    """Whether this process has joined a process group."""
    return dist.is_available() and dist.is_initialized()


def world() -> World | None:
    """This process's place in the process group, or ``None`` outside one."""
    return _current() if is_initialized() else None


def destroy() -> None:
    """Leave the process group (at the end of the script); nothing if none was joined."""
    if is_initialized():
        dist.destroy_process_group()


def _current() -> World:
    rank, size = dist.get_rank(), dist.get_world_size()
    return World(
        rank=rank,
        world_size=size,
        local_rank=_local_rank(),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", size)),
        backend=str(dist.get_backend()),
    )
