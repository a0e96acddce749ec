// CUDA half of the ABI: the one batched block-copy kernel, device checks, peer access and IPC.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "common.h"

#ifndef VLLM_EXT_CUDA_ARCHS
#define VLLM_EXT_CUDA_ARCHS "unknown"
#endif

namespace {

using vllm_ext::slice_address;
using vllm_ext::fail;
using vllm_ext::layer_base;

#ifndef VLLM_EXT_THREADS
#define VLLM_EXT_THREADS 256
#endif
constexpr int kThreads = VLLM_EXT_THREADS;
static_assert(kThreads % 32 == 0, "VLLM_EXT_THREADS: whole warps (the digest kernel's warp sums use every lane)");
// Vectors each thread keeps in flight per tile on the main path, and the CTAs per SM the
// register budget must allow (1 = no constraint); build-time knobs for tuning runs.
#ifndef VLLM_EXT_DEEP_UNROLL
#define VLLM_EXT_DEEP_UNROLL 8
#endif
#ifndef VLLM_EXT_MIN_CTAS_PER_SM
#define VLLM_EXT_MIN_CTAS_PER_SM 1
#endif
constexpr int kDeepUnroll = VLLM_EXT_DEEP_UNROLL;
constexpr int kMaxDevices = 64;

int cuda_fail(cudaError_t err, const char* what) {
  const int status = (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction)
                         ? VLLM_EXT_ERR_NO_KERNEL_IMAGE
                         : VLLM_EXT_ERR_CUDA;
  return fail(status, std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                          cudaGetErrorString(err) + ")");
}

#define VLLM_EXT_CUDA_TRY(call)                             \
  do {                                                      \
    const cudaError_t err_ = (call);                        \
    if (err_ != cudaSuccess) return cuda_fail(err_, #call); \
  } while (0)

// A driver function reached without linking libcuda; null where the driver lacks it.
void* driver_entry_point(const char* symbol) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult query;
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &query) != cudaSuccess ||
      query != cudaDriverEntryPointSuccess)
    return nullptr;
  return fn;
}

using GetCurrentContext = int (*)(void** context);

GetCurrentContext driver_get_current_context() {  // cuCtxGetCurrent, looked up once
  static const auto fn = reinterpret_cast<GetCurrentContext>(driver_entry_point("cuCtxGetCurrent"));
  return fn;
}

// Makes `device` current for the scope and restores the caller's device (torch keeps its own).
// NOTE: a thread with no context yet reports device 0; "restoring" that would create GPU 0's
// primary context (hundreds of MiB) in a process that may never use GPU 0, so then nothing
// is restored.
class DeviceGuard {
 public:
  // `bind`: call cudaSetDevice even when `device` is already the runtime's current one, so
  // that its context is current on this thread for driver calls.
  explicit DeviceGuard(int device, bool bind = false) {
    void* context = nullptr;
    GetCurrentContext current = driver_get_current_context();
    const bool had_context = current == nullptr || (current(&context) == 0 && context != nullptr);
    ok_ = cudaGetDevice(&previous_) == cudaSuccess;
    if (ok_ && (bind || previous_ != device || !had_context)) {
      ok_ = cudaSetDevice(device) == cudaSuccess;
      restore_ = ok_ && had_context && previous_ != device;
    }
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }
  bool ok() const { return ok_; }

 private:
  int previous_ = 0;
  bool ok_ = false;
  bool restore_ = false;
};

#ifndef VLLM_EXT_STREAMING_HINTS
#define VLLM_EXT_STREAMING_HINTS 1
#endif

// NOTE: a block copy touches each byte once; evict-first loads and stores (ld/st.global.cs)
// keep it from flushing the L2 lines the serving kernels around it are using.
template <typename T>
__device__ __forceinline__ T load_once(const T* p) {
#if VLLM_EXT_STREAMING_HINTS
  return __ldcs(p);
#else
  return *p;
#endif
}

template <typename T>
__device__ __forceinline__ void store_once(T* p, T v) {
#if VLLM_EXT_STREAMING_HINTS
  __stcs(p, v);
#else
  *p = v;
#endif
}

template <int kBytes> struct VecOf;
template <> struct VecOf<16> { using type = uint4; };
template <> struct VecOf<8> { using type = uint2; };
template <> struct VecOf<4> { using type = uint32_t; };
template <> struct VecOf<2> { using type = uint16_t; };
template <> struct VecOf<1> { using type = uint8_t; };

// grid: (min(tiles, resident CTAs)), block: (kThreads); a grid-stride loop over tiles.
// A tile is kThreads x kUnroll vectors of one slice; slice index = (i * L + l) * C + c, so the
// wire order of a buffer side is written front to back. Every thread issues its kUnroll loads
// before its first store to keep enough bytes in flight.
// NOTE: tiles interleave over CTAs (tile t on CTA t % grid), so all CTAs stream through
// neighbouring addresses at once; giving each CTA one contiguous range instead measured 4-5%
// slower at 64 MiB on an H200 (DRAM locality), despite a better balanced last wave.
// src/dst slices:
//   layer_base(l) + block_ids[i] * block_stride + c * component_stride, slice_vecs vectors.
// Where a launch finds block id i of each side.
struct SideIds {  // the sides' own block_ids: [device] arrays, or NULL for 0..n-1
  __device__ __forceinline__ int64_t src(const vllm_ext_side& side, int64_t i) const {
    return side.block_ids != nullptr ? side.block_ids[i] : i;
  }
  __device__ __forceinline__ int64_t dst(const vllm_ext_side& side, int64_t i) const {
    return side.block_ids != nullptr ? side.block_ids[i] : i;
  }
};

constexpr int kMaxInlineIds = VLLM_EXT_MAX_INLINE_IDS;
// Ids carried by the launch (a __grid_constant__ kernel parameter, read in place from the
// constant bank): no upload and no device buffer. 3.6 KB; with the other parameters 3.7 KB,
// under the 4 KB every driver takes (checked below).
struct InlineIds {
  int64_t first;  // a side without a list uses ids first, first + 1, ... (a buffer's rows)
  int32_t has_src, has_dst;
  int32_t src_ids[kMaxInlineIds];  // -1: skipped (out of range)
  int32_t dst_ids[kMaxInlineIds];
  __device__ __forceinline__ int64_t src(const vllm_ext_side&, int64_t i) const {
    return has_src ? src_ids[i] : first + i;
  }
  __device__ __forceinline__ int64_t dst(const vllm_ext_side&, int64_t i) const {
    return has_dst ? dst_ids[i] : first + i;
  }
};

