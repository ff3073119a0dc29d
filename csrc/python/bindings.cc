// The module definition of expertcache_native: each component binds itself (bind.h).
#include <pybind11/pybind11.h>

#include "bind.h"

PYBIND11_MODULE(expertcache_native, m) {
  m.doc() = "ExpertCache native core: slot table, host pool, O_DIRECT reader, CUDA arena and copies";
  bind_slot_table(m);
  bind_host_pool(m);
  bind_reader(m);
  bind_cuda(m);
}
