// Python binding of the EAMC match (csrc/include/expertcache/eamc_match.h): numpy arrays in and
// out, read in place (no copy: the collection's arrays are column slices and strided columns of
// the index's matrices), the work itself without the GIL. Bad arguments raise ValueError naming
// the argument.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "bind.h"
#include "expertcache/eamc_match.h"

namespace py = pybind11;
using expertcache::Q4ScanPath;

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

// Rows of a 2-D array must be contiguous (column stride 1); returns the row stride.
size_t row_stride(const char* fn, const py::array& a, const char* name) {
  if (element_stride(fn, a, 1, 1, name) != 1)
    throw std::invalid_argument(std::string(fn) + ": the rows of " + name + " must be contiguous (column stride 1)");
  return element_stride(fn, a, 0, a.shape(1), name);
}

void check_rows(const char* fn, const py::array& a, const char* name, size_t n) {
  if (static_cast<size_t>(a.shape(0)) != n)
    throw std::invalid_argument(std::string(fn) + ": " + name + " has " + std::to_string(a.shape(0)) +
                                " rows for " + std::to_string(n) + " entries");
}

Q4ScanPath path_of(const std::string& name) {
  return name == "auto" ? expertcache::q4_scan_default_path() : expertcache::q4_scan_path_from_name(name);
}

}  // namespace

