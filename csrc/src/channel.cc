#include "expertcache/channel.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "expertcache/futex.h"

namespace expertcache {
namespace {

constexpr size_t kRecordHeader = 8;  // u32 length (bytes, a multiple of 8), u16 type, u16 zero

size_t round8(size_t n) { return (n + 7) / 8 * 8; }
size_t round64(size_t n) { return (n + 63) / 64 * 64; }

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + 4);
}

void put_experts(std::vector<uint8_t>& out, const std::vector<int64_t>& experts, const char* what) {
  for (int64_t e : experts) {
    if (e < 0 || e > 0xFFFF)
      throw std::invalid_argument(std::string(what) + ": expert " + std::to_string(e) +
                                  " is outside 0..65535");
    const uint16_t v = static_cast<uint16_t>(e);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out.insert(out.end(), p, p + 2);
  }
}

void pad4(std::vector<uint8_t>& out) {
  while (out.size() % 4) out.push_back(0);
}

// Bounded reads of one record's payload (daemon side): any overrun marks the record malformed.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool u32(uint32_t* v) {
    if (at_ + 4 > size_) return false;
    std::memcpy(v, data_ + at_, 4);
    at_ += 4;
    return true;
  }
  bool experts(uint32_t n, std::vector<uint16_t>* out) { return array(n, out); }
  bool floats(uint32_t n, std::vector<float>* out) { return array(n, out); }
  bool bytes(uint32_t n, std::string* out) {
    if (n > size_ - at_) return false;
    out->assign(reinterpret_cast<const char*>(data_ + at_), n);
    at_ += n;
    return true;
  }
  void align4() { at_ = std::min(size_, (at_ + 3) / 4 * 4); }

 private:
  // `n` values of T, copied out as they lie (the producer's byte order is ours).
  template <class T>
  bool array(uint32_t n, std::vector<T>* out) {
    if (static_cast<uint64_t>(n) * sizeof(T) > size_ - at_) return false;
    out->resize(n);
    std::memcpy(out->data(), data_ + at_, static_cast<size_t>(n) * sizeof(T));
    at_ += static_cast<size_t>(n) * sizeof(T);
    return true;
  }

  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

void copy_message(char* dst, const std::string& msg) {
  const size_t n = std::min<size_t>(msg.size(), kChannelMessageBytes - 1);
  std::memcpy(dst, msg.data(), n);
  dst[n] = '\0';
}

}  // namespace

ClientChannel::ClientChannel(ChannelHeader* header, uint32_t* experts, uint8_t* sources,
                             uint8_t* ring, uint32_t max_demand, uint32_t ring_bytes,
                             std::string where, std::shared_ptr<void> keep)
    : header_(header),
      experts_(experts),
      sources_(sources),
      ring_(ring),
      max_demand_(max_demand),
      ring_bytes_(ring_bytes),
      where_(std::move(where)),
      keep_(std::move(keep)) {}

size_t ClientChannel::region_bytes(uint32_t max_demand, uint32_t ring_bytes) {
  return sizeof(ChannelHeader) + round64(static_cast<size_t>(max_demand) * sizeof(uint32_t)) +
         round64(max_demand) + round64(ring_bytes);
}

void ClientChannel::layout(char* base, uint32_t max_demand, uint32_t ring_bytes,
                           ChannelHeader** header, uint32_t** experts, uint8_t** sources,
                           uint8_t** ring) {
  *header = reinterpret_cast<ChannelHeader*>(base);
  char* p = base + sizeof(ChannelHeader);
  *experts = reinterpret_cast<uint32_t*>(p);
  p += round64(static_cast<size_t>(max_demand) * sizeof(uint32_t));
  *sources = reinterpret_cast<uint8_t*>(p);
  p += round64(max_demand);
  *ring = reinterpret_cast<uint8_t*>(p);
  (void)ring_bytes;
}

