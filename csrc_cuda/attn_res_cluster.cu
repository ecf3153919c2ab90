// The thread-block-cluster forward's entry (the kernel: attn_res_cluster_kernel.h): the threads per CTA for a call,
// and the launch through the translation unit of its cluster size.
#include "attn_res_cluster.h"

namespace k3_ops::cuda {

int cluster_fwd_threads(int64_t K, int64_t H, IoDtype io_dtype, int cluster_size) {
  if (cluster_size == 1) return stream_fwd_threads(K, H, io_dtype);
  if (io_dtype == IoDtype::kFloat32 || K < 1 || K > kClusterMaxBlocks) return 0;
  if (cluster_size != 2 && cluster_size != 4 && cluster_size != 8) return 0;
  if (H % (8 * cluster_size) != 0) return 0;
  const int64_t vecs = H / 8 / cluster_size;
  const int64_t threads = (vecs + 31) / 32 * 32;
  return threads <= kClusterMaxThreads ? static_cast<int>(threads) : 0;
}

cudaError_t launch_cluster_fwd(const ClusterFwdArgs& args, int cluster_size, bool pdl, cudaStream_t stream) {
  if (cluster_size == 1) return launch_stream_fwd(args, pdl, stream);
  const int threads = cluster_fwd_threads(args.K, args.H, args.io_dtype, cluster_size);
  if (threads == 0) return cudaErrorInvalidValue;
  switch (cluster_size) {
    case 2: return launch_cluster_fwd_cs2(args, threads, pdl, stream);
    case 4: return launch_cluster_fwd_cs4(args, threads, pdl, stream);
    default: return launch_cluster_fwd_cs8(args, threads, pdl, stream);
  }
}

}  // namespace k3_ops::cuda
