"""Checkpoint loading at full size: seconds, GB/s from disk and peak host RSS per load.

Writes one synthetic DeepSeek-V3 FP8 MoE layer (256 experts, H 7168, I 2048, 128x128 F32 block
scales, v3 tensor names) and one DeepSeek-V4 MXFP4 layer (256 experts, H 4096, I 2048, F8_E8M0
1x32 scales, FP8 shared expert with E8M0 block scales, v4 release names) as sharded safetensors
files with an index and a config.json, then loads each one with `load_moe_layer` (config from
config.json, checkpoint form) twice: all experts, and one EP rank's slice of `--ep` experts. Every
load runs in a fresh child process, after the files' pages were dropped from the page cache
(fsync + posix_fadvise DONTNEED), so neither the writer's memory nor cached pages count:

    disk GB    bytes the child read from storage (/proc/self/io read_bytes)
    GB/s       disk GB / seconds (the load: headers, checks, reads, stacking, jax arrays)
    peak RSS   the child's high-water mark (VmHWM); base = its RSS before loading (python + jax)
    ratio      (peak - base) / loaded bytes; a row passes when it is <= 1.25 (judged at full size;
               at --small sizes jax's fixed allocations dominate the ratio: "n/a")

The V3 layer is about 11 GB on disk: it needs that much free disk and memory. `--small` runs the
same at a scaled size (seconds). Exit status 1 when a load fails or a row does not pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from moe_jax.bench._cli import exit_status, log, write_json

RSS_LIMIT = 1.25
SHARD_BYTES = 4 << 30  # like the released checkpoints' ~4-5 GB shards


@dataclass(frozen=True)
class Family:
    name: str
    layer: int
    prefix: str  # tensor prefix, {layer} filled
    proj: tuple[str, str, str]  # gate, up, down leaves
    bias: str
    experts: int
    hidden: int
    inter: int
    fmt: str  # "fp8_block" | "mxfp4"
    config_json: dict


def families(small: bool) -> list[Family]:
    e, h, i4, h4 = (16, 256, 128, 256) if small else (256, 7168, 2048, 4096)
    i3 = 128 if small else 2048
    v3 = dict(model_type="deepseek_v3", hidden_size=h, moe_intermediate_size=i3, n_routed_experts=e,
              num_experts_per_tok=8, n_group=8, topk_group=4, topk_method="noaux_tc",
              scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1,
              num_hidden_layers=61, num_nextn_predict_layers=1, first_k_dense_replace=3, moe_layer_freq=1,
              hidden_act="silu", vocab_size=129280,
              quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                                       weight_block_size=[128, 128]))
    v4 = dict(model_type="deepseek_v4", hidden_size=h4, moe_intermediate_size=i4, n_routed_experts=e,
              num_experts_per_tok=6, topk_method="noaux_tc", scoring_func="sqrtsoftplus",
              norm_topk_prob=True, routed_scaling_factor=1.5, n_shared_experts=1, num_hidden_layers=43,
              num_hash_layers=3, swiglu_limit=10.0, hidden_act="silu", vocab_size=129280, expert_dtype="fp4",
              quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                                       weight_block_size=[128, 128], scale_fmt="ue8m0"))
    return [
        Family("V3 FP8", 3, "model.layers.3.mlp.", ("gate_proj", "up_proj", "down_proj"),
               "gate.e_score_correction_bias", e, h, i3, "fp8_block", v3),
        Family("V4 MXFP4", 5, "layers.5.ffn.", ("w1", "w3", "w2"), "gate.bias", e, h4, i4, "mxfp4", v4),
    ]


# -- writing ----------------------------------------------------------------------------------------

class _Pools:
    """A few random byte pools the synthetic tensors are cut from (content does not matter to a
    load; generating 11 GB of fresh random bytes would dominate the run)."""

    def __init__(self, nbytes: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.pools = [rng.integers(0, 256, nbytes, np.uint8) for _ in range(3)]

    def take(self, nbytes: int, k: int) -> np.ndarray:
        return self.pools[k % len(self.pools)][:nbytes]


def _specs(fam: Family, pools: _Pools) -> list[tuple[str, str, tuple[int, ...], object]]:
    """(name, safetensors dtype, shape, make() -> bytes-like) of every tensor of the layer."""
    h, i, p = fam.hidden, fam.inter, fam.prefix
    specs = [(p + "gate.weight", "BF16", (fam.experts, h),
              lambda: np.random.default_rng(1).normal(0, 0.02, (fam.experts, h)).astype(ml_dtypes.bfloat16)),
             (p + fam.bias, "F32", (fam.experts,), lambda: np.zeros(fam.experts, np.float32))]

    def fp8(n, k, j):  # e4m3 bytes without the NaN codes (0x7F / 0xFF)
        return lambda: pools.take(n * k, j) & 0xFE

    def block_f32(n, k):
        return lambda: np.full((-(-n // 128), -(-k // 128)), 1e-3, np.float32)

    def block_e8m0(n, k):
        return lambda: np.full((-(-n // 128), -(-k // 128)), 118, np.uint8)

    shapes = ((i, h), (i, h), (h, i))
    for e in range(fam.experts):
        for j, (leaf, (n, k)) in enumerate(zip(fam.proj, shapes)):
            w = f"{p}experts.{e}.{leaf}"
            if fam.fmt == "fp8_block":
                specs.append((w + ".weight", "F8_E4M3", (n, k), fp8(n, k, e + j)))
                specs.append((w + ".weight_scale_inv", "F32", (-(-n // 128), -(-k // 128)), block_f32(n, k)))
            else:
                specs.append((w + ".weight", "I8", (n, k // 2), (lambda n=n, k=k, j=e + j: pools.take(n * k // 2, j))))
                specs.append((w + ".scale", "F8_E8M0", (n, k // 32), (lambda n=n, k=k: np.full((n, k // 32), 120, np.uint8))))
    for j, (leaf, (n, k)) in enumerate(zip(fam.proj, shapes)):
        w = f"{p}shared_experts.{leaf}"
        specs.append((w + ".weight", "F8_E4M3", (n, k), fp8(n, k, j)))
        if fam.fmt == "fp8_block":
            specs.append((w + ".weight_scale_inv", "F32", (-(-n // 128), -(-k // 128)), block_f32(n, k)))
        else:
            specs.append((w + ".scale", "F8_E8M0", (-(-n // 128), -(-k // 128)), block_e8m0(n, k)))
    return specs


_ITEM = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}


def write_layer(fam: Family, d: Path, shard_bytes: int = SHARD_BYTES) -> int:
    """Sharded safetensors files + model.safetensors.index.json + config.json in `d`, fsynced and
    dropped from the page cache. Returns the bytes written. One tensor in memory at a time."""
    d.mkdir(parents=True, exist_ok=True)
    pools = _Pools(max(fam.inter * fam.hidden, 1 << 16))
    specs = _specs(fam, pools)
    shards, cur, size = [], [], 0
    for s in specs:
        nb = int(np.prod(s[2])) * _ITEM[s[1]]
        if cur and size + nb > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += nb
    shards.append(cur)
    weight_map, total = {}, 0
    for si, shard in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {}, 0
        for name, dt, shape, _ in shard:
            nb = int(np.prod(shape)) * _ITEM[dt]
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
            weight_map[name] = fname
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        with open(d / fname, "wb") as f:
            f.write(len(hb).to_bytes(8, "little") + hb)
            for _, _, _, make in shard:
                f.write(np.ascontiguousarray(make()).tobytes())
            f.flush()
            os.fsync(f.fileno())
        total += 8 + len(hb) + off
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(fam.config_json, indent=1))
    drop_page_cache(d)
    return total


def drop_page_cache(d: Path) -> None:
    """Ask the kernel to drop the (clean) cached pages of every file in `d`."""
    for f in d.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- loading, in a child process --------------------------------------------------------------------

def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def child_main(arg: str) -> None:
    """Runs in the child: one load, one JSON line on stdout."""
    import jax

    from moe_jax.checkpoint import load_moe_layer

    a = json.loads(arg)
    jax.devices()  # backend initialized before the baseline
    base, io0 = _status("VmRSS"), _read_bytes()
    t0 = time.perf_counter()
    config, params = load_moe_layer(a["dir"], layer=a["layer"], prepare=False,
                                    expert_range=tuple(a["range"]) if a["range"] else None)
    leaves = [x for x in jax.tree_util.tree_leaves(params) if hasattr(x, "nbytes")]
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - t0
    print(json.dumps(dict(seconds=seconds, loaded=int(sum(x.nbytes for x in leaves)), base=base,
                          peak=_status("VmHWM"), disk=_read_bytes() - io0, recipe=config.recipe,
                          experts=int(params.w13.shape[0]))))


def load_in_child(d: Path, layer: int, expert_range: tuple[int, int] | None) -> dict:
    drop_page_cache(d)
    arg = json.dumps(dict(dir=str(d), layer=layer, range=list(expert_range) if expert_range else None))
    code = "import sys; from moe_jax.bench.load import child_main; child_main(sys.argv[1])"
    r = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"load failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="moe_jax_load_"))
    rows, failed = [], []
    try:
        for fam in families(args.small):
            d = root / fam.name.replace(" ", "_")
            log(f"writing {fam.name} layer {fam.layer} ({fam.experts} experts, H {fam.hidden}, "
                f"I {fam.inter}) to {d}")
            t0 = time.perf_counter()
            written = write_layer(fam, d, args.shard_bytes)
            log(f"  {written / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
            ep = min(args.ep, fam.experts // 2)
            for rng in (None, (0, ep)):
                what = f"{fam.name}, {'all experts' if rng is None else f'EP slice {rng[0]}-{rng[1]}'}"
                log(f"loading {what}")
                try:
                    m = load_in_child(d, fam.layer, rng)
                except RuntimeError as exc:
                    log(f"  FAILED: {exc}")
                    failed.append(what)
                    continue
                ratio = (m["peak"] - m["base"]) / m["loaded"]
                judged = not args.small
                ok = ratio <= RSS_LIMIT or not judged
                if not ok:
                    failed.append(what)
                rows.append(dict(layer=fam.name, experts=m["experts"], recipe=m["recipe"],
                                 disk_gb=m["disk"] / 1e9, loaded_gb=m["loaded"] / 1e9, seconds=m["seconds"],
                                 gb_per_s=m["disk"] / 1e9 / m["seconds"], peak_rss_gb=m["peak"] / 1e9,
                                 base_rss_gb=m["base"] / 1e9, ratio=ratio, ok=ok, judged=judged))
            if not args.dir or not args.keep:
                shutil.rmtree(d, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"| layer | experts | disk GB read | loaded GB | s | GB/s from disk | peak RSS GB | base RSS GB "
          f"| (peak-base)/loaded | <= {RSS_LIMIT} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['experts']} | {r['disk_gb']:.3f} | {r['loaded_gb']:.3f} | {r['seconds']:.1f} "
              f"| {r['gb_per_s']:.2f} | {r['peak_rss_gb']:.2f} | {r['base_rss_gb']:.2f} | {r['ratio']:.3f} "
              f"| {('yes' if r['ok'] else 'NO') if r['judged'] else 'n/a'} |")
    if args.json:
        write_json(args.json, rows)
    return exit_status(failed)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.description = __doc__.split("\n\n")[0] if __doc__ else None
    ap.add_argument("--dir", help="where to write the layers (default: a temporary directory, deleted after)")
    ap.add_argument("--keep", action="store_true", help="keep the files written under --dir")
    ap.add_argument("--small", action="store_true", help="scaled sizes (16 experts, H 256, I 128), seconds")
    ap.add_argument("--ep", type=int, default=32, help="experts in the EP slice load (default 32)")
    ap.add_argument("--shard-bytes", type=int, default=SHARD_BYTES, help="safetensors shard size")
    ap.add_argument("--json", metavar="PATH", help="write every row as JSON here")
    ap.set_defaults(func=run)
