"""The ``custom_dataset`` functions of the local task YAMLs: each reads its file(s) from the data
directory and returns a ``datasets.DatasetDict`` whose split and fields are those of the HF
dataset lm-eval's own task loads, so that lm-eval's unchanged prompt templates apply.

lm-eval calls them as ``custom_dataset(**metadata, **dataset_kwargs)``, so every keyword of the
task's metadata arrives here (version, config_source, the model arguments on the CLI); only
``iiet_data_dir`` is ours. The ``*_docs(data_dir)`` functions do the conversion alone and return
plain lists of dicts.
"""

from __future__ import annotations

import bz2
import csv
import json
import logging
import re
from pathlib import Path
from typing import Any, Callable, Optional

from lm_eval.api.samplers import ContextSampler

from megatron_iiet.eval.tasks import (
    DATA_DIR_KEY,
    ENV_VAR,
    TASK_FILES,
    TASKS,
    LocalDataError,
    _data_dir_and_origin,
    _no_data_dir_message,
    missing_files,
)

log = logging.getLogger(__name__)


def _directory(metadata: dict[str, Any]) -> tuple[Path, str]:
    given = metadata.get(DATA_DIR_KEY)
    if given:
        return Path(str(given)).expanduser(), f"metadata {DATA_DIR_KEY}"
    directory, origin = _data_dir_and_origin(None)
    if directory is None:
        raise LocalDataError(_no_data_dir_message())
    return directory, origin


def _jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise LocalDataError(f"{path}:{lineno}: not a JSON line ({err.msg})") from None
    return rows


def _field(row: dict, key: str, path: Path, index: int) -> Any:
    try:
        return row[key]
    except (KeyError, TypeError):
        raise LocalDataError(f"{path}: record {index} has no {key!r} field") from None


# ---------------------------------------------------------------------------- WikiText-2

def _is_article_title(line: str) -> bool:
    # Section headings (" = = Career = = ") collapse to "== Career ==" and so stop looking like
    # an article's " = Title = " line; this is how EleutherAI/wikitext_document_level cuts pages.
    collapsed = line.replace("= = =", "===").replace("= =", "==").strip()
    return collapsed.startswith("= ") and collapsed.endswith(" =")


def wikitext_docs(data_dir: Path) -> list[dict]:
    path = data_dir / TASK_FILES["wikitext"][0]
    # Text mode and "\n" splitting, as the HF dataset's builder reads the raw file; a page keeps
    # its lines' leading and trailing spaces, the word count of lm-eval's metric depends on them.
    lines = path.read_text(encoding="utf-8").split("\n")
    pages: list[str] = []
    current: list[str] = []
    for line in lines:
        if _is_article_title(line):
            page = "\n".join(current)
            # Only whatever precedes the first title (a blank line) is dropped as empty.
            if page.strip():
                pages.append(page)
            current = []
        current.append(line)
    pages.append("\n".join(current))
    return [{"page": page} for page in pages]


# ---------------------------------------------------------------------------- LAMBADA

def lambada_openai_docs(data_dir: Path) -> list[dict]:
    path = data_dir / TASK_FILES["lambada_openai"][0]
    return [{"text": _field(row, "text", path, i)} for i, row in enumerate(_jsonl(path))]


# ---------------------------------------------------------------------------- PIQA

