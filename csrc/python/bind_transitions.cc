// Python binding of the routing-transition table (csrc/include/expertcache/transitions.h), used by
// cache_daemon/decisions/transitions.py. Arrays are read and written in place; bad arguments
// raise ValueError naming the argument.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "bind.h"
#include "expertcache/transitions.h"

namespace py = pybind11;
using expertcache::TransitionTable;

namespace {

using Experts = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

void check_row(const py::array& a, size_t n, const char* name, bool writable) {
  check_float_row(a, n, "TransitionTable", name, writable);
}

}  // namespace

void bind_transitions(py::module_& m) {
  py::class_<TransitionTable>(m, "TransitionTable")
      .def(py::init<size_t, size_t, double, double, double>(), py::arg("layers"), py::arg("experts"),
           py::arg("prior_count"), py::arg("history_exponent"), py::arg("half_life_visits"))
      .def_property_readonly("layers", &TransitionTable::layers)
      .def_property_readonly("experts", &TransitionTable::experts)
      .def("visits", &TransitionTable::visits, py::arg("layer"),
           "Successor visits of `layer` counted so far, decayed.")
      .def(
          "step",
          [](TransitionTable& t, size_t layer, const py::object& previous, const Experts& current,
             const py::array& history, const py::array& history_long, float long_weight, py::array& out) {
            check_row(history, t.experts(), "history", false);
            check_row(history_long, t.experts(), "history_long", false);
            if (!(long_weight >= 0.0f && long_weight <= 1.0f))
              throw std::invalid_argument("TransitionTable: long_weight must be in [0, 1], got " +
                                          std::to_string(long_weight));
            check_row(out, t.experts(), "out", true);
            const int64_t* prev = nullptr;
            size_t n_prev = 0;
            Experts prev_arr;
            if (!previous.is_none()) {
              prev_arr = previous.cast<Experts>();
              prev = prev_arr.data();
              n_prev = static_cast<size_t>(prev_arr.size());
            }
            t.step(layer, prev, n_prev, current.data(), static_cast<size_t>(current.size()),
                   static_cast<const float*>(history.data()), static_cast<const float*>(history_long.data()),
                   long_weight, static_cast<float*>(out.mutable_data()));
          },
          py::arg("layer"), py::arg("previous"), py::arg("current"), py::arg("history"), py::arg("history_long"),
          py::arg("long_weight"), py::arg("out"),
          "Layer `layer` routed `current` (int64 experts) after routing `previous` at its previous "
          "visit of the request (None: none); counts the pair, then writes the next-visit "
          "probabilities (float32 [E]) into `out`, the request's history being "
          "(1 - long_weight) * history + long_weight * history_long.")
      .def(
          "predict",
          [](const TransitionTable& t, size_t layer, const Experts& previous, const py::array& history) {
            check_row(history, t.experts(), "history", false);
            py::array_t<float> out(static_cast<py::ssize_t>(t.experts()));
            t.predict(layer, previous.data(), static_cast<size_t>(previous.size()),
                      static_cast<const float*>(history.data()), out.mutable_data());
            return out;
          },
          py::arg("layer"), py::arg("previous"), py::arg("history"),
          "The next-visit probabilities (float32 [E]) after a visit that routed `previous`, counting nothing.");
}
