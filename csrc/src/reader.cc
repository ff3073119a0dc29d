// Reader (see csrc/include/expertcache/reader.h for the request -> chunk -> queue -> backend ->
// completion diagram). One mutex guards the queues, the requests and the completions; the read
// system calls and the CRC run outside it. The CRC is taken chunk by chunk by the thread that
// landed the chunk (a pread worker, or io_uring's dispatcher once it has handed the ring its next
// reads), so it overlaps the request's other chunks, and the request completes with no hop to
// another thread: its chunks' CRCs are combined in order (crc32_combine) when the last is back.
#include "expertcache/reader.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <zlib.h>

#include "expertcache/crc32.h"

#ifdef EXPERTCACHE_WITH_URING
#include <liburing.h>
#endif

namespace expertcache {

namespace {

using Clock = std::chrono::steady_clock;

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

struct FileEntry {
  int fd;
  std::string path;
  bool direct;
  FileEntry(int f, std::string p, bool d) : fd(f), path(std::move(p)), direct(d) {}
  ~FileEntry() { ::close(fd); }
};

struct Request {
  uint64_t id;
  uint64_t tag;
  int priority;
  std::shared_ptr<FileEntry> file;
  uint64_t offset;
  uint64_t length;
  uint8_t* dest;
  bool has_crc;
  uint32_t crc;
  bool pollable;  // its completion is queued for poll() (else only wait(id) consumes it)
  Clock::time_point submitted;

  uint64_t next_issue = 0;  // offset (relative) of the next chunk to issue
  int in_flight = 0;        // chunks issued and not yet back
  uint64_t bytes_got = 0;
  bool queued = false;      // sits in a priority queue (has unissued chunks)
  bool done = false;        // completion published
  ReadCompletion result;    // kind/error filled as soon as known
  // With has_crc: the CRC-32 of each chunk that landed whole, by its index (its relative offset
  // / chunk_bytes; chunk_range gives every chunk's range), combined in order at completion.
  std::vector<uint32_t> chunk_crcs;
};

struct Chunk {
  std::shared_ptr<Request> req;
  int priority;     // the request's class when the chunk was issued (a promote may change it)
  uint64_t offset;  // absolute file offset
  uint64_t len;
  uint8_t* dest;
  uint64_t done = 0;
  uint32_t crc = 0;  // of its len bytes, once landed whole (io_uring: taken outside the lock)
};

}  // namespace

struct Reader::Impl {
  Reader* owner;
  bool uring = false;

  mutable std::mutex mu;
  std::condition_variable work_cv;    // pread workers: a chunk is ready or stopping
  std::condition_variable done_cv;    // waiters: a completion was published
  std::deque<std::shared_ptr<Request>> queues[kNumReadPriorities];
  std::unordered_map<uint64_t, std::shared_ptr<Request>> pending;  // submitted, not consumed
  std::deque<uint64_t> completed_order;  // published pollable ids, consumed ones skipped lazily
  size_t unconsumed = 0;                 // published pollable completions not yet consumed
  std::unordered_map<int64_t, std::shared_ptr<FileEntry>> files;
  int64_t next_file = 1;
  uint64_t next_id = 1;
  bool paused = false;
  bool closed = false;    // no more submissions
  bool stopping = false;  // threads exit once their work drains
  uint64_t in_flight_by_priority[kNumReadPriorities] = {};  // chunks issued, not yet back
  ReaderStats st;

  std::mutex close_mu;  // serialises close() (joins)
  bool joined = false;
  std::vector<std::thread> threads;
  std::thread dispatcher;

#ifdef EXPERTCACHE_WITH_URING
  struct io_uring ring;
  bool ring_ready = false;
  int wake_fd = -1;
#endif

  // -- scheduling (mu held) --------------------------------------------------------------
  // The class whose next chunk may be issued now, or -1: DEMAND whenever it has one; the
  // background classes (LAYER_AHEAD, PREFETCH) only while no demand is queued or in flight and
  // fewer than background_depth of their chunks are in flight.
  uint64_t in_flight_chunks() const {
    uint64_t n = 0;
    for (const uint64_t c : in_flight_by_priority) n += c;
    return n;
  }

