"""Child processes that end with the process that started them.

A parent killed with SIGKILL runs no cleanup, so nothing else would stop its children: the
preprocessing workers would tokenize on as orphans, a sweep's run would train on unobserved. On
Linux the kernel can signal a child when its parent dies (prctl PR_SET_PDEATHSIG); the setting
survives exec, so it also serves as a ``subprocess.Popen(preexec_fn=...)``. Elsewhere callers
fall back to watching the parent themselves.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def signal_on_parent_death(signum: int, parent_pid: int) -> bool:
    """Ask the kernel for ``signum`` when ``parent_pid`` (our parent) dies. False where that is
    not available (not Linux); exits at once if the parent died before the request took effect
    (no signal would come). The kernel sends it when the parent's *thread* that started us exits:
    start children from a thread that lives as long as the parent (the main one)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:
        os._exit(1)
    return True


def terminate_with_parent(parent_pid: int):
    """A ``preexec_fn`` for Popen: the child gets SIGTERM when ``parent_pid`` dies (a trainer
    then saves its step and exits, as on preemption)."""
    return lambda: signal_on_parent_death(signal.SIGTERM, parent_pid)
