// Python binding of the learned next-visit model's arithmetic (csrc/include/expertcache/next_visit.h),
// used by cache_daemon/decisions/next_visit.py. Bad arguments raise ValueError naming the argument.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "bind.h"
#include "expertcache/next_visit.h"

namespace py = pybind11;
using expertcache::NextVisitLogistic;

namespace {

using Floats = py::array_t<float, py::array::c_style | py::array::forcecast>;
using Experts = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

void check_row(const py::array& a, size_t n, const char* name, bool writable) {
  check_float_row(a, n, "NextVisitLogistic", name, writable);
}

}  // namespace

void bind_next_visit(py::module_& m) {
  py::class_<NextVisitLogistic>(m, "NextVisitLogistic")
      .def(py::init([](const Floats& weights, const Floats& bias, size_t window) {
             if (weights.ndim() != 3 || bias.ndim() != 2)
               throw std::invalid_argument("NextVisitLogistic: weights must be 3-D and bias 2-D");
             const auto layers = static_cast<size_t>(weights.shape(0));
             const auto experts = static_cast<size_t>(weights.shape(2));
             if (static_cast<size_t>(weights.shape(1)) != (window + 2) * experts)
               throw std::invalid_argument("NextVisitLogistic: weights must have (window + 2) * experts inputs per layer");
             if (static_cast<size_t>(bias.shape(0)) != layers || static_cast<size_t>(bias.shape(1)) != experts)
               throw std::invalid_argument("NextVisitLogistic: bias must be [layers, experts]");
             return new NextVisitLogistic(layers, experts, window, weights.data(), bias.data());
           }),
           py::arg("weights"), py::arg("bias"), py::arg("window"))
      .def_property_readonly("layers", &NextVisitLogistic::layers)
      .def_property_readonly("experts", &NextVisitLogistic::experts)
      .def_property_readonly("window", &NextVisitLogistic::window)
      .def("window_start", &NextVisitLogistic::window_start, py::arg("layer"), "First layer of `layer`'s input window.")
      .def(
          "step",
          [](const NextVisitLogistic& t, size_t layer, const Experts& experts, py::array& latest,
             const py::array& short_history, const py::array& long_history, py::array& out) {
            check_row(latest, t.layers() * t.experts(), "latest", true);
            check_row(short_history, t.experts(), "short_history", false);
            check_row(long_history, t.experts(), "long_history", false);
            check_row(out, t.experts(), "out", true);
            t.step(layer, experts.data(), static_cast<size_t>(experts.size()), static_cast<float*>(latest.mutable_data()),
                   static_cast<const float*>(short_history.data()), static_cast<const float*>(long_history.data()),
                   static_cast<float*>(out.mutable_data()));
          },
          py::arg("layer"), py::arg("experts"), py::arg("latest"), py::arg("short_history"), py::arg("long_history"),
          py::arg("out"),
          "Layer `layer` routed `experts` (int64): records them in `latest` (float32 [layers * E], the "
          "request's one-hot latest routing of every layer), then writes the layer's next-visit "
          "probabilities (float32 [E]) into `out` from `latest`'s window and the histories (float32 [E] each).")
      .def(
          "tail",
          [](const NextVisitLogistic& t, size_t layer, const py::array& latest, const py::array& short_history,
             const py::array& long_history, const py::array& p_next, size_t visits, py::array& out) {
            check_row(latest, t.layers() * t.experts(), "latest", false);
            check_row(short_history, t.experts(), "short_history", false);
            check_row(long_history, t.experts(), "long_history", false);
            check_row(p_next, t.experts(), "p_next", false);
            check_row(out, t.experts(), "out", true);
            t.tail(layer, static_cast<const float*>(latest.data()), static_cast<const float*>(short_history.data()),
                   static_cast<const float*>(long_history.data()), static_cast<const float*>(p_next.data()), visits,
                   static_cast<float*>(out.mutable_data()));
          },
          py::arg("layer"), py::arg("latest"), py::arg("short_history"), py::arg("long_history"), py::arg("p_next"),
          py::arg("visits"), py::arg("out"),
          "As a horizon head (chance of use within `visits` visits): writes each expert's per-visit chance of "
          "use after its next visit (float32 [E]) into `out`, from `latest` (float32 [layers * E], as step left "
          "it), the histories and the next-visit chances `p_next` (float32 [E] each).")
      .def(
          "predict",
          [](const NextVisitLogistic& t, size_t layer, const py::array& latest, const py::array& short_history,
             const py::array& long_history, py::array& out) {
            check_row(latest, t.window() * t.experts(), "latest", false);
            check_row(short_history, t.experts(), "short_history", false);
            check_row(long_history, t.experts(), "long_history", false);
            check_row(out, t.experts(), "out", true);
            t.predict(layer, static_cast<const float*>(latest.data()), static_cast<const float*>(short_history.data()),
                      static_cast<const float*>(long_history.data()), static_cast<float*>(out.mutable_data()));
          },
          py::arg("layer"), py::arg("latest"), py::arg("short_history"), py::arg("long_history"), py::arg("out"),
          "Writes the next-visit probabilities (float32 [E]) of layer `layer` into `out`, from the "
          "one-hot latest routing of its window (float32 [window * E]) and its histories (float32 [E] each).");
}
