// libcudart_model.so: a modelled CUDA runtime/driver for tests on machines without a GPU.
//
// N devices whose "device memory" is host memory; every stream is a worker thread running its operations in order.
// Copies move the real bytes and then complete at the time a bandwidth model says: each PCIe link (per device,
// per direction) and each device's outgoing NVLink port is a FIFO timeline; a copy of B bytes reserves
// B / (bandwidth * (1 - background)) seconds on it. Peer copies use NVLink when peer access was enabled between
// the two devices, otherwise they are staged through host memory over both PCIe links (like the real runtime).
// Events, host functions, stream callbacks, stream memory wait (cuStreamWaitValue32) on host-mapped memory and a
// spin kernel launched from a module (the fallback path) are modelled. Configuration by environment:
//   MODEL_NDEV (4), MODEL_LINK_GBPS (1.0, per link and direction), MODEL_NVLINK_GBPS (10), MODEL_PEERS
//   ("all" | "none" | "0-1,2-3"), MODEL_BG ("0:h2d:0.5,1:d2h:0.3": fraction of a link taken by background
//   traffic), MODEL_NO_MEMOPS=1 (cuStreamWaitValue32 reports not supported), MODEL_OP_LATENCY_US (5).
// Extra entry points for tests: mmaModelStatsJson, mmaModelResetStats, mmaModelSetBackground, mmaModelCallLog,
// mmaModelStreamSleep.
#include "cuda_min.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define API extern "C" __attribute__((visibility("default")))

namespace {

using Clock = std::chrono::steady_clock;
const Clock::time_point t0 = Clock::now();
double now_s() { return std::chrono::duration<double>(Clock::now() - t0).count(); }
void sleep_until_s(double t) {
  std::this_thread::sleep_until(t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(t)));
}

double env_d(const char* n, double d) {
  const char* v = getenv(n);
  return v && *v ? atof(v) : d;
}

struct Link {
  double bw = 1e9;   // bytes/s
  double bg = 0.0;   // fraction taken by background traffic
  double free_at = 0;
  uint64_t bytes = 0, ops = 0;
  double busy = 0, first = -1, last = 0;
  std::vector<std::array<double, 3>> resv;  // (start, end, bytes) since the last reset, for window accounting
};

struct Model {
  int ndev = 4;
  double latency = 5e-6;
  bool no_memops = false;
  std::mutex mu;                       // links, peers, stats
  std::vector<Link> pcie;              // [dev*2 + dir], dir 0 = H2D, 1 = D2H
  std::vector<Link> nvl;               // [dev] outgoing NVLink port
  std::vector<char> can_peer;          // [a*ndev+b]
  std::vector<char> peer_on;           // [a*ndev+b] access enabled from a to b
  uint64_t spin_kernels = 0, memop_waits = 0, host_fns = 0, staged_peer = 0;
  Model() {
    ndev = std::max(1, (int)env_d("MODEL_NDEV", 4));
    latency = env_d("MODEL_OP_LATENCY_US", 5) * 1e-6;
    no_memops = env_d("MODEL_NO_MEMOPS", 0) != 0;
    double bw = env_d("MODEL_LINK_GBPS", 1.0) * 1e9, nv = env_d("MODEL_NVLINK_GBPS", 10.0) * 1e9;
    pcie.resize(ndev * 2);
    nvl.resize(ndev);
    for (auto& l : pcie) l.bw = bw;
    for (auto& l : nvl) l.bw = nv;
    can_peer.assign(ndev * ndev, 0);
    peer_on.assign(ndev * ndev, 0);
    std::string peers = getenv("MODEL_PEERS") ? getenv("MODEL_PEERS") : "all";
    if (peers == "all") {
      for (int a = 0; a < ndev; a++)
        for (int b = 0; b < ndev; b++) can_peer[a * ndev + b] = a != b;
    } else if (peers != "none") {
      int a, b, n;
      const char* p = peers.c_str();
      while (sscanf(p, "%d-%d%n", &a, &b, &n) == 2) {
        if (a >= 0 && b >= 0 && a < ndev && b < ndev && a != b) can_peer[a * ndev + b] = can_peer[b * ndev + a] = 1;
        p += n;
        if (*p == ',') p++;
      }
    }
    if (const char* bg = getenv("MODEL_BG")) {
      std::string s = bg;
      size_t pos = 0;
      while (pos < s.size()) {
        size_t e = s.find(',', pos);
        std::string item = s.substr(pos, e == std::string::npos ? std::string::npos : e - pos);
        int link;
        char dir[8];
        double frac;
        if (sscanf(item.c_str(), "%d:%7[a-z2]:%lf", &link, dir, &frac) == 3 && link >= 0 && link < ndev)
          pcie[link * 2 + (strcmp(dir, "d2h") == 0)].bg = std::min(0.99, std::max(0.0, frac));
        if (e == std::string::npos) break;
        pos = e + 1;
      }
    }
  }
  // Reserves a slot on a link timeline starting no earlier than `not_before`; returns the end time.
  double reserve(Link& l, size_t bytes, double not_before) {
    double start = std::max(not_before, l.free_at);
    double dur = latency + (double)bytes / (l.bw * (1.0 - l.bg));
    l.free_at = start + dur;
    l.bytes += bytes;
    l.ops++;
    l.busy += dur;
    if (l.first < 0 || start < l.first) l.first = start;
    l.last = std::max(l.last, start + dur);
    if (l.resv.size() < 1000000) l.resv.push_back({start, start + dur, (double)bytes});
    return start + dur;
  }
};
Model& M() {
  static Model* m = new Model;  // never destroyed: worker threads may outlive static destruction
  return *m;
}

