// The client channel: how a compute process asks the cache daemon for experts and tells it what
// its layers routed to, through shared memory instead of gRPC messages.
//
// Each client ledger of the slot table (slot_table.h) is followed by one channel, used by the
// client that holds the ledger and by the daemon thread that serves it:
//
//   demand mailbox   compute posts one demand at a time (it runs one MoE layer at a time):
//                    layer + up to max_demand experts (+ the W3C trace context of a traced
//                    demand), then bumps demand_seq and rings the
//                    doorbell. The daemon's thread for that client admits it (all or nothing),
//                    pins every expert *into the client's ledger* (SlotTable::hold_for_client:
//                    LOADING or RESIDENT), and answers with reply_seq = demand_seq and a status
//                    (0 = admitted; else an error code and a message). Compute then pins nothing
//                    itself: it waits until each entry is RESIDENT (the table's state) and later
//                    unpins them with unpin_many, like its own hits. A load that fails is
//                    unpinned by the daemon, its entry goes back to ABSENT and its message is
//                    left in the channel (fail_message).
//   signal ring      one-way records (request begin / end, a layer's routing, a lookahead),
//                    single producer (compute) single consumer (the daemon), 8-byte aligned
//                    variable-length records; a record that does not fit is dropped and counted.
//   notify word      the futex compute sleeps on: the daemon bumps it when it answers a demand
//                    or a load of an entry the client waits for lands or fails; compute's own
//                    interrupt (another thread) and a broken Demand stream bump it too.
//   doorbell word    the futex the daemon's thread sleeps on: compute bumps it after posting.
//
// A killed compute leaks no pin: every pin the daemon hands over is in the client's ledger,
// which the daemon reclaims when the client's Demand stream ends (slot_table.h). The daemon resets
// the channel when it hands the ledger to a client (SlotTable::claim_channel, at Attach), before the
// client can write to it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace expertcache {

constexpr uint32_t kChannelMessageBytes = 256;
constexpr uint32_t kChannelTraceBytes = 256;  // a demand's W3C trace context (expertcache/protocol.py)
constexpr uint32_t kDefaultRingBytes = 128 * 1024;
constexpr uint32_t kMaxRequestIdBytes = 1024;

// Signal record types (the first 16 bits after the length).
enum class SignalType : uint16_t { kPad = 0, kBegin = 1, kEnd = 2, kRoute = 3, kAhead = 4 };

struct alignas(64) ChannelHeader {
  // -- written by compute --------------------------------------------------------------------
  std::atomic<uint32_t> demand_seq;  // bumped (release) after the demand fields are written
  uint32_t demand_layer;
  uint32_t demand_count;
  std::atomic<uint32_t> doorbell;        // bumped after every post; the daemon's futex
  std::atomic<uint32_t> daemon_sleeping;  // the daemon's thread is (about to be) asleep on it
  uint32_t pad0;
  std::atomic<uint64_t> ring_head;  // bytes written so far (never wraps: 64 bits)
  std::atomic<uint64_t> ring_dropped;  // records that did not fit
  // -- written by the daemon ---------------------------------------------------------------------
  alignas(64) std::atomic<uint32_t> reply_seq;  // = demand_seq once answered (release)
  int32_t reply_status;                         // 0 admitted, else an error code (the daemon's)
  std::atomic<uint32_t> notify;                 // compute's futex
  std::atomic<uint32_t> compute_sleeping;
  std::atomic<uint64_t> ring_tail;  // bytes consumed so far
  std::atomic<uint32_t> fail_seq;   // bumped when fail_message is written (a failed load)
  int32_t fail_status;
  std::atomic<uint32_t> copying;    // nonzero while the daemon's thread copies experts for this client
  alignas(64) char reply_message[kChannelMessageBytes];
  char fail_message[kChannelMessageBytes];
  // -- written by compute with each demand, before demand_seq --------------------------------
  alignas(64) uint32_t demand_trace_len;  // 0: not traced
  char demand_trace[kChannelTraceBytes];
};

// One decoded signal record (daemon side).
struct SignalRecord {
  SignalType type;
  uint32_t handle;
  uint32_t token = 0;
  std::string request_id;  // kBegin
  // kRoute: one entry; kAhead: one per depth.
  std::vector<uint32_t> layers;
  std::vector<uint32_t> depths;
  std::vector<std::vector<uint16_t>> experts;
  std::vector<std::vector<float>> scores;
};

// A view of one client's channel inside a mapped slot table (not owning; the table outlives it).
class ClientChannel {
 public:
  ClientChannel(ChannelHeader* header, uint32_t* experts, uint8_t* sources, uint8_t* ring,
                uint32_t max_demand, uint32_t ring_bytes, std::string where,
                std::shared_ptr<void> keep = nullptr);

  static size_t region_bytes(uint32_t max_demand, uint32_t ring_bytes);
  static void layout(char* base, uint32_t max_demand, uint32_t ring_bytes, ChannelHeader** header,
                     uint32_t** experts, uint8_t** sources, uint8_t** ring);

  uint32_t max_demand() const { return max_demand_; }
  uint32_t ring_bytes() const { return ring_bytes_; }

