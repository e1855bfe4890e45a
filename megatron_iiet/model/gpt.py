"""The whole language model of one pipeline stage: embedding, ODE stack, final norm, LM head."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_iiet.errors import BadInput
from megatron_iiet.model.config import IIETTransformerConfig
from megatron_iiet.model.stack import ODEStack


def block_spec(config: IIETTransformerConfig) -> ModuleSpec:
    """The block every pass evaluates: megatron-core's own layer with its local (non-TE) modules.

    Swapping in another ModuleSpec (e.g. Transformer Engine's on GPUs) changes the kernels, not
    the architecture.
    """
    return get_gpt_layer_local_spec(normalization=config.normalization)


class IIETGPTModel(LanguageModule):
    """IIET or one of its baselines, as megatron-core expects a GPT-style model to behave.

    ``forward(input_ids, position_ids, labels)`` returns per-token losses [b, s] when labels are
    given (last stage), logits [b, s, vocab/tp] otherwise, and on earlier pipeline stages the
    packed tensor the next stage receives.
    """

    def __init__(
        self,
        config: IIETTransformerConfig,
        pre_process: Optional[bool] = None,
        post_process: Optional[bool] = None,
        spec: Optional[ModuleSpec] = None,
    ):
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if config.vocab_size % tp != 0:
            raise BadInput(
                f"vocab_size: {config.vocab_size} is not divisible by the tensor-parallel size {tp}"
                " (pad the vocabulary)"
            )
        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage()
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage()
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = config.share_embeddings_and_output_weights
        self.vocab_size = config.vocab_size

        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config,
                vocab_size=config.vocab_size,
                max_sequence_length=config.max_sequence_length,
                position_embedding_type="rope",
            )
        self.rotary_pos_emb = RotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_base=config.rotary_base,
            use_cpu_initialization=config.use_cpu_initialization,
        )
        self.decoder = ODEStack(config, spec or block_spec(config), pre_process, post_process)
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size,
                config.vocab_size,
                config=config,
                init_method=config.init_method,
                bias=False,
                skip_bias_add=False,
                gather_output=False,
                skip_weight_param_allocation=pre_process
                and self.share_embeddings_and_output_weights,
            )
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    # megatron's schedules hand the received tensor to the model through this.
    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def pipeline_tensor_shapes(self, recv_shapes, send_shapes):
        """``adjust_tensor_shapes_fn`` for megatron's 1F1B schedule: history rides along."""
        (s, b, h), = recv_shapes
        return [(s * self.decoder.slices_received, b, h)], [(s * self.decoder.slices_sent, b, h)]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        decoder_input = None
        if self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary = self.rotary_pos_emb(input_ids.shape[1])
        hidden = self.decoder(decoder_input, attention_mask=attention_mask, rotary_pos_emb=rotary)
        if not self.post_process:
            return hidden
        weight = self.shared_embedding_or_output_weight() if (
            self.share_embeddings_and_output_weights) else None
        logits, _ = self.output_layer(hidden, weight=weight)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)
