// The CUDA half of the ABI for a CPU-only build: every entry point says the build has no CUDA.
#include "common.h"

namespace {
int no_cuda() {
  return vllm_ext::fail(VLLM_EXT_ERR_NO_CUDA,
                        "vllm-ext was built without CUDA (VLLM_EXT_TARGET_DEVICE=cpu)");
}
}  // namespace

extern "C" {
int vllm_ext_copy_blocks_cuda(const vllm_ext_side*, const vllm_ext_side*, int64_t, int32_t,
                              int32_t, int64_t, int64_t, int32_t, int32_t, void*, int32_t) { return no_cuda(); }
int vllm_ext_copy_blocks_cuda_inline(const vllm_ext_side*, const vllm_ext_side*, const int64_t*, const int64_t*,
                                     int64_t, int32_t, int32_t, int64_t, int64_t, int32_t, int32_t, void*, int32_t) {
  return no_cuda();
}
int vllm_ext_staged_transfer(const vllm_ext_side*, const vllm_ext_staging*, int32_t, const int64_t*, const int64_t*,
                             int32_t, int32_t, int32_t, int32_t, int64_t, int64_t, int32_t, int32_t, void*, void*,
                             void*) {
  return no_cuda();
}
int vllm_ext_pull_server_start(int32_t, const vllm_ext_side*, const vllm_ext_staging*, int32_t, int32_t, int32_t,
                               int64_t, int32_t, int32_t, void*, const int32_t*, const vllm_ext_pull_heads*,
                               vllm_ext_pull_server**) {
  return no_cuda();
}
int vllm_ext_pull_server_test_stall(vllm_ext_pull_server*, const int64_t*) { return no_cuda(); }
int vllm_ext_pull_server_stop(vllm_ext_pull_server*) { return no_cuda(); }
int vllm_ext_pull_server_wait(vllm_ext_pull_server*, int64_t, int32_t*, int32_t*, char*, int32_t) {
  return no_cuda();
}
int vllm_ext_pull_server_destroy(vllm_ext_pull_server*) { return no_cuda(); }
int vllm_ext_block_digests_cuda(const vllm_ext_side*, const int64_t*, int64_t, int32_t, int32_t, int64_t, int64_t,
                                int32_t, uint64_t*, int32_t, void*) {
  return no_cuda();
}
int vllm_ext_copy_blocks_memcpy(const vllm_ext_side*, const vllm_ext_side*, int64_t, int32_t, int32_t,
                                int64_t, int32_t, void*) { return no_cuda(); }
int vllm_ext_check_device(int32_t, int32_t*, int32_t*) { return no_cuda(); }
int32_t vllm_ext_device_count(void) { return 0; }
int vllm_ext_stream_is_capturing(void*, int32_t*) { return no_cuda(); }
int vllm_ext_enable_peer_access(int32_t, int32_t) { return no_cuda(); }
int vllm_ext_can_access_peer(int32_t, int32_t, int32_t*) { return no_cuda(); }
int vllm_ext_device_pci_bus_id(int32_t, char*, int32_t) { return no_cuda(); }
int vllm_ext_ipc_export(uint64_t, uint8_t*, uint64_t*, uint64_t*) { return no_cuda(); }
int vllm_ext_ipc_import(const uint8_t*, int32_t, uint64_t*) { return no_cuda(); }
int vllm_ext_ipc_close(uint64_t, int32_t) { return no_cuda(); }
int32_t vllm_ext_built_with_cuda(void) { return 0; }
const char* vllm_ext_cuda_archs(void) { return ""; }
}
