"""Training metrics: a progress bar with ETA on stdout, TensorBoard and a JSONL file.

Only rank 0 writes; every rank calls the same methods.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import secrets
import time
from pathlib import Path
from typing import Optional

import torch

from megatron_iiet import platform
from megatron_iiet.storage import storage_error


def measured_peak_flops(dtype: torch.dtype = torch.float32, n: int = 2048) -> float:
    """This device's achievable dense GEMM rate: the denominator of MFU."""
    device = platform.compute_device()
    # values do not matter; a private generator keeps the training RNG streams untouched
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g, dtype=dtype).to(device)
    b = torch.randn(n, n, generator=g, dtype=dtype).to(device)
    a @ b
    best = math.inf
    for _ in range(3):
        platform.synchronize()
        t0 = time.perf_counter()
        a @ b
        platform.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def memory_mb() -> dict:
    if platform.cuda_available():
        return {"mem_allocated_mb": torch.cuda.memory_allocated() / 2**20,
                "mem_peak_mb": torch.cuda.max_memory_allocated() / 2**20}
    return {"mem_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


class WandbSink:
    """Weights & Biases as one more sink of the records metrics.jsonl gets (rank 0 only).

    The run id lives in the logging directory, so a resumed run continues the same W&B run;
    ``offline`` writes under logging.dir/wandb for a later `wandb sync` (no network)."""

    def __init__(self, root: Path, logging_cfg, config: Optional[dict]):
        from megatron_iiet.errors import BadInput

        try:
            import wandb
        except ImportError:
            raise BadInput("logging.wandb_project is set but wandb is not installed "
                           "(pip install wandb, or leave logging.wandb_project null)") from None
        if logging_cfg.wandb_mode not in ("online", "offline"):
            raise BadInput(f"logging.wandb_mode: {logging_cfg.wandb_mode!r} is not online or "
                           "offline")
        id_file = root / "wandb_run_id"
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            from megatron_iiet.data.atomic import write_bytes_atomic

            run_id = secrets.token_hex(8)
            write_bytes_atomic(id_file, (run_id + "\n").encode())
        self._run = wandb.init(project=logging_cfg.wandb_project, entity=logging_cfg.wandb_entity,
                               name=logging_cfg.wandb_name or root.resolve().name, id=run_id,
                               resume="allow", dir=str(root), mode=logging_cfg.wandb_mode,
                               config=config)

    def write(self, record: dict) -> None:
        values = {f"{record['kind']}/{k}": v for k, v in record.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)
                  and k not in ("step", "time")}
        if values:
            self._run.log(values, step=record["step"])

    def close(self) -> None:
        self._run.finish()


class MetricsLogger:
    def __init__(self, log_dir: str, enabled: bool, total_steps: int, start_step: int,
                 tensorboard: bool = True, progress_bar: bool = True, logging_cfg=None,
                 run_config: Optional[dict] = None):
        self.enabled = enabled
        self.root = Path(log_dir)
        self.total_steps = total_steps
        self._bar = None
        self._tb = None
        self._jsonl = None
        self._wandb = None
        if not enabled:
            return
        root = self.root
        self.jsonl_path = root / "metrics.jsonl"
        with self._storage_faults():
            root.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.jsonl_path, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(root / "tensorboard"))
        if logging_cfg is not None and logging_cfg.wandb_project:
            self._wandb = WandbSink(root, logging_cfg, run_config)
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step",
                             dynamic_ncols=True, desc="train")

    @contextlib.contextmanager
    def _storage_faults(self):
        """A full or read-only logging disk is the operator's to fix: one line naming it."""
        try:
            yield
        except OSError as err:
            fault = storage_error(err, self.root)
            if fault is None:
                raise
            raise fault from err

    def _write(self, record: dict) -> None:
        with self._storage_faults():
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step = record["step"]
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step" and v is not None:
                    self._tb.add_scalar(f"{record['kind']}/{k}", v, step)
        if self._wandb is not None:
            self._wandb.write(record)

    def event(self, kind: str, step: int, **fields) -> None:
        if self.enabled:
            self._write({"kind": kind, "step": step, "time": time.time(), **fields})

    def log_step(self, step: int, **metrics) -> None:
        if not self.enabled:
            return
        self._write({"kind": "train", "step": step, "time": time.time(), **metrics})
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                                  tok_s=f"{metrics['tokens_per_s']:.0f}",
                                  mfu=f"{metrics['mfu']:.1%}", refresh=False)
        else:
            print(f"step {step}/{self.total_steps} loss {metrics['loss']:.4f} "
                  f"lr {metrics['lr']:.2e} tok/s {metrics['tokens_per_s']:.0f}", flush=True)

    def log_eval(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        ppl = math.exp(loss) if loss < 50 else float("inf")
        self._write({"kind": "valid", "step": step, "time": time.time(), "loss": loss, "ppl": ppl})
        message = f"validation at step {step}: loss {loss:.4f}, perplexity {ppl:.2f}"
        (self._bar.write if self._bar is not None else print)(message)

    def message(self, text: str) -> None:
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
        if self._jsonl is not None:
            self._jsonl.close()


class Throughput:
    """Tokens/s and MFU of a step from its wall time."""

    def __init__(self, flops_per_step: float, tokens_per_step: int, peak_flops: float,
                 world_size: int):
        self.flops = flops_per_step
        self.tokens = tokens_per_step
        self.peak = peak_flops * world_size

    def __call__(self, seconds: float) -> dict:
        return {"step_s": seconds, "tokens_per_s": self.tokens / seconds,
                "mfu": self.flops / seconds / self.peak}


def optional_float(x) -> Optional[float]:
    return None if x is None else float(x)
