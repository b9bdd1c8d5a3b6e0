// libmma_preload.so: multipath host<->GPU copies for unmodified CUDA programs (LD_PRELOAD).
//
// Interposes cudaMemcpy and cudaMemcpyAsync. Host<->device copies at or above a threshold are replaced on the
// user's stream by a "dummy task": a host function that releases the copy to the multipath engine, followed by a
// stream wait on a host-mapped flag (cuStreamWaitValue32, or a spin kernel from embedded PTX where memory ops are
// not supported). The engine splits the copy into chunks, queues them per destination GPU, and one outstanding
// queue per PCIe path (link, direction) pulls chunks: its own GPU's queue first (direct path), otherwise a relay for
// another GPU through a relay buffer on its own GPU and a peer copy. When every chunk has landed the flag is set
// and the user's stream continues. Everything else goes to the native entry point unchanged.
// No CUDA toolkit is needed: the few types are declared in cuda_min.h and the real entry points are resolved at run
// time (dlsym/dlvsym RTLD_NEXT, then the already loaded libcudart/libcuda).
#include "cuda_min.h"

#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#define MMA_EXPORT extern "C" __attribute__((visibility("default")))

namespace mma {

// ------------------------------------------------------------------ configuration
size_t parse_size(const char* v, size_t dflt) {
  if (!v || !*v) return dflt;
  char* end = nullptr;
  double x = strtod(v, &end);
  if (end == v || x < 0) return dflt;
  switch (*end) {
    case 'k': case 'K': x *= 1024; break;
    case 'm': case 'M': x *= 1024 * 1024; break;
    case 'g': case 'G': x *= 1024.0 * 1024 * 1024; break;
    default: break;
  }
  return (size_t)x;
}
long env_l(const char* n, long d) {
  const char* v = getenv(n);
  return v && *v ? strtol(v, nullptr, 10) : d;
}

struct Config {
  bool enable = true;
  size_t chunk[2] = {3u << 20, 5u << 20};  // [H2D, D2H]
  size_t threshold[2] = {0, 0};            // copies below go native; default 2 chunks
  int depth = 2;
  std::vector<int> paths;  // links allowed (empty = all)
  bool relay = true;
  int relay_min_chunks = 2;
  bool pageable = true;
  bool single_path = false;  // intercept even when a device has no second path
  std::string wait = "auto";
  int log_level = 1;
  long drain_ms = 5000;
  std::string stats_file;
  void load() {
    enable = env_l("MMA_ENABLE", 1) != 0;
    size_t c = parse_size(getenv("MMA_CHUNK"), 0);
    if (c) chunk[0] = chunk[1] = c;
    chunk[0] = std::max<size_t>(4096, parse_size(getenv("MMA_CHUNK_H2D"), chunk[0]));
    chunk[1] = std::max<size_t>(4096, parse_size(getenv("MMA_CHUNK_D2H"), chunk[1]));
    size_t t = parse_size(getenv("MMA_THRESHOLD"), 0);
    for (int d = 0; d < 2; d++) threshold[d] = t ? t : 2 * chunk[d];
    threshold[0] = parse_size(getenv("MMA_THRESHOLD_H2D"), threshold[0]);
    threshold[1] = parse_size(getenv("MMA_THRESHOLD_D2H"), threshold[1]);
    for (int d = 0; d < 2; d++) threshold[d] = std::max<size_t>(threshold[d], 1);
    depth = (int)std::max(1L, std::min(64L, env_l("MMA_QUEUE_DEPTH", 2)));
    if (const char* p = getenv("MMA_PATHS")) {
      if (*p && strcmp(p, "all") != 0) {
        std::string s = p;
        size_t pos = 0;
        while (pos <= s.size()) {
          size_t e = s.find(',', pos);
          std::string item = s.substr(pos, e == std::string::npos ? std::string::npos : e - pos);
          if (!item.empty()) paths.push_back(atoi(item.c_str()));
          if (e == std::string::npos) break;
          pos = e + 1;
        }
        if (paths.empty()) paths.push_back(-1);  // nothing allowed
      }
    }
    relay = env_l("MMA_RELAY", 1) != 0;
    relay_min_chunks = (int)std::max(1L, env_l("MMA_RELAY_MIN_CHUNKS", 2));
    pageable = env_l("MMA_PAGEABLE", 1) != 0;
    single_path = env_l("MMA_SINGLE_PATH", 0) != 0;
    if (const char* w = getenv("MMA_WAIT")) wait = w;
    log_level = (int)env_l("MMA_LOG_LEVEL", 1);
    drain_ms = env_l("MMA_DRAIN_TIMEOUT_MS", 5000);
    if (const char* f = getenv("MMA_STATS_FILE")) stats_file = f;
  }
  bool path_allowed(int link) const {
    return paths.empty() || std::find(paths.begin(), paths.end(), link) != paths.end();
  }
};
Config cfg;

void logf(int level, const char* fmt, ...) {
  if (cfg.log_level < level) return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stderr, "[mma %d] %s\n", (int)getpid(), buf);
}

