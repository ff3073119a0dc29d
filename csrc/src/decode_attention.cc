// The dense half of a decoder layer for a decode step (csrc/include/expertcache/decode_attention.h).
#include "expertcache/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

#include "expertcache/decode.h"
#include "expertcache/float_bits.h"

namespace expertcache {
namespace {

size_t bytes_of(FfnDtype d) { return d == FfnDtype::kFloat32 ? 4 : 2; }

template <FfnDtype D>
inline float load(const uint8_t* p, size_t i) {
  if constexpr (D == FfnDtype::kBFloat16) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return float_of(uint32_t(h) << 16);
  } else if constexpr (D == FfnDtype::kFloat32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  } else {
    return ffn_load(p, D, i);
  }
}

// Stores `v` (already a value of `d`) as `d`.
void store(uint8_t* p, FfnDtype d, size_t i, float v) {
  if (d == FfnDtype::kFloat32) {
    std::memcpy(p + 4 * i, &v, 4);
    return;
  }
  uint16_t h;
  if (d == FfnDtype::kBFloat16) {
    h = uint16_t(bits_of(v) >> 16);  // exact: v is a bf16 value
  } else {
    h = float_to_fp16(v);
  }
  std::memcpy(p + 2 * i, &h, 2);
}

// dot(a [n] float, b [n] of D)
template <FfnDtype D>
inline float dot(const float* a, const uint8_t* b, size_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (size_t l = 0; l < 8; ++l) acc[l] += a[i + l] * load<D>(b, i + l);
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * load<D>(b, i);
  return s;
}

// out[n] += p * b[n] (b of D)
template <FfnDtype D>
inline void axpy(float p, const uint8_t* b, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] += p * load<D>(b, i);
}

float dot_of(FfnDtype d, const float* a, const uint8_t* b, size_t n) {
  switch (d) {
    case FfnDtype::kBFloat16: return dot<FfnDtype::kBFloat16>(a, b, n);
    case FfnDtype::kFloat16: return dot<FfnDtype::kFloat16>(a, b, n);
    default: return dot<FfnDtype::kFloat32>(a, b, n);
  }
}

void axpy_of(FfnDtype d, float p, const uint8_t* b, size_t n, float* out) {
  switch (d) {
    case FfnDtype::kBFloat16: return axpy<FfnDtype::kBFloat16>(p, b, n, out);
    case FfnDtype::kFloat16: return axpy<FfnDtype::kFloat16>(p, b, n, out);
    default: return axpy<FfnDtype::kFloat32>(p, b, n, out);
  }
}

}  // namespace

DecodeAttention::DecodeAttention(const AttentionSpec& spec) : spec_(spec) {
  const auto bad = [](const std::string& what) { throw std::invalid_argument("decode attention: " + what); };
  if (!spec.hidden || !spec.heads || !spec.kv_heads || !spec.head_dim) bad("a size is 0");
  if (spec.heads % spec.kv_heads) bad("heads are not a multiple of the key/value heads");
  if (spec.head_dim % 2) bad("head_dim is odd: the rotation needs halves");
  if (spec.router_top_k > 0) {
    if (spec.router_top_k > spec.router_outputs) bad("router_top_k is more than the router's outputs");
    if (!router_top_k_supported(spec.dtype, spec.router_top_k))
      bad("router_top_k needs a 2-byte dtype and k < 8 (where torch's softmax is scalar code)");
  }
  avx2_ = ffn_cpu_has_avx2();
  dp_ = spec.dtype == FfnDtype::kBFloat16 && ffn_cpu_has_avx512_bf16();
}

void DecodeAttention::add_layer(const AttentionWeights& w) {
  if (!w.input_norm || !w.post_norm || !w.q || !w.k || !w.v || !w.o)
    throw std::invalid_argument("decode attention: a layer lacks a norm or a projection");
  if (w.sinks && spec_.softmax != AttnSoftmax::kEager)
    throw std::invalid_argument("decode attention: sinks need the eager softmax");
  if ((w.router != nullptr) != (spec_.router_outputs > 0))
    throw std::invalid_argument("decode attention: a router's weights go with spec router_outputs > 0");
  layers_.push_back(w);
}

