"""Cross-layer history (spec section 3), used by PCformer and by IIET's released form.

The model keeps one state per layer: ``S_0`` is the embedding output, ``S_l`` the state of layer
l. Layer l owns row l of the two lower-triangular weight matrices (``W`` "pop", ``Wc`` "refine"),
stored here as vectors of length l+1, and two LayerNorms: ``Np`` for its first (predictor)
state and ``Nc`` for every later update. Storing rows per layer keeps every parameter on the
pipeline stage that uses it; the (L+1)x(L+1) matrices of the HF layout are assembled on export.

Cost. Every pass of layer l needs ``pop(l) = sum_{k<=l} W[l,k] S_k`` and the layer ends with
``refine(l)``, but only ``S_l`` changes while the layer runs. So the sums over the finished
states ``S_0..S_{l-1}`` are taken once per layer, both rows in one matmul over a preallocated
buffer holding the states side by side (``StateBuffer``); each pass then costs one ``addcmul``
with the newest state. The history's kernels are O(1) per pass plus O(1) per layer, in forward
and backward, instead of O(l) per pass.

Autograd. The buffer is written once per state and read by every later layer, which autograd
cannot track in place; the three functions below carry the gradients themselves. A later layer's
partial sums add ``d loss / d S_k`` into a gradient buffer of the same shape (one ``addmm`` per
layer; the first writes instead of adding, so the buffer is never zero-filled), and the function
that stored ``S_k`` hands that slot to the state's producer. A chain of empty *tokens* (each
store takes the previous token and returns a new one, each partial sum takes the newest) gives
autograd the order: every reader of slot k runs its backward before the store of ``S_k`` does.

Across a pipeline-stage boundary the next stage needs the layer output and all states so far:
they travel as the buffer itself, ``[x; S_0; ...; S_m]`` stacked along the sequence dimension,
so sending needs no concatenation and receiving one copy.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class LayerHistoryParams(nn.Module):
    """Row ``layer_number`` of W and Wc, plus Np and Nc, for one layer (1-based number)."""

    def __init__(self, config, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        dtype, eps = config.params_dtype, config.history_norm_eps
        if config.history_init == "current":
            row = torch.zeros((layer_number + 1,), dtype=dtype)
            row[-1] = 1.0
        else:
            row = torch.full((layer_number + 1,), 1.0 / (layer_number + 1), dtype=dtype)
        self.pop_weight = nn.Parameter(row.clone())
        self.refine_weight = nn.Parameter(row.clone())
        self.predictor_norm = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.corrector_norm = nn.LayerNorm(config.hidden_size, eps=eps, dtype=dtype)


class StateBuffer:
    """One micro-batch's history on one pipeline stage: slot 0 the stage output (what is sent
    on), slot k+1 the state ``S_k``; ``[slots * s, b, h]``, slots contiguous along the sequence.
    ``grad`` is the same layout for ``d loss / d S_k``, made on the first backward write."""

    def __init__(self, slots: int, like: torch.Tensor):
        self.seq = like.shape[0]
        self.data = like.new_empty((slots * self.seq, *like.shape[1:]))
        self.grad: Optional[torch.Tensor] = None
        self.grad_slots = 0  # slots 0..grad_slots-1 of `grad` hold written values

    @property
    def slots(self) -> int:
        return self.data.shape[0] // self.seq

    def slot(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        return tensor[index * self.seq:(index + 1) * self.seq]

    def rows(self, tensor: torch.Tensor, first: int, count: int) -> torch.Tensor:
        """Slots first..first+count-1 as a [count, s*b*h] matrix (a view)."""
        return tensor[first * self.seq:(first + count) * self.seq].view(count, -1)

    def grad_rows(self, first: int, count: int) -> tuple[torch.Tensor, bool]:
        """Slots first..first+count-1 of ``grad`` as rows, and whether this is the buffer's first
        write: then the rows hold garbage and the caller writes them instead of adding. The first
        writer (the stage's last reader in forward) covers every slot a later one touches, so
        only the slots outside its range are zeroed, not the whole buffer."""
        fresh = self.grad is None
        if fresh:
            self.grad = torch.empty_like(self.data)
            self.grad[:first * self.seq].zero_()
            self.grad[(first + count) * self.seq:].zero_()
        self.grad_slots = max(self.grad_slots, first + count)
        return self.rows(self.grad, first, count), fresh

    def state_grad(self, state_index: int) -> Optional[torch.Tensor]:
        slot = state_index + 1
        if self.grad is None or slot >= self.grad_slots:
            return None  # no later reader: the state's gradient comes through autograd alone
        return self.slot(self.grad, slot)


def _token(like: torch.Tensor) -> torch.Tensor:
    return like.new_zeros(())


class _StoreState(torch.autograd.Function):
    """Writes ``S_k`` into its slot; returns the next token. Backward: the slot's gradient."""

    @staticmethod
    def forward(ctx, state, previous_token, buffer: StateBuffer, state_index: int):
        if state.dtype != buffer.data.dtype:
            raise TypeError(f"history state {state_index} is {state.dtype}, "
                            f"the history buffer {buffer.data.dtype}")
        buffer.slot(buffer.data, state_index + 1).copy_(state)
        ctx.buffer, ctx.state_index = buffer, state_index
        return _token(state)

    @staticmethod
    def backward(ctx, _token_grad):
        return ctx.buffer.state_grad(ctx.state_index), None, None, None


class _PartialSums(torch.autograd.Function):
    """``sum_{k<count} W[l,k] S_k`` and the same over Wc, in one matmul over the buffer."""

    @staticmethod
    def forward(ctx, pop_weight, refine_weight, token, buffer: StateBuffer, count: int):
        states = buffer.rows(buffer.data, 1, count)
        weights = torch.stack([pop_weight[:count], refine_weight[:count]]).to(states.dtype)
        sums = torch.mm(weights, states).view(2, buffer.seq, *buffer.data.shape[1:])
        ctx.buffer, ctx.count, ctx.weight_dtype = buffer, count, pop_weight.dtype
        ctx.full_length = pop_weight.shape[0]
        ctx.save_for_backward(weights)
        return sums[0], sums[1]

    @staticmethod
    def backward(ctx, pop_grad, refine_grad):
        (weights,) = ctx.saved_tensors
        buffer, count = ctx.buffer, ctx.count
        grads = torch.stack([pop_grad.reshape(-1), refine_grad.reshape(-1)])  # [2, s*b*h]
        weight_grads = torch.mm(grads, buffer.rows(buffer.data, 1, count).t())
        rows, fresh = buffer.grad_rows(1, count)
        rows.addmm_(weights.t(), grads, beta=0.0 if fresh else 1.0)  # beta 0 ignores the garbage
        full = weight_grads.new_zeros((2, ctx.full_length))
        full[:, :count] = weight_grads
        full = full.to(ctx.weight_dtype)
        return full[0], full[1], None, None, None


class _SendStates(torch.autograd.Function):
    """The stage output and its states as one tensor: the buffer itself (not a view, so
    megatron may free what it sends). Backward: the received gradient becomes the buffer's."""

    @staticmethod
    def forward(ctx, x, token, buffer: StateBuffer):
        buffer.slot(buffer.data, 0).copy_(x)
        ctx.buffer = buffer
        return buffer.data.detach()

    @staticmethod
    def backward(ctx, packed_grad):
        buffer = ctx.buffer
        rows, fresh = buffer.grad_rows(0, buffer.slots)
        packed_grad = packed_grad.reshape(buffer.slots, -1)
        if fresh:
            rows.copy_(packed_grad)
        else:
            rows.add_(packed_grad)
        return buffer.slot(buffer.grad, 0), None, None


class _ReceiveStates(torch.autograd.Function):
    """Unpacks what the previous stage sent: the layer input, and its states into the buffer."""

    @staticmethod
    def forward(ctx, packed, buffer: StateBuffer):
        slots = packed.shape[0] // buffer.seq
        buffer.rows(buffer.data, 1, slots - 1).copy_(buffer.rows(packed, 1, slots - 1))
        ctx.buffer, ctx.slots = buffer, slots
        return buffer.slot(packed, 0).clone(), _token(packed)

    @staticmethod
    def backward(ctx, x_grad, _token_grad):
        buffer, slots = ctx.buffer, ctx.slots
        grad, fresh = buffer.grad_rows(0, slots)
        if fresh:  # no layer of this stage read the received states (not in practice)
            grad[1:].zero_()
        grad[0].copy_(x_grad.reshape(-1))
        return buffer.rows(buffer.grad, 0, slots).view(slots * buffer.seq, *x_grad.shape[1:]), None


class History:
    """The states of one forward on one stage, as layers see them: ``layer(params)`` opens a
    layer's view (partial sums taken), its ``pop`` runs a pass's input, ``finish`` stores the
    layer's last state and gives its output."""

    def __init__(self, buffer: StateBuffer, token: torch.Tensor):
        self.buffer = buffer
        self.token = token

    @classmethod
    def start(cls, embedding_output: torch.Tensor, slots: int) -> History:
        """First stage: ``S_0`` is the embedding output."""
        buffer = StateBuffer(slots, embedding_output)
        return cls(buffer, _StoreState.apply(embedding_output, None, buffer, 0))

    @classmethod
    def receive(cls, packed: torch.Tensor, seq: int, slots: int) -> tuple[torch.Tensor, History]:
        """Later stage: the layer input and a history holding the states that were sent."""
        buffer = StateBuffer(slots, packed[:seq])
        x, token = _ReceiveStates.apply(packed, buffer)
        return x, cls(buffer, token)

    def send(self, x: torch.Tensor) -> torch.Tensor:
        return _SendStates.apply(x, self.token, self.buffer)

    def layer(self, params: LayerHistoryParams) -> LayerHistory:
        return LayerHistory(self, params)


class LayerHistory:
    """Layer l's view: pop(l) and refine(l) as partial sums plus the layer's newest state."""

    def __init__(self, history: History, params: LayerHistoryParams):
        self.history, self.params = history, params
        l = params.layer_number
        self.pop_sum, self.refine_sum = _PartialSums.apply(
            params.pop_weight, params.refine_weight, history.token, history.buffer, l)
        self.own_pop_weight = params.pop_weight[l]
        self.own_refine_weight = params.refine_weight[l]

    @property
    def predictor_norm(self) -> nn.Module:
        return self.params.predictor_norm

    @property
    def corrector_norm(self) -> nn.Module:
        return self.params.corrector_norm

    def pop(self, state: torch.Tensor) -> torch.Tensor:
        """sum_k W[l, k] S_k over S_0..S_l, with ``state`` as the layer's newest S_l."""
        return torch.addcmul(self.pop_sum, self.own_pop_weight, state)

    def finish(self, state: torch.Tensor) -> torch.Tensor:
        """Stores ``state`` as the layer's final S_l; returns the layer output refine(l)."""
        h = self.history
        h.token = _StoreState.apply(state, h.token, h.buffer, self.params.layer_number)
        return torch.addcmul(self.refine_sum, self.own_refine_weight, state)


def slices_crossing_boundary(first_layer_number: int, uses_history: bool) -> int:
    """How many [s, b, h] slices enter the stage whose first layer has this 1-based number.

    With history: the layer input plus states S_0..S_{first-1}; without: the layer input.
    """
    return first_layer_number + 1 if uses_history else 1
