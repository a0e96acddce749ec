/*
 * vllm_ext.h: the whole C ABI of libvllm_ext.
 *
 * One primitive moves KV-cache blocks: a batched copy of `num_ids` blocks, each made of
 * `num_layers x num_components` chunks of `slice_nbytes` contiguous bytes, from one side to
 * another. A side is a paged KV cache (per-layer base addresses plus strides) or a buffer (the
 * same description with identity block ids), so gather, scatter and peer pull are one kernel.
 *
 * Conventions: every function returns a vllm_ext_status (0 = success); vllm_ext_status_string()
 * decodes it and vllm_ext_last_error() gives the detailed message of the calling thread's last
 * failure. A stream, when taken, is the last argument (a cudaStream_t passed as void*).
 * Memory spaces are marked [host], [device] (memory the kernel's GPU can address: its own
 * memory, a peer GPU's with peer access enabled, or pinned host memory) or [any].
 */
#ifndef VLLM_EXT_H_
#define VLLM_EXT_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define VLLM_EXT_ABI_VERSION 10

/* The library is built with hidden visibility; only these functions are exported. */
#if defined(__GNUC__)
#define VLLM_EXT_API __attribute__((visibility("default")))
#else
#define VLLM_EXT_API
#endif

typedef enum {
  VLLM_EXT_OK = 0,
  VLLM_EXT_ERR_INVALID_ARGUMENT = 1, /* a null pointer, a negative count, misaligned sizes */
  VLLM_EXT_ERR_NO_CUDA = 2,          /* the library was built without CUDA */
  VLLM_EXT_ERR_CUDA = 3,             /* a CUDA runtime call failed; see vllm_ext_last_error() */
  VLLM_EXT_ERR_NO_KERNEL_IMAGE = 4,  /* the GPU's arch is not among the built archs */
  VLLM_EXT_ERR_TRANSFER = 5,         /* the caller's transfer function (ncclSend/ncclRecv) failed */
} vllm_ext_status;

/*
 * One side of a block copy. Slice (layer l, component c) of block b starts at
 *   layer_base(l) + b * block_stride + c * component_stride + slice_offset
 * where layer_base(l) = layer_ptrs[l] if layer_ptrs is non-null, else base + l * layer_stride.
 * A buffer of rows [n, num_layers * num_components * slice_nbytes] is the side
 *   {layer_ptrs = NULL, base = buf, layer_stride = C * slice, block_stride = L * C * slice,
 *    component_stride = slice, block_ids = NULL, slice_offset = 0, row_stride = 0}.
 * Ids >= num_blocks or < 0 are skipped by every implementation: nothing outside the
 * described blocks is ever read or written (callers validate ids before calling).
 *
 * Part of each slice (a head range): the copies and digests take `num_rows`. The bytes that
 * move of each slice are then num_rows rows of slice_nbytes / num_rows bytes, row r at
 *   slice start (above, slice_offset included) + r * row_stride
 * on each side (row_stride 0: the rows are adjacent, as in a buffer). KV heads
 * [h, h + n) of a cache whose slices are [block_size, num_kv_heads, head_size] (NHD) are
 * num_rows = block_size rows of n * head_bytes, slice_offset = h * head_bytes and
 * row_stride = num_kv_heads * head_bytes; of an HND slice, one row at h * block_size *
 * head_bytes. num_rows = 1 with slice_offset 0 moves whole slices (the fast path).
 */
typedef struct {
  const uint64_t* layer_ptrs; /* [num_layers] base addresses; [device] for CUDA, [host] for CPU */
  uint64_t base;              /* used when layer_ptrs is NULL */
  int64_t layer_stride;       /* bytes; used when layer_ptrs is NULL */
  int64_t block_stride;       /* bytes between consecutive blocks of one component */
  int64_t component_stride;   /* bytes between K and V of one block (0 when one component) */
  int64_t num_blocks;         /* blocks this side holds: the bound for block_ids */
  const int64_t* block_ids;   /* [num_ids]; [device] for CUDA, [host] for CPU; NULL = 0..n-1 */
  int64_t slice_offset;       /* bytes from a slice's start to the first byte that moves (0: all) */
  int64_t row_stride;         /* bytes between the rows of one slice (num_rows > 1); 0: adjacent */
} vllm_ext_side;

