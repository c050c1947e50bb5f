"""``python -m moe_jax.bench <subcommand>``: benchmarks that print one table per run.

Subcommands: ``gemm`` (grouped/dense GEMMs: DeepGEMM custom calls vs jax.lax.ragged_dot; needs an
SM90 CUDA GPU), ``layer`` (the routed MoE layer: per-stage times, end to end, error, peak temporary
memory; ``--small`` runs anywhere). Each takes ``--json PATH`` and ``--plot PATH`` (PNG); the table
goes to stdout, progress to stderr. ``python -m moe_jax.bench <subcommand> --help`` for the options.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_jax.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    from moe_jax.bench import gemm

    gemm.add_arguments(sub.add_parser("gemm", help="grouped GEMMs: DeepGEMM custom calls vs ragged_dot"))
    from moe_jax.bench import layer

    layer.add_arguments(sub.add_parser("layer", help="whole routed layer: stages, end to end, error, memory"))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
