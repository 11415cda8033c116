// The CPU entry of the ops that have a C++ kernel: custom::<op> (and offload_ref::dsa_install_sc) on the
// CPU dispatch key, without Python on the hot path (docs/ops.md §13).
//
// Every op has three dispatcher entries with the same arguments:
//   <ns>::<op>                  the op users call; its CPU kernel is the CheckedEntry below;
//   offload_cpu::<op>           the bare C++ kernel (csrc/<op>.cpp): the op's arguments, all positional (the
//                               Python path passes them so), then maybe tuning arguments with defaults (grain);
//   offload_cpu::<op>_checked   the op's Python CPU path (custom_ops/_library.py register_twins): binds,
//                               validates with the op's validate_<op> (the messages users see), runs the
//                               bare kernel or, with OFFLOAD_PASSES_CPU_KERNELS=reference, the reference.
// The entry runs the bare kernel directly for a call signature (dtypes, sizes, contiguity, the non-tensor
// arguments) that passed the checked path before: the checks that read only the signature cannot fail
// again, and the checks that read the data are in the bare kernels. A new signature, the reference mode
// or a bypass (a Python observer of the op: custom_ops/dsa_plan.py) takes the checked path. Failures are
// never remembered.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_set>
#include <vector>

namespace {

constexpr size_t kMaxSignatures = 1024;  // bounded like custom_ops/_library.py ValidationMemo

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& v) const noexcept {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t x : v) {
      h ^= static_cast<uint64_t>(x);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

// The C++ kernels run unless OFFLOAD_PASSES_CPU_KERNELS names another mode (read on every call, as
// custom_ops/_library.py cpu_kernel_mode does, so a test can switch it at run time).
bool cpp_mode() {
  const char* v = std::getenv("OFFLOAD_PASSES_CPU_KERNELS");
  if (v == nullptr) return true;
  std::string s(v);
  s.erase(std::remove_if(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c); }), s.end());
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s == "cpp";
}

// The signature of the n arguments on top of the stack; false if an argument's kind is not keyed (it then
// always takes the checked path).
bool signature(const torch::jit::Stack& stack, size_t n, std::vector<int64_t>* key) {
  key->clear();
  for (const c10::IValue& v : torch::jit::last(stack, n)) {
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      key->push_back(1);
      key->push_back(static_cast<int64_t>(t.scalar_type()));
      key->push_back(static_cast<int64_t>(t.device().type()));
      key->push_back(t.is_contiguous() ? 1 : 0);
      key->push_back(t.dim());
      for (int64_t s : t.sizes()) key->push_back(s);
    } else if (v.isInt()) {
      key->push_back(2);
      key->push_back(v.toInt());
    } else if (v.isBool()) {
      key->push_back(3);
      key->push_back(v.toBool() ? 1 : 0);
    } else if (v.isNone()) {
      key->push_back(4);
    } else if (v.isDouble()) {
      const double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof(bits));
      key->push_back(5);
      key->push_back(bits);
    } else {
      return false;
    }
  }
  return true;
}

class CheckedEntry final : public c10::OperatorKernel {
 public:
  CheckedEntry(c10::OperatorHandle bare, c10::OperatorHandle checked, size_t n_args)
      : bare_(bare), checked_(checked), n_args_(n_args) {
    // the bare kernel's trailing arguments (tuning knobs) take their defaults
    const auto& args = bare.schema().arguments();
    for (size_t i = n_args; i < args.size(); ++i) trailing_.push_back(*args[i].default_value());
  }

  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
    static thread_local std::vector<int64_t> key;
    const c10::DispatchKeySet cpu(c10::DispatchKey::CPU);
    const bool keyed = !bypass_.load(std::memory_order_relaxed) && cpp_mode() && signature(*stack, n_args_, &key);
    if (keyed) {
      std::shared_lock<std::shared_mutex> lock(mu_);
      if (seen_.count(key)) {
        lock.unlock();
        for (const c10::IValue& v : trailing_) stack->push_back(v);
        bare_.redispatchBoxed(cpu, stack);
        return;
      }
    }
    // the checked path may call ops again on this thread (reusing `key`): remember this call's own copy
    std::vector<int64_t> mine = keyed ? key : std::vector<int64_t>();
    checked_.redispatchBoxed(cpu, stack);  // raises with the op's message; nothing remembered then
    if (keyed) {
      std::unique_lock<std::shared_mutex> lock(mu_);
      if (seen_.size() >= kMaxSignatures) seen_.clear();
      seen_.insert(std::move(mine));
    }
  }

  void set_bypass(bool on) {
    bypass_.store(on);
    std::unique_lock<std::shared_mutex> lock(mu_);
    seen_.clear();
  }

  size_t signatures() {
    std::shared_lock<std::shared_mutex> lock(mu_);
    return seen_.size();
  }

 private:
  c10::OperatorHandle bare_, checked_;
  size_t n_args_;
  std::vector<c10::IValue> trailing_;
  std::atomic<bool> bypass_{false};
  std::shared_mutex mu_;
  std::unordered_set<std::vector<int64_t>, KeyHash> seen_;
};

