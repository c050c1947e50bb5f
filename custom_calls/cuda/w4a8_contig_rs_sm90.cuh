// W4A8 contig GEMM on SM90, persistent and warp-specialized, the weights the wgmma's register operand:
// D[m, n] = sum_k A[m, k] * W[m_indices[m], n, k], rows with m_indices -1 written as 0. Operands as
// w4a8_gemm_sm90.cuh's contig layout.
//
// Why this shape: the warp-specialized kernel it replaced widened each weight tile into shared memory,
// which cost stores, a proxy fence and a barrier per K block on top of the widening, and its producers
// could not issue that work within the tensor core's time (docs/ARCHITECTURE.md). Here each consumer thread widens
// its own fragment of the weights in registers (the masked kernel's fragment order, w4a8_gemm_sm90.cuh)
// and hands it to the tensor core directly; the tokens are the wgmma's shared-memory operand, 128 of them
// (N = 128), so each widened word feeds 128 tokens:
//   warp group 0 (producer): one thread issues each K block's TMA copies into a ring slot (the tile's 128
//     tokens at the 128-byte swizzle, its 128 4-bit weight rows, the tokens' scales; barrier `full`),
//     tile after tile, a slot refilled once the 256 consumer threads have arrived on `empty`; its warp 1
//     multiplies the slot's 128 token scales by sf128, the tile's block scale, once for the block
//     (barrier `scaled`), in the order the consumers' 16-byte loads read them;
//   warp groups 1 and 2 (consumers): weight rows 64 (wg - 1) .. + 63 of the tile each; per K block a
//     thread reads its 16 bytes of two rows, widens them (two `prmt` a word), runs four RS wgmma
//     m64n128k32 and promotes: acc += part * (token scale x sf128), one FFMA per accumulator.
// Why the scaling warp: a thread's accumulators span 32 tokens (the tokens are the MMA's N side), so each
// of the 256 consumer threads would load and multiply 32 scales per K block where 128 products serve all.
// A block loops over tiles blockIdx.x, + gridDim.x, ... (token block major, so the blocks at work share
// the tokens and one expert's weights in L2); the producer runs ahead into the next tile while the
// consumers write the last one out through shared memory (rows of 16-byte stores).
// Why the consumers load a tile's expert and first scale words during the tile before it, and the rows'
// m_indices at the tile's start: both consumer warp groups start and finish a tile together, so a load
// waited on there idles the tensor core (loaded in place they cost 1.10-1.13x at V4's GEMM2, K 2048, and
// 1.03-1.05x at GEMM1, K 4096).
//
// The generated translation unit defines, before this text: W4A8_RS_N, W4A8_RS_K, W4A8_RS_STAGES, W4A8_RS_AHEAD
// (1: K block kb + 1 widened while K block kb's MMA runs); then
// w4a8_sm90_common.cuh and wgmma_m64n128k32_rs(d, a, desc, accumulate). Dynamic shared memory:
// `w4a8_contig_rs.smem_bytes`.
// Shared memory: STAGES slots from the first 1024-byte boundary, the output staging, then STAGES arrays of
// scaled token scales: token 8 u + 2 c + b at c * SCALED_LD + 2 u + b (consumer thread c's 32 scales in a row,
// its 16-byte loads at four rows' different banks).

namespace moe_jax_w4a8_rs {

constexpr int N = W4A8_RS_N, K = W4A8_RS_K, STAGES = W4A8_RS_STAGES, KB = K / 128;
constexpr int BLOCK = 128;  // tokens and weight rows of a tile
constexpr int N_TILES = (N + BLOCK - 1) / BLOCK;
constexpr int TOKEN_BYTES = BLOCK * 128, W4_BYTES = BLOCK * 64, SCALE_BYTES = BLOCK * 4;
constexpr int SLOT = (TOKEN_BYTES + W4_BYTES + SCALE_BYTES + 1023) / 1024 * 1024;
constexpr int OUT_LD = BLOCK + 8;  // the output staging's row stride in bf16: a warp's stores hit 16 banks
constexpr int SCALED_LD = 36;      // floats per row of the scaled token scales (32 + 4: rows at other banks)
constexpr int CONSUMER_WARPS = 8;
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;  // 128 x 40 + 256 x 232 <= 65536
static_assert(K % 128 == 0, "K must be a multiple of 128");
static_assert(STAGES >= 2 && STAGES <= 7, "STAGES must be in [2, 7]");

}  // namespace moe_jax_w4a8_rs