void DecodeAttention::set_head(const HeadWeights& w) {
  if (!w.norm || !w.weight || !w.vocab) throw std::invalid_argument("decode attention: the head lacks its norm or weight");
  head_ = w;
}

void DecodeAttention::head(size_t rows, const uint8_t* h, uint8_t* out) {
  if (!has_head()) throw std::logic_error("decode attention: head before set_head");
  const FfnDtype d = spec_.dtype;
  const size_t H = spec_.hidden, V = head_.vocab;
  x_.resize(std::max(x_.size(), rows * H));
  y_.resize(std::max(y_.size(), std::max(H, rows * V)));
  for (size_t r = 0; r < rows; ++r) {
    for (size_t i = 0; i < H; ++i) y_[i] = ffn_load(h, d, r * H + i);
    norm(head_.norm, y_.data(), H, x_.data() + r * H, head_.eps);
  }
  linear(head_.weight, head_.bias, x_.data(), rows, H, V, y_.data());
  for (size_t i = 0; i < rows * V; ++i) store(out, d, i, y_[i]);
}

// RMSNorm of x [n] (values of the compute dtype) into out, rounded as the spec's norm rounds.
void DecodeAttention::norm(const uint8_t* weight, const float* x, size_t n, float* out, float eps) const {
  const FfnDtype d = spec_.dtype;
  float sq = 0.0f;
  for (size_t i = 0; i < n; ++i) sq += x[i] * x[i];
  const float r = 1.0f / std::sqrt(sq / float(n) + eps);
  for (size_t i = 0; i < n; ++i) {
    const float w = ffn_load(weight, d, i);
    out[i] = spec_.norm == AttnNorm::kWeightThenCast ? ffn_round(w * (x[i] * r), d)
                                                     : ffn_round(w * ffn_round(x[i] * r, d), d);
  }
}

// y [rows, out] = x [rows, in] W^T (+ bias), each output rounded once (as addmm rounds).
void DecodeAttention::linear(const uint8_t* w, const uint8_t* bias, const float* x, size_t rows, size_t in,
                             size_t out, float* y) {
  const FfnDtype d = spec_.dtype;
  if (!(dp_ && ffn_plain_dot_bf16(w, in, out, x, rows, y, words_))) ffn_plain_dot(w, d, in, out, x, rows, y, avx2_);
  for (size_t r = 0; r < rows; ++r)
    for (size_t i = 0; i < out; ++i) {
      float v = y[r * out + i];
      if (bias) v += ffn_load(bias, d, i);
      y[r * out + i] = ffn_round(v, d);
    }
}

// Row r's attention over its cache: out [heads * head_dim].
void DecodeAttention::attend(const AttentionWeights& w, const float* q, const uint8_t* keys,
                             const uint8_t* values, size_t capacity, size_t length, float* out) {
  const FfnDtype d = spec_.dtype;
  const size_t D = spec_.head_dim, groups = spec_.heads / spec_.kv_heads, B = bytes_of(d);
  const size_t last = length;  // the new token's index
  const size_t first = w.window && last + 1 > w.window ? last + 1 - w.window : 0;
  const size_t n = last + 1 - first;
  if (s_.size() < n) s_.resize(n);
  float* s = s_.data();
  const bool eager = spec_.softmax == AttnSoftmax::kEager;
  for (size_t hq = 0; hq < spec_.heads; ++hq) {
    const size_t g = hq / groups;
    const uint8_t* kh = keys + (g * capacity) * D * B;
    const uint8_t* vh = values + (g * capacity) * D * B;
    const float* qh = q + hq * D;
    float m = -std::numeric_limits<float>::infinity();
    for (size_t j = 0; j < n; ++j) {
      float v = dot_of(d, qh, kh + (first + j) * D * B, D);
      if (eager) v = ffn_round(ffn_round(v, d) * spec_.scaling, d);
      else v *= spec_.scaling;
      s[j] = v;
      m = std::max(m, v);
    }
    float sink = 0.0f;
    if (w.sinks) {
      sink = ffn_load(w.sinks, d, hq);
      m = std::max(m, sink);
    }
    float sum = 0.0f;
    if (eager) {
      // combined - max (rounded), then softmax in float32 over the rounded differences.
      for (size_t j = 0; j < n; ++j) {
        s[j] = std::exp(ffn_round(s[j] - m, d));
        sum += s[j];
      }
      if (w.sinks) sum += std::exp(ffn_round(sink - m, d));
      const float inv = 1.0f / sum;
      for (size_t j = 0; j < n; ++j) s[j] = ffn_round(s[j] * inv, d);
    } else {
      for (size_t j = 0; j < n; ++j) {
        const float e = std::exp(s[j] - m);
        sum += e;
        s[j] = ffn_round(e, d);
      }
    }
    float* oh = out + hq * D;
    std::fill(oh, oh + D, 0.0f);
    for (size_t j = 0; j < n; ++j) axpy_of(d, s[j], vh + (first + j) * D * B, D, oh);
    const float scale = eager ? 1.0f : 1.0f / sum;
    for (size_t i = 0; i < D; ++i) oh[i] = ffn_round(oh[i] * scale, d);
  }
}

