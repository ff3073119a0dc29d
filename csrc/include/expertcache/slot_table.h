// Shared-memory slot table: per (layer, expert) entry state, slot, pin count, generation and
// last-access stamp, plus one pin ledger per attached compute client.
// One process (the cache daemon) creates the table file; others open it. All mutation is done
// with lock-free atomics on a MAP_SHARED mapping. Nobody polls: waiters block with futex on
//   - an entry's state word, for a load to finish (wait_resident; finish_load/abort_load wake);
//   - the header's unpin word, for shared pins to drop (wait_unpin: an unpin that takes an
//     entry's pin count to zero bumps the word and wakes the daemon when it waits for slots);
//   - a client ledger's busy word, for a client inside a pin call to leave it (reclaim_client).
// Failures are reported as exceptions: std::out_of_range (bad index), std::invalid_argument
// (bad file / bad argument), std::runtime_error (illegal state transition, system errors),
// StaleClient (this handle's client ledger was reclaimed by the daemon).
//
// File layout (version 4; version 3 had no client channels, version 2 no unpin word):
//   SlotTableHeader (128 B) | SlotEntry[num_entries] (64 B each) | client[num_clients]
//   client = LedgerHeader (64 B) + uint32 pins[num_entries], padded to a multiple of 64 B,
//            then the client's channel (channel.h: demand mailbox of max_demand experts and a
//            signal ring of ring_bytes).
//
// Pin ledgers (crash safety of pins held by compute processes). Protocol:
//   daemon, at Attach:   picks a free ledger index c, reads its epoch E (client_epoch(c)) and
//                        hands (c, E) to the client; the client binds its handle:
//                        attach_client(c, E). The client names (c, E) when it opens its Demand
//                        stream; the daemon ties the ledger to that stream.
//   client, pin:         busy := 1 (seq_cst); if epoch != E { busy := 0; throw StaleClient }
//                        ledger[e] += 1; pins[e] += 1; re-check state/generation (undo both,
//                        pins first, if the entry stopped being resident); busy := 0.
//   client, unpin:       busy := 1; if epoch != E { busy := 0; throw StaleClient };
//                        pins[e] -= 1; ledger[e] -= 1; busy := 0.
//   daemon, reclaim(c):  when the client's Demand stream ends (close, cancel, process death):
//                        epoch += 1 (seq_cst); wait while busy != 0 (bounded, kReclaimWaitS;
//                        futex on busy = 2, which the client's leave wakes);
//                        for every entry: n = ledger[e].exchange(0); pins[e] -= min(n, pins[e]).
//   Why it is safe: the client's "busy := 1; read epoch" and the daemon's "epoch += 1; read busy"
//   are both seq_cst, so at least one side sees the other: either the client sees the new epoch
//   and touches nothing, or the daemon sees busy and waits until the client's operation has
//   updated both counters. Afterwards every call with the old epoch throws StaleClient, so a
//   reclaimed ledger is never decremented twice. While outside a call the ledger holds exactly
//   this client's share of every pin count.
//   Known race: a client killed *inside* a call (between its ledger and shared-pin updates, a
//   window of a few instructions) leaves busy == 1 and the two counters one apart for one entry;
//   the daemon waits kReclaimWaitS, then reclaims anyway: the entry keeps one stray pin (pin
//   path: never evicted again until the daemon restarts) or loses one pin another client holds
//   (unpin path: the min() clamp prevents underflow, but that entry could be evicted under the
//   other client). Pins taken without a bound client (attach_client never called) are not
//   ledgered and are not reclaimed.

#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "expertcache/channel.h"

namespace expertcache {

enum class SlotState : uint32_t { kAbsent = 0, kLoading = 1, kResident = 2, kEvicting = 3 };

struct alignas(64) SlotEntry {
  std::atomic<uint32_t> state;
  std::atomic<int32_t> slot;
  std::atomic<uint32_t> pins;
  std::atomic<uint32_t> generation;
  // Header clock value taken by the last successful pin (0 = never pinned through the table).
  std::atomic<uint64_t> stamp;
};
static_assert(sizeof(SlotEntry) == 64, "SlotEntry must be one cache line");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "need lock-free 32-bit atomics");
static_assert(std::atomic<int32_t>::is_always_lock_free, "need lock-free 32-bit atomics");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need lock-free 64-bit atomics");

