"""tools/merge_datasets.py never replaces data by surprise: an input is never the output (even
with --overwrite, even through a linked folder), and an existing output is kept unless
--overwrite. Real datasets, the real CLI."""

from __future__ import annotations

from pathlib import Path

from tests.data.helpers import megatron_documents, one_line_error, preprocess, run_tool, write_jsonl

SUFFIXES = (".bin", ".idx", ".meta.json")


def _dataset(tmp_path: Path, tokenizer, name: str, documents: int) -> str:
    source = write_jsonl(tmp_path / f"{name}.jsonl", [f"{name} document {i} " * 4 for i in range(documents)])
    return preprocess([source], tokenizer, tmp_path / "ds" / name).outputs[0]


def _files(prefix) -> dict[str, bytes]:
    return {suffix: Path(str(prefix) + suffix).read_bytes() for suffix in SUFFIXES}


def test_merge_never_replaces_an_input_nor_an_existing_output_without_overwrite(tmp_path, small_tokenizer):
    a = _dataset(tmp_path, small_tokenizer, "a", 20)
    b = _dataset(tmp_path, small_tokenizer, "b", 7)
    inputs = _files(a)
    (tmp_path / "linked").symlink_to(tmp_path / "ds")
    for out, flags in ((a, ()), (a, ("--overwrite",)), (tmp_path / "linked" / "a", ("--overwrite",))):
        line = one_line_error(run_tool("merge_datasets.py", "--input", a, b, "--output-prefix", out, *flags))
        assert "is one of the inputs" in line and str(a) in line, line
        assert _files(a) == inputs

    merged = tmp_path / "out" / "merged"
    done = run_tool("merge_datasets.py", "--input", a, b, "--output-prefix", merged)
    assert done.returncode == 0, done.stderr[-3000:]
    first = _files(merged)
    line = one_line_error(run_tool("merge_datasets.py", "--input", b, "--output-prefix", merged))
    assert f"{merged}.meta.json: exists" in line and "--overwrite" in line, line
    assert _files(merged) == first

    done = run_tool("merge_datasets.py", "--input", b, "--output-prefix", merged, "--overwrite")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [d.tolist() for d in megatron_documents(merged)] == [d.tolist() for d in megatron_documents(b)]
