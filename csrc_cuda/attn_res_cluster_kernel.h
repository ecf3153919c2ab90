// The thread-block-cluster forward of kimi_k3::attn_res for decode sizes (sm_90+): the kernel and its launch, included
// by one translation unit per cluster size (attn_res_cluster_cs{2,4,8}.cu), which the build compiles in parallel;
// attn_res_cluster.cu picks the unit for a call.
//
// Why: one program per token reads a token's K + 1 rows through one SM, so at T <= 64 the time is one SM's
// bandwidth and latency, not the device's. Here a token is split over a cluster of CS CTAs (CS = 2, 4 or 8), each
// holding H / CS columns of every candidate in registers (one 16-byte vector per thread and row, all loads in
// flight at once). The per-candidate partial statistics (sum v^2, <v, w>) are exchanged through distributed shared
// memory, pushed: each CTA stores its partials into its slot of every rank's inbox, one split cluster barrier
// (arrive.release, wait.acquire) publishes them, and every CTA sums its own inbox's CS partials in rank order (so
// all ranks compute identical scores), takes the softmax and writes its columns of the output. No workspace, no
// global barrier, nothing shared between launches: concurrent calls on any streams are independent. Numerics: FP32
// throughout (the score from correctly rounded sqrt and reciprocal; the per-token Triton kernel's 1 / sqrt is
// within 1 ulp of it); that and the summation order differ from theirs, so bits differ, within the accuracy contract.
//
// The fused calls run here too (addend, new_prefix or in-place prefix, snapshot, output RMSNorm), so that their mix
// is attn_res's bit for bit on every path. The norm's sum of squares is a second exchange of one partial per CTA,
// the FP8 scale's max a third, each into an inbox of its own. With kGram (ClusterFwdArgs::norm_gram) the norm's sum
// of squares comes from the first exchange instead: each CTA's partial products <v_i, v_j> of every pair of
// candidates travel with its statistics, and |mix|^2 = sum_ij p_i p_j <v_i, v_j> / l^2, the same value in every
// thread of every rank (the same sums in the same order), so the branch to the second exchange, taken only where
// that value is inaccurate (gram_tau, as the Triton kernels' _gram_result), is uniform over the cluster.
//
// Why push: reading the ranks' partials after the barrier (pull) costs a remote load's round trip after it, and a
// second barrier before exit, so that no CTA frees shared memory another still reads. Pushed, the remote traffic
// is stores ahead of the barrier, only local reads follow it, and no barrier is needed at exit: every store into a
// CTA's inbox is released before an arrive that CTA waits for. Each inbox is written once per launch, so no
// exchange waits for the previous one's readers. DSMEM may only be written once the target CTA runs: a relaxed
// arrive at entry, waited for just before the first remote store (long satisfied by then). Same sums in the same
// order as pull, so the same bits (the two timed side by side: docs/kernels.md, "Design studies").
//
// Loads: everything a thread reads (the weights, the K block rows, the prefix, the addend, the output norm's weight)
// is fetched before anything is converted (attn_res_vec.h, fetch8). What that buys is the output norm's weight:
// loaded after the mix, its round trip came after the first exchange; with the inputs it hides behind theirs
// (docs/history.md, "Forward (`attn_res`) and the fused serving op").
// The plain op gains nothing: its loads were already in flight together.
//
// PDL: nothing is read before griddepcontrol.wait (cudaGridDependencySynchronize); dependents are released right
// after it.
#pragma once

#include "attn_res_cluster.h"

#include <cooperative_groups.h>

#include <type_traits>

#include "attn_res_vec.h"
#include "kernel_launch.h"
#include "warp_reduce.h"

