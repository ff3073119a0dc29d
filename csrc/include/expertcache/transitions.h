// Routing transitions (cache_daemon/decisions/transitions.py owns the model and documents it):
// per MoE layer, counts of which expert a layer routes at a visit after routing a given expert at
// its previous visit of the same request, and the next-visit probability they imply. Runs once
// per routed layer on the daemon's hot path, so update and prediction are one call here (a dozen
// numpy calls on 32-element rows cost more than the arithmetic).
//
//   base(b)  = (to[b] + a) / (visits + a * E / k)                  a = prior_count in count units
//   c(p, b)  = (pairs[p, b] + a * base(b)) / (from[p] + a)
//   x(b)     = prod_{p in previous} c(p, b) / base(b)^(k - 1) * (h(b) + eps)^beta
//   q(b)     = min(1, k * x(b) / sum x)
//
// Counts are kept in growing units (a visit adds unit[l], which grows by 1 / decay per visit and
// is rescaled to 1 before it grows past 1e30): the same as decaying every count per visit.
//
// Not thread-safe: the caller serialises (ActivationSignals runs under the residency lock).
// Failures are std::invalid_argument naming the argument (a layer or expert out of range).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace expertcache {

class TransitionTable {
 public:
  TransitionTable(size_t layers, size_t experts, double prior_count, double history_exponent,
                  double half_life_visits);

  // Layer `layer` routed `current` (n_current experts). If n_previous > 0, its previous visit in
  // the same request routed `previous`, and the pair is counted. Then writes to out[0..E) the
  // probability of each expert at the layer's next visit after this one, given `current` and the
  // request's history row, (1 - long_weight) * history + long_weight * history_long (float32 [E]
  // each).
  void step(size_t layer, const int64_t* previous, size_t n_previous, const int64_t* current,
            size_t n_current, const float* history, const float* history_long, float long_weight,
            float* out);

  // The next-visit probability after a visit that routed `previous`, without counting anything.
  void predict(size_t layer, const int64_t* previous, size_t n_previous, const float* history,
               float* out) const;

  size_t layers() const { return layers_; }
  size_t experts() const { return experts_; }
  double visits(size_t layer) const;  // successor visits counted, decayed

 private:
  void check(size_t layer, const int64_t* experts, size_t n, const char* name) const;
  // predict() after the arguments were checked.
  void estimate(size_t layer, const int64_t* previous, size_t n_previous, const float* history, float* out) const;
  void update(size_t layer, const int64_t* previous, size_t n_previous, const int64_t* current,
              size_t n_current);

  size_t layers_, experts_;
  double prior_count_, history_exponent_, growth_;
  std::vector<double> unit_, visits_;
  std::vector<float> pairs_;  // [layers, E, E]
  std::vector<float> from_;   // [layers, E]
  std::vector<float> to_;     // [layers, E]
};

}  // namespace expertcache
