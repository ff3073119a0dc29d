// The learned next-visit model's arithmetic: see csrc/include/expertcache/next_visit.h.
#include "expertcache/next_visit.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace expertcache {

namespace {

// float32 -> bfloat16 bits, rounded to nearest even (the inputs are finite).
uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

}  // namespace

NextVisitLogistic::NextVisitLogistic(size_t layers, size_t experts, size_t window, const float* weights,
                                     const float* bias)
    : layers_(layers), experts_(experts), window_(window), inputs_((window + 2) * experts) {
  if (layers < 1 || experts < 1 || experts > kMaxExperts)
    throw std::invalid_argument("NextVisitLogistic: layers must be >= 1 and experts in [1, " +
                                std::to_string(kMaxExperts) + "], got " +
                                std::to_string(layers) + " and " + std::to_string(experts));
  if (window < 1 || window > layers)
    throw std::invalid_argument("NextVisitLogistic: window must be in [1, " + std::to_string(layers) + "], got " +
                                std::to_string(window));
  const size_t n = layers * inputs_ * experts;
  weights_.resize(n);
  for (size_t i = 0; i < n; ++i) weights_[i] = to_bf16(weights[i]);
  bias_.assign(bias, bias + layers * experts);
}

size_t NextVisitLogistic::window_start(size_t layer) const {
  const size_t half = (window_ - 1) / 2;
  const size_t lo = layer > half ? layer - half : 0;
  return lo < layers_ - window_ ? lo : layers_ - window_;
}

void NextVisitLogistic::step(size_t layer, const int64_t* experts, size_t n, float* latest,
                             const float* short_history, const float* long_history, float* out) const {
  if (layer >= layers_)
    throw std::invalid_argument("NextVisitLogistic: layer " + std::to_string(layer) + " outside 0.." +
                                std::to_string(layers_ - 1));
  const size_t E = experts_;
  for (size_t i = 0; i < n; ++i)
    if (experts[i] < 0 || static_cast<uint64_t>(experts[i]) >= E)
      throw std::invalid_argument("NextVisitLogistic: expert " + std::to_string(experts[i]) + " outside 0.." +
                                  std::to_string(E - 1));
  float* row = latest + layer * E;
  for (size_t e = 0; e < E; ++e) row[e] = 0.0f;
  for (size_t i = 0; i < n; ++i) row[experts[i]] = 1.0f;
  predict(layer, latest + window_start(layer) * E, short_history, long_history, out);
}

void NextVisitLogistic::predict(size_t layer, const float* latest, const float* short_history,
                                const float* long_history, float* out) const {
  if (layer >= layers_)
    throw std::invalid_argument("NextVisitLogistic: layer " + std::to_string(layer) + " outside 0.." +
                                std::to_string(layers_ - 1));
  const size_t E = experts_;
  const size_t wE = window_ * E;
  const uint16_t* w = &weights_[layer * inputs_ * E];
  float z[kMaxExperts];
  const float* b = &bias_[layer * E];
  for (size_t e = 0; e < E; ++e) z[e] = b[e];
  for (size_t i = 0; i < wE; ++i) {
    const float x = latest[i];
    if (x == 0.0f) continue;  // one-hot: k of each layer's E are set
    const uint16_t* row = w + i * E;
    for (size_t e = 0; e < E; ++e) z[e] += x * from_bf16(row[e]);
  }
  const float* hist[2] = {short_history, long_history};
  for (size_t h = 0; h < 2; ++h) {
    const uint16_t* rows = w + (wE + h * E) * E;
    for (size_t i = 0; i < E; ++i) {
      const float x = hist[h][i];
      const uint16_t* row = rows + i * E;
      for (size_t e = 0; e < E; ++e) z[e] += x * from_bf16(row[e]);
    }
  }
  for (size_t e = 0; e < E; ++e) out[e] = 1.0f / (1.0f + std::exp(-z[e]));
}

void NextVisitLogistic::tail(size_t layer, const float* latest, const float* short_history,
                             const float* long_history, const float* p_next, size_t visits, float* out) const {
  if (layer >= layers_)
    throw std::invalid_argument("NextVisitLogistic: layer " + std::to_string(layer) + " outside 0.." +
                                std::to_string(layers_ - 1));
  if (visits < 2) throw std::invalid_argument("NextVisitLogistic: visits must be >= 2, got " + std::to_string(visits));
  float within[kMaxExperts];
  predict(layer, latest + window_start(layer) * experts_, short_history, long_history, within);
  tail_probability(experts_, p_next, within, visits, out);
}

void tail_probability(size_t n, const float* p_next, const float* within, size_t visits, float* out) {
  const double inv = 1.0 / static_cast<double>(visits - 1);
  for (size_t i = 0; i < n; ++i) {
    double miss = 1.0 - static_cast<double>(p_next[i]);
    if (!(miss >= 1e-12)) miss = 1e-12;  // np.maximum(., 1e-12)
    double stay = (1.0 - static_cast<double>(within[i])) / miss;
    stay = stay < 0.0 ? 0.0 : (stay > 1.0 ? 1.0 : stay);  // np.clip(., 0, 1)
    out[i] = static_cast<float>(1.0 - std::pow(stay, inv));
  }
}

}  // namespace expertcache