/*
 * Copies slice (l, c) of block src.block_ids[i] to slice (l, c) of block dst.block_ids[i] for
 * every i < num_ids, l < num_layers, c < num_components: slice_nbytes bytes of each, in
 * num_rows rows (>= 1, dividing slice_nbytes; see vllm_ext_side).
 * `alignment` is a power of two that divides slice_nbytes / num_rows, every stride and offset
 * and every base address of both sides (the caller knows the addresses); it selects the access
 * width (16 bytes at most).
 */

/* CUDA: one kernel launch on `device`, enqueued on `stream`; no allocation, no synchronisation,
 * so the call can be captured in a CUDA graph. `max_ctas` caps the grid (0 = every CTA that
 * fits on the GPU at once): a copy that runs beside a communication kernel (NCCL) leaves it
 * room on every SM. */
VLLM_EXT_API int vllm_ext_copy_blocks_cuda(const vllm_ext_side* src, const vllm_ext_side* dst, int64_t num_ids,
                              int32_t num_layers, int32_t num_components, int64_t slice_nbytes,
                              int64_t num_rows, int32_t alignment, int32_t device, void* stream,
                              int32_t max_ctas);

/* The same copy with the block ids given as [host] arrays, read during the call and carried
 * by the launch itself (kernel parameters): no upload, no device buffer, no event, so a small
 * migration costs one launch. src_ids / dst_ids hold num_ids ids each, or are NULL for
 * 0..num_ids-1 (a buffer side); the sides' own block_ids must be NULL. Any num_ids: one launch
 * per VLLM_EXT_MAX_INLINE_IDS ids. Ids outside a side are skipped, as above. */
#define VLLM_EXT_MAX_INLINE_IDS 448
VLLM_EXT_API int vllm_ext_copy_blocks_cuda_inline(const vllm_ext_side* src, const vllm_ext_side* dst,
                                     const int64_t* src_ids, const int64_t* dst_ids, int64_t num_ids,
                                     int32_t num_layers, int32_t num_components, int64_t slice_nbytes,
                                     int64_t num_rows, int32_t alignment, int32_t device, void* stream,
                                     int32_t max_ctas);

/*
 * Staged transfer: the enqueue sequence of one side of a pipelined pull, in one call.
 * `transfer` has the signature of ncclSend / ncclRecv; the caller passes their address, so the
 * library never links NCCL. A side has num_lanes lanes (1 .. VLLM_EXT_MAX_LANES), each with its
 * own communicator, streams, two slots and events: chunk k goes through lane k % num_lanes, in
 * its slot (k / num_lanes) % 2. The lanes run concurrently, so one chunk's transfer starts
 * while its neighbour's ends (and NCCL moves a lane's chunk on that lane's own channels).
 * Chunk c (0 <= c < num_chunks) moves the blocks ids[bounds[c] .. bounds[c+1]) of `cache`,
 * k = first_chunk + c, j = k / num_lanes (the lane's own count), s = j % 2:
 *   SEND: copy_stream waits moved[s] (j >= 2), gathers the blocks into the slot, records
 *         copied[s]; comm_stream waits for it, transfers the slot out, records moved[s].
 *   RECV: comm_stream waits copied[s] (j >= 2), transfers into the slot, records moved[s];
 *         copy_stream waits for it, scatters the slot into the blocks, records copied[s].
 *         (A chunk's transfer is enqueued before the previous chunk's scatter.)
 * When `after_event` is not NULL, it is recorded on `after_stream` (NULL: the legacy default
 * stream) and every lane's copy stream first waits for it: the copies follow the work the
 * caller queued there. At the end every lane records `tail` on its last stream (comm
 * for SEND, copy for RECV) and, when `done` is not NULL, lane 0's last stream waits for every
 * tail and records `done`: the whole side's work, this call's and earlier calls'.
 * Everything is enqueued, nothing waited for. On a failure the streams hold a prefix of the
 * sequence (a transfer that failed is not enqueued), so the caller must end its communicators
 * (ncclCommAbort) before reusing the slots.
 */
