// The learned next-visit model's arithmetic (cache_daemon/decisions/next_visit.py owns the model,
// its features and its file, and documents them): per MoE layer j, a logistic regression from
// the latest routing of a window of layers (one-hot), and the request's short and long histories
// of layer j, to the probability of each of layer j's experts at its next visit:
//
//   z = bias[j] + sum_i latest[i] * W[j][i] + sum_e short[e] * W[j][wE + e] + sum_e long[e] * W[j][wE + E + e]
//   q = 1 / (1 + exp(-z))
//
// with W[j] a (w * E + 2E) x E row-major matrix, held in bfloat16 (rounded to nearest even; the
// Python model rounds its weights the same way, so both compute the same numbers). It runs once
// per routed layer on the daemon's hot path: the one-hot rows are summed only where `latest` is
// non-zero (k per layer), so a call costs about k * w * E + 2 * E * E multiply-adds, and its time
// is mostly the cache misses on those rows (gpt-oss-20b: 160 rows, 10 KiB in bfloat16).
//
// Immutable after construction (the weights are copied in); predict is const and thread-safe.
// Failures are std::invalid_argument naming the argument.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace expertcache {

class NextVisitLogistic {
 public:
  static constexpr size_t kMaxExperts = 4096;  // experts per layer (cache_daemon/decisions/next_visit.py: MAX_EXPERTS)

  // weights: float32 [layers, (window + 2) * experts, experts]; bias: float32 [layers, experts].
  NextVisitLogistic(size_t layers, size_t experts, size_t window, const float* weights, const float* bias);

  size_t layers() const { return layers_; }
  size_t experts() const { return experts_; }
  size_t window() const { return window_; }

  // Layer `layer` routed `experts` (n of them): records it in `latest`, the request's one-hot
  // latest routing of every layer (float [layers * E], its layer row cleared first), then writes
  // to out[0..E) the next-visit probabilities of the layer's experts from `latest`'s window and the
  // request's histories of the layer (float [E] each).
  void step(size_t layer, const int64_t* experts, size_t n, float* latest, const float* short_history,
            const float* long_history, float* out) const;

  // The same arithmetic without recording: from the window's latest routing (float [window * E]).
  void predict(size_t layer, const float* window_latest, const float* short_history, const float* long_history,
               float* out) const;

  // As a horizon head (its outputs: each expert's chance of use within `visits` >= 2 visits), from
  // `latest`, the request's latest routing of every layer (float [layers * E], as `step` leaves
  // it), and the histories: writes to out[0..E) each expert's per-visit chance of use at the
  // visits after the next one, given its next-visit chance p_next[0..E) (tail_probability).
  void tail(size_t layer, const float* latest, const float* short_history, const float* long_history,
            const float* p_next, size_t visits, float* out) const;

  // First layer of `layer`'s input window.
  size_t window_start(size_t layer) const;

 private:
  size_t layers_, experts_, window_, inputs_;
  std::vector<uint16_t> weights_;  // bfloat16: half the bytes a call touches (cache misses dominate it)
  std::vector<float> bias_;
};

// The per-visit chance of use at the visits after the next one, taken alike and independent, from
// the chance at the next visit p_next[i] and within the next `visits` (>= 2) visits within[i]:
//   1 - within = (1 - p_next) * (1 - out) ^ (visits - 1)
// in float64 as cache_daemon/decisions/next_visit.py's tail_probability: stay = clip((1 - within)
// / max(1 - p_next, 1e-12), 0, 1), out = 1 - stay ^ (1 / (visits - 1)).
void tail_probability(size_t n, const float* p_next, const float* within, size_t visits, float* out);

}  // namespace expertcache
