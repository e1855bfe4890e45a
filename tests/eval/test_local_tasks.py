"""The local lm-eval tasks (megatron_iiet/eval/tasks): each reads its file into lm-eval's official
example count, and the requests it sends a model for a document are the ones lm-eval's own
built-in task sends for the official form of that document.

The official tasks are built from lm-eval's installed YAMLs with the download replaced by a
dataset holding one document written here from the local record (independently of our loaders),
so nothing is fetched. Without the data directory the data tests skip, except under CI=true,
where the data is expected and its absence fails.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from megatron_iiet.errors import OperatorError
from megatron_iiet.eval import tasks as local
from megatron_iiet.eval.tasks import loaders

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import lm_eval.tasks  # noqa: E402
from lm_eval.api.task import ConfigurableTask  # noqa: E402
from lm_eval.tasks._yaml_loader import load_yaml  # noqa: E402

BUILTIN = Path(lm_eval.tasks.__file__).parent
BUILTIN_YAML = {
    "wikitext": "wikitext/wikitext.yaml", "lambada_openai": "lambada/lambada_openai.yaml",
    "piqa": "piqa/piqa.yaml", "hellaswag": "hellaswag/hellaswag.yaml",
    "winogrande": "winogrande/default.yaml", "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml", "boolq": "super_glue/boolq/default.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml", "sciq": "sciq/sciq.yaml",
}
OFFICIAL_COUNTS = {
    "wikitext": 62, "lambada_openai": 5153, "piqa": 1838, "hellaswag": 10042, "winogrande": 1267,
    "arc_easy": 2376, "arc_challenge": 1172, "boolq": 3270, "openbookqa": 500, "sciq": 1000,
}
# Everything of a task config that shapes a request or a score; only the data source may differ.
SCORING_KEYS = ("output_type", "doc_to_text", "doc_to_target", "doc_to_choice", "process_docs",
                "process_results", "target_delimiter", "fewshot_delimiter", "description", "num_fewshot",
                "metric_list", "generation_kwargs", "filter_list", "repeats", "should_decontaminate",
                "doc_to_decontamination_query", "gen_prefix", "use_prompt")

# Rowan/hellaswag validation row 0 (ind 24), as published in the dataset's card and viewer.
HELLASWAG_ROW0 = {
    "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
    "ctx": "A man is sitting on a roof. he",
    "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
    "label": "3",
}


@pytest.fixture(scope="module")
def data_dir() -> Path:
    found = local.default_data_dir()
    if found is None or not found.is_dir():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but the evaluation data directory is missing ({found}; "
                        f"../shared/data beside the repo or ${local.ENV_VAR})")
        pytest.skip(f"no evaluation data directory ({found or '../shared/data beside the repo'}; "
                    f"set ${local.ENV_VAR})")
    return found


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# The built-in folders holding our tasks' namesakes and the tags and groups that name them.
# Indexing all of lm-eval's ~15k YAMLs takes 12-25 s on two cores; the precedence under test is
# per name, so these folders show it (the full index was checked by hand, and the evaluation
# tool's slow tests use it).
BUILTIN_DIRS = ("wikitext", "lambada", "piqa", "hellaswag", "winogrande", "arc", "super_glue",
                "openbookqa", "sciq")


@pytest.fixture(scope="module")
def manager_and_warnings(data_dir):
    """``task_manager(data_dir)`` over a part of lm-eval's built-in tasks, and what lm-eval's
    indexer warned while it was built."""
    from lm_eval.tasks._index import TaskIndex

    every_yaml = TaskIndex._iter_yaml_files

    def fewer_builtins(root: Path):
        for path in every_yaml(root):
            if Path(root).resolve() != BUILTIN.resolve() or path.relative_to(root).parts[0] in BUILTIN_DIRS:
                yield path

    recorder, index_log = _Recorder(), logging.getLogger("lm_eval.tasks._index")
    index_log.addHandler(recorder)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TaskIndex, "_iter_yaml_files", staticmethod(fewer_builtins))
        try:
            manager = local.task_manager(data_dir)
        finally:
            index_log.removeHandler(recorder)
    assert "lambada_standard" in manager.task_index and "cb" in manager.task_index
    return manager, recorder.messages


@pytest.fixture(scope="module")
def manager(manager_and_warnings):
    return manager_and_warnings[0]


@pytest.fixture(scope="module")
def loaded(manager):
    return manager.load(list(local.LOCAL_TASKS))["tasks"]


def _first_json_line(path: Path) -> dict:
    with path.open(encoding="utf-8") as fh:
        return json.loads(fh.readline())


def official_doc0(task: str, data_dir: Path) -> dict:
    """Record 0 of the local file in the form of lm-eval's HF dataset, written out here."""
    if task == "wikitext":
        raw = (data_dir / "wikitext-2-raw/wiki.test.raw").read_text(encoding="utf-8")
        end = raw.index("\n = Du Fu = \n")
        return {"page": raw[len(" \n"):end]}
    if task == "lambada_openai":
        return {"text": _first_json_line(data_dir / "lambada/lambada_test.jsonl")["text"]}
    if task == "piqa":
        row = _first_json_line(data_dir / "piqa/valid.jsonl")
        label = (data_dir / "piqa/valid-labels.lst").read_text().split()[0]
        return {**row, "label": int(label)}
    if task == "hellaswag":
        return dict(HELLASWAG_ROW0)
    if task == "winogrande":
        row = _first_json_line(data_dir / "winogrande/dev.jsonl")
        return {k: row[k] for k in ("sentence", "option1", "option2", "answer")}
    if task == "arc_easy":
        row = _first_json_line(data_dir / "arc/ARC-Easy/test.jsonl")
        choices = row["question"]["choices"]
        return {"id": row["id"], "question": row["question"]["stem"], "answerKey": row["answerKey"],
                "choices": {"text": [c["text"] for c in choices], "label": [c["label"] for c in choices]}}
    if task == "arc_challenge":
        row = _first_json_line(data_dir / "arc/ARC-Challenge/test.jsonl")
        return {k: row[k] for k in ("id", "question", "choices", "answerKey")}
    if task == "boolq":
        row = _first_json_line(data_dir / "boolq/val.jsonl")
        return {**row, "label": {"false": 0, "true": 1}[row["label"]]}
    if task == "openbookqa":
        # From the MosaicML copy, a second source for the same questions.
        row = _first_json_line(data_dir / "openbookqa/openbook_qa.jsonl")
        return {"id": "8-343", "question_stem": row["query"], "answerKey": "ABCD"[row["gold"]],
                "choices": {"text": row["choices"], "label": ["A", "B", "C", "D"]}}
    if task == "sciq":
        row = json.loads((data_dir / "sciq/test.json").read_text(encoding="utf-8"))[0]
        lines = row["instruction"].split("\n")
        question = lines[0].removeprefix("Please choose the correct answer to the question: ")
        options = [line.split(": ", 1)[1] for line in lines[2:6]]
        correct = options.pop(int(row["answer"][-1]) - 1)
        return {"question": question, "distractor1": options[0], "distractor2": options[1],
                "distractor3": options[2], "correct_answer": correct, "support": ""}
    raise AssertionError(task)


