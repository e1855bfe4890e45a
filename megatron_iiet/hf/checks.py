"""Checks a conversion runs on its input before writing anything (plain files and tensors only:
no megatron import).

Every refusal is a ConversionError whose one-line message names the file (or tensor) at fault,
so the CLI can print it as is and exit 2. The mapping itself is in mapping.py, the two
directions in megatron_to_hf.py and hf_to_megatron.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Mapping, Optional

import torch

from megatron_iiet.errors import OperatorError
from megatron_iiet.training.checkpoint_index import (LATEST, META, CheckpointError, read_meta,
                                                     resolve_checkpoint)

# dist_checkpointing's own marker file: tells a megatron checkpoint from any other folder.
DIST_CKPT_MARKER = "metadata.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Largest |weight| a conversion passes on by default (--max-abs-weight): trained weights stay
# orders of magnitude below (|w| < 10 in the usual models; norm gains and outlier rows reach a
# few hundred), so a larger value is damage or divergence, and 1e4 still fits bf16 and fp16.
DEFAULT_MAX_ABS_WEIGHT = 1e4
# Written into every output of a conversion; --force replaces only a folder holding it.
EXPORT_MARKER = ".megatron_iiet_export.json"


class ConversionError(OperatorError, ValueError):
    """Bad input for a conversion (named in the message); nothing has been written."""


def dtype_named(option: str, name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConversionError(f"{option}: {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def check_destination(dst: Path, force: bool, sources: Iterable = ()) -> None:
    """Refuse an output that would destroy something: one that is, holds or lies inside a
    source (whatever the flags: replacing it would delete the source, or a run folder around
    it), an existing one without `force`, and, even with `force`, anything but an earlier
    export left as the converter wrote it (its EXPORT_MARKER lists what it wrote) or an empty
    folder. Run before the work starts and again just before the rename."""
    dst = Path(dst)
    target = dst.resolve()
    for src in sources:
        source = Path(src).resolve()
        relation = ("is" if target == source else "contains" if target in source.parents
                    else "lies inside" if source in target.parents else None)
        if relation:
            raise ConversionError(f"{dst}: the output {relation} the source {src}; choose an "
                                  "output outside it (nothing was written)")
    if not dst.exists() and not dst.is_symlink():
        return
    if not force:
        raise ConversionError(f"{dst} exists; pass --force to replace it")
    if not dst.is_dir():
        raise ConversionError(f"{dst}: not a folder, so not an earlier export; --force replaces "
                              "only those (remove it yourself or choose another output)")
    present = {p.name for p in dst.iterdir()}
    if not present:
        return
    marker = dst / EXPORT_MARKER
    try:
        written = json.loads(marker.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConversionError(f"{dst}: not an earlier export of this converter (no readable "
                              f"{EXPORT_MARKER}); --force replaces only those (remove it yourself "
                              "or choose another output)") from None
    # A training run pointed at an imported root adds iter_* folders, an operator adds notes:
    # those are not the converter's to delete.
    added = sorted(present - set(written) - {EXPORT_MARKER})
    if added:
        raise ConversionError(f"{dst}: holds {', '.join(added[:3])}"
                              f"{' ...' if len(added) > 3 else ''} that the export did not write; "
                              "--force replaces only an export as written (move them first)")


def mark_export(folder: Path, kind: str, sources: Iterable = ()) -> None:
    """Record in `folder` that the converter wrote it, and what: check_destination lets --force
    replace such a folder, and nothing else."""
    record = {"written_by": "megatron_iiet conversion", "kind": kind,
              "sources": [str(Path(s).resolve()) for s in sources],
              "files": sorted(p.name for p in Path(folder).iterdir())}
    (Path(folder) / EXPORT_MARKER).write_text(json.dumps(record, indent=2) + "\n")


# ==============================================================================================
# A megatron checkpoint directory (read as the trainer's checkpoint index reads it)
# ==============================================================================================
def find_checkpoint(path) -> Path:
    """The iter_* directory of a checkpoint root (via `latest`) or the iter_* directory itself:
    checkpoint_index.resolve_checkpoint, following `latest` strictly."""
    try:
        return resolve_checkpoint(path, follow_latest=True)
    except CheckpointError as err:
        raise ConversionError(str(err)) from err


def read_checkpoint_meta(ckpt: Path):
    try:
        meta = read_meta(ckpt)
    except CheckpointError as err:  # missing, not JSON, no step: the index names the file
        raise ConversionError(str(err)) from err
    except OSError as err:
        raise ConversionError(f"{ckpt / META}: unreadable ({err.strerror})") from err
    missing = [k for k in ("config", "architecture") if getattr(meta, k) is None]
    if missing:
        raise ConversionError(f"{ckpt / META}: not written by this project's trainer "
                              f"(no {', '.join(missing)})")
    return meta


def check_shards_present(ckpt: Path) -> None:
    """Every file the dist-checkpoint metadata names must exist (a copy may have lost some)."""
    if not (ckpt / DIST_CKPT_MARKER).is_file() or not (ckpt / ".metadata").is_file():
        raise ConversionError(f"{ckpt}: no dist_checkpointing files ({DIST_CKPT_MARKER}, "
                              ".metadata): the model tensors are missing")
    from megatron_iiet.safe_pickle import read_dcp_metadata

    metadata = read_dcp_metadata(ckpt)  # torch's own reader would run code a planted file names
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    missing = [f for f in files if not (ckpt / f).is_file()]
    if missing:
        raise ConversionError(f"{ckpt}: missing checkpoint shards: {', '.join(missing)} "
                              f"(of {len(files)})")


def check_expected_architecture(meta, expected: Optional[str], where: Path) -> None:
    if expected is None:
        return
    actual = meta.signature_value("architecture")
    if expected != actual:
        formulation = meta.signature_value("formulation")
        detail = f" ({formulation} form)" if formulation else ""
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


def _fits(lo: torch.Tensor, hi: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether finite values between `lo` and `hi` stay finite cast to `dtype` (casting is
    monotonic: they do iff the smallest and largest do)."""
    if torch.finfo(dtype).max >= torch.finfo(lo.dtype).max:
        return True
    return bool(torch.isfinite(torch.stack((lo, hi)).to(dtype)).all())


