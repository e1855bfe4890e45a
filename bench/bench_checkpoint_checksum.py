"""What the per-file checksums in a checkpoint's manifest cost: save and load of the 55m preset
(megatron engine, model + Adam state + RNG, fp32, 1 process), with and without them, side by
side in one process.

    .venv/bin/python bench/bench_checkpoint_checksum.py [--rounds 5 --out /tmp/bench_ckpt_sum]

"with": the trainer's save (each file hashed with xxh3-128 at commit, recorded in meta.json) and
load (every file compared with its checksum, then megatron's pickles read through
`safe_pickle.check_dist_checkpoint`, then the restore). "without": the same save with the
hashing left out (no checksums recorded), and the load of that checkpoint, which is what a
checkpoint written before checksums gets (sizes only; the pickle check still runs). A warm-up
round is not counted; then rounds alternate which goes first, so the page cache and the machine's
load hit both alike. Medians are printed, and the added work timed alone (hashing every file;
`verify_for_load`): on a busy machine the whole save and load vary by more than it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

from megatron_iiet.distributed import spawn_local


def measure(out: str, rounds: int, preset: str) -> dict:
    import torch

    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.training import checkpointing
    from megatron_iiet.training.checkpointing import CheckpointManager, TrainingState
    from megatron_iiet.training.config import (DataSection, ModelSection, TrainConfig,
                                               build_model_config)
    from megatron_iiet.training.engines import MegatronEngine

    cfg = TrainConfig(model=ModelSection(preset=preset), data=DataSection(seq_length=256))
    model = IIETGPTModel(build_model_config(cfg, 32000))
    engine = MegatronEngine(cfg, model)
    # one step, so that the optimizer state (Adam moments) exists and is saved
    tokens = torch.randint(0, 32000, (1, 257), generator=torch.Generator().manual_seed(0))
    engine.train_step([{"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
                        "loss_mask": torch.ones(1, 256)}])
    hashing = checkpointing.checksums
    times = {(kind, op): [] for kind in ("with", "without") for op in ("save", "load")}
    verify_s, hash_s = [], []
    size = 0
    for r in range(rounds + 1):  # round 0: warm-up (writer start-up, first allocations)
        for kind in ("with", "without") if r % 2 else ("without", "with"):
            root = Path(out) / kind
            shutil.rmtree(root, ignore_errors=True)
            manager = CheckpointManager(str(root), keep_last=0, log=lambda *_: None)
            checkpointing.checksums = hashing if kind == "with" else (lambda d, names: {})
            start = time.perf_counter()
            saved = manager.save(engine, TrainingState(step=1, consumed_samples=1),
                                 {"config": cfg.to_dict()})
            manager.close()
            save_s = time.perf_counter() - start
            checkpointing.checksums = hashing
            start = time.perf_counter()
            checkpointing.load(engine, saved, seed=0)
            load_s = time.perf_counter() - start
            if r == 0:
                continue
            times[(kind, "save")].append(save_s)
            times[(kind, "load")].append(load_s)
            if kind == "with":
                size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
                t0 = time.perf_counter()
                checkpointing.verify_for_load(saved)
                verify_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                hashing(saved, list(checkpointing.manifest(saved)))
                hash_s.append(time.perf_counter() - t0)
    return {"median": {k: statistics.median(v) for k, v in times.items()},
            "verify_s": statistics.median(verify_s), "hash_s": statistics.median(hash_s),
            "bytes": size,
            "params": sum(p.numel() for p in model.parameters())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--preset", default="55m")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="/tmp/bench_checkpoint_checksum")
    args = p.parse_args(argv)
    r = spawn_local(measure, 1, threads_per_rank=args.threads, timeout_s=3600, out=args.out,
                    rounds=args.rounds, preset=args.preset)[0]
    shutil.rmtree(args.out, ignore_errors=True)
    m = r["median"]
    print(f"preset {args.preset}: {r['params'] / 1e6:.1f}M parameters, checkpoint "
          f"{r['bytes'] / 2**20:.0f} MiB, {args.threads} thread(s), median of {args.rounds}\n")
    print("| | save s | load s |")
    print("|---|---|---|")
    for kind in ("without", "with"):
        print(f"| {kind} checksums | {m[(kind, 'save')]:.3f} | {m[(kind, 'load')]:.3f} |")
    print(f"| difference | {m[('with', 'save')] - m[('without', 'save')]:+.3f} | "
          f"{m[('with', 'load')] - m[('without', 'load')]:+.3f} |")
    print(f"\nthe added work alone, median of {args.rounds}:")
    print(f"- at save, hashing every file (one rank): {r['hash_s']:.3f} s "
          f"({r['bytes'] / r['hash_s'] / 2**30:.1f} GiB/s)")
    print(f"- at load, verify_for_load (every checksum + the pickle check): {r['verify_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
