"""Asynchronous checkpoint saves are complete, atomic and resume exactly."""

import json

from tests.training.conftest import base_overrides, check_ok, launch, records, train_losses


def test_async_saves_resume_exactly(tiny_data, tmp_path):
    sync, split = tmp_path / "sync", tmp_path / "async"
    check_ok(launch(base_overrides(tiny_data, sync)))
    settings = {"checkpoint.async_save": True, "checkpoint.save_interval": 2,
                "checkpoint.keep_last": 2}
    check_ok(launch(base_overrides(tiny_data, split, **settings, **{"schedule.exit_interval": 4})))
    ckpts = split / "checkpoints"
    assert (ckpts / "latest").read_text() == "iter_0000004"
    for name in ("iter_0000002", "iter_0000004"):
        assert json.loads((ckpts / name / "meta.json").read_text())["step"] == int(name[5:])
    assert all(r["async_save"] for r in records(split, "checkpoint"))
    check_ok(launch(base_overrides(tiny_data, split, **settings)))
    assert records(split, "resume")[-1]["step"] == 4
    assert train_losses(split) == train_losses(sync)
    assert records(split, "end")[-1]["params_sha256"] == records(sync, "end")[-1]["params_sha256"]
    # keep_last=2: of the saves at steps 2, 4 and 6 only the newest two remain
    assert sorted(p.name for p in ckpts.iterdir()) == ["iter_0000004", "iter_0000006", "latest"]
