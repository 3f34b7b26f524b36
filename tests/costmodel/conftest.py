import pytest

from configs import load_config


@pytest.fixture(scope="session")
def small_cfg():
    """paper-3b shapes on a small DualPipe layout (fast to simulate)."""
    return load_config("paper-3b", {"parallel": {"ranks": 4, "microbatches": 64, "expert_parallel": 8}})
