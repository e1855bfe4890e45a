"""megatron -> HF (`export_to_hf`): a checkpoint written by the trainer at any TP/PP, by either
engine, is loaded in ONE process into a TP=1/PP=1 model: our dist-checkpoint keys are global
(layers by global index, tensors sharded by megatron's own ShardedTensors), so megatron's
`dist_checkpointing.load` reshards any layout into that one. The full tensors are then renamed
and reshaped into the HF layout (mapping.py) and written with `save_pretrained` (config with
auto_map, the modeling code, safetensors shards, generation config) plus the tokenizer and a
model card.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .checks import (DEFAULT_MAX_ABS_WEIGHT, META, ConversionError, check_destination,
                     check_expected_architecture, check_shards_present, dtype_named,
                     find_checkpoint, read_checkpoint_meta, refuse_nonfinite)
from .mapping import hf_config_for, megatron_to_hf_tensors
from .megatron_model import Progress, load_megatron_checkpoint, quiet
from .release_import import TOKENIZER_FILES, assemble_model, check_tensors, write_atomically


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


def tokenizer_candidates(path: str, meta, ckpt: Path) -> list[Path]:
    """Where the tokenizer path a checkpoint records may point. The trainer stores it resolved;
    older checkpoints hold it as given, relative to the directory training ran in, so a
    relative path is tried as is, then from that directory (the checkpoint root minus the
    run's relative `checkpoint.dir`), then from each folder up from the checkpoint (a run
    folder moved or copied whole)."""
    given = Path(path)
    if given.is_absolute():
        return [given]
    found = [given]
    ckpt = ckpt.resolve()
    config = meta.config or {}
    logs = (config.get("logging") or {}).get("dir") or "outputs/run"  # TrainConfig's defaults
    named = Path((config.get("checkpoint") or {}).get("dir") or Path(logs) / "checkpoints").parts
    root = ckpt.parent.parts  # the checkpoint root: training called it `named`
    if named and not Path(*named).is_absolute() and ".." not in named and root[-len(named):] == named:
        found.append(Path(*root[:-len(named)]) / given)
    found += [folder / given for folder in (ckpt, *ckpt.parents)]
    return list(dict.fromkeys(found))


def resolve_tokenizer(meta, override: Optional[str], ckpt: Path):
    """The checkpoint's tokenizer (or `override`), checked against the saved fingerprint."""
    from megatron_iiet.data.tokenizer import Tokenizer, fingerprint_matches

    path = (override or meta.tokenizer
            or ((meta.config or {}).get("data") or {}).get("tokenizer"))
    if not path:
        raise ConversionError(f"{ckpt / META}: names no tokenizer; pass --tokenizer PATH "
                              "(or --no-tokenizer to export the weights only)")
    # An --tokenizer path is the operator's, relative to where they are; only the recorded one
    # is looked for where training may have meant it.
    candidates = [Path(path)] if override else tokenizer_candidates(path, meta, ckpt)
    existing = [c for c in candidates if c.exists()]
    if not existing:
        raise ConversionError(f"tokenizer {path} (named by {ckpt / META}) does not exist; pass "
                              "--tokenizer PATH (or --no-tokenizer)")
    saved = meta.tokenizer_fingerprint
    first = None
    for candidate in existing:
        try:
            tokenizer = Tokenizer.from_path(candidate)
        except ValueError as err:
            raise ConversionError(f"tokenizer {candidate}: {err}") from err
        if not saved or fingerprint_matches(saved, tokenizer.fingerprint):
            return tokenizer
        first = first or tokenizer  # a folder further up may hold the right one
    raise ConversionError(f"tokenizer {first.path} ({first.fingerprint}) is not the one the "
                          f"checkpoint was trained with ({saved})")


CARD_LICENSE = "apache-2.0"
"""The card's license: the model code's (this project's). Weights trained on data with other
terms need their card edited before publishing."""


def _model_card(summary_fields: dict, hf_config, meta, with_tokenizer: bool) -> str:
    import yaml

    from megatron_iiet.model.architectures import get_architecture

    its = (f"- iterations per layer: {hf_config.iterations} (formulation `{hf_config.formulation}`)\n"
           if get_architecture(hf_config.architecture, hf_config.formulation).iterates else "")
    # the Hub's card metadata: what the model page, search and the inference widget read
    hub = {"license": CARD_LICENSE, "library_name": "transformers",
           "pipeline_tag": "text-generation",
           "tags": ["iiet", "megatron-iiet", hf_config.architecture.replace("_", "-"),
                    "custom_code"]}
    return (
        "---\n" + yaml.safe_dump(hub, sort_keys=False) + "---\n\n"
        f"# {hf_config.architecture} model ({hf_config.num_hidden_layers} layers, hidden "
        f"{hf_config.hidden_size})\n\n"
        "Converted from a megatron_iiet training checkpoint by `tools/convert_checkpoint.py`.\n\n"
        f"- architecture: `{hf_config.architecture}`\n{its}"
        f"- heads {hf_config.num_attention_heads} (kv {hf_config.num_key_value_heads}), FFN "
        f"{hf_config.intermediate_size}, vocab {hf_config.vocab_size}, tied embeddings "
        f"{hf_config.tie_word_embeddings}\n"
        f"- source: `{summary_fields['source']}` (step {meta.step}, layout "
        f"{meta.layout}, engine {meta.engine})\n"
        f"- weights dtype: {summary_fields['dtype']}\n\n"
        + _usage(with_tokenizer) +
        "The cached `generate` keeps one KV cache per (layer, pass), so it reproduces the "
        "full-sequence logits exactly (see docs/hf.md of megatron_iiet).\n\n"
        "## Training configuration\n\n```yaml\n"
        + yaml.safe_dump(meta.config, sort_keys=False) + "```\n")


