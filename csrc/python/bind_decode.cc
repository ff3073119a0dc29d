// Python binding of the expert decode (csrc/include/expertcache/decode.h), used by
// expertcache/encodings.py for CPU tensors: numpy views of the torch tensors in (zero-copy:
// `t.view(torch.uint8).numpy()`, bf16 / fp16 outputs as `out.view(torch.int16).numpy()`), the
// decode written into `out` in place, the loop without the GIL. Every argument is checked here
// (type, element size, shape, contiguity, writability, the output's size), so a bad call raises
// ValueError naming the argument instead of reading or writing past a buffer.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "expertcache/decode.h"

namespace py = pybind11;
using expertcache::DecodeDtype;
using expertcache::DecodePath;

namespace {

std::string shape_of(const py::array& a) {
  std::string shape = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) shape += (i ? ", " : "") + std::to_string(a.shape(i));
  if (a.ndim() == 1) shape += ",";
  return shape + ")";
}

std::string describe(const py::array& a) { return std::string(py::str(a.dtype())) + " of shape " + shape_of(a); }

[[noreturn]] void fail(const char* fn, const std::string& message) {
  throw std::invalid_argument(std::string(fn) + ": " + message);
}

// `obj` as a C-contiguous numpy array of `ndim` dimensions whose elements are `kinds` (numpy kind
// characters) of `itemsize` bytes; `what` describes it for the message. No conversion: a list or
// another buffer is refused, so an output is never written into a temporary copy.
py::array checked(const char* fn, const py::object& obj, const char* name, const char* kinds, py::ssize_t itemsize,
                  py::ssize_t ndim, const std::string& what) {
  if (!py::isinstance<py::array>(obj))
    fail(fn, std::string(name) + " must be a numpy array (" + what + "), got " +
                 std::string(py::str(py::type::of(obj).attr("__name__"))));
  py::array a = obj.cast<py::array>();
  const char kind = a.dtype().kind();
  if (a.itemsize() != itemsize || std::string(kinds).find(kind) == std::string::npos)
    fail(fn, std::string(name) + " must be " + what + ", got " + describe(a));
  if (ndim >= 0 && a.ndim() != ndim) fail(fn, std::string(name) + " must be " + what + ", got " + describe(a));
  if (!(a.flags() & py::array::c_style))
    fail(fn, std::string(name) + " must be C-contiguous (a contiguous tensor's view), got strides that are not");
  return a;
}

// The output: `values` elements of the dtype's size, writable, contiguous, any shape.
void* checked_out(const char* fn, const py::object& obj, DecodeDtype dtype, size_t values, const std::string& how) {
  const bool wide = dtype == DecodeDtype::kFloat32;
  const std::string what = std::string("a contiguous array of ") + (wide ? "4" : "2") + "-byte elements (" +
                           expertcache::decode_dtype_name(dtype) + (wide ? ": float32" : " bits: int16, uint16") +
                           (dtype == DecodeDtype::kFloat16 ? " or float16" : "") + ")";
  const char* kinds = wide ? "f" : (dtype == DecodeDtype::kFloat16 ? "iuf" : "iu");
  py::array out = checked(fn, obj, "out", kinds, wide ? 4 : 2, -1, what);
  if (!out.writeable()) fail(fn, "out must be writable");
  if (static_cast<size_t>(out.size()) != values)
    fail(fn, std::string("out ") + (static_cast<size_t>(out.size()) < values ? "is too small" : "is too large") +
                 ": it holds " + std::to_string(out.size()) + " values, the decode writes " + how + " = " +
                 std::to_string(values));
  return out.mutable_data();
}

DecodePath path_of(const std::string& name) {
  return name == "auto" ? expertcache::decode_default_path() : expertcache::decode_path_from_name(name);
}

}  // namespace

