#include "expertcache/slot_table.h"

#include "expertcache/futex.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <utility>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <system_error>

namespace expertcache {
namespace {

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

constexpr uint32_t kAbsent = static_cast<uint32_t>(SlotState::kAbsent);
constexpr uint32_t kLoading = static_cast<uint32_t>(SlotState::kLoading);
constexpr uint32_t kResident = static_cast<uint32_t>(SlotState::kResident);
constexpr uint32_t kEvicting = static_cast<uint32_t>(SlotState::kEvicting);

std::string state_str(uint32_t s) { return slot_state_name(static_cast<SlotState>(s)); }

}  // namespace

const char* slot_state_name(SlotState s) {
  switch (s) {
    case SlotState::kAbsent: return "ABSENT";
    case SlotState::kLoading: return "LOADING";
    case SlotState::kResident: return "RESIDENT";
    case SlotState::kEvicting: return "EVICTING";
  }
  return "UNKNOWN";
}

size_t SlotTable::ledger_bytes(uint32_t num_entries) {
  const size_t raw = sizeof(LedgerHeader) + static_cast<size_t>(num_entries) * sizeof(uint32_t);
  return (raw + 63) / 64 * 64;
}

uint32_t SlotTable::default_max_demand(uint32_t num_entries) { return std::min<uint32_t>(num_entries, 4096); }

size_t SlotTable::ledger_stride(uint32_t num_entries, uint32_t max_demand, uint32_t ring_bytes) {
  if (max_demand == 0) max_demand = default_max_demand(num_entries);
  return ledger_bytes(num_entries) + ClientChannel::region_bytes(max_demand, ring_bytes);
}

size_t SlotTable::file_size(uint32_t num_entries, uint32_t num_clients, uint32_t max_demand,
                            uint32_t ring_bytes) {
  return sizeof(SlotTableHeader) + static_cast<size_t>(num_entries) * sizeof(SlotEntry) +
         static_cast<size_t>(num_clients) * ledger_stride(num_entries, max_demand, ring_bytes);
}

SlotTable::SlotTable(std::string path, void* base, size_t size)
    : path_(std::move(path)),
      base_(base),
      size_(size),
      header_(static_cast<SlotTableHeader*>(base)),
      entries_(reinterpret_cast<SlotEntry*>(static_cast<char*>(base) + sizeof(SlotTableHeader))),
      ledgers_(nullptr),
      client_locks_(new std::mutex[4096]) {}

SlotTable::~SlotTable() { munmap(base_, size_); }

std::unique_ptr<SlotTable> SlotTable::create(const std::string& path, uint32_t num_entries,
                                             uint32_t num_slots, uint32_t num_clients,
                                             uint32_t max_demand, uint32_t ring_bytes) {
  if (num_entries == 0) throw std::invalid_argument("slot table " + path + ": num_entries must be > 0");
  if (num_slots == 0) throw std::invalid_argument("slot table " + path + ": num_slots must be > 0");
  if (num_slots > static_cast<uint32_t>(INT32_MAX))
    throw std::invalid_argument("slot table " + path + ": num_slots too large");
  if (num_clients == 0 || num_clients > 4096)
    throw std::invalid_argument("slot table " + path + ": num_clients must be in [1, 4096], got " +
                                std::to_string(num_clients));
  if (max_demand == 0) max_demand = default_max_demand(num_entries);
  if (max_demand > 65536)
    throw std::invalid_argument("slot table " + path + ": max_demand must be in [1, 65536], got " +
                                std::to_string(max_demand));
  if (ring_bytes < 4096 || ring_bytes % 64 || ring_bytes > (64u << 20))
    throw std::invalid_argument("slot table " + path +
                                ": ring_bytes must be a multiple of 64 in [4096, 64 MiB], got " +
                                std::to_string(ring_bytes));
  const size_t size = file_size(num_entries, num_clients, max_demand, ring_bytes);
  // Build under a temporary name and rename into place, so open() never sees a partial table.
  // Owner-only whatever the umask, and never through a planted file or symlink: O_EXCL (a stale
  // temporary of a dead daemon with this pid is removed first, only if it is not a directory).
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  ::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) throw_errno("slot table " + path + ": cannot create " + tmp);
  if (fchmod(fd, 0600) != 0) {
    int e = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    errno = e;
    throw_errno("slot table " + path + ": fchmod");
  }
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int e = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    errno = e;
    throw_errno("slot table " + path + ": ftruncate");
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    ::unlink(tmp.c_str());
    errno = e;
    throw_errno("slot table " + path + ": mmap");
  }
  // ftruncate zero-fills: every ledger starts at epoch 0, not busy, with no pins.
  std::unique_ptr<SlotTable> t(new SlotTable(path, base, size));
  t->ledgers_ = static_cast<char*>(base) + sizeof(SlotTableHeader) +
                static_cast<size_t>(num_entries) * sizeof(SlotEntry);
  for (uint32_t i = 0; i < num_entries; ++i) {
    SlotEntry& en = t->entries_[i];
    en.state.store(kAbsent, std::memory_order_relaxed);
    en.slot.store(-1, std::memory_order_relaxed);
    en.pins.store(0, std::memory_order_relaxed);
    en.generation.store(0, std::memory_order_relaxed);
    en.stamp.store(0, std::memory_order_relaxed);
  }
  t->header_->version = kSlotTableVersion;
  t->header_->num_entries = num_entries;
  t->header_->num_slots = num_slots;
  t->header_->num_clients = num_clients;
  t->header_->ledger_stride = ledger_stride(num_entries, max_demand, ring_bytes);
  t->header_->max_demand = max_demand;
  t->header_->ring_bytes = ring_bytes;
  t->header_->signals_wanted.store(1, std::memory_order_relaxed);
  t->header_->clock.store(0, std::memory_order_relaxed);
  t->header_->hits.store(0, std::memory_order_relaxed);
  t->header_->unpin_seq.store(0, std::memory_order_relaxed);
  t->header_->unpin_waiters.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  t->header_->magic = kSlotTableMagic;
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e2 = errno;
    ::unlink(tmp.c_str());
    errno = e2;
    throw_errno("slot table " + path + ": rename from " + tmp);
  }
  return t;
}

