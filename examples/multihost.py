"""One sharded MoE layer under `jax.distributed`: the same program on every process (host).

On one machine, N CPU processes on 127.0.0.1 (gloo collectives), 2 CPU devices each:

    python examples/multihost.py --local 2

On a cluster, run on every host:

    python examples/multihost.py --coordinator HOST0:12345 --num-processes 2 --process-id I
    python examples/multihost.py --cluster     # jax.distributed reads SLURM / Open MPI's variables

Every process builds the same global inputs from fixed seeds, runs each pattern over the global
mesh, and process 0 checks the result against the single-device `moe_forward` (every process exits
with status 1 if a pattern's max error relative to max |moe_forward| exceeds TOLERANCE); `--out`
saves the results.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

TOLERANCE = 2**-6  # bf16 outputs, partial sums added in another order
PATTERNS = {
    "dp_ep-normal": dict(pattern="dp_ep", moe_axes=("x",)),
    "dp_ep-ring": dict(pattern="dp_ep", moe_axes=("x",), ep_mode="ring"),
    "dp_tp": dict(pattern="dp_tp", moe_axes=("x",)),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(n: int, devices_per_process: int, extra: list[str], timeout: float) -> int:
    """Start n CPU processes of this script on 127.0.0.1; returns the worst exit code."""
    port = _free_port()
    # the caller's other XLA flags stay (the processes compile as the caller does); the device count is ours
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"]))
    procs = [subprocess.Popen([sys.executable, __file__, "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", str(n), "--process-id", str(i), "--cpu", *extra],
                              env=env) for i in range(n)]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return 124
    return max(codes)


def build_inputs(n: int, m: int):
    """Same config, weights and tokens on every process (fixed seeds): (config, params, x (n*m, H)
    f32, lengths (n,) int32 real rows per device for the DP pattern)."""
    import jax
    import numpy as np

    from moe_jax import MoEConfig, init_params

    # 2 experts per device: the 8 expert groups shrink to a divisor of 2n (fit_routing)
    config = MoEConfig.deepseek_v3().scaled(num_experts=2 * n, top_k=4, hidden_size=256,
                                            intermediate_size=64 * n, recipe="bf16", fit_routing=True)
    params = init_params(jax.random.key(0), config)
    x = np.asarray(jax.random.normal(jax.random.key(1), (n * m, config.hidden_size)), np.float32)
    lengths = np.random.default_rng(2).integers(1, m + 1, n).astype(np.int32)
    return config, params, x, lengths


def run_patterns(mesh, config, params, x, lengths, names=tuple(PATTERNS)) -> dict:
    """The patterns `names` (keys of PATTERNS) over `mesh` (one axis "x"):
    {name: y (n*m, H) global bf16 array}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from moe_jax.parallel import ParallelConfig, place, shard_params, sharded_moe_forward

    f = jax.jit(sharded_moe_forward, static_argnames=("config", "mesh", "pc"))
    out = {}
    for name in names:
        pc = ParallelConfig(**PATTERNS[name])
        # each process uploads only the shards its own devices hold
        placed = shard_params(params, config, mesh, pc)
        xg = place(np.asarray(jnp.asarray(x, jnp.bfloat16)), mesh, P("x", None))
        num_tokens = place(lengths, mesh, P()) if pc.pattern == "dp_tp" else None
        out[name] = f(xg, placed, config=config, mesh=mesh, pc=pc, num_tokens=num_tokens)
    return out


def run(args) -> None:
    import jax

    if args.cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator:
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes, process_id=args.process_id)
    else:
        jax.distributed.initialize()

    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    from moe_jax import moe_forward

    mesh = Mesh(np.array(jax.devices()), ("x",))  # every process's devices: one global mesh
    config, params, x, lengths = build_inputs(mesh.size, args.tokens_per_device)
    m = args.tokens_per_device
    results = {name: np.asarray(multihost_utils.process_allgather(y, tiled=True), np.float32)
               for name, y in run_patterns(mesh, config, params, x, lengths, args.patterns).items()}
    n = mesh.size

    failed = []
    if jax.process_index() == 0:
        ref = np.asarray(jax.jit(moe_forward, static_argnames=("config",))(
            jnp.asarray(x, jnp.bfloat16), params, config=config).astype(jnp.float32))
        real = (np.arange(m)[None, :] < lengths[:, None]).reshape(-1)
        for name, y in results.items():
            want = np.where(real[:, None], ref, 0) if name == "dp_tp" else ref
            err = np.abs(y - want).max() / np.abs(ref).max()
            print(f"{name}: {jax.process_count()} processes, {n} devices, max |y - moe_forward| / "
                  f"max |moe_forward| = {err:.2e}", flush=True)
            if not err <= TOLERANCE:  # also catches nan
                failed.append(name)
        if args.out:
            np.savez(args.out, x=x, lengths=lengths, **results)
        if failed:
            print(f"FAILED (error above {TOLERANCE:.1e}): {failed}", flush=True)
    # every process learns the verdict, and none leaves before the others are done
    verdict = multihost_utils.broadcast_one_to_all(np.int32(len(failed)))
    multihost_utils.sync_global_devices("done")
    if int(verdict):
        raise SystemExit(1)
    if jax.process_index() == 0:
        print(f"OK: {len(results)} patterns over {jax.process_count()} processes agree with the "
              f"single-device layer", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--local", type=int, default=0, help="start this many CPU processes here")
    ap.add_argument("--devices-per-process", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    ap.add_argument("--num-processes", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("--cluster", action="store_true",
                    help="let jax.distributed detect the cluster (SLURM, Open MPI) instead of the three flags")
    ap.add_argument("--cpu", action="store_true", help="CPU devices: gloo collectives")
    ap.add_argument("--tokens-per-device", type=int, default=6)
    ap.add_argument("--out", default=None, help="process 0 saves x and every result here (.npz)")
    ap.add_argument("--patterns", default=",".join(PATTERNS), help=f"comma separated, of {list(PATTERNS)}")
    args = ap.parse_args()
    if not (args.local or args.coordinator or args.cluster):
        # jax.distributed.initialize() without a coordinator or a detected cluster fails deep in JAX
        ap.print_usage(sys.stderr)
        sys.stderr.write("\nchoose where the processes come from, e.g. two CPU processes on this machine:\n\n"
                         f"    python {sys.argv[0]} --local 2\n\n"
                         "or --coordinator HOST:PORT --num-processes N --process-id I on every host, "
                         "or --cluster under SLURM / Open MPI (see --help)\n")
        sys.exit(2)
    args.patterns = tuple(args.patterns.split(","))
    unknown = set(args.patterns) - set(PATTERNS)
    if unknown:
        ap.error(f"--patterns: unknown {sorted(unknown)}; choose from {list(PATTERNS)}")
    if args.local:
        extra = ["--tokens-per-device", str(args.tokens_per_device), "--patterns", ",".join(args.patterns)]
        if args.out:
            extra += ["--out", args.out]
        sys.exit(launch_local(args.local, args.devices_per_process, extra, args.timeout))
    run(args)


if __name__ == "__main__":
    main()