class _OfflineOfficial(ConfigurableTask):
    """lm-eval's built-in task config, its dataset replaced by given documents in every split it
    names (so its few-shot source exists too)."""

    def __init__(self, config: dict, docs: list[dict]):
        self._given_docs = docs
        super().__init__(config=config)

    def download(self, dataset_kwargs=None, **kwargs) -> None:
        import datasets

        splits = {self.config.training_split, self.config.validation_split, self.config.test_split} - {None}
        self.dataset = datasets.DatasetDict({s: datasets.Dataset.from_list(self._given_docs) for s in splits})


def official_task(task: str, docs: list[dict]) -> ConfigurableTask:
    config = load_yaml(BUILTIN / BUILTIN_YAML[task], resolve_func=True)
    config.pop("tag", None)
    return _OfflineOfficial(config, docs)


def requests_for(task: ConfigurableTask, doc: dict) -> list[tuple]:
    ctx = task.fewshot_context(doc, num_fewshot=0, gen_prefix=task.doc_to_prefix(doc))
    made = task.construct_requests(doc=doc, ctx=ctx, metadata=(task.config.task, 0, 1))
    return [inst.arguments for inst in (made if isinstance(made, list) else [made])]


def fake_results(task: ConfigurableTask, n_requests: int) -> list:
    if task.OUTPUT_TYPE == "loglikelihood_rolling":
        return [-1234.5]
    return [(-1.5 - i, i == 1) for i in range(n_requests)]


