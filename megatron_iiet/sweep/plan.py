"""A scaling-law sweep: the YAML (architectures x sizes x token budgets, shape rules, batch, an LR
grid per architecture or fixed values, seeds) expanded into concrete runs, each with its
parameters, FLOPs per token counting every pass (model/flops.py), tokens, total FLOPs and
estimated time. Everything wrong with the sweep (an unknown architecture or key, a size whose
head count does not divide, a run config the trainer would refuse) is found here, before
anything runs.

Learning rates: ``lr.grid`` gives each architecture a grid tried at one size (``lr.grid_size``,
default the smallest). The other sizes use the grid's best value (lowest final validation loss,
mean over seeds) carried by ``lr.carry``: ``constant`` (the same value) or ``inverse_width``
(scaled by grid width / width, the muP-style rule for hidden layers under Adam). Those runs
are phase 2: their LR is known once the grid runs are collected. ``lr.values`` fixes an
architecture's LR instead (no grid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass
class SizeSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: Optional[int] = None
    """Default: hidden_size / shape_rules.head_dim."""
    ffn_hidden_size: Optional[int] = None
    """Default: hidden_size x shape_rules.ffn_ratio, rounded up to shape_rules.ffn_multiple."""
    tokens: Optional[list[float]] = None
    """This size's token budgets (default: the sweep's `tokens`)."""
    set: dict[str, Any] = field(default_factory=dict)
    """Overrides for this size's runs (e.g. untied embeddings, TP/PP at the large sizes)."""


@dataclass
class ShapeRules:
    head_dim: int = 64
    ffn_ratio: float = 8 / 3
    ffn_multiple: int = 16


@dataclass
class BatchSpec:
    global_batch_size: int = 16
    micro_batch_size: int = 8
    seq_length: Optional[int] = None
    """Default: the base config's data.seq_length."""


@dataclass
class LRSpec:
    grid: dict[str, list[float]] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    grid_size: Optional[str] = None
    carry: str = "constant"
    """constant | inverse_width"""
    min_lr_ratio: float = 0.1


@dataclass
class NoiseSpec:
    """Extra seeds at one size (every architecture, the carried LR), to measure seed noise."""

    size: Optional[str] = None
    seeds: list[int] = field(default_factory=list)


@dataclass
class SweepSpec:
    name: str
    base: str
    """A pretrain_iiet.py config every run starts from (relative to the sweep file or cwd)."""
    output: str
    architectures: list[str]
    sizes: list[SizeSpec]
    tokens: list[float]
    """Token budgets: every (architecture, size) trains on each; equal across architectures."""
    batch: BatchSpec = field(default_factory=BatchSpec)
    set: dict[str, Any] = field(default_factory=dict)
    """Dotted overrides for every run (as pretrain_iiet.py --set)."""
    arch_set: dict[str, dict[str, Any]] = field(default_factory=dict)
    shape_rules: ShapeRules = field(default_factory=ShapeRules)
    lr: LRSpec = field(default_factory=LRSpec)
    warmup_fraction: float = 0.05
    seeds: list[int] = field(default_factory=lambda: [1234])
    noise: NoiseSpec = field(default_factory=NoiseSpec)
    vocab_size: Optional[int] = None
    """The tokenizer's vocabulary, for planning where the tokenizer is not on this machine
    (default: read from data.tokenizer)."""
    flops_per_second: Optional[float] = None
    """Sustained training FLOP/s per run for the time estimate (default: measured here)."""
    committed: Optional[str] = None
    """A results.json of this sweep kept in the repository (relative to the sweep file): a run
    it lists as finished counts as finished where its own folder is gone (a later session on
    another machine continues the sweep instead of rerunning it)."""


@dataclass
class RunPlan:
    name: str
    architecture: str
    size: str
    tokens: int
    seed: int
    phase: int
    """1: its LR is known; 2: it waits for the grid's best LR."""
    lr: Optional[float]
    lr_factor: float
    """Phase 2: lr = best grid LR of the architecture x lr_factor."""
    grid: bool
    overrides: dict[str, Any]
    params: int
    non_embedding_params: int
    flops_per_token: float
    """Training FLOPs (forward + backward) per token, every pass counted."""
    total_flops: float
    train_steps: int
    estimated_seconds: Optional[float]

    def lr_text(self) -> str:
        if self.lr is not None:
            return f"{self.lr:.3g}"
        return f"best({self.architecture}) x {self.lr_factor:.3g}"