  int issuable_priority() const {
    if (!queues[kDemand].empty()) return kDemand;
    int first = -1;
    for (int p = kDemand + 1; p < kNumReadPriorities; ++p)
      if (!queues[p].empty()) {
        first = p;
        break;
      }
    if (first < 0) return -1;
    // With no demand chunk in flight, every chunk in flight is a background one.
    if (in_flight_by_priority[kDemand] > 0 ||
        in_flight_chunks() >= static_cast<uint64_t>(owner->background_depth_))
      return -1;
    return first;
  }

  void unqueue(const std::shared_ptr<Request>& r) {
    auto& q = queues[r->priority];
    q.erase(std::remove(q.begin(), q.end(), r), q.end());
    r->queued = false;
  }

  // The length of the chunk that starts with `left` bytes of its request still unissued: a
  // chunk_bytes, or all of them when they are at most a quarter more (a blob a little over a chunk,
  // such as 1 MiB of weights and 4 KiB of scales, is one read, not a read and a sliver). Every
  // chunk but the last thus starts at a multiple of chunk_bytes.
  uint64_t chunk_len(uint64_t left) const {
    const uint64_t c = owner->chunk_bytes_;
    return left <= c + c / 4 ? left : c;
  }

  // The next chunk of the front request of class p (issuable_priority()).
  Chunk next_chunk(int p) {
    auto& q = queues[p];
    std::shared_ptr<Request> r = q.front();
    if (r->next_issue == 0) {
      // Its first chunk: does it overtake a lower-priority request already being read?
      bool overtakes = false;
      for (int lower = p + 1; lower < kNumReadPriorities && !overtakes; ++lower)
        for (const auto& o : queues[lower])
          if (o->next_issue > 0) {
            overtakes = true;
            break;
          }
      if (overtakes) ++st.preemptions;
    }
    const uint64_t rel = r->next_issue;
    const uint64_t len = chunk_len(r->length - rel);
    r->next_issue += len;
    ++r->in_flight;
    if (r->next_issue == r->length) {
      q.pop_front();
      r->queued = false;
    }
    ++in_flight_by_priority[p];
    ++st.chunks;
    return Chunk{r, p, r->offset + rel, len, r->dest + rel};
  }

  // Records a chunk's outcome. Returns true when its request has nothing left in flight and
  // nothing left to issue (it must now be finished: CRC and publish).
  bool chunk_done(const Chunk& c, int err, bool eof) {
    Request& r = *c.req;
    --r.in_flight;
    if (r.has_crc && err == 0 && !eof && c.done == c.len)
      r.chunk_crcs[(c.offset - r.offset) / owner->chunk_bytes_] = c.crc;
    // The last demand chunk back: the background chunks held for it may go now (the pread
    // workers that found nothing to issue are asleep; io_uring's dispatcher looks again itself).
    if (--in_flight_by_priority[c.priority] == 0 && c.priority == kDemand && !uring)
      work_cv.notify_all();
    r.bytes_got += c.done;
    st.bytes_read += c.done;
    if (r.result.kind == ReadErrorKind::kNone && (err != 0 || eof)) {
      if (err != 0) {
        r.result.kind = ReadErrorKind::kIo;
        r.result.err = err;
        r.result.error = r.file->path + " offset " + std::to_string(c.offset + c.done) + ": " +
                         std::strerror(err);
      } else {
        r.result.kind = ReadErrorKind::kShortRead;  // message built at publish (needs the total)
      }
      if (r.queued) unqueue(c.req);  // the rest would fail too: stop issuing
    }
    return r.in_flight == 0 && !r.queued;
  }