// The copy kernel's parameters, in order (see copy_blocks_kernel).
constexpr size_t kInlineParamBytes = 2 * sizeof(vllm_ext_side) + 2 * sizeof(int32_t) + 4 * sizeof(int64_t) +
                                     sizeof(InlineIds);
static_assert(kInlineParamBytes <= 4096, "inline ids: kernel parameters over 4 KB (VLLM_EXT_MAX_INLINE_IDS)");
static_assert(sizeof(vllm_ext_staging) == 112, "vllm_ext_staging: the layout vllm_ext/_lib.py mirrors");
static_assert(sizeof(vllm_ext_side) == 72, "vllm_ext_side: the layout vllm_ext/_lib.py mirrors");

// Where vector v of a slice's moved bytes lies, in vectors from its first one: rows of
// row_vecs vectors, `pitch` vectors apart. kRows false (whole slices, or adjacent rows): v.
// The host keeps a slice under 2^32 vectors when kRows (a 32-bit division per access).
template <bool kRows>
__device__ __forceinline__ int64_t row_offset(int64_t v, uint32_t row_vecs, int64_t pitch) {
  if constexpr (!kRows) {
    return v;
  } else {
    const uint32_t r = static_cast<uint32_t>(v) / row_vecs;
    return int64_t{r} * pitch + (static_cast<uint32_t>(v) - r * row_vecs);
  }
}

// kRows: each slice moves as rows of row_vecs vectors (a head range), see row_offset.
template <int kVecBytes, int kUnroll, bool kRows, typename Ids>
__global__ void __launch_bounds__(kThreads, VLLM_EXT_MIN_CTAS_PER_SM)
    copy_blocks_kernel(const vllm_ext_side src, const vllm_ext_side dst, int32_t num_layers,
                       int32_t num_components, int64_t slice_vecs, int64_t tiles_per_slice,
                       int64_t num_tiles, int64_t row_vecs, const __grid_constant__ Ids ids) {
  using Vec = typename VecOf<kVecBytes>::type;
  constexpr int64_t kTileVecs = int64_t{kThreads} * kUnroll;
  const int64_t src_pitch = kRows ? vllm_ext::row_stride(src, row_vecs * kVecBytes) / kVecBytes : 0;
  const int64_t dst_pitch = kRows ? vllm_ext::row_stride(dst, row_vecs * kVecBytes) / kVecBytes : 0;
  const uint32_t rv = static_cast<uint32_t>(row_vecs);
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t slice = tile / tiles_per_slice;
    const int64_t tile_start = (tile - slice * tiles_per_slice) * kTileVecs;
    const int32_t c = static_cast<int32_t>(slice % num_components);
    const int64_t rest = slice / num_components;
    const int32_t l = static_cast<int32_t>(rest % num_layers);
    const int64_t i = rest / num_layers;
    const int64_t s = ids.src(src, i);
    const int64_t d = ids.dst(dst, i);
    // Never touch memory outside the described blocks, whatever the ids say.
    if (s < 0 || s >= src.num_blocks || d < 0 || d >= dst.num_blocks) continue;
    const Vec* from = reinterpret_cast<const Vec*>(slice_address(src, layer_base(src, l), s, c));
    Vec* to = reinterpret_cast<Vec*>(slice_address(dst, layer_base(dst, l), d, c));
    const int64_t first = tile_start + threadIdx.x;  // this thread's first vector of the slice
    Vec v[kUnroll];
    if (slice_vecs - tile_start >= kTileVecs) {  // a full tile: no per-access bounds checks
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = load_once(from + row_offset<kRows>(first + u * kThreads, rv, src_pitch));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) store_once(to + row_offset<kRows>(first + u * kThreads, rv, dst_pitch), v[u]);
    } else {
      const int64_t left = slice_vecs - first;  // vectors from this thread on
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (u * kThreads < left) v[u] = load_once(from + row_offset<kRows>(first + u * kThreads, rv, src_pitch));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (u * kThreads < left) store_once(to + row_offset<kRows>(first + u * kThreads, rv, dst_pitch), v[u]);
    }
  }
}

// Resident CTAs of `kernel` on `device` (SMs x CTAs per SM), cached per device and kernel.
// NOTE: the grid must not exceed what is resident at once: a second, partial wave of a
// grid-stride loop leaves most SMs idle at the end (seen as ~20% lost bandwidth).
template <auto kKernel>
int64_t resident_ctas(int device) {
  static std::atomic<int64_t> cached[kMaxDevices] = {};
  if (device >= 0 && device < kMaxDevices) {
    const int64_t known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) sms = 1;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, 0) != cudaSuccess || per_sm <= 0)
    per_sm = 1;
  const int64_t n = int64_t{sms} * per_sm;
  if (device >= 0 && device < kMaxDevices) cached[device].store(n, std::memory_order_relaxed);
  return n;
}

// cudaLaunchKernel returns this launch's own error (a <<<>>> launch needs cudaGetLastError,
// which would also report, and clear, an error some earlier call left pending).
template <auto kKernel, typename Ids>
int launch_tiles(vllm_ext_side src, vllm_ext_side dst, int32_t num_layers, int32_t num_components,
                 int64_t slice_vecs, int64_t tiles_per_slice, int64_t num_tiles, int64_t row_vecs, int device,
                 cudaStream_t stream, int32_t max_ctas, const Ids& ids) {
  int64_t grid = std::min<int64_t>(num_tiles, resident_ctas<kKernel>(device));
  if (max_ctas > 0) grid = std::min<int64_t>(grid, max_ctas);
  void* args[] = {&src,       &dst,        &num_layers, &num_components, &slice_vecs, &tiles_per_slice,
                  &num_tiles, &row_vecs,   const_cast<Ids*>(&ids)};
  VLLM_EXT_CUDA_TRY(cudaLaunchKernel(reinterpret_cast<const void*>(kKernel), dim3(static_cast<unsigned>(grid)),
                                     dim3(kThreads), args, 0, stream));
  return VLLM_EXT_OK;
}

