// Host->device copies on dedicated non-blocking streams, completion tracked by pooled events.
// A waiter sleeps on a condition variable that a host function, queued on the stream right after
// the copy, signals when the copy is done (no polling).
#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "check.cuh"
#include "expertcache/cuda.h"

namespace expertcache::cuda {

using detail::check;
using detail::check_ordinal;
using detail::DeviceGuard;
using detail::report;

namespace {
constexpr int kMaxStreams = 64;
}  // namespace

struct CopyEngine::Impl {
  int device = 0;
  std::vector<cudaStream_t> streams;
  mutable std::mutex mu;  // guards everything below
  std::condition_variable done_cv;  // notified by on_copied
  uint64_t next_ticket = 1;
  std::unordered_map<uint64_t, cudaEvent_t> inflight;  // ticket -> event recorded after its copy
  std::unordered_set<uint64_t> copied;  // in flight, and its stream has run past the copy
  std::vector<cudaEvent_t> free_events;

  // Under mu. A pooled event, or a new one (the device must be current).
  cudaEvent_t take_event() {
    if (!free_events.empty()) {
      cudaEvent_t e = free_events.back();
      free_events.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    // No timing: cheaper to record and query; we never measure with these events.
    check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
          "cudaEventCreateWithFlags(cudaEventDisableTiming)");
    return e;
  }

  // Under mu. true when the ticket's copy has completed (releasing its event).
  bool query_locked(uint64_t ticket) {
    if (ticket == 0 || ticket >= next_ticket)
      throw std::invalid_argument("unknown copy ticket " + std::to_string(ticket) +
                                  " (issued so far: 1.." + std::to_string(next_ticket - 1) + ")");
    auto it = inflight.find(ticket);
    if (it == inflight.end()) return true;  // seen complete before and released
    const cudaError_t err = cudaEventQuery(it->second);
    if (err == cudaErrorNotReady) return false;
    check(err, "cudaEventQuery(ticket " + std::to_string(ticket) + ")");
    free_events.push_back(it->second);
    inflight.erase(it);
    copied.erase(ticket);
    return true;
  }

  // What the host function queued after a copy needs: the engine and the ticket.
  struct Copied {
    Impl* impl;
    uint64_t ticket;
  };

