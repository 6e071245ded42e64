import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny_models.py


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


class ReferenceOnCpu:
    """Inside the block the "cpu" backend runs the pure-PyTorch reference ops (kbit_hf/backends/reference.py); the
    compiled CPU library again afterwards."""

    def __enter__(self):
        from kbit_hf import ops
        from kbit_hf.backends import reference

        ops.register_backend("cpu", quantize=reference.quantize, dequantize=reference.dequantize,
                             linear=reference.linear, expert_linear=reference.expert_linear)

    def __exit__(self, *exc):
        from kbit_hf.backends import cpu

        cpu.register()
