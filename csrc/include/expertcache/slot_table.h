// Shared-memory slot table: per (layer, expert) entry state, slot and generation, written by the
// cache daemon alone, plus one private region per attached compute client (its pins, access stamps
// and channel), which only that client and the daemon map.
//
// Memory (version 6; every part is a memfd, never a path another process could open):
//   table    SlotTableHeader (128 B) | SlotEntry[num_entries] (16 B each). The daemon maps it
//            read-write; it is then sealed (F_SEAL_FUTURE_WRITE, SHRINK, GROW, SEAL), so compute
//            can only map it read-only.
//   region   one per client ledger, made anew at every claim (claim_channel): ClientHeader (128 B)
//            | uint32 pins[num_entries] | uint64 stamps[num_entries] | channel (channel.h), each
//            part padded to 64 B; sealed against SHRINK and GROW (a client cannot truncate it
//            under the daemon). Only the client it is handed to (over the handoff socket) maps it.
//
// Trust. The daemon never reads back what it owns: every size, and each entry's state, slot,
// generation and daemon pins ("holds"), live in private memory; the table's copies are published
// for compute. What it reads from a region (pins, stamps, hits, the channel) is client input: a
// region's bytes are used only within bounds the daemon keeps privately, its pins only ever keep
// an entry resident (never choose a slot or a state), and `audit_client` finds pins on entries
// that are not LOADING or RESIDENT (no real pin survives there; see below). A region is detached
// when its client is reclaimed: what the old client writes there afterwards is never read again.
//
// Waiting, with futexes: compute on an entry's state word (wait_resident) and on its channel's
// notify word; the daemon on a channel's doorbell and, for unpins, on the table's unpin word
// (compute makes FUTEX_WAKE on its read-only mapping of it when the daemon announces waiters).
//
// Pin protocol (compute):
//   pin:    if epoch != E: throw StaleClient; pins[e] += 1 (seq_cst); re-check that the entry
//           is RESIDENT at the generation seen before (else pins[e] -= 1: not pinned);
//           stamps[e] := now.
//   unpin:  epoch check; pins[e] -= 1; a count that reaches 0 bumps the region's unpin_seq
//           and, when the daemon waits for unpins, wakes it.
// Evict (daemon, try_evict): unless the entry is RESIDENT without holds, no; publish EVICTING
//   (seq_cst), then read pins[e] of every attached region: any non-zero → back to RESIDENT, no.
//   The pinner's "pins += 1; read state" and the evictor's "state := EVICTING; read pins" are
//   both seq_cst: one of them sees the other.
// Reclaim (daemon, when the client's Demand stream ends): the private epoch += 1 and the
//   region's epoch := kDetachedEpoch (never handed out); count the region's pins and detach it.
//   Every claim (a new region) takes a new epoch too. Nothing waits for the client: the pins
//   of a detached region count nowhere, so there is no shared count to keep exact. The
//   client's later calls throw StaleClient (its epoch moved on); a client that ignores that
//   writes only into a region nobody reads.
// Audit (daemon, when admission lacks slots): a pin on an entry that is neither LOADING nor
//   RESIDENT exists only inside a pin call (a few instructions); seen on the same entry twice,
//   far apart in time, it is a client writing its pins at will, and the daemon ends its session.

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

enum class TableState : uint32_t { kAbsent = 0, kLoading = 1, kResident = 2, kEvicting = 3 };

// One entry of the table, as published for compute (the daemon's own copy is private).
struct alignas(16) SlotEntry {
  std::atomic<uint32_t> state;
  std::atomic<int32_t> slot;
  std::atomic<uint32_t> generation;
  uint32_t pad;
};
static_assert(sizeof(SlotEntry) == 16, "SlotEntry must be 16 bytes");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "need lock-free 32-bit atomics");
static_assert(std::atomic<int32_t>::is_always_lock_free, "need lock-free 32-bit atomics");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need lock-free 64-bit atomics");

