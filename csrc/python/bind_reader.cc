// Python binding of expertcache::Reader (csrc/include/expertcache/reader.h).
//
// Error mapping: a failed read raises ReadError (a subclass of OSError; str() is the C++ message;
// attributes kind = "short_read" | "io" | "checksum" | "cancelled", nbytes, actual_crc, and errno
// for "io"); wait() past its timeout raises TimeoutError; open failures raise OSError (its errno
// subclass, e.g. FileNotFoundError) naming the path; bad arguments ValueError; an unknown or
// already consumed request id IndexError (std::out_of_range, as everywhere in this module).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bind.h"
#include "expertcache/crc32.h"
#include "expertcache/reader.h"

namespace py = pybind11;
using expertcache::ReadCompletion;
using expertcache::Reader;
using expertcache::ReadErrorKind;

namespace {

PyObject* g_read_error = nullptr;  // expertcache_native.ReadError, owned by the module

const char* kind_name(ReadErrorKind k) {
  switch (k) {
    case ReadErrorKind::kNone: return "ok";
    case ReadErrorKind::kShortRead: return "short_read";
    case ReadErrorKind::kIo: return "io";
    case ReadErrorKind::kChecksum: return "checksum";
    case ReadErrorKind::kCancelled: return "cancelled";
  }
  return "unknown";
}

// The ReadError of a failed completion: its message, kind, request_id, nbytes, actual_crc (a
// checksum mismatch) and errno (an I/O error).
py::object read_error(const ReadCompletion& c) {
  py::object cls = py::reinterpret_borrow<py::object>(g_read_error);
  py::object exc = cls(c.error);
  exc.attr("kind") = kind_name(c.kind);
  exc.attr("request_id") = c.id;
  exc.attr("nbytes") = c.nbytes;
  exc.attr("actual_crc") = c.kind == ReadErrorKind::kChecksum ? py::object(py::int_(c.actual_crc))
                                                              : py::object(py::none());
  if (c.kind == ReadErrorKind::kIo) exc.attr("errno") = c.err;
  return exc;
}

[[noreturn]] void raise_read_error(const ReadCompletion& c) {
  PyErr_SetObject(g_read_error, read_error(c).ptr());
  throw py::error_already_set();
}

// (id, tag, None or its ReadError, nbytes, elapsed_s)
py::tuple completion_tuple(const ReadCompletion& c) {
  return py::make_tuple(c.id, c.tag, c.ok() ? py::object(py::none()) : read_error(c), c.nbytes,
                        c.elapsed_s);
}

}  // namespace

