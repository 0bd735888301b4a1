// Causal attention through cuDNN's fused scaled-dot-product attention (cuDNN 9's graph API, built with
// NVIDIA's header-only cudnn-frontend). The graphs read and write the backend's own layouts in place:
// q/o [T, heads*hd] and k/v [T, kv_heads*hd] row-major with T = sequences * L are the tensors
// [sequences, heads, L, hd] with strides (L*heads*hd, hd, heads*hd, 1), and the softmax statistics
// [sequences*heads, L] are [sequences, heads, L, 1] with strides (heads*L, L, 1, 1), so no copy or
// transpose surrounds a call. libcudnn is opened on first use, not linked (as cuBLASLt, and for the
// same reason: every `piper` process would pay for it at start-up); one handle and one cache of
// built graphs per thread, since virtual devices are threads that share a GPU.
#include <dlfcn.h>

#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>

#include "piper/runtime/cuda/device.hpp"
#include "piper/runtime/cuda/kernels.hpp"

#if PIPER_HAVE_CUDNN_FRONTEND
#include <cudnn_frontend.h>

// cudnn-frontend's dynamic loading reads cuDNN's entry points from this handle.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend
#endif

namespace piper::runtime::cuda {

#if PIPER_HAVE_CUDNN_FRONTEND
namespace {

namespace fe = cudnn_frontend;

// Opens libcudnn once per process; returns the reason it could not, or "".
const std::string& load_cudnn() {
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    // The frontend opens the CUDA runtime itself for a few calls: it must be the one this binary links
    // (it would try libcudart.so.12 first), unless the user named another.
    const std::string cudart = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
    setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", cudart.c_str(), 0);
    std::string tried;
    for (const char* name : std::initializer_list<const char*>{
             std::getenv("PIPER_CUDNN_LIBRARY"), "libcudnn.so.9",
#ifdef PIPER_CUDNN_PATH
             PIPER_CUDNN_PATH,  // the toolkit's, found at configure time
#endif
             "/usr/local/cuda/lib/libcudnn.so.9", "/usr/local/cuda/lib64/libcudnn.so.9"}) {
      if (name == nullptr || *name == '\0') continue;
      if ((fe::cudnn_dlhandle = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) return;
      const char* why = dlerror();
      tried += std::string(tried.empty() ? "" : "; ") + (why != nullptr ? why : name);
    }
    error = "cannot load cuDNN 9 (" + tried + ")";
  });
  return error;
}

// Tensor uids of the variant packs.
enum Uid : fe::graph::Tensor_attributes::uid_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV };

using Key = std::tuple<int, int, int, int, int, int, bool>;  // device, sequences, L, heads, kv_heads, hd, backward

struct Built {
  std::shared_ptr<fe::graph::Graph> graph;  // null when cuDNN cannot run the shape
  std::int64_t workspace = 0;
  std::string why;  // why not, when graph is null
};

// Strides of a [T, heads*hd] row-major tensor read as [sequences, heads, L, hd].
std::vector<std::int64_t> token_major(const AttentionDims& d, int heads) {
  const std::int64_t h = heads, L = d.seq_len, hd = d.head_dim;
  return {L * h * hd, hd, h * hd, 1};
}

std::shared_ptr<fe::graph::Tensor_attributes> tensor(fe::graph::Graph& g, const char* name, Uid uid,
                                                     const AttentionDims& d, int heads) {
  const std::int64_t seqs = d.tokens / d.seq_len;
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim({seqs, heads, d.seq_len, d.head_dim})
                      .set_stride(token_major(d, heads)));
}

void output(const std::shared_ptr<fe::graph::Tensor_attributes>& t, Uid uid, const AttentionDims& d, int heads) {
  const std::int64_t seqs = d.tokens / d.seq_len;
  t->set_output(true).set_uid(uid).set_dim({seqs, heads, d.seq_len, d.head_dim}).set_stride(token_major(d, heads));
}

std::shared_ptr<fe::graph::Tensor_attributes> stats_tensor(fe::graph::Graph& g, const AttentionDims& d) {
  const std::int64_t seqs = d.tokens / d.seq_len, h = d.heads, L = d.seq_len;
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name("stats")
                      .set_uid(kStats)
                      .set_dim({seqs, h, L, 1})
                      .set_stride({h * L, L, 1, 1})
                      .set_data_type(fe::DataType_t::FLOAT));
}

