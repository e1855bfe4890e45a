"""Nothing lost under faults (issue 9): concurrent runs to one output, corrupted or foreign
datasets before training, inputs edited in place, directory prefixes, unwritable or full output
directories, and a main process killed under its workers. Faults are real: processes, signals,
mounts and files."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_iiet.data import indexed_io
from megatron_iiet.data.atomic import temp_leftovers, temp_path_for
from megatron_iiet.data.blend import validate_blend
from megatron_iiet.data.errors import DataInputError, OutputWriteError
from megatron_iiet.locks import lock_path
from megatron_iiet.data.preprocess import shard_prefix
from megatron_iiet.data.tokenizer import Tokenizer
from tests.data.helpers import (REPO, gutenberg_paragraphs, megatron_documents, one_line_error, preprocess, run_tool,
                                tool_command, write_jsonl)

HOUR_NS = 3600 * 10**9


def _wait_for(condition, what: str, process: subprocess.Popen | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"process ended (rc {process.returncode}) before {what}: {process.stderr.read()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _files(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()}


def _dataset_bytes(prefix) -> tuple[bytes, bytes]:
    return indexed_io.bin_path(prefix).read_bytes(), indexed_io.idx_path(prefix).read_bytes()


def _age(prefix, nanoseconds: int = HOUR_NS) -> None:
    """Date a dataset's files back: a just-written dataset is not remembered as verified (an edit
    in the same timestamp tick as its last write would keep the mtime)."""
    for path in indexed_io.dataset_files(prefix):
        stamp = path.stat().st_mtime_ns - nanoseconds
        os.utime(path, ns=(stamp, stamp))


def _flip_byte_in_place(path: Path, offset: int = 7) -> None:
    """Corrupt one byte without changing the file's size or inode."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        value = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([value ^ 0xFF]))


@pytest.fixture()
def dataset(tmp_path, small_tokenizer) -> str:
    source = write_jsonl(tmp_path / "in.jsonl", [f"document number {i} " * 5 for i in range(50)])
    return preprocess([source], small_tokenizer, tmp_path / "ds" / "data").outputs[0]


# ---- mounts: root ignores file permissions, so unwritable and full directories need a real mount ---
def _mount_tmpfs(target: Path, options: str) -> None:
    target.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"tmpfs mount not available ({result.stderr.strip() or result.returncode}); "
                    "as root only a mount makes a directory unwritable or full")


@pytest.fixture()
def mounts():
    """mounts(target, options) mounts a tmpfs there for the test; unmounted afterwards."""
    mounted: list[Path] = []

    def mount(target: Path, options: str) -> Path:
        _mount_tmpfs(target, options)
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", str(target)], check=False)


@pytest.fixture()
def read_only_dir(tmp_path, mounts) -> Path:
    target = tmp_path / "read_only"
    if os.geteuid() != 0:
        target.mkdir()
        target.chmod(0o555)
        yield target
        target.chmod(0o755)
        return
    yield mounts(target, "ro,size=1m")


# ---- 5: two runs to one output --------------------------------------------------------------------
def test_second_preprocess_to_same_prefix_refuses(tmp_path, small_tokenizer, shared_data):
    source = write_jsonl(tmp_path / "in.jsonl", gutenberg_paragraphs(shared_data, books=2))
    solo = preprocess([source], small_tokenizer, tmp_path / "solo" / "ds").outputs[0]
    prefix = tmp_path / "out" / "ds"
    command = tool_command("preprocess_data.py", "--input", source, "--tokenizer", small_tokenizer,
                           "--output-prefix", prefix, "--workers", "1", "--no-progress")
    first = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = lock_path(prefix)
    try:
        _wait_for(lambda: lock.exists() and f"pid {first.pid} " in lock.read_text(), "the first run holds the lock", first)
        # Stopped, the first run holds the lock for as long as the second needs: no race on timing.
        os.killpg(first.pid, signal.SIGSTOP)
        before = _files(prefix.parent)
        line = one_line_error(run_tool("preprocess_data.py", *command[2:], timeout=120))
        assert line.startswith(f"error: {prefix}: busy: another preprocessing run holds {lock} (pid {first.pid} on host ")
        assert line.endswith("wait for it to finish or choose another --output-prefix")
        assert _files(prefix.parent) == before  # nothing of the first run's touched
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert _dataset_bytes(prefix) == _dataset_bytes(solo)
    assert not lock.exists() and not list(prefix.parent.glob("*tmp-partial*"))