  void publish(const std::shared_ptr<Request>& r) {
    ReadCompletion& res = r->result;
    res.id = r->id;
    res.tag = r->tag;
    res.nbytes = r->bytes_got;
    res.elapsed_s = std::chrono::duration<double>(Clock::now() - r->submitted).count();
    if (res.kind == ReadErrorKind::kShortRead)
      res.error = "short read: got " + std::to_string(r->bytes_got) + " of " +
                  std::to_string(r->length) + " bytes at offset " + std::to_string(r->offset) +
                  " of " + r->file->path;
    switch (res.kind) {
      case ReadErrorKind::kNone: ++st.completed; break;
      case ReadErrorKind::kCancelled: ++st.cancelled; break;
      default: ++st.failed; break;
    }
    r->done = true;
    r->file.reset();  // the descriptor may close now if close_file() was called
    if (r->pollable) {
      completed_order.push_back(r->id);
      if (unconsumed++ == 0) signal_event();
    }
    done_cv.notify_all();
  }

  // Consumes a published completion (mu held).
  void consume(uint64_t id) {
    auto it = pending.find(id);
    const bool pollable = it->second->pollable;
    pending.erase(it);
    if (pollable && --unconsumed == 0) drain_event();
  }

  void signal_event() {
    const uint64_t one = 1;
    ssize_t n;
    do n = ::write(owner->event_fd_, &one, sizeof one);
    while (n < 0 && errno == EINTR);
  }

  void drain_event() {
    uint64_t v;
    ssize_t n;
    do n = ::read(owner->event_fd_, &v, sizeof v);
    while (n < 0 && errno == EINTR);
  }

  // The CRC-32 of the whole request from its chunks' (each landed whole).
  uint32_t combined_crc(const Request& r) const {
    uLong crc = 0;
    for (uint64_t rel = 0; rel < r.length;) {
      const uint64_t len = chunk_len(r.length - rel);
      crc = ::crc32_combine(crc, r.chunk_crcs[rel / owner->chunk_bytes_], static_cast<z_off_t>(len));
      rel += len;
    }
    return static_cast<uint32_t>(crc);
  }

  // Checks the request's CRC (from its chunks') and publishes it (mu held).
  void finish(const std::shared_ptr<Request>& r) {
    if (r->result.kind == ReadErrorKind::kNone && r->has_crc) {
      const uint32_t got = combined_crc(*r);
      if (got != r->crc) {
        r->result.kind = ReadErrorKind::kChecksum;
        r->result.actual_crc = got;
        r->result.error = "checksum mismatch for " + r->file->path + " offset " +
                          std::to_string(r->offset) + ": expected " + hex32(r->crc) + " got " +
                          hex32(got);
      }
    }
    publish(r);
  }

  void wake() {
#ifdef EXPERTCACHE_WITH_URING
    if (uring) {
      const uint64_t one = 1;
      ssize_t n;
      do n = ::write(wake_fd, &one, sizeof one);
      while (n < 0 && errno == EINTR);
      return;
    }
#endif
    work_cv.notify_all();
  }

  // -- pread backend ---------------------------------------------------------------------
  static void read_chunk(Chunk& c, int* err, bool* eof) {
    const FileEntry& f = *c.req->file;
    *err = 0;
    *eof = false;
    while (c.done < c.len) {
      const ssize_t n = ::pread(f.fd, c.dest + c.done, c.len - c.done,
                                static_cast<off_t>(c.offset + c.done));
      if (n < 0) {
        if (errno == EINTR) continue;
        *err = errno;
        return;
      }
      if (n == 0) {
        *eof = true;
        return;
      }
      c.done += static_cast<uint64_t>(n);
      // A partial O_DIRECT read ends at end of file (continuing at an unaligned offset would
      // only fail with EINVAL).
      if (f.direct && c.done < c.len) {
        *eof = true;
        return;
      }
    }
  }

  void pread_worker() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      int p = -1;
      work_cv.wait(lk, [&] { return stopping || (!paused && (p = issuable_priority()) >= 0); });
      if (stopping) return;
      Chunk c = next_chunk(p);
      lk.unlock();
      int err;
      bool eof;
      read_chunk(c, &err, &eof);
      if (err == 0 && !eof && c.req->has_crc) c.crc = crc32(c.dest, c.len);
      lk.lock();
      if (chunk_done(c, err, eof)) finish(c.req);
    }
  }

  // -- io_uring backend ------------------------------------------------------------------
