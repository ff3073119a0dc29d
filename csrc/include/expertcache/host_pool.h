// Host pool: one page-aligned anonymous mapping carved into fixed-size slots (each slot starts
// on a 4 KiB boundary, so O_DIRECT reads can target it). Thread-safe alloc/free of slot indices.
// With pin=true the whole mapping is page-locked for CUDA (cudaHostRegister, portable to every
// context) so host->device copies from it are asynchronous DMA; it is unregistered before unmap.
// With numa_node >= 0 the mapping's pages are placed on that NUMA node (mbind MPOL_PREFERRED
// before the first touch): a pool that feeds a GPU lives on the GPU's node, so host->device DMA
// does not cross the socket interconnect. -1 leaves placement to the kernel (first touch).
// Failures are exceptions: std::out_of_range (bad index), std::invalid_argument (bad argument,
// double free), std::runtime_error (exhausted, mmap failure, "cannot pin host memory: <reason>"
// when pinning is asked for in a build without CUDA or the CUDA call fails; the caller decides
// whether to fall back to an unpinned pool).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace expertcache {

class HostPool {
 public:
  static constexpr size_t kAlignment = 4096;

  HostPool(size_t num_slots, size_t slot_bytes, bool pin = false, int numa_node = -1);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  size_t alloc();
  void free(int64_t index);
  bool is_allocated(int64_t index) const;

  uint8_t* slot_ptr(int64_t index) const;  // checks bounds, not allocation
  uint8_t* base() const { return base_; }
  size_t num_slots() const { return num_slots_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t stride() const { return stride_; }  // slot_bytes rounded up to kAlignment
  size_t total_bytes() const { return total_bytes_; }
  size_t num_free() const;
  bool pinned() const { return pinned_; }
  int numa_node() const { return numa_node_; }  // -1: no placement asked for

 private:
  size_t check_index(int64_t index) const;

  size_t num_slots_;
  size_t slot_bytes_;
  size_t stride_;
  size_t total_bytes_;
  uint8_t* base_;
  bool pinned_ = false;
  int numa_node_ = -1;
  mutable std::mutex mu_;
  std::vector<size_t> free_list_;  // stack; lowest index on top initially
  std::vector<bool> in_use_;
};

}  // namespace expertcache
