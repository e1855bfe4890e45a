"""lm-eval task configs that read the paper's zero-shot suite from local files, for clusters
without internet access.

The YAMLs in ``TASKS_DIR`` carry lm-eval 0.4.13's own names (``wikitext``, ``lambada_openai``,
``piqa``, ...) and its own prompts and metrics; only the dataset loading is ours. Passed to
``lm_eval.tasks.TaskManager(include_path=TASKS_DIR)`` they take the place of the built-in tasks
of the same name (lm-eval indexes ``include_path`` after its own tasks, and the later entry
wins), so built-in tags and groups that name them (``ai2_arc``, ``lambada``, ...) use the local
files too.

The data directory is a setting, read in this order: the ``iiet_data_dir`` entry of the
TaskManager's ``metadata`` (what ``task_manager(data_dir)`` sets, or ``lm_eval --metadata
'{"iiet_data_dir": "/path"}'``), then ``$IIET_SHARED_DATA``, then ``../shared/data`` beside the
repository. lm-eval hands a task's metadata to its ``custom_dataset`` function as keyword
arguments (``ConfigurableTask.download``), which is how the loaders in ``loaders.py`` see it.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional, Union

from megatron_iiet.errors import BadInput

if TYPE_CHECKING:
    import lm_eval.tasks

log = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).resolve().parent

DATA_DIR_KEY = "iiet_data_dir"
ENV_VAR = "IIET_SHARED_DATA"  # the one variable for the shared data folder (tests, scripts too)

@dataclass(frozen=True)
class LocalTask:
    """One local task: everything about it besides its lm-eval YAML (``<name>.yaml`` here, with
    ``custom_dataset: !function megatron_iiet.eval.tasks.loaders.<name>``, generated there)."""

    name: str
    files: tuple[str, ...]
    """Relative to the data directory; every file the converter opens."""
    split: str
    """The split lm-eval evaluates (the one the converted documents become)."""
    expected_count: int
    """That split's size in lm-eval's HF dataset: a local file that yields another count is not
    the same benchmark, and the loader says so."""
    converter: str
    """The function of loaders.py that turns the files into lm-eval's documents."""
    paper: bool = False
    """A column of the paper's zero-shot table (in this order)."""


TASKS: dict[str, LocalTask] = {t.name: t for t in (
    LocalTask("wikitext", ("wikitext-2-raw/wiki.test.raw",), "test", 62, "wikitext_docs",
              paper=True),
    LocalTask("lambada_openai", ("lambada/lambada_test.jsonl",), "test", 5153,
              "lambada_openai_docs", paper=True),
    LocalTask("piqa", ("piqa/valid.jsonl", "piqa/valid-labels.lst"), "validation", 1838,
              "piqa_docs", paper=True),
    LocalTask("hellaswag", ("hellaswag/hellaswag_val_full.txt.bz2",), "validation", 10042,
              "hellaswag_docs", paper=True),
    LocalTask("winogrande", ("winogrande/dev.jsonl",), "validation", 1267, "winogrande_docs",
              paper=True),
    LocalTask("arc_easy", ("arc/ARC-Easy/test.jsonl",), "test", 2376, "arc_easy_docs",
              paper=True),
    LocalTask("arc_challenge", ("arc/ARC-Challenge/test.jsonl",), "test", 1172,
              "arc_challenge_docs", paper=True),
    LocalTask("boolq", ("boolq/val.jsonl",), "validation", 3270, "boolq_docs"),
    LocalTask("openbookqa", ("openbookqa/test.tsv",), "test", 500, "openbookqa_docs"),
    LocalTask("sciq", ("sciq/test.json",), "test", 1000, "sciq_docs"),
)}

# Views of TASKS, for callers that want one property of every task.
PAPER_SUITE = tuple(name for name, task in TASKS.items() if task.paper)
LOCAL_TASKS = tuple(TASKS)
TASK_FILES: dict[str, tuple[str, ...]] = {name: task.files for name, task in TASKS.items()}

_OVERRIDE_MSG = "Task '%s' from %s overrides existing task from %s"

PathLike = Union[str, os.PathLike]


class LocalDataError(BadInput):
    """A task name, data directory or local evaluation file the operator must fix: one line."""


def _repo_root() -> Optional[Path]:
    root = TASKS_DIR.parents[2]
    # Only a source checkout has a sibling ../shared/data; an installed package's parents do not.
    return root if (root / "pyproject.toml").is_file() else None


