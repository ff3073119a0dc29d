// A native span's demands (ExpertFfn.run_layers with `demand`): where a layer has an expert that
// is not resident, the span pins the resident ones, posts the demand for the others on compute's
// channel itself and waits for them as DaemonClient's acquire would, without returning to Python.
// Where the wait does not end well (an error reply, a failed load, an expert dropped, the time
// limit, an interrupt or the stream's end: `stop`), the layer is handed back: its pins and the
// posted demand stay, and Python adopts them (DaemonClient.acquire_batches), whose wait maps each
// of those ends to its error. One object per span call; its results are read after the call.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

#include "expertcache/channel.h"

struct SpanDemand {
  using clock = std::chrono::steady_clock;

  SpanDemand(expertcache::ClientChannel& channel, double timeout_s, double deadline_s, double spin_s,
             double reply_grace_s, double landing_grace_s, bool gather)
      : channel(channel),
        timeout_s(timeout_s),
        spin_s(spin_s),
        reply_grace_s(reply_grace_s),
        landing_grace_s(landing_grace_s),
        gather(gather),
        step_deadline(deadline_s >= 1e9 ? clock::time_point::max()
                                        : clock::now() + std::chrono::duration_cast<clock::duration>(
                                                             std::chrono::duration<double>(deadline_s))) {}

  // Another thread (an interrupt, the stream's end): a wait in progress returns and hands its
  // layer back; no later layer posts a demand.
  void stop() {
    stopped.store(true, std::memory_order_release);
    channel.notify();
  }
  bool is_stopped() const { return stopped.load(std::memory_order_acquire); }

  // The limit of the wait of a demand posted at `posted_at`: its timeout, or the step's deadline.
  clock::time_point until(clock::time_point posted_at) const {
    if (timeout_s >= 1e9) return step_deadline;
    const auto limit = posted_at + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
    return std::min(limit, step_deadline);
  }

  expertcache::ClientChannel& channel;
  const double timeout_s, spin_s, reply_grace_s, landing_grace_s;
  const bool gather;  // misses are run together once all landed (small experts)
  const clock::time_point step_deadline;
  std::atomic<bool> stopped{false};

  // -- results ------------------------------------------------------------------------------------
  std::vector<uint8_t> sources;  // per expert demanded and run here, its source (channel codes)
  std::vector<double> waits;     // per layer demanded and run here, the seconds it waited for them

  // -- the layer handed back (pending: its demand posted and its hits pinned, not run) -------------
  bool pending = false;
  uint32_t layer = 0, seq = 0, fail_seen = 0;
  std::vector<int64_t> hit_experts, hit_slots, misses;
  double elapsed_s = 0;  // seconds it had waited when handed back
};
