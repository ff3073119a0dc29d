// Python binding of expertcache::HostPool (see csrc/include/expertcache/host_pool.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bind.h"
#include "expertcache/host_pool.h"

namespace py = pybind11;
using expertcache::HostPool;

void bind_host_pool(py::module_& m) {
  py::class_<HostPool>(m, "HostPool", py::buffer_protocol())
      // pin=True page-locks the pool for CUDA copies; RuntimeError "cannot pin host memory: ..."
      // without CUDA in the build or without a usable device (the caller may retry unpinned).
      // numa_node >= 0 places its pages on that node (RuntimeError naming mbind's error if not).
      .def(py::init<size_t, size_t, bool, int>(), py::arg("num_slots"), py::arg("slot_bytes"),
           py::arg("pin") = false, py::arg("numa_node") = -1)
      .def("alloc", &HostPool::alloc)
      .def("free", &HostPool::free, py::arg("index"))
      .def("is_allocated", &HostPool::is_allocated, py::arg("index"))
      // A writable memoryview of one allocated slot (slot_bytes long). It is a slice of the
      // pool's own buffer, so it keeps the pool alive.
      .def(
          "view",
          [](py::object self, int64_t index) {
            HostPool& p = self.cast<HostPool&>();
            if (!p.is_allocated(index))
              throw std::invalid_argument("host pool: slot " + std::to_string(index) +
                                          " is not allocated");
            const size_t off = static_cast<size_t>(index) * p.stride();
            py::memoryview whole(self);
            return py::memoryview(whole[py::slice(static_cast<py::ssize_t>(off),
                                                  static_cast<py::ssize_t>(off + p.slot_bytes()), 1)]);
          },
          py::arg("index"))
      .def("slot_address", [](const HostPool& p, int64_t i) {
        return reinterpret_cast<uintptr_t>(p.slot_ptr(i));
      }, py::arg("index"))
      .def_property_readonly("base_address",
                             [](const HostPool& p) { return reinterpret_cast<uintptr_t>(p.base()); })
      .def_property_readonly("num_slots", &HostPool::num_slots)
      .def_property_readonly("slot_bytes", &HostPool::slot_bytes)
      .def_property_readonly("stride", &HostPool::stride)
      .def_property_readonly("total_bytes", &HostPool::total_bytes)
      .def_property_readonly("num_free", &HostPool::num_free)
      .def_property_readonly("pinned", &HostPool::pinned)
      .def_property_readonly("numa_node", &HostPool::numa_node)
      .def_buffer([](HostPool& p) {
        return py::buffer_info(p.base(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(p.total_bytes())}, {1});
      });
}
