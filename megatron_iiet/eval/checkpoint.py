"""A training checkpoint rebuilt for inference at the launch's own TP/PP layout.

The model is built from the checkpoint's saved training config (architecture and sizes) with the
layout replaced by the one this job runs at, and its tensors are read with megatron's
dist-checkpointing, which reshards them: a checkpoint saved at TP=2/PP=1 loads at TP=1/PP=2 and
vice versa. Activation recomputation is switched off (nothing is trained).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megatron_iiet.errors import OperatorError


@dataclass
class InferenceModel:
    model: torch.nn.Module
    tokenizer: object  # megatron_iiet.data.tokenizer.Tokenizer
    max_length: int
    path: Path
    meta: dict


def inference_config(meta: dict, ckpt: Path, tensor: int, pipeline: int):
    """The model config of a checkpoint at this layout, checked against its saved architecture."""
    from megatron_iiet.hf.megatron_model import check_rebuilds, train_config_from_dict
    from megatron_iiet.training.config import build_model_config

    train_cfg = train_config_from_dict(meta["config"])
    par = dataclasses.replace(train_cfg.parallel, tensor=tensor, pipeline=pipeline)
    model = dataclasses.replace(train_cfg.model, recompute_granularity=None,
                                recompute_method=None, recompute_num_layers=None,
                                iteration_checkpointing="none")
    cfg = dataclasses.replace(train_cfg, parallel=par, model=model)
    try:
        model_cfg = build_model_config(cfg, meta["architecture"]["vocab_size"])
    except ValueError as err:
        raise OperatorError(f"{ckpt}: cannot run at TP={tensor}/PP={pipeline}: {err}") from err
    check_rebuilds(meta, model_cfg, ckpt)
    return model_cfg


def load_for_inference(path: str | Path, tokenizer: Optional[str] = None) -> InferenceModel:
    """The checkpoint at ``path`` (an ``iter_*`` folder or a run's checkpoint root: its newest
    complete checkpoint), in eval mode, on this rank's share of the current process groups."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_iiet.hf.megatron_to_hf import resolve_tokenizer
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.platform import compute_device
    from megatron_iiet.training.checkpoint_index import read_meta, resolve_checkpoint

    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    tok = resolve_tokenizer(meta, tokenizer, ckpt)
    model_cfg = inference_config(meta, ckpt, ps.get_tensor_model_parallel_world_size(),
                                 ps.get_pipeline_model_parallel_world_size())
    model = IIETGPTModel(model_cfg).to(compute_device())
    try:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
    except Exception as err:  # megatron's errors are long; keep the cause, name the folder
        raise OperatorError(f"{ckpt}: cannot read the model tensors: "
                            f"{str(err).splitlines()[0][:300]}") from err
    model.load_state_dict(loaded["model"])
    model.eval()
    return InferenceModel(model, tok, model_cfg.max_sequence_length, ckpt, meta)
