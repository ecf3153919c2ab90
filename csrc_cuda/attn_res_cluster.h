// The thread-block-cluster forward of kimi_k3::attn_res (decode sizes): host-side interface of attn_res_cluster.cu
// (the entry) and attn_res_cluster_cs{2,4,8}.cu (the kernel of attn_res_cluster_kernel.h, a unit per cluster size).
//
// Plain CUDA runtime types only, as attn_res_bwd.h; python_cuda.cpp turns tensors into these arguments.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attn_res_bwd.h"  // IoDtype

namespace k3_ops::cuda {

enum class Fp8Kind : int { kNone = 0, kE4M3Fn = 1, kE4M3Fnuz = 2 };

struct ClusterFwdArgs {
  const void* prefix;       // [T, H], unit hidden stride, 16-byte aligned rows
  void* blocks;             // [T, C, H] view, unit hidden stride, 16-byte aligned rows; only slots < K are read,
                            // only slot write_idx is written (the fused call's snapshot)
  const void* norm_weight;  // [H], contiguous
  const void* proj_weight;  // [H], contiguous
  void* out;                // [T, H] contiguous
  // The fused calls: the prefix candidate is round(prefix + addend) (addend may be null), stored into new_prefix
  // ([T, H] contiguous) or, with inplace_prefix and an addend, back into prefix's row; with write_idx >= 0 also
  // into blocks[:, write_idx] (a slot >= K).
  const void* addend;       // [T, H], unit hidden stride, 16-byte aligned rows, or null
  void* new_prefix;         // or null (the plain op, and the in-place call)
  int64_t write_idx;        // -1: no snapshot
  bool inplace_prefix;      // fused_attn_res_: the new prefix goes back into prefix
  // The output RMSNorm, or null: out = (y * rsqrt(mean(y^2) + out_eps)) * out_norm_weight, with y the mix rounded
  // to the io dtype (norm_rounded_mix) or the FP32 mix itself.
  const void* out_norm_weight;  // [H], contiguous, 16-byte aligned
  double out_eps;
  bool norm_rounded_mix;
  // fused_attn_res.quant / an FP8 fused_attn_res_: out is [T, H] of e4m3 bytes, q = clamp(y / scale) rounded to
  // nearest even, scale = max(amax(y), 1e-10) / fp8_max into scale ([T] fp32), y the output rounded to the io dtype.
  Fp8Kind fp8;
  float* scale;
  double fp8_max;
  int64_t T, K, H;
  int64_t stride_pt, stride_bt, stride_bc, stride_at;  // in elements
  double eps;
  IoDtype io_dtype, nw_dtype, pw_dtype, onw_dtype;
  // The cluster kernel with the output norm only (the streaming kernel ignores them): the norm's sum of squares
  // from the candidates' pairwise products, exchanged with their statistics (no second exchange), where it is at
  // least gram_tau (sum_i p_i |v_i|)^2; y in that sum is the FP32 mix (the output still the norm of y as above).
  // Last, so that the other fields keep their offsets in the kernels' parameter block.
  bool norm_gram;
  float gram_tau;
};

// The most block rows of any compiled variant.
constexpr int kClusterMaxBlocks = 8;
// Threads per CTA at most: 128 registers each for the 9 x 8 candidate values held across the exchange.
constexpr int kClusterMaxThreads = 512;

// The launch for 2, 4 or 8 CTAs per token (attn_res_cluster_cs{2,4,8}.cu; threads: cluster_fwd_threads's).
cudaError_t launch_cluster_fwd_cs2(const ClusterFwdArgs& args, int threads, bool pdl, cudaStream_t stream);
cudaError_t launch_cluster_fwd_cs4(const ClusterFwdArgs& args, int threads, bool pdl, cudaStream_t stream);
cudaError_t launch_cluster_fwd_cs8(const ClusterFwdArgs& args, int threads, bool pdl, cudaStream_t stream);

// Threads per CTA for this shape, or 0 when the kernel cannot run it: a 16-bit io dtype, 1 <= K <= 8, H a multiple
// of 8 x cluster_size with at most 512 8-element vectors per CTA, cluster_size 2, 4 or 8; cluster_size 1 is the
// streaming kernel's (stream_fwd_threads).
int cluster_fwd_threads(int64_t K, int64_t H, IoDtype io_dtype, int cluster_size);

// Launch T clusters of cluster_size CTAs on `stream`, with programmatic dependent launch when `pdl`; cluster_size 1
// launches the streaming kernel (launch_stream_fwd).
cudaError_t launch_cluster_fwd(const ClusterFwdArgs& args, int cluster_size, bool pdl, cudaStream_t stream);

// The streaming forward (attn_res_stream.cu), same arguments: two persistent CTAs per SM, each streaming its
// tokens' rows through a shared-memory ring. Threads per CTA, or 0 when it cannot run the shape: a 16-bit io dtype,
// 1 <= K <= 8, H a multiple of 8 V with H / (8 V) <= 128 (one V-vector column strip per thread) for one V in
// {1, 2, 4, 7, 8}, and shared memory per CTA for a ring of at least 3 rows beside the output norm's FP32 weight.
int stream_fwd_threads(int64_t K, int64_t H, IoDtype io_dtype);
cudaError_t launch_stream_fwd(const ClusterFwdArgs& args, bool pdl, cudaStream_t stream);

}  // namespace k3_ops::cuda
