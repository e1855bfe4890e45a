"""Cross-layer history (spec section 3), used by PCformer and by IIET's released form.

The model keeps one state per layer: ``S_0`` is the embedding output, ``S_l`` the state of layer
l. Layer l owns row l of the two lower-triangular weight matrices (``W`` "pop", ``Wc`` "refine"),
stored here as vectors of length l+1, and two LayerNorms: ``Np`` for its first (predictor)
state and ``Nc`` for every later update. Storing rows per layer keeps every parameter on the
pipeline stage that uses it; the (L+1)x(L+1) matrices of the HF layout are assembled on export.

Across a pipeline-stage boundary the next stage needs the layer output and all states so far;
they travel as one tensor, stacked along the sequence dimension (contiguous slices on unpack).
"""

from __future__ import annotations

import torch
from torch import nn


class LayerHistoryParams(nn.Module):
    """Row ``layer_number`` of W and Wc, plus Np and Nc, for one layer (1-based number)."""

    def __init__(self, config, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        dtype, eps = config.params_dtype, config.history_norm_eps
        uniform = torch.full((layer_number + 1,), 1.0 / (layer_number + 1), dtype=dtype)
        self.pop_weight = nn.Parameter(uniform.clone())
        self.refine_weight = nn.Parameter(uniform.clone())
        self.predictor_norm = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.corrector_norm = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)

    @staticmethod
    def _combine(weights: torch.Tensor, states: list[torch.Tensor]) -> torch.Tensor:
        out = weights[0] * states[0]
        for k in range(1, len(states)):
            out = out + weights[k] * states[k]
        return out

    def pop(self, states: list[torch.Tensor]) -> torch.Tensor:
        """sum_k W[l, k] S_k over S_0..S_l (S_l is the layer's newest state)."""
        return self._combine(self.pop_weight, states)

    def refine(self, states: list[torch.Tensor]) -> torch.Tensor:
        """sum_k Wc[l, k] S_k: the layer's output."""
        return self._combine(self.refine_weight, states)


def pack_stage_output(x: torch.Tensor, states: list[torch.Tensor]) -> torch.Tensor:
    """What a pipeline stage sends on: the layer output followed by every history state."""
    if not states:
        return x
    return torch.cat([x, *states], dim=0)


def unpack_stage_input(
    packed: torch.Tensor, seq_length: int, uses_history: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    if not uses_history:
        return packed, []
    slices = list(torch.split(packed, seq_length, dim=0))
    return slices[0], slices[1:]


def slices_crossing_boundary(first_layer_number: int, uses_history: bool) -> int:
    """How many [s, b, h] slices enter the stage whose first layer has this 1-based number.

    With history: the layer input plus states S_0..S_{first-1}; without: the layer input.
    """
    return first_layer_number + 1 if uses_history else 1
