import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_random():
    """A randomly initialised tiny backbone (no pretraining, instant)."""
    import common
    torch.manual_seed(0)
    return common.load_model("tiny", "random")
