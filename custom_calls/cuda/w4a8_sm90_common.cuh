// Device helpers of the W4A8 kernels on SM90 (w4a8_gemm_sm90.cuh, w4a8_contig_rs_sm90.cuh): the W4A8
// word widening (layouts/w4a8.py), shared-memory descriptors, mbarriers and TMA copies. The host code puts
// this text before each kernel's.

#include <cstdint>
#include <cuda_bf16.h>

namespace moe_jax_w4a8 {

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

// Half h of a thread's register fragment of one K block (h = 0: its row r, 1: row r + 8): the row's 16 bytes
// `v` (one word per k32 step q) widened with the row's table -> frag[q][h] (even columns), frag[q][2 + h]
// (odd columns), the m64k32 A fragment's order.
__device__ __forceinline__ void widen_row(const uint4 v, uint32_t lo, uint32_t hi, int h, uint32_t (&frag)[4][4]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) widen(words[q], lo, hi, frag[q][h], frag[q][2 + h]);
}

// A K-major wgmma operand with the 128-byte swizzle TMA writes: 128-byte rows in atoms of 8 (SBO 1024);
// k32 step s starts 32 bytes along the row (+2 in the address field).
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

struct alignas(64) TmaDesc {
  unsigned long long opaque[16];
};

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar), "r"(phase) : "memory");
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TmaDesc* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1) : "memory");
}

}  // namespace moe_jax_w4a8
