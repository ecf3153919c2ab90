// The CUDA kernels of the kimi_k3 ops: a C++ replay cache in front of the Python launch policy.
//
// Why: a kernel registered from Python costs the dispatcher's boxing into Python, the Python policy and Triton's
// launcher on every eager call: 45-60 us of host time per call on the H200, against about 7 us for torch.add
// (docs/benchmarks.md, "Host cost of an eager call"). Here one boxed C++ kernel serves every kimi_k3 op on the CUDA
// key:
//
//   * The call's metadata (per tensor: device, dtype, sizes, strides, 16-byte alignment; every int, float, bool
//     and None) is the key. The launch policy (backends/cuda.py) decides from exactly these, so equal keys launch
//     equal kernels with equal arguments up to the tensors' addresses.
//   * Hit: allocate the outputs and scratch buffers as recorded (at::empty_strided, the caching allocator) and
//     replay the recorded launches: Triton's compiled kernels through cuLaunchKernelEx with the arguments packed
//     as Triton's own launcher packs them, the CUDA C++ kernels (single-read backward, cluster forward) through
//     their launch functions.
//   * Miss: call the op's Python kernel through the recorder (k3_ops/backends/_launch.py, ``record_call``). It
//     runs the policy and its launches as before and returns, besides the op's result, the recipe: each launch's
//     compiled function, grid, block, shared memory, PDL flag and arguments, each pointer named by its role
//     (input i, output j, scratch k). A call whose device work the recorder cannot name (a copy, a weight cast,
//     the reference for fp64, a Triton launch hook, the interpreter) returns no recipe and always takes the
//     Python path.
//
// Guarantees kept: arguments are checked before anything is written (a key is only stored after its Python call
// passed the checks, and the checks depend on nothing outside the key, so a hit is a call that passes them: the
// aliasing rules read how tensors that share a storage lie in it, so such pairs' relative byte offsets are keyed);
// recompile safety (a replay compiles nothing); graph capture (a replay only allocates from the caching allocator
// and launches on the current stream); profilers that hook Triton's launches (while a hook is set every call takes
// the Python path, which calls them). Inputs that share an address take the Python path (roles would be
// ambiguous). K3_OPS_CPP_LAUNCH=0 turns replay off (every call goes to Python, nothing is recorded).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
// c10's stream header, not ATen/cuda/CUDAContext.h: that one pulls in cuBLAS, cuSPARSE and cuSOLVER headers,
// which a toolkit of only nvcc and the runtime (a conda cuda-nvcc install, say) does not ship.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/SmallVector.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "native_launch.h"

