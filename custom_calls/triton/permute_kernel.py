"""Pre-permute as Triton kernels: scatter each (token, k) route into its grouped-layout row fused
with the per-token-group quantization for GEMM1 (scales written in the GEMM's image), and zero
the rows no route lands on.

Same signatures and results as `custom_calls.permute` (the reference):
  permute_contig(x, src2dst, *, num_rows, recipe, arch) -> (lhs (num_rows, H), lhs_scale image | None)
  permute_masked(x, src2dst, *, num_groups, m_pad, recipe, arch) -> (lhs (G, m_pad, H), image | None)
The placement (`src2dst`) comes from the dispatcher; this op only moves and quantizes data.
Both also take `config=`, a `PermuteConfig` (tiling; None: `heuristic_config(recipe)`, what the
registered "triton" implementations use).

Three launches (contig; masked: two, and a memset):
  1. contig: `row_source_kernel`: src1[r] = 1 + the token placed at row r, 0 for a row no route
     lands on (the buffer is zeroed before the launch; M * k int32 read, one int32 written per
     route). Masked: the scatter kernel writes src1 itself (nothing reads it before step 3), which
     saves a launch at decode, where every launch costs more than its work.
  2. `scatter_quant_kernel`, two kinds of programs (by row block):
     * contig only, a block of ZERO_ROWS destination rows each (first, so their writes overlap the
       rest): the rows nothing lands on (src1[r] == 0) get q = 0, as the reference quantizer gives
       them (the masked layout leaves them unwritten: its GEMM never reads them);
     * a [TOKENS, tile] block of x each: read once, quantized once, stored to each of its tokens'
       top_k destination rows (x read once instead of top_k times); its scales go once, token-major,
       to a small (M, G) fp32 buffer.
     Each row block is split along H into chunks of GROUPS groups, one program each.
  3. `scale_image_kernel`: the scale image, column block by column block: each row's scales
     gathered from the token-major buffer through src1 (a zero row's scale where no route lands,
     0 in the image padding columns), so every image store is coalesced. Scattered 4-byte stores
     straight from step 2 (one per route and group, top_k times more than the tokens' scales)
     made step 2 bound by L2 requests rather than by DRAM.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from layouts import ceil_div, gemm_format, get_recipe
from custom_calls.triton.launch import triton_call
from custom_calls.triton.tile_quant import (lhs_load_cols, lhs_order_tile, quantize_tile, store_scale_image,
                                            tile_ids, ue8m0_bits_exponent, zero_row_scale)
from custom_calls.triton.tuning import (check_groups, check_launch, check_powers_of_two, column_group,
                                        config_or_default, tile_groups)


@dataclasses.dataclass(frozen=True)
class PermuteConfig:
    """Tiling of the three permute launches (`heuristic_config` gives the default; see
    `custom_calls.triton.tuning`). Every size is a power of two.

    tile: elements of H per scatter program, whole scale groups (bf16: chunks of `tuning.BF16_CHUNK`);
    tokens: tokens per scatter program; zero_rows / zero_sub: rows checked per zero-fill program /
    rows it writes at once (zero_sub <= zero_rows); num_warps: of the scatter kernel;
    chunks_fastest: the H chunks of one token block are neighbouring programs; source_block:
    routes per row-source program; image_rows / image_groups: image columns / scale groups per
    scale-image program (image_groups a multiple of 4 when the image is packed UE8M0).
    """

    tile: int
    tokens: int
    zero_rows: int
    zero_sub: int
    num_warps: int
    chunks_fastest: bool
    source_block: int
    image_rows: int
    image_groups: int

    def __post_init__(self) -> None:
        check_powers_of_two(self, "tile", "tokens", "zero_rows", "zero_sub", "source_block", "image_rows",
                            "image_groups")
        check_launch(self)
        if self.zero_sub > self.zero_rows:
            raise ValueError(f"PermuteConfig.zero_sub: expected at most zero_rows = {self.zero_rows}, "
                             f"got {self.zero_sub}")


def heuristic_config(recipe: str) -> PermuteConfig:
    """The default tiling: 1024 elements of H (2 KiB of bf16 in, 1 KiB of e4m3 out per destination)
    and at least 4 scale groups per scatter program, 4 tokens, 4 warps; zero-fill 64 rows checked,
    4 written at once; 1024 routes per row-source program; 128 image columns x 8 groups."""
    return PermuteConfig(tile=max(1024, 4 * column_group(recipe)), tokens=4, zero_rows=64, zero_sub=4,
                         num_warps=4, chunks_fastest=True, source_block=1024, image_rows=128, image_groups=8)


@triton.jit
def row_source_kernel(src2dst_ptr, src1_ptr, N: tl.constexpr, TOPK: tl.constexpr, R: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Grid cdiv(N, BLOCK), N = M * TOPK; src1 (R,) int32 must hold 0 before the launch.
    src1[src2dst[i]] = i // TOPK + 1 for every route i with a row in [0, R)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dst = tl.load(src2dst_ptr + i, mask=i < N, other=-1)
    ok = (dst >= 0) & (dst < R)
    tl.store(src1_ptr + tl.where(ok, dst, 0), i // TOPK + 1, mask=ok)


@triton.jit
def scatter_quant_kernel(
    x_ptr, src2dst_ptr, src1_ptr,
    lhs_ptr, sf_ptr, src1_out_ptr,
    M: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, R: tl.constexpr,
    G: tl.constexpr, GROUP: tl.constexpr, QUANT: tl.constexpr, UE8M0: tl.constexpr, W4A8_ORDER: tl.constexpr,
    GROUPS: tl.constexpr, TOKENS: tl.constexpr, ZERO_FILL: tl.constexpr, ZERO_ROWS: tl.constexpr,
    ZERO_SUB: tl.constexpr, CHUNKS_FASTEST: tl.constexpr, ROW_SOURCE_OUT: tl.constexpr,
):
    """Grid ((ZERO_PROGRAMS + cdiv(M, TOKENS)) * cdiv(G, GROUPS),), ZERO_PROGRAMS = cdiv(R, ZERO_ROWS)
    if ZERO_FILL else 0; TOPK_P2 = next_pow2(TOPK).
    lhs (R, H) e4m3 | bf16; sf (M, G) fp32 token-major scales (QUANT only). src1 (R,) is read by
    the zero-fill programs; with ROW_SOURCE_OUT (no zero fill) the token programs of the first
    chunk write it to src1_out (R,) instead, zeroed before the launch."""
    ZERO_PROGRAMS: tl.constexpr = (R + ZERO_ROWS - 1) // ZERO_ROWS if ZERO_FILL else 0
    TOKEN_PROGRAMS: tl.constexpr = (M + TOKENS - 1) // TOKENS
    pid, chunk = tile_ids(ZERO_PROGRAMS + TOKEN_PROGRAMS, (G + GROUPS - 1) // GROUPS, CHUNKS_FASTEST)
    group0 = chunk * GROUPS
    cols = group0 * GROUP + tl.arange(0, GROUPS * GROUP)
    col_ok = tl.expand_dims(cols < H, 0)
    if pid >= ZERO_PROGRAMS:
        t = (pid - ZERO_PROGRAMS) * TOKENS + tl.arange(0, TOKENS)
        t64 = t.to(tl.int64)
        # every destination of the block in one load, issued before x's
        js = tl.expand_dims(tl.arange(0, TOPK_P2), 0)
        dsts = tl.load(src2dst_ptr + tl.expand_dims(t64 * TOPK, 1) + js,
                       mask=tl.expand_dims(t < M, 1) & (js < TOPK), other=-1)
        x = tl.load(x_ptr + tl.expand_dims(t64 * H, 1) + tl.expand_dims(lhs_load_cols(cols, H, W4A8_ORDER), 0),
                    mask=tl.expand_dims(t < M, 1) & col_ok, other=0.0).to(tl.float32)
        x = lhs_order_tile(x, TOKENS, GROUPS * GROUP, H, W4A8_ORDER)
        if QUANT:
            q, sf, _ = quantize_tile(x, TOKENS, GROUPS, GROUP, UE8M0)
            g = group0 + tl.arange(0, GROUPS)
            tl.store(sf_ptr + tl.expand_dims(t64 * G, 1) + tl.expand_dims(g, 0), sf,
                     mask=tl.expand_dims(t < M, 1) & tl.expand_dims(g < G, 0))
        else:
            q = x.to(lhs_ptr.dtype.element_ty)
        for j in tl.static_range(TOPK):
            dst = tl.sum(tl.where(js == j, dsts, 0), axis=1)  # [TOKENS]
            ok = (dst >= 0) & (dst < R)  # a row outside the buffer is dropped, as the reference drops it
            d64 = tl.where(ok, dst, 0).to(tl.int64)
            tl.store(lhs_ptr + tl.expand_dims(d64 * H, 1) + tl.expand_dims(cols, 0), q,
                     mask=tl.expand_dims(ok, 1) & col_ok)
            if ROW_SOURCE_OUT:
                tl.store(src1_out_ptr + d64, t + 1, mask=ok & (t < M) & (chunk == 0))
    else:
        # A zero program owns ZERO_ROWS rows but writes them ZERO_SUB at a time: a
        # [ZERO_ROWS, tile] block held at once would set the register count (and occupancy) of the
        # whole kernel.
        r0 = pid * ZERO_ROWS
        rows = r0 + tl.arange(0, ZERO_ROWS)
        src = tl.load(src1_ptr + rows, mask=rows < R, other=1)
        if tl.min(src, axis=0) == 0:
            q = tl.zeros((ZERO_SUB, GROUPS * GROUP), lhs_ptr.dtype.element_ty)
            for sub in range(ZERO_ROWS // ZERO_SUB):
                rs = (r0 + sub * ZERO_SUB + tl.arange(0, ZERO_SUB)).to(tl.int64)
                srcs = tl.load(src1_ptr + rs, mask=rs < R, other=1)
                tl.store(lhs_ptr + tl.expand_dims(rs * H, 1) + tl.expand_dims(cols, 0), q,
                         mask=tl.expand_dims(srcs == 0, 1) & col_ok)


@triton.jit
def scale_image_kernel(
    src1_ptr, sf_ptr,
    img_ptr,
    MN: tl.constexpr, G: tl.constexpr, IMG_LD: tl.constexpr, IMG_SLAB: tl.constexpr,
    UE8M0: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr, ROW_BLOCKS: tl.constexpr,
):
    """Grid (ROW_BLOCKS * cdiv(G, GROUPS),), ROW_BLOCKS = S * cdiv(IMG_LD, ROWS) over S slabs of MN rows.
    image column m of slab s: the scales of token src1[s * MN + m] - 1, the zero row's scale where
    src1 is 0, and 0 in the padding columns MN <= m < IMG_LD."""
    BLOCKS_PER_SLAB: tl.constexpr = (IMG_LD + ROWS - 1) // ROWS
    pid_m, chunk = tile_ids(ROW_BLOCKS, (G + GROUPS - 1) // GROUPS, False)
    slab = (pid_m // BLOCKS_PER_SLAB).to(tl.int64)
    m = (pid_m % BLOCKS_PER_SLAB) * ROWS + tl.arange(0, ROWS)
    real = m < MN
    src = tl.load(src1_ptr + slab * MN + m, mask=real, other=0)
    placed = tl.expand_dims(src > 0, 1)
    group0 = chunk * GROUPS
    g = tl.expand_dims(group0 + tl.arange(0, GROUPS), 0)
    sf = tl.load(sf_ptr + tl.expand_dims((src - 1).to(tl.int64) * G, 1) + g, mask=placed & (g < G), other=0.0)
    sf = tl.where(placed, sf, tl.where(tl.expand_dims(real, 1), zero_row_scale(UE8M0), 0.0))
    exp = ue8m0_bits_exponent(sf)
    store_scale_image(img_ptr, sf, exp, slab * IMG_SLAB + m, m < IMG_LD, group0, G, IMG_LD, ROWS, GROUPS, UE8M0)


def row_sources(src2dst: jax.Array, num_rows: int, block: int = 1024) -> jax.Array:
    """src2dst: (M, k) int32 rows, or -1 -> src1 (num_rows,) int32: 1 + the token placed at each
    row, 0 where none is (rows outside [0, num_rows) are ignored). block: routes per program."""
    m, k = src2dst.shape
    if m * k == 0:
        return jnp.zeros((num_rows,), jnp.int32)
    (src1,) = triton_call(
        src2dst, kernel=row_source_kernel, out_shape=[jax.ShapeDtypeStruct((num_rows,), jnp.int32)],
        grid=(ceil_div(m * k, block),), num_warps=4, name="moe_permute_row_sources",
        zeroed_outputs=(0,), N=m * k, TOPK=k, R=num_rows, BLOCK=block)
    return src1


def kernel_config(recipe: str, arch: int, config: PermuteConfig | None = None) -> dict:
    """The scatter kernel's static tiling for `config` (None: `heuristic_config(recipe)`): group
    size along H, groups per program, quantized or not. ValueError naming the field of a config
    that does not fit (recipe, arch)."""
    quant = get_recipe(recipe).is_quantized
    config = config_or_default(config, PermuteConfig, lambda: heuristic_config(recipe))
    group = column_group(recipe)
    groups = tile_groups(config, "tile", group=group, packed=False)  # scales go token-major, as fp32
    check_groups(config, "image_groups", packed=quant and gemm_format(recipe, arch).ue8m0)
    return dict(GROUP=group, GROUPS=groups, QUANT=quant)


def _permute(x: jax.Array, src2dst: jax.Array, *, slabs: int, mn: int, recipe: str, arch: int,
             zero_fill: bool, config: PermuteConfig | None):
    config = config_or_default(config, PermuteConfig, lambda: heuristic_config(recipe))
    cfg = kernel_config(recipe, arch, config)
    m, h = x.shape
    top_k = src2dst.shape[1]
    rows = slabs * mn
    fmt = gemm_format(recipe, arch)
    quant = cfg["QUANT"]
    g = ceil_div(h, cfg["GROUP"])
    zero_programs = ceil_div(rows, config.zero_rows) if zero_fill else 0
    # the zero fill reads the row sources, so they come first; without it (masked) the scatter
    # kernel writes them for the scale image (only needed with quantization)
    src1_out = quant and not zero_fill
    src1 = row_sources(src2dst, rows, config.source_block) if zero_fill else jnp.zeros((1,), jnp.int32)
    lhs, sf, src1_written = triton_call(
        x, src2dst, src1, kernel=scatter_quant_kernel,
        out_shape=[jax.ShapeDtypeStruct((rows, h), jnp.float8_e4m3fn if quant else jnp.bfloat16),
                   jax.ShapeDtypeStruct((m, g) if quant else (1,), jnp.float32),
                   jax.ShapeDtypeStruct((rows,) if src1_out else (1,), jnp.int32)],
        grid=((zero_programs + ceil_div(m, config.tokens)) * ceil_div(g, cfg["GROUPS"]),),
        num_warps=config.num_warps, name="moe_permute_quant", zeroed_outputs=(2,) if src1_out else (),
        M=m, H=h, TOPK=top_k, TOPK_P2=triton.next_power_of_2(top_k), R=rows, G=g, UE8M0=fmt.ue8m0,
        W4A8_ORDER=fmt.w4a8, TOKENS=config.tokens, ZERO_FILL=zero_fill, ZERO_ROWS=config.zero_rows,
        ZERO_SUB=config.zero_sub, CHUNKS_FASTEST=config.chunks_fastest, ROW_SOURCE_OUT=src1_out, **cfg)
    if src1_out:
        src1 = src1_written
    if not quant:
        return lhs, None
    (gi, img_ld), img_dtype = fmt.lhs_scale_shape(mn, h), fmt.scale_dtype
    row_blocks = slabs * ceil_div(img_ld, config.image_rows)
    (img,) = triton_call(
        src1, sf, kernel=scale_image_kernel,
        out_shape=[jax.ShapeDtypeStruct((gi, img_ld) if slabs == 1 else (slabs, gi, img_ld), img_dtype)],
        grid=(row_blocks * ceil_div(g, config.image_groups),), num_warps=4, name="moe_permute_scale_image",
        MN=mn, G=g, IMG_LD=img_ld, IMG_SLAB=gi * img_ld, UE8M0=fmt.ue8m0, ROWS=config.image_rows,
        GROUPS=config.image_groups, ROW_BLOCKS=row_blocks)
    return lhs, img


def permute_contig(x: jax.Array, src2dst: jax.Array, *, num_rows: int, recipe: str, arch: int,
                   config: PermuteConfig | None = None):
    """x: (M, H) float, src2dst: (M, k) int32 in [0, num_rows) or -1
    -> (lhs (num_rows, H) e4m3 | bf16, lhs_scale image (see custom_calls.act_quant) | None).
    config: the tiling (None: `heuristic_config(recipe)`)."""
    if x.shape[0] == 0:  # no token: every row is a zero row
        kernel_config(recipe, arch, config)  # a bad config is an error whatever the shape
        return gemm_format(recipe, arch).quantize_lhs(jnp.zeros((num_rows, x.shape[1]), x.dtype))
    return _permute(x, src2dst, slabs=1, mn=num_rows, recipe=recipe, arch=arch, zero_fill=True, config=config)


def permute_masked(x: jax.Array, src2dst: jax.Array, *, num_groups: int, m_pad: int, recipe: str,
                   arch: int, config: PermuteConfig | None = None):
    """x: (M, H) float, src2dst: (M, k) int32 flat slab rows g * m_pad + r, or -1
    -> (lhs (G, m_pad, H) e4m3 | bf16, lhs_scale (G, ...) image | None); lhs rows no route lands on
    are left unwritten. config: the tiling (None: `heuristic_config(recipe)`)."""
    if x.shape[0] == 0:  # no token: every row is a zero row
        kernel_config(recipe, arch, config)
        return gemm_format(recipe, arch).quantize_lhs(jnp.zeros((num_groups, m_pad, x.shape[1]), x.dtype))
    lhs, img = _permute(x, src2dst, slabs=num_groups, mn=m_pad, recipe=recipe, arch=arch, zero_fill=False,
                        config=config)
    return lhs.reshape(num_groups, m_pad, x.shape[1]), img
