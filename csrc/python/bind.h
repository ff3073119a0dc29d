// One Python module (expertcache._native), one bind_* function per component, each in its own
// csrc/python/bind_<component>.cc. C++ exceptions are translated by pybind11:
// std::out_of_range -> IndexError, std::invalid_argument -> ValueError,
// std::runtime_error (incl. std::system_error) -> RuntimeError.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>

// std::invalid_argument "<owner>: <name> must be a contiguous float32 array of <n> values" (or
// "... must be writable") unless `a` is one (the row arguments of the per-layer hot-path calls).
inline void check_float_row(const pybind11::array& a, size_t n, const char* owner, const char* name,
                            bool writable) {
  if (!pybind11::isinstance<pybind11::array_t<float>>(a) || a.ndim() != 1 || static_cast<size_t>(a.shape(0)) != n ||
      !(a.flags() & pybind11::array::c_style))
    throw std::invalid_argument(std::string(owner) + ": " + name + " must be a contiguous float32 array of " +
                                std::to_string(n) + " values");
  if (writable && !a.writeable()) throw std::invalid_argument(std::string(owner) + ": " + name + " must be writable");
}

void bind_slot_table(pybind11::module_& m);
void bind_host_pool(pybind11::module_& m);
void bind_reader(pybind11::module_& m);
// eamc_match / q4_topk / q4_dots / Q4_SCAN_PATHS: the predictor's EAMC match.
void bind_eamc_match(pybind11::module_& m);
// TransitionTable: the routing-transition counts of cache_daemon/decisions/transitions.py.
void bind_transitions(pybind11::module_& m);
// NextVisitLogistic: the learned next-visit model of cache_daemon/decisions/next_visit.py.
void bind_next_visit(pybind11::module_& m);
// request_estimates / next_use_layers: the signals' per-version estimates (use_estimates.py).
void bind_use_estimates(pybind11::module_& m);
// Defines CUDA_BUILT (bool) always; the CUDA classes only in a build with EXPERTCACHE_WITH_CUDA.
void bind_cuda(pybind11::module_& m);
// ExpertFfn: one MoE layer's experts fused on the CPU, from their stored encoding.
void bind_expert_ffn(pybind11::module_& m);
// DecodeAttention: the dense half of a decoder layer for decode steps on the CPU.
void bind_decode_attention(pybind11::module_& m);

namespace expertcache {
class LayerSignals;
}
struct SpanDemand;

// The expertcache::LayerSignals of a Python LayerSignals (bound in bind_slot_table.cc, beside the
// channel it writes to, which it keeps alive); std::invalid_argument naming `what` otherwise.
expertcache::LayerSignals& layer_signals_of(const pybind11::object& obj, const char* what);
// The SpanDemand (span_demand.h) of a Python SpanDemand (bound in bind_slot_table.cc, beside the
// channel it posts on, which it keeps alive); std::invalid_argument naming `what` otherwise.
SpanDemand& span_demand_of(const pybind11::object& obj, const char* what);

// A DecodeAttention's begun step lent to another native call (ExpertFfn.run_layers): `run(layer)`
// computes that layer's dense half for the step's rows, touching no Python object (call it without
// the GIL). The attention's lock is held while the runner lives, so no other call of it can run.
struct DecodeLayerRunner {
  std::function<void(size_t)> run;
  // Layer-ahead (also without the GIL): `route_ahead(layer, ids, scores)` runs `layer`'s router on
  // the step's mlp_in (the MoE input of the layer that ran last), as `run` routes a layer: its top
  // k, ids [rows, top_k] and softmax scores [rows, top_k] widened to float. Null where the attention
  // routes no layer (top_k 0).
  std::function<void(size_t, int64_t*, float*)> route_ahead;
  size_t top_k = 0;
  size_t layers = 0;
  size_t rows = 0;
  std::unique_lock<std::mutex> lock;
};

// `attention` (a DecodeAttention whose step has begun) as a runner, made with the GIL held;
// std::invalid_argument where it is not one, no step has begun, or another call of it is running.
DecodeLayerRunner decode_layer_runner(const pybind11::object& attention);