std::unique_ptr<SlotTable> SlotTable::open(const std::string& path) {
  // O_NOFOLLOW: a symlink planted at the table's name is refused (ELOOP), never followed.
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) throw_errno("slot table " + path + ": cannot open");
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    errno = e;
    throw_errno("slot table " + path + ": fstat");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < sizeof(SlotTableHeader)) {
    ::close(fd);
    throw std::invalid_argument("slot table " + path + ": file is " + std::to_string(size) +
                                " bytes, smaller than the " + std::to_string(sizeof(SlotTableHeader)) +
                                "-byte header");
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    errno = e;
    throw_errno("slot table " + path + ": mmap");
  }
  std::unique_ptr<SlotTable> t(new SlotTable(path, base, size));  // unmaps on throw below
  const SlotTableHeader& h = *t->header_;
  if (h.magic != kSlotTableMagic)
    throw std::invalid_argument("slot table " + path + ": bad magic (not a slot table)");
  std::atomic_thread_fence(std::memory_order_acquire);
  if (h.version != kSlotTableVersion)
    throw std::invalid_argument("slot table " + path + ": version " + std::to_string(h.version) +
                                ", expected " + std::to_string(kSlotTableVersion) +
                                " (written by another release of expertcache: restart the cache "
                                "daemon so it recreates the table)");
  if (size < sizeof(SlotTableHeader))
    throw std::invalid_argument("slot table " + path + ": file is " + std::to_string(size) +
                                " bytes, smaller than the " +
                                std::to_string(sizeof(SlotTableHeader)) + "-byte header");
  if (h.max_demand == 0 || h.max_demand > 65536 || h.ring_bytes < 4096 || h.ring_bytes % 64 ||
      h.ring_bytes > (64u << 20))
    throw std::invalid_argument("slot table " + path + ": bad client channel layout (max_demand " +
                                std::to_string(h.max_demand) + ", ring_bytes " +
                                std::to_string(h.ring_bytes) + ")");
  if (h.num_clients == 0 || h.num_clients > 4096 ||
      h.ledger_stride != ledger_stride(h.num_entries, h.max_demand, h.ring_bytes))
    throw std::invalid_argument("slot table " + path + ": bad client ledger layout (" +
                                std::to_string(h.num_clients) + " clients)");
  if (h.num_entries == 0 || size != file_size(h.num_entries, h.num_clients, h.max_demand, h.ring_bytes))
    throw std::invalid_argument(
        "slot table " + path + ": file is " + std::to_string(size) + " bytes, header says " +
        std::to_string(h.num_entries) + " entries and " + std::to_string(h.num_clients) +
        " clients (" +
        std::to_string(file_size(h.num_entries, h.num_clients, h.max_demand, h.ring_bytes)) +
        " bytes)");
  if (h.num_slots == 0 || h.num_slots > static_cast<uint32_t>(INT32_MAX))
    throw std::invalid_argument("slot table " + path + ": bad num_slots " +
                                std::to_string(h.num_slots));
  t->ledgers_ = static_cast<char*>(t->base_) + sizeof(SlotTableHeader) +
                static_cast<size_t>(h.num_entries) * sizeof(SlotEntry);
  return t;
}

