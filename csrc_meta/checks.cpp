#include "checks.h"

#include <c10/core/ScalarType.h>
#include <c10/core/SymBool.h>
#include <c10/core/SymInt.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace k3_ops {
namespace {

// ---- Message formatting, without iostreams: on the H200's torch 2.11 build, `ostream << long` inside this
// extension segfaulted (cuda-gdb: std::basic_ostream::_M_insert<long> reaching a bogus locale facet), which is
// also what c10::str does. Integers go through std::to_string, doubles through snprintf("%g"), which prints
// what ostream's default formatting prints ("1e-06", "nan", "inf", "0").
inline std::string piece(const std::string& s) { return s; }
inline std::string piece(const char* s) { return s; }
inline std::string piece(int64_t v) { return std::to_string(v); }
inline std::string piece(int v) { return std::to_string(v); }
inline std::string piece(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}
template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  ((out += piece(args)), ...);
  return out;
}

// A rule: when `ok` is false, the op's first violation is this message.
#define K3_RULE(ok, is_type, ...)                               \
  do {                                                          \
    if (!(ok)) return Violation{(is_type), cat(__VA_ARGS__)};   \
  } while (0)
#define K3_VALUE_RULE(ok, ...) K3_RULE(ok, false, __VA_ARGS__)
#define K3_TYPE_RULE(ok, ...) K3_RULE(ok, true, __VA_ARGS__)
// The first violation of a group of rules written as a function.
#define K3_FIRST(verdict)                                       \
  do {                                                          \
    if (Verdict v_ = (verdict)) return v_;                      \
  } while (0)

// ---- Size policies: how a rule reads, compares and prints a size.
// Concrete (eager tensors): int64 throughout.
struct Concrete {
  using Int = int64_t;
  static Int size(const at::Tensor& t, int64_t d) { return t.size(d); }
  static bool eq(Int a, Int b) { return a == b; }
  static bool ge(Int a, int64_t b) { return a >= b; }
  static bool gt(Int a, int64_t b) { return a > b; }
  static std::string str(Int v) { return std::to_string(v); }
  // A dimension of more than one element with stride 0 (an expand()ed view): writing it would write one
  // memory location many times.
  static bool broadcast(const at::Tensor& t, int64_t d) { return t.size(d) > 1 && t.stride(d) == 0; }
  static std::optional<int64_t> known(int64_t v) { return v; }
  static std::optional<int64_t> stride(const at::Tensor& t, int64_t d) { return t.stride(d); }
  static std::optional<int64_t> offset(const at::Tensor& t) { return t.storage_offset(); }
};

// Symbolic (Meta kernels under tracing): SymInts; comparisons that dynamo cannot decide without a guard on
// data-dependent (unbacked) sizes become deferred runtime asserts (expect_true), never a graph break.
struct Symbolic {
  using Int = c10::SymInt;
  static Int size(const at::Tensor& t, int64_t d) { return t.sym_size(d); }
  static bool eq(const Int& a, const Int& b) { return a.sym_eq(b).expect_true(__FILE__, __LINE__); }
  static bool ge(const Int& a, int64_t b) { return a.sym_ge(b).expect_true(__FILE__, __LINE__); }
  static bool gt(const Int& a, int64_t b) { return a.sym_gt(b).expect_true(__FILE__, __LINE__); }
  static std::string str(const Int& v) {
    if (auto i = v.maybe_as_int()) {
      return std::to_string(*i);
    }
    return v.toSymNodeImplUnowned()->str();
  }
  // Decided only where the trace knows it without a guard: a stride that is 0 and a size known to exceed 1
  // (a symbolic stride or size is left to the eager check, which sees the real tensor).
  static bool broadcast(const at::Tensor& t, int64_t d) {
    const auto stride = t.sym_stride(d).maybe_as_int();
    const auto size = t.sym_size(d).maybe_as_int();
    return stride && *stride == 0 && size && *size > 1;
  }
  // Values the trace knows without a guard; nullopt leaves the rule to the eager check.
  static std::optional<int64_t> known(const c10::SymInt& v) {
    if (auto i = v.maybe_as_int()) {
      return *i;
    }
    return std::nullopt;
  }
  static std::optional<int64_t> stride(const at::Tensor& t, int64_t d) { return known(t.sym_stride(d)); }
  static std::optional<int64_t> offset(const at::Tensor& t) { return known(t.sym_storage_offset()); }
};

template <typename P>
std::string shape_of(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) {
    out += (i ? ", " : "") + P::str(P::size(t, i));
  }
  return out + "]";
}