namespace k3_ops {

namespace {

// ---- Recipes -------------------------------------------------------------------------------------------------
// Where a pointer argument of a recorded launch comes from.
enum class Role : int64_t { kConst = 0, kInput = 1, kOutput = 2, kScratch = 3, kNull = 4 };

struct Arg {
  Role role;
  int64_t index;  // input: schema argument position; output: return position; scratch: buffer number
  uint64_t bits;  // kConst: the value's bytes (4 or 8 of them; the driver reads the parameter's size)
};

struct TensorSpec {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
};

// A recorded launch: a Triton kernel, or one of k3_ops._C's CUDA C++ kernels through its launch function.
enum class Kind { kTriton, kSingleRead, kClusterForward };

struct Launch {
  Kind kind = Kind::kTriton;
  CUfunction function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 0, shared = 0, num_ctas = 1;
  bool pdl = false, cooperative = false;
  std::vector<Arg> args;             // Triton: every non-constexpr parameter in order; native: its tensors
  std::vector<int64_t> native_ints;  // single read: K, tokens_per_prog, grid, vectors_per_thread; cluster: K, CS, PDL,
                                     // write_idx, in-place prefix, norm of the rounded mix, FP8 kind, norm_gram
  std::vector<double> native_floats;  // single read: eps; cluster: eps, out_eps, fp8_max, gram_tau
};

struct Recipe {
  std::vector<TensorSpec> outputs, scratch;
  std::vector<Launch> launches;
};

// ---- The cache -----------------------------------------------------------------------------------------------
using Key = std::vector<int64_t>;

struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the words
    for (int64_t v : k) {
      h ^= static_cast<uint64_t>(v);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

// Entries at most (a new T is a new key; eager prefill of many lengths must not grow it without bound). Past
// it, new keys take the Python path.
constexpr size_t kMaxEntries = 8192;

std::shared_mutex cache_mutex;
std::unordered_map<Key, std::shared_ptr<const Recipe>, KeyHash> cache;
std::atomic<uint64_t> generation{0};  // bumped by clear(): a recording that began before it is not stored

// Python side, set once by k3_ops._registration (and the Triton knobs object by the first recording).
struct PythonSide {
  py::object recorder;                                    // _launch.record_call
  std::unordered_map<std::string, py::object> fallbacks;  // op name -> its Python CUDA kernel
  py::object knobs_runtime;                               // triton.knobs.runtime (launch hooks), or None
};
PythonSide* python_side() {
  static auto* side = new PythonSide();  // never destroyed: py::objects must not be released after Python exits
  return side;
}

// ---- Driver entry point (libcuda through dlopen, as Triton's launcher does: no link-time libcuda) ------------
using LaunchKernelEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using CtxGetCurrent = CUresult (*)(CUcontext*);
using GetErrorString = CUresult (*)(CUresult, const char**);

struct Driver {
  LaunchKernelEx launch = nullptr;
  CtxGetCurrent ctx_get_current = nullptr;
  GetErrorString error_string = nullptr;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib != nullptr) {
      d.launch = reinterpret_cast<LaunchKernelEx>(dlsym(lib, "cuLaunchKernelEx"));
      d.ctx_get_current = reinterpret_cast<CtxGetCurrent>(dlsym(lib, "cuCtxGetCurrent"));
      d.error_string = reinterpret_cast<GetErrorString>(dlsym(lib, "cuGetErrorString"));
    }
    return d;
  }();
  return d;
}

bool replay_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("K3_OPS_CPP_LAUNCH");
    return (v == nullptr || std::strcmp(v, "0") != 0) && driver().launch != nullptr &&
           driver().ctx_get_current != nullptr;
  }();
  return enabled;
}

// ---- The key -------------------------------------------------------------------------------------------------
// Every argument, in schema order, with a tag per kind. False when some argument is of a kind the policy is not
// known to decide on (no replay then).
bool make_key(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, Key& key,
              std::vector<const void*>& addresses) {
  key.reserve(64);
  // Tensors that share a storage: (storage, byte offset, argument position). The aliasing checks decide from how
  // such tensors lie in their storage, which sizes and strides alone do not say: their relative byte offsets join
  // the key, so equal keys still mean equal verdicts.
  struct Placed {
    const c10::StorageImpl* storage;
    int64_t offset;
    int64_t position;
  };
  c10::SmallVector<Placed, 8> placed;
  int64_t position = -1;
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&op.schema())));
  for (const c10::IValue& v : args) {
    ++position;
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      // Sparse, nested or storage-less tensors have no strides to key on: the Python path checks and rejects them.
      if (t.layout() != at::kStrided || t.is_nested() || !t.has_storage()) return false;
      key.push_back(1);
      key.push_back(static_cast<int64_t>(t.device().type()));
      key.push_back(t.device().index());
      key.push_back(static_cast<int64_t>(t.scalar_type()));
      key.push_back(t.dim());
      for (int64_t d = 0; d < t.dim(); ++d) {
        key.push_back(t.size(d));
        key.push_back(t.stride(d));
      }
      key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16));
      if (t.numel() > 0) {
        addresses.push_back(t.data_ptr());
        placed.push_back({t.storage().unsafeGetStorageImpl(),
                          t.storage_offset() * static_cast<int64_t>(t.element_size()), position});
      }
    } else if (v.isNone()) {
      key.push_back(2);
    } else if (v.isInt()) {  // ints and ScalarType
      key.push_back(3);
      key.push_back(v.toInt());
    } else if (v.isDouble()) {
      key.push_back(4);
      const double d = v.toDouble();
      int64_t bits;
      std::memcpy(&bits, &d, sizeof(bits));
      key.push_back(bits);
    } else if (v.isBool()) {
      key.push_back(5);
      key.push_back(v.toBool());
    } else if (v.isBoolList()) {
      key.push_back(6);
      const auto list = v.toBoolList();
      key.push_back(static_cast<int64_t>(list.size()));
      for (bool b : list) key.push_back(b);
    } else {
      return false;
    }
  }
  for (size_t i = 0; i < placed.size(); ++i) {
    for (size_t j = i + 1; j < placed.size(); ++j) {
      if (placed[i].storage == placed[j].storage) {
        key.push_back(7);
        key.push_back(placed[i].position);
        key.push_back(placed[j].position);
        key.push_back(placed[j].offset - placed[i].offset);
      }
    }
  }
  return true;
}

