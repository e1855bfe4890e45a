"""Run a script of this repository (a tool, pretrain_iiet.py) as a forked copy of the test process
instead of a fresh interpreter: what the script does is the same, its ~5 s of imports are not.

A fresh `python tools/x.py` spends most of a small test's time importing torch, megatron-core and
transformers. Here the child is `os.fork()`ed from pytest, which has those modules loaded, and runs
the script with `runpy` as `__main__` under the caller's argv, environment and working directory,
with its stdout and stderr at the file-descriptor level captured, its exit code as a process's
(`sys.exit`, an uncaught exception = 1 with the traceback on stderr, a signal = minus the signal).
The modules a child imported that the parent had not are imported in the parent afterwards, so
the next child of the same script starts warm.

What a fork cannot reproduce, and where a test must therefore use a real subprocess (the callers
fall back on their own):
- a run of several processes (torchrun), or one the test signals or kills while it runs;
- a parent with a live torch.distributed process group (its sockets would be shared);
- more than one intra-op thread: GNU OpenMP's thread pool does not survive a fork, so the child
  runs with OMP_NUM_THREADS=1, as every launcher in this suite asks anyway.
A test about start-up itself (imports, `--help` in a clean interpreter) keeps a real subprocess.
Set IIET_TEST_FRESH_PROCESSES=1 to run everything in fresh interpreters (the slow, literal way).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

# Only these packages' modules are imported into the test process after a child used them:
# libraries, never the scripts themselves or anything of the tests.
_WARMABLE = ("torch", "megatron", "megatron_iiet", "transformers", "lm_eval", "datasets",
             "sentencepiece", "safetensors", "numpy", "deepspeed", "tensorboard", "evaluate")


def fork_usable(env: dict) -> bool:
    """Whether a forked child can stand in for a fresh process here (see the module's notes)."""
    if os.environ.get("IIET_TEST_FRESH_PROCESSES") == "1" or not hasattr(os, "fork"):
        return False
    if env.get("OMP_NUM_THREADS", "1") != "1":
        return False
    try:
        import torch.distributed as dist
        return not (dist.is_available() and dist.is_initialized())
    except ImportError:
        return True


def run_script(script: str | Path, args, *, env: dict | None = None, cwd: str | Path | None = None,
               timeout: float | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run([python, script, *args], capture_output=True, text=True, ...)`, forked when
    `fork_usable(env)`, else exactly that."""
    env = dict(os.environ if env is None else env)
    argv = [str(script), *map(str, args)]
    if not fork_usable(env):
        return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="forked_") as folder:
        out, err, imported = (Path(folder) / name for name in ("stdout", "stderr", "modules"))
        before = set(sys.modules)
        # The parent's garbage is collected here, where its threads live: a process group freed
        # in the child would wait forever for worker threads a fork does not copy.
        gc.collect()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _child(argv, env, cwd, timeout, out, err, imported, before)
        code = _wait(pid, timeout)
        stdout, stderr = (path.read_text(errors="replace") for path in (out, err))
        if code is None:
            stop = subprocess.TimeoutExpired([sys.executable, *argv], timeout, stdout, stderr)
            stop.add_note(f"the child's stderr, ending with its stacks:\n{stderr[-6000:]}")
            raise stop
        _warm(imported)
        return subprocess.CompletedProcess([sys.executable, *argv], code, stdout, stderr)


def _child(argv, env, cwd, timeout, out: Path, err: Path, imported: Path, before: set) -> None:
    code = 1
    gc.freeze()  # and the child never collects what it inherited
    try:
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False,
                          buffering=1)
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False,
                          buffering=1)
        sys.stdin = open(os.devnull)
        os.environ.clear()
        os.environ.update(env)
        if cwd is not None:
            os.chdir(cwd)
        # A fresh interpreter's state, where pytest's differs: signal dispositions, handlers on the
        # root logger (pytest's capture), warning filters, atexit hooks, one intra-op thread.
        for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
                       signal.SIGCHLD, signal.SIGALRM):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        logging.root.handlers.clear()
        logging.root.setLevel(logging.WARNING)
        warnings.resetwarnings()
        if "ignore" in env.get("PYTHONWARNINGS", ""):
            warnings.simplefilter("ignore")
        atexit._clear()
        # multiprocessing's exit hook (it shuts down the managers a script started, e.g.
        # megatron-core's checkpoint-writer queue, and joins its children) is registered at
        # import, in this process's parent: cleared above, a manager the script started would
        # outlive it (one ~330 MB process per save test, ignoring SIGTERM as our helpers do).
        # Registered afresh, for the script's own finalizers and children, not the parent's.
        import multiprocessing.process
        import multiprocessing.util
        multiprocessing.util._finalizer_registry.clear()
        multiprocessing.process._children.clear()
        atexit.register(multiprocessing.util._exit_function)
        if timeout is not None:  # a child killed at the timeout shows where it hung
            import faulthandler
            faulthandler.dump_traceback_later(max(timeout - 1, timeout / 2), file=sys.stderr)
        import torch
        torch.set_num_threads(1)
        import runpy
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if stop.code is not None and not isinstance(stop.code, int):
                print(stop.code, file=sys.stderr)
        except BaseException:  # as an interpreter would: the traceback, then status 1
            import traceback
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
        new = sorted(name for name in set(sys.modules) - before
                     if name.split(".")[0] in _WARMABLE)
        imported.write_text("\n".join(new))
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)


def _wait(pid: int, timeout: float | None) -> int | None:
    """The child's exit code as subprocess reports it, or None once it was killed at `timeout`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if deadline is not None and time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.05)


def _warm(imported: Path) -> None:
    if not imported.is_file():
        return
    for name in imported.read_text().splitlines():
        if name and name not in sys.modules:
            try:
                __import__(name)
            except Exception:  # a module that only imports in the child's state: stays cold
                pass
