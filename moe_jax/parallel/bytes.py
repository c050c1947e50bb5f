"""Bytes each parallel pattern moves per MoE layer, computed (not measured): what one GPU sends.

    python -m moe_jax.parallel.bytes [--ranks 8] [--prefill 4096] [--decode 128] [--capacity 128]

Model (n = ranks of the MoE group, T = tokens per GPU entering the layer, H hidden, k top_k):
  * ring algorithms: all-gather / reduce-scatter send (n-1)/n of the full buffer per GPU,
    all-reduce twice that; an all-to-all sends the (n-1)/n of its buffer meant for other GPUs,
    a ragged all-to-all only the real rows for other GPUs.
  * a token row on the wire: FP8 H bytes + one f32 scale per activation group (128; 32 for mxfp8)
    (bf16: 2H), plus 4k bytes of expert ids and 4k of weights when routing travels with it.
  * EP "normal" sends each token once to each remote GPU holding one of its experts; expected
    number under uniform routing: (n-1) * (1 - C(E - E/n, k) / C(E, k)) (DeepSeek-V3's group-limited
    routing lowers it further: at most topk_group groups per token).
  * "tp_ep" runs EP on T/n tokens per GPU (attention-TP ranks hold the same T tokens) and
    all-gathers bf16 results; "tp" holds the same T tokens on every GPU and all-reduces.
Return trips: EP rows in bf16 (combine_dtype), collective sums in f32 (reduce_dtype), the defaults.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from math import comb

from layouts import get_recipe
from moe_jax.config import MoEConfig

F32, BF16 = 4, 2


def row_bytes(hidden: int, top_k: int, *, fp8: bool, routing: bool, group: int = 128) -> int:
    """Bytes of one token message: hidden row (FP8 + f32 scale per `group` values, or bf16) +
    ids/weights."""
    x = hidden + F32 * -(-hidden // group) if fp8 else BF16 * hidden
    return x + (8 * top_k if routing else 0)


def remote_ranks_per_token(num_experts: int, top_k: int, n: int) -> float:
    """Expected number of OTHER ranks holding at least one of a token's top_k experts, uniform routing."""
    e_loc = num_experts // n
    p_none = comb(num_experts - e_loc, top_k) / comb(num_experts, top_k)
    return (n - 1) * (1.0 - p_none)


@dataclass(frozen=True)
class Traffic:
    pattern: str
    mode: str
    wire: str
    collectives: str
    bytes_per_gpu: float  # sent by one GPU per layer
    note: str = ""


def layer_traffic(config: MoEConfig, n: int, tokens: int, *, capacity: int = 128) -> list[Traffic]:
    """Every (pattern, EP mode, wire) for `tokens` per GPU over n ranks."""
    h, k, e = config.hidden_size, config.top_k, config.num_experts
    rec = get_recipe(config.recipe)
    fp8 = rec.is_quantized
    group = rec.act_group_size  # the activation group (ep_common.send_quant_for)
    frac = (n - 1) / n
    r = remote_ranks_per_token(e, k, n)
    out = []
    # TP x TP-MoE: all-reduce of (T, H) f32
    out.append(Traffic("tp", "-", "-", "1 all-reduce", 2 * frac * tokens * h * F32))
    # DP x TP-MoE: all-gather bf16 rows (+4 B padding flag), reduce-scatter f32 partials
    gather = (n - 1) * tokens * (BF16 * h + 4)
    scatter = (n - 1) * tokens * h * F32
    out.append(Traffic("dp_tp", "-", "bf16", "all-gather + reduce-scatter", gather + scatter))
    out.append(Traffic("cp", "-", "bf16", "all-gather + reduce-scatter",
                       (n - 1) * tokens * BF16 * h + scatter))

    def ep(t: float, pattern: str, extra: float, extra_name: str):
        for q in ([True, False] if fp8 else [False]):
            rb = row_bytes(h, k, fp8=q, routing=True, group=group)
            w = "fp8" if q else "bf16"
            back = BF16 * h
            out.append(Traffic(pattern, "normal (ragged)", w, "count a2a + 2 ragged a2a" + extra_name,
                               t * r * (rb + back) + n * 8 + extra))
            out.append(Traffic(pattern, "normal (dense)", w, "2 all-to-all" + extra_name,
                               (n - 1) * t * (rb + back) + extra))
            out.append(Traffic(pattern, f"low_latency C={capacity}", w, "2 all-to-all" + extra_name,
                               (n - 1) * capacity * (rb + back) + extra,
                               "drops tokens: T > C" if t > capacity else ""))
            out.append(Traffic(pattern, "ring", w, "all-gather + reduce-scatter" + extra_name,
                               (n - 1) * t * rb + (n - 1) * t * h * F32 + extra))
    ep(tokens, "dp_ep", 0.0, "")
    t_s = tokens / n
    ep(t_s, "tp_ep", (n - 1) * t_s * BF16 * h, " + all-gather")
    return out


def format_table(config: MoEConfig, n: int, prefill: int, decode: int, capacity: int = 128) -> str:
    pre = layer_traffic(config, n, prefill, capacity=capacity)
    dec = layer_traffic(config, n, decode, capacity=capacity)
    lines = [
        f"MoE layer traffic per GPU (sent), {n} ranks, H={config.hidden_size}, E={config.num_experts}, "
        f"top_k={config.top_k}, recipe={config.recipe}; expected remote ranks per token "
        f"{remote_ranks_per_token(config.num_experts, config.top_k, n):.2f} (uniform routing)",
        "",
        f"| pattern | EP mode | wire | collectives | prefill {prefill} tok/GPU (MB) | "
        f"decode {decode} tok/GPU (MB) | note |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for a, b in zip(pre, dec):
        note = "; ".join(f"{ph}: {t.note}" for ph, t in (("prefill", a), ("decode", b)) if t.note)
        lines.append(f"| {a.pattern} | {a.mode} | {a.wire} | {a.collectives} | "
                     f"{a.bytes_per_gpu / 1e6:.2f} | {b.bytes_per_gpu / 1e6:.2f} | {note} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--capacity", type=int, default=128, help="num_max_dispatch_tokens_per_rank")
    a = ap.parse_args(argv)
    print(format_table(MoEConfig.deepseek_v3(), a.ranks, a.prefill, a.decode, a.capacity))


if __name__ == "__main__":
    main()
