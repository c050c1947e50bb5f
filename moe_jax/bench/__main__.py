"""``python -m moe_jax.bench <subcommand>``: benchmarks that print one table per run.

Subcommands: ``gemm`` (grouped/dense GEMMs: DeepGEMM custom calls vs jax.lax.ragged_dot; needs an
SM90 CUDA GPU), ``layer`` (the routed MoE layer: per-stage times, end to end, error, peak temporary
memory; without a GPU it runs scaled shapes), ``triton`` (bandwidth of the Triton kernels and their
tiling configs; needs a CUDA GPU), ``parallel`` (the shard_map patterns on whatever devices jax
sees), ``load`` (writes full-size synthetic V3/V4 layers and loads them: seconds, GB/s, peak host
RSS; ``--small`` for a scaled run), ``fused`` (the fused MoE kernel's template options side by side,
kernel time; needs an SM90 GPU), ``timeline`` (a steady stream of the layer kernel by kernel:
durations, the idle gaps between them, start-up; needs an SM90 GPU), ``w4a8`` (the W4A8 masked GEMM's
CUDA kernel tilings beside DeepGEMM FP8 and the Triton kernel at V4's slice, with the layer's own rows per
expert; needs an SM90 GPU). The table goes to stdout, progress to stderr. Exit status: 0
when every requested row ran, 1 when one failed, 2 when the machine cannot run the subcommand.
``python -m moe_jax.bench <subcommand> --help`` for the options.
"""

from __future__ import annotations

import argparse
import sys

SUBCOMMANDS = {  # name: (module, help)
    "gemm": ("gemm", "grouped GEMMs: DeepGEMM custom calls vs ragged_dot"),
    "layer": ("layer", "whole routed layer: stages, end to end, error, memory"),
    "triton": ("triton_kernels", "Triton kernels: bandwidth per kernel and tiling config"),
    "parallel": ("parallel", "parallel patterns on the devices jax sees"),
    "load": ("load", "checkpoint loading: seconds, GB/s from disk, peak host RSS"),
    "fused": ("fused", "the fused MoE kernel's template options side by side (kernel time)"),
    "timeline": ("timeline", "a steady stream of the layer, kernel by kernel: durations and idle gaps"),
    "w4a8": ("w4a8", "the W4A8 masked GEMM's CUDA tilings beside DeepGEMM FP8 and Triton at V4's slice"),
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    parser = argparse.ArgumentParser(prog="python -m moe_jax.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_) in SUBCOMMANDS.items():
        importlib.import_module(f"moe_jax.bench.{module}").add_arguments(sub.add_parser(name, help=help_))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
