"""Each training callback alone, and the checkpoint manager with an engine it has never seen.

The trainer here drives a minimal engine (one torch linear layer, plain SGD) that implements
the engine protocol for real: train_step, eval_step, save, state_meta, load, digest. This keeps
megatron's start-up (~8 s a process) out of tests of the loop's parts, and shows that the loop
and checkpointing.py depend on the protocol, not on the megatron or DeepSpeed engine.
"""

import hashlib
import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from megatron_iiet.training.callbacks import (
    Callback, CheckpointCallback, CheckpointRecords, ExitDurationCallback, ExitIntervalCallback,
    MetricsCallback, NonFiniteCallback, PreemptionCallback, TooManySkippedSteps,
    ValidationCallback)
from megatron_iiet.training.checkpoint_index import defect, read_meta
from megatron_iiet.training.checkpointing import CheckpointManager, TrainingState, load
from megatron_iiet.training.engines import StepResult
from megatron_iiet.training.metrics import MetricsLogger, Throughput
from megatron_iiet.training.signals import PreemptionHandler
from megatron_iiet.training.trainer import Trainer


class LinearEngine:
    """y = w x by SGD on a fixed regression task; a batch with NaN inputs gives a NaN loss,
    whose update is skipped as the real engines do."""

    name = "linear"

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.module = torch.nn.Linear(4, 1, bias=False)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)

    def _loss(self, batch):
        x = batch["x"]
        return ((self.module(x) - x.sum(-1, keepdim=True)) ** 2).mean()

    def train_step(self, micro_batches, before_optimizer_step=lambda: None):
        self.optimizer.zero_grad()
        loss = sum(self._loss(b) for b in micro_batches) / len(micro_batches)
        if not math.isfinite(loss.item()):
            return StepResult(loss.item(), None, True, 0.1)
        loss.backward()
        before_optimizer_step()
        self.optimizer.step()
        return StepResult(loss.item(), 1.0, False, 0.1)

    @torch.no_grad()
    def eval_step(self, micro_batches):
        return float(sum(self._loss(b) for b in micro_batches) / len(micro_batches))

    def train(self, mode=True):
        self.module.train(mode)

    def save(self, directory, async_save=False):
        torch.save(self.module.state_dict(), Path(directory) / "weights.pt")

    def state_meta(self):
        return {"engine": self.name, "layout": {}, "scheduler": self.scheduler.state_dict()}

    def load(self, directory, meta, seed):
        self.module.load_state_dict(torch.load(Path(directory) / "weights.pt"))

    def parameters_digest(self):
        return hashlib.sha256(self.module.weight.detach().numpy().tobytes()).hexdigest()


def _batches(poisoned_steps=()):
    g = torch.Generator().manual_seed(1)
    step = 0
    while True:
        step += 1
        x = torch.randn(8, 4, generator=g)
        if step in poisoned_steps:
            x[0, 0] = float("nan")
        yield [{"x": x}]


def _trainer(tmp_path, callbacks, steps=6, engine=None, poisoned=(), state=None):
    engine = engine or LinearEngine()
    reporter = MetricsLogger(str(tmp_path / "logs"), True, steps, 0, tensorboard=False,
                             progress_bar=False)
    valid = [{"x": torch.ones(2, 4)}]
    return Trainer(engine, state or TrainingState(), _batches(poisoned),
                   lambda: engine.eval_step(valid), reporter, callbacks, steps, 8,
                   {"config": {}})


def _records(tmp_path, kind):
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _throughput():
    return Throughput(flops_per_step=1e6, tokens_per_step=100, peak_flops=1e9, world_size=1)


def test_metrics_callback_logs_step_one_every_interval_and_validations(tmp_path):
    summary = _trainer(tmp_path, [MetricsCallback(3, _throughput()), ValidationCallback(4)],
                       steps=7).fit()
    train = _records(tmp_path, "train")
    assert [r["step"] for r in train] == [1, 3, 6]
    assert all(r["loss"] > 0 and r["mfu"] > 0 and r["tokens_per_s"] > 0 for r in train)
    assert [r["step"] for r in _records(tmp_path, "valid")] == [4, 7]  # every 4, and the end
    assert summary.valid_loss == _records(tmp_path, "valid")[-1]["loss"]
    assert _records(tmp_path, "end")[0]["step"] == 7


def test_non_finite_steps_are_counted_logged_and_stop_the_run_past_the_limit(tmp_path, capsys):
    trainer = _trainer(tmp_path, [MetricsCallback(100, _throughput()), NonFiniteCallback(1)],
                       poisoned=(2, 4))
    with pytest.raises(TooManySkippedSteps, match="2 steps with non-finite loss"):
        trainer.fit()
    assert trainer.state.step == 4 and trainer.state.skipped_steps == 2
    assert [r["step"] for r in _records(tmp_path, "train")] == [1, 2, 4]  # skipped ones too
    assert "step 2: non-finite loss nan, update skipped (1/1)" in capsys.readouterr().out


def test_preemption_callback_saves_and_stops_after_the_step_with_the_signal(tmp_path):
    class SignalAtStep(Callback):
        def on_step_end(self, trainer, event):
            if event.step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)

    manager = CheckpointManager(str(tmp_path / "ckpt"), keep_last=0, log=lambda _: None)
    with PreemptionHandler() as handler:
        trainer = _trainer(tmp_path, [SignalAtStep(), PreemptionCallback(handler),
                                      CheckpointCallback(manager, 0, None)])
        summary = trainer.fit()
    assert summary.preempted and summary.steps == 2
    assert _records(tmp_path, "preempted")[0]["reason"] == "SIGUSR1 received"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["iter_0000002", "latest"]


