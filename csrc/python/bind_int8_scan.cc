// Python binding of the int8 scan (csrc/include/expertcache/int8_scan.h): numpy arrays in and
// out, read in place (no copy: rows may be a column slice of a wider matrix, scale a strided
// column), the scan itself without the GIL. Bad arguments raise ValueError naming the argument.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "bind.h"
#include "expertcache/int8_scan.h"

namespace py = pybind11;
using expertcache::Int8ScanPath;

namespace {

std::string describe(const py::array& a) {
  std::string shape = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) shape += (i ? ", " : "") + std::to_string(a.shape(i));
  if (a.ndim() == 1) shape += ",";
  return std::string(py::str(a.dtype())) + " of shape " + shape + ")";
}

template <typename T>
py::array checked(const char* fn, const py::object& obj, const char* name, py::ssize_t ndim, const char* what) {
  if (!py::isinstance<py::array_t<T>>(obj) || obj.cast<py::array>().ndim() != ndim) {
    std::string got = py::isinstance<py::array>(obj) ? describe(obj.cast<py::array>())
                                                     : std::string(py::str(py::type::of(obj).attr("__name__")));
    throw std::invalid_argument(std::string(fn) + ": " + name + " must be " + what + ", got " + got);
  }
  return obj.cast<py::array>();
}

// Stride of axis `axis` in elements; an axis of length <= 1, or any axis of an empty array, has
// whatever stride numpy reports, so it reads as `fallback`.
size_t element_stride(const char* fn, const py::array& a, py::ssize_t axis, size_t fallback, const char* name) {
  if (a.shape(axis) <= 1 || a.size() == 0) return fallback;
  const py::ssize_t s = a.strides(axis);
  if (s < 0 || s % a.itemsize() != 0)
    throw std::invalid_argument(std::string(fn) + ": " + name + " has a negative or unaligned stride (" +
                                std::to_string(s) + " bytes): pass a forward view or a copy");
  return static_cast<size_t>(s / a.itemsize());
}

Int8ScanPath path_of(const std::string& name) {
  return name == "auto" ? expertcache::int8_scan_default_path() : expertcache::int8_scan_path_from_name(name);
}

}  // namespace

void bind_int8_scan(py::module_& m) {
  std::vector<std::string> paths;
  for (Int8ScanPath p : expertcache::int8_scan_paths()) paths.emplace_back(expertcache::int8_scan_path_name(p));
  // The paths this CPU can run, fastest first; the first is what path="auto" runs.
  m.attr("INT8_SCAN_PATHS") = paths;

  m.def(
      "int8_topk",
      [](const py::object& queries_obj, const py::object& rows_obj, const py::object& scale_obj, size_t k,
         const std::string& path_name) {
        py::array queries = checked<int8_t>("int8_topk", queries_obj, "queries", 2, "a 2-D int8 array [T, width]");
        py::array rows = checked<int8_t>("int8_topk", rows_obj, "rows", 2, "a 2-D int8 array [N, width]");
        py::array scale = checked<float>("int8_topk", scale_obj, "scale", 1, "a 1-D float32 array [N]");
        const size_t t = queries.shape(0), width = queries.shape(1), n = rows.shape(0);
        if (static_cast<size_t>(rows.shape(1)) != width)
          throw std::invalid_argument("int8_topk: rows are " + std::to_string(rows.shape(1)) +
                                      " wide but the queries " + std::to_string(width));
        if (static_cast<size_t>(scale.shape(0)) != n)
          throw std::invalid_argument("int8_topk: scale has " + std::to_string(scale.shape(0)) +
                                      " values for " + std::to_string(n) + " rows");
        if (element_stride("int8_topk", queries, 1, 1, "queries") != 1 || element_stride("int8_topk", rows, 1, 1, "rows") != 1)
          throw std::invalid_argument("int8_topk: the rows of queries and rows must be contiguous (column stride 1)");
        const size_t q_ld = element_stride("int8_topk", queries, 0, width, "queries");
        const size_t ld = element_stride("int8_topk", rows, 0, width, "rows");
        const size_t s_ld = element_stride("int8_topk", scale, 0, 1, "scale");
        if (k == 0) throw std::invalid_argument("int8_topk: k must be >= 1, got 0");
        const Int8ScanPath path = path_of(path_name);
        const size_t kk = std::min(k, n);
        py::array_t<int64_t> index({t, kk});
        py::array_t<float> score({t, kk});
        auto* q = static_cast<const int8_t*>(queries.data());
        auto* r = static_cast<const int8_t*>(rows.data());
        auto* s = static_cast<const float*>(scale.data());
        int64_t* oi = index.mutable_data();
        float* os = score.mutable_data();
        {
          py::gil_scoped_release release;
          expertcache::int8_topk(q, t, q_ld, r, n, ld, width, s, s_ld, k, path, oi, os);
        }
        return py::make_tuple(index, score);
      },
      py::arg("queries"), py::arg("rows"), py::arg("scale"), py::arg("k"), py::arg("path") = "auto",
      "The k rows with the highest float(int8 dot with the query) * scale, for each query: "
      "queries int8 [T, width] with values in [0, 127], rows int8 [N, width] (any row stride), "
      "scale float32 [N] -> (index int64 [T, min(k, N)], score float32 [T, min(k, N)]), best "
      "first, equal scores by lower index. path: 'auto' or one of INT8_SCAN_PATHS.");

  m.def(
      "int8_dots",
      [](const py::object& query_obj, const py::object& rows_obj, const std::string& path_name) {
        py::array query = checked<int8_t>("int8_dots", query_obj, "query", 1, "a 1-D int8 array [width]");
        py::array rows = checked<int8_t>("int8_dots", rows_obj, "rows", 2, "a 2-D int8 array [N, width]");
        const size_t width = query.shape(0), n = rows.shape(0);
        if (static_cast<size_t>(rows.shape(1)) != width)
          throw std::invalid_argument("int8_dots: rows are " + std::to_string(rows.shape(1)) +
                                      " wide but the query " + std::to_string(width));
        if (element_stride("int8_dots", query, 0, 1, "query") != 1 || element_stride("int8_dots", rows, 1, 1, "rows") != 1)
          throw std::invalid_argument("int8_dots: query and the rows must be contiguous (column stride 1)");
        const size_t ld = element_stride("int8_dots", rows, 0, width, "rows");
        const Int8ScanPath path = path_of(path_name);
        py::array_t<int32_t> dots(n);
        auto* q = static_cast<const int8_t*>(query.data());
        auto* r = static_cast<const int8_t*>(rows.data());
        int32_t* out = dots.mutable_data();
        {
          py::gil_scoped_release release;
          expertcache::int8_dots(q, r, n, ld, width, path, out);
        }
        return dots;
      },
      py::arg("query"), py::arg("rows"), py::arg("path") = "auto",
      "The exact int32 dot products of query int8 [width] with each of rows int8 [N, width], by "
      "the given path (the scan's first step, for tests); query values in [0, 127].");
}
