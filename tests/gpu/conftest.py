"""tests/gpu also runs where pytest-timeout is not installed (the GPU machine's own Python): the marker is declared
so that --strict-markers accepts it; each test bounds its subprocesses itself."""
import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's bound, where that plugin is installed")