def _comparable(value):
    if callable(value):
        return (value.__module__, value.__qualname__)
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------- no data needed

def test_every_local_task_is_one_record_and_its_yaml():
    yamls = {p.stem: load_yaml(p, resolve_func=False) for p in local.TASKS_DIR.glob("*.yaml")}
    assert set(yamls) == set(local.TASKS)
    for name, task in local.TASKS.items():
        assert yamls[name]["task"] == name
        # the YAML names the loader generated from the record; its converter exists
        assert str(yamls[name]["custom_dataset"]).endswith(
            f"megatron_iiet.eval.tasks.loaders.{name}"), name
        assert callable(getattr(loaders, name)) and callable(getattr(loaders, task.converter))
        assert loaders.DOCS[name] == (task.split, getattr(loaders, task.converter))
    assert local.PAPER_SUITE == ("wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande",
                                 "arc_easy", "arc_challenge")


def test_unknown_task_is_one_line_operator_error_with_close_names(tmp_path):
    with pytest.raises(OperatorError) as err:
        local.resolve_tasks(["paper", "hellaswg"], tmp_path)
    message = str(err.value)
    assert "\n" not in message and "'hellaswg'" in message and "hellaswag" in message


def test_missing_data_file_is_one_line_operator_error_naming_it(tmp_path):
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa/valid.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b"}\n')
    with pytest.raises(OperatorError) as err:
        local.resolve_tasks(["piqa"], tmp_path)
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "piqa/valid-labels.lst") in message
    assert local.ENV_VAR in message and "--data-dir" in message
    assert local.ENV_VAR == "IIET_SHARED_DATA"  # one variable for the shared folder, as tests/data
    # The same from inside lm-eval, where the loader gets the directory through the metadata.
    with pytest.raises(OperatorError) as err:
        loaders.piqa(**{local.DATA_DIR_KEY: str(tmp_path), "version": 1.0})
    assert "\n" not in str(err.value) and "valid-labels.lst" in str(err.value)


def test_data_dir_setting_order(tmp_path, monkeypatch):
    monkeypatch.setenv(local.ENV_VAR, str(tmp_path / "elsewhere"))
    assert local.default_data_dir() == tmp_path / "elsewhere"
    with pytest.raises(OperatorError, match=local.ENV_VAR):
        local.resolve_tasks(["lambada_openai"], None)
    (tmp_path / "lambada").mkdir()
    (tmp_path / "lambada/lambada_test.jsonl").write_text('{"text": "a b c"}\n')
    assert local.resolve_tasks(["lambada_openai,lambada_openai"], tmp_path) == ["lambada_openai"]
    # metadata wins over the environment.
    docs = loaders.lambada_openai(**{local.DATA_DIR_KEY: str(tmp_path)})["test"]
    assert docs[0] == {"text": "a b c"}


def test_hellaswag_context_split():
    assert loaders.split_context("A man is sitting on a roof. he") == ("A man is sitting on a roof.", "he")
    assert loaders.split_context("How to x. Do y. Then z.") == ("How to x. Do y. Then z.", "")
    assert loaders.split_context('He says "hi." the man') == ('He says "hi."', "the man")


# ---------------------------------------------------------------------------- with the data

def test_resolve_paper_suite(data_dir):
    assert local.resolve_tasks(["paper", "boolq", "piqa"], data_dir) == list(local.PAPER_SUITE) + ["boolq"]


