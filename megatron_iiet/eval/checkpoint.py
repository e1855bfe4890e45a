"""A training checkpoint rebuilt for inference at the launch's own TP/PP layout.

The model is built from the checkpoint's saved training config (architecture and sizes) with the
layout replaced by the one this job runs at, and its tensors are read with megatron's
dist-checkpointing, which reshards them: a checkpoint saved at TP=2/PP=1 loads at TP=1/PP=2 and
vice versa. Activation recomputation is switched off (nothing is trained).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch


@dataclass
class InferenceModel:
    model: torch.nn.Module
    tokenizer: object  # megatron_iiet.data.tokenizer.Tokenizer
    max_length: int
    path: Path
    meta: dict


def load_for_inference(path: str | Path, tokenizer: Optional[str] = None,
                       with_tokenizer: bool = True) -> InferenceModel:
    """The checkpoint at ``path`` (an ``iter_*`` folder or a run's checkpoint root: its newest
    complete checkpoint), in eval mode, on this rank's share of the current process groups.
    ``with_tokenizer=False`` (a distillation teacher: only its fingerprint matters) leaves
    ``tokenizer`` None."""
    from megatron.core import parallel_state as ps

    from megatron_iiet.hf.megatron_model import (check_rebuilds, load_model_tensors,
                                                 single_process_model_config,
                                                 train_config_from_dict)
    from megatron_iiet.hf.megatron_to_hf import resolve_tokenizer
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.platform import compute_device
    from megatron_iiet.training.checkpoint_index import read_meta, resolve_checkpoint

    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    tok = resolve_tokenizer(meta, tokenizer, ckpt) if with_tokenizer else None
    model_cfg = single_process_model_config(train_config_from_dict(meta["config"]),
                                            meta["architecture"]["vocab_size"],
                                            ps.get_tensor_model_parallel_world_size(),
                                            ps.get_pipeline_model_parallel_world_size())
    check_rebuilds(meta, model_cfg, ckpt)
    model = IIETGPTModel(model_cfg).to(compute_device())
    load_model_tensors(model, ckpt)
    model.eval()
    return InferenceModel(model, tok, model_cfg.max_sequence_length, ckpt, meta)