SlotEntry& SlotTable::at(int64_t entry) const {
  if (entry < 0 || entry >= static_cast<int64_t>(header_->num_entries))
    throw std::out_of_range("slot table " + path_ + ": entry " + std::to_string(entry) +
                            " out of range [0, " + std::to_string(header_->num_entries) + ")");
  return entries_[entry];
}

void SlotTable::check_entry(int64_t entry) const {
  if (entry < 0 || entry >= static_cast<int64_t>(header_->num_entries))
    throw std::out_of_range("slot table " + path_ + ": entry " + std::to_string(entry) +
                            " out of range [0, " + std::to_string(header_->num_entries) + ")");
}

LedgerHeader& SlotTable::ledger(int64_t client) const {
  if (client < 0 || client >= static_cast<int64_t>(header_->num_clients))
    throw std::out_of_range("slot table " + path_ + ": client " + std::to_string(client) +
                            " out of range [0, " + std::to_string(header_->num_clients) + ")");
  return *reinterpret_cast<LedgerHeader*>(ledgers_ + static_cast<size_t>(client) * header_->ledger_stride);
}

std::atomic<uint32_t>* SlotTable::ledger_pins(int64_t client) const {
  return reinterpret_cast<std::atomic<uint32_t>*>(reinterpret_cast<char*>(&ledger(client)) +
                                                  sizeof(LedgerHeader));
}

void SlotTable::attach_client(int64_t client, uint32_t epoch) {
  const uint32_t now = ledger(client).epoch.load();
  if (now != epoch)
    throw StaleClient("slot table " + path_ + ": client ledger " + std::to_string(client) +
                      " is at epoch " + std::to_string(now) + ", not " + std::to_string(epoch) +
                      " (reclaimed by the cache daemon): attach again");
  client_ = client;
  epoch_ = epoch;
}

std::atomic<uint32_t>* SlotTable::enter_ledger() {
  if (client_ < 0) return nullptr;
  LedgerHeader& l = ledger(client_);
  l.busy.store(1);  // seq_cst: ordered before the epoch load (see the protocol in the header)
  const uint32_t now = l.epoch.load();
  if (now != epoch_) {
    leave_ledger();
    throw StaleClient("slot table " + path_ + ": client ledger " + std::to_string(client_) +
                      " was reclaimed by the cache daemon (epoch " + std::to_string(epoch_) +
                      " -> " + std::to_string(now) + "): its pins are gone, attach again");
  }
  return ledger_pins(client_);
}

void SlotTable::leave_ledger() {
  if (client_ < 0) return;
  LedgerHeader& l = ledger(client_);
  // 2: a reclaim waits for us to leave (it set 2 while we were inside).
  if (l.busy.exchange(0) == 2) futex_wake_all(&l.busy);
}

void SlotTable::notify_unpinned() {
  header_->unpin_seq.fetch_add(1);  // seq_cst: ordered before the waiters load
  if (header_->unpin_waiters.load() != 0) futex_wake_all(&header_->unpin_seq);
}

