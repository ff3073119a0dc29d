// Python binding of the dense half of a decoder layer for decode steps
// (csrc/include/expertcache/decode_attention.h), used by compute_svc.engine.decode_step.
//
//   att = DecodeAttention(spec)            sizes, dtype, eps, scaling, norm, softmax
//   att.add_layer(weights, window)         numpy views of the layer's tensors, kept alive here
//   att.begin_step(h, mlp_in, cos, sin, keys, values, capacity, length, logits=None,
//                  top_ids=None, top_scores=None)  [layers, rows, k] with spec router_top_k
//   native.router_top_k_supported(dtype, k)
//   att.run(layer)                         once per layer of the step, without the GIL
//   att.set_head(weights, eps)             the final norm and the LM head: {"norm", "weight", "bias"}
//   att.head(logits)                       after the layers: logits [rows, vocab] of the begun step's h,
//                                          without the GIL
//
// Arrays hold the compute dtype's storage: 2-byte items for bf16 / fp16 (numpy int16, uint16 or
// float16 views of torch tensors), float32 for fp32. Every size is checked (ValueError naming the
// argument). `keys` / `values` / `capacity` [layers, rows] are the addresses of each row's cache tensors of each
// layer ([kv_heads, capacity, head_dim], contiguous) and their capacities: compute's own tensors, which it keeps alive
// for the step; the addresses themselves cannot be checked here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bind.h"
#include "expertcache/decode_attention.h"

namespace py = pybind11;
using expertcache::AttentionSpec;
using expertcache::AttentionWeights;
using expertcache::DecodeAttention;
using expertcache::FfnDtype;

namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument("DecodeAttention: " + message); }

template <class T>
T get(const py::dict& d, const char* key) {
  if (!d.contains(key)) fail(std::string("spec has no '") + key + "'");
  return d[key].cast<T>();
}

size_t item_bytes(FfnDtype d) { return d == FfnDtype::kFloat32 ? 4 : 2; }

// `obj` as a contiguous array of `count` items of the compute dtype's storage.
py::array storage(const py::object& obj, FfnDtype d, size_t count, const std::string& name, bool writable = false) {
  if (!py::isinstance<py::array>(obj)) fail(name + " must be a numpy array");
  py::array a = obj.cast<py::array>();
  const bool f32 = d == FfnDtype::kFloat32;
  const char kind = a.dtype().kind();
  if (size_t(a.itemsize()) != item_bytes(d) || (f32 ? kind != 'f' : (kind != 'i' && kind != 'u' && kind != 'f')))
    fail(name + " must hold " + (f32 ? "float32" : "2-byte (bf16 / fp16 storage)") + " items");
  if (!(a.flags() & py::array::c_style)) fail(name + " must be C-contiguous");
  if (size_t(a.size()) != count) fail(name + " must hold " + std::to_string(count) + " values, not " + std::to_string(a.size()));
  if (writable && !a.writeable()) fail(name + " must be writable");
  return a;
}

py::array_t<int64_t> int64s(const py::object& obj, size_t count, const std::string& name) {
  if (!py::isinstance<py::array_t<int64_t>>(obj)) fail(name + " must be a numpy int64 array");
  auto a = obj.cast<py::array_t<int64_t>>();
  if (!(a.flags() & py::array::c_style)) fail(name + " must be C-contiguous");
  if (size_t(a.size()) != count) fail(name + " must hold " + std::to_string(count) + " values, not " + std::to_string(a.size()));
  return a;
}

struct Step {
  size_t rows = 0;
  py::array h, mlp_in, cos, sin, logits;
  py::array_t<int64_t> keys, values, capacity, length;
  py::array_t<int64_t> top_ids;  // [layers, rows, k] with router_top_k
  py::array top_scores;          // [layers, rows, k] of the dtype
  std::vector<uint8_t*> key_ptrs, value_ptrs;  // [layers * rows]
};

struct Attention {
  std::unique_ptr<DecodeAttention> att;
  std::vector<py::object> kept;  // the layers' arrays
  std::unique_ptr<Step> step;
  std::mutex busy;
};