void bind_eamc_match(py::module_& m) {
  std::vector<std::string> paths;
  for (Q4ScanPath p : expertcache::q4_scan_paths()) paths.emplace_back(expertcache::q4_scan_path_name(p));
  // The paths this CPU can run, fastest first; the first is what path="auto" runs.
  m.attr("Q4_SCAN_PATHS") = paths;

  m.def(
      "eamc_match",
      [](const py::object& counts_obj, size_t layers, const py::object& q4_obj, const py::object& rank_obj,
         const py::object& rows_obj, const py::object& nonempty_obj, const py::object& scale_obj,
         size_t candidates, size_t k, float sharpness, const std::string& path_name) {
        const char* fn = "eamc_match";
        py::array counts = checked<float>(fn, counts_obj, "counts", 3, "a 3-D float32 array [T, L, E]");
        py::array q4 = checked<uint8_t>(fn, q4_obj, "q4", 2, "a 2-D uint8 array [N, row bytes]");
        py::array rank = checked<float>(fn, rank_obj, "rank", 1, "a 1-D float32 array [N]");
        py::array rows = checked<float>(fn, rows_obj, "rows", 2, "a 2-D float32 array [N, L * E]");
        py::array nonempty = checked<float>(fn, nonempty_obj, "nonempty", 1, "a 1-D float32 array [N]");
        py::array scale = checked<float>(fn, scale_obj, "scale", 2, "a 2-D float32 array [N, L]");
        if (!(counts.flags() & py::array::c_style))
          throw std::invalid_argument("eamc_match: counts must be C-contiguous");
        const size_t t = counts.shape(0), L = counts.shape(1), E = counts.shape(2), n = q4.shape(0);
        for (const auto& [a, name] : std::initializer_list<std::pair<py::array, const char*>>{
                 {rank, "rank"}, {rows, "rows"}, {nonempty, "nonempty"}, {scale, "scale"}})
          check_rows(fn, a, name, n);
        if (element_stride(fn, rank, 0, 1, "rank") != 1)
          throw std::invalid_argument("eamc_match: rank must be contiguous");
        if (static_cast<size_t>(rows.shape(1)) < L * E || static_cast<size_t>(scale.shape(1)) < L)
          throw std::invalid_argument("eamc_match: rows must be at least L * E = " + std::to_string(L * E) +
                                      " wide and scale at least L = " + std::to_string(L) + ", got " +
                                      describe(rows) + " and " + describe(scale));
        if (static_cast<size_t>(q4.shape(1)) < expertcache::q4_row_bytes(L * E))
          throw std::invalid_argument("eamc_match: q4 rows are " + std::to_string(q4.shape(1)) + " bytes, " +
                                      std::to_string(L * E) + " values take " +
                                      std::to_string(expertcache::q4_row_bytes(L * E)));
        expertcache::EamcRows r;
        r.num_rows = n;
        r.layers = L;
        r.experts = E;
        r.q4 = static_cast<const uint8_t*>(q4.data());
        r.q4_ld = row_stride(fn, q4, "q4");
        r.rank = static_cast<const float*>(rank.data());
        r.rows = static_cast<const float*>(rows.data());
        r.rows_ld = row_stride(fn, rows, "rows");
        r.nonempty = static_cast<const float*>(nonempty.data());
        r.nonempty_ld = element_stride(fn, nonempty, 0, 1, "nonempty");
        r.scale = static_cast<const float*>(scale.data());
        r.scale_ld = row_stride(fn, scale, "scale");
        const Q4ScanPath path = path_of(path_name);
        py::array_t<int64_t> best({t, k});
        py::array_t<float> sims({t, k});
        py::array_t<float> prediction({t, L, E});
        auto* c = static_cast<const float*>(counts.data());
        int64_t* ob = best.mutable_data();
        float* os = sims.mutable_data();
        float* op = prediction.mutable_data();
        {
          py::gil_scoped_release release;
          expertcache::eamc_match(r, c, t, layers, candidates, k, sharpness, path, ob, os, op);
        }
        return py::make_tuple(best, sims, prediction);
      },
      py::arg("counts"), py::arg("layers"), py::arg("q4"), py::arg("rank"), py::arg("rows"), py::arg("nonempty"),
      py::arg("scale"), py::arg("candidates"), py::arg("k"), py::arg("sharpness"), py::arg("path") = "auto",
      "The EAMC match of T queries (counts float32 [T, L, E]) over the first `layers` layers: "
      "(best int64 [T, k], cosines float32 [T, k], best first; prediction float32 [T, L, E]). "
      "Collection: q4 uint8 [N, row bytes] (4-bit rows), rank float32 [N] (contiguous; the "
      "column for `layers`), rows float32 [N, >= L*E], nonempty float32 [N] (may be strided), "
      "scale float32 [N, >= L]. Needs k <= candidates <= N. path: 'auto' or one of Q4_SCAN_PATHS.");

  m.def(
      "q4_topk",
      [](const py::object& queries_obj, const py::object& rows_obj, const py::object& scale_obj, size_t k,
         const std::string& path_name) {
        const char* fn = "q4_topk";
        py::array queries = checked<int8_t>(fn, queries_obj, "queries", 2, "a 2-D int8 array [T, width]");
        py::array rows = checked<uint8_t>(fn, rows_obj, "rows", 2, "a 2-D uint8 array [N, row bytes]");
        py::array scale = checked<float>(fn, scale_obj, "scale", 1, "a 1-D float32 array [N]");
        const size_t t = queries.shape(0), width = queries.shape(1), n = rows.shape(0);
        if (static_cast<size_t>(rows.shape(1)) < expertcache::q4_row_bytes(width))
          throw std::invalid_argument("q4_topk: rows are " + std::to_string(rows.shape(1)) + " bytes but " +
                                      std::to_string(width) + " values take " +
                                      std::to_string(expertcache::q4_row_bytes(width)));
        check_rows(fn, scale, "scale", n);
        if (element_stride(fn, scale, 0, 1, "scale") != 1) throw std::invalid_argument("q4_topk: scale must be contiguous");
        if (k == 0) throw std::invalid_argument("q4_topk: k must be >= 1, got 0");
        const size_t q_ld = row_stride(fn, queries, "queries");
        const size_t ld = row_stride(fn, rows, "rows");
        const Q4ScanPath path = path_of(path_name);
        const size_t kk = std::min(k, n);
        py::array_t<int64_t> index({t, kk});
        py::array_t<float> score({t, kk});
        auto* q = static_cast<const int8_t*>(queries.data());
        auto* r = static_cast<const uint8_t*>(rows.data());
        auto* s = static_cast<const float*>(scale.data());
        int64_t* oi = index.mutable_data();
        float* os = score.mutable_data();
        {
          py::gil_scoped_release release;
          expertcache::q4_topk(q, t, q_ld, r, n, ld, width, s, k, path, oi, os);
        }
        return py::make_tuple(index, score);
      },
      py::arg("queries"), py::arg("rows"), py::arg("scale"), py::arg("k"), py::arg("path") = "auto",
      "The first stage of the match alone: the k rows with the highest float(dot) * scale for "
      "each query: queries int8 [T, width] in [0, 127], rows uint8 [N, row bytes] (4-bit, "
      "eamc_match.h), scale float32 [N] -> (index int64 [T, min(k, N)], score float32), best first, "
      "equal scores by lower row. path: 'auto' or one of Q4_SCAN_PATHS.");

  m.def(
      "q4_dots",
      [](const py::object& query_obj, const py::object& rows_obj, const std::string& path_name) {
        const char* fn = "q4_dots";
        py::array query = checked<int8_t>(fn, query_obj, "query", 1, "a 1-D int8 array [width]");
        py::array rows = checked<uint8_t>(fn, rows_obj, "rows", 2, "a 2-D uint8 array [N, row bytes]");
        const size_t width = query.shape(0), n = rows.shape(0);
        if (static_cast<size_t>(rows.shape(1)) < expertcache::q4_row_bytes(width))
          throw std::invalid_argument("q4_dots: rows are " + std::to_string(rows.shape(1)) + " bytes but " +
                                      std::to_string(width) + " values take " +
                                      std::to_string(expertcache::q4_row_bytes(width)));
        if (element_stride(fn, query, 0, 1, "query") != 1) throw std::invalid_argument("q4_dots: query must be contiguous");
        const size_t ld = row_stride(fn, rows, "rows");
        const Q4ScanPath path = path_of(path_name);
        py::array_t<int32_t> dots(n);
        auto* q = static_cast<const int8_t*>(query.data());
        auto* r = static_cast<const uint8_t*>(rows.data());
        int32_t* out = dots.mutable_data();
        {
          py::gil_scoped_release release;
          expertcache::q4_dots(q, r, n, ld, width, path, out);
        }
        return dots;
      },
      py::arg("query"), py::arg("rows"), py::arg("path") = "auto",
      "The exact int32 dot products of query int8 [width] (values in [0, 127]) with each 4-bit "
      "row of rows uint8 [N, row bytes], by the given path (for tests).");
}
