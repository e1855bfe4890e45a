"""megatron <-> HF names, of tensors and of config fields (the table of docs/hf.md).

The block's tensors are the same for every architecture and are mapped here; what an
architecture adds (history rows and norms, the RK2 gate, PCformer's alpha and stage norms) is
mapped from the ``TensorName``s its registry entry declares (megatron_iiet/model/architectures.py),
so a new architecture needs nothing here. Config fields come from model/config.py's KNOBS.
Pure tensor work: no megatron import at import time, no files.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from .checks import ConversionError

_LAYER = "decoder.layers.{i}."
_HF_LAYER = "model.layers.{i}."

# (megatron suffix within a layer, HF suffix within a layer) of block tensors copied unchanged
_BLOCK_RENAMES = (
    ("block.input_layernorm.weight", "input_layernorm.weight"),
    ("block.pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("block.self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("block.mlp.linear_fc2.weight", "mlp.down_proj.weight"),
)

def config_fields() -> tuple[tuple[str, str], ...]:
    """(megatron config field, IIETConfig field) of the values copied unchanged: the knobs with an
    HF name that mapping does not derive (model/config.py's KNOBS, the one table)."""
    from megatron_iiet.model.config import KNOBS

    return tuple((name, knob.hf) for name, knob in KNOBS.items()
                 if knob.hf is not None and not knob.hf_derived)


Take = Callable[[str], torch.Tensor]


def _architecture(cfg):
    from megatron_iiet.model.architectures import get_architecture

    try:
        return get_architecture(cfg.architecture, cfg.formulation)
    except ValueError as err:  # an HF config of an architecture megatron does not have
        raise ConversionError(f"config: {err}") from err


# ==============================================================================================
# Tensors
# ==============================================================================================
def _qkv_split(fused: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # megatron groups rows per query group: [q heads of the group; k; v], each head_dim rows.
    groups, hd = cfg.num_query_groups, cfg.kv_channels
    per_group = cfg.num_attention_heads // groups
    grouped = fused.reshape(groups, per_group + 2, hd, fused.shape[-1])
    q = grouped[:, :per_group].reshape(-1, fused.shape[-1])
    k = grouped[:, per_group].reshape(-1, fused.shape[-1])
    v = grouped[:, per_group + 1].reshape(-1, fused.shape[-1])
    return q, k, v


def _qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg) -> torch.Tensor:
    groups, hd = cfg.num_query_groups, cfg.kv_channels
    d = q.shape[-1]
    per_group = cfg.num_attention_heads // groups
    grouped = torch.cat([q.reshape(groups, per_group, hd, d), k.reshape(groups, 1, hd, d),
                         v.reshape(groups, 1, hd, d)], dim=1)
    return grouped.reshape(-1, d)


def _history_matrix(rows: list[torch.Tensor]) -> torch.Tensor:
    """(L+1)x(L+1) lower-triangular matrix from the per-layer rows (layer l owns row l+1).

    Row 0 is never read; it keeps the release's initial value [1, 0, ...]."""
    size = len(rows) + 1
    matrix = torch.zeros(size, size, dtype=rows[0].dtype)
    matrix[0, 0] = 1.0
    for layer, row in enumerate(rows):
        matrix[layer + 1, : layer + 2] = row
    return matrix


def _taker(tensors: dict[str, torch.Tensor], what: str) -> Take:
    """`take(name)`: remove and return tensors[name]; a missing one is a ConversionError. What is
    left at the end had no counterpart."""
    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ConversionError(f"{what} {name} is missing")
        return tensors.pop(name)

    return take


def _renames(cfg) -> list[tuple[str, str]]:
    """(megatron name, HF name) of every tensor copied unchanged, the architecture's included."""
    pairs = [("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
             ("decoder.final_norm.weight", "model.norm.weight")]
    for i in range(cfg.num_layers):
        pairs += [(_LAYER.format(i=i) + ours, _HF_LAYER.format(i=i) + theirs)
                  for ours, theirs in _BLOCK_RENAMES]
    for name in _architecture(cfg).tensor_names:
        if not name.history_row:
            pairs += name.pairs(cfg.num_layers)
    return pairs


def _history_rows(cfg):
    return [name for name in _architecture(cfg).tensor_names if name.history_row]


def _refuse_leftovers(tensors: dict, what: str) -> None:
    if tensors:
        raise ConversionError(f"{what}: {', '.join(sorted(tensors)[:8])}")


def megatron_to_hf_tensors(meg: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Full megatron tensors (TP=1/PP=1 names) -> HF state dict (lm_head only when untied)."""
    meg = dict(meg)
    take = _taker(meg, "checkpoint tensor")
    hf = {theirs: take(ours) for ours, theirs in _renames(cfg)}
    for i in range(cfg.num_layers):
        src, dst = _LAYER.format(i=i), _HF_LAYER.format(i=i)
        q, k, v = _qkv_split(take(src + "block.self_attention.linear_qkv.weight"), cfg)
        hf[dst + "self_attn.q_proj.weight"] = q
        hf[dst + "self_attn.k_proj.weight"] = k
        hf[dst + "self_attn.v_proj.weight"] = v
        gate, up = take(src + "block.mlp.linear_fc1.weight").chunk(2, dim=0)  # [gate; up]
        hf[dst + "mlp.gate_proj.weight"] = gate
        hf[dst + "mlp.up_proj.weight"] = up
    for name in _history_rows(cfg):
        hf[name.hf] = _history_matrix([take(name.megatron.format(i=i))
                                       for i in range(cfg.num_layers)])
    if not cfg.share_embeddings_and_output_weights:
        hf["lm_head.weight"] = take("output_layer.weight")
    _refuse_leftovers(meg, "checkpoint tensors with no HF name")
    return {k: v.contiguous() for k, v in hf.items()}


def hf_to_megatron_tensors(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """HF state dict -> full megatron tensors (TP=1/PP=1 names), vocab padded to cfg.vocab_size."""
    hf = dict(hf)
    take = _taker(hf, "HF tensor")

    def padded_vocab(t):
        # Rows past the tokenizer's vocabulary are never a label or an input; zeros, as the
        # trainer's padding would be meaningless to copy from anywhere.
        extra = cfg.vocab_size - t.shape[0]
        return t if extra == 0 else torch.cat([t, t.new_zeros(extra, t.shape[1])])

    meg = {ours: take(theirs) for ours, theirs in _renames(cfg)}
    embedding = "embedding.word_embeddings.weight"
    meg[embedding] = padded_vocab(meg[embedding])
    for i in range(cfg.num_layers):
        src, dst = _HF_LAYER.format(i=i), _LAYER.format(i=i)
        meg[dst + "block.self_attention.linear_qkv.weight"] = _qkv_fuse(
            take(src + "self_attn.q_proj.weight"), take(src + "self_attn.k_proj.weight"),
            take(src + "self_attn.v_proj.weight"), cfg)
        meg[dst + "block.mlp.linear_fc1.weight"] = torch.cat(
            [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")], dim=0)
    for name in _history_rows(cfg):
        matrix = take(name.hf)
        for i in range(cfg.num_layers):
            meg[name.megatron.format(i=i)] = matrix[i + 1, : i + 2].clone()
    if not cfg.share_embeddings_and_output_weights:
        meg["output_layer.weight"] = padded_vocab(take("lm_head.weight"))
    hf.pop("lm_head.weight", None)  # tied: the embedding is the head
    _refuse_leftovers(hf, "HF tensors with no megatron name")
    return {k: v.contiguous() for k, v in meg.items()}


# ==============================================================================================
# Config fields
# ==============================================================================================
def hf_config_for(model_cfg, vocab_size: int, tokenizer=None, max_positions: int = 2048):
    """The IIETConfig of a megatron model config (vocabulary and positions given apart)."""
    from megatron_iiet.hf.configuration_iiet import IIETConfig

    architecture = _architecture(model_cfg)
    fields = {theirs: getattr(model_cfg, ours) for ours, theirs in config_fields()}
    fields["rope_theta"] = float(fields["rope_theta"])
    if tokenizer is not None:
        fields.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                      pad_token_id=tokenizer.pad_id)
    return IIETConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        formulation=architecture.formulation or "history",
        iterations=model_cfg.layer_iterations if architecture.iterates else None,
        **fields,
    )


def _preset_for(hf_config) -> str:
    """The spec preset with these sizes, else "tiny" (every size is set explicitly anyway)."""
    from megatron_iiet.model.config import PRESET_SHAPES

    for name, shape in PRESET_SHAPES.items():
        if (shape["hidden_size"], shape["num_layers"]) == (hf_config.hidden_size,
                                                           hf_config.num_hidden_layers):
            return name
    return "tiny"


def train_config_for_hf(hf_config, tokenizer_path: Optional[str], precision: str, tp: int,
                        pp: int):
    """A TrainConfig whose model section rebuilds this HF model in megatron."""
    from megatron_iiet.model.config import preset
    from megatron_iiet.training.config import (DataSection, ModelSection, ParallelSection,
                                               TrainConfig)

    expressible = {f.name for f in dataclasses.fields(ModelSection)}
    defaults = preset("tiny")
    for ours, theirs in config_fields():
        if ours in expressible:
            continue
        # TrainConfig cannot set it, so the HF value must be the megatron default.
        value, default = getattr(hf_config, theirs), getattr(defaults, ours)
        if abs(float(value) - float(default)) > 1e-12 * max(1.0, abs(default)):
            raise ConversionError(f"config {theirs}={value}: the megatron model supports only "
                                  f"{default}")
    copied = {ours: getattr(hf_config, theirs) for ours, theirs in config_fields()
              if ours in expressible and ours != "max_iterations"}
    architecture = _architecture(hf_config)
    iterates = architecture.iterates
    its = list(hf_config.iterations)
    # The trained r, where the folder records it (our exports do; the release does not).
    r = int(getattr(hf_config, "max_iterations", None) or max(its)) if iterates else 3
    if iterates and max(its) > r:
        r = max(its)
    copied.update(
        max_iterations=r,
        formulation=architecture.formulation or "history",
        iterations=None if (not iterates or all(i == r for i in its)) else its,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        init_method_std=float(hf_config.initializer_range),
    )
    return TrainConfig(model=ModelSection(preset=_preset_for(hf_config), **copied),
                       data=DataSection(tokenizer=tokenizer_path,
                                        seq_length=int(hf_config.max_position_embeddings)),
                       parallel=ParallelSection(tensor=tp, pipeline=pp, precision=precision))
