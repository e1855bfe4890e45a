"""The training job's configuration: typed sections, YAML files, dotted CLI overrides.

    cfg = load_config("examples/tiny_iiet.yaml", ["optimizer.lr=3e-4", "parallel.tensor=2"])

Unknown keys, wrong types and impossible layouts fail here, before anything is built, with the
dotted name of the offending field.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml


@dataclass
class ModelSection:
    """Fields of the model config (megatron_iiet.model.config.IIETTransformerConfig) a run may
    set. None (every default here) leaves the preset's value, or the model config's own default:
    the defaults are written once, there (architecture iiet, formulation history,
    max_iterations 3, no iteration checkpointing, no dropout, init std 0.02)."""

    preset: str = "tiny"
    """tiny | 55m | 340m | 1.3b (spec table); any field below overrides the preset."""
    architecture: Optional[str] = None
    formulation: Optional[str] = None
    iterations: Optional[list[int]] = None
    max_iterations: Optional[int] = None
    iteration_checkpointing: Optional[str] = None
    compile: Optional[bool] = None
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    num_layers: Optional[int] = None
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    share_embeddings_and_output_weights: Optional[bool] = None
    hidden_dropout: Optional[float] = None
    attention_dropout: Optional[float] = None
    init_method_std: Optional[float] = None
    history_init: Optional[str] = None


@dataclass
class DataSection:
    train: Union[str, list, None] = None
    """Blend: "path" or "w1 path1 w2 path2 ..." (or a list). None: the built-in corpus."""
    valid: Union[str, list, None] = None
    """Separate validation blend; None: carve it out of `train` with `split`."""
    split: str = "98,2,0"
    tokenizer: Optional[str] = None
    """sentencepiece .model or HF tokenizer dir; None with the built-in corpus."""
    seq_length: int = 128
    num_workers: int = 2
    cache_dir: Optional[str] = None
    verify_checksums: bool = True
    """Check each dataset against the sha256 recorded at preprocessing before training (a full
    read once per file version, remembered in PREFIX.verified.json); false skips that read."""
    builtin_dir: str = "outputs/builtin_data"
    builtin_vocab_size: int = 4096
    builtin_corpus_size: str = "4MB"


@dataclass
class OptimizerSection:
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class ScheduleSection:
    train_steps: int = 100
    warmup_steps: int = 10
    decay_style: str = "cosine"
    """cosine | linear | constant | WSD"""
    wsd_decay_steps: Optional[int] = None
    wsd_decay_style: str = "cosine"
    exit_interval: Optional[int] = None
    """Save and stop after this many steps of this run (the schedule still spans train_steps)."""


@dataclass
class ParallelSection:
    engine: str = "megatron"
    """megatron (megatron-core DDP + optimizer) | deepspeed (ZeRO)"""
    tensor: int = 1
    pipeline: int = 1
    micro_batch_size: int = 4
    global_batch_size: int = 8
    precision: str = "fp32"
    """fp32 | bf16 | fp16"""
    zero_stage: int = 1
    offload_optimizer: bool = False
    use_distributed_optimizer: bool = False
    """megatron engine on GPU: shard optimizer state over DP (ZeRO-1 style)."""


@dataclass
class CheckpointSection:
    dir: Optional[str] = None
    """Where checkpoints go (defaults to <logging.dir>/checkpoints)."""
    save_interval: int = 0
    """Save every N steps (0: only at the end)."""
    keep_last: int = 3
    """Checkpoints kept (the newest; 0 keeps all). Never the one just saved, nor a newer one."""
    load: Optional[str] = "auto"
    """auto: resume from `dir` if it holds a checkpoint; a path; or null for a fresh start."""
    load_model_only: bool = False
    """Take only the weights of `load` (fresh optimizer and schedule, step 0), e.g. to switch
    engines."""
    overwrite: bool = False
    """Allow a start below the newest checkpoint in `dir` (a fresh start, a rollback): those
    newer checkpoints are deleted once this run commits its first checkpoint."""
    async_save: bool = False
    init_from: Optional[str] = None
    """Weights to start from when this run has no checkpoint of its own yet (a fresh start,
    e.g. the E-IIET student from its IIET): once the run has saved, `load: auto` resumes it
    instead. Fresh optimizer and schedule, like load_model_only."""


@dataclass
class LoggingSection:
    dir: str = "outputs/run"
    log_interval: int = 1
    tensorboard: bool = True
    progress_bar: bool = True
    max_skipped_steps: int = 10
    """Stop after this many steps with non-finite loss."""


@dataclass
class EvalSection:
    interval: int = 0
    """Validate every N steps (0: only at the end)."""
    steps: int = 4
    tasks: list[str] = field(default_factory=list)
    """lm-eval tasks scored on the live model during training (names, or "paper" for the
    paper's suite; docs/evaluation.md). Empty: none."""
    tasks_interval: int = 0
    """Run eval.tasks every N steps (0: only at the end of the run)."""
    tasks_limit: Optional[float] = 64
    """Examples per task (lm-eval's --limit: a count, or a fraction < 1); null: all."""
    tasks_batch_size: int = 8
    tasks_data_dir: Optional[str] = None
    """Folder with the task files (default: ../shared/data beside the repo, $IIET_EVAL_DATA)."""


@dataclass
class TeacherSection:
    """One frozen teacher: a training checkpoint run live in the job, or precomputed top-k
    logits (tools/precompute_teacher_logits.py). Exactly one of the two."""

    checkpoint: Optional[str] = None
    """A training checkpoint (an iter_* folder or a run's checkpoint root: its newest complete
    one), any architecture; loaded at the student's TP/PP layout (resharded on load)."""
    logits: Optional[str] = None
    """A folder of precomputed top-k teacher logits aligned with this run's training data."""
    weight: float = 1.0
    name: Optional[str] = None
    """Metric name suffix (kl_<name>); default: the teacher's architecture."""
    zero3: bool = False
    """deepspeed engine: hold this teacher ZeRO-3-partitioned over the data-parallel ranks
    (parameters gathered layer by layer during its forward) when memory is short."""


@dataclass
class DistillSection:
    """IIAD distillation (spec 6.3-6.4): loss = CE + kl_weight * sum_t w_t * T^2 * KL(t || s),
    while start_step < step <= end_step. No teachers: plain training. docs/iiad.md."""

    teachers: list[TeacherSection] = field(default_factory=list)
    kl_weight: float = 1.0
    """lambda (the release: 1)."""
    temperature: float = 1.0
    """T, applied to teacher and student logits; the KL is scaled by T^2 (the release: 1)."""
    start_step: int = 0
    end_step: Optional[int] = None
    """Distil on steps start_step < step <= end_step (null: to the end). The release's window,
    on while 5000 < train_steps - step <= 10000, is start_step: 20000, end_step: 25000 of 30k."""
    positions: str = "labelled"
    """Which tokens the KL averages over: labelled (the loss mask, like the CE) | all (every
    shifted position, no label or padding mask: the release's semantics)."""


@dataclass
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    eval: EvalSection = field(default_factory=EvalSection)
    distill: DistillSection = field(default_factory=DistillSection)
    seed: int = 1234

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or str(Path(self.logging.dir) / "checkpoints")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- building from dicts -----------------------------------------------------------------


def _check_type(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if dataclasses.is_dataclass(annotation):
        return _build(annotation, value if value is not None else {}, where)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(value, a, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        inner = args[1] if len(args) == 2 else Any
        return {k: _check_type(v, inner, f"{where}.{k}") for k, v in value.items()}
    if origin is list or annotation is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return [_check_type(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        # PyYAML reads exponents without a dot ("3e-4") as strings
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{where}: expected a number, got {value!r}") from None
    if annotation in (int, str, bool) and not (
        isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    ):
        raise ValueError(f"{where}: expected {annotation.__name__}, got {value!r}")
    return value


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        if key not in fields:
            raise ValueError(f"{name}: unknown key (known: {', '.join(fields)})")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value or {}, name)
        else:
            kwargs[key] = _check_type(value, hint, name)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"{dotted}: {k} is not a section")
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ValueError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None,
                here: bool = True) -> TrainConfig:
    """``here=False`` skips the checks of what this machine can run (a config planned for a
    GPU cluster, e.g. by tools/sweep.py plan)."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config: {path} does not exist")
        tree = yaml.safe_load(p.read_text()) or {}
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    cfg = _build(TrainConfig, tree, "")
    validate(cfg, here=here)
    return cfg


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    # A multiple of 128 whatever the TP size, so every layout shares one embedding shape.
    return -(-vocab_size // multiple) * multiple


def build_model_config(cfg: TrainConfig, vocab_size: int):
    """The model config a training config describes, for a tokenizer of ``vocab_size`` pieces
    (padded with ``padded_vocab_size`` by the caller)."""
    import torch

    from megatron_iiet.model.config import preset

    m, par = cfg.model, cfg.parallel
    overrides = {k: v for k, v in dataclasses.asdict(m).items() if k != "preset" and v is not None}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[par.precision]
    return preset(
        m.preset,
        **overrides,
        vocab_size=vocab_size,
        max_sequence_length=cfg.data.seq_length,
        tensor_model_parallel_size=par.tensor,
        pipeline_model_parallel_size=par.pipeline,
        params_dtype=dtype,
        bf16=par.precision == "bf16",
        fp16=par.precision == "fp16",
    )


def _check_model(cfg: TrainConfig) -> None:
    """Build the model config once with a stand-in vocabulary (the tokenizer is read later), so
    that a bad model setting fails at load time with its dotted name."""
    try:
        build_model_config(cfg, padded_vocab_size(1))
    except (ValueError, AssertionError) as err:
        text = str(err) or type(err).__name__
        known = {f.name for f in dataclasses.fields(ModelSection)}
        field_name = text.split(":", 1)[0].strip()
        raise ValueError(f"model.{text}" if field_name in known or field_name == "preset"
                         else f"model: {text}") from None


def _check_distill(cfg: TrainConfig) -> None:
    d = cfg.distill
    for i, t in enumerate(d.teachers):
        where = f"distill.teachers[{i}]"
        if (t.checkpoint is None) == (t.logits is None):
            raise ValueError(f"{where}: give exactly one of checkpoint (a live teacher) or "
                             "logits (precomputed top-k logits)")
        if t.weight < 0:
            raise ValueError(f"{where}.weight: must be >= 0, got {t.weight}")
        if t.zero3 and (cfg.parallel.engine != "deepspeed" or t.checkpoint is None):
            raise ValueError(f"{where}.zero3: a ZeRO-3 teacher needs parallel.engine=deepspeed "
                             "and a checkpoint teacher")
    if d.temperature <= 0:
        raise ValueError(f"distill.temperature: must be > 0, got {d.temperature}")
    if d.kl_weight < 0:
        raise ValueError(f"distill.kl_weight: must be >= 0, got {d.kl_weight}")
    if d.positions not in ("labelled", "all"):
        raise ValueError(f"distill.positions: unknown {d.positions!r} (labelled | all)")
    if d.end_step is not None and d.end_step <= d.start_step:
        raise ValueError(f"distill.end_step: {d.end_step} must be after start_step "
                         f"{d.start_step}")
    if cfg.checkpoint.init_from is not None and cfg.checkpoint.load not in ("auto", None):
        raise ValueError("checkpoint.init_from: only with checkpoint.load auto (a run resumes "
                         "its own checkpoints, and starts from init_from before it has any)")


def validate(cfg: TrainConfig, world_size: Optional[int] = None, here: bool = True) -> None:
    """Checks that need several fields at once; world_size adds the layout checks."""
    par = cfg.parallel
    if par.engine not in ("megatron", "deepspeed"):
        raise ValueError(f"parallel.engine: unknown {par.engine!r} (megatron | deepspeed)")
    if par.precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"parallel.precision: unknown {par.precision!r} (fp32 | bf16 | fp16)")
    from megatron_iiet.platform import gpu_only_refusal

    if here and par.engine == "megatron" and par.precision != "fp32":
        refusal = gpu_only_refusal("mixed_precision_optimizer")
        if refusal:
            raise ValueError(f"parallel.precision: {par.precision} with the megatron engine "
                             f"{refusal}")
    if here and par.use_distributed_optimizer and par.engine == "megatron":
        refusal = gpu_only_refusal("distributed_optimizer")
        if refusal:
            raise ValueError(f"parallel.use_distributed_optimizer: megatron's distributed "
                             f"optimizer {refusal}")
    if par.engine == "deepspeed" and par.pipeline != 1:
        raise ValueError("parallel.pipeline: the deepspeed engine runs with pipeline=1")
    if par.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"parallel.zero_stage: must be 0..3, got {par.zero_stage}")
    if par.global_batch_size % par.micro_batch_size:
        raise ValueError(
            f"parallel.global_batch_size: {par.global_batch_size} is not a multiple of "
            f"micro_batch_size {par.micro_batch_size}"
        )
    if cfg.schedule.decay_style not in ("cosine", "linear", "constant", "WSD"):
        raise ValueError(f"schedule.decay_style: unknown {cfg.schedule.decay_style!r}")
    if cfg.checkpoint.keep_last < 0:
        raise ValueError(f"checkpoint.keep_last: must be >= 0 (0 keeps all), got "
                         f"{cfg.checkpoint.keep_last}")
    ev = cfg.eval
    if ev.tasks_interval < 0 or ev.tasks_batch_size < 1:
        raise ValueError("eval.tasks_interval must be >= 0 and eval.tasks_batch_size >= 1")
    if ev.tasks_limit is not None and ev.tasks_limit <= 0:
        raise ValueError(f"eval.tasks_limit: must be positive (or null: all), got {ev.tasks_limit}")
    _check_distill(cfg)
    if cfg.schedule.warmup_steps >= cfg.schedule.train_steps:
        raise ValueError("schedule.warmup_steps: must be shorter than schedule.train_steps")
    _check_model(cfg)
    if world_size is not None:
        mp = par.tensor * par.pipeline
        if world_size % mp:
            raise ValueError(
                f"parallel: tensor x pipeline = {mp} does not divide the {world_size} processes"
            )
        dp = world_size // mp
        if par.global_batch_size % (par.micro_batch_size * dp):
            raise ValueError(
                f"parallel.global_batch_size: {par.global_batch_size} is not divisible by "
                f"micro_batch_size x data-parallel size = {par.micro_batch_size} x {dp}"
            )