// Rows that need the row walk: more than one, and not adjacent on both sides (adjacent rows are
// one contiguous run, the whole-slice kernel's).
bool walks_rows(const vllm_ext_side& src, const vllm_ext_side& dst, int64_t slice_nbytes, int64_t num_rows) {
  const int64_t row_nbytes = slice_nbytes / num_rows;
  return num_rows > 1 &&
         (vllm_ext::row_stride(src, row_nbytes) != row_nbytes || vllm_ext::row_stride(dst, row_nbytes) != row_nbytes);
}

template <int kVecBytes, typename Ids>
int launch(const vllm_ext_side& src, const vllm_ext_side& dst, int64_t num_ids, int32_t num_layers,
           int32_t num_components, int64_t slice_nbytes, int64_t num_rows, int device, cudaStream_t stream,
           int32_t max_ctas, const Ids& ids) {
  const int64_t slice_vecs = slice_nbytes / kVecBytes;
  const int64_t num_slices = num_ids * num_layers * num_components;
  const bool rows = walks_rows(src, dst, slice_nbytes, num_rows);
  const int64_t row_vecs = rows ? slice_vecs / num_rows : slice_vecs;
  // NOTE: small slices (a few hundred vectors) would leave most of a deep tile idle; they
  // get one vector per thread and more tiles instead.
  const bool deep = slice_vecs >= int64_t{kThreads} * kDeepUnroll;
  const int64_t tile_vecs = int64_t{kThreads} * (deep ? kDeepUnroll : 1);
  const int64_t tiles_per_slice = (slice_vecs + tile_vecs - 1) / tile_vecs;
  const int64_t num_tiles = num_slices * tiles_per_slice;
  if (rows)
    return deep ? launch_tiles<copy_blocks_kernel<kVecBytes, kDeepUnroll, true, Ids>>(
                      src, dst, num_layers, num_components, slice_vecs, tiles_per_slice, num_tiles, row_vecs, device,
                      stream, max_ctas, ids)
                : launch_tiles<copy_blocks_kernel<kVecBytes, 1, true, Ids>>(
                      src, dst, num_layers, num_components, slice_vecs, tiles_per_slice, num_tiles, row_vecs, device,
                      stream, max_ctas, ids);
  return deep ? launch_tiles<copy_blocks_kernel<kVecBytes, kDeepUnroll, false, Ids>>(
                    src, dst, num_layers, num_components, slice_vecs, tiles_per_slice, num_tiles, row_vecs, device,
                    stream, max_ctas, ids)
              : launch_tiles<copy_blocks_kernel<kVecBytes, 1, false, Ids>>(
                    src, dst, num_layers, num_components, slice_vecs, tiles_per_slice, num_tiles, row_vecs, device,
                    stream, max_ctas, ids);
}

// One launch of the widest access `alignment` allows (the caller checked it).
template <typename Ids>
int launch_aligned(const vllm_ext_side& src, const vllm_ext_side& dst, int64_t num_ids, int32_t num_layers,
                   int32_t num_components, int64_t slice_nbytes, int64_t num_rows, int32_t alignment, int device,
                   cudaStream_t s, int32_t max_ctas, const Ids& ids) {
  switch (std::min(alignment, 16)) {
    case 16: return launch<16>(src, dst, num_ids, num_layers, num_components, slice_nbytes, num_rows, device, s, max_ctas, ids);
    case 8: return launch<8>(src, dst, num_ids, num_layers, num_components, slice_nbytes, num_rows, device, s, max_ctas, ids);
    case 4: return launch<4>(src, dst, num_ids, num_layers, num_components, slice_nbytes, num_rows, device, s, max_ctas, ids);
    case 2: return launch<2>(src, dst, num_ids, num_layers, num_components, slice_nbytes, num_rows, device, s, max_ctas, ids);
    default: return launch<1>(src, dst, num_ids, num_layers, num_components, slice_nbytes, num_rows, device, s, max_ctas, ids);
  }
}

// The access width must divide a row (slice_nbytes / num_rows; the caller checked num_rows
// divides slice_nbytes), and the row walk indexes a slice's vectors in 32 bits.
int check_alignment(int32_t alignment, int64_t slice_nbytes, int64_t num_rows = 1) {
  const int64_t row_nbytes = num_rows > 0 ? slice_nbytes / num_rows : slice_nbytes;
  if (alignment <= 0 || (alignment & (alignment - 1)) != 0 || row_nbytes % alignment != 0)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT,
                "alignment " + std::to_string(alignment) + " is not a power of two dividing a row's " +
                    std::to_string(row_nbytes) + " bytes (slice_nbytes " + std::to_string(slice_nbytes) +
                    ", num_rows " + std::to_string(num_rows) + ")");
  if (num_rows > 1 && slice_nbytes / alignment > int64_t{UINT32_MAX})
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "slice_nbytes " + std::to_string(slice_nbytes) +
                                                   " in rows: a slice of 2^32 vectors or more");
  return VLLM_EXT_OK;
}

// The part of a slice a side names (slice_offset, row_stride) must sit on the access width.
int check_part_alignment(const vllm_ext_side& side, const char* name, int32_t alignment) {
  if (side.slice_offset % alignment != 0 || side.row_stride % alignment != 0)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, std::string(name) + ": slice_offset " +
                                                   std::to_string(side.slice_offset) + " or row_stride " +
                                                   std::to_string(side.row_stride) + " is not a multiple of alignment " +
                                                   std::to_string(alignment));
  return VLLM_EXT_OK;
}

// One id of a host list for an InlineIds: -1 when outside the side (the kernel skips it).
bool inline_id(int64_t id, int64_t num_blocks, int32_t* out) {
  if (id < 0 || id >= num_blocks) {
    *out = -1;
    return true;
  }
  if (id > INT32_MAX) return false;
  *out = static_cast<int32_t>(id);
  return true;
}

