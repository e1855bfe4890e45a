"""Preemption: SIGTERM / SIGUSR1 ask the job to finish its step, save and exit 0.

The handler only records the request; the training loop polls it once per step and all ranks
agree (a MAX all-reduce), so every rank saves the same step even if only some got the signal.
A signal that arrives during a save does not interrupt it.

The signal rarely reaches the trainer alone: torchrun forwards it to each rank's whole process
group, and SLURM (``scancel --signal``, preemption) signals every process of the step. So the
trainer's helper processes ignore these signals and end when the trainer ends them, after the
save: forked ones (data-loader workers, megatron's checkpoint writers) through a fork hook active
while the handler is installed; spawned ones (the queue manager of megatron's writers) because
they re-import the entry script as ``__mp_main__``, which calls ``protect_spawned_helper``.

Under torchrun each rank also watches its launcher: when the agent is gone (``kill -9``), the
ranks, which live in their own process sessions, would otherwise train on to the end unseen;
they treat it like a preemption signal instead.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Optional

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_active = False  # a PreemptionHandler is installed in this process
_fork_hook_registered = False


def ignore_preemption_signals(*_args) -> None:
    """In a helper process: leave preemption signals to the trainer (also a worker_init_fn)."""
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _after_fork_in_child() -> None:
    if _active:
        ignore_preemption_signals()


def protect_spawned_helper(module_name: str) -> None:
    """Called at the top of an entry script with its ``__name__``: a process that multiprocessing
    spawns re-imports the script as ``__mp_main__`` (and a signal mask does not survive that
    start), so this is where a spawned helper learns to ignore preemption signals. Cheap: no
    torch import."""
    if module_name == "__mp_main__":
        ignore_preemption_signals()


def _end_daemonic_helpers() -> None:
    """Daemonic children (data-loader workers) are terminated at interpreter exit with
    SIGTERM, which ours ignore: end any still alive here with SIGKILL, which is what their
    daemonic status promises (they die with their parent), so the exit cannot hang.

    PyTorch's SIGCHLD handler reports a worker killed while its loader is still referenced as
    a failure ("DataLoader worker ... is killed by signal"), which failed a finished run on a
    GPU: these deaths are ours, so that handler is removed first."""
    import multiprocessing

    helpers = [c for c in multiprocessing.active_children() if c.daemon]
    if helpers and hasattr(signal, "SIGCHLD"):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in helpers:
        child.kill()
        child.join(5)


def launcher_pid() -> Optional[int]:
    """The torchrun agent that started this rank (its parent), or None outside torchrun.

    Only torchrun's agent is watched: a plain `python` or `nohup` launch may outlive its shell
    on purpose, and under srun the step's processes are ended by SLURM itself.
    """
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


class PreemptionHandler:
    def __init__(self):
        self.received: int = 0
        self.reason: Optional[str] = None
        self._previous = {}
        self._launcher = launcher_pid()
        self._raise: Optional[type] = None

    def __enter__(self):
        global _active, _fork_hook_registered
        for sig in PREEMPTION_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        if not _fork_hook_registered:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook_registered = True
        _active = True
        return self

    def __exit__(self, *exc):
        global _active
        _active = False
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        _end_daemonic_helpers()

    def _on_signal(self, signum, frame):
        self.received = signum
        self._raise_if_received()

    def _raise_if_received(self) -> None:
        if self._raise is not None and self.received:
            self.reason = self.reason or f"{signal.Signals(self.received).name} received"
            raise self._raise(self.reason)

    @contextlib.contextmanager
    def raising(self, exc_type: Optional[type]):
        """While inside, a preemption signal raises ``exc_type`` in the main thread at once (one
        received before raises on entry); ``None`` suspends an enclosing one. Only around work
        that runs no collective (lm-eval building its requests on rank 0), which may then be
        left at any point without leaving another rank inside a collective."""
        previous, self._raise = self._raise, exc_type
        try:
            self._raise_if_received()
            yield
        finally:
            self._raise = previous
        self._raise_if_received()  # a signal that came while suspended

    _LAUNCHER_GONE = 1000  # above every signal number, so a lost launcher outranks a signal

    def _local_reason(self) -> tuple[int, Optional[str]]:
        """(code, reason): 0 nothing, the signal's number, or _LAUNCHER_GONE."""
        if self._launcher is not None and os.getppid() != self._launcher:
            return self._LAUNCHER_GONE, f"the launcher (torchrun, pid {self._launcher}) is gone"
        if self.received:
            return int(self.received), f"{signal.Signals(self.received).name} received"
        return 0, None

    def stop_requested(self) -> bool:
        """True on every rank if any rank was signalled or lost its launcher. A launcher such as
        torchrun forwards a signal to one rank after another, so a rank may learn of it from the
        others first: its reason then names the signal another rank received."""
        import torch
        import torch.distributed as dist

        code, local = self._local_reason()
        flag = torch.tensor([code], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        agreed = int(flag.item())
        if agreed and self.reason is None:
            if code == agreed or (code and agreed != self._LAUNCHER_GONE):
                self.reason = local  # its own signal, even where another rank got a different one
            elif agreed == self._LAUNCHER_GONE:
                self.reason = "the launcher is gone (seen by another rank)"
            else:
                self.reason = f"{signal.Signals(agreed).name} received by another rank"
        return bool(agreed)
