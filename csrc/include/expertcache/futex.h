// Shared (cross-process) futex waits and wakes on 32-bit atomics in a MAP_SHARED mapping.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <system_error>

namespace expertcache {

// Shared (non-_PRIVATE) futex ops: waiters and wakers live in different processes.
inline long futex_wait(std::atomic<uint32_t>* word, uint32_t expected, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, timeout,
                 nullptr, 0);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

inline void futex_wake_one(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

// One FUTEX_WAIT while `*word == expected`, at most `timeout` (null: no limit). True when woken or
// the word was no longer `expected`; false when the time ran out or a signal came. Any other error
// throws std::system_error with the text `message()` (made only then).
template <class Message>
inline bool futex_wait_checked(std::atomic<uint32_t>* word, uint32_t expected, const timespec* timeout,
                               const Message& message) {
  if (futex_wait(word, expected, timeout) == 0) return true;
  const int e = errno;
  if (e == EAGAIN) return true;
  if (e == EINTR || e == ETIMEDOUT) return false;
  throw std::system_error(e, std::generic_category(), message());
}

// Counts its owner in `sleepers` (null: no count) while it lives, so that a waker makes the wake
// syscall only when someone sleeps.
class FutexSleeper {
 public:
  explicit FutexSleeper(std::atomic<uint32_t>* sleepers) : sleepers_(sleepers) {
    if (sleepers_ != nullptr) sleepers_->fetch_add(1);
  }
  ~FutexSleeper() {
    if (sleepers_ != nullptr) sleepers_->fetch_sub(1);
  }
  FutexSleeper(const FutexSleeper&) = delete;
  FutexSleeper& operator=(const FutexSleeper&) = delete;

 private:
  std::atomic<uint32_t>* sleepers_;
};

// The steady-clock time `timeout_s` from now; time_point::max() (no limit) when < 0 or infinite.
inline std::chrono::steady_clock::time_point futex_deadline(double timeout_s) {
  using clock = std::chrono::steady_clock;
  if (timeout_s < 0 || std::isinf(timeout_s)) return clock::time_point::max();
  return clock::now() +
         std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
}

// Sleeps while `*word == seen`, until `deadline` (time_point::max(): no limit), counted in
// `sleepers` (null: none, for a word whose wakers always make the wake syscall). Returns true
// when the word changed. `what` names the word in errors.
inline bool futex_wait_until(std::atomic<uint32_t>* word, std::atomic<uint32_t>* sleepers,
                             uint32_t seen, std::chrono::steady_clock::time_point deadline,
                             const std::string& what) {
  using clock = std::chrono::steady_clock;
  const bool forever = deadline == clock::time_point::max();
  // Registered before the word is read (both seq_cst): a waker either sees a sleeper and wakes,
  // or changed the word before our read and we return at once.
  const FutexSleeper sleeping(sleepers);
  for (;;) {
    if (word->load() != seen) return true;
    timespec ts{};
    const timespec* tp = nullptr;
    if (!forever) {
      const auto left = deadline - clock::now();
      if (left <= clock::duration::zero()) return false;
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      ts = timespec{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      tp = &ts;
    }
    futex_wait_checked(word, seen, tp, [&] { return what + ": futex wait"; });
  }
}

// Sleeps while `*word == seen`, at most `timeout_s` (< 0 or inf: no limit), announcing itself in
// `sleepers` first so that a waker makes the wake syscall only when someone sleeps. Returns true
// when the word changed. `what` names the word in errors.
inline bool futex_wait_changed(std::atomic<uint32_t>* word, std::atomic<uint32_t>* sleepers,
                               uint32_t seen, double timeout_s, const std::string& what) {
  if (std::isnan(timeout_s)) throw std::invalid_argument(what + ": timeout_s is NaN");
  return futex_wait_until(word, sleepers, seen, futex_deadline(timeout_s), what);
}

// A hint to the CPU inside a polling loop (x86's PAUSE; nothing elsewhere).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Polls until `done()` without sleeping: for `grace_s`, and past that only while `worth()` holds
// (the thread that will make it done is at work on another core: no sleep, and the waker makes no
// wake syscall), `spin_s` in all (at most 1 ms). True as soon as `done()`; false when the polling
// stops short of it (then the caller sleeps).
template <class Done, class Worth>
inline bool poll_while_worth(Done done, double spin_s, double grace_s, Worth worth) {
  if (!(spin_s > 0)) return false;
  using clock = std::chrono::steady_clock;
  auto seconds = [](double s) {
    return std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
  };
  const auto start = clock::now();
  const auto until = start + seconds(std::min(spin_s, 1e-3));
  const auto grace_until = std::min(until, start + seconds(std::max(grace_s, 0.0)));
  for (unsigned i = 0;; ++i) {
    if (done()) return true;
    if ((i & 63) == 63) {
      const auto now = clock::now();
      if (now >= until || (now >= grace_until && !worth())) return false;
    }
    cpu_relax();
  }
}

// The same, polling `*word` while it equals `seen`: true as soon as it differs.
template <class Worth>
inline bool poll_while_worth(std::atomic<uint32_t>* word, uint32_t seen, double spin_s, double grace_s,
                             Worth worth) {
  return poll_while_worth([word, seen] { return word->load(std::memory_order_acquire) != seen; }, spin_s,
                          grace_s, worth);
}

// Bumps `word` and wakes its sleepers, if any. A channel's words have one sleeper each (the
// daemon's thread for that client on the doorbell, compute's scheduler thread on notify).
inline void futex_bump(std::atomic<uint32_t>* word, std::atomic<uint32_t>* sleepers) {
  word->fetch_add(1);  // seq_cst: ordered before the sleepers load
  const uint32_t n = sleepers->load();
  if (n == 1) futex_wake_one(word);
  else if (n != 0) futex_wake_all(word);
}

}  // namespace expertcache