def piqa_docs(data_dir: Path) -> list[dict]:
    questions_path, labels_path = (data_dir / rel for rel in TASK_FILES["piqa"])
    questions = _jsonl(questions_path)
    labels = [line.strip() for line in labels_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(labels) != len(questions):
        raise LocalDataError(f"{labels_path} has {len(labels)} labels for the {len(questions)} questions "
                             f"of {questions_path}")
    docs = []
    for i, (row, label) in enumerate(zip(questions, labels)):
        if label not in ("0", "1"):
            raise LocalDataError(f"{labels_path}:{i + 1}: label {label!r} is not 0 or 1")
        docs.append({key: _field(row, key, questions_path, i) for key in ("goal", "sol1", "sol2")}
                    | {"label": int(label)})
    return docs


# ---------------------------------------------------------------------------- HellaSwag

# The end of the last complete sentence: lm-eval's ctx_b follows it.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


def split_context(ctx: str) -> tuple[str, str]:
    """(ctx_a, ctx_b) guessed from a context in which they were joined by one space.

    HellaSwag's ctx_b (ActivityNet rows) is the unfinished start of the sentence the endings
    complete; lm-eval capitalises it. So the text after the last sentence end is taken as ctx_b
    when it is unfinished (has no sentence-final mark itself); a context that ends a sentence (the
    WikiHow rows) gets an empty ctx_b."""
    ends = list(_SENTENCE_END.finditer(ctx))
    if not ends:
        return ctx, ""
    tail = ctx[ends[-1].end():]
    if not tail or re.search(r"[.!?]", tail):
        return ctx, ""
    return ctx[:ends[-1].end()].rstrip(), tail


def hellaswag_docs(data_dir: Path) -> list[dict]:
    path = data_dir / TASK_FILES["hellaswag"][0]
    try:
        lines = bz2.decompress(path.read_bytes()).decode("utf-8").split("\n")
    except (OSError, ValueError) as err:
        raise LocalDataError(f"{path}: not a bzip2 file of UTF-8 text ({err})") from None
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise LocalDataError(f"{path}: {len(lines)} lines, not 6 per task")
    docs = []
    for start in range(0, len(lines), 6):
        head, label, *endings = lines[start:start + 6]
        activity_label, sep, ctx = head.partition(": ")
        if not sep or label not in ("0", "1", "2", "3"):
            raise LocalDataError(f"{path}:{start + 1}: not an 'activity_label: context' line "
                                 f"followed by a 0-3 label")
        ctx_a, ctx_b = split_context(ctx)
        # label stays a string, as in Rowan/hellaswag; lm-eval's process_docs reads these fields.
        docs.append({"activity_label": activity_label, "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": ctx,
                     "endings": endings, "label": label})
    return docs


# ---------------------------------------------------------------------------- WinoGrande

def winogrande_docs(data_dir: Path) -> list[dict]:
    path = data_dir / TASK_FILES["winogrande"][0]
    docs = []
    for i, row in enumerate(_jsonl(path)):
        answer = str(_field(row, "answer", path, i))
        if answer not in ("1", "2"):
            raise LocalDataError(f"{path}: record {i} has answer {answer!r}, not 1 or 2")
        docs.append({"sentence": _field(row, "sentence", path, i), "option1": _field(row, "option1", path, i),
                     "option2": _field(row, "option2", path, i), "answer": answer})
    return docs


# ---------------------------------------------------------------------------- ARC

def _arc_doc(row: dict, path: Path, index: int) -> dict:
    question = _field(row, "question", path, index)
    if isinstance(question, dict):
        # AI2's release: {"question": {"stem", "choices": [{"text", "label"}, ...]}}
        choices = _field(question, "choices", path, index)
        texts, labels = [c["text"] for c in choices], [c["label"] for c in choices]
        question = _field(question, "stem", path, index)
    else:
        choices = _field(row, "choices", path, index)
        texts, labels = list(choices["text"]), list(choices["label"])
    answer = _field(row, "answerKey", path, index)
    if answer not in labels:
        raise LocalDataError(f"{path}: record {index} has answerKey {answer!r}, not one of {labels}")
    return {"id": _field(row, "id", path, index), "question": question,
            "choices": {"text": texts, "label": labels}, "answerKey": answer}


def arc_easy_docs(data_dir: Path) -> list[dict]:
    path = data_dir / TASK_FILES["arc_easy"][0]
    return [_arc_doc(row, path, i) for i, row in enumerate(_jsonl(path))]


def arc_challenge_docs(data_dir: Path) -> list[dict]:
    path = data_dir / TASK_FILES["arc_challenge"][0]
    return [_arc_doc(row, path, i) for i, row in enumerate(_jsonl(path))]


# ---------------------------------------------------------------------------- BoolQ

_BOOLQ_LABELS = {"false": 0, "true": 1, False: 0, True: 1, 0: 0, 1: 1}


def boolq_docs(data_dir: Path) -> list[dict]:
    path = data_dir / TASK_FILES["boolq"][0]
    docs = []
    for i, row in enumerate(_jsonl(path)):
        raw = _field(row, "label", path, i)
        key = raw.lower() if isinstance(raw, str) else raw
        if key not in _BOOLQ_LABELS:
            raise LocalDataError(f"{path}: record {i} has label {raw!r}, not true or false")
        docs.append({"question": _field(row, "question", path, i), "passage": _field(row, "passage", path, i),
                     "idx": int(row.get("idx", i)), "label": _BOOLQ_LABELS[key]})
    return docs


# ---------------------------------------------------------------------------- OpenBookQA

_OBQA_CHOICES = re.compile(r"\(A\) (.*?) \(B\) (.*?) \(C\) (.*?) \(D\) (.*)", re.DOTALL)


def openbookqa_docs(data_dir: Path) -> list[dict]:
    path = data_dir / TASK_FILES["openbookqa"][0]
    with path.open(encoding="utf-8", newline="") as fh:
        rows = list(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    header, body = rows[0], rows[1:]
    expected = ["ID", "Question Stem", "Choices", "Complete Question", "Answer Key"]
    if header != expected:
        raise LocalDataError(f"{path}: header {header}, expected {expected}")
    docs = []
    for lineno, row in enumerate(body, 2):
        if len(row) != len(expected):
            raise LocalDataError(f"{path}:{lineno}: {len(row)} columns, expected {len(expected)}")
        ident, stem, choices, _, answer = row
        match = _OBQA_CHOICES.fullmatch(choices)
        if match is None or answer not in "ABCD" or len(answer) != 1:
            raise LocalDataError(f"{path}:{lineno}: choices not '(A) .. (B) .. (C) .. (D) ..' "
                                 f"or answer not A-D")
        docs.append({"id": ident, "question_stem": stem,
                     "choices": {"text": list(match.groups()), "label": ["A", "B", "C", "D"]},
                     "answerKey": answer})
    return docs


# ---------------------------------------------------------------------------- SciQ

_SCIQ_INSTRUCTION = re.compile(
    r"Please choose the correct answer to the question: (?P<question>.*?)\n\n"
    r"Answer1: (?P<a1>.*?)\nAnswer2: (?P<a2>.*?)\nAnswer3: (?P<a3>.*?)\nAnswer4: (?P<a4>.*?)\n\n"
    r"Answer format: answer1/answer2/answer3/answer4", re.DOTALL)


def sciq_docs(data_dir: Path) -> list[dict]:
    path = data_dir / TASK_FILES["sciq"][0]
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise LocalDataError(f"{path}: not JSON ({err.msg} at line {err.lineno})") from None
    docs = []
    for i, row in enumerate(rows):
        match = _SCIQ_INSTRUCTION.fullmatch(_field(row, "instruction", path, i))
        answer = str(_field(row, "answer", path, i))
        if match is None or answer not in ("answer1", "answer2", "answer3", "answer4"):
            raise LocalDataError(f"{path}: record {i} is not the 'question + Answer1..4' "
                                 f"instruction with answer answerN")
        options = [match.group(f"a{n}") for n in range(1, 5)]
        correct = options.pop(int(answer[-1]) - 1)
        # The options are shuffled in this file, so which distractor is which number is unknown;
        # the choice order changes no score (each choice is scored on its own), only how exact
        # ties would break. There is no support paragraph: lm-eval's prompt gets "".
        docs.append({"question": match.group("question"), "distractor3": options[2],
                     "distractor1": options[0], "distractor2": options[1],
                     "correct_answer": correct, "support": ""})
    return docs


# ---------------------------------------------------------------------------- few-shot

def no_fewshot_samples() -> list[dict]:
    """The YAMLs' few-shot pool: empty. Without it lm-eval would draw examples from the evaluated
    split itself (no train split is stored locally), and would copy that split into a list at
    every task load."""
    return []


class ZeroShotOnly(ContextSampler):
    """A few-shot sampler that refuses: asking a local task for examples is an operator error,
    not something to answer with examples from the evaluated split."""

    def sample(self, n: int, eval_doc=None, df=None, **kwargs) -> list[dict]:
        if n <= 0:
            return []
        raise LocalDataError(f"the local evaluation tasks are zero-shot only ({n}-shot asked): the "
                             f"local data has no train split to draw examples from")


# ---------------------------------------------------------------------------- custom_dataset

# (split, converter) of every task, from its LocalTask record.
DOCS: dict[str, tuple[str, Callable[[Path], list[dict]]]] = {
    name: (task.split, globals()[task.converter]) for name, task in TASKS.items()}


def load_docs(task: str, data_dir: Optional[Path] = None,
              origin: str = "given as the data directory") -> list[dict]:
    """The converted documents of ``task``, after checking that its files exist."""
    if data_dir is None:
        found, origin = _data_dir_and_origin(None)
        if found is None:
            raise LocalDataError(_no_data_dir_message())
        data_dir = found
    missing = missing_files(task, data_dir)
    if missing:
        raise LocalDataError(f"{task} needs {missing[0]}, which does not exist (evaluation data directory "
                             f"{data_dir}, {origin}; set another with --data-dir, metadata {DATA_DIR_KEY} or ${ENV_VAR})")
    docs = DOCS[task][1](data_dir)
    if len(docs) != TASKS[task].expected_count:
        log.warning("%s: %d documents in %s, lm-eval's split has %d; the scores are not comparable",
                    task, len(docs), data_dir, TASKS[task].expected_count)
    return docs


def _dataset_dict(task: str, metadata: dict[str, Any]):
    import datasets

    directory, origin = _directory(metadata)
    split, _ = DOCS[task]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(load_docs(task, directory, origin))})


def _custom_dataset(task: str) -> Callable[..., Any]:
    """The ``custom_dataset`` function a task's YAML names (``loaders.<task>``)."""
    def load(**metadata):
        return _dataset_dict(task, metadata)

    load.__name__ = load.__qualname__ = task
    load.__doc__ = f"lm-eval's {task} documents from the local files."
    return load


for _name in TASKS:
    globals()[_name] = _custom_dataset(_name)
