"""Megatron checkpoints <-> Hugging Face folders (the format of docs/hf.md).

megatron -> HF (`export_to_hf`): a checkpoint written by the trainer at any TP/PP, by either
engine, is loaded in ONE process into a TP=1/PP=1 model: our dist-checkpoint keys are global
(layers by global index, tensors sharded by megatron's own ShardedTensors), so megatron's
`dist_checkpointing.load` reshards any layout into that one. The full tensors are then renamed
and reshaped into the HF layout and written with `save_pretrained` (config with auto_map, the
modeling code, safetensors shards, generation config) plus the tokenizer and a model card.

HF -> megatron (`import_from_hf`): an HF folder of ours, or the authors' release layout (read
with `release_import`), becomes a model-only megatron checkpoint (meta.json with
`"model_only": true` + dist_checkpointing "model", no optimizer) written by TP x PP ranks at the
chosen layout. The trainer loads it for continued training (fresh optimizer, step 0).

The name mapping is in `megatron_to_hf_tensors` / `hf_to_megatron_tensors` and in docs/hf.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from .checks import (LATEST, META, ConversionError, check_expected_architecture,
                     check_shards_present, find_checkpoint, read_checkpoint_meta,
                     refuse_nonfinite)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                      "special_tokens_map.json", "added_tokens.json")

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# ==============================================================================================
# Rebuilding the model of a megatron checkpoint (its files are checked in checks.py)
# ==============================================================================================
def train_config_from_dict(tree: dict):
    """The TrainConfig saved in meta.json (unknown keys are refused: another trainer version)."""
    from megatron_iiet.training.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    values = {}
    for name, value in tree.items():
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


def single_process_model_config(train_cfg, vocab_size: int):
    """The model config of a saved training config, rebuilt at TP=1/PP=1 (no recompute)."""
    from megatron_iiet.training.trainer import build_model_config

    par = dataclasses.replace(train_cfg.parallel, tensor=1, pipeline=1)
    model = dataclasses.replace(train_cfg.model, recompute_granularity=None,
                                recompute_method=None, recompute_num_layers=None,
                                iteration_checkpointing="none")
    try:
        return build_model_config(dataclasses.replace(train_cfg, parallel=par, model=model),
                                  vocab_size)
    except ValueError as err:
        raise ConversionError(f"model config: {err}") from err


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
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
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


def load_megatron_checkpoint(ckpt: Path, meta: dict):
    """(TP=1/PP=1 model config, {megatron full name: tensor}) of a checkpoint of any layout."""
    from megatron.core import dist_checkpointing

    from megatron_iiet.model.gpt import IIETModel
    from megatron_iiet.training.checkpointing import architecture_signature

    train_cfg = train_config_from_dict(meta["config"])
    model_cfg = single_process_model_config(train_cfg, meta["architecture"]["vocab_size"])
    rebuilt = architecture_signature(model_cfg)
    if rebuilt != meta["architecture"]:
        diffs = {k: (meta["architecture"].get(k), v) for k, v in rebuilt.items()
                 if meta["architecture"].get(k) != v}
        raise ConversionError(f"{ckpt / META}: its config does not rebuild the saved "
                              f"architecture (saved, rebuilt): {diffs}")
    with one_process_group():
        model = IIETModel(model_cfg)
        try:
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
        except Exception as err:  # megatron's errors are long; keep the cause, name the folder
            raise ConversionError(f"{ckpt}: cannot read the model tensors: "
                                  f"{str(err).splitlines()[0][:300]}") from err
        model.load_state_dict(loaded["model"])
        tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model_cfg, tensors


# ==============================================================================================
# The name mapping (one place; docs/hf.md shows the same table)
# ==============================================================================================
_LAYER = "decoder.layers.{i}."
_HF_LAYER = "model.layers.{i}."


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


# (megatron suffix within a layer, HF suffix within a layer) for tensors copied unchanged
_LAYER_RENAMES = (
    ("block.input_layernorm.weight", "input_layernorm.weight"),
    ("block.pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("block.self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("block.mlp.linear_fc2.weight", "mlp.down_proj.weight"),
    ("gate.weight", "gate_linear.weight"),
)
_HISTORY_NORMS = (("predictor_norm", "rouge_predictions_norm"), ("corrector_norm", "layer_norms"))


def _taker(tensors: dict[str, torch.Tensor], what: str):
    """`take(name)`: remove and return tensors[name]; a missing one is a ConversionError. What is
    left at the end had no counterpart."""
    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ConversionError(f"{what} {name} is missing")
        return tensors.pop(name)

    return take


def megatron_to_hf_tensors(meg: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Full megatron tensors (TP=1/PP=1 names) -> HF state dict (lm_head only when untied)."""
    meg = dict(meg)
    hf: dict[str, torch.Tensor] = {}

    take = _taker(meg, "checkpoint tensor")

    hf["model.embed_tokens.weight"] = take("embedding.word_embeddings.weight")
    pop_rows, refine_rows = [], []
    for i in range(cfg.num_layers):
        src, dst = _LAYER.format(i=i), _HF_LAYER.format(i=i)
        for m_suffix, h_suffix in _LAYER_RENAMES:
            if src + m_suffix in meg:
                hf[dst + h_suffix] = take(src + m_suffix)
        q, k, v = _qkv_split(take(src + "block.self_attention.linear_qkv.weight"), cfg)
        hf[dst + "self_attn.q_proj.weight"] = q
        hf[dst + "self_attn.k_proj.weight"] = k
        hf[dst + "self_attn.v_proj.weight"] = v
        gate, up = take(src + "block.mlp.linear_fc1.weight").chunk(2, dim=0)  # [gate; up]
        hf[dst + "mlp.gate_proj.weight"] = gate
        hf[dst + "mlp.up_proj.weight"] = up
        if src + "history.pop_weight" in meg:
            pop_rows.append(take(src + "history.pop_weight"))
            refine_rows.append(take(src + "history.refine_weight"))
            for m_norm, h_norm in _HISTORY_NORMS:
                for p in ("weight", "bias"):
                    hf[f"model.history.{h_norm}.{i}.{p}"] = take(f"{src}history.{m_norm}.{p}")
    if pop_rows:
        hf["model.history.weight"] = _history_matrix(pop_rows)
        hf["model.history.weight_c"] = _history_matrix(refine_rows)
    if "decoder.shared.alpha" in meg:
        hf["model.alpha"] = take("decoder.shared.alpha")
        j = 0
        while f"decoder.shared.stage_norms.{j}.weight" in meg:
            for p in ("weight", "bias"):
                hf[f"model.RK_norm.{j}.{p}"] = take(f"decoder.shared.stage_norms.{j}.{p}")
            j += 1
    hf["model.norm.weight"] = take("decoder.final_norm.weight")
    if not cfg.share_embeddings_and_output_weights:
        hf["lm_head.weight"] = take("output_layer.weight")
    if meg:
        raise ConversionError(f"checkpoint tensors with no HF name: {', '.join(sorted(meg)[:8])}")
    return {k: v.contiguous() for k, v in hf.items()}


