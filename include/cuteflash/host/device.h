// Host helpers that read the current CUDA device: error checks, the device's limits (queried once per device),
// and the kernels' shared-memory attribute. Host code only, so that the binding (src/api.cpp) includes it too.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace cuteflash {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("cuteflash: ") + what + " failed: " + cudaGetErrorString(err));
  }
}

constexpr int kMaxDevices = 64;

// The current CUDA device.
inline int current_device() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device < 0 || device >= kMaxDevices) {
    throw std::runtime_error("cuteflash: CUDA device " + std::to_string(device) + " is beyond the " +
                             std::to_string(kMaxDevices) + " devices it supports");
  }
  return device;
}

// The limits of a device that the launches read, queried once per device: a launch reads them on every call,
// and they do not change while the process runs.
struct DeviceLimits {
  int sms = 0;                   // multiprocessors
  int smem_per_sm = 0;           // shared memory per multiprocessor, bytes
  int smem_per_block_optin = 0;  // the most one block may opt in to, bytes
};

inline DeviceLimits const& device_limits() {
  static std::array<std::once_flag, kMaxDevices> once;
  static std::array<DeviceLimits, kMaxDevices> limits;
  const int device = current_device();
  std::call_once(once[device], [device] {
    DeviceLimits l;
    check_cuda(cudaDeviceGetAttribute(&l.sms, cudaDevAttrMultiProcessorCount, device), "reading the SM count");
    check_cuda(cudaDeviceGetAttribute(&l.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
               "reading the shared memory per SM");
    check_cuda(cudaDeviceGetAttribute(&l.smem_per_block_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
               "reading the shared-memory limit");
    limits[device] = l;
  });
  return limits[device];
}

// The opt-in shared memory per block of the current device. Developers: CUTEFLASH_SMEM_LIMIT=<bytes>
// lowers it, so that the tiles of a smaller GPU (T4: 65536, sm86/89: 101376) run on a larger one.
inline int max_smem_per_block() {
  int max_smem = device_limits().smem_per_block_optin;
  if (char const* limit = std::getenv("CUTEFLASH_SMEM_LIMIT"); limit != nullptr && *limit != '\0') {
    max_smem = std::min(max_smem, std::atoi(limit));
  }
  return max_smem;
}

// Lets kernel use smem bytes of dynamic shared memory on the current device. The attribute belongs to the
// kernel on each device; it is set once per kernel and device (again only for a larger size), not before every
// launch.
inline void allow_dynamic_smem(void const* kernel, int smem, char const* what) {
  static std::mutex mutex;
  static std::map<std::pair<void const*, int>, int> allowed;
  const std::pair key{kernel, current_device()};
  std::lock_guard<std::mutex> lock(mutex);
  int& done = allowed[key];
  if (smem > done) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               (std::string("setting the shared-memory size of the ") + what + " kernel").c_str());
    done = smem;
  }
}

}  // namespace cuteflash
