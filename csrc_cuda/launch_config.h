// The launch configuration of k3_ops's CUDA C++ kernels and of the probes in tools/ that build beside them:
// cudaLaunchKernelEx's config with the two attributes they use, a thread-block cluster along x and programmatic
// dependent launch (PDL). Host code only; plain CUDA runtime types.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace k3_ops::cuda {

// config.attrs points into this object, so it is neither copied nor moved: build it where it launches.
class LaunchConfig {
 public:
  LaunchConfig(dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream) {
    config_.gridDim = grid;
    config_.blockDim = block;
    config_.dynamicSmemBytes = dynamic_smem;
    config_.stream = stream;
    config_.attrs = attrs_;
  }
  LaunchConfig(const LaunchConfig&) = delete;
  LaunchConfig& operator=(const LaunchConfig&) = delete;

  // Clusters of `size` CTAs along x (the grid's x a multiple of it).
  LaunchConfig& cluster(unsigned size) {
    cudaLaunchAttribute& a = attrs_[config_.numAttrs++];
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = size;
    a.val.clusterDim.y = 1;
    a.val.clusterDim.z = 1;
    return *this;
  }
  // Programmatic stream serialization: with `allowed`, the kernel may start before its predecessor in the stream
  // has finished, and waits for it with griddepcontrol.wait (cudaGridDependencySynchronize) before reading its data.
  LaunchConfig& pdl(bool allowed) {
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
