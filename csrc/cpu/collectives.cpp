// Shared-memory collectives for tensor-parallel ranks on one host (inferd.distributed.comm).
//
// Why not gloo: its all-reduce goes through loopback TCP (tens of microseconds a call, 61 calls a
// decode step for the default model), while ranks on one host can simply read each other's memory.
//
// The segment: a 4 KiB header (one 32-bit arrival counter, one abort word), then two sets of
// `world` slots of `slot_bytes` each. Collective number s (1, 2, ...; every rank runs the same
// sequence) uses slot set s % 2: a rank copies its part into its slot, arrives, waits until all
// `world` ranks have arrived (the counter reaches world * s), then reads every slot. Two sets make
// one barrier per collective enough: a rank writing collective s + 2's slot has passed barrier
// s + 1, which every rank reached only after reading collective s.
//
// Waiting yields the core for a short while, then sleeps on a futex (no spinning: on two cores the
// API process and two ranks already share the CPUs). The last rank to arrive wakes the sleepers. An
// abort word, set by the rank that saw a peer die, and a deadline turn a lost rank into an error
// instead of a hang.
#include <torch/extension.h>

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kHeader = 4096;

inline uint32_t* arrived_word(uint8_t* base) { return reinterpret_cast<uint32_t*>(base); }
inline uint32_t* abort_word(uint8_t* base) { return reinterpret_cast<uint32_t*>(base + 64); }

long futex(uint32_t* addr, int op, uint32_t val, const timespec* ts) {
  // not FUTEX_PRIVATE_FLAG: the word is shared between processes
  return syscall(SYS_futex, addr, op, val, ts, nullptr, 0);
}

double now_s() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

uint8_t* base_of(const at::Tensor& shm) {
  TORCH_CHECK(shm.scalar_type() == at::kByte && shm.is_contiguous() && shm.numel() > kHeader,
              "tensor-parallel segment must be a contiguous uint8 tensor");
  return shm.data_ptr<uint8_t>();
}

inline bool reached(uint32_t v, uint32_t target) { return static_cast<int32_t>(v - target) >= 0; }

inline uint32_t target_of(int64_t world, int64_t seq) {
  return static_cast<uint32_t>(static_cast<uint64_t>(world) * static_cast<uint64_t>(seq));
}

void arrive(uint8_t* base, int64_t world, int64_t seq) {
  uint32_t* arrived = arrived_word(base);
  uint32_t v = __atomic_add_fetch(arrived, 1u, __ATOMIC_ACQ_REL);
  if (reached(v, target_of(world, seq))) futex(arrived, FUTEX_WAKE, INT_MAX, nullptr);
}

// 0: every rank arrived; 1: the deadline passed (timeout_s > 0); 2: aborted
int wait_all(uint8_t* base, int64_t world, int64_t seq, double timeout_s) {
  uint32_t* arrived = arrived_word(base);
  const uint32_t target = target_of(world, seq);
  const double start = now_s();
  for (int yields = 0;; ++yields) {
    uint32_t v = __atomic_load_n(arrived, __ATOMIC_ACQUIRE);
    if (reached(v, target)) return 0;
    if (__atomic_load_n(abort_word(base), __ATOMIC_ACQUIRE)) return 2;
    if (yields < 64) {  // the other rank is usually microseconds away: give it the core
      sched_yield();
      continue;
    }
    timespec ts{0, 20 * 1000 * 1000};  // wake at least every 20 ms to see the abort word and the clock
    futex(arrived, FUTEX_WAIT, v, &ts);
    if (timeout_s > 0 && now_s() - start > timeout_s) return 1;
  }
}

void barrier_or_throw(uint8_t* base, int64_t world, int64_t seq, double timeout_s) {
  arrive(base, world, seq);
  int r = wait_all(base, world, seq, timeout_s);
  TORCH_CHECK(r != 2, "tensor-parallel collective aborted: a rank stopped");
  TORCH_CHECK(r != 1, "tensor-parallel collective timed out after ", timeout_s, " s: a rank stopped responding");
}

