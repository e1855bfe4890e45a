"""Import a checkpoint in the IIET authors' released layout into this project's HF format.

The release is a LLaMA folder (config.json is a LlamaConfig) whose state dict carries extra
tensors: `model.history.*` for IIET, plus `model.alpha` and `model.RK_norm.*` for PCformer. Our
HF names were chosen to equal the release's, so the tensor mapping is the identity; this module
reads the folder (safetensors or pytorch_model.bin, sharded or not), finds the architecture
(from the tensors, or from `--architecture` / the config where the tensors fit several), checks
every tensor against the shapes our model expects and writes an exported folder (weights, config
with auto_map, the two code files) atomically. The mapping is documented in docs/hf.md.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pickle
import zipfile

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as load_safetensors

from megatron_iiet.errors import OperatorError

from .configuration_iiet import IIETConfig, architecture_names
from .modeling_iiet import IIETForCausalLM


class ReleaseImportError(OperatorError, ValueError):
    """The source folder is not a usable release checkpoint, or the output cannot be written."""


# Llama config keys we read, and the IIETConfig field each becomes (same names on purpose).
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_OPTIONAL_KEYS = {
    "num_key_value_heads": None,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,  # LlamaConfig's default when the key is absent
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}
# Buffers some LLaMA checkpoints carry; our RoPE tables are recomputed from rope_theta.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# What the safetensors and torch.load readers raise on a truncated, garbled or foreign file.
_CORRUPT_FILE_ERRORS = (SafetensorError, pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError,
                        EOFError, ValueError)
# Files copied unchanged so the imported folder keeps its tokenizer.
TOKENIZER_FILES = (
    "tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)


# ----------------------------------------------------------------------------------------------
# Reading the release folder
# ----------------------------------------------------------------------------------------------
def read_json(path: Path):
    """The JSON in `path`; a truncated, binary or unreadable file is refused by name."""
    try:
        return json.loads(path.read_bytes())  # bytes: binary data is a decode error
    except OSError as err:
        raise ReleaseImportError(f"{path}: unreadable ({err.strerror or err})") from err
    except UnicodeDecodeError as err:
        raise ReleaseImportError(f"{path} is not valid JSON: binary data ({err.reason} at byte "
                                 f"{err.start})") from err
    except json.JSONDecodeError as err:
        raise ReleaseImportError(f"{path} is not valid JSON: {err}") from err


def read_release_config(src: Path) -> dict:
    path = src / "config.json"
    if not src.is_dir():
        raise ReleaseImportError(f"{src} is not a directory")
    if not path.is_file():
        raise ReleaseImportError(f"{src} is not a model folder: no config.json")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ReleaseImportError(f"{path} is not a LlamaConfig: a JSON {type(config).__name__}")
    missing = [k for k in _REQUIRED_KEYS if k not in config]
    if missing:
        raise ReleaseImportError(f"{path} is not a LlamaConfig: missing {', '.join(missing)}")
    return config


def _rope_theta(config: dict) -> float:
    # transformers 5 nests RoPE settings in rope_parameters; older files have rope_theta/rope_scaling.
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ReleaseImportError(f"RoPE scaling {rope_type!r} is not supported (IIET uses plain RoPE)")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def find_weight_files(src: Path) -> list[Path]:
    """The weight files of the folder: sharded (via index json) or single, safetensors first."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index_path = src / index_name
        if index_path.is_file():
            index = read_json(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not weight_map or not isinstance(weight_map, dict):
                raise ReleaseImportError(f"{index_path} has no weight_map")
            if not all(isinstance(name, str) and name for name in weight_map.values()):
                raise ReleaseImportError(f"{index_path}: its weight_map holds a shard that is "
                                         "not a file name")
            shards = sorted(set(weight_map.values()))
            missing = [name for name in shards if not (src / name).is_file()]
            if missing:
                raise ReleaseImportError(f"{index_path} names shards that are missing: {', '.join(missing)}")
            return [src / name for name in shards]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (src / single).is_file():
            return [src / single]
    raise ReleaseImportError(
        f"{src} holds no weights: expected model.safetensors, pytorch_model.bin or a sharded index"
    )


def read_weight_file(path: Path) -> dict[str, torch.Tensor]:
    """The state dict in one safetensors / pytorch_model.bin file; a truncated, garbled or
    foreign file is refused by name (the readers' own errors are tracebacks without one)."""
    is_safetensors = path.suffix == ".safetensors"
    kind = "safetensors" if is_safetensors else "PyTorch weights"
    try:
        if is_safetensors:
            part = load_safetensors(str(path))
        else:
            part = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as err:
        raise ReleaseImportError(f"{path}: unreadable ({err.strerror or err})") from err
    except _CORRUPT_FILE_ERRORS as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ReleaseImportError(f"{path}: not a valid {kind} file ({reason})") from err
    if not isinstance(part, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in part.items()):
        raise ReleaseImportError(f"{path}: not a valid {kind} file (no name -> tensor state dict)")
    return part


def load_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        part = read_weight_file(path)
        duplicated = sorted(set(part) & set(tensors))
        if duplicated:
            raise ReleaseImportError(f"tensor {duplicated[0]} appears in more than one shard ({path.name})")
        tensors.update(part)
    return {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}


def detect_architecture(names) -> str:
    """pcformer_* if the PCformer scalars are present, iiet if only the history is, else vanilla.
    Only for tensors no architecture fits exactly (`choose_architecture` decides the others):
    the nearest guess, for which check_tensors then names what is missing or unexpected."""
    names = set(names)
    rk_norms = {n.split(".")[2] for n in names if n.startswith("model.RK_norm.")}
    if "model.alpha" in names or rk_norms:
        if len(rk_norms) not in (2, 4):
            raise ReleaseImportError(f"PCformer checkpoint with {len(rk_norms)} RK_norm stages (expected 2 or 4)")
        return f"pcformer_rk{len(rk_norms)}"
    if "model.history.weight" in names:
        return "iiet"
    return "vanilla"


def build_config(release: dict, architecture: str, iterations=None) -> IIETConfig:
    if iterations is not None and architecture != "iiet":
        raise ReleaseImportError(f"iterations only apply to IIET; this checkpoint is {architecture}")
    fields = {k: release[k] for k in _REQUIRED_KEYS}
    fields.update({k: release.get(k, default) for k, default in _OPTIONAL_KEYS.items()})
    if iterations is None and architecture == "iiet" and release.get("architecture") == "iiet":
        iterations = release.get("iterations")  # a folder of ours keeps its plan
    try:
        return IIETConfig(
            **fields,
            rope_theta=_rope_theta(release),
            architecture=architecture,
            # the release has only the history form (spec 5b); a folder of ours names its own
            formulation=release.get("formulation", "history"),
            iterations=iterations,
        )
    except ValueError as err:
        raise ReleaseImportError(f"bad config: {err}") from err


def expected_tensor_names(config: IIETConfig) -> set[str]:
    with torch.device("meta"):
        names = set(IIETForCausalLM(config).state_dict())
    if config.tie_word_embeddings:
        names.discard("lm_head.weight")
    return names


def fitting_architectures(names, release: dict) -> list[str]:
    """The architectures whose tensor names are exactly `names`. Several fit a plain LLaMA:
    vanilla, ode_rk2 and ode_rk4 (and any other that adds no tensor) differ only in how often
    and how the block runs, which no tensor records."""
    present = set(names) - ({"lm_head.weight"} if release.get("tie_word_embeddings") else set())
    fitting = []
    for name in architecture_names():
        try:
            config = build_config(release, name)
        except ReleaseImportError:  # e.g. a formulation this architecture does not have
            continue
        if expected_tensor_names(config) == present:
            fitting.append(name)
    return fitting


def choose_architecture(names, release: dict, requested, src: Path,
                        option: str = "--architecture") -> str:
    """`requested` (--architecture), else what config.json names, else the one architecture
    the tensors fit; a choice the tensors contradict, or a guess they cannot confirm, is
    refused (importing an ODE model as vanilla gives wrong logits with no error)."""
    named = release.get("architecture")  # an IIETConfig field; the authors' LlamaConfig has none
    if requested and named and requested != named:
        raise ReleaseImportError(f"{option} {requested} contradicts {src / 'config.json'}, "
                                 f"which names {named}")
    choice = requested or named
    source = option if requested else f"architecture (of {src / 'config.json'})"
    if choice is not None and choice not in architecture_names():
        raise ReleaseImportError(f"{source} {choice!r} is not one of {', '.join(architecture_names())}")
    fitting = fitting_architectures(names, release)
    if choice is not None:
        if fitting and choice not in fitting:
            raise ReleaseImportError(f"{source} {choice} does not fit the tensors of {src}: "
                                     f"they are those of {' or '.join(fitting)}")
        return choice  # when nothing fits, check_tensors names what is missing or unexpected
    if len(fitting) > 1:
        raise ReleaseImportError(f"{src}: its tensors fit {', '.join(fitting)} alike and "
                                 f"config.json does not say which; pass {option} "
                                 f"{' | '.join(fitting)}")
    return fitting[0] if fitting else detect_architecture(names)


# ----------------------------------------------------------------------------------------------
# Checking and assembling the model
# ----------------------------------------------------------------------------------------------
def check_tensors(tensors: dict[str, torch.Tensor], config: IIETConfig) -> dict[str, torch.Tensor]:
    """Return the tensors our model loads; raise naming any missing, unexpected or misshapen one."""
    with torch.device("meta"):
        expected = {k: v.shape for k, v in IIETForCausalLM(config).state_dict().items()}
    tensors = dict(tensors)
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        head = tensors.pop("lm_head.weight", None)
        embed = tensors.get("model.embed_tokens.weight")
        if head is not None and embed is not None and not torch.equal(head, embed):
            raise ReleaseImportError("tie_word_embeddings is true but lm_head.weight differs from the embedding")
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise ReleaseImportError(f"missing tensors for {config.architecture}: {', '.join(missing[:8])}")
    if unexpected:
        raise ReleaseImportError(f"unexpected tensors for {config.architecture}: {', '.join(unexpected[:8])}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ReleaseImportError(
                f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {tuple(shape)}"
            )
    return tensors


def assemble_model(tensors: dict[str, torch.Tensor], config: IIETConfig, dtype=None) -> IIETForCausalLM:
    dtype = dtype or tensors["model.embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = IIETForCausalLM(config)
    state = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    meta = [n for n, p in model.state_dict().items() if p.is_meta]
    if meta:
        raise ReleaseImportError(f"tensors left unset after loading: {', '.join(meta[:8])}")
    model.config.dtype = dtype
    return model.eval()


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------
def write_atomically(dst: Path, force: bool, fill, sources=(), kind: str = "hf") -> Path:
    """Fill a temp dir next to dst, then rename it into place; never leave a half-written dst.
    What may be replaced is checks.check_destination's rule (never a source or a folder around
    one; with `force`, only an earlier export), checked again just before the rename: the old
    folder may have changed during a long conversion. The output is marked as an export
    (checks.mark_export) and its files get the mode a plain write gives them."""
    from .checks import check_destination, mark_export

    dst = Path(dst)
    check_destination(dst, force, sources)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        fill(tmp)
        give_plain_file_modes(tmp)
        mark_export(tmp, kind, sources)
        check_destination(dst, force, sources)
        if dst.exists() or dst.is_symlink():
            old = dst.parent / f".{dst.name}.old-{os.getpid()}"
            os.replace(dst, old)
            os.replace(tmp, dst)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
        else:
            os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _umask() -> int:
    try:  # Linux states it; os.umask can only read it by setting it (racy with threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_plain_file_modes(folder: Path) -> None:
    """safetensors writes its files 0600 (a private temp file renamed), copy2 keeps a source's
    mode: give every file of `folder` the mode open() would, 0666 less the umask, so an export
    is readable by whoever may read the rest of it."""
    mode = 0o666 & ~_umask()
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink() and (path.stat().st_mode & 0o7777) != mode:
            os.chmod(path, mode)


def import_release(src, dst, iterations=None, force=False, dtype=None, max_shard_size="5GB",
                   architecture=None) -> Path:
    """Convert the release folder `src` into an exported IIET folder `dst`; returns dst.
    `architecture` is needed where the tensors fit several (a plain LLaMA: vanilla, ode_rk2,
    ode_rk4) and config.json does not name one."""
    src = Path(src)
    release_config = read_release_config(src)
    tensors = load_tensors(find_weight_files(src))
    architecture = choose_architecture(tensors, release_config, architecture, src)
    config = build_config(release_config, architecture, iterations)
    model = assemble_model(check_tensors(tensors, config), config, dtype)

    def fill(folder: Path):
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, folder / name)

    return write_atomically(Path(dst), force, fill, sources=(src,))


__all__ = [
    "ReleaseImportError",
    "TOKENIZER_FILES",
    "build_config",
    "check_tensors",
    "choose_architecture",
    "detect_architecture",
    "fitting_architectures",
    "find_weight_files",
    "import_release",
    "load_tensors",
    "read_json",
    "read_release_config",
    "read_weight_file",
]