def test_local_tasks_replace_builtins_quietly(manager_and_warnings):
    manager, warnings = manager_and_warnings
    assert not [m for m in warnings if "overrides existing task" in m]
    for name in local.LOCAL_TASKS:
        assert Path(manager.task_index[name].yaml_path).parent == local.TASKS_DIR
    # lm-eval's own tags keep all their members and reach ours by name.
    assert manager.task_index["lambada"].tags >= {"lambada_openai", "lambada_standard"}
    assert manager.task_index["ai2_arc"].tags == {"arc_easy", "arc_challenge"}
    arc = manager.load(["ai2_arc"])["tasks"]
    assert {n: t.config.custom_dataset.__module__ for n, t in arc.items()} == {
        "arc_easy": loaders.__name__, "arc_challenge": loaders.__name__}


def test_counts_are_lm_evals(loaded, data_dir):
    assert {name: len(task.task_docs) for name, task in loaded.items()} == OFFICIAL_COUNTS
    for name, task in loaded.items():
        assert task.config.metadata[local.DATA_DIR_KEY] == str(data_dir.absolute()), name


@pytest.mark.parametrize("name", local.LOCAL_TASKS)
def test_config_is_lm_evals_but_for_the_data(name, loaded):
    ours = loaded[name]
    official = official_task(name, [official_doc0(name, Path(ours.config.metadata[local.DATA_DIR_KEY]))])
    for key in SCORING_KEYS:
        assert _comparable(ours.config[key]) == _comparable(official.config[key]), (name, key)
    assert ours.config.metadata["version"] == official.config.metadata["version"]
    eval_split = lambda cfg: cfg.test_split or cfg.validation_split  # noqa: E731
    assert eval_split(ours.config) == eval_split(official.config)


@pytest.mark.parametrize("name", local.LOCAL_TASKS)
def test_requests_and_scores_are_lm_evals(name, loaded, data_dir):
    ours = loaded[name]
    doc0 = official_doc0(name, data_dir)
    official = official_task(name, [doc0])
    our_doc = ours.task_docs[0]
    official_doc = official.eval_docs[0]
    assert {k: our_doc[k] for k in doc0} == doc0, "the loader's record 0 is not the official form"
    sent = requests_for(ours, our_doc)
    assert sent == requests_for(official, official_doc)
    results = fake_results(ours, len(sent))
    assert ours.process_results(our_doc, results) == official.process_results(official_doc, results)


def test_wikitext_pages_cover_the_file(data_dir):
    pages = [d["page"] for d in loaders.wikitext_docs(data_dir)]
    raw = (data_dir / "wikitext-2-raw/wiki.test.raw").read_text(encoding="utf-8")
    assert "\n".join(pages) == raw[len(" \n"):]
    assert all(loaders._is_article_title(p.split("\n", 1)[0]) for p in pages)


def test_openbookqa_tsv_matches_second_copy(loaded, data_dir):
    with (data_dir / "openbookqa/openbook_qa.jsonl").open(encoding="utf-8") as fh:
        second = [json.loads(line) for line in fh]
    docs = loaded["openbookqa"].task_docs
    assert [(d["question_stem"], d["choices"]["text"], "ABCD".index(d["answerKey"])) for d in docs] == [
        (r["query"], r["choices"], r["gold"]) for r in second]


def test_few_shot_is_refused_not_drawn_from_the_evaluated_split(loaded):
    task = loaded["arc_challenge"]
    with pytest.raises(OperatorError, match="zero-shot only"):
        task.fewshot_context(task.task_docs[0], num_fewshot=2)


def test_no_data_directory_names_the_flag_and_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(local.ENV_VAR, raising=False)
    monkeypatch.setattr(local, "default_data_dir", lambda: None)  # an installed package: no ../shared
    with pytest.raises(OperatorError) as err:
        local.resolve_tasks(["piqa"], None)
    message = str(err.value)
    assert "--data-dir DIR" in message and "$IIET_SHARED_DATA" in message and "\n" not in message
