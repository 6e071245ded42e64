"""kbit-bench (or python -m kbit_hf.bench) <subcommand>

  kernels   per-layer kernel times: kbit dequantize and fused GEMV (K = 2..5) against bf16 cuBLAS, torch's int4
            tinygemm (group 32) and bitsandbytes NF4 (when importable), in microseconds and % of copy bandwidth
  generate  end-to-end `generate`: load time, memory, time to first token, prefill and decode tokens/s, eager and
            static cache, on named model shapes (random weights) or a local checkpoint, against bf16,
            bitsandbytes NF4 and torchao int4; table, JSON and PNG chart
  experts   one MoE experts block (Qwen3-30B-A3B, Mixtral-8x7B, gpt-oss-20b shapes) at 1..8192 tokens: kbit's expert
            kernels against bf16 experts through torch._grouped_mm
  train     a LoRA training step (QLoRA): tokens/s and peak memory against bf16 LoRA and bitsandbytes NF4
  calibrate wall time and peak device memory of calibrated quantization of a named shape
  plot      the chart and table of a `generate` JSON file
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="kbit-bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("kernels", help="kernel micro-benchmarks (needs a CUDA GPU and the compiled library)")
    pk.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336,28672x8192",
                    help="comma-separated OUTxIN weight shapes")
    pk.add_argument("--m", default="1,2,4,8,16,32,64", help="comma-separated activation rows M")
    pk.add_argument("--k", default="2,3,4,5", help="comma-separated K")
    pk.add_argument("--repeats", type=int, default=30, help="graph replays; the median is reported")
    pk.add_argument("--dequant-shape", default="8192x8192", help="OUTxIN for the dequantize benchmark (>= 64M elements)")
    pk.add_argument("--json", default=None, help="also write the results as JSON here")
    pg = sub.add_parser("generate", help="end-to-end generation benchmark (CUDA GPU; also runs on CPU, slowly)")
    from .generate import add_arguments

    add_arguments(pg)
    pe = sub.add_parser("experts", help="MoE experts-block micro-benchmark (needs a CUDA GPU and the compiled library)")
    from .experts import add_arguments as add_experts_arguments

    add_experts_arguments(pe)
    pt = sub.add_parser("train", help="LoRA training-step speed and memory (QLoRA) on a named shape")
    from .train import add_arguments as add_train_arguments

    add_train_arguments(pt)
    pc = sub.add_parser("calibrate", help="time and peak memory of calibrated quantization on a named shape")
    from .calibrate import add_arguments as add_calibrate_arguments

    add_calibrate_arguments(pc)
    pp = sub.add_parser("plot", help="chart + table from a `generate` JSON file")
    pp.add_argument("json_in")
    pp.add_argument("png_out")
    args = parser.parse_args(argv)
    if args.cmd == "kernels":
        from .kernels import run

        return run(args)
    if args.cmd == "generate":
        from .generate import run

        return run(args)
    if args.cmd == "experts":
        from .experts import run as run_experts

        return run_experts(args)
    if args.cmd == "train":
        from .train import run as run_train

        return run_train(args)
    if args.cmd == "calibrate":
        from .calibrate import run as run_calibrate

        return run_calibrate(args)
    if args.cmd == "plot":
        from .generate import plot_main

        return plot_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