  // Runs on a CUDA driver thread once the stream has passed the copy (no CUDA calls allowed
  // here). The engine outlives it: its destructor synchronizes every stream first.
  static void CUDART_CB on_copied(void* arg) {
    Copied* c = static_cast<Copied*>(arg);
    {
      std::lock_guard<std::mutex> g(c->impl->mu);
      // Released meanwhile by a query that saw the event complete: nothing to record.
      if (c->impl->inflight.count(c->ticket) != 0) c->impl->copied.insert(c->ticket);
    }
    c->impl->done_cv.notify_all();
    delete c;
  }
};

CopyEngine::CopyEngine(int device, int num_streams) : impl_(new Impl) {
  if (num_streams < 1 || num_streams > kMaxStreams)
    throw std::invalid_argument("copy engine: num_streams must be in [1, " +
                                std::to_string(kMaxStreams) + "], got " +
                                std::to_string(num_streams));
  check_ordinal(device);
  impl_->device = device;
  DeviceGuard guard(device);
  for (int i = 0; i < num_streams; ++i) {
    cudaStream_t s = nullptr;
    // Non-blocking: no implicit synchronisation with the legacy default stream, which torch
    // or other libraries in the process may be using for unrelated work.
    const cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (err != cudaSuccess) {
      for (cudaStream_t t : impl_->streams) report(cudaStreamDestroy(t), "cudaStreamDestroy");
      check(err, "cudaStreamCreateWithFlags(cudaStreamNonBlocking) on device " +
                     std::to_string(device));
    }
    impl_->streams.push_back(s);
  }
}

CopyEngine::~CopyEngine() {
  try {
    DeviceGuard guard(impl_->device);
    for (cudaStream_t s : impl_->streams) report(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    for (auto& kv : impl_->inflight) report(cudaEventDestroy(kv.second), "cudaEventDestroy");
    for (cudaEvent_t e : impl_->free_events) report(cudaEventDestroy(e), "cudaEventDestroy");
    for (cudaStream_t s : impl_->streams) report(cudaStreamDestroy(s), "cudaStreamDestroy");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "expertcache: destroying the copy engine: %s\n", e.what());
  }
}

uint64_t CopyEngine::copy_h2d(uintptr_t dst, uintptr_t src, size_t nbytes, int stream) {
  if (stream < 0 || stream >= static_cast<int>(impl_->streams.size()))
    throw std::out_of_range("copy engine: stream " + std::to_string(stream) + " out of range [0, " +
                            std::to_string(impl_->streams.size()) + ")");
  if (dst == 0 || src == 0)
    throw std::invalid_argument("copy engine: null address (dst=" + std::to_string(dst) +
                                ", src=" + std::to_string(src) + ")");
  DeviceGuard guard(impl_->device);
  cudaEvent_t ev;
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    ev = impl_->take_event();
    ticket = impl_->next_ticket++;
  }
  cudaStream_t s = impl_->streams[stream];
  // Outside the lock: from pageable memory the call blocks until the bytes are staged.
  cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src),
                                    nbytes, cudaMemcpyHostToDevice, s);
  std::string call = "cudaMemcpyAsync(dst=" + std::to_string(dst) + ", src=" +
                     std::to_string(src) + ", " + std::to_string(nbytes) +
                     " bytes, cudaMemcpyHostToDevice, stream " + std::to_string(stream) + ")";
  if (err == cudaSuccess) {
    err = cudaEventRecord(ev, s);
    call = "cudaEventRecord(stream " + std::to_string(stream) + ")";
  }
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    if (err != cudaSuccess) {
      impl_->free_events.push_back(ev);
      check(err, call);
    }
    impl_->inflight.emplace(ticket, ev);
  }
  // Queued after the event: when it runs, the copy is done and wait() is woken.
  auto* c = new Impl::Copied{impl_.get(), ticket};
  err = cudaLaunchHostFunc(s, &Impl::on_copied, c);
  if (err != cudaSuccess) {
    delete c;
    // The copy is queued and its event recorded: only its wake-up is missing. Wait for the
    // stream (a failure here is rare and the copy short), so no waiter can sleep forever.
    report(cudaStreamSynchronize(s), "cudaStreamSynchronize after a failed cudaLaunchHostFunc");
    std::lock_guard<std::mutex> g(impl_->mu);
    impl_->copied.insert(ticket);
    check(err, "cudaLaunchHostFunc(stream " + std::to_string(stream) + ")");
  }
  return ticket;
}

bool CopyEngine::query(uint64_t ticket) {
  DeviceGuard guard(impl_->device);
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->query_locked(ticket);
}

void CopyEngine::wait(uint64_t ticket, double timeout_s) {
  using clock = std::chrono::steady_clock;
  DeviceGuard guard(impl_->device);
  std::unique_lock<std::mutex> lock(impl_->mu);
  if (impl_->query_locked(ticket)) return;  // also checks that the ticket was issued
  // Sleep until the host function queued after the copy says the stream passed it.
  auto passed = [&] { return impl_->copied.count(ticket) != 0 || impl_->inflight.count(ticket) == 0; };
  if (timeout_s < 0) {
    impl_->done_cv.wait(lock, passed);
  } else if (!impl_->done_cv.wait_until(
                 lock,
                 clock::now() + std::chrono::duration_cast<clock::duration>(
                                    std::chrono::duration<double>(timeout_s)),
                 passed)) {
    throw CopyTimeout("copy ticket " + std::to_string(ticket) + " not complete after " +
                      std::to_string(timeout_s) + " s");
  }
  // The event was recorded before the host function ran, so it is complete: release it and
  // surface any error of the copy.
  if (!impl_->query_locked(ticket))
    throw std::runtime_error("copy ticket " + std::to_string(ticket) +
                             ": the stream passed the copy but its event is not complete");
}

void CopyEngine::synchronize() {
  DeviceGuard guard(impl_->device);
  for (size_t i = 0; i < impl_->streams.size(); ++i)
    check(cudaStreamSynchronize(impl_->streams[i]), "cudaStreamSynchronize(stream " +
                                                        std::to_string(i) + ")");
  std::lock_guard<std::mutex> g(impl_->mu);
  std::vector<uint64_t> tickets;
  for (const auto& kv : impl_->inflight) tickets.push_back(kv.first);
  for (uint64_t t : tickets) impl_->query_locked(t);  // releases every event recorded before
}

int CopyEngine::device() const { return impl_->device; }

int CopyEngine::num_streams() const { return static_cast<int>(impl_->streams.size()); }

size_t CopyEngine::pending() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->inflight.size();
}

}  // namespace expertcache::cuda
