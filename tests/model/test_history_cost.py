"""The history's cost: O(1) kernels per pass plus O(1) per layer (counted by
bench/bench_history.py's dispatch counter), and the GPU step script runs (on CPU, tiny)."""

import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import bench_history  # noqa: E402


def _kernels(form: str, layers: int, iterations: int = 3) -> tuple[int, int]:
    config = bench_history.Config(16, torch.float32)
    model = [bench_history.Layer(config, n) for n in range(1, layers + 1)]
    x0 = torch.randn(8, 2, 16)
    counts, _ = bench_history.measure(form, model, x0, iterations, repeats=1)
    return counts["forward"][0], counts["backward"][0]


def test_buffered_history_kernels_grow_linearly_with_depth():
    k4, k6, k8 = (_kernels("buffered", n) for n in (4, 6, 8))
    for phase in (0, 1):  # forward, backward: the same count for every added layer
        assert k8[phase] - k6[phase] == k6[phase] - k4[phase], (k4, k6, k8)
    per_layer = (k8[0] + k8[1] - k6[0] - k6[1]) / 2
    assert per_layer <= 16 * 4, f"{per_layer} history kernels per layer of 4 passes"


def test_direct_history_kernels_grow_quadratically():
    d4, d6, d8 = (sum(_kernels("direct", n)) for n in (4, 6, 8))
    assert d8 - d6 > d6 - d4  # what the buffer removes: the counter sees it


def test_gpu_step_script_runs_on_cpu(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_step.py"), "--preset", "tiny", "--seq", "32",
         "--micro-batch", "1", "--vocab", "512", "--steps", "1", "--dtype", "float32",
         "--only", "vanilla,iiet r=3 all_passes", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    import json
    rows = json.loads(out.read_text())
    assert [r["label"] for r in rows] == ["vanilla", "iiet r=3 all_passes"]
    assert rows[1]["passes"] == 4.0 and rows[1]["step_s"] > 0