// Launches the copy of ids [0, num_ids) with host lists (NULL = rows first..), in launches of at
// most kMaxInlineIds ids.
int launch_inline(const vllm_ext_side& src, const vllm_ext_side& dst, const int64_t* src_ids,
                  const int64_t* dst_ids, int64_t num_ids, int32_t num_layers, int32_t num_components,
                  int64_t slice_nbytes, int64_t num_rows, int32_t alignment, int device, cudaStream_t stream,
                  int32_t max_ctas) {
  InlineIds ids;
  ids.has_src = src_ids != nullptr;
  ids.has_dst = dst_ids != nullptr;
  int32_t unused;
  for (int64_t i = 0; i < num_ids; ++i)  // refused before the first launch, not midway
    if ((src_ids && !inline_id(src_ids[i], src.num_blocks, &unused)) ||
        (dst_ids && !inline_id(dst_ids[i], dst.num_blocks, &unused)))
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "a block id above 2^31 cannot be passed inline");
  for (int64_t first = 0; first < num_ids; first += kMaxInlineIds) {
    const int64_t n = std::min<int64_t>(kMaxInlineIds, num_ids - first);
    ids.first = first;
    for (int64_t i = 0; i < n; ++i) {
      if (src_ids) inline_id(src_ids[first + i], src.num_blocks, &ids.src_ids[i]);
      if (dst_ids) inline_id(dst_ids[first + i], dst.num_blocks, &ids.dst_ids[i]);
    }
    // A side without a list: the kernel's bound (num_blocks) still applies to first + i.
    const int status = launch_aligned(src, dst, n, num_layers, num_components, slice_nbytes, num_rows, alignment,
                                      device, stream, max_ctas, ids);
    if (status != VLLM_EXT_OK) return status;
  }
  return VLLM_EXT_OK;
}

// ---- block digests (vllm_ext.h) ----------------------------------------------------------------
// The terms of one vector whose first word is word p of its block row (raw = digest_raw(p)).
__device__ __forceinline__ uint64_t digest_terms(uint32_t x, uint64_t raw) { return uint64_t{x} * (raw | 1u); }
__device__ __forceinline__ uint64_t digest_terms(uint2 v, uint64_t raw) {
  return digest_terms(v.x, raw) + digest_terms(v.y, raw + VLLM_EXT_DIGEST_STEP);
}
__device__ __forceinline__ uint64_t digest_terms(uint4 v, uint64_t raw) {
  return digest_terms(v.x, raw) + digest_terms(v.y, raw + VLLM_EXT_DIGEST_STEP) +
         digest_terms(v.z, raw + 2 * VLLM_EXT_DIGEST_STEP) + digest_terms(v.w, raw + 3 * VLLM_EXT_DIGEST_STEP);
}

// grid: (min(tiles, resident CTAs)), block: (kThreads); tiles as in copy_blocks_kernel, over
// slice index i * L * C + k (k = l * C + c, the slice's place in its block row). Each warp
// adds its tile's terms into out[i] with one atomic: the sum mod 2^64 has no order, so the
// digest is the same whatever the grid. Ids were checked on the host.
// NOTE: every thread of a CTA walks the same tiles, so the warp reduction below is reached by
// all 32 lanes (threads past the end of a partial tile add 0).
// kRows: the slice's moved part is rows of row_vecs vectors (a head range), see row_offset;
// a row's words follow the previous row's in the block row the digest is defined on.
template <int kVecBytes, int kUnroll, bool kRows>
__global__ void __launch_bounds__(kThreads, VLLM_EXT_MIN_CTAS_PER_SM)
    block_digests_kernel(const vllm_ext_side cache, int32_t num_layers, int32_t num_components, int64_t slice_vecs,
                         int64_t tiles_per_slice, int64_t num_tiles, int64_t row_vecs, unsigned long long* out,
                         const __grid_constant__ InlineIds ids) {
  using Vec = typename VecOf<kVecBytes>::type;
  constexpr int kWords = kVecBytes / 4;
  constexpr int64_t kTileVecs = int64_t{kThreads} * kUnroll;
  constexpr uint64_t kUnrollStep = VLLM_EXT_DIGEST_STEP * kThreads * kWords;  // raw from vector u to u + 1
  const int64_t per_block = int64_t{num_layers} * num_components;
  const int64_t pitch = kRows ? vllm_ext::row_stride(cache, row_vecs * kVecBytes) / kVecBytes : 0;
  const uint32_t rv = static_cast<uint32_t>(row_vecs);
  for (int64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const int64_t slice = tile / tiles_per_slice;
    const int64_t first_vec = (tile - slice * tiles_per_slice) * kTileVecs + threadIdx.x;
    const int64_t k = slice % per_block, i = slice / per_block;
    const int64_t b = ids.src(cache, i);
    if (b < 0 || b >= cache.num_blocks) continue;  // never outside the cache (the whole CTA skips)
    const int32_t l = static_cast<int32_t>(k / num_components), c = static_cast<int32_t>(k % num_components);
    const Vec* from = reinterpret_cast<const Vec*>(slice_address(cache, layer_base(cache, l), b, c));
    const uint64_t raw = vllm_ext::digest_raw(static_cast<uint64_t>((k * slice_vecs + first_vec) * kWords));
    Vec v[kUnroll];
    uint64_t sum = 0;
    if (slice_vecs - (first_vec - threadIdx.x) >= kTileVecs) {  // a full tile: no per-access bounds checks
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = load_once(from + row_offset<kRows>(first_vec + u * kThreads, rv, pitch));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) sum += digest_terms(v[u], raw + u * kUnrollStep);
    } else {
      const int64_t left = slice_vecs - first_vec;  // vectors from this thread on
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (u * kThreads < left) v[u] = load_once(from + row_offset<kRows>(first_vec + u * kThreads, rv, pitch));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (u * kThreads < left) sum += digest_terms(v[u], raw + u * kUnrollStep);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if ((threadIdx.x & 31) == 0) atomicAdd(out + i, static_cast<unsigned long long>(sum));
  }
}

