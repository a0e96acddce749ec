// The source side of staged (nccl) pulls, served by a library thread: requests are read,
// checked and enqueued with no Python and no GIL on the way (see vllm_ext.h).
#include <cuda_runtime.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common.h"

using vllm_ext::fail;

namespace {

using Clock = std::chrono::steady_clock;

struct RequestHeader {
  uint32_t magic;
  uint32_t count;
  double timeout_s;
  int32_t first_head;
  int32_t num_heads;  // 0: whole blocks
};
struct ReplyHeader {
  uint32_t magic;
  uint32_t kind;
  uint32_t message_len;
  uint32_t reserved;
};
static_assert(sizeof(RequestHeader) == 24 && sizeof(ReplyHeader) == 16, "wire headers: 24 and 16 bytes");

// Largest power of two (at most 16) dividing `value` (0: 16), as the ops' _pow2_alignment.
int32_t pow2_alignment(int64_t value) {
  int32_t a = 16;
  while (a > 1 && value % a != 0) a /= 2;
  return a;
}

constexpr double kSpinS = 2e-3;          // after a pull: poll without sleeping this long
constexpr int kIdlePollMs = 100;         // between requests: wake up this often to see `stop`
constexpr uint32_t kMaxMessage = 4096;   // bytes of a reply's message

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool send_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// 1: n bytes read; 0: the peer closed the connection before the first byte; -1: error or EOF
// inside the frame.
int recv_exact(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  size_t got = 0;
  while (got < n) {
    const ssize_t k = ::recv(fd, p + got, n - got, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) return got == 0 ? 0 : -1;
    if (k < 0) return -1;
    got += static_cast<size_t>(k);
  }
  return 1;
}

// True when the peer closed its end (or the socket broke); leaves waiting data in place.
bool peer_closed(int fd) {
  pollfd p = {fd, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLRDHUP | POLLNVAL)) return true;
  char c;
  const ssize_t k = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

}  // namespace

struct vllm_ext_pull_server {
  int fd = -1;
  vllm_ext_side cache{};
  const volatile int32_t* grants = nullptr;  // [host] per-block grant counts, or NULL: every block
  bool serves_heads = false;                  // head ranges (`heads` given)
  vllm_ext_pull_heads heads{};
  std::vector<vllm_ext_staging> lanes;
  int32_t num_layers = 0, num_components = 0, alignment = 1, device = 0;
  int64_t slice_nbytes = 0;
  cudaEvent_t done = nullptr;
  std::atomic<const volatile int64_t*> stall{nullptr};  // tests: {chunk, microseconds}, read at every pull
  std::atomic<bool> stop{false};
  std::mutex mutex;
  std::condition_variable ended_cv;
  bool ended = false;
  int32_t reason = VLLM_EXT_PULL_SERVER_PEER_CLOSED;
  std::string message;
  std::thread thread;
  bool device_bound = false;

  void reply(uint32_t kind, const std::string& text) {
    const std::string body = text.substr(0, kMaxMessage);
    const ReplyHeader head = {VLLM_EXT_PULL_REPLY_MAGIC, kind, static_cast<uint32_t>(body.size()), 0};
    std::string frame(reinterpret_cast<const char*>(&head), sizeof head);
    frame += body;
    send_all(fd, frame.data(), frame.size());  // a peer that is gone learns nothing either way
  }