def _largest_finite_magnitude(tensor: torch.Tensor) -> float:
    """max |value| over the finite values (NaN/Inf let through by --allow-nonfinite are the
    finiteness check's business, not the bound's)."""
    finite = tensor[torch.isfinite(tensor)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def refuse_nonfinite(tensors: Mapping[str, torch.Tensor], source, allow: bool,
                     cast_to: Optional[torch.dtype] = None,
                     max_abs: Optional[float] = None) -> None:
    """Refuse NaN/Inf weights (a diverged run, a damaged file) unless `allow`: converting them
    would only hand the problem to whoever loads the output. With `cast_to`, values the cast
    would turn into Inf (beyond fp16's range, say) are refused too. With `max_abs`, finite
    values larger in magnitude are refused whatever `allow` says (3e30 in a weight is damage
    or divergence, and would overflow the first matmul of any dtype). Cheap: a sum and a
    min/max per tensor; counting (for the message) happens only for the bad ones."""
    nonfinite = []  # (tensor name, what is wrong with it), in the source's order
    too_large = []  # (tensor name, largest magnitude)
    for name, tensor in tensors.items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        finite = _all_finite(tensor)
        if not finite:
            if not allow:
                nan = int(torch.isnan(tensor).sum())
                inf = int(torch.isinf(tensor).sum())
                nonfinite.append((name, f"{nan} NaN and {inf} Inf of {tensor.numel()} values"))
            elif max_abs is not None and _largest_finite_magnitude(tensor) > max_abs:
                too_large.append((name, _largest_finite_magnitude(tensor)))
            continue
        if max_abs is None and (allow or cast_to is None):
            continue
        lo, hi = torch.aminmax(tensor)
        if max_abs is not None and max(-float(lo), float(hi)) > max_abs:
            too_large.append((name, max(-float(lo), float(hi))))
        if not allow and cast_to is not None and not _fits(lo, hi, cast_to):
            overflow = int((~torch.isfinite(tensor.to(cast_to))).sum())
            nonfinite.append((name, f"{overflow} of {tensor.numel()} values would become Inf "
                                    f"in {_dtype_name(cast_to)}"))
    if nonfinite:
        first, what = nonfinite[0]
        raise ConversionError(f"{source}: {len(nonfinite)} of {len(tensors)} tensors are not "
                              f"finite (first: {first}, {what}); pass --allow-nonfinite to "
                              "convert them anyway")
    if too_large:
        first, largest = too_large[0]
        raise ConversionError(f"{source}: {len(too_large)} of {len(tensors)} tensors hold values "
                              f"beyond the bound {max_abs:g} (first: {first}, |value| up to "
                              f"{largest:.3g}): damaged or diverged weights; pass "
                              "--max-abs-weight N to convert values up to N")


__all__ = [
    "ConversionError",
    "DEFAULT_MAX_ABS_WEIGHT",
    "DIST_CKPT_MARKER",
    "DTYPES",
    "EXPORT_MARKER",
    "LATEST",
    "META",
    "check_destination",
    "check_expected_architecture",
    "check_shards_present",
    "dtype_named",
    "find_checkpoint",
    "mark_export",
    "read_checkpoint_meta",
    "refuse_nonfinite",
]