bool distinct(std::vector<const void*>& addresses) {
  for (size_t i = 0; i < addresses.size(); ++i) {
    for (size_t j = i + 1; j < addresses.size(); ++j) {
      if (addresses[i] == addresses[j]) return false;
    }
  }
  return true;
}

// While a Triton launch hook is set (a profiler), every call takes the Python path, whose launches call it.
bool launch_hooks_set() {
  py::gil_scoped_acquire gil;
  const py::object& runtime = python_side()->knobs_runtime;
  if (!runtime || runtime.is_none()) return true;  // not known yet: let Python decide
  for (const char* name : {"launch_enter_hook", "launch_exit_hook"}) {
    py::object hook = runtime.attr(name);
    if (hook.is_none()) continue;
    if (py::hasattr(hook, "calls")) {  // Triton >= 3.4: an always-present HookChain
      if (py::len(hook.attr("calls")) > 0) return true;
    } else {
      return true;
    }
  }
  return false;
}

// ---- Replay --------------------------------------------------------------------------------------------------
[[noreturn]] void launch_failed(const char* what, CUresult r) {
  const char* msg = nullptr;
  if (driver().error_string != nullptr) driver().error_string(r, &msg);
  throw std::runtime_error(std::string("k3_ops C++ launch: ") + what + " failed: " + (msg ? msg : "unknown error") +
                           " (set K3_OPS_CPP_LAUNCH=0 to launch through Python)");
}

const at::Tensor& role_tensor(const Arg& a, c10::ArrayRef<c10::IValue> args, const std::vector<at::Tensor>& outputs,
                              const std::vector<at::Tensor>& scratch) {
  switch (a.role) {
    case Role::kInput: return args[a.index].toTensor();
    case Role::kOutput: return outputs[a.index];
    default: return scratch[a.index];
  }
}

c10::optional<at::Tensor> native_tensor(const Arg& a, c10::ArrayRef<c10::IValue> args,
                                        const std::vector<at::Tensor>& outputs,
                                        const std::vector<at::Tensor>& scratch) {
  if (a.role == Role::kNull) return c10::nullopt;
  return role_tensor(a, args, outputs, scratch);
}

