// Device discovery by UUID, host page-locking, and the device arena (allocate / export / open).
#include <cuda_runtime.h>

#include <cctype>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "check.cuh"
#include "expertcache/cuda.h"

namespace expertcache::cuda {

using detail::check;
using detail::check_ordinal;
using detail::DeviceGuard;
using detail::report;

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "cudaIpcMemHandle_t size changed");

namespace {

std::string hex(uintptr_t v) {
  char buf[2 + 2 * sizeof(v) + 1];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

int device_count() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::string no_device_reason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    const std::string why = detail::driver_too_old();
    return detail::error_message(err, "cudaGetDeviceCount()") + (why.empty() ? "" : ": " + why);
  }
  return n == 0 ? "cudaGetDeviceCount() returned 0 devices" : "";
}

int driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return v;
}

int runtime_version() { return CUDART_VERSION; }

std::string driver_mismatch(int driver_version) { return detail::driver_too_old(driver_version); }

int device_numa_node(int ordinal) {
  check_ordinal(ordinal);
  char bus[32] = {0};
  check(cudaDeviceGetPCIBusId(bus, sizeof(bus), ordinal),
        "cudaDeviceGetPCIBusId(device " + std::to_string(ordinal) + ")");
  // sysfs names PCI devices in lower case with a 4-digit domain: 0000:3b:00.0
  std::string id(bus);
  for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (id.size() > 12 && id.compare(0, 4, "0000") == 0 && id[8] == ':') id = id.substr(4);  // 8-digit domain
  std::FILE* f = std::fopen(("/sys/bus/pci/devices/" + id + "/numa_node").c_str(), "r");
  if (f == nullptr) return -1;
  int node = -1;
  if (std::fscanf(f, "%d", &node) != 1) node = -1;
  std::fclose(f);
  return node;  // -1: the platform does not say (one node, or a VM)
}

std::string device_uuid(int ordinal) {
  check_ordinal(ordinal);
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, ordinal),
        "cudaGetDeviceProperties(device " + std::to_string(ordinal) + ")");
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  // 8-4-4-4-12 lower-case hex of the 16 bytes in order, as nvidia-smi and torch print them.
  char buf[64];
  std::snprintf(buf, sizeof(buf),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return buf;
}

std::string normalize_uuid(const std::string& uuid) {
  std::string s;
  for (char c : uuid) s.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  // Surrounding whitespace (a line read from nvidia-smi) is not part of the UUID.
  const auto first = s.find_first_not_of(" \t\r\n");
  const auto last = s.find_last_not_of(" \t\r\n");
  s = first == std::string::npos ? "" : s.substr(first, last - first + 1);
  if (s.rfind("gpu-", 0) == 0) s = s.substr(4);
  bool ok = s.size() == 36;
  for (size_t i = 0; ok && i < s.size(); ++i) {
    const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    ok = dash ? s[i] == '-' : std::isxdigit(static_cast<unsigned char>(s[i])) != 0;
  }
  if (!ok)
    throw std::invalid_argument("malformed GPU UUID '" + uuid +
                                "': expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (hex)");
  return "GPU-" + s;
}

int device_for_uuid(const std::string& uuid) {
  const std::string want = normalize_uuid(uuid);
  const int n = device_count();
  std::string seen;
  for (int i = 0; i < n; ++i) {
    const std::string have = device_uuid(i);
    if (have == want) return i;
    seen += (seen.empty() ? "" : ", ") + have;
  }
  if (n == 0) seen = "none (" + no_device_reason() + ")";
  throw std::invalid_argument("no visible CUDA device has UUID " + want + "; visible: " + seen);
}

void host_register(void* p, size_t n) {
  check(cudaHostRegister(p, n, cudaHostRegisterPortable),
        "cudaHostRegister(" + hex(reinterpret_cast<uintptr_t>(p)) + ", " + std::to_string(n) +
            " bytes, cudaHostRegisterPortable)");
}

void host_unregister(void* p) {
  check(cudaHostUnregister(p), "cudaHostUnregister(" + hex(reinterpret_cast<uintptr_t>(p)) + ")");
}