namespace k3_ops::cuda {
// Unnamed on purpose, in a header: each unit that includes it instantiates its own cluster size's variants, and
// none of them is a symbol outside that unit (only its launch_cluster_fwd_cs<N> is).
namespace {

namespace cg = cooperative_groups;
using namespace device;  // NOLINT: the shared vector helpers

// The launch bound's minimum of CTAs per SM: 1 for the fused 2-block variants with an FP32 weight, 0 (none)
// elsewhere. With none, ptxas stops the 2-block FP32-weight variants at 64 registers, and the fused ones with 8 CTAs
// spill; a minimum of 1 lets them take the 128 that 512 threads allow, and they run faster
// (docs/history.md, "Forward (`attn_res`) and the fused serving op"). Only them: the plain ones do not spill and
// run slower with the minimum; on every other variant a minimum of 1 changes the sm_90 code (the timed bf16 ones
// among them), while 0 leaves it as timed.
template <typename NW, typename PW, int MB, bool kFused>
constexpr int kMinCtasPerSm =
    (kFused && MB == 2 && (std::is_same_v<NW, float> || std::is_same_v<PW, float>)) ? 1 : 0;

// kFused: the fused calls' code (addend, prefix stores, output norm, FP8 output), compiled out of the plain op's
// instantiation, which is faster without it and computes the same bits
// (docs/history.md, "Forward (`attn_res`) and the fused serving op").
// MB: the most block rows the variant holds (2, 4, 6 or kClusterMaxBlocks; pick_kernel). The kernel is bound by its
// instruction stream's latency (docs/kernels.md, "Design studies", "Cluster exchanges"), and a variant holding more
// candidates than the call has still runs the absent ones' statistics and their warp sums; every sum is the same
// one in each variant (the transposing butterfly adds the plain butterfly's pairs for any count), so the bits are
// too.
// This thread's partial products <x_i, x_j> over its 8 columns for the candidate pairs i < j numbered kBase ..
// kBase + kN - 1 in the order (0, 1), (0, 2), .., (1, 2), ..; 0 where either candidate is absent. The loops unroll
// fully, so every index is a compile-time constant (no local memory).
template <int kMaxCand, int kBase, int kN>
__device__ __forceinline__ void gram_partials(const float (&x)[kMaxCand][8], bool active, int K, float (&out)[kN]) {
  int q = 0;
#pragma unroll
  for (int i = 0; i < kMaxCand; ++i) {
#pragma unroll
    for (int j = i + 1; j < kMaxCand; ++j) {
      if (q >= kBase && q < kBase + kN) {
        float s = 0.f;
        if (active && (i < K || i == kMaxCand - 1) && (j < K || j == kMaxCand - 1)) {
#pragma unroll
          for (int c = 0; c < 8; ++c) s = fmaf(x[i][c], x[j][c], s);
        }
        out[q - kBase] = s;
      }
      ++q;
    }
  }
}

// Pairs kBase .. kBase + kN - 1 summed over the warp (warp_reduce.h), each total into its slot of this warp's row.
template <int kMaxCand, int kBase, int kN, int kPairs>
__device__ __forceinline__ void gram_warp_sums(const float (&x)[kMaxCand][8], bool active, int K, int lane,
                                               float (&row)[kPairs]) {
  float part[kN];
  gram_partials<kMaxCand, kBase, kN>(x, active, K, part);
  const float total = warp_sum_transposed<kN>(part, lane);
  const int index = butterfly_index<kN>(lane);
  if (index < kN) row[kBase + index] = total;
}

template <typename IO, typename NW, typename PW, int CS, int MB, bool kFused, bool kGram = false>
__global__ void __launch_bounds__(kClusterMaxThreads, (kMinCtasPerSm<NW, PW, MB, kFused>))
    attn_res_cluster_kernel(ClusterFwdArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // clusters need sm_90; the launch policy never picks this kernel below it (an sm_80 build still links)
#else
  constexpr int kMaxCand = MB + 1;  // the prefix is candidate K, held in slot kMaxCand - 1
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t t = blockIdx.x / CS;
  const int vecs = static_cast<int>(a.H / 8 / CS);  // 8-element vectors per CTA
  const int v = threadIdx.x;
  const bool active = v < vecs;
  const int64_t col = (static_cast<int64_t>(rank) * vecs + v) * 8;
  const int K = static_cast<int>(a.K);
  const int warps = (blockDim.x + 31) / 32, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ float warp_part[32][2 * kMaxCand];
  __shared__ float inbox[CS][2 * kMaxCand];  // rank r's (ss_i, d_i) in row r, stored by rank r
  __shared__ float shared_score[kMaxCand];
  __shared__ float warp_norm[32];
  __shared__ float norm_inbox[CS];  // rank r's sum of squares of the output-norm input
  __shared__ float amax_inbox[CS];  // rank r's max |output| for the FP8 scale
  // kGram: the candidate pairs' products (gram_partials' order), per warp, per rank, summed; the statistics' ss.
  constexpr int kPairs = kGram ? kMaxCand * (kMaxCand - 1) / 2 : 1;
  __shared__ float warp_gram[kGram ? 32 : 1][kPairs];
  __shared__ float gram_inbox[kGram ? CS : 1][kPairs];
  __shared__ float shared_gram[kPairs];
  __shared__ float shared_ss[kGram ? kMaxCand : 1];

  cluster_arrive_relaxed();  // "this CTA runs": waited for before the first remote store
  cudaGridDependencySynchronize();
  cudaTriggerProgrammaticLaunchCompletion();
  float x[kMaxCand][8];
  float w[8];
  float g[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // the output norm's weight (fused, with the norm)
  if (active) {
    // Every load in flight before any is used (attn_res_vec.h, fetch8): the weights, the K block rows, the prefix,
    // the addend and the output norm's weight (held converted across the exchange: 8 registers), then the
    // conversions.
    const Raw8<NW> raw_nw = fetch8(static_cast<const NW*>(a.norm_weight) + col);
    const Raw8<PW> raw_pw = fetch8(static_cast<const PW*>(a.proj_weight) + col);
    const IO* blocks = static_cast<const IO*>(a.blocks) + t * a.stride_bt + col;
    Raw8<IO> raw[kMaxCand];
#pragma unroll
    for (int i = 0; i < kMaxCand - 1; ++i) {
      if (i < K) raw[i] = fetch8(blocks + i * a.stride_bc);  // slots >= K are never addressed
    }
    raw[kMaxCand - 1] = fetch8(static_cast<const IO*>(a.prefix) + t * a.stride_pt + col);
    Raw8<IO> raw_add = {};
    const bool has_addend = kFused && a.addend != nullptr;
    if (has_addend) raw_add = fetch8(static_cast<const IO*>(a.addend) + t * a.stride_at + col);
    Raw8Any raw_g = {};
    const bool has_norm = kFused && a.out_norm_weight != nullptr;
    if (has_norm) raw_g = fetch8_any(a.out_norm_weight, a.onw_dtype, col);
    float nw[8], pw[8];
    unpack8(raw_nw, nw);
    unpack8(raw_pw, pw);
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = nw[j] * pw[j];
#pragma unroll
    for (int i = 0; i < kMaxCand - 1; ++i) {
      if (i < K) unpack8(raw[i], x[i]);
    }
    float (&v)[8] = x[kMaxCand - 1];
    unpack8(raw[kMaxCand - 1], v);
    if (has_addend) {
      // round(prefix + addend): one FP32 add, one rounding to the io dtype, as torch's add (and the Triton kernels).
      float add[8];
      unpack8(raw_add, add);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = to_float(from_float<IO>(v[j] + add[j]));
    }
    if (has_norm) unpack8_any(raw_g, a.onw_dtype, g);
    // The new prefix: each thread stores exactly the columns it has read, so the in-place store cannot race a
    // read of another thread or CTA.
    if constexpr (kFused) {
      if (a.new_prefix != nullptr) store8(static_cast<IO*>(a.new_prefix) + t * a.H + col, x[kMaxCand - 1]);
      if (a.inplace_prefix && a.addend != nullptr) {
        store8(const_cast<IO*>(static_cast<const IO*>(a.prefix)) + t * a.stride_pt + col, x[kMaxCand - 1]);
      }
      if (a.write_idx >= 0) {
        store8(static_cast<IO*>(a.blocks) + t * a.stride_bt + a.write_idx * a.stride_bc + col, x[kMaxCand - 1]);
      }
    }
  }
  // This thread's (ss_i, d_i), then their warp sums (warp_reduce.h: 2 (MB + 1) values in 20 shuffles at MB = 8,
  // not 90; 15 at MB = 6, 12 at MB = 4, 8 at MB = 2; the kernel is bound by its instructions' latency, one warp per
  // scheduler, and shuffles are its second stall). Lane l holds the total of value butterfly_index(l), the plain
  // butterfly's bits.
  float part[2 * kMaxCand];
#pragma unroll
  for (int i = 0; i < kMaxCand; ++i) {
    float s = 0.f, dd = 0.f;
    if (active && (i < K || i == kMaxCand - 1)) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s = fmaf(x[i][j], x[i][j], s);
        dd = fmaf(x[i][j], w[j], dd);
      }
    }
    part[2 * i] = s;
    part[2 * i + 1] = dd;
  }
  const float warp_total = warp_sum_transposed<2 * kMaxCand>(part, lane);
  const int part_index = butterfly_index<2 * kMaxCand>(lane);
  if (part_index < 2 * kMaxCand) warp_part[warp][part_index] = warp_total;
  if constexpr (kGram) {
    // The pairs in at most two warp sums of at most 32 values (36 pairs at MB = 8), after the statistics' (whose
    // partials are dead by now: fewer registers live beside the candidates).
    constexpr int kFirst = kPairs > 32 ? kPairs / 2 : kPairs;
    gram_warp_sums<kMaxCand, 0, kFirst, kPairs>(x, active, K, lane, warp_gram[warp]);
    if constexpr (kPairs > kFirst) {
      gram_warp_sums<kMaxCand, kFirst, kPairs - kFirst, kPairs>(x, active, K, lane, warp_gram[warp]);
    }
  }
  __syncthreads();
  float mine = 0.f;
  if (threadIdx.x < 2 * kMaxCand) {
    for (int q = 0; q < warps; ++q) mine += warp_part[q][threadIdx.x];
  }
  cluster_wait_acquire();  // every CTA of the cluster runs: its shared memory may be written
  if (threadIdx.x < 2 * kMaxCand) {
#pragma unroll
    for (int r = 0; r < CS; ++r) cluster.map_shared_rank(&inbox[rank][0], r)[threadIdx.x] = mine;
  }
  if constexpr (kGram) {
    for (int q = static_cast<int>(threadIdx.x); q < kPairs; q += static_cast<int>(blockDim.x)) {
      float g2 = 0.f;
      for (int w2 = 0; w2 < warps; ++w2) g2 += warp_gram[w2][q];
#pragma unroll
      for (int r = 0; r < CS; ++r) cluster.map_shared_rank(&gram_inbox[rank][0], r)[q] = g2;
    }
  }
  cluster_arrive_release();
  cluster_wait_acquire();  // every rank's partials are in this CTA's inbox
  // Scores (the prefix is candidate K, kept in slot kMaxCand - 1), one per thread of the first kMaxCand, shared:
  // formed in every thread, they were 9 correctly rounded sqrt-and-reciprocal sequences in series per thread.
  if (threadIdx.x < kMaxCand) {
    const int i = static_cast<int>(threadIdx.x);
    float s = 0.f, dd = 0.f;
#pragma unroll
    for (int r = 0; r < CS; ++r) {
      s += inbox[r][2 * i];
      dd += inbox[r][2 * i + 1];
    }
    const float inv_h = 1.0f / static_cast<float>(a.H);
    const bool valid = i < K || i == kMaxCand - 1;
    shared_score[i] = valid ? __fdiv_rn(1.0f, __fsqrt_rn(s * inv_h + static_cast<float>(a.eps))) * dd : -INFINITY;
    if constexpr (kGram) shared_ss[i] = valid ? s : 0.f;
  }
  if constexpr (kGram) {
    for (int q = static_cast<int>(threadIdx.x); q < kPairs; q += static_cast<int>(blockDim.x)) {
      float g2 = 0.f;
#pragma unroll
      for (int r = 0; r < CS; ++r) g2 += gram_inbox[r][q];
      shared_gram[q] = g2;
    }
  }
  __syncthreads();
  // Softmax and mix of this CTA's columns.
  float score[kMaxCand];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kMaxCand; ++i) {
    score[i] = shared_score[i];
    m = fmaxf(m, score[i]);
  }
  float l = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float weight[kMaxCand];  // p_i (kGram: the norm's sum of squares below); 0 for absent candidates
#pragma unroll
  for (int i = 0; i < kMaxCand; ++i) {
    weight[i] = 0.f;
    if (i < K || i == kMaxCand - 1) {
      const float p = __expf(score[i] - m);
      weight[i] = p;
      l += p;
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = fmaf(p, x[i][j], acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = acc[j] / l;
  if (kFused && a.out_norm_weight != nullptr) {
    // kGram: |mix|^2 from the exchanged pairs, and whether it is accurate: each pair's FP32 sum carries an error of
    // a few ulp of |v_i| |v_j|, so A's is a few ulp of B^2 = (sum_i p_i |v_i|)^2; below gram_tau B^2 (candidates
    // that cancel), or NaN, the second exchange below. Every thread of every rank computes the same A and B.
    bool gram_ok = false;
    float gram_ss = 0.f;
    if constexpr (kGram) {
      float A = 0.f, B = 0.f;
      int q = 0;
#pragma unroll
      for (int i = 0; i < kMaxCand; ++i) {
        A = fmaf(weight[i] * weight[i], shared_ss[i], A);
        B = fmaf(weight[i], sqrtf(shared_ss[i]), B);
#pragma unroll
        for (int j = i + 1; j < kMaxCand; ++j, ++q) A = fmaf(2.f * weight[i] * weight[j], shared_gram[q], A);
      }
      gram_ok = A >= a.gram_tau * (B * B);
      gram_ss = A / (l * l);
    }
    // y: the mix as the norm sees it (rounded to the io dtype, or the FP32 mix); 0 in inactive threads.
    float ss = gram_ss;
    if (!gram_ok) {
      float sq = 0.f;
      if (active) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (a.norm_rounded_mix) acc[j] = to_float(from_float<IO>(acc[j]));
          sq = fmaf(acc[j], acc[j], sq);
        }
      }
      sq = cta_sum(sq, warp_norm, warps, lane, warp);
      if (threadIdx.x < CS) *cluster.map_shared_rank(&norm_inbox[rank], static_cast<int>(threadIdx.x)) = sq;
      cluster_arrive_release();
      cluster_wait_acquire();  // every rank's sum of squares is in this CTA's inbox
      ss = 0.f;
#pragma unroll
      for (int r = 0; r < CS; ++r) ss += norm_inbox[r];
    } else if (a.norm_rounded_mix) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = to_float(from_float<IO>(acc[j]));
    }
    // torch's rms_norm order, (y * rsqrt(mean(y^2) + eps)) * weight; the rsqrt correctly rounded (as _norm_scale).
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fdiv_rn(ss, static_cast<float>(a.H)) +
                                                   static_cast<float>(a.out_eps)));
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = acc[j] * scale * g[j];
  }
  if (kFused && a.fp8 != Fp8Kind::kNone) {
    // The output as the model dtype holds it, its per-token scale (one more exchange: the max), the e4m3 bytes.
    float amax = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      acc[j] = to_float(from_float<IO>(acc[j]));
      amax = fmaxf(amax, fabsf(acc[j]));
    }
    amax = cta_max(active ? amax : 0.f, warp_norm, warps, lane, warp);
    if (threadIdx.x < CS) *cluster.map_shared_rank(&amax_inbox[rank], static_cast<int>(threadIdx.x)) = amax;
    cluster_arrive_release();
    cluster_wait_acquire();  // every rank's max is in this CTA's inbox
    for (int r = 0; r < CS; ++r) amax = fmaxf(amax, amax_inbox[r]);
    const float fp8_max = static_cast<float>(a.fp8_max);
    const float scale = __fdiv_rn(fmaxf(amax, 1e-10f), fp8_max);
    if (active) {
      uint32_t word[2] = {0u, 0u};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float q = __fdiv_rn(acc[j], scale);
        if (q == q) q = fminf(fmaxf(q, -fp8_max), fp8_max);
        word[j / 4] |= e4m3_bits(q, a.fp8 == Fp8Kind::kE4M3Fnuz) << (8 * (j % 4));
      }
      *reinterpret_cast<uint2*>(static_cast<uint8_t*>(a.out) + t * a.H + col) = make_uint2(word[0], word[1]);
    }
    if (rank == 0 && threadIdx.x == 0) a.scale[t] = scale;
  } else if (active) {
    store8(static_cast<IO*>(a.out) + t * a.H + col, acc);
  }
  // No barrier at exit: every remote store into this CTA's inboxes was released before an arrive it has waited for.