  // Sleeps `seconds` (tests), in steps that notice `stop`, the peer leaving and the deadline.
  void pause(double seconds, Clock::time_point deadline) {
    const auto until = std::min(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                   std::chrono::duration<double>(seconds)),
                                deadline);
    while (!stop.load() && Clock::now() < until && !peer_closed(fd))
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }

  // The end of a pull that cannot go on (stopped, the peer left, past the deadline), or
  // nothing (true) when it can.
  bool interrupted(Clock::time_point deadline, double timeout_s) {
    if (stop.load()) {
      reply(VLLM_EXT_PULL_FAILED, "nccl send: the source endpoint stopped serving (closing)");
      return !end(VLLM_EXT_PULL_SERVER_STOPPED, "stopped during a pull");
    }
    if (peer_closed(fd)) return !end(VLLM_EXT_PULL_SERVER_PEER_CLOSED, "the connection closed during a pull");
    if (Clock::now() >= deadline) {
      char what[160];
      std::snprintf(what, sizeof what, "nccl send: not complete at the deadline of %g s", timeout_s);
      reply(VLLM_EXT_PULL_FAILED, what);
      return !end(VLLM_EXT_PULL_SERVER_DEADLINE, what);
    }
    return false;
  }

  // Waits until a request (or EOF) is readable; false when stopped. After a pull it spins a
  // little: the stages of a migration come in bursts.
  bool wait_readable(bool spin) {
    const auto start = Clock::now();
    while (!stop.load()) {
      pollfd p = {fd, POLLIN | POLLRDHUP, 0};
      const int timeout = spin && seconds_since(start) < kSpinS ? 0 : kIdlePollMs;
      const int r = ::poll(&p, 1, timeout);
      if (r > 0) return true;
      if (r < 0 && errno != EINTR) return true;  // the read that follows reports the error
    }
    return false;
  }

  // One request; returns false when the server must end (reason and message set).
  bool serve_one() {
    RequestHeader head;
    const int got = recv_exact(fd, &head, sizeof head);
    if (got == 0) return end(stop.load() ? VLLM_EXT_PULL_SERVER_STOPPED : VLLM_EXT_PULL_SERVER_PEER_CLOSED, "");
    if (got < 0) return end(VLLM_EXT_PULL_SERVER_PEER_CLOSED, "the connection broke");
    if (head.magic != VLLM_EXT_PULL_REQUEST_MAGIC || head.count > VLLM_EXT_PULL_MAX_IDS) {
      reply(VLLM_EXT_PULL_FAILED, "malformed pull request");
      return end(VLLM_EXT_PULL_SERVER_FAILED, "a malformed pull request (magic or count)");
    }
    std::vector<int64_t> ids(head.count);
    if (head.count && recv_exact(fd, ids.data(), ids.size() * sizeof(int64_t)) != 1)
      return end(VLLM_EXT_PULL_SERVER_PEER_CLOSED, "the connection broke inside a request");
    // Refused requests move nothing and leave the pair usable.
    if (!(head.timeout_s > 0) || !(head.timeout_s < 1e9)) {
      reply(VLLM_EXT_PULL_REFUSED, "timeout: must be a positive number of seconds");
      return true;
    }
    // The deadline counts from the request's arrival, as the destination's counts from its send.
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(head.timeout_s));
    // What moves of each slice: the whole slice, or a head range's rows (vllm_ext_side).
    vllm_ext_side side = cache;
    int64_t part_nbytes = slice_nbytes, num_rows = 1;
    int32_t part_alignment = alignment;
    if (head.num_heads == 0) {
      if (serves_heads && !heads.whole_blocks) {
        reply(VLLM_EXT_PULL_REFUSED, "whole blocks of " + std::to_string(heads.num_kv_heads) +
                                         " KV heads for a destination of another head count; name a head range");
        return true;
      }
    } else {
      const int64_t first = head.first_head, count = head.num_heads;
      if (!serves_heads) {
        reply(VLLM_EXT_PULL_REFUSED, "heads: this source serves whole blocks only");
        return true;
      }
      if (first < 0 || count < 1 || first + count > heads.num_kv_heads) {
        reply(VLLM_EXT_PULL_REFUSED, "heads: heads [" + std::to_string(first) + ", " + std::to_string(first + count) +
                                         ") are outside the source's " + std::to_string(heads.num_kv_heads) +
                                         " KV heads");
        return true;
      }
      const int64_t run = heads.num_kv_heads * heads.head_stride;  // checked at start: divides a slice
      const int64_t runs = slice_nbytes / run;
      part_nbytes = runs * count * heads.head_stride;
      side.slice_offset = first * heads.head_stride;
      if (count < heads.num_kv_heads && runs > 1) {
        num_rows = runs;
        side.row_stride = run;
      }
      part_alignment = std::min({alignment, pow2_alignment(side.slice_offset), pow2_alignment(part_nbytes / num_rows),
                                 pow2_alignment(side.row_stride)});
    }
    for (int64_t id : ids) {
      if (id < 0 || id >= cache.num_blocks) {
        reply(VLLM_EXT_PULL_REFUSED, "src_block_ids: id " + std::to_string(id) + " out of range for a cache of " +
                                         std::to_string(cache.num_blocks) + " blocks");
        return true;
      }
      if (grants != nullptr && grants[id] <= 0) {
        reply(VLLM_EXT_PULL_REFUSED, "src_block_ids: block " + std::to_string(id) + " is not granted by the source");
        return true;
      }
    }
    // The chunks the destination derives from n as well; a request that would queue too many
    // launches is refused before anything is allocated for it.
    const int64_t n = static_cast<int64_t>(ids.size());
    const int64_t count = vllm_ext_ramp_bounds(n, lanes[0].slot_blocks, nullptr, 0);
    if (count > VLLM_EXT_PULL_MAX_CHUNKS || n > VLLM_EXT_PULL_MAX_REQUEST_IDS) {
      reply(VLLM_EXT_PULL_REFUSED, "src_block_ids: " + std::to_string(n) + " blocks make " + std::to_string(count) +
                                       " chunks; a request holds at most " +
                                       std::to_string(VLLM_EXT_PULL_MAX_CHUNKS) + " chunks and " +
                                       std::to_string(VLLM_EXT_PULL_MAX_REQUEST_IDS) + " ids");
      return true;
    }
    std::vector<int64_t> bounds(static_cast<size_t>(count + 1));
    vllm_ext_ramp_bounds(n, lanes[0].slot_blocks, bounds.data(), count + 1);
    const int32_t chunks = static_cast<int32_t>(bounds.size() - 1);
    const volatile int64_t* const test_stall = stall.load();
    const int64_t stall_chunk = test_stall ? test_stall[0] : -1;
    int status = VLLM_EXT_OK;
    if (!device_bound) {  // at the first pull: requests can be refused on a host without a GPU
      const cudaError_t e = cudaSetDevice(device);
      if (e == cudaSuccess)
        device_bound = true;
      else
        status = fail(VLLM_EXT_ERR_CUDA, std::string("cudaSetDevice: ") + cudaGetErrorString(e));
    }
    if (status != VLLM_EXT_OK) {
      // reported below
    } else if (stall_chunk >= 0 && stall_chunk < chunks) {  // tests: a source that pauses before a chunk
      const int32_t first = static_cast<int32_t>(stall_chunk);
      if (first > 0) status = enqueue(side, part_nbytes, num_rows, part_alignment, ids, bounds.data(), 0, first, nullptr);
      if (status == VLLM_EXT_OK) {
        pause(static_cast<double>(test_stall[1]) * 1e-6, deadline);
        if (interrupted(deadline, head.timeout_s)) return false;  // the rest is not enqueued
        status = enqueue(side, part_nbytes, num_rows, part_alignment, ids, bounds.data() + first, first, chunks - first,
                         done);
      }
    } else {  // records `done` after the last send
      status = enqueue(side, part_nbytes, num_rows, part_alignment, ids, bounds.data(), 0, chunks, done);
    }
    if (status != VLLM_EXT_OK) {
      const std::string what = std::string("nccl send: ") + vllm_ext_last_error();
      reply(VLLM_EXT_PULL_FAILED, what);
      return end(VLLM_EXT_PULL_SERVER_FAILED, what);
    }
    reply(VLLM_EXT_PULL_ACCEPTED, "");  // said after the launches: off the data's path
    return wait_done(deadline, head.timeout_s);
  }

  int enqueue(const vllm_ext_side& side, int64_t part_nbytes, int64_t num_rows, int32_t part_alignment,
              const std::vector<int64_t>& ids, const int64_t* bounds, int32_t first, int32_t count, cudaEvent_t last) {
    return vllm_ext_staged_transfer(&side, lanes.data(), static_cast<int32_t>(lanes.size()), ids.data(), bounds, first,
                                    count, num_layers, num_components, part_nbytes, num_rows, part_alignment, device,
                                    nullptr, nullptr, last);
  }

  // Waits for the pull's last send against its deadline, watching the connection.
  bool wait_done(Clock::time_point deadline, double timeout_s) {
    const auto start = Clock::now();
    while (true) {
      const cudaError_t e = cudaEventQuery(done);
      if (e == cudaSuccess) return true;
      if (e != cudaErrorNotReady) {
        const std::string what = std::string("nccl send: ") + cudaGetErrorString(e);
        reply(VLLM_EXT_PULL_FAILED, what);
        return end(VLLM_EXT_PULL_SERVER_FAILED, what);
      }
      if (interrupted(deadline, timeout_s)) return false;
      const double waited = seconds_since(start);
      if (waited > kSpinS)  // then sleep 2% of the time waited: completion noticed ~2% late
        std::this_thread::sleep_for(std::chrono::duration<double>(std::min(std::max(0.02 * waited, 20e-6), 1e-3)));
    }
  }

  bool end(int32_t why, const std::string& text) {
    std::lock_guard<std::mutex> lock(mutex);
    reason = why;
    message = text;
    return false;
  }

  void run() {
    bool after_pull = false;
    while (true) {
      if (!wait_readable(after_pull)) {
        end(VLLM_EXT_PULL_SERVER_STOPPED, "");
        break;
      }
      try {
        if (!serve_one()) break;
      } catch (const std::exception& e) {  // an allocation: end this server, not the process
        end(VLLM_EXT_PULL_SERVER_FAILED, std::string("pull server: ") + e.what());
        break;
      }
      after_pull = true;
    }
    ::shutdown(fd, SHUT_RDWR);  // the peer sees the end at once (the fd is closed by destroy)
    std::lock_guard<std::mutex> lock(mutex);
    ended = true;
    ended_cv.notify_all();
  }
};

