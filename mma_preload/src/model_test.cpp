// mma_model_test: a CUDA program linked against the modelled runtime; run with and without LD_PRELOAD.
// Every subcommand prints one JSON object on its last stdout line.
//   bytes SIZE...                      H2D and D2H, pinned and pageable, async and sync, every device
//   order THREADS STREAMS ITERS SIZE   copies followed by dependent operations (same stream and via events)
//   fallback SMALL LARGE               which calls reach the native entry points, with which arguments
//   exit SIZE COPIES SLEEP_US          copies in flight (streams blocked SLEEP_US first) when main returns
//   bw DEV DIR SIZE REPS [STREAMS]     big copies to/from DEV (DIR h2d|d2h), REPS per stream, STREAMS at once
//   busy DIR SIZE REPS                 one thread per device copying to/from its own device at once
//   fork SIZE                          fork before any CUDA use; the child copies SIZE both ways and checks
#include "cuda_min.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

extern "C" {
cudaError_t cudaGetDeviceCount(int*);
cudaError_t cudaSetDevice(int);
cudaError_t cudaMalloc(void**, size_t);
cudaError_t cudaFree(void*);
cudaError_t cudaMallocHost(void**, size_t);
cudaError_t cudaFreeHost(void*);
cudaError_t cudaMemcpy(void*, const void*, size_t, cudaMemcpyKind);
cudaError_t cudaMemcpyAsync(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t);
cudaError_t cudaStreamCreate(cudaStream_t*);
cudaError_t cudaStreamSynchronize(cudaStream_t);
cudaError_t cudaLaunchHostFunc(cudaStream_t, cudaHostFn_t, void*);
cudaError_t cudaEventCreate(cudaEvent_t*);
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t);
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned);
cudaError_t cudaDeviceSynchronize(void);
int mmaModelStatsJson(char*, int);
void mmaModelResetStats(void);
void mmaModelStreamSleep(cudaStream_t, unsigned);
int mmaModelCallLog(void*, int);
void mmaModelClearCallLog(void);
double mmaModelNow(void);
}