#endif
}

using ClusterKernel = void (*)(ClusterFwdArgs);

// The variant for a call: the fewest block rows that hold its K.
template <typename IO, typename NW, typename PW, int CS, bool kFused, bool kGram>
ClusterKernel pick_kernel(int64_t K) {
  if (K <= 2) return attn_res_cluster_kernel<IO, NW, PW, CS, 2, kFused, kGram>;
  if (K <= 4) return attn_res_cluster_kernel<IO, NW, PW, CS, 4, kFused, kGram>;
  if (K <= 6) return attn_res_cluster_kernel<IO, NW, PW, CS, 6, kFused, kGram>;
  static_assert(kClusterMaxBlocks == 8, "pick_kernel's last variant is kClusterMaxBlocks");
  return attn_res_cluster_kernel<IO, NW, PW, CS, kClusterMaxBlocks, kFused, kGram>;
}

template <typename IO, typename NW, typename PW, int CS>
cudaError_t launch(const ClusterFwdArgs& args, int threads, bool pdl, cudaStream_t stream) {
  // The plain op's calls take the instantiation without the fused code (a call with in-place prefix but no addend
  // changes nothing, and may take either: how the two are timed side by side).
  const bool fused = args.addend != nullptr || args.new_prefix != nullptr || args.inplace_prefix ||
                     args.write_idx >= 0 || args.out_norm_weight != nullptr || args.fp8 != Fp8Kind::kNone;
  // kGram only with the output norm (it is the norm's sum of squares); its own instantiation, so that the variant
  // without it compiles as it was timed.
  const bool gram = args.norm_gram && args.out_norm_weight != nullptr;
  const ClusterKernel kernel = !fused ? pick_kernel<IO, NW, PW, CS, false, false>(args.K)
                               : gram ? pick_kernel<IO, NW, PW, CS, true, true>(args.K)
                                      : pick_kernel<IO, NW, PW, CS, true, false>(args.K);
  return KernelLaunch(dim3(static_cast<unsigned>(args.T * CS)), dim3(static_cast<unsigned>(threads)), 0, stream)
      .cluster(CS)
      .pdl(pdl)
      .launch(kernel, args);
}

