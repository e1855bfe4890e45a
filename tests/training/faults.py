"""What the fault tests share: copies of a finished run, real mounts for full and read-only
disks, process helpers, and the one-line-error check."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.training.conftest import records


def one_line_error(proc, *needles) -> str:
    """The run ended with exit 2 and a single `error:` line on stderr holding ``needles``."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(set(errors)) == 1, proc.stderr[-3000:]  # one line (each rank may print it)
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def copy_checkpoints(run_dir: Path, dst: Path) -> Path:
    """A new run directory holding a copy of ``run_dir``'s checkpoints (and nothing else)."""
    shutil.copytree(run_dir / "checkpoints", dst / "checkpoints")
    return dst


def listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A real tmpfs at ``path`` (``options``: e.g. "size=1m" or "ro"), for full and read-only
    disks: root ignores file permissions, so only a real mount makes a write fail here."""
    if os.geteuid() != 0:
        pytest.skip("not available: mounting a tmpfs needs root (full / read-only disk faults)")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs not available here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def wait_for(predicate, timeout: float = 240, proc=None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited early ({proc.returncode}):\n{proc.stdout.read()}")
        time.sleep(0.2)
    raise AssertionError("timed out waiting")


def wait_for_steps(log_dir: Path, n: int, proc) -> None:
    wait_for(lambda: len(records(log_dir, "train")) >= n, proc=proc)


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Payload:
    """Unpickling it creates ``marker``: planted code that reading a checkpoint must never run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def forge_manifest(ckpt: Path) -> None:
    """Re-record the manifest (sizes, checksums) of ``ckpt`` for its files as they are now, as
    whoever planted a file and rewrote meta.json would: only reading the pickles can catch it."""
    import json

    from megatron_iiet.training.checkpoint_index import (
        CHECKSUMS_KEY, MANIFEST_KEY, checksum_record, checksums, manifest)

    meta = json.loads((ckpt / "meta.json").read_text())
    files = manifest(ckpt)
    meta.update({MANIFEST_KEY: files, CHECKSUMS_KEY: checksum_record(checksums(ckpt, list(files)))})
    (ckpt / "meta.json").write_text(json.dumps(meta))
