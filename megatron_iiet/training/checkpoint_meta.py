"""The checkpoint contract: what a checkpoint's `meta.json` holds, read and written in one place.

`CheckpointMeta` is the typed form every reader uses; `write_meta` is the one writer (training's
commit and the HF importer), and it always records the manifest (every file, its size and
checksum), so any checkpoint this project wrote is integrity-checked at load. Checkpoints of
older versions parse too: each field has the default an older checkpoint, which lacked it,
implies (a field added later must not make every older checkpoint refuse to resume or export),
and keys of a newer version are kept, not refused.

The architecture signature (what must match for weights to mean the same thing) is the declared
list `SIGNATURE`: a field added to it later gets a default, which is what an older checkpoint's
signature is read as.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_iiet.data.atomic import write_bytes_atomic
from megatron_iiet.training.checkpoint_index import (CHECKSUMS_KEY, META, MANIFEST_KEY,
                                                     CheckpointError, checksum_record,
                                                     checksums, manifest)

# 1: written before meta.json had a version; 2: typed, with `version`.
META_VERSION = 2
_REQUIRED = object()


@dataclass(frozen=True)
class SignatureField:
    name: str
    read: Callable[[Any], Any]  # the value of a megatron model config
    default: Any = _REQUIRED    # what a checkpoint saved before this field existed implies


def _formulation(c) -> Optional[str]:
    from megatron_iiet.model.architectures import get_architecture

    return get_architecture(c.architecture, c.formulation).formulation


def _attr(name: str) -> Callable[[Any], Any]:
    return lambda c: getattr(c, name)


SIGNATURE: tuple[SignatureField, ...] = (
    SignatureField("architecture", _attr("architecture")),
    SignatureField("formulation", _formulation),
    SignatureField("num_layers", _attr("num_layers")),
    SignatureField("hidden_size", _attr("hidden_size")),
    SignatureField("num_attention_heads", _attr("num_attention_heads")),
    SignatureField("num_query_groups", _attr("num_query_groups")),
    SignatureField("ffn_hidden_size", _attr("ffn_hidden_size")),
    SignatureField("vocab_size", _attr("vocab_size")),
    SignatureField("share_embeddings_and_output_weights",
                   _attr("share_embeddings_and_output_weights")),
)


def architecture_signature(model_config) -> dict:
    """What must match for weights to mean the same thing (the fields of SIGNATURE)."""
    return {f.name: f.read(model_config) for f in SIGNATURE}


def signature_differences(saved: dict, model_config) -> dict[str, tuple]:
    """{field: (saved, rebuilt)} where they differ; a field the saved signature lacks counts
    as its declared default, and one without a default as missing (None)."""
    diffs = {}
    for f in SIGNATURE:
        mine = f.read(model_config)
        theirs = saved.get(f.name, None if f.default is _REQUIRED else f.default)
        if theirs != mine:
            diffs[f.name] = (theirs, mine)
    return diffs


# name: (type, whether null is allowed)
_TYPES: dict[str, tuple[type, bool]] = {
    "version": (int, False), "step": (int, False), "consumed_samples": (int, False),
    "skipped_steps": (int, False), "model_only": (bool, False), "engine": (str, True),
    "layout": (dict, True), "scheduler": (dict, True), "config": (dict, True),
    "architecture": (dict, True), "tokenizer": (str, True), "tokenizer_fingerprint": (str, True),
    "data_order": (str, True), "source": (dict, True), MANIFEST_KEY: (dict, False),
    CHECKSUMS_KEY: (dict, True),
}


@dataclass
class CheckpointMeta:
    """A checkpoint's meta.json. Only ``step`` is required of an older checkpoint."""

    step: int
    consumed_samples: int = 0
    skipped_steps: int = 0
    version: int = 1
    engine: Optional[str] = None
    layout: Optional[dict] = None
    scheduler: Optional[dict] = None
    model_only: bool = False
    config: Optional[dict] = None          # TrainConfig.to_dict() of the run that saved it
    architecture: Optional[dict] = None    # architecture_signature()
    tokenizer: Optional[str] = None        # path, resolved where training ran
    tokenizer_fingerprint: Optional[str] = None
    data_order: Optional[str] = None       # training/data.py ORDER_VERSION; None: before it
    source: Optional[dict] = None          # an imported checkpoint's origin
    files: dict = field(default_factory=dict)          # manifest: {name: size}
    checksums: Optional[dict] = None                   # checkpoint_index.checksum_record()
    extra: dict = field(default_factory=dict)          # keys of a newer version, kept as read

    @classmethod
    def from_dict(cls, raw: Any, where: Path | str = META) -> "CheckpointMeta":
        if not isinstance(raw, dict) or "step" not in raw:
            raise CheckpointError(f"{where}: not a checkpoint's metadata (no 'step')")
        known, extra = {}, {}
        for key, value in raw.items():
            if key not in _TYPES:
                extra[key] = value
                continue
            kind, optional = _TYPES[key]
            ok = (value is None and optional) or (
                isinstance(value, kind) and not (kind is int and isinstance(value, bool)))
            if not ok:
                raise CheckpointError(f"{where}: {key} is {value!r}, expected {kind.__name__}")
            known[key] = value
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return {**self.extra, **out}

    def signature_value(self, name: str):
        """The saved signature's ``name``, or its declared default for an older checkpoint."""
        saved = self.architecture or {}
        if name in saved:
            return saved[name]
        default = next(f.default for f in SIGNATURE if f.name == name)
        return None if default is _REQUIRED else default

    @property
    def vocab_size(self) -> Optional[int]:
        return self.signature_value("vocab_size")