namespace {

struct CallRec {
  int api;
  void* dst;
  const void* src;
  size_t count;
  int kind;
  void* stream;
};

#define CK(x)                                                              \
  do {                                                                     \
    cudaError_t e_ = (x);                                                  \
    if (e_ != cudaSuccess) {                                               \
      fprintf(stderr, "%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)e_); \
      exit(3);                                                             \
    }                                                                      \
  } while (0)

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
void fill(void* p, size_t n, uint64_t seed) {
  auto* b = static_cast<uint8_t*>(p);
  size_t words = n / 8;
  for (size_t w = 0; w < words; w++) {
    uint64_t v = mix(seed * 0x100000001b3ull + w);
    memcpy(b + w * 8, &v, 8);
  }
  for (size_t i = words * 8; i < n; i++) b[i] = (uint8_t)(mix(seed * 0x100000001b3ull + words) >> (8 * (i % 8)));
}
// Returns the first mismatching offset, or -1.
long long first_bad(const void* p, size_t n, uint64_t seed) {
  auto* b = static_cast<const uint8_t*>(p);
  size_t words = n / 8;
  for (size_t w = 0; w < words; w++) {
    uint64_t v = mix(seed * 0x100000001b3ull + w), got;
    memcpy(&got, b + w * 8, 8);
    if (got != v)
      for (int k = 0; k < 8; k++)
        if (b[w * 8 + k] != (uint8_t)(v >> (8 * k))) return (long long)(w * 8 + k);
  }
  for (size_t i = words * 8; i < n; i++)
    if (b[i] != (uint8_t)(mix(seed * 0x100000001b3ull + words) >> (8 * (i % 8)))) return (long long)i;
  return -1;
}
bool all_byte(const void* p, size_t n, uint8_t v) {
  auto* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; i++)
    if (b[i] != v) return false;
  return true;
}
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
std::string model_stats() {
  std::vector<char> buf(1 << 16);
  mmaModelStatsJson(buf.data(), (int)buf.size());
  return buf.data();
}
int ndev() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  return n;
}

// ---------------------------------------------------------------- bytes
int cmd_bytes(int argc, char** argv) {
  const size_t guard = 64;
  int checked = 0, failures = 0;
  std::string fail_msgs;
  for (int a = 0; a < argc; a++) {
    size_t n = strtoull(argv[a], nullptr, 10);
    for (int dev = 0; dev < ndev(); dev++) {
      CK(cudaSetDevice(dev));
      cudaStream_t s;
      CK(cudaStreamCreate(&s));
      void *d, *hp, *hq;
      CK(cudaMalloc(&d, n + guard));
      CK(cudaMallocHost(&hp, n + guard));
      CK(cudaMallocHost(&hq, n + guard));
      std::vector<uint8_t> pg_src(n + guard), pg_dst(n + guard);
      for (int pinned = 0; pinned < 2; pinned++) {
        for (int sync = 0; sync < 2; sync++) {
          uint64_t seed = n * 131 + dev * 17 + pinned * 5 + sync;
          void* src = pinned ? hp : pg_src.data();
          void* dst = pinned ? hq : pg_dst.data();
          fill(src, n, seed);
          memset(d, 0xA5, n + guard);
          memset(dst, 0x5A, n + guard);
          if (sync) {
            CK(cudaMemcpy(d, src, n, cudaMemcpyHostToDevice));
          } else {
            CK(cudaMemcpyAsync(d, src, n, cudaMemcpyHostToDevice, s));
            CK(cudaStreamSynchronize(s));
          }
          long long bad = first_bad(d, n, seed);
          bool guard_ok = all_byte(static_cast<char*>(d) + n, guard, 0xA5);
          // D2H from the device copy into a fresh host buffer (cudaMemcpyDefault for the sync variant).
          if (sync) {
            CK(cudaMemcpy(dst, d, n, cudaMemcpyDefault));
          } else {
            CK(cudaMemcpyAsync(dst, d, n, cudaMemcpyDeviceToHost, s));
            CK(cudaStreamSynchronize(s));
          }
          long long bad2 = first_bad(dst, n, seed);
          bool guard2_ok = all_byte(static_cast<char*>(dst) + n, guard, 0x5A);
          checked += 2;
          if (bad >= 0 || !guard_ok || bad2 >= 0 || !guard2_ok) {
            failures++;
            char m[256];
            snprintf(m, sizeof m, "%s\"n=%zu dev=%d pinned=%d sync=%d h2d_bad=%lld guard=%d d2h_bad=%lld guard=%d\"",
                     fail_msgs.empty() ? "" : ",", n, dev, pinned, sync, bad, guard_ok, bad2, guard2_ok);
            fail_msgs += m;
          }
        }
      }
      CK(cudaFree(d));
      CK(cudaFreeHost(hp));
      CK(cudaFreeHost(hq));
    }
  }
  printf("{\"checked\":%d,\"failures\":%d,\"messages\":[%s]}\n", checked, failures, fail_msgs.c_str());
  return failures ? 1 : 0;
}

// ---------------------------------------------------------------- order
std::atomic<long> g_bad{0}, g_verified{0};
struct Check {
  const void* p;
  size_t n;
  uint64_t seed;
};
void verify_cb(void* arg) {
  auto* c = static_cast<Check*>(arg);
  if (first_bad(c->p, c->n, c->seed) >= 0) g_bad++;
  g_verified++;
  delete c;
}

int cmd_order(int argc, char** argv) {
  if (argc < 4) return 2;
  int T = atoi(argv[0]), S = atoi(argv[1]), I = atoi(argv[2]);
  size_t n = strtoull(argv[3], nullptr, 10);
  const int K = 3;
  std::vector<std::thread> th;
  double t0 = now();
  for (int t = 0; t < T; t++) {
    th.emplace_back([=] {
      int dev = t % ndev();
      CK(cudaSetDevice(dev));
      struct Lane {
        cudaStream_t s, s2;
        cudaEvent_t e1, e2;
        void *a, *b, *c;
        void* src[K];
      };
      std::vector<Lane> lanes(S);
      for (int l = 0; l < S; l++) {
        Lane& L = lanes[l];
        CK(cudaStreamCreate(&L.s));
        CK(cudaStreamCreate(&L.s2));
        CK(cudaEventCreate(&L.e1));
        CK(cudaEventCreate(&L.e2));
        CK(cudaMalloc(&L.a, n));
        CK(cudaMallocHost(&L.b, n));
        CK(cudaMallocHost(&L.c, n));
        for (int k = 0; k < K; k++) {
          CK(cudaMallocHost(&L.src[k], n));
          fill(L.src[k], n, (uint64_t)t * 1000003 + l * 101 + k);
        }
      }
      for (int it = 0; it < I; it++) {
        for (int l = 0; l < S; l++) {
          Lane& L = lanes[l];
          int k = it % K;
          uint64_t seed = (uint64_t)t * 1000003 + l * 101 + k;
          CK(cudaMemcpyAsync(L.a, L.src[k], n, cudaMemcpyHostToDevice, L.s));
          CK(cudaLaunchHostFunc(L.s, verify_cb, new Check{L.a, n, seed}));  // same stream: sees all of it
          CK(cudaEventRecord(L.e1, L.s));
          CK(cudaStreamWaitEvent(L.s2, L.e1, 0));  // other stream, ordered by an event
          CK(cudaMemcpyAsync(L.c, L.a, n, cudaMemcpyDeviceToHost, L.s2));
          CK(cudaLaunchHostFunc(L.s2, verify_cb, new Check{L.c, n, seed}));
          CK(cudaEventRecord(L.e2, L.s2));
          CK(cudaMemcpyAsync(L.b, L.a, n, cudaMemcpyDeviceToHost, L.s));
          CK(cudaLaunchHostFunc(L.s, verify_cb, new Check{L.b, n, seed}));
          CK(cudaStreamWaitEvent(L.s, L.e2, 0));  // the next H2D into L.a waits for the reader on s2
        }
      }
      for (auto& L : lanes) {
        CK(cudaStreamSynchronize(L.s));
        CK(cudaStreamSynchronize(L.s2));
        if (first_bad(L.b, n, (uint64_t)t * 1000003 + (&L - lanes.data()) * 101 + (I - 1) % K) >= 0) g_bad++;
      }
    });
  }
  for (auto& x : th) x.join();
  long expected = (long)T * S * I * 3;
  printf("{\"verified\":%ld,\"expected\":%ld,\"bad\":%ld,\"seconds\":%.3f}\n", g_verified.load(), expected,
         g_bad.load(), now() - t0);
  return g_bad || g_verified != expected ? 1 : 0;
}

// ---------------------------------------------------------------- fallback
int cmd_fallback(int argc, char** argv) {
  if (argc < 2) return 2;
  size_t small = strtoull(argv[0], nullptr, 10), large = strtoull(argv[1], nullptr, 10);
  CK(cudaSetDevice(0));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  void *d, *h, *h2;
  CK(cudaMalloc(&d, large));
  CK(cudaMallocHost(&h, large));
  CK(cudaMallocHost(&h2, large));
  fill(h, large, 7);
  mmaModelClearCallLog();
  CK(cudaMemcpyAsync(d, h, small, cudaMemcpyHostToDevice, s));
  CK(cudaMemcpyAsync(h2, d, small, cudaMemcpyDeviceToHost, s));
  CK(cudaMemcpy(static_cast<char*>(d) + small, h, small, cudaMemcpyHostToDevice));
  CK(cudaStreamSynchronize(s));
  std::vector<CallRec> log(100000);
  int nl = mmaModelCallLog(log.data(), (int)log.size());
  struct Want {
    int api;
    void* dst;
    const void* src;
    int kind;
    void* stream;
  } want[3] = {{1, d, h, cudaMemcpyHostToDevice, s}, {1, h2, d, cudaMemcpyDeviceToHost, s},
               {0, static_cast<char*>(d) + small, h, cudaMemcpyHostToDevice, nullptr}};
  int exact = 0;
  for (auto& w : want)
    for (int i = 0; i < nl; i++)
      if (log[i].api == w.api && log[i].dst == w.dst && log[i].src == w.src && log[i].count == small &&
          log[i].kind == w.kind && log[i].stream == w.stream)
        exact++;
  bool small_ok = first_bad(h2, small, 7) < 0;
  // A large copy: with the preload it must not reach the native entry point as one call.
  mmaModelClearCallLog();
  CK(cudaMemcpyAsync(d, h, large, cudaMemcpyHostToDevice, s));
  CK(cudaStreamSynchronize(s));
  nl = mmaModelCallLog(log.data(), (int)log.size());
  int large_native = 0, pieces = 0;
  for (int i = 0; i < nl; i++) {
    if (log[i].dst == d && log[i].src == h && log[i].count == large) large_native++;
    if (log[i].api == 1 && log[i].stream != s) pieces++;
  }
  bool large_ok = first_bad(d, large, 7) < 0;
  printf("{\"small_calls\":%d,\"small_exact\":%d,\"small_ok\":%s,\"large_native_calls\":%d,\"engine_calls\":%d,"
         "\"large_ok\":%s}\n",
         3, exact, small_ok ? "true" : "false", large_native, pieces, large_ok ? "true" : "false");
  return 0;
}

// ---------------------------------------------------------------- exit with copies in flight
int cmd_exit(int argc, char** argv) {
  if (argc < 3) return 2;
  size_t n = strtoull(argv[0], nullptr, 10);
  int copies = atoi(argv[1]);
  unsigned sleep_us = (unsigned)atoi(argv[2]);
  int nd = ndev();
  for (int c = 0; c < copies; c++) {
    int dev = c % nd;
    CK(cudaSetDevice(dev));
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    void *d, *h;
    CK(cudaMalloc(&d, n));
    CK(cudaMallocHost(&h, n));
    if (sleep_us) mmaModelStreamSleep(s, sleep_us);
    if (c % 2)
      CK(cudaMemcpyAsync(h, d, n, cudaMemcpyDeviceToHost, s));
    else
      CK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, s));
  }
  printf("{\"issued\":%d}\n", copies);
  fflush(stdout);
  return 0;  // no synchronization: exit with copies in flight
}

