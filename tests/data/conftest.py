"""Fixtures for the data-pipeline tests: a small tokenizer trained once per session, and the
location of the shared real-data directory (../shared/data, or $IIET_SHARED_DATA)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.data.helpers import shared_data_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not (path / "gutenberg").is_dir():
        pytest.skip(f"shared data not found at {path} (set IIET_SHARED_DATA to the directory holding gutenberg/)")
    return path


@pytest.fixture(scope="session")
def small_tokenizer(tmp_path_factory) -> Path:
    """BPE, vocab 600, trained on 1 MB of the built-in corpus (about a second)."""
    from megatron_iiet.data.tokenizer_training import TokenizerTrainingConfig, train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(TokenizerTrainingConfig(inputs=("builtin:python-stdlib:1MB",), output_dir=str(out), vocab_size=600))
    return out / "tokenizer.model"