// ------------------------------------------------------------------ real entry points
struct Real {
  cudaError_t (*memcpy_)(void*, const void*, size_t, cudaMemcpyKind) = nullptr;
  cudaError_t (*memcpyAsync)(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t) = nullptr;
  cudaError_t (*memcpyPeerAsync)(void*, int, const void*, int, size_t, cudaStream_t) = nullptr;
  cudaError_t (*getDeviceCount)(int*) = nullptr;
  cudaError_t (*setDevice)(int) = nullptr;
  cudaError_t (*getDevice)(int*) = nullptr;
  cudaError_t (*pointerGetAttributes)(cudaPointerAttributes*, const void*) = nullptr;
  cudaError_t (*getLastError)() = nullptr;
  cudaError_t (*peekAtLastError)() = nullptr;
  cudaError_t (*launchHostFunc)(cudaStream_t, cudaHostFn_t, void*) = nullptr;
  cudaError_t (*streamCreateWithFlags)(cudaStream_t*, unsigned) = nullptr;
  cudaError_t (*streamIsCapturing)(cudaStream_t, int*) = nullptr;
  cudaError_t (*streamGetDevice)(cudaStream_t, int*) = nullptr;
  cudaError_t (*eventCreateWithFlags)(cudaEvent_t*, unsigned) = nullptr;
  cudaError_t (*eventRecord)(cudaEvent_t, cudaStream_t) = nullptr;
  cudaError_t (*eventSynchronize)(cudaEvent_t) = nullptr;
  cudaError_t (*malloc_)(void**, size_t) = nullptr;
  cudaError_t (*hostAlloc)(void**, size_t, unsigned) = nullptr;
  cudaError_t (*hostGetDevicePointer)(void**, void*, unsigned) = nullptr;
  cudaError_t (*deviceCanAccessPeer)(int*, int, int) = nullptr;
  cudaError_t (*deviceEnablePeerAccess)(int, unsigned) = nullptr;
  // driver
  CUresult (*cuStreamWaitValue32)(CUstream, CUdeviceptr, uint32_t, unsigned) = nullptr;
  CUresult (*cuModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**) = nullptr;
  CUresult (*cuMemGetAccess)(unsigned long long*, const CUmemLocation*, CUdeviceptr) = nullptr;
};
Real real;

