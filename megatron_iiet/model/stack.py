"""A pipeline stage's share of the decoder: ODE layers over megatron-core blocks.

Each ``ODELayer`` wraps one megatron ``TransformerLayer`` (the block, built from a ModuleSpec, so
tensor parallelism is megatron's own) and runs it the way its architecture says. The stack
carries the layer input and the cross-layer history from layer to layer and across stage
boundaries, and applies megatron-style layer-level recompute (``recompute_granularity='full'``).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import sharded_state_dict_default
from torch import nn

from megatron_iiet.model.architectures import Architecture, StepInputs, get_architecture
from megatron_iiet.model.config import IIETTransformerConfig
from megatron_iiet.model.history import History, slices_crossing_boundary
from megatron_iiet.model.ode_step import (KEEP_TAIL_MODE, PassRunner, checkpoint_with_rng_replay,
                                          checkpointed_passes)


class ODELayer(MegatronModule):
    """One decoder layer: a block (weights shared by all its passes) plus the parameters its
    architecture declares (``architecture.layer_parameters``, each an attribute by its name)."""

    def __init__(
        self,
        config: IIETTransformerConfig,
        block_spec: ModuleSpec,
        layer_number: int,
        architecture: Architecture,
    ):
        super().__init__(config=config)
        self.layer_number = layer_number  # 1-based, global
        self.architecture = architecture
        self.iterations = config.layer_iterations[layer_number - 1]
        self.block = build_module(block_spec, config=config, layer_number=layer_number)
        for part in architecture.layer_parameters:
            self.add_module(part.name, build_module(part.spec(), config=config,
                                                    layer_number=layer_number))

    @property
    def passes(self) -> int:
        return self.architecture.passes(self.iterations)

    def forward(
        self,
        x: torch.Tensor,
        history: Optional[History],
        shared: Optional[nn.Module],
        block_kwargs: dict,
        checkpoint_passes: bool = True,
    ) -> torch.Tensor:
        mode = self.config.iteration_checkpointing if checkpoint_passes else "none"
        run = PassRunner(self.block, block_kwargs, checkpointed_passes(mode, self.passes),
                         compiled=self.config.compile, keep_tail=mode == KEEP_TAIL_MODE)
        out = self.architecture.step(
            StepInputs(x=x, history=history.layer(self.history) if history else None, run=run,
                       layer=self, shared=shared, iterations=self.iterations)
        )
        run.finish()
        return out


class ODEStack(MegatronModule):
    """The decoder layers of one pipeline stage (and the final norm on the last one)."""

    def __init__(
        self,
        config: IIETTransformerConfig,
        block_spec: ModuleSpec,
        pre_process: bool,
        post_process: bool,
    ):
        super().__init__(config=config)
        self.pre_process = pre_process
        self.post_process = post_process
        self.architecture = get_architecture(config.architecture, config.formulation)
        self.layer_offset = get_transformer_layer_offset(config)
        num_layers = get_num_layers_to_build(config)
        self.layers = nn.ModuleList(
            ODELayer(config, block_spec, self.layer_offset + i + 1, self.architecture)
            for i in range(num_layers)
        )
        self.shared = None  # the architecture's model-wide parameters (PCformer's alpha, norms)
        if self.architecture.shared_parameters is not None:
            self.shared = build_module(self.architecture.shared_parameters.spec(), config=config)
            # Every pipeline stage holds a copy: their gradients are summed over the pipeline
            # group (``pipeline_shared`` marks them for ``finalize_model_grads``).
            for p in self.shared.parameters():
                p.pipeline_shared = True
        self.final_norm = None
        if post_process:
            self.final_norm = build_module(
                block_spec.submodules.input_layernorm,
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )
        self.input_tensor: Optional[torch.Tensor] = None

    # ---- pipeline boundary -----------------------------------------------------------------
    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        self.input_tensor = input_tensor

    @property
    def slices_received(self) -> int:
        return slices_crossing_boundary(self.layer_offset + 1, self.architecture.uses_history)

    @property
    def slices_sent(self) -> int:
        return slices_crossing_boundary(
            self.layer_offset + len(self.layers) + 1, self.architecture.uses_history
        )

    # ---- layer-level recompute (megatron's recompute_granularity='full') -------------------
    def _layers_recomputed_whole(self) -> list[list[int]]:
        """Groups of local layer indices each recomputed as one unit."""
        cfg = self.config
        if cfg.recompute_granularity != "full":
            return []
        n = len(self.layers)
        if cfg.recompute_method == "uniform":
            k = cfg.recompute_num_layers
            return [list(range(i, min(i + k, n))) for i in range(0, n, k)]
        return [[i] for i in range(min(cfg.recompute_num_layers, n))]

    def _run_layers(self, indices, x, history, block_kwargs, checkpoint_passes):
        for i in indices:
            x = self.layers[i](x, history, self.shared, block_kwargs, checkpoint_passes)
        return x

    def forward(
        self,
        hidden_states: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        history = None
        x = hidden_states if self.pre_process else self.input_tensor
        if self.architecture.uses_history:
            if self.pre_process:
                history = History.start(x, self.slices_sent)
            else:
                x, history = History.receive(x, x.shape[0] // self.slices_received,
                                             self.slices_sent)
        block_kwargs = {"attention_mask": attention_mask, "rotary_pos_emb": rotary_pos_emb}

        whole = {i: group for group in self._layers_recomputed_whole() for i in group[:1]}
        covered = {i for group in whole.values() for i in group}
        i = 0
        while i < len(self.layers):
            if i in whole and torch.is_grad_enabled():
                group = whole[i]

                def run_group(x_, token, group=group):
                    # The token is the history's state before the group: recomputing the
                    # group in backward re-reads the buffer from there (see history.py).
                    if history is not None:
                        history.token = token
                    out = self._run_layers(group, x_, history, block_kwargs, False)
                    return out, history.token if history is not None else token

                token = history.token if history is not None else None
                x, token = checkpoint_with_rng_replay(run_group, x, token)
                if history is not None:
                    history.token = token
                i = group[-1] + 1
            else:
                x = self._run_layers([i], x, history, block_kwargs, i not in covered)
                i += 1

        if self.post_process:
            return self.final_norm(x)
        return history.send(x) if history is not None else x

    # ---- distributed checkpointing ---------------------------------------------------------
    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> ShardedStateDict:
        """Layers keyed by their global index, so any PP layout reads any other's checkpoint.

        Layers are not homogeneous (history rows grow with depth), hence one key per layer
        rather than a stacked PP-sharded tensor.
        """
        assert not sharded_offsets, "unexpected sharded offsets"
        out: ShardedStateDict = {}
        for i, layer in enumerate(self.layers):
            local, global_ = f"{prefix}layers.{i}.", f"{prefix}layers.{layer.layer_number - 1}."
            layer_sd = layer.sharded_state_dict(local, (), metadata)
            replace_prefix_for_sharding(layer_sd, local, global_)
            out.update(layer_sd)
        for name, module in self.named_children():
            if module is self.layers:
                continue
            # The TP group must be explicit: megatron-core 0.16 otherwise gives every TP rank
            # replica id 0 (all "main" copies) once metadata carries the DP group.
            module_sd = sharded_state_dict_default(
                module, f"{prefix}{name}.", (), metadata,
                tp_group=parallel_state.get_tensor_model_parallel_group())
            if module is self.shared:
                _mark_pipeline_replicas(module_sd)
            out.update(module_sd)
        return out


def _mark_pipeline_replicas(sharded_sd: ShardedStateDict) -> None:
    """Parameters every stage holds: only stage 0's copy is the main replica."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    for value in sharded_sd.values():
        if isinstance(value, ShardedTensor):
            replica = value.replica_id if isinstance(value.replica_id, tuple) else (value.replica_id,)
            value.replica_id = (pp_rank, *replica)
