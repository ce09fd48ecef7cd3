// torch binding for int_dequant.cu: checks the tensors, converts scales to float32, launches on the
// current stream. Built by kernels/cuda_ext.py with torch.utils.cpp_extension on first use.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "int_dequant.h"

namespace {

const int32_t* optional_ptr(const c10::optional<torch::Tensor>& t) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->is_cuda() && t->scalar_type() == torch::kInt32, "zeros/g_idx must be int32 CUDA tensors");
  return t->data_ptr<int32_t>();
}

torch::Tensor dequantize(torch::Tensor words, int64_t sw_k, int64_t sw_n, torch::Tensor scales, int64_t ss_g, int64_t ss_n,
                         c10::optional<torch::Tensor> zeros, int64_t sz_g, int64_t sz_n, int64_t zero_offset,
                         c10::optional<torch::Tensor> g_idx, int64_t group_width, int64_t bits, int64_t n, int64_t k) {
  TORCH_CHECK(words.is_cuda() && words.scalar_type() == torch::kInt32, "words must be an int32 CUDA tensor");
  TORCH_CHECK(scales.is_cuda() && scales.scalar_type() == torch::kFloat32, "scales must be a float32 CUDA tensor");
  const c10::cuda::CUDAGuard guard(words.device());
  auto out = torch::empty({n, k}, words.options().dtype(torch::kFloat32));
  GroupPackedArgs args{words.data_ptr<int32_t>(), sw_k, sw_n, scales.data_ptr<float>(), ss_g, ss_n,
                       optional_ptr(zeros), sz_g, sz_n, static_cast<int32_t>(zero_offset), optional_ptr(g_idx),
                       group_width, static_cast<int32_t>(bits), n, k};
  const cudaError_t err = compress_int_dequant(args, out.data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "int dequant kernel failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize", &dequantize, "float32 [n, k] weight of a GroupPacked int layout (kernels/layouts.py)");
}