extern "C" {

int vllm_ext_pull_server_start(int32_t fd, const vllm_ext_side* cache, const vllm_ext_staging* lanes,
                               int32_t num_lanes, int32_t num_layers, int32_t num_components, int64_t slice_nbytes,
                               int32_t alignment, int32_t device, void* done_event, const int32_t* grants,
                               const vllm_ext_pull_heads* heads, vllm_ext_pull_server** server) {
  if (server == nullptr || cache == nullptr || lanes == nullptr || done_event == nullptr || fd < 0)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "null argument or negative fd to vllm_ext_pull_server_start");
  *server = nullptr;
  if (heads != nullptr && (heads->num_kv_heads < 1 || heads->head_stride < 1 ||
                           slice_nbytes % (heads->num_kv_heads * heads->head_stride) != 0))
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "pull server: " + std::to_string(heads->num_kv_heads) + " heads of " +
                                                   std::to_string(heads->head_stride) +
                                                   " bytes do not tile a slice of " + std::to_string(slice_nbytes));
  if (num_lanes < 1 || num_lanes > VLLM_EXT_MAX_LANES)
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "pull server: " + std::to_string(num_lanes) + " lanes (1 to " +
                                                   std::to_string(VLLM_EXT_MAX_LANES) + ")");
  for (int32_t i = 0; i < num_lanes; ++i)
    if (lanes[i].direction != VLLM_EXT_STAGE_SEND || lanes[i].slot_blocks <= 0 ||
        lanes[i].slot_blocks != lanes[0].slot_blocks || lanes[i].transfer == nullptr)
      return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "pull server: every lane must be a SEND side with equal slots");
  auto* s = new vllm_ext_pull_server();
  s->fd = fd;
  s->cache = *cache;
  s->lanes.assign(lanes, lanes + num_lanes);
  s->num_layers = num_layers;
  s->num_components = num_components;
  s->slice_nbytes = slice_nbytes;
  s->alignment = alignment;
  s->device = device;
  s->done = static_cast<cudaEvent_t>(done_event);
  s->grants = grants;
  s->serves_heads = heads != nullptr;
  if (heads != nullptr) s->heads = *heads;
  try {
    s->thread = std::thread([s] { s->run(); });
  } catch (const std::exception& e) {
    delete s;
    return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, std::string("pull server: no thread: ") + e.what());
  }
  *server = s;
  return VLLM_EXT_OK;
}