// A begun step's buffers as raw pointers, taken with the GIL held: `run(layer)` then touches no
// Python object. The caller holds the attention's lock and has checked that a step has begun.
class StepLayers {
 public:
  explicit StepLayers(Attention& a) : att_(*a.att), st_(*a.step) {
    const auto& spec = att_.spec();
    h_ = static_cast<uint8_t*>(st_.h.mutable_data());
    mlp_in_ = static_cast<uint8_t*>(st_.mlp_in.mutable_data());
    logits_ = spec.router_outputs > 0 ? static_cast<uint8_t*>(st_.logits.mutable_data()) : nullptr;
    k_ = spec.router_top_k;
    item_ = spec.dtype == FfnDtype::kFloat32 ? 4 : 2;
    ids_ = k_ > 0 ? st_.top_ids.mutable_data() : nullptr;
    scores_ = k_ > 0 ? static_cast<uint8_t*>(st_.top_scores.mutable_data()) : nullptr;
  }

  // `layer`'s router on the step's mlp_in: ids and scores [rows, k], the scores as floats.
  void route_ahead(size_t layer, int64_t* ids, float* scores) const {
    const size_t n = st_.rows * k_;
    if (ahead_scores_.size() < n * item_) ahead_scores_.resize(n * item_);
    att_.route_with(layer, st_.rows, mlp_in_, ids, ahead_scores_.data());
    const FfnDtype d = att_.spec().dtype;
    for (size_t i = 0; i < n; ++i) scores[i] = expertcache::ffn_load(ahead_scores_.data(), d, i);
  }

  // The dense half of `layer` (< the attention's layers) for every row of the step.
  void run(size_t layer) const {
    const size_t at = layer * st_.rows;
    att_.run(layer, st_.rows, h_, mlp_in_, static_cast<const uint8_t*>(st_.cos.data()),
             static_cast<const uint8_t*>(st_.sin.data()), st_.key_ptrs.data() + at, st_.value_ptrs.data() + at,
             st_.capacity.data() + at, st_.length.data(), logits_, ids_ ? ids_ + at * k_ : nullptr,
             scores_ ? scores_ + at * k_ * item_ : nullptr);
  }

 private:
  DecodeAttention& att_;
  Step& st_;
  uint8_t *h_, *mlp_in_, *logits_, *scores_;
  int64_t* ids_;
  size_t k_, item_;
  mutable std::vector<uint8_t> ahead_scores_;  // route_ahead's scores in the dtype
};

}  // namespace

DecodeLayerRunner decode_layer_runner(const py::object& attention) {
  if (!py::isinstance<Attention>(attention)) fail("attention must be a DecodeAttention");
  Attention& a = attention.cast<Attention&>();
  DecodeLayerRunner runner;
  runner.lock = std::unique_lock<std::mutex>(a.busy, std::try_to_lock);
  if (!runner.lock.owns_lock()) fail("lent while another call of the same object is in progress");
  if (!a.step) fail("lent before begin_step");
  runner.layers = a.att->layers();
  runner.rows = a.step->rows;
  auto layers = std::make_shared<StepLayers>(a);
  runner.run = [layers](size_t layer) { layers->run(layer); };
  runner.top_k = a.att->spec().router_top_k;
  if (runner.top_k > 0)
    runner.route_ahead = [layers](size_t layer, int64_t* ids, float* scores) { layers->route_ahead(layer, ids, scores); };
  return runner;
}

