"""Running a planned sweep and collecting its results.

``launch`` runs the plan's runs with pretrain_iiet.py (torchrun when ``nproc`` > 1), one after
another or ``jobs`` at a time (the cores shared out between them), phase 1 first (known LRs:
the grid), then phase 2 with the grid's best LR per architecture carried by the plan's rule
(an architecture's phase-2 runs need its own grid finished, not the others'). It
is idempotent: a run whose metrics say it finished is skipped, an unfinished one is started
again and resumes from its newest checkpoint (every run saves every quarter of its schedule
unless the sweep says otherwise). ``task`` picks one run of a phase (a SLURM array task). Runs
end with their launcher, even one killed with -9 (they save their step first, on Linux).

``collect`` reads every run's metrics.jsonl: status, final training and validation loss, the
validation curve, and optionally the loss of the final checkpoint on extra validation sets;
writes results.json and results.csv, and the best LR per architecture when the plan has a grid.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from megatron_iiet.lifetime import terminate_with_parent
from megatron_iiet.sweep.plan import RunPlan, SweepPlan, run_overrides
from megatron_iiet.training.metrics_log import last_attempt, read_records

REPO = Path(__file__).resolve().parents[2]


def run_dir(plan: SweepPlan, run: RunPlan) -> Path:
    return Path(run.overrides["logging.dir"])


def run_status(plan: SweepPlan, run: RunPlan, count_committed: bool = True) -> str:
    """finished | partial | missing. ``count_committed``: a run with no folder here that the
    committed results list counts as finished."""
    records = read_records(run_dir(plan, run))
    if any(r.get("kind") == "end" and r.get("finished") and r.get("step") == run.train_steps
           for r in records):
        return "finished"
    if not records and count_committed and run.name in plan.committed:
        return "finished"  # in the repository's results, its folder on another machine
    return "partial" if records else "missing"


def best_lrs(plan: SweepPlan, architectures: Optional[set[str]] = None) -> dict[str, float]:
    """Per architecture with a grid (only those in `architectures` when given): the grid LR of
    lowest final validation loss (mean over seeds). Raises when one of their grid runs has not
    finished; another architecture's unfinished grid does not hold them back."""
    losses: dict[str, dict[float, list[float]]] = {}
    for run in plan.runs:
        if not run.grid or (architectures is not None and run.architecture not in architectures):
            continue
        result = run_result(plan, run)
        if result["status"] != "finished" or result["valid_loss"] is None:
            raise ValueError(f"{run.name}: the LR grid run has not finished (launch phase 1 "
                             "first)")
        losses.setdefault(run.architecture, {}).setdefault(run.lr, []).append(
            result["valid_loss"])
    return {arch: min(by_lr, key=lambda lr: sum(by_lr[lr]) / len(by_lr[lr]))
            for arch, by_lr in losses.items()}


def resolved_lr(plan: SweepPlan, run: RunPlan, best: Optional[dict[str, float]]) -> float:
    if run.lr is not None:
        return run.lr
    if best is None or run.architecture not in best:
        raise ValueError(f"{run.name}: its LR is the grid's best; collect phase 1 first")
    return best[run.architecture] * run.lr_factor


def saved_lr(plan: SweepPlan, run: RunPlan) -> Optional[float]:
    """The LR a run's newest complete checkpoint was trained with (None without one)."""
    from megatron_iiet.training.checkpoint_index import newest_complete, read_meta

    root = run_dir(plan, run) / "checkpoints"
    newest = newest_complete(root, warn=lambda _: None) if root.is_dir() else None
    if newest is None:
        return None
    return ((read_meta(newest).config or {}).get("optimizer") or {}).get("lr")


def check_same_lr(plan: SweepPlan, run: RunPlan, lr: float, status: str) -> None:
    """Refuse to skip or resume a run trained at another LR than the plan now gives it (the LR
    grid grew and its best moved): its results would be counted for the wrong LR."""
    if status == "missing":
        return
    saved = saved_lr(plan, run)
    if saved is not None and abs(saved - lr) > 1e-9 * max(abs(lr), 1e-12):
        raise ValueError(f"{run.name}: trained with lr {saved:.4g} but the plan now gives "
                         f"{lr:.4g} (the grid's best moved); move {run_dir(plan, run)} aside "
                         "to run it again")


