"""Checkpoint conversion benchmark: wall time and peak RSS of megatron -> HF (from TP=1 and TP=2
checkpoints written by the trainer's checkpoint code, optimizer state included) and of
HF -> megatron (TP=1), for the spec's model sizes.

    python bench/bench_convert.py --presets 55m --tp 1 2 [--out outputs/bench_convert]

Each measured conversion runs in its own fresh process (its peak RSS is that process's
ru_maxrss; HF -> megatron at TP>1 would add its spawned ranks, reported separately). The
source checkpoints are IIET (history form, r=3) with random weights, fp32, no tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def write_checkpoint(root: str, preset: str) -> None:
    """Inside the spawned ranks: an IIET model of `preset` saved by CheckpointManager."""
    from megatron.core import parallel_state as ps

    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.model.sharding import init_layout_independent
    from megatron_iiet.training.checkpointing import CheckpointManager, TrainingState
    from megatron_iiet.training.config import ModelSection, ParallelSection, TrainConfig
    from megatron_iiet.training.engines import MegatronEngine
    from megatron_iiet.training.config import build_model_config

    tp = ps.get_tensor_model_parallel_world_size()
    cfg = TrainConfig(model=ModelSection(preset=preset),
                      parallel=ParallelSection(tensor=tp, micro_batch_size=1, global_batch_size=1))
    model = IIETGPTModel(build_model_config(cfg, 32000))
    init_layout_independent(model, seed=1)
    engine = MegatronEngine(cfg, model)
    manager = CheckpointManager(root, keep_last=1)
    manager.save(engine, TrainingState(step=1), {"config": cfg.to_dict()})
    manager.close()


def measure(direction: str, src: str, dst: str) -> dict:
    """Runs in a fresh process: one conversion, its time and this process's peak RSS."""
    from megatron_iiet.hf.convert import export_to_hf, import_from_hf

    start = time.perf_counter()
    if direction == "megatron-to-hf":
        export_to_hf(src, dst, with_tokenizer=False, force=True)
    else:
        import_from_hf(src, dst, force=True)
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"seconds": seconds, "peak_rss_mb": peak_mb, "children_peak_rss_mb": children_mb}


def _measure_in_fresh_process(direction: str, src: Path, dst: Path) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    wall = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--measure", direction, str(src), str(dst)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_seconds"] = time.perf_counter() - wall  # + python/torch/megatron import
    return result


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["55m"])
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    p.add_argument("--out", default="outputs/bench_convert")
    p.add_argument("--measure", nargs=3, metavar=("DIRECTION", "SRC", "DST"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return 0

    from megatron_iiet.distributed import spawn_local

    out = Path(args.out)
    rows = []
    for preset in args.presets:
        for tp in args.tp:
            ckpt, hf, back = (out / f"{preset}-tp{tp}-{kind}" for kind in ("ckpt", "hf", "meg"))
            shutil.rmtree(ckpt, ignore_errors=True)
            spawn_local(write_checkpoint, tp, tp, 1, timeout_s=1800, threads_per_rank=1,
                        root=str(ckpt), preset=preset)
            to_hf = _measure_in_fresh_process("megatron-to-hf", ckpt, hf)
            rows.append({"preset": preset, "direction": f"megatron TP={tp} -> HF",
                         "source_mb": _size_mb(ckpt), "output_mb": _size_mb(hf), **to_hf})
            print(json.dumps(rows[-1]), flush=True)
            if tp == 1:
                to_meg = _measure_in_fresh_process("hf-to-megatron", hf, back)
                rows.append({"preset": preset, "direction": "HF -> megatron TP=1",
                             "source_mb": _size_mb(hf), "output_mb": _size_mb(back), **to_meg})
                print(json.dumps(rows[-1]), flush=True)
    print("\n| preset | conversion | source MB | output MB | convert s | process wall s | "
          "peak RSS MB |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['direction']} | {r['source_mb']:.0f} | {r['output_mb']:.0f} "
              f"| {r['seconds']:.1f} | {r['process_wall_seconds']:.1f} | {r['peak_rss_mb']:.0f} |")
    return 0


if __name__ == "__main__":  # the guard matters: dist_checkpointing's writer re-imports __main__
    sys.exit(main())
