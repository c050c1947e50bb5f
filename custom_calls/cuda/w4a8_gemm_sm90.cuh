// W4A8 grouped GEMMs on SM90, one kernel text for both layouts (W4A8_CONTIG):
//   masked: D[g, m, n] = sum_k A[g, m, k] * W[g, n, k] for m < masked_m[g];
//   contig: D[m, n] = sum_k A[m, k] * W[m_indices[m], n, k], rows with m_indices -1 written as 0.
//
// A: (G, M_PAD, K), contig (M_cap, K), e4m3 in the W4A8 column order (layouts/w4a8.py: byte
// 32s + 16e + 4c + i of each 128-column block holds column 32c + 8s + 2i + e) with fp32 scales per
// token and 128 columns, sa (G, K/128, SA_LD), contig (K/128, align(M_cap, 4)); W: MXFP4 kept 4-bit
// (layouts/w4a8.py): values (G, N, K/2) in the W4A8 word layout and one int32 scale word per row and
// 128 columns, sw (G, N, K/128); D: (G, M_PAD, N), contig (M_cap, N), bf16; masked rows >= masked_m[g]
// not written. Contig: a block's TOKENS rows lie in one expert's aligned segment (the host checks that
// TOKENS divides the alignment), so the expert of its first row is the block's.
//
// Why this shape: at decode every weight byte is read once and the few tokens ride along, so the
// weights are the wgmma's A operand from registers (the tokens, N = 8 * TOKEN_TILES, are B from
// shared memory). Per 128-column K block one thread issues three TMA copies into a ring slot: the
// block's tokens (their bytes are already the K-major B image, 128-byte swizzle), its 64 * WARPGROUPS
// weight rows (64 bytes each) and the tokens' scales; the slot's mbarrier counts the bytes. Each
// thread then reads its 16 bytes of two rows from shared memory, widens each 4-byte word to two e4m3
// registers with two byte permutes from its 32-group's table, and hands them to the tensor core.
// Fragment column c (lane % 4) takes 32-group c of each block: word 4c + s is k32 step s, its even
// columns at k = 4c..4c+3 (a0/a1) and odd ones at k = 16 + 4c.. (a2/a3), exactly where the W4A8 column
// order puts those columns' tokens. Per 128 columns the fp32 partial is promoted with (weight block
// scale) x (token scale), DeepGEMM's 1D2D recipe.
//
// With the copies asynchronous the threads hold no operand ring in registers (79 at the default
// tiling against 166 when each thread loaded its words and staged the tokens itself), so more blocks
// share an SM, and the loads no longer wait in the threads' instruction streams.
//
// Prefill (contig) runs the same loop with wider token tiles (`contig_config`: 64 tokens, two blocks
// per SM). It reaches 0.47x DeepGEMM's FP8 kernel there (BENCHMARKS.md): per K block a thread's work
// beside the MMA (widening, and a promotion whose scale is a weight row's times a token's, two
// operations per accumulator) does not hide under it (profiled: 4.7x DeepGEMM's instructions), and
// issuing the next K block's MMA before the promotion was slower. Where the alignment allows, prefill
// runs the persistent kernel instead (w4a8_contig_rs_sm90.cuh).
//
// The generated translation unit defines, before this text: W4A8_CONTIG (0 or 1), W4A8_N, W4A8_K,
// W4A8_M_PAD and W4A8_SA_LD (masked; contig takes its rows from the grid and has 0 here),
// W4A8_TOKEN_TILES, W4A8_WARPGROUPS (64 weight rows each), W4A8_STAGES (ring slots), W4A8_MIN_BLOCKS;
// and wgmma_m64k32(d, a, desc, accumulate) for N = 8 * TOKEN_TILES; then w4a8_sm90_common.cuh (the
// widening, descriptors, mbarriers, TMA). Dynamic shared memory: `w4a8_gemm.smem_bytes`.

