#!/usr/bin/env python
"""Evaluation throughput: the native `iiet` backend (TP=1 with the torch and the megatron runner,
TP=2) against lm-eval's `hf` backend on the export of the same checkpoint, and the wall time of
the paper's suite.

    python bench/bench_eval.py [--preset 55m --seq 256 --requests 128 --batch-size 8
                                --gen-requests 8 --gen-tokens 32 --suite-limit 100]

It trains a `--preset` IIET for 2 steps on the built-in corpus (the weights only need to be a
real checkpoint), exports it, then times in fresh processes, side by side, each backend on the
same requests: loglikelihood (`--ll-task`'s requests as lm-eval makes them: every choice of each
question) and greedy
generation (LAMBADA passages, `--gen-tokens` new tokens). Both cores are used by every row:
one process with 2 threads, or TP=2 with one thread per rank. Then `tools/evaluate.py --tasks
paper --limit N` on the native backend, TP=1. Needs ../shared/data (or $IIET_SHARED_DATA).
Results go into docs/benchmarks.md ("Evaluation").
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def requests(data_dir: Path, task_name: str, n_ll: int, n_gen: int, gen_tokens: int):
    """The first ``n_ll`` loglikelihood requests lm-eval makes for ``task_name`` (its prompts,
    all choices of each question), and ``n_gen`` LAMBADA passages to continue greedily."""
    from lm_eval.api.instance import Instance

    from megatron_iiet.eval.tasks import task_manager

    task = task_manager(data_dir, include_defaults=False).load([task_name])["tasks"][task_name]
    ll = []
    for doc in task.eval_docs:
        ctx = task.fewshot_context(doc, num_fewshot=0, gen_prefix=task.doc_to_prefix(doc))
        made = task.construct_requests(doc=doc, ctx=ctx, metadata=(task_name, 0, 1))
        ll += [Instance("loglikelihood", {}, inst.arguments, len(ll))
               for inst in (made if isinstance(made, list) else [made])]
        if len(ll) >= n_ll:
            break
    texts = [json.loads(line)["text"] for line in (data_dir / "lambada" / "lambada_test.jsonl").open()]
    gen = [Instance("generate_until", {}, (t[:400], {"until": ["\n\n"], "max_gen_toks": gen_tokens}), i)
           for i, t in enumerate(texts[:n_gen])]
    return ll[:n_ll], gen


def worker(args) -> None:
    """One backend in this process: requests/s of loglikelihood and of generation."""
    ll, gen = requests(Path(args.data_dir), args.ll_task, args.requests, args.gen_requests,
                       args.gen_tokens)
    if args.worker == "hf":
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=args.hf, trust_remote_code=True, batch_size=args.batch_size,
                  device="cpu", dtype="float32")
        drive = lambda work: work()  # noqa: E731
    else:
        from megatron_iiet.eval.native_lm import IIETMegatronLM

        lm = IIETMegatronLM(checkpoint=args.checkpoint, batch_size=args.batch_size,
                            tensor_parallel=args.tp, runner=args.runner, progress=False)
        drive = lm.scorer.drive

    def work():
        lm.loglikelihood(ll[: args.batch_size])  # warm-up
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            lm.loglikelihood(ll)
            rates.append(len(ll) / (time.perf_counter() - t0))
        gen_rates = []
        for _ in range(args.gen_repeats):
            t1 = time.perf_counter()
            out = lm.generate_until(gen)
            gen_rates.append(len(gen) / (time.perf_counter() - t1))
        return {"ll_per_s": statistics.median(rates), "ll_spread": max(rates) / min(rates),
                "gen_per_s": statistics.median(gen_rates),
                "gen_spread": max(gen_rates) / min(gen_rates),
                "gen_tokens": sum(len(lm.tok_encode(o)) for o in out)}

    result = drive(work)
    if result is not None:
        Path(args.out).write_text(json.dumps(result))


def run(cmd, threads, env_extra=None, timeout=3600):
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore",
           "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="55m")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--ll-task", default="piqa", help="task whose loglikelihood requests are timed")
    p.add_argument("--gen-requests", type=int, default=8)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="loglikelihood timings (median)")
    p.add_argument("--gen-repeats", type=int, default=1, help="generation timings (median)")
    p.add_argument("--only", default=None, help="comma list: rows whose name contains one")
    p.add_argument("--suite-limit", type=int, default=100, help="0: skip the suite timing")
    p.add_argument("--work", default=None, help="folder for the checkpoint (default: a temp dir)")
    p.add_argument("--data-dir", default=None)
    # worker mode (internal)
    p.add_argument("--worker", choices=["native", "hf"])
    p.add_argument("--checkpoint")
    p.add_argument("--hf")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--runner", default="auto")
    p.add_argument("--out")
    args = p.parse_args()
    from megatron_iiet.eval.tasks import default_data_dir

    args.data_dir = args.data_dir or (str(default_data_dir()) if default_data_dir() else None)
    if args.data_dir is None:
        sys.exit("needs the task data: ../shared/data or --data-dir")
    if args.worker:
        return worker(args)

    from megatron_iiet.data.prepare import prepare_builtin_corpus

    work = Path(args.work or tempfile.mkdtemp(prefix="bench_eval_"))
    data = prepare_builtin_corpus(str(work / "data"), vocab_size=args.vocab, corpus_size="4MB")
    run_dir = work / "run"
    sets = {"model.preset": args.preset, "data.train": data.data_prefix,
            "data.tokenizer": data.tokenizer_model, "data.seq_length": args.seq,
            "data.num_workers": 0, "schedule.train_steps": 2, "schedule.warmup_steps": 1,
            "parallel.micro_batch_size": 1, "parallel.global_batch_size": 1,
            "logging.dir": str(run_dir), "logging.tensorboard": "false",
            "logging.progress_bar": "false", "eval.steps": 1, "data.split": "90,10,0"}
    if not (run_dir / "checkpoints" / "latest").exists():
        run([sys.executable, "pretrain_iiet.py", *sum((["--set", f"{k}={v}"] for k, v in sets.items()), [])], 2)
    export = work / "hf"
    if not export.exists():
        run([sys.executable, "tools/convert_checkpoint.py", "megatron-to-hf",
             str(run_dir / "checkpoints"), str(export)], 2)
    common = ["--requests", args.requests, "--ll-task", args.ll_task, "--repeats", args.repeats,
              "--gen-repeats", args.gen_repeats, "--gen-requests", args.gen_requests, "--gen-tokens",
              args.gen_tokens, "--batch-size", args.batch_size, "--data-dir", args.data_dir]
    common = list(map(str, common))
    me = str(Path(__file__).resolve())
    rows = {}
    for name, cmd, threads in [
        ("native TP=1, torch runner", [sys.executable, me, "--worker", "native", "--runner",
                                       "torch", "--checkpoint", str(run_dir / "checkpoints")], 2),
        ("native TP=1, megatron runner", [sys.executable, me, "--worker", "native", "--runner",
                                          "megatron", "--checkpoint", str(run_dir / "checkpoints")], 2),
        ("native TP=2", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node=2", me, "--worker", "native", "--tp", "2",
                         "--checkpoint", str(run_dir / "checkpoints")], 1),
        ("hf backend", [sys.executable, me, "--worker", "hf", "--hf", str(export)], 2),
    ]:
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        out = work / f"{name.replace(' ', '_').replace('=', '').replace(',', '')}_{args.ll_task}.json"
        run([*cmd, *common, "--out", str(out)], threads)
        rows[name] = json.loads(out.read_text())
    print(f"\n{args.preset} IIET (seq {args.seq}, vocab {args.vocab}), batch size {args.batch_size}, "
          f"{args.requests} {args.ll_task} loglikelihood requests, {args.gen_requests} generations of "
          f"<= {args.gen_tokens} tokens; fp32, 2 cores\n")
    print(f"| backend | loglikelihood req/s (median of {args.repeats}; max/min) | vs hf | "
          f"generate req/s (median of {args.gen_repeats}; max/min) | vs hf |")
    print("|---|---|---|---|---|")
    ref = rows["hf backend"]
    for name, r in rows.items():
        print(f"| {name} | {r['ll_per_s']:.2f} ({r['ll_spread']:.2f}) | "
              f"{r['ll_per_s'] / ref['ll_per_s']:.2f}x | {r['gen_per_s']:.3f} "
              f"({r.get('gen_spread', 1.0):.2f}) | "
              f"{r['gen_per_s'] / ref['gen_per_s']:.2f}x |")
    if args.suite_limit:
        seconds = run([sys.executable, "tools/evaluate.py", "--checkpoint",
                       str(run_dir / "checkpoints"), "--tasks", "paper", "--limit",
                       str(args.suite_limit), "--batch-size", str(args.batch_size),
                       "--output", str(work / "suite"), "--data-dir", args.data_dir,
                       "--no-progress"], 2)
        print(f"\npaper suite (7 tasks), --limit {args.suite_limit}, native TP=1 (torch runner): "
              f"{seconds:.0f} s wall (including start-up and task loading)")
        print((work / "suite" / "results.md").read_text().split("\n## ")[0])


if __name__ == "__main__":
    main()
