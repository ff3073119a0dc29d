#include "expertcache/host_pool.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#ifdef EXPERTCACHE_WITH_CUDA
#include "expertcache/cuda.h"
#endif

namespace expertcache {

namespace {

// mbind(2) without libnuma: MPOL_PREFERRED (1) puts pages on `node` when it has memory and
// elsewhere rather than failing when it has none. Must run before the pages are first touched.
constexpr int kMpolPreferred = 1;

void prefer_node(void* p, size_t bytes, int node) {
  constexpr size_t kBitsPerWord = 8 * sizeof(unsigned long);
  if (node < 0 || node >= 1024)
    throw std::invalid_argument("host pool: NUMA node " + std::to_string(node) +
                                " out of range [0, 1024)");
  std::vector<unsigned long> mask(1024 / kBitsPerWord, 0);
  mask[static_cast<size_t>(node) / kBitsPerWord] |= 1UL << (static_cast<size_t>(node) % kBitsPerWord);
  if (syscall(SYS_mbind, p, bytes, kMpolPreferred, mask.data(), 1024 + 1, 0) != 0)
    throw std::system_error(errno, std::generic_category(),
                            "host pool: mbind to NUMA node " + std::to_string(node));
}

}  // namespace

HostPool::HostPool(size_t num_slots, size_t slot_bytes, bool pin, int numa_node)
    : num_slots_(num_slots), slot_bytes_(slot_bytes) {
#ifndef EXPERTCACHE_WITH_CUDA
  if (pin)
    throw std::runtime_error(
        "cannot pin host memory: this build has no CUDA path (nvcc was not found when it was "
        "built, or it was built with WITH_CUDA=0)");
#endif
  if (num_slots == 0) throw std::invalid_argument("host pool: num_slots must be > 0");
  if (slot_bytes == 0) throw std::invalid_argument("host pool: slot_bytes must be > 0");
  stride_ = (slot_bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (num_slots > SIZE_MAX / stride_) throw std::invalid_argument("host pool: size overflows");
  total_bytes_ = num_slots * stride_;
  void* p = mmap(nullptr, total_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw std::system_error(errno, std::generic_category(),
                            "host pool: mmap of " + std::to_string(total_bytes_) + " bytes");
  base_ = static_cast<uint8_t*>(p);
  if (numa_node >= 0) {
    try {
      prefer_node(base_, total_bytes_, numa_node);
    } catch (...) {
      munmap(base_, total_bytes_);
      throw;
    }
    numa_node_ = numa_node;
  }
#ifdef EXPERTCACHE_WITH_CUDA
  if (pin) {
    try {
      cuda::host_register(base_, total_bytes_);
    } catch (const std::exception& e) {
      munmap(base_, total_bytes_);
      throw std::runtime_error(std::string("cannot pin host memory: ") + e.what());
    }
    pinned_ = true;
  }
#endif
  in_use_.assign(num_slots, false);
  free_list_.reserve(num_slots);
  for (size_t i = num_slots; i-- > 0;) free_list_.push_back(i);
}

HostPool::~HostPool() {
#ifdef EXPERTCACHE_WITH_CUDA
  // Unregister before unmapping: the driver's record of the range must not outlive the pages.
  if (pinned_) {
    try {
      cuda::host_unregister(base_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "expertcache: host pool: %s\n", e.what());
    }
  }
#endif
  munmap(base_, total_bytes_);
}

size_t HostPool::check_index(int64_t index) const {
  if (index < 0 || static_cast<uint64_t>(index) >= num_slots_)
    throw std::out_of_range("host pool: slot " + std::to_string(index) + " out of range [0, " +
                            std::to_string(num_slots_) + ")");
  return static_cast<size_t>(index);
}

size_t HostPool::alloc() {
  std::lock_guard<std::mutex> g(mu_);
  if (free_list_.empty())
    throw std::runtime_error("host pool exhausted: all " + std::to_string(num_slots_) +
                             " slots in use");
  size_t i = free_list_.back();
  free_list_.pop_back();
  in_use_[i] = true;
  return i;
}

void HostPool::free(int64_t index) {
  size_t i = check_index(index);
  std::lock_guard<std::mutex> g(mu_);
  if (!in_use_[i])
    throw std::invalid_argument("host pool: double free of slot " + std::to_string(i));
  in_use_[i] = false;
  free_list_.push_back(i);
}

bool HostPool::is_allocated(int64_t index) const {
  size_t i = check_index(index);
  std::lock_guard<std::mutex> g(mu_);
  return in_use_[i];
}

uint8_t* HostPool::slot_ptr(int64_t index) const { return base_ + check_index(index) * stride_; }

size_t HostPool::num_free() const {
  std::lock_guard<std::mutex> g(mu_);
  return free_list_.size();
}

}  // namespace expertcache
