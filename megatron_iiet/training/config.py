"""The training job's configuration: typed sections, YAML files, dotted CLI overrides.

    cfg = load_config("examples/tiny_iiet.yaml", ["optimizer.lr=3e-4", "parallel.tensor=2"])

Unknown keys, wrong types, impossible values and layouts, repeated YAML keys and YAML syntax
errors fail here, before anything is built or locked, as one ``BadInput`` line naming the dotted
field (or the file and line).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from megatron_iiet.errors import BadInput


def _model_section():
    """ModelSection: `preset`, then one Optional field per model knob a run may set
    (model/config.py's KNOBS), typed as the model config types it. None (every default here)
    leaves the preset's value, or the model config's own default: defaults are written once,
    there."""
    from megatron_iiet.model.config import KNOBS, knob_type

    fields = [("preset", str, field(default="tiny"))]
    fields += [(name, Optional[knob_type(name)], field(default=None))
               for name, knob in KNOBS.items() if knob.run]
    section = dataclasses.make_dataclass("ModelSection", fields)
    section.__module__ = __name__
    section.__doc__ = ("Fields of the model config (megatron_iiet.model.config."
                       "IIETTransformerConfig) a run may set; None leaves the preset's value or "
                       "the model config's default. preset: tiny | 55m | 340m | 1.3b (spec "
                       "table); any other field overrides the preset.")
    return section


ModelSection = _model_section()


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
    verify_checksums: Union[bool, str] = True
    """Check each dataset against the sha256 recorded at preprocessing before training (a full
    read once per file version, remembered in PREFIX.verified.json, and a few random 1 MiB blocks
    re-read at every start); "full": the full read every time; false skips the check."""
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
    exit_duration_minutes: Optional[float] = None
    """Save and stop at the first step end after the run has lasted this long, set-up included
    (megatron-LM's --exit-duration-in-mins): a job with a time limit ends with its own checkpoint."""
    rewarmup_from: Optional[int] = None
    """A second linear warm-up starts after this step: for a run that starts mid-schedule with a
    fresh optimizer (checkpoint.init_from + init_from_position, two-stage training)."""
    rewarmup_steps: int = 0
    """Updates over which that second warm-up ramps the LR from 0 back to the schedule's."""


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
    stall_timeout_s: float = 1800.0
    """Stall watchdog: a rank that finishes no step (nor validation, nor save) for this long ends
    the job with one line naming the stalled rank (the first step gets 3x: compilation, warm-up);
    0: off. docs/training.md, "Hangs"."""
    collective_timeout_s: Optional[float] = None
    """Timeout of every collective (gloo and NCCL, megatron's groups included); null:
    stall_timeout_s + 600, so that the watchdog names the stalled rank first (600 with it off)."""
    flush_denormals: bool = True
    """Without a GPU: flush subnormal floats to zero in CPU math (x86 FTZ/DAZ). Once attention
    sharpens, subnormal inputs make each CPU step up to ~2x slower (docs/benchmarks.md,
    "Subnormal floats on CPU"); the values flushed are below 1.2e-38. No effect on GPUs."""


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
    init_from_position: bool = False
    """Continue init_from's step, LR schedule and sample stream (two-stage training: the second
    stage, e.g. IIET from a vanilla checkpoint, takes up where the first stopped); the optimizer
    still starts fresh."""


@dataclass
class LoggingSection:
    dir: str = "outputs/run"
    log_interval: int = 1
    tensorboard: bool = True
    progress_bar: bool = True
    max_skipped_steps: int = 10
    """Stop after this many steps with non-finite loss."""
    wandb_project: Optional[str] = None
    """Also log to Weights & Biases under this project (needs `pip install wandb`); null: off."""
    wandb_mode: str = "online"
    """online | offline (written under logging.dir/wandb, `wandb sync` later: no network needed)"""
    wandb_entity: Optional[str] = None
    wandb_name: Optional[str] = None
    """The W&B run's name (default: the logging directory's name). A resumed run continues the
    same W&B run (its id is kept in logging.dir/wandb_run_id)."""


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
    """Folder with the task files (default: ../shared/data beside the repo, $IIET_SHARED_DATA)."""


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
    callbacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Callbacks named in the config, run after the built-in ones: ``{name: {class:
    pkg.module.Class, <its keyword arguments>}}`` (a training.callbacks.Callback subclass,
    importable from the run's Python path), as OLMo-core's config names them."""

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
        return build_typed(annotation, value if value is not None else {}, where)
    if origin is typing.Literal:
        if value not in args:
            raise BadInput(f"{where}: expected one of {', '.join(map(repr, args))}, got {value!r}")
        return value
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
        raise BadInput(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is dict:
        if not isinstance(value, dict):
            raise BadInput(f"{where}: expected a mapping, got {value!r}")
        inner = args[1] if len(args) == 2 else Any
        return {k: _check_type(v, inner, f"{where}.{k}") for k, v in value.items()}
    if origin is list or annotation is list:
        if not isinstance(value, list):
            raise BadInput(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return [_check_type(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        # PyYAML reads exponents without a dot ("3e-4") as strings
        try:
            return float(value)
        except ValueError:
            raise BadInput(f"{where}: expected a number, got {value!r}") from None
    if annotation in (int, str, bool) and not (
        isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    ):
        raise BadInput(f"{where}: expected {annotation.__name__}, got {value!r}")
    return value


def build_typed(cls, data: dict, where: str):
    """An instance of the config dataclass ``cls`` from a plain mapping (YAML, a checkpoint's
    saved config, a sweep file), strictly: an unknown key or a value of the wrong type is one
    BadInput line naming the dotted field under ``where``. The one parser of every config."""
    if not isinstance(data, dict):
        raise BadInput(f"{where or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        if key not in fields:
            raise BadInput(f"{name}: unknown key (known: {', '.join(fields)})")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = build_typed(hint, value or {}, name)
        else:
            kwargs[key] = _check_type(value, hint, name)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise BadInput(f"{dotted}: {k} is not a section")
    node[keys[-1]] = value


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: the plain loader keeps the
    last copy, so a section repeated further down a config silently dropped the first one."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor` entries may be overridden on purpose
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:
                    continue  # an unhashable key: the base constructor refuses it
                if first is not None:
                    raise BadInput(f"{self.name}: line {line}: duplicate key {key!r} (first "
                                   f"given on line {first})")
                seen[key] = line
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, name: str) -> Any:
    """``text`` parsed with ``UniqueKeyLoader``; a syntax error is one line naming ``name``,
    the line and the column."""
    loader = UniqueKeyLoader(text)
    loader.name = name  # what its marks (and so our messages) call the source
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise BadInput(f"{name}: not valid YAML: {where}{problem}") from None
    finally:
        loader.dispose()


def read_yaml_mapping(path: str, what: str) -> dict:
    """The mapping a YAML file holds (empty file: {}), for configs and sweep specs."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{what}: {path} does not exist")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise BadInput(f"{what}: cannot read {path}: {err}") from None
    tree = parse_yaml(text, str(path))
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise BadInput(f"{what}: {path} holds a {type(tree).__name__}, not a mapping of keys")
    return tree


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise BadInput(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    return key.strip(), parse_yaml(raw, f"override {text!r}") if raw.strip() else None


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None,
                here: bool = True) -> TrainConfig:
    """``here=False`` skips the checks of what this machine can run (a config planned for a
    GPU cluster, e.g. by tools/sweep.py plan)."""
    tree = read_yaml_mapping(path, "config") if path is not None else {}
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    cfg = build_typed(TrainConfig, tree, "")
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
        raise BadInput(f"model.{text}" if field_name in known or field_name == "preset"
                       else f"model: {text}") from None


# The range of every numeric field, checked first: an impossible value failed far from its
# cause (data.seq_length=0 in a SIGFPE inside megatron's index builder, leaving the run lock; a zero
# batch size or log interval in a ZeroDivisionError). None (a preset's value, "off") passes.
# tests/training/test_config_values.py checks that every numeric field is listed.
VALUE_RANGES: tuple[tuple[str, Any, tuple[str, ...]], ...] = (
    (">= 1", lambda v: v >= 1, (
        "model.num_layers", "model.hidden_size", "model.num_attention_heads",
        "model.num_query_groups", "model.ffn_hidden_size", "model.recompute_num_layers",
        "data.seq_length", "data.builtin_vocab_size", "schedule.train_steps",
        "schedule.wsd_decay_steps", "parallel.tensor", "parallel.pipeline",
        "parallel.micro_batch_size", "parallel.global_batch_size", "logging.log_interval",
        "eval.steps", "eval.tasks_batch_size")),
    (">= 0", lambda v: v >= 0, (
        "model.max_iterations", "model.init_method_std", "data.num_workers", "optimizer.lr",
        "optimizer.min_lr", "optimizer.weight_decay", "optimizer.eps", "optimizer.clip_grad",
        "schedule.warmup_steps", "schedule.exit_interval", "schedule.rewarmup_from",
        "schedule.rewarmup_steps", "checkpoint.save_interval",
        "checkpoint.keep_last", "logging.max_skipped_steps", "eval.interval",
        "parallel.stall_timeout_s",
        "eval.tasks_interval", "distill.kl_weight", "distill.start_step", "seed")),
    ("> 0", lambda v: v > 0, ("eval.tasks_limit", "distill.temperature", "distill.end_step",
                              "parallel.collective_timeout_s", "schedule.exit_duration_minutes")),
    ("in [0, 1)", lambda v: 0 <= v < 1, (
        "model.hidden_dropout", "model.attention_dropout", "optimizer.beta1", "optimizer.beta2")),
    ("0..3", lambda v: v in (0, 1, 2, 3), ("parallel.zero_stage",)),
)


def _check_ranges(cfg: TrainConfig) -> None:
    for rule, holds, names in VALUE_RANGES:
        for name in names:
            value = operator.attrgetter(name)(cfg)
            finite = not isinstance(value, float) or math.isfinite(value)
            if value is not None and not (finite and holds(value)):
                raise BadInput(f"{name}: must be {rule}, got {value}")


def _check_split(split: str) -> None:
    # megatron's parser takes any run of digits and dots, so "abc" or "1.2.3" failed inside it.
    parts = split.split(",")
    try:
        shares = [float(p) for p in parts]
    except ValueError:
        shares = []
    if not 1 <= len(parts) <= 3 or len(shares) != len(parts) or not all(
            math.isfinite(v) and v >= 0 for v in shares) or not sum(shares) > 0:
        raise BadInput(f"data.split: {split!r} is not 'TRAIN,VALID,TEST' (up to three "
                       "non-negative shares, e.g. 98,2,0)")


def _check_distill(cfg: TrainConfig) -> None:
    d = cfg.distill
    for i, t in enumerate(d.teachers):
        where = f"distill.teachers[{i}]"
        if (t.checkpoint is None) == (t.logits is None):
            raise BadInput(f"{where}: give exactly one of checkpoint (a live teacher) or "
                           "logits (precomputed top-k logits)")
        if t.weight < 0:
            raise BadInput(f"{where}.weight: must be >= 0, got {t.weight}")
        if t.zero3 and (cfg.parallel.engine != "deepspeed" or t.checkpoint is None):
            raise BadInput(f"{where}.zero3: a ZeRO-3 teacher needs parallel.engine=deepspeed "
                           "and a checkpoint teacher")
    if d.positions not in ("labelled", "all"):
        raise BadInput(f"distill.positions: unknown {d.positions!r} (labelled | all)")
    if d.end_step is not None and d.end_step <= d.start_step:
        raise BadInput(f"distill.end_step: {d.end_step} must be after start_step "
                       f"{d.start_step}")
    if cfg.checkpoint.init_from_position and cfg.checkpoint.init_from is None:
        raise BadInput("checkpoint.init_from_position: needs checkpoint.init_from (whose step "
                       "and data position the run continues)")
    if cfg.checkpoint.init_from is not None and cfg.checkpoint.load not in ("auto", None):
        raise BadInput("checkpoint.init_from: only with checkpoint.load auto (a run resumes "
                       "its own checkpoints, and starts from init_from before it has any)")


def _check_rewarmup(s: ScheduleSection) -> None:
    if (s.rewarmup_from is None) != (s.rewarmup_steps == 0):
        raise BadInput("schedule.rewarmup_from and schedule.rewarmup_steps: give both (the step "
                       "the second warm-up starts after, and its length) or neither")
    if s.rewarmup_from is not None and s.rewarmup_from + s.rewarmup_steps > s.train_steps:
        raise BadInput(f"schedule.rewarmup_steps: the second warm-up ({s.rewarmup_steps} steps "
                       f"after step {s.rewarmup_from}) must end by train_steps {s.train_steps}")


def validate(cfg: TrainConfig, world_size: Optional[int] = None, here: bool = True) -> None:
    """Every field's range, then the checks that need several fields at once; world_size adds
    the layout checks."""
    _check_ranges(cfg)
    _check_split(cfg.data.split)
    for name, spec in cfg.callbacks.items():
        target = spec.get("class")
        if not isinstance(target, str) or "." not in target:
            raise BadInput(f"callbacks.{name}.class: a dotted path to a Callback class "
                           f"(pkg.module.Class), got {target!r}")
    if isinstance(cfg.data.verify_checksums, str) and cfg.data.verify_checksums != "full":
        raise BadInput(f"data.verify_checksums: unknown {cfg.data.verify_checksums!r} "
                       "(true | false | full)")
    par = cfg.parallel
    if par.engine not in ("megatron", "deepspeed"):
        raise BadInput(f"parallel.engine: unknown {par.engine!r} (megatron | deepspeed)")
    if par.precision not in ("fp32", "bf16", "fp16"):
        raise BadInput(f"parallel.precision: unknown {par.precision!r} (fp32 | bf16 | fp16)")
    from megatron_iiet.platform import gpu_only_refusal

    if here and par.engine == "megatron" and par.precision != "fp32":
        refusal = gpu_only_refusal("mixed_precision_optimizer")
        if refusal:
            raise BadInput(f"parallel.precision: {par.precision} with the megatron engine "
                           f"{refusal}")
    if here and par.use_distributed_optimizer and par.engine == "megatron":
        refusal = gpu_only_refusal("distributed_optimizer")
        if refusal:
            raise BadInput(f"parallel.use_distributed_optimizer: megatron's distributed "
                           f"optimizer {refusal}")
    if par.engine == "deepspeed" and par.pipeline != 1:
        raise BadInput("parallel.pipeline: the deepspeed engine runs with pipeline=1")
    if par.global_batch_size % par.micro_batch_size:
        raise BadInput(
            f"parallel.global_batch_size: {par.global_batch_size} is not a multiple of "
            f"micro_batch_size {par.micro_batch_size}"
        )
    if cfg.schedule.decay_style not in ("cosine", "linear", "constant", "WSD"):
        raise BadInput(f"schedule.decay_style: unknown {cfg.schedule.decay_style!r}")
    _check_distill(cfg)
    if cfg.schedule.warmup_steps >= cfg.schedule.train_steps:
        raise BadInput("schedule.warmup_steps: must be shorter than schedule.train_steps")
    _check_rewarmup(cfg.schedule)
    _check_model(cfg)
    if world_size is not None:
        mp = par.tensor * par.pipeline
        if world_size % mp:
            raise BadInput(
                f"parallel: tensor x pipeline = {mp} does not divide the {world_size} processes"
            )
        dp = world_size // mp
        if par.global_batch_size % (par.micro_batch_size * dp):
            raise BadInput(
                f"parallel.global_batch_size: {par.global_batch_size} is not divisible by "
                f"micro_batch_size x data-parallel size = {par.micro_batch_size} x {dp}"
            )
