#include "expertcache/slot_table.h"

#include "expertcache/futex.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <utility>

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010
#endif
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif

namespace expertcache {
namespace {

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

constexpr uint32_t kAbsent = static_cast<uint32_t>(TableState::kAbsent);
constexpr uint32_t kLoading = static_cast<uint32_t>(TableState::kLoading);
constexpr uint32_t kResident = static_cast<uint32_t>(TableState::kResident);
constexpr uint32_t kEvicting = static_cast<uint32_t>(TableState::kEvicting);

std::string state_str(uint32_t s) { return slot_state_name(static_cast<TableState>(s)); }

size_t round64(size_t n) { return (n + 63) / 64 * 64; }

uint64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ULL + static_cast<uint64_t>(ts.tv_nsec);
}

timespec to_timespec(double s) {
  const auto ns = static_cast<int64_t>(s * 1e9);
  return timespec{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
}

// Throws std::out_of_range unless 0 <= i < n, naming the table `*name` (null: no name).
void check_index(const std::string* name, const char* what, int64_t i, uint32_t n) {
  if (i >= 0 && i < static_cast<int64_t>(n)) return;
  throw std::out_of_range((name ? "slot table " + *name : std::string("slot table")) + ": " + what + " " +
                          std::to_string(i) + " out of range [0, " + std::to_string(n) + ")");
}

// A daemon-side transition asked of an entry in the wrong state.
[[noreturn]] void throw_bad_state(const std::string& name, const char* op, int64_t entry, uint32_t state,
                                  const char* expected) {
  throw std::runtime_error("slot table " + name + ": " + op + " of entry " + std::to_string(entry) +
                           " in state " + state_str(state) + ", expected " + expected);
}

[[noreturn]] void throw_no_region(const std::string& name, int64_t client) {
  throw std::runtime_error("slot table " + name + ": client ledger " + std::to_string(client) +
                           " has no region (not claimed)");
}

// A close-on-exec duplicate of `fd`, for handing to another process.
int dup_cloexec(int fd, const std::string& name) {
  const int out = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (out < 0) throw_errno("slot table " + name + ": dup");
  return out;
}

// The entries array, right after the header of a mapped table.
SlotEntry* entries_of(void* table) {
  return reinterpret_cast<SlotEntry*>(static_cast<char*>(table) + sizeof(SlotTableHeader));
}

// A ledger's next epoch: a new one at every claim and reclaim, never kDetachedEpoch.
uint32_t next_epoch(uint32_t& epoch) {
  if (++epoch == kDetachedEpoch) ++epoch;
  return epoch;
}

// Wakes the daemon's threads sleeping on the table's unpin word, if any (FUTEX_WAKE needs no
// write access: compute's view of the table is read-only).
void wake_unpin_sleepers(SlotTableHeader* h) {
  if (h->unpin_waiters.load() != 0) futex_wake_all(&h->unpin_word);
}

// Takes (entry, n) pins off `pins` for each of `counts`, after checking that all are there (a
// missing one throws std::runtime_error(missing(entry)) and takes none off). True when one
// reached zero.
template <class Missing>
bool release_pins(std::atomic<uint32_t>* pins, const std::vector<std::pair<int64_t, uint32_t>>& counts,
                  const Missing& missing) {
  for (const auto& [entry, n] : counts)
    if (pins[entry].load() < n) throw std::runtime_error(missing(entry));
  bool zero = false;
  for (const auto& [entry, n] : counts) zero = (pins[entry].fetch_sub(n) == n) || zero;
  return zero;
}

// The view of the channel that follows a client region's pins and stamps.
ClientChannel channel_at(char* base, uint32_t max_demand, uint32_t ring_bytes, std::string where,
                         std::shared_ptr<void> keep) {
  ChannelHeader* h = nullptr;
  uint32_t* experts = nullptr;
  uint8_t* sources = nullptr;
  uint8_t* ring = nullptr;
  ClientChannel::layout(base, max_demand, ring_bytes, &h, &experts, &sources, &ring);
  return ClientChannel(h, experts, sources, ring, max_demand, ring_bytes, std::move(where), std::move(keep));
}

// A memfd of `size` zero bytes mapped read-write, sealed against shrinking and growing.
std::shared_ptr<SharedRegion> make_memfd(const std::string& name, size_t size) {
  auto r = std::make_shared<SharedRegion>();
  r->fd = static_cast<int>(syscall(SYS_memfd_create, name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (r->fd < 0) throw_errno("slot table " + name + ": memfd_create");
  if (ftruncate(r->fd, static_cast<off_t>(size)) != 0) throw_errno("slot table " + name + ": ftruncate");
  if (fcntl(r->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0)
    throw_errno("slot table " + name + ": sealing its size");
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
  if (base == MAP_FAILED) throw_errno("slot table " + name + ": mmap");
  r->base = base;
  r->size = size;
  return r;
}

// Maps a received memfd of exactly `size` bytes; `writable` or read-only.
std::shared_ptr<SharedRegion> map_fd(int fd, size_t min_size, bool writable, const std::string& what) {
  struct stat st;
  if (fstat(fd, &st) != 0) throw_errno(what + ": fstat");
  if (static_cast<size_t>(st.st_size) < min_size)
    throw std::invalid_argument(what + ": " + std::to_string(st.st_size) + " bytes, smaller than " +
                                std::to_string(min_size));
  // A size the sender cannot change afterwards: a region that shrank under us would fault.
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
    throw std::invalid_argument(what + ": not a sealed memfd of the cache daemon");
  auto r = std::make_shared<SharedRegion>();
  const size_t size = static_cast<size_t>(st.st_size);
  void* base = mmap(nullptr, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) throw_errno(what + ": mmap");
  r->base = base;
  r->size = size;
  return r;
}

}  // namespace

SharedRegion::~SharedRegion() {
  if (base != nullptr) munmap(base, size);
  if (fd >= 0) ::close(fd);
}

// A client region: its mapping and the parts of it, with sizes from the daemon's own record.
struct SlotTable::Region {
  std::shared_ptr<SharedRegion> mem;
  ClientHeader* header = nullptr;
  std::atomic<uint32_t>* pins = nullptr;
  std::atomic<uint64_t>* stamps = nullptr;
  char* channel = nullptr;

  Region(std::shared_ptr<SharedRegion> m, uint32_t num_entries) : mem(std::move(m)) {
    char* p = static_cast<char*>(mem->base);
    header = reinterpret_cast<ClientHeader*>(p);
    p += sizeof(ClientHeader);
    pins = reinterpret_cast<std::atomic<uint32_t>*>(p);
    p += round64(static_cast<size_t>(num_entries) * sizeof(uint32_t));
    stamps = reinterpret_cast<std::atomic<uint64_t>*>(p);
    p += round64(static_cast<size_t>(num_entries) * sizeof(uint64_t));
    channel = p;
  }
};

const char* slot_state_name(TableState s) {
  switch (s) {
    case TableState::kAbsent: return "ABSENT";
    case TableState::kLoading: return "LOADING";
    case TableState::kResident: return "RESIDENT";
    case TableState::kEvicting: return "EVICTING";
  }
  return "UNKNOWN";
}

uint32_t SlotTable::default_max_demand(uint32_t num_entries) { return std::min<uint32_t>(num_entries, 4096); }

size_t SlotTable::table_bytes(uint32_t num_entries) {
  return sizeof(SlotTableHeader) + round64(static_cast<size_t>(num_entries) * sizeof(SlotEntry));
}

size_t SlotTable::region_bytes(uint32_t num_entries, uint32_t max_demand, uint32_t ring_bytes) {
  if (max_demand == 0) max_demand = default_max_demand(num_entries);
  return sizeof(ClientHeader) + round64(static_cast<size_t>(num_entries) * sizeof(uint32_t)) +
         round64(static_cast<size_t>(num_entries) * sizeof(uint64_t)) +
         ClientChannel::region_bytes(max_demand, ring_bytes);
}

SlotTable::~SlotTable() = default;

std::unique_ptr<SlotTable> SlotTable::create(const std::string& name, uint32_t num_entries,
                                             uint32_t num_slots, uint32_t num_clients,
                                             uint32_t max_demand, uint32_t ring_bytes) {
  const std::string what = "slot table " + name;
  if (num_entries == 0) throw std::invalid_argument(what + ": num_entries must be > 0");
  if (num_entries > (1u << 24)) throw std::invalid_argument(what + ": num_entries must be <= 2^24");
  if (num_slots == 0) throw std::invalid_argument(what + ": num_slots must be > 0");
  if (num_slots > static_cast<uint32_t>(INT32_MAX)) throw std::invalid_argument(what + ": num_slots too large");
  if (num_clients == 0 || num_clients > kMaxClients)
    throw std::invalid_argument(what + ": num_clients must be in [1, " + std::to_string(kMaxClients) +
                                "], got " + std::to_string(num_clients));
  if (max_demand == 0) max_demand = default_max_demand(num_entries);
  if (max_demand > 65536)
    throw std::invalid_argument(what + ": max_demand must be in [1, 65536], got " + std::to_string(max_demand));
  if (ring_bytes < 4096 || ring_bytes % 64 || ring_bytes > (64u << 20))
    throw std::invalid_argument(what + ": ring_bytes must be a multiple of 64 in [4096, 64 MiB], got " +
                                std::to_string(ring_bytes));
  std::unique_ptr<SlotTable> t(new SlotTable());
  t->name_ = name;
  t->owner_ = true;
  t->num_entries_ = num_entries;
  t->num_slots_ = num_slots;
  t->num_clients_ = num_clients;
  t->max_demand_ = max_demand;
  t->ring_bytes_ = ring_bytes;
  t->table_ = make_memfd(name, table_bytes(num_entries));
  t->header_ = static_cast<SlotTableHeader*>(t->table_->base);
  t->entries_ = entries_of(t->table_->base);
  t->state_.assign(num_entries, kAbsent);
  t->slot_.assign(num_entries, -1);
  t->generation_.assign(num_entries, 0);
  t->holds_.reset(new std::atomic<uint32_t>[num_entries]);
  for (uint32_t i = 0; i < num_entries; ++i) t->holds_[i].store(0, std::memory_order_relaxed);
  t->epochs_.reset(new uint32_t[num_clients]());
  t->regions_.resize(num_clients);
  t->client_locks_.reset(new std::mutex[num_clients]);
  for (uint32_t i = 0; i < num_entries; ++i) t->entries_[i].slot.store(-1, std::memory_order_relaxed);
  SlotTableHeader* h = t->header_;
  h->version = kSlotTableVersion;
  h->num_entries = num_entries;
  h->num_slots = num_slots;
  h->num_clients = num_clients;
  h->max_demand = max_demand;
  h->ring_bytes = ring_bytes;
  h->signals_wanted.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kSlotTableMagic;
  // From now on nobody can map it writable: compute gets the read-only view it needs.
  if (fcntl(t->table_->fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0)
    throw_errno(what + ": sealing the table against writes (Linux >= 5.1 is needed)");
  return t;
}

std::unique_ptr<SlotTable> SlotTable::attach(int table_fd, int region_fd, int64_t client, uint32_t epoch) {
  std::unique_ptr<SlotTable> t(new SlotTable());
  t->name_ = "of the cache daemon";
  auto table = map_fd(table_fd, sizeof(SlotTableHeader), false, "slot table");
  const auto& h = *static_cast<const SlotTableHeader*>(table->base);
  if (h.magic != kSlotTableMagic) throw std::invalid_argument("slot table: bad magic (not a slot table)");
  std::atomic_thread_fence(std::memory_order_acquire);
  if (h.version != kSlotTableVersion)
    throw std::invalid_argument("slot table: version " + std::to_string(h.version) + ", expected " +
                                std::to_string(kSlotTableVersion) +
                                " (the cache daemon runs another release of expertcache)");
  if (h.num_entries == 0 || h.num_entries > (1u << 24) || h.num_slots == 0 ||
      h.num_slots > static_cast<uint32_t>(INT32_MAX) || h.num_clients == 0 || h.num_clients > kMaxClients ||
      h.max_demand == 0 || h.max_demand > 65536 || h.ring_bytes < 4096 || h.ring_bytes % 64 ||
      h.ring_bytes > (64u << 20) || table->size != table_bytes(h.num_entries))
    throw std::invalid_argument("slot table: inconsistent header (" + std::to_string(h.num_entries) +
                                " entries, " + std::to_string(table->size) + " bytes)");
  t->num_entries_ = h.num_entries;
  t->num_slots_ = h.num_slots;
  t->num_clients_ = h.num_clients;
  t->max_demand_ = h.max_demand;
  t->ring_bytes_ = h.ring_bytes;
  check_index(nullptr, "client", client, t->num_clients_);
  const size_t rbytes = region_bytes(t->num_entries_, t->max_demand_, t->ring_bytes_);
  auto mem = map_fd(region_fd, rbytes, true, "client region");
  if (mem->size != rbytes) throw std::invalid_argument("client region: " + std::to_string(mem->size) +
                                                      " bytes, expected " + std::to_string(rbytes));
  auto region = std::make_shared<Region>(mem, t->num_entries_);
  if (region->header->magic != kClientRegionMagic || region->header->version != kSlotTableVersion ||
      region->header->num_entries != t->num_entries_)
    throw std::invalid_argument("client region: not a region of this slot table");
  t->table_ = std::move(table);
  t->header_ = static_cast<SlotTableHeader*>(t->table_->base);
  t->entries_ = entries_of(t->table_->base);
  const uint32_t now = region->header->epoch.load();
  if (now != epoch || epoch == kDetachedEpoch)
    throw StaleClient("slot table: client ledger " + std::to_string(client) + " is at epoch " +
                      std::to_string(now) + ", not " + std::to_string(epoch) +
                      " (reclaimed by the cache daemon): attach again");
  t->client_ = client;
  t->epoch_ = epoch;
  t->own_ = std::move(region);
  return t;
}

// -- checks ------------------------------------------------------------------------------------
void SlotTable::check_entry(int64_t entry) const {
  check_index(&name_, "entry", entry, num_entries_);
}

void SlotTable::check_client(int64_t client) const {
  check_index(&name_, "client", client, num_clients_);
}

void SlotTable::require_owner(const char* what) const {
  if (!owner_) throw std::logic_error(std::string("slot table: ") + what + " is the cache daemon's");
}

std::shared_ptr<SlotTable::Region> SlotTable::region_of(int64_t client) const {
  std::lock_guard<std::mutex> g(regions_mu_);
  return regions_[client];
}

void SlotTable::publish(int64_t entry, uint32_t state, int32_t slot) {
  state_[entry] = state;
  slot_[entry] = slot;
  entries_[entry].slot.store(slot);
  entries_[entry].state.store(state);
}

void SlotTable::set_signals_wanted(bool wanted) {
  require_owner("set_signals_wanted");
  header_->signals_wanted.store(wanted ? 1 : 0);
}

// -- compute side ------------------------------------------------------------------------------
void SlotTable::enter_ledger() {
  const uint32_t now = own_->header->epoch.load();
  if (now != epoch_)
    throw StaleClient("slot table: client ledger " + std::to_string(client_) +
                      " was reclaimed by the cache daemon (epoch " + std::to_string(epoch_) + " -> " +
                      std::to_string(now) + "): its pins are gone, attach again");
}

std::optional<int32_t> SlotTable::try_pin(int64_t entry) {
  const auto slots = try_pin_many({entry});
  if (slots[0] < 0) return std::nullopt;
  return slots[0];
}

std::vector<int32_t> SlotTable::try_pin_many(const std::vector<int64_t>& entries, bool count) {
  if (owner_ || !own_) throw std::logic_error("slot table: try_pin is compute's (an attached handle)");
  for (int64_t entry : entries) check_entry(entry);
  std::vector<int32_t> slots(entries.size(), -1);
  Region& r = *own_;
  enter_ledger();
  const uint64_t now = monotonic_ns();
  uint64_t hits = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const int64_t e = entries[i];
    SlotEntry& en = entries_[e];
    if (en.state.load() != kResident) continue;
    const uint32_t gen = en.generation.load();
    r.pins[e].fetch_add(1);
    // Seq-cst pin increment, then re-check: an evictor either saw our pin (and backs off) or had
    // already left RESIDENT (and we back off). A reload in between changes the generation.
    if (en.state.load() != kResident || en.generation.load() != gen) {
      r.pins[e].fetch_sub(1);
      continue;
    }
    slots[i] = en.slot.load();
    r.stamps[e].store(now, std::memory_order_relaxed);
    ++hits;
  }
  if (hits && count) r.header->hits.fetch_add(hits, std::memory_order_relaxed);
  return slots;
}

void SlotTable::count_hits(uint64_t n) {
  if (owner_ || !own_) throw std::logic_error("slot table: count_hits is compute's (an attached handle)");
  if (n) own_->header->hits.fetch_add(n, std::memory_order_relaxed);
}

void SlotTable::count_waited(uint64_t n) {
  if (owner_ || !own_) throw std::logic_error("slot table: count_waited is compute's (an attached handle)");
  if (n) own_->header->waited.fetch_add(n, std::memory_order_relaxed);
}

void SlotTable::unpin(int64_t entry) { unpin_many({entry}); }

void SlotTable::unpin_many(const std::vector<int64_t>& entries) {
  for (int64_t entry : entries) check_entry(entry);
  // Check everything first (counting repeats), so a bad entry unpins nothing.
  std::vector<std::pair<int64_t, uint32_t>> counts;
  for (int64_t entry : entries) {
    auto it = std::find_if(counts.begin(), counts.end(), [&](auto& c) { return c.first == entry; });
    if (it == counts.end()) counts.emplace_back(entry, 1);
    else ++it->second;
  }
  if (owner_) {  // the daemon's holds
    const auto missing = [&](int64_t entry) {
      return "slot table " + name_ + ": unpin of entry " + std::to_string(entry) + " which has no pins";
    };
    if (release_pins(holds_.get(), counts, missing)) notify_unpinned();
    return;
  }
  if (!own_) throw std::logic_error("slot table: unpin on a handle with no client region");
  Region& r = *own_;
  enter_ledger();
  const auto missing = [](int64_t entry) {
    return "slot table: unpin of entry " + std::to_string(entry) + " which this client has not pinned";
  };
  if (release_pins(r.pins, counts, missing)) {
    r.header->unpin_seq.fetch_add(1);  // seq_cst: ordered before the waiters load
    wake_unpin_sleepers(header_);
  }
}

bool SlotTable::wait_resident(int64_t entry, double timeout_s) {
  check_entry(entry);
  if (!(timeout_s >= 0) || std::isinf(timeout_s))
    throw std::invalid_argument("wait_resident: timeout_s must be finite and >= 0");
  SlotEntry& e = entries_[entry];
  const auto deadline = futex_deadline(timeout_s);
  for (;;) {
    const uint32_t s = e.state.load();
    if (s != kLoading) return s == kResident;
    // No sleeper count (compute cannot write the table): the daemon wakes at every change.
    if (!futex_wait_until(&e.state, nullptr, kLoading, deadline, "slot table " + name_)) return false;
  }
}

std::vector<int32_t> SlotTable::resident_slots(const std::vector<int64_t>& entries) const {
  for (int64_t entry : entries) check_entry(entry);
  std::vector<int32_t> out;
  out.reserve(entries.size());
  for (int64_t entry : entries) {
    const SlotEntry& e = entries_[entry];
    const uint32_t s = e.state.load();
    out.push_back(s == kResident ? e.slot.load() : s == kLoading ? -1 : -2);
  }
  return out;
}

ClientChannel SlotTable::channel(int64_t client) {
  check_client(client);
  std::shared_ptr<Region> r;
  if (owner_) {
    r = region_of(client);
    if (!r) throw_no_region(name_, client);
  } else {
    if (client != client_)
      throw std::invalid_argument("slot table: this process holds client ledger " + std::to_string(client_) +
                                  ", not " + std::to_string(client));
    r = own_;
  }
  return channel_at(r->channel, max_demand_, ring_bytes_,
                    "slot table " + name_ + " channel " + std::to_string(client), r);
}

// -- daemon side -------------------------------------------------------------------------------
void SlotTable::begin_load(int64_t entry, int64_t slot) {
  require_owner("begin_load");
  check_entry(entry);
  check_index(&name_, "slot", slot, num_slots_);
  if (state_[entry] != kAbsent) throw_bad_state(name_, "begin_load", entry, state_[entry], "ABSENT");
  publish(entry, kLoading, static_cast<int32_t>(slot));
}

void SlotTable::finish_load(int64_t entry) {
  require_owner("finish_load");
  check_entry(entry);
  if (state_[entry] != kLoading) throw_bad_state(name_, "finish_load", entry, state_[entry], "LOADING");
  // Generation first, so a pinner that sees RESIDENT also sees the new generation.
  entries_[entry].generation.store(++generation_[entry]);
  publish(entry, kResident, slot_[entry]);
  futex_wake_all(&entries_[entry].state);
}

void SlotTable::abort_load(int64_t entry) {
  require_owner("abort_load");
  check_entry(entry);
  if (state_[entry] != kLoading) throw_bad_state(name_, "abort_load", entry, state_[entry], "LOADING");
  publish(entry, kAbsent, -1);
  futex_wake_all(&entries_[entry].state);
}

bool SlotTable::try_evict(int64_t entry) {
  require_owner("try_evict");
  check_entry(entry);
  if (state_[entry] != kResident || holds_[entry].load() != 0) return false;
  SlotEntry& e = entries_[entry];
  e.state.store(kEvicting);  // seq_cst: ordered before the pins loads
  {
    std::lock_guard<std::mutex> g(regions_mu_);
    for (const auto& r : regions_) {
      if (r && r->pins[entry].load() != 0) {
        e.state.store(kResident);
        return false;
      }
    }
  }
  publish(entry, kAbsent, -1);
  futex_wake_all(&e.state);
  return true;
}

void SlotTable::hold(int64_t entry, uint32_t n) {
  require_owner("hold");
  check_entry(entry);
  const uint32_t s = state_[entry];
  if (s != kLoading && s != kResident) throw_bad_state(name_, "hold", entry, s, "LOADING or RESIDENT");
  holds_[entry].fetch_add(n);
}

uint32_t SlotTable::claim_channel(int64_t client) {
  require_owner("claim_channel");
  check_client(client);
  std::lock_guard<std::mutex> guard(client_locks_[client]);
  auto mem = make_memfd(name_ + "-client-" + std::to_string(client),
                        region_bytes(num_entries_, max_demand_, ring_bytes_));
  auto r = std::make_shared<Region>(mem, num_entries_);
  ClientHeader& h = *r->header;
  h.version = kSlotTableVersion;
  h.num_entries = num_entries_;
  // A new epoch for every claim: no region this ledger had before (detached, or still attached
  // when claimed over) is ever at the epoch of the new one.
  const uint32_t epoch = next_epoch(epochs_[client]);
  h.epoch.store(epoch);
  h.magic = kClientRegionMagic;
  {
    std::lock_guard<std::mutex> g(regions_mu_);
    if (regions_[client]) {
      retire_counts(*regions_[client]->header);
      regions_[client]->header->epoch.store(kDetachedEpoch);  // its holder's calls throw StaleClient
    }
    regions_[client] = std::move(r);
  }
  return epoch;
}

int SlotTable::table_fd() const {
  require_owner("table_fd");
  return dup_cloexec(table_->fd, name_);
}

int SlotTable::client_fd(int64_t client) const {
  require_owner("client_fd");
  check_client(client);
  auto r = region_of(client);
  if (!r) throw_no_region(name_, client);
  return dup_cloexec(r->mem->fd, name_);
}

bool SlotTable::hold_for_client(int64_t client, uint32_t epoch, int64_t entry) {
  require_owner("hold_for_client");
  check_entry(entry);
  check_client(client);
  std::lock_guard<std::mutex> guard(client_locks_[client]);
  auto r = region_of(client);
  if (!r || epochs_[client] != epoch) return false;
  const uint32_t s = state_[entry];
  if (s != kLoading && s != kResident)
    throw_bad_state(name_, "hold_for_client", entry, s, "LOADING or RESIDENT");
  r->pins[entry].fetch_add(1);
  return true;
}

bool SlotTable::unhold_for_client(int64_t client, uint32_t epoch, int64_t entry) {
  require_owner("unhold_for_client");
  check_entry(entry);
  check_client(client);
  std::lock_guard<std::mutex> guard(client_locks_[client]);
  auto r = region_of(client);
  if (!r || epochs_[client] != epoch) return false;
  std::atomic<uint32_t>& mine = r->pins[entry];
  uint32_t have = mine.load();
  do {
    if (have == 0) return false;
  } while (!mine.compare_exchange_weak(have, have - 1));
  if (have == 1) notify_unpinned();
  return true;
}

uint32_t SlotTable::client_epoch(int64_t client) const {
  check_client(client);
  if (!owner_) return own_->header->epoch.load();
  std::lock_guard<std::mutex> guard(client_locks_[client]);
  return epochs_[client];
}

uint32_t SlotTable::client_pins(int64_t client, int64_t entry) const {
  check_entry(entry);
  check_client(client);
  if (!owner_) return client == client_ ? own_->pins[entry].load() : 0;
  auto r = region_of(client);
  return r ? r->pins[entry].load() : 0;
}

uint64_t SlotTable::reclaim_client(int64_t client) {
  require_owner("reclaim_client");
  check_client(client);
  std::lock_guard<std::mutex> guard(client_locks_[client]);
  next_epoch(epochs_[client]);
  auto r = region_of(client);
  if (!r) return 0;
  ClientHeader& h = *r->header;
  h.epoch.store(kDetachedEpoch);  // the client's next call sees it and throws StaleClient
  uint64_t removed = 0;
  for (uint32_t i = 0; i < num_entries_; ++i) removed += r->pins[i].load(std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> g(regions_mu_);
    retire_counts(h);
    regions_[client].reset();  // detached: nothing it holds counts any more
  }
  notify_unpinned();
  // The daemon's thread serving this client sleeps on the channel's doorbell: wake it to see
  // the end; a compute still waiting on its notify word learns it too.
  ClientChannel view = channel_at(r->channel, max_demand_, ring_bytes_, name_, r);
  view.ring_doorbell();
  view.notify();
  return removed;
}

ClientAudit SlotTable::audit_client(int64_t client) const {
  require_owner("audit_client");
  check_client(client);
  ClientAudit out;
  auto r = region_of(client);
  if (!r) return out;
  for (uint32_t i = 0; i < num_entries_; ++i) {
    if (r->pins[i].load(std::memory_order_relaxed) == 0) continue;
    ++out.pinned_entries;
    const uint32_t s = state_[i];
    if (s != kLoading && s != kResident && out.stray.size() < 64) out.stray.push_back(i);
  }
  return out;
}

std::pair<std::vector<int64_t>, uint64_t> SlotTable::accessed_since(uint64_t since) const {
  require_owner("accessed_since");
  const uint64_t until = monotonic_ns();
  std::vector<std::pair<uint64_t, int64_t>> hits;
  std::vector<std::shared_ptr<Region>> regions;
  {
    std::lock_guard<std::mutex> g(regions_mu_);
    for (const auto& r : regions_)
      if (r) regions.push_back(r);
  }
  for (const auto& r : regions) {
    for (uint32_t i = 0; i < num_entries_; ++i) {
      const uint64_t s = r->stamps[i].load(std::memory_order_relaxed);
      if (s > since && s <= until) hits.emplace_back(s, i);
    }
  }
  std::sort(hits.begin(), hits.end());
  std::vector<int64_t> out;
  out.reserve(hits.size());
  for (const auto& h : hits) out.push_back(h.second);
  return {out, std::max(since, until)};
}

uint32_t SlotTable::unpin_seq() const { return header_->unpin_word.load(); }

void SlotTable::notify_unpinned() {
  header_->unpin_word.fetch_add(1);  // seq_cst: ordered before the waiters load
  wake_unpin_sleepers(header_);
}

bool SlotTable::wait_unpin(uint32_t seen, double timeout_s) {
  require_owner("wait_unpin");
  if (std::isnan(timeout_s)) throw std::invalid_argument("wait_unpin: timeout_s is NaN");
  if (timeout_s < 0 || timeout_s > kUnpinPollS) timeout_s = kUnpinPollS;
  const FutexSleeper sleeping(&header_->unpin_waiters);  // before the word is read (both seq_cst)
  if (header_->unpin_word.load() != seen) return true;
  // One wait, not a loop: a client's wake (its unpin) leaves the word as it is.
  const timespec ts = to_timespec(timeout_s);
  const bool woken = futex_wait_checked(&header_->unpin_word, seen, &ts,
                                        [&] { return "slot table " + name_ + ": futex wait (unpin)"; });
  // Woken (by the daemon's change or a client's wake), or the word already moved on.
  return woken || header_->unpin_word.load() != seen;
}

void SlotTable::wake_unpin_waiters() {
  require_owner("wake_unpin_waiters");
  notify_unpinned();
}

std::vector<uint32_t> SlotTable::states() const {
  if (owner_) return state_;
  std::vector<uint32_t> out(num_entries_);
  for (uint32_t i = 0; i < num_entries_; ++i) out[i] = entries_[i].state.load();
  return out;
}

std::vector<int32_t> SlotTable::slots() const {
  if (owner_) return slot_;
  std::vector<int32_t> out(num_entries_);
  for (uint32_t i = 0; i < num_entries_; ++i) out[i] = entries_[i].slot.load();
  return out;
}

// -- introspection -------------------------------------------------------------------------------
TableState SlotTable::state(int64_t entry) const {
  check_entry(entry);
  return static_cast<TableState>(owner_ ? state_[entry] : entries_[entry].state.load());
}

uint32_t SlotTable::pins(int64_t entry) const {
  check_entry(entry);
  if (!owner_) return own_ ? own_->pins[entry].load() : 0;
  uint64_t n = holds_[entry].load();
  std::lock_guard<std::mutex> g(regions_mu_);
  for (const auto& r : regions_)
    if (r) n += r->pins[entry].load(std::memory_order_relaxed);
  return static_cast<uint32_t>(std::min<uint64_t>(n, UINT32_MAX));
}

int32_t SlotTable::slot(int64_t entry) const {
  check_entry(entry);
  return owner_ ? slot_[entry] : entries_[entry].slot.load();
}

uint32_t SlotTable::generation(int64_t entry) const {
  check_entry(entry);
  return owner_ ? generation_[entry] : entries_[entry].generation.load();
}

uint64_t SlotTable::ledger_count(std::atomic<uint64_t> ClientHeader::*count,
                                 const std::atomic<uint64_t>& retired) const {
  if (!owner_) return own_ ? (own_->header->*count).load() : 0;
  uint64_t n = retired.load();
  std::lock_guard<std::mutex> g(regions_mu_);
  for (const auto& r : regions_)
    if (r) n += (r->header->*count).load(std::memory_order_relaxed);
  return n;
}

void SlotTable::retire_counts(const ClientHeader& h) {
  retired_hits_.fetch_add(h.hits.load(std::memory_order_relaxed));
  retired_waited_.fetch_add(h.waited.load(std::memory_order_relaxed));
}

uint64_t SlotTable::hits() const { return ledger_count(&ClientHeader::hits, retired_hits_); }

uint64_t SlotTable::waited() const { return ledger_count(&ClientHeader::waited, retired_waited_); }

}  // namespace expertcache
