// Python binding of expertcache::SlotTable (see csrc/include/expertcache/slot_table.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bind.h"
#include "expertcache/slot_table.h"

namespace py = pybind11;
using expertcache::SlotState;
using expertcache::SlotTable;

void bind_slot_table(py::module_& m) {
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

}
