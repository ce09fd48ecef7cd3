// W[n, k] = (c[n, k] - z[g(k), n]) * s[g(k), n] in float32: the same operations, in the same order, as
// formats/compressed_tensors.dequantize_pack_quantized and formats/gptq.dequantize (see kernels/layouts.py).
#include "int_dequant.h"

namespace {

template <int BITS>
__global__ void dequant_kernel(GroupPackedArgs a, float* __restrict__ out) {
  constexpr int kPerWord = 32 / BITS;
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // consecutive threads: consecutive k
  if (k >= a.k) return;
  const int64_t g = a.g_idx ? static_cast<int64_t>(a.g_idx[k]) : k / a.group_width;
  const int shift = static_cast<int>(k % kPerWord) * BITS;
  for (int64_t n = blockIdx.y; n < a.n; n += gridDim.y) {
    const uint32_t word = static_cast<uint32_t>(a.words[(k / kPerWord) * a.sw_k + n * a.sw_n]);
    const float code = static_cast<float>((word >> shift) & kMask);
    float zero;
    if (a.zeros) {
      const uint32_t zword = static_cast<uint32_t>(a.zeros[g * a.sz_g + (n / kPerWord) * a.sz_n]);
      zero = static_cast<float>(static_cast<int32_t>((zword >> ((n % kPerWord) * BITS)) & kMask) + a.zero_offset);
    } else {
      zero = static_cast<float>(1 << (BITS - 1));
    }
    // __fsub_rn/__fmul_rn: two roundings, never contracted into one FMA (the reference rounds twice)
    out[n * a.k + k] = __fmul_rn(__fsub_rn(code, zero), a.scales[g * a.ss_g + n * a.ss_n]);
  }
}

template <int BITS>
cudaError_t launch(const GroupPackedArgs& a, float* out, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const dim3 grid(static_cast<unsigned>((a.k + kThreads - 1) / kThreads),
                  static_cast<unsigned>(a.n < 65535 ? a.n : 65535));
  dequant_kernel<BITS><<<grid, kThreads, 0, stream>>>(a, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t compress_int_dequant(const GroupPackedArgs& args, float* out, cudaStream_t stream) {
  if (args.n == 0 || args.k == 0) return cudaSuccess;
  switch (args.bits) {
    case 2: return launch<2>(args, out, stream);
    case 4: return launch<4>(args, out, stream);
    case 8: return launch<8>(args, out, stream);
    default: return cudaErrorInvalidValue;
  }
}
