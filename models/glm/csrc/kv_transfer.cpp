// KV transfer for the serving loop (models/glm/serve.py): copies whole cache blocks by block id, the way
// an engine writes KV outside the decode graph (a reshape-and-cache kernel, a transfer engine writing the
// blocks it received). Declared in place (Tensor(a!)) and implemented in C++ only, with raw memory copies:
// like those writes it moves no PyTorch version counter, so only the per-row signals (block table,
// announcement) can see it (docs/new-requests.md, "The engine's contract").
#include <torch/extension.h>
#include <torch/library.h>

#include <cstring>

namespace {

void copy_blocks_cpu(at::Tensor dst, const at::Tensor& src, const at::Tensor& dst_blocks,
                     const at::Tensor& src_blocks) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "glm_serve::copy_blocks_: dst and src must be contiguous");
  TORCH_CHECK(dst.dtype() == src.dtype(), "glm_serve::copy_blocks_: dst dtype ", dst.dtype(), " != src dtype ",
              src.dtype());
  TORCH_CHECK(dst.dim() >= 1 && src.dim() == dst.dim(), "glm_serve::copy_blocks_: dst and src must have the same rank");
  for (int64_t d = 1; d < dst.dim(); ++d) {
    TORCH_CHECK(dst.size(d) == src.size(d), "glm_serve::copy_blocks_: block shapes differ at dim ", d);
  }
  TORCH_CHECK(dst_blocks.scalar_type() == at::kLong && src_blocks.scalar_type() == at::kLong &&
                  dst_blocks.dim() == 1 && src_blocks.numel() == dst_blocks.numel(),
              "glm_serve::copy_blocks_: dst_blocks and src_blocks must be int64 [n] of one length");
  const int64_t block_bytes = dst.numel() == 0 ? 0 : (dst.numel() / dst.size(0)) * dst.element_size();
  const int64_t* db = dst_blocks.contiguous().data_ptr<int64_t>();
  const int64_t* sb = src_blocks.contiguous().data_ptr<int64_t>();
  char* out = static_cast<char*>(dst.data_ptr());
  const char* in = static_cast<const char*>(src.data_ptr());
  for (int64_t i = 0; i < dst_blocks.numel(); ++i) {
    TORCH_CHECK(0 <= db[i] && db[i] < dst.size(0), "glm_serve::copy_blocks_: dst block ", db[i],
                " out of range [0, ", dst.size(0), ")");
    TORCH_CHECK(0 <= sb[i] && sb[i] < src.size(0), "glm_serve::copy_blocks_: src block ", sb[i],
                " out of range [0, ", src.size(0), ")");
    std::memcpy(out + db[i] * block_bytes, in + sb[i] * block_bytes, block_bytes);
  }
}

}  // namespace

TORCH_LIBRARY(glm_serve, m) {
  m.def("copy_blocks_(Tensor(a!) dst, Tensor src, Tensor dst_blocks, Tensor src_blocks) -> ()");
}

TORCH_LIBRARY_IMPL(glm_serve, CPU, m) { m.impl("copy_blocks_", copy_blocks_cpu); }
