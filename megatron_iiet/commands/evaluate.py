"""Zero-shot evaluation with lm-evaluation-harness, on local task data.

    # a megatron checkpoint (native `iiet` backend), at any TP/PP; extra ranks are data-parallel
    torchrun --nproc-per-node 2 tools/evaluate.py --checkpoint RUN/checkpoints --tp 2 \
        --tasks paper --output eval/run1
    # an HF export (lm-eval's own `hf` backend), one process
    python tools/evaluate.py --hf EXPORT --tasks piqa,arc_easy --limit 200 --output eval/hf

--tasks: task names (wikitext, lambada_openai, piqa, hellaswag, winogrande, arc_easy,
arc_challenge, boolq, openbookqa, sciq) or `paper` for the paper's suite. The task files are
read from --data-dir (default: ../shared/data beside the repository, or $IIET_SHARED_DATA).
Writes OUTPUT/results.json (lm-eval's results) and OUTPUT/results.md (the paper's table and every
metric). One evaluation writes into an OUTPUT at a time (OUTPUT.lock), and existing results are
kept unless --overwrite. --hf loads an IIET export with this package's classes (no code from
the folder runs); --trust-remote-code lets transformers run a folder's own code, for other
models that need it. Details: docs/evaluation.md.
"""

import argparse
import contextlib
import json
import os
from pathlib import Path

from megatron_iiet.cli import fail
from megatron_iiet.errors import OperatorError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--checkpoint", help="megatron checkpoint: iter_* folder or checkpoint root")
    model.add_argument("--hf", help="HF folder (e.g. tools/convert_checkpoint.py megatron-to-hf)")
    parser.add_argument("--tasks", default="paper", help="comma list, or 'paper' (default)")
    parser.add_argument("--limit", type=float, default=None,
                        help="examples per task (an int), or a fraction < 1")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--output", type=Path, required=True, help="folder for results.json/.md")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the results already in --output (kept otherwise)")
    parser.add_argument("--data-dir", default=None, help="folder with the task files")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (native backend)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (native backend)")
    parser.add_argument("--runner", default="auto", choices=["auto", "megatron", "torch"],
                        help="native backend: megatron-core's model at the job's layout, or the "
                        "plain PyTorch model in one process (auto: torch for a one-process job "
                        "at TP=PP=1; docs/evaluation.md)")
    parser.add_argument("--tokenizer", default=None, help="override the checkpoint's tokenizer")
    parser.add_argument("--max-length", type=int, default=None,
                        help="context length (default: the model's sequence length)")
    parser.add_argument("--bootstrap-iters", type=int, default=1000,
                        help="bootstrap resamples for perplexity stderr (lm-eval's default: 100000)")
    parser.add_argument("--dtype", default="float32", help="HF backend weights dtype")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="HF backend: let transformers import and run the .py files of the "
                        "--hf folder, for a model this environment has no classes for (not "
                        "needed for this project's exports, which always load with the "
                        "package's own classes)")
    parser.add_argument("--label", default=None, help="row label of the table")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _limit(value):
    if value is None:
        return None
    if value <= 0:
        raise OperatorError(f"--limit {value}: must be positive")
    return int(value) if value >= 1 else value


def native_lm(args):
    from megatron_iiet.eval.native_lm import IIETMegatronLM

    return IIETMegatronLM(checkpoint=args.checkpoint, tokenizer=args.tokenizer,
                          batch_size=args.batch_size, max_length=args.max_length,
                          tensor_parallel=args.tp, pipeline_parallel=args.pp,
                          runner=args.runner, progress=not args.no_progress)


def hf_lm(args):
    from lm_eval.models.huggingface import HFLM

    from megatron_iiet.platform import cuda_available

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise OperatorError("--hf runs in one process (launch it without torchrun)")
    folder = Path(args.hf)
    check_hf_folder(folder, args.trust_remote_code)
    kwargs = {"max_length": args.max_length} if args.max_length else {}
    return HFLM(pretrained=str(folder), trust_remote_code=args.trust_remote_code,
                batch_size=args.batch_size, device="cuda" if cuda_available() else "cpu",
                dtype=args.dtype, **kwargs)


def check_hf_folder(folder: Path, trust_remote_code: bool) -> None:
    """An HF model folder that loads without running its own code (our exports: importing
    megatron_iiet.hf registers model_type "iiet"), or --trust-remote-code given: transformers
    would otherwise stop with a traceback (or, on a terminal, a prompt)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import megatron_iiet.hf  # noqa: F401  registers the IIET classes

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise OperatorError(f"--hf {folder}: not an HF model folder (no config.json)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise OperatorError(f"{config_file}: unreadable ({err})") from err
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not trust_remote_code and model_type not in CONFIG_MAPPING:
        raise OperatorError(f"{config_file}: model_type {model_type!r} is not a class this "
                            "environment has; its code is in the folder: pass "
                            "--trust-remote-code to run it (read it first)")


def _default_label(path: Path) -> str:
    """The run's name for a checkpoint root (RUN/checkpoints), else the folder's name."""
    resolved = path.resolve()
    return resolved.parent.name if resolved.name == "checkpoints" else resolved.name


def refuse_existing_results(output: Path, overwrite: bool) -> None:
    found = [p for p in (output / "results.json", output / "results.md") if p.exists()]
    if found and not overwrite:
        raise OperatorError(f"{found[0]}: exists (an earlier evaluation); pass --overwrite to "
                            "replace it, or choose another --output")


def writing_results(args) -> contextlib.AbstractContextManager:
    """The lock of --output (OUTPUT.lock beside it) for the whole evaluation, taken by the
    process that writes the results (rank 0): a second evaluation into the same folder refuses
    at once instead of overwriting the first one's results when it ends."""
    if int(os.environ.get("RANK", "0")) != 0:
        return contextlib.nullcontext()
    from megatron_iiet.locks import exclusive_output

    return exclusive_output(args.output, "another evaluation writing these results",
                            "wait for it to finish or choose another --output")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_iiet.platform import name_deepspeed_accelerator

    name_deepspeed_accelerator()  # before anything imports DeepSpeed
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with contextlib.ExitStack() as held:
        try:
            from megatron_iiet.eval.harness import run_tasks, write_reports
            from megatron_iiet.eval.tasks import resolve_tasks

            refuse_existing_results(args.output, args.overwrite)  # every rank: no model loaded
            held.enter_context(writing_results(args))
            refuse_existing_results(args.output, args.overwrite)  # one finished meanwhile
            if args.batch_size < 1:
                raise OperatorError(f"--batch-size {args.batch_size}: must be >= 1")
            limit = _limit(args.limit)
            tasks = resolve_tasks([t for t in args.tasks.split(",") if t], args.data_dir)
            lm = native_lm(args) if args.checkpoint else hf_lm(args)
            label = args.label or _default_label(Path(args.checkpoint or args.hf))
            work = lambda: run_tasks(lm, tasks, limit, args.data_dir, args.bootstrap_iters)  # noqa: E731
            results = lm.scorer.drive(work) if args.checkpoint else work()
        except OperatorError as err:
            fail(err)
        finally:
            if args.checkpoint:
                from megatron_iiet.distributed import teardown

                teardown()
        if results is None:  # a serving rank of the native backend
            return 0
        json_path, md_path = write_reports(results, args.output, label, limit)
    print(Path(md_path).read_text().split("\n## ")[0])
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":  # python -m megatron_iiet.commands.evaluate
    raise SystemExit(main())
