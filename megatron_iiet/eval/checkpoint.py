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
    meta: object  # megatron_iiet.training.checkpoint_meta.CheckpointMeta


def load_model_tensors(model, ckpt: Path) -> None:
    """This rank's share of a checkpoint's model tensors, resharded to the model's layout (its
    files checked first: checkpointing.verify_for_load)."""
    from megatron.core import dist_checkpointing

    from megatron_iiet.training.checkpointing import CheckpointError, verify_for_load

    verify_for_load(ckpt)
    try:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
    except Exception as err:  # megatron's errors are long; keep the cause, name the folder
        raise CheckpointError(f"{ckpt}: cannot read the model tensors: "
                              f"{str(err).splitlines()[0][:300]}") from err
    model.load_state_dict(loaded["model"])


def load_for_inference(path: str | Path, tokenizer: Optional[str] = None,
                       with_tokenizer: bool = True) -> InferenceModel:
    """The checkpoint at ``path`` (an ``iter_*`` folder or a run's checkpoint root: its newest
    complete checkpoint), in eval mode, on this rank's share of the current process groups.
    ``with_tokenizer=False`` (a distillation teacher: only its fingerprint matters) leaves
    ``tokenizer`` None."""
    from megatron.core import parallel_state as ps

    from megatron_iiet.hf.megatron_to_hf import resolve_tokenizer
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.platform import compute_device
    from megatron_iiet.training.checkpoint_index import read_meta, resolve_checkpoint
    from megatron_iiet.training.checkpoint_meta import model_config_from

    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    tok = resolve_tokenizer(meta, tokenizer, ckpt) if with_tokenizer else None
    model_cfg = model_config_from(meta, ckpt, ps.get_tensor_model_parallel_world_size(),
                                  ps.get_pipeline_model_parallel_world_size())
    model = IIETGPTModel(model_cfg).to(compute_device())
    load_model_tensors(model, ckpt)
    model.eval()
    return InferenceModel(model, tok, model_cfg.max_sequence_length, ckpt, meta)
