"""The stall watchdog: a rank that makes no progress ends the job with one line naming it.

A stopped rank (SIGSTOP, a hung NFS read, a frozen node) used to hang a job for ever: the other
ranks wait in their next collective. Collective timeouts (``parallel.collective_timeout_s``,
passed to every process group) are the backstop; this watchdog comes first and says who.

Each rank runs a daemon thread that writes a heartbeat (``<logging.dir>/heartbeats/rankN.json``:
last finished step, wall time, whether the training thread is inside a collective) every
``stall_timeout_s / 10`` (at most 10 s). Progress is a finished step, validation or save. When a
rank sees no progress of its own for ``stall_timeout_s`` (3x before the first step: compilation,
warm-up), it reads every heartbeat and names the stalled rank: one whose heartbeat stopped (the
whole process is frozen), else one still at an older step, else one busy outside any collective
while the others wait in one. The lowest-ranked healthy rank prints the line, the stalled ranks
on its host are killed (a frozen process honours nothing but SIGKILL) and every rank that fired
exits with status 3, which ends the job under torchrun and under ``srun --kill-on-bad-exit``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from megatron_iiet.training.callbacks import Callback

STALL_EXIT_CODE = 3
FIRST_STEP_FACTOR = 3
_MAX_BEAT_SECONDS = 10.0


def collective_timeout_s(stall_timeout_s: float, collective_timeout: Optional[float]) -> float:
    """The process groups' timeout: as configured, else longer than the watchdog's, so that the
    watchdog names the stalled rank before a collective times out without saying who."""
    if collective_timeout is not None:
        return collective_timeout
    return stall_timeout_s + 600.0 if stall_timeout_s else 600.0


class StallWatchdog(Callback):
    def __init__(self, stall_timeout_s: float, directory: str | os.PathLike):
        self.timeout = stall_timeout_s
        self.directory = Path(directory)
        self.beat_seconds = min(_MAX_BEAT_SECONDS, stall_timeout_s / 10)
        from megatron_iiet.distributed import rank, world_size

        self.rank, self.world = rank(), world_size()
        self.host = socket.gethostname()
        self._progress = time.monotonic()
        self._step = 0
        self._first_step: Optional[int] = None
        self._watched = None  # the frame of Trainer.fit: the thread ends when it is gone

    # ---- progress (training thread) --------------------------------------------------------
    def _progressed(self, step: int) -> None:
        self._step, self._progress = step, time.monotonic()

    def on_train_begin(self, trainer):
        self._first_step = trainer.state.step
        self._progressed(trainer.state.step)
        self._watched = (threading.get_ident(), sys._getframe(1))
        self.directory.mkdir(parents=True, exist_ok=True)
        self._beat(waiting=False)
        threading.Thread(target=self._run, name="stall-watchdog", daemon=True).start()

    def on_step_end(self, trainer, event):
        self._progressed(event.step)

    def on_validation(self, trainer, step, loss):
        self._progressed(self._step)

    def on_save(self, trainer, path, seconds):
        self._progressed(self._step)

    def on_train_end(self, trainer, finished):
        self._progressed(self._step)  # the final validation and save come next

    # ---- the thread --------------------------------------------------------------------------
    def _stack(self) -> Optional[list]:
        """The training thread's frames while Trainer.fit runs, else None."""
        ident, fit_frame = self._watched
        frame = sys._current_frames().get(ident)
        frames = []
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        return frames if any(f is fit_frame for f in frames) else None

    def _beat(self, waiting: bool) -> None:
        from megatron_iiet.data.atomic import write_json_atomic

        try:
            write_json_atomic(self.directory / f"rank{self.rank}.json",
                              {"rank": self.rank, "host": self.host, "pid": os.getpid(),
                               "step": self._step, "time": time.time(), "waiting": waiting})
        except OSError:
            pass  # a full or unreachable disk: the others will read this rank as silent

    def _run(self) -> None:
        while True:
            time.sleep(self.beat_seconds)
            frames = self._stack()
            if frames is None:
                return  # training ended (or raised): nothing left to watch
            waiting = any(f"torch{os.sep}distributed{os.sep}" in f.f_code.co_filename
                          for f in frames)
            self._beat(waiting)
            allowed = self.timeout * (FIRST_STEP_FACTOR if self._step == self._first_step else 1)
            idle = time.monotonic() - self._progress
            if idle > allowed:
                self._end_job(idle)

    def _heartbeats(self) -> dict[int, Optional[dict]]:
        beats = {}
        for rank in range(self.world):
            try:
                beats[rank] = json.loads((self.directory / f"rank{rank}.json").read_text())
            except (OSError, ValueError):
                beats[rank] = None
        return beats

    def stalled_ranks(self) -> tuple[list[int], str]:
        """(the ranks to blame, why), from every rank's heartbeat."""
        beats = self._heartbeats()
        now = time.time()
        silent_after = max(self.timeout / 2, 3 * self.beat_seconds)
        silent = [r for r, b in beats.items() if b is None or now - b["time"] > silent_after]
        if silent:
            return silent, f"sent no heartbeat for over {silent_after:.0f} s (the process is " \
                           "stopped or frozen: SIGSTOP, a read in uninterruptible sleep, a dead node)"
        steps = {r: b["step"] for r, b in beats.items()}
        if min(steps.values()) < max(steps.values()):
            behind = [r for r, s in steps.items() if s == min(steps.values())]
            return behind, f"is still at step {min(steps.values())} while others finished " \
                           f"step {max(steps.values())}"
        busy = [r for r, b in beats.items() if not b["waiting"]]
        if busy and len(busy) < len(beats):
            return busy, "is busy outside any collective while the others wait for it in one " \
                         "(a hung read, a deadlock)"
        return [], "every rank waits in a collective"

    def _end_job(self, idle: float) -> None:
        culprits, why = self.stalled_ranks()
        healthy = [r for r in range(self.world) if r not in culprits]
        if self.rank == (healthy or culprits or [0])[0]:
            who = (f"rank {culprits[0]}" if len(culprits) == 1 else
                   f"ranks {', '.join(map(str, culprits))}" if culprits else "no single rank")
            print(f"error: training stalled: {who} {why}; no progress for {idle:.0f} s after "
                  f"step {self._step} (parallel.stall_timeout_s={self.timeout:g}); ending the job",
                  file=sys.stderr, flush=True)
            beats = self._heartbeats()
            for rank in culprits:
                beat = beats.get(rank)
                if beat and beat.get("host") == self.host and _same_job(beat.get("pid")):
                    try:
                        os.kill(beat["pid"], signal.SIGKILL)
                    except OSError:
                        pass  # gone already
        else:
            time.sleep(2 * self.beat_seconds)  # let the reporting rank's line go out first
        sys.stdout.flush()
        os._exit(STALL_EXIT_CODE)


def _same_job(pid) -> bool:
    """Whether ``pid`` is another rank of this job on this host (the same command line), not a
    process that reuses the pid of a rank of an earlier run whose heartbeat file is left."""
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() == Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return False  # gone, or no /proc: leave it to the launcher