// ---- allocations
struct Alloc {
  size_t size;
  int type;  // cudaMemoryTypeHost or cudaMemoryTypeDevice
  int dev;
  bool owned;
};
std::mutex g_alloc_mu;
std::map<uintptr_t, Alloc> g_allocs;

bool lookup(const void* p, Alloc* out) {
  std::lock_guard<std::mutex> lk(g_alloc_mu);
  auto it = g_allocs.upper_bound((uintptr_t)p);
  if (it == g_allocs.begin()) return false;
  --it;
  if ((uintptr_t)p >= it->first + it->second.size) return false;
  *out = it->second;
  return true;
}

thread_local int t_dev = 0;

// ---- events
struct Event {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0, completed = 0;
  void complete(uint64_t seq) {
    std::lock_guard<std::mutex> lk(mu);
    completed = std::max(completed, seq);
    cv.notify_all();
  }
  void wait(uint64_t seq) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return completed >= seq; });
  }
};

// ---- streams
struct Stream {
  int dev;
  std::mutex mu;
  std::condition_variable cv, idle;
  // Each op gets its enqueue time and the stream's virtual time: it starts (in the model) at
  // max(enqueue time, end of the previous op), so back-to-back copies on one stream leave no gap on the link,
  // as with a DMA engine's queue, however late this thread wakes up. Copies return their modelled end time.
  struct Op {
    double enq;
    std::function<double(double)> run;
  };
  std::deque<Op> ops;
  double v_end = 0;
  uint64_t enq = 0, done = 0;
  bool destroyed = false;
  explicit Stream(int d) : dev(d) {
    std::thread([this] { run(); }).detach();
  }
  void run() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return !ops.empty() || destroyed; });
      if (ops.empty()) return;  // destroyed and drained (object leaked on purpose)
      Op op = std::move(ops.front());
      ops.pop_front();
      double start = std::max(op.enq, v_end);
      lk.unlock();
      double end = op.run(start);
      lk.lock();
      v_end = end;
      done++;
      idle.notify_all();
    }
  }
  uint64_t push_timed(std::function<double(double)> f) {
    std::lock_guard<std::mutex> lk(mu);
    ops.push_back({now_s(), std::move(f)});
    cv.notify_one();
    return ++enq;
  }
  uint64_t push(std::function<void()> f) {  // an op that takes real time (host function, wait, event)
    return push_timed([f = std::move(f)](double) {
      f();
      return now_s();
    });
  }
  void sync_to(uint64_t seq) {
    std::unique_lock<std::mutex> lk(mu);
    idle.wait(lk, [&] { return done >= seq; });
  }
  void sync() {
    uint64_t target;
    {
      std::lock_guard<std::mutex> lk(mu);
      target = enq;
    }
    sync_to(target);
  }
};