void DecodeAttention::run(size_t layer, size_t rows, uint8_t* h, uint8_t* mlp_in, const uint8_t* cos,
                          const uint8_t* sin, uint8_t* const* keys, uint8_t* const* values, const int64_t* capacity,
                          const int64_t* length, uint8_t* logits, int64_t* top_ids, uint8_t* top_scores) {
  if (layer >= layers_.size()) throw std::out_of_range("decode attention: no layer " + std::to_string(layer));
  const AttentionWeights& w = layers_[layer];
  const FfnDtype d = spec_.dtype;
  const size_t H = spec_.hidden, D = spec_.head_dim, half = D / 2;
  const size_t Q = spec_.heads * D, KV = spec_.kv_heads * D;
  x_.resize(std::max(x_.size(), rows * H));
  q_.resize(std::max(q_.size(), rows * Q));
  k_.resize(std::max(k_.size(), rows * KV));
  v_.resize(std::max(v_.size(), rows * KV));
  a_.resize(std::max(a_.size(), rows * Q));
  y_.resize(std::max(y_.size(), rows * std::max(H, Q)));
  float* x = x_.data();
  for (size_t r = 0; r < rows; ++r) {
    for (size_t i = 0; i < H; ++i) y_[i] = ffn_load(h, d, r * H + i);
    norm(w.input_norm, y_.data(), H, x + r * H);
  }
  linear(w.q, w.q_bias, x, rows, H, Q, q_.data());
  linear(w.k, w.k_bias, x, rows, H, KV, k_.data());
  linear(w.v, w.v_bias, x, rows, H, KV, v_.data());
  for (size_t r = 0; r < rows; ++r) {
    // Per-head norms, then the rotation of q and k at the row's position.
    const auto rotate = [&](float* heads, size_t count, const uint8_t* head_norm) {
      for (size_t hd = 0; hd < count; ++hd) {
        float* v = heads + hd * D;
        if (head_norm) {
          std::copy(v, v + D, y_.data());
          norm(head_norm, y_.data(), D, v);
        }
        for (size_t i = 0; i < half; ++i) {
          const float c = ffn_load(cos, d, r * half + i), s = ffn_load(sin, d, r * half + i);
          const float a = v[i], b = v[i + half];
          v[i] = ffn_round(ffn_round(a * c, d) - ffn_round(b * s, d), d);
          v[i + half] = ffn_round(ffn_round(b * c, d) + ffn_round(a * s, d), d);
        }
      }
    };
    rotate(q_.data() + r * Q, spec_.heads, w.q_norm);
    rotate(k_.data() + r * KV, spec_.kv_heads, w.k_norm);
    // The new key and value into the cache at index length[r].
    const size_t cap = size_t(capacity[r]), at = size_t(length[r]);
    for (size_t g = 0; g < spec_.kv_heads; ++g)
      for (size_t i = 0; i < D; ++i) {
        store(keys[r], d, (g * cap + at) * D + i, k_[r * KV + g * D + i]);
        store(values[r], d, (g * cap + at) * D + i, v_[r * KV + g * D + i]);
      }
    attend(w, q_.data() + r * Q, keys[r], values[r], cap, at, a_.data() + r * Q);
  }
  linear(w.o, w.o_bias, a_.data(), rows, Q, H, y_.data());
  for (size_t r = 0; r < rows; ++r) {
    float* hr = x + r * H;  // the residual after attention
    for (size_t i = 0; i < H; ++i) {
      hr[i] = ffn_round(ffn_load(h, d, r * H + i) + y_[r * H + i], d);
      store(h, d, r * H + i, hr[i]);
    }
  }
  for (size_t r = 0; r < rows; ++r) {
    norm(w.post_norm, x + r * H, H, y_.data() + r * H);
    for (size_t i = 0; i < H; ++i) store(mlp_in, d, r * H + i, y_[r * H + i]);
  }
  if (w.router != nullptr && logits != nullptr) {
    const size_t E = spec_.router_outputs;
    q_.resize(std::max(q_.size(), rows * E));
    linear(w.router, w.router_bias, y_.data(), rows, H, E, q_.data());
    for (size_t i = 0; i < rows * E; ++i) store(logits, d, i, q_[i]);
    if (spec_.router_top_k > 0 && top_ids != nullptr && top_scores != nullptr) route(q_.data(), rows, top_ids, top_scores);
  }
}

