// Python binding of the signals' per-version estimates (csrc/include/expertcache/use_estimates.h),
// used by cache_daemon/decisions/use_estimates.py. Rows are read, and outputs written, in place;
// bad arguments raise ValueError naming the argument.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "bind.h"
#include "expertcache/use_estimates.h"

namespace py = pybind11;

namespace {

void check_row(const py::array& a, size_t n, const char* name, bool writable) {
  check_float_row(a, n, "use_estimates", name, writable);
}

template <class T>
void check_typed_row(const py::array& a, size_t n, const char* name, const char* type, bool writable) {
  if (!py::isinstance<py::array_t<T>>(a) || a.ndim() != 1 || static_cast<size_t>(a.shape(0)) != n ||
      !(a.flags() & py::array::c_style))
    throw std::invalid_argument(std::string("use_estimates: ") + name + " must be a contiguous " + type +
                                " array of " + std::to_string(n) + " values");
  if (writable && !a.writeable()) throw std::invalid_argument(std::string("use_estimates: ") + name + " must be writable");
}

void check_weight(double w, const char* name) {
  if (!(w >= 0.0 && w <= 1.0))
    throw std::invalid_argument(std::string("use_estimates: ") + name + " must be in [0, 1], got " + std::to_string(w));
}

// The rows that next_use_layers and idle_log_survival read and write, checked by name: distance
// (int64), p_next and p_long (float32), out (float64, writable), all of one length (returned),
// and moe_layers >= 1.
size_t check_estimate_rows(const py::array& distance, const py::array& p_next, const py::array& p_long,
                           int64_t moe_layers, const py::array& out) {
  if (distance.ndim() != 1) throw std::invalid_argument("use_estimates: distance must be 1-D");
  const auto n = static_cast<size_t>(distance.shape(0));
  check_typed_row<int64_t>(distance, n, "distance", "int64", false);
  check_row(p_next, n, "p_next", false);
  check_row(p_long, n, "p_long", false);
  check_typed_row<double>(out, n, "out", "float64", true);
  if (moe_layers < 1) throw std::invalid_argument("use_estimates: moe_layers must be >= 1");
  return n;
}

}  // namespace