def _usage(with_tokenizer: bool) -> str:
    """The card's snippet (`folder`: this folder's path). Importing megatron_iiet.hf registers
    the IIET classes with the Auto classes, so both loads use the installed package's code and
    nothing from the folder runs (nor does transformers ask: the prompt concerns remote code
    only). Without the package, trust_remote_code=True is the only way in, and it runs the
    folder's .py files: the card says so rather than putting that in the snippet."""
    loads = ("model = AutoModelForCausalLM.from_pretrained(folder)\n"
             + ("tokenizer = AutoTokenizer.from_pretrained(folder)\n"
                "ids = tokenizer(\"def main():\", return_tensors=\"pt\").input_ids\n"
                "print(tokenizer.decode(model.generate(ids, max_new_tokens=20)[0]))\n"
                if with_tokenizer else ""))
    imports = "AutoModelForCausalLM, AutoTokenizer" if with_tokenizer else "AutoModelForCausalLM"
    return ("## Usage\n\n`folder` is the path of this folder; `megatron_iiet` must be installed.\n\n"
            "```python\nimport megatron_iiet.hf  # registers the IIET classes with transformers\n"
            f"from transformers import {imports}\n\n{loads}```\n\n"
            + ("" if with_tokenizer else "Exported without a tokenizer.\n\n")
            + "Without `megatron_iiet`, pass `trust_remote_code=True` to "
            + ("both calls" if with_tokenizer else "the call")
            + ": transformers then imports and runs this folder's own `configuration_iiet.py`, "
              "`modeling_iiet.py` and `cache_iiet.py` (the same code as the package's, unless "
              "someone changed them: read them before you trust a copy of this folder).\n\n")


def _write_tokenizer(tokenizer, folder: Path) -> None:
    from megatron_iiet.data.hf_export import export_hf_tokenizer

    src = Path(tokenizer.path)
    if src.is_file():  # a sentencepiece model: build the HF files from it
        export_hf_tokenizer(src, folder)
        return
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)


def build_hf_model(ckpt: Path, meta, tok, torch_dtype, trim_vocab: bool = False,
                   allow_nonfinite: bool = False, progress: Progress = quiet,
                   max_abs_weight: Optional[float] = None):
    """(HF model in eval mode, its config, the TP=1/PP=1 megatron model config) of the
    checkpoint ``ckpt``, in memory: what ``export_to_hf`` writes, and what the evaluation's
    one-process runner scores with. ``torch_dtype`` None keeps the checkpoint's own dtype;
    ``max_abs_weight`` bounds the weights' magnitude (checks.refuse_nonfinite)."""
    progress(f"reading {ckpt} (layout {meta.layout}, engine {meta.engine})")
    model_cfg, meg = load_megatron_checkpoint(ckpt, meta)
    refuse_nonfinite(meg, ckpt, allow_nonfinite, cast_to=torch_dtype, max_abs=max_abs_weight)
    progress(f"loaded {len(meg)} tensors into one TP=1/PP=1 {model_cfg.architecture} model")
    hf = megatron_to_hf_tensors(meg, model_cfg)
    del meg
    vocab = model_cfg.vocab_size
    if trim_vocab:
        vocab = tok.vocab_size
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in hf:
                hf[name] = hf[name][:vocab].contiguous()
    seq = ((meta.config or {}).get("data") or {}).get("seq_length", 2048)
    hf_config = hf_config_for(model_cfg, vocab, tok, seq)
    return assemble_model(check_tensors(hf, hf_config), hf_config, torch_dtype), hf_config, model_cfg


def export_to_hf(src, dst, dtype: str = "fp32", trim_vocab: bool = False,
                 max_shard_size: str = "2GB", force: bool = False,
                 expect_architecture: Optional[str] = None, tokenizer: Optional[str] = None,
                 with_tokenizer: bool = True, allow_nonfinite: bool = False,
                 progress: Progress = quiet,
                 max_abs_weight: Optional[float] = DEFAULT_MAX_ABS_WEIGHT) -> ExportSummary:
    """Write the HF folder `dst` for the megatron checkpoint `src` (root or iter_* dir).
    NaN/Inf weights (or weights `dtype` cannot hold) are refused unless `allow_nonfinite`,
    weights beyond +-`max_abs_weight` always (None: no bound). `dst` may be neither the source
    nor around or inside it; `force` replaces only an earlier export."""
    start = time.perf_counter()
    dst = Path(dst)
    torch_dtype = dtype_named("dtype", dtype)
    ckpt = find_checkpoint(src)
    meta = read_checkpoint_meta(ckpt)
    check_expected_architecture(meta, expect_architecture, ckpt)
    check_shards_present(ckpt)
    check_destination(dst, force, sources=(src, ckpt))
    tok = resolve_tokenizer(meta, tokenizer, ckpt) if with_tokenizer else None
    if trim_vocab and tok is None:
        raise ConversionError("--trim-vocab needs the tokenizer (its vocabulary size)")
    model, hf_config, model_cfg = build_hf_model(ckpt, meta, tok, torch_dtype, trim_vocab,
                                                 allow_nonfinite, progress, max_abs_weight)
    vocab = hf_config.vocab_size
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
        card = _model_card({"source": str(ckpt), "dtype": dtype}, hf_config, meta, tok is not None)
        (folder / "README.md").write_text(card)

    write_atomically(dst, force, fill, sources=(src, ckpt))
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    return ExportSummary(str(dst), str(ckpt), model_cfg.architecture, meta.step,
                         meta.layout or {}, parameters, vocab, dtype, files,
                         str(tok.path) if tok is not None else None,
                         time.perf_counter() - start)
