// W4A8 masked grouped GEMM on SM90: D[g, m, n] = sum_k A[g, m, k] * W[g, n, k] for m < masked_m[g].
//
// A: (G, M_PAD, K) e4m3 with fp32 scales per token and 128 columns, sa (G, K/128, SA_LD);
// W: MXFP4 kept 4-bit (layouts/w4a8.py): values (G, N, K/2) in the W4A8 word layout and one int32
// scale word per row and 128 columns, sw (G, N, K/128); D: (G, M_PAD, N) bf16, rows >= masked_m[g]
// not written.
//
// Why this shape: at decode every weight byte is read once and the few tokens ride along, so the
// weights are the wgmma's A operand taken from registers: each thread loads its own 16 bytes per row
// and 128 columns straight from global memory (one 128-bit load), widens each 4-byte word to two e4m3
// registers with two byte permutes from its 32-group's table, and hands them to the tensor core with
// no shared-memory round trip. Only the tokens (the B operand, N = 8 * TOKEN_TILES) are staged in
// shared memory. Fragment column c (lane % 4) takes the 32 columns 32c..32c+31 of each 128-block:
// word 4c + s is k32 step s, its even columns in a0/a1 and odd columns in a2/a3, and the tokens are
// staged with the same permutation (even columns of each 8 in the first 16-byte core matrix of a step,
// odd in the second) so A and B agree on every k. Per 128 columns the fp32 partial is promoted with
// (weight block scale) x (token scale), DeepGEMM's 1D2D recipe.
//
// The generated translation unit defines, before this text: W4A8_N, W4A8_K, W4A8_M_PAD, W4A8_SA_LD,
// W4A8_TOKEN_TILES, W4A8_WARPGROUPS (64 weight rows each), W4A8_STAGES (K blocks in flight per
// thread, even), W4A8_MIN_BLOCKS; and wgmma_m64k32(d, a, desc, accumulate) for N = 8 * TOKEN_TILES.

#include <cstdint>
#include <cuda_bf16.h>

namespace moe_jax_w4a8 {

constexpr int N = W4A8_N, K = W4A8_K, M_PAD = W4A8_M_PAD, SA_LD = W4A8_SA_LD;
constexpr int T = W4A8_TOKEN_TILES, WG = W4A8_WARPGROUPS, STAGES = W4A8_STAGES;
constexpr int KB = K / 128;
constexpr int THREADS = 128 * WG;
constexpr int TOKENS = 8 * T;
constexpr int ITEMS = (32 * T + THREADS - 1) / THREADS;  // staging items (token, column slice) per thread
constexpr int STEP_BYTES = 2 * TOKENS * 16;              // one k32 step of the tokens: two core-matrix columns
constexpr int SLOT_BYTES = 4 * STEP_BYTES;               // one 128-column K block
static_assert(K % 128 == 0, "K must be a multiple of 128");
static_assert(SA_LD % 4 == 0 && SA_LD >= M_PAD, "SA_LD must be align(M_PAD, 4)");
static_assert(STAGES == 2 || STAGES == 4, "STAGES must be 2 or 4");

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// A 32-group's e4m3 table E4M3_TABLES[idx] (layouts/w4a8.py) as two little-endian words: tables 8+
// (6+ for hi) are the s = 0 table with s added to each nonzero byte's exponent; below, e4m3
// subnormals rounded to nearest even. Host-callable so that a CPU test checks it against the tables.
__host__ __device__ __forceinline__ void table_words(uint32_t idx, uint32_t& lo, uint32_t& hi) {
  const uint32_t s = idx - 13u;  // wraps for idx < 13, as the two's complement products below expect
  lo = 0x3C383000u + s * 0x08080800u;
  hi = 0x4C484440u + s * 0x08080808u;
  if (idx < 8u)
    lo = idx == 7u ? 0x0C080400u : idx == 6u ? 0x06040200u : idx == 5u ? 0x03020100u
       : idx == 4u ? 0x02010000u : idx == 3u ? 0x01000000u : 0u;
  if (idx < 6u)
    hi = idx == 5u ? 0x0C080604u : idx == 4u ? 0x06040302u : idx == 3u ? 0x03020201u
       : idx == 2u ? 0x02010100u : idx == 1u ? 0x01000000u : 0u;
}

// One W4A8 word (8 codes, columns 8q..8q+7) -> e4m3 bytes of its even columns and of its odd columns.
__device__ __forceinline__ void widen(uint32_t w, uint32_t lo, uint32_t hi, uint32_t& even, uint32_t& odd) {
  even = prmt(lo, hi, w & 0x7777u) | (w & 0x80808080u);
  odd = prmt(lo, hi, (w >> 16) & 0x7777u) | ((w << 4) & 0x80808080u);
}

// The weight stream: read once, so it skips L1 and asks L2 for the rest of the row's 256 bytes.
__device__ __forceinline__ void load_stream(const uint8_t* p, uint32_t* v) {
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "l"(p));
}

__device__ __forceinline__ void load_tokens(const uint8_t* p, uint32_t* v) {
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "l"(p));
}

// K-major B operand without swizzle: 8-token x 16-byte core matrices; LBO = the step's second core
// column (odd columns), SBO = the next 8 tokens.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  constexpr uint64_t lbo = TOKENS * 16, sbo = 128;
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32);
}