// -- compute side ----------------------------------------------------------------------------------
uint32_t ClientChannel::post_demand(uint32_t layer, const std::vector<int64_t>& experts,
                                   const std::string& trace) {
  if (experts.empty() || experts.size() > max_demand_)
    throw std::invalid_argument(where_ + ": a demand names 1.." + std::to_string(max_demand_) +
                                " experts, got " + std::to_string(experts.size()));
  if (trace.size() > kChannelTraceBytes)
    throw std::invalid_argument(where_ + ": a demand's trace context is at most " +
                                std::to_string(kChannelTraceBytes) + " bytes, got " +
                                std::to_string(trace.size()));
  for (size_t i = 0; i < experts.size(); ++i) {
    if (experts[i] < 0 || experts[i] > static_cast<int64_t>(UINT32_MAX))
      throw std::invalid_argument(where_ + ": demand expert " + std::to_string(experts[i]) +
                                  " out of range");
    experts_[i] = static_cast<uint32_t>(experts[i]);
    sources_[i] = 0;
  }
  header_->demand_layer = layer;
  header_->demand_count = static_cast<uint32_t>(experts.size());
  std::memcpy(header_->demand_trace, trace.data(), trace.size());
  header_->demand_trace_len = static_cast<uint32_t>(trace.size());
  const uint32_t seq = header_->demand_seq.load(std::memory_order_relaxed) + 1;
  header_->demand_seq.store(seq, std::memory_order_release);
  return seq;
}

bool ClientChannel::write_record(SignalType type, const std::vector<uint8_t>& payload) {
  const size_t need = round8(kRecordHeader + payload.size());
  if (need > ring_bytes_ / 2) {
    header_->ring_dropped.fetch_add(1);
    return false;
  }
  const uint64_t head = header_->ring_head.load(std::memory_order_relaxed);
  const uint64_t tail = header_->ring_tail.load(std::memory_order_acquire);
  const size_t pos = static_cast<size_t>(head % ring_bytes_);
  const size_t pad = pos + need > ring_bytes_ ? ring_bytes_ - pos : 0;
  if (head + pad + need - tail > ring_bytes_) {
    header_->ring_dropped.fetch_add(1);
    return false;
  }
  auto write_header = [&](size_t at, uint32_t len, SignalType t) {
    const uint16_t ty = static_cast<uint16_t>(t);
    const uint16_t zero = 0;
    std::memcpy(ring_ + at, &len, 4);
    std::memcpy(ring_ + at + 4, &ty, 2);
    std::memcpy(ring_ + at + 6, &zero, 2);
  };
  size_t at = pos;
  if (pad) {
    write_header(pos, static_cast<uint32_t>(pad), SignalType::kPad);
    at = 0;
  }
  write_header(at, static_cast<uint32_t>(need), type);
  std::memcpy(ring_ + at + kRecordHeader, payload.data(), payload.size());
  std::memset(ring_ + at + kRecordHeader + payload.size(), 0, need - kRecordHeader - payload.size());
  header_->ring_head.store(head + pad + need, std::memory_order_release);
  return true;
}

bool ClientChannel::signal_begin(uint32_t handle, const std::string& request_id) {
  if (request_id.size() > kMaxRequestIdBytes)
    throw std::invalid_argument(where_ + ": request id of " + std::to_string(request_id.size()) +
                                " bytes; at most " + std::to_string(kMaxRequestIdBytes));
  std::vector<uint8_t> p;
  put_u32(p, handle);
  put_u32(p, static_cast<uint32_t>(request_id.size()));
  p.insert(p.end(), request_id.begin(), request_id.end());
  return write_record(SignalType::kBegin, p);
}

bool ClientChannel::signal_end(uint32_t handle) {
  std::vector<uint8_t> p;
  put_u32(p, handle);
  return write_record(SignalType::kEnd, p);
}

bool ClientChannel::signal_route(uint32_t handle, uint32_t token, uint32_t layer,
                                 const std::vector<int64_t>& experts) {
  std::vector<uint8_t> p;
  p.reserve(16 + experts.size() * 2);
  put_u32(p, handle);
  put_u32(p, token);
  put_u32(p, layer);
  put_u32(p, static_cast<uint32_t>(experts.size()));
  put_experts(p, experts, "route");
  return write_record(SignalType::kRoute, p);
}