#ifdef EXPERTCACHE_WITH_URING
  // user_data of the wake-up poll: the Impl itself (every other user_data is a Chunk*).
  void arm_wake() {
    struct io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    io_uring_prep_poll_add(sqe, wake_fd, POLLIN);
    io_uring_sqe_set_data(sqe, this);
  }

  void prep_chunk(Chunk* c) {
    struct io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    io_uring_prep_read(sqe, c->req->file->fd, c->dest + c->done,
                       static_cast<unsigned>(c->len - c->done), c->offset + c->done);
    io_uring_sqe_set_data(sqe, c);
  }

  // One thread keeps the ring: it issues chunks (at most queue_depth in flight), lands them, takes
  // the CRC of each landed chunk (outside the lock, after handing the ring the reads that the
  // landing allowed, so the device is busy meanwhile) and publishes the requests it completed.
  void uring_dispatcher() {
    const int depth = owner->queue_depth_;
    arm_wake();
    int to_submit = 1;
    std::vector<Chunk*> resubmit;
    std::vector<Chunk*> verify;  // landed whole, their CRC to take (still counted in flight)
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu);
        int p;
        while (!paused && !stopping && in_flight_chunks() < static_cast<uint64_t>(depth) &&
               (p = issuable_priority()) >= 0) {
          prep_chunk(new Chunk(next_chunk(p)));
          ++to_submit;
        }
        if (stopping && in_flight_chunks() == 0) break;
      }
      for (Chunk* c : resubmit) {
        prep_chunk(c);
        ++to_submit;
      }
      resubmit.clear();
      int rc;
      if (!verify.empty()) {
        if (to_submit > 0) {
          rc = io_uring_submit(&ring);
          if (rc >= 0) to_submit = 0;
          else if (rc != -EINTR && rc != -EAGAIN && rc != -EBUSY)
            std::fprintf(stderr, "expertcache reader: io_uring submit failed: %s\n", std::strerror(-rc));
        }
        for (Chunk* c : verify) c->crc = crc32(c->dest, c->len);
        std::lock_guard<std::mutex> g(mu);
        for (Chunk* c : verify) {
          std::unique_ptr<Chunk> owned(c);
          if (chunk_done(*c, 0, false)) finish(c->req);
        }
        verify.clear();
        continue;  // what landed meanwhile is taken before sleeping
      }
      struct io_uring_cqe* cqe = nullptr;
      if (to_submit > 0) {
        rc = io_uring_submit_and_wait(&ring, 1);
        if (rc >= 0) to_submit = 0;
      } else {
        rc = io_uring_wait_cqe(&ring, &cqe);
      }
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY)
        std::fprintf(stderr, "expertcache reader: io_uring wait failed: %s\n", std::strerror(-rc));
      unsigned head;
      unsigned seen = 0;
      std::vector<std::pair<Chunk*, int>> landed;
      io_uring_for_each_cqe(&ring, head, cqe) {
        ++seen;
        if (io_uring_cqe_get_data(cqe) == static_cast<void*>(this)) {
          uint64_t v;
          while (::read(wake_fd, &v, sizeof v) < 0 && errno == EINTR) {
          }
          arm_wake();
          ++to_submit;
          continue;
        }
        landed.emplace_back(static_cast<Chunk*>(io_uring_cqe_get_data(cqe)), cqe->res);
      }
      io_uring_cq_advance(&ring, seen);
      if (landed.empty()) continue;
      std::unique_lock<std::mutex> lk(mu);
      for (auto& [c, res] : landed) {
        int err = 0;
        bool eof = false;
        if (res < 0) {
          if (res == -EINTR || res == -EAGAIN) {
            resubmit.push_back(c);
            continue;
          }
          err = -res;
        } else if (res == 0) {
          eof = true;
        } else {
          c->done += static_cast<uint64_t>(res);
          if (c->done < c->len) {
            if (c->req->file->direct) {
              eof = true;  // partial O_DIRECT read: end of file
            } else {
              resubmit.push_back(c);  // a short buffered read: read the rest
              continue;
            }
          }
        }
        if (err == 0 && !eof && c->req->has_crc && c->req->result.kind == ReadErrorKind::kNone) {
          verify.push_back(c);  // its CRC, then its completion, once the ring has its next reads
          continue;
        }
        std::unique_ptr<Chunk> owned(c);
        if (chunk_done(*c, err, eof)) finish(c->req);
      }
    }
  }