@dataclass
class SweepPlan:
    spec: SweepSpec
    base_path: Path
    runs: list[RunPlan]
    committed: dict[str, dict] = field(default_factory=dict)
    """Finished runs of ``spec.committed`` by name."""

    def run(self, name: str) -> RunPlan:
        return next(r for r in self.runs if r.name == name)


def load_sweep(path: str | Path) -> SweepSpec:
    from megatron_iiet.model.architectures import architecture_names
    from megatron_iiet.training.config import build_typed, read_yaml_mapping

    spec = build_typed(SweepSpec, read_yaml_mapping(str(path), "sweep"), "")
    known = architecture_names()
    for i, arch in enumerate(spec.architectures):
        if arch not in known:
            raise ValueError(f"architectures[{i}]: unknown {arch!r} (known: {', '.join(known)})")
    for where, names in (("arch_set", spec.arch_set), ("lr.grid", spec.lr.grid),
                         ("lr.values", spec.lr.values)):
        for arch in names:
            if arch not in spec.architectures:
                raise ValueError(f"{where}.{arch}: not one of the sweep's architectures "
                                 f"({', '.join(spec.architectures)})")
    for arch in spec.architectures:
        if (arch in spec.lr.grid) == (arch in spec.lr.values):
            raise ValueError(f"lr: give {arch} either a grid (lr.grid.{arch}) or a value "
                             f"(lr.values.{arch})")
        if arch in spec.lr.grid and not spec.lr.grid[arch]:
            raise ValueError(f"lr.grid.{arch}: empty")
    if spec.lr.carry not in ("constant", "inverse_width"):
        raise ValueError(f"lr.carry: unknown {spec.lr.carry!r} (constant | inverse_width)")
    names = [s.name for s in spec.sizes]
    if not names:
        raise ValueError("sizes: at least one size")
    if len(set(names)) != len(names):
        raise ValueError(f"sizes: names repeat ({names})")
    for where, size in (("lr.grid_size", spec.lr.grid_size), ("noise.size", spec.noise.size)):
        if size is not None and size not in names:
            raise ValueError(f"{where}: {size!r} is not a size ({', '.join(names)})")
    if not spec.tokens or any(t <= 0 for t in spec.tokens):
        raise ValueError("tokens: one or more positive token budgets")
    return spec


def _shape(size: SizeSpec, rules: ShapeRules, where: str) -> dict[str, int]:
    heads = size.num_attention_heads
    if heads is None:
        if size.hidden_size % rules.head_dim:
            raise ValueError(f"{where}: hidden_size {size.hidden_size} is not divisible by "
                             f"shape_rules.head_dim {rules.head_dim}")
        heads = size.hidden_size // rules.head_dim
    if size.hidden_size % heads:
        raise ValueError(f"{where}: hidden_size {size.hidden_size} is not divisible by "
                         f"{heads} attention heads")
    ffn = size.ffn_hidden_size or rules.ffn_multiple * math.ceil(
        size.hidden_size * rules.ffn_ratio / rules.ffn_multiple)
    return {"model.num_layers": size.num_layers, "model.hidden_size": size.hidden_size,
            "model.num_attention_heads": heads, "model.ffn_hidden_size": ffn}


def resolve_base(spec: SweepSpec, sweep_path: str | Path) -> Path:
    for candidate in (Path(sweep_path).parent / spec.base, Path(spec.base)):
        if candidate.is_file():
            return candidate
    raise ValueError(f"base: {spec.base} not found (relative to {Path(sweep_path).parent} or "
                     "the current directory)")


def as_sets(values: dict[str, Any]) -> list[str]:
    """Dotted overrides as pretrain_iiet.py --set texts (JSON is YAML: numbers, lists, maps)."""
    import json

    return [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in values.items()]