def test_temp_names_differ_between_processes(tmp_path):
    target = tmp_path / "ds.bin"
    code = "import sys; from megatron_iiet.data.atomic import temp_path_for; print(temp_path_for(sys.argv[1]))"
    theirs = Path(subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, check=True,
                                 cwd=REPO).stdout.strip())
    ours = temp_path_for(target)
    assert theirs != ours and theirs.parent == ours.parent == tmp_path
    for path in (theirs, ours):
        path.write_bytes(b"partial")
    (tmp_path / "ds.bin.other").write_bytes(b"not a leftover of ds.bin")
    assert temp_leftovers(target) == sorted([theirs, ours])  # a cleanup finds both runs' leftovers


def test_train_tokenizer_refuses_to_replace_model_without_overwrite(tmp_path):
    out = tmp_path / "tok"
    common = ("--input", "builtin:python-stdlib:200KB", "--output-dir", out, "--threads", "1")
    assert run_tool("train_tokenizer.py", *common, "--vocab-size", "400").returncode == 0
    model = out / "tokenizer.model"
    original = model.read_bytes()
    line = one_line_error(run_tool("train_tokenizer.py", *common, "--vocab-size", "500"))
    assert line == (f"error: {model}: already exists (data preprocessed with it would no longer match); "
                    "choose another --output-dir or pass --overwrite")
    assert model.read_bytes() == original
    replaced = run_tool("train_tokenizer.py", *common, "--vocab-size", "500", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert Tokenizer.from_path(model).vocab_size == 500
    assert not lock_path(model).exists()


# ---- 6: training checks the recorded checksums and the token ids ----------------------------------
def _train_config(prefix, tokenizer, **data):
    from megatron_iiet.training.config import TrainConfig

    config = TrainConfig()
    config.data.train, config.data.tokenizer = str(prefix), str(tokenizer)
    for key, value in data.items():
        setattr(config.data, key, value)
    return config


def test_flipped_bytes_in_bin_fail_the_training_data_check(dataset, small_tokenizer):
    from megatron_iiet.training.data import resolve_sources

    _flip_byte_in_place(indexed_io.bin_path(dataset))
    message = f"{dataset}.bin: checksum differs from data.meta.json; the file is corrupted"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        validate_blend(dataset)
    with pytest.raises(ValueError, match=f"^data: {re.escape(message)}$"):
        resolve_sources(_train_config(dataset, small_tokenizer))
    skipped = resolve_sources(_train_config(dataset, small_tokenizer, verify_checksums=False))
    assert skipped.train_blend == [(1.0, dataset)]


def test_token_id_outside_vocabulary_fails_naming_the_dataset(tmp_path, small_tokenizer):
    from megatron_iiet.training.data import resolve_sources

    tokenizer = Tokenizer.from_path(small_tokenizer)
    prefix = str(tmp_path / "foreign" / "ds")
    # Intact files with this tokenizer's fingerprint but an id it does not have (data converted
    # from elsewhere): only the id check can catch it, before the embedding would.
    writer = indexed_io.IndexedDatasetWriter(prefix, np.uint16)
    writer.add_documents(np.array([5, 6, tokenizer.vocab_size, tokenizer.eod_id]), np.array([4]))
    writer.finalize({"tokenizer": tokenizer.describe()})
    expected = "^" + re.escape(f"data: blend dataset {prefix} holds token id {tokenizer.vocab_size}, outside the "
                               f"tokenizer's vocabulary of {tokenizer.vocab_size} (ids 0..{tokenizer.vocab_size - 1})")
    for verify in (True, False):  # found in the checksum pass, or read from the meta.json
        with pytest.raises(ValueError, match=expected):
            resolve_sources(_train_config(prefix, small_tokenizer, verify_checksums=verify))


def test_checksum_check_is_remembered_until_the_file_changes(dataset):
    for path in indexed_io.dataset_files(dataset):
        os.utime(path)  # written just now, whatever the time the fixture took
    validate_blend(dataset)
    assert not indexed_io.verified_path(dataset).exists(), "files written just now must not be remembered"
    _age(dataset)
    validate_blend(dataset)
    assert indexed_io.verified_path(dataset).exists()
    record = indexed_io.verified_path(dataset).stat().st_mtime_ns
    assert validate_blend(dataset) == [(1.0, dataset)]  # remembered: no new full read, no new record
    assert indexed_io.verified_path(dataset).stat().st_mtime_ns == record
    # Corrupt the .bin in place and put its mtime back: the ctime moved (no ordinary tool sets it
    # back), so the check runs again (issue 28: this used to train on the corrupted bytes).
    binary = indexed_io.bin_path(dataset)
    stamp = binary.stat().st_mtime_ns
    _flip_byte_in_place(binary)
    os.utime(binary, ns=(stamp, stamp))
    with pytest.raises(ValueError, match=r"data\.bin: checksum differs"):
        validate_blend(dataset)
    os.utime(binary, ns=(stamp + 10**9, stamp + 10**9))  # any change of the mtime: read again
    with pytest.raises(ValueError, match=r"data\.bin: checksum differs"):
        validate_blend(dataset)


def test_read_only_dataset_is_verified_without_remembering(tmp_path, small_tokenizer, mounts):
    if os.geteuid() != 0:
        pytest.skip("not available: remounting read-only needs root")
    shared = mounts(tmp_path / "shared", "size=4m")
    source = write_jsonl(tmp_path / "in.jsonl", [f"text {i}" for i in range(20)])
    prefix = preprocess([source], small_tokenizer, shared / "ds").outputs[0]
    _age(prefix)
    subprocess.run(["mount", "-o", "remount,ro", str(shared)], check=True)
    assert validate_blend(prefix) == [(1.0, prefix)]
    assert not indexed_io.verified_path(prefix).exists()


def test_corrupted_dataset_stops_pretrain_with_one_line(tmp_path, dataset, small_tokenizer):
    from tests.training.conftest import base_overrides, launch, records

    _flip_byte_in_place(indexed_io.bin_path(dataset), offset=100)
    data = SimpleNamespace(data_prefix=dataset, tokenizer_model=str(small_tokenizer))
    line = one_line_error(launch(base_overrides(data, tmp_path / "run"), timeout=300))
    assert line == f"error: data: {dataset}.bin: checksum differs from data.meta.json; the file is corrupted"
    assert not records(tmp_path / "run", "train")


# ---- 7: inputs edited in place ----------------------------------------------------------------------
def test_input_edited_in_place_is_not_taken_as_complete(tmp_path, small_tokenizer):
    source = write_jsonl(tmp_path / "in.jsonl", ["the old text", "more words"])
    prefix = tmp_path / "out" / "ds"
    preprocess([source], small_tokenizer, prefix)
    assert preprocess([source], small_tokenizer, prefix).already_complete  # unchanged: nothing redone
    old_output = _dataset_bytes(prefix)
    size = source.stat().st_size
    source.write_text(source.read_text().replace("old", "new"))  # same size, other content
    assert source.stat().st_size == size
    with pytest.raises(DataInputError, match=re.escape(f"differs in: inputs: {source} was modified since") + ".*pass --overwrite$"):
        preprocess([source], small_tokenizer, prefix)
    assert _dataset_bytes(prefix) == old_output
    redone = preprocess([source], small_tokenizer, prefix, overwrite=True)
    assert not redone.already_complete
    assert Tokenizer.from_path(small_tokenizer).decode(megatron_documents(prefix)[0][:-1]) == "the new text"
    assert preprocess([source], small_tokenizer, prefix).already_complete


def test_record_without_input_mtimes_still_counts_as_complete(tmp_path, small_tokenizer):
    source = write_jsonl(tmp_path / "in.jsonl", ["some text"])
    prefix = tmp_path / "out" / "ds"
    preprocess([source], small_tokenizer, prefix)
    meta = indexed_io.read_meta(prefix)
    meta["run"]["inputs"] = [entry[:2] for entry in meta["run"]["inputs"]]  # as recorded before mtimes were
    indexed_io.write_json_atomic(indexed_io.meta_path(prefix), meta)
    assert preprocess([source], small_tokenizer, prefix).already_complete


# ---- 8: a prefix naming a directory -----------------------------------------------------------------
@pytest.mark.parametrize("form", ["trailing slash", "existing directory"])
def test_output_prefix_naming_a_directory_refuses(tmp_path, small_tokenizer, form):
    source = write_jsonl(tmp_path / "in.jsonl", ["some text"])
    directory = tmp_path / "out"
    if form == "existing directory":
        directory.mkdir()
    prefix = f"{directory}/" if form == "trailing slash" else str(directory)
    expected = f"--output-prefix {prefix}: names a directory, not a file name prefix; give e.g. {directory}/corpus "
    with pytest.raises(DataInputError, match="^" + re.escape(expected)):
        preprocess([source], small_tokenizer, prefix)
    assert not directory.exists() or not list(directory.iterdir())


def test_cli_output_prefix_with_trailing_slash_gives_one_line(tmp_path, small_tokenizer):
    source = write_jsonl(tmp_path / "in.jsonl", ["some text"])
    line = one_line_error(run_tool("preprocess_data.py", "--input", source, "--tokenizer", small_tokenizer,
                                   "--output-prefix", f"{tmp_path / 'out'}/"))
    assert line.startswith(f"error: --output-prefix {tmp_path / 'out'}/: names a directory")
    assert not (tmp_path / "out").exists()


# ---- 11: unwritable and full output directories ----------------------------------------------------
def test_read_only_output_directory_refuses_with_one_line(tmp_path, small_tokenizer, read_only_dir):
    source = write_jsonl(tmp_path / "in.jsonl", ["some text"] * 20)
    reason = "(read-only file system|permission denied)"
    for command in (("preprocess_data.py", "--input", source, "--tokenizer", small_tokenizer,
                     "--output-prefix", read_only_dir / "sub" / "ds", "--no-progress"),
                    ("train_tokenizer.py", "--input", source, "--output-dir", read_only_dir, "--vocab-size", "300")):
        line = one_line_error(run_tool(*command))
        assert re.fullmatch(rf"error: cannot write to {re.escape(str(read_only_dir))}: {reason}", line), line


def test_full_output_directory_reports_no_space(tmp_path, small_tokenizer, shared_data, mounts):
    if os.geteuid() != 0:
        pytest.skip("not available: mounting a small tmpfs needs root")
    full = mounts(tmp_path / "small", "size=64k")
    source = write_jsonl(tmp_path / "in.jsonl", gutenberg_paragraphs(shared_data, books=1))  # ~300 KB of tokens
    with pytest.raises(OutputWriteError, match=f"^no space left on {re.escape(str(full))}"):
        preprocess([source], small_tokenizer, full / "ds")
    assert not list(full.iterdir())  # the partial .bin, its spill file and the lock are gone


# ---- 15b: workers of a killed main process ----------------------------------------------------------
def test_workers_exit_when_main_process_is_killed(tmp_path, small_tokenizer, shared_data):
    psutil = pytest.importorskip("psutil")
    source = write_jsonl(tmp_path / "in.jsonl", gutenberg_paragraphs(shared_data, books=6))
    prefix = tmp_path / "out" / "ds"
    command = tool_command("preprocess_data.py", "--input", source, "--tokenizer", small_tokenizer, "--output-prefix",
                           prefix, "--workers", "2", "--shard-size", "40K", "--batch-documents", "32", "--no-progress")
    main = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        _wait_for(lambda: indexed_io.meta_path(shard_prefix(str(prefix), 1)).exists(), "the workers tokenize", main)
        workers = psutil.Process(main.pid).children(recursive=True)
        assert len(workers) >= 2, workers
        os.kill(main.pid, signal.SIGKILL)  # no cleanup runs in the main process
        main.wait()
        _, alive = psutil.wait_procs(workers, timeout=10)
        # An orphan that exited waits as a zombie until whatever adopted it reaps it: it is gone.
        running = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not running, f"workers outlived their main process: {running}"
    finally:
        for process in workers:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass


def test_a_forked_child_does_not_hold_its_parents_lock(tmp_path):
    """A lock is its holder's (the file names the pid): a child forked while it is held must be
    refused like any other process, not take it again as its own."""
    from megatron_iiet.locks import LockHeld, exclusive_output

    target = tmp_path / "out"
    with exclusive_output(target, "the parent's job", "wait"):
        pid = os.fork()
        if pid == 0:
            try:
                with exclusive_output(target, "the parent's job", "wait"):
                    os._exit(1)  # taken: wrong
            except LockHeld as refusal:
                os._exit(0 if f"pid {os.getppid()}" in str(refusal) else 3)
            os._exit(4)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not lock_path(target).exists()