// ---------------------------------------------------------------- bandwidth
void* alloc_dev(int dev, size_t n) {
  CK(cudaSetDevice(dev));
  void* p;
  CK(cudaMalloc(&p, n));
  return p;
}

int cmd_bw(int argc, char** argv) {
  if (argc < 4) return 2;
  int dev = atoi(argv[0]);
  bool h2d = strcmp(argv[1], "h2d") == 0;
  size_t n = strtoull(argv[2], nullptr, 10);
  int reps = atoi(argv[3]);
  int ns = argc > 4 ? std::max(1, atoi(argv[4])) : 1;  // streams issuing copies at once (e.g. several layers)
  std::vector<void*> d(ns), h(ns);
  std::vector<cudaStream_t> s(ns);
  for (int i = 0; i < ns; i++) {
    d[i] = alloc_dev(dev, n);
    CK(cudaMallocHost(&h[i], n));
    CK(cudaStreamCreate(&s[i]));
  }
  auto one = [&](int i) {
    CK(h2d ? cudaMemcpyAsync(d[i], h[i], n, cudaMemcpyHostToDevice, s[i])
           : cudaMemcpyAsync(h[i], d[i], n, cudaMemcpyDeviceToHost, s[i]));
  };
  one(0);  // warm-up (engine start)
  CK(cudaStreamSynchronize(s[0]));
  mmaModelResetStats();
  double t0 = now();
  for (int r = 0; r < reps; r++)
    for (int i = 0; i < ns; i++) one(i);
  for (int i = 0; i < ns; i++) CK(cudaStreamSynchronize(s[i]));
  double dt = now() - t0;
  printf("{\"bytes\":%zu,\"seconds\":%.6f,\"gbps\":%.4f,\"model\":%s}\n", n * reps * ns, dt, n * reps * ns / dt / 1e9,
         model_stats().c_str());
  return 0;
}

