// The module definition of expertcache._native: each component binds itself (bind.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bind.h"

// decode_mxfp4 / decode_fp8 / DECODE_PATHS: the CPU decode of encoded experts (bind_decode.cc).
void bind_decode(pybind11::module_& m);

PYBIND11_MODULE(_native, m) {
  m.doc() = "ExpertCache native core: slot table, host pool, O_DIRECT reader, CUDA arena and copies, EAMC match, routing transitions, next-visit model, use estimates, expert decode, fused CPU expert FFN";
  // The optional features this build was compiled with (CMakeLists.txt): what expertcache.native
  // reports at start, and what tests/build checks for each forced-off configuration.
  std::vector<std::string> features;
#ifdef EXPERTCACHE_WITH_URING
  features.emplace_back("io_uring");
#endif
#ifdef EXPERTCACHE_WITH_ISAL
  features.emplace_back("isa-l");
#endif
#ifdef EXPERTCACHE_WITH_CUDA
  features.emplace_back("cuda");
#endif
  m.attr("FEATURES") = features;
  bind_slot_table(m);
  bind_host_pool(m);
  bind_reader(m);
  bind_eamc_match(m);
  bind_transitions(m);
  bind_next_visit(m);
  bind_use_estimates(m);
  bind_decode(m);
  bind_expert_ffn(m);
  bind_decode_attention(m);
  bind_cuda(m);
}