typedef int (*vllm_ext_transfer_fn)(void* buf, size_t count, int32_t datatype, int32_t peer,
                                    void* comm, void* stream);
typedef enum { VLLM_EXT_STAGE_SEND = 0, VLLM_EXT_STAGE_RECV = 1 } vllm_ext_stage_direction;
#define VLLM_EXT_MAX_LANES 8
typedef struct {              /* one lane */
  int32_t direction;          /* vllm_ext_stage_direction (the same for every lane) */
  int32_t max_ctas;           /* grid cap of the gathers / scatters (0 = the whole GPU) */
  uint64_t slots[2];          /* [device] two staging buffers of slot_blocks rows */
  int64_t slot_blocks;        /* rows of one slot (the same for every lane) */
  void* copy_stream;          /* cudaStream_t of the gathers / scatters */
  void* comm_stream;          /* cudaStream_t of the transfers */
  void* copied[2];            /* cudaEvent_t per slot: its copy is done */
  void* moved[2];             /* cudaEvent_t per slot: its transfer is done */
  void* tail;                 /* cudaEvent_t: the lane's last stage (see above) */
  vllm_ext_transfer_fn transfer;
  void* comm;                 /* passed to transfer */
  int32_t peer;               /* passed to transfer */
  int32_t datatype;           /* passed to transfer: a 1-byte type (ncclUint8); count = bytes */
} vllm_ext_staging;

/* `cache` describes the paged cache (its block_ids must be NULL; its slice_offset and
 * row_stride with num_rows select a head range, see vllm_ext_side); ids and bounds are [host];
 * rows of a slot are num_layers * num_components * slice_nbytes bytes (the buffer wire
 * format); alignment divides the cache's and the slots' addresses, strides and offsets. */
VLLM_EXT_API int vllm_ext_staged_transfer(const vllm_ext_side* cache, const vllm_ext_staging* lanes,
                             int32_t num_lanes, const int64_t* ids, const int64_t* bounds,
                             int32_t first_chunk, int32_t num_chunks, int32_t num_layers,
                             int32_t num_components, int64_t slice_nbytes, int64_t num_rows,
                             int32_t alignment, int32_t device, void* after_stream, void* after_event,
                             void* done);

/* The chunks of a staged pull of n blocks, which both sides derive from n alone: they grow
 * 1, 2, 4, ... blocks up to slot_blocks, so the first transfer starts after one block's copy
 * and long pulls need few transfers. Writes bounds[0 .. chunks] (bounds[0] = 0, the last = n)
 * when `capacity` holds chunks + 1 values (bounds may be NULL to count) and returns the number
 * of chunks; -1 for n < 0 or slot_blocks < 1. In every build, CUDA or not. */
VLLM_EXT_API int64_t vllm_ext_ramp_bounds(int64_t n, int64_t slot_blocks, int64_t* bounds, int64_t capacity);

