// Python binding of the CUDA path (csrc/include/expertcache/cuda.h).
#include <pybind11/pybind11.h>

#include "bind.h"

void bind_cuda(pybind11::module_& m) {
#ifdef EXPERTCACHE_WITH_CUDA
  m.attr("CUDA_BUILT") = true;
#else
  m.attr("CUDA_BUILT") = false;
#endif
}
