#!/usr/bin/env python
"""Preprocessing throughput and peak memory vs input size, side by side in one run.

Input: the Gutenberg books of ../shared/data (boilerplate stripped), cut into ~4 KB documents,
written as jsonl and repeated up to each size (the books are ~20 MB, so 20 MB is one pass over
distinct text and 200 MB is ten passes). Rows: a plain single-process loop (json.loads, per-document
sentencepiece encode, numpy write: the floor), `run_preprocess` with 1 and 2 worker processes, and
`run_preprocess` with 1 worker and the segment cache off (per-document encode, as the floor). Each
configuration runs in a fresh subprocess so its peak RSS is its own; every output .bin must be
byte-identical to the floor's. On a shared machine wall time swings with the load, so CPU time of
all the run's processes (getrusage self + joined children) is reported too.

  .venv/bin/python bench/bench_preprocess.py --sizes-mb 20 200

`--compare-megatron` measures instead, side by side in one run on 20 MB of distinct text (one pass
over the books, no repeats) and a 32k sentencepiece BPE model trained at spm_train's defaults
(nmt_nfkc, dummy prefix, whitespace collapsing, no byte fallback; trained once on the books and
cached in --model-cache): Megatron-LM's own `tools/preprocess_data.py` end to end (when
--megatron-lm names a Megatron-LM checkout, its tools directory or the script itself), the plain
per-document `sp.encode` loop, and `run_preprocess`; token ids and document lengths are checked
identical across all rows.

  .venv/bin/python bench/bench_preprocess.py --compare-megatron --megatron-lm ~/Megatron-LM

Megatron-LM is not a package: its tool lives in the repository, not in the megatron-core wheel. A
full checkout runs as it is (its own `megatron/`, first on the path). A lone copy of the script is
run against the installed megatron-core, and only the imports it cannot resolve there are filled in,
each named in the output: the tokenizer builder under the module path of newer megatron-core
releases (aliased to the installed one), and `megatron.training.arguments._add_tokenizer_args` (an
argparse helper of the training package; the bench declares the tokenizer flags the builder reads).
Reading, JSON decoding, tokenizing and writing are the tool's and megatron-core's own code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import runpy
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def book_documents(shared: Path) -> list[str]:
    """The Gutenberg books, boilerplate stripped, cut into 4 KB documents: one pass of distinct text."""
    from megatron_iiet.data.corpus import strip_gutenberg_boilerplate

    documents = []
    for book in sorted((shared / "gutenberg").glob("*.txt")):
        with open(book, encoding="utf-8-sig", newline="") as handle:
            body = strip_gutenberg_boilerplate(handle.read(), str(book))
        documents.extend(body[i:i + 4096] for i in range(0, len(body), 4096))
    return documents


def make_input(shared: Path, path: Path, size_mb: int) -> int:
    """Write ~size_mb MB of jsonl: 4 KB documents of Gutenberg text, the books repeated."""
    documents = book_documents(shared)
    target = size_mb * 10**6
    written = count = 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            for document in documents:
                line = json.dumps({"text": document}) + "\n"
                out.write(line)
                written += len(line.encode("utf-8"))
                count += 1
                if written >= target:
                    break
    return count


def floor_loop(source: str, tokenizer: str, prefix: str) -> tuple[int, int]:
    """The plain baseline: one process, line by line, no batching, no pipelining."""
    import numpy as np
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=tokenizer)
    eod = sp.eos_id()
    lengths = []
    with open(source, encoding="utf-8") as lines, open(prefix + ".bin", "wb") as out:
        for line in lines:
            ids = sp.encode(json.loads(line)["text"]) + [eod]
            out.write(np.array(ids, dtype=np.uint16).tobytes())
            lengths.append(len(ids))
    np.array(lengths, dtype=np.int32).tofile(prefix + ".lengths")
    return len(lengths), sum(lengths)


def _lengths_from_idx(dataset: str, prefix: str) -> tuple[int, int]:
    """Write PREFIX.lengths (int32 document lengths, the floor's format) from DATASET.idx, as
    megatron-core's own reader sees it: the rows compare token streams and document boundaries."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    index = IndexedDataset(dataset).index
    boundaries = np.asarray(index.document_indices)
    sequence_ends = np.concatenate(([0], np.cumsum(index.sequence_lengths, dtype=np.int64)))
    lengths = np.diff(sequence_ends[boundaries]).astype(np.int32)
    lengths.tofile(prefix + ".lengths")
    return len(lengths), int(lengths.sum())


def resolve_megatron_lm(path: str) -> tuple[Path, Path | None]:
    """(tools/preprocess_data.py, checkout root or None) from a checkout, its tools dir or the file."""
    given = Path(path).expanduser().resolve()
    for tool in (given, given / "preprocess_data.py", given / "tools" / "preprocess_data.py"):
        if tool.is_file():
            root = tool.parent.parent
            return tool, root if (root / "megatron").is_dir() else None
    raise FileNotFoundError(f"{given}: no tools/preprocess_data.py there (give a Megatron-LM checkout, "
                            "its tools directory or the script)")


def _add_tokenizer_args(parser):
    """The tokenizer flags megatron-core's `build_tokenizer(args)` reads (stands in for
    `megatron.training.arguments._add_tokenizer_args` when the training package is absent)."""
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", type=str, default=None)
    group.add_argument("--tokenizer-model", type=str, default=None)
    group.add_argument("--vocab-file", type=str, default=None)
    group.add_argument("--merge-file", type=str, default=None)
    group.add_argument("--vocab-size", type=int, default=None)
    group.add_argument("--vocab-extra-ids", type=int, default=0)
    group.add_argument("--tokenizer-special-tokens", type=str, nargs="+", default=None)
    group.add_argument("--tokenizer-sentencepiece-legacy", action="store_true")
    group.add_argument("--tokenizer-metadata", type=str, default=None)
    group.add_argument("--tokenizer-hf-use-fast", action="store_true")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true")
    group.add_argument("--trust-remote-code", action="store_true")
    group.add_argument("--tiktoken-pattern", type=str, default=None)
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000)
    group.add_argument("--legacy-tokenizer", action="store_true")
    return parser