def _command(plan: SweepPlan, run: RunPlan, lr: float, nproc: int,
             extra: tuple[str, ...] = ()) -> list[str]:
    sets = run_overrides(run, lr, plan.spec.lr.min_lr_ratio)
    if "checkpoint.save_interval" not in plan.spec.set:
        sets.append(f"checkpoint.save_interval={max(1, run.train_steps // 4)}")
    sets += extra  # later --set wins
    head = ([sys.executable] if nproc == 1 else
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={nproc}"])
    args = [*head, str(REPO / "pretrain_iiet.py"), "--config", str(plan.base_path.resolve())]
    for s in sets:
        args += ["--set", s]
    return args


@dataclass(frozen=True)
class Calibration:
    """This machine's pace on the sweep, measured by running its smallest run for a few steps:
    seconds per training FLOP at that size, and the fixed cost of a run (start-up, data indices,
    validation, checkpoints). Small models are far below the GEMM rate, so a rate derived from
    a matmul under-estimates a CPU ladder by orders of magnitude."""

    seconds_per_flop: float
    overhead_s: float

    def estimate(self, run: RunPlan) -> float:
        return self.overhead_s + run.total_flops * self.seconds_per_flop


MEASURED_STEPS = 6


def calibrate(plan: SweepPlan, nproc: int = 1, scratch: Optional[Path] = None) -> Calibration:
    """Run the sweep's smallest run (by FLOPs) for MEASURED_STEPS steps into ``scratch`` (a
    temporary folder by default) and time it: the median step after the first two gives the
    seconds per FLOP, the rest of the wall time the per-run overhead."""
    import shutil
    import statistics
    import tempfile

    run = min(plan.runs, key=lambda r: r.total_flops)
    folder = Path(scratch or tempfile.mkdtemp(prefix="sweep_calibration_"))
    steps = min(MEASURED_STEPS, run.train_steps)
    cmd = _command(plan, run, run.lr or 1e-3, nproc, extra=(
        f"schedule.train_steps={steps}", f"schedule.warmup_steps={max(1, steps // 3)}",
        f"logging.dir={folder / 'run'}", "checkpoint.dir=null", "checkpoint.save_interval=0",
        "checkpoint.load=null", "logging.progress_bar=false", "logging.tensorboard=false",
        "logging.log_interval=1", f"data.cache_dir={folder / 'cache'}"))
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"calibration run {run.name} failed: {tail}")
        step_s = [r["step_s"] for r in read_records(folder / "run") if r.get("kind") == "train"]
    finally:
        if scratch is None:
            shutil.rmtree(folder, ignore_errors=True)
    per_step = statistics.median(step_s[2:] or step_s)
    step_flops = run.total_flops / run.train_steps
    # the measured run's own validation and save happen once, as in every run
    return Calibration(per_step / step_flops, max(0.0, wall - sum(step_s)))


def phase_runs(plan: SweepPlan, phase: int) -> list[RunPlan]:
    """A phase's runs rung by rung: every architecture at a size and budget before the next one,
    the extra noise seeds last, so a sweep stopped part-way still compares architectures."""
    sizes = [s.name for s in plan.spec.sizes]
    archs = list(plan.spec.architectures)
    return sorted((r for r in plan.runs if r.phase == phase),
                  key=lambda r: (r.seed not in plan.spec.seeds, sizes.index(r.size), r.tokens,
                                 archs.index(r.architecture)))


