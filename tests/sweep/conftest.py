"""The sweep tests share the training tests' tiny corpus."""

from tests.training.conftest import tiny_data  # noqa: F401
