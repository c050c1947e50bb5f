// W4A8 contig GEMM on SM90, warp-specialized: D[m, n] = sum_k A[m, k] * W[m_indices[m], n, k], rows with
// m_indices -1 written as 0. Operands as w4a8_gemm_sm90.cuh's contig layout.
//
// Why this shape: prefill is bound by the tensor core, and the register-operand kernel (w4a8_gemm_sm90.cuh)
// spends a thread's issue slots beside each MMA on widening its weights and on a promotion whose scale is
// a weight row's times a token's. Here a block is 128 tokens x 128 weight rows, one FP4 -> FP8 tile, so
// the weights' block scale sf128 is one number per K block and the promotion is DeepGEMM's (one FFMA per
// accumulator); and the tile is widened once for all 128 tokens:
//   warp groups 0 and 1 (producers, 256 threads): thread 0 issues TMA copies of each K block's tokens
//     (128-byte swizzle), the tile's 4-bit rows and the token scales into a ring slot (barrier `full`);
//     thread t then widens row t / 2, 32-groups 2h and 2h + 1 (h = t % 2): words 4c..4c+3 of the row, one
//     table per group, their even bytes to bytes 32q + 4c and odd bytes to 32q + 16 + 4c of the row's 128,
//     which is the W4A8 column order the tokens have, stored at the 128-byte swizzle: the wgmma's K-major
//     image, built by the threads. A proxy fence and the barrier `widened` hand it over;
//   warp groups 2 and 3 (consumers): 64 tokens each, SS wgmma m64n128k32 (tokens A, widened weights B),
//     then acc += part * (token scale x sf128); their arrivals on `empty` free the slot for the copies of
//     K block kb + STAGES, which thread 0 issues after widening kb + 1.
// Measured on one H100 (BENCHMARKS.md): with one producer warp group the producers alone (no MMA) took
// as long as the whole register-operand kernel, and the kernel was no faster than it; two producer warp
// groups (the consumers keep their 146 registers through setmaxnreg: 56 for producers, 200 for
// consumers) and the rows' scale words loaded one K block ahead made it 1.09-1.13x faster at V4's GEMM1
// and 1.03-1.04x at GEMM2. It still executes 3x DeepGEMM's instructions per MMA, and they do not all issue
// within the tensor core's time.
//
// Where a producer finds its row's scale word (W4A8_WS_SHARED_SCALES): 0, loaded from global memory one K
// block ahead; 1, from the tile's scale words, which all threads copy into shared memory after the ring
// before the first K block (rows padded to an odd word count, so a warp's 16 rows read distinct banks).
// A load still in flight when a producer fences its stores for the wgmma (fence.proxy.async) is waited
// for there, so the first form may pay the load's latency every K block.
//
// The generated translation unit defines, before this text: W4A8_WS_N, W4A8_WS_K, W4A8_WS_STAGES,
// W4A8_WS_SHARED_SCALES; then
// w4a8_sm90_common.cuh and wgmma_m64n128k32_ss(d, desc_a, desc_b, accumulate). Dynamic shared memory:
// `w4a8_contig_ws.smem_bytes`.

namespace moe_jax_w4a8_ws {

constexpr int N = W4A8_WS_N, K = W4A8_WS_K, STAGES = W4A8_WS_STAGES, KB = K / 128;
constexpr int BLOCK = 128;  // tokens and weight rows of a block
constexpr int TOKEN_BYTES = BLOCK * 128, WIDE_BYTES = BLOCK * 128, W4_BYTES = BLOCK * 64, SCALE_BYTES = BLOCK * 4;
// a ring slot: tokens and widened weights first (the 128-byte swizzle repeats every 1024 bytes)
constexpr int SLOT = (TOKEN_BYTES + WIDE_BYTES + W4_BYTES + SCALE_BYTES + 1023) / 1024 * 1024;
static_assert(K % 128 == 0, "K must be a multiple of 128");
constexpr int SW_LD = KB | 1;  // shared scale words: a row's stride in words
constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 200;  // 256 x 56 + 256 x 200 = 65536
static_assert(STAGES >= 2 && STAGES <= 5, "STAGES must be in [2, 5]");

}  // namespace moe_jax_w4a8_ws

