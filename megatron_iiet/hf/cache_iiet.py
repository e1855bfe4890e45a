"""The KV cache of the HF IIET model: one growing key/value store per (layer, pass).

Shipped inside every exported checkpoint folder next to modeling_iiet.py (which imports it);
imports only torch and transformers. Why one store per pass: spec section 5d (during training
every pass attends to its own pass's keys and values).
"""

import torch
from transformers.cache_utils import Cache, DynamicLayer


# ----------------------------------------------------------------------------------------------
# KV cache: one slot per (layer, pass)
# ----------------------------------------------------------------------------------------------
class IIETCacheLayer(DynamicLayer):
    """One (layer, pass) key/value store that grows in place.

    `DynamicLayer` concatenates the whole store with every new token: a copy of all past keys and
    values per pass per step, as many bytes as the attention itself reads, and a cost that grows
    with the context. Here keys and values live in a buffer with spare room along the sequence;
    `update` writes the new positions in place and returns views of the filled part, so a decode
    step copies only its own token. The buffer grows by at least half its size (rounded up to
    `BLOCK` positions) when full, so growth costs O(1) per token amortised. Anything assigned to
    `keys` / `values` (`crop`, beam-search `reorder_cache`, `batch_select_indices`, offloading:
    DynamicLayer's own code) becomes the new buffer, filled to its end. Keys or values that
    require grad are concatenated as DynamicLayer does (an in-place write would invalidate the
    graph of earlier steps).
    """

    BLOCK = 256

    def __init__(self, **kwargs):
        # keys and values each keep their own filled length: DynamicLayer's code assigns
        # `self.keys = f(self.keys)` and then `self.values = f(self.values)`, one after the other.
        self._buffers, self._lengths = [None, None], [0, 0]
        super().__init__(**kwargs)

    def _filled(self, i):
        buffer = self._buffers[i]
        return buffer if buffer is None or buffer.dim() < 3 else buffer[..., : self._lengths[i], :]

    def _assign(self, i, value):
        self._buffers[i] = value
        self._lengths[i] = value.shape[-2] if value is not None and value.dim() >= 3 else 0

    keys = property(lambda self: self._filled(0), lambda self, value: self._assign(0, value))
    values = property(lambda self: self._filled(1), lambda self, value: self._assign(1, value))

    def get_seq_length(self):
        return self._lengths[0] if self.is_initialized else 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._lengths[0], self._lengths[0] + key_states.shape[-2]
        for i, new in enumerate((key_states, value_states)):
            buffer = self._buffers[i]
            if new.requires_grad and torch.is_grad_enabled():
                self._assign(i, new if start == 0 else torch.cat([self._filled(i), new], dim=-2))
                continue
            if buffer is None or buffer.dim() < 3 or end > buffer.shape[-2] or buffer.shape[:-2] != new.shape[:-2]:
                buffer = self._grow(i, new, end)
            buffer[..., start:end, :].copy_(new)
            self._lengths[i] = end
        return self._filled(0), self._filled(1)

    def _grow(self, i, new, needed):
        old, length = self._buffers[i], self._lengths[i]
        has_old = old is not None and old.dim() >= 3 and length > 0
        if has_old and old.shape[:-2] != new.shape[:-2]:
            raise ValueError(f"cached {('keys', 'values')[i]} of shape {tuple(old.shape)} cannot take new ones "
                             f"of shape {tuple(new.shape)}")
        capacity = max(needed, (old.shape[-2] * 3) // 2 if has_old else 0)
        capacity = -(-capacity // self.BLOCK) * self.BLOCK
        buffer = new.new_empty((*new.shape[:-2], capacity, new.shape[-1]))
        if has_old:
            buffer[..., :length, :].copy_(old[..., :length, :])
        self._buffers[i] = buffer
        return buffer


class IIETCache(Cache):
    """A transformers `Cache` with one growing key/value store per (layer, pass).

    Slots are laid out layer by layer: layer l's passes occupy `offsets[l] .. offsets[l] +
    passes[l] - 1`. Slot 0 (layer 0, pass 0) always exists, so `get_seq_length()` works unchanged.
    Each slot is an `IIETCacheLayer` (in-place writes into a preallocated buffer).
    """

    def __init__(self, passes_per_layer):
        self.passes_per_layer = [int(p) for p in passes_per_layer]
        if not self.passes_per_layer or min(self.passes_per_layer) < 1:
            raise ValueError(f"every layer needs at least one pass, got {self.passes_per_layer}")
        self.slot_offsets = []
        total = 0
        for passes in self.passes_per_layer:
            self.slot_offsets.append(total)
            total += passes
        super().__init__(layers=[IIETCacheLayer() for _ in range(total)])

    def slot(self, layer_index, pass_index):
        if not 0 <= pass_index < self.passes_per_layer[layer_index]:
            raise IndexError(
                f"layer {layer_index} has {self.passes_per_layer[layer_index]} cached passes, "
                f"pass {pass_index} requested"
            )
        return self.slot_offsets[layer_index] + pass_index
