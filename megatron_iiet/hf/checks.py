"""Checks a conversion runs on its input before writing anything (plain files and tensors only:
no megatron import).

Every refusal is a ConversionError whose one-line message names the file (or tensor) at fault,
so the CLI can print it as is and exit 2. Kept apart from convert.py, which does the mapping.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional

import torch

LATEST = "latest"
META = "meta.json"
# dist_checkpointing's own marker file: tells a megatron checkpoint from any other folder.
DIST_CKPT_MARKER = "metadata.json"


class ConversionError(ValueError):
    """Bad input for a conversion (named in the message); nothing has been written."""


# ==============================================================================================
# A megatron checkpoint directory
# ==============================================================================================
def _shown(text: str, limit: int = 40) -> str:
    """`text` quoted on one line (repr escapes control characters), cut to `limit` chars."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def read_latest_pointer(pointer: Path) -> str:
    """The directory name a `latest` file holds. The trainer writes one bare iter_* name; a
    garbled file (binary, several lines, a path leading out of the root) is refused by name
    rather than followed somewhere unexpected."""
    try:
        raw = pointer.read_bytes()
    except OSError as err:
        raise ConversionError(f"{pointer}: unreadable ({err.strerror})") from err
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        found = f"{len(raw)} bytes of binary data"
    else:
        if name and name.isprintable() and name not in (".", "..") and Path(name).name == name:
            return name
        found = "an empty file" if not name else _shown(name)
    raise ConversionError(f"{pointer}: not a checkpoint pointer (expected the name of an iter_* "
                          f"directory next to it, found {found})")


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
    path = ckpt / META
    try:
        meta = json.loads(path.read_bytes())  # bytes: a binary file is a decode error, below
    except OSError as err:
        raise ConversionError(f"{path}: unreadable ({err.strerror})") from err
    except UnicodeDecodeError as err:
        raise ConversionError(f"{path}: not valid JSON (binary data: {err.reason} at byte "
                              f"{err.start})") from err
    except json.JSONDecodeError as err:  # a truncated file ends up here too
        raise ConversionError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(meta, dict):
        raise ConversionError(f"{path}: not written by this project's trainer (a JSON "
                              f"{type(meta).__name__}, not an object)")
    missing = [k for k in ("config", "architecture") if not isinstance(meta.get(k), dict)]
    if missing:
        raise ConversionError(f"{path}: not written by this project's trainer "
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
    "LATEST",
    "META",
    "check_expected_architecture",
    "check_shards_present",
    "find_checkpoint",
    "read_checkpoint_meta",
    "read_latest_pointer",
    "refuse_nonfinite",
]