def _megatron_compat(notes: list[str]) -> None:
    """Fill in what the tool imports and this environment lacks; each filled-in import is noted."""
    import importlib
    import types

    def importable(name: str) -> bool:
        try:
            importlib.import_module(name)
            return True
        except Exception:  # noqa: BLE001 (a checkout's training package can fail in many ways)
            return False

    new, old = "megatron.core.tokenizers.utils.build_tokenizer", "megatron.core.tokenizers.text.utils.build_tokenizer"
    if not importable(new) and importable(old):
        package = types.ModuleType(new.rpartition(".")[0])
        package.__path__ = []
        sys.modules[package.__name__] = package
        sys.modules[new] = sys.modules[old]
        notes.append(f"{new} -> installed megatron-core's {old}")
    if not importable("megatron.training.arguments"):
        training = types.ModuleType("megatron.training")
        training.__path__ = []
        arguments = types.ModuleType("megatron.training.arguments")
        arguments._add_tokenizer_args = _add_tokenizer_args
        training.arguments = arguments
        sys.modules.update({"megatron.training": training, "megatron.training.arguments": arguments})
        notes.append("megatron.training.arguments._add_tokenizer_args -> the bench's (argparse flags only)")


def megatron_command(tool: Path, source: str, tokenizer: str, prefix: str, workers: int) -> list[str]:
    return [str(tool), "--input", source, "--output-prefix", prefix, "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", tokenizer, "--workers", str(workers), "--append-eod"]


def megatron_tool(source: str, tokenizer: str, prefix: str, notes: list[str]) -> tuple[int, int]:
    """Megatron-LM's tools/preprocess_data.py, run in this process as `python preprocess_data.py ...`
    would run it (its Pool forks from here, so getrusage's children are its processes)."""
    import traceback

    tool, root = resolve_megatron_lm(os.environ["IIET_BENCH_MEGATRON_LM"])
    workers = int(os.environ.get("IIET_BENCH_WORKERS", "1"))
    if root is not None:  # deliberate: the compared tool runs on its checkout's megatron, not the installed one
        sys.path.insert(0, str(root))
    _megatron_compat(notes)
    sys.argv = megatron_command(tool, source, tokenizer, prefix, workers)
    cwd = os.getcwd()
    os.chdir(Path(prefix).parent)  # the tool lists its working directory at the end (see below)
    try:
        runpy.run_path(str(tool), run_name="__main__")
    except IndexError:
        # At some commits main() ends with find_optimal_num_workers(args.performance_dir) even
        # without --find-optimal-num-workers: it lists the working directory for perf .json files
        # and fails on finding none, after the dataset is written and closed.
        if "find_optimal_num_workers" not in traceback.format_exc():
            raise
        notes.append("the tool ended with IndexError in find_optimal_num_workers after writing its output")
    finally:
        os.chdir(cwd)
    return 0, 0  # counted from its output after the clock stops


