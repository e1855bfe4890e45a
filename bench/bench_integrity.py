"""What the integrity checks cost, beside what they guard, in one run.

    .venv/bin/python bench/bench_integrity.py [--shared ../shared/data] [--out outputs/bench_integrity]

1. Dataset verification before training: structure only, first full check (sha256 + token range),
   remembered check, against preprocessing the same data. Data: the 22 Gutenberg books of
   ../shared/data (paragraphs), a 4096-piece BPE tokenizer trained on them.
2. Checkpoint manifest: writing it at commit and checking a checkpoint's files against it, per
   checkpoint of the tiny model and of a 55M-parameter model-sized directory of random bytes.
3. Conversion's finiteness check (hf/checks.refuse_nonfinite) over tiny and 55M-parameter fp32
   weights, against reading those weights from safetensors.
Timings are medians of 5 (the first full verification: of 3 fresh copies).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def timed(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tool(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, capture_output=True, cwd=REPO,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - t0


def datasets(shared: Path, out: Path) -> list[tuple[str, str]]:
    from megatron_iiet.data import indexed_io
    from megatron_iiet.data.checksum_cache import verify_checksums_once

    books = shared / "gutenberg"
    tok, prefix = out / "tok", out / "data" / "gutenberg"
    shutil.rmtree(out, ignore_errors=True)
    tool("tools/train_tokenizer.py", "--input", str(books), "--output-dir", str(tok),
         "--vocab-size", "4096")
    preprocess = tool("tools/preprocess_data.py", "--input", str(books), "--text-unit",
                      "paragraph", "--tokenizer", str(tok / "tokenizer.model"), "--output-prefix",
                      str(prefix), "--workers", "1", "--no-progress")
    size = indexed_io.bin_path(prefix).stat().st_size + indexed_io.idx_path(prefix).stat().st_size
    time.sleep(2.5)  # checks of files written in the last 2 s are not remembered
    firsts = []
    for i in range(3):
        copy = out / f"copy{i}"
        copy.mkdir()
        for f in indexed_io.dataset_files(prefix):
            shutil.copy2(f, copy / f.name)
        time.sleep(2.5)
        t0 = time.perf_counter()
        verify_checksums_once(copy / prefix.name)
        firsts.append(time.perf_counter() - t0)
    structure = timed(lambda: indexed_io.verify_dataset(str(prefix)))
    verify_checksums_once(prefix)
    remembered = timed(lambda: verify_checksums_once(prefix))
    first = statistics.median(firsts)
    return [
        ("dataset: .bin + .idx", f"{size / 2**20:.1f} MiB"),
        ("preprocessing it (1 worker, CLI wall time)", f"{preprocess:.2f} s"),
        ("structure check only (verify_checksums=false)", f"{structure * 1e3:.1f} ms"),
        ("first full check: sha256 + token range", f"{first * 1e3:.1f} ms "
                                                  f"({size / first / 2**20:.0f} MiB/s)"),
        ("remembered check (same file versions)", f"{remembered * 1e3:.2f} ms"),
    ]


def checkpoints(out: Path) -> list[tuple[str, str]]:
    from megatron_iiet.training.checkpoint_index import defect, manifest

    rows = []
    for label, sizes in (("tiny model (3.2 MB, 4 files)", [2_900_000, 200_000, 60_000, 45_000]),
                         ("55M-param model + Adam (660 MB, 2 ranks' files)",
                          [330_000_000, 330_000_000, 300_000, 50_000, 50_000])):
        d = out / "ckpt" / "iter_0000001"
        shutil.rmtree(d.parent, ignore_errors=True)
        (d / "rng").mkdir(parents=True)
        for i, n in enumerate(sizes):
            (d / ("rng" if i >= len(sizes) - 2 else ".") / f"f{i}").write_bytes(os.urandom(n))
        files = manifest(d)
        import json

        (d / "meta.json").write_text(json.dumps({"step": 1, "files": files}))
        rows.append((f"manifest at commit, {label}", f"{timed(lambda: manifest(d)) * 1e3:.2f} ms"))
        rows.append((f"completeness check at resume, {label}",
                     f"{timed(lambda: defect(d)) * 1e3:.2f} ms"))
    return rows


def finiteness(out: Path) -> list[tuple[str, str]]:
    from safetensors.torch import load_file, save_file

    from megatron_iiet.hf.checks import refuse_nonfinite

    rows = []
    g = torch.Generator().manual_seed(0)
    for label, shapes in (("tiny (0.15M params)", [(512, 64)] + [(176, 64)] * 12 + [(64,)] * 9),
                          ("55M params", [(32000, 512)] + [(1408, 512)] * 36 + [(512, 512)] * 48)):
        tensors = {f"t{i}": torch.randn(*s, generator=g) for i, s in enumerate(shapes)}
        path = out / "weights.safetensors"
        save_file(tensors, str(path))
        read = timed(lambda: load_file(str(path)))
        check = timed(lambda: refuse_nonfinite(tensors, path, allow=False))
        fp16 = timed(lambda: refuse_nonfinite(tensors, path, allow=False, cast_to=torch.float16))
        rows.append((f"finiteness check, {label}", f"{check * 1e3:.2f} ms (with the fp16 range: "
                                                   f"{fp16 * 1e3:.2f} ms); reading the file: "
                                                   f"{read * 1e3:.1f} ms"))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shared", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--out", default=str(REPO / "outputs" / "bench_integrity"))
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    rows = datasets(Path(args.shared), out / "data") + checkpoints(out) + finiteness(out)
    print("| what | cost |\n|---|---|")
    for what, cost in rows:
        print(f"| {what} | {cost} |")


if __name__ == "__main__":
    main()