extern "C" __global__ void __launch_bounds__(512, 1)
moe_jax_w4a8_contig_ws_sm90(const __grid_constant__ moe_jax_w4a8::TmaDesc tokens_map,
                            const __grid_constant__ moe_jax_w4a8::TmaDesc scales_map,
                            const __grid_constant__ moe_jax_w4a8::TmaDesc weights_map,
                            const uint32_t* __restrict__ sw, const int* __restrict__ m_indices,
                            __nv_bfloat16* __restrict__ d) {
  using namespace moe_jax_w4a8;
  using namespace moe_jax_w4a8_ws;
  extern __shared__ uint8_t ring_smem[];  // STAGES slots from the first 1024-byte boundary
  __shared__ __align__(8) uint64_t bars[3 * STAGES];  // full (1 + the copies' bytes), widened (256), empty (256)
  __shared__ uint2 tables[32];  // table_words of every 5-bit index

  const int tid = threadIdx.x, wg = tid / 128, t = tid % 128;
  const int mb = blockIdx.y * BLOCK, wrow0 = blockIdx.x * BLOCK;
  const int g = m_indices[mb];  // a block lies in one expert's segment (the alignment is a multiple of 128)
  if (g < 0) {  // a padding block: zeros, and no copies (no barrier is left waiting)
    for (int i = tid; i < BLOCK * BLOCK; i += 512) {
      const int m = mb + i / BLOCK, n = wrow0 + i % BLOCK;
      if (n < N) d[static_cast<size_t>(m) * N + n] = __float2bfloat16_rn(0.f);
    }
    return;
  }
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(ring_smem));
  const uint32_t ring = (raw + 1023u) & ~1023u;
  uint8_t* ring_ptr = ring_smem + (ring - raw);
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(&bars[0]));
  auto full = [&](int s) { return bar0 + 8 * s; };
  auto widened = [&](int s) { return bar0 + 8 * (STAGES + s); };
  auto empty = [&](int s) { return bar0 + 8 * (2 * STAGES + s); };
  // thread 0: K block kb's tokens, the tile's 4-bit rows (rows past N: the next group's, or zeros past the
  // tensor; widened as zeros) and the token scales into slot kb % STAGES
  auto issue = [&](int kb) {
    const int s = kb % STAGES;
    const uint32_t slot = ring + s * SLOT;
    mbar_expect_tx(full(s), TOKEN_BYTES + W4_BYTES + SCALE_BYTES);
    tma_load_2d(slot, &tokens_map, full(s), kb * 128, mb);
    tma_load_2d(slot + TOKEN_BYTES + WIDE_BYTES, &weights_map, full(s), kb * 64, g * N + wrow0);
    tma_load_2d(slot + TOKEN_BYTES + WIDE_BYTES + W4_BYTES, &scales_map, full(s), mb, kb);
  };
  if (tid < 32) {
    uint32_t lo, hi;
    table_words(tid, lo, hi);
    tables[tid] = make_uint2(lo, hi);
  }
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 1);
      mbar_init(widened(s), 256);
      mbar_init(empty(s), 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int kb = 0; kb < STAGES && kb < KB; ++kb) issue(kb);
  }
#if W4A8_WS_SHARED_SCALES
  uint32_t* tile_sw = reinterpret_cast<uint32_t*>(ring_ptr + STAGES * SLOT);  // (BLOCK, SW_LD); rows past N: 0
  for (int i = tid; i < BLOCK * KB; i += 512) {
    const int row = i / KB;
    tile_sw[row * SW_LD + i % KB] = wrow0 + row < N ? __ldg(sw + (static_cast<size_t>(g) * N + wrow0) * KB + i) : 0u;
  }
