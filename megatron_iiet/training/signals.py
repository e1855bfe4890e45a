"""Preemption: SIGTERM / SIGUSR1 ask the job to finish its step, save and exit 0.

The handler only records the request; the training loop polls it once per step and all ranks
agree (a MAX all-reduce), so every rank saves the same step even if only some got the signal.
A signal that arrives during a save does not interrupt it.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    def __init__(self):
        self.received: int = 0
        self._previous = {}

    def __enter__(self):
        for sig in PREEMPTION_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        self.received = signum

    def stop_requested(self) -> bool:
        """True on every rank if any rank received a preemption signal."""
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