template <typename T>
void sum_slots(T* out, uint8_t* const* slots, int64_t world, int64_t n) {
  // the same order on every rank (0, 1, ...): each rank ends with bit-identical sums
  for (int64_t i = 0; i < n; ++i) {
    float acc = static_cast<float>(reinterpret_cast<const T*>(slots[0])[i]);
    for (int64_t r = 1; r < world; ++r) acc += static_cast<float>(reinterpret_cast<const T*>(slots[r])[i]);
    out[i] = static_cast<T>(acc);
  }
}

}  // namespace

// x += every other rank's x, in place; returns the next collective number
int64_t tp_all_reduce_(at::Tensor x, at::Tensor shm, int64_t rank, int64_t world, int64_t seq, int64_t slot_bytes,
                       double timeout_s) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "tp all-reduce needs a contiguous CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "tp all-reduce takes float32 or bfloat16");
  uint8_t* base = base_of(shm);
  TORCH_CHECK(kHeader + 2 * world * slot_bytes <= shm.numel(), "tensor-parallel segment too small");
  const int64_t esz = x.element_size();
  const int64_t per = slot_bytes / esz;
  const int64_t n = x.numel();
  uint8_t* xp = reinterpret_cast<uint8_t*>(x.data_ptr());
  uint8_t* slots[64];
  TORCH_CHECK(world <= 64, "at most 64 tensor-parallel ranks on one host");
  for (int64_t off = 0; off < n; off += per, ++seq) {
    const int64_t m = std::min(per, n - off);
    uint8_t* set = base + kHeader + (seq & 1) * world * slot_bytes;
    for (int64_t r = 0; r < world; ++r) slots[r] = set + r * slot_bytes;
    std::memcpy(slots[rank], xp + off * esz, m * esz);
    barrier_or_throw(base, world, seq, timeout_s);
    if (x.scalar_type() == at::kFloat)
      sum_slots<float>(reinterpret_cast<float*>(xp) + off, slots, world, m);
    else
      sum_slots<at::BFloat16>(reinterpret_cast<at::BFloat16*>(xp) + off, slots, world, m);
  }
  return seq;
}

// one barrier: every rank's slot of collective `seq` is written when it returns
void tp_barrier(at::Tensor shm, int64_t world, int64_t seq, double timeout_s) {
  barrier_or_throw(base_of(shm), world, seq, timeout_s);
}

// the two halves of a barrier, for a rank that waits a long time and must look around meanwhile
void tp_arrive(at::Tensor shm, int64_t world, int64_t seq) { arrive(base_of(shm), world, seq); }

// 0: all arrived; 1: not yet (timeout_s passed); 2: aborted
int64_t tp_wait(at::Tensor shm, int64_t world, int64_t seq, double timeout_s) {
  return wait_all(base_of(shm), world, seq, timeout_s);
}

// a peer is gone: every rank waiting (or about to wait) in a collective gets an error
void tp_abort(at::Tensor shm) {
  uint8_t* base = base_of(shm);
  __atomic_store_n(abort_word(base), 1u, __ATOMIC_RELEASE);
  futex(arrived_word(base), FUTEX_WAKE, INT_MAX, nullptr);
}

TORCH_LIBRARY_FRAGMENT(inferd, m) {
  m.def("tp_all_reduce_(Tensor(a!) x, Tensor shm, int rank, int world, int seq, int slot_bytes, float timeout) -> int",
        &tp_all_reduce_);
  m.def("tp_barrier(Tensor shm, int world, int seq, float timeout) -> ()", &tp_barrier);
  m.def("tp_arrive(Tensor shm, int world, int seq) -> ()", &tp_arrive);
  m.def("tp_wait(Tensor shm, int world, int seq, float timeout) -> int", &tp_wait);
  m.def("tp_abort(Tensor shm) -> ()", &tp_abort);
}