/*
 * Pull server: the source side of staged pulls, run by a library thread, so that serving a
 * pull needs no Python (a source process whose Python is busy would otherwise delay every
 * request by GIL hand-overs). The thread owns `fd`, a connected stream socket, and answers
 * binary requests on it until the peer closes it or vllm_ext_pull_server_stop:
 *   request: uint32 magic VLLM_EXT_PULL_REQUEST_MAGIC, uint32 count, float64 timeout_s,
 *            int32 first_head, int32 num_heads, then count int64 block ids of `cache` (little
 *            endian); num_heads 0: whole blocks, else only KV heads [first_head, first_head +
 *            num_heads) of each block, rows of that head range (see vllm_ext_pull_heads)
 *   reply:   uint32 magic VLLM_EXT_PULL_REPLY_MAGIC, uint32 kind (vllm_ext_pull_reply),
 *            uint32 message_len, uint32 0, then message_len bytes of UTF-8
 * A request with an id outside the cache, a bad timeout, more than VLLM_EXT_PULL_MAX_CHUNKS
 * chunks or more than VLLM_EXT_PULL_MAX_REQUEST_IDS ids is REFUSED (nothing moves; a destination splits longer pulls into requests: a full
 * launch queue would block the thread where no deadline reaches it). Otherwise
 * its chunks (vllm_ext_ramp_bounds) are enqueued over the lanes as vllm_ext_staged_transfer
 * does, with `done_event` as its done, the reply is ACCEPTED, and the thread waits for done_event until timeout_s after the request arrived:
 * past it, it sends FAILED and ends (as it does after a failed enqueue, or on a stop during a
 * pull); a peer that closes the connection ends it too. After the thread ends, the caller must
 * end the communicator (ncclCommAbort) before reusing the slots: a pull may be half enqueued.
 * `grants` ([host], may be NULL: every block is served) holds one int32 per block of `cache`,
 * read at every request: a request naming a block whose count is not positive is REFUSED (the
 * source serves only blocks it granted, e.g. those of live leases).
 * `heads` ([host], copied; may be NULL: whole blocks only) says where the cache's KV heads lie,
 * for requests of a head range: one outside [0, num_kv_heads) is REFUSED, and so is a
 * whole-block request when whole_blocks is 0 (a destination of another head count).
 * `cache` and the lanes are copied; done_event, `grants` and the streams, events, slots and
 * communicators that the lanes name must stay valid until destroy.
 */
#define VLLM_EXT_PULL_REQUEST_MAGIC 0x32505856u /* "VXP2": with a head range */
#define VLLM_EXT_PULL_REPLY_MAGIC 0x31525856u   /* "VXR1" */
#define VLLM_EXT_PULL_MAX_IDS (1u << 24)
#define VLLM_EXT_PULL_MAX_CHUNKS 256 /* per request: bounds the launches queued at once */
/* ids per request: at most this many launches of inline ids (VLLM_EXT_MAX_INLINE_IDS each) */
#define VLLM_EXT_PULL_MAX_REQUEST_IDS (VLLM_EXT_PULL_MAX_CHUNKS * VLLM_EXT_MAX_INLINE_IDS)
typedef enum { VLLM_EXT_PULL_ACCEPTED = 0, VLLM_EXT_PULL_REFUSED = 1, VLLM_EXT_PULL_FAILED = 2 } vllm_ext_pull_reply;
typedef enum {
  VLLM_EXT_PULL_SERVER_PEER_CLOSED = 0, /* the peer closed the connection (between or during pulls) */
  VLLM_EXT_PULL_SERVER_STOPPED = 1,     /* vllm_ext_pull_server_stop */
  VLLM_EXT_PULL_SERVER_FAILED = 2,      /* an enqueue or CUDA call failed, or a malformed request */
  VLLM_EXT_PULL_SERVER_DEADLINE = 3,    /* a pull was not complete at its deadline */
} vllm_ext_pull_server_end;
typedef struct vllm_ext_pull_server vllm_ext_pull_server;
typedef struct {
  int32_t num_kv_heads; /* of the cache */
  int32_t whole_blocks; /* 1: whole-block requests are served (the destination has the same heads) */
  int64_t head_stride;  /* bytes from one head to the next in a slice; the heads lie in
                           slice_nbytes / (num_kv_heads * head_stride) runs per slice */
} vllm_ext_pull_heads;
VLLM_EXT_API int vllm_ext_pull_server_start(int32_t fd, const vllm_ext_side* cache, const vllm_ext_staging* lanes,
                               int32_t num_lanes, int32_t num_layers, int32_t num_components, int64_t slice_nbytes,
                               int32_t alignment, int32_t device, void* done_event, const int32_t* grants,
                               const vllm_ext_pull_heads* heads, vllm_ext_pull_server** server);