struct alignas(64) SlotTableHeader {
  // Offsets of magic and version are the same in every version, so open() can name the version
  // of any table file.
  uint64_t magic;
  uint32_t version;
  uint32_t num_entries;
  uint32_t num_slots;
  uint32_t num_clients;
  uint64_t ledger_stride;  // bytes per client: ledger and channel
  uint32_t max_demand;     // experts one demand on a channel may name
  uint32_t ring_bytes;     // each channel's signal ring
  // 1 while the daemon uses compute's routing and lookahead signals (its policy reads them or
  // prefetch is on); compute writes those records only then. Request begin/end always go.
  std::atomic<uint32_t> signals_wanted;
  // Second cache line: written by every pin of every client.
  alignas(64) std::atomic<uint64_t> clock;  // last access stamp handed out
  std::atomic<uint64_t> hits;               // successful pins through the table
  // Bumped whenever an unpin (or a reclaim) takes an entry's pins to zero; futex word.
  std::atomic<uint32_t> unpin_seq;
  // Threads blocked in wait_unpin: an unpin makes the wake syscall only when there are some.
  std::atomic<uint32_t> unpin_waiters;
};
static_assert(sizeof(SlotTableHeader) == 128, "header must be two cache lines");

struct alignas(64) LedgerHeader {
  std::atomic<uint32_t> epoch;  // bumped by every reclaim
  // 1 while the client is inside a pin/unpin call; 2 when, in addition, a reclaim waits for it
  // to leave (futex word: the client's leave wakes the reclaim).
  std::atomic<uint32_t> busy;
};
static_assert(sizeof(LedgerHeader) == 64, "ledger header must be one cache line");

constexpr uint64_t kSlotTableMagic = 0x4C42545453435845ULL;  // "EXCSTTBL" little-endian
constexpr uint32_t kSlotTableVersion = 4;
constexpr uint32_t kDefaultClients = 32;
constexpr double kReclaimWaitS = 1.0;  // how long reclaim waits for a client inside a call

// The client's ledger was reclaimed (its Demand stream ended): it must re-Attach.
class StaleClient : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class SlotTable {
 public:
  // Creates (atomically replacing) the table file at `path`; all entries ABSENT, slot -1,
  // `num_clients` empty ledgers at epoch 0.
  // Each client's channel takes demands of up to `max_demand` experts (0: min(num_entries,
  // 4096)) and has a signal ring of `ring_bytes` (a multiple of 64, at least 4096).
  static std::unique_ptr<SlotTable> create(const std::string& path, uint32_t num_entries,
                                           uint32_t num_slots,
                                           uint32_t num_clients = kDefaultClients,
                                           uint32_t max_demand = 0,
                                           uint32_t ring_bytes = kDefaultRingBytes);
  // Opens an existing table, validating magic, version and file size.
  static std::unique_ptr<SlotTable> open(const std::string& path);

  ~SlotTable();
  SlotTable(const SlotTable&) = delete;
  SlotTable& operator=(const SlotTable&) = delete;

  // -- compute side ---------------------------------------------------------------------------
  // Binds this handle to ledger `client` at `epoch` (both from Attach): from now on every pin
  // and unpin of this handle is ledgered. Throws StaleClient if the ledger's epoch differs.
  void attach_client(int64_t client, uint32_t epoch);
  int64_t bound_client() const { return client_; }

  // Pins a RESIDENT entry and returns its slot; nullopt if it is not (or stops being) resident.
  // A successful pin takes a new stamp from the header clock and counts one hit.
  std::optional<int32_t> try_pin(int64_t entry);
  // try_pin for each entry (one ledger check for the batch): slot or -1 per entry. All indexes
  // are checked before anything is pinned.
  std::vector<int32_t> try_pin_many(const std::vector<int64_t>& entries);
  // Drops one pin; throws if the entry has no pins (or, with a bound client, none of its own).
  // A pin count that reaches zero bumps the unpin word and wakes wait_unpin.
  void unpin(int64_t entry);
  // unpin for each entry; all are checked (index, own pin) before anything is unpinned.
  void unpin_many(const std::vector<int64_t>& entries);

  // -- daemon side ----------------------------------------------------------------------------
  // ABSENT -> LOADING, recording the destination slot; throws if the entry is not ABSENT.
  void begin_load(int64_t entry, int64_t slot);
  // LOADING -> RESIDENT, bumps the generation and wakes all waiters; throws if not LOADING.
  void finish_load(int64_t entry);
  // LOADING -> ABSENT (a failed load); wakes all waiters, who then see "not resident".
  void abort_load(int64_t entry);
  // RESIDENT -> EVICTING -> ABSENT if unpinned; false (and no change) otherwise.
  bool try_evict(int64_t entry);
  // Adds `n` pins to a LOADING or RESIDENT entry for the daemon's own sessions (not ledgered,
  // no access stamp): the shared count then holds every pin, the daemon's and compute's, so
  // try_evict checks one number. Dropped with unpin/unpin_many on the daemon's handle. Throws if
  // the entry is ABSENT or EVICTING.
  void hold(int64_t entry, uint32_t n);
  // Blocks while the entry is LOADING; true iff it is RESIDENT on return. timeout_s >= 0.
  bool wait_resident(int64_t entry, double timeout_s);
  // Current epoch of ledger `client`.
  uint32_t client_epoch(int64_t client) const;
  // Pins ledger `client` holds on `entry`.
  uint32_t client_pins(int64_t client, int64_t entry) const;
  // Ends ledger `client`'s epoch and subtracts its pins from the shared counts (see the
  // protocol above); returns the number of pins removed. May wait up to kReclaimWaitS.
  uint64_t reclaim_client(int64_t client);
  // Entries whose stamp is > `since`, in increasing stamp order (the recency of table pins).
  std::vector<int64_t> accessed_since(uint64_t since) const;
  // The unpin word: changes whenever some entry's pin count drops to zero.
  uint32_t unpin_seq() const { return header_->unpin_seq.load(); }
  // Blocks while the unpin word still equals `seen` (read it, check what you wait for, then call
  // this: an unpin in between makes it return at once). True when it changed, false after
  // timeout_s (< 0: no limit).
  bool wait_unpin(uint32_t seen, double timeout_s);
  // Bumps the unpin word and wakes every wait_unpin (the daemon's own shutdown).
  void wake_unpin_waiters();
  // Every entry's state and slot, in entry order (one call instead of one per entry).
  std::vector<uint32_t> states() const;
  std::vector<int32_t> slots() const;