std::mutex g_streams_mu;
std::vector<Stream*> g_all_streams;
std::vector<Stream*>& default_streams() {
  static std::vector<Stream*>* v = [] {
    auto* d = new std::vector<Stream*>;
    std::lock_guard<std::mutex> lk(g_streams_mu);
    for (int i = 0; i < M().ndev; i++) {
      d->push_back(new Stream(i));
      g_all_streams.push_back(d->back());
    }
    return d;
  }();
  return *v;
}
Stream* S(cudaStream_t s) {
  if ((uintptr_t)s <= 2) return default_streams()[t_dev];
  return reinterpret_cast<Stream*>(s);
}

// ---- call log (what reached the "native" copy entry points)
struct CallRec {
  int api;  // 0 cudaMemcpy, 1 cudaMemcpyAsync, 2 cudaMemcpyPeerAsync
  void* dst;
  const void* src;
  size_t count;
  int kind;
  void* stream;
};
std::mutex g_log_mu;
std::vector<CallRec> g_log;
std::atomic<uint64_t> g_calls[3];
void log_call(int api, void* dst, const void* src, size_t n, int kind, void* stream) {
  g_calls[api]++;
  std::lock_guard<std::mutex> lk(g_log_mu);
  if (g_log.size() < 100000) g_log.push_back({api, dst, src, n, kind, stream});
}

// Location of a pointer: -1 host, otherwise device index.
int where(const void* p, bool* pinned) {
  Alloc a;
  if (lookup(p, &a)) {
    if (pinned) *pinned = a.type == cudaMemoryTypeHost;
    return a.type == cudaMemoryTypeDevice ? a.dev : -1;
  }
  if (pinned) *pinned = false;
  return -1;
}

// Moves the bytes and waits until the link model says the copy is done (runs on a stream thread).
double timed_copy(double t, void* dst, const void* src, size_t n, int src_loc, int dst_loc) {
  Model& m = M();
  double end;
  {
    std::lock_guard<std::mutex> lk(m.mu);
    if (src_loc < 0 && dst_loc >= 0) {
      end = m.reserve(m.pcie[dst_loc * 2 + 0], n, t);
    } else if (src_loc >= 0 && dst_loc < 0) {
      end = m.reserve(m.pcie[src_loc * 2 + 1], n, t);
    } else if (src_loc >= 0 && dst_loc >= 0 && src_loc != dst_loc) {
      int a = src_loc, b = dst_loc;
      if (m.peer_on[a * m.ndev + b] || m.peer_on[b * m.ndev + a]) {
        end = m.reserve(m.nvl[a], n, t);
      } else {  // staged through host memory: D2H on the source link, then H2D on the destination link
        m.staged_peer++;
        double mid = m.reserve(m.pcie[a * 2 + 1], n, t);
        end = m.reserve(m.pcie[b * 2 + 0], n, mid);
      }
    } else {
      end = t + m.latency;  // device-local or host-local
    }
  }
  if (n) memmove(dst, src, n);
  sleep_until_s(end);
  return end;
}

cudaError_t enqueue_copy(void* dst, const void* src, size_t n, int kind, cudaStream_t stream, bool sync) {
  if (n == 0) return cudaSuccess;
  if (!dst || !src) return cudaErrorInvalidValue;
  bool dpin, spin;
  int dl = where(dst, &dpin), sl = where(src, &spin);
  if (kind == cudaMemcpyHostToDevice && !(sl < 0 && dl >= 0)) return cudaErrorInvalidValue;
  if (kind == cudaMemcpyDeviceToHost && !(sl >= 0 && dl < 0)) return cudaErrorInvalidValue;
  if (kind < 0 || kind > 4) return cudaErrorInvalidValue;
  bool pageable = (sl < 0 && !spin) || (dl < 0 && !dpin);
  Stream* s = S(stream);
  uint64_t seq = s->push_timed([=](double t) { return timed_copy(t, dst, src, n, sl, dl); });
  if (sync || pageable) s->sync_to(seq);  // pageable host memory: returns when done, like the real runtime
  return cudaSuccess;
}

