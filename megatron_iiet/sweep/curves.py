"""Reading training curves: the unigram plateau and curves at equal tokens or equal FLOPs.

A language model first learns the tokens' frequencies: its loss falls from ln(V) to the unigram
entropy H of the training data (the cross-entropy of the best context-free prediction) and may
sit there before it learns to use the context. The time on that plateau is what separated IIET
from vanilla on the CPU ladder (docs/scaling.md), so it is measured, not eyeballed:

* ``unigram_entropy(prefix)``: H in nats per token, from the token counts of an indexed dataset;
* ``plateau(curve, H, band)``: the span of steps the (smoothed) training loss spends within
  ``band`` of H, from the first step it comes down to H + band to the first step it falls below
  H - band (the end of the run when it never does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


def unigram_entropy(prefix: str) -> float:
    """Entropy (nats) of the token frequencies of the indexed dataset at ``prefix``."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    counts = np.zeros(1, dtype=np.int64)
    for start in range(0, len(dataset), 1024):  # documents a batch at a time: bounded memory
        tokens = np.concatenate([np.asarray(dataset[i]) for i in
                                 range(start, min(start + 1024, len(dataset)))])
        found = np.bincount(tokens.astype(np.int64))
        if len(found) > len(counts):
            counts = np.pad(counts, (0, len(found) - len(counts)))
        counts[:len(found)] += found
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@dataclass(frozen=True)
class Plateau:
    entered: Optional[int]
    """First step at or below H + band (None: never came down to the plateau)."""
    left: Optional[int]
    """First step below H - band after entering (None: still on it at the end)."""
    steps: int
    """Steps spent on it: left - entered, or last step - entered."""
    fraction: float
    """steps / the run's steps."""


def smooth(losses: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` logged points (noise of single batches would otherwise end
    the plateau at the first lucky batch)."""
    out, total = [], 0.0
    for i, value in enumerate(losses):
        total += value
        if i >= window:
            total -= losses[i - window]
        out.append(total / min(i + 1, window))
    return out


def plateau(curve: Sequence[tuple[int, float]], entropy: float, band: float = 0.1,
            total_steps: Optional[int] = None, window: int = 4) -> Plateau:
    """The plateau of a training curve [(step, loss), ...] around ``entropy``."""
    if not curve:
        return Plateau(None, None, 0, 0.0)
    steps = [s for s, _ in curve]
    losses = smooth([loss for _, loss in curve], window)
    total = total_steps or steps[-1]
    entered = next((s for s, v in zip(steps, losses) if v <= entropy + band), None)
    if entered is None:
        return Plateau(None, None, 0, 0.0)
    left = next((s for s, v in zip(steps, losses) if s > entered and v < entropy - band), None)
    span = (left if left is not None else total) - entered
    return Plateau(entered, left, span, span / total if total else math.nan)


def at_equal_x(curves: dict[str, Sequence[tuple[float, float]]], x: float) -> dict[str, float]:
    """Each curve's value at ``x`` (linear between its points; None outside its range): curves
    compared at equal tokens (x = tokens) or equal FLOPs (x = tokens x FLOPs per token)."""
    out = {}
    for name, points in curves.items():
        xs = [p[0] for p in points]
        out[name] = (float(np.interp(x, xs, [p[1] for p in points]))
                     if points and xs[0] <= x <= xs[-1] else None)
    return out
