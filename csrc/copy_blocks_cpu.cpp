// CPU twin of the block copy: the same (block, layer, component) walk with memcpy, so CI
// without a GPU tests compiled code and GPU tests have a reference to compare bytes with.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "common.h"

namespace {

using vllm_ext::slice_address;
using vllm_ext::layer_base;
using vllm_ext::row_stride;

// Copies the chunks with flat index in [begin, end); flat index = (i * L + l) * C + c, the
// wire order, so each thread writes a contiguous range of a buffer side. A chunk is num_rows
// rows of slice_nbytes / num_rows bytes (one row: the whole slice).
void copy_range(const vllm_ext_side& src, const vllm_ext_side& dst, int32_t num_layers,
                int32_t num_components, int64_t slice_nbytes, int64_t num_rows, int64_t begin, int64_t end) {
  const int64_t row_nbytes = slice_nbytes / num_rows;
  const int64_t src_pitch = row_stride(src, row_nbytes), dst_pitch = row_stride(dst, row_nbytes);
  for (int64_t chunk = begin; chunk < end; ++chunk) {
    const int32_t c = static_cast<int32_t>(chunk % num_components);
    const int32_t l = static_cast<int32_t>((chunk / num_components) % num_layers);
    const int64_t i = chunk / (static_cast<int64_t>(num_components) * num_layers);
    const int64_t s = src.block_ids ? src.block_ids[i] : i;
    const int64_t d = dst.block_ids ? dst.block_ids[i] : i;
    if (s < 0 || s >= src.num_blocks || d < 0 || d >= dst.num_blocks) continue;
    const uint64_t from = slice_address(src, layer_base(src, l), s, c);
    const uint64_t to = slice_address(dst, layer_base(dst, l), d, c);
    for (int64_t r = 0; r < num_rows; ++r)
      std::memcpy(reinterpret_cast<void*>(to + static_cast<uint64_t>(r * dst_pitch)),
                  reinterpret_cast<const void*>(from + static_cast<uint64_t>(r * src_pitch)),
                  static_cast<size_t>(row_nbytes));
  }
}

}  // namespace

extern "C" int vllm_ext_copy_blocks_cpu(const vllm_ext_side* src, const vllm_ext_side* dst,
                                        int64_t num_ids, int32_t num_layers,
                                        int32_t num_components, int64_t slice_nbytes,
                                        int64_t num_rows, int32_t num_threads) {
  int status = vllm_ext::check_copy_args(src, dst, num_ids, num_layers, num_components, slice_nbytes, num_rows);
  if (status != VLLM_EXT_OK) return status;
  const int64_t num_chunks = num_ids * num_layers * num_components;
  if (num_chunks == 0 || slice_nbytes == 0) return VLLM_EXT_OK;
  // NOTE: threads only pay off past a few MiB; below that one thread is faster.
  constexpr int64_t kBytesPerThread = int64_t{4} << 20;
  const int64_t by_size = std::max<int64_t>(1, num_chunks * slice_nbytes / kBytesPerThread);
  const int64_t threads = std::min<int64_t>({std::max(1, num_threads), by_size, num_chunks});
  if (threads == 1) {
    copy_range(*src, *dst, num_layers, num_components, slice_nbytes, num_rows, 0, num_chunks);
    return VLLM_EXT_OK;
  }
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(threads));
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t begin = num_chunks * t / threads, end = num_chunks * (t + 1) / threads;
    workers.emplace_back(copy_range, std::cref(*src), std::cref(*dst), num_layers, num_components,
                         slice_nbytes, num_rows, begin, end);
  }
  for (auto& w : workers) w.join();
  return VLLM_EXT_OK;
}
