// What a decode layer run natively tells the cache daemon: the signals compute's channel
// transport writes for a layer (compute_svc/daemon/transport.py, ChannelTransport.routed and
// .layer_ahead; the records are channel.h's), written from native code so that a layer whose
// experts are all resident needs no Python (ExpertFfn.run_layers).
//
// Per layer, for a step of R rows, one request's token each (row r: the request's channel handle
// and its token's position):
//   route   per row: the layer's experts of the row, ascending, each once;
//   ahead   per row, where the layer predicts later ones: per depth d (1 ..), the predicted layer
//           and its experts best first (ties: the lower expert), each with its score.
// Then the doorbell rings once. A record the ring has no room for is dropped and counted, as the
// transport counts it.
//
// Predictions come from the later layers' routers on this layer's MoE input (their top k and
// softmax weights, renormalised to sum to 1 in float32 and capped at 1: what
// compute_svc.experts.layer_ahead.LayerAheadPredictor.predict_host gives), or are given whole
// ("as given": a benchmark's modelled predictions, already ordered; only the cap applies).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "expertcache/channel.h"

namespace expertcache {

class LayerSignals {
 public:
  // `handles` / `tokens`: per row; `top_k`: ids per row; `ahead` [layers, depth]: the layer
  // predicted at depth d + 1 from layer l, or -1 (none: past the last MoE layer). Throws
  // std::invalid_argument where handles and tokens differ in length or a count is 0.
  LayerSignals(ClientChannel& channel, std::vector<uint32_t> handles, std::vector<uint32_t> tokens,
               size_t top_k, size_t layers, size_t depth, std::vector<int64_t> ahead);

  size_t rows() const { return handles_.size(); }
  size_t layers() const { return layers_; }
  size_t top_k() const { return top_k_; }
  size_t depth() const { return depth_; }
  // The layer predicted at depth d (1 ..) from `layer`, or -1.
  int64_t ahead(size_t layer, size_t d) const { return ahead_[layer * depth_ + d - 1]; }

  // Layer `layer`'s records: `ids` [rows * top_k] its routing; for each depth d with a layer
  // ahead, `ahead_ids[d - 1]` / `ahead_scores[d - 1]` [rows * top_k] its prediction (router
  // weights, or the scores as given with `as_given`). Then rings the doorbell, or with `ring`
  // false leaves that to what follows (a demand posted for the layer rings for both): `unrung`.
  void write(size_t layer, const int64_t* ids, const std::vector<const int64_t*>& ahead_ids,
             const std::vector<const float*>& ahead_scores, bool as_given, bool ring = true);

  // Rings the doorbell for records written unrung (a miss layer's, whose span then waits for its
  // experts in flight instead of demanding them); nothing when none are.
  void ring();
  // The records written unrung were covered by a doorbell rung for what followed them (the
  // demand a native span posted for the layer): nothing left to ring.
  void covered() { unrung_ = false; }

  size_t written() const { return written_; }
  size_t dropped() const { return dropped_; }
  // Records were written since the doorbell last rang.
  bool unrung() const { return unrung_; }

 private:
  void count(bool ok) { ok ? ++written_ : ++dropped_; }

  ClientChannel& channel_;
  std::vector<uint32_t> handles_, tokens_;
  size_t top_k_, layers_, depth_;
  std::vector<int64_t> ahead_;
  size_t written_ = 0, dropped_ = 0;
  bool unrung_ = false;
  // Scratch of one row's records.
  std::vector<int64_t> experts_;
  std::vector<uint32_t> layers_out_, depths_out_;
  std::vector<std::vector<int64_t>> ahead_experts_;
  std::vector<std::vector<float>> ahead_out_;
  std::vector<std::pair<float, int64_t>> pairs_;
};

}  // namespace expertcache
