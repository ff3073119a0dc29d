// Reader: asynchronous reads of byte ranges of files into caller-owned memory, with priority
// classes, chunk-level pre-emption, optional CRC-32 verification and two backends (io_uring, or a
// thread pool of pread workers).
//
//   submit(file, offset, length, dest, priority, crc?, tag, pollable)
//        │
//        ▼
//   Request ──split──▶ chunks of chunk_bytes (issued lazily, one at a time, never all at once);
//        │             a last piece of at most a quarter chunk rides with the chunk before it
//        │
//        ▼
//   priority queues   [DEMAND] [LAYER_AHEAD] [PREFETCH]     FIFO within a class; the dispatcher
//        │            always takes the next chunk of the front request of the highest non-empty
//        │            class, so a demand submitted while a prefetch is half read overtakes the
//        │            prefetch's remaining chunks (a "pre-emption" in stats)
//        │            Demand first: no LAYER_AHEAD or PREFETCH chunk is issued while a DEMAND
//        │            request is queued or has a chunk in flight, and at most background_depth
//        │            of theirs are in flight at once, so a demand never shares the device with
//        │            more than background_depth chunks it did not ask for (parallel reads share
//        │            the device's bandwidth: each one in flight slows the others)
//        ▼
//   backend           io_uring: one dispatcher thread keeps up to queue_depth chunks in the ring
//        │            pread:    `threads` workers, one chunk in flight each
//        ▼
//   each chunk back ──▶ its CRC-32 (if expected), in the thread that landed it: the pread worker,
//        │              or the dispatcher once the ring has its next reads (so it overlaps them)
//        ▼
//   all chunks back ──▶ their CRCs combined in order and checked ──▶ completion, published by
//        │              that same thread (zlib's crc32, expertcache/crc32.h; no other thread)
//        ▼
//   completions not yet consumed: wait(id) or poll() consumes each exactly once; event_fd() is
//   readable while any poll() would return exist, so an event loop can sleep on it. A request
//   submitted with pollable=false is left to wait(id): poll() never returns (nor consumes) it, so
//   one thread can reap the pollable requests while others wait for their own.
//
// Ownership: dest must stay valid and untouched until the request's completion is observed.
// Failures of the API are exceptions (std::invalid_argument for bad arguments, std::out_of_range
// for unknown ids, OsError for open failures, std::runtime_error for a closed reader); failures of
// a read are reported in its Completion (error kind + message), never as -1 or exit().
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace expertcache {


// Priority classes; a lower value is dispatched first.
enum ReadPriority : int { kDemand = 0, kLayerAhead = 1, kPrefetch = 2 };
constexpr int kNumReadPriorities = 3;

enum class ReadErrorKind : int { kNone = 0, kShortRead, kIo, kChecksum, kCancelled };

// A system call failed on behalf of the caller (open): carries errno; message names the path.
class OsError : public std::runtime_error {
 public:
  OsError(int err, const std::string& what) : std::runtime_error(what), err_(err) {}
  int err() const { return err_; }

 private:
  int err_;
};

// wait() ran out of time; the request is still pending and can be waited on again.
class WaitTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ReadCompletion {
  uint64_t id = 0;
  uint64_t tag = 0;
  ReadErrorKind kind = ReadErrorKind::kNone;
  std::string error;     // empty when kind == kNone
  int err = 0;           // errno for kIo
  uint64_t nbytes = 0;   // bytes read into dest (all of length on success)
  double elapsed_s = 0;  // submit -> completion
  uint32_t actual_crc = 0;  // for kChecksum
  bool ok() const { return kind == ReadErrorKind::kNone; }
};

struct ReaderStats {
  uint64_t submitted = 0, completed = 0, failed = 0, cancelled = 0, bytes_read = 0, chunks = 0,
           preemptions = 0, in_flight = 0, queued = 0;
};

class Reader {
 public:
  static constexpr size_t kAlignment = 4096;  // O_DIRECT alignment of offset, length and dest

  // backend: "auto" (io_uring when compiled in and usable, else pread), "io_uring", "pread".
  // threads: the pread backend's workers (in [1, 256] either way; io_uring runs one dispatcher).
  // background_depth: LAYER_AHEAD and PREFETCH chunks in flight at most, in [1, the backend's
  // concurrency] (threads for pread, queue_depth for io_uring); 0 = half that, at least 1.
  Reader(int threads, int queue_depth, size_t chunk_bytes, const std::string& backend,
         int background_depth = 0);
  ~Reader();  // close()
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  // Opens path read-only (O_DIRECT when direct). Throws std::invalid_argument when the
  // filesystem refuses O_DIRECT (EINVAL), OsError otherwise.
  int64_t open_file(const std::string& path, bool direct);
  // Forgets the file id; its descriptor is closed once no pending request uses it.
  void close_file(int64_t file_id);

  uint64_t submit(int64_t file_id, uint64_t offset, uint64_t length, uintptr_t dest, int priority,
                  std::optional<uint32_t> expected_crc, uint64_t tag, bool pollable = true);
  // True if the request still had unissued chunks: they are dropped and it completes with error
  // "cancelled" (after its in-flight chunks land). False if it is complete or fully issued.
  bool cancel(uint64_t id);
  // Moves a request with unissued chunks to another class (back of its FIFO). False otherwise.
  bool promote(uint64_t id, int priority);

  // A request's current state without consuming it: false if unknown or consumed.
  struct RequestState {
    int priority;
    bool queued;  // has unissued chunks
    bool done;    // completion published, not yet consumed
  };
  bool query(uint64_t id, RequestState* out) const;

  // Blocks until the request completes (or timeout_s passes: WaitTimeout; < 0 waits forever) and
  // consumes its completion. Throws std::out_of_range for an unknown or already consumed id.
  ReadCompletion wait(uint64_t id, double timeout_s);
  // Up to max_n unconsumed completions of pollable requests in completion order, waiting up to
  // timeout_s for the first.
  std::vector<ReadCompletion> poll(size_t max_n, double timeout_s);
  int event_fd() const { return event_fd_; }

  void pause();
  void resume();
  ReaderStats stats() const;
  // Cancels queued requests, waits for in-flight chunks, stops the threads. Idempotent.
  void close();

  const std::string& backend() const { return backend_name_; }
  size_t chunk_bytes() const { return chunk_bytes_; }
  int threads() const { return threads_; }
  int queue_depth() const { return queue_depth_; }
  int background_depth() const { return background_depth_; }
  // Whether io_uring is compiled in and a ring can be created here; why not, if not.
  static bool uring_available(std::string* why);

  struct Impl;

 private:
  std::string backend_name_;
  size_t chunk_bytes_;
  int threads_;
  int queue_depth_;
  int background_depth_;
  int event_fd_ = -1;
  std::unique_ptr<Impl> impl_;
};

}  // namespace expertcache
