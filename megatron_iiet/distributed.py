"""Process groups, seeds and teardown, from torchrun/SLURM environments or spawned locally.

``initialize`` is what every entry point calls. ``spawn_local`` runs a function on N fresh local
processes with gloo (tests and CPU benchmarks): fresh processes, because a gloo group forked
inside a big parent (pytest) can deadlock, and a short group timeout so a stuck rank fails in
seconds rather than half an hour.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_iiet.platform import cuda_available, install_cpu_compat


def _env_int(*names: str, default: int) -> int:
    for n in names:
        if n in os.environ:
            return int(os.environ[n])
    return default


def barrier() -> None:
    """A barrier over all ranks, or nothing in a single process without a group."""
    if dist.is_initialized():
        dist.barrier()


def on_rank0(fn: Callable[[], Any],
             explain: Callable[[BaseException], BaseException] = lambda err: err) -> Any:
    """Run ``fn`` on rank 0 alone and hand its result to every rank; when it fails, every rank
    raises, so none waits forever.

    ``explain(err)`` turns rank 0's exception into the one to raise (an operator's one-line
    error, or ``err`` itself); the other ranks raise ReportedByRank0 with the same text when it
    is an operator error, else a RuntimeError naming rank 0's failure (a bug, like a plain
    ValueError: rank 0 shows its traceback).
    """
    from megatron_iiet.errors import OperatorError, ReportedByRank0

    outcome: tuple = ("ok", None)
    error: BaseException | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            outcome = ("ok", fn())
        except Exception as err:  # noqa: BLE001  (re-raised below, on every rank)
            error = explain(err)
            outcome = ("error", isinstance(error, OperatorError), str(error))
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if error is not None:
        raise error
    if outcome[0] == "error":
        _, one_line, text = outcome
        raise ReportedByRank0(text) if one_line else RuntimeError(f"rank 0 failed: {text}")
    return outcome[1]


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def all_gather(value: Any) -> list[Any]:
    """Every rank's ``value`` in rank order, on every rank (``[value]`` without a group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def initialize(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    seed: int = 1234,
    timeout_s: float = 600.0,
) -> None:
    """Join the process group (torchrun or srun env vars), build megatron's groups, seed RNGs.

    ``timeout_s`` bounds every collective, on the default group and on megatron's groups alike
    (megatron gives its own 30 minutes unless told: a rank stopped during training hung the job
    for that long in the data-parallel all-reduce, whatever the default group's timeout)."""
    install_cpu_compat()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        rank = _env_int("RANK", "SLURM_PROCID", default=0)
        world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
        local = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
        # Libraries that read the torchrun variables (DeepSpeed) see the same answers under
        # srun or a plain `python` launch.
        for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local)):
            os.environ.setdefault(name, str(value))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        # A lone process needs no agreed port: take a free one, so two single-process jobs on
        # one machine do not collide on a fixed default.
        os.environ.setdefault("MASTER_PORT", str(free_port() if world == 1 else 29500))
        # With CUDA, NCCL carries the GPU tensors and gloo the small CPU ones (stop flags, metric
        # sums, all_gather_object): one default group serves both, as torchtitan sets it up.
        backend = "cpu:gloo,cuda:nccl" if cuda_available() else "gloo"
        if cuda_available():
            torch.cuda.set_device(local)
            # NCCL's watchdog only ends a timed-out collective with error handling on
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel) != 0:
        from megatron_iiet.errors import BadInput

        raise BadInput(
            f"tensor_parallel x pipeline_parallel ({tensor_parallel} x {pipeline_parallel}) does "
            f"not divide the world size {world}"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_parallel, pipeline_parallel,
                                                 distributed_timeout_minutes=timeout_s / 60)
    seed_everything(seed)


def seed_everything(seed: int) -> None:
    """Seeds torch and megatron's TP-aware RNG streams (restarting them from scratch)."""
    from megatron.core import tensor_parallel as mp_tensor_parallel

    torch.manual_seed(seed)
    mp_tensor_parallel.model_parallel_cuda_manual_seed(seed)


