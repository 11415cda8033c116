// TEST DOUBLE — CPU stand-in for CANN's custom-op torch extension (the `custom_ops` wheel built from the
// reference's ops/ascendc/torch_ops_extension, library custom_ops_lib*.so).
//
// Like the real library it owns the `custom` namespace with TORCH_LIBRARY(custom, m), defines the seven
// DSA/gather schemas (exact strings of docs/ops.md §1-§4), and registers Meta kernels that compute the
// output shapes CANN's Meta kernels compute, plus PrivateUse1 (NPU) kernels. It has no CPU kernels (the
// real one has none either), and its NPU kernels only throw: nothing here runs on a device.
#include <torch/extension.h>
#include <torch/library.h>

#include <tuple>

namespace {

constexpr int64_t kPage = 4096;

int64_t align_up(int64_t v, int64_t a) { return ((v + a - 1) / a) * a; }

// docs/ops.md §2.2: install_records allocation of dsa_plan (stride, rec_bytes, cnt_bytes, +4095 slack).
int64_t records_alloc(int64_t batch, int64_t raw_seq, int64_t topk) {
  const int64_t stride = align_up(((topk + 7) / 8) * 16, kPage);
  const int64_t microtasks = batch * raw_seq * 8;
  const int64_t rec_bytes = align_up(microtasks * stride, kPage);
  const int64_t cnt_bytes = align_up(microtasks * 32, kPage);
  return rec_bytes + cnt_bytes + kPage - 1;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dsa_plan_meta(
    const at::Tensor& topk, const at::Tensor& full_kv_actual_seq, const at::Tensor& pool_ids,
    const at::Tensor& id_to_slot, const at::Tensor& lru_counter, int64_t raw_seq, int64_t group_id,
    int64_t owner_layer, int64_t group_kind) {
  TORCH_CHECK(topk.dim() == 3 || topk.dim() == 4, "selection_topk_indices dim must be 3 or 4");
  const int64_t k = topk.size(topk.dim() - 1);
  TORCH_CHECK(k > 0, "selection_topk_indices topK must be positive");
  const int64_t n = topk.numel();
  auto plan = at::zeros({n, 2}, topk.options());
  auto records = at::zeros({records_alloc(topk.size(0), raw_seq, k)}, topk.options().dtype(at::kChar));
  auto act = at::empty({n / k}, topk.options());
  return std::make_tuple(plan, records, act);
}

void dsa_serve_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                    int64_t) {}

std::tuple<at::Tensor, at::Tensor> dsa_serve_functional_meta(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor& selection_kv_cache, const at::Tensor& selection_k_rope, int64_t, int64_t, int64_t,
    int64_t) {
  return std::make_tuple(at::empty_like(selection_kv_cache), at::empty_like(selection_k_rope));
}

void dsa_install_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, int64_t, int64_t, int64_t, int64_t) {}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dsa_install_functional_meta(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor& pool_kv_cache, const at::Tensor& pool_k_rope, const at::Tensor& pool_ids,
    const at::Tensor& id_to_slot, const at::Tensor& lru_counter, int64_t, int64_t, int64_t, int64_t) {
  return std::make_tuple(at::empty_like(pool_kv_cache), at::empty_like(pool_k_rope), at::empty_like(pool_ids),
                         at::empty_like(id_to_slot), at::empty_like(lru_counter));
}

// CANN: the in-place gather returns selection_kv_actual_seq = empty([block_table.size(0)]) with the
// top-k's options (int32).
at::Tensor gather_meta(const at::Tensor&, const at::Tensor&, const at::Tensor& selection_kv_block_table,
                       const at::Tensor&, const at::Tensor& selection_topk_indices, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  return at::empty({selection_kv_block_table.size(0)}, selection_topk_indices.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gather_functional_meta(
    const at::Tensor& selection_k_rope, const at::Tensor& selection_kv_cache,
    const at::Tensor& selection_kv_block_table, const at::Tensor& selection_kv_block_status,
    const at::Tensor& selection_topk_indices, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, int64_t) {
  return std::make_tuple(at::empty({selection_kv_block_table.size(0)}, selection_topk_indices.options()),
                         at::empty_like(selection_k_rope), at::empty_like(selection_kv_cache),
                         at::empty_like(selection_kv_block_table), at::empty_like(selection_kv_block_status));
}

// The stand-in's "NPU kernels": a boxed kernel that refuses (there is no device here).
void npu_kernel(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, "TEST DOUBLE: the CPU stand-in of CANN's custom_ops_lib has no NPU kernel for ",
              op.schema().name());
}

}  // namespace