// The forward or backward graph of one shape: bf16 in and out, fp32 softmax, causal with the diagonal
// at the top left (query i sees keys 0..i), scores scaled by 1/sqrt(hd) as every path does. For a GPU
// of compute capability `sm_version`, or the current one when 0.
std::shared_ptr<fe::graph::Graph> describe(const AttentionDims& d, bool backward, int sm_version = 0) {
  auto g = std::make_shared<fe::graph::Graph>();
  if (sm_version > 0) g->set_sm_version(sm_version);
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d.head_dim));
  auto q = tensor(*g, "q", kQ, d, d.heads), k = tensor(*g, "k", kK, d, d.kv_heads),
       v = tensor(*g, "v", kV, d, d.kv_heads);
  if (!backward) {
    auto options = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true).set_attn_scale(scale);
    options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
    auto [o, stats] = g->sdpa(q, k, v, options);
    output(o, kO, d, d.heads);
    stats->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT);
    return g;
  }
  auto o = tensor(*g, "o", kO, d, d.heads), d_o = tensor(*g, "d_o", kDO, d, d.heads);
  auto options = fe::graph::SDPA_backward_attributes().set_name("attention_backward").set_attn_scale(scale);
  options.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, d_o, stats_tensor(*g, d), options);
  output(dq, kDQ, d, d.heads);
  output(dk, kDK, d, d.kv_heads);
  output(dv, kDV, d, d.kv_heads);
  return g;
}

std::string failure(fe::error_t e, const char* step) { return std::string(step) + ": " + e.get_message(); }

struct ThreadState {
  cudnnHandle_t handle = nullptr;
  int device = -1;
  std::map<Key, Built> graphs;
  ~ThreadState() {
    if (handle != nullptr) fe::detail::destroy_handle(handle);
  }
};

ThreadState& state() {
  thread_local ThreadState s;
  return s;
}

// The built graph of this shape on this thread, built on first use; graph is null (and `why` says
// why) when cuDNN is missing or cannot run it.
const Built& built(const AttentionDims& d, bool backward) {
  ThreadState& s = state();
  int device = -1;
  const cudaError_t got_device = cudaGetDevice(&device);
  if (got_device != cudaSuccess) cudaGetLastError();  // not left for a later launch check to report
  const Key key{device, d.tokens / d.seq_len, d.seq_len, d.heads, d.kv_heads, d.head_dim, backward};
  if (auto it = s.graphs.find(key); it != s.graphs.end()) return it->second;
  Built b;
  if (const std::string& why = load_cudnn(); !why.empty()) {
    b.why = why;
  } else {
    try {
      check(got_device, "cudaGetDevice");
      if (s.handle == nullptr || s.device != device) {
        if (s.handle != nullptr) fe::detail::destroy_handle(s.handle);
        s.handle = nullptr;
        if (fe::detail::create_handle(&s.handle) != CUDNN_STATUS_SUCCESS)
          throw std::runtime_error("cudnnCreate failed");
        s.device = device;
      }
      auto g = describe(d, backward);
      if (auto e = g->validate(); e.is_bad()) {
        b.why = failure(e, "validate");
      } else if (auto e2 = g->build(s.handle, {fe::HeurMode_t::A}); e2.is_bad()) {
        b.why = failure(e2, "build");
      } else if (auto e3 = g->get_workspace_size(b.workspace); e3.is_bad()) {
        b.why = failure(e3, "workspace");
      } else {
        b.graph = std::move(g);
      }
    } catch (const std::exception& e) {
      b.why = e.what();
    }
  }
  return s.graphs.emplace(key, std::move(b)).first->second;
}

void execute(const Built& b, std::unordered_map<fe::graph::Tensor_attributes::uid_t, void*>& pack, void* workspace,
             cudaStream_t stream, const char* what) {
  if (!b.graph) throw CudaError(std::string(what) + ": cuDNN attention cannot run this shape (" + b.why + ")");
  cudnnHandle_t h = state().handle;
  if (fe::detail::set_stream(h, stream) != CUDNN_STATUS_SUCCESS)
    throw CudaError(std::string(what) + ": cudnnSetStream");
  if (auto e = b.graph->execute(h, pack, workspace); e.is_bad()) throw CudaError(failure(e, what));
}

// What in the shape itself rules cuDNN out ("" when nothing does).
std::string shape_problem(const AttentionDims& d) {
  if (d.seq_len < 1 || d.tokens % d.seq_len != 0 || d.kv_heads < 1 || d.heads % d.kv_heads != 0)
    return "tokens must be whole sequences and heads a multiple of kv_heads";
  if (d.cp > 1) return "context parallelism (keys of every CP rank, masked by position) runs on the reference kernels";
  return "";
}

}  // namespace

bool cudnn_attention_compiled() { return true; }

std::string cudnn_attention_validate(const AttentionDims& d, int sm_version) {
  if (std::string problem = shape_problem(d); !problem.empty()) return problem;
  if (const std::string& why = load_cudnn(); !why.empty()) return why;
  for (bool backward : {false, true}) {
    try {
      if (auto e = describe(d, backward, sm_version)->validate(); e.is_bad())
        return std::string(backward ? "backward " : "forward ") + failure(e, "validate");
    } catch (const std::exception& e) {
      return e.what();
    }
  }
  return "";
}

