"""The megatron side of a conversion: the model of a checkpoint rebuilt from its meta.json in
one process at TP=1/PP=1 and loaded (megatron -> HF), or built at the target layout and saved
rank by rank (HF -> megatron).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import typing
from pathlib import Path
from typing import Callable

import torch

from .checks import META, ConversionError

Progress = Callable[[str], None]


def quiet(_: str) -> None:
    pass


def train_config_from_dict(tree: dict):
    """The TrainConfig saved in meta.json (unknown keys are refused: another trainer version)."""
    from megatron_iiet.training.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    values = {}
    for name, value in tree.items():
        if name == "distill":  # a training matter (teachers, window): the model needs none of it
            continue
        if name not in hints:
            raise ConversionError(f"meta.json config: unknown section {name!r}")
        cls = hints[name]
        if dataclasses.is_dataclass(cls):
            if not isinstance(value, dict):
                raise ConversionError(f"meta.json config.{name}: not an object")
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ConversionError(f"meta.json config.{name}: unknown keys {unknown}")
            value = cls(**value)
        values[name] = value
    return TrainConfig(**values)


def single_process_model_config(train_cfg, vocab_size: int, tensor: int = 1, pipeline: int = 1):
    """The model config of a saved training config, rebuilt for inference (no recompute) at
    TP=``tensor``/PP=``pipeline`` (default one process). Eager: evaluation's varying shapes
    would recompile a compiled pass for every new length."""
    from megatron_iiet.training.config import build_model_config

    par = dataclasses.replace(train_cfg.parallel, tensor=tensor, pipeline=pipeline)
    model = dataclasses.replace(train_cfg.model, recompute_granularity=None,
                                recompute_method=None, recompute_num_layers=None,
                                iteration_checkpointing="none", compile=False)
    try:
        return build_model_config(dataclasses.replace(train_cfg, parallel=par, model=model),
                                  vocab_size)
    except ValueError as err:
        raise ConversionError(f"model config at TP={tensor}/PP={pipeline}: {err}") from err


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


def check_rebuilds(meta: dict, model_cfg, ckpt: Path) -> None:
    """Refuse a checkpoint whose saved config no longer builds the architecture it saved."""
    from megatron_iiet.training.checkpointing import architecture_signature

    rebuilt = architecture_signature(model_cfg)
    if rebuilt != meta["architecture"]:
        diffs = {k: (meta["architecture"].get(k), v) for k, v in rebuilt.items()
                 if meta["architecture"].get(k) != v}
        raise ConversionError(f"{ckpt / META}: its config does not rebuild the saved "
                              f"architecture (saved, rebuilt): {diffs}")


def load_model_tensors(model, ckpt: Path) -> None:
    """This rank's share of a checkpoint's model tensors, resharded to the model's layout."""
    from megatron.core import dist_checkpointing

    from megatron_iiet.training.checkpointing import verify_for_load

    verify_for_load(ckpt)
    try:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
    except Exception as err:  # megatron's errors are long; keep the cause, name the folder
        raise ConversionError(f"{ckpt}: cannot read the model tensors: "
                              f"{str(err).splitlines()[0][:300]}") from err
    model.load_state_dict(loaded["model"])


def load_megatron_checkpoint(ckpt: Path, meta: dict):
    """(TP=1/PP=1 model config, {megatron full name: tensor}) of a checkpoint of any layout."""
    from megatron_iiet.model.gpt import IIETGPTModel

    train_cfg = train_config_from_dict(meta["config"])
    model_cfg = single_process_model_config(train_cfg, meta["architecture"]["vocab_size"])
    check_rebuilds(meta, model_cfg, ckpt)
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
