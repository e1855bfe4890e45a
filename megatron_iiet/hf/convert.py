"""Megatron checkpoints <-> Hugging Face folders (the format of docs/hf.md): one import for the
tools, tests and benchmarks.

    megatron_to_hf.py   export_to_hf: a trainer checkpoint of any TP/PP -> an HF folder
    hf_to_megatron.py   import_from_hf: an HF folder (ours or the release's) -> a model-only
                        megatron checkpoint at a chosen TP/PP
    mapping.py          the tensor and config-field names of both layouts
    megatron_model.py   the megatron model of a conversion, in one process or rank by rank
    checks.py           what is refused before anything is written (ConversionError)
"""

from .checks import ConversionError, find_checkpoint, read_checkpoint_meta
from .hf_to_megatron import ImportSummary, import_from_hf
from .mapping import hf_config_for, hf_to_megatron_tensors, megatron_to_hf_tensors
from .megatron_model import load_megatron_checkpoint
from .megatron_to_hf import ExportSummary, export_to_hf

__all__ = [
    "ConversionError",
    "ExportSummary",
    "ImportSummary",
    "export_to_hf",
    "find_checkpoint",
    "hf_config_for",
    "hf_to_megatron_tensors",
    "import_from_hf",
    "load_megatron_checkpoint",
    "megatron_to_hf_tensors",
    "read_checkpoint_meta",
]
