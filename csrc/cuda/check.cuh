// Private to csrc/cuda/*.cu: error checking and a scoped current-device switch.
#pragma once

#include <cuda.h>  // types only (CUcontext, CUresult): driver calls go through the runtime
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

inline std::string cuda_version_text(int v) {
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

// "" when the installed driver can run the CUDA runtime this module links (statically, so it is
// the runtime of the nvcc that built it, whatever torch was built with); otherwise what is wrong
// and how to fix it. A driver runs every runtime of its major version and older ones.
inline std::string driver_too_old(int driver) {
  if (driver == 0 || driver / 1000 >= CUDART_VERSION / 1000) return "";  // 0: no driver at all
  return "the NVIDIA driver supports CUDA " + cuda_version_text(driver) +
         ", older than the CUDA runtime " + cuda_version_text(CUDART_VERSION) +
         " that this build of the native core links: install a driver for CUDA " +
         std::to_string(CUDART_VERSION / 1000) + " or rebuild the native core with a CUDA toolkit of at most " +
         cuda_version_text(driver) + " (its nvcc first on PATH, then `pip install .` or `make native`)";
}

inline std::string driver_too_old() {
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) {
    (void)cudaGetLastError();
    return "";
  }
  return driver_too_old(driver);
}

// cudaGetDeviceCount, with the driver/runtime mismatch spelt out when that is why it fails.
inline int checked_device_count() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    const std::string why = driver_too_old();
    if (!why.empty()) {
      (void)cudaGetLastError();
      throw std::runtime_error(error_message(err, "cudaGetDeviceCount()") + ": " + why);
    }
    check(err, "cudaGetDeviceCount()");
  }
  return n;
}

// The ordinal is checked against the visible devices first, so a machine without a driver or
// device reports cudaGetDeviceCount's error (naming the cause) rather than a later call's.
inline void check_ordinal(int device) {
  const int n = checked_device_count();
  if (device < 0 || device >= n)
    throw std::out_of_range("CUDA device ordinal " + std::to_string(device) + " out of range [0, " +
                            std::to_string(n) + ")");
}

// The driver's current-context calls, reached through the runtime (cudaGetDriverEntryPoint*),
// so the module needs no link to libcuda and still loads on machines without a driver.
struct DriverContextCalls {
  CUresult (*get)(CUcontext*) = nullptr;
  CUresult (*set)(CUcontext) = nullptr;
};

inline const DriverContextCalls& driver_context_calls() {
  static const DriverContextCalls calls = [] {
    DriverContextCalls c;
    void* get = nullptr;
    void* set = nullptr;
    cudaDriverEntryPointQueryResult q1, q2;
#if CUDART_VERSION >= 12050
    const bool ok =
        cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get, 12000, cudaEnableDefault, &q1) == cudaSuccess &&
        cudaGetDriverEntryPointByVersion("cuCtxSetCurrent", &set, 12000, cudaEnableDefault, &q2) == cudaSuccess;
#else
    const bool ok = cudaGetDriverEntryPoint("cuCtxGetCurrent", &get, cudaEnableDefault, &q1) == cudaSuccess &&
                    cudaGetDriverEntryPoint("cuCtxSetCurrent", &set, cudaEnableDefault, &q2) == cudaSuccess;
#endif
    if (ok && q1 == cudaDriverEntryPointSuccess && q2 == cudaDriverEntryPointSuccess) {
      c.get = reinterpret_cast<CUresult (*)(CUcontext*)>(get);
      c.set = reinterpret_cast<CUresult (*)(CUcontext)>(set);
    } else {
      (void)cudaGetLastError();
    }
    return c;
  }();
  return calls;
}

// Makes `device` current for the calling thread and, on exit, restores exactly the context that
// was current before: none if none was. (The runtime's cudaGetDevice answers 0 on a thread with
// no context, and setting device 0 back would create a context on GPU 0 for work that was meant
// for another GPU, costing that GPU hundreds of MiB.) The runtime's current device is per thread
// and shared with torch in the same process.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    const DriverContextCalls& calls = driver_context_calls();
    if (calls.get != nullptr && calls.set != nullptr && calls.get(&prev_ctx_) == CUDA_SUCCESS) {
      by_context_ = true;
      check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
      return;
    }
    // Without the driver calls: restore the previous device, unless the runtime reports the
    // device we are about to set (nothing to restore then).
    check(cudaGetDevice(&prev_), "cudaGetDevice()");
    if (prev_ != device) {
      check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
      restore_ = true;
    }
  }
  ~DeviceGuard() {
    if (by_context_) {
      const CUresult r = driver_context_calls().set(prev_ctx_);
      if (r != CUDA_SUCCESS) std::fprintf(stderr, "expertcache: cuCtxSetCurrent failed: %d\n", static_cast<int>(r));
    } else if (restore_) {
      report(cudaSetDevice(prev_), "cudaSetDevice(" + std::to_string(prev_) + ")");
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  CUcontext prev_ctx_ = nullptr;
  bool by_context_ = false;
  int prev_ = 0;
  bool restore_ = false;
};

}  // namespace expertcache::cuda::detail
