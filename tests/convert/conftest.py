"""Session fixtures of the conversion tests: a tokenizer + corpus, megatron checkpoints of every
variant at TP=1 / TP=2 / PP=2 (written by the trainer's checkpoint code in 2 spawned ranks), and
their HF exports (converted in one spawned process). Few processes, because each one pays
megatron's ~8 s import."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.forked import run_script

REPO = Path(__file__).resolve().parents[2]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    from megatron_iiet.data.prepare import prepare_builtin_corpus

    from tests.convert.workers import TOKENIZER_VOCAB

    root = tmp_path_factory.mktemp("convert_data")
    return prepare_builtin_corpus(str(root), vocab_size=TOKENIZER_VOCAB, corpus_size="128KB")


@pytest.fixture(scope="session")
def hf_source(corpus, tmp_path_factory):
    """An HF folder made directly with the HF model (not by the exporter)."""
    from tests.convert.workers import write_hf_source

    folder = tmp_path_factory.mktemp("hf_source")
    write_hf_source(folder, corpus.tokenizer_model)
    return folder


@pytest.fixture(scope="session")
def checkpoints(corpus, hf_source, tmp_path_factory):
    """(root with <variant>-<layout> checkpoint roots, {(variant, layout): megatron logits},
    hf_source converted to a TP=2 checkpoint root by the 2 ranks themselves)."""
    from megatron_iiet.distributed import spawn_local

    from tests.convert.workers import write_checkpoints

    root = tmp_path_factory.mktemp("megatron_ckpts")
    hf_to_tp2 = tmp_path_factory.mktemp("from_hf") / "tp2"
    logits = spawn_local(write_checkpoints, 2, timeout_s=600, root=str(root),
                         tokenizer=corpus.tokenizer_model, fingerprint=corpus.fingerprint,
                         hf_source=str(hf_source), hf_to_tp2=str(hf_to_tp2))[0]
    return root, logits, hf_to_tp2


@pytest.fixture(scope="session")
def converted(checkpoints, tmp_path_factory):
    """out/hf/<variant>-<layout> exports, out/meg/<variant> and out/back/<variant> round trips,
    out/back/hf_to_tp2, out/digest.txt: the trainer's parameter digest of the TP=2 conversion."""
    from megatron_iiet.distributed import spawn_local

    from tests.convert.workers import convert_all

    out = tmp_path_factory.mktemp("converted")
    result = spawn_local(convert_all, 1, timeout_s=600, root=str(checkpoints[0]), out=str(out),
                         hf_to_tp2=str(checkpoints[2]))
    (out / "digest.txt").write_text(result[0]["digest"])
    return out


def run_cli(*args, timeout=300, env=None, cwd=REPO):
    """tools/convert_checkpoint.py with `args`, as a process (forked from this one: tests/forked.py)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    return run_script(REPO / "tools" / "convert_checkpoint.py", args, cwd=cwd, env=full_env,
                      timeout=timeout)


def assert_refused(proc, *named) -> str:
    """The CLI's answer to bad input: exit 2 and a single stderr line `error: ...` that names
    each of `named` (a file, a tensor); returns that line."""
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for text in named:
        assert str(text) in lines[0], lines[0]
    return lines[0]


def assert_nothing_written(dst: Path) -> None:
    """No output, and no temporary folder left next to where it would have gone."""
    assert not dst.exists()
    assert [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")] == []


def copy_checkpoint(checkpoints, name: str, tmp_path: Path) -> Path:
    """A private copy of one of the `checkpoints` roots, to damage."""
    return Path(shutil.copytree(checkpoints[0] / name, tmp_path / name))


def hf_state(folder) -> dict[str, torch.Tensor]:
    from megatron_iiet.hf.release_import import find_weight_files, load_tensors

    return load_tensors(find_weight_files(Path(folder)))


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread):
    """Every test here uses tiny tensors."""
