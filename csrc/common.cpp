// Status strings, the per-thread error message and argument checks shared by CPU and CUDA.
#include <algorithm>

#include "common.h"

namespace vllm_ext {

namespace {
thread_local std::string last_error_message;
}

int fail(int status, const std::string& message) {
  last_error_message = message;
  return status;
}

int check_copy_args(const vllm_ext_side* src, const vllm_ext_side* dst, int64_t num_ids,
                    int32_t num_layers, int32_t num_components, int64_t slice_nbytes, int64_t num_rows,
                    const char* src_name, const char* dst_name) {
  if (src == nullptr || dst == nullptr) return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "src/dst is NULL");
  if (num_ids < 0 || num_layers < 0 || num_components < 1 || num_components > 2 || slice_nbytes < 0)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT,
                "negative count, or num_components not 1 or 2 (num_ids=" + std::to_string(num_ids) +
                    ", num_layers=" + std::to_string(num_layers) +
                    ", num_components=" + std::to_string(num_components) +
                    ", slice_nbytes=" + std::to_string(slice_nbytes) + ")");
  for (const vllm_ext_side* side : {src, dst}) {
    if (side->layer_ptrs == nullptr && side->base == 0 && num_ids > 0 && num_layers > 0)
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "a side has neither layer_ptrs nor base");
    if (side->num_blocks < 0 || side->block_stride < 0 || side->component_stride < 0)
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "a side has a negative stride or block count");
  }
  if (num_rows < 1 || slice_nbytes % num_rows != 0)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "num_rows " + std::to_string(num_rows) +
                                                   " is not a positive divisor of slice_nbytes " +
                                                   std::to_string(slice_nbytes));
  const int64_t row_nbytes = slice_nbytes / num_rows;
  for (const vllm_ext_side* side : {src, dst}) {
    const char* name = side == src ? src_name : dst_name;
    if (side->slice_offset < 0)
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT,
                  std::string(name) + " slice_offset " + std::to_string(side->slice_offset) + " is negative");
    // Rows of one slice must not share bytes: a copy into them would be undefined.
    if (num_rows > 1 && side->row_stride != 0 && side->row_stride < row_nbytes)
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, std::string(name) + " row_stride " +
                                                     std::to_string(side->row_stride) + " is below a row's " +
                                                     std::to_string(row_nbytes) + " bytes (num_rows " +
                                                     std::to_string(num_rows) + ")");
    // The bytes that move of a slice stay inside the side's block (vllm_ext.h: nothing outside the
    // described blocks is read or written): slice_offset + (num_rows - 1) * row_stride + a row's
    // bytes <= block_stride, computed without overflow. Checked whenever bytes can move.
    if (num_layers == 0 || slice_nbytes == 0) continue;
    const int64_t stride = row_stride(*side, row_nbytes);
    bool inside = side->slice_offset <= side->block_stride && row_nbytes <= side->block_stride - side->slice_offset;
    if (inside && num_rows > 1)
      inside = stride <= (side->block_stride - side->slice_offset - row_nbytes) / (num_rows - 1);
    if (!inside)
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT,
                  std::string(name) + " slice_offset " + std::to_string(side->slice_offset) + " + (num_rows " +
                      std::to_string(num_rows) + " - 1) * row_stride " + std::to_string(stride) + " + row " +
                      std::to_string(row_nbytes) + " bytes passes the block's " +
                      std::to_string(side->block_stride) + " bytes (block_stride)");
  }
  return VLLM_EXT_OK;
}

int check_digest_args(const vllm_ext_side* cache, const int64_t* ids, int64_t num_ids, int32_t num_layers,
                      int32_t num_components, int64_t slice_nbytes, int64_t num_rows) {
  int status = check_copy_args(cache, cache, num_ids, num_layers, num_components, slice_nbytes, num_rows, "cache",
                               "cache");
  if (status != VLLM_EXT_OK) return status;
  if (cache->block_ids != nullptr)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "block digests: cache->block_ids must be NULL (ids go in `ids`)");
  if (slice_nbytes % 4 != 0)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "block digests: slice_nbytes " + std::to_string(slice_nbytes) +
                                                   " is not a multiple of 4 (the digest reads 32-bit words)");
  if ((slice_nbytes / num_rows) % 4 != 0)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "block digests: rows of " + std::to_string(slice_nbytes / num_rows) +
                                                   " bytes are not whole 32-bit words");
  if (num_ids > 0 && ids == nullptr) return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "block digests: ids is NULL");
  for (int64_t i = 0; i < num_ids; ++i)
    if (ids[i] < 0 || ids[i] >= cache->num_blocks)
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "block digests: id " + std::to_string(ids[i]) +
                                                     " out of range for a cache of " +
                                                     std::to_string(cache->num_blocks) + " blocks");
  return VLLM_EXT_OK;
}

}  // namespace vllm_ext

extern "C" {

const char* vllm_ext_status_string(int status) {
  switch (status) {
    case VLLM_EXT_OK: return "success";
    case VLLM_EXT_ERR_INVALID_ARGUMENT: return "invalid argument";
    case VLLM_EXT_ERR_NO_CUDA: return "library built without CUDA";
    case VLLM_EXT_ERR_CUDA: return "CUDA error";
    case VLLM_EXT_ERR_NO_KERNEL_IMAGE: return "no kernel image for this GPU";
    case VLLM_EXT_ERR_TRANSFER: return "transfer function failed";
    default: return "unknown status";
  }
}

const char* vllm_ext_last_error(void) { return vllm_ext::last_error_message.c_str(); }

int32_t vllm_ext_abi_version(void) { return VLLM_EXT_ABI_VERSION; }

int64_t vllm_ext_ramp_bounds(int64_t n, int64_t slot_blocks, int64_t* bounds, int64_t capacity) {
  if (n < 0 || slot_blocks < 1) return -1;
  int64_t chunks = 0;
  for (int64_t lo = 0, size = 1; lo < n; size = size > slot_blocks / 2 ? slot_blocks : size * 2) {
    lo += std::min(size, n - lo);
    ++chunks;
  }
  if (bounds != nullptr && capacity >= chunks + 1) {
    bounds[0] = 0;
    for (int64_t c = 0, size = 1; c < chunks; ++c, size = size > slot_blocks / 2 ? slot_blocks : size * 2)
      bounds[c + 1] = std::min(bounds[c] + size, n);
  }
  return chunks;
}

}  // extern "C"