// Python spelling ("torch.int64"), since that is what the caller wrote.
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBool: return "torch.bool";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    case at::kFloat8_e4m3fnuz: return "torch.float8_e4m3fnuz";
    case at::kFloat8_e5m2fnuz: return "torch.float8_e5m2fnuz";
    default: return std::string("torch.") + c10::toString(t);
  }
}

bool is_io_dtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat || t == at::kDouble;
}

Verdict same_device(const at::Tensor& t, const char* name, const at::Tensor& prefix_sum) {
  K3_VALUE_RULE(t.device() == prefix_sum.device(), name, " must be on prefix_sum's device (",
                prefix_sum.device().str(), "), got ", t.device().str());
  return std::nullopt;
}

Verdict floating_weight(const at::Tensor& t, const char* name) {
  K3_TYPE_RULE(at::isFloatingType(t.scalar_type()), name, ".dtype must be a floating dtype, got ",
               dtype_name(t.scalar_type()));
  return std::nullopt;
}

Verdict positive_eps(double eps, const char* name) {
  K3_VALUE_RULE(std::isfinite(eps) && eps > 0.0, name, " must be finite and > 0, got ", eps);
  return std::nullopt;
}

// grad_out of the backward and addend of the fused op are "another [T, H] tensor like prefix_sum".
template <typename P>
Verdict like_prefix(const at::Tensor& t, const char* name, const at::Tensor& prefix_sum) {
  K3_VALUE_RULE(t.dim() == 2, name, " must be 2-D [T, H] like prefix_sum, got a ", t.dim(), "-D tensor of shape ",
                shape_of<P>(t));
  K3_TYPE_RULE(t.scalar_type() == prefix_sum.scalar_type(), name, ".dtype must equal prefix_sum.dtype=",
               dtype_name(prefix_sum.scalar_type()), ", got ", dtype_name(t.scalar_type()));
  K3_FIRST(same_device(t, name, prefix_sum));
  const auto T = P::size(prefix_sum, 0);
  const auto H = P::size(prefix_sum, 1);
  K3_VALUE_RULE(P::eq(P::size(t, 0), T), name, ".size(0) must equal prefix_sum.size(0)=", P::str(T),
                " (token count), got ", P::str(P::size(t, 0)));
  K3_VALUE_RULE(P::eq(P::size(t, 1), H), name, ".size(1) must equal prefix_sum.size(1)=", P::str(H),
                " (hidden size), got ", P::str(P::size(t, 1)));
  return std::nullopt;
}

