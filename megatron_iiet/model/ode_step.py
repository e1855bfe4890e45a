"""The one mechanism every architecture uses: running passes of a layer's block.

A "pass" is one evaluation of a layer's (weight-shared) block, optionally followed by a
normalisation owned by the architecture (PCformer's stage norms, the history's Np/Nc). Passes are
where the memory goes, so this is where activation checkpointing lives: each pass can be
checkpointed on its own, keeping only its input (the history states are kept by the history
itself) and recomputing the block inside backward.

Architectures (``architectures.py``) only decide how pass inputs are formed and how pass outputs
combine; they never touch checkpointing, RNG replay or pass counting.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from megatron.core import tensor_parallel
from torch.utils.checkpoint import checkpoint as torch_checkpoint


def checkpoint_with_rng_replay(function: Callable, *args):
    """``function(*args)`` without keeping its activations; recomputed in backward.

    Dropout must draw the same masks when recomputed. torch's checkpoint restores the default
    generators; megatron's tensor-parallel RNG streams (used by attention dropout) live in its
    RNG tracker, so their states are snapshotted here and put back for the recompute.
    """
    tracker = tensor_parallel.get_cuda_rng_tracker()
    snapshot = dict(tracker.get_states())
    first_call = True

    def run(*inner_args):
        nonlocal first_call
        if first_call:
            first_call = False
            return function(*inner_args)
        live_states = tracker.get_states()
        tracker.set_states(dict(snapshot))
        try:
            return function(*inner_args)
        finally:
            tracker.set_states(live_states)

    return torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


def checkpointed_passes(mode: str, total_passes: int) -> list[bool]:
    """Which passes of a layer are checkpointed under an iteration_checkpointing mode."""
    if mode == "none":
        return [False] * total_passes
    if mode == "all_passes":
        return [True] * total_passes
    if mode == "all_but_last_pass":
        return [True] * (total_passes - 1) + [False]
    raise ValueError(f"iteration_checkpointing: unknown mode {mode!r}")


class PassRunner:
    """Runs the passes of one layer's block during one forward.

    Calling it runs the next pass: ``runner(u)`` is ``Block(u)``; ``runner(u, norm)`` is
    ``norm(Block(u))`` with the norm inside the checkpointed region, so a checkpointed pass keeps
    only ``u`` and its (normalised) output.
    """

    def __init__(
        self,
        block: torch.nn.Module,
        block_kwargs: dict,
        checkpoint_flags: list[bool],
    ):
        self.block = block
        self.block_kwargs = block_kwargs
        self.checkpoint_flags = checkpoint_flags
        self.passes_run = 0

    @property
    def total_passes(self) -> int:
        return len(self.checkpoint_flags)

    def _run_block(self, u: torch.Tensor, norm: Optional[torch.nn.Module]) -> torch.Tensor:
        out, _ = self.block(u, **self.block_kwargs)
        return out if norm is None else norm(out)

    def __call__(self, u: torch.Tensor, norm: Optional[torch.nn.Module] = None) -> torch.Tensor:
        index = self.passes_run
        if index >= self.total_passes:
            raise RuntimeError(
                f"architecture ran pass {index + 1} but declared {self.total_passes} passes"
            )
        self.passes_run += 1
        if self.checkpoint_flags[index] and torch.is_grad_enabled():
            return checkpoint_with_rng_replay(self._run_block, u, norm)
        return self._run_block(u, norm)

    def residual(self, u: torch.Tensor) -> torch.Tensor:
        """F(u) = Block(u) - u, the block's residual branch (one pass)."""
        return self(u) - u

    def finish(self) -> None:
        if self.passes_run != self.total_passes:
            raise RuntimeError(
                f"architecture ran {self.passes_run} passes but declared {self.total_passes}"
            )