// Spin kernel / memop: waits until (int32)(*flag - value) >= 0.
void wait_value(const volatile uint32_t* flag, uint32_t value) {
  // Polls with a growing pause (20 us .. 500 us) so that many waiting streams do not starve a small machine.
  for (int us = 20; (int32_t)(__atomic_load_n(flag, __ATOMIC_ACQUIRE) - value) < 0; us = std::min(500, us * 2))
    std::this_thread::sleep_for(std::chrono::microseconds(us));
}

struct ModelFunc {
  int kind;  // 1 = mma_spin_wait
};
ModelFunc g_spin_fn{1};
int g_module_dummy;

}  // namespace

// ================= runtime API =================
API cudaError_t cudaGetDeviceCount(int* n) {
  *n = M().ndev;
  return cudaSuccess;
}
API cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= M().ndev) return cudaErrorInvalidDevice;
  t_dev = d;
  return cudaSuccess;
}
API cudaError_t cudaGetDevice(int* d) {
  *d = t_dev;
  return cudaSuccess;
}
API cudaError_t cudaGetLastError(void) { return cudaSuccess; }
API cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
API const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "model error"; }
API cudaError_t cudaDeviceSynchronize(void) {
  std::vector<Stream*> v;
  default_streams();
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    for (auto* s : g_all_streams)
      if (s->dev == t_dev) v.push_back(s);
  }
  for (auto* s : v) s->sync();
  return cudaSuccess;
}

API cudaError_t cudaMalloc(void** p, size_t n) {
  void* m = aligned_alloc(256, (std::max<size_t>(n, 1) + 255) / 256 * 256);
  if (!m) return cudaErrorMemoryAllocation;
  std::lock_guard<std::mutex> lk(g_alloc_mu);
  g_allocs[(uintptr_t)m] = {std::max<size_t>(n, 1), cudaMemoryTypeDevice, t_dev, true};
  *p = m;
  return cudaSuccess;
}
API cudaError_t cudaHostAlloc(void** p, size_t n, unsigned) {
  void* m = aligned_alloc(4096, (std::max<size_t>(n, 1) + 4095) / 4096 * 4096);
  if (!m) return cudaErrorMemoryAllocation;
  std::lock_guard<std::mutex> lk(g_alloc_mu);
  g_allocs[(uintptr_t)m] = {std::max<size_t>(n, 1), cudaMemoryTypeHost, t_dev, true};
  *p = m;
  return cudaSuccess;
}
API cudaError_t cudaMallocHost(void** p, size_t n) { return cudaHostAlloc(p, n, 0); }
static cudaError_t free_any(void* p) {
  if (!p) return cudaSuccess;
  std::lock_guard<std::mutex> lk(g_alloc_mu);
  auto it = g_allocs.find((uintptr_t)p);
  if (it == g_allocs.end()) return cudaErrorInvalidValue;
  if (it->second.owned) free(p);
  g_allocs.erase(it);
  return cudaSuccess;
}
API cudaError_t cudaFree(void* p) { return free_any(p); }
API cudaError_t cudaFreeHost(void* p) { return free_any(p); }
API cudaError_t cudaHostRegister(void* p, size_t n, unsigned) {
  std::lock_guard<std::mutex> lk(g_alloc_mu);
  g_allocs[(uintptr_t)p] = {n, cudaMemoryTypeHost, t_dev, false};
  return cudaSuccess;
}
API cudaError_t cudaHostUnregister(void* p) { return free_any(p); }
API cudaError_t cudaHostGetDevicePointer(void** d, void* h, unsigned) {
  *d = h;
  return cudaSuccess;
}
API cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  memset(a, 0, sizeof(*a));
  Alloc al;
  if (lookup(p, &al)) {
    a->type = al.type;
    a->device = al.dev;
    a->devicePointer = const_cast<void*>(p);
    a->hostPointer = al.type == cudaMemoryTypeHost ? const_cast<void*>(p) : nullptr;
  } else {
    a->type = cudaMemoryTypeUnregistered;
    a->device = -2;
    a->hostPointer = const_cast<void*>(p);
  }
  return cudaSuccess;
}

API cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, cudaMemcpyKind kind) {
  log_call(0, dst, src, n, kind, nullptr);
  return enqueue_copy(dst, src, n, kind, nullptr, true);
}
API cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s) {
  log_call(1, dst, src, n, kind, s);
  return enqueue_copy(dst, src, n, kind, s, false);
}
API cudaError_t cudaMemcpyPeerAsync(void* dst, int dd, const void* src, int sd, size_t n, cudaStream_t s) {
  log_call(2, dst, src, n, cudaMemcpyDeviceToDevice, s);
  if (dd < 0 || sd < 0 || dd >= M().ndev || sd >= M().ndev) return cudaErrorInvalidDevice;
  if (where(dst, nullptr) != dd || where(src, nullptr) != sd) return cudaErrorInvalidValue;
  return enqueue_copy(dst, src, n, cudaMemcpyDeviceToDevice, s, false);
}

API cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  auto* st = new Stream(t_dev);
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    g_all_streams.push_back(st);
  }
  *s = reinterpret_cast<cudaStream_t>(st);
  return cudaSuccess;
}
API cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }
API cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if ((uintptr_t)s <= 2) return cudaErrorInvalidResourceHandle;
  Stream* st = S(s);
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    g_all_streams.erase(std::remove(g_all_streams.begin(), g_all_streams.end(), st), g_all_streams.end());
  }
  std::lock_guard<std::mutex> lk(st->mu);
  st->destroyed = true;
  st->cv.notify_all();
  return cudaSuccess;
}
API cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  S(s)->sync();
  return cudaSuccess;
}
API cudaError_t cudaStreamQuery(cudaStream_t s) {
  Stream* st = S(s);
  std::lock_guard<std::mutex> lk(st->mu);
  return st->done >= st->enq ? cudaSuccess : cudaErrorNotReady;
}
API cudaError_t cudaStreamGetDevice(cudaStream_t s, int* d) {
  *d = S(s)->dev;
  return cudaSuccess;
}
API cudaError_t cudaStreamIsCapturing(cudaStream_t, int* status) {
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
API cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* data) {
  S(s)->push([=] {
    {
      std::lock_guard<std::mutex> lk(M().mu);
      M().host_fns++;
    }
    fn(data);
  });
  return cudaSuccess;
}
API cudaError_t cudaStreamAddCallback(cudaStream_t s, cudaStreamCallback_t cb, void* data, unsigned) {
  S(s)->push([=] { cb(s, cudaSuccess, data); });
  return cudaSuccess;
}

API cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = reinterpret_cast<cudaEvent_t>(new Event);
  return cudaSuccess;
}
API cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
API cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }  // leaked: a stream op may still hold it
API cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  Event* ev = reinterpret_cast<Event*>(e);
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lk(ev->mu);
    seq = ++ev->recorded;
  }
  S(s)->push([=] { ev->complete(seq); });
  return cudaSuccess;
}
API cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  Event* ev = reinterpret_cast<Event*>(e);
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lk(ev->mu);
    seq = ev->recorded;
  }
  ev->wait(seq);
  return cudaSuccess;
}
API cudaError_t cudaEventQuery(cudaEvent_t e) {
  Event* ev = reinterpret_cast<Event*>(e);
  std::lock_guard<std::mutex> lk(ev->mu);
  return ev->completed >= ev->recorded ? cudaSuccess : cudaErrorNotReady;
}
API cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  Event* ev = reinterpret_cast<Event*>(e);
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lk(ev->mu);
    seq = ev->recorded;
  }
  S(s)->push([=] { ev->wait(seq); });
  return cudaSuccess;
}