template <typename P>
Verdict attn_res_rules(const at::Tensor& prefix_sum, const at::Tensor& block_residual, const at::Tensor& norm_weight,
                       const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps) {
  // Ranks first: every later rule indexes sizes.
  K3_VALUE_RULE(prefix_sum.dim() == 2, "prefix_sum must be 2-D [T, H], got a ", prefix_sum.dim(),
                "-D tensor of shape ", shape_of<P>(prefix_sum));
  K3_VALUE_RULE(block_residual.dim() == 3,
                "block_residual must be 3-D [T, C, H] (pass a block-major [C, T, H] buffer as "
                ".transpose(0, 1)), got a ", block_residual.dim(), "-D tensor of shape ", shape_of<P>(block_residual));
  K3_VALUE_RULE(norm_weight.dim() == 1, "norm_weight must be 1-D [H], got a ", norm_weight.dim(),
                "-D tensor of shape ", shape_of<P>(norm_weight));
  K3_VALUE_RULE(proj_weight.dim() == 1 || proj_weight.dim() == 2,
                "proj_weight must be [H] or [1, H] (an nn.Linear(H, 1) weight), got a ", proj_weight.dim(),
                "-D tensor of shape ", shape_of<P>(proj_weight));
  if (proj_weight.dim() == 2) {
    K3_VALUE_RULE(P::eq(P::size(proj_weight, 0), 1),
                  "proj_weight must be [H] or [1, H] (an nn.Linear(H, 1) weight), got shape ", shape_of<P>(proj_weight));
  }

  // Dtypes: the candidates share one I/O dtype; the weights may be any floating dtype.
  K3_TYPE_RULE(is_io_dtype(prefix_sum.scalar_type()),
               "prefix_sum.dtype must be one of torch.bfloat16, torch.float16, torch.float32, torch.float64, got ",
               dtype_name(prefix_sum.scalar_type()));
  K3_TYPE_RULE(block_residual.scalar_type() == prefix_sum.scalar_type(),
               "block_residual.dtype must equal prefix_sum.dtype=", dtype_name(prefix_sum.scalar_type()), ", got ",
               dtype_name(block_residual.scalar_type()));
  K3_FIRST(floating_weight(norm_weight, "norm_weight"));
  K3_FIRST(floating_weight(proj_weight, "proj_weight"));

  K3_FIRST(same_device(block_residual, "block_residual", prefix_sum));
  K3_FIRST(same_device(norm_weight, "norm_weight", prefix_sum));
  K3_FIRST(same_device(proj_weight, "proj_weight", prefix_sum));

  // Sizes: one hidden size H >= 1 and one token count T across all arguments.
  const auto H = P::size(prefix_sum, 1);
  K3_VALUE_RULE(P::ge(H, 1), "prefix_sum.size(1) (hidden size H) must be >= 1, got ", P::str(H));
  K3_VALUE_RULE(P::eq(P::size(block_residual, 2), H), "block_residual.size(2) must equal prefix_sum.size(1)=",
                P::str(H), " (hidden size), got ", P::str(P::size(block_residual, 2)));
  K3_VALUE_RULE(P::eq(P::size(norm_weight, 0), H), "norm_weight.size(0) must equal prefix_sum.size(1)=", P::str(H),
                " (hidden size), got ", P::str(P::size(norm_weight, 0)));
  K3_VALUE_RULE(P::eq(P::size(proj_weight, proj_weight.dim() - 1), H),
                "proj_weight.size(-1) must equal prefix_sum.size(1)=", P::str(H), " (hidden size), got ",
                P::str(P::size(proj_weight, proj_weight.dim() - 1)));
  K3_VALUE_RULE(P::eq(P::size(block_residual, 0), P::size(prefix_sum, 0)),
                "block_residual.size(0) must equal prefix_sum.size(0)=", P::str(P::size(prefix_sum, 0)),
                " (token count), got ", P::str(P::size(block_residual, 0)));

  // The valid prefix of the buffer: dim 1 is only capacity.
  const auto C = P::size(block_residual, 1);
  K3_VALUE_RULE(num_valid_blocks >= 0, "num_valid_blocks must be in [0, block_residual.size(1)=", P::str(C),
                "], got ", num_valid_blocks);
  K3_VALUE_RULE(P::ge(C, num_valid_blocks), "num_valid_blocks must be in [0, block_residual.size(1)=", P::str(C),
                "], got ", num_valid_blocks);
  return positive_eps(eps, "eps");
}

template <typename P>
Verdict attn_res_backward_rules(const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                                const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps) {
  K3_FIRST(attn_res_rules<P>(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps));
  return like_prefix<P>(grad_out, "grad_out", prefix_sum);
}

template <typename P>
Verdict fused_attn_res_arg_rules(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                 const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                 const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                 int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                 c10::optional<double> out_norm_eps) {
  K3_FIRST(attn_res_rules<P>(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps));
  if (addend.has_value()) {
    K3_FIRST(like_prefix<P>(*addend, "addend", prefix_sum));
  }
  if (block_write_idx != -1) {
    // The snapshot goes into free capacity: never over a valid block, never past the buffer.
    const auto C = P::size(block_residual, 1);
    K3_VALUE_RULE(block_write_idx >= num_valid_blocks && P::gt(C, block_write_idx),
                  "block_write_idx must be -1 (no snapshot) or in [num_valid_blocks=", num_valid_blocks,
                  ", block_residual.size(1)=", P::str(C), "), got ", block_write_idx);
  }
  if (out_norm_weight.has_value()) {
    const at::Tensor& w = *out_norm_weight;
    K3_VALUE_RULE(w.dim() == 1, "out_norm_weight must be 1-D [H], got a ", w.dim(), "-D tensor of shape ",
                  shape_of<P>(w));
    K3_VALUE_RULE(P::eq(P::size(w, 0), P::size(prefix_sum, 1)), "out_norm_weight.size(0) must equal prefix_sum.size(1)=",
                  P::str(P::size(prefix_sum, 1)), " (hidden size), got ", P::str(P::size(w, 0)));
    K3_FIRST(floating_weight(w, "out_norm_weight"));
    K3_FIRST(same_device(w, "out_norm_weight", prefix_sum));
  } else {
    K3_VALUE_RULE(!out_norm_eps.has_value(), "out_norm_eps needs out_norm_weight (there is no output norm "
                  "without it), got out_norm_eps=", out_norm_eps.value_or(0.0), " and out_norm_weight=None");
  }
  if (out_norm_eps.has_value()) {
    K3_FIRST(positive_eps(*out_norm_eps, "out_norm_eps"));
  }
  return std::nullopt;
}