struct alignas(64) SlotTableHeader {
  // Offsets of magic and version are the same in every version, so a reader can name the version.
  uint64_t magic;
  uint32_t version;
  uint32_t num_entries;
  uint32_t num_slots;
  uint32_t num_clients;
  uint32_t max_demand;  // experts one demand on a channel may name
  uint32_t ring_bytes;  // each channel's signal ring
  // 1 while the daemon uses compute's routing and lookahead signals (its policy reads them or
  // prefetch is on); compute writes those records only then. Request begin/end always go.
  std::atomic<uint32_t> signals_wanted;
  // Second cache line: the daemon's wait for unpins.
  alignas(64) std::atomic<uint32_t> unpin_word;     // futex word the daemon sleeps on
  std::atomic<uint32_t> unpin_waiters;              // non-zero while it does: unpins wake it
};
static_assert(sizeof(SlotTableHeader) == 128, "header must be two cache lines");

struct alignas(64) ClientHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t num_entries;
  std::atomic<uint32_t> epoch;  // the client's epoch (a copy: the daemon's is private)
  uint32_t reserved;
  alignas(64) std::atomic<uint64_t> hits;     // successful pins of this client
  std::atomic<uint32_t> unpin_seq;            // bumped when one of its pin counts reaches 0
  // Experts in flight (LOADING) when this client's layer came, which it waited for and pinned
  // itself, without a demand: misses the daemon's admissions never saw.
  std::atomic<uint64_t> waited;
};
static_assert(sizeof(ClientHeader) == 128, "client header must be two cache lines");

constexpr uint64_t kSlotTableMagic = 0x4C42545453435845ULL;   // "EXCSTTBL" little-endian
constexpr uint64_t kClientRegionMagic = 0x4E47524343435845ULL;  // "EXCCRGN" little-endian
constexpr uint32_t kSlotTableVersion = 6;
constexpr uint32_t kDefaultClients = 32;
constexpr uint32_t kMaxClients = 4096;
// The epoch a detached region is left at: no ledger is ever handed out at it.
constexpr uint32_t kDetachedEpoch = 0xFFFFFFFFu;
// The longest wait_unpin sleeps before the caller checks again (a client's wake can be lost).
constexpr double kUnpinPollS = 0.005;

// The client's ledger was reclaimed (its Demand stream ended): it must re-Attach.
class StaleClient : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A mapped memfd (the table or a client region); unmapped and closed with its last owner.
struct SharedRegion {
  int fd = -1;
  void* base = nullptr;
  size_t size = 0;
  SharedRegion() = default;
  SharedRegion(const SharedRegion&) = delete;
  SharedRegion& operator=(const SharedRegion&) = delete;
  ~SharedRegion();
};

// What an audit of one client region found (see the protocol above).
struct ClientAudit {
  uint64_t pinned_entries = 0;      // entries the region pins
  std::vector<int64_t> stray;       // pinned entries that are neither LOADING nor RESIDENT
};

class SlotTable {
 public:
  // -- daemon side: the owner --------------------------------------------------------------------
  // Makes the table (all entries ABSENT, slot -1) for `num_clients` client ledgers, each with a
  // channel taking demands of up to `max_demand` experts (0: min(num_entries, 4096)) and a signal
  // ring of `ring_bytes` (a multiple of 64 in [4096, 64 MiB]). `name` names the memfds (for
  // /proc and error messages).
  static std::unique_ptr<SlotTable> create(const std::string& name, uint32_t num_entries,
                                           uint32_t num_slots,
                                           uint32_t num_clients = kDefaultClients,
                                           uint32_t max_demand = 0,
                                           uint32_t ring_bytes = kDefaultRingBytes);
  // -- compute side ------------------------------------------------------------------------------
  // Maps the table read-only from `table_fd` and this client's region read-write from
  // `region_fd` (both received from the daemon; the caller keeps ownership of the fds), checks
  // both, and binds the handle to ledger `client` at `epoch`. StaleClient if the region is at
  // another epoch; std::invalid_argument for a table or region that is not what it should be.
  static std::unique_ptr<SlotTable> attach(int table_fd, int region_fd, int64_t client,
                                           uint32_t epoch);

  ~SlotTable();
  SlotTable(const SlotTable&) = delete;
  SlotTable& operator=(const SlotTable&) = delete;

  bool is_owner() const { return owner_; }
  int64_t bound_client() const { return client_; }