def launch(plan: SweepPlan, *, nproc: int = 1, phase: Optional[int] = None,
           task: Optional[int] = None, jobs: int = 1, dry_run: bool = False,
           retrain_committed: bool = False, say: Callable[[str], None] = print) -> int:
    """Run what is not finished, `jobs` runs at a time; returns how many runs it started.
    ``retrain_committed``: a run finished only in the committed results (its folder is on
    another machine) is trained again here, for its checkpoints; its committed loss still
    counts towards the best LR."""
    started = 0
    finished: list[tuple[RunPlan, float]] = []  # this launch's, for the ETA
    for current in (1, 2):
        if phase is not None and current != phase:
            continue
        runs = phase_runs(plan, current)
        if task is not None:
            if not 0 <= task < len(runs):
                raise ValueError(f"task {task}: phase {current} has {len(runs)} runs")
            runs = [runs[task]]
        best = None
        if current == 2 and runs:
            if dry_run:
                best = {r.architecture: float("nan") for r in plan.runs}
            else:
                best = best_lrs(plan, {r.architecture for r in runs})
                choice = Path(plan.spec.output) / "lr_choice.json"
                _write_json(choice, {**_read_lr_choice(choice), **best})
                say("best grid LR: " + ", ".join(f"{a} {v:.3g}" for a, v in best.items()))
        todo: list[tuple[RunPlan, str, list[str]]] = []
        for run in runs:
            status = run_status(plan, run, count_committed=not retrain_committed)
            lr = resolved_lr(plan, run, best)
            check_same_lr(plan, run, lr, status)
            if status == "finished":
                say(f"skip {run.name} (finished)")
                continue
            cmd = _command(plan, run, lr, nproc)
            if dry_run:
                say(" ".join(cmd))
                continue
            todo.append((run, f"{'resume' if status == 'partial' else 'start'} {run.name} "
                              f"({run.train_steps} steps, lr {lr:.3g})", cmd))
        later = [] if phase is not None else [
            r for r in phase_runs(plan, 2) if current == 1 and run_status(plan, r) != "finished"]
        started += _run_all(plan, todo, jobs, _threads_per_run(jobs, nproc), say, finished,
                            later)
    return started


def _threads_per_run(jobs: int, nproc: int) -> Optional[int]:
    """The cores shared out between the runs at once (None: one run, torch's own default)."""
    if jobs <= 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // (jobs * nproc))


def _run_all(plan: SweepPlan, todo, jobs: int, threads: Optional[int],
             say: Callable[[str], None], finished: list[tuple[RunPlan, float]],
             later: list[RunPlan]) -> int:
    """Start the runs in order, at most `jobs` at once. A failed or preempted run lets the others
    that are running finish (or save) and starts no new one; then the first problem is raised."""
    running: dict[subprocess.Popen, tuple[RunPlan, Path]] = {}
    started_at: dict[subprocess.Popen, float] = {}
    pending: list = []
    problems: list[Exception] = []
    received: list[int] = []
    started = 0

    def forward(signum, _frame):
        received.append(signum)
        for proc in running:
            if proc.poll() is None:
                proc.send_signal(signum)

    def reap(proc: subprocess.Popen) -> None:
        run, log = running.pop(proc)
        if proc.returncode == 0 and not received:
            finished.append((run, time.perf_counter() - started_at.pop(proc)))
            say(_progress_line(plan, run, finished, [r for r, *_ in pending]
                               + [r for r, _ in running.values()] + later, jobs))
        if received:
            problems.append(Stopped(f"{run.name}: stopped by {signal.Signals(received[0]).name} "
                                    "(the run saved a checkpoint; launch again to resume it)"))
        elif proc.returncode != 0:
            problems.append(RuntimeError(f"{run.name}: pretrain_iiet.py exited "
                                         f"{proc.returncode} (log: {log})"))

    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        pending[:] = todo
        while pending or running:
            while pending and len(running) < max(1, jobs) and not problems and not received:
                run, message, cmd = pending.pop(0)
                say(message)
                run_dir(plan, run).mkdir(parents=True, exist_ok=True)
                log = run_dir(plan, run) / "launch.log"
                with open(log, "a") as out:
                    # A launcher killed with -9 forwards nothing: its run would train on
                    # unobserved. The kernel sends the run SIGTERM instead (on Linux): it saves
                    # its step and stops, and the next launch resumes it.
                    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                            env=env, preexec_fn=terminate_with_parent(os.getpid()))
                running[proc] = (run, log)
                started_at[proc] = time.perf_counter()
                started += 1
            if problems or received:
                pending.clear()
            ended = [proc for proc in running if proc.poll() is not None]
            for proc in ended:
                reap(proc)
            if running and not ended:
                time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if problems:
        raise problems[0]
    return started