def default_data_dir() -> Optional[Path]:
    """``$IIET_SHARED_DATA`` if set (whether or not it exists, so that a wrong setting is reported
    rather than silently replaced), else ``../shared/data`` beside the repository when present,
    else None."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    root = _repo_root()
    if root is not None:
        shared = (root.parent / "shared" / "data").resolve()
        if shared.is_dir():
            return shared
    return None


def _data_dir_and_origin(data_dir: Optional[PathLike]) -> tuple[Optional[Path], str]:
    """The directory and a phrase saying which setting chose it, for messages."""
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir).expanduser(), "given as the data directory"
    if os.environ.get(ENV_VAR):
        return default_data_dir(), f"from ${ENV_VAR}"
    found = default_data_dir()
    return found, "the default ../shared/data beside the repository"


def _no_data_dir_message() -> str:
    return (f"no evaluation data directory: pass --data-dir DIR (training: eval.tasks_data_dir; "
            f"lm_eval: --metadata '{{\"{DATA_DIR_KEY}\": \"DIR\"}}') or set ${ENV_VAR} to the "
            f"folder holding arc/, piqa/, ...; the default ../shared/data beside the repository "
            f"was not found")


def missing_files(task: str, data_dir: Path) -> list[Path]:
    return [data_dir / rel for rel in TASK_FILES[task] if not (data_dir / rel).is_file()]


def resolve_tasks(names: Iterable[str], data_dir: Optional[PathLike] = None) -> list[str]:
    """Task names as given (comma-separated entries allowed), "paper" expanded to PAPER_SUITE,
    duplicates dropped. Raises LocalDataError, an OperatorError of one line, for a name that is
    not a local task, or a task whose data file is missing in ``data_dir`` (None: the default)."""
    wanted: list[str] = []
    for entry in names:
        for name in (part.strip() for part in str(entry).split(",")):
            if not name:
                continue
            if name == "paper":
                expanded: Iterable[str] = PAPER_SUITE
            elif name in LOCAL_TASKS:
                expanded = (name,)
            else:
                close = difflib.get_close_matches(name, ("paper",) + LOCAL_TASKS, n=3, cutoff=0.5)
                hint = f"did you mean {', '.join(close)}? " if close else ""
                raise LocalDataError(f"unknown evaluation task {name!r}: {hint}choose from paper, "
                                    f"{', '.join(LOCAL_TASKS)}")
            wanted.extend(t for t in expanded if t not in wanted)
    if not wanted:
        raise LocalDataError(f"no evaluation task given: choose from paper, {', '.join(LOCAL_TASKS)}")
    directory, origin = _data_dir_and_origin(data_dir)
    if directory is None:
        raise LocalDataError(_no_data_dir_message())
    for task in wanted:
        missing = missing_files(task, directory)
        if missing:
            raise LocalDataError(f"{task} needs {missing[0]}, which does not exist (evaluation data "
                                f"directory {directory}, {origin}; set another with --data-dir or "
                                f"${ENV_VAR})")
    return wanted


class _DropLocalOverrideNotes(logging.Filter):
    """lm-eval warns once per task that include_path replaces a built-in one; for ours that is
    the intent, so one summary line replaces the ten warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _OVERRIDE_MSG and isinstance(record.args, tuple) and len(record.args) == 3:
            name, new_path = record.args[0], Path(str(record.args[1]))
            return not (name in LOCAL_TASKS and new_path.parent == TASKS_DIR)
        return True


def task_manager(data_dir: Optional[PathLike] = None,
                 include_defaults: bool = True) -> "lm_eval.tasks.TaskManager":
    """An lm-eval TaskManager with lm-eval's built-in tasks plus ours (which replace the
    built-ins of the same names), its metadata pointing our loaders at ``data_dir`` (or
    ``default_data_dir()``). Without any data directory the manager is still built; loading a
    local task then raises LocalDataError (an OperatorError). ``include_defaults=False``
    indexes our tasks alone: milliseconds instead of the >10 s of lm-eval's ~15k files."""
    from lm_eval.tasks import TaskManager

    directory, _ = _data_dir_and_origin(data_dir)
    metadata = {} if directory is None else {DATA_DIR_KEY: str(directory.absolute())}
    index_log = logging.getLogger("lm_eval.tasks._index")
    quiet = _DropLocalOverrideNotes()
    index_log.addFilter(quiet)
    try:
        manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=include_defaults,
                              metadata=metadata)
    finally:
        index_log.removeFilter(quiet)
    log.info("lm-eval tasks %s read local files under %s", ", ".join(LOCAL_TASKS),
             directory if directory is not None else "(no data directory set)")
    return manager
