"""In-loop task evaluation during pretraining: eval.tasks scored on the live TP=2 model at the
configured steps, in metrics.jsonl and TensorBoard; a run resumed between two evaluations logs
the same metrics as the uninterrupted one."""

import pytest

from tests.eval.conftest import TASKS_INTERVAL, TRAIN_STEPS, copy_run_until, require_task_data, run_overrides
from tests.training.conftest import check_ok, launch, records, train_losses

METRICS = ("lambada_openai/acc", "lambada_openai/perplexity", "piqa/acc", "piqa/acc_norm")


def _task_records(log_dir):
    return {r["step"]: {k: v for k, v in r.items() if k not in ("time", "seconds")}
            for r in records(log_dir, "tasks")}


@pytest.mark.distributed
def test_tasks_logged_at_the_configured_steps(trained):
    require_task_data()
    logged = _task_records(trained[0])
    assert sorted(logged) == list(range(TASKS_INTERVAL, TRAIN_STEPS + 1, TASKS_INTERVAL))
    for step, metrics in logged.items():
        for name in METRICS:
            assert isinstance(metrics[name], float), (step, name)
    assert 0 <= logged[TRAIN_STEPS]["piqa/acc"] <= 1
    assert logged[TRAIN_STEPS] != logged[TASKS_INTERVAL]  # the model changed in between

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(trained[0] / "tensorboard"))
    board.Reload()
    events = board.Scalars("tasks/piqa/acc")
    assert [e.step for e in events] == sorted(logged)
    assert [e.value for e in events] == pytest.approx([logged[s]["piqa/acc"] for s in sorted(logged)])


@pytest.mark.distributed
@pytest.mark.slow
def test_resumed_run_logs_the_same_task_metrics(trained, tmp_path):
    require_task_data()
    resumed = copy_run_until(trained, TASKS_INTERVAL, tmp_path / "run")
    check_ok(launch(run_overrides(trained[2], resumed, **{"logging.tensorboard": False}), nproc=2))
    again, first = _task_records(resumed), _task_records(trained[0])
    assert sorted(again) == [s for s in sorted(first) if s > TASKS_INTERVAL]
    for step in again:
        assert again[step] == first[step], step
    losses = train_losses(resumed)
    reference = train_losses(trained[0])
    assert {s: losses[s] for s in losses} == {s: reference[s] for s in losses}