#endif
};

bool Reader::uring_available(std::string* why) {
#ifdef EXPERTCACHE_WITH_URING
  struct io_uring ring;
  const int rc = io_uring_queue_init(4, &ring, 0);
  if (rc < 0) {
    if (why) *why = std::string("io_uring_queue_init failed: ") + std::strerror(-rc);
    return false;
  }
  io_uring_queue_exit(&ring);
  return true;
#else
  if (why) *why = "this build has no io_uring support (liburing was not found when csrc was compiled)";
  return false;
#endif
}

Reader::Reader(int threads, int queue_depth, size_t chunk_bytes, const std::string& backend,
               int background_depth)
    : chunk_bytes_(chunk_bytes), threads_(threads), queue_depth_(queue_depth) {
  if (threads < 1 || threads > 256)
    throw std::invalid_argument("reader: threads=" + std::to_string(threads) +
                                " must be in [1, 256]");
  if (queue_depth < 1 || queue_depth > 4096)
    throw std::invalid_argument("reader: queue_depth=" + std::to_string(queue_depth) +
                                " must be in [1, 4096]");
  if (chunk_bytes == 0 || chunk_bytes % kAlignment != 0 || chunk_bytes > (size_t{1} << 30))
    throw std::invalid_argument("reader: chunk_bytes=" + std::to_string(chunk_bytes) +
                                " must be a positive multiple of 4096, at most 1 GiB");
  bool use_uring;
  std::string why;
  if (backend == "auto") {
    use_uring = uring_available(&why);
  } else if (backend == "io_uring") {
    if (!uring_available(&why))
      throw std::invalid_argument("reader: the io_uring backend is unavailable: " + why);
    use_uring = true;
  } else if (backend == "pread") {
    use_uring = false;
  } else {
    throw std::invalid_argument("reader: unknown backend '" + backend +
                                "'; valid: auto, io_uring, pread");
  }
  backend_name_ = use_uring ? "io_uring" : "pread";
  const int concurrency = use_uring ? queue_depth : threads;
  if (background_depth < 0 || background_depth > concurrency)
    throw std::invalid_argument("reader: background_depth=" + std::to_string(background_depth) +
                                " must be in [1, " + std::to_string(concurrency) + "] (the " +
                                backend_name_ + " backend's " +
                                (use_uring ? "queue_depth" : "threads") + "), or 0 for half that");
  background_depth_ = background_depth > 0 ? background_depth : std::max(1, concurrency / 2);
  event_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (event_fd_ < 0) throw OsError(errno, std::string("reader: eventfd: ") + std::strerror(errno));
  impl_ = std::make_unique<Impl>();
  impl_->owner = this;
  impl_->uring = use_uring;
  try {
#ifdef EXPERTCACHE_WITH_URING
    if (use_uring) {
      impl_->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
      if (impl_->wake_fd < 0)
        throw OsError(errno, std::string("reader: eventfd: ") + std::strerror(errno));
      // Room for queue_depth reads, their resubmissions and the wake-up poll.
      const int rc = io_uring_queue_init(static_cast<unsigned>(queue_depth) + 2, &impl_->ring, 0);
      if (rc < 0)
        throw OsError(-rc, std::string("reader: io_uring_queue_init: ") + std::strerror(-rc));
      impl_->ring_ready = true;
      impl_->dispatcher = std::thread([this] { impl_->uring_dispatcher(); });
    }
#endif
    if (!use_uring)
      for (int i = 0; i < threads; ++i) impl_->threads.emplace_back([this] { impl_->pread_worker(); });
  } catch (...) {
    close();
    ::close(event_fd_);
    throw;
  }
}

Reader::~Reader() {
  close();
  ::close(event_fd_);
}

