"""The megatron side of a conversion: the model of a checkpoint rebuilt from its meta.json in
one process at TP=1/PP=1 and loaded (megatron -> HF), or built at the target layout and saved
rank by rank (HF -> megatron).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable

import torch

from .checks import META, ConversionError

Progress = Callable[[str], None]


def quiet(_: str) -> None:
    pass


def train_config_from_dict(tree: dict):
    """The TrainConfig saved in meta.json (unknown keys are refused: another trainer version)."""
    from megatron_iiet.training.checkpoint_meta import parse_saved_config

    return parse_saved_config(tree, f"{META} config", ConversionError)


def single_process_model_config(train_cfg, vocab_size: int, tensor: int = 1, pipeline: int = 1):
    """The model config of a training config, rebuilt for inference at TP/PP (default one
    process): checkpoint_meta.inference_model_config, failing as a conversion does."""
    from megatron_iiet.training.checkpoint_meta import inference_model_config

    return inference_model_config(train_cfg, vocab_size, tensor, pipeline, ConversionError)


@contextlib.contextmanager
def one_process_group():
    """A 1-rank gloo group and megatron's TP=1/PP=1 groups (reused if the caller has them)."""
    import torch.distributed as dist

    from megatron_iiet.distributed import free_port, initialize, teardown

    if dist.is_initialized():
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized() and (
                ps.get_tensor_model_parallel_world_size() != 1
                or ps.get_pipeline_model_parallel_world_size() != 1):
            raise ConversionError("conversion needs TP=1/PP=1 process groups (run it on its own)")
        if not ps.model_parallel_is_initialized():
            initialize(1, 1)
        yield
        return
    saved = {k: os.environ.get(k)
             for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1")
    try:
        initialize(1, 1, timeout_s=120.0)
        yield
    finally:
        teardown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_megatron_checkpoint(ckpt: Path, meta):
    """(TP=1/PP=1 model config, {megatron full name: tensor}) of a checkpoint of any layout."""
    from megatron_iiet.eval.checkpoint import load_model_tensors
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.training.checkpoint_meta import model_config_from

    model_cfg = model_config_from(meta, ckpt, error=ConversionError)
    with one_process_group():
        model = IIETGPTModel(model_cfg)
        load_model_tensors(model, ckpt)
        tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model_cfg, tensors


def write_rank_shard(train_config: dict, vocab_size: int, state_file: str, out_dir: str):
    """Inside one rank of the target layout: build the model, take this rank's share, save."""
    from megatron.core import dist_checkpointing

    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.model.sharding import load_full
    from megatron_iiet.training.config import build_model_config

    cfg = train_config_from_dict(train_config)
    model = IIETGPTModel(build_model_config(cfg, vocab_size))
    full = torch.load(state_file, map_location="cpu", weights_only=True, mmap=True)
    load_full(model, full, strict=True)
    del full
    dist_checkpointing.save({"model": model.sharded_state_dict()}, out_dir)
    return True
