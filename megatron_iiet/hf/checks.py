"""Checks a conversion runs on its input before writing anything (plain files and tensors only:
no megatron import).

Every refusal is a ConversionError whose one-line message names the file (or tensor) at fault,
so the CLI can print it as is and exit 2. The mapping itself is in mapping.py, the two
directions in megatron_to_hf.py and hf_to_megatron.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional

import torch

from megatron_iiet.errors import OperatorError
from megatron_iiet.training.checkpoint_index import (LATEST, META, CheckpointError,
                                                     checkpoint_name_in, describe_contents,
                                                     read_meta)

# dist_checkpointing's own marker file: tells a megatron checkpoint from any other folder.
DIST_CKPT_MARKER = "metadata.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ConversionError(OperatorError, ValueError):
    """Bad input for a conversion (named in the message); nothing has been written."""


def dtype_named(option: str, name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConversionError(f"{option}: {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def check_destination(dst: Path, force: bool) -> None:
    if dst.exists() and not force:
        raise ConversionError(f"{dst} exists; pass --force to replace it")


# ==============================================================================================
# A megatron checkpoint directory (read as the trainer's checkpoint index reads it)
# ==============================================================================================
def read_latest_pointer(pointer: Path) -> str:
    """The directory name a `latest` file holds. The trainer writes one bare iter_* name; a
    garbled file (binary, several lines, a path leading out of the root) is refused by name
    rather than followed somewhere unexpected (a resume would fall back to the newest complete
    checkpoint instead; a conversion of "the latest" must not guess)."""
    try:
        raw = pointer.read_bytes()
    except OSError as err:
        raise ConversionError(f"{pointer}: unreadable ({err.strerror})") from err
    name = checkpoint_name_in(raw)
    if name is None:
        raise ConversionError(f"{pointer}: not a checkpoint pointer (expected the name of an "
                              f"iter_* directory next to it, found {describe_contents(raw)})")
    return name


def find_checkpoint(path) -> Path:
    """The iter_* directory of a checkpoint root (via `latest`) or the iter_* directory itself."""
    p = Path(path)
    if not p.exists():
        raise ConversionError(f"{p}: does not exist")
    if not p.is_dir():
        raise ConversionError(f"{p}: not a directory (expected a megatron checkpoint directory)")
    if (p / META).is_file():
        return p
    pointer = p / LATEST
    if pointer.is_file():
        target = p / read_latest_pointer(pointer)
        if not (target / META).is_file():
            raise ConversionError(f"{pointer}: points to {target}, which is not a complete checkpoint")
        return target
    raise ConversionError(
        f"{p}: not a megatron checkpoint (no {META}, no {LATEST} pointer); pass a checkpoint root "
        f"or one of its iter_* directories")


def read_checkpoint_meta(ckpt: Path) -> dict:
    try:
        meta = read_meta(ckpt)
    except CheckpointError as err:  # missing, not JSON, no step: the index names the file
        raise ConversionError(str(err)) from err
    except OSError as err:
        raise ConversionError(f"{ckpt / META}: unreadable ({err.strerror})") from err
    missing = [k for k in ("config", "architecture") if not isinstance(meta.get(k), dict)]
    if missing:
        raise ConversionError(f"{ckpt / META}: not written by this project's trainer "
                              f"(no {', '.join(missing)})")
    return meta


def check_shards_present(ckpt: Path) -> None:
    """Every file the dist-checkpoint metadata names must exist (a copy may have lost some)."""
    if not (ckpt / DIST_CKPT_MARKER).is_file() or not (ckpt / ".metadata").is_file():
        raise ConversionError(f"{ckpt}: no dist_checkpointing files ({DIST_CKPT_MARKER}, "
                              ".metadata): the model tensors are missing")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(ckpt)).read_metadata()
    except Exception as err:  # a truncated or foreign .metadata
        raise ConversionError(f"{ckpt / '.metadata'}: unreadable ({err})") from err
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    missing = [f for f in files if not (ckpt / f).is_file()]
    if missing:
        raise ConversionError(f"{ckpt}: missing checkpoint shards: {', '.join(missing)} "
                              f"(of {len(files)})")


def check_expected_architecture(meta: dict, expected: Optional[str], where: Path) -> None:
    if expected is None:
        return
    sig = meta["architecture"]
    actual = sig.get("architecture")
    if expected != actual:
        detail = f" ({sig['formulation']} form)" if sig.get("formulation") else ""
        raise ConversionError(f"{where}: holds a {actual}{detail} model, expected {expected}")


# ==============================================================================================
# Tensor values
# ==============================================================================================
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _all_finite(tensor: torch.Tensor) -> bool:
    # A sum is NaN/Inf whenever one element is (IEEE arithmetic), and one sum costs a tenth of
    # isfinite().all() on large tensors; only a sum that overflowed from finite values needs the
    # exact check. Half types are summed in fp32 so that overflow stays rare.
    total = tensor.sum(dtype=torch.float32 if tensor.element_size() < 4 else tensor.dtype)
    return bool(torch.isfinite(total)) or bool(torch.isfinite(tensor).all())


def _fits(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether finite `tensor` stays finite cast to `dtype` (casting is monotonic: it does iff
    its smallest and largest values do)."""
    if torch.finfo(dtype).max >= torch.finfo(tensor.dtype).max or tensor.numel() == 0:
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(tensor)).to(dtype)).all())


def refuse_nonfinite(tensors: Mapping[str, torch.Tensor], source, allow: bool,
                     cast_to: Optional[torch.dtype] = None) -> None:
    """Refuse NaN/Inf weights (a diverged run, a damaged file) unless `allow`: converting them
    would only hand the problem to whoever loads the output. With `cast_to`, values the cast
    would turn into Inf (beyond fp16's range, say) are refused too. Cheap: one or two
    reductions per tensor; counting (for the message) happens only for the bad ones."""
    if allow:
        return
    bad = []  # (tensor name, what is wrong with it), in the source's order
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        if not _all_finite(tensor):
            nan = int(torch.isnan(tensor).sum())
            inf = int(torch.isinf(tensor).sum())
            bad.append((name, f"{nan} NaN and {inf} Inf of {tensor.numel()} values"))
        elif cast_to is not None and not _fits(tensor, cast_to):
            overflow = int((~torch.isfinite(tensor.to(cast_to))).sum())
            bad.append((name, f"{overflow} of {tensor.numel()} values would become Inf in "
                              f"{_dtype_name(cast_to)}"))
    if bad:
        first, what = bad[0]
        raise ConversionError(f"{source}: {len(bad)} of {len(tensors)} tensors are not finite "
                              f"(first: {first}, {what}); pass --allow-nonfinite to convert them "
                              "anyway")


__all__ = [
    "ConversionError",
    "DIST_CKPT_MARKER",
    "DTYPES",
    "LATEST",
    "META",
    "check_destination",
    "check_expected_architecture",
    "check_shards_present",
    "dtype_named",
    "find_checkpoint",
    "read_checkpoint_meta",
    "read_latest_pointer",
    "refuse_nonfinite",
]