def hf_to_megatron_tensors(hf: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """HF state dict -> full megatron tensors (TP=1/PP=1 names), vocab padded to cfg.vocab_size."""
    hf = dict(hf)
    meg: dict[str, torch.Tensor] = {}

    take = _taker(hf, "HF tensor")

    def padded_vocab(t):
        # Rows past the tokenizer's vocabulary are never a label or an input; zeros, as the
        # trainer's padding would be meaningless to copy from anywhere.
        extra = cfg.vocab_size - t.shape[0]
        return t if extra == 0 else torch.cat([t, t.new_zeros(extra, t.shape[1])])

    meg["embedding.word_embeddings.weight"] = padded_vocab(take("model.embed_tokens.weight"))
    W = hf.pop("model.history.weight", None)
    Wc = hf.pop("model.history.weight_c", None)
    for i in range(cfg.num_layers):
        src, dst = _HF_LAYER.format(i=i), _LAYER.format(i=i)
        for m_suffix, h_suffix in _LAYER_RENAMES:
            if src + h_suffix in hf:
                meg[dst + m_suffix] = take(src + h_suffix)
        meg[dst + "block.self_attention.linear_qkv.weight"] = _qkv_fuse(
            take(src + "self_attn.q_proj.weight"), take(src + "self_attn.k_proj.weight"),
            take(src + "self_attn.v_proj.weight"), cfg)
        meg[dst + "block.mlp.linear_fc1.weight"] = torch.cat(
            [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")], dim=0)
        if W is not None:
            meg[dst + "history.pop_weight"] = W[i + 1, : i + 2].clone()
            meg[dst + "history.refine_weight"] = Wc[i + 1, : i + 2].clone()
            for m_norm, h_norm in _HISTORY_NORMS:
                for p in ("weight", "bias"):
                    meg[f"{dst}history.{m_norm}.{p}"] = take(f"model.history.{h_norm}.{i}.{p}")
    if "model.alpha" in hf:
        meg["decoder.shared.alpha"] = take("model.alpha")
        j = 0
        while f"model.RK_norm.{j}.weight" in hf:
            for p in ("weight", "bias"):
                meg[f"decoder.shared.stage_norms.{j}.{p}"] = take(f"model.RK_norm.{j}.{p}")
            j += 1
    meg["decoder.final_norm.weight"] = take("model.norm.weight")
    if not cfg.share_embeddings_and_output_weights:
        meg["output_layer.weight"] = padded_vocab(take("lm_head.weight"))
    hf.pop("lm_head.weight", None)  # tied: the embedding is the head
    if hf:
        raise ConversionError(f"HF tensors with no megatron name: {', '.join(sorted(hf)[:8])}")
    return {k: v.contiguous() for k, v in meg.items()}


# ==============================================================================================
# megatron -> HF
# ==============================================================================================
@dataclass
class ExportSummary:
    output: str
    source: str
    architecture: str
    step: Optional[int]
    source_layout: dict
    parameters: int
    vocab_size: int
    dtype: str
    weight_files: list
    tokenizer: Optional[str]
    seconds: float


def resolve_tokenizer(meta: dict, override: Optional[str], ckpt: Path):
    """The checkpoint's tokenizer (or `override`), checked against the saved fingerprint."""
    from megatron_iiet.data.tokenizer import Tokenizer

    path = override or meta.get("tokenizer") or meta["config"].get("data", {}).get("tokenizer")
    if not path:
        raise ConversionError(f"{ckpt / META}: names no tokenizer; pass --tokenizer PATH "
                              "(or --no-tokenizer to export the weights only)")
    if not Path(path).exists():
        raise ConversionError(f"tokenizer {path} (named by {ckpt / META}) does not exist; pass "
                              "--tokenizer PATH (or --no-tokenizer)")
    try:
        tokenizer = Tokenizer.from_path(path)
    except ValueError as err:
        raise ConversionError(f"tokenizer {path}: {err}") from err
    saved = meta.get("tokenizer_fingerprint")
    if saved and tokenizer.fingerprint != saved:
        raise ConversionError(f"tokenizer {path} ({tokenizer.fingerprint}) is not the one the "
                              f"checkpoint was trained with ({saved})")
    return tokenizer


def hf_config_for(model_cfg, vocab_size: int, tokenizer=None, max_positions: int = 2048):
    from megatron_iiet.hf.configuration_iiet import IIETConfig

    iiet = model_cfg.architecture == "iiet"
    special = {}
    if tokenizer is not None:
        special = dict(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                       pad_token_id=tokenizer.pad_id)
    return IIETConfig(
        vocab_size=vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.ffn_hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_attention_heads,
        num_key_value_heads=model_cfg.num_query_groups,
        max_position_embeddings=max_positions,
        rms_norm_eps=model_cfg.layernorm_epsilon,
        rope_theta=float(model_cfg.rotary_base),
        initializer_range=model_cfg.init_method_std,
        tie_word_embeddings=model_cfg.share_embeddings_and_output_weights,
        architecture=model_cfg.architecture,
        formulation=model_cfg.formulation if iiet else "history",
        iterations=model_cfg.layer_iterations if iiet else None,
        history_norm_eps=model_cfg.history_norm_eps,
        # Not read by the HF model; kept so HF -> megatron restores the trained r.
        max_iterations=model_cfg.max_iterations,
        **special,
    )


def _model_card(summary_fields: dict, hf_config, meta: dict) -> str:
    import yaml

    its = (f"- iterations per layer: {hf_config.iterations} (formulation `{hf_config.formulation}`)\n"
           if hf_config.architecture == "iiet" else "")
    return (
        f"# {hf_config.architecture} model ({hf_config.num_hidden_layers} layers, hidden "
        f"{hf_config.hidden_size})\n\n"
        "Converted from a megatron_iiet training checkpoint by `tools/convert_checkpoint.py`.\n\n"
        f"- architecture: `{hf_config.architecture}`\n{its}"
        f"- heads {hf_config.num_attention_heads} (kv {hf_config.num_key_value_heads}), FFN "
        f"{hf_config.intermediate_size}, vocab {hf_config.vocab_size}, tied embeddings "
        f"{hf_config.tie_word_embeddings}\n"
        f"- source: `{summary_fields['source']}` (step {meta.get('step')}, layout "
        f"{meta.get('layout')}, engine {meta.get('engine')})\n"
        f"- weights dtype: {summary_fields['dtype']}\n\n"
        "## Usage\n\n```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)\n"
        "tokenizer = AutoTokenizer.from_pretrained(folder)\n```\n\n"
        "The cached `generate` keeps one KV cache per (layer, pass), so it reproduces the "
        "full-sequence logits exactly (see docs/hf.md of megatron_iiet).\n\n"
        "## Training configuration\n\n```yaml\n"
        + yaml.safe_dump(meta["config"], sort_keys=False) + "```\n")


def _write_tokenizer(tokenizer, folder: Path) -> None:
    from megatron_iiet.data.hf_export import export_hf_tokenizer

    src = Path(tokenizer.path)
    if src.is_file():  # a sentencepiece model: build the HF files from it
        export_hf_tokenizer(src, folder)
        return
    for name in HF_TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)


def _check_destination(dst: Path, force: bool) -> None:
    if dst.exists() and not force:
        raise ConversionError(f"{dst} exists; pass --force to replace it")


def export_to_hf(src, dst, dtype: str = "fp32", trim_vocab: bool = False,
                 max_shard_size: str = "2GB", force: bool = False,
                 expect_architecture: Optional[str] = None, tokenizer: Optional[str] = None,
                 with_tokenizer: bool = True, allow_nonfinite: bool = False,
                 progress: Progress = _quiet) -> ExportSummary:
    """Write the HF folder `dst` for the megatron checkpoint `src` (root or iter_* dir).
    NaN/Inf weights (or weights `dtype` cannot hold) are refused unless `allow_nonfinite`."""
    from megatron_iiet.hf.release_import import assemble_model, check_tensors, write_atomically

    start = time.perf_counter()
    dst = Path(dst)
    if dtype not in DTYPES:
        raise ConversionError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    ckpt = find_checkpoint(src)
    meta = read_checkpoint_meta(ckpt)
    check_expected_architecture(meta, expect_architecture, ckpt)
    check_shards_present(ckpt)
    _check_destination(dst, force)
    tok = resolve_tokenizer(meta, tokenizer, ckpt) if with_tokenizer else None
    if trim_vocab and tok is None:
        raise ConversionError("--trim-vocab needs the tokenizer (its vocabulary size)")
    progress(f"reading {ckpt} (layout {meta.get('layout')}, engine {meta.get('engine')})")
    model_cfg, meg = load_megatron_checkpoint(ckpt, meta)
    refuse_nonfinite(meg, ckpt, allow_nonfinite, cast_to=DTYPES[dtype])
    progress(f"loaded {len(meg)} tensors into one TP=1/PP=1 {model_cfg.architecture} model")
    hf = megatron_to_hf_tensors(meg, model_cfg)
    del meg
    vocab = model_cfg.vocab_size
    if trim_vocab:
        vocab = tok.vocab_size
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in hf:
                hf[name] = hf[name][:vocab].contiguous()
    seq = meta["config"].get("data", {}).get("seq_length", 2048)
    hf_config = hf_config_for(model_cfg, vocab, tok, seq)
    model = assemble_model(check_tensors(hf, hf_config), hf_config, DTYPES[dtype])
    del hf
    parameters = sum(p.numel() for p in model.parameters())
    progress(f"writing {dst} ({parameters / 1e6:.1f}M parameters, {dtype})")

    def fill(folder: Path):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig(
            bos_token_id=hf_config.bos_token_id, eos_token_id=hf_config.eos_token_id,
            pad_token_id=hf_config.pad_token_id)
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        if tok is not None:
            _write_tokenizer(tok, folder)
        card = _model_card({"source": str(ckpt), "dtype": dtype}, hf_config, meta)
        (folder / "README.md").write_text(card)

    write_atomically(dst, force, fill)
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    return ExportSummary(str(dst), str(ckpt), model_cfg.architecture, meta.get("step"),
                         meta.get("layout", {}), parameters, vocab, dtype, files,
                         str(tok.path) if tok is not None else None,
                         time.perf_counter() - start)


# ==============================================================================================
# HF -> megatron
# ==============================================================================================
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


def read_hf_folder(src: Path, iterations=None):
    """(IIETConfig, tensors) of an HF folder of ours or of the authors' release layout."""
    from megatron_iiet.hf import release_import as rel
    from megatron_iiet.hf.configuration_iiet import IIETConfig

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
            config = rel.build_config(raw, rel.detect_architecture(tensors), iterations)
        tensors = rel.check_tensors(tensors, config)
    except ValueError as err:  # ReleaseImportError, or IIETConfig refusing the config
        raise ConversionError(str(err)) from err
    return config, tensors


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

    # Fields TrainConfig cannot express must keep their megatron defaults.
    defaults = preset("tiny")
    fixed = {"rms_norm_eps": defaults.layernorm_epsilon, "rope_theta": defaults.rotary_base,
             "history_norm_eps": defaults.history_norm_eps}
    for name, value in fixed.items():
        if abs(float(getattr(hf_config, name)) - float(value)) > 1e-12 * max(1.0, abs(value)):
            raise ConversionError(f"config {name}={getattr(hf_config, name)}: the megatron "
                                  f"model supports only {value}")
    iiet = hf_config.architecture == "iiet"
    its = list(hf_config.iterations)
    r = int(getattr(hf_config, "max_iterations", None) or max(its)) if iiet else 3
    if iiet and max(its) > r:
        r = max(its)
    model = ModelSection(
        preset=_preset_for(hf_config),
        architecture=hf_config.architecture,
        formulation=hf_config.formulation if iiet else "history",
        iterations=None if (not iiet or all(i == r for i in its)) else its,
        max_iterations=r,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        init_method_std=float(hf_config.initializer_range),
    )
    return TrainConfig(model=model,
                       data=DataSection(tokenizer=tokenizer_path,
                                        seq_length=int(hf_config.max_position_embeddings)),
                       parallel=ParallelSection(tensor=tp, pipeline=pp, precision=precision))


def write_rank_shard(train_config: dict, vocab_size: int, state_file: str, out_dir: str):
    """Inside one rank of the target layout: build the model, take this rank's share, save."""
    from megatron.core import dist_checkpointing

    from megatron_iiet.model.gpt import IIETModel
    from megatron_iiet.model.sharding import load_full
    from megatron_iiet.training.trainer import build_model_config

    cfg = train_config_from_dict(train_config)
    model = IIETModel(build_model_config(cfg, vocab_size))
    full = torch.load(state_file, map_location="cpu", weights_only=True, mmap=True)
    load_full(model, full, strict=True)
    del full
    dist_checkpointing.save({"model": model.sharded_state_dict()}, out_dir)
    return True


def import_from_hf(src, dst, tp: int = 1, pp: int = 1, precision: str = "fp32",
                   iterations=None, force: bool = False,
                   expect_architecture: Optional[str] = None, allow_nonfinite: bool = False,
                   progress: Progress = _quiet) -> ImportSummary:
    """Write a model-only megatron checkpoint root `dst` (latest + iter_0000000) for `src`.
    NaN/Inf weights (or weights `precision` cannot hold) are refused unless `allow_nonfinite`."""
    from megatron_iiet.hf.release_import import write_atomically
    from megatron_iiet.training.trainer import padded_vocab_size  # cheap: no megatron import

    start = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if precision not in DTYPES:
        raise ConversionError(f"precision: {precision!r} is not one of {', '.join(DTYPES)}")
    if tp < 1 or pp < 1:
        raise ConversionError(f"layout: TP and PP must be >= 1, got TP={tp} PP={pp}")
    hf_config, hf = read_hf_folder(src, iterations)
    # The mapping only moves values (and pads with zeros): checking the HF tensors covers it.
    refuse_nonfinite(hf, src, allow_nonfinite, cast_to=DTYPES[precision])
    if expect_architecture is not None and hf_config.architecture != expect_architecture:
        raise ConversionError(f"{src}: holds a {hf_config.architecture} model, expected "
                              f"{expect_architecture}")
    _check_destination(dst, force)
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
        torch.save({k: v.to(DTYPES[precision]) for k, v in meg.items()}, state_file)
        return dict(train_config=train_cfg.to_dict(), vocab_size=vocab,
                    state_file=str(state_file), out_dir=str(root / name))

    def finish(root: Path) -> None:
        from megatron_iiet.training.checkpointing import architecture_signature

        (root / ".full_state.pt").unlink()
        ckpt = root / name
        if tokenizer_path is not None:  # after the save: dist_checkpointing wants an empty dir
            (ckpt / "tokenizer").mkdir()
            for f in HF_TOKENIZER_FILES:
                if (src / f).is_file():
                    shutil.copy2(src / f, ckpt / "tokenizer" / f)
        meta = {
            "config": train_cfg.to_dict(),
            "architecture": architecture_signature(model_cfg),
            "layout": {"tensor": tp, "pipeline": pp, "data": 1},
            "engine": None,
            # Weights only: the trainer starts a fresh optimizer and schedule at step 0.
            "model_only": True,
            "step": 0,
            "consumed_samples": 0,
            "skipped_steps": 0,
            "scheduler": None,
            "tokenizer": tokenizer_path,
            "tokenizer_fingerprint": fingerprint,
            "source": {"hf_folder": str(src.resolve())},
        }
        (ckpt / META).write_text(json.dumps(meta, indent=2))
        (root / LATEST).write_text(name)

    progress(f"writing the dist checkpoint with TP={tp} PP={pp} ({tp * pp} ranks)")
    if _inside_job_of_layout(tp, pp):
        _write_in_this_job(dst, force, write_full_state, finish)
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

        write_atomically(dst, force, fill)
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


def _write_in_this_job(dst: Path, force: bool, write_full_state, finish) -> None:
    """Rank 0 prepares and finalises a temp folder; every rank writes its shard into it."""
    import torch.distributed as dist

    from megatron_iiet.hf.release_import import write_atomically

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

            write_atomically(dst, force, move_into)
    finally:
        dist.barrier()
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)


def _source_tokenizer(src: Path, vocab: int):
    """(file name inside the copied tokenizer dir, or "" for the dir itself; fingerprint), or
    (None, None) when the HF folder ships no tokenizer."""
    from megatron_iiet.data.tokenizer import Tokenizer
    from megatron_iiet.training.trainer import padded_vocab_size

    present = [f for f in HF_TOKENIZER_FILES if (src / f).is_file()]
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


__all__ = [
    "ConversionError",
    "ExportSummary",
    "ImportSummary",
    "export_to_hf",
    "find_checkpoint",
    "hf_to_megatron_tensors",
    "import_from_hf",
    "load_megatron_checkpoint",
    "megatron_to_hf_tensors",
    "read_checkpoint_meta",
]