namespace moe_jax_w4a8 {

constexpr int N = W4A8_N, K = W4A8_K, M_PAD = W4A8_M_PAD, SA_LD = W4A8_SA_LD;
constexpr int T = W4A8_TOKEN_TILES, WG = W4A8_WARPGROUPS, STAGES = W4A8_STAGES;
constexpr int KB = K / 128;
constexpr int TOKENS = 8 * T;
constexpr int TOKEN_BYTES = TOKENS * 128;              // one K block of the block's tokens
constexpr int W_BYTES = 64 * WG * 64;                  // one K block of the block's weight rows
constexpr int SCALE_BYTES = TOKENS * 4;                // the tokens' scales of one K block
constexpr int SCALE_SLOT = (SCALE_BYTES + 127) / 128 * 128;  // TMA writes shared memory 128-byte aligned
// a ring slot: tokens first (the 128-byte swizzle repeats every 1024 bytes), weights, scales
constexpr int SLOT_STRIDE = (TOKEN_BYTES + W_BYTES + SCALE_SLOT + 1023) / 1024 * 1024;
static_assert(K % 128 == 0, "K must be a multiple of 128");
static_assert(W4A8_CONTIG || (SA_LD % 4 == 0 && SA_LD >= M_PAD), "SA_LD must be align(M_PAD, 4)");
static_assert(STAGES >= 2 && STAGES <= 8, "STAGES must be in [2, 8]");

}  // namespace moe_jax_w4a8

extern "C" __global__ void __launch_bounds__(128 * W4A8_WARPGROUPS, W4A8_MIN_BLOCKS)
moe_jax_w4a8_gemm_sm90(const __grid_constant__ moe_jax_w4a8::TmaDesc tokens_map,
                       const __grid_constant__ moe_jax_w4a8::TmaDesc scales_map,
                       const __grid_constant__ moe_jax_w4a8::TmaDesc weights_map,
                       const uint32_t* __restrict__ sw, const int* __restrict__ rows_index,
                       __nv_bfloat16* __restrict__ d) {
  using namespace moe_jax_w4a8;
  extern __shared__ uint8_t ring_smem[];  // STAGES slots from the first 1024-byte boundary
  __shared__ __align__(8) uint64_t full[STAGES];

  const int tid = threadIdx.x, lane = tid % 32, gid = lane / 4, c = lane % 4;
  const int mb = blockIdx.y * TOKENS;
  // g: the weights' group; slab: the group of A, sa and D (contig has one); rows: the block writes
  // rows < rows (rows_index: masked_m, contig m_indices)
#if W4A8_CONTIG
  // the grid covers the rows of A exactly (M_cap a multiple of the alignment, TOKENS a divisor of it)
  const int g = rows_index[mb], slab = 0, rows = gridDim.y * TOKENS;
  if (g < 0) {  // a padding block: zeros, and no copies (no barrier is left waiting)
    for (int i = tid; i < TOKENS * 64 * WG; i += 128 * WG) {
      const int m = mb + i / (64 * WG), n = blockIdx.x * 64 * WG + i % (64 * WG);
      if (n < N) d[static_cast<size_t>(m) * N + n] = __float2bfloat16_rn(0.f);
    }
    return;
  }
#else
  const int g = blockIdx.z, slab = g, rows = rows_index[g];
  if (mb >= rows) return;  // the whole block: no barrier is left waiting
#endif
  const int row0 = blockIdx.x * 64 * WG + (tid / 32) * 16 + gid;  // and row0 + 8
  const int wrow0 = blockIdx.x * 64 * WG;
  const size_t srow[2] = {static_cast<size_t>(g) * N + row0, static_cast<size_t>(g) * N + row0 + 8};
  const bool row_ok[2] = {row0 < N, row0 + 8 < N};
  const uint32_t smem_raw = static_cast<uint32_t>(__cvta_generic_to_shared(ring_smem));
  const uint32_t ring = (smem_raw + 1023u) & ~1023u;
  const uint8_t* ring_ptr = ring_smem + (ring - smem_raw);
  const uint32_t bars = static_cast<uint32_t>(__cvta_generic_to_shared(&full[0]));

  // One thread: K block kb's tokens, weight rows and token scales into slot kb % STAGES. Rows past N
  // (the next group's, or zeros past the tensor) are never written out; their scale words read as 0.
  auto issue = [&](int kb) {
    const uint32_t slot = ring + (kb % STAGES) * SLOT_STRIDE, bar = bars + 8 * (kb % STAGES);
    mbar_expect_tx(bar, TOKEN_BYTES + W_BYTES + SCALE_BYTES);
    tma_load_2d(slot, &tokens_map, bar, kb * 128, slab * M_PAD + mb);
    tma_load_2d(slot + TOKEN_BYTES, &weights_map, bar, kb * 64, g * N + wrow0);
    tma_load_2d(slot + TOKEN_BYTES + W_BYTES, &scales_map, bar, mb, slab * KB + kb);
  };
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < STAGES; ++i) mbar_init(bars + 8 * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i)
      if (i < KB) issue(i);
  }

  // the rows' scale words, loaded STAGES K blocks ahead (0: table 0 and block scale 0, the row reads as zeros)
  uint32_t scale_ring[STAGES][2];
  auto load_scales = [&](uint32_t (&s)[2], int kb) {
#pragma unroll
    for (int h = 0; h < 2; ++h) s[h] = kb < KB && row_ok[h] ? __ldg(sw + srow[h] * KB + kb) : 0u;
  };