int vllm_ext_pull_server_test_stall(vllm_ext_pull_server* server, const int64_t* stall) {
  if (server == nullptr) return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "server is NULL");
  server->stall.store(stall);
  return VLLM_EXT_OK;
}

int vllm_ext_pull_server_stop(vllm_ext_pull_server* server) {
  if (server == nullptr) return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "server is NULL");
  server->stop.store(true);
  ::shutdown(server->fd, SHUT_RD);  // wakes a blocking read; the thread can still answer
  return VLLM_EXT_OK;
}

int vllm_ext_pull_server_wait(vllm_ext_pull_server* server, int64_t timeout_us, int32_t* ended, int32_t* reason,
                              char* message, int32_t message_len) {
  if (server == nullptr || ended == nullptr) return fail(VLLM_EXT_ERR_INVALID_ARGUMENT, "server/ended is NULL");
  std::unique_lock<std::mutex> lock(server->mutex);
  server->ended_cv.wait_for(lock, std::chrono::microseconds(std::max<int64_t>(timeout_us, 0)),
                            [server] { return server->ended; });
  *ended = server->ended ? 1 : 0;
  if (server->ended) {
    if (reason) *reason = server->reason;
    if (message && message_len > 0) {
      const size_t n = std::min(server->message.size(), static_cast<size_t>(message_len - 1));
      std::memcpy(message, server->message.data(), n);
      message[n] = '\0';
    }
  }
  return VLLM_EXT_OK;
}

int vllm_ext_pull_server_destroy(vllm_ext_pull_server* server) {
  if (server == nullptr) return VLLM_EXT_OK;
  vllm_ext_pull_server_stop(server);
  if (server->thread.joinable()) server->thread.join();
  ::close(server->fd);
  delete server;
  return VLLM_EXT_OK;
}

}  // extern "C"