def run_overrides(run: RunPlan, lr: float, min_lr_ratio: float) -> list[str]:
    """The run's --set list for pretrain_iiet.py, at learning rate ``lr``."""
    return as_sets({**run.overrides, "optimizer.lr": lr, "optimizer.min_lr": lr * min_lr_ratio})


def _counts(train_cfg, vocab: int) -> tuple[int, int, float]:
    """(parameters, non-embedding parameters, training FLOPs per token) of a run config,
    from the model built on the meta device (no memory) and model/flops.py."""
    import torch

    from megatron_iiet.model.flops import step_flops
    from megatron_iiet.model.gpt import IIETGPTModel
    from megatron_iiet.training.config import build_model_config, padded_vocab_size

    model_cfg = build_model_config(train_cfg, padded_vocab_size(vocab))
    model_cfg.use_cpu_initialization, model_cfg.perform_initialization = True, False
    with torch.device("meta"):
        model = IIETGPTModel(model_cfg)
    total = embedding = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if "word_embeddings" in name or name.startswith("output_layer"):
            embedding += p.numel()
    seq = train_cfg.data.seq_length
    per_token = step_flops(model_cfg, 1, seq).model / seq
    return total, total - embedding, per_token


def _tokenizer_vocab(train_cfg) -> int:
    if train_cfg.data.tokenizer is None:
        return train_cfg.data.builtin_vocab_size
    from megatron_iiet.data.tokenizer import Tokenizer

    try:
        return Tokenizer.from_path(train_cfg.data.tokenizer).vocab_size
    except (OSError, ValueError) as err:
        raise ValueError(f"data.tokenizer: {err}") from None


def plan_sweep(sweep_path: str | Path, flops_per_second: Optional[float] = None) -> SweepPlan:
    """Every run of the sweep, checked (model config, trainer config) and counted."""
    from megatron_iiet.hf.megatron_model import one_process_group
    from megatron_iiet.training.config import load_config

    spec = load_sweep(sweep_path)
    base = resolve_base(spec, sweep_path)
    grid_size = spec.lr.grid_size or spec.sizes[0].name
    grid_width = next(s.hidden_size for s in spec.sizes if s.name == grid_size)
    rate = flops_per_second or spec.flops_per_second
    runs: list[RunPlan] = []
    try:
        vocab = spec.vocab_size or _tokenizer_vocab(load_config(str(base), as_sets(spec.set),
                                                                here=False))
    except ValueError as err:
        raise ValueError(f"base + set: {err}") from None
    with one_process_group():
        for arch in spec.architectures:
            for i, size in enumerate(spec.sizes):
                shape = _shape(size, spec.shape_rules, f"sizes[{i}] ({size.name})")
                seeds = list(spec.seeds)
                if spec.noise.size == size.name:
                    seeds += [s for s in spec.noise.seeds if s not in seeds]
                for tokens in size.tokens or spec.tokens:
                    lrs: list[tuple[Optional[float], float, bool]]
                    if arch in spec.lr.values:
                        lrs = [(spec.lr.values[arch], 1.0, False)]
                    elif size.name == grid_size:
                        lrs = [(lr, 1.0, True) for lr in spec.lr.grid[arch]]
                        if len(seeds) > len(spec.seeds):  # noise seeds here run at the grid's best
                            lrs.append((None, 1.0, False))
                    else:
                        factor = (grid_width / size.hidden_size
                                  if spec.lr.carry == "inverse_width" else 1.0)
                        lrs = [(None, factor, False)]
                    for lr, factor, grid in lrs:
                        if grid:
                            run_seeds = spec.seeds
                        elif lr is None and size.name == grid_size:
                            run_seeds = seeds[len(spec.seeds):]  # the grid ran the sweep's seeds
                        else:
                            run_seeds = seeds
                        for seed in run_seeds:
                            runs.append(_run(spec, base, arch, size, shape, tokens, lr, factor,
                                             grid, seed, rate, vocab))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError("sweep: two runs share a name (repeated sizes or budgets?)")
    return SweepPlan(spec, base, runs, _committed(spec, sweep_path))