#pragma unroll
  for (int i = 0; i < STAGES; ++i) load_scales(scale_ring[i], i);

  float acc[4 * T], part[4 * T];
#pragma unroll
  for (int j = 0; j < 4 * T; ++j) acc[j] = 0.f;

#pragma unroll 1
  for (int kb0 = 0; kb0 < KB; kb0 += STAGES) {
#pragma unroll
    for (int i = 0; i < STAGES; ++i) {  // unrolled: slot i, and scale_ring[i] stays in registers
      const int kb = kb0 + i;
      if (kb >= KB) break;
      // every thread is done with K block kb - 1 (its wgmma waited, its scales read): that slot takes
      // K block kb + STAGES - 1
      __syncthreads();
      if (tid == 0 && kb + STAGES - 1 < KB) issue(kb + STAGES - 1);
      mbar_wait(bars + 8 * i, (kb / STAGES) & 1);
      const uint8_t* slot = ring_ptr + i * SLOT_STRIDE;

      uint32_t frag[4][4];  // per k32 step: a0 (row0, even), a1 (row0 + 8, even), a2 (row0, odd), a3 (row0 + 8, odd)
      float block_scale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v = *reinterpret_cast<const uint4*>(slot + TOKEN_BYTES + (row0 - wrow0 + 8 * h) * 64 + 16 * c);
        uint32_t lo, hi;
        table_words((scale_ring[i][h] >> (8 + 5 * c)) & 31u, lo, hi);
        block_scale[h] = __uint_as_float((scale_ring[i][h] & 0xFFu) << 23);
        widen_row(v, lo, hi, h, frag);
      }
      load_scales(scale_ring[i], kb + STAGES);

#pragma unroll
      for (int j = 0; j < 4 * T; ++j) fence_operand(part[j]);
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
      const uint32_t tokens = ring + i * SLOT_STRIDE;
#pragma unroll
      for (int s = 0; s < 4; ++s) wgmma_m64k32(part, frag[s], smem_desc_sw128(tokens + 32 * s), s > 0);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
      for (int j = 0; j < 4 * T; ++j) fence_operand(part[j]);

      // part[4t + j]: weight row row0 + 8 * (j / 2), token 8t + 2c + j % 2
      const float* token_scale = reinterpret_cast<const float*>(slot + TOKEN_BYTES + W_BYTES);
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float2 ts = *reinterpret_cast<const float2*>(token_scale + 8 * t + 2 * c);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          acc[4 * t + j] = fmaf((j & 1 ? ts.y : ts.x) * block_scale[j >> 1], part[4 * t + j], acc[4 * t + j]);
      }
    }
  }

#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int n = row0 + 8 * (j >> 1);
    if (n >= N) continue;
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int m = mb + 8 * t + 2 * c + (j & 1);
      if (m >= rows) continue;
#if W4A8_CONTIG
      const float v = rows_index[m] >= 0 ? acc[4 * t + j] : 0.f;  // the segment's padding rows
#else
      const float v = acc[4 * t + j];
#endif
      d[(static_cast<size_t>(slab) * M_PAD + m) * N + n] = __float2bfloat16_rn(v);
    }
  }
}
