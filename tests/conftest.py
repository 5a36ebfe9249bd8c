import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# The checkout's folders are deltaserve.*, never top-level packages: `python -m pytest` puts the root on sys.path,
# where our kernels/ would stand in for Hugging Face's `kernels`, which transformers imports.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on the CPU (must be set before any kernel is defined).
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter accepts any dot shape; Triton's compiler for NVIDIA GPUs refuses a contraction under 16 (32
    # for 8-bit operands; the device's Triton 3.6 asks 16 of fp32 too, where later releases ask 8). The interpreted
    # kernels are held to those bounds, so a shape only a GPU would refuse (a GDN key head of 8) fails here too.
    from triton.runtime import interpreter

    interpreter.interpreter_builder.codegen_fns["min_dot_size"] = \
        lambda lhs, rhs: (1, 1, 32 if lhs.scalar.primitive_bitwidth == 8 else 16)

torch.set_num_threads(min(2, os.cpu_count() or 1))

# Hypothesis draws the same examples on every run under CI (`derandomize`), so a failure there reproduces and a
# pass means the same cases passed; without CI it explores afresh each run. No example database either way: CI
# starts from a clean clone.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", database=None, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same random inputs on every run: a failure reproduces."""
    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _cpu_unless_gpu(request, monkeypatch):
    """EngineArgs' device defaults to "auto": the CPU tests keep to the CPU backend on a GPU machine too."""
    if "gpu" not in request.keywords:
        monkeypatch.setattr("deltaserve.devices.backend.default_device", lambda: "cpu")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from deltaserve.model.synthetic import write_checkpoint

    return write_checkpoint(str(tmp_path_factory.mktemp("tiny")), "tiny")


@pytest.fixture(scope="session")
def tiny_tp_ckpt(tmp_path_factory):
    from deltaserve.model.synthetic import write_checkpoint

    return write_checkpoint(str(tmp_path_factory.mktemp("tiny_tp")), "tiny-tp", sharded=3)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        for item in items:  # under xdist, one worker runs them all: they measure and fill the one device
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.xdist_group("gpu"))
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