void bind_decode(py::module_& m) {
  std::vector<std::string> paths;
  for (DecodePath p : expertcache::decode_paths()) paths.emplace_back(expertcache::decode_path_name(p));
  // The paths this CPU can run, fastest first; the first is what path="auto" runs.
  m.attr("DECODE_PATHS") = paths;

  m.def(
      "decode_mxfp4",
      [](const py::object& blocks_obj, const py::object& scales_obj, const py::object& out_obj,
         const std::string& out_dtype, const std::string& path_name) {
        constexpr const char* fn = "decode_mxfp4";
        const DecodeDtype dtype = expertcache::decode_dtype_from_name(out_dtype);
        const DecodePath path = path_of(path_name);
        py::array blocks = checked(fn, blocks_obj, "blocks", "u", 1, 3, "uint8 [R, G, 16]");
        if (blocks.shape(2) != 16) fail(fn, "blocks must be uint8 [R, G, 16], got " + describe(blocks));
        const size_t rows = static_cast<size_t>(blocks.shape(0)), groups = static_cast<size_t>(blocks.shape(1));
        py::array scales = checked(fn, scales_obj, "scales", "u", 1, 2, "uint8 [R, G]");
        if (static_cast<size_t>(scales.shape(0)) != rows || static_cast<size_t>(scales.shape(1)) != groups)
          fail(fn, "scales must be uint8 [R, G] = (" + std::to_string(rows) + ", " + std::to_string(groups) +
                       ") for blocks of shape " + shape_of(blocks) + ", got " + describe(scales));
        void* out = checked_out(fn, out_obj, dtype, rows * groups * 32,
                                std::to_string(rows) + " x " + std::to_string(groups * 32));
        const auto* b = static_cast<const uint8_t*>(blocks.data());
        const auto* s = static_cast<const uint8_t*>(scales.data());
        py::gil_scoped_release release;
        expertcache::decode_mxfp4(b, s, rows, groups, dtype, path, out);
      },
      py::arg("blocks"), py::arg("scales"), py::arg("out"), py::arg("out_dtype"), py::arg("path") = "auto",
      "MXFP4 blocks uint8 [R, G, 16] and E8M0 scales uint8 [R, G] decoded into out ([R, G * 32] values "
      "of out_dtype: 'bfloat16' / 'float16' as 2-byte bits, 'float32'), low nibble first, bit for bit "
      "transformers' convert_moe_packed_tensors (transposed). path: 'auto' or one of DECODE_PATHS.");

  m.def(
      "decode_fp8",
      [](const py::object& values_obj, const py::object& scale_obj, py::ssize_t block_rows, py::ssize_t block_cols,
         const py::object& out_obj, const std::string& out_dtype, const std::string& path_name) {
        constexpr const char* fn = "decode_fp8";
        const DecodeDtype dtype = expertcache::decode_dtype_from_name(out_dtype);
        const DecodePath path = path_of(path_name);
        if (block_rows < 1 || block_cols < 1)
          fail(fn, "block_rows and block_cols must be >= 1, got " + std::to_string(block_rows) + " and " +
                       std::to_string(block_cols));
        py::array values = checked(fn, values_obj, "values", "u", 1, 2,
                                   "the uint8 bytes of float8_e4m3fn [R, C] (t.view(torch.uint8))");
        const size_t rows = static_cast<size_t>(values.shape(0)), cols = static_cast<size_t>(values.shape(1));
        const size_t bm = static_cast<size_t>(block_rows), bn = static_cast<size_t>(block_cols);
        const size_t grid_rows = (rows + bm - 1) / bm, grid_cols = (cols + bn - 1) / bn;
        py::array scale = checked(fn, scale_obj, "scale_inv", "f", 4, 2, "float32 [ceil(R / bm), ceil(C / bn)]");
        if (static_cast<size_t>(scale.shape(0)) != grid_rows || static_cast<size_t>(scale.shape(1)) != grid_cols)
          fail(fn, "scale_inv must be float32 (" + std::to_string(grid_rows) + ", " + std::to_string(grid_cols) +
                       ") for values of shape " + shape_of(values) + " in " + std::to_string(bm) + " x " +
                       std::to_string(bn) + " blocks, got " + describe(scale));
        void* out = checked_out(fn, out_obj, dtype, rows * cols, std::to_string(rows) + " x " + std::to_string(cols));
        const auto* v = static_cast<const uint8_t*>(values.data());
        const auto* s = static_cast<const float*>(scale.data());
        py::gil_scoped_release release;
        expertcache::decode_fp8(v, s, rows, cols, bm, bn, dtype, path, out);
      },
      py::arg("values"), py::arg("scale_inv"), py::arg("block_rows"), py::arg("block_cols"), py::arg("out"),
      py::arg("out_dtype"), py::arg("path") = "auto",
      "Block-FP8 values (the bytes of float8_e4m3fn [R, C]) times their block's scale_inv (float32 "
      "[ceil(R / block_rows), ceil(C / block_cols)]), rounded once into out ([R, C] values of out_dtype), "
      "bit for bit transformers' Fp8Dequantize on CPU. path: 'auto' or one of DECODE_PATHS.");
}