def parse_meta(text: bytes, where: Path) -> CheckpointMeta:
    try:
        raw = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{where}: not valid JSON ({err})") from None
    return CheckpointMeta.from_dict(raw, where)


def write_meta(directory: Path, meta: CheckpointMeta,
               sums: Optional[dict[str, str]] = None) -> CheckpointMeta:
    """Write ``meta`` into the checkpoint ``directory`` (atomically, last), with the manifest of
    every file there and their checksums (``sums`` when the caller hashed them already: the
    ranks of a job split the work; else hashed here)."""
    directory = Path(directory)
    files = manifest(directory)
    if sums is None:
        sums = checksums(directory, list(files))
    meta = dataclasses.replace(meta, version=META_VERSION, files=files,
                               checksums=checksum_record(sums))
    try:  # what is written must read back: a wrong type here is this program's bug
        CheckpointMeta.from_dict(meta.to_dict(), directory / META)
    except CheckpointError as err:
        raise TypeError(f"writing {err}") from None
    write_bytes_atomic(directory / META,
                       json.dumps(meta.to_dict(), indent=2, default=str).encode())
    return meta


def check_tokenizer(saved: Optional[str], current: Optional[str], what: str,
                    error=CheckpointError) -> None:
    """The one tokenizer check: ``saved`` (a checkpoint's fingerprint) against ``current``
    (the tokenizer about to be used); either unknown passes (older checkpoints recorded none).
    ``what`` opens the message: where the checkpoint is, and what the current one belongs to."""
    from megatron_iiet.data.tokenizer import fingerprint_matches

    if saved and current and not fingerprint_matches(saved, current):
        raise error(f"{what}: trained with tokenizer {saved}, but {current} is used here")


def parse_saved_config(tree: Any, where: Path | str, error=CheckpointError):
    """A TrainConfig saved as a dict (a checkpoint's `config`), through the config's own strict
    parser. Its `distill` section is a training matter (teachers, window) no rebuild needs, and
    is dropped."""
    from megatron_iiet.errors import BadInput
    from megatron_iiet.training.config import TrainConfig, build_typed

    if not isinstance(tree, dict):
        raise error(f"{where}: not written by this project's trainer (no config)")
    try:
        return build_typed(TrainConfig, {k: v for k, v in tree.items() if k != "distill"},
                           "config")
    except BadInput as err:
        raise error(f"{where}: {err}") from err


def saved_train_config(meta: CheckpointMeta, where: Path, error=CheckpointError):
    """The TrainConfig the checkpoint at ``where`` was saved with."""
    return parse_saved_config(meta.config, Path(where) / META, error)


def inference_model_config(train_cfg, vocab_size: int, tensor: int = 1, pipeline: int = 1,
                           error=CheckpointError):
    """The model config of a training config, rebuilt for inference (no recompute) at
    TP=``tensor``/PP=``pipeline``. Eager: evaluation's varying shapes would recompile a
    compiled pass for every new length."""
    from megatron_iiet.training.config import build_model_config

    par = dataclasses.replace(train_cfg.parallel, tensor=tensor, pipeline=pipeline)
    model = dataclasses.replace(train_cfg.model, recompute_granularity=None,
                                recompute_method=None, recompute_num_layers=None,
                                iteration_checkpointing="none", compile=False)
    try:
        return build_model_config(dataclasses.replace(train_cfg, parallel=par, model=model),
                                  vocab_size)
    except ValueError as err:
        raise error(f"model config at TP={tensor}/PP={pipeline}: {err}") from err


def model_config_from(meta: CheckpointMeta, where: Path, tensor: int = 1, pipeline: int = 1,
                      error=CheckpointError):
    """The model config of the checkpoint at ``where``, rebuilt for inference at
    TP=``tensor``/PP=``pipeline``, refused when it no longer builds the saved architecture."""
    train_cfg = saved_train_config(meta, where, error)
    if meta.vocab_size is None:
        raise error(f"{where / META}: not written by this project's trainer (no architecture)")
    model_cfg = inference_model_config(train_cfg, meta.vocab_size, tensor, pipeline, error)
    diffs = signature_differences(meta.architecture or {}, model_cfg)
    if diffs:
        raise error(f"{where / META}: its config does not rebuild the saved architecture "
                    f"(saved, rebuilt): {diffs}")
    return model_cfg