void DecodeAttention::route_with(size_t layer, size_t rows, const uint8_t* x, int64_t* ids, uint8_t* scores) {
  if (layer >= layers_.size() || layers_[layer].router == nullptr || spec_.router_top_k == 0)
    throw std::invalid_argument("decode attention: route_with needs a layer with a router and router_top_k");
  const size_t H = spec_.hidden, E = spec_.router_outputs;
  const FfnDtype d = spec_.dtype;
  ahead_x_.resize(std::max(ahead_x_.size(), rows * H));
  ahead_logits_.resize(std::max(ahead_logits_.size(), rows * E));
  for (size_t i = 0; i < rows * H; ++i) ahead_x_[i] = ffn_load(x, d, i);
  const AttentionWeights& w = layers_[layer];
  linear(w.router, w.router_bias, ahead_x_.data(), rows, H, E, ahead_logits_.data());
  route(ahead_logits_.data(), rows, ids, scores);
}

bool router_top_k_supported(FfnDtype dtype, size_t k) { return dtype != FfnDtype::kFloat32 && k >= 1 && k < 8; }

// torch.topk(logits, k, dim=-1) on the CPU: (value as float, index) pairs ordered by a comparator
// that puts NaN first, then greater values; std::partial_sort where k * 64 <= E, else
// std::nth_element at k - 1 and std::sort of the k - 1 before it (so ties fall as there). Then
// torch.softmax(top, dim=1) of a 2-byte dtype with k < 8, which torch computes in scalar code: the
// max by std::max from -inf, std::exp(x - max) summed in order from 0, times 1 / sum, rounded.
void DecodeAttention::route(const float* logits, size_t rows, int64_t* ids, uint8_t* scores) {
  const size_t E = spec_.router_outputs, k = spec_.router_top_k;
  const FfnDtype d = spec_.dtype;
  using Elem = std::pair<float, int64_t>;
  const auto before = [](const Elem& x, const Elem& y) {
    return (std::isnan(x.first) && !std::isnan(y.first)) || x.first > y.first;
  };
  queue_.resize(E);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t j = 0; j < E; ++j) queue_[j] = {logits[r * E + j], int64_t(j)};
    if (k * 64 <= E) {
      std::partial_sort(queue_.begin(), queue_.begin() + k, queue_.end(), before);
    } else {
      std::nth_element(queue_.begin(), queue_.begin() + k - 1, queue_.end(), before);
      std::sort(queue_.begin(), queue_.begin() + k - 1, before);
    }
    float max = -std::numeric_limits<float>::infinity();
    for (size_t j = 0; j < k; ++j) max = std::max(max, queue_[j].first);
    float e[8], sum = 0.0f;
    for (size_t j = 0; j < k; ++j) {
      e[j] = std::exp(queue_[j].first - max);
      sum += e[j];
    }
    sum = 1 / sum;
    for (size_t j = 0; j < k; ++j) {
      ids[r * k + j] = queue_[j].second;
      store(scores, d, r * k + j, ffn_round(e[j] * sum, d));
    }
  }
}

}  // namespace expertcache
