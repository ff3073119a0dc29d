// A natively run decode layer's signals to the cache daemon (see layer_signals.h).
#include "expertcache/layer_signals.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace expertcache {

LayerSignals::LayerSignals(ClientChannel& channel, std::vector<uint32_t> handles, std::vector<uint32_t> tokens,
                           size_t top_k, size_t layers, size_t depth, std::vector<int64_t> ahead)
    : channel_(channel),
      handles_(std::move(handles)),
      tokens_(std::move(tokens)),
      top_k_(top_k),
      layers_(layers),
      depth_(depth),
      ahead_(std::move(ahead)) {
  if (handles_.size() != tokens_.size())
    throw std::invalid_argument("layer signals: " + std::to_string(handles_.size()) + " handles but " +
                                std::to_string(tokens_.size()) + " tokens (one of each per row)");
  if (handles_.empty() || top_k_ == 0 || layers_ == 0)
    throw std::invalid_argument("layer signals need rows, a top k and layers");
  if (ahead_.size() != layers_ * depth_)
    throw std::invalid_argument("layer signals: the lookahead table holds " + std::to_string(ahead_.size()) +
                                " layers, not layers x depth = " + std::to_string(layers_ * depth_));
}

void LayerSignals::ring() {
  if (unrung_) channel_.ring_doorbell();
  unrung_ = false;
}

void LayerSignals::write(size_t layer, const int64_t* ids, const std::vector<const int64_t*>& ahead_ids,
                         const std::vector<const float*>& ahead_scores, bool as_given, bool ring) {
  const auto done = [&] {
    if (ring) channel_.ring_doorbell();
    unrung_ = !ring;
  };
  const size_t K = top_k_;
  for (size_t r = 0; r < rows(); ++r) {
    experts_.assign(ids + r * K, ids + (r + 1) * K);
    std::sort(experts_.begin(), experts_.end());
    experts_.erase(std::unique(experts_.begin(), experts_.end()), experts_.end());
    count(channel_.signal_route(handles_[r], tokens_[r], uint32_t(layer), experts_));
  }
  if (depth_ == 0) {
    done();
    return;
  }
  ahead_experts_.resize(depth_);
  ahead_out_.resize(depth_);
  for (size_t r = 0; r < rows(); ++r) {
    layers_out_.clear();
    depths_out_.clear();
    size_t n = 0;
    for (size_t d = 1; d <= depth_; ++d) {
      const int64_t target = ahead(layer, d);
      if (target < 0 || d > ahead_ids.size() || ahead_ids[d - 1] == nullptr) continue;
      const int64_t* pid = ahead_ids[d - 1] + r * K;
      const float* psc = ahead_scores[d - 1] + r * K;
      pairs_.clear();
      if (as_given) {
        for (size_t k = 0; k < K; ++k) pairs_.emplace_back(std::min(1.0f, psc[k]), pid[k]);
      } else {
        float sum = 0.0f;
        for (size_t k = 0; k < K; ++k) sum += psc[k];
        sum = std::max(sum, 1e-20f);
        for (size_t k = 0; k < K; ++k) {
          const float p = psc[k] / sum;
          if (!(p > 0.0f)) continue;  // as predict_host: a weight of 0 (or NaN) names no expert
          const auto same = std::find_if(pairs_.begin(), pairs_.end(), [&](const auto& x) { return x.second == pid[k]; });
          if (same == pairs_.end())
            pairs_.emplace_back(p, pid[k]);
          else if (p > same->first)
            same->first = p;
        }
        std::sort(pairs_.begin(), pairs_.end(), [](const auto& a, const auto& b) {
          return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        for (auto& x : pairs_) x.first = std::min(1.0f, x.first);
      }
      if (pairs_.empty()) continue;  // an empty prediction is not sent
      auto& ex = ahead_experts_[n];
      auto& sc = ahead_out_[n];
      ex.clear();
      sc.clear();
      for (const auto& [p, e] : pairs_) {
        ex.push_back(e);
        sc.push_back(p);
      }
      layers_out_.push_back(uint32_t(target));
      depths_out_.push_back(uint32_t(d));
      ++n;
    }
    if (n == 0) continue;
    const std::vector<std::vector<int64_t>> ex(ahead_experts_.begin(), ahead_experts_.begin() + n);
    const std::vector<std::vector<float>> sc(ahead_out_.begin(), ahead_out_.begin() + n);
    count(channel_.signal_ahead(handles_[r], tokens_[r], layers_out_, depths_out_, ex, sc));
  }
  done();
}

}  // namespace expertcache
