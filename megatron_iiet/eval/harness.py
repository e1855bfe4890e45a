"""Running lm-eval tasks on a model and reporting them: the JSON lm-eval writes, a markdown table
in the paper's layout, and flat metric names for the training metrics log.

The paper's table (IIET, EMNLP 2025): WikiText perplexity (word level), LAMBADA perplexity and
accuracy, PIQA acc, HellaSwag acc_norm, WinoGrande acc, ARC-Easy acc, ARC-Challenge acc_norm, and
the average of those accuracy columns (in %). Zero-shot, lm-eval's task definitions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from megatron_iiet.data.atomic import write_bytes_atomic

# (column, task, lm-eval metric, is an accuracy, in the average)
PAPER_COLUMNS = [
    ("Wiki ppl", "wikitext", "word_perplexity", False),
    ("LMB ppl", "lambada_openai", "perplexity", False),
    ("LMB acc", "lambada_openai", "acc", True),
    ("PIQA acc", "piqa", "acc", True),
    ("Hella acc_norm", "hellaswag", "acc_norm", True),
    ("Wino acc", "winogrande", "acc", True),
    ("ARC-e acc", "arc_easy", "acc", True),
    ("ARC-c acc_norm", "arc_challenge", "acc_norm", True),
]


def run_tasks(lm, tasks: list[str], limit: Optional[float] = None,
              data_dir: Optional[str] = None, bootstrap_iters: int = 1000,
              seed: int = 1234) -> dict:
    """lm-eval's ``simple_evaluate`` of ``lm`` on ``tasks`` (already resolved) with the local
    task data; zero-shot. Returns lm-eval's results dict."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), num_fewshot=0, limit=limit,
        task_manager=_task_manager(data_dir), bootstrap_iters=bootstrap_iters,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
        fewshot_random_seed=seed, log_samples=False)


_MANAGERS: dict = {}


def _task_manager(data_dir: Optional[str]):
    """Our local tasks alone (``resolve_tasks`` admits no others), one manager per data
    directory and process: indexing lm-eval's own ~15k task files would cost >10 s per call."""
    from megatron_iiet.eval.tasks import task_manager

    key = str(data_dir)
    if key not in _MANAGERS:
        _MANAGERS[key] = task_manager(data_dir, include_defaults=False)
    return _MANAGERS[key]


def flat_metrics(results: dict) -> dict[str, float]:
    """``{"task/metric": value}`` of every numeric, non-stderr metric (``acc,none`` -> ``acc``)."""
    flat = {}
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if "stderr" in name or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            suffix = "" if filt in ("", "none") else f"[{filt}]"
            flat[f"{task}/{name}{suffix}"] = float(value)
    return flat


def _metric(results: dict, task: str, metric: str) -> Optional[float]:
    value = results.get("results", {}).get(task, {}).get(f"{metric},none")
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def paper_table(results: dict, label: str) -> str:
    """One markdown row in the paper's layout (accuracies in %, '-' where a task did not run);
    the average is over the accuracy columns that ran, and says how many."""
    header = [c[0] for c in PAPER_COLUMNS] + ["Avg acc"]
    cells, accs = [], []
    for _, task, metric, is_acc in PAPER_COLUMNS:
        value = _metric(results, task, metric)
        if value is None:
            cells.append("-")
            continue
        if is_acc:
            accs.append(100 * value)
            cells.append(f"{100 * value:.2f}")
        else:
            cells.append(f"{value:.2f}")
    n_acc = sum(1 for c in PAPER_COLUMNS if c[3])
    avg = "-" if not accs else (f"{sum(accs) / len(accs):.2f}" +
                                ("" if len(accs) == n_acc else f" ({len(accs)}/{n_acc})"))
    lines = ["| model | " + " | ".join(header) + " |",
             "|---|" + "---|" * len(header),
             f"| {label} | " + " | ".join(cells + [avg]) + " |"]
    return "\n".join(lines) + "\n"


def all_metrics_table(results: dict) -> str:
    lines = ["| task | metric | value | stderr |", "|---|---|---|---|"]
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if "stderr" in name or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            err = metrics.get(f"{name}_stderr,{filt}")
            err_text = f"{err:.4f}" if isinstance(err, (int, float)) else "-"
            lines.append(f"| {task} | {name} | {value:.4f} | {err_text} |")
    return "\n".join(lines) + "\n"


def write_reports(results: dict, out_dir: Path, label: str, limit: Optional[float]) -> tuple[Path, Path]:
    """results.json (lm-eval's dict) and results.md (paper table + every metric), atomically."""
    from lm_eval.utils import handle_non_serializable

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    write_bytes_atomic(json_path, (json.dumps(results, indent=2, default=handle_non_serializable,
                                              sort_keys=True) + "\n").encode())
    note = "" if limit is None else f"\n\n(`--limit {limit}`: a subset of every task; not comparable with full-task numbers)"
    samples = {t: v.get("effective", v.get("original")) for t, v in
               results.get("n-samples", {}).items()}
    text = (f"# Zero-shot evaluation: {label}\n\n" + paper_table(results, label) + note
            + "\n\n## Every metric\n\n" + all_metrics_table(results)
            + f"\nExamples per task: {json.dumps(samples, sort_keys=True)}\n")
    write_bytes_atomic(md_path, text.encode())
    return json_path, md_path
