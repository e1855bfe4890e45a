"""Only the C extension is declared here; everything else is in pyproject.toml.

`megatron_iiet.data._segment_table` is the preprocessing fast path (megatron_iiet/data/bpe_cache.py).
It is optional: where it cannot be compiled, preprocessing encodes each document whole (same
output, slower) and says why.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("megatron_iiet.data._segment_table", ["megatron_iiet/data/_segment_table.c"], optional=True)])
