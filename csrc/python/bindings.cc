// The one binding file: expertcache_native. C++ exceptions are translated by pybind11:
// std::out_of_range -> IndexError, std::invalid_argument -> ValueError,
// std::runtime_error (incl. std::system_error) -> RuntimeError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "expertcache/host_pool.h"
#include "expertcache/slot_table.h"

namespace py = pybind11;
using expertcache::HostPool;
using expertcache::SlotState;
using expertcache::SlotTable;

PYBIND11_MODULE(expertcache_native, m) {
  m.doc() = "ExpertCache native core: shared-memory slot table and host pool";

  m.attr("ABSENT") = static_cast<uint32_t>(SlotState::kAbsent);
  m.attr("LOADING") = static_cast<uint32_t>(SlotState::kLoading);
  m.attr("RESIDENT") = static_cast<uint32_t>(SlotState::kResident);
  m.attr("EVICTING") = static_cast<uint32_t>(SlotState::kEvicting);
  m.attr("SLOT_TABLE_VERSION") = expertcache::kSlotTableVersion;

  py::class_<SlotTable>(m, "SlotTable")
      .def_static("create", &SlotTable::create, py::arg("path"), py::arg("num_entries"),
                  py::arg("num_slots"))
      .def_static("open", &SlotTable::open, py::arg("path"))
      .def_static("file_size", &SlotTable::file_size, py::arg("num_entries"))
      .def("try_pin", &SlotTable::try_pin, py::arg("entry"))
      .def("unpin", &SlotTable::unpin, py::arg("entry"))
      .def("begin_load", &SlotTable::begin_load, py::arg("entry"), py::arg("slot"))
      .def("finish_load", &SlotTable::finish_load, py::arg("entry"))
      .def("abort_load", &SlotTable::abort_load, py::arg("entry"))
      .def("try_evict", &SlotTable::try_evict, py::arg("entry"))
      .def("wait_resident", &SlotTable::wait_resident, py::arg("entry"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def("state", [](const SlotTable& t, int64_t e) { return static_cast<uint32_t>(t.state(e)); },
           py::arg("entry"))
      .def("pins", &SlotTable::pins, py::arg("entry"))
      .def("slot", &SlotTable::slot, py::arg("entry"))
      .def("generation", &SlotTable::generation, py::arg("entry"))
      .def_property_readonly("num_entries", &SlotTable::num_entries)
      .def_property_readonly("num_slots", &SlotTable::num_slots)
      .def_property_readonly("path", &SlotTable::path)
      .def("__repr__", [](const SlotTable& t) {
        return "<SlotTable path=" + t.path() + " entries=" + std::to_string(t.num_entries()) +
               " slots=" + std::to_string(t.num_slots()) + ">";
      });

  py::class_<HostPool>(m, "HostPool", py::buffer_protocol())
      .def(py::init<size_t, size_t>(), py::arg("num_slots"), py::arg("slot_bytes"))
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
      .def_buffer([](HostPool& p) {
        return py::buffer_info(p.base(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(p.total_bytes())}, {1});
      });
}
