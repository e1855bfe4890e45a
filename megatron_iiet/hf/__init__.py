"""Hugging Face side of megatron_iiet: config, model, KV cache, release import.

Importing this package registers model_type "iiet" with AutoConfig / AutoModel /
AutoModelForCausalLM, so an
environment with megatron_iiet installed loads exported folders without trust_remote_code. The
exported folders also carry configuration_iiet.py / modeling_iiet.py themselves (auto_map), so
any transformers install loads them with trust_remote_code=True.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_iiet import IIETConfig, architecture_names, formulation_names
from .modeling_iiet import IIETCache, IIETForCausalLM, IIETModel

AutoConfig.register(IIETConfig.model_type, IIETConfig, exist_ok=True)
AutoModel.register(IIETConfig, IIETModel, exist_ok=True)
AutoModelForCausalLM.register(IIETConfig, IIETForCausalLM, exist_ok=True)

__all__ = ["IIETCache", "IIETConfig", "IIETForCausalLM", "IIETModel", "architecture_names",
           "formulation_names"]