void replay(const Recipe& r, c10::ArrayRef<c10::IValue> args, const at::Device& device,
            std::vector<at::Tensor>& outputs) {
  const c10::cuda::CUDAGuard guard(device);
  const auto options = at::TensorOptions().device(device);
  outputs.reserve(r.outputs.size());
  for (const TensorSpec& s : r.outputs) outputs.push_back(at::empty_strided(s.sizes, s.strides, options.dtype(s.dtype)));
  std::vector<at::Tensor> scratch;
  scratch.reserve(r.scratch.size());
  for (const TensorSpec& s : r.scratch) scratch.push_back(at::empty_strided(s.sizes, s.strides, options.dtype(s.dtype)));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const Driver& d = driver();
  CUcontext ctx = nullptr;
  if (d.ctx_get_current(&ctx) == CUDA_SUCCESS && ctx == nullptr) {
    // A thread that has not used the runtime yet has no current context: make the device's primary one current
    // (the one Triton loaded the kernels into, and torch's).
    cudaSetDevice(device.index());
    cudaFree(nullptr);
  }
  for (const Launch& l : r.launches) {
    if (l.kind != Kind::kTriton) {
      const auto t = [&](int i) { return native_tensor(l.args[i], args, outputs, scratch); };
      const auto& n = l.native_ints;
      if (l.kind == Kind::kSingleRead) {
        attn_res_bwd_single_read_launch(*t(0), *t(1), *t(2), *t(3), *t(4), t(5), t(6), t(7), t(8), t(9), n[0],
                                        l.native_floats[0], n[1], n[2], n[3]);
      } else {
        const auto& f = l.native_floats;
        attn_res_cluster_forward(*t(0), *t(1), *t(2), *t(3), *t(4), t(5), t(6), t(7), t(8), n[0], f[0], f[1], f[2],
                                 n[3], n[1], n[2] != 0, n[4] != 0, n[5] != 0, n[6], n[7] != 0, f[3]);
      }
      continue;
    }
    // Parameters as Triton's launcher passes them: each non-constexpr argument, then its two scratch pointers
    // (global and profile scratch; null: the recorder only records kernels that need neither).
    const size_t n = l.args.size();
    std::vector<uint64_t> storage(n + 2, 0);
    std::vector<void*> params(n + 2);
    for (size_t i = 0; i < n; ++i) {
      const Arg& a = l.args[i];
      if (a.role == Role::kConst) {
        storage[i] = a.bits;
      } else if (a.role != Role::kNull) {
        storage[i] = reinterpret_cast<uint64_t>(role_tensor(a, args, outputs, scratch).data_ptr());
      }
      params[i] = &storage[i];
    }
    params[n] = &storage[n];
    params[n + 1] = &storage[n + 1];
    CUlaunchAttribute attrs[3];
    unsigned num_attrs = 0;
    if (l.pdl) {
      attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attrs[num_attrs].value.programmaticStreamSerializationAllowed = 1;
      ++num_attrs;
    }
    if (l.cooperative) {
      attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
      attrs[num_attrs].value.cooperative = 1;
      ++num_attrs;
    }
    if (l.num_ctas != 1) {
      attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
      attrs[num_attrs].value.clusterDim.x = l.num_ctas;
      attrs[num_attrs].value.clusterDim.y = 1;
      attrs[num_attrs].value.clusterDim.z = 1;
      ++num_attrs;
    }
    CUlaunchConfig config;
    std::memset(&config, 0, sizeof(config));
    config.gridDimX = l.grid[0] * l.num_ctas;
    config.gridDimY = l.grid[1];
    config.gridDimZ = l.grid[2];
    config.blockDimX = l.block;
    config.blockDimY = 1;
    config.blockDimZ = 1;
    config.sharedMemBytes = l.shared;
    config.hStream = reinterpret_cast<CUstream>(stream);
    config.attrs = attrs;
    config.numAttrs = num_attrs;
    const CUresult res = d.launch(&config, l.function, params.data(), nullptr);
    if (res != CUDA_SUCCESS) launch_failed("cuLaunchKernelEx", res);
  }
}

// ---- Recording -----------------------------------------------------------------------------------------------
TensorSpec spec_of(const at::Tensor& t) {
  return TensorSpec{t.sizes().vec(), t.strides().vec(), t.scalar_type()};
}

TensorSpec spec_from(const py::handle& h) {
  // (sizes, strides, dtype) of a scratch buffer.
  auto tup = h.cast<py::tuple>();
  return TensorSpec{tup[0].cast<std::vector<int64_t>>(), tup[1].cast<std::vector<int64_t>>(),
                    tup[2].cast<at::ScalarType>()};
}