// ---- Aliasing: what an op writes must share no memory with what it reads (as PyTorch's own in-place ops check).
// A Region is the memory a tensor, or a slot range of a [T, C, H] buffer, can touch: its storage, element size,
// offset, sizes and strides, each known or not (a symbolic value the trace cannot read without a guard). Built by
// arithmetic on the tensor's metadata, never by making a view, so an eager check costs no allocation or dispatch.
struct Region {
  const c10::StorageImpl* storage = nullptr;  // nullptr: no storage (nothing to alias)
  int64_t item = 1;
  std::optional<int64_t> offset;
  int64_t dim = 0;
  std::array<std::optional<int64_t>, 3> size, stride;
};

template <typename P>
Region region_of(const at::Tensor& t) {
  Region r;
  if (!t.has_storage() || t.dim() > 3) {
    return r;  // no storage; the ops' tensors are 1-D to 3-D (their shape rules ran first)
  }
  r.storage = t.storage().unsafeGetStorageImpl();
  r.item = static_cast<int64_t>(t.element_size());
  r.offset = P::offset(t);
  r.dim = t.dim();
  for (int64_t d = 0; d < t.dim(); ++d) {
    r.size[d] = P::known(P::size(t, d));
    r.stride[d] = P::stride(t, d);
  }
  return r;
}

// Slots [lo, hi) of a [T, C, H] buffer (lo <= hi <= C, checked before).
template <typename P>
Region slots_of(const at::Tensor& bank, int64_t lo, int64_t hi) {
  Region r = region_of<P>(bank);
  if (r.offset && r.stride[1]) {
    r.offset = *r.offset + lo * *r.stride[1];
  } else {
    r.offset.reset();
  }
  r.size[1] = hi - lo;
  return r;
}

bool known(const Region& r) {
  if (!r.offset) {
    return false;
  }
  for (int64_t d = 0; d < r.dim; ++d) {
    if (!r.size[d] || !r.stride[d]) {
      return false;
    }
  }
  return true;
}

bool empty(const Region& r) {
  for (int64_t d = 0; d < r.dim; ++d) {
    if (r.size[d] && *r.size[d] == 0) {
      return true;
    }
  }
  return false;
}

// The bytes [first, last) a known, non-empty region's elements can occupy (non-negative strides).
std::pair<int64_t, int64_t> byte_extent(const Region& r) {
  int64_t last = *r.offset;
  for (int64_t d = 0; d < r.dim; ++d) {
    last += (*r.size[d] - 1) * *r.stride[d];
  }
  return {*r.offset * r.item, (last + 1) * r.item};
}

// Where a 2-D [T, H] or 3-D [T, C, H] region of contiguous rows keeps its rows within one period of its token stride
// s: the column ranges [start, start + H) modulo s of its rows (one per slot of a 3-D region). nullopt where a row
// is not contiguous or longer than s.
std::optional<std::vector<std::pair<int64_t, int64_t>>> row_columns(const Region& r, int64_t s) {
  if (r.dim != 2 && r.dim != 3) {
    return std::nullopt;
  }
  const int64_t last = r.dim - 1;
  const int64_t len = *r.size[last];
  if ((len > 1 && *r.stride[last] != 1) || len > s) {
    return std::nullopt;
  }
  const int64_t slots = r.dim == 3 ? *r.size[1] : 1;
  const int64_t slot_stride = r.dim == 3 ? *r.stride[1] : 0;
  std::vector<std::pair<int64_t, int64_t>> rows;
  for (int64_t c = 0; c < slots; ++c) {
    rows.emplace_back(((*r.offset + c * slot_stride) % s + s) % s, len);
  }
  return rows;
}

// Regions of contiguous rows at one token stride s whose rows sit in different columns of s, e.g. the two halves of
// one [T, 2 H] allocation, a [T, H] slot beside a [T, C, H] bank in one [T, C + 1, H] allocation, or a token-major
// bank's snapshot slot beside its valid slots: their elements never meet, whatever their extents.
bool side_by_side_rows(const Region& a, const Region& b) {
  if (a.dim < 2 || b.dim < 2 || a.item != b.item) {
    return false;
  }
  const int64_t s = *a.stride[0];
  if (s != *b.stride[0] || s <= 0) {
    return false;
  }
  const auto ra = row_columns(a, s), rb = row_columns(b, s);
  if (!ra || !rb) {
    return false;
  }
  for (const auto& [a0, la] : *ra) {
    for (const auto& [b0, lb] : *rb) {
      // On a circle of s columns: b's row starts d after a's; they miss each other iff a ends before b starts and b
      // ends before a starts again.
      const int64_t d = ((b0 - a0) % s + s) % s;
      if (d < la || d + lb > s) {
        return false;
      }
    }
  }
  return true;
}