void bind_use_estimates(py::module_& m) {
  m.def(
      "request_estimates",
      [](const py::array& history, const py::array& history_long, const py::array& next_p, const py::array& hints,
         const py::array& hint_token, int64_t token, bool has_hints, float long_weight, float transition_weight,
         double hint_weight, int64_t hint_ttl_tokens, bool learned, py::array& out_long, const py::object& out_next) {
        if (history.ndim() != 1) throw std::invalid_argument("use_estimates: history must be 1-D");
        const auto n = static_cast<size_t>(history.shape(0));
        check_row(history, n, "history", false);
        check_row(history_long, n, "history_long", false);
        check_row(next_p, n, "next_p", false);
        check_row(hints, n, "hints", false);
        check_typed_row<int64_t>(hint_token, n, "hint_token", "int64", false);
        check_row(out_long, n, "out_long", true);
        check_weight(long_weight, "long_weight");
        check_weight(transition_weight, "transition_weight");
        check_weight(hint_weight, "hint_weight");
        if (hint_ttl_tokens < 0) throw std::invalid_argument("use_estimates: hint_ttl_tokens must be >= 0");
        float* next = nullptr;
        py::array next_arr;
        if (!out_next.is_none()) {
          next_arr = out_next.cast<py::array>();
          check_row(next_arr, n, "out_next", true);
          next = static_cast<float*>(next_arr.mutable_data());
        }
        const expertcache::RequestRows rows{
            static_cast<const float*>(history.data()), static_cast<const float*>(history_long.data()),
            static_cast<const float*>(next_p.data()),  static_cast<const float*>(hints.data()),
            static_cast<const int64_t*>(hint_token.data()), token, has_hints};
        const expertcache::EstimateWeights w{long_weight, transition_weight, hint_weight, hint_ttl_tokens, learned};
        expertcache::request_estimates(n, rows, w, static_cast<float*>(out_long.mutable_data()), next);
      },
      py::arg("history"), py::arg("history_long"), py::arg("next_p"), py::arg("hints"), py::arg("hint_token"),
      py::arg("token"), py::arg("has_hints"), py::arg("long_weight"), py::arg("transition_weight"),
      py::arg("hint_weight"), py::arg("hint_ttl_tokens"), py::arg("learned"), py::arg("out_long"),
      py::arg("out_next") = py::none(),
      "One request's estimates in one pass (float32 [n] rows; hint_token int64): writes its per-visit "
      "use estimate beyond the next visit into out_long and, unless out_next is None, its next-visit "
      "estimate into out_next, element for element as UseEstimates' numpy expressions.");
  m.def(
      "apply_lookahead",
      [](py::array& p, size_t num_experts, const py::list& predictions) {
        if (p.ndim() != 1) throw std::invalid_argument("use_estimates: p must be 1-D");
        const auto n = static_cast<size_t>(p.shape(0));
        check_row(p, n, "p", true);
        if (num_experts < 1 || n % num_experts != 0)
          throw std::invalid_argument("use_estimates: num_experts must divide the " + std::to_string(n) + " entries");
        const size_t layers = n / num_experts;
        // Every prediction checked before anything is written.
        struct Item {
          size_t layer;
          double keep;
          py::array_t<int64_t> entries;
          py::array_t<double> confidence;
        };
        std::vector<Item> items;
        items.reserve(predictions.size());
        for (const auto& obj : predictions) {
          const auto t = obj.cast<py::tuple>();
          if (t.size() != 4)
            throw std::invalid_argument("use_estimates: a prediction is (layer, keep, entries, confidence)");
          const auto layer = t[0].cast<int64_t>();
          if (layer < 0 || static_cast<size_t>(layer) >= layers)
            throw std::invalid_argument("use_estimates: predicted layer " + std::to_string(layer) + " outside 0.." +
                                        std::to_string(layers - 1));
          const auto keep = t[1].cast<double>();
          const auto entries = t[2].cast<py::array>();
          const auto confidence = t[3].cast<py::array>();
          if (entries.ndim() != 1) throw std::invalid_argument("use_estimates: entries must be 1-D");
          const auto k = static_cast<size_t>(entries.shape(0));
          check_typed_row<int64_t>(entries, k, "entries", "int64", false);
          check_typed_row<double>(confidence, k, "confidence", "float64", false);
          const auto* e = static_cast<const int64_t*>(entries.data());
          for (size_t j = 0; j < k; ++j)
            if (e[j] < 0 || static_cast<size_t>(e[j]) >= n)
              throw std::invalid_argument("use_estimates: entry " + std::to_string(e[j]) + " outside 0.." +
                                          std::to_string(n - 1));
          items.push_back({static_cast<size_t>(layer), keep, py::array_t<int64_t>(entries), py::array_t<double>(confidence)});
        }
        auto* out = static_cast<float*>(p.mutable_data());
        for (const auto& it : items)
          expertcache::apply_lookahead(out, num_experts, it.layer, it.keep, it.entries.data(), it.confidence.data(),
                                       static_cast<size_t>(it.entries.size()));
      },
      py::arg("p"), py::arg("num_experts"), py::arg("predictions"),
      "Each predicted layer's override of the next-visit estimate p (float32 [n], in place), in order: "
      "predictions is a list of (layer, keep, entries int64, confidence float64); the layer's row is "
      "scaled by keep, then each entry raised to at least its confidence, as UseEstimates.use_probability.");
  m.def(
      "victim_order",
      [](const py::array& resident, const py::array& next_use, const py::array& stamp) {
        if (resident.ndim() != 1) throw std::invalid_argument("use_estimates: resident must be 1-D");
        const auto n = static_cast<size_t>(resident.shape(0));
        check_typed_row<bool>(resident, n, "resident", "bool", false);
        check_typed_row<double>(next_use, n, "next_use", "float64", false);
        check_typed_row<int64_t>(stamp, n, "stamp", "int64", false);
        py::array_t<int64_t> out(static_cast<py::ssize_t>(n));
        const size_t count =
            expertcache::victim_order(n, static_cast<const bool*>(resident.data()), static_cast<const double*>(next_use.data()),
                                      static_cast<const int64_t*>(stamp.data()), out.mutable_data());
        out.resize({static_cast<py::ssize_t>(count)});
        return out;
      },
      py::arg("resident"), py::arg("next_use"), py::arg("stamp"),
      "The resident entries (int64), best victim first: by -next_use, then by stamp, stably, NaN last, "
      "as np.lexsort((stamp.astype(float64), -next_use)) over np.flatnonzero(resident).");
  m.def(
      "idle_log_survival",
      [](const py::array& distance, const py::array& p_next, const py::array& p_long, int64_t moe_layers,
         double horizon, py::array& out) {
        const size_t n = check_estimate_rows(distance, p_next, p_long, moe_layers, out);
        if (!(horizon > 0.0) || !std::isfinite(horizon))
          throw std::invalid_argument("use_estimates: horizon must be > 0 and finite");
        expertcache::idle_log_survival(n, static_cast<const int64_t*>(distance.data()),
                                       static_cast<const float*>(p_next.data()),
                                       static_cast<const float*>(p_long.data()), moe_layers, horizon,
                                       static_cast<double*>(out.mutable_data()));
      },
      py::arg("distance"), py::arg("p_next"), py::arg("p_long"), py::arg("moe_layers"), py::arg("horizon"),
      py::arg("out"),
      "Log-probability that each entry goes unused over the next horizon layer steps (float64 [n] into "
      "out): 0 where distance > horizon, else log1p(-p_next) + (horizon - distance) / moe_layers * "
      "log1p(-p_long), probabilities taken in [0, 1 - 1e-9], as UseEstimates.idle_log_survival.");
  m.def(
      "next_use_layers",
      [](const py::array& distance, const py::array& p_next, const py::array& p_long, int64_t moe_layers,
         double floor, py::array& out) {
        const size_t n = check_estimate_rows(distance, p_next, p_long, moe_layers, out);
        if (!(floor > 0.0)) throw std::invalid_argument("use_estimates: floor must be > 0");
        expertcache::next_use_layers(n, static_cast<const int64_t*>(distance.data()),
                                     static_cast<const float*>(p_next.data()), static_cast<const float*>(p_long.data()),
                                     moe_layers, floor, static_cast<double*>(out.mutable_data()));
      },
      py::arg("distance"), py::arg("p_next"), py::arg("p_long"), py::arg("moe_layers"), py::arg("floor"),
      py::arg("out"),
      "Expected layer steps to each entry's next use (float64 [n] into out): distance + moe_layers * "
      "(1 - p_next) / max(p_long, floor), as UseEstimates.next_use_layers.");
}