/* Tests only, never called in production: `stall` ([host], NULL to end it) holds {chunk,
 * microseconds}, read at every later request; the thread pauses that long (bounded by the
 * deadline, ended by a stop or the peer leaving) before enqueueing that chunk. It must stay
 * valid until destroy or the next call. */
VLLM_EXT_API int vllm_ext_pull_server_test_stall(vllm_ext_pull_server* server, const int64_t* stall);
/* Asks the thread to end (shuts the socket down for reading; a pull in flight is answered
 * FAILED); returns at once. Any thread may call it until destroy (callers serialise the two). */
VLLM_EXT_API int vllm_ext_pull_server_stop(vllm_ext_pull_server* server);
/* Waits up to timeout_us for the thread to end: *ended = 1 then, with *reason
 * (vllm_ext_pull_server_end) and the message (NUL-terminated, message_len bytes at most). */
VLLM_EXT_API int vllm_ext_pull_server_wait(vllm_ext_pull_server* server, int64_t timeout_us, int32_t* ended,
                              int32_t* reason, char* message, int32_t message_len);
/* Stops, joins the thread, closes fd and frees the server (once, by its owner). */
VLLM_EXT_API int vllm_ext_pull_server_destroy(vllm_ext_pull_server* server);

/* Baseline (what vLLM's swap_blocks and Llumnix do): one cudaMemcpyAsync per (block, layer,
 * component) on the copy engines. Here layer_ptrs and block_ids of both sides are [host]; host
 * work grows with blocks x layers. Benchmarks compare the kernel against it. */
VLLM_EXT_API int vllm_ext_copy_blocks_memcpy(const vllm_ext_side* src, const vllm_ext_side* dst, int64_t num_ids,
                                int32_t num_layers, int32_t num_components, int64_t slice_nbytes,
                                int32_t device, void* stream);

/* CPU twin: the same copy with memcpy over [host] memory, split over num_threads threads. */
VLLM_EXT_API int vllm_ext_copy_blocks_cpu(const vllm_ext_side* src, const vllm_ext_side* dst, int64_t num_ids,
                             int32_t num_layers, int32_t num_components, int64_t slice_nbytes,
                             int64_t num_rows, int32_t num_threads);

/*
 * Block digests: one 64-bit digest per block over every byte of it, so that a transfer can be
 * checked end to end (the source digests what it grants, the destination what it received).
 * The digest of a block is defined on its row of the buffer wire format (slices (l, c) in the
 * order l * num_components + c, slice_nbytes bytes each), read as little-endian 32-bit words
 * x_0, x_1, ...:
 *   digest = sum_p x_p * w_p  (mod 2^64),  w_p = (p * VLLM_EXT_DIGEST_STEP + VLLM_EXT_DIGEST_SEED) | 1
 * Every weight is odd, so changing any one word changes the digest; a sum mod 2^64 has no
 * order, so every implementation (and any split of the work) gives the same value. Each byte
 * is read once. `cache` is a paged side (its block_ids NULL); ids are [host], num_ids of them,
 * each in [0, cache->num_blocks) (else VLLM_EXT_ERR_INVALID_ARGUMENT, nothing done);
 * slice_nbytes is a multiple of 4. With num_rows, slice_offset and row_stride selecting part of
 * each slice (a head range, as for the copy), the digest is that of the block's row in a buffer
 * of those parts: what a gather of the part writes, so a head range digests the same on a
 * source and on a destination of other head counts. Rows are whole words (a multiple of 4).
 */
#define VLLM_EXT_DIGEST_STEP 0x9E3779B97F4A7C15ull
#define VLLM_EXT_DIGEST_SEED 0x243F6A8885A308D3ull

