"""Exporting from anywhere: a checkpoint whose meta.json names its tokenizer relative to the
directory training ran in (as the trainer wrote it before it stored the resolved path) converts
from any other working directory; and the exported model card's snippet runs as written, in a
process without a terminal, with no interactive prompt."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.convert.conftest import assert_nothing_written, assert_refused, run_cli
from tests.convert.workers import TOKENIZER_VOCAB

pytestmark = pytest.mark.distributed  # uses the spawned checkpoint fixtures

RELATIVE = "tok/tokenizer.model"
TRAINED_IN = "outputs/run/checkpoints"  # the checkpoint.dir training was given
PROMPT = "Do you wish to run the custom code"  # transformers' trust_remote_code question


def old_run(checkpoints, corpus, run: Path, ckpt_dir: str) -> Path:
    """A run directory as an older trainer left it: the tokenizer at run/tok/, the checkpoint
    root at run/<ckpt_dir>, and meta.json naming both relative to run (where training ran)."""
    (run / "tok").mkdir(parents=True)
    shutil.copy2(corpus.tokenizer_model, run / RELATIVE)
    root = Path(shutil.copytree(checkpoints[0] / "iiet-history-tp1", run / ckpt_dir))
    for meta_file in root.glob("iter_*/meta.json"):
        meta = json.loads(meta_file.read_text())
        meta["tokenizer"] = meta["config"]["data"]["tokenizer"] = RELATIVE
        meta["config"]["checkpoint"]["dir"] = TRAINED_IN
        meta_file.write_text(json.dumps(meta))
    return root


def elsewhere(tmp_path: Path) -> Path:
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    assert not (cwd / RELATIVE).exists()
    return cwd


@pytest.fixture(scope="module")
def old_export(checkpoints, corpus, tmp_path_factory):
    """(CLI result, exported folder) of an old-style run exported from another directory."""
    tmp = tmp_path_factory.mktemp("old_run")
    root = old_run(checkpoints, corpus, tmp / "run", TRAINED_IN)
    out = tmp / "export"
    return run_cli("megatron-to-hf", root, out, cwd=elsewhere(tmp)), out


def test_relative_tokenizer_is_found_from_elsewhere(old_export, corpus):
    proc, out = old_export
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    from transformers import AutoTokenizer

    from megatron_iiet.data.tokenizer import Tokenizer

    text = "def main():\n    return 42"
    hf = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert hf(text).input_ids == Tokenizer.from_path(corpus.tokenizer_model).encode(text)


def test_moved_run_folder(checkpoints, corpus, tmp_path):
    """The checkpoint root no longer where checkpoint.dir says (the run folder was
    reorganised): the tokenizer is found in a folder up from the checkpoint."""
    root = old_run(checkpoints, corpus, tmp_path / "run", "moved/ckpts")
    out = tmp_path / "export"
    proc = run_cli("megatron-to-hf", root, out, cwd=elsewhere(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "tokenizer.json").is_file()


def test_a_tokenizer_found_nowhere_is_refused(checkpoints, corpus, tmp_path):
    root = old_run(checkpoints, corpus, tmp_path / "run", TRAINED_IN)
    shutil.rmtree(tmp_path / "run" / "tok")
    out = tmp_path / "export"
    assert_refused(run_cli("megatron-to-hf", root, out, cwd=elsewhere(tmp_path)),
                   f"tokenizer {RELATIVE}", "does not exist", "--tokenizer PATH")
    assert_nothing_written(out)


def card_snippet(folder: Path) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (folder / "README.md").read_text(), re.S)
    assert len(blocks) == 1, blocks
    return blocks[0]


def run_snippet(snippet: str, folder: Path, tmp_path: Path):
    """The snippet with `folder` set, in a fresh interpreter without the repository on its
    path, offline, stdin closed (no terminal to answer a prompt)."""
    script = tmp_path / "card.py"
    script.write_text(f"import sys\nfolder = sys.argv[1]\n{snippet}\n" + textwrap.dedent("""
        print("model:", type(model).__name__)
        print("tokenizer:", len(tokenizer), tokenizer.decode(tokenizer("def main():").input_ids))
        """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(script), str(folder)], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240)


def test_model_card_snippet_runs_without_a_prompt(old_export, tmp_path):
    proc, folder = old_export
    assert proc.returncode == 0, proc.stderr[-3000:]
    snippet = card_snippet(folder)
    child = run_snippet(snippet, folder, tmp_path)
    assert child.returncode == 0, child.stderr[-3000:]
    assert PROMPT not in child.stdout + child.stderr
    assert "model: IIETForCausalLM" in child.stdout
    assert f"tokenizer: {TOKENIZER_VOCAB} " in child.stdout and "def main():" in child.stdout
    # What the check guards against: the same loads without the package's classes registered
    # (and without trust_remote_code) reach the prompt.
    old = snippet.replace("import megatron_iiet.hf", "pass")
    assert old != snippet
    assert PROMPT in run_snippet(old, folder, tmp_path).stdout


def test_model_card_snippet_runs_no_code_from_the_folder(old_export, tmp_path):
    """The card's snippet uses the installed package's classes: a tampered copy of the folder
    runs nothing. The card says what trust_remote_code=True would run instead."""
    proc, exported = old_export
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = Path(shutil.copytree(exported, tmp_path / "copy"))
    marker = tmp_path / "ran.txt"
    for code in folder.glob("*.py"):
        code.write_text(code.read_text() + f"\nopen({str(marker)!r}, 'a').write(__name__)\n")
    child = run_snippet(card_snippet(folder), folder, tmp_path)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "model: IIETForCausalLM" in child.stdout
    assert not marker.exists(), marker.read_text()
    card = (folder / "README.md").read_text()
    assert "trust_remote_code=True" not in card_snippet(folder)
    assert "trust_remote_code=True" in card and "runs this folder's own" in card


def test_model_card_carries_the_hubs_metadata(old_export):
    """YAML front matter as the Hugging Face Hub reads it: license, library, pipeline, tags."""
    import yaml

    proc, folder = old_export
    assert proc.returncode == 0, proc.stderr[-3000:]
    card = (folder / "README.md").read_text()
    assert card.startswith("---\n")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["license"] == "apache-2.0" and front["library_name"] == "transformers"
    assert front["pipeline_tag"] == "text-generation"
    assert {"iiet", "megatron-iiet", "custom_code"} <= set(front["tags"])
    config = json.loads((folder / "config.json").read_text())
    assert config["architecture"].replace("_", "-") in front["tags"]