def _agree_on_a_stop(rank: int, store_path: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        handler = PreemptionHandler()
        handler.received = signal.SIGUSR1 if rank == 1 else 0  # as if torchrun reached rank 1 first
        stop = handler.stop_requested()
        Path(out, f"rank{rank}.json").write_text(json.dumps([stop, handler.reason]))
    finally:
        dist.destroy_process_group()


def test_a_rank_without_the_signal_stops_too_and_names_the_signal_another_rank_got(tmp_path):
    # torchrun forwards a signal to one rank after another: the step's all-reduce can reach a rank
    # before the signal does (two gloo processes, one signalled)
    torch.multiprocessing.spawn(_agree_on_a_stop, args=(str(tmp_path / "store"), str(tmp_path)),
                                nprocs=2)
    assert json.loads((tmp_path / "rank1.json").read_text()) == [True, "SIGUSR1 received"]
    assert json.loads((tmp_path / "rank0.json").read_text()) == [
        True, "SIGUSR1 received by another rank"]


def test_exit_interval_saves_and_stops_after_that_many_steps_of_this_run(tmp_path):
    manager = CheckpointManager(str(tmp_path / "ckpt"), keep_last=0, log=lambda _: None)
    trainer = _trainer(tmp_path, [ExitIntervalCallback(2), CheckpointCallback(manager, 0, 3)],
                       state=TrainingState(step=3, consumed_samples=24))
    summary = trainer.fit()
    assert summary.steps == 5 and not summary.preempted
    assert trainer.state.consumed_samples == 40
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000005"


class _TickingClock:
    """A clock that advances `seconds` each time it is read (the callback reads it once a step):
    the test controls elapsed time without sleeping."""

    def __init__(self, seconds: float):
        self.seconds, self.now = seconds, 0.0

    def __call__(self) -> float:
        self.now += self.seconds
        return self.now


def test_exit_duration_saves_and_stops_at_the_first_step_past_the_limit(tmp_path, capsys):
    manager = CheckpointManager(str(tmp_path / "ckpt"), keep_last=0, log=lambda _: None)
    # 10 s a step against a limit of 0.5 min: steps end at 10, 20, 30 s, so step 3 is the last
    trainer = _trainer(tmp_path, [ExitDurationCallback(0.5, 0.0, _TickingClock(10.0)),
                                  CheckpointCallback(manager, 0, None)], steps=6)
    summary = trainer.fit()
    assert summary.steps == 3 and not summary.preempted
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000003"
    assert ("schedule.exit_duration_minutes: stopped after step 3, 0.50 min into the run "
            "(limit 0.5)") in capsys.readouterr().out


def _stop_on_the_slowest_ranks_clock(rank: int, store_path: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        run = Path(out, f"rank{rank}")
        # rank 1's clock runs twice as fast: alone it would stop at step 3 (60 s), rank 0 at 6
        clock = _TickingClock(20.0 if rank == 1 else 10.0)
        summary = _trainer(run, [ExitDurationCallback(1.0, 0.0, clock)], steps=8).fit()
        Path(out, f"rank{rank}.json").write_text(json.dumps(summary.steps))
    finally:
        dist.destroy_process_group()


def test_exit_duration_stops_every_rank_at_the_same_step(tmp_path):
    # two gloo processes whose clocks disagree, as ranks started seconds apart do
    torch.multiprocessing.spawn(_stop_on_the_slowest_ranks_clock,
                                args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [3, 3]


def test_checkpoint_callback_saves_by_interval_and_at_the_end_with_any_engine(tmp_path):
    root = tmp_path / "ckpt"
    manager = CheckpointManager(str(root), keep_last=2, log=lambda _: None)
    summary = _trainer(tmp_path, [CheckpointRecords(False), CheckpointCallback(manager, 2, None)],
                       steps=5).fit()
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000004", "iter_0000005", "latest"]
    assert summary.checkpoint == str(root / "iter_0000005")
    assert [r["step"] for r in _records(tmp_path, "checkpoint")] == [2, 4, 5]
    meta = read_meta(root / "iter_0000005")
    assert meta.engine == "linear" and meta.step == 5 and meta.consumed_samples == 40
    assert meta.files == {"weights.pt": (root / "iter_0000005" / "weights.pt").stat().st_size}
    assert defect(root / "iter_0000005") is None
    # the engine-agnostic load restores what it saved
    engine = LinearEngine(seed=99)
    state = load(engine, root / "iter_0000005", seed=0)
    assert (state.step, state.consumed_samples) == (5, 40)
    assert engine.parameters_digest() == _records(tmp_path, "end")[0]["params_sha256"]


def test_a_custom_callback_logs_its_own_metric_at_every_step(tmp_path):
    class WeightNorm(Callback):  # what a user writes, outside the library
        def on_step_end(self, trainer, event):
            norm = trainer.engine.module.weight.norm().item()
            trainer.reporter.event("weight_norm", event.step, value=norm)

    _trainer(tmp_path, [WeightNorm()], steps=4).fit()
    assert [r["step"] for r in _records(tmp_path, "weight_norm")] == [1, 2, 3, 4]
    assert all(r["value"] > 0 for r in _records(tmp_path, "weight_norm"))
