// Routing transitions: see csrc/include/expertcache/transitions.h.
#include "expertcache/transitions.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace expertcache {

namespace {
constexpr double kRescaleAt = 1e30;
constexpr double kHistoryEps = 1e-3;
}  // namespace

TransitionTable::TransitionTable(size_t layers, size_t experts, double prior_count, double history_exponent,
                                 double half_life_visits)
    : layers_(layers),
      experts_(experts),
      prior_count_(prior_count),
      history_exponent_(history_exponent),
      growth_(std::pow(0.5, -1.0 / half_life_visits)),
      unit_(layers, 1.0),
      visits_(layers, 0.0),
      pairs_(layers * experts * experts, 0.0f),
      from_(layers * experts, 0.0f),
      to_(layers * experts, 0.0f) {
  if (layers < 1 || experts < 1)
    throw std::invalid_argument("TransitionTable: layers and experts must be >= 1, got " + std::to_string(layers) +
                                " and " + std::to_string(experts));
  if (!(prior_count > 0.0)) throw std::invalid_argument("TransitionTable: prior_count must be > 0");
  if (!(history_exponent >= 0.0)) throw std::invalid_argument("TransitionTable: history_exponent must be >= 0");
  if (!(half_life_visits > 0.0)) throw std::invalid_argument("TransitionTable: half_life_visits must be > 0");
}

void TransitionTable::check(size_t layer, const int64_t* experts, size_t n, const char* name) const {
  if (layer >= layers_)
    throw std::invalid_argument("TransitionTable: layer " + std::to_string(layer) + " outside 0.." +
                                std::to_string(layers_ - 1));
  if (n > experts_)
    throw std::invalid_argument(std::string("TransitionTable: ") + name + " names " + std::to_string(n) +
                                " experts, more than the layer's " + std::to_string(experts_));
  for (size_t i = 0; i < n; ++i)
    if (experts[i] < 0 || static_cast<uint64_t>(experts[i]) >= experts_)
      throw std::invalid_argument(std::string("TransitionTable: ") + name + " expert " + std::to_string(experts[i]) +
                                  " outside 0.." + std::to_string(experts_ - 1));
}

double TransitionTable::visits(size_t layer) const {
  if (layer >= layers_) throw std::invalid_argument("TransitionTable: layer out of range");
  return visits_[layer] / unit_[layer];
}

void TransitionTable::update(size_t layer, const int64_t* previous, size_t n_previous, const int64_t* current,
                             size_t n_current) {
  const size_t E = experts_;
  float* pairs = &pairs_[layer * E * E];
  float* from = &from_[layer * E];
  float* to = &to_[layer * E];
  double unit = unit_[layer] * growth_;
  if (unit > kRescaleAt) {
    const double f = 1.0 / unit;
    for (size_t i = 0; i < E * E; ++i) pairs[i] = static_cast<float>(pairs[i] * f);
    for (size_t i = 0; i < E; ++i) {
      from[i] = static_cast<float>(from[i] * f);
      to[i] = static_cast<float>(to[i] * f);
    }
    visits_[layer] *= f;
    unit = 1.0;
  }
  unit_[layer] = unit;
  visits_[layer] += unit;
  const float u = static_cast<float>(unit);
  for (size_t i = 0; i < n_previous; ++i) {
    const size_t p = static_cast<size_t>(previous[i]);
    from[p] += u;
    for (size_t j = 0; j < n_current; ++j) pairs[p * E + static_cast<size_t>(current[j])] += u;
  }
  for (size_t j = 0; j < n_current; ++j) to[static_cast<size_t>(current[j])] += u;
}

void TransitionTable::predict(size_t layer, const int64_t* previous, size_t n_previous, const float* history,
                              float* out) const {
  check(layer, previous, n_previous, "previous");
  estimate(layer, previous, n_previous, history, out);
}

void TransitionTable::estimate(size_t layer, const int64_t* previous, size_t n_previous, const float* history,
                               float* out) const {
  const size_t E = experts_;
  const size_t k = std::max<size_t>(n_previous, 1);
  const double a = prior_count_ * unit_[layer];
  const float* pairs = &pairs_[layer * E * E];
  const float* from = &from_[layer * E];
  const float* to = &to_[layer * E];
  const double base_den = visits_[layer] + a * static_cast<double>(E) / static_cast<double>(k);
  std::vector<double> x(E);
  double sum = 0.0;
  for (size_t b = 0; b < E; ++b) {
    const double base = (to[b] + a) / base_den;
    // In logs: a product of k factors near 0 would underflow for a large k.
    double s = (1.0 - static_cast<double>(n_previous)) * std::log(base);
    for (size_t i = 0; i < n_previous; ++i) {
      const size_t p = static_cast<size_t>(previous[i]);
      s += std::log((pairs[p * E + b] + a * base) / (from[p] + a));
    }
    if (history_exponent_ > 0.0) s += history_exponent_ * std::log(static_cast<double>(history[b]) + kHistoryEps);
    x[b] = s;
  }
  const double top = *std::max_element(x.begin(), x.end());
  for (size_t b = 0; b < E; ++b) {
    x[b] = std::exp(x[b] - top);
    sum += x[b];
  }
  const double scale = static_cast<double>(k) / sum;
  for (size_t b = 0; b < E; ++b) out[b] = static_cast<float>(std::min(1.0, x[b] * scale));
}

void TransitionTable::step(size_t layer, const int64_t* previous, size_t n_previous, const int64_t* current,
                           size_t n_current, const float* history, const float* history_long, float long_weight,
                           float* out) {
  check(layer, previous, n_previous, "previous");
  check(layer, current, n_current, "current");
  if (n_previous > 0) update(layer, previous, n_previous, current, n_current);
  std::vector<float> blend(experts_);
  for (size_t b = 0; b < experts_; ++b) blend[b] = (1.0f - long_weight) * history[b] + long_weight * history_long[b];
  estimate(layer, current, n_current, blend.data(), out);  // current was checked above
}

}  // namespace expertcache