def _committed(spec: SweepSpec, sweep_path: str | Path) -> dict[str, dict]:
    import json

    if spec.committed is None:
        return {}
    path = Path(sweep_path).parent / spec.committed
    if not path.is_file():
        return {}  # nothing committed yet
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"committed: {path}: not JSON ({err})") from None
    return {r["name"]: r for r in rows if r.get("status") == "finished"}


RUN_OVERHEAD_S = 20.0
"""What a small run costs besides its steps (start-up, data indices, validation, checkpoints):
about 20 s measured on the 2-core machine; `plan --measure` measures it and the step pace."""


def tokens_tag(tokens: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:g}{unit}"
    return f"{tokens:g}"


def _run(spec, base, arch, size, shape, tokens, lr, factor, grid, seed, rate, vocab) -> RunPlan:
    from megatron_iiet.training.config import load_config

    overrides: dict[str, Any] = dict(spec.set)
    overrides.update(spec.arch_set.get(arch, {}))
    overrides.update(shape)
    overrides.update(size.set)
    overrides["model.architecture"] = arch
    overrides["seed"] = seed
    overrides["parallel.global_batch_size"] = spec.batch.global_batch_size
    overrides["parallel.micro_batch_size"] = spec.batch.micro_batch_size
    if spec.batch.seq_length is not None:
        overrides["data.seq_length"] = spec.batch.seq_length
    lr_tag = f"lr{lr:g}" if lr is not None else "lrbest"
    name = f"{arch}_{size.name}_{tokens_tag(tokens)}_{lr_tag}_s{seed}"
    where = f"run {name}"
    seq = (spec.batch.seq_length
           or load_config(str(base), as_sets(spec.set), here=False).data.seq_length)
    per_step = spec.batch.global_batch_size * seq
    steps = max(1, round(tokens / per_step))
    overrides["schedule.train_steps"] = steps
    overrides["schedule.warmup_steps"] = min(steps - 1, max(1, round(spec.warmup_fraction * steps)))
    overrides["logging.dir"] = str(Path(spec.output) / "runs" / name)
    overrides["checkpoint.load"] = "auto"
    overrides["checkpoint.dir"] = None  # each run its own
    try:
        cfg = load_config(str(base), as_sets(overrides), here=False)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    try:
        params, non_embedding, per_token = _counts(cfg, vocab)
    except (ValueError, AssertionError) as err:
        raise ValueError(f"{where}: model: {err}") from None
    actual = steps * per_step
    total = per_token * actual
    return RunPlan(name=name, architecture=arch, size=size.name, tokens=actual, seed=seed,
                   phase=1 if lr is not None else 2, lr=lr, lr_factor=factor, grid=grid,
                   overrides=overrides, params=params, non_embedding_params=non_embedding,
                   flops_per_token=per_token, total_flops=total, train_steps=steps,
                   estimated_seconds=total / rate + RUN_OVERHEAD_S if rate else None)


def plan_table(plan: SweepPlan) -> str:
    lines = ["| run | phase | params | non-emb params | tokens | steps | lr | FLOPs/token | "
             "total FLOPs | est. time |", "|---|---|---|---|---|---|---|---|---|---|"]
    total_s = 0.0
    for r in plan.runs:
        est = "-" if r.estimated_seconds is None else duration_text(r.estimated_seconds)
        total_s += r.estimated_seconds or 0.0
        lines.append(f"| {r.name} | {r.phase} | {r.params / 1e6:.2f}M | "
                     f"{r.non_embedding_params / 1e6:.3f}M | {tokens_tag(r.tokens)} | "
                     f"{r.train_steps} | {r.lr_text()} | {r.flops_per_token:.3g} | "
                     f"{r.total_flops:.3g} | {est} |")
    total_flops = sum(r.total_flops for r in plan.runs)
    lines.append("")
    lines.append(f"{len(plan.runs)} runs, {total_flops:.3g} FLOPs"
                 + (f", about {duration_text(total_s)} one after another" if total_s else ""))
    return "\n".join(lines)


def duration_text(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
