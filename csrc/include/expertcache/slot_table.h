// Shared-memory slot table: per (layer, expert) entry state, slot, pin count and generation.
// One process (the cache daemon) creates the table file; others open it. All mutation is done
// with lock-free atomics on a MAP_SHARED mapping; waiters block on the state word with futex.
// Failures are reported as exceptions: std::out_of_range (bad index), std::invalid_argument
// (bad file / bad argument), std::runtime_error (illegal state transition, system errors).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace expertcache {

enum class SlotState : uint32_t { kAbsent = 0, kLoading = 1, kResident = 2, kEvicting = 3 };

struct alignas(64) SlotEntry {
  std::atomic<uint32_t> state;
  std::atomic<int32_t> slot;
  std::atomic<uint32_t> pins;
  std::atomic<uint32_t> generation;
};
static_assert(sizeof(SlotEntry) == 64, "SlotEntry must be one cache line");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "need lock-free 32-bit atomics");
static_assert(std::atomic<int32_t>::is_always_lock_free, "need lock-free 32-bit atomics");

struct alignas(64) SlotTableHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t num_entries;
  uint32_t num_slots;
};
static_assert(sizeof(SlotTableHeader) == 64, "header must be one cache line");

constexpr uint64_t kSlotTableMagic = 0x4C42545453435845ULL;  // "EXCSTTBL" little-endian
constexpr uint32_t kSlotTableVersion = 1;

class SlotTable {
 public:
  // Creates (atomically replacing) the table file at `path`; all entries ABSENT, slot -1.
  static std::unique_ptr<SlotTable> create(const std::string& path, uint32_t num_entries,
                                           uint32_t num_slots);
  // Opens an existing table, validating magic, version and file size.
  static std::unique_ptr<SlotTable> open(const std::string& path);

  ~SlotTable();
  SlotTable(const SlotTable&) = delete;
  SlotTable& operator=(const SlotTable&) = delete;

  // Pins a RESIDENT entry and returns its slot; nullopt if it is not (or stops being) resident.
  std::optional<int32_t> try_pin(int64_t entry);
  // Drops one pin; throws if the entry has no pins.
  void unpin(int64_t entry);
  // ABSENT -> LOADING, recording the destination slot; throws if the entry is not ABSENT.
  void begin_load(int64_t entry, int64_t slot);
  // LOADING -> RESIDENT, bumps the generation and wakes all waiters; throws if not LOADING.
  void finish_load(int64_t entry);
  // LOADING -> ABSENT (a failed load); wakes all waiters, who then see "not resident".
  void abort_load(int64_t entry);
  // RESIDENT -> EVICTING -> ABSENT if unpinned; false (and no change) otherwise.
  bool try_evict(int64_t entry);
  // Blocks while the entry is LOADING; true iff it is RESIDENT on return. timeout_s >= 0.
  bool wait_resident(int64_t entry, double timeout_s);

  SlotState state(int64_t entry) const;
  uint32_t pins(int64_t entry) const;
  int32_t slot(int64_t entry) const;
  uint32_t generation(int64_t entry) const;

  uint32_t num_entries() const { return header_->num_entries; }
  uint32_t num_slots() const { return header_->num_slots; }
  const std::string& path() const { return path_; }

  static size_t file_size(uint32_t num_entries);

 private:
  SlotTable(std::string path, void* base, size_t size);
  SlotEntry& at(int64_t entry) const;

  std::string path_;
  void* base_;
  size_t size_;
  SlotTableHeader* header_;
  SlotEntry* entries_;
};

const char* slot_state_name(SlotState s);

}  // namespace expertcache
