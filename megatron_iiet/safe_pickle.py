"""Reading the pickles a checkpoint holds without running code hidden in them.

Pickle calls whatever callable a file names, so a crafted file runs code when it is read. torch
refuses that with ``torch.load(weights_only=True)``; three readers inside megatron's
dist-checkpointing do not ask for it: torch.distributed.checkpoint reads ``.metadata`` with plain
``pickle.load``, its default load planner reads "bytes" items of ``*.distcp`` (megatron's
ShardedObjects: the layers' ``_extra_state``) with ``weights_only=False``, and megatron reads
``common.pt`` with torch's default, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns off.

``check_dist_checkpoint`` reads all three first: ``.metadata`` through ``RestrictedUnpickler``
(only the classes torch's checkpoint metadata is made of), the bytes items and ``common.pt`` with
``weights_only=True``. A file that names anything else is refused with one line naming it, before
megatron opens it.
"""

from __future__ import annotations

import io
import pickle
from collections import defaultdict
from pathlib import Path

from megatron_iiet.training.checkpoint_index import CheckpointError

DCP_METADATA = ".metadata"
COMMON = "common.pt"

# What a saved `.metadata` pickles (listed from real checkpoints of both engines, every layout);
# torch's dtypes are allowed by type below.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name, from torch's own table
    "torch": {"Size"},
    "collections": {"OrderedDict"},
}


class RefusedGlobal(pickle.UnpicklingError):
    pass


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only plain data and the classes of torch.distributed.checkpoint's metadata."""

    def find_class(self, module: str, name: str):
        import torch

        if name in _ALLOWED.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise RefusedGlobal(f"{module}.{name}")


def _refusal(path: Path, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{path}: refusing to unpickle it: it names {err}, which no checkpoint holds (a damaged "
        "or planted file); load an earlier checkpoint or one from a trusted source")


def _unreadable(path: Path, err: BaseException) -> CheckpointError:
    first = (str(err).splitlines() or [""])[0][:200]
    return CheckpointError(f"{path}: unreadable ({type(err).__name__}: {first})")


def read_dcp_metadata(directory: str | Path):
    """The torch.distributed.checkpoint ``Metadata`` of the checkpoint in ``directory``."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(directory) / DCP_METADATA
    try:
        with open(path, "rb") as f:
            metadata = RestrictedUnpickler(f).load()
    except RefusedGlobal as err:
        raise _refusal(path, err) from None
    except Exception as err:  # noqa: BLE001  (damaged bytes raise anything; the file is at fault)
        raise _unreadable(path, err) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: not torch.distributed.checkpoint metadata "
                              f"(holds a {type(metadata).__name__})")
    return metadata


def load_data(source, path: Path, what: str = "", allowed: tuple = ()):
    """``torch.load(source, weights_only=True)`` (``allowed``: classes it may build besides
    tensors and plain data); a refused or damaged pickle is a CheckpointError naming ``path``
    (and ``what`` inside it)."""
    import torch

    inside = f" ({what})" if what else ""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" in str(err):
            refused = next((ln.strip() for ln in str(err).splitlines()
                            if "GLOBAL" in ln or "Unsupported" in ln or "got <" in ln), "")
            raise CheckpointError(
                f"{path}{inside}: refusing to unpickle it: it holds more than tensors and plain "
                f"data{' (' + refused[:160] + ')' if refused else ''} (a damaged or planted "
                "file); load an earlier checkpoint or one from a trusted source") from None
        raise _unreadable(path, err) from None
    except (OSError, EOFError, RuntimeError, ValueError) as err:
        raise _unreadable(path, err) from None


def check_dist_checkpoint(directory: str | Path) -> None:
    """Refuse a dist-checkpointing directory whose pickles would run code when megatron reads
    them (see the module's docstring). Reads ``.metadata``, ``common.pt`` and the bytes items:
    small next to the tensors."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    directory = Path(directory)
    if not (directory / DCP_METADATA).is_file():
        return  # not a dist checkpoint: megatron's own "missing" error names it
    metadata = read_dcp_metadata(directory)
    items = defaultdict(list)
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            items[info.relative_path].append((index.fqn, info))
    for name, entries in sorted(items.items()):
        path = directory / name
        try:
            with open(path, "rb") as f:
                for fqn, info in entries:
                    if info.transform_descriptors:
                        raise CheckpointError(f"{path} ({fqn}): stored through stream "
                                              "transforms, which this project never writes")
                    f.seek(info.offset)
                    load_data(io.BytesIO(f.read(info.length)), path, fqn)
        except OSError as err:
            raise _unreadable(path, err) from None
    if (directory / COMMON).is_file():
        load_data(directory / COMMON, directory / COMMON)


# What DeepSpeed's own checkpoint files hold besides tensors and plain data (found by loading
# ZeRO-1/2/3 checkpoints of this project's runs): data classes, no code.
_DEEPSPEED_CLASSES = (("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                      ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
                      ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                      ("deepspeed.utils.tensor_fragment", "fragment_address"))


def check_deepspeed_checkpoint(directory: str | Path) -> None:
    """DeepSpeed reads its own files with ``weights_only=False`` inside its code: read each one
    first with ``weights_only=True`` and only DeepSpeed's data classes allowed, so a planted
    pickle is refused (one line naming the file) before DeepSpeed could run it."""
    import importlib

    allowed = tuple(getattr(importlib.import_module(module), name)
                    for module, name in _DEEPSPEED_CLASSES)
    for path in sorted(Path(directory).rglob("*.pt")):
        load_data(path, path, allowed=allowed)