// The call's weight dtypes, for the cluster size of the translation unit that includes this header.
template <typename IO, typename NW, int CS>
cudaError_t by_pw(const ClusterFwdArgs& args, int threads, bool pdl, cudaStream_t stream) {
  switch (args.pw_dtype) {
    case IoDtype::kFloat32: return launch<IO, NW, float, CS>(args, threads, pdl, stream);
    case IoDtype::kBFloat16: return launch<IO, NW, __nv_bfloat16, CS>(args, threads, pdl, stream);
    default: return launch<IO, NW, __half, CS>(args, threads, pdl, stream);
  }
}

template <typename IO, int CS>
cudaError_t by_nw(const ClusterFwdArgs& args, int threads, bool pdl, cudaStream_t stream) {
  switch (args.nw_dtype) {
    case IoDtype::kFloat32: return by_pw<IO, float, CS>(args, threads, pdl, stream);
    case IoDtype::kBFloat16: return by_pw<IO, __nv_bfloat16, CS>(args, threads, pdl, stream);
    default: return by_pw<IO, __half, CS>(args, threads, pdl, stream);
  }
}

template <int CS>
cudaError_t launch_for_cluster_size(const ClusterFwdArgs& args, int threads, bool pdl, cudaStream_t stream) {
  if (args.io_dtype == IoDtype::kBFloat16) return by_nw<__nv_bfloat16, CS>(args, threads, pdl, stream);
  return by_nw<__half, CS>(args, threads, pdl, stream);
}

}  // namespace
}  // namespace k3_ops::cuda