def _hwm_mb(pid: str = "self") -> float:
    """Peak RSS (VmHWM) of one process; unlike ru_maxrss it is not inherited across exec."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class _WorkerPeakWatcher(threading.Thread):
    """Polls the peak RSS of this process's children (the tokenizer workers)."""

    def __init__(self, forked: bool = False) -> None:
        super().__init__(daemon=True)
        self.peak = 0.0
        self.forked = forked  # Megatron-LM's tool forks: every descendant counts
        self.stop = threading.Event()

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.wait(0.2):
            pending, seen = [str(me)], []
            while pending:  # descendants, breadth first
                pid = pending.pop()
                try:
                    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                except OSError:
                    continue
                seen += children
                if self.forked:
                    pending += children
            for pid in seen:
                try:  # only our spawn workers: a finished child's pid may be reused meanwhile
                    if not self.forked and b"multiprocessing.spawn" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                        continue
                except OSError:
                    continue
                self.peak = max(self.peak, _hwm_mb(pid))


def child(args) -> None:
    watcher = _WorkerPeakWatcher(forked=args.mode == "megatron")
    watcher.start()
    load = os.getloadavg()[0]
    started = time.perf_counter()
    notes: list[str] = []
    if args.mode == "floor":
        documents, tokens = floor_loop(args.source, args.tokenizer, args.prefix)
    elif args.mode == "megatron":
        documents, tokens = megatron_tool(args.source, args.tokenizer, args.prefix, notes)
    else:
        from megatron_iiet.data.preprocess import PreprocessConfig, run_preprocess

        workers, _, variant = args.mode.partition("-")
        cache = {"segment_cache_entries": 0} if variant == "nocache" else {}
        summary = run_preprocess(PreprocessConfig(inputs=(args.source,), tokenizer=args.tokenizer, output_prefix=args.prefix,
                                                  workers=int(workers), progress=False, **cache))
        documents, tokens = summary.documents, summary.tokens
    seconds = time.perf_counter() - started
    watcher.stop.set()
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    main_rss = _hwm_mb()
    if args.mode == "megatron":  # after the clock: the common format the rows are compared in
        documents, tokens = _lengths_from_idx(args.prefix + "_text_document", args.prefix)
        os.replace(args.prefix + "_text_document.bin", args.prefix + ".bin")
    elif args.mode != "floor":
        _lengths_from_idx(args.prefix, args.prefix)
    print(json.dumps({"documents": documents, "tokens": tokens, "seconds": seconds, "main_rss_mb": main_rss,
                      "worker_rss_mb": watcher.peak, "cpu_main": own.ru_utime + own.ru_stime,
                      "cpu_workers": children.ru_utime + children.ru_stime, "load": (load + os.getloadavg()[0]) / 2,
                      "notes": notes}))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


MODES = ("floor", "1", "2", "1-nocache")
NAMES = {"floor": "plain loop (floor)", "1": "preprocess, 1 worker", "2": "preprocess, 2 workers",
         "1-nocache": "preprocess, 1 worker, no segment cache"}


