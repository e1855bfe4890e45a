"""A split too small for a corpus of few, long documents (books) names one that works."""

import re

import pytest

from tests.training.conftest import base_overrides


def test_too_small_validation_share_names_a_split_that_works(tiny_data, tmp_path):
    from megatron_iiet.errors import BadInput
    from megatron_iiet.training.config import load_config
    from megatron_iiet.training.data import build_datasets, resolve_sources

    cfg = load_config(None, base_overrides(tiny_data, tmp_path / "r", **{"data.split": "99,1,0"}))
    with pytest.raises(BadInput, match="megatron splits by document") as refused:
        build_datasets(cfg, resolve_sources(cfg))
    working = re.search(r"data\.split=(\d+,\d+,0)", str(refused.value)).group(1)
    cfg = load_config(None, base_overrides(tiny_data, tmp_path / "r", **{"data.split": working}))
    train, valid = build_datasets(cfg, resolve_sources(cfg))
    assert len(train) > 0 and len(valid) > 0
