// Internal helpers shared by the CPU and CUDA halves of the library (not part of the ABI).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "vllm_ext.h"

#ifdef __CUDACC__
#define VLLM_EXT_HOST_DEVICE __host__ __device__
#else
#define VLLM_EXT_HOST_DEVICE
#endif

namespace vllm_ext {

// Records the calling thread's detailed error message and returns `status`.
int fail(int status, const std::string& message);

// Checks the arguments both implementations share; returns VLLM_EXT_OK or a failure.
int check_copy_args(const vllm_ext_side* src, const vllm_ext_side* dst, int64_t num_ids,
                    int32_t num_layers, int32_t num_components, int64_t slice_nbytes);

// Base address of `layer` on one side: its table entry, or base + layer * layer_stride.
VLLM_EXT_HOST_DEVICE inline uint64_t layer_base(const vllm_ext_side& side, int32_t layer) {
  return side.layer_ptrs != nullptr ? side.layer_ptrs[layer]
                                    : side.base + static_cast<uint64_t>(layer * side.layer_stride);
}

// Address of slice (layer, component) of `block` on one side (the block id already resolved).
VLLM_EXT_HOST_DEVICE inline uint64_t slice_address(const vllm_ext_side& side, uint64_t layer_base, int64_t block,
                              int32_t component) {
  return layer_base + static_cast<uint64_t>(block * side.block_stride +
                                            component * side.component_stride);
}

}  // namespace vllm_ext