int cmd_busy(int argc, char** argv) {
  if (argc < 3) return 2;
  bool h2d = strcmp(argv[0], "h2d") == 0;
  size_t n = strtoull(argv[1], nullptr, 10);
  int reps = atoi(argv[2]);
  int nd = ndev();
  std::vector<void*> d(nd), h(nd);
  std::vector<cudaStream_t> s(nd);
  for (int i = 0; i < nd; i++) {
    d[i] = alloc_dev(i, n);
    CK(cudaMallocHost(&h[i], n));
    CK(cudaStreamCreate(&s[i]));
  }
  // warm-up on device 0 only, then reset the counters
  CK(h2d ? cudaMemcpyAsync(d[0], h[0], n, cudaMemcpyHostToDevice, s[0])
         : cudaMemcpyAsync(h[0], d[0], n, cudaMemcpyDeviceToHost, s[0]));
  CK(cudaStreamSynchronize(s[0]));
  mmaModelResetStats();
  std::atomic<int> ready{0};
  std::vector<double> done(nd);
  std::vector<std::thread> th;
  double t0 = now();
  for (int i = 0; i < nd; i++)
    th.emplace_back([&, i] {
      CK(cudaSetDevice(i));
      ready++;
      while (ready.load() < nd) std::this_thread::yield();
      // Hold the stream briefly so that every device has its copies queued before any of them starts.
      mmaModelStreamSleep(s[i], 30000);
      for (int r = 0; r < reps; r++)
        CK(h2d ? cudaMemcpyAsync(d[i], h[i], n, cudaMemcpyHostToDevice, s[i])
               : cudaMemcpyAsync(h[i], d[i], n, cudaMemcpyDeviceToHost, s[i]));
      // Stamped on the stream right after its last copy: this device's own copies have all landed.
      CK(cudaLaunchHostFunc(s[i], [](void* p) { *static_cast<double*>(p) = mmaModelNow(); }, &done[i]));
      CK(cudaStreamSynchronize(s[i]));
    });
  for (auto& t : th) t.join();
  double dt = now() - t0;
  printf("{\"bytes\":%zu,\"seconds\":%.6f,\"gbps\":%.4f,\"first_done\":%.6f,\"model\":%s}\n", n * reps * nd, dt,
         n * reps * nd / dt / 1e9, *std::min_element(done.begin(), done.end()), model_stats().c_str());
  return 0;
}

