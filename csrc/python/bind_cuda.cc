// Python binding of the CUDA path (csrc/include/expertcache/cuda.h). CUDA_BUILT always; the
// functions and classes only in a build with EXPERTCACHE_WITH_CUDA. CopyTimeout -> TimeoutError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bind.h"

#ifdef EXPERTCACHE_WITH_CUDA
#include "expertcache/cuda.h"
#endif

namespace py = pybind11;

void bind_cuda(py::module_& m) {
#ifdef EXPERTCACHE_WITH_CUDA
  namespace cu = expertcache::cuda;
  m.attr("CUDA_BUILT") = true;
  m.attr("CUDA_IPC_HANDLE_BYTES") = cu::kIpcHandleBytes;
  m.attr("CUDA_SLOT_ALIGNMENT") = cu::kSlotAlignment;

  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const cu::CopyTimeout& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    }
  });

  m.def("cuda_device_count", &cu::device_count);
  m.def("cuda_driver_version", &cu::driver_version);
  m.def("cuda_runtime_version", &cu::runtime_version);
  m.def("cuda_driver_mismatch", &cu::driver_mismatch, py::arg("driver_version"));
  m.def("cuda_device_numa_node", &cu::device_numa_node, py::arg("ordinal"));
  m.def("cuda_no_device_reason", &cu::no_device_reason);
  m.def("cuda_device_uuid", &cu::device_uuid, py::arg("ordinal"));
  m.def("cuda_normalize_uuid", &cu::normalize_uuid, py::arg("uuid"));
  m.def("cuda_device_for_uuid", &cu::device_for_uuid, py::arg("uuid"));

  py::class_<cu::DeviceArena>(m, "CudaArena")
      .def_static("allocate", &cu::DeviceArena::allocate, py::arg("device"), py::arg("num_slots"),
                  py::arg("slot_bytes"), py::call_guard<py::gil_scoped_release>())
      .def_static(
          "open",
          [](py::bytes handle, const std::string& gpu_uuid, size_t num_slots, size_t slot_bytes) {
            std::string h = handle;
            py::gil_scoped_release nogil;
            return cu::DeviceArena::open(h, gpu_uuid, num_slots, slot_bytes);
          },
          py::arg("handle"), py::arg("gpu_uuid"), py::arg("num_slots"), py::arg("slot_bytes"))
      .def("export_handle",
           [](const cu::DeviceArena& a) { return py::bytes(a.export_handle()); })
      // Frees (or unmaps) the memory now. Tensors made from __cuda_array_interface__ keep the
      // Python object alive, not the memory: close only when no such view is in use.
      .def("close", &cu::DeviceArena::close)
      .def("slot_address", &cu::DeviceArena::slot_address, py::arg("index"))
      .def_property_readonly("base_address", &cu::DeviceArena::base_address)
      .def_property_readonly("gpu_uuid", &cu::DeviceArena::gpu_uuid)
      .def_property_readonly("device", &cu::DeviceArena::device)
      .def_property_readonly("num_slots", &cu::DeviceArena::num_slots)
      .def_property_readonly("slot_bytes", &cu::DeviceArena::slot_bytes)
      .def_property_readonly("stride", &cu::DeviceArena::stride)
      .def_property_readonly("size_bytes", &cu::DeviceArena::size_bytes)
      .def_property_readonly("owned", &cu::DeviceArena::owned)
      .def_property_readonly("closed", &cu::DeviceArena::closed)
      // [num_slots, stride] uint8, C-contiguous: torch.as_tensor(arena, device=f"cuda:{arena.device}")
      // is a view without a copy (the tensor holds a reference to this object).
      .def_property_readonly("__cuda_array_interface__",
                             [](const cu::DeviceArena& a) {
                               py::dict d;
                               d["shape"] = py::make_tuple(a.num_slots(), a.stride());
                               d["typestr"] = "|u1";
                               d["data"] = py::make_tuple(a.base_address(), false);
                               d["strides"] = py::none();
                               d["version"] = 3;
                               return d;
                             })
      .def("__repr__", [](const cu::DeviceArena& a) {
        return "<CudaArena " + std::string(a.owned() ? "owned" : "imported") + " " + a.gpu_uuid() +
               " (cuda:" + std::to_string(a.device()) + ") slots=" + std::to_string(a.num_slots()) +
               " slot_bytes=" + std::to_string(a.slot_bytes()) + " stride=" +
               std::to_string(a.stride()) + (a.closed() ? " closed" : "") + ">";
      });

  py::class_<cu::CopyEngine>(m, "CopyEngine")
      .def(py::init<int, int>(), py::arg("device"), py::arg("num_streams") = 2,
           py::call_guard<py::gil_scoped_release>())
      .def("copy_h2d", &cu::CopyEngine::copy_h2d, py::arg("dst"), py::arg("src"),
           py::arg("nbytes"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>())
      .def("query", &cu::CopyEngine::query, py::arg("ticket"))
      .def("wait", &cu::CopyEngine::wait, py::arg("ticket"), py::arg("timeout_s") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &cu::CopyEngine::synchronize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("device", &cu::CopyEngine::device)
      .def_property_readonly("num_streams", &cu::CopyEngine::num_streams)
      .def_property_readonly("pending", &cu::CopyEngine::pending);
#else
  m.attr("CUDA_BUILT") = false;
#endif
}
