"""Callbacks named in a run's config (issue 30): a user's class, outside the package, runs in
the loop with the arguments the config gives it; one that does not resolve is refused in one
line before anything is trained."""

import pytest

from tests.training.conftest import base_overrides, check_ok, launch, records

pytestmark = pytest.mark.distributed  # pretrain_iiet.py in a fresh process

USER_CLASS = "tests.training.user_callbacks.TokensSeen"


def test_a_callback_named_in_the_config_runs(tiny_data, tmp_path):
    run = tmp_path / "run"
    check_ok(launch(base_overrides(tiny_data, run, **{
        "callbacks.tokens.class": USER_CLASS, "callbacks.tokens.tokens_per_sample": 32})))
    seen = records(run, "tokens_seen")
    assert [r["step"] for r in seen] == list(range(1, 7))
    assert [r["tokens"] for r in seen] == [4 * 32 * s for s in range(1, 7)]  # 4 samples a step


@pytest.mark.parametrize("overrides, named", [
    ({"callbacks.tokens.class": "tests.training.user_callbacks.Missing"}, "cannot import"),
    ({"callbacks.tokens.class": "tests.training.conftest.launch"}, "is not a"),
    ({"callbacks.tokens.class": USER_CLASS}, "does not take"),  # tokens_per_sample missing
    ({"callbacks.tokens.class": "TokensSeen"}, "a dotted path"),
])
def test_a_callback_that_does_not_resolve_is_one_line(tiny_data, tmp_path, overrides, named):
    proc = launch(base_overrides(tiny_data, tmp_path / "run", **overrides))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and named in lines[0], proc.stderr[-2000:]
    assert not list((tmp_path / "run").glob("checkpoints/iter_*"))  # nothing was trained


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_a_callback_sees_the_reduced_unclipped_gradients_before_the_step(tiny_data, tmp_path,
                                                                         engine):
    """on_before_optimizer_step + Engine.gradients: with clipping at 0.01 (every step clipped)
    the norm a callback computes is the step's own pre-clipping norm, on both engines."""
    run = tmp_path / "run"
    check_ok(launch(base_overrides(tiny_data, run, **{
        "parallel.engine": engine, "optimizer.clip_grad": 0.01,
        "callbacks.gn.class": "tests.training.user_callbacks.GradNormSeen"})))
    seen = {r["step"]: r["norm"] for r in records(run, "grad_norm_seen")}
    reported = {r["step"]: r["grad_norm"] for r in records(run, "train")}
    assert sorted(seen) == list(range(1, 7))
    for step, norm in seen.items():
        assert norm > 0.01 and norm == pytest.approx(reported[step], rel=1e-4), (step, norm)