def spm_defaults_model(shared: Path, vocab_size: int, cache: Path) -> Path:
    """A BPE model trained at spm_train's defaults (only model_type and vocab_size given) on the
    lines of the Gutenberg books; trained once (a few seconds to minutes) and kept in `cache`."""
    import sentencepiece

    from megatron_iiet.data.corpus import strip_gutenberg_boilerplate

    lines = []
    for book in sorted((shared / "gutenberg").glob("*.txt")):
        with open(book, encoding="utf-8-sig", newline="") as handle:
            body = strip_gutenberg_boilerplate(handle.read(), str(book))
        lines.extend(line for line in body.splitlines() if line.strip())
    text = "\n".join(lines) + "\n"
    key = hashlib.sha256(f"{sentencepiece.__version__} bpe {vocab_size}\n{text}".encode("utf-8")).hexdigest()[:16]
    model = cache / f"gutenberg_spm_defaults_bpe{vocab_size}_{key}.model"
    if not model.exists():
        cache.mkdir(parents=True, exist_ok=True)
        corpus = cache / f"gutenberg_lines_{key}.txt"
        corpus.write_text(text, encoding="utf-8")
        started = time.perf_counter()
        prefix = str(model)[: -len(".model")] + f".tmp{os.getpid()}"
        sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=prefix, model_type="bpe",
                                                 vocab_size=vocab_size, minloglevel=2)
        os.replace(prefix + ".model", model)
        os.unlink(prefix + ".vocab")
        corpus.unlink()
        print(f"  trained {model.name} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return model


COMPARE_NAMES = {"megatron": "Megatron-LM tools/preprocess_data.py", "floor": "plain per-document sp.encode loop",
                 "ours": "run_preprocess (segment cache)", "ours-nocache": "run_preprocess, --no-segment-cache"}


def compare_megatron(args, shared: Path) -> None:
    model = spm_defaults_model(shared, args.vocab_size, Path(args.model_cache))
    tool = None
    if args.megatron_lm:
        tool, root = resolve_megatron_lm(args.megatron_lm)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as scratch:
        scratch = Path(scratch)
        source = scratch / "in.jsonl"
        documents = make_input(shared, source, args.size_mb)
        one_pass = len(book_documents(shared))
        if documents > one_pass:
            print(f"  note: {args.size_mb} MB repeats the books ({documents} documents, {one_pass} distinct)", file=sys.stderr)
        # The same pipelines on the first few documents: their start-up cost (imports, workers,
        # tokenizer loading), subtracted for the start-up-excluded rate.
        tiny = scratch / "tiny.jsonl"
        with open(source, encoding="utf-8") as full, open(tiny, "w", encoding="utf-8") as out:
            out.writelines(line for _, line in zip(range(8), full))
        rows = []
        plan = [(mode, w) for w in args.workers for mode in (["megatron"] if tool else []) + ["ours"]]
        plan = [("floor", 1)] + plan + ([("ours-nocache", 1)] if args.with_nocache else [])
        for mode, workers in plan:
            child_mode = mode if mode in ("floor", "megatron") else f"{workers}-nocache" if mode == "ours-nocache" else str(workers)
            env = {**os.environ, "IIET_BENCH_WORKERS": str(workers)}
            if tool:
                env["IIET_BENCH_MEGATRON_LM"] = str(tool)
            measured = []
            for name, path in (("full", source), ("start-up", tiny)):
                prefix = scratch / f"out_{mode}_{workers}_{name}" / "ds"
                prefix.parent.mkdir()
                result = subprocess.run([sys.executable, __file__, "--child", child_mode, str(path), str(model), str(prefix)],
                                        capture_output=True, text=True, env=env)
                if result.returncode:
                    raise SystemExit(f"error: {mode} ({workers} workers, {name}) failed:\n{result.stderr[-3000:]}")
                row = json.loads(result.stdout.strip().splitlines()[-1])
                row.update(mode=mode, workers=workers, bin_sha256=_sha256(Path(str(prefix) + ".bin")),
                           lengths_sha256=_sha256(Path(str(prefix) + ".lengths")),
                           stderr=[line for line in result.stderr.splitlines() if line.startswith("preprocess:")])
                measured.append(row)
                for output in prefix.parent.iterdir():
                    output.unlink()
            row, row["startup"] = measured
            rows.append(row)
            print(f"  done {COMPARE_NAMES[mode]}, {workers} worker(s): {row['tokens'] / row['seconds']:,.0f} tok/s, "
                  f"start-up {row['startup']['seconds']:.1f} s, load {row['load']:.1f}", file=sys.stderr)
    reference = next((r for r in rows if r["mode"] == "megatron"), rows[0])
    ref_name = "Megatron-LM" if reference["mode"] == "megatron" else "floor"
    print(f"\ntokenizer: {model.name} (sentencepiece {__import__('sentencepiece').__version__} BPE, vocab "
          f"{args.vocab_size}, spm_train defaults: nmt_nfkc, add_dummy_prefix, remove_extra_whitespaces, no byte "
          f"fallback); input: {args.size_mb} MB jsonl, {documents:,} documents of ~4 KB, "
          f"{'distinct text' if documents <= one_pass else 'books repeated'}; {os.cpu_count()} CPUs")
    if tool:
        print(f"Megatron-LM: python {' '.join(megatron_command(tool, 'IN.jsonl', 'MODEL', 'OUT', args.workers[0]))}"
              f"{' (checkout ' + str(root) + ')' if root else ' (script alone, installed megatron-core)'}")
        for note in reference["notes"]:
            print(f"  compat: {note}")
    else:
        print("Megatron-LM: row skipped (no usable --megatron-lm PATH: its tool is not in the megatron-core wheel); "
              "ratios are to the plain per-document sp.encode loop")
    print(f"\n| pipeline | workers | tokens | wall s | tokens/s per worker | / {ref_name} | start-up s | "
          f"tokens/s per worker, start-up excluded | / {ref_name} | CPU s main + workers | tokens per CPU-s | / {ref_name} | "
          f"tokens per CPU-s, start-up excluded | / {ref_name} | peak RSS main / worker MB | load avg | ids = {ref_name} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def steady(r):  # tokens/s per worker past the start-up
        return (r["tokens"] - r["startup"]["tokens"]) / max(r["seconds"] - r["startup"]["seconds"], 1e-9) / r["workers"]

    def steady_cpu(r):  # tokens per CPU-second (all processes) past the start-up
        cpu = r["cpu_main"] + r["cpu_workers"] - r["startup"]["cpu_main"] - r["startup"]["cpu_workers"]
        return (r["tokens"] - r["startup"]["tokens"]) / max(cpu, 1e-9)

    ref_rate = reference["tokens"] / reference["seconds"] / reference["workers"]
    ref_cpu = reference["tokens"] / (reference["cpu_main"] + reference["cpu_workers"])
    for r in rows:
        rate = r["tokens"] / r["seconds"] / r["workers"]
        cpu_rate = r["tokens"] / (r["cpu_main"] + r["cpu_workers"])
        same = r["bin_sha256"] == reference["bin_sha256"] and r["lengths_sha256"] == reference["lengths_sha256"]
        worker_rss = "-" if r["mode"] == "floor" else f"{r['worker_rss_mb']:.0f}"
        print(f"| {COMPARE_NAMES[r['mode']]} | {r['workers']} | {r['tokens']:,} | {r['seconds']:.1f} | {rate:,.0f} | "
              f"{rate / ref_rate:.2f}x | {r['startup']['seconds']:.1f} | {steady(r):,.0f} | {steady(r) / steady(reference):.2f}x | "
              f"{r['cpu_main']:.1f} + {r['cpu_workers']:.1f} | {cpu_rate:,.0f} | {cpu_rate / ref_cpu:.2f}x | "
              f"{steady_cpu(r):,.0f} | {steady_cpu(r) / steady_cpu(reference):.2f}x | "
              f"{r['main_rss_mb']:.0f} / {worker_rss} | {r['load']:.1f} | {'yes' if same else '**NO**'} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    said = sorted({line for r in rows for line in r["stderr"]})
    print(f"\nrun_preprocess said on stderr: {said if said else 'nothing (the segment cache was on)'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[20, 200])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--shared-data", default=os.environ.get("IIET_SHARED_DATA", str(REPO.parent / "shared" / "data")))
    parser.add_argument("--work-dir", default=None, help="scratch directory (default: a temp dir, deleted)")
    parser.add_argument("--compare-megatron", action="store_true",
                        help="the side-by-side run against Megatron-LM's tool (see above) instead of --sizes-mb")
    parser.add_argument("--megatron-lm", default=None, metavar="PATH",
                        help="Megatron-LM checkout, its tools/ directory or tools/preprocess_data.py (row skipped if absent)")
    parser.add_argument("--size-mb", type=int, default=20, help="--compare-megatron: input size")
    parser.add_argument("--workers", type=int, nargs="+", default=[1], help="--compare-megatron: worker counts")
    parser.add_argument("--with-nocache", action="store_true", help="--compare-megatron: add the no-segment-cache row")
    parser.add_argument("--json-out", default=None, help="--compare-megatron: also write the raw rows here")
    parser.add_argument("--model-cache", default=os.path.join(tempfile.gettempdir(), "iiet_bench_models"),
                        help="--compare-megatron: where the trained model is kept between runs")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "SOURCE", "TOKENIZER", "PREFIX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.mode, args.source, args.tokenizer, args.prefix = args.child
        return child(args)
    shared = Path(args.shared_data)
    if not (shared / "gutenberg").is_dir():
        raise SystemExit(f"error: {shared}/gutenberg not found (set --shared-data or IIET_SHARED_DATA)")
    if args.compare_megatron:
        if args.vocab_size == parser.get_default("vocab_size"):
            args.vocab_size = 32000
        if args.megatron_lm:
            try:
                resolve_megatron_lm(args.megatron_lm)
            except FileNotFoundError as error:
                print(f"note: Megatron-LM row skipped: {error}", file=sys.stderr)
                args.megatron_lm = None
        return compare_megatron(args, shared)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as scratch:
        scratch = Path(scratch)
        from megatron_iiet.data.tokenizer_training import TokenizerTrainingConfig, train_tokenizer

        make_input(shared, scratch / "train.jsonl", 20)
        train_tokenizer(TokenizerTrainingConfig(inputs=(str(scratch / "train.jsonl"),), output_dir=str(scratch / "tok"),
                                                vocab_size=args.vocab_size, input_sentence_size=100_000))
        tokenizer = str(scratch / "tok" / "tokenizer.model")
        rows = []
        for size in args.sizes_mb:
            source = scratch / f"in_{size}.jsonl"
            documents = make_input(shared, source, size)
            for mode in MODES:
                prefix = scratch / f"out_{size}_{mode}" / "ds"
                prefix.parent.mkdir()
                result = subprocess.run([sys.executable, __file__, "--child", mode, str(source), tokenizer, str(prefix)],
                                        capture_output=True, text=True)
                if result.returncode:
                    raise SystemExit(f"error: {mode} on {size} MB failed:\n{result.stderr[-3000:]}")
                row = json.loads(result.stdout.strip().splitlines()[-1])
                row.update(size=size, mode=mode, input_documents=documents, bin_sha256=_sha256(Path(str(prefix) + ".bin")))
                rows.append(row)
                print(f"  done {size} MB {mode}: {row['tokens'] / row['seconds']:,.0f} tok/s, "
                      f"{row['tokens'] / (row['cpu_main'] + row['cpu_workers']):,.0f} tok/CPU-s, load {row['load']:.1f}",
                      file=sys.stderr)
                for path in prefix.parent.iterdir():
                    path.unlink()
            source.unlink()
    print(f"\ntokenizer: sentencepiece BPE vocab {args.vocab_size}; documents ~4 KB; {os.cpu_count()} CPUs\n")
    print("| input | pipeline | tokens | wall s | tokens/s | tokens/s per worker / floor | CPU s main + workers | "
          "tokens per CPU-s | per CPU-s / floor | peak RSS main MB | peak RSS per worker MB | load avg | .bin = floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    floors = {r["size"]: r for r in rows if r["mode"] == "floor"}
    for r in rows:
        floor = floors[r["size"]]
        rate, floor_rate = r["tokens"] / r["seconds"], floor["tokens"] / floor["seconds"]
        cpu = r["cpu_main"] + r["cpu_workers"]
        cpu_rate = r["tokens"] / cpu
        floor_cpu_rate = floor["tokens"] / (floor["cpu_main"] + floor["cpu_workers"])
        workers = 1 if r["mode"] == "floor" else int(r["mode"].split("-")[0])
        worker_rss = "-" if r["mode"] == "floor" else f"{r['worker_rss_mb']:.0f}"
        same = "yes" if r["bin_sha256"] == floor["bin_sha256"] and r["tokens"] == floor["tokens"] else "**NO**"
        print(f"| {r['size']} MB | {NAMES[r['mode']]} | {r['tokens']:,} | {r['seconds']:.1f} | {rate:,.0f} | "
              f"{rate / workers / floor_rate:.2f}x | {r['cpu_main']:.1f} + {r['cpu_workers']:.1f} | {cpu_rate:,.0f} | "
              f"{cpu_rate / floor_cpu_rate:.2f}x | {r['main_rss_mb']:.0f} | {worker_rss} | {r['load']:.1f} | {same} |")
    if len(args.sizes_mb) >= 2:
        small, large = args.sizes_mb[0], args.sizes_mb[-1]
        print(f"\nPeak RSS growth {small} MB -> {large} MB input:")
        for mode in MODES:
            a = next(r for r in rows if r["size"] == small and r["mode"] == mode)
            b = next(r for r in rows if r["size"] == large and r["mode"] == mode)
            workers = "" if mode == "floor" else f", workers {100 * (b['worker_rss_mb'] / max(a['worker_rss_mb'], 1) - 1):+.1f}%"
            print(f"  {NAMES[mode]}: main {100 * (b['main_rss_mb'] / a['main_rss_mb'] - 1):+.1f}%{workers}")


if __name__ == "__main__":
    main()
