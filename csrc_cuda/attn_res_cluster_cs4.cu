// The cluster forward's variants with 4 CTAs per token (attn_res_cluster_kernel.h): a translation unit of their
// own, so that the build compiles the three cluster sizes' variants in parallel.
#include "attn_res_cluster_kernel.h"

namespace k3_ops::cuda {

cudaError_t launch_cluster_fwd_cs4(const ClusterFwdArgs& args, int threads, bool pdl, cudaStream_t stream) {
  return launch_for_cluster_size<4>(args, threads, pdl, stream);
}

}  // namespace k3_ops::cuda