bool ClientChannel::signal_ahead(uint32_t handle, uint32_t token, const std::vector<uint32_t>& layers,
                                 const std::vector<uint32_t>& depths,
                                 const std::vector<std::vector<int64_t>>& experts,
                                 const std::vector<std::vector<float>>& scores) {
  const size_t n = layers.size();
  if (depths.size() != n || experts.size() != n || scores.size() != n)
    throw std::invalid_argument(where_ + ": a lookahead needs as many depths, expert lists and "
                                         "score lists as layers");
  std::vector<uint8_t> p;
  put_u32(p, handle);
  put_u32(p, token);
  put_u32(p, static_cast<uint32_t>(n));
  for (size_t i = 0; i < n; ++i) {
    if (experts[i].size() != scores[i].size())
      throw std::invalid_argument(where_ + ": lookahead for layer " + std::to_string(layers[i]) +
                                  " has " + std::to_string(experts[i].size()) + " experts but " +
                                  std::to_string(scores[i].size()) + " scores");
    put_u32(p, layers[i]);
    put_u32(p, depths[i]);
    put_u32(p, static_cast<uint32_t>(experts[i].size()));
    put_experts(p, experts[i], "lookahead");
    pad4(p);
    const auto* f = reinterpret_cast<const uint8_t*>(scores[i].data());
    p.insert(p.end(), f, f + scores[i].size() * 4);
  }
  return write_record(SignalType::kAhead, p);
}

void ClientChannel::ring_doorbell() { futex_bump(&header_->doorbell, &header_->daemon_sleeping); }

std::string ClientChannel::reply_message() const {
  return std::string(header_->reply_message, strnlen(header_->reply_message, kChannelMessageBytes));
}

std::string ClientChannel::fail_message() const {
  return std::string(header_->fail_message, strnlen(header_->fail_message, kChannelMessageBytes));
}

bool ClientChannel::wait_notify(uint32_t seen, double timeout_s, double spin_s, double grace_s) {
  const double poll_s = timeout_s < 0 ? spin_s : std::min(spin_s, timeout_s);
  if (poll_while_worth(&header_->notify, seen, poll_s, grace_s, [this] { return copying(); })) return true;
  return futex_wait_changed(&header_->notify, &header_->compute_sleeping, seen, timeout_s,
                            where_ + " (notify)");
}

bool ClientChannel::wait_reply(uint32_t seq, uint32_t seen, double timeout_s, double spin_s,
                               double grace_s) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto answered = [this, seq] { return header_->reply_seq.load(std::memory_order_acquire) == seq; };
  if (answered()) return true;
  // Poll for a short grace (an answer from a thread already at work comes in microseconds), and
  // past it only while the daemon's thread copies for this client: an admission that reads the
  // store, or applies a layer's signals first, takes hundreds of microseconds, which polling would
  // take from the daemon's own threads on a small node. A notify after `seen` ends it too: the
  // caller checks what came.
  const double poll_s = timeout_s < 0 ? spin_s : std::min(spin_s, timeout_s);
  auto notified = [this, seen] { return header_->notify.load(std::memory_order_relaxed) != seen; };
  if (poll_while_worth([&] { return answered() || notified(); }, poll_s, grace_s, [this] { return copying(); }))
    return answered();
  if (answered()) return true;
  double left = -1.0;
  if (timeout_s >= 0) {
    left = timeout_s - std::chrono::duration<double>(clock::now() - start).count();
    if (left <= 0) return false;
  }
  futex_wait_changed(&header_->notify, &header_->compute_sleeping, seen, left, where_ + " (notify)");
  return answered();
}

uint8_t ClientChannel::source(uint32_t i) const {
  if (i >= max_demand_) throw std::out_of_range(where_ + ": demand position out of range");
  return reinterpret_cast<std::atomic<uint8_t>*>(sources_ + i)->load(std::memory_order_acquire);
}

void ClientChannel::notify() { futex_bump(&header_->notify, &header_->compute_sleeping); }

// -- daemon side -----------------------------------------------------------------------------------
void ClientChannel::reset() {
  header_->demand_seq.store(0);
  header_->demand_layer = 0;
  header_->demand_count = 0;
  header_->ring_head.store(0);
  header_->ring_dropped.store(0);
  header_->reply_seq.store(0);
  header_->reply_status = 0;
  header_->ring_tail.store(0);
  header_->fail_seq.store(0);
  header_->fail_status = 0;
  header_->copying.store(0);
  header_->reply_message[0] = '\0';
  header_->fail_message[0] = '\0';
  // doorbell / notify keep counting (a sleeper compares against what it read).
}

bool ClientChannel::wait_doorbell(uint32_t seen, double timeout_s) {
  return futex_wait_changed(&header_->doorbell, &header_->daemon_sleeping, seen, timeout_s,
                            where_ + " (doorbell)");
}