API cudaError_t cudaDeviceCanAccessPeer(int* can, int dev, int peer) {
  Model& m = M();
  if (dev < 0 || peer < 0 || dev >= m.ndev || peer >= m.ndev) return cudaErrorInvalidDevice;
  *can = m.can_peer[dev * m.ndev + peer];
  return cudaSuccess;
}
API cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned) {
  Model& m = M();
  if (peer < 0 || peer >= m.ndev || !m.can_peer[t_dev * m.ndev + peer]) return cudaErrorInvalidDevice;
  std::lock_guard<std::mutex> lk(m.mu);
  if (m.peer_on[t_dev * m.ndev + peer]) return cudaErrorPeerAccessAlreadyEnabled;
  m.peer_on[t_dev * m.ndev + peer] = 1;
  return cudaSuccess;
}

// ================= driver API pieces =================
API CUresult cuStreamWaitValue32(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) {
  if (M().no_memops) return CUDA_ERROR_NOT_SUPPORTED;
  if (flags != CU_STREAM_WAIT_VALUE_GEQ) return CUDA_ERROR_INVALID_VALUE;
  {
    std::lock_guard<std::mutex> lk(M().mu);
    M().memop_waits++;
  }
  auto* flag = reinterpret_cast<const volatile uint32_t*>(addr);
  S(reinterpret_cast<cudaStream_t>(s))->push([=] { wait_value(flag, value); });
  return CUDA_SUCCESS;
}
API CUresult cuStreamWaitValue32_v2(CUstream s, CUdeviceptr addr, uint32_t value, unsigned flags) {
  return cuStreamWaitValue32(s, addr, value, flags);
}
API CUresult cuModuleLoadData(CUmodule* m, const void* image) {
  if (!image || !strstr(static_cast<const char*>(image), ".entry mma_spin_wait")) return CUDA_ERROR_INVALID_VALUE;
  *m = reinterpret_cast<CUmodule>(&g_module_dummy);
  return CUDA_SUCCESS;
}
API CUresult cuModuleGetFunction(CUfunction* f, CUmodule, const char* name) {
  if (strcmp(name, "mma_spin_wait") != 0) return CUDA_ERROR_NOT_FOUND;
  *f = reinterpret_cast<CUfunction>(&g_spin_fn);
  return CUDA_SUCCESS;
}
API CUresult cuLaunchKernel(CUfunction f, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            CUstream s, void** params, void**) {
  if (reinterpret_cast<ModelFunc*>(f) != &g_spin_fn || !params) return CUDA_ERROR_INVALID_VALUE;
  auto* flag = reinterpret_cast<const volatile uint32_t*>(*static_cast<unsigned long long*>(params[0]));
  uint32_t value = *static_cast<uint32_t*>(params[1]);
  {
    std::lock_guard<std::mutex> lk(M().mu);
    M().spin_kernels++;
  }
  S(reinterpret_cast<cudaStream_t>(s))->push([=] { wait_value(flag, value); });
  return CUDA_SUCCESS;
}
API CUresult cuMemGetAccess(unsigned long long*, const CUmemLocation*, CUdeviceptr) {
  return CUDA_ERROR_INVALID_VALUE;  // no VMM allocations in the model
}

