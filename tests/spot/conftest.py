"""The drafter tests' fixtures (tiny random targets), for the spot training tests."""

from tests.drafter.conftest import llama, qwen2, target  # noqa: F401 -- fixtures, found by name
