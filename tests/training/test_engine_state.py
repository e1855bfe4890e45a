"""Engines own their state, the loss comes in through the Objective, and a custom callback plugs
into a real training run: all on the real tiny IIET, in a spawned gloo rank per engine."""

import pytest
import torch

from megatron_iiet.distributed import spawn_local
from megatron_iiet.training.callbacks import Callback

ENGINES = ("megatron", "deepspeed")


def _engine(engine_name, objective=None):
    from megatron_iiet.training.config import TrainConfig
    from megatron_iiet.training.engines import build_engine
    from tests.workers import build_tiny

    cfg = TrainConfig()
    cfg.parallel.engine = engine_name
    cfg.parallel.micro_batch_size, cfg.parallel.global_batch_size = 2, 4
    cfg.optimizer.lr = 3e-3
    return build_engine(cfg, build_tiny(("iiet", "history", None)), objective)


def state_round_trip(engine_name: str, directory: str) -> dict:
    """Two steps, save, a third step; a fresh engine loads the save and takes the third step."""
    from pathlib import Path

    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.training.checkpoint_meta import CheckpointMeta
    from megatron_iiet.training.engines import init_deepspeed_distributed
    from tests.workers import micro_batches

    if engine_name == "deepspeed":
        init_deepspeed_distributed()
    batches = [micro_batches(n=2, batch=2, seq=16, seed=s) for s in range(3)]
    seed_everything(1)
    engine = _engine(engine_name)
    for b in batches[:2]:
        engine.train_step(b)
    engine.save(Path(directory))
    meta = CheckpointMeta(**engine.state_meta(), step=2)
    third = engine.train_step(batches[2])
    after = engine.parameters_digest()

    seed_everything(2)  # a different start: everything must come from the save
    fresh = _engine(engine_name)
    before_load = fresh.parameters_digest()
    fresh.load(Path(directory), meta, seed=1234)
    again = fresh.train_step(batches[2])
    return {"loss": third.loss, "loss_after_load": again.loss, "lr": third.lr,
            "lr_after_load": again.lr, "digest": after, "digest_after_load":
            fresh.parameters_digest(), "fresh_differed": before_load != after}


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ENGINES)
def test_engine_state_round_trip_gives_the_same_next_step(engine, tmp_path):
    r = spawn_local(state_round_trip, 1, engine_name=engine, directory=str(tmp_path))[0]
    assert r["fresh_differed"]
    assert r["loss_after_load"] == r["loss"] and r["lr_after_load"] == r["lr"]
    assert r["digest_after_load"] == r["digest"]


def _constant_term(batch, per_token_loss):
    return torch.tensor(0.25)


def _scaled_lm_term(batch, per_token_loss):
    from megatron_iiet.training.step import masked_mean

    return 0.5 * masked_mean(per_token_loss, batch["loss_mask"])


def extra_loss_terms(engine_name: str) -> dict:
    """The same step with the plain objective, with a constant term added (same gradients) and
    with half the LM loss added (gradients x 1.5)."""
    from megatron_iiet.distributed import seed_everything
    from megatron_iiet.training.engines import init_deepspeed_distributed
    from megatron_iiet.training.step import Objective
    from tests.workers import micro_batches

    if engine_name == "deepspeed":
        init_deepspeed_distributed()
    out = {}
    for name, objective in (("plain", None),
                            ("constant", Objective({"constant": _constant_term})),
                            ("scaled", Objective({"half_lm": _scaled_lm_term}))):
        seed_everything(1)
        engine = _engine(engine_name, objective)
        r = engine.train_step(micro_batches(n=2, batch=2, seq=16))
        out[name] = {"loss": r.loss, "terms": r.terms, "digest": engine.parameters_digest()}
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ENGINES)
def test_extra_loss_terms_come_in_through_the_objective(engine):
    r = spawn_local(extra_loss_terms, 1, engine_name=engine)[0]
    plain, constant, scaled = r["plain"], r["constant"], r["scaled"]
    assert plain["terms"] == {}
    assert constant["terms"]["lm"] == plain["loss"] and constant["terms"]["constant"] == 0.25
    assert constant["loss"] == pytest.approx(plain["loss"] + 0.25, abs=1e-6)
    assert constant["digest"] == plain["digest"], "a constant term must not change the update"
    assert scaled["loss"] == pytest.approx(1.5 * plain["loss"], rel=1e-6)
    assert scaled["digest"] != plain["digest"]


class TokensSeen(Callback):
    """A user's callback, defined outside the library: logs a metric at every step."""

    def on_step_end(self, trainer, event):
        trainer.reporter.event("tokens_seen", event.step,
                               tokens=trainer.state.consumed_samples * 32)


def train_with_callback(overrides: list) -> dict:
    from megatron_iiet.training.config import load_config
    from megatron_iiet.run import train

    summary = train(load_config(None, overrides), callbacks=(TokensSeen(),))
    return {"steps": summary.steps}


@pytest.mark.distributed
def test_a_custom_callback_logs_a_metric_at_every_step_of_a_real_run(tiny_data, tmp_path):
    from tests.training.conftest import base_overrides, records

    log = tmp_path / "run"
    r = spawn_local(train_with_callback, 1, overrides=base_overrides(tiny_data, log))[0]
    assert r["steps"] == 6
    assert [(x["step"], x["tokens"]) for x in records(log, "tokens_seen")] == [
        (s, s * 4 * 32) for s in range(1, 7)]
