"""IIAD offline teachers: a teacher's top-k logits over a distillation run's training data.

    torchrun --nproc-per-node 2 tools/precompute_teacher_logits.py --config e-iiet.yaml \
        --checkpoint runs/iiet/checkpoints --output teacher_logits/iiet --top-k 32 --dtype bf16

The training dataset is the one the run given by ``--config`` (plus ``--set`` overrides) reads,
in its own sample order, for its whole schedule (``--samples`` to cover fewer or more). The
teacher loads at ``--tp``/``--pp`` (resharded) and runs data-parallel over the remaining ranks;
``--slice I/N`` (e.g. a SLURM array task) takes every N-th shard from the I-th. Shards are
written atomically: a killed run is resumed by running it again, which computes the missing
shards only. The run then reads them with ``distill.teachers: [{logits: OUTPUT, weight: 1}]``.
Format and the top-k KL: megatron_iiet/iiad/teacher_logits.py, docs/iiad.md.
"""

import argparse
import json
import sys
from pathlib import Path

from megatron_iiet.cli import run_tool
from megatron_iiet.errors import OperatorError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the distillation run's config (its data)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, as for pretrain_iiet.py (repeatable)")
    p.add_argument("--checkpoint", required=True, help="the teacher: iter_* folder or a root")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                   help="storage type of the values (ids are int32)")
    p.add_argument("--samples", type=int, default=None,
                   help="default: train_steps x global_batch_size of the config")
    p.add_argument("--shard-samples", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="samples per teacher forward")
    p.add_argument("--slice", default="0/1", help="I/N: this task takes shards I, I+N, ...")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_slice(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise OperatorError(f"--slice {text!r}: expected I/N, e.g. 0/4") from None
    if n < 1 or not 0 <= i < n:
        raise OperatorError(f"--slice {text}: needs 0 <= I < N")
    return i, n


def main(argv=None) -> int:
    return run_tool(run, build_parser().parse_args(argv), distributed=True)


def _index(args, cfg, dataset, tokenizer, teacher, samples: int) -> dict:
    from megatron_iiet.iiad.teacher_logits import FORMAT, dataset_identity

    return {"format": FORMAT, "num_samples": samples, "shard_samples": args.shard_samples,
            "num_shards": -(-samples // args.shard_samples), "top_k": args.top_k,
            "dtype": args.dtype,
            "dataset": dataset_identity(dataset, tokenizer.fingerprint),
            "data": {"train": cfg.data.train, "seq_length": cfg.data.seq_length,
                     "seed": cfg.seed},
            "teacher": {"checkpoint": str(Path(teacher.path).resolve()),
                        "step": teacher.meta.step,
                        "architecture": teacher.meta.signature_value("architecture"),
                        "vocab_size": teacher.meta.vocab_size}}


def _write_index(root: Path, index: dict) -> None:
    """Rank 0: the index first (a rerun finds the same one; another dataset or teacher is
    refused rather than mixed into the same folder)."""
    from megatron_iiet.data.atomic import write_json_atomic

    path = root / "index.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved != index:
            diffs = sorted(k for k in set(saved) | set(index) if saved.get(k) != index.get(k))
            raise OperatorError(f"--output {root}: holds logits of another run or teacher "
                                f"(differs in {', '.join(diffs)}); use another folder")
        return
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, index)


def run(args) -> int:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_iiet.data.atomic import temp_leftovers, write_bytes_atomic
    from megatron_iiet.data.prepare import builtin_corpus
    from megatron_iiet.distributed import barrier, initialize, on_rank0
    from megatron_iiet.eval.checkpoint import load_for_inference
    from megatron_iiet.iiad.kl import vocab_parallel_topk
    from megatron_iiet.iiad.teacher_logits import DTYPES, shard_bytes, shard_name
    from megatron_iiet.platform import compute_device
    from megatron_iiet.training.checkpoint_meta import check_tokenizer
    from megatron_iiet.training.config import load_config, padded_vocab_size
    from megatron_iiet.training.data import build_datasets, resolve_sources
    from megatron_iiet.training.step import forward_only

    first_task, tasks = parse_slice(args.slice)
    for name in ("top_k", "shard_samples", "batch_size"):
        if getattr(args, name) < 1:
            raise OperatorError(f"--{name.replace('_', '-')}: must be >= 1")
    try:
        cfg = load_config(args.config, args.set)
    except ValueError as err:
        raise OperatorError(f"--config {args.config}: {err}") from None
    initialize(args.tp, args.pp, seed=cfg.seed)
    try:
        sources = resolve_sources(cfg, builtin_corpus(cfg.data, dist.get_rank()))
        train_ds, _ = build_datasets(cfg, sources)
    except ValueError as err:
        raise OperatorError(f"--config {args.config}: {err}") from None
    try:
        teacher = load_for_inference(args.checkpoint, with_tokenizer=False)
    except ValueError as err:
        raise OperatorError(f"--checkpoint: {err}") from None
    student_vocab = padded_vocab_size(sources.tokenizer.vocab_size)
    if teacher.meta.vocab_size != student_vocab:
        raise OperatorError(f"--checkpoint {teacher.path}: vocabulary "
                            f"{teacher.meta.vocab_size} vs the run's {student_vocab}")
    check_tokenizer(teacher.meta.tokenizer_fingerprint, sources.tokenizer.fingerprint,
                    f"--checkpoint {teacher.path} (the run's data)", OperatorError)
    samples = args.samples or cfg.schedule.train_steps * cfg.parallel.global_batch_size
    if samples > len(train_ds):
        raise OperatorError(f"--samples {samples}: the run's dataset has {len(train_ds)}")
    if args.top_k > student_vocab:
        raise OperatorError(f"--top-k {args.top_k}: the vocabulary has {student_vocab} entries")
    index = _index(args, cfg, train_ds, sources.tokenizer, teacher, samples)
    on_rank0(lambda: _write_index(args.output, index))

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = [s for s in range(first_task, index["num_shards"], tasks)][dp_rank::dp]
    writer = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    todo = [s for s in mine if not (args.output / shard_name(s)).is_file()]
    # every rank of a model-parallel group must agree on the shards it runs
    flags = torch.tensor([int(s in todo) for s in mine], dtype=torch.int64)
    if flags.numel():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=ps.get_model_parallel_group())
    todo = [s for s, f in zip(mine, flags.tolist()) if f]
    if writer:  # what a killed run of these shards (a requeued task's first try) left half-written
        for shard in todo:
            for leftover in temp_leftovers(args.output / shard_name(shard)):
                leftover.unlink(missing_ok=True)
    bar = None
    if dist.get_rank() == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(mine), initial=len(mine) - len(todo), desc="teacher shards",
                   unit="shard", file=sys.stderr)
    device, dtype = compute_device(), DTYPES[args.dtype]

    def reduce(batch, logits):
        ids, values = vocab_parallel_topk(logits.float(), args.top_k)
        return ids.to(torch.int32).cpu(), values.to(dtype).cpu()

    for shard in todo:
        first = shard * args.shard_samples
        last = min(first + args.shard_samples, samples)
        ids, values, sums = [], [], []
        for start in range(first, last, args.batch_size):
            tokens = torch.stack([torch.as_tensor(train_ds[i]["tokens"])
                                  for i in range(start, min(start + args.batch_size, last))])
            out = forward_only(teacher.model, [{"input_ids": tokens.to(device)}],
                               lambda m, b: m(b["input_ids"]), reduce)
            if out:
                ids.append(out[0][0])
                values.append(out[0][1])
            sums.append(tokens.long().sum(dim=-1))
        if writer:
            write_bytes_atomic(args.output / shard_name(shard),
                               shard_bytes(torch.cat(ids), torch.cat(values), torch.cat(sums),
                                           first))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    barrier()
    if dist.get_rank() == 0:
        done = sum((args.output / shard_name(s)).is_file() for s in range(index["num_shards"]))
        print(f"{args.output}: {done} of {index['num_shards']} shards "
              f"({samples} samples x {cfg.data.seq_length} tokens, top-{args.top_k} {args.dtype})"
              + ("" if done == index["num_shards"] else "; the other slices write the rest"))
    return 0


if __name__ == "__main__":  # python -m megatron_iiet.commands.precompute_teacher_logits
    raise SystemExit(main())