void bind_decode_attention(py::module_& m) {
  m.def(
      "router_top_k_supported",
      [](const std::string& dtype, size_t k) {
        if (dtype == "float32") return expertcache::router_top_k_supported(FfnDtype::kFloat32, k);
        if (dtype == "bfloat16") return expertcache::router_top_k_supported(FfnDtype::kBFloat16, k);
        if (dtype == "float16") return expertcache::router_top_k_supported(FfnDtype::kFloat16, k);
        fail("dtype '" + dtype + "' is not float32, bfloat16 or float16");
      },
      py::arg("dtype"), py::arg("k"),
      "Whether DecodeAttention computes a router's top k and softmax as torch does for `dtype` (spec router_top_k)");
  py::class_<Attention>(m, "DecodeAttention")
      .def(py::init([](const py::dict& spec) {
             AttentionSpec s;
             s.hidden = get<size_t>(spec, "hidden");
             s.heads = get<size_t>(spec, "heads");
             s.kv_heads = get<size_t>(spec, "kv_heads");
             s.head_dim = get<size_t>(spec, "head_dim");
             const auto dtype = get<std::string>(spec, "dtype");
             if (dtype == "float32") s.dtype = FfnDtype::kFloat32;
             else if (dtype == "bfloat16") s.dtype = FfnDtype::kBFloat16;
             else if (dtype == "float16") s.dtype = FfnDtype::kFloat16;
             else fail("spec['dtype'] '" + dtype + "' is not float32, bfloat16 or float16");
             s.eps = get<float>(spec, "eps");
             s.scaling = get<float>(spec, "scaling");
             const auto norm = get<std::string>(spec, "norm");
             if (norm == "cast_then_weight") s.norm = expertcache::AttnNorm::kCastThenWeight;
             else if (norm == "weight_then_cast") s.norm = expertcache::AttnNorm::kWeightThenCast;
             else fail("spec['norm'] '" + norm + "' is not cast_then_weight or weight_then_cast");
             const auto softmax = get<std::string>(spec, "softmax");
             if (softmax == "eager") s.softmax = expertcache::AttnSoftmax::kEager;
             else if (softmax == "fused") s.softmax = expertcache::AttnSoftmax::kFused;
             else fail("spec['softmax'] '" + softmax + "' is not eager or fused");
             if (spec.contains("router_outputs")) s.router_outputs = spec["router_outputs"].cast<size_t>();
             if (spec.contains("router_top_k")) s.router_top_k = spec["router_top_k"].cast<size_t>();
             auto a = std::make_unique<Attention>();
             a->att = std::make_unique<DecodeAttention>(s);
             return a;
           }),
           py::arg("spec"))
      .def_property_readonly("layers", [](const Attention& a) { return a.att->layers(); })
      .def_property_readonly("router_top_k", [](const Attention& a) { return a.att->spec().router_top_k; })
      .def_property_readonly("path", [](const Attention& a) { return std::string(a.att->path()); })
      .def(
          "add_layer",
          [](Attention& a, const py::dict& weights, size_t window) {
            const AttentionSpec& s = a.att->spec();
            const size_t H = s.hidden, Q = s.heads * s.head_dim, KV = s.kv_heads * s.head_dim;
            AttentionWeights w;
            const auto take = [&](const char* name, size_t count, bool required) -> const uint8_t* {
              if (!weights.contains(name) || weights[name].is_none()) {
                if (required) fail(std::string("the layer has no '") + name + "'");
                return nullptr;
              }
              py::array arr = storage(weights[name], s.dtype, count, name);
              a.kept.push_back(arr);
              return static_cast<const uint8_t*>(arr.data());
            };
            w.input_norm = take("input_norm", H, true);
            w.post_norm = take("post_norm", H, true);
            w.q = take("q", Q * H, true);
            w.k = take("k", KV * H, true);
            w.v = take("v", KV * H, true);
            w.o = take("o", H * Q, true);
            w.q_bias = take("q_bias", Q, false);
            w.k_bias = take("k_bias", KV, false);
            w.v_bias = take("v_bias", KV, false);
            w.o_bias = take("o_bias", H, false);
            w.q_norm = take("q_norm", s.head_dim, false);
            w.k_norm = take("k_norm", s.head_dim, false);
            w.sinks = take("sinks", s.heads, false);
            if (s.router_outputs == 0 && weights.contains("router") && !weights["router"].is_none())
              fail("a router's weights go with spec router_outputs > 0");
            w.router = take("router", s.router_outputs * H, s.router_outputs > 0);
            w.router_bias = take("router_bias", s.router_outputs, false);
            w.window = window;
            a.att->add_layer(w);
          },
          py::arg("weights"), py::arg("window") = 0)
      .def(
          "set_head",
          [](Attention& a, const py::dict& weights, float eps) {
            const AttentionSpec& s = a.att->spec();
            const auto has = [&](const char* name) { return weights.contains(name) && !weights[name].is_none(); };
            if (!has("norm") || !has("weight")) fail("the head needs 'norm' and 'weight'");
            py::array norm = storage(weights["norm"], s.dtype, s.hidden, "norm");
            py::array w = weights["weight"].cast<py::array>();
            if (w.ndim() != 2 || size_t(w.shape(1)) != s.hidden || w.shape(0) < 1)
              fail("weight must be [vocab, hidden " + std::to_string(s.hidden) + "]");
            const size_t vocab = size_t(w.shape(0));
            w = storage(weights["weight"], s.dtype, vocab * s.hidden, "weight");
            expertcache::HeadWeights head;
            head.norm = static_cast<const uint8_t*>(norm.data());
            head.weight = static_cast<const uint8_t*>(w.data());
            head.eps = eps;
            head.vocab = vocab;
            a.kept.push_back(norm);
            a.kept.push_back(w);
            if (has("bias")) {
              py::array bias = storage(weights["bias"], s.dtype, vocab, "bias");
              head.bias = static_cast<const uint8_t*>(bias.data());
              a.kept.push_back(bias);
            }
            std::lock_guard<std::mutex> lock(a.busy);
            a.att->set_head(head);
          },
          py::arg("weights"), py::arg("eps"))
      .def_property_readonly("vocab", [](const Attention& a) { return a.att->vocab(); })
      .def(
          "head",
          [](Attention& a, const py::object& logits) {
            std::unique_lock<std::mutex> lock(a.busy, std::try_to_lock);
            if (!lock.owns_lock()) fail("head called while another call of the same object is in progress");
            if (!a.att->has_head()) fail("head before set_head");
            if (!a.step) fail("head before begin_step");
            const AttentionSpec& s = a.att->spec();
            const size_t rows = a.step->rows;
            py::array out = storage(logits, s.dtype, rows * a.att->vocab(), "logits", true);
            const uint8_t* h = static_cast<const uint8_t*>(a.step->h.data());
            uint8_t* o = static_cast<uint8_t*>(out.mutable_data());
            py::gil_scoped_release release;
            a.att->head(rows, h, o);
          },
          py::arg("logits"))
      .def(
          "begin_step",
          [](Attention& a, const py::object& h, const py::object& mlp_in, const py::object& cos, const py::object& sin,
             const py::object& keys, const py::object& values, const py::object& capacity, const py::object& length,
             const py::object& logits, const py::object& top_ids, const py::object& top_scores) {
            const AttentionSpec& s = a.att->spec();
            const size_t L = a.att->layers();
            if (!py::isinstance<py::array>(h) || h.cast<py::array>().ndim() != 2) fail("h must be [rows, hidden]");
            const size_t rows = size_t(h.cast<py::array>().shape(0));
            if (rows == 0) fail("a step has at least one row");
            auto step = std::make_unique<Step>();
            step->rows = rows;
            step->h = storage(h, s.dtype, rows * s.hidden, "h", true);
            step->mlp_in = storage(mlp_in, s.dtype, rows * s.hidden, "mlp_in", true);
            step->cos = storage(cos, s.dtype, rows * s.head_dim / 2, "cos");
            step->sin = storage(sin, s.dtype, rows * s.head_dim / 2, "sin");
            step->keys = int64s(keys, L * rows, "keys");
            step->values = int64s(values, L * rows, "values");
            step->capacity = int64s(capacity, L * rows, "capacity");
            step->length = int64s(length, rows, "length");
            if (s.router_outputs > 0) {
              if (logits.is_none()) fail("logits are needed: the layers have a router");
              step->logits = storage(logits, s.dtype, rows * s.router_outputs, "logits", true);
            } else if (!logits.is_none()) {
              fail("logits given, but the layers have no router");
            }
            const size_t K = s.router_top_k;
            if (K > 0) {
              if (top_ids.is_none() || top_scores.is_none())
                fail("top_ids and top_scores are needed: the spec asks for the router's top k");
              step->top_ids = int64s(top_ids, L * rows * K, "top_ids");
              if (!step->top_ids.writeable()) fail("top_ids must be writable");
              step->top_scores = storage(top_scores, s.dtype, L * rows * K, "top_scores", true);
            } else if (!top_ids.is_none() || !top_scores.is_none()) {
              fail("top_ids / top_scores given, but the spec asks for no top k");
            }
            for (size_t i = 0; i < L * rows; ++i) {
              const int64_t len = step->length.data()[i % rows], cap = step->capacity.data()[i];
              if (len < 0 || len >= cap)
                fail("row " + std::to_string(i % rows) + " of layer " + std::to_string(i / rows) + ": length " +
                     std::to_string(len) + " leaves no room in a capacity of " + std::to_string(cap));
            }
            for (size_t i = 0; i < L * rows; ++i) {
              if (step->keys.data()[i] == 0 || step->values.data()[i] == 0) fail("a cache address is null");
              step->key_ptrs.push_back(reinterpret_cast<uint8_t*>(step->keys.data()[i]));
              step->value_ptrs.push_back(reinterpret_cast<uint8_t*>(step->values.data()[i]));
            }
            std::lock_guard<std::mutex> lock(a.busy);
            a.step = std::move(step);
          },
          py::arg("h"), py::arg("mlp_in"), py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"),
          py::arg("capacity"), py::arg("length"), py::arg("logits") = py::none(), py::arg("top_ids") = py::none(),
          py::arg("top_scores") = py::none())
      .def(
          "run",
          [](Attention& a, size_t layer) {
            std::unique_lock<std::mutex> lock(a.busy, std::try_to_lock);
            if (!lock.owns_lock()) fail("run called while another call of the same object is in progress");
            if (!a.step) fail("run before begin_step");
            if (layer >= a.att->layers()) fail("no layer " + std::to_string(layer));
            const StepLayers layers(a);
            py::gil_scoped_release release;
            layers.run(layer);
          },
          py::arg("layer"))
      .def(
          "route_with",
          [](Attention& a, size_t layer, const py::object& x_obj, const py::object& ids_obj,
             const py::object& scores_obj) {
            const auto& s = a.att->spec();
            if (s.router_top_k == 0) fail("route_with needs a spec with router_top_k");
            if (layer >= a.att->layers()) fail("no layer " + std::to_string(layer));
            if (!py::isinstance<py::array>(x_obj)) fail("x must be a numpy array");
            const size_t n = size_t(x_obj.cast<py::array>().size());
            if (n == 0 || n % s.hidden) fail("x must hold rows of " + std::to_string(s.hidden) + " values");
            const size_t rows = n / s.hidden, k = s.router_top_k;
            py::array x = storage(x_obj, s.dtype, n, "x");
            auto ids = int64s(ids_obj, rows * k, "ids");
            if (!ids.writeable()) fail("ids must be writable");
            py::array scores = storage(scores_obj, s.dtype, rows * k, "scores", true);
            std::unique_lock<std::mutex> lock(a.busy, std::try_to_lock);
            if (!lock.owns_lock()) fail("route_with called while another call of the same object is in progress");
            a.att->route_with(layer, rows, static_cast<const uint8_t*>(x.data()), ids.mutable_data(),
                              static_cast<uint8_t*>(scores.mutable_data()));
          },
          py::arg("layer"), py::arg("x"), py::arg("ids"), py::arg("scores"),
          "Layer-ahead: layer `layer`'s router on x [rows, hidden] (the dtype's values): its top k into ids "
          "[rows, k] and its softmax scores into scores [rows, k] (the dtype's storage), as a step routes a layer")
      .def("end_step", [](Attention& a) {
        std::lock_guard<std::mutex> lock(a.busy);
        a.step.reset();
      });
}