  // -- compute side ------------------------------------------------------------------------------
  // Pins a RESIDENT entry and returns its slot; nullopt if it is not (or stops being) resident.
  std::optional<int32_t> try_pin(int64_t entry);
  // try_pin for each entry (one ledger check for the batch): slot or -1 per entry. All indexes
  // are checked before anything is pinned. Each pin counts as a hit (`hits`), unless `count` is
  // false: an all-or-none pin counts its hits (count_hits) only once it has them all.
  std::vector<int32_t> try_pin_many(const std::vector<int64_t>& entries, bool count = true);
  // Drops one pin; on the owner's handle, one of the daemon's holds. Throws if there is none.
  void unpin(int64_t entry);
  // unpin for each entry; all are checked (index, own pin) before anything is unpinned.
  void unpin_many(const std::vector<int64_t>& entries);
  // Counts `n` hits of this client (compute side): pins try_pin_many took uncounted.
  void count_hits(uint64_t n);
  // Counts `n` experts this client waited for in flight and pinned itself (compute side; misses).
  void count_waited(uint64_t n);
  // Blocks while the entry is LOADING; true iff it is RESIDENT on return. timeout_s >= 0.
  bool wait_resident(int64_t entry, double timeout_s);
  // Per entry: its slot if RESIDENT, -1 while LOADING, -2 otherwise (ABSENT / EVICTING).
  std::vector<int32_t> resident_slots(const std::vector<int64_t>& entries) const;
  // This client's channel (compute: `client` must be its own ledger), or the daemon's view of
  // ledger `client`'s channel in its current region. The view keeps its region mapped.
  ClientChannel channel(int64_t client);

  // -- daemon side ---------------------------------------------------------------------------------
  // ABSENT -> LOADING, recording the destination slot; throws if the entry is not ABSENT.
  void begin_load(int64_t entry, int64_t slot);
  // LOADING -> RESIDENT, bumps the generation and wakes all waiters; throws if not LOADING.
  void finish_load(int64_t entry);
  // LOADING -> ABSENT (a failed load); wakes all waiters, who then see "not resident".
  void abort_load(int64_t entry);
  // RESIDENT -> EVICTING -> ABSENT if nobody pins it; false (and no change) otherwise.
  bool try_evict(int64_t entry);
  // Adds `n` holds (the daemon's own sessions' pins) to a LOADING or RESIDENT entry; dropped
  // with unpin/unpin_many on this handle. Throws if the entry is ABSENT or EVICTING.
  void hold(int64_t entry, uint32_t n);
  // A new, empty region for ledger `client` at a new epoch (the old region, if any, is detached
  // and its holder's calls throw StaleClient): at Attach, before the client can write to it.
  // Returns the new epoch.
  uint32_t claim_channel(int64_t client);
  // The memfds to hand to a client: the sealed table and ledger `client`'s current region
  // (new descriptors; the caller closes them).
  int table_fd() const;
  int client_fd(int64_t client) const;
  // Adds a pin on a LOADING or RESIDENT `entry` to `client`'s region, if the ledger is still at
  // `epoch` (false: it was reclaimed, nothing pinned).
  bool hold_for_client(int64_t client, uint32_t epoch, int64_t entry);
  // Takes such a pin back (a load that failed), if the ledger is still at `epoch` and its region
  // pins `entry` (false otherwise).
  bool unhold_for_client(int64_t client, uint32_t epoch, int64_t entry);
  // Current epoch of ledger `client` (the daemon's own record).
  uint32_t client_epoch(int64_t client) const;
  // Pins ledger `client`'s region holds on `entry` (0 without a region).
  uint32_t client_pins(int64_t client, int64_t entry) const;
  // Ends ledger `client`'s epoch and detaches its region (never waits for the client);
  // returns the pins it held. Wakes the channel's both sides.
  uint64_t reclaim_client(int64_t client);
  // Pins of ledger `client`'s region on entries that are not LOADING or RESIDENT.
  ClientAudit audit_client(int64_t client) const;
  // Entries pinned through the regions with a stamp in (since, until], in stamp order, and
  // `until` (now). Stamps from the future are ignored. A pin that read the clock before the scan
  // and writes its stamp after it is not seen (a window of a few instructions): recency is a
  // hint, and that access counts at the entry's next hit.
  std::pair<std::vector<int64_t>, uint64_t> accessed_since(uint64_t since) const;
  // The unpin word: read it, check what you wait for, then wait_unpin(seen). An unpin by the
  // daemon changes it; a client's unpin wakes the wait. wait_unpin returns true when woken or the
  // word changed, false after min(timeout_s, kUnpinPollS): a client's wake can come just before
  // the wait starts, so the caller checks again either way.
  uint32_t unpin_seq() const;
  bool wait_unpin(uint32_t seen, double timeout_s);
  // Bumps the unpin word and wakes every wait_unpin (the daemon's own shutdown).
  void wake_unpin_waiters();
  // Every entry's state and slot, in entry order (the daemon's own record).
  std::vector<uint32_t> states() const;
  std::vector<int32_t> slots() const;
  bool signals_wanted() const { return header_->signals_wanted.load(std::memory_order_relaxed) != 0; }
  void set_signals_wanted(bool wanted);
  uint32_t max_demand() const { return max_demand_; }
  uint32_t ring_bytes() const { return ring_bytes_; }