template <int kVecBytes, bool kRows>
int launch_digests_rows(const vllm_ext_side& cache, int64_t num_ids, int32_t num_layers, int32_t num_components,
                        int64_t slice_nbytes, int64_t num_rows, unsigned long long* out, int device,
                        cudaStream_t stream, const InlineIds& ids) {
  vllm_ext_side side = cache;
  int64_t slice_vecs = slice_nbytes / kVecBytes;
  int64_t row_vecs = slice_vecs / num_rows;
  const bool deep = slice_vecs >= int64_t{kThreads} * kDeepUnroll;
  const int64_t tile_vecs = int64_t{kThreads} * (deep ? kDeepUnroll : 1);
  int64_t tiles_per_slice = (slice_vecs + tile_vecs - 1) / tile_vecs;
  int64_t num_tiles = num_ids * num_layers * num_components * tiles_per_slice;
  const void* kernel = deep ? reinterpret_cast<const void*>(block_digests_kernel<kVecBytes, kDeepUnroll, kRows>)
                            : reinterpret_cast<const void*>(block_digests_kernel<kVecBytes, 1, kRows>);
  const int64_t resident = deep ? resident_ctas<block_digests_kernel<kVecBytes, kDeepUnroll, kRows>>(device)
                                : resident_ctas<block_digests_kernel<kVecBytes, 1, kRows>>(device);
  const int64_t grid = std::min<int64_t>(num_tiles, resident);
  void* args[] = {&side, &num_layers, &num_components, &slice_vecs, &tiles_per_slice, &num_tiles, &row_vecs, &out,
                  const_cast<InlineIds*>(&ids)};
  VLLM_EXT_CUDA_TRY(cudaLaunchKernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(kThreads), args, 0, stream));
  return VLLM_EXT_OK;
}

template <int kVecBytes>
int launch_digests(const vllm_ext_side& cache, int64_t num_ids, int32_t num_layers, int32_t num_components,
                   int64_t slice_nbytes, int64_t num_rows, unsigned long long* out, int device, cudaStream_t stream,
                   const InlineIds& ids) {
  const int64_t row_nbytes = slice_nbytes / num_rows;
  if (num_rows > 1 && vllm_ext::row_stride(cache, row_nbytes) != row_nbytes)
    return launch_digests_rows<kVecBytes, true>(cache, num_ids, num_layers, num_components, slice_nbytes, num_rows,
                                                out, device, stream, ids);
  return launch_digests_rows<kVecBytes, false>(cache, num_ids, num_layers, num_components, slice_nbytes, 1, out,
                                               device, stream, ids);
}

using GetAddressRange = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);

GetAddressRange driver_get_address_range() {  // cuMemGetAddressRange, looked up once
  static const auto fn = reinterpret_cast<GetAddressRange>(driver_entry_point("cuMemGetAddressRange"));
  return fn;
}

}  // namespace

extern "C" {

// The checks every copy entry point makes before any CUDA call.
int check_cuda_copy(const vllm_ext_side* src, const vllm_ext_side* dst, int64_t num_ids, int32_t num_layers,
                    int32_t num_components, int64_t slice_nbytes, int64_t num_rows, int32_t alignment) {
  int status = vllm_ext::check_copy_args(src, dst, num_ids, num_layers, num_components, slice_nbytes, num_rows);
  if (status == VLLM_EXT_OK) status = check_alignment(alignment, slice_nbytes, num_rows);
  if (status == VLLM_EXT_OK) status = check_part_alignment(*src, "src", alignment);
  if (status == VLLM_EXT_OK) status = check_part_alignment(*dst, "dst", alignment);
  return status;
}

int vllm_ext_copy_blocks_cuda(const vllm_ext_side* src, const vllm_ext_side* dst, int64_t num_ids,
                              int32_t num_layers, int32_t num_components, int64_t slice_nbytes,
                              int64_t num_rows, int32_t alignment, int32_t device, void* stream, int32_t max_ctas) {
  const int status = check_cuda_copy(src, dst, num_ids, num_layers, num_components, slice_nbytes, num_rows, alignment);
  if (status != VLLM_EXT_OK) return status;
  if (num_ids == 0 || num_layers == 0 || slice_nbytes == 0) return VLLM_EXT_OK;
  DeviceGuard guard(device);
  if (!guard.ok()) return cuda_fail(cudaGetLastError(), "cudaSetDevice");
  return launch_aligned(*src, *dst, num_ids, num_layers, num_components, slice_nbytes, num_rows, alignment, device,
                        static_cast<cudaStream_t>(stream), max_ctas, SideIds{});
}

int vllm_ext_copy_blocks_cuda_inline(const vllm_ext_side* src, const vllm_ext_side* dst, const int64_t* src_ids,
                                     const int64_t* dst_ids, int64_t num_ids, int32_t num_layers,
                                     int32_t num_components, int64_t slice_nbytes, int64_t num_rows,
                                     int32_t alignment, int32_t device, void* stream, int32_t max_ctas) {
  const int status = check_cuda_copy(src, dst, num_ids, num_layers, num_components, slice_nbytes, num_rows, alignment);
  if (status != VLLM_EXT_OK) return status;
  if (src->block_ids != nullptr || dst->block_ids != nullptr)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "the sides' block_ids must be NULL (ids go in src_ids/dst_ids)");
  if (num_ids == 0 || num_layers == 0 || slice_nbytes == 0) return VLLM_EXT_OK;
  DeviceGuard guard(device);
  if (!guard.ok()) return cuda_fail(cudaGetLastError(), "cudaSetDevice");
  return launch_inline(*src, *dst, src_ids, dst_ids, num_ids, num_layers, num_components, slice_nbytes, num_rows,
                       alignment, device, static_cast<cudaStream_t>(stream), max_ctas);
}