bool ClientChannel::take_demand(uint32_t taken, uint32_t* seq, uint32_t* layer,
                                std::vector<uint32_t>* experts, std::string* trace, bool copying) {
  const uint32_t s = header_->demand_seq.load(std::memory_order_acquire);
  if (s == taken) return false;
  set_copying(copying);
  const uint32_t count = header_->demand_count;
  *seq = s;
  *layer = header_->demand_layer;
  // A count beyond the mailbox is compute's fault: hand back what fits, the check refuses it.
  experts->assign(experts_, experts_ + std::min(count, max_demand_));
  if (count > max_demand_) experts->push_back(UINT32_MAX);
  // Compute writes the length: bounded here (the bytes themselves are checked by the caller).
  trace->assign(header_->demand_trace, std::min(header_->demand_trace_len, kChannelTraceBytes));
  return true;
}

void ClientChannel::reply(uint32_t seq, int32_t status, const std::string& message) {
  header_->reply_status = status;
  copy_message(header_->reply_message, message);
  header_->reply_seq.store(seq, std::memory_order_release);
  notify();
}

void ClientChannel::fail(int32_t status, const std::string& message) {
  header_->fail_status = status;
  copy_message(header_->fail_message, message);
  header_->fail_seq.fetch_add(1, std::memory_order_release);
  notify();
}

void ClientChannel::set_source(uint32_t i, uint8_t tier) {
  if (i >= max_demand_) throw std::out_of_range(where_ + ": demand position out of range");
  reinterpret_cast<std::atomic<uint8_t>*>(sources_ + i)->store(tier, std::memory_order_release);
}

std::vector<SignalRecord> ClientChannel::drain(bool* corrupt) {
  *corrupt = false;
  std::vector<SignalRecord> out;
  uint64_t tail = header_->ring_tail.load(std::memory_order_relaxed);
  const uint64_t head = header_->ring_head.load(std::memory_order_acquire);
  if (head < tail || head - tail > ring_bytes_) {
    *corrupt = true;
    header_->ring_tail.store(head, std::memory_order_release);
    return out;
  }
  while (tail < head) {
    const size_t pos = static_cast<size_t>(tail % ring_bytes_);
    uint32_t len = 0;
    uint16_t type = 0;
    if (pos + kRecordHeader > ring_bytes_) {
      *corrupt = true;
      break;
    }
    std::memcpy(&len, ring_ + pos, 4);
    std::memcpy(&type, ring_ + pos + 4, 2);
    if (len < kRecordHeader || len % 8 || pos + len > ring_bytes_ || tail + len > head) {
      *corrupt = true;
      break;
    }
    tail += len;
    if (type == static_cast<uint16_t>(SignalType::kPad)) continue;
    Reader r(ring_ + pos + kRecordHeader, len - kRecordHeader);
    SignalRecord rec;
    rec.type = static_cast<SignalType>(type);
    bool ok = r.u32(&rec.handle);
    switch (rec.type) {
      case SignalType::kBegin: {
        uint32_t n = 0;
        ok = ok && r.u32(&n) && n <= kMaxRequestIdBytes && r.bytes(n, &rec.request_id);
        break;
      }
      case SignalType::kEnd:
        break;
      case SignalType::kRoute: {
        uint32_t layer = 0, n = 0;
        std::vector<uint16_t> ex;
        ok = ok && r.u32(&rec.token) && r.u32(&layer) && r.u32(&n) && r.experts(n, &ex);
        if (ok) {
          rec.layers.push_back(layer);
          rec.experts.push_back(std::move(ex));
        }
        break;
      }
      case SignalType::kAhead: {
        uint32_t depths = 0;
        ok = ok && r.u32(&rec.token) && r.u32(&depths);
        for (uint32_t d = 0; ok && d < depths; ++d) {
          uint32_t layer = 0, depth = 0, n = 0;
          std::vector<uint16_t> ex;
          std::vector<float> sc;
          ok = r.u32(&layer) && r.u32(&depth) && r.u32(&n) && r.experts(n, &ex);
          if (!ok) break;
          r.align4();
          ok = r.floats(n, &sc);
          if (!ok) break;
          rec.layers.push_back(layer);
          rec.depths.push_back(depth);
          rec.experts.push_back(std::move(ex));
          rec.scores.push_back(std::move(sc));
        }
        break;
      }
      default:
        ok = false;
    }
    if (!ok) {
      *corrupt = true;
      break;
    }
    out.push_back(std::move(rec));
  }
  if (*corrupt) tail = head;  // skip the rest: what follows a malformed record cannot be trusted
  header_->ring_tail.store(tail, std::memory_order_release);
  return out;
}

}  // namespace expertcache
