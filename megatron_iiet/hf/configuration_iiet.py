"""Hugging Face configuration for IIET models and their baselines.

This file is copied verbatim into every exported checkpoint folder, so it must import nothing but
the standard library, torch, transformers and its sibling modeling_iiet.py (which declares the
architectures). Field names follow LlamaConfig so LLaMA-aware tooling reads the sizes; the
IIET-specific fields are `architecture`, `formulation`, `iterations` and `history_norm_eps`.
"""

from transformers import PretrainedConfig

DEFAULT_ITERATIONS = 3


def _architectures():
    # The architectures are declared once, with their steps, in modeling_iiet.py (its sibling in
    # every export). Imported when asked: modeling_iiet imports this module at its top.
    from .modeling_iiet import ARCHITECTURES

    return ARCHITECTURES


def architecture_key(architecture, formulation):
    """The ARCHITECTURES key: the formulation counts only where an architecture has several."""
    key = f"{architecture}/{formulation}"
    return key if key in _architectures() else architecture


def architecture_names():
    return tuple(dict.fromkeys(key.split("/")[0] for key in _architectures()))


def formulation_names():
    return tuple(dict.fromkeys(key.split("/")[1] for key in _architectures() if "/" in key))


class IIETConfig(PretrainedConfig):
    model_type = "iiet"
    keys_to_ignore_at_inference = ["cache"]

    # An explicit __init__ (rather than dataclass fields) keeps this file loadable by the
    # transformers versions that predate dataclass configs.
    def __init__(
        self,
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=None,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=0.02,
        tie_word_embeddings=True,
        use_cache=True,
        architecture="iiet",
        formulation="history",
        iterations=None,
        history_norm_eps=1e-5,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.initializer_range = initializer_range
        self.tie_word_embeddings = tie_word_embeddings
        self.use_cache = use_cache
        self.architecture = architecture
        self.formulation = formulation
        if iterations is None:
            iterations = [DEFAULT_ITERATIONS] * num_hidden_layers
        elif isinstance(iterations, int):
            iterations = [iterations] * num_hidden_layers
        self.iterations = [int(r) for r in iterations]
        self.history_norm_eps = history_norm_eps
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self._check()
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def _check(self):
        if self.architecture not in architecture_names():
            raise ValueError(f"architecture must be one of {architecture_names()}, got {self.architecture!r}")
        if self.formulation not in formulation_names():
            raise ValueError(f"formulation must be one of {formulation_names()}, got {self.formulation!r}")
        if architecture_key(self.architecture, self.formulation) not in _architectures():
            raise ValueError(f"architecture {self.architecture!r} has no {self.formulation!r} formulation")
        if len(self.iterations) != self.num_hidden_layers:
            raise ValueError(
                f"iterations has {len(self.iterations)} entries, expected one per layer "
                f"(num_hidden_layers={self.num_hidden_layers})"
            )
        if any(r < 0 for r in self.iterations):
            raise ValueError(f"iterations must be >= 0, got {self.iterations}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")

    @property
    def uses_history(self):
        """Whether the model carries the cross-layer history of spec section 3."""
        return _architectures()[architecture_key(self.architecture, self.formulation)].uses_history

    def passes_per_layer(self):
        """Block evaluations of each layer: one KV-cache slot per (layer, pass)."""
        passes = _architectures()[architecture_key(self.architecture, self.formulation)].passes
        return [passes(r) for r in self.iterations]


# save_pretrained copies this file next to the weights and records it in auto_map.
IIETConfig.register_for_auto_class()

__all__ = ["IIETConfig", "architecture_key", "architecture_names", "formulation_names"]
