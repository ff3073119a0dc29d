// Python binding of expertcache::Reader (csrc/include/expertcache/reader.h).
#include <pybind11/pybind11.h>

#include "bind.h"

void bind_reader(pybind11::module_& /*m*/) {}