extern "C" __global__ void __launch_bounds__(384, 1)
moe_jax_w4a8_contig_rs_sm90(const __grid_constant__ moe_jax_w4a8::TmaDesc tokens_map,
                            const __grid_constant__ moe_jax_w4a8::TmaDesc scales_map,
                            const __grid_constant__ moe_jax_w4a8::TmaDesc weights_map,
                            const uint32_t* __restrict__ sw, const int* __restrict__ m_indices,
                            __nv_bfloat16* __restrict__ d, const uint32_t m_blocks) {
  using namespace moe_jax_w4a8;
  using namespace moe_jax_w4a8_rs;
  extern __shared__ uint8_t ring_smem[];  // the slots, the staging, the scaled token scales (above)
  __shared__ __align__(8) uint64_t bars[3 * STAGES];  // full (1 + the copies' bytes), empty (256 consumer threads), scaled (32)
  __shared__ uint2 tables[32];                        // table_words of every 5-bit index

  const int tid = threadIdx.x, wg = tid / 128;
  const int num_tiles = static_cast<int>(m_blocks) * N_TILES;
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(ring_smem));
  const uint32_t ring = (raw + 1023u) & ~1023u;
  uint8_t* ring_ptr = ring_smem + (ring - raw);
  __nv_bfloat16* staging = reinterpret_cast<__nv_bfloat16*>(ring_ptr + STAGES * SLOT);  // (BLOCK tokens, OUT_LD)
  float* scaled_ts = reinterpret_cast<float*>(staging + BLOCK * OUT_LD);                   // (STAGES, 4, SCALED_LD)
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(&bars[0]));
  auto full = [&](int s) { return bar0 + 8 * s; };
  auto empty = [&](int s) { return bar0 + 8 * (STAGES + s); };
  auto scaled = [&](int s) { return bar0 + 8 * (2 * STAGES + s); };
  if (tid < 32) {
    uint32_t lo, hi;
    table_words(tid, lo, hi);
    tables[tid] = make_uint2(lo, hi);
  }
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 32 * CONSUMER_WARPS);
      mbar_init(scaled(s), 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();  // the tables and the barriers, before anyone reads or waits

  if (wg == 0) {
    // Producer: K block after K block of each real tile (a padding tile has no copies), slot it % STAGES
    // refilled once its previous K block's eight consumer warps arrived.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(PRODUCER_REGS) : "memory");
    if (tid / 32 == 1) {
      // Scaling warp: lane l takes tokens 4 l .. + 3 of each K block (u = l / 2, c = 2 (l % 2) + {0, 1}).
      // Consumers free a slot only after `scaled`, so its next copies wait for this warp too.
      const int lane = tid % 32, u = lane / 2;
      int it = 0;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const int mb = (tile / N_TILES) * BLOCK, wrow0 = (tile % N_TILES) * BLOCK;
        const int g = m_indices[mb];
        if (g < 0) continue;
        const uint32_t* srow = sw + (static_cast<size_t>(g) * N + wrow0) * KB;  // a real row: sf128 of the tile
        uint32_t word = __ldg(srow);
        for (int kb = 0; kb < KB; ++kb, ++it) {
          const int s = it % STAGES;
          const float sf128 = __uint_as_float((word & 0xFFu) << 23);
          if (kb + 1 < KB) word = __ldg(srow + kb + 1);
          mbar_wait(full(s), (it / STAGES) & 1);
          // implied by `full` (its copies were issued after `empty`), waited so that the order is explicit
          if (it >= STAGES) mbar_wait(empty(s), ((it / STAGES) - 1) & 1);
          const float4 ts = *reinterpret_cast<const float4*>(ring_ptr + s * SLOT + TOKEN_BYTES + W4_BYTES + 16 * lane);
          float* out = scaled_ts + s * 4 * SCALED_LD + 2 * u;
          *reinterpret_cast<float2*>(out + (2 * (lane % 2)) * SCALED_LD) = make_float2(ts.x * sf128, ts.y * sf128);
          *reinterpret_cast<float2*>(out + (2 * (lane % 2) + 1) * SCALED_LD) = make_float2(ts.z * sf128, ts.w * sf128);
          mbar_arrive(scaled(s));
        }
      }
    } else if (tid == 0) {
      int it = 0;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const int mb = (tile / N_TILES) * BLOCK, wrow0 = (tile % N_TILES) * BLOCK;
        const int g = m_indices[mb];  // a tile's tokens lie in one expert's segment (alignment % 128 == 0)
        if (g < 0) continue;
        for (int kb = 0; kb < KB; ++kb, ++it) {
          const int s = it % STAGES;
          if (it >= STAGES) mbar_wait(empty(s), ((it / STAGES) - 1) & 1);
          const uint32_t slot = ring + s * SLOT;
          mbar_expect_tx(full(s), TOKEN_BYTES + W4_BYTES + SCALE_BYTES);
          tma_load_2d(slot, &tokens_map, full(s), kb * 128, mb);
          tma_load_2d(slot + TOKEN_BYTES, &weights_map, full(s), kb * 64, g * N + wrow0);
          tma_load_2d(slot + TOKEN_BYTES + W4_BYTES, &scales_map, full(s), mb, kb);
        }
      }
    }
    return;
  }

  // Consumers: warp group cw takes the tile's weight rows 64 cw .. + 63; thread (warp, gid, c) rows
  // r0 = 64 cw + 16 warp + gid and r0 + 8, 32-group c of each K block (the register fragment's order).
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER_REGS) : "memory");
  const int cw = wg - 1, t = tid % 128, warp = t / 32, lane = t % 32, gid = lane / 4, c = lane % 4;
  const int r0 = 64 * cw + 16 * warp + gid;
  // the expert of tile `tile` (-1: a padding tile or past the last)
  auto tile_expert = [&](int tile) { return tile < num_tiles ? m_indices[(tile / N_TILES) * BLOCK] : -1; };
  // the scale words of K block kb of this thread's rows r0, r0 + 8 of tile `tile` in expert g (rows past N:
  // table 0, block scale 0; not written out)
  auto row_words = [&](int g, int tile, int kb, uint32_t& w0, uint32_t& w1) {
    const int row = (tile % N_TILES) * BLOCK + r0;
    const uint32_t* p = sw + (static_cast<size_t>(g) * N + row) * KB + kb;
    w0 = row < N ? __ldg(p) : 0u;
    w1 = row + 8 < N ? __ldg(p + 8 * KB) : 0u;
  };
  // a tile's expert and first scale words: loaded during the tile before it (below; the first tile's here)
  int tile = blockIdx.x;
  int g = tile_expert(tile);
  uint32_t first0 = 0, first1 = 0;
  if (g >= 0) row_words(g, tile, 0, first0, first1);
  int it = 0;
