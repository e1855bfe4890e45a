"""What the slurm/ scripts ask of Python: a health check of the allocation, a config check before
any node is kept busy, and "is this run finished?" for the requeue decision.

    python -m megatron_iiet.slurm health                      # under srun: every task
    python -m megatron_iiet.slurm check CONFIG [--set k=v]... # one line and exit 2 if it is bad
    python -m megatron_iiet.slurm finished CONFIG [--set k=v]...  # exit 0 if the run is done

The health check joins a process group at the job's rendezvous (MASTER_ADDR, MASTER_PORT + 1, so
it never holds the port the real job binds next), gathers every rank's (rank, world size, host)
and fails in one line unless all ranks arrived within the timeout and agree on the world size.
Rank 0 writes ``$IIET_JOB_DIR/health.json``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
from pathlib import Path


def health(timeout_s: float) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_iiet.distributed import _env_int  # the trainer's reading of torchrun/srun variables

    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500")) + 1
    from megatron_iiet.platform import cuda_available

    gpu = cuda_available()
    backend = "nccl" if gpu else "gloo"
    if gpu:
        torch.cuda.set_device(local % torch.cuda.device_count())
    started = time.monotonic()
    try:
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        mine = {"rank": rank, "world_size": world, "host": socket.gethostname(),
                "node": os.environ.get("SLURMD_NODENAME", ""), "local_rank": local}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        if gpu:  # one collective on the devices too: NCCL's own path, not only the TCP store
            probe = torch.ones(1, device="cuda")
            dist.all_reduce(probe)
            assert int(probe.item()) == world
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - whatever broke, the operator gets one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SystemExit(f"error: health check: rank {rank} of {world} could not reach the "
                         f"rendezvous {addr}:{port} ({backend}) within {timeout_s:.0f} s: {first}")
    sizes = {r["world_size"] for r in everyone}
    if sizes != {world} or sorted(r["rank"] for r in everyone) != list(range(world)):
        raise SystemExit(f"error: health check: the ranks disagree on the world: {everyone}")
    return {"ranks": everyone, "world_size": world, "backend": backend,
            "seconds": round(time.monotonic() - started, 2), "rank": rank}


def _config(argv: list[str]):
    from pretrain_iiet import parse_args
    from megatron_iiet.training.config import load_config

    args = parse_args(["--config", *argv])
    if not Path(args.config).is_file():
        raise SystemExit(f"error: config {args.config} does not exist")
    try:
        return load_config(args.config, args.set, here=False)
    except ValueError as err:
        raise SystemExit(f"error: {err}")


def _missing_inputs(config) -> list[str]:
    """Files the run names that are not there (checked by the trainer too, but only after every
    node has started Python and joined the process group)."""
    from megatron_iiet.data.blend import blend_pairs

    missing = []
    for key in ("train", "valid"):
        spec = getattr(config.data, key)
        if spec is None:
            continue  # the built-in corpus / a split of data.train
        try:
            pairs = blend_pairs(spec)
        except ValueError as err:
            missing.append(f"data.{key}: {err}")
            continue
        for _, prefix in pairs:
            if not Path(prefix + ".bin").is_file() or not Path(prefix + ".idx").is_file():
                missing.append(f"data.{key} {prefix} (no {prefix}.bin / .idx)")
    tokenizer = config.data.tokenizer
    if tokenizer and not Path(tokenizer).exists():
        missing.append(f"data.tokenizer {tokenizer}")
    init_from = getattr(config.checkpoint, "init_from", None)
    if init_from and not Path(init_from).exists():
        missing.append(f"checkpoint.init_from {init_from}")
    for i, teacher in enumerate(getattr(getattr(config, "distill", None), "teachers", None) or []):
        for key in ("checkpoint", "logits"):
            path = getattr(teacher, key, None)
            if path and not Path(path).exists():
                missing.append(f"distill.teachers[{i}].{key} {path}")
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_iiet.slurm")
    sub = parser.add_subparsers(dest="command", required=True)
    h = sub.add_parser("health", help="under srun: every rank reaches the rendezvous")
    h.add_argument("--timeout", type=float, default=float(os.environ.get("IIET_HEALTH_TIMEOUT", 300)))
    for name in ("check", "finished"):
        p = sub.add_parser(name)
        p.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "health":
        report = health(args.timeout)
        if report["rank"] == 0:
            hosts = sorted({r["node"] or r["host"] for r in report["ranks"]})
            print(f"health: {report['world_size']} ranks on {','.join(hosts)} agree on world size "
                  f"{report['world_size']} ({report['backend']}, {report['seconds']} s)", flush=True)
            job_dir = os.environ.get("IIET_JOB_DIR")
            if job_dir:
                from megatron_iiet.data.atomic import write_json_atomic
                write_json_atomic(Path(job_dir) / "health.json", report)
        return 0
    config = _config(args.rest)
    if args.command == "check":
        missing = _missing_inputs(config)
        if missing:
            raise SystemExit(f"error: missing: {'; '.join(missing)}")
        return 0
    from megatron_iiet.training.metrics_log import read_records

    ends = [r for r in read_records(Path(config.logging.dir)) if r.get("kind") == "end"]
    return 0 if ends and ends[-1].get("finished") else 1


if __name__ == "__main__":
    sys.exit(main())
