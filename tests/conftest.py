import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on the CPU (must be set before any kernel is defined).
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, os.cpu_count() or 1))


def _hide_hub_kernels_from_transformers() -> None:
    """transformers (5.25 on) depends on Hugging Face's `kernels` distribution and imports it when it is installed,
    but our top-level `kernels` package (the Triton kernels) is the one that import finds, and it fails. The
    reference model needs no hub kernels: tell transformers that they are absent."""
    try:
        import transformers.utils.import_utils as import_utils
    except ImportError:  # transformers is optional for the tests that do not compare with it
        return
    import_utils.is_kernels_available = lambda *args, **kwargs: False


_hide_hub_kernels_from_transformers()


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same random inputs on every run: a failure reproduces."""
    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from tools.make_checkpoint import write_checkpoint

    return write_checkpoint(str(tmp_path_factory.mktemp("tiny")), "tiny")


@pytest.fixture(scope="session")
def tiny_tp_ckpt(tmp_path_factory):
    from tools.make_checkpoint import write_checkpoint

    return write_checkpoint(str(tmp_path_factory.mktemp("tiny_tp")), "tiny-tp", sharded=3)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