// The same memory with the same layout: the one alias a contract may allow (addend is prefix_sum).
bool same_view(const Region& a, const Region& b) {
  if (a.storage != b.storage || a.item != b.item || a.dim != b.dim || a.offset != b.offset) {
    return false;
  }
  for (int64_t d = 0; d < a.dim; ++d) {
    if (a.size[d] != b.size[d] || (a.size[d] != std::optional<int64_t>(1) && a.stride[d] != b.stride[d])) {
      return false;
    }
  }
  return true;
}

// A region written by the op against one it reads (or also writes): no shared element, decided from byte extents
// in one storage, except that rows side by side at one token stride pass. Conservative otherwise: two interleaved
// views whose elements never coincide count as overlapping. Unknown at trace time (symbolic offsets or strides):
// left to the eager check, which every kernel runs.
Verdict no_shared_memory(const Region& out, const std::string& out_name, const char* role, const Region& t,
                         const std::string& name, const char* why) {
  if (out.storage == nullptr || out.storage != t.storage || empty(out) || empty(t) || !known(out) || !known(t) ||
      side_by_side_rows(out, t)) {
    return std::nullopt;
  }
  const auto a = byte_extent(out);
  const auto b = byte_extent(t);
  K3_VALUE_RULE(!(a.first < b.second && b.first < a.second), out_name, role, " must not share memory with ", name,
                " (", why, "), got ", out_name, " at bytes [", a.first, ", ", a.second, ") and ", name, " at bytes [",
                b.first, ", ", b.second, ") of one storage");
  return std::nullopt;
}

std::string slot_label(int64_t w) { return "block_residual[:, block_write_idx=" + std::to_string(w) + "]"; }

// A written region must not map two of its elements to one location (a stride-0 or overlapping layout): the dims of
// more than one element, by increasing stride, each step past everything the smaller ones reach. Conservative:
// an interleaved layout that never collides still fails.
Verdict no_internal_overlap(const Region& r, const char* name, int64_t slot, const char* why) {
  if (r.storage == nullptr || empty(r) || !known(r)) {
    return std::nullopt;
  }
  std::array<std::pair<int64_t, int64_t>, 3> dims;  // (stride, size) of the dims with more than one element
  size_t n = 0;
  for (int64_t d = 0; d < r.dim; ++d) {
    if (*r.size[d] > 1) {
      dims[n++] = {*r.stride[d], *r.size[d]};
    }
  }
  std::sort(dims.begin(), dims.begin() + n);
  int64_t reach = 0;  // the largest offset the smaller dims reach
  bool ok = true;
  for (size_t i = 0; i < n && ok; ++i) {
    ok = dims[i].first > reach;
    reach += (dims[i].second - 1) * dims[i].first;
  }
  if (ok) {
    return std::nullopt;
  }
  std::string sizes, strides;
  for (int64_t d = 0; d < r.dim; ++d) {
    sizes += (d ? ", " : "") + std::to_string(*r.size[d]);
    strides += (d ? ", " : "") + std::to_string(*r.stride[d]);
  }
  K3_VALUE_RULE(false, slot < 0 ? std::string(name) : slot_label(slot), " is written (", why,
                ") and must not map two elements to one memory location, got sizes [", sizes, "] and strides [",
                strides, "]");
  return std::nullopt;
}

