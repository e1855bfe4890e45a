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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def make_input(shared: Path, path: Path, size_mb: int) -> int:
    """Write ~size_mb MB of jsonl: 4 KB documents of Gutenberg text, the books repeated."""
    from megatron_iiet.data.corpus import strip_gutenberg_boilerplate

    documents = []
    for book in sorted((shared / "gutenberg").glob("*.txt")):
        with open(book, encoding="utf-8-sig", newline="") as handle:
            body = strip_gutenberg_boilerplate(handle.read(), str(book))
        documents.extend(body[i:i + 4096] for i in range(0, len(body), 4096))
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

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.wait(0.2):
            try:
                children = Path(f"/proc/{me}/task/{me}/children").read_text().split()
            except OSError:
                continue
            for pid in children:
                try:  # only our spawn workers: a finished child's pid may be reused meanwhile
                    if b"multiprocessing.spawn" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                        continue
                except OSError:
                    continue
                self.peak = max(self.peak, _hwm_mb(pid))


def child(args) -> None:
    watcher = _WorkerPeakWatcher()
    watcher.start()
    load = os.getloadavg()[0]
    started = time.perf_counter()
    if args.mode == "floor":
        documents, tokens = floor_loop(args.source, args.tokenizer, args.prefix)
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
    print(json.dumps({"documents": documents, "tokens": tokens, "seconds": seconds, "main_rss_mb": _hwm_mb(),
                      "worker_rss_mb": watcher.peak, "cpu_main": own.ru_utime + own.ru_stime,
                      "cpu_workers": children.ru_utime + children.ru_stime, "load": (load + os.getloadavg()[0]) / 2}))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


MODES = ("floor", "1", "2", "1-nocache")
NAMES = {"floor": "plain loop (floor)", "1": "preprocess, 1 worker", "2": "preprocess, 2 workers",
         "1-nocache": "preprocess, 1 worker, no segment cache"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[20, 200])
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--shared-data", default=os.environ.get("IIET_SHARED_DATA", str(REPO.parent / "shared" / "data")))
    parser.add_argument("--work-dir", default=None, help="scratch directory (default: a temp dir, deleted)")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "SOURCE", "TOKENIZER", "PREFIX"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.mode, args.source, args.tokenizer, args.prefix = args.child
        return child(args)
    shared = Path(args.shared_data)
    if not (shared / "gutenberg").is_dir():
        raise SystemExit(f"error: {shared}/gutenberg not found (set --shared-data or IIET_SHARED_DATA)")
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