/* CUDA: `out` [device] receives num_ids digests. Enqueued on `stream` (a memset and one launch
 * per VLLM_EXT_MAX_INLINE_IDS ids, which travel in the launch): no allocation, no
 * synchronisation. `alignment` (4, 8 or 16) divides slice_nbytes, the strides and every layer
 * address; it selects the access width. */
VLLM_EXT_API int vllm_ext_block_digests_cuda(const vllm_ext_side* cache, const int64_t* ids, int64_t num_ids,
                                int32_t num_layers, int32_t num_components, int64_t slice_nbytes,
                                int64_t num_rows, int32_t alignment, uint64_t* out, int32_t device,
                                void* stream);

/* CPU twin: the same digests of [host] memory into `out` [host], over num_threads threads. */
VLLM_EXT_API int vllm_ext_block_digests_cpu(const vllm_ext_side* cache, const int64_t* ids, int64_t num_ids,
                               int32_t num_layers, int32_t num_components, int64_t slice_nbytes,
                               int64_t num_rows, uint64_t* out, int32_t num_threads);

/* Checks that the library holds code that runs on `device` (loading the kernel on it).
 * Returns VLLM_EXT_ERR_NO_KERNEL_IMAGE for a GPU arch the library was not built for.
 * *major / *minor receive the device's compute capability. */
VLLM_EXT_API int vllm_ext_check_device(int32_t device, int32_t* major, int32_t* minor);

/* *capturing = 1 when `stream` (a cudaStream_t of any device) is capturing a CUDA graph. */
VLLM_EXT_API int vllm_ext_stream_is_capturing(void* stream, int32_t* capturing);

/* Number of CUDA devices the driver shows (0 without a driver or a CUDA build). Never fails. */
VLLM_EXT_API int32_t vllm_ext_device_count(void);

/* Lets kernels on `device` read and write memory of `peer_device` (idempotent). */
VLLM_EXT_API int vllm_ext_enable_peer_access(int32_t device, int32_t peer_device);

/* 1 when kernels on `device` can address memory of `peer_device`, else 0. */
VLLM_EXT_API int vllm_ext_can_access_peer(int32_t device, int32_t peer_device, int32_t* can_access);

/* PCI bus id of `device` ("0000:3b:00.0"), written to buf [host] of buf_len bytes. */
VLLM_EXT_API int vllm_ext_device_pci_bus_id(int32_t device, char* buf, int32_t buf_len);

/* CUDA IPC. The exporting side turns a device address into the handle of the allocation that
 * holds it plus the address's offset and the allocation's size; the importing side maps that
 * allocation on `device` (peer access enabled lazily) and later unmaps it. */
#define VLLM_EXT_IPC_HANDLE_BYTES 64
VLLM_EXT_API int vllm_ext_ipc_export(uint64_t address, uint8_t handle[VLLM_EXT_IPC_HANDLE_BYTES],
                        uint64_t* offset, uint64_t* allocation_nbytes);
VLLM_EXT_API int vllm_ext_ipc_import(const uint8_t handle[VLLM_EXT_IPC_HANDLE_BYTES], int32_t device,
                        uint64_t* mapped_base);
VLLM_EXT_API int vllm_ext_ipc_close(uint64_t mapped_base, int32_t device);

/* Static strings. */
VLLM_EXT_API const char* vllm_ext_status_string(int status);
VLLM_EXT_API const char* vllm_ext_last_error(void); /* the calling thread's last detailed error message */
VLLM_EXT_API int32_t vllm_ext_abi_version(void);
VLLM_EXT_API int32_t vllm_ext_built_with_cuda(void); /* 1 for a CUDA build, 0 for a CPU-only build */
VLLM_EXT_API const char* vllm_ext_cuda_archs(void);  /* the -gencode targets the library holds, e.g. "sm_90 compute_120" */

#ifdef __cplusplus
}
#endif

#endif /* VLLM_EXT_H_ */