  // -- introspection ---------------------------------------------------------------------------------
  TableState state(int64_t entry) const;
  // Every pin on `entry`: the daemon's holds and every attached region's (daemon side); this
  // client's own (compute side).
  uint32_t pins(int64_t entry) const;
  int32_t slot(int64_t entry) const;
  uint32_t generation(int64_t entry) const;
  // Successful pins: of this client (compute side), of every client so far (daemon side).
  uint64_t hits() const;
  // count_waited's counts, as hits() sums hits.
  uint64_t waited() const;

  uint32_t num_entries() const { return num_entries_; }
  uint32_t num_slots() const { return num_slots_; }
  uint32_t num_clients() const { return num_clients_; }
  const std::string& name() const { return name_; }

  static size_t table_bytes(uint32_t num_entries);
  static size_t region_bytes(uint32_t num_entries, uint32_t max_demand, uint32_t ring_bytes);
  static uint32_t default_max_demand(uint32_t num_entries);

 private:
  // A ledger counter (ClientHeader::hits or ::waited): this client's (compute side), or every
  // region's plus `retired`, the detached ones' (daemon side).
  uint64_t ledger_count(std::atomic<uint64_t> ClientHeader::*count, const std::atomic<uint64_t>& retired) const;
  // A region leaves (reclaimed or claimed over): its counts go to the retired ones.
  void retire_counts(const ClientHeader& h);
  struct Region;  // a client region mapped by the daemon, with its parts
  SlotTable() = default;
  void check_entry(int64_t entry) const;
  void check_client(int64_t client) const;
  void require_owner(const char* what) const;
  void publish(int64_t entry, uint32_t state, int32_t slot);
  // Checks this handle's epoch (compute side): StaleClient once reclaimed.
  void enter_ledger();
  void notify_unpinned();  // the daemon's own unpin (a hold dropped, a reclaim)
  std::shared_ptr<Region> region_of(int64_t client) const;

  std::string name_;
  bool owner_ = false;
  // Sizes: private, checked once (compute: validated at attach; daemon: its own).
  uint32_t num_entries_ = 0, num_slots_ = 0, num_clients_ = 0, max_demand_ = 0, ring_bytes_ = 0;
  std::shared_ptr<SharedRegion> table_;
  SlotTableHeader* header_ = nullptr;
  SlotEntry* entries_ = nullptr;
  // Daemon side: the private record of every entry, the holds, each ledger's epoch and region.
  std::vector<uint32_t> state_;
  std::vector<int32_t> slot_;
  std::vector<uint32_t> generation_;
  std::unique_ptr<std::atomic<uint32_t>[]> holds_;
  std::unique_ptr<uint32_t[]> epochs_;
  std::vector<std::shared_ptr<Region>> regions_;  // null: no client holds the ledger
  mutable std::mutex regions_mu_;                 // regions_ (short holds: a pointer copy, a scan)
  std::unique_ptr<std::mutex[]> client_locks_;    // per ledger: hold/unhold vs claim and reclaim
  std::atomic<uint64_t> retired_hits_{0};         // hits of detached regions
  std::atomic<uint64_t> retired_waited_{0};       // waited of detached regions
  // Compute side: the bound ledger and its region.
  int64_t client_ = -1;
  uint32_t epoch_ = 0;
  std::shared_ptr<Region> own_;
};

const char* slot_state_name(TableState s);

}  // namespace expertcache