// ================= model control for tests =================
API void mmaModelSetBackground(int link, int dir, double frac) {
  Model& m = M();
  std::lock_guard<std::mutex> lk(m.mu);
  if (link >= 0 && link < m.ndev && (dir == 0 || dir == 1)) m.pcie[link * 2 + dir].bg = frac;
}
API double mmaModelNow(void) { return now_s(); }
API void mmaModelResetStats(void) {
  Model& m = M();
  std::lock_guard<std::mutex> lk(m.mu);
  for (auto* v : {&m.pcie, &m.nvl})
    for (auto& l : *v) {
      l.bytes = l.ops = 0;
      l.busy = 0;
      l.first = -1;
      l.last = 0;
      l.resv.clear();
    }
  m.spin_kernels = m.memop_waits = m.host_fns = m.staged_peer = 0;
}
// Stream op that blocks the stream for `us` microseconds (a stand-in for a long kernel).
API void mmaModelStreamSleep(cudaStream_t s, unsigned us) {
  S(s)->push([=] { std::this_thread::sleep_for(std::chrono::microseconds(us)); });
}
API int mmaModelStatsJson(char* buf, int len) {
  Model& m = M();
  std::lock_guard<std::mutex> lk(m.mu);
  std::string o = "{\"ndev\":" + std::to_string(m.ndev) + ",\"links\":[";
  auto link = [](const Link& l) {
    char b[256];
    snprintf(b, sizeof b, "{\"bytes\":%llu,\"ops\":%llu,\"busy\":%.6f,\"first\":%.6f,\"last\":%.6f,\"bw\":%.0f,\"bg\":%.3f}",
             (unsigned long long)l.bytes, (unsigned long long)l.ops, l.busy, l.first, l.last, l.bw, l.bg);
    return std::string(b);
  };
  for (int d = 0; d < m.ndev; d++)
    o += std::string(d ? "," : "") + "{\"h2d\":" + link(m.pcie[d * 2]) + ",\"d2h\":" + link(m.pcie[d * 2 + 1]) +
         ",\"nvlink\":" + link(m.nvl[d]) + "}";
  // Per direction: throughput over [first start, last end] of all links ("window"), and over the steady part
  // [first start, earliest last end among the links used] ("steady": while every used link still had work).
  for (int dir = 0; dir < 2; dir++) {
    double first = -1, last = 0, min_last = 1e300;
    double bytes = 0;
    for (int d = 0; d < m.ndev; d++) {
      const Link& l = m.pcie[d * 2 + dir];
      if (!l.bytes) continue;
      first = first < 0 ? l.first : std::min(first, l.first);
      last = std::max(last, l.last);
      min_last = std::min(min_last, l.last);
      bytes += (double)l.bytes;
    }
    double steady_bytes = 0;
    for (int d = 0; d < m.ndev && first >= 0; d++)
      for (auto& r : m.pcie[d * 2 + dir].resv) {
        double a = std::max(r[0], first), b = std::min(r[1], min_last);
        if (b > a) steady_bytes += r[2] * (b - a) / (r[1] - r[0]);
      }
    char b[256];
    snprintf(b, sizeof b, "%s\"%s\":{\"window_gbps\":%.6f,\"steady_gbps\":%.6f,\"window_s\":%.6f,\"steady_s\":%.6f}",
             dir ? "," : "],", dir ? "d2h" : "h2d", first >= 0 && last > first ? bytes / (last - first) / 1e9 : 0.0,
             first >= 0 && min_last > first ? steady_bytes / (min_last - first) / 1e9 : 0.0,
             first >= 0 ? last - first : 0.0, first >= 0 ? min_last - first : 0.0);
    o += b;
  }
  o += ",\"spin_kernels\":" + std::to_string(m.spin_kernels) + ",\"memop_waits\":" + std::to_string(m.memop_waits) +
       ",\"host_fns\":" + std::to_string(m.host_fns) + ",\"staged_peer\":" + std::to_string(m.staged_peer) +
       ",\"calls\":[" + std::to_string(g_calls[0].load()) + "," + std::to_string(g_calls[1].load()) + "," +
       std::to_string(g_calls[2].load()) + "],\"now\":" + std::to_string(now_s()) + "}";
  snprintf(buf, len, "%s", o.c_str());
  return (int)o.size();
}
// Copies out the log of calls that reached the model's copy entry points (api, dst, src, count, kind, stream).
API int mmaModelCallLog(void* out, int max) {
  std::lock_guard<std::mutex> lk(g_log_mu);
  int n = std::min<int>(max, (int)g_log.size());
  memcpy(out, g_log.data(), n * sizeof(CallRec));
  return n;
}
API void mmaModelClearCallLog(void) {
  std::lock_guard<std::mutex> lk(g_log_mu);
  g_log.clear();
}