__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// What a thread holds of one K block before it is used: its weight rows' words and scale words, and
// its staging items' token bytes and scales.
struct Block {
  uint32_t v[2][4];
  uint32_t scale[2];
  uint32_t x[ITEMS][8];
  float token_scale[ITEMS];
};

}  // namespace moe_jax_w4a8

extern "C" __global__ void __launch_bounds__(128 * W4A8_WARPGROUPS, W4A8_MIN_BLOCKS)
moe_jax_w4a8_masked_sm90(const uint8_t* __restrict__ a, const float* __restrict__ sa,
                         const uint8_t* __restrict__ w, const uint32_t* __restrict__ sw,
                         const int* __restrict__ masked_m, __nv_bfloat16* __restrict__ d) {
  using namespace moe_jax_w4a8;
  __shared__ __align__(1024) uint8_t tokens_smem[2][SLOT_BYTES];
  __shared__ float scale_smem[2][TOKENS];

  const int g = blockIdx.z;
  const int rows = masked_m[g];
  const int mb = blockIdx.y * TOKENS;
  if (mb >= rows) return;  // the whole block: no barrier is left waiting
  const int tid = threadIdx.x, lane = tid % 32, gid = lane / 4, c = lane % 4;
  const int row0 = blockIdx.x * 64 * WG + (tid / 32) * 16 + gid;  // and row0 + 8
  const size_t wrow[2] = {static_cast<size_t>(g) * N + row0, static_cast<size_t>(g) * N + row0 + 8};
  const bool row_ok[2] = {row0 < N, row0 + 8 < N};

  auto load = [&](Block& b, int kb) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (kb < KB && row_ok[h]) {
        load_stream(w + wrow[h] * (K / 2) + kb * 64 + 16 * c, b.v[h]);
        b.scale[h] = __ldg(sw + wrow[h] * KB + kb);
      } else {
#pragma unroll
        for (int s = 0; s < 4; ++s) b.v[h][s] = 0u;
        b.scale[h] = 0u;  // table 0 and block scale 0: the row reads as zeros
      }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int item = tid + i * THREADS, m = mb + item / 4;
      const bool ok = kb < KB && item < 32 * T && m < rows;
      if (ok) {
        const uint8_t* p = a + (static_cast<size_t>(g) * M_PAD + m) * K + kb * 128 + 32 * (item % 4);
        load_tokens(p, &b.x[i][0]);
        load_tokens(p + 16, &b.x[i][4]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) b.x[i][j] = 0u;
      }
      b.token_scale[i] = ok && item % 4 == 0 ? __ldg(sa + (static_cast<size_t>(g) * KB + kb) * SA_LD + m) : 0.f;
    }
  };

  float acc[4 * T], part[4 * T];
#pragma unroll
  for (int j = 0; j < 4 * T; ++j) acc[j] = 0.f;

  Block ring[STAGES];
#pragma unroll
  for (int i = 0; i < STAGES; ++i) load(ring[i], i);

#pragma unroll 1
  for (int kb0 = 0; kb0 < KB; kb0 += STAGES) {
#pragma unroll
    for (int i = 0; i < STAGES; ++i) {
      const int kb = kb0 + i;
      if (kb >= KB) break;
      Block& b = ring[i];
      uint8_t* slot = tokens_smem[i % 2];
      // stage the tokens, permuted as the weight fragments are (see the top of this file)
#pragma unroll
      for (int it = 0; it < ITEMS; ++it) {
        const int item = tid + it * THREADS;
        if (item < 32 * T) {
          const int n = item / 4, col = item % 4;
          uint8_t* base = slot + (n / 8) * 128 + (n % 8) * 16 + 4 * col;
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            *reinterpret_cast<uint32_t*>(base + s * STEP_BYTES) = prmt(b.x[it][2 * s], b.x[it][2 * s + 1], 0x6420u);
            *reinterpret_cast<uint32_t*>(base + s * STEP_BYTES + TOKENS * 16) =
                prmt(b.x[it][2 * s], b.x[it][2 * s + 1], 0x7531u);
          }
          if (col == 0) scale_smem[i % 2][n] = b.token_scale[it];
        }
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();

      uint32_t frag[4][4];  // per k32 step: a0 (row0, even), a1 (row0 + 8, even), a2 (row0, odd), a3 (row0 + 8, odd)
      float block_scale[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t lo, hi;
        table_words((b.scale[h] >> (8 + 5 * c)) & 31u, lo, hi);
        block_scale[h] = __uint_as_float((b.scale[h] & 0xFFu) << 23);
#pragma unroll
        for (int s = 0; s < 4; ++s) widen(b.v[h][s], lo, hi, frag[s][h], frag[s][2 + h]);
      }
      load(b, kb + STAGES);

      const uint32_t slot_addr = static_cast<uint32_t>(__cvta_generic_to_shared(slot));
#pragma unroll
      for (int j = 0; j < 4 * T; ++j) fence_operand(part[j]);
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int s = 0; s < 4; ++s) wgmma_m64k32(part, frag[s], smem_desc(slot_addr + s * STEP_BYTES), s > 0);
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
      for (int j = 0; j < 4 * T; ++j) fence_operand(part[j]);

      // part[4t + j]: weight row row0 + 8 * (j / 2), token 8t + 2c + j % 2
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float2 ts = *reinterpret_cast<const float2*>(&scale_smem[i % 2][8 * t + 2 * c]);
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
      if (m < rows) d[(static_cast<size_t>(g) * M_PAD + m) * N + n] = __float2bfloat16_rn(acc[4 * t + j]);
    }
  }
}
