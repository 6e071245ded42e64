"""Implementations of the kbit ops (kbit_hf/ops.py): `reference` (pure PyTorch, every device, the ground truth)
and `cuda` (the compiled kernels of csrc/). A new backend (another device type, a new kernel family) registers its
implementations with `kbit_hf.ops.register_backend` and, for a layout of its own, `kbit_hf.ops.register_layout`."""