Arg arg_from(const py::handle& h) {
  auto tup = h.cast<py::tuple>();
  return Arg{static_cast<Role>(tup[0].cast<int64_t>()), tup[1].cast<int64_t>(), tup[2].cast<uint64_t>()};
}

// The recipe k3_ops/backends/_launch.py's Recorder.recipe() built (see there for its layout), with the outputs'
// layouts taken from the tensors the call returned.
std::shared_ptr<const Recipe> parse_recipe(const py::handle& recipe, const std::vector<at::Tensor>& outputs) {
  auto r = std::make_shared<Recipe>();
  for (const at::Tensor& o : outputs) {
    if (o.storage_offset() != 0) return nullptr;  // not a fresh allocation
    r->outputs.push_back(spec_of(o));
  }
  auto tup = recipe.cast<py::tuple>();
  for (const auto& s : tup[0]) r->scratch.push_back(spec_from(s));
  for (const auto& item : tup[1]) {
    auto l = item.cast<py::tuple>();
    Launch launch;
    const auto kind = l[0].cast<std::string>();
    if (kind == "triton") {
      launch.function = reinterpret_cast<CUfunction>(l[1].cast<uint64_t>());
      auto grid = l[2].cast<std::vector<int64_t>>();
      for (size_t i = 0; i < 3; ++i) launch.grid[i] = static_cast<unsigned>(i < grid.size() ? grid[i] : 1);
      launch.block = l[3].cast<unsigned>();
      launch.shared = l[4].cast<unsigned>();
      launch.num_ctas = l[5].cast<unsigned>();
      launch.pdl = l[6].cast<bool>();
      launch.cooperative = l[7].cast<bool>();
      for (const auto& a : l[8]) launch.args.push_back(arg_from(a));
    } else if (kind == "single_read" || kind == "cluster_fwd") {
      const bool single = kind == "single_read";
      launch.kind = single ? Kind::kSingleRead : Kind::kClusterForward;
      for (const auto& a : l[1]) launch.args.push_back(arg_from(a));
      launch.native_ints = l[2].cast<std::vector<int64_t>>();
      launch.native_floats = l[3].cast<std::vector<double>>();
      if (launch.args.size() != (single ? 10u : 9u) || launch.native_ints.size() != (single ? 4u : 8u) ||
          launch.native_floats.size() != (single ? 1u : 4u)) {
        return nullptr;
      }
      for (size_t i = 0; i < 5; ++i) {  // the first five tensors of either kernel are required
        if (launch.args[i].role == Role::kNull) return nullptr;
      }
    } else {
      return nullptr;
    }
    r->launches.push_back(std::move(launch));
  }
  if (r->launches.empty()) return nullptr;
  return r;
}

// The Python path: the op's Python kernel through the recorder. Returns the op's outputs; stores the recipe under
// `key` when the call produced one (and `record`).
std::vector<at::Tensor> call_python(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, const Key& key,
                                    bool record) {
  py::gil_scoped_acquire gil;
  PythonSide* side = python_side();
  const auto& schema = op.schema();
  // "kimi_k3::fused_attn_res" + ".quant" -> "fused_attn_res.quant", the name k3_ops._registration uses.
  std::string name = schema.operator_name().name;
  name = name.substr(name.find("::") == std::string::npos ? 0 : name.find("::") + 2);
  if (!schema.operator_name().overload_name.empty()) name += "." + schema.operator_name().overload_name;
  auto fn = side->fallbacks.find(name);
  if (fn == side->fallbacks.end() || !side->recorder) {
    throw std::runtime_error(name + ": no CUDA kernel registered (k3_ops._registration was not imported)");
  }
  py::list positional;
  py::dict keywords;
  const auto& formals = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = args[i];
    py::object obj;
    // real_type(): the schema's ScalarType (type() says int, its IValue representation).
    const auto& type = formals[i].real_type();
    const bool scalar_type = type->kind() == c10::TypeKind::ScalarTypeType ||
                             (type->kind() == c10::TypeKind::OptionalType &&
                              type->containedType(0)->kind() == c10::TypeKind::ScalarTypeType);
    if (scalar_type && v.isInt()) {
      obj = py::cast(static_cast<at::ScalarType>(v.toInt()));  // a torch.dtype, as the Python kernels take it
    } else {
      obj = torch::jit::toPyObject(v);
    }
    if (formals[i].kwarg_only()) {
      keywords[py::str(formals[i].name())] = obj;
    } else {
      positional.append(obj);
    }
  }
  const uint64_t gen = generation.load();
  py::tuple result = side->recorder(fn->second, py::tuple(positional), keywords, record).cast<py::tuple>();
  std::vector<at::Tensor> outputs;
  py::object value = result[0];
  if (schema.returns().size() == 1) {
    outputs.push_back(value.cast<at::Tensor>());
  } else {
    for (const auto& o : value.cast<py::tuple>()) outputs.push_back(o.cast<at::Tensor>());
  }
  if (record && !result[1].is_none()) {
    if (!side->knobs_runtime && py::len(result) > 2) side->knobs_runtime = result[2];
    auto recipe = parse_recipe(result[1], outputs);
    if (recipe) {
      std::unique_lock<std::shared_mutex> lock(cache_mutex);
      if (generation.load() == gen && cache.size() < kMaxEntries) cache.emplace(key, std::move(recipe));
    }
  }
  return outputs;
}