int64_t Reader::open_file(const std::string& path, bool direct) {
  const int flags = O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0);
  int fd;
  do fd = ::open(path.c_str(), flags);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int e = errno;
    if (direct && e == EINVAL)
      throw std::invalid_argument("cannot open " + path +
                                  ": O_DIRECT is unsupported by its filesystem (EINVAL); open it "
                                  "with direct=False");
    throw OsError(e, "cannot open " + path + ": " + std::strerror(e));
  }
  auto entry = std::make_shared<FileEntry>(fd, path, direct);
  std::lock_guard<std::mutex> g(impl_->mu);
  const int64_t id = impl_->next_file++;
  impl_->files.emplace(id, std::move(entry));
  return id;
}

void Reader::close_file(int64_t file_id) {
  std::lock_guard<std::mutex> g(impl_->mu);
  if (impl_->files.erase(file_id) == 0)
    throw std::invalid_argument("reader: unknown file id " + std::to_string(file_id));
}

uint64_t Reader::submit(int64_t file_id, uint64_t offset, uint64_t length, uintptr_t dest,
                        int priority, std::optional<uint32_t> expected_crc, uint64_t tag,
                        bool pollable) {
  if (priority < 0 || priority >= kNumReadPriorities)
    throw std::invalid_argument("reader: priority " + std::to_string(priority) +
                                " is not one of DEMAND=0, LAYER_AHEAD=1, PREFETCH=2");
  if (length == 0) throw std::invalid_argument("reader: length must be > 0");
  if (dest == 0) throw std::invalid_argument("reader: dest_address is null");
  Impl& im = *impl_;
  std::lock_guard<std::mutex> g(im.mu);
  if (im.closed) throw std::runtime_error("reader: submit on a closed reader");
  auto f = im.files.find(file_id);
  if (f == im.files.end())
    throw std::invalid_argument("reader: unknown file id " + std::to_string(file_id));
  const std::shared_ptr<FileEntry>& file = f->second;
  if (file->direct) {
    const char* bad = offset % kAlignment ? "offset" : length % kAlignment ? "length"
                      : dest % kAlignment                                ? "dest_address"
                                                                         : nullptr;
    if (bad) {
      const uint64_t v = offset % kAlignment ? offset : length % kAlignment ? length : dest;
      throw std::invalid_argument("reader: " + std::string(bad) + " " + std::to_string(v) +
                                  " is not a multiple of 4096, which O_DIRECT reads of " +
                                  file->path + " need");
    }
  }
  auto r = std::make_shared<Request>();
  r->id = im.next_id++;
  r->tag = tag;
  r->priority = priority;
  r->file = file;
  r->offset = offset;
  r->length = length;
  r->dest = reinterpret_cast<uint8_t*>(dest);
  r->has_crc = expected_crc.has_value();
  r->crc = expected_crc.value_or(0);
  r->pollable = pollable;
  if (r->has_crc) r->chunk_crcs.resize((length + chunk_bytes_ - 1) / chunk_bytes_);
  r->submitted = Clock::now();
  r->queued = true;
  im.queues[priority].push_back(r);
  im.pending.emplace(r->id, r);
  ++im.st.submitted;
  if (!im.paused) im.wake();
  return r->id;
}

bool Reader::cancel(uint64_t id) {
  Impl& im = *impl_;
  std::lock_guard<std::mutex> g(im.mu);
  auto it = im.pending.find(id);
  if (it == im.pending.end()) return false;
  std::shared_ptr<Request> r = it->second;
  if (r->done || !r->queued) return false;
  im.unqueue(r);
  r->result.kind = ReadErrorKind::kCancelled;
  r->result.error = "cancelled";
  if (r->in_flight == 0) im.publish(r);
  return true;
}

bool Reader::promote(uint64_t id, int priority) {
  if (priority < 0 || priority >= kNumReadPriorities)
    throw std::invalid_argument("reader: priority " + std::to_string(priority) +
                                " is not one of DEMAND=0, LAYER_AHEAD=1, PREFETCH=2");
  Impl& im = *impl_;
  std::lock_guard<std::mutex> g(im.mu);
  auto it = im.pending.find(id);
  if (it == im.pending.end()) return false;
  std::shared_ptr<Request> r = it->second;
  if (r->done || !r->queued) return false;
  if (r->priority != priority) {
    im.unqueue(r);
    r->priority = priority;
    r->queued = true;
    im.queues[priority].push_back(r);
    if (!im.paused) im.wake();
  }
  return true;
}

