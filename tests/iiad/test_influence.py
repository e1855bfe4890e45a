"""Iteration influence (spec 6.1): an iteration made a no-op has influence 0 (and relative update
0) and the planner drops it; the result does not depend on how the ablations are spread (DP=2)
or on the layout (PP=2); the tool runs end to end under torchrun and its plan is a config the
trainer accepts; bad input is one line and exit 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forked import run_script
from torch import nn

from megatron_iiet.distributed import spawn_local
from tests.training.conftest import base_overrides, check_ok, launch

REPO = Path(__file__).resolve().parents[2]
PLAN = [2, 2, 2, 2]
NOOP_LAYER = 3  # its last iteration returns the state it would replace

pytestmark = pytest.mark.distributed


class LastIterationRepeats(nn.Module):
    """A corrector norm whose r-th call per forward returns the layer's previous state: the
    layer's last iteration changes nothing, so running one iteration fewer is the same model."""

    def __init__(self, norm, predictor_norm, iterations):
        super().__init__()
        self.norm, self.iterations = norm, iterations
        self.calls, self.previous = 0, None
        predictor_norm.register_forward_hook(self._start)

    def _start(self, _module, _inputs, state):
        self.calls, self.previous = 0, state

    def forward(self, z):
        self.calls += 1
        if self.calls == self.iterations:
            return self.previous
        self.previous = self.norm(z)
        return self.previous


def influence_of_tiny(noop: bool):
    from megatron_iiet.iiad.influence import measure_influence
    from tests.workers import build_tiny, micro_batches

    model = build_tiny(("iiet", "history", PLAN)).eval()
    for layer in model.decoder.layers:
        if noop and layer.layer_number == NOOP_LAYER:
            h = layer.history
            h.corrector_norm = LastIterationRepeats(h.corrector_norm, h.predictor_norm,
                                                    layer.iterations)
    return measure_influence(model, micro_batches(2), PLAN, history_form=True)


@pytest.fixture(scope="module")
def single():
    return spawn_local(influence_of_tiny, 1, noop=True)[0]


def test_a_no_op_iteration_has_no_influence_and_is_dropped(single):
    from megatron_iiet.iiad.planner import Planner
    from megatron_iiet.model.config import preset

    base, influence, relative = single
    last = PLAN[NOOP_LAYER - 1]
    assert influence[NOOP_LAYER - 1][last - 1] == 0.0  # the same computation: exactly
    assert relative[NOOP_LAYER - 1][last - 1] == 0.0
    others = [v for layer, row in enumerate(influence) for i, v in enumerate(row)
              if (layer, i) != (NOOP_LAYER - 1, last - 1)]
    assert all(v != 0.0 for v in others) and all(r > 0 for row in relative for r in row
                                                 if r != relative[NOOP_LAYER - 1][last - 1])
    tau = min(abs(v) for v in others) / 2
    plan = Planner(influence, preset("tiny", architecture="iiet", iterations=PLAN), 32).plan(tau)
    assert plan.iterations[NOOP_LAYER - 1] < last


@pytest.mark.parametrize("world,pp", [(2, 1), (2, 2)], ids=["dp2", "pp2"])
def test_influence_does_not_depend_on_the_layout(single, world, pp):
    base, influence, relative = single
    got = spawn_local(influence_of_tiny, world, 1, pp, noop=True)
    for rank in got:  # every rank has the whole result
        b, inf, rel = rank
        assert abs(b - base) <= 1e-6 * abs(base)
        for row, ref in zip(inf, influence):
            assert all(abs(x - y) <= 1e-6 for x, y in zip(row, ref)), (row, ref)
        for row, ref in zip(rel, relative):
            assert all(abs(x - y) <= 1e-5 * max(abs(y), 1e-6) for x, y in zip(row, ref))


@pytest.fixture(scope="module")
def trained_iiet(tmp_path_factory):
    from megatron_iiet.data.prepare import prepare_builtin_corpus

    data = prepare_builtin_corpus(str(tmp_path_factory.mktemp("iiad_data")), vocab_size=512,
                                  corpus_size="256KB")
    log_dir = tmp_path_factory.mktemp("iiad_run") / "run"
    check_ok(launch(base_overrides(data, log_dir, **{"model.architecture": "iiet",
                                                     "model.max_iterations": 2,
                                                     "schedule.train_steps": 4})))
    return log_dir / "checkpoints", data


def _tool(name, *args, nproc=1):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if nproc == 1:  # forked from this process when it can be (tests/forked.py)
        return run_script(REPO / "tools" / name, args, cwd=REPO, env=env, timeout=600)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", str(REPO / "tools" / name),
                           *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=env)


def _one_line_error(proc, words: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], proc.stderr[-2000:]


def test_influence_tool_and_plan_end_to_end(trained_iiet, tmp_path):
    from megatron_iiet.training.config import load_config

    ckpt, data = trained_iiet
    out = tmp_path / "influence"
    proc = _tool("iiad_influence.py", "--checkpoint", ckpt, "--data", data.data_prefix,
                 "--batches", 2, "--batch-size", 2, "--seq-length", 32, "--output", out,
                 "--no-progress", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "influence.json").read_text())
    assert len(report["influence"]) == 4 and all(len(r) == 2 for r in report["influence"])
    assert len(report["relative_update"]) == 4 and report["calibration"]["world_size"] == 2
    assert (out / "influence.png").stat().st_size > 1000 and (out / "influence.md").is_file()

    config = tmp_path / "e-iiet.yaml"
    proc = _tool("iiad_plan.py", "--influence", out, "--target-passes", 9, "--output", config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(config.with_suffix(".json").read_text())
    assert plan["passes"] <= 9 and sum(plan["iterations"]) > 0
    cfg = load_config(str(config))  # what pretrain_iiet.py --config reads
    assert cfg.model.iterations == plan["iterations"]
    assert cfg.checkpoint.load == "auto" and Path(cfg.checkpoint.init_from).exists()
    assert [t.checkpoint for t in cfg.distill.teachers] == [cfg.checkpoint.init_from]
    proc = _tool("iiad_plan.py", "--influence", out, "--target-passes", 9, "--output", config,
                 "--no-distill", "--train-steps", 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = load_config(str(config))
    assert cfg.distill.teachers == [] and cfg.schedule.train_steps == 3

    proc = _tool("iiad_plan.py", "--influence", out, "--threshold", 1e9, "--output", config)
    _one_line_error(proc, "drops every iteration")
    proc = _tool("iiad_influence.py", "--checkpoint", ckpt, "--data", tmp_path / "missing",
                 "--output", out)
    _one_line_error(proc, "missing")