void bind_reader(py::module_& m) {
  g_read_error = PyErr_NewExceptionWithDoc(
      "expertcache_native.ReadError",
      "A read submitted to Reader failed: short read, I/O error, checksum mismatch or cancelled "
      "(attribute kind). str() is the message naming the path and offset.",
      PyExc_OSError, nullptr);
  m.attr("ReadError") = py::handle(g_read_error);
  m.attr("CRC32_IMPL") = expertcache::crc32_impl();
  m.def(
      "crc32",
      [](py::buffer data) {
        py::buffer_info info = data.request();
        const uint64_t nbytes = static_cast<uint64_t>(info.size) * static_cast<uint64_t>(info.itemsize);
        py::gil_scoped_release release;
        return expertcache::crc32(info.ptr, nbytes);
      },
      py::arg("data"), "zlib-compatible CRC-32 of a contiguous buffer (GIL released).");
  m.def(
      "crc32_by",
      [](const std::string& impl, py::buffer data, uint32_t crc) {
        py::buffer_info info = data.request();
        const uint64_t nbytes = static_cast<uint64_t>(info.size) * static_cast<uint64_t>(info.itemsize);
        const auto* p = static_cast<const uint8_t*>(info.ptr);
        if (impl == "pclmul") {
          if (!expertcache::detail::cpu_has_pclmul()) throw py::value_error("this CPU has no PCLMULQDQ");
          py::gil_scoped_release release;
          return expertcache::detail::crc32_pclmul(crc, p, nbytes);
        }
        if (impl == "zlib") {
          py::gil_scoped_release release;
          return expertcache::detail::crc32_zlib(crc, p, nbytes);
        }
        throw py::value_error("crc32_by: impl must be 'pclmul' or 'zlib', got '" + impl + "'");
      },
      py::arg("impl"), py::arg("data"), py::arg("crc") = 0,
      "zlib's crc32(crc, data) by one named implementation, 'pclmul' or 'zlib' (tests, benchmarks).");

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const expertcache::WaitTimeout& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const expertcache::OsError& e) {
      // OSError(errno, message) becomes its errno subclass (FileNotFoundError, ...).
      py::object exc = py::reinterpret_borrow<py::object>(PyExc_OSError)(e.err(), e.what());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  py::class_<Reader> cls(m, "Reader");
  cls.attr("DEMAND") = static_cast<int>(expertcache::kDemand);
  cls.attr("LAYER_AHEAD") = static_cast<int>(expertcache::kLayerAhead);
  cls.attr("PREFETCH") = static_cast<int>(expertcache::kPrefetch);
  cls.attr("ALIGNMENT") = Reader::kAlignment;
  cls.def(py::init<int, int, size_t, const std::string&, int>(), py::arg("threads") = 4,
          py::arg("queue_depth") = 64, py::arg("chunk_bytes") = size_t{1} << 20,
          py::arg("backend") = "auto", py::arg("background_depth") = 0)
      .def_static("uring_available",
                  [] {
                    std::string why;
                    const bool ok = Reader::uring_available(&why);
                    return py::make_tuple(ok, why);
                  })
      .def("open_file", &Reader::open_file, py::arg("path"), py::arg("direct") = true)
      .def("close_file", &Reader::close_file, py::arg("file_id"))
      .def("submit", &Reader::submit, py::arg("file_id"), py::arg("offset"), py::arg("length"),
           py::arg("dest_address"), py::arg("priority"), py::arg("expected_crc") = py::none(),
           py::arg("tag") = 0, py::arg("pollable") = true)
      .def("cancel", &Reader::cancel, py::arg("request_id"))
      .def("promote", &Reader::promote, py::arg("request_id"), py::arg("priority"))
      // {"priority", "queued", "done"} of a request not yet consumed, else None.
      .def(
          "query",
          [](const Reader& r, uint64_t id) -> py::object {
            Reader::RequestState st;
            if (!r.query(id, &st)) return py::none();
            py::dict d;
            d["priority"] = st.priority;
            d["queued"] = st.queued;
            d["done"] = st.done;
            return std::move(d);
          },
          py::arg("request_id"))
      .def(
          "wait",
          [](Reader& r, uint64_t id, std::optional<double> timeout_s) {
            ReadCompletion c;
            {
              py::gil_scoped_release nogil;
              c = r.wait(id, timeout_s.value_or(-1.0));
            }
            if (!c.ok()) raise_read_error(c);
          },
          py::arg("request_id"), py::arg("timeout_s") = py::none())
      .def(
          "poll",
          [](Reader& r, size_t max_n, double timeout_s) {
            std::vector<ReadCompletion> done;
            {
              py::gil_scoped_release nogil;
              done = r.poll(max_n, timeout_s);
            }
            py::list out;
            for (const auto& c : done) out.append(completion_tuple(c));
            return out;
          },
          py::arg("max_n") = 64, py::arg("timeout_s") = 0.0)
      .def_property_readonly("event_fd", &Reader::event_fd)
      .def("pause", &Reader::pause)
      .def("resume", &Reader::resume)
      .def("stats",
           [](const Reader& r) {
             const auto s = r.stats();
             py::dict d;
             d["submitted"] = s.submitted;
             d["completed"] = s.completed;
             d["failed"] = s.failed;
             d["cancelled"] = s.cancelled;
             d["bytes_read"] = s.bytes_read;
             d["chunks"] = s.chunks;
             d["preemptions"] = s.preemptions;
             d["in_flight"] = s.in_flight;
             d["queued"] = s.queued;
             return d;
           })
      .def("close", &Reader::close, py::call_guard<py::gil_scoped_release>())
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](Reader& r, py::args) {
        py::gil_scoped_release nogil;
        r.close();
      })
      .def_property_readonly("backend", &Reader::backend)
      .def_property_readonly("chunk_bytes", &Reader::chunk_bytes)
      .def_property_readonly("threads", &Reader::threads)
      .def_property_readonly("queue_depth", &Reader::queue_depth)
      .def_property_readonly("background_depth", &Reader::background_depth)
      .def("__repr__", [](const Reader& r) {
        return "<Reader backend=" + r.backend() + " threads=" + std::to_string(r.threads()) +
               " queue_depth=" + std::to_string(r.queue_depth()) +
               " chunk_bytes=" + std::to_string(r.chunk_bytes()) +
               " background_depth=" + std::to_string(r.background_depth()) + ">";
      });
}