bool SlotTable::wait_unpin(uint32_t seen, double timeout_s) {
  if (std::isnan(timeout_s)) throw std::invalid_argument("wait_unpin: timeout_s is NaN");
  using clock = std::chrono::steady_clock;
  const bool forever = timeout_s < 0 || std::isinf(timeout_s);
  const auto deadline = forever ? clock::time_point::max()
                                : clock::now() + std::chrono::duration_cast<clock::duration>(
                                                     std::chrono::duration<double>(timeout_s));
  // Registered before the word is read (both seq_cst): an unpinner either sees a waiter and
  // wakes, or bumped the word before our read and we return at once.
  header_->unpin_waiters.fetch_add(1);
  bool changed = false;
  for (;;) {
    if (header_->unpin_seq.load() != seen) {
      changed = true;
      break;
    }
    timespec ts{};
    const timespec* tp = nullptr;
    if (!forever) {
      const auto left = deadline - clock::now();
      if (left <= clock::duration::zero()) break;
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      ts = timespec{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      tp = &ts;
    }
    if (futex_wait(&header_->unpin_seq, seen, tp) != 0 && errno != EAGAIN && errno != EINTR &&
        errno != ETIMEDOUT) {
      header_->unpin_waiters.fetch_sub(1);
      throw_errno("slot table " + path_ + ": futex wait (unpin)");
    }
  }
  header_->unpin_waiters.fetch_sub(1);
  return changed;
}

void SlotTable::wake_unpin_waiters() { notify_unpinned(); }

std::vector<uint32_t> SlotTable::states() const {
  std::vector<uint32_t> out(header_->num_entries);
  for (uint32_t i = 0; i < header_->num_entries; ++i) out[i] = entries_[i].state.load();
  return out;
}

std::vector<int32_t> SlotTable::slots() const {
  std::vector<int32_t> out(header_->num_entries);
  for (uint32_t i = 0; i < header_->num_entries; ++i) out[i] = entries_[i].slot.load();
  return out;
}

int32_t SlotTable::pin_one(int64_t entry, std::atomic<uint32_t>* lp) {
  SlotEntry& e = entries_[entry];
  if (e.state.load() != kResident) return -1;
  const uint32_t gen = e.generation.load();
  if (lp != nullptr) lp[entry].fetch_add(1);
  e.pins.fetch_add(1);
  // Seq-cst pin increment, then re-check: an evictor either saw our pin (and backs off) or had
  // already left RESIDENT (and we back off). A reload in between changes the generation.
  if (e.state.load() != kResident || e.generation.load() != gen) {
    e.pins.fetch_sub(1);
    if (lp != nullptr) lp[entry].fetch_sub(1);
    return -1;
  }
  const int32_t slot = e.slot.load();
  e.stamp.store(header_->clock.fetch_add(1) + 1);
  header_->hits.fetch_add(1);
  return slot;
}

std::optional<int32_t> SlotTable::try_pin(int64_t entry) {
  check_entry(entry);
  std::atomic<uint32_t>* lp = enter_ledger();
  const int32_t slot = pin_one(entry, lp);
  leave_ledger();
  if (slot < 0) return std::nullopt;
  return slot;
}

std::vector<int32_t> SlotTable::try_pin_many(const std::vector<int64_t>& entries) {
  for (int64_t entry : entries) check_entry(entry);
  std::vector<int32_t> slots(entries.size(), -1);
  std::atomic<uint32_t>* lp = enter_ledger();
  for (size_t i = 0; i < entries.size(); ++i) slots[i] = pin_one(entries[i], lp);
  leave_ledger();
  return slots;
}

void SlotTable::unpin(int64_t entry) { unpin_many({entry}); }

void SlotTable::unpin_many(const std::vector<int64_t>& entries) {
  for (int64_t entry : entries) check_entry(entry);
  std::atomic<uint32_t>* lp = enter_ledger();
  // Check everything first (counting repeats), so a bad entry unpins nothing.
  std::vector<std::pair<int64_t, uint32_t>> counts;
  for (int64_t entry : entries) {
    auto it = std::find_if(counts.begin(), counts.end(), [&](auto& c) { return c.first == entry; });
    if (it == counts.end()) counts.emplace_back(entry, 1);
    else ++it->second;
  }
  for (const auto& [entry, n] : counts) {
    const uint32_t have = lp != nullptr ? lp[entry].load() : entries_[entry].pins.load();
    if (have < n) {
      leave_ledger();
      throw std::runtime_error("slot table " + path_ + ": unpin of entry " + std::to_string(entry) +
                               (lp != nullptr ? " which this client has not pinned"
                                              : " which has no pins"));
    }
  }
  bool zero = false;
  for (int64_t entry : entries) {
    SlotEntry& e = entries_[entry];
    uint32_t p = e.pins.load();
    while (p != 0 && !e.pins.compare_exchange_weak(p, p - 1)) {
    }
    zero = zero || p == 1;
    if (lp != nullptr) lp[entry].fetch_sub(1);
  }
  leave_ledger();
  if (zero) notify_unpinned();  // the entry may be evicted now: a waiting daemon re-checks
}

uint32_t SlotTable::client_epoch(int64_t client) const { return ledger(client).epoch.load(); }

uint32_t SlotTable::client_pins(int64_t client, int64_t entry) const {
  check_entry(entry);
  ledger(client);
  return ledger_pins(client)[entry].load();
}

uint64_t SlotTable::reclaim_client(int64_t client) {
  LedgerHeader& l = ledger(client);
  std::lock_guard<std::mutex> guard(client_locks_[client]);
  l.epoch.fetch_add(1);  // seq_cst: ordered before the busy load
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(kReclaimWaitS));
  // A client inside a call leaves it within a few instructions; mark that we wait (busy = 2) so
  // its leave wakes us, and sleep on the word.
  for (;;) {
    uint32_t b = l.busy.load();
    if (b == 0) break;
    const auto left = deadline - clock::now();
    if (left <= clock::duration::zero()) break;
    if (b == 1 && !l.busy.compare_exchange_strong(b, 2)) continue;  // it left or changed: re-read
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    futex_wait(&l.busy, 2, &ts);  // EAGAIN / EINTR / ETIMEDOUT: the loop re-checks
  }
  l.busy.store(0);  // a client killed inside a call left it set (the known race)
  std::atomic<uint32_t>* lp = ledger_pins(client);
  uint64_t removed = 0;
  for (uint32_t i = 0; i < header_->num_entries; ++i) {
    uint32_t n = lp[i].exchange(0);
    if (n == 0) continue;
    SlotEntry& e = entries_[i];
    uint32_t p = e.pins.load();
    uint32_t take;
    do {
      take = std::min(n, p);
    } while (!e.pins.compare_exchange_weak(p, p - take));
    removed += take;
  }
  if (removed != 0) notify_unpinned();
  // The daemon's thread serving this client sleeps on the channel's doorbell: wake it to see
  // the end; a compute still waiting on its notify word learns it too.
  ClientChannel ch = channel(client);
  ch.ring_doorbell();
  ch.notify();
  return removed;
}

