// Int group dequant for the GroupPacked view (kernels/layouts.py): header-free of torch, so CI can
// compile the kernel with plain nvcc; binding.cpp is the thin torch side.
#pragma once
#include <cstdint>
#include <cuda_runtime_api.h>

struct GroupPackedArgs {
  const int32_t* words;   // codes packed along K
  int64_t sw_k, sw_n;     // strides: per word along K, per output row n
  const float* scales;    // float32 (the binding converts), [G, N] through strides
  int64_t ss_g, ss_n;
  const int32_t* zeros;   // zero codes packed along N; nullptr: symmetric, zero = 2^(bits-1)
  int64_t sz_g, sz_n;
  int32_t zero_offset;    // GPTQ v1 stores Z - 1
  const int32_t* g_idx;   // [K]; nullptr: group = k / group_width
  int64_t group_width;
  int32_t bits;           // 2, 4 or 8
  int64_t n, k;           // out_features, in_features
};

// out: float32 [n, k], row-major. Returns cudaErrorInvalidValue for an unsupported bit width.
cudaError_t compress_int_dequant(const GroupPackedArgs& args, float* out, cudaStream_t stream);