// The aliasing rules of the serving ops, for the writes each makes: the snapshot slot block_residual[:, w] (every
// overload, w >= 0), prefix_sum in place (fused_attn_res_ with an addend) and sum_out (.full). Each written region
// has no internal overlap and shares no memory with any argument the op reads (prefix_sum, addend, the valid blocks
// block_residual[:, :K], the weights) or writes besides it. The one alias a contract allows: addend is prefix_sum
// (fused_attn_res_, prefix_sum += prefix_sum, each element read before it is written by the same lane).
template <typename P>
Verdict serving_alias_rules(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                            const at::Tensor& block_residual, const at::Tensor& norm_weight,
                            const at::Tensor& proj_weight, int64_t num_valid_blocks, int64_t block_write_idx,
                            const c10::optional<at::Tensor>& out_norm_weight, bool prefix_written,
                            const c10::optional<at::Tensor>& sum_out) {
  // Each written region first on its own (no allocation: names are built only for a message).
  const bool snapshot = block_write_idx >= 0;
  if (prefix_written) {
    K3_FIRST(no_internal_overlap(region_of<P>(prefix_sum), "prefix_sum", -1,
                                 "round(prefix_sum + addend) is stored into it in place"));
  }
  if (snapshot) {
    K3_FIRST(no_internal_overlap(slots_of<P>(block_residual, block_write_idx, block_write_idx + 1), "", block_write_idx,
                                 "the snapshot of the new prefix"));
  }
  // Then against each other argument. Different storages cannot alias: the common case ends here.
  auto storage = [](const at::Tensor& t) -> const c10::StorageImpl* {
    return t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
  };
  const std::array<const c10::StorageImpl*, 7> stores = {
      storage(prefix_sum), storage(block_residual), storage(norm_weight), storage(proj_weight),
      addend ? storage(*addend) : nullptr, out_norm_weight ? storage(*out_norm_weight) : nullptr,
      sum_out ? storage(*sum_out) : nullptr};
  bool shared = false;
  for (size_t i = 0; i < stores.size() && !shared; ++i) {
    for (size_t j = i + 1; j < stores.size(); ++j) {
      shared = shared || (stores[i] != nullptr && stores[i] == stores[j]);
    }
  }
  if (!shared) {
    return std::nullopt;
  }

  struct Named {
    Region region;
    std::string name;
  };
  const std::string valid_name = "block_residual[:, :num_valid_blocks=" + std::to_string(num_valid_blocks) + "]";
  std::vector<Named> reads = {{region_of<P>(prefix_sum), "prefix_sum"},
                              {slots_of<P>(block_residual, 0, num_valid_blocks), valid_name},
                              {region_of<P>(norm_weight), "norm_weight"},
                              {region_of<P>(proj_weight), "proj_weight"}};
  if (addend) reads.push_back({region_of<P>(*addend), "addend"});
  if (out_norm_weight) reads.push_back({region_of<P>(*out_norm_weight), "out_norm_weight"});

  if (prefix_written) {
    const Region prefix = reads[0].region;
    for (size_t i = 1; i < reads.size(); ++i) {
      if (reads[i].name == "addend" && same_view(prefix, reads[i].region)) {
        continue;  // prefix_sum += prefix_sum: allowed
      }
      K3_FIRST(no_shared_memory(prefix, "prefix_sum", " (written in place)", reads[i].region, reads[i].name,
                                "the new prefix is stored into prefix_sum while the inputs are read"));
    }
  }
  if (snapshot) {
    const Region slot = slots_of<P>(block_residual, block_write_idx, block_write_idx + 1);
    const std::string slot_name = slot_label(block_write_idx);
    for (const Named& r : reads) {
      K3_FIRST(no_shared_memory(slot, slot_name, " (the snapshot slot, written)", r.region, r.name,
                                "the snapshot is stored while the inputs are read"));
    }
  }
  if (sum_out) {
    const Region s = region_of<P>(*sum_out);
    const char* why = "the new prefix is stored into sum_out while the inputs are read";
    reads.push_back({region_of<P>(block_residual), "block_residual"});
    for (const Named& r : reads) {
      if (r.name.rfind("block_residual[", 0) == 0) {
        continue;  // the whole buffer, below, covers its valid slots and the snapshot slot
      }
      K3_FIRST(no_shared_memory(s, "sum_out", "", r.region, r.name, why));
    }
  }
  return std::nullopt;
}

// fused_attn_res (out of place): its arguments' rules, then the snapshot's aliasing.
template <typename P>
Verdict fused_attn_res_rules(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                             const at::Tensor& block_residual, const at::Tensor& norm_weight,
                             const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                             int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                             c10::optional<double> out_norm_eps) {
  K3_FIRST(fused_attn_res_arg_rules<P>(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                       eps, block_write_idx, out_norm_weight, out_norm_eps));
  return serving_alias_rules<P>(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                block_write_idx, out_norm_weight, /*prefix_written=*/false, c10::nullopt);
}

// The FP8 output formats of the serving ops: the two e4m3 variants serving engines quantize activations to
// (float8_e4m3fn on NVIDIA, float8_e4m3fnuz on AMD MI300); each output row gets a dynamic per-token scale.
bool is_fp8_out_dtype(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e4m3fnuz; }

template <typename P>
Verdict fused_attn_res_quant_rules(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                   const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                   const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                   int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                   c10::optional<double> out_norm_eps, at::ScalarType out_dtype) {
  K3_FIRST(fused_attn_res_rules<P>(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                   eps, block_write_idx, out_norm_weight, out_norm_eps));
  K3_TYPE_RULE(is_fp8_out_dtype(out_dtype), "out_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got ",
               dtype_name(out_dtype));
  return std::nullopt;
}