int vllm_ext_staged_transfer(const vllm_ext_side* cache, const vllm_ext_staging* lanes, int32_t num_lanes,
                             const int64_t* ids, const int64_t* bounds, int32_t first_chunk, int32_t num_chunks,
                             int32_t num_layers, int32_t num_components, int64_t slice_nbytes, int64_t num_rows,
                             int32_t alignment, int32_t device, void* after_stream, void* after_event, void* done) {
  if (cache == nullptr || lanes == nullptr || bounds == nullptr)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "null argument to vllm_ext_staged_transfer");
  if (cache->block_ids != nullptr)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "cache->block_ids must be NULL (ids go in `ids`)");
  if (num_lanes < 1 || num_lanes > VLLM_EXT_MAX_LANES || first_chunk < 0 || num_chunks < 0)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "staged transfer: bad lane count or chunk range");
  const int32_t direction = lanes[0].direction;
  const int64_t slot_blocks = lanes[0].slot_blocks;
  for (int32_t i = 0; i < num_lanes; ++i) {
    const vllm_ext_staging& st = lanes[i];
    if (st.transfer == nullptr)
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "staged transfer: a NULL transfer function (lane " + std::to_string(i) + ")");
    if ((st.direction != VLLM_EXT_STAGE_SEND && st.direction != VLLM_EXT_STAGE_RECV) || st.direction != direction ||
        st.slot_blocks <= 0 || st.slot_blocks != slot_blocks || st.slots[0] == 0 || st.slots[1] == 0)
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "staged transfer: bad direction or slots (lane " + std::to_string(i) + ")");
    if (st.copied[0] == nullptr || st.copied[1] == nullptr || st.moved[0] == nullptr || st.moved[1] == nullptr ||
        st.tail == nullptr)
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT,
                  "staged transfer: a NULL event (every slot needs copied and moved, every lane a tail)");
  }
  for (int32_t c = 0; c < num_chunks; ++c) {
    const int64_t n = bounds[c + 1] - bounds[c];
    if (bounds[c] < 0 || n < 0 || n > slot_blocks)
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "staged transfer: chunk " + std::to_string(c) + " holds " +
                                                     std::to_string(n) + " blocks, a slot " +
                                                     std::to_string(slot_blocks));
  }
  const int64_t rows_total = bounds[num_chunks] - bounds[0];
  if (rows_total > 0 && ids == nullptr) return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "ids is NULL");
  int status = check_alignment(alignment, slice_nbytes, num_rows);
  if (status == VLLM_EXT_OK) status = check_part_alignment(*cache, "cache", alignment);
  for (int32_t i = 0; i < num_lanes && status == VLLM_EXT_OK; ++i) {
    for (int slot = 0; slot < 2 && status == VLLM_EXT_OK; ++slot) {
      // the slot as the buffer side of its rows (Stage::rows below), its block one row
      vllm_ext_side probe = {nullptr, lanes[i].slots[slot], num_components * slice_nbytes,
                             int64_t{num_layers} * num_components * slice_nbytes, slice_nbytes, slot_blocks,
                             nullptr, 0, 0};
      status = vllm_ext::check_copy_args(cache, &probe, 0, num_layers, num_components, slice_nbytes, num_rows);
    }
  }
  if (status != VLLM_EXT_OK) return status;
  if (num_layers == 0 || slice_nbytes == 0) return VLLM_EXT_OK;  // blocks of no bytes: nothing moves
  DeviceGuard guard(device, /*bind=*/true);  // the transfer function may need the context current
  if (!guard.ok()) return cuda_fail(cudaGetLastError(), "cudaSetDevice");
  const bool send = direction == VLLM_EXT_STAGE_SEND;
  const int64_t row_nbytes = int64_t{num_layers} * num_components * slice_nbytes;
  auto stream_of = [](void* s) { return static_cast<cudaStream_t>(s); };
  auto event_of = [](void* e) { return static_cast<cudaEvent_t>(e); };
  if (after_event != nullptr) {  // after_stream NULL: the legacy default stream, as everywhere
    VLLM_EXT_CUDA_TRY(cudaEventRecord(event_of(after_event), stream_of(after_stream)));
    for (int32_t i = 0; i < num_lanes; ++i)
      VLLM_EXT_CUDA_TRY(cudaStreamWaitEvent(stream_of(lanes[i].copy_stream), event_of(after_event), 0));
  }
  // Chunk c's lane, slot and the slot as a buffer side of its rows (the wire format of gather/scatter).
  struct Stage {
    const vllm_ext_staging* lane;
    int slot;
    int64_t lane_chunk;
    vllm_ext_side rows;
  };
  auto stage = [&](int32_t c) {
    const int64_t k = int64_t{first_chunk} + c;
    Stage g;
    g.lane = &lanes[k % num_lanes];
    g.lane_chunk = k / num_lanes;
    g.slot = static_cast<int>(g.lane_chunk % 2);
    g.rows = {nullptr, g.lane->slots[g.slot], num_components * slice_nbytes, row_nbytes, slice_nbytes,
              bounds[c + 1] - bounds[c], nullptr, 0, 0};
    return g;
  };
  auto transfer = [&](int32_t c, const Stage& g) -> int {
    const int rc = g.lane->transfer(reinterpret_cast<void*>(g.lane->slots[g.slot]),
                                    static_cast<size_t>(g.rows.num_blocks * row_nbytes), g.lane->datatype,
                                    g.lane->peer, g.lane->comm, g.lane->comm_stream);
    if (rc != 0)
      return fail(VLLM_EXT_ERR_TRANSFER, std::string(send ? "send" : "receive") + " of chunk " +
                                             std::to_string(int64_t{first_chunk} + c) + " returned " +
                                             std::to_string(rc));
    VLLM_EXT_CUDA_TRY(cudaEventRecord(event_of(g.lane->moved[g.slot]), stream_of(g.lane->comm_stream)));
    return VLLM_EXT_OK;
  };
  auto scatter = [&](int32_t c) -> int {
    const Stage g = stage(c);
    auto copy = stream_of(g.lane->copy_stream);
    VLLM_EXT_CUDA_TRY(cudaStreamWaitEvent(copy, event_of(g.lane->moved[g.slot]), 0));
    const int rc = launch_inline(g.rows, *cache, nullptr, ids + bounds[c], g.rows.num_blocks, num_layers,
                                 num_components, slice_nbytes, num_rows, alignment, device, copy, g.lane->max_ctas);
    if (rc != VLLM_EXT_OK) return rc;
    VLLM_EXT_CUDA_TRY(cudaEventRecord(event_of(g.lane->copied[g.slot]), copy));
    return VLLM_EXT_OK;
  };
  for (int32_t c = 0; c < num_chunks; ++c) {
    const Stage g = stage(c);
    auto copy = stream_of(g.lane->copy_stream), comm = stream_of(g.lane->comm_stream);
    if (send) {
      if (g.lane_chunk >= 2) VLLM_EXT_CUDA_TRY(cudaStreamWaitEvent(copy, event_of(g.lane->moved[g.slot]), 0));
      status = launch_inline(*cache, g.rows, ids + bounds[c], nullptr, g.rows.num_blocks, num_layers, num_components,
                             slice_nbytes, num_rows, alignment, device, copy, g.lane->max_ctas);
      if (status != VLLM_EXT_OK) return status;
      VLLM_EXT_CUDA_TRY(cudaEventRecord(event_of(g.lane->copied[g.slot]), copy));
      VLLM_EXT_CUDA_TRY(cudaStreamWaitEvent(comm, event_of(g.lane->copied[g.slot]), 0));
      if ((status = transfer(c, g)) != VLLM_EXT_OK) return status;
    } else {
      // The slot's previous scatter (this lane's chunk j - 2) was enqueued: scatters trail by one chunk.
      if (g.lane_chunk >= 2) VLLM_EXT_CUDA_TRY(cudaStreamWaitEvent(comm, event_of(g.lane->copied[g.slot]), 0));
      if ((status = transfer(c, g)) != VLLM_EXT_OK) return status;
      if (c >= 1 && (status = scatter(c - 1)) != VLLM_EXT_OK) return status;
    }
  }
  if (!send && num_chunks > 0 && (status = scatter(num_chunks - 1)) != VLLM_EXT_OK) return status;
  for (int32_t i = 0; i < num_lanes; ++i)
    VLLM_EXT_CUDA_TRY(cudaEventRecord(event_of(lanes[i].tail), stream_of(send ? lanes[i].comm_stream
                                                                               : lanes[i].copy_stream)));
  if (done != nullptr) {
    auto last = stream_of(send ? lanes[0].comm_stream : lanes[0].copy_stream);
    for (int32_t i = 1; i < num_lanes; ++i) VLLM_EXT_CUDA_TRY(cudaStreamWaitEvent(last, event_of(lanes[i].tail), 0));
    VLLM_EXT_CUDA_TRY(cudaEventRecord(event_of(done), last));
  }
  return VLLM_EXT_OK;
}

