// Private to csrc/cuda/*.cu: error checking and a scoped current-device switch.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <stdexcept>
#include <string>

namespace expertcache::cuda::detail {

// "cudaXxx(<args>) failed: cudaErrorYyy: <description>"
inline std::string error_message(cudaError_t err, const std::string& call) {
  return call + " failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
}

inline void check(cudaError_t err, const std::string& call) {
  if (err != cudaSuccess) {
    // Clears the error where it is not sticky, so the next unrelated call does not report it.
    (void)cudaGetLastError();
    throw std::runtime_error(error_message(err, call));
  }
}

// For destructors and close(): the failure is reported, never thrown.
inline void report(cudaError_t err, const std::string& call) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    std::fprintf(stderr, "expertcache: %s\n", error_message(err, call).c_str());
  }
}

// The ordinal is checked against the visible devices first, so a machine without a driver or
// device reports cudaGetDeviceCount's error (naming the cause) rather than a later call's.
inline void check_ordinal(int device) {
  int n = 0;
  check(cudaGetDeviceCount(&n), "cudaGetDeviceCount()");
  if (device < 0 || device >= n)
    throw std::out_of_range("CUDA device ordinal " + std::to_string(device) + " out of range [0, " +
                            std::to_string(n) + ")");
}

// Makes `device` current for the calling thread and restores the previous one on exit: the
// runtime's current device is per thread and shared with torch in the same process.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&prev_), "cudaGetDevice()");
    if (prev_ != device) {
      check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
      restore_ = true;
    }
  }
  ~DeviceGuard() {
    if (restore_) report(cudaSetDevice(prev_), "cudaSetDevice(" + std::to_string(prev_) + ")");
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool restore_ = false;
};

}  // namespace expertcache::cuda::detail
