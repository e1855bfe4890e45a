import os
import warnings

import pytest
import torch

# megatron-core warns at import about every optional CUDA extension it does not find.
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture
def one_torch_thread():
    """Tiny tensors: one thread avoids oversubscribing the 2 shared cores (directories whose
    tests are all tiny use it for every test)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