#pragma unroll 1
  for (; tile < num_tiles; tile += gridDim.x) {
    const int mb = (tile / N_TILES) * BLOCK, wrow0 = (tile % N_TILES) * BLOCK;
    const int next = tile + gridDim.x;
    const int g_next = tile_expert(next);
    int row_ids[8];  // m_indices of the rows of this thread's 16-byte stores (row (t + 128 j) / 8)
#pragma unroll
    for (int j = 0; j < 8; ++j) row_ids[j] = m_indices[mb + (t + 128 * j) / 8];
    float acc[64];
#pragma unroll
    for (int j = 0; j < 64; ++j) acc[j] = 0.f;
    if (g >= 0) {
      // thread's fragment of K block (slot s) per k32 step: a0 (r0, even), a1 (r0 + 8, even), a2 (r0, odd),
      // a3 (r0 + 8, odd)
      auto widen_block = [&](int s, uint32_t sword0, uint32_t sword1, uint32_t (&frag)[4][4]) {
        const uint8_t* slot = ring_ptr + s * SLOT;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint4 v = *reinterpret_cast<const uint4*>(slot + TOKEN_BYTES + (r0 + 8 * h) * 64 + 16 * c);
          const uint2 tw = tables[((h ? sword1 : sword0) >> (8 + 5 * c)) & 31u];
          widen_row(v, tw.x, tw.y, h, frag);
        }
      };
      float part[64];
      auto mma = [&](int s, const uint32_t (&frag)[4][4]) {
#pragma unroll
        for (int j = 0; j < 64; ++j) fence_operand(part[j]);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        const uint64_t desc = smem_desc_sw128(ring + s * SLOT);
#pragma unroll
        for (int q = 0; q < 4; ++q) wgmma_m64n128k32_rs(part, frag[q], desc + 2 * q, q > 0);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      };
      // acc += part * (token scale x sf128); part[4 u + j]: weight row r0 + 8 (j / 2), token 8 u + 2 c + j % 2.
      // The scaled token scales are read before the thread frees the slot (and with it their array).
      auto promote = [&](int s, uint32_t phase) {
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
        for (int j = 0; j < 64; ++j) fence_operand(part[j]);
        mbar_wait(scaled(s), phase);
        const float* row = scaled_ts + (s * 4 + c) * SCALED_LD;
        float4 ts[8];  // tokens 8 u + 2 c + {0, 1}: ts[u / 2] .x .y (u even), .z .w (u odd)
#pragma unroll
        for (int i = 0; i < 8; ++i) ts[i] = *reinterpret_cast<const float4*>(row + 4 * i);
        mbar_arrive(empty(s));  // this thread is done with the slot (every thread arrives: its own reads ordered)
#pragma unroll
        for (int u = 0; u < 16; ++u) {
          const float s0 = u % 2 ? ts[u / 2].z : ts[u / 2].x, s1 = u % 2 ? ts[u / 2].w : ts[u / 2].y;
          acc[4 * u + 0] = fmaf(s0, part[4 * u + 0], acc[4 * u + 0]);
          acc[4 * u + 1] = fmaf(s1, part[4 * u + 1], acc[4 * u + 1]);
          acc[4 * u + 2] = fmaf(s0, part[4 * u + 2], acc[4 * u + 2]);
          acc[4 * u + 3] = fmaf(s1, part[4 * u + 3], acc[4 * u + 3]);
        }
      };
      uint32_t next0 = first0, next1 = first1;
#if W4A8_RS_AHEAD
      // K block kb + 1 widened while K block kb's MMA runs: two fragment sets, their roles swapped every
      // K block (two K blocks a loop iteration, so that no fragment is copied)
      uint32_t frag_a[4][4], frag_b[4][4];
      mbar_wait(full(it % STAGES), (it / STAGES) & 1);
      widen_block(it % STAGES, next0, next1, frag_a);
      if (KB > 1) row_words(g, tile, 1, next0, next1);  // the rows' scale words, one K block ahead
      auto step = [&](int kb, const uint32_t (&frag)[4][4], uint32_t (&ahead)[4][4]) {
        const int s = it % STAGES;
        mma(s, frag);
        if (kb + 1 < KB) {
          const int s1 = (it + 1) % STAGES;
          mbar_wait(full(s1), ((it + 1) / STAGES) & 1);
          widen_block(s1, next0, next1, ahead);
          if (kb + 2 < KB) row_words(g, tile, kb + 2, next0, next1);
        }
        promote(s, (it / STAGES) & 1);
        ++it;
      };
#pragma unroll 1
      for (int kb = 0; kb < KB; kb += 2) {
        step(kb, frag_a, frag_b);
        if (kb + 1 < KB) step(kb + 1, frag_b, frag_a);
      }
#else
#pragma unroll 1
      for (int kb = 0; kb < KB; ++kb, ++it) {
        const int s = it % STAGES;
        const uint32_t sword0 = next0, sword1 = next1;
        if (kb + 1 < KB) row_words(g, tile, kb + 1, next0, next1);
        mbar_wait(full(s), (it / STAGES) & 1);
        uint32_t frag[4][4];
        widen_block(s, sword0, sword1, frag);
        mma(s, frag);
        promote(s, (it / STAGES) & 1);
      }
#endif
    }
    if (g_next >= 0) row_words(g_next, next, 0, first0, first1);  // the next tile's, under this tile's epilogue
    g = g_next;
    // Out through shared memory: the warp group's 64 columns of the tile's 128 token rows, then 16-byte
    // stores along each row (the segment's padding rows and a padding tile: 0).
    asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");  // the last tile's rows are out
#pragma unroll
    for (int u = 0; u < 16; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        staging[(8 * u + 2 * c + (j & 1)) * OUT_LD + r0 + 8 * (j >> 1)] = __float2bfloat16_rn(acc[4 * u + j]);
    asm volatile("bar.sync %0, 128;" ::"r"(1 + cw) : "memory");
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int i = t + 128 * j, row = i / 8, col = 64 * cw + 8 * (i % 8), m = mb + row, n = wrow0 + col;
      if (n >= N) continue;
      const bool real = row_ids[j] >= 0;
      __nv_bfloat16* p = d + static_cast<size_t>(m) * N + n;
      if (N % 8 == 0) {
        const uint4 v = real ? *reinterpret_cast<const uint4*>(staging + row * OUT_LD + col) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(p) = v;
      } else {
        for (int e = 0; e < 8 && n + e < N; ++e) p[e] = real ? staging[row * OUT_LD + col + e] : __float2bfloat16_rn(0.f);
      }
    }
  }
}