int vllm_ext_block_digests_cuda(const vllm_ext_side* cache, const int64_t* ids, int64_t num_ids, int32_t num_layers,
                                int32_t num_components, int64_t slice_nbytes, int64_t num_rows, int32_t alignment,
                                uint64_t* out, int32_t device, void* stream) {
  int status = vllm_ext::check_digest_args(cache, ids, num_ids, num_layers, num_components, slice_nbytes, num_rows);
  if (status == VLLM_EXT_OK) status = check_alignment(alignment, slice_nbytes, num_rows);
  if (status == VLLM_EXT_OK) status = check_part_alignment(*cache, "cache", alignment);
  if (status != VLLM_EXT_OK) return status;
  if (alignment < 4) return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "block digests: alignment " +
                                                                    std::to_string(alignment) + " is below 4");
  if (num_ids > 0 && out == nullptr) return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "block digests: out is NULL");
  if (num_ids > INT32_MAX) return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "block digests: too many ids");
  InlineIds chunk;
  for (int64_t i = 0; i < num_ids; ++i)  // in range (checked above); refused before the first launch
    if (!inline_id(ids[i], cache->num_blocks, &chunk.src_ids[0]))
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "block digests: a block id above 2^31 cannot be passed inline");
  if (num_ids == 0) return VLLM_EXT_OK;
  DeviceGuard guard(device);
  if (!guard.ok()) return cuda_fail(cudaGetLastError(), "cudaSetDevice");
  auto s = static_cast<cudaStream_t>(stream);
  VLLM_EXT_CUDA_TRY(cudaMemsetAsync(out, 0, static_cast<size_t>(num_ids) * sizeof(uint64_t), s));
  if (num_layers == 0 || slice_nbytes == 0) return VLLM_EXT_OK;
  auto* sums = reinterpret_cast<unsigned long long*>(out);
  chunk.has_src = 1;
  chunk.has_dst = 0;
  for (int64_t first = 0; first < num_ids; first += kMaxInlineIds) {
    const int64_t n = std::min<int64_t>(kMaxInlineIds, num_ids - first);
    chunk.first = first;
    for (int64_t i = 0; i < n; ++i) inline_id(ids[first + i], cache->num_blocks, &chunk.src_ids[i]);
    switch (std::min(alignment, 16)) {
      case 16: status = launch_digests<16>(*cache, n, num_layers, num_components, slice_nbytes, num_rows, sums + first, device, s, chunk); break;
      case 8: status = launch_digests<8>(*cache, n, num_layers, num_components, slice_nbytes, num_rows, sums + first, device, s, chunk); break;
      default: status = launch_digests<4>(*cache, n, num_layers, num_components, slice_nbytes, num_rows, sums + first, device, s, chunk); break;
    }
    if (status != VLLM_EXT_OK) return status;
  }
  return VLLM_EXT_OK;
}

int vllm_ext_copy_blocks_memcpy(const vllm_ext_side* src, const vllm_ext_side* dst, int64_t num_ids,
                                int32_t num_layers, int32_t num_components, int64_t slice_nbytes,
                                int32_t device, void* stream) {
  int status = vllm_ext::check_copy_args(src, dst, num_ids, num_layers, num_components, slice_nbytes, 1);
  if (status != VLLM_EXT_OK) return status;
  DeviceGuard guard(device);
  if (!guard.ok()) return cuda_fail(cudaGetLastError(), "cudaSetDevice");
  auto s = static_cast<cudaStream_t>(stream);
  for (int64_t i = 0; i < num_ids; ++i) {
    const int64_t sb = src->block_ids ? src->block_ids[i] : i;
    const int64_t db = dst->block_ids ? dst->block_ids[i] : i;
    if (sb < 0 || sb >= src->num_blocks || db < 0 || db >= dst->num_blocks) continue;
    for (int32_t l = 0; l < num_layers; ++l) {
      for (int32_t c = 0; c < num_components; ++c) {
        const uint64_t from = slice_address(*src, layer_base(*src, l), sb, c);
        const uint64_t to = slice_address(*dst, layer_base(*dst, l), db, c);
        VLLM_EXT_CUDA_TRY(cudaMemcpyAsync(reinterpret_cast<void*>(to), reinterpret_cast<const void*>(from),
                                          static_cast<size_t>(slice_nbytes), cudaMemcpyDefault, s));
      }
    }
  }
  return VLLM_EXT_OK;
}

