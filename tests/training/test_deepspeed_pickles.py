"""DeepSpeed reads its own checkpoint files with weights_only=False inside its code: a pickle
planted there is refused (one line naming the file) before DeepSpeed reads it, and its code
never runs; an honest DeepSpeed checkpoint still resumes (test_resume_and_engines.py, ZeRO-1
on 2 ranks, goes through the same check)."""

import torch

from tests.training.conftest import base_overrides, check_ok, launch
from tests.training.faults import Payload, forge_manifest, one_line_error

SETTINGS = {"parallel.engine": "deepspeed", "parallel.zero_stage": 1,
            "schedule.train_steps": 2, "schedule.warmup_steps": 1, "checkpoint.save_interval": 2}


def test_a_pickle_planted_in_deepspeeds_files_is_refused_and_does_not_run(tiny_data, tmp_path):
    run = tmp_path / "run"
    check_ok(launch(base_overrides(tiny_data, run, **SETTINGS)))
    ckpt = run / "checkpoints" / "iter_0000002"
    optim = next((ckpt / "deepspeed").rglob("*optim_states.pt"))
    marker = tmp_path / "payload-ran"
    state = torch.load(optim, weights_only=False)  # the test's own file: trusted here
    state["planted"] = Payload(marker)
    torch.save(state, optim)
    forge_manifest(ckpt)  # as whoever planted it would: only reading the pickle can tell
    proc = launch(base_overrides(tiny_data, run, **{**SETTINGS, "schedule.train_steps": 4}))
    one_line_error(proc, f"{optim}: refusing to unpickle it")
    assert not marker.exists(), "the planted code ran"
