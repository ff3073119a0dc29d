// The CUDA path of the native core: the device arena (one cudaMalloc of num_slots x stride bytes,
// shared with another process through a CUDA IPC handle keyed by GPU UUID), host->device copies
// on dedicated streams completed by events, and page-locking of host memory.
//
//   daemon process                                  compute process
//   DeviceArena::allocate(dev, n, slot_bytes)       DeviceArena::open(handle, gpu_uuid, n, slot_bytes)
//     export_handle() -> 64 bytes  ── gRPC ──▶        device found by UUID (ordinals differ
//     gpu_uuid()      -> "GPU-…"                      between containers), cudaIpcOpenMemHandle
//   CopyEngine(dev).copy_h2d(slot_address(i), pinned host slot, nbytes) -> ticket; wait(ticket)
//
// This header is compiled by g++ without the CUDA headers (the binding and host_pool.cc include
// it): no CUDA type appears here; IPC handles travel as std::string bytes, device pointers as
// uintptr_t. The implementation is csrc/cuda/*.cu, compiled only when nvcc is found
// (EXPERTCACHE_WITH_CUDA); without it nothing here is defined and callers must not link to it.
//
// Every cudaError_t is checked. Failures are exceptions: std::runtime_error whose message is
// "cudaXxx(<args>) failed: <cudaGetErrorName>: <cudaGetErrorString>", std::invalid_argument
// (bad argument, unknown GPU UUID), std::out_of_range (slot or stream index), CopyTimeout.
// Every call sets the device it needs for its duration and restores the calling thread's
// previous current device, so torch's notion of the current device is left alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

namespace expertcache::cuda {

// sizeof(cudaIpcMemHandle_t); checked against the real type in the .cu.
constexpr size_t kIpcHandleBytes = 64;
// Slot stride in the device arena: slot_bytes rounded up to 256 B, the alignment cudaMalloc
// guarantees for its base, so every slot starts as aligned as a fresh allocation (vectorised
// loads of any dtype). Expert blobs are 4 KiB multiples already, so for them stride == slot_bytes.
constexpr size_t kSlotAlignment = 256;

// wait() ran out of time; the copy is still in flight and its ticket stays valid.
class CopyTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Number of visible CUDA devices; 0 when there is no driver or no device (never throws).
int device_count();
// Why device_count() is 0 ("cudaGetDeviceCount() failed: cudaErrorNoDevice: ..."), or "" when
// devices are present.
std::string no_device_reason();
// The CUDA version the installed driver supports (12080 = 12.8), 0 without a driver; and the
// version of the CUDA runtime this module links. A driver older (by major version) than the
// runtime cannot run it: device_count() is then 0 and no_device_reason() says what to do.
int driver_version();
int runtime_version();
// What is wrong with a driver of `driver_version` for this runtime, and how to fix it; "" if
// nothing is (what no_device_reason() adds when the installed driver is too old).
std::string driver_mismatch(int driver_version);
// The NUMA node the device is attached to (sysfs of its PCI bus id), -1 when unknown.
int device_numa_node(int ordinal);
// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", lower-case hex: the form nvidia-smi prints;
// torch's str(get_device_properties(i).uuid) is the same without the "GPU-" prefix.
std::string device_uuid(int ordinal);
// "GPU-" + lower-case of uuid with or without a "GPU-" prefix, in any case. Throws
// std::invalid_argument when what remains is not 8-4-4-4-12 hex digits.
std::string normalize_uuid(const std::string& uuid);
// Ordinal of the visible device whose UUID is uuid (any case, "GPU-" prefix optional). Throws
// std::invalid_argument naming the UUIDs that are visible (or why none is) when it is not there.
int device_for_uuid(const std::string& uuid);

// Page-locks [p, p+n) for every CUDA context (cudaHostRegisterPortable), so copies from it are
// true async DMA. Undo with host_unregister(p) before the memory is freed.
void host_register(void* p, size_t n);
void host_unregister(void* p);

// num_slots x stride bytes of device memory in one allocation, zero-initialised. Either owned
// (allocate: cudaFree on close) or imported from another process (open: cudaIpcCloseMemHandle
// on close). Slot i is [base + i*stride, base + i*stride + slot_bytes).
class DeviceArena {
 public:
  static std::unique_ptr<DeviceArena> allocate(int device, size_t num_slots, size_t slot_bytes);
  // handle: the kIpcHandleBytes of export_handle() in the owning process (a process cannot
  // open its own handle). Peer access is enabled lazily if the memory is on another device.
  static std::unique_ptr<DeviceArena> open(const std::string& handle, const std::string& gpu_uuid,
                                           size_t num_slots, size_t slot_bytes);
  ~DeviceArena();  // close(), never throws
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // Frees (owned) or unmaps (imported) now; idempotent. Errors are reported on stderr, not
  // thrown, so that close() is safe from destructors. Accessors of addresses throw afterwards.
  void close() noexcept;
  bool closed() const { return base_ == 0; }
  bool owned() const { return owned_; }

  std::string export_handle() const;  // kIpcHandleBytes bytes (cudaIpcGetMemHandle); owned only
  const std::string& gpu_uuid() const { return gpu_uuid_; }
  int device() const { return device_; }
  uintptr_t base_address() const;
  uintptr_t slot_address(int64_t index) const;  // std::out_of_range outside [0, num_slots)
  size_t num_slots() const { return num_slots_; }
  size_t slot_bytes() const { return slot_bytes_; }
  size_t stride() const { return stride_; }
  size_t size_bytes() const { return num_slots_ * stride_; }

 private:
  DeviceArena(int device, std::string gpu_uuid, size_t num_slots, size_t slot_bytes, size_t stride,
              uintptr_t base, bool owned)
      : device_(device), gpu_uuid_(std::move(gpu_uuid)), num_slots_(num_slots),
        slot_bytes_(slot_bytes), stride_(stride), base_(base), owned_(owned) {}

  int device_;
  std::string gpu_uuid_;
  size_t num_slots_;
  size_t slot_bytes_;
  size_t stride_;
  uintptr_t base_;  // 0 once closed
  bool owned_;
};

// Host->device copies on num_streams non-blocking streams of one device. Each copy records an
// event (from a recycled pool) and returns a ticket: tickets are 1, 2, 3, ... in issue order;
// a ticket whose copy was seen complete (by query or wait) is released and its event reused, and
// later calls with it report it complete. Thread-safe.
//
// wait() does not poll: a host function queued on the stream right after each copy
// (cudaLaunchHostFunc) notifies a condition variable the waiter sleeps on, with the timeout
// (cudaEventSynchronize has none, and blocking on an event outside the lock would race with its
// recycling). The engine's destructor synchronizes every stream before the state the host
// functions touch goes away.
class CopyEngine {
 public:
  explicit CopyEngine(int device, int num_streams = 2);
  ~CopyEngine();  // synchronizes the streams, then destroys streams and events; never throws
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Queues nbytes from host src (pinned for an asynchronous copy; pageable memory works but the
  // call then returns only once the bytes are staged) to device dst on stream `stream`.
  uint64_t copy_h2d(uintptr_t dst, uintptr_t src, size_t nbytes, int stream = 0);
  bool query(uint64_t ticket);  // true once the copy has completed
  // Returns when the copy has completed; CopyTimeout after timeout_s seconds (< 0: no limit).
  void wait(uint64_t ticket, double timeout_s);
  void synchronize();  // every queued copy on every stream has completed
  int device() const;
  int num_streams() const;
  size_t pending() const;  // copies issued and not yet seen complete

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace expertcache::cuda