  // -- client channels (channel.h) -------------------------------------------------------------
  // The channel of ledger `client` (a view into this mapping: it must not outlive the table).
  ClientChannel channel(int64_t client);
  // Daemon: empties `client`'s channel before handing the ledger out (at Attach).
  void claim_channel(int64_t client);
  // Daemon: adds a pin on a LOADING or RESIDENT `entry` to `client`'s ledger and to the shared
  // count, if the ledger is still at `epoch` (false: it was reclaimed, nothing pinned).
  bool hold_for_client(int64_t client, uint32_t epoch, int64_t entry);
  // Daemon: takes such a pin back (a load that failed), if the ledger is still at `epoch` and
  // holds one on `entry` (false otherwise). A pin count that reaches zero wakes wait_unpin.
  bool unhold_for_client(int64_t client, uint32_t epoch, int64_t entry);
  bool signals_wanted() const { return header_->signals_wanted.load(std::memory_order_relaxed) != 0; }
  void set_signals_wanted(bool wanted) { header_->signals_wanted.store(wanted ? 1 : 0); }
  uint32_t max_demand() const { return header_->max_demand; }
  uint32_t ring_bytes() const { return header_->ring_bytes; }
  // Per entry: its slot if RESIDENT, -1 while LOADING, -2 otherwise (ABSENT / EVICTING).
  std::vector<int32_t> resident_slots(const std::vector<int64_t>& entries) const;

  // -- introspection --------------------------------------------------------------------------
  SlotState state(int64_t entry) const;
  uint32_t pins(int64_t entry) const;
  int32_t slot(int64_t entry) const;
  uint32_t generation(int64_t entry) const;
  uint64_t stamp(int64_t entry) const;
  std::vector<uint64_t> access_stamps(const std::vector<int64_t>& entries) const;
  uint64_t clock() const { return header_->clock.load(); }
  uint64_t hits() const { return header_->hits.load(); }

  uint32_t num_entries() const { return header_->num_entries; }
  uint32_t num_slots() const { return header_->num_slots; }
  uint32_t num_clients() const { return header_->num_clients; }
  const std::string& path() const { return path_; }

  static size_t ledger_bytes(uint32_t num_entries);
  static size_t ledger_stride(uint32_t num_entries, uint32_t max_demand, uint32_t ring_bytes);
  static size_t file_size(uint32_t num_entries, uint32_t num_clients = kDefaultClients,
                          uint32_t max_demand = 0, uint32_t ring_bytes = kDefaultRingBytes);
  static uint32_t default_max_demand(uint32_t num_entries);

 private:
  SlotTable(std::string path, void* base, size_t size);
  SlotEntry& at(int64_t entry) const;
  void check_entry(int64_t entry) const;
  LedgerHeader& ledger(int64_t client) const;
  std::atomic<uint32_t>* ledger_pins(int64_t client) const;
  // Pins one checked entry (ledger `lp` may be null); slot or -1.
  int32_t pin_one(int64_t entry, std::atomic<uint32_t>* lp);
  // Marks this handle's ledger busy and checks its epoch; returns the ledger's pin array, or
  // null when no client is bound.
  std::atomic<uint32_t>* enter_ledger();
  void leave_ledger();
  // The unpin word moved on: bump it and wake waiters, if any.
  void notify_unpinned();

  std::string path_;
  void* base_;
  size_t size_;
  SlotTableHeader* header_;
  SlotEntry* entries_;
  char* ledgers_;
  int64_t client_ = -1;  // bound ledger (handle-local), -1 = none
  uint32_t epoch_ = 0;
  // Daemon side: serialises hold_for_client / unhold_for_client with reclaim_client per ledger.
  std::unique_ptr<std::mutex[]> client_locks_;
};

const char* slot_state_name(SlotState s);

}  // namespace expertcache
