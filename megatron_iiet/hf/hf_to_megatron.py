"""HF -> megatron (`import_from_hf`): an HF folder of ours, or the authors' release layout (read
with `release_import`), becomes a model-only megatron checkpoint (meta.json with
`"model_only": true` + dist_checkpointing "model", no optimizer) written by TP x PP ranks at the
chosen layout. The trainer loads it for continued training (fresh optimizer, step 0).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import release_import as rel
from .checks import (DEFAULT_MAX_ABS_WEIGHT, LATEST, ConversionError, check_destination,
                     dtype_named, refuse_nonfinite)
from .configuration_iiet import IIETConfig
from .mapping import hf_to_megatron_tensors, train_config_for_hf
from .megatron_model import (Progress, one_process_group, quiet, single_process_model_config,
                             write_rank_shard)
from .release_import import TOKENIZER_FILES, write_atomically


@dataclass
class ImportSummary:
    output: str
    checkpoint: str
    architecture: str
    layout: dict
    vocab_size: int
    precision: str
    tokenizer: Optional[str]
    seconds: float


def read_hf_folder(src: Path, iterations=None, architecture: Optional[str] = None):
    """(IIETConfig, tensors) of an HF folder of ours or of the authors' release layout; the
    release layout's architecture comes from the tensors, or ``architecture`` when they fit
    several (a plain LLaMA's tensors fit vanilla and the ODE models alike)."""
    try:
        raw = rel.read_release_config(src)  # checks it is a folder with a usable config.json
        tensors = rel.load_tensors(rel.find_weight_files(src))
        if raw.get("model_type") == "iiet":
            fields = {k: v for k, v in raw.items() if k != "auto_map"}
            if iterations is not None:
                fields["iterations"] = iterations
            try:
                config = IIETConfig.from_dict(fields)
            except (TypeError, ValueError) as err:  # a field of the wrong type or value
                raise ConversionError(f"{src / 'config.json'}: {err}") from err
        else:
            chosen = rel.choose_architecture(tensors, raw, architecture, src,
                                             option="--expect-architecture")
            config = rel.build_config(raw, chosen, iterations)
        tensors = rel.check_tensors(tensors, config)
    except ValueError as err:  # ReleaseImportError, or IIETConfig refusing the config
        raise ConversionError(str(err)) from err
    return config, tensors


def import_from_hf(src, dst, tp: int = 1, pp: int = 1, precision: str = "fp32",
                   iterations=None, force: bool = False,
                   expect_architecture: Optional[str] = None, allow_nonfinite: bool = False,
                   progress: Progress = quiet,
                   max_abs_weight: Optional[float] = DEFAULT_MAX_ABS_WEIGHT) -> ImportSummary:
    """Write a model-only megatron checkpoint root `dst` (latest + iter_0000000) for `src`.
    NaN/Inf weights (or weights `precision` cannot hold) are refused unless `allow_nonfinite`,
    weights beyond +-`max_abs_weight` always (None: no bound)."""
    from megatron_iiet.training.config import padded_vocab_size

    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    torch_dtype = dtype_named("precision", precision)
    if tp < 1 or pp < 1:
        raise ConversionError(f"layout: TP and PP must be >= 1, got TP={tp} PP={pp}")
    hf_config, hf = read_hf_folder(src, iterations, expect_architecture)
    # The mapping only moves values (and pads with zeros): checking the HF tensors covers it.
    refuse_nonfinite(hf, src, allow_nonfinite, cast_to=torch_dtype, max_abs=max_abs_weight)
    if expect_architecture is not None and hf_config.architecture != expect_architecture:
        raise ConversionError(f"{src}: holds a {hf_config.architecture} model, expected "
                              f"{expect_architecture}")
    check_destination(dst, force, sources=(src,))
    if hf_config.num_hidden_layers % pp:
        raise ConversionError(f"layout: PP={pp} does not divide the "
                              f"{hf_config.num_hidden_layers} layers")
    vocab = padded_vocab_size(hf_config.vocab_size)
    if vocab % tp:
        raise ConversionError(f"layout: TP={tp} does not divide the padded vocabulary {vocab}")
    if hf_config.num_key_value_heads % tp:
        raise ConversionError(f"layout: TP={tp} does not divide the "
                              f"{hf_config.num_key_value_heads} key/value heads")
    progress(f"read {src} ({hf_config.architecture}, {len(hf)} tensors)")

    name = "iter_0000000"
    # meta.json names the tokenizer where it will be once the folder is renamed into place.
    tokenizer_file, fingerprint = _source_tokenizer(src, vocab)
    tokenizer_path = (None if tokenizer_file is None
                      else str(dst.resolve() / name / "tokenizer" / tokenizer_file))
    train_cfg = train_config_for_hf(hf_config, tokenizer_path, precision, tp, pp)
    model_cfg = single_process_model_config(train_cfg, vocab)

    def write_full_state(root: Path) -> dict:
        """The full megatron tensors in a file every rank reads; write_rank_shard's kwargs."""
        (root / name).mkdir(parents=True)
        meg = hf_to_megatron_tensors(hf, model_cfg)
        state_file = root / ".full_state.pt"
        torch.save({k: v.to(torch_dtype) for k, v in meg.items()}, state_file)
        return dict(train_config=train_cfg.to_dict(), vocab_size=vocab,
                    state_file=str(state_file), out_dir=str(root / name))

    def finish(root: Path) -> None:
        from megatron_iiet.training.checkpoint_meta import (CheckpointMeta,
                                                            architecture_signature, write_meta)

        (root / ".full_state.pt").unlink()
        ckpt = root / name
        if tokenizer_path is not None:  # after the save: dist_checkpointing wants an empty dir
            (ckpt / "tokenizer").mkdir()
            for f in TOKENIZER_FILES:
                if (src / f).is_file():
                    shutil.copy2(src / f, ckpt / "tokenizer" / f)
        # Weights only: the trainer starts a fresh optimizer and schedule at step 0. The
        # manifest and checksums make the import integrity-checked at load like any checkpoint.
        write_meta(ckpt, CheckpointMeta(
            step=0, model_only=True, config=train_cfg.to_dict(),
            architecture=architecture_signature(model_cfg),
            layout={"tensor": tp, "pipeline": pp, "data": 1}, tokenizer=tokenizer_path,
            tokenizer_fingerprint=fingerprint, source={"hf_folder": str(src.resolve())}))
        (root / LATEST).write_text(name)

    progress(f"writing the dist checkpoint with TP={tp} PP={pp} ({tp * pp} ranks)")
    if _inside_job_of_layout(tp, pp):
        _write_in_this_job(dst, force, write_full_state, finish, src)
    else:
        def fill(root: Path):
            kwargs = write_full_state(root)
            if tp * pp == 1:
                with one_process_group():
                    write_rank_shard(**kwargs)
            else:
                from megatron_iiet.distributed import spawn_local

                spawn_local(write_rank_shard, tp * pp, tp, pp, timeout_s=3600.0, **kwargs)
            finish(root)

        write_atomically(dst, force, fill, sources=(src,), kind="megatron")
    return ImportSummary(str(dst), str(dst / name), hf_config.architecture,
                         {"tensor": tp, "pipeline": pp}, vocab, precision, tokenizer_path,
                         time.perf_counter() - start)


def _inside_job_of_layout(tp: int, pp: int) -> bool:
    """Called on every rank of a running job whose whole world is this TP x PP layout (e.g.
    under torchrun): the ranks write their shards themselves instead of spawning new ones."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    from megatron.core import parallel_state as ps

    if not (dist.get_world_size() == tp * pp and ps.model_parallel_is_initialized()
            and ps.get_tensor_model_parallel_world_size() == tp
            and ps.get_pipeline_model_parallel_world_size() == pp):
        raise ConversionError(f"inside a distributed job, HF -> megatron needs the job's layout "
                              f"to be exactly TP={tp} x PP={pp} (world {dist.get_world_size()})")
    return True


def _write_in_this_job(dst: Path, force: bool, write_full_state, finish, src: Path) -> None:
    """Rank 0 prepares and finalises a temp folder; every rank writes its shard into it."""
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    tmp = dst.parent / f".{dst.name}.tmp-job"
    box: list = [None]
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            box[0] = write_full_state(tmp)
        except Exception as err:  # tell the other ranks instead of leaving them waiting
            box[0] = f"rank 0 failed: {err}"
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ConversionError(box[0])
    try:
        write_rank_shard(**box[0])
        dist.barrier()
        if rank0:
            finish(tmp)

            def move_into(folder: Path):
                for item in tmp.iterdir():
                    os.replace(item, folder / item.name)

            write_atomically(dst, force, move_into, sources=(src,), kind="megatron")
    finally:
        dist.barrier()
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)


def _source_tokenizer(src: Path, vocab: int):
    """(file name inside the copied tokenizer dir, or "" for the dir itself; fingerprint), or
    (None, None) when the HF folder ships no tokenizer."""
    from megatron_iiet.data.tokenizer import Tokenizer
    from megatron_iiet.training.config import padded_vocab_size

    present = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not present:
        return None, None
    # A sentencepiece .model is preferred when present: it is what the data tools read.
    file_name = "tokenizer.model" if "tokenizer.model" in present else ""
    try:
        tok = Tokenizer.from_path(src / file_name if file_name else src)
    except ValueError as err:
        raise ConversionError(f"{src}: unusable tokenizer files ({err})") from err
    if padded_vocab_size(tok.vocab_size) != vocab:
        raise ConversionError(f"{src}: the tokenizer has {tok.vocab_size} tokens and the model "
                              f"{vocab} (padded): they do not belong together")
    return file_name, tok.fingerprint