bool cudnn_attention_supported(DType dt, const AttentionDims& d, std::string* why) {
  std::string reason = dt != DType::BF16 ? "cuDNN attention runs bf16 only" : shape_problem(d);
  if (reason.empty()) {
    const Built& f = built(d, false);
    if (!f.graph)
      reason = "forward: " + f.why;
    else if (const Built& b = built(d, true); !b.graph)
      reason = "backward: " + b.why;
  }
  if (why != nullptr) *why = reason;
  return reason.empty();
}

std::size_t cudnn_attention_workspace(const AttentionDims& d, bool backward) {
  return static_cast<std::size_t>(built(d, backward).workspace);
}

void cudnn_attention_forward(const AttentionDims& d, const void* q, const void* k, const void* v, float* stats, void* o,
                             void* workspace, cudaStream_t stream) {
  std::unordered_map<fe::graph::Tensor_attributes::uid_t, void*> pack = {
      {kQ, const_cast<void*>(q)}, {kK, const_cast<void*>(k)}, {kV, const_cast<void*>(v)}, {kO, o}, {kStats, stats}};
  execute(built(d, false), pack, workspace, stream, "cuDNN attention forward");
}

void cudnn_attention_backward(const AttentionDims& d, const void* q, const void* k, const void* v, const void* o,
                              const float* stats, const void* d_o, void* dq, void* dk, void* dv, void* workspace,
                              cudaStream_t stream) {
  std::unordered_map<fe::graph::Tensor_attributes::uid_t, void*> pack = {{kQ, const_cast<void*>(q)},
                                                                         {kK, const_cast<void*>(k)},
                                                                         {kV, const_cast<void*>(v)},
                                                                         {kO, const_cast<void*>(o)},
                                                                         {kStats, const_cast<float*>(stats)},
                                                                         {kDO, const_cast<void*>(d_o)},
                                                                         {kDQ, dq},
                                                                         {kDK, dk},
                                                                         {kDV, dv}};
  execute(built(d, true), pack, workspace, stream, "cuDNN attention backward");
}

#else  // built without the cudnn-frontend headers

namespace {
constexpr const char* kNotBuilt =
    "built without cuDNN attention (no cudnn-frontend headers at configure time: scripts/install-deps.sh fetches them)";
}

bool cudnn_attention_compiled() { return false; }
std::string cudnn_attention_validate(const AttentionDims&, int) { return kNotBuilt; }
bool cudnn_attention_supported(DType, const AttentionDims&, std::string* why) {
  if (why != nullptr) *why = kNotBuilt;
  return false;
}
std::size_t cudnn_attention_workspace(const AttentionDims&, bool) { return 0; }
void cudnn_attention_forward(const AttentionDims&, const void*, const void*, const void*, float*, void*, void*,
                             cudaStream_t) {
  throw CudaError(kNotBuilt);
}
void cudnn_attention_backward(const AttentionDims&, const void*, const void*, const void*, const void*, const float*,
                              const void*, void*, void*, void*, void*, cudaStream_t) {
  throw CudaError(kNotBuilt);
}

#endif

const char* attention_path_name(AttentionPath p) {
  switch (p) {
    case AttentionPath::Reference:
      return "reference";
    case AttentionPath::Flash:
      return "flash";
    case AttentionPath::Cudnn:
      return "cudnn";
  }
  return "?";
}

std::optional<AttentionPath> attention_path_forced() {
  // Read once: the choice must not change between a forward and its backward.
  static const std::optional<AttentionPath> forced = []() -> std::optional<AttentionPath> {
    const char* v = std::getenv("PIPER_ATTENTION");
    const std::string value = v != nullptr ? v : "";
    if (value.empty() || value == "auto") return std::nullopt;
    for (AttentionPath p : {AttentionPath::Reference, AttentionPath::Flash, AttentionPath::Cudnn})
      if (value == attention_path_name(p)) return p;
    throw CudaError("PIPER_ATTENTION=" + value + ": expected auto, reference, flash or cudnn");
  }();
  return forced;
}

bool attention_reference_forced() { return attention_path_forced() == AttentionPath::Reference; }

AttentionPath choose_attention(DType dt, const AttentionDims& d) {
  const std::optional<AttentionPath> forced = attention_path_forced();
  std::string why;
  if (forced == AttentionPath::Reference) return AttentionPath::Reference;
  if (forced == AttentionPath::Cudnn) {
    if (!cudnn_attention_supported(dt, d, &why)) throw CudaError("PIPER_ATTENTION=cudnn: " + why);
    return AttentionPath::Cudnn;
  }
  if (forced == AttentionPath::Flash) {
    if (!use_flash_attention(dt, d))
      throw CudaError(d.cp > 1 ? "PIPER_ATTENTION=flash: context parallelism runs on the reference kernels"
                               : "PIPER_ATTENTION=flash: the flash kernels run bf16 with head_dim 64 or 128 only");
    return AttentionPath::Flash;
  }
  if (dt == DType::BF16 && cudnn_attention_supported(dt, d)) return AttentionPath::Cudnn;
  return use_flash_attention(dt, d) ? AttentionPath::Flash : AttentionPath::Reference;
}

}  // namespace piper::runtime::cuda