template <typename P>
Verdict fused_attn_res_inplace_rules(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                     const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                     const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                     int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                     c10::optional<double> out_norm_eps, c10::optional<at::ScalarType> out_dtype) {
  K3_FIRST(fused_attn_res_arg_rules<P>(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                       eps, block_write_idx, out_norm_weight, out_norm_eps));
  if (out_dtype.has_value()) {
    K3_TYPE_RULE(is_fp8_out_dtype(*out_dtype), "out_dtype must be None, torch.float8_e4m3fn or torch.float8_e4m3fnuz, "
                 "got ", dtype_name(*out_dtype));
  }
  if (addend.has_value()) {
    // round(prefix_sum + addend) is stored back into prefix_sum, one element per location.
    for (int64_t d = 0; d < 2; ++d) {
      K3_VALUE_RULE(!P::broadcast(prefix_sum, d), "prefix_sum is written in place (an addend is given) and must not "
                    "be a broadcast view, got prefix_sum.stride(", d, ")=0 with prefix_sum.size(", d, ")=",
                    P::str(P::size(prefix_sum, d)));
    }
  }
  return serving_alias_rules<P>(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                block_write_idx, out_norm_weight, /*prefix_written=*/addend.has_value(), c10::nullopt);
}

template <typename P>
Verdict fused_attn_res_full_rules(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                  const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                  const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                  int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                  c10::optional<double> out_norm_eps, bool return_mix, bool mix,
                                  const c10::optional<at::Tensor>& sum_out) {
  K3_FIRST(fused_attn_res_arg_rules<P>(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                       eps, block_write_idx, out_norm_weight, out_norm_eps));
  K3_VALUE_RULE(mix || !return_mix, "return_mix=True needs mix=True (with mix=False nothing is mixed), got "
                "return_mix=True and mix=False");
  if (out_norm_weight.has_value()) {
    K3_VALUE_RULE(mix, "out_norm_weight needs mix=True (with mix=False there is no output to normalise), got mix=False "
                  "and out_norm_weight of shape ", shape_of<P>(*out_norm_weight));
  }
  if (sum_out.has_value()) {
    const at::Tensor& s = *sum_out;
    K3_FIRST(like_prefix<P>(s, "sum_out", prefix_sum));
    // Rows of H contiguous elements (the kernels store whole rows), at any token stride that keeps them apart.
    const auto size0 = P::known(P::size(s, 0));
    const auto size1 = P::known(P::size(s, 1));
    const auto stride0 = P::stride(s, 0);
    const auto stride1 = P::stride(s, 1);
    if (size1 && stride1 && *size1 > 1) {
      K3_VALUE_RULE(*stride1 == 1, "sum_out must have contiguous rows (sum_out.stride(1) == 1), got sum_out.stride(1)=",
                    *stride1);
    }
    if (size0 && size1 && stride0 && *size0 > 1) {
      K3_VALUE_RULE(*stride0 >= *size1, "sum_out's rows must not overlap (sum_out.stride(0) >= sum_out.size(1)=",
                    *size1, "), got sum_out.stride(0)=", *stride0);
    }
  }
  return serving_alias_rules<P>(prefix_sum, addend, block_residual, norm_weight, proj_weight, num_valid_blocks,
                                block_write_idx, out_norm_weight, /*prefix_written=*/false, sum_out);
}

// Trace time: raise the violation as the matching Python exception type.
// tp_all_reduce: a per-rank partial [T, H] of an I/O dtype and the name of the group that sums it.
template <typename P>
Verdict tp_all_reduce_rules(const at::Tensor& partial, const std::string& group_name) {
  K3_VALUE_RULE(partial.dim() == 2, "partial must be 2-D [T, H], got a ", partial.dim(), "-D tensor of shape ",
                shape_of<P>(partial));
  K3_TYPE_RULE(is_io_dtype(partial.scalar_type()),
               "partial.dtype must be one of torch.bfloat16, torch.float16, torch.float32, torch.float64, got ",
               dtype_name(partial.scalar_type()));
  K3_VALUE_RULE(P::gt(P::size(partial, 1), 0), "partial.size(1) (hidden size) must be > 0, got ",
                P::str(P::size(partial, 1)));
  K3_VALUE_RULE(!group_name.empty(), "group_name must name a process group (ProcessGroup.group_name), got ''");
  return std::nullopt;
}


void raise(const Verdict& v) {
  if (!v) {
    return;
  }
  if (v->type_error) {
    TORCH_CHECK_TYPE(false, v->message);
  }
  TORCH_CHECK_VALUE(false, v->message);
}

}  // namespace

Verdict attn_res_violation(const at::Tensor& prefix_sum, const at::Tensor& block_residual,
                           const at::Tensor& norm_weight, const at::Tensor& proj_weight, int64_t num_valid_blocks,
                           double eps) {
  return attn_res_rules<Concrete>(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps);
}

