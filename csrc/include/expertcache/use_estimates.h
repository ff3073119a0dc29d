// The per-version estimates of cache_daemon/decisions/use_estimates.py (which documents them), in
// one pass over a request's entries each: the prefetch scheduler and the eviction policy read
// them after every routed layer, and as numpy calls on rows of a few hundred entries they cost a
// few microseconds per call, dozens of calls per layer. Element for element the same arithmetic,
// in the same order and precision, as the numpy expressions they replace (this file is compiled
// without contraction into fused multiply-adds), so decisions are bit for bit those of the numpy
// code.
//
// Not thread-safe: the caller serialises (ActivationSignals runs under the residency lock).
#pragma once

#include <cstddef>
#include <cstdint>

namespace expertcache {

// One live request's rows, each [n] and indexed by entry.
struct RequestRows {
  const float* history;       // short recency-weighted use per visit
  const float* history_long;  // the same with the long half-life
  const float* next_p;        // next-visit estimate, < 0 where there is none
  const float* hints;         // hint scores
  const int64_t* hint_token;  // the token each hint came at
  int64_t token;              // the request's position (token of its last observe)
  bool has_hints;
};

struct EstimateWeights {
  float long_weight;        // blend of the two histories (float32, as np.float32(w))
  float transition_weight;  // blend of the next-visit estimate with the history (float32)
  double hint_weight;       // blend of fresh hints (a Python float)
  int64_t hint_ttl_tokens;  // a hint older than this many tokens is stale
  bool learned;             // the next-visit estimate is the learned model's (hints only where it has none)
};

// out_long[i]: the per-visit use estimate beyond the next visit, the blended history with the
// fresh hints blended in (UseEstimates.request_probabilities). out_next[i], when out_next is not
// null: the estimate at the layer's next visit (UseEstimates.request_next_probabilities with a
// transition weight above 0).
void request_estimates(size_t n, const RequestRows& rows, const EstimateWeights& w, float* out_long,
                       float* out_next);

// One predicted layer's override of the next-visit estimate (UseEstimates.use_probability): the
// layer's row scaled by `keep` (1 - the depth's precision), then each predicted entry raised to at
// least its confidence: p[layer * E : (layer + 1) * E] *= keep; p[entries] = maximum(p[entries],
// confidence) (float64 maximum, NaN kept, rounded back to float32; the entries' values are read
// before any is written, as numpy's fancy indexing does).
void apply_lookahead(float* p, size_t num_experts, size_t layer, double keep, const int64_t* entries,
                     const double* confidence, size_t n);

// out[i] = distance[i] + moe_layers * (1 - p_next[i]) / max(p_long[i], floor), in float64
// (UseEstimates.next_use_layers before the entries in use are zeroed).
void next_use_layers(size_t n, const int64_t* distance, const float* p_next, const float* p_long,
                     int64_t moe_layers, double floor, double* out);

// out[i] = log of the probability that entry i goes unused over the next horizon layer steps
// (UseEstimates.idle_log_survival before the entries in use get -inf), in float64: 0 where its
// next visit is beyond the horizon (distance[i] > horizon), else
//   log1p(-p_next[i]) + (horizon - distance[i]) / moe_layers * log1p(-p_long[i])
// with each probability taken in [0, 1 - 1e-9] (used at its next visit, then at each later
// visit within the horizon, independently); NaN stays NaN.
void idle_log_survival(size_t n, const int64_t* distance, const float* p_next, const float* p_long,
                       int64_t moe_layers, double horizon, double* out);

// The resident entries, best victim first (ShapedPolicy.victim_order for the activation-aware
// policy): entries with resident[e] set, in ascending order, stably sorted by keep score
// -next_use[e] and then by tiebreak (double)stamp[e], NaN last for each key as numpy's lexsort
// orders them. Writes them to out (room for every entry) and returns their number.
size_t victim_order(size_t n, const bool* resident, const double* next_use, const int64_t* stamp, int64_t* out);

}  // namespace expertcache
