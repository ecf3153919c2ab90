// How k3_ops's CUDA C++ kernels are launched: cudaLaunchKernelEx with the two attributes they use, a thread-block
// cluster along x and programmatic dependent launch (PDL). Host code only; plain CUDA runtime types. (Not the
// launch table's k3_ops.backends.cuda_table.LaunchConfig, which picks the kernel and its plan.)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace k3_ops::cuda {

// config.attrs points into this object, so it is neither copied nor moved: build it where it launches.
class KernelLaunch {
 public:
  KernelLaunch(dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream) {
    config_.gridDim = grid;
    config_.blockDim = block;
    config_.dynamicSmemBytes = dynamic_smem;
    config_.stream = stream;
    config_.attrs = attrs_;
  }
  KernelLaunch(const KernelLaunch&) = delete;
  KernelLaunch& operator=(const KernelLaunch&) = delete;

  // Clusters of `size` CTAs along x (the grid's x a multiple of it).
  KernelLaunch& cluster(unsigned size) {
    cudaLaunchAttribute& a = attrs_[config_.numAttrs++];
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = size;
    a.val.clusterDim.y = 1;
    a.val.clusterDim.z = 1;
    return *this;
  }
  // Programmatic stream serialization: with `allowed`, the kernel may start before its predecessor in the stream
  // has finished, and waits for it with griddepcontrol.wait (cudaGridDependencySynchronize) before reading its data.
  KernelLaunch& pdl(bool allowed) {
    cudaLaunchAttribute& a = attrs_[config_.numAttrs++];
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = allowed ? 1 : 0;
    return *this;
  }

  const cudaLaunchConfig_t* get() const { return &config_; }

  template <typename... KernelParams, typename... Args>
  cudaError_t launch(void (*kernel)(KernelParams...), Args&&... args) const {
    return cudaLaunchKernelEx(&config_, kernel, static_cast<Args&&>(args)...);
  }

 private:
  cudaLaunchConfig_t config_ = {};
  cudaLaunchAttribute attrs_[2] = {};
};

}  // namespace k3_ops::cuda