ClientChannel SlotTable::channel(int64_t client) {
  char* base = reinterpret_cast<char*>(&ledger(client)) + ledger_bytes(header_->num_entries);
  ChannelHeader* h = nullptr;
  uint32_t* experts = nullptr;
  uint8_t* sources = nullptr;
  uint8_t* ring = nullptr;
  ClientChannel::layout(base, header_->max_demand, header_->ring_bytes, &h, &experts, &sources, &ring);
  return ClientChannel(h, experts, sources, ring, header_->max_demand, header_->ring_bytes,
                       "slot table " + path_ + " channel " + std::to_string(client));
}

void SlotTable::claim_channel(int64_t client) {
  std::lock_guard<std::mutex> guard(client_locks_[client]);
  channel(client).reset();
}

bool SlotTable::hold_for_client(int64_t client, uint32_t epoch, int64_t entry) {
  check_entry(entry);
  LedgerHeader& l = ledger(client);
  std::lock_guard<std::mutex> guard(client_locks_[client]);
  if (l.epoch.load() != epoch) return false;
  SlotEntry& e = entries_[entry];
  const uint32_t s = e.state.load();
  if (s != kLoading && s != kResident)
    throw std::runtime_error("slot table " + path_ + ": hold_for_client of entry " +
                             std::to_string(entry) + " in state " + state_str(s) +
                             ", expected LOADING or RESIDENT");
  ledger_pins(client)[entry].fetch_add(1);
  e.pins.fetch_add(1);
  return true;
}

