// CPU twin of the block digests (vllm_ext.h): the same weighted sum of a block row's 32-bit
// words, so CI without a GPU tests compiled code and GPU tests have a reference to compare with.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "common.h"

namespace {

using vllm_ext::digest_raw;
using vllm_ext::layer_base;
using vllm_ext::slice_address;

// Adds the terms of the slices with flat index in [begin, end) (flat = i * L * C + l * C + c)
// to sums[i]; slice k = l * C + c of a block starts at word k * words of its row, and its
// num_rows rows follow each other there (whatever their stride in the cache).
void digest_range(const vllm_ext_side& cache, const int64_t* ids, int32_t num_layers, int32_t num_components,
                  int64_t slice_nbytes, int64_t num_rows, int64_t begin, int64_t end, uint64_t* sums) {
  const int64_t words = slice_nbytes / 4, row_words = words / num_rows;
  const int64_t pitch = vllm_ext::row_stride(cache, slice_nbytes / num_rows);
  const int64_t per_block = int64_t{num_layers} * num_components;
  for (int64_t flat = begin; flat < end; ++flat) {
    const int64_t i = flat / per_block, k = flat % per_block;
    const int32_t l = static_cast<int32_t>(k / num_components), c = static_cast<int32_t>(k % num_components);
    const auto* slice = reinterpret_cast<const unsigned char*>(slice_address(cache, layer_base(cache, l), ids[i], c));
    uint64_t raw = digest_raw(static_cast<uint64_t>(k * words)), sum = 0;
    for (int64_t r = 0; r < num_rows; ++r) {
      const unsigned char* bytes = slice + r * pitch;
      for (int64_t j = 0; j < row_words; ++j, raw += VLLM_EXT_DIGEST_STEP) {
        uint32_t x;
        std::memcpy(&x, bytes + 4 * j, 4);  // little-endian hosts only (every one torch supports)
        sum += uint64_t{x} * (raw | 1u);
      }
    }
    sums[i] += sum;
  }
}

}  // namespace

extern "C" int vllm_ext_block_digests_cpu(const vllm_ext_side* cache, const int64_t* ids, int64_t num_ids,
                                          int32_t num_layers, int32_t num_components, int64_t slice_nbytes,
                                          int64_t num_rows, uint64_t* out, int32_t num_threads) {
  int status = vllm_ext::check_digest_args(cache, ids, num_ids, num_layers, num_components, slice_nbytes, num_rows);
  if (status != VLLM_EXT_OK) return status;
  if (num_ids > 0 && out == nullptr) return vllm_ext::fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "block digests: out is NULL");
  std::fill(out, out + num_ids, uint64_t{0});
  const int64_t num_slices = num_ids * num_layers * num_components;
  if (num_slices == 0 || slice_nbytes == 0) return VLLM_EXT_OK;
  constexpr int64_t kBytesPerThread = int64_t{4} << 20;  // as for the copy: threads pay off past a few MiB
  const int64_t by_size = std::max<int64_t>(1, num_slices * slice_nbytes / kBytesPerThread);
  const int64_t threads = std::min<int64_t>({std::max(1, num_threads), by_size, num_slices});
  if (threads == 1) {
    digest_range(*cache, ids, num_layers, num_components, slice_nbytes, num_rows, 0, num_slices, out);
    return VLLM_EXT_OK;
  }
  // Each thread sums into its own row of partial digests; the rows add up after the join.
  std::vector<uint64_t> partial(static_cast<size_t>(threads * num_ids), 0);
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(threads));
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t begin = num_slices * t / threads, end = num_slices * (t + 1) / threads;
    workers.emplace_back(digest_range, std::cref(*cache), ids, num_layers, num_components, slice_nbytes, num_rows,
                         begin, end, partial.data() + t * num_ids);
  }
  for (auto& w : workers) w.join();
  for (int64_t t = 0; t < threads; ++t)
    for (int64_t i = 0; i < num_ids; ++i) out[i] += partial[static_cast<size_t>(t * num_ids + i)];
  return VLLM_EXT_OK;
}