struct Registry {
  std::mutex mu;
  std::vector<std::unique_ptr<torch::Library>> libs;  // never destroyed: the entries live as long as the process
  std::vector<std::pair<std::string, CheckedEntry*>> entries;

  CheckedEntry* find(const std::string& qualname) {
    for (auto& e : entries)
      if (e.first == qualname) return e.second;
    return nullptr;
  }
};

Registry& registry() {
  static Registry* r = new Registry();  // leaked on purpose: kernels may run during interpreter teardown
  return *r;
}

std::pair<std::string, std::string> split(const std::string& qualname) {
  const auto at = qualname.find("::");
  TORCH_CHECK(at != std::string::npos, "offload_cpu::_register_checked_entry: ", qualname,
              " is not a qualified op name");
  return {qualname.substr(0, at), qualname.substr(at + 2)};
}

// Registers the CheckedEntry of `qualname` (e.g. "custom::dsa_serve") as its CPU kernel. The bare and checked
// ops must exist and take the op's arguments first, in order, with the same names and types.
void register_checked_entry(const std::string& qualname) {
  auto& d = c10::Dispatcher::singleton();
  const auto [ns, name] = split(qualname);
  auto op = d.findSchemaOrThrow(qualname.c_str(), "");
  auto bare = d.findSchemaOrThrow(("offload_cpu::" + name).c_str(), "");
  auto checked = d.findSchemaOrThrow(("offload_cpu::" + name + "_checked").c_str(), "");
  const auto& want = op.schema().arguments();
  for (const auto* other : {&bare, &checked}) {
    const auto& got = other->schema().arguments();
    TORCH_CHECK(got.size() >= want.size(), "offload_cpu::_register_checked_entry: ", other->schema().name(),
                " takes fewer arguments than ", qualname);
    for (size_t i = 0; i < want.size(); ++i) {
      TORCH_CHECK(got[i].name() == want[i].name() && *got[i].type() == *want[i].type(),
                  "offload_cpu::_register_checked_entry: argument ", i, " of ", other->schema().name(), " is ",
                  got[i].name(), ", ", qualname, " has ", want[i].name());
    }
    for (size_t i = want.size(); i < got.size(); ++i) {
      TORCH_CHECK(got[i].default_value().has_value(), "offload_cpu::_register_checked_entry: extra argument ",
                  got[i].name(), " of ", other->schema().name(), " needs a default");
    }
  }
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  TORCH_CHECK(reg.find(qualname) == nullptr, "offload_cpu::_register_checked_entry: ", qualname,
              " is registered already");
  auto entry = std::make_unique<CheckedEntry>(bare, checked, want.size());
  CheckedEntry* raw = entry.get();
  reg.libs.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::CPU,
                                                      __FILE__, __LINE__));
  reg.libs.back()->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(std::move(entry)));
  reg.entries.emplace_back(qualname, raw);
}

CheckedEntry& entry_of(const std::string& qualname) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  CheckedEntry* e = reg.find(qualname);
  TORCH_CHECK(e != nullptr, "offload_cpu: no checked CPU entry is registered for ", qualname);
  return *e;
}

// Every call of `qualname` takes the checked path while `on` (and the remembered signatures are dropped).
void set_checked_bypass(const std::string& qualname, bool on) { entry_of(qualname).set_bypass(on); }

// Signatures the entry of `qualname` runs without the checked path (tests).
int64_t checked_signatures(const std::string& qualname) {
  return static_cast<int64_t>(entry_of(qualname).signatures());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(offload_cpu, m) {
  // no tensor arguments: registered as catch-all kernels with their schemas
  m.def("_register_checked_entry(str qualname) -> ()", &register_checked_entry);
  m.def("_set_checked_bypass(str qualname, bool on) -> ()", &set_checked_bypass);
  m.def("_checked_signatures(str qualname) -> int", &checked_signatures);
}
