"""Moving between a model's local (TP/PP-sharded) parameters and their full, layout-free form.

Two uses: initialising models of any TP/PP layout to the *same* weights (megatron's own init
draws different numbers when the pipeline layout changes), and gathering parameters or
gradients into one full dict to compare layouts or to export.

Full names are the local names with layer indices made global (``decoder.layers.{g}.``); a tied
output layer on the last stage is named after the word embeddings it duplicates.
"""

from __future__ import annotations

import hashlib
import re
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EMBEDDING = "embedding.word_embeddings.weight"


def full_name(model, local_name: str) -> str:
    m = _LAYER.match(local_name)
    if m:
        g = model.decoder.layer_offset + int(m.group(1))
        return f"decoder.layers.{g}." + local_name[m.end():]
    if local_name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return _EMBEDDING
    return local_name


def local_name(model, full: str) -> Optional[str]:
    """The local parameter name for a full name, or None if this rank holds no part of it."""
    m = _LAYER.match(full)
    if m:
        i = int(m.group(1)) - model.decoder.layer_offset
        if 0 <= i < len(model.decoder.layers):
            return f"decoder.layers.{i}." + full[m.end():]
        return None
    if full == _EMBEDDING and not model.pre_process:
        return "output_layer.weight" if (
            model.post_process and model.share_embeddings_and_output_weights) else None
    return full


def _is_gated_fc1(model, name: str) -> bool:
    return name.endswith("mlp.linear_fc1.weight") and model.config.gated_linear_unit


def _tp_blocks(model, name: str) -> int:
    # A gated fc1 holds [gate; up]; each TP rank holds [gate_r; up_r], not a contiguous slice.
    return 2 if _is_gated_fc1(model, name) else 1


def shard(model, name: str, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the full tensor ``full`` for local parameter ``param``."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    dim = param.partition_dim
    blocks = full.chunk(_tp_blocks(model, name), dim=dim)
    return torch.cat([b.chunk(tp, dim=dim)[rank] for b in blocks], dim=dim)


def unshard(model, name: str, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The full tensor from every TP rank's ``local`` part (collective over the TP group)."""
    if not getattr(param, "tensor_model_parallel", False):
        return local
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    dim = param.partition_dim
    k = _tp_blocks(model, name)
    per_rank_blocks = [p.chunk(k, dim=dim) for p in parts]
    return torch.cat([torch.cat([blocks[j] for blocks in per_rank_blocks], dim=dim)
                      for j in range(k)], dim=dim)


def full_shape(model, name: str, param: torch.Tensor) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= parallel_state.get_tensor_model_parallel_world_size()
    return tuple(shape)


def _seed_for(name: str, seed: int) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_layout_independent(model, seed: int) -> None:
    """Draw every weight matrix from N(0, init_method_std) keyed by its full name.

    Any TP/PP layout then starts from the same full weights. Vectors (norms, history rows,
    PCformer's alpha) keep their deterministic constructor values.
    """
    std = model.config.init_method_std
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        fname = full_name(model, name)
        g = torch.Generator().manual_seed(_seed_for(fname, seed))
        full = torch.empty(full_shape(model, name, p), dtype=torch.float32).normal_(
            0.0, std, generator=g)
        p.copy_(shard(model, name, p, full).to(p.dtype))


def gather_full(model, local_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors for every parameter of the whole model, on every rank.

    ``local_tensors`` maps local parameter names to tensors shaped like those parameters (the
    parameters themselves, or their gradients). Collective over the TP and PP groups.
    """
    params = dict(model.named_parameters())
    mine = {}
    for name, tensor in local_tensors.items():
        full = unshard(model, name, params[name], tensor.detach().cpu())
        mine.setdefault(full_name(model, name), full)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return mine
    gathered: list = [None] * pp
    dist.all_gather_object(gathered, mine, group=parallel_state.get_pipeline_model_parallel_group())
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for k, v in part.items():
            merged.setdefault(k, v)
    return merged


@torch.no_grad()
def load_full(model, full_tensors: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy this rank's share of full tensors into the model's parameters."""
    for name, p in model.named_parameters():
        fname = full_name(model, name)
        if fname not in full_tensors:
            if strict:
                raise KeyError(f"{fname}: missing from the full state")
            continue
        p.copy_(shard(model, name, p, full_tensors[fname]).to(p.dtype))


def grad_of(p: torch.Tensor):
    """A parameter's gradient: megatron's DDP accumulates it in ``main_grad`` (fp32), plain
    autograd in ``grad``; None before any backward."""
    g = getattr(p, "main_grad", None)
    return p.grad if g is None else g


def grads_of(model, read=grad_of) -> dict[str, torch.Tensor]:
    """Every local parameter's gradient as ``read`` finds it (zeros for one without), by local
    name."""
    out = {}
    for name, p in model.named_parameters():
        g = read(p)
        out[name] = torch.zeros_like(p) if g is None else g
    return out


def pipeline_shared_params(models: Iterable[torch.nn.Module]):
    for m in models:
        for p in m.parameters():
            if getattr(p, "pipeline_shared", False):
                yield p


def parameters_sha256(model) -> str:
    """A digest of the full (gathered) parameters: equal digests mean bitwise-equal models."""
    import hashlib

    full = gather_full(model, dict(model.named_parameters()))
    h = hashlib.sha256()
    for name in sorted(full):
        h.update(name.encode())
        h.update(full[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()
