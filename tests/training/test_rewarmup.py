"""schedule.rewarmup_*: a second linear warm-up for a fresh optimizer started mid-schedule (the
second stage of two-stage training, issue 31). The end-to-end check (a second stage's logged LR)
is in test_init_from_architecture.py."""

import pytest
import torch

from megatron_iiet.errors import BadInput
from megatron_iiet.training.config import load_config
from megatron_iiet.training.engines import build_scheduler

SCHEDULE = ["schedule.train_steps=20", "schedule.warmup_steps=2", "optimizer.lr=1e-3",
            "optimizer.min_lr=1e-4"]


def _lrs(overrides: list[str], steps: range, resume_at: int = 0) -> dict[int, float]:
    """The LR each update in ``steps`` uses; ``resume_at``: a fresh scheduler taking over there,
    as a resumed run's does (only the step count comes from the checkpoint)."""
    cfg = load_config(None, SCHEDULE + overrides)
    scheduler = None
    lrs = {}
    for step in steps:
        if scheduler is None or step == resume_at + 1:
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
            scheduler = build_scheduler(cfg, optimizer)
            scheduler.num_steps = step - 1
        scheduler.step(increment=1)
        lrs[step] = optimizer.param_groups[0]["lr"]
    return lrs


def test_the_second_warm_up_ramps_from_its_start_and_then_follows_the_schedule():
    plain = _lrs([], range(1, 21))
    rewarmed = _lrs(["schedule.rewarmup_from=10", "schedule.rewarmup_steps=4"], range(1, 21))
    for step in range(1, 21):
        into = step - 10
        scale = into / 4 if 0 < into < 4 else 1.0
        assert rewarmed[step] == pytest.approx(plain[step] * scale, rel=1e-12), step
    assert rewarmed[11] == pytest.approx(plain[11] / 4) and rewarmed[14] == plain[14]


def test_a_resume_inside_the_ramp_continues_it():
    settings = ["schedule.rewarmup_from=10", "schedule.rewarmup_steps=4"]
    assert _lrs(settings, range(11, 21), resume_at=12) == _lrs(settings, range(11, 21))


@pytest.mark.parametrize("overrides, message", [
    (["schedule.rewarmup_from=10"], "give both"),
    (["schedule.rewarmup_steps=4"], "give both"),
    (["schedule.rewarmup_from=18", "schedule.rewarmup_steps=4"], "must end by train_steps"),
    (["schedule.rewarmup_from=-1", "schedule.rewarmup_steps=4"], "must be >= 0"),
])
def test_an_incomplete_or_overlong_second_warm_up_is_refused(overrides, message):
    with pytest.raises(BadInput, match=message):
        load_config(None, SCHEDULE + overrides)
