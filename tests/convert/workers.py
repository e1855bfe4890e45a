"""Functions run in spawned processes by the conversion tests (module level: spawn imports them).

`write_checkpoints` writes, for every variant and every layout (TP=1, TP=2, PP=2), a checkpoint
with the trainer's own CheckpointManager and MegatronEngine (so the optimizer state is in it
too), from layout-independent random weights whose vectors (history rows, norms, PCformer's
alpha) are pushed away from their init. `convert_all` exports each to HF and round-trips HF
folders through megatron, all in one process.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from tests.workers import VARIANTS, variant_id

SEED = 1234
TOKENIZER_VOCAB = 500  # pads to 512: the export must handle the padded rows
PADDED_VOCAB = 512
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
# A few variants are untied (separate LM head) or use GQA, so those mappings are exercised too.
UNTIED = {"ode_rk4", "iiet-history-3102"}
GQA = {"vanilla", "iiet-history", "pcformer_rk2"}


def input_ids(batch: int = 2, seq: int = 24) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, TOKENIZER_VOCAB, (batch, seq), generator=g)


def train_config(variant, tokenizer: str, tp: int, pp: int):
    from megatron_iiet.training.config import (DataSection, ModelSection, ParallelSection,
                                               TrainConfig)

    arch, form, its = variant
    vid = variant_id(variant)
    model = ModelSection(preset="tiny", architecture=arch, formulation=form, iterations=its,
                         share_embeddings_and_output_weights=vid not in UNTIED,
                         num_query_groups=2 if vid in GQA else None)
    return TrainConfig(model=model, data=DataSection(tokenizer=tokenizer, seq_length=32),
                       parallel=ParallelSection(tensor=tp, pipeline=pp, micro_batch_size=1,
                                                global_batch_size=2))


@torch.no_grad()
def perturb_vectors(model, seed: int) -> None:
    """Move every vector parameter off its init, by amounts keyed by its full (global) name."""
    from megatron_iiet.model.sharding import full_name

    for name, p in model.named_parameters():
        if p.dim() >= 2:
            continue
        key = f"{seed}:{full_name(model, name)}".encode()
        g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:7], "little"))
        p.add_(0.2 * torch.randn(p.shape, generator=g))


def _switch_layout(tp: int, pp: int) -> None:
    from megatron.core import parallel_state

    from megatron_iiet.distributed import seed_everything

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tp, pp)
    seed_everything(SEED)


def _full_logits(model, ids):
    """[b, s, V] logits of a TP-sharded last stage, gathered over the TP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    logits = model(ids)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def write_checkpoints(root: str, tokenizer: str, fingerprint: str, hf_source: str,
                      hf_to_tp2: str) -> dict:
    """Checkpoint roots at root/<variant>-<layout>, and the HF folder `hf_source` converted to
    a TP=2 checkpoint root `hf_to_tp2`; returns megatron logits (TP=1 and TP=2)."""
    from megatron.core import parallel_state as ps

    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.model.sharding import init_layout_independent
    from megatron_iiet.training.checkpointing import (CheckpointManager, TrainingState,
                                                      architecture_signature)
    from megatron_iiet.training.engines import MegatronEngine
    from megatron_iiet.training.config import build_model_config

    logits = {}
    ids = input_ids()
    for layout, (tp, pp) in LAYOUTS.items():
        _switch_layout(tp, pp)
        for variant in VARIANTS:
            cfg = train_config(variant, tokenizer, tp, pp)
            model = IIETGPTModel(build_model_config(cfg, PADDED_VOCAB))
            init_layout_independent(model, SEED)
            perturb_vectors(model, SEED)
            if pp == 1:  # the megatron model's own logits, before the engine wraps it
                model.eval()
                with torch.no_grad():
                    logits[(variant_id(variant), layout)] = _full_logits(model, ids)
            engine = MegatronEngine(cfg, model)
            manager = CheckpointManager(str(Path(root) / f"{variant_id(variant)}-{layout}"),
                                        keep_last=1)
            manager.save(engine, TrainingState(step=7, consumed_samples=14),
                         {"config": cfg.to_dict(), "tokenizer": tokenizer,
                          "tokenizer_fingerprint": fingerprint,
                          "architecture": architecture_signature(model.config)})
            manager.close()
        if (tp, pp) == (2, 1):  # HF -> megatron by the ranks of this TP=2 job themselves
            from megatron_iiet.hf.convert import import_from_hf

            import_from_hf(hf_source, hf_to_tp2, tp=2)
    return logits if ps.get_data_parallel_rank() == 0 else None


def write_hf_source(folder, tokenizer_model: str) -> None:
    """An HF folder of ours made without megatron: random IIET ([3,1,0,2], untied head),
    every tensor drawn anew, plus the HF tokenizer files of the test tokenizer."""
    from megatron_iiet.data.hf_export import export_hf_tokenizer
    from megatron_iiet.hf import IIETConfig, IIETForCausalLM

    config = IIETConfig(vocab_size=PADDED_VOCAB, hidden_size=64, intermediate_size=176,
                        num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=32,
                        tie_word_embeddings=False, architecture="iiet",
                        iterations=[3, 1, 0, 2], max_iterations=3, bos_token_id=1,
                        eos_token_id=2, pad_token_id=3)
    torch.manual_seed(SEED)
    model = IIETForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.history.weight" or name == "model.history.weight_c":
                # rows 1..L (lower triangle); row 0 is never read and keeps its init, as in any
                # trained model (megatron has no row 0: it comes back as the init).
                p[1:].add_(torch.tril(0.2 * torch.randn(p.shape))[1:])
            elif p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape))
    model.save_pretrained(folder)
    export_hf_tokenizer(tokenizer_model, folder)


def convert_all(root: str, out: str, hf_to_tp2: str) -> dict:
    """Export every checkpoint under root to out/hf/<name>; round-trip each TP=1 export through
    a TP=1 megatron checkpoint (out/meg/<variant>) back to HF (out/back/<variant>); export the
    TP=2 checkpoint `hf_to_tp2` to out/back/hf_to_tp2. Returns the trainer's parameter digest
    of `hf_to_tp2`."""
    from megatron_iiet.hf.convert import (export_to_hf, find_checkpoint, import_from_hf,
                                          load_megatron_checkpoint, read_checkpoint_meta)
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.model.sharding import load_full
    from megatron_iiet.model.sharding import parameters_sha256

    out = Path(out)
    for ckpt in sorted(Path(root).iterdir()):
        export_to_hf(ckpt, out / "hf" / ckpt.name)
    for exported in sorted((out / "hf").glob("*-tp1")):
        vid = exported.name[: -len("-tp1")]
        import_from_hf(exported, out / "meg" / vid)
        export_to_hf(out / "meg" / vid, out / "back" / vid)
    export_to_hf(hf_to_tp2, out / "back" / "hf_to_tp2")
    ckpt = find_checkpoint(hf_to_tp2)
    config, tensors = load_megatron_checkpoint(ckpt, read_checkpoint_meta(ckpt))
    model = IIETGPTModel(config)
    load_full(model, tensors)
    return {"digest": parameters_sha256(model)}
