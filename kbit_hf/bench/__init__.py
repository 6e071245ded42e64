"""Benchmarks: `python -m kbit_hf.bench kernels` (kernel micro-benchmarks); room for more subcommands."""