Verdict attn_res_backward_violation(const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                                    const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                    const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps) {
  return attn_res_backward_rules<Concrete>(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                           num_valid_blocks, eps);
}

Verdict fused_attn_res_violation(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                 const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                 const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                 int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                 c10::optional<double> out_norm_eps) {
  return fused_attn_res_rules<Concrete>(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                        num_valid_blocks, eps, block_write_idx, out_norm_weight, out_norm_eps);
}

Verdict fused_attn_res_quant_violation(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                       const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                       const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                       int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                       c10::optional<double> out_norm_eps, at::ScalarType out_dtype) {
  return fused_attn_res_quant_rules<Concrete>(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                              num_valid_blocks, eps, block_write_idx, out_norm_weight, out_norm_eps,
                                              out_dtype);
}

Verdict fused_attn_res_inplace_violation(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                         const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                         const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                         int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                         c10::optional<double> out_norm_eps,
                                         c10::optional<at::ScalarType> out_dtype) {
  return fused_attn_res_inplace_rules<Concrete>(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                                num_valid_blocks, eps, block_write_idx, out_norm_weight,
                                                out_norm_eps, out_dtype);
}

void check_attn_res_args(const at::Tensor& prefix_sum, const at::Tensor& block_residual,
                         const at::Tensor& norm_weight, const at::Tensor& proj_weight, int64_t num_valid_blocks,
                         double eps) {
  raise(attn_res_rules<Symbolic>(prefix_sum, block_residual, norm_weight, proj_weight, num_valid_blocks, eps));
}

void check_attn_res_backward_args(const at::Tensor& grad_out, const at::Tensor& prefix_sum,
                                  const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                  const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps) {
  raise(attn_res_backward_rules<Symbolic>(grad_out, prefix_sum, block_residual, norm_weight, proj_weight,
                                          num_valid_blocks, eps));
}

void check_fused_attn_res_args(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                               const at::Tensor& block_residual, const at::Tensor& norm_weight,
                               const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                               int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                               c10::optional<double> out_norm_eps) {
  raise(fused_attn_res_rules<Symbolic>(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                       num_valid_blocks, eps, block_write_idx, out_norm_weight, out_norm_eps));
}

void check_fused_attn_res_quant_args(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                     const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                     const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                     int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                     c10::optional<double> out_norm_eps, at::ScalarType out_dtype) {
  raise(fused_attn_res_quant_rules<Symbolic>(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                             num_valid_blocks, eps, block_write_idx, out_norm_weight, out_norm_eps,
                                             out_dtype));
}

void check_fused_attn_res_inplace_args(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                       const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                       const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                       int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                       c10::optional<double> out_norm_eps, c10::optional<at::ScalarType> out_dtype) {
  raise(fused_attn_res_inplace_rules<Symbolic>(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                               num_valid_blocks, eps, block_write_idx, out_norm_weight, out_norm_eps,
                                               out_dtype));
}

Verdict fused_attn_res_full_violation(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                      const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                      const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                      int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                      c10::optional<double> out_norm_eps, bool return_mix, bool mix,
                                      const c10::optional<at::Tensor>& sum_out) {
  return fused_attn_res_full_rules<Concrete>(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                             num_valid_blocks, eps, block_write_idx, out_norm_weight, out_norm_eps,
                                             return_mix, mix, sum_out);
}

void check_fused_attn_res_full_args(const at::Tensor& prefix_sum, const c10::optional<at::Tensor>& addend,
                                    const at::Tensor& block_residual, const at::Tensor& norm_weight,
                                    const at::Tensor& proj_weight, int64_t num_valid_blocks, double eps,
                                    int64_t block_write_idx, const c10::optional<at::Tensor>& out_norm_weight,
                                    c10::optional<double> out_norm_eps, bool return_mix, bool mix,
                                    const c10::optional<at::Tensor>& sum_out) {
  raise(fused_attn_res_full_rules<Symbolic>(prefix_sum, addend, block_residual, norm_weight, proj_weight,
                                            num_valid_blocks, eps, block_write_idx, out_norm_weight, out_norm_eps,
                                            return_mix, mix, sum_out));
}

Verdict tp_all_reduce_violation(const at::Tensor& partial, const std::string& group_name) {
  return tp_all_reduce_rules<Concrete>(partial, group_name);
}

void check_tp_all_reduce_args(const at::Tensor& partial, const std::string& group_name) {
  raise(tp_all_reduce_rules<Symbolic>(partial, group_name));
}

}  // namespace k3_ops