bool Reader::query(uint64_t id, RequestState* out) const {
  std::lock_guard<std::mutex> g(impl_->mu);
  auto it = impl_->pending.find(id);
  if (it == impl_->pending.end()) return false;
  const Request& r = *it->second;
  *out = RequestState{r.priority, r.queued, r.done};
  return true;
}

ReadCompletion Reader::wait(uint64_t id, double timeout_s) {
  Impl& im = *impl_;
  std::unique_lock<std::mutex> lk(im.mu);
  auto it = im.pending.find(id);
  if (it == im.pending.end())
    throw std::out_of_range("reader: unknown request id " + std::to_string(id) +
                            " (never submitted, or its completion was already consumed)");
  std::shared_ptr<Request> r = it->second;
  auto ready = [&] { return r->done; };
  if (timeout_s < 0) {
    im.done_cv.wait(lk, ready);
  } else if (!im.done_cv.wait_for(lk, std::chrono::duration<double>(timeout_s), ready)) {
    throw WaitTimeout("reader: request " + std::to_string(id) + " did not complete within " +
                      std::to_string(timeout_s) + " s");
  }
  if (im.pending.find(id) == im.pending.end())
    throw std::out_of_range("reader: the completion of request " + std::to_string(id) +
                            " was consumed by another caller");
  im.consume(id);
  return r->result;
}

std::vector<ReadCompletion> Reader::poll(size_t max_n, double timeout_s) {
  Impl& im = *impl_;
  std::unique_lock<std::mutex> lk(im.mu);
  if (im.unconsumed == 0 && timeout_s > 0)
    im.done_cv.wait_for(lk, std::chrono::duration<double>(timeout_s),
                        [&] { return im.unconsumed > 0; });
  std::vector<ReadCompletion> out;
  while (out.size() < max_n && !im.completed_order.empty()) {
    const uint64_t id = im.completed_order.front();
    im.completed_order.pop_front();
    auto it = im.pending.find(id);
    if (it == im.pending.end()) continue;  // consumed by wait()
    out.push_back(it->second->result);
    im.consume(id);
  }
  return out;
}

void Reader::pause() {
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->paused = true;
}

void Reader::resume() {
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->paused = false;
  impl_->wake();
}

ReaderStats Reader::stats() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  ReaderStats s = impl_->st;
  s.in_flight = impl_->in_flight_chunks();
  s.queued = 0;
  for (const auto& q : impl_->queues) s.queued += q.size();
  return s;
}

void Reader::close() {
  if (!impl_) return;
  Impl& im = *impl_;
  std::lock_guard<std::mutex> cg(im.close_mu);
  if (im.joined) return;
  {
    std::lock_guard<std::mutex> g(im.mu);
    im.closed = true;
    for (auto& q : im.queues) {
      std::deque<std::shared_ptr<Request>> dropped;
      dropped.swap(q);
      for (auto& r : dropped) {
        r->queued = false;
        if (r->result.kind == ReadErrorKind::kNone) {
          r->result.kind = ReadErrorKind::kCancelled;
          r->result.error = "cancelled";
        }
        if (r->in_flight == 0) im.publish(r);
      }
    }
    im.stopping = true;
    im.paused = false;
    im.wake();
    im.work_cv.notify_all();
  }
  if (im.dispatcher.joinable()) im.dispatcher.join();
  for (auto& t : im.threads)
    if (t.joinable()) t.join();
  im.threads.clear();
#ifdef EXPERTCACHE_WITH_URING
  if (im.ring_ready) {
    io_uring_queue_exit(&im.ring);
    im.ring_ready = false;
  }
  if (im.wake_fd >= 0) {
    ::close(im.wake_fd);
    im.wake_fd = -1;
  }
#endif
  im.joined = true;
}

}  // namespace expertcache