// The CUDA kernel of every kimi_k3 op.
void cuda_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const size_t nargs = op.schema().arguments().size();
  const auto args = torch::jit::last(*stack, nargs);
  Key key;
  std::vector<const void*> addresses;
  const bool keyed = replay_enabled() && make_key(op, args, key, addresses) && distinct(addresses);
  std::vector<at::Tensor> outputs;
  std::shared_ptr<const Recipe> recipe;
  if (keyed) {
    std::shared_lock<std::shared_mutex> lock(cache_mutex);
    auto it = cache.find(key);
    if (it != cache.end()) recipe = it->second;
  }
  if (recipe && !launch_hooks_set()) {
    at::Device device = at::kCPU;
    for (const c10::IValue& v : args) {
      if (v.isTensor()) {
        device = v.toTensor().device();
        break;
      }
    }
    replay(*recipe, args, device, outputs);
  } else {
    outputs = call_python(op, args, key, keyed && !recipe);
  }
  torch::jit::drop(*stack, nargs);
  for (auto& o : outputs) stack->emplace_back(std::move(o));
}

void set_cuda_kernels(py::object recorder, py::dict fallbacks) {
  PythonSide* side = python_side();
  side->recorder = std::move(recorder);
  for (const auto& item : fallbacks) side->fallbacks[item.first.cast<std::string>()] = py::reinterpret_borrow<py::object>(item.second);
}

void clear_recipes() {
  std::unique_lock<std::shared_mutex> lock(cache_mutex);
  generation.fetch_add(1);
  cache.clear();
}

int64_t recipe_count() {
  std::shared_lock<std::shared_mutex> lock(cache_mutex);
  return static_cast<int64_t>(cache.size());
}

}  // namespace

TORCH_LIBRARY_IMPL(kimi_k3, CUDA, m) {
  for (const char* name :
       {"attn_res", "attn_res_backward", "fused_attn_res", "fused_attn_res.quant", "fused_attn_res.full",
        "fused_attn_res_"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&cuda_kernel>());
  }
}

void register_launch_cache_functions(py::module& m) {
  m.def("set_cuda_kernels", &set_cuda_kernels,
        "Give the C++ CUDA kernels their Python side: the recorder and the Python kernel of each op by name",
        py::arg("recorder"), py::arg("fallbacks"));
  m.def("clear_launch_recipes", &clear_recipes, "Forget every recorded launch recipe (the next call of each key "
        "runs the Python launch policy again)");
  m.def("launch_recipe_count", &recipe_count, "Number of recorded launch recipes");
  m.attr("cpp_launch_enabled") = replay_enabled();
}

}  // namespace k3_ops