TORCH_LIBRARY(custom, m) {
  m.def("npu_gather_selection_kv_cache(Tensor(a!) selection_k_rope, Tensor(b!) selection_kv_cache, "
        "Tensor(c!) selection_kv_block_table, Tensor(d!) selection_kv_block_status, Tensor selection_topk_indices, "
        "Tensor full_k_rope, Tensor full_kv_cache, Tensor full_kv_block_table, Tensor full_kv_actual_seq, "
        "Tensor full_q_actual_seq, *, int selection_topk_block_size=64) -> Tensor");
  m.def("npu_gather_selection_kv_cache_functional(Tensor selection_k_rope, Tensor selection_kv_cache, "
        "Tensor selection_kv_block_table, Tensor selection_kv_block_status, Tensor selection_topk_indices, "
        "Tensor full_k_rope, Tensor full_kv_cache, Tensor full_kv_block_table, Tensor full_kv_actual_seq, "
        "Tensor full_q_actual_seq, *, int selection_topk_block_size=64) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("dsa_plan(Tensor selection_topk_indices, Tensor full_kv_actual_seq, Tensor pool_ids, Tensor id_to_slot, "
        "Tensor lru_counter, *, int raw_seq=1, int group_id=0, int owner_layer=0, int group_kind=0) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("dsa_serve(Tensor plan, Tensor full_kv_cache, Tensor full_k_rope, Tensor pool_kv_cache, "
        "Tensor pool_k_rope, Tensor(a!) selection_kv_cache, Tensor(b!) selection_k_rope, *, int raw_seq=1, "
        "int topk=2048, int selection_block_size=128, int compact_layout=1) -> ()");
  m.def("dsa_serve_functional(Tensor plan, Tensor full_kv_cache, Tensor full_k_rope, Tensor pool_kv_cache, "
        "Tensor pool_k_rope, Tensor selection_kv_cache, Tensor selection_k_rope, *, int raw_seq=1, "
        "int topk=2048, int selection_block_size=128, int compact_layout=1) -> (Tensor, Tensor)");
  m.def("dsa_install(Tensor install_records, Tensor selection_kv_cache, Tensor selection_k_rope, "
        "Tensor selection_kv_block_table, Tensor(a!) pool_kv_cache, Tensor(b!) pool_k_rope, Tensor(c!) pool_ids, "
        "Tensor(d!) id_to_slot, Tensor(e!) lru_counter, *, int raw_seq=1, int topk=2048, "
        "int selection_block_size=128, int metadata_update=1) -> ()");
  m.def("dsa_install_functional(Tensor install_records, Tensor selection_kv_cache, Tensor selection_k_rope, "
        "Tensor selection_kv_block_table, Tensor pool_kv_cache, Tensor pool_k_rope, Tensor pool_ids, "
        "Tensor id_to_slot, Tensor lru_counter, *, int raw_seq=1, int topk=2048, int selection_block_size=128, "
        "int metadata_update=1) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(custom, Meta, m) {
  m.impl("dsa_plan", &dsa_plan_meta);
  m.impl("dsa_serve", &dsa_serve_meta);
  m.impl("dsa_serve_functional", &dsa_serve_functional_meta);
  m.impl("dsa_install", &dsa_install_meta);
  m.impl("dsa_install_functional", &dsa_install_functional_meta);
  m.impl("npu_gather_selection_kv_cache", &gather_meta);
  m.impl("npu_gather_selection_kv_cache_functional", &gather_functional_meta);
}

TORCH_LIBRARY_IMPL(custom, PrivateUse1, m) {
  for (const char* name : {"dsa_plan", "dsa_serve", "dsa_serve_functional", "dsa_install", "dsa_install_functional",
                           "npu_gather_selection_kv_cache", "npu_gather_selection_kv_cache_functional"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&npu_kernel>());
  }
}

// Importable as a Python module (`custom_ops.custom_ops_lib`), like the real wheel's extension.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
