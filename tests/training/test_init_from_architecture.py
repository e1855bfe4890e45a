"""Two-stage training (issue 31): ``checkpoint.init_from`` a vanilla checkpoint into an IIET
run. The layer weights map one to one and are taken; what IIET adds (each layer's history)
starts from its initialisation; anything that does not map is refused in one line."""

from pathlib import Path

import pytest
import torch

from tests.training.conftest import base_overrides, check_ok, launch

pytestmark = pytest.mark.distributed  # pretrain_iiet.py in fresh processes

TINY_LR = {"optimizer.lr": 1e-6, "optimizer.min_lr": 1e-7}  # weights move by < 3e-6 in 2 steps


@pytest.fixture(scope="module")
def stages(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("two_stage")
    vanilla = root / "vanilla"
    check_ok(launch(base_overrides(tiny_data, vanilla, **{"model.architecture": "vanilla",
                                                          "schedule.train_steps": 4})))
    iiet = root / "iiet"
    proc = launch(base_overrides(tiny_data, iiet, **{
        "model.architecture": "iiet", "checkpoint.init_from": str(vanilla / "checkpoints"),
        "schedule.train_steps": 2, "schedule.warmup_steps": 1, **TINY_LR}))
    check_ok(proc)
    return vanilla, iiet, proc


def _weights(run: Path) -> tuple[dict[str, torch.Tensor], object]:
    """(parameters, model config) of a run's newest checkpoint; inside one_process_group."""
    from megatron_iiet.eval.checkpoint import load_for_inference

    model = load_for_inference(run / "checkpoints", with_tokenizer=False).model
    return {n: p.detach().clone() for n, p in model.named_parameters()}, model.config


def test_vanilla_weights_go_into_iiet_and_the_history_starts_fresh(stages):
    from megatron_iiet.hf.megatron_model import one_process_group
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.model.sharding import init_layout_independent

    vanilla_run, iiet_run, proc = stages
    assert "weights of this architecture start from their initialisation" in proc.stdout
    assert "decoder.layers.*.history.pop_weight" in proc.stdout
    with one_process_group():
        vanilla, _ = _weights(vanilla_run)
        iiet, iiet_config = _weights(iiet_run)
        fresh = IIETGPTModel(iiet_config)
        init_layout_independent(fresh, 1234)
        initial = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    taken = [n for n in iiet if n in vanilla]
    added = [n for n in iiet if n not in vanilla]
    assert taken and added and all(".history." in n for n in added)
    for name in taken:  # vanilla's trained weights, moved by at most 2 steps of lr 1e-6
        assert torch.allclose(iiet[name], vanilla[name], atol=5e-6, rtol=0), name
    moved = max((vanilla[n] - initial[n]).abs().max().item() for n in taken)
    assert moved > 1e-3  # so the check above could tell vanilla's weights from a fresh start
    for name in added:
        assert torch.allclose(iiet[name], initial[name], atol=5e-6, rtol=0), name


def test_weights_with_no_place_in_the_model_are_refused_in_one_line(stages, tiny_data, tmp_path):
    _, iiet_run, _ = stages
    proc = launch(base_overrides(tiny_data, tmp_path / "back_to_vanilla", **{
        "model.architecture": "vanilla", "checkpoint.init_from": str(iiet_run / "checkpoints")}))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "have no place in this model" in lines[0] and "history" in lines[0], lines[0]


def test_another_shape_or_a_resume_across_architectures_is_still_refused(stages, tiny_data,
                                                                        tmp_path):
    vanilla_run, _, _ = stages
    wider = launch(base_overrides(tiny_data, tmp_path / "wider", **{
        "model.architecture": "iiet", "model.hidden_size": 96,
        "checkpoint.init_from": str(vanilla_run / "checkpoints")}))
    assert wider.returncode == 2 and "hidden_size" in wider.stderr, wider.stderr[-3000:]
    resume = launch(base_overrides(tiny_data, tmp_path / "resume", **{
        "model.architecture": "iiet", "checkpoint.load": str(vanilla_run / "checkpoints")}))
    assert resume.returncode == 2 and "checkpoint.init_from" in resume.stderr, \
        resume.stderr[-3000:]


def test_a_second_stage_continues_the_first_stages_step_schedule_and_samples(tiny_data,
                                                                             tmp_path):
    """checkpoint.init_from_position: IIET takes up a vanilla run at its step 3 of 6; the LR of
    every later step is the one the vanilla run had there, and the samples go on from step 3."""
    from megatron_iiet.training.checkpoint_index import read_meta
    from tests.training.conftest import records

    first = tmp_path / "vanilla"
    common = {"schedule.train_steps": 6, "checkpoint.save_interval": 3}
    check_ok(launch(base_overrides(tiny_data, first, **{"model.architecture": "vanilla",
                                                        **common})))
    second = tmp_path / "iiet"
    proc = launch(base_overrides(tiny_data, second, **{
        "model.architecture": "iiet", **common, "checkpoint.init_from_position": True,
        "checkpoint.init_from": str(first / "checkpoints" / "iter_0000003")}))
    check_ok(proc)
    assert "and its position, step 3 (fresh optimizer)" in proc.stdout
    vanilla_lr = {r["step"]: r["lr"] for r in records(first, "train")}
    iiet_lr = {r["step"]: r["lr"] for r in records(second, "train")}
    assert sorted(iiet_lr) == [4, 5, 6]
    assert all(iiet_lr[s] == pytest.approx(vanilla_lr[s], rel=1e-12) for s in iiet_lr)
    [resume] = records(second, "resume")
    assert resume["step"] == 3 and resume["model_only"]
    [end] = records(second, "end")
    assert end["step"] == 6 and end["finished"]
    consumed = [read_meta(run / "checkpoints" / "iter_0000006").consumed_samples
                for run in (first, second)]
    assert consumed[0] == consumed[1] == 6 * 4  # not 3 x 4: the stream went on from step 3
    # with a second warm-up of 2 updates the first update after the switch takes half the LR
    rewarmed = tmp_path / "iiet_rewarmed"
    check_ok(launch(base_overrides(tiny_data, rewarmed, **{
        "model.architecture": "iiet", **common, "checkpoint.init_from_position": True,
        "checkpoint.init_from": str(first / "checkpoints" / "iter_0000003"),
        "schedule.rewarmup_from": 3, "schedule.rewarmup_steps": 2})))
    rewarmed_lr = {r["step"]: r["lr"] for r in records(rewarmed, "train")}
    assert rewarmed_lr[4] == pytest.approx(vanilla_lr[4] / 2, rel=1e-12)
    assert all(rewarmed_lr[s] == pytest.approx(vanilla_lr[s], rel=1e-12) for s in (5, 6))


def test_init_from_position_without_init_from_is_refused(tiny_data, tmp_path):
    proc = launch(base_overrides(tiny_data, tmp_path / "run",
                                 **{"checkpoint.init_from_position": True}))
    assert proc.returncode == 2 and "needs checkpoint.init_from" in proc.stderr, proc.stderr