def _progress_line(plan: SweepPlan, run: RunPlan, finished: list[tuple[RunPlan, float]],
                   left: list[RunPlan], jobs: int) -> str:
    """`done RUN: valid loss, time; k runs done, n left, ETA`: the ETA prices the runs left at
    the seconds per FLOP this launch's finished runs took (with their start-up included)."""
    from megatron_iiet.sweep.plan import duration_text

    result = run_result(plan, run)
    loss = result["valid_loss"]
    seconds = finished[-1][1]
    pace = sum(t for _, t in finished) / max(1.0, sum(r.total_flops for r, _ in finished))
    eta = sum(r.total_flops for r in left) * pace / max(1, jobs)
    return (f"done {run.name}: valid loss {'-' if loss is None else f'{loss:.4f}'}, "
            f"{duration_text(seconds)}; {len(finished)} done, {len(left)} left"
            + (f", ETA {duration_text(eta)}" if left else ""))


class Stopped(RuntimeError):
    """A preemption signal reached the launcher: the running runs saved and stopped."""


def submit_slurm(plan: SweepPlan, sweep_path: str, *, sbatch_args: list[str] = (),
                 max_parallel: Optional[int] = None, dry_run: bool = False,
                 say: Callable[[str], None] = print) -> list[str]:
    """Submit the sweep as SLURM array jobs of slurm/sweep.sbatch, one array per phase, phase 2
    after phase 1 has succeeded (its LRs come from phase 1's results). Only unfinished runs get
    an array task (their indices in ``phase_runs``); a phase with none is not submitted.
    Returns the job ids."""
    sweep = str(Path(sweep_path).resolve())
    jobs: list[str] = []
    for phase in (1, 2):
        runs = phase_runs(plan, phase)
        if not runs:
            continue
        pending = [i for i, run in enumerate(runs) if run_status(plan, run) != "finished"]
        if not pending:
            say(f"phase {phase}: all {len(runs)} runs finished, nothing to submit")
            continue
        array = _index_ranges(pending) + (f"%{max_parallel}" if max_parallel else "")
        cmd = ["sbatch", "--parsable", f"--array={array}", f"--job-name=sweep-{plan.spec.name}-p{phase}",
               *(["--dependency=afterok:" + jobs[-1]] if jobs else []), *sbatch_args,
               str(REPO / "slurm" / "sweep.sbatch"), sweep, "--phase", str(phase)]
        if dry_run:
            say(" ".join(cmd))
            jobs.append(f"<phase {phase} job>")
            continue
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch refused phase {phase}: {proc.stderr.strip()}")
        jobs.append(proc.stdout.strip().split(";")[0])
        done = len(runs) - len(pending)
        say(f"phase {phase}: {len(pending)} runs, array job {jobs[-1]}"
            + (f" ({done} finished, not submitted)" if done else ""))
    return jobs