namespace {

size_t checked_stride(size_t num_slots, size_t slot_bytes) {
  if (num_slots == 0) throw std::invalid_argument("device arena: num_slots must be > 0");
  if (slot_bytes == 0) throw std::invalid_argument("device arena: slot_bytes must be > 0");
  if (slot_bytes > SIZE_MAX - kSlotAlignment)
    throw std::invalid_argument("device arena: slot_bytes too large");
  const size_t stride = (slot_bytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
  if (num_slots > SIZE_MAX / stride) throw std::invalid_argument("device arena: size overflows");
  return stride;
}

}  // namespace

std::unique_ptr<DeviceArena> DeviceArena::allocate(int device, size_t num_slots,
                                                   size_t slot_bytes) {
  const size_t stride = checked_stride(num_slots, slot_bytes);
  const size_t size = num_slots * stride;
  check_ordinal(device);
  std::string uuid = device_uuid(device);
  DeviceGuard guard(device);
  void* p = nullptr;
  check(cudaMalloc(&p, size), "cudaMalloc(" + std::to_string(size) + " bytes on device " +
                                  std::to_string(device) + ")");
  // cudaMemset is asynchronous to the host and runs on the legacy default stream, which our
  // non-blocking copy streams do not wait for: finish it before anyone can copy into a slot.
  cudaError_t err = cudaMemset(p, 0, size);
  std::string call = "cudaMemset(" + hex(reinterpret_cast<uintptr_t>(p)) + ", 0, " +
                     std::to_string(size) + ")";
  if (err == cudaSuccess) {
    err = cudaStreamSynchronize(0);
    call = "cudaStreamSynchronize(0) after " + call;
  }
  if (err != cudaSuccess) {
    report(cudaFree(p), "cudaFree(" + hex(reinterpret_cast<uintptr_t>(p)) + ")");
    check(err, call);
  }
  return std::unique_ptr<DeviceArena>(new DeviceArena(device, std::move(uuid), num_slots,
                                                      slot_bytes, stride,
                                                      reinterpret_cast<uintptr_t>(p), true));
}

std::unique_ptr<DeviceArena> DeviceArena::open(const std::string& handle,
                                               const std::string& gpu_uuid, size_t num_slots,
                                               size_t slot_bytes) {
  if (handle.size() != kIpcHandleBytes)
    throw std::invalid_argument("CUDA IPC handle must be " + std::to_string(kIpcHandleBytes) +
                                " bytes (cudaIpcMemHandle_t), got " +
                                std::to_string(handle.size()));
  const size_t stride = checked_stride(num_slots, slot_bytes);
  // By UUID, never by ordinal: CUDA_VISIBLE_DEVICES differs between containers of one pod.
  const int device = device_for_uuid(gpu_uuid);
  DeviceGuard guard(device);
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), kIpcHandleBytes);
  void* p = nullptr;
  check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
        "cudaIpcOpenMemHandle(device " + std::to_string(device) + " " + normalize_uuid(gpu_uuid) +
            ", cudaIpcMemLazyEnablePeerAccess)");
  return std::unique_ptr<DeviceArena>(new DeviceArena(device, normalize_uuid(gpu_uuid), num_slots,
                                                      slot_bytes, stride,
                                                      reinterpret_cast<uintptr_t>(p), false));
}

DeviceArena::~DeviceArena() { close(); }

void DeviceArena::close() noexcept {
  if (base_ == 0) return;
  void* p = reinterpret_cast<void*>(base_);
  base_ = 0;
  try {
    DeviceGuard guard(device_);
    if (owned_)
      report(cudaFree(p), "cudaFree(" + hex(reinterpret_cast<uintptr_t>(p)) + ")");
    else
      report(cudaIpcCloseMemHandle(p),
             "cudaIpcCloseMemHandle(" + hex(reinterpret_cast<uintptr_t>(p)) + ")");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "expertcache: closing the device arena: %s\n", e.what());
  }
}

uintptr_t DeviceArena::base_address() const {
  if (base_ == 0) throw std::runtime_error("device arena is closed");
  return base_;
}

uintptr_t DeviceArena::slot_address(int64_t index) const {
  if (index < 0 || static_cast<uint64_t>(index) >= num_slots_)
    throw std::out_of_range("device arena: slot " + std::to_string(index) + " out of range [0, " +
                            std::to_string(num_slots_) + ")");
  return base_address() + static_cast<size_t>(index) * stride_;
}

std::string DeviceArena::export_handle() const {
  if (!owned_)
    throw std::runtime_error(
        "device arena: an arena opened from an IPC handle cannot be exported again");
  const uintptr_t base = base_address();
  DeviceGuard guard(device_);
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)),
        "cudaIpcGetMemHandle(" + hex(base) + ")");
  return std::string(reinterpret_cast<const char*>(&h), kIpcHandleBytes);
}

}  // namespace expertcache::cuda