int vllm_ext_check_device(int32_t device, int32_t* major, int32_t* minor) {
  int count = 0;
  VLLM_EXT_CUDA_TRY(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT,
                "device " + std::to_string(device) + " out of range for " + std::to_string(count) +
                    " CUDA devices");
  int ma = 0, mi = 0;
  VLLM_EXT_CUDA_TRY(cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, device));
  VLLM_EXT_CUDA_TRY(cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, device));
  if (major) *major = ma;
  if (minor) *minor = mi;
  DeviceGuard guard(device);
  if (!guard.ok()) return cuda_fail(cudaGetLastError(), "cudaSetDevice");
  cudaFuncAttributes attr;
  // Loading the kernel is what fails on a GPU with neither machine code nor usable PTX.
  VLLM_EXT_CUDA_TRY(cudaFuncGetAttributes(&attr, copy_blocks_kernel<16, kDeepUnroll, false, SideIds>));
  return VLLM_EXT_OK;
}

int vllm_ext_stream_is_capturing(void* stream, int32_t* capturing) {
  if (capturing == nullptr) return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "capturing is NULL");
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  VLLM_EXT_CUDA_TRY(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  *capturing = status == cudaStreamCaptureStatusActive ? 1 : 0;
  return VLLM_EXT_OK;
}

int32_t vllm_ext_device_count(void) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

int vllm_ext_enable_peer_access(int32_t device, int32_t peer_device) {
  if (device == peer_device) return VLLM_EXT_OK;
  DeviceGuard guard(device);
  if (!guard.ok()) return cuda_fail(cudaGetLastError(), "cudaSetDevice");
  const cudaError_t err = cudaDeviceEnablePeerAccess(peer_device, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
    return VLLM_EXT_OK;
  }
  if (err != cudaSuccess) return cuda_fail(err, "cudaDeviceEnablePeerAccess");
  return VLLM_EXT_OK;
}

int vllm_ext_can_access_peer(int32_t device, int32_t peer_device, int32_t* can_access) {
  int can = device == peer_device ? 1 : 0;
  if (device != peer_device) VLLM_EXT_CUDA_TRY(cudaDeviceCanAccessPeer(&can, device, peer_device));
  if (can_access) *can_access = can;
  return VLLM_EXT_OK;
}

int vllm_ext_device_pci_bus_id(int32_t device, char* buf, int32_t buf_len) {
  if (buf == nullptr || buf_len < 16) return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "buffer too small");
  VLLM_EXT_CUDA_TRY(cudaDeviceGetPCIBusId(buf, buf_len, device));
  return VLLM_EXT_OK;
}

int vllm_ext_ipc_export(uint64_t address, uint8_t handle[VLLM_EXT_IPC_HANDLE_BYTES],
                        uint64_t* offset, uint64_t* allocation_nbytes) {
  if (address == 0 || handle == nullptr || offset == nullptr || allocation_nbytes == nullptr)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "null argument to vllm_ext_ipc_export");
  // The driver call needs the owning device's context current on this thread, which a server
  // thread that never touched CUDA lacks: find the device, then make it current.
  cudaPointerAttributes attributes;
  VLLM_EXT_CUDA_TRY(cudaPointerGetAttributes(&attributes, reinterpret_cast<void*>(address)));
  if (attributes.type != cudaMemoryTypeDevice)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "address is not device memory (cudaMalloc'ed)");
  DeviceGuard guard(attributes.device, /*bind=*/true);
  if (!guard.ok()) return cuda_fail(cudaGetLastError(), "cudaSetDevice");
  GetAddressRange range = driver_get_address_range();
  if (range == nullptr) return fail(VLLM_EXT_ERR_CUDA, "cuMemGetAddressRange is not available");
  unsigned long long base = 0;
  size_t size = 0;
  const int rc = range(&base, &size, static_cast<unsigned long long>(address));
  if (rc != 0)
    return fail(VLLM_EXT_ERR_CUDA, "cuMemGetAddressRange failed with CUresult " + std::to_string(rc) +
                                       " (is the address device memory?)");
  cudaIpcMemHandle_t h;
  VLLM_EXT_CUDA_TRY(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)));
  static_assert(sizeof(h) == VLLM_EXT_IPC_HANDLE_BYTES, "IPC handle size");
  std::memcpy(handle, &h, sizeof(h));
  *offset = address - base;
  *allocation_nbytes = size;
  return VLLM_EXT_OK;
}

int vllm_ext_ipc_import(const uint8_t handle[VLLM_EXT_IPC_HANDLE_BYTES], int32_t device,
                        uint64_t* mapped_base) {
  if (handle == nullptr || mapped_base == nullptr)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "null argument to vllm_ext_ipc_import");
  DeviceGuard guard(device);
  if (!guard.ok()) return cuda_fail(cudaGetLastError(), "cudaSetDevice");
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle, sizeof(h));
  void* p = nullptr;
  VLLM_EXT_CUDA_TRY(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  *mapped_base = reinterpret_cast<uint64_t>(p);
  return VLLM_EXT_OK;
}

int vllm_ext_ipc_close(uint64_t mapped_base, int32_t device) {
  DeviceGuard guard(device);
  if (!guard.ok()) return cuda_fail(cudaGetLastError(), "cudaSetDevice");
  VLLM_EXT_CUDA_TRY(cudaIpcCloseMemHandle(reinterpret_cast<void*>(mapped_base)));
  return VLLM_EXT_OK;
}

int32_t vllm_ext_built_with_cuda(void) { return 1; }

const char* vllm_ext_cuda_archs(void) { return VLLM_EXT_CUDA_ARCHS; }

}  // extern "C"
