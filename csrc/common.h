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

// Checks the arguments both implementations share (num_rows: see vllm_ext_side); returns
// VLLM_EXT_OK or a failure. Errors name the sides src_name and dst_name.
int check_copy_args(const vllm_ext_side* src, const vllm_ext_side* dst, int64_t num_ids,
                    int32_t num_layers, int32_t num_components, int64_t slice_nbytes, int64_t num_rows,
                    const char* src_name = "src", const char* dst_name = "dst");

// Checks the arguments both digest implementations share (ids [host], every one in range).
int check_digest_args(const vllm_ext_side* cache, const int64_t* ids, int64_t num_ids, int32_t num_layers,
                      int32_t num_components, int64_t slice_nbytes, int64_t num_rows);

// The digest's weight of word p of a block row (vllm_ext.h) is digest_raw(p) | 1; the raw
// value grows by VLLM_EXT_DIGEST_STEP from word to word, so loops walk it with additions.
VLLM_EXT_HOST_DEVICE inline uint64_t digest_raw(uint64_t p) { return p * VLLM_EXT_DIGEST_STEP + VLLM_EXT_DIGEST_SEED; }

// Base address of `layer` on one side: its table entry, or base + layer * layer_stride.
VLLM_EXT_HOST_DEVICE inline uint64_t layer_base(const vllm_ext_side& side, int32_t layer) {
  return side.layer_ptrs != nullptr ? side.layer_ptrs[layer]
                                    : side.base + static_cast<uint64_t>(layer * side.layer_stride);
}

// Address of the first byte that moves of slice (layer, component) of `block` on one side (the
// block id already resolved): the slice's start plus the side's slice_offset.
VLLM_EXT_HOST_DEVICE inline uint64_t slice_address(const vllm_ext_side& side, uint64_t layer_base, int64_t block,
                              int32_t component) {
  return layer_base + static_cast<uint64_t>(block * side.block_stride +
                                            component * side.component_stride + side.slice_offset);
}

// Bytes between the rows of a slice on one side, for rows of row_nbytes (0 = adjacent).
VLLM_EXT_HOST_DEVICE inline int64_t row_stride(const vllm_ext_side& side, int64_t row_nbytes) {
  return side.row_stride != 0 ? side.row_stride : row_nbytes;
}

}  // namespace vllm_ext
