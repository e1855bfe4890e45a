"""examples/step_probe.py on a tiny one-run sweep that saves every step: the AdamW update it
rebuilds from a checkpoint's moments is the update training took to reach it (checkpoint k+1's
moments and step count, the LR of step k+1, weight decay on the matrices: theta_k -
theta_{k+1}), and the probe's output-space speed does not depend on the probe LR while it is
small."""

import json
import subprocess
import sys

import torch

from tests.sweep.conftest import ENV, REPO, launch_iiet_cell

STEPS = 8


def test_the_rebuilt_update_is_the_step_training_took_and_the_speed_is_eta_free(
        tmp_path, tiny_data):
    sweep, run = launch_iiet_cell(tmp_path, tiny_data, STEPS, 2, **{
        "eval.interval": 4, "logging.log_interval": 1, "checkpoint.keep_last": STEPS + 1,
        "checkpoint.save_interval": 1, "optimizer.weight_decay": 0.1})
    output = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "step_probe.py"), str(sweep),
                           run.name, "--eta", "1e-5", "2e-5", "--batches", "1",
                           "--batch-size", "2", "--output", str(output)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    probed = json.loads(output.read_text())[run.name]
    assert [c["step"] for c in probed["checkpoints"]] == list(range(1, STEPS))  # not the last
    for ck in probed["checkpoints"]:
        groups = {r["group"] for r in ck["rows"]}
        assert groups == {"all", "embedding", "blocks", "other"}
        for group in groups:
            small, large = [r for r in ck["rows"] if r["group"] == group]
            assert small["kl"] > 0 and large["kl"] > 0
            assert abs(large["speed"] / small["speed"] - 1) < 0.02, (ck["step"], group)
        assert -1 <= ck["descent_cosine"] <= 1 and ck["descent_cosine"] != 0
        # 2 layers: rows of length 2 and 3 (S_0..S_l), pop and refine
        assert sorted(len(row) for row in ck["history"].values()) == [2, 2, 3, 3]
    assert f"| {run.name} | 4 |" in proc.stdout

    sys.path.insert(0, str(REPO / "examples"))
    try:
        from step_probe import adam_direction, checkpoint_keys
    finally:
        sys.path.remove(str(REPO / "examples"))
    from megatron_iiet.eval.checkpoint import load_for_inference
    from megatron_iiet.hf.megatron_model import one_process_group

    lr = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text()
                                          .splitlines()) if r["kind"] == "train"}
    ckpts = run / "checkpoints"
    with one_process_group():
        for k in (3, 6):
            before = load_for_inference(ckpts / f"iter_{k:07d}", with_tokenizer=False).model
            after = load_for_inference(ckpts / f"iter_{k + 1:07d}", with_tokenizer=False).model
            theta = {n: p.detach() for n, p in before.named_parameters()}
            update = adam_direction(ckpts / f"iter_{k + 1:07d}", theta, checkpoint_keys(before))
            for name, p in after.named_parameters():
                taken = theta[name] - p.detach()
                assert torch.allclose(taken, lr[k + 1] * update[name], rtol=1e-4,
                                      atol=1e-7), (k, name)