def teardown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # megatron-core 0.16.1's destroy_model_parallel leaves a few groups in its globals (the
    # intra-partial data-parallel and hierarchical context-parallel ones): drop them too, so that
    # the destroyed groups are freed here and not later, at an unexpected moment.
    for name, value in vars(parallel_state).items():
        members = value if isinstance(value, (list, tuple)) else [value]
        if name.isupper() and members and all(isinstance(g, dist.ProcessGroup) for g in members):
            setattr(parallel_state, name, None)
    if dist.is_initialized():
        dist.destroy_process_group()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port that is free now and that the kernel will not hand out meanwhile.

    Asking the kernel for port 0 returns an ephemeral port, and the kernel gives the same range to
    every outgoing connection (gloo opens many): between our check and the rendezvous binding it,
    another job's connection could take it (EADDRINUSE). So pick below the ephemeral range.
    """
    import random

    low, _ = _ephemeral_range()
    below = range(20000, low)
    # A kernel range that starts low (some clusters use 1024-65535) leaves no room below it:
    # then the kernel's own choice, as before.
    candidates = random.Random().sample(below, k=64) if len(below) >= 1000 else []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all taken: the kernel's choice is better than none
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_entry(rank, world, port, tp, pp, fn, kwargs, conn, timeout_s, threads):
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    result: Any
    try:
        initialize(tp, pp, timeout_s=timeout_s)
        result = ("ok", fn(**kwargs))
    except BaseException as exc:  # report every failure to the parent, then fail the process
        result = ("error", f"rank {rank}: {exc!r}\n{traceback.format_exc()}")
    finally:
        try:
            teardown()
        except Exception:
            pass
    # Through a pipe from our own child, not a file: nothing another process could plant. By
    # value: conn.send would pass tensors as shared-memory handles, which die with this process.
    conn.send_bytes(pickle.dumps(result))
    conn.close()


def spawn_local(
    fn: Callable[..., Any],
    world_size: int,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    timeout_s: float = 600.0,
    threads_per_rank: int = 1,
    **kwargs,
) -> list[Any]:
    """Run ``fn(**kwargs)`` on ``world_size`` fresh gloo processes; returns each rank's result.

    ``fn`` must be importable (module level). Raises RuntimeError with the failing rank's
    traceback, or TimeoutError if a rank hangs past ``timeout_s``.
    """
    for attempt in range(3):
        try:
            return _spawn_once(fn, world_size, tensor_parallel, pipeline_parallel, timeout_s,
                               threads_per_rank, kwargs)
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class _PortTaken(RuntimeError):
    """Rank 0 could not listen on the rendezvous port: another process took it after free_port.
    fn never ran on rank 0, and the other ranks are stopped at once (they would wait for a store
    that is not there, or, should the port's holder be another job's store, join that one), so
    the job can start again on another port."""


def _spawn_once(fn, world_size, tensor_parallel, pipeline_parallel, timeout_s, threads_per_rank,
                kwargs) -> list[Any]:
    import multiprocessing as mp
    from multiprocessing.connection import wait

    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_spawned_entry,
            args=(r, world_size, port, tensor_parallel, pipeline_parallel, fn, kwargs,
                  pipes[r][1], min(timeout_s, 120.0), threads_per_rank),
        )
        for r in range(world_size)
    ]
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank)
    try:
        for p in procs:
            p.start()
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    for _, sending in pipes:
        sending.close()  # the child's end: its exit then reads as EOF here
    # Read while waiting: a large result fills the pipe, and its rank cannot exit before it is read.
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    received: dict[int, tuple] = {}
    open_ends = {pipes[r][0]: r for r in range(world_size)}
    while open_ends:
        remaining = (deadline - datetime.datetime.now()).total_seconds()
        ready = wait(list(open_ends), timeout=max(remaining, 0.0))
        if not ready:
            break
        for end in ready:
            rank = open_ends.pop(end)
            try:
                received[rank] = pickle.loads(end.recv_bytes())
            except EOFError:  # died without a result
                pass
            end.close()
            status, value = received.get(rank, (None, None))
            if rank == 0 and status == "error" and "EADDRINUSE" in value:
                for p in procs:
                    p.kill()
                for p in procs:
                    p.join()
                for other in open_ends:
                    other.close()
                raise _PortTaken(value)
    for end in open_ends:
        end.close()
    for p in procs:
        remaining = (deadline - datetime.datetime.now()).total_seconds()
        p.join(max(remaining, 0.1))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results = []
    errors = []
    for r in range(world_size):
        if r not in received:
            if r not in hung:
                errors.append(f"rank {r}: exited with code {procs[r].exitcode} without a result")
            results.append(None)
            continue
        status, value = received[r]
        if status == "error":
            errors.append(value)
        results.append(value)
    if hung:
        raise TimeoutError(f"ranks {hung} still running after {timeout_s:.0f}s; "
                           + ("\n".join(errors) if errors else ""))
    if errors:
        raise RuntimeError("\n".join(errors))
    return results
