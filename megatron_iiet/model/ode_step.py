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


def run_pass(block: torch.nn.Module, norm: Optional[torch.nn.Module], u: torch.Tensor,
             block_kwargs: dict) -> torch.Tensor:
    """One pass: ``norm(Block(u))`` (or ``Block(u)``)."""
    out, _ = block(u, **block_kwargs)
    return out if norm is None else norm(out)


# Every pass checkpointed, but its tail (FC2 and the pass's norm) keeps its saved tensors: see
# PassRunner.
KEEP_TAIL_MODE = "all_passes_keep_tail"


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _SavedAsIs:
    """While ``module`` runs, the tensors it saves for backward are stored as they are instead of
    being left to the enclosing checkpoint (module hooks, so the block's code is not forked)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __enter__(self):
        contexts = []

        def enter(_module, _args):
            contexts.append(torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is))
            contexts[-1].__enter__()

        def leave(_module, _args, _output):
            if contexts:
                contexts.pop().__exit__(None, None, None)

        self.handles = (self.module.register_forward_pre_hook(enter),
                        self.module.register_forward_hook(leave, always_call=True))
        return self

    def __exit__(self, *_exc):
        for handle in self.handles:
            handle.remove()


_compiled_run_pass: Optional[Callable] = None

# Distinct graphs of one run: (architecture's pass kinds: with / without a norm) x (train / eval)
# x (micro-batch shapes: training, validation, evaluation). dynamo's default of 8 recompiles
# per function would fall back to eager silently at about that count.
COMPILE_RECOMPILE_LIMIT = 64


def compiled_run_pass() -> Callable:
    """``run_pass`` under torch.compile, created once per process.

    One function for every layer: the block and norm are arguments, so dynamo treats their
    parameters as graph inputs and every layer of the same shape reuses one graph (instead of
    one compile per layer, as ``torch.compile(module)`` per block would). ``dynamic=False``
    because a run has a handful of fixed shapes. Graph breaks remain where megatron's
    attention forks the tensor-parallel RNG tracker (``get_rng_state`` cannot be traced);
    each pass is then two or three graphs, not one.
    """
    global _compiled_run_pass
    if _compiled_run_pass is None:
        import torch._dynamo

        limit = max(torch._dynamo.config.recompile_limit, COMPILE_RECOMPILE_LIMIT)
        torch._dynamo.config.recompile_limit = limit
        _compiled_run_pass = torch.compile(run_pass, dynamic=False)
    return _compiled_run_pass


def checkpointed_passes(mode: str, total_passes: int) -> list[bool]:
    """Which passes of a layer are checkpointed under an iteration_checkpointing mode."""
    if mode == "none":
        return [False] * total_passes
    if mode in ("all_passes", KEEP_TAIL_MODE):
        return [True] * total_passes
    if mode == "all_but_last_pass":
        return [True] * (total_passes - 1) + [False]
    raise ValueError(f"iteration_checkpointing: unknown mode {mode!r}")


class PassRunner:
    """Runs the passes of one layer's block during one forward.

    Calling it runs the next pass: ``runner(u)`` is ``Block(u)``; ``runner(u, norm)`` is
    ``norm(Block(u))`` with the norm inside the checkpointed region, so a checkpointed pass keeps
    only ``u`` and its (normalised) output. With ``compiled`` the pass runs under torch.compile
    (``model.compile``), inside the checkpointed region when there is one.

    ``keep_tail`` (``all_passes_keep_tail``): a checkpointed pass also keeps what its FC2 and its
    norm save (FC2's input, the norm's input). torch's checkpoint stops recomputing after the
    last operator whose saved tensors it manages, so the recompute then ends at the gated
    activation, before FC2's matmul and the norm. Costs ffn/(h * tp) + 1 more hidden-size
    vectors per token per pass. With hidden dropout the mask drawn after FC2 is the
    checkpoint's to recompute again, so FC2 is recomputed as before (still exact).
    """

    def __init__(
        self,
        block: torch.nn.Module,
        block_kwargs: dict,
        checkpoint_flags: list[bool],
        compiled: bool = False,
        keep_tail: bool = False,
    ):
        self.block = block
        self.run_pass = compiled_run_pass() if compiled else run_pass
        self.block_kwargs = block_kwargs
        self.checkpoint_flags = checkpoint_flags
        self.passes_run = 0
        self.tail = None
        if keep_tail and compiled:
            raise ValueError(f"iteration_checkpointing={KEEP_TAIL_MODE!r} runs its passes eagerly; "
                             "it cannot be combined with model.compile")
        if keep_tail:
            self.tail = getattr(getattr(block, "mlp", None), "linear_fc2", None)
            if self.tail is None:
                raise ValueError(f"iteration_checkpointing={KEEP_TAIL_MODE!r} needs a block "
                                 f"with mlp.linear_fc2; {type(block).__name__} has none")

    @property
    def total_passes(self) -> int:
        return len(self.checkpoint_flags)

    def _run_block(self, u: torch.Tensor, norm: Optional[torch.nn.Module]) -> torch.Tensor:
        return self.run_pass(self.block, norm, u, self.block_kwargs)

    def _run_block_keeping_tail(self, u: torch.Tensor,
                                norm: Optional[torch.nn.Module]) -> torch.Tensor:
        with _SavedAsIs(self.tail):
            out, _ = self.block(u, **self.block_kwargs)
        if norm is None:
            return out
        with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
            return norm(out)

    def __call__(self, u: torch.Tensor, norm: Optional[torch.nn.Module] = None) -> torch.Tensor:
        index = self.passes_run
        if index >= self.total_passes:
            raise RuntimeError(
                f"architecture ran pass {index + 1} but declared {self.total_passes} passes"
            )
        self.passes_run += 1
        if self.checkpoint_flags[index] and torch.is_grad_enabled():
            body = self._run_block if self.tail is None else self._run_block_keeping_tail
            return checkpoint_with_rng_replay(body, u, norm)
        return self._run_block(u, norm)

    def residual(self, u: torch.Tensor) -> torch.Tensor:
        """F(u) = Block(u) - u, the block's residual branch (one pass)."""
        return self(u) - u

    def finish(self) -> None:
        if self.passes_run != self.total_passes:
            raise RuntimeError(
                f"architecture ran {self.passes_run} passes but declared {self.total_passes}"
            )