def _index_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (sbatch --array syntax)."""
    parts, start = [], None
    for k, i in enumerate(indices):
        if start is None:
            start = i
        if k + 1 == len(indices) or indices[k + 1] != i + 1:
            parts.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ",".join(parts)


# ---- collect ------------------------------------------------------------------------------

@dataclass
class ExtraValid:
    name: str
    prefix: str
    batches: int = 8
    batch_size: int = 4


def run_result(plan: SweepPlan, run: RunPlan) -> dict:
    records = read_records(run_dir(plan, run))
    if not records and run.name in plan.committed:
        return dict(plan.committed[run.name])
    valid, train = last_attempt(records, "valid"), last_attempt(records, "train")
    per_step = run.tokens / run.train_steps
    return {
        "name": run.name, "architecture": run.architecture, "size": run.size,
        "seed": run.seed, "lr": run.lr, "lr_factor": run.lr_factor, "grid": run.grid,
        "phase": run.phase, "params": run.non_embedding_params, "total_params": run.params,
        "tokens": run.tokens, "flops": run.total_flops, "flops_per_token": run.flops_per_token,
        "train_steps": run.train_steps, "status": run_status(plan, run),
        "valid_loss": valid[-1]["loss"] if valid and valid[-1]["step"] == run.train_steps
        else None,
        "train_loss": train[-1]["loss"] if train else None,
        "loss_curve": [(r["step"] * per_step, r["loss"]) for r in valid],
        # training loss at every logged step: where a run sat on the unigram plateau
        "train_curve": [(r["step"], r["loss"]) for r in train],
        # a finished run's last step, whatever the log interval (its end record says)
        "steps_done": max([r["step"] for r in records if r.get("kind") == "end"]
                          + ([train[-1]["step"]] if train else [0])),
    }


def _extra_losses(plan: SweepPlan, results: list[dict], extra: list[ExtraValid]) -> None:
    """Each finished run on each extra validation set, at every checkpoint it kept (one process):
    ``valid_loss_NAME`` at its final checkpoint, ``loss_curve_NAME`` as (tokens, loss) at all of
    them (a run keeps its quarter checkpoints with ``checkpoint.keep_last`` >= 5)."""
    if not extra:
        return
    from megatron_iiet.eval.checkpoint import load_for_inference
    from megatron_iiet.hf.megatron_model import one_process_group
    from megatron_iiet.iiad.influence import calibration_batches, mean_loss
    from megatron_iiet.training.checkpoint_index import defect, list_checkpoints, step_of

    with one_process_group():
        for result in results:
            run = plan.run(result["name"])
            root = run_dir(plan, run) / "checkpoints"
            kept = [c for c in list_checkpoints(root) if defect(c) is None]
            if result["status"] != "finished" or not kept:
                continue  # a committed result keeps the extra losses it was collected with
            per_step = run.tokens / run.train_steps
            curves: dict[str, list] = {ev.name: [] for ev in extra}
            for ckpt in kept:
                loaded = load_for_inference(ckpt, with_tokenizer=False)
                for ev in extra:
                    batches = calibration_batches(ev.prefix, ev.batches, ev.batch_size,
                                                  loaded.max_length)
                    curves[ev.name].append((step_of(ckpt) * per_step,
                                            mean_loss(loaded.model, batches)))
            for name, curve in curves.items():
                result[f"loss_curve_{name}"] = curve
                if step_of(kept[-1]) == run.train_steps:
                    result[f"valid_loss_{name}"] = curve[-1][1]


def collect(plan: SweepPlan, extra: Optional[list[ExtraValid]] = None) -> list[dict]:
    results = [run_result(plan, r) for r in plan.runs]
    choice = _read_lr_choice(Path(plan.spec.output) / "lr_choice.json")
    for r in results:  # phase 2 runs: the LR they ran at
        if r["lr"] is None and r["architecture"] in choice:
            r["lr"] = choice[r["architecture"]] * r["lr_factor"]
    _extra_losses(plan, results, extra or [])
    out = Path(plan.spec.output)
    _write_json(out / "results.json", results)
    _write_csv(out / "results.csv", results)
    if any(r["grid"] for r in results):
        try:
            _write_json(out / "best_lr.json", best_lrs(plan))
        except ValueError:
            pass  # the grid is not finished yet: results still written
    return results


def _read_lr_choice(path: Path) -> dict[str, float]:
    """The best grid LR per architecture that phase 2 ran with ({} before any phase-2 run)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_json(path: Path, data) -> None:
    from megatron_iiet.data.atomic import write_json_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)


def _write_csv(path: Path, results: list[dict]) -> None:
    from megatron_iiet.data.atomic import write_bytes_atomic

    def scalar(key: str) -> bool:  # the curves stay in results.json
        return not key.endswith("_curve") and not key.startswith("loss_curve")

    columns = [k for k in results[0] if scalar(k)] if results else []
    for r in results:
        columns += [k for k in r if k not in columns and scalar(k)]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for r in results:
        writer.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v)
                         for k, v in r.items() if scalar(k)})
    write_bytes_atomic(path, text.getvalue().encode())