// ---------------------------------------------------------------- fork before the first copy (vLLM fork workers)
int cmd_fork(int argc, char** argv) {
  if (argc < 1) return 2;
  size_t n = strtoull(argv[0], nullptr, 10);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    CK(cudaSetDevice(1));
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    void *d, *h, *h2;
    CK(cudaMalloc(&d, n));
    CK(cudaMallocHost(&h, n));
    CK(cudaMallocHost(&h2, n));
    fill(h, n, 99);
    CK(cudaMemcpyAsync(d, h, n, cudaMemcpyHostToDevice, s));
    CK(cudaMemcpyAsync(h2, d, n, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    exit(first_bad(h2, n, 99) < 0 ? 0 : 1);  // exit handlers: engine shutdown, stats
  }
  int status = 0;
  waitpid(pid, &status, 0);
  bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  printf("{\"child_ok\":%s}\n", ok ? "true" : "false");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s bytes|order|fallback|exit|bw|busy ...\n", argv[0]);
    return 2;
  }
  std::string c = argv[1];
  int rest = argc - 2;
  char** av = argv + 2;
  if (c == "bytes") return cmd_bytes(rest, av);
  if (c == "order") return cmd_order(rest, av);
  if (c == "fallback") return cmd_fallback(rest, av);
  if (c == "exit") return cmd_exit(rest, av);
  if (c == "bw") return cmd_bw(rest, av);
  if (c == "busy") return cmd_busy(rest, av);
  if (c == "fork") return cmd_fork(rest, av);
  fprintf(stderr, "unknown command %s\n", argv[1]);
  return 2;
}
