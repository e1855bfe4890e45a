"""IIAD step 1 (spec 6.1): how much each IIET iteration matters, measured on calibration data.

The paper does not publish its influence metric; this is the project's choice, as the spec fixes
it. Two measures per layer l and iteration i (1-based, i = 1..r_l):

* ablation influence ``I[l][i] = loss(layer l runs i-1 iterations, every other layer its full
  plan) - loss(full plan)``: dropping iteration i of a layer means the layer stops after i-1.
  It is exact (the model's own loss on the same batches) and costs one forward over the
  calibration data per (layer, iteration); the ablations are spread over data-parallel replicas.
* relative update ``||S_l^(i) - S_l^(i-1)|| / ||S_l^(i-1)||`` (history form only: ``S_l^(0)`` is
  the predictor's state, ``S_l^(i)`` the state after iteration i), from the full model's
  forward: cheap, but only a proxy (a large update may still barely move the loss).

Layers change their iteration count in place (``ODELayer.iterations``); the weights never do.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch


@dataclass
class InfluenceReport:
    checkpoint: str
    architecture: str
    formulation: str
    iterations: list[int]  # the full plan the influences are relative to
    base_loss: float
    influence: list[list[float]]  # [layer][i-1]: loss increase when layer runs i-1 iterations
    relative_update: Optional[list[list[float]]]  # [layer][i-1], history form only
    calibration: dict = field(default_factory=dict)

    def write(self, path: Path) -> None:
        from megatron_iiet.data.atomic import write_json_atomic

        write_json_atomic(path, asdict(self))

    @classmethod
    def read(cls, path: Path) -> InfluenceReport:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(**data)


def calibration_batches(prefix: str, batches: int, batch_size: int, seq_length: int,
                        offset_tokens: int = 0) -> list[dict]:
    """Consecutive windows of ``seq_length + 1`` tokens of a preprocessed dataset, from
    ``offset_tokens`` on, as the trainer's micro-batches (documents joined by their EOD tokens,
    as pretraining reads them)."""
    from megatron_iiet.data.errors import DataInputError
    from megatron_iiet.data.indexed_io import bin_path, verify_dataset

    info = verify_dataset(prefix)
    tokens = np.memmap(bin_path(prefix), dtype=info.dtype_name, mode="r")
    needed = offset_tokens + batches * batch_size * (seq_length + 1)
    if needed > tokens.shape[0]:
        raise DataInputError(f"{prefix}: {tokens.shape[0]} tokens, the calibration needs "
                             f"{needed} ({batches} batches of {batch_size} x {seq_length + 1} "
                             f"from token {offset_tokens})")
    out = []
    window = batch_size * (seq_length + 1)
    for b in range(batches):
        start = offset_tokens + b * window
        chunk = torch.from_numpy(np.array(tokens[start:start + window], dtype=np.int64))
        chunk = chunk.view(batch_size, seq_length + 1)
        out.append({"input_ids": chunk[:, :-1].contiguous(), "labels": chunk[:, 1:].contiguous(),
                    "loss_mask": torch.ones(batch_size, seq_length)})
    return out


def ablations(plan: list[int]) -> list[tuple[int, int]]:
    """(layer, iteration) for every iteration of the plan, both 1-based."""
    return [(layer, i) for layer, r in enumerate(plan, start=1) for i in range(1, r + 1)]


def _local_layers(model) -> dict:
    return {layer.layer_number: layer for layer in model.decoder.layers}


@contextlib.contextmanager
def layer_iterations(model, layer_number: int, iterations: int):
    """Layer ``layer_number`` (1-based, global) runs ``iterations`` inside the block (on the
    pipeline stage that holds it; other stages are unaffected)."""
    layer = _local_layers(model).get(layer_number)
    if layer is None:
        yield
        return
    saved = layer.iterations
    layer.iterations = iterations
    try:
        yield
    finally:
        layer.iterations = saved


def mean_loss(model, batches: list[dict]) -> Optional[float]:
    """The mean LM loss over the batches (every batch has the same token count); None off the
    last pipeline stage."""
    from megatron.core import parallel_state as ps

    from megatron_iiet.training.step import forward_backward

    with torch.no_grad():
        metrics = forward_backward(model, batches, forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    return float(np.mean([m["loss"] for m in metrics]))


class RelativeUpdates:
    """Forward hooks on each local layer's Np/Nc: the states of every iteration, as they are
    made; accumulates ``||S^(i) - S^(i-1)|| / ||S^(i-1)||`` per (layer, iteration)."""

    def __init__(self, model):
        self.sums: dict[int, np.ndarray] = {}
        self._previous: dict[int, torch.Tensor] = {}
        self._index: dict[int, int] = {}
        self._handles = []
        for number, layer in _local_layers(model).items():
            history = getattr(layer, "history", None)
            if history is None:
                continue
            self.sums[number] = np.zeros(layer.iterations)
            self._handles.append(history.predictor_norm.register_forward_hook(
                self._hook(number, first=True)))
            self._handles.append(history.corrector_norm.register_forward_hook(
                self._hook(number, first=False)))

    def _hook(self, number: int, first: bool) -> Callable:
        def record(_module, _inputs, state):
            state = state.detach().float()
            if first:
                self._index[number] = 0
            else:
                i = self._index[number]
                previous = self._previous[number]
                self.sums[number][i] += ((state - previous).norm() / previous.norm()).item()
                self._index[number] = i + 1
            self._previous[number] = state
        return record

    def means(self, forwards: int) -> dict[int, list[float]]:
        return {n: (s / max(forwards, 1)).tolist() for n, s in self.sums.items()}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def measure_influence(model, batches: list[dict], plan: list[int], history_form: bool,
                      progress: Optional[Callable[[int, int], None]] = None
                      ) -> tuple[float, list[list[float]], Optional[list[list[float]]]]:
    """Collective over the world. Returns (base loss, influence, relative update) on every rank.

    Data-parallel replica d measures ablations d, d + DP, d + 2 DP, ...; replica 0 also runs the
    full model (with the relative-update hooks). Results are gathered over the world."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    mine = [a for j, a in enumerate(ablations(plan)) if j % dp == dp_rank]
    found: dict = {}
    updates: dict = {}
    if dp_rank == 0:
        hooks = RelativeUpdates(model) if history_form else None
        base = mean_loss(model, batches)
        if hooks is not None:
            updates = hooks.means(len(batches))
            hooks.remove()
        if reporter:
            found["base"] = base
    for done, (layer, i) in enumerate(mine, start=1):
        with layer_iterations(model, layer, i - 1):
            loss = mean_loss(model, batches)
        if reporter:
            found[(layer, i)] = loss
        if progress is not None:
            progress(done, len(mine))
    if ps.get_tensor_model_parallel_rank() != 0:
        updates = {}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (found, updates))
    losses, proxy = {}, {}
    for f, u in gathered:
        losses.update(f)
        proxy.update(u)
    base = losses["base"]
    influence = [[losses[(layer, i)] - base for i in range(1, r + 1)]
                 for layer, r in enumerate(plan, start=1)]
    relative = ([proxy[layer] for layer in range(1, len(plan) + 1)] if history_form else None)
    return base, influence, relative