  // -- compute side ---------------------------------------------------------------------------
  // Writes a demand for `experts` of `layer`, with its trace context (empty: not traced), and
  // returns its sequence number (the daemon answers with the same one). Throws
  // std::invalid_argument when more than max_demand experts or kChannelTraceBytes of trace.
  uint32_t post_demand(uint32_t layer, const std::vector<int64_t>& experts, const std::string& trace = {});
  // Signal records; false when the ring is full (the record is dropped and counted).
  bool signal_begin(uint32_t handle, const std::string& request_id);
  bool signal_end(uint32_t handle);
  bool signal_route(uint32_t handle, uint32_t token, uint32_t layer, const std::vector<int64_t>& experts);
  // One prediction per depth: layers[i], depths[i], experts[i], scores[i].
  bool signal_ahead(uint32_t handle, uint32_t token, const std::vector<uint32_t>& layers,
                    const std::vector<uint32_t>& depths,
                    const std::vector<std::vector<int64_t>>& experts,
                    const std::vector<std::vector<float>>& scores);
  // Wakes the daemon's thread if it sleeps (one syscall then, none otherwise).
  void ring_doorbell();
  uint32_t reply_seq() const { return header_->reply_seq.load(std::memory_order_acquire); }
  int32_t reply_status() const { return header_->reply_status; }
  std::string reply_message() const;
  uint32_t fail_seq() const { return header_->fail_seq.load(std::memory_order_acquire); }
  int32_t fail_status() const { return header_->fail_status; }
  std::string fail_message() const;
  uint32_t notify_seq() const { return header_->notify.load(); }
  // Sleeps while the notify word equals `seen` (at most timeout_s; < 0: no limit). Polls it first
  // without sleeping for grace_s, and for up to spin_s (at most 1 ms) while the daemon's thread
  // copies for this client (`copying`): those copies land in microseconds, a store read in
  // milliseconds, which polling would only take from the CPUs. True when it changed.
  bool wait_notify(uint32_t seen, double timeout_s, double spin_s = 0.0, double grace_s = 0.0);
  // Waits until demand `seq` is answered (true) or timeout_s passes (false), waking also on any
  // notify after `seen` (read notify_seq() *before* checking for an interrupt or the stream's
  // end, so that one arriving after the check is not slept through: the caller checks again).
  // Polls without sleeping for `grace_s`, and for up to spin_s (at most 1 ms) while the daemon's
  // thread copies for this client (`copying`, as wait_notify): an admission that reads the store
  // or applies the layer's signals takes far longer than a poll is worth on a node whose CPUs the
  // daemon's threads share. Then sleeps on the notify word.
  bool wait_reply(uint32_t seq, uint32_t seen, double timeout_s, double spin_s, double grace_s);
  // The source tier the daemon recorded for demand position `i` (0 until it knows).
  uint8_t source(uint32_t i) const;
  bool copying() const { return header_->copying.load(std::memory_order_acquire) != 0; }
  uint64_t ring_dropped() const { return header_->ring_dropped.load(); }

  // -- both sides -----------------------------------------------------------------------------
  // Bumps the notify word and wakes compute if it sleeps (the daemon's answers and load
  // completions; compute's own interrupt and stream end).
  void notify();

  // -- daemon side ----------------------------------------------------------------------------
  // Zeroes the channel (no demand, empty ring): only while no client uses it.
  void reset();
  uint32_t doorbell_seq() const { return header_->doorbell.load(); }
  // Sleeps while the doorbell equals `seen` (timeout_s < 0: no limit); true when it changed.
  bool wait_doorbell(uint32_t seen, double timeout_s);
  // The posted demand newer than `taken`, if any: (seq, layer, experts, trace). Taking one sets
  // `copying` to `copying` at once (the answer is microseconds away: compute, waiting for it,
  // keeps polling rather than sleep), with no gap between the take and the flag.
  bool take_demand(uint32_t taken, uint32_t* seq, uint32_t* layer, std::vector<uint32_t>* experts,
                   std::string* trace, bool copying = false);
  // Answers demand `seq` (status 0: admitted) and notifies compute.
  void reply(uint32_t seq, int32_t status, const std::string& message);
  // Records that a load compute waits for failed (message kept for compute), and notifies.
  void fail(int32_t status, const std::string& message);
  void set_source(uint32_t i, uint8_t tier);
  // Raised while this thread copies experts the client waits for (the client polls then).
  void set_copying(bool on) { header_->copying.store(on ? 1 : 0, std::memory_order_release); }
  // Every complete record since the last drain, in order. A malformed record (a length that
  // does not fit the ring, an unknown type, counts beyond the record) ends the drain: the rest
  // of the ring is skipped and `*corrupt` is set.
  std::vector<SignalRecord> drain(bool* corrupt);

 private:
  bool write_record(SignalType type, const std::vector<uint8_t>& payload);

  ChannelHeader* header_;
  uint32_t* experts_;
  uint8_t* sources_;
  uint8_t* ring_;
  uint32_t max_demand_;
  uint32_t ring_bytes_;
  std::string where_;
  std::shared_ptr<void> keep_;  // the mapping this view points into
};

}  // namespace expertcache
