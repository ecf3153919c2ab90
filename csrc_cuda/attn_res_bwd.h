// The single-read CUDA backward of kimi_k3::attn_res: host-side interface of attn_res_bwd.cu.
//
// Plain CUDA runtime types only (no torch headers): python_cuda.cpp turns tensors into these arguments, and this
// file's .cu compiles with nvcc alone. The math is docs/attn_res_backward.md's; the design is in attn_res_bwd.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace k3_ops::cuda {

// Element types the kernel reads (candidates and grad_out share one; each weight has its own).
enum class IoDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct SingleReadBwdArgs {
  const void* grad_out;     // [T, H], unit hidden stride
  const void* prefix;       // [T, H], unit hidden stride
  const void* blocks;       // [T, C, H] view, unit hidden stride; only slots < K are read
  const void* norm_weight;  // [H], contiguous
  const void* proj_weight;  // [H], contiguous
  void* grad_prefix;        // [T, H] contiguous, or null (not written)
  void* grad_blocks;        // [T, C, H] contiguous, or null (not written)
  double* workspace;        // [grid, H] FP64 weight-gradient partials, or null (not computed)
  // The partials reduced in the kernel (ring layout, cooperative launch), times the other weight: [H] of the
  // norm weight's dtype (nw_dtype) and of the proj weight's (pw_dtype), each or both null (not asked for); both
  // null: a separate reduction sums the workspace.
  void* grad_norm_weight;
  void* grad_proj_weight;
  int64_t T, K, C, H;
  int64_t stride_gyt, stride_pt, stride_bt, stride_bc;  // in elements
  int64_t tokens_per_prog;  // program p walks tokens [p * tokens_per_prog, (p + 1) * tokens_per_prog)
  double eps;
  IoDtype io_dtype, nw_dtype, pw_dtype;
  int vectors_per_thread;  // 0: rows in shared memory, one 16-byte vector per thread; 1 or 2: in registers;
                           // kRingLayout: a shared-memory ring of row slots
  int ring_rows;           // kRingLayout: row slots (set by the launch from the device's shared memory)
};

// vectors_per_thread of the ring layout (rows of the tokens ahead in flight through a ring of row slots).
constexpr int kRingLayout = 3;
// The ring's most slots (cp.async.wait_group counts are immediates: the kernel instantiates kRingMaxRows - 3 + 1).
constexpr int kRingMaxRows = 16;

// The most rows (grad_out plus K + 1 candidates, i.e. K + 2) of any compiled variant: K <= 8.
constexpr int kSingleReadMaxRows = 10;

// Threads per program for a row of H elements (a multiple of 32), or 0 when H is not supported.
int single_read_threads(int64_t H, int vectors_per_thread);

// Dynamic shared memory of one program (bytes), or 0 when the shape is not supported (io dtype not 16-bit,
// H % 8 != 0 or too wide, K + 2 > kSingleReadMaxRows). The caller compares it with the device's opt-in limit.
size_t single_read_smem_bytes(int64_t K, int64_t H, IoDtype io_dtype, int vectors_per_thread);

// The ring layout's shared memory with ring_rows slots, and the slots that fit smem_limit bytes (0: not even K + 2).
size_t ring_smem_bytes(int64_t K, int64_t H, int ring_rows);
int ring_rows_for(int64_t K, int64_t H, size_t smem_limit);

// Launch `grid` programs on `stream` (grid * tokens_per_prog >= T). Returns the launch's error code.
cudaError_t launch_single_read_bwd(const SingleReadBwdArgs& args, int grid, cudaStream_t stream);

}  // namespace k3_ops::cuda