const char* const kCudartVersions[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"};

void* self_handle() {
  static void* h = [] {
    Dl_info info;
    if (dladdr((void*)&self_handle, &info) && info.dli_fname) return dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    return (void*)nullptr;
  }();
  return h;
}

void* cudart_sym(const char* name) {
  void* own = self_handle() ? dlsym(self_handle(), name) : nullptr;
  auto ok = [&](void* p) { return p && p != own; };
  for (const char* v : kCudartVersions) {
    void* p = dlvsym(RTLD_NEXT, name, v);
    if (ok(p)) return p;
  }
  void* p = dlsym(RTLD_NEXT, name);
  if (ok(p)) return p;
  // libcudart loaded as a dependency of an RTLD_LOCAL module (e.g. torch) is not in the global scope.
  const char* names[] = {getenv("MMA_CUDART"), "libcudart.so.13", "libcudart.so.12", "libcudart.so"};
  for (const char* n : names) {
    if (!n || !*n) continue;
    void* h = dlopen(n, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) continue;
    p = dlsym(h, name);
    if (ok(p)) return p;
  }
  return nullptr;
}

void* driver_sym(const char* name) {
  void* p = dlsym(RTLD_DEFAULT, name);
  if (p) return p;
  for (int flags : {RTLD_LAZY | RTLD_NOLOAD, RTLD_LAZY}) {
    void* h = dlopen("libcuda.so.1", flags);
    if (h && (p = dlsym(h, name))) return p;
  }
  return nullptr;
}

template <class F>
void load(F& f, const char* name) {
  f = reinterpret_cast<F>(cudart_sym(name));
}
template <class F>
void load_drv(F& f, const char* name, const char* alt = nullptr) {
  f = reinterpret_cast<F>(alt ? driver_sym(alt) : nullptr);
  if (!f) f = reinterpret_cast<F>(driver_sym(name));
}

std::once_flag g_resolve_once;
bool g_resolved_ok = false;
void resolve() {
  std::call_once(g_resolve_once, [] {
    load(real.memcpy_, "cudaMemcpy");
    load(real.memcpyAsync, "cudaMemcpyAsync");
    load(real.memcpyPeerAsync, "cudaMemcpyPeerAsync");
    load(real.getDeviceCount, "cudaGetDeviceCount");
    load(real.setDevice, "cudaSetDevice");
    load(real.getDevice, "cudaGetDevice");
    load(real.pointerGetAttributes, "cudaPointerGetAttributes");
    load(real.getLastError, "cudaGetLastError");
    load(real.peekAtLastError, "cudaPeekAtLastError");
    load(real.launchHostFunc, "cudaLaunchHostFunc");
    load(real.streamCreateWithFlags, "cudaStreamCreateWithFlags");
    load(real.streamIsCapturing, "cudaStreamIsCapturing");
    load(real.streamGetDevice, "cudaStreamGetDevice");
    load(real.eventCreateWithFlags, "cudaEventCreateWithFlags");
    load(real.eventRecord, "cudaEventRecord");
    load(real.eventSynchronize, "cudaEventSynchronize");
    load(real.malloc_, "cudaMalloc");
    load(real.hostAlloc, "cudaHostAlloc");
    load(real.hostGetDevicePointer, "cudaHostGetDevicePointer");
    load(real.deviceCanAccessPeer, "cudaDeviceCanAccessPeer");
    load(real.deviceEnablePeerAccess, "cudaDeviceEnablePeerAccess");
    load_drv(real.cuStreamWaitValue32, "cuStreamWaitValue32", "cuStreamWaitValue32_v2");
    load_drv(real.cuModuleLoadData, "cuModuleLoadData");
    load_drv(real.cuModuleGetFunction, "cuModuleGetFunction");
    load_drv(real.cuLaunchKernel, "cuLaunchKernel");
    load_drv(real.cuMemGetAccess, "cuMemGetAccess");
    g_resolved_ok = real.memcpyAsync && real.memcpyPeerAsync && real.getDeviceCount && real.setDevice &&
                    real.getDevice && real.pointerGetAttributes && real.launchHostFunc &&
                    real.streamCreateWithFlags && real.eventCreateWithFlags && real.eventRecord &&
                    real.eventSynchronize && real.malloc_ && real.hostAlloc && real.hostGetDevicePointer &&
                    real.deviceCanAccessPeer && real.deviceEnablePeerAccess;
  });
}

// ------------------------------------------------------------------ spin kernel (fallback stream wait)
// Waits until (int32)(*flag - value) >= 0, like CU_STREAM_WAIT_VALUE_GEQ. Two targets, newest first.
const char* const kSpinPtx[] = {
    ".version 7.0\n.target sm_70\n.address_size 64\n"
    ".visible .entry mma_spin_wait(.param .u64 p0, .param .u32 p1)\n{\n"
    " .reg .pred %p<2>;\n .reg .b32 %r<4>;\n .reg .b64 %rd<3>;\n"
    " ld.param.u64 %rd1, [p0];\n ld.param.u32 %r1, [p1];\n cvta.to.global.u64 %rd2, %rd1;\n"
    "$L_spin:\n ld.volatile.global.u32 %r2, [%rd2];\n sub.s32 %r3, %r2, %r1;\n setp.lt.s32 %p1, %r3, 0;\n"
    " @%p1 nanosleep.u32 200;\n @%p1 bra $L_spin;\n ret;\n}\n",
    ".version 6.0\n.target sm_50\n.address_size 64\n"
    ".visible .entry mma_spin_wait(.param .u64 p0, .param .u32 p1)\n{\n"
    " .reg .pred %p<2>;\n .reg .b32 %r<4>;\n .reg .b64 %rd<3>;\n"
    " ld.param.u64 %rd1, [p0];\n ld.param.u32 %r1, [p1];\n cvta.to.global.u64 %rd2, %rd1;\n"
    "$L_spin:\n ld.volatile.global.u32 %r2, [%rd2];\n sub.s32 %r3, %r2, %r1;\n setp.lt.s32 %p1, %r3, 0;\n"
    " @%p1 bra $L_spin;\n ret;\n}\n",
};

// ------------------------------------------------------------------ engine
enum { H2D = 0, D2H = 1 };
const char* dir_name(int d) { return d == H2D ? "h2d" : "d2h"; }
constexpr int kSlots = 4096;
constexpr int kMaxDev = 64;

struct Task {
  int dev = 0, dir = 0;
  char* host = nullptr;
  char* dptr = nullptr;
  size_t bytes = 0, chunk = 0;
  size_t next_off = 0;  // first byte not yet handed to a path
  int chunks_left = 0;  // chunks not yet landed
  int slot = -1;
  uint32_t gen = 0;
  uint64_t relay_mask = ~0ull;  // links that may relay for this task
  bool released = false, completed = false, waiter = false, abandoned = false;
  int refs = 1;  // engine reference, +1 while a caller blocks on it
  size_t waiting_chunks() const { return (bytes - next_off + chunk - 1) / chunk; }
};

struct Inflight {
  Task* t;
  size_t off, len;
  cudaEvent_t ev;
  bool relay;
  double t_launch;
};

double mono_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct PathStats {
  uint64_t direct_bytes = 0, relay_bytes = 0, chunks = 0, relay_chunks = 0;
};

struct Path {
  int link = 0, dir = 0;
  cudaStream_t direct = nullptr, relay[2] = {nullptr, nullptr};
  char* relay_buf[2] = {nullptr, nullptr};
  int relay_rr = 0;
  std::vector<cudaEvent_t> events;
  uint64_t seq = 0;
  int inflight_n = 0;  // chunks taken (launching or in flight)
  size_t out_bytes = 0;  // bytes taken and not landed
  // Passive congestion inference: the path's service rate (bytes/s) = bytes landed / time the path was occupied
  // (had chunks outstanding), both decayed per completion so that the estimate follows the last ~10 chunks.
  double rate = 0, mark = 0, acc_b = 0, acc_t = 0;
  std::deque<Inflight> inflight;
  std::condition_variable cv_comp;
  std::thread submit, complete;
  PathStats st;
  bool ok = false;
};

struct Stats {  // engine counters, under E->mu
  uint64_t intercepted[2] = {0, 0}, intercepted_bytes[2] = {0, 0};
  uint64_t waits_memop = 0, waits_spin = 0, waits_host = 0, sync_calls = 0;
  uint64_t abandoned = 0, errors = 0;
};
struct Fallbacks {  // counted with or without an engine
  std::atomic<uint64_t> fallback{0}, fallback_bytes{0};
  std::atomic<uint64_t> fb_small{0}, fb_kind{0}, fb_memtype{0}, fb_capture{0}, fb_single_path{0}, fb_disabled{0},
      fb_no_slot{0}, fb_error{0}, fb_stopping{0};
};
Fallbacks g_fb;
std::atomic<bool> g_stats_written{false};

struct Engine {
  std::mutex mu;
  std::condition_variable cv_sub[2], cv_done;
  int ndev = 0;
  std::vector<Path*> paths;                  // paths[link*2+dir] (nullptr if not usable)
  std::vector<std::deque<Task*>> queue;      // [dev*2+dir] released tasks
  std::vector<size_t> queue_chunks;          // [dev*2+dir] chunks waiting
  std::vector<int> own_pending;              // [dev*2+dir] intercepted, not completed
  std::vector<char> peer_ok;                 // [link*ndev+dev] link may relay for dev
  std::vector<int> npaths;                   // [dev] usable paths for copies to/from dev
  std::unordered_set<Task*> pending;
  volatile uint32_t* flags = nullptr;        // host-mapped flag slots
  CUdeviceptr flags_dev = 0;
  std::vector<int> free_slots;
  uint32_t gens[kSlots] = {};
  bool stopping = false, exit_threads = false;
  Stats st;
  // stream wait mode: 0 memop, 1 spin, 2 host (caller blocks)
  std::atomic<int> wait_mode{0};
  std::mutex spin_mu;
  CUfunction spin_fn[kMaxDev] = {};
  bool spin_tried[kMaxDev] = {};
};
Engine* E = nullptr;  // leaked on purpose: threads and late host functions may touch it during exit
std::once_flag g_init_once;
bool g_engine_ok = false;
std::atomic<bool> g_child{false};           // forked from a process whose engine had started
std::atomic<bool> g_engine_started{false};
thread_local bool t_engine_thread = false;

void complete_task(Task* t);  // under E->mu

void drop_ref(Task* t) {  // under E->mu
  if (--t->refs == 0 && !t->abandoned) delete t;
}

// Paths that may serve chunks queued for device `dev` in direction d right now. Under E->mu.
bool serves(const Path& x, int dev, int d) {
  Engine& e = *E;
  if (x.link == dev) return true;
  if (!cfg.relay || !e.peer_ok[x.link * e.ndev + dev]) return false;
  if (e.own_pending[x.link * 2 + d] != 0 || e.queue_chunks[x.link * 2 + d] != 0) return false;
  if (e.queue_chunks[dev * 2 + d] < (size_t)cfg.relay_min_chunks) return false;
  const auto& q = e.queue[dev * 2 + d];
  return q.empty() || (q.front()->relay_mask >> x.link & 1);
}

// Tail balancing from the inferred path rates: path p takes a chunk of `len` bytes for queue `dev` when it is the
// path that would finish it first, or when its backlog with the chunk stays within the common finish time of the
// queued work spread over every path serving the queue (so a congested path does not hoard the last chunks while
// faster paths go idle). Under E->mu.
bool may_take(const Path& p, int dev, size_t len) {
  Engine& e = *E;
  int d = p.dir;
  double known = 0;
  int nk = 0;
  for (Path* x : e.paths)
    if (x && x->dir == d && x->rate > 0) known += x->rate, nk++;
  double dflt = nk ? known / nk : 1.0;
  auto rate = [&](const Path& x) { return x.rate > 0 ? x.rate : dflt; };
  if (p.link == dev && p.out_bytes == 0) return true;  // an idle direct path always takes: guarantees progress
  double mine = (double)(p.out_bytes + len) / rate(p);
  double best_other = 1e300, sum_rate = 0, sum_out = 0;
  for (Path* x : e.paths) {
    if (!x || x->dir != d || !serves(*x, dev, d)) continue;
    sum_rate += rate(*x);
    sum_out += (double)x->out_bytes;
    if (x != &p) best_other = std::min(best_other, (double)(x->out_bytes + len) / rate(*x));
  }
  if (mine <= best_other) return true;
  double work = (double)e.queue_chunks[dev * 2 + d] * (double)len;  // approximate bytes still queued
  double t_star = (work + sum_out) / std::max(sum_rate, 1e-9);
  return (double)(p.out_bytes + len) <= rate(p) * t_star + 0.5 * (double)len;
}

// Takes the next chunk for path p; returns false when there is nothing it may take. Under E->mu.
bool pick(Path& p, Inflight& out) {
  Engine& e = *E;
  int d = p.dir;
  int src_q = -1;
  if (e.queue_chunks[p.link * 2 + d] > 0) {
    src_q = p.link;  // direct path first
  } else if (cfg.relay && e.own_pending[p.link * 2 + d] == 0) {
    // Relay only while this GPU has no copies of its own pending, from the longest queue with a backlog.
    size_t best = 0;
    for (int i = 0; i < e.ndev; i++) {
      if (i == p.link || !e.peer_ok[p.link * e.ndev + i]) continue;
      size_t n = e.queue_chunks[i * 2 + d];
      if (n < (size_t)cfg.relay_min_chunks || n <= best) continue;
      if (!(e.queue[i * 2 + d].front()->relay_mask >> p.link & 1)) continue;
      best = n;
      src_q = i;
    }
  }
  if (src_q < 0) return false;
  auto& q = e.queue[src_q * 2 + d];
  Task* t = q.front();
  if (!may_take(p, src_q, std::min(t->chunk, t->bytes - t->next_off))) return false;
  out.t = t;
  out.off = t->next_off;
  out.len = std::min(t->chunk, t->bytes - t->next_off);
  out.relay = src_q != p.link;
  t->next_off += out.len;
  if (t->next_off >= t->bytes) q.pop_front();
  e.queue_chunks[src_q * 2 + d]--;
  return true;
}

cudaError_t launch(Path& p, Inflight& f) {
  Task* t = f.t;
  char* h = t->host + f.off;
  char* dv = t->dptr + f.off;
  cudaError_t r;
  cudaStream_t s;
  if (!f.relay) {
    s = p.direct;
    r = p.dir == H2D ? real.memcpyAsync(dv, h, f.len, cudaMemcpyHostToDevice, s)
                     : real.memcpyAsync(h, dv, f.len, cudaMemcpyDeviceToHost, s);
  } else {
    // Two relay pipelines per path: each has its own stream and one-chunk buffer; stream order protects reuse.
    int k = p.relay_rr;
    p.relay_rr ^= 1;
    s = p.relay[k];
    char* buf = p.relay_buf[k];
    if (p.dir == H2D) {
      r = real.memcpyAsync(buf, h, f.len, cudaMemcpyHostToDevice, s);
      if (r == cudaSuccess) r = real.memcpyPeerAsync(dv, t->dev, buf, p.link, f.len, s);
    } else {
      r = real.memcpyPeerAsync(buf, p.link, dv, t->dev, f.len, s);
      if (r == cudaSuccess) r = real.memcpyAsync(h, buf, f.len, cudaMemcpyDeviceToHost, s);
    }
  }
  f.ev = p.events[p.seq++ % p.events.size()];
  cudaError_t r2 = real.eventRecord(f.ev, s);
  return r != cudaSuccess ? r : r2;
}

void submit_loop(Path* pp) {
  t_engine_thread = true;
  Path& p = *pp;
  real.setDevice(p.link);
  Engine& e = *E;
  std::unique_lock<std::mutex> lk(e.mu);
  for (;;) {
    Inflight f{};
    if (e.exit_threads) break;
    if (p.inflight_n >= cfg.depth || !pick(p, f)) {
      e.cv_sub[p.dir].wait(lk);
      continue;
    }
    p.inflight_n++;
    f.t_launch = mono_s();
    if (p.out_bytes == 0) p.mark = f.t_launch;  // the path becomes occupied
    p.out_bytes += f.len;
    lk.unlock();
    cudaError_t r = launch(p, f);
    lk.lock();
    if (r != cudaSuccess) {
      e.st.errors++;
      logf(1, "chunk copy on path %d/%s failed: error %d", p.link, dir_name(p.dir), r);
    }
    p.inflight.push_back(f);
    p.cv_comp.notify_one();
  }
}

void complete_loop(Path* pp) {
  t_engine_thread = true;
  Path& p = *pp;
  real.setDevice(p.link);
  Engine& e = *E;
  std::unique_lock<std::mutex> lk(e.mu);
  for (;;) {
    p.cv_comp.wait(lk, [&] { return !p.inflight.empty() || e.exit_threads; });
    if (p.inflight.empty()) break;
    Inflight f = p.inflight.front();
    lk.unlock();
    real.eventSynchronize(f.ev);
    double now = mono_s();
    lk.lock();
    p.inflight.pop_front();
    p.inflight_n--;
    p.out_bytes -= f.len;
    p.acc_b = 0.9 * p.acc_b + (double)f.len;
    p.acc_t = 0.9 * p.acc_t + std::max(0.0, now - p.mark);
    p.mark = now;
    if (p.acc_t > 0) p.rate = p.acc_b / p.acc_t;
    p.st.chunks++;
    if (f.relay) {
      p.st.relay_bytes += f.len;
      p.st.relay_chunks++;
    } else {
      p.st.direct_bytes += f.len;
    }
    Task* t = f.t;
    if (--t->chunks_left == 0 && !t->completed) complete_task(t);
    if (t->chunks_left == 0) drop_ref(t);
    e.cv_sub[p.dir].notify_all();
  }
}

// Sets the task's flag (the user's stream continues) and wakes blocked callers. Under E->mu.
void complete_task(Task* t) {
  Engine& e = *E;
  t->completed = true;
  __atomic_store_n(const_cast<uint32_t*>(&e.flags[t->slot]), t->gen, __ATOMIC_RELEASE);
  e.free_slots.push_back(t->slot);
  e.own_pending[t->dev * 2 + t->dir]--;
  e.pending.erase(t);
  e.cv_done.notify_all();
  e.cv_sub[t->dir].notify_all();  // own_pending changed: relays may become allowed
}

// Host function on the user's stream: the stream reached the copy, hand it to the engine.
void release_cb(void* arg) {
  Task* t = static_cast<Task*>(arg);
  Engine& e = *E;
  std::lock_guard<std::mutex> lk(e.mu);
  if (t->completed) return;  // abandoned at shutdown
  if (e.exit_threads) {      // engine gone: let the stream go (data not copied; only during process exit)
    e.st.abandoned++;
    t->abandoned = true;
    complete_task(t);
    return;
  }
  t->released = true;
  e.queue[t->dev * 2 + t->dir].push_back(t);
  e.queue_chunks[t->dev * 2 + t->dir] += t->chunks_left;
  e.cv_sub[t->dir].notify_all();
}

void write_stats();

void shutdown() {
  if (!E || g_child) return;
  Engine& e = *E;
  {
    std::unique_lock<std::mutex> lk(e.mu);
    e.stopping = true;  // new copies go native
    bool drained = e.cv_done.wait_for(lk, std::chrono::milliseconds(cfg.drain_ms), [&] { return e.pending.empty(); });
    if (!drained) {
      // Let every waiting stream go so that nothing hangs in exit; their data is not complete.
      std::vector<Task*> left(e.pending.begin(), e.pending.end());
      for (Task* t : left) {
        e.st.abandoned++;
        t->abandoned = true;
        auto& q = e.queue[t->dev * 2 + t->dir];
        if (t->released && std::find(q.begin(), q.end(), t) != q.end()) {
          q.erase(std::find(q.begin(), q.end(), t));
          e.queue_chunks[t->dev * 2 + t->dir] -= t->waiting_chunks();
        }
        complete_task(t);
      }
      logf(1, "exit: %zu copies still pending after %ld ms were abandoned", left.size(), cfg.drain_ms);
    }
    e.exit_threads = true;
    e.cv_sub[0].notify_all();
    e.cv_sub[1].notify_all();
    for (Path* p : e.paths)
      if (p) p->cv_comp.notify_all();
  }
  for (Path* p : e.paths) {
    if (!p) continue;
    if (p->submit.joinable()) p->submit.join();
    if (p->complete.joinable()) p->complete.join();
  }
  write_stats();
}

void init_engine_thread() {
  t_engine_thread = true;
  Engine* e = new Engine;
  if (real.getDeviceCount(&e->ndev) != cudaSuccess || e->ndev <= 0) {
    logf(1, "no CUDA devices; multipath disabled");
    return;
  }
  e->ndev = std::min(e->ndev, kMaxDev);
  int n = e->ndev;
  e->queue.resize(n * 2);
  e->queue_chunks.assign(n * 2, 0);
  e->own_pending.assign(n * 2, 0);
  e->peer_ok.assign(n * n, 0);
  e->npaths.assign(n, 0);
  e->paths.assign(n * 2, nullptr);
  void* fl = nullptr;
  if (real.hostAlloc(&fl, kSlots * sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
    logf(1, "cannot allocate the host-mapped flags; multipath disabled");
    return;
  }
  memset(fl, 0, kSlots * sizeof(uint32_t));
  e->flags = static_cast<volatile uint32_t*>(fl);
  void* fd = nullptr;
  real.hostGetDevicePointer(&fd, fl, 0);
  e->flags_dev = (CUdeviceptr)(fd ? fd : fl);
  for (int i = kSlots - 1; i >= 0; i--) e->free_slots.push_back(i);

  for (int link = 0; link < n; link++) {
    if (!cfg.path_allowed(link)) continue;
    if (real.setDevice(link) != cudaSuccess) continue;
    bool any_peer = false;
    if (cfg.relay) {
      for (int i = 0; i < n; i++) {
        int can = 0;
        if (i == link || real.deviceCanAccessPeer(&can, link, i) != cudaSuccess || !can) continue;
        cudaError_t r = real.deviceEnablePeerAccess(i, 0);
        if (r == cudaSuccess || r == cudaErrorPeerAccessAlreadyEnabled) {
          e->peer_ok[link * n + i] = 1;
          any_peer = true;
        }
      }
    }
    for (int d = 0; d < 2; d++) {
      Path* p = new Path;
      p->link = link;
      p->dir = d;
      bool ok = real.streamCreateWithFlags(&p->direct, cudaStreamNonBlocking) == cudaSuccess;
      if (any_peer) {
        for (int k = 0; k < 2 && ok; k++) {
          void* b = nullptr;
          ok = real.streamCreateWithFlags(&p->relay[k], cudaStreamNonBlocking) == cudaSuccess &&
               real.malloc_(&b, cfg.chunk[d]) == cudaSuccess;
          p->relay_buf[k] = static_cast<char*>(b);
        }
      }
      p->events.resize(cfg.depth);
      for (auto& ev : p->events)
        ok = ok && real.eventCreateWithFlags(&ev, cudaEventBlockingSync | cudaEventDisableTiming) == cudaSuccess;
      if (!ok) {
        logf(1, "path %d/%s: setup failed, not used", link, dir_name(d));
        delete p;
        if (any_peer)
          for (int i = 0; i < n; i++) e->peer_ok[link * n + i] = 0;
        continue;
      }
      e->paths[link * 2 + d] = p;
    }
  }
  real.getLastError();  // clear errors from peer-access probing (this thread only)
  for (int dev = 0; dev < n; dev++) {
    int c = (e->paths[dev * 2] && e->paths[dev * 2 + 1]) ? 1 : 0;
    for (int link = 0; link < n; link++)
      if (link != dev && e->peer_ok[link * n + dev] && e->paths[link * 2]) c++;
    e->npaths[dev] = c;
  }
  if (cfg.wait == "spin") e->wait_mode = 1;
  else if (cfg.wait == "host") e->wait_mode = 2;
  else if (!real.cuStreamWaitValue32) e->wait_mode = real.cuLaunchKernel ? 1 : 2;
  E = e;
  for (Path* p : e->paths) {
    if (!p) continue;
    p->submit = std::thread(submit_loop, p);
    p->complete = std::thread(complete_loop, p);
  }
  g_engine_ok = true;
  std::string s;
  for (int d = 0; d < n; d++) s += " " + std::to_string(e->npaths[d]);
  logf(2, "engine up: %d devices, paths per device:%s, chunk %zu/%zu, threshold %zu/%zu, depth %d", n, s.c_str(),
       cfg.chunk[0], cfg.chunk[1], cfg.threshold[0], cfg.threshold[1], cfg.depth);
}

bool engine() {
  std::call_once(g_init_once, [] {
    g_engine_started = true;
    // CUDA calls that change per-thread state (current device, last error) run on a thread of our own.
    std::thread(init_engine_thread).join();
    if (g_engine_ok) atexit(shutdown);
  });
  return g_engine_ok;
}

// Puts the wait for the task's flag on the user's stream. Returns false when it could not (caller blocks).
bool enqueue_wait(cudaStream_t stream, Task* t) {
  Engine& e = *E;
  CUdeviceptr addr = e.flags_dev + (CUdeviceptr)t->slot * sizeof(uint32_t);
  if (e.wait_mode == 0) {
    CUresult r = real.cuStreamWaitValue32((CUstream)stream, addr, t->gen, CU_STREAM_WAIT_VALUE_GEQ);
    if (r == CUDA_SUCCESS) {
      std::lock_guard<std::mutex> lk(e.mu);
      e.st.waits_memop++;
      return true;
    }
    if (cfg.wait == "memop") return false;
    logf(2, "cuStreamWaitValue32 failed (%d); using the spin kernel", r);
    e.wait_mode = real.cuLaunchKernel ? 1 : 2;
  }
  if (e.wait_mode == 1) {
    int dev = -1;
    if (!real.streamGetDevice || real.streamGetDevice(stream, &dev) != cudaSuccess) real.getDevice(&dev);
    CUfunction fn = nullptr;
    if (dev >= 0 && dev < kMaxDev) {
      std::lock_guard<std::mutex> lk(e.spin_mu);
      if (!e.spin_tried[dev] && real.cuModuleLoadData && real.cuModuleGetFunction) {
        e.spin_tried[dev] = true;
        int cur = -1;
        real.getDevice(&cur);
        if (cur != dev) real.setDevice(dev);
        for (const char* ptx : kSpinPtx) {
          CUmodule m = nullptr;
          if (real.cuModuleLoadData(&m, ptx) == CUDA_SUCCESS &&
              real.cuModuleGetFunction(&e.spin_fn[dev], m, "mma_spin_wait") == CUDA_SUCCESS)
            break;
          e.spin_fn[dev] = nullptr;
        }
        if (cur != dev && cur >= 0) real.setDevice(cur);
        if (!e.spin_fn[dev]) logf(1, "spin kernel unavailable on device %d; copies there block the caller", dev);
      }
      fn = e.spin_fn[dev];
    }
    if (fn) {
      unsigned long long a = addr;
      uint32_t v = t->gen;
      void* params[] = {&a, &v};
      if (real.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, (CUstream)stream, params, nullptr) == CUDA_SUCCESS) {
        std::lock_guard<std::mutex> lk(e.mu);
        e.st.waits_spin++;
        return true;
      }
    }
  }
  return false;
}

// Peer links that may relay for this device allocation (VMM memory needs cuMemSetAccess for each peer).
uint64_t relay_mask_for(const void* dptr) {
  if (!real.cuMemGetAccess) return ~0ull;
  uint64_t mask = ~0ull;
  for (int link = 0; link < E->ndev; link++) {
    unsigned long long flags = 0;
    CUmemLocation loc{1, link};
    if (real.cuMemGetAccess(&flags, &loc, (CUdeviceptr)dptr) == CUDA_SUCCESS &&
        (flags & CU_MEM_ACCESS_FLAGS_PROT_READWRITE) != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      mask &= ~(1ull << link);
  }
  return mask;
}

enum FallbackWhy { FB_NONE, FB_SMALL, FB_KIND, FB_MEMTYPE, FB_CAPTURE, FB_SINGLE, FB_DISABLED, FB_NOSLOT, FB_ERROR,
                   FB_STOPPING };

void count_fallback(FallbackWhy why, size_t n) {
  Fallbacks& s = g_fb;
  s.fallback++;
  s.fallback_bytes += n;
  switch (why) {
    case FB_SMALL: s.fb_small++; break;
    case FB_KIND: s.fb_kind++; break;
    case FB_MEMTYPE: s.fb_memtype++; break;
    case FB_CAPTURE: s.fb_capture++; break;
    case FB_SINGLE: s.fb_single_path++; break;
    case FB_DISABLED: s.fb_disabled++; break;
    case FB_NOSLOT: s.fb_no_slot++; break;
    case FB_ERROR: s.fb_error++; break;
    case FB_STOPPING: s.fb_stopping++; break;
    default: break;
  }
}

bool attrs(const void* p, cudaPointerAttributes* a) {
  cudaError_t before = real.peekAtLastError ? real.peekAtLastError() : cudaSuccess;
  memset(a, 0, sizeof(*a));
  if (real.pointerGetAttributes(a, p) == cudaSuccess) return true;
  if (before == cudaSuccess && real.getLastError) real.getLastError();  // do not leave our error behind
  return false;
}

// Returns FB_NONE when the copy was taken by the engine (and *ret holds its result).
FallbackWhy try_multipath(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t stream,
                          bool sync, cudaError_t* ret) {
  if (!cfg.enable || g_child || t_engine_thread) return FB_DISABLED;
  if (n < std::min(cfg.threshold[0], cfg.threshold[1])) return FB_SMALL;
  if (kind != cudaMemcpyHostToDevice && kind != cudaMemcpyDeviceToHost && kind != cudaMemcpyDefault) return FB_KIND;
  resolve();
  if (!g_resolved_ok) return FB_DISABLED;
  cudaPointerAttributes da, sa;
  if (!attrs(dst, &da) || !attrs(src, &sa)) return FB_MEMTYPE;
  auto is_host = [](const cudaPointerAttributes& a) {
    return a.type == cudaMemoryTypeHost || (a.type == cudaMemoryTypeUnregistered && cfg.pageable);
  };
  int dir;
  const cudaPointerAttributes* dev_a;
  if (da.type == cudaMemoryTypeDevice && is_host(sa) && kind != cudaMemcpyDeviceToHost) {
    dir = H2D;
    dev_a = &da;
  } else if (sa.type == cudaMemoryTypeDevice && is_host(da) && kind != cudaMemcpyHostToDevice) {
    dir = D2H;
    dev_a = &sa;
  } else {
    return FB_MEMTYPE;
  }
  if (n < cfg.threshold[dir]) return FB_SMALL;
  int capturing = cudaStreamCaptureStatusNone;
  if (real.streamIsCapturing && (real.streamIsCapturing(stream, &capturing) != cudaSuccess ||
                                 capturing != cudaStreamCaptureStatusNone)) {
    if (real.getLastError && capturing == cudaStreamCaptureStatusNone) real.getLastError();
    return FB_CAPTURE;
  }
  if (!engine()) return FB_DISABLED;
  Engine& e = *E;
  int dev = dev_a->device;
  if (dev < 0 || dev >= e.ndev) return FB_MEMTYPE;
  bool pageable = (dir == H2D ? sa : da).type == cudaMemoryTypeUnregistered;
  if (e.npaths[dev] < 1 || (e.npaths[dev] < 2 && !cfg.single_path) || !e.paths[dev * 2 + dir]) return FB_SINGLE;

  Task* t = new Task;
  t->dev = dev;
  t->dir = dir;
  t->host = static_cast<char*>(dir == H2D ? const_cast<void*>(src) : dst);
  t->dptr = static_cast<char*>(dir == H2D ? dst : const_cast<void*>(src));
  t->bytes = n;
  t->chunk = cfg.chunk[dir];
  t->chunks_left = (int)t->waiting_chunks();
  t->relay_mask = relay_mask_for(t->dptr);
  {
    std::lock_guard<std::mutex> lk(e.mu);
    if (e.stopping) {
      delete t;
      return FB_STOPPING;
    }
    if (e.free_slots.empty()) {
      delete t;
      return FB_NOSLOT;
    }
    t->slot = e.free_slots.back();
    e.free_slots.pop_back();
    t->gen = ++e.gens[t->slot];
    e.own_pending[dev * 2 + dir]++;
    e.pending.insert(t);
    t->refs = 2;  // engine + this caller until the wait is enqueued
  }
  if (real.launchHostFunc(stream, release_cb, t) != cudaSuccess) {
    std::lock_guard<std::mutex> lk(e.mu);
    e.free_slots.push_back(t->slot);
    e.own_pending[dev * 2 + dir]--;
    e.pending.erase(t);
    delete t;
    if (real.getLastError) real.getLastError();
    return FB_ERROR;
  }
  bool waited = e.wait_mode != 2 && enqueue_wait(stream, t);
  std::unique_lock<std::mutex> lk(e.mu);
  e.st.intercepted[dir]++;
  e.st.intercepted_bytes[dir] += n;
  if (sync) e.st.sync_calls++;
  if (!waited) e.st.waits_host++;
  if (sync || pageable || !waited) {
    // Synchronous semantics (cudaMemcpy, pageable memory) or no device-side wait: block until every chunk landed.
    e.cv_done.wait(lk, [&] { return t->completed; });
  }
  drop_ref(t);
  *ret = cudaSuccess;
  return FB_NONE;
}

// ------------------------------------------------------------------ stats
void write_stats() {
  if (g_child || g_stats_written.exchange(true)) return;
  static Engine no_engine;
  Engine& e = E ? *E : no_engine;
  std::lock_guard<std::mutex> lk(e.mu);
  Stats& s = e.st;
  Fallbacks& fb = g_fb;
  uint64_t relay_bytes = 0, direct_bytes = 0, relay_chunks = 0, chunks = 0;
  std::string paths;
  for (Path* p : e.paths) {
    if (!p) continue;
    relay_bytes += p->st.relay_bytes;
    direct_bytes += p->st.direct_bytes;
    relay_chunks += p->st.relay_chunks;
    chunks += p->st.chunks;
    char b[256];
    snprintf(b, sizeof b,
             "%s{\"link\":%d,\"dir\":\"%s\",\"direct_bytes\":%llu,\"relay_bytes\":%llu,\"chunks\":%llu,"
             "\"relay_chunks\":%llu,\"rate_gbps\":%.4f}",
             paths.empty() ? "" : ",", p->link, dir_name(p->dir), (unsigned long long)p->st.direct_bytes,
             (unsigned long long)p->st.relay_bytes, (unsigned long long)p->st.chunks,
             (unsigned long long)p->st.relay_chunks, p->rate / 1e9);
    paths += b;
  }
  const char* mode = e.wait_mode == 0 ? "memop" : e.wait_mode == 1 ? "spin" : "host";
  uint64_t icount = s.intercepted[0] + s.intercepted[1];
  if (cfg.log_level >= 1 && (icount || fb.fallback.load())) {
    fprintf(stderr,
            "[mma %d] stats: intercepted %llu (h2d %llu, d2h %llu; %.1f MiB), direct %.1f MiB, relay %.1f MiB "
            "(%llu chunks), fallbacks %llu (%.1f MiB; small %llu, memtype %llu, single-path %llu, capture %llu, "
            "other %llu), waits memop/spin/host %llu/%llu/%llu, abandoned %llu, errors %llu\n",
            (int)getpid(), (unsigned long long)icount, (unsigned long long)s.intercepted[0],
            (unsigned long long)s.intercepted[1], (s.intercepted_bytes[0] + s.intercepted_bytes[1]) / 1048576.0,
            direct_bytes / 1048576.0, relay_bytes / 1048576.0, (unsigned long long)relay_chunks,
            (unsigned long long)fb.fallback.load(), fb.fallback_bytes.load() / 1048576.0, (unsigned long long)fb.fb_small.load(),
            (unsigned long long)fb.fb_memtype.load(), (unsigned long long)fb.fb_single_path.load(),
            (unsigned long long)fb.fb_capture.load(),
            (unsigned long long)(fb.fb_kind.load() + fb.fb_disabled.load() + fb.fb_no_slot.load() + fb.fb_error.load() + fb.fb_stopping.load()),
            (unsigned long long)s.waits_memop, (unsigned long long)s.waits_spin, (unsigned long long)s.waits_host,
            (unsigned long long)s.abandoned, (unsigned long long)s.errors);
    for (Path* p : e.paths)
      if (p && p->st.chunks)
        fprintf(stderr, "[mma %d]   path %d %s: direct %.1f MiB, relay %.1f MiB, %llu chunks, rate %.3f GB/s\n",
                (int)getpid(), p->link, dir_name(p->dir), p->st.direct_bytes / 1048576.0,
                p->st.relay_bytes / 1048576.0, (unsigned long long)p->st.chunks, p->rate / 1e9);
  }
  if (!cfg.stats_file.empty() && (E || fb.fallback.load())) {  // processes that never copied write nothing
    std::string path = cfg.stats_file;
    size_t pos = path.find("%p");
    if (pos != std::string::npos) path.replace(pos, 2, std::to_string(getpid()));
    FILE* f = fopen(path.c_str(), "w");
    if (!f) return;
    fprintf(f,
            "{\"intercepted\":%llu,\"intercepted_h2d\":%llu,\"intercepted_d2h\":%llu,\"intercepted_bytes\":%llu,"
            "\"direct_bytes\":%llu,\"relay_bytes\":%llu,\"chunks\":%llu,\"relay_chunks\":%llu,"
            "\"fallback\":%llu,\"fallback_bytes\":%llu,\"fallback_small\":%llu,\"fallback_kind\":%llu,"
            "\"fallback_memtype\":%llu,\"fallback_capture\":%llu,\"fallback_single_path\":%llu,"
            "\"fallback_disabled\":%llu,\"fallback_no_slot\":%llu,\"fallback_error\":%llu,\"fallback_stopping\":%llu,"
            "\"waits_memop\":%llu,\"waits_spin\":%llu,\"waits_host\":%llu,\"sync_calls\":%llu,\"wait_mode\":\"%s\","
            "\"abandoned\":%llu,\"errors\":%llu,\"pending_at_exit\":%zu,\"paths\":[%s]}\n",
            (unsigned long long)icount, (unsigned long long)s.intercepted[0], (unsigned long long)s.intercepted[1],
            (unsigned long long)(s.intercepted_bytes[0] + s.intercepted_bytes[1]), (unsigned long long)direct_bytes,
            (unsigned long long)relay_bytes, (unsigned long long)chunks, (unsigned long long)relay_chunks,
            (unsigned long long)fb.fallback.load(), (unsigned long long)fb.fallback_bytes.load(), (unsigned long long)fb.fb_small.load(),
            (unsigned long long)fb.fb_kind.load(), (unsigned long long)fb.fb_memtype.load(), (unsigned long long)fb.fb_capture.load(),
            (unsigned long long)fb.fb_single_path.load(), (unsigned long long)fb.fb_disabled.load(),
            (unsigned long long)fb.fb_no_slot.load(), (unsigned long long)fb.fb_error.load(), (unsigned long long)fb.fb_stopping.load(),
            (unsigned long long)s.waits_memop, (unsigned long long)s.waits_spin, (unsigned long long)s.waits_host,
            (unsigned long long)s.sync_calls, mode, (unsigned long long)s.abandoned, (unsigned long long)s.errors,
            e.pending.size(), paths.c_str());
    fclose(f);
  }
}

struct Boot {
  Boot() {
    cfg.load();
    atexit(write_stats);  // runs after the engine's own exit handler, which writes them first when it exists
    // A child forked after the engine started has none of its threads: it copies natively. A child forked
    // before (vLLM workers started with fork) starts its own engine on first use.
    pthread_atfork(nullptr, nullptr, [] {
      if (g_engine_started) g_child = true;
    });
  }
};
Boot boot;

}  // namespace mma

using namespace mma;

MMA_EXPORT cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                                       cudaStream_t stream) {
  cudaError_t ret = cudaSuccess;
  FallbackWhy why = try_multipath(dst, src, count, kind, stream, false, &ret);
  if (why == FB_NONE) return ret;
  resolve();
  if (!real.memcpyAsync) return cudaErrorUnknown;
  count_fallback(why, count);
  return real.memcpyAsync(dst, src, count, kind, stream);
}

MMA_EXPORT cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  cudaError_t ret = cudaSuccess;
  FallbackWhy why = try_multipath(dst, src, count, kind, nullptr, true, &ret);
  if (why == FB_NONE) return ret;
  resolve();
  if (!real.memcpy_) return cudaErrorUnknown;
  count_fallback(why, count);
  return real.memcpy_(dst, src, count, kind);
}
