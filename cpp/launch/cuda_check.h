// Error checking of CUDA runtime calls in the launcher: a failed call throws std::runtime_error
// with CUDA's error string (the torch binding turns it into a Python RuntimeError).
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace prefixattn {

inline void cuda_check(cudaError_t e, const char* expr, const char* file, int line) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(e) + " (" + expr +
                             " at " + file + ":" + std::to_string(line) + ")");
  }
}

}  // namespace prefixattn

#define PREFIXATTN_CUDA_CHECK(expr) ::prefixattn::cuda_check((expr), #expr, __FILE__, __LINE__)