bool SlotTable::unhold_for_client(int64_t client, uint32_t epoch, int64_t entry) {
  check_entry(entry);
  LedgerHeader& l = ledger(client);
  std::lock_guard<std::mutex> guard(client_locks_[client]);
  if (l.epoch.load() != epoch) return false;
  std::atomic<uint32_t>& mine = ledger_pins(client)[entry];
  uint32_t have = mine.load();
  do {
    if (have == 0) return false;
  } while (!mine.compare_exchange_weak(have, have - 1));
  SlotEntry& e = entries_[entry];
  uint32_t p = e.pins.load();
  while (p != 0 && !e.pins.compare_exchange_weak(p, p - 1)) {
  }
  if (p == 1) notify_unpinned();
  return true;
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

std::vector<int64_t> SlotTable::accessed_since(uint64_t since) const {
  std::vector<std::pair<uint64_t, int64_t>> hits;
  for (uint32_t i = 0; i < header_->num_entries; ++i) {
    const uint64_t s = entries_[i].stamp.load(std::memory_order_relaxed);
    if (s > since) hits.emplace_back(s, i);
  }
  std::sort(hits.begin(), hits.end());
  std::vector<int64_t> out;
  out.reserve(hits.size());
  for (const auto& h : hits) out.push_back(h.second);
  return out;
}

std::vector<uint64_t> SlotTable::access_stamps(const std::vector<int64_t>& entries) const {
  std::vector<uint64_t> out;
  out.reserve(entries.size());
  for (int64_t entry : entries) out.push_back(at(entry).stamp.load());
  return out;
}

uint64_t SlotTable::stamp(int64_t entry) const { return at(entry).stamp.load(); }

void SlotTable::begin_load(int64_t entry, int64_t slot) {
  SlotEntry& e = at(entry);
  if (slot < 0 || slot >= static_cast<int64_t>(header_->num_slots))
    throw std::out_of_range("slot table " + path_ + ": slot " + std::to_string(slot) +
                            " out of range [0, " + std::to_string(header_->num_slots) + ")");
  uint32_t expected = kAbsent;
  if (!e.state.compare_exchange_strong(expected, kLoading))
    throw std::runtime_error("slot table " + path_ + ": begin_load of entry " +
                             std::to_string(entry) + " in state " + state_str(expected) +
                             ", expected ABSENT");
  e.slot.store(static_cast<int32_t>(slot));
}

void SlotTable::finish_load(int64_t entry) {
  SlotEntry& e = at(entry);
  uint32_t s = e.state.load();
  if (s != kLoading)
    throw std::runtime_error("slot table " + path_ + ": finish_load of entry " +
                             std::to_string(entry) + " in state " + state_str(s) +
                             ", expected LOADING");
  // Generation first, so a pinner that sees RESIDENT also sees the new generation.
  e.generation.fetch_add(1);
  uint32_t expected = kLoading;
  if (!e.state.compare_exchange_strong(expected, kResident))
    throw std::runtime_error("slot table " + path_ + ": finish_load of entry " +
                             std::to_string(entry) + " raced to state " + state_str(expected));
  futex_wake_all(&e.state);
}

void SlotTable::abort_load(int64_t entry) {
  SlotEntry& e = at(entry);
  uint32_t expected = kLoading;
  if (!e.state.compare_exchange_strong(expected, kAbsent))
    throw std::runtime_error("slot table " + path_ + ": abort_load of entry " +
                             std::to_string(entry) + " in state " + state_str(expected) +
                             ", expected LOADING");
  e.slot.store(-1);
  futex_wake_all(&e.state);
}

bool SlotTable::try_evict(int64_t entry) {
  SlotEntry& e = at(entry);
  if (e.pins.load() != 0) return false;
  uint32_t expected = kResident;
  if (!e.state.compare_exchange_strong(expected, kEvicting)) return false;
  // A pinner may have incremented between our check and the CAS; it re-checks state and backs
  // off on EVICTING, but we must not evict under it.
  if (e.pins.load() != 0) {
    e.state.store(kResident);
    return false;
  }
  e.slot.store(-1);
  e.state.store(kAbsent);
  futex_wake_all(&e.state);
  return true;
}

void SlotTable::hold(int64_t entry, uint32_t n) {
  SlotEntry& e = at(entry);
  const uint32_t s = e.state.load();
  if (s != kLoading && s != kResident)
    throw std::runtime_error("slot table " + path_ + ": hold of entry " + std::to_string(entry) +
                             " in state " + state_str(s) + ", expected LOADING or RESIDENT");
  e.pins.fetch_add(n);
}

bool SlotTable::wait_resident(int64_t entry, double timeout_s) {
  SlotEntry& e = at(entry);
  if (!(timeout_s >= 0) || std::isinf(timeout_s))
    throw std::invalid_argument("wait_resident: timeout_s must be finite and >= 0");
  using clock = std::chrono::steady_clock;
  const auto deadline =
      clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  for (;;) {
    const uint32_t s = e.state.load();
    if (s != kLoading) return s == kResident;
    const auto left = deadline - clock::now();
    if (left <= clock::duration::zero()) return false;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    if (futex_wait(&e.state, kLoading, &ts) != 0 && errno != EAGAIN && errno != EINTR &&
        errno != ETIMEDOUT)
      throw_errno("slot table " + path_ + ": futex wait");
  }
}

SlotState SlotTable::state(int64_t entry) const { return static_cast<SlotState>(at(entry).state.load()); }
uint32_t SlotTable::pins(int64_t entry) const { return at(entry).pins.load(); }
int32_t SlotTable::slot(int64_t entry) const { return at(entry).slot.load(); }
uint32_t SlotTable::generation(int64_t entry) const { return at(entry).generation.load(); }

}  // namespace expertcache
