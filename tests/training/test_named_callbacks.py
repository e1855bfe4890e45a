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