#endif
  __syncthreads();  // the tables, the barriers (and the scale words), before anyone reads or waits

  if (wg < 2) {
    // Producers. Thread tid: row r = tid / 2 of the tile, 32-groups 2h and 2h + 1 (h = tid % 2), which are
    // 8 bytes of each 16-byte (k32 step, even / odd) chunk of the row; the row's swizzle fixes the chunks.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS) : "memory");
    const int r = tid / 2, h = tid % 2;
    uint32_t chunk[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) chunk[j] = r * 128 + ((j ^ (r % 8)) * 16) + 8 * h;
#if W4A8_WS_SHARED_SCALES
    const uint32_t* row_sw = tile_sw + r * SW_LD;
#else
    // the row's scale word one K block ahead: its load is in flight while the previous block is widened
    // (table 0 for rows past N: their columns of D are not written)
    const bool row_ok = wrow0 + r < N;
    const uint32_t* srow = sw + (static_cast<size_t>(g) * N + wrow0 + r) * KB;
    uint32_t next_sword = row_ok ? __ldg(srow) : 0u;
#endif
#pragma unroll 1
    for (int kb = 0; kb < KB; ++kb) {
      const int s = kb % STAGES;
#if W4A8_WS_SHARED_SCALES
      const uint32_t sword = row_sw[kb];
#else
      const uint32_t sword = next_sword;
      next_sword = row_ok && kb + 1 < KB ? __ldg(srow + kb + 1) : 0u;
#endif
      mbar_wait(full(s), (kb / STAGES) & 1);
      const uint8_t* w4 = ring_ptr + s * SLOT + TOKEN_BYTES + WIDE_BYTES;
      uint8_t* wide = ring_ptr + s * SLOT + TOKEN_BYTES;
      uint4 v[2];
      uint2 tw[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int c = 2 * h + i;
        v[i] = *reinterpret_cast<const uint4*>(w4 + r * 64 + 16 * c);
        tw[i] = tables[(sword >> (8 + 5 * c)) & 31u];
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        uint32_t even[2], odd[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const uint32_t word = q == 0 ? v[i].x : q == 1 ? v[i].y : q == 2 ? v[i].z : v[i].w;
          widen(word, tw[i].x, tw[i].y, even[i], odd[i]);
        }
        *reinterpret_cast<uint2*>(wide + chunk[2 * q]) = make_uint2(even[0], even[1]);
        *reinterpret_cast<uint2*>(wide + chunk[2 * q + 1]) = make_uint2(odd[0], odd[1]);
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the threads' stores, for the wgmma
      mbar_arrive(widened(s));
      if (tid == 0 && kb >= 1 && kb - 1 + STAGES < KB) {  // the slot of K block kb - 1, once both consumers are done
        mbar_wait(empty((kb - 1) % STAGES), ((kb - 1) / STAGES) & 1);
        issue(kb - 1 + STAGES);
      }
    }
    return;
  }

  // Consumers: warp group wg takes tokens 64 (wg - 2) .. + 63 of the block.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS) : "memory");
  const int cw = wg - 2, warp = t / 32, gid = (t % 32) / 4, c = t % 4;
  float acc[64], part[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) acc[j] = 0.f;
  const uint32_t* tile_words = sw + (static_cast<size_t>(g) * N + wrow0) * KB;  // row wrow0 < N: the tile's sf128
  uint32_t sf_word = __ldg(tile_words);
#pragma unroll 1
  for (int kb = 0; kb < KB; ++kb) {
    const int s = kb % STAGES;
    const float sf128 = __uint_as_float((sf_word & 0xFFu) << 23);
    if (kb + 1 < KB) sf_word = __ldg(tile_words + kb + 1);
    mbar_wait(full(s), (kb / STAGES) & 1);
    mbar_wait(widened(s), (kb / STAGES) & 1);
    const uint64_t desc_a = smem_desc_sw128(ring + s * SLOT + cw * 64 * 128);
    const uint64_t desc_b = smem_desc_sw128(ring + s * SLOT + TOKEN_BYTES);
#pragma unroll
    for (int j = 0; j < 64; ++j) fence_operand(part[j]);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k32 = 0; k32 < 4; ++k32) wgmma_m64n128k32_ss(part, desc_a + 2 * k32, desc_b + 2 * k32, k32 > 0);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
    for (int j = 0; j < 64; ++j) fence_operand(part[j]);
    const float* token_scale =
        reinterpret_cast<const float*>(ring_ptr + s * SLOT + TOKEN_BYTES + WIDE_BYTES + W4_BYTES) + 64 * cw + 16 * warp + gid;
    const float s0 = token_scale[0] * sf128, s1 = token_scale[8] * sf128;
    mbar_arrive(empty(s));  // this thread is done with the slot
    // part[4j + e]: token 16 warp + gid + 8 (e / 2) of the warp group's 64, weight row 8j + 2c + e % 2
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      acc[4 * j + 0] = fmaf(s0, part[4 * j + 0], acc[4 * j + 0]);
      acc[4 * j + 1] = fmaf(s0, part[4 * j + 1], acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(s1, part[4 * j + 2], acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(s1, part[4 * j + 3], acc[4 * j + 3]);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = mb + 64 * cw + 16 * warp + gid + 8 * h;
    const bool real = m_indices[m] >= 0;  // the segment's padding rows: 0
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int n = wrow0 + 8 * j + 2 * c;
      const float v0 = real ? acc[4 * j + 2 * h] : 0.f, v1 = real ? acc[4 * j + 2 * h + 1] : 0.f;
      __nv_bfloat16* p = d + static_cast<size_t>(m) * N + n;
      if (N % 2 == 0 && n + 1 < N) {
        *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
      } else {
        if (n < N) p[0] = __float2bfloat16_rn(v0);
        if (n + 1 < N) p[1] = __float2bfloat16_rn(v1);
      }
    }
  }
}
