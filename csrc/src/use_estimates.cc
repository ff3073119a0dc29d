// See csrc/include/expertcache/use_estimates.h. Each expression names the numpy one it mirrors.
#include "expertcache/use_estimates.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace expertcache {

void request_estimates(size_t n, const RequestRows& r, const EstimateWeights& w, float* out_long,
                       float* out_next) {
  // (np.float32(1.0) - w) * history + w * history_long, w = np.float32(long_weight)
  const float keep_short = 1.0f - w.long_weight;
  // with_hints: (1.0 - weight) * p + weight * h; a Python float meets a float32 row as float32
  const bool hints = w.hint_weight > 0.0 && r.has_hints;
  const float keep_p = static_cast<float>(1.0 - w.hint_weight);
  const float take_h = static_cast<float>(w.hint_weight);
  // tw * next_p + (np.float32(1.0) - tw) * hist, tw = np.float32(transition_weight)
  const float tw = w.transition_weight;
  const float keep_hist = 1.0f - tw;
  for (size_t i = 0; i < n; ++i) {
    const float a = keep_short * r.history[i];
    const float b = w.long_weight * r.history_long[i];
    const float hist = a + b;
    // fresh_hints: where((token - hint_token) <= ttl, hints, 0)
    const float h = hints && (r.token - r.hint_token[i]) <= w.hint_ttl_tokens ? r.hints[i] : 0.0f;
    auto with_hints = [&](float p) {
      if (!(h > 0.0f)) return p;
      const float x = keep_p * p;
      const float y = take_h * h;
      return x + y;
    };
    const float long_run = hints ? with_hints(hist) : hist;
    out_long[i] = long_run;
    if (out_next == nullptr) continue;
    const float np_ = r.next_p[i];
    const float c = tw * np_;
    const float d = keep_hist * hist;
    const float blend = c + d;
    if (w.learned)
      out_next[i] = np_ >= 0.0f ? blend : long_run;  // where(next_p >= 0, blend, with_hints(hist))
    else
      out_next[i] = hints ? with_hints(np_ >= 0.0f ? blend : hist) : (np_ >= 0.0f ? blend : hist);
  }
}

void apply_lookahead(float* p, size_t num_experts, size_t layer, double keep, const int64_t* entries,
                     const double* confidence, size_t n) {
  // p[sl] *= 1.0 - precision: a Python float meets a float32 row as float32
  const float k = static_cast<float>(keep);
  float* row = p + layer * num_experts;
  for (size_t i = 0; i < num_experts; ++i) row[i] = row[i] * k;
  // p[entries] = np.maximum(p[entries], conf): every value read, then written in order
  std::vector<float> raised(n);
  for (size_t j = 0; j < n; ++j) {
    const double a = static_cast<double>(p[entries[j]]);
    const double c = confidence[j];
    raised[j] = static_cast<float>(std::isnan(a) || a >= c ? a : c);
  }
  for (size_t j = 0; j < n; ++j) p[entries[j]] = raised[j];
}

void next_use_layers(size_t n, const int64_t* distance, const float* p_next, const float* p_long,
                     int64_t moe_layers, double floor, double* out) {
  const double m = static_cast<double>(moe_layers);
  for (size_t i = 0; i < n; ++i) {
    // np.maximum(p_long.astype(float64), floor): NaN stays NaN
    const double pl = static_cast<double>(p_long[i]);
    const double kept = pl < floor ? floor : pl;
    // distance.astype(float64) + M * (1.0 - p_next) / p_long
    const double miss = 1.0 - static_cast<double>(p_next[i]);
    const double steps = m * miss;
    out[i] = static_cast<double>(distance[i]) + steps / kept;
  }
}

void idle_log_survival(size_t n, const int64_t* distance, const float* p_next, const float* p_long,
                       int64_t moe_layers, double horizon, double* out) {
  constexpr double kMaxP = 1.0 - 1e-9;  // a certain use would be log(0)
  auto log_miss = [](float p) {
    const double q = static_cast<double>(p);
    if (std::isnan(q)) return q;
    return std::log1p(-(q < 0.0 ? 0.0 : (q > kMaxP ? kMaxP : q)));
  };
  const double m = static_cast<double>(moe_layers);
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(distance[i]);
    if (d > horizon) {
      out[i] = 0.0;  // not visited within the horizon: certainly idle
      continue;
    }
    out[i] = log_miss(p_next[i]) + (horizon - d) / m * log_miss(p_long[i]);
  }
}

size_t victim_order(size_t n, const bool* resident, const double* next_use, const int64_t* stamp, int64_t* out) {
  size_t count = 0;
  for (size_t e = 0; e < n; ++e)
    if (resident[e]) out[count++] = static_cast<int64_t>(e);
  // a before b under numpy's float order: NaN after every number, NaNs equal
  auto less = [](double a, double b) { return std::isnan(a) ? false : (std::isnan(b) || a < b); };
  std::stable_sort(out, out + count, [&](int64_t a, int64_t b) {
    const double ka = -next_use[a], kb = -next_use[b];
    if (less(ka, kb)) return true;
    if (less(kb, ka)) return false;
    return less(static_cast<double>(stamp[a]), static_cast<double>(stamp[b]));
  });
  return count;
}

}  // namespace expertcache
