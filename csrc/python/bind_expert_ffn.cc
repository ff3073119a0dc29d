// Python binding of the fused CPU expert FFN (csrc/include/expertcache/expert_ffn.h), used by
// compute_svc for decode steps on CPU. `ExpertFfn(spec)` takes a dict describing the two
// projections and the activation (compute_svc builds it from the manifest); `run` takes numpy
// views (zero-copy) of the arena, the routing and the rows, checks every index and size against
// the arena, the slot and the arrays (ValueError naming the argument), and runs without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bind.h"
#include "expertcache/decode.h"
#include "expertcache/expert_ffn.h"
#include "expertcache/float_bits.h"
#include "expertcache/layer_signals.h"
#include "expertcache/slot_table.h"
#include "span_demand.h"

namespace py = pybind11;
using expertcache::ExpertFfn;
using expertcache::FfnDtype;
using expertcache::FfnProjection;
using expertcache::FfnSpec;
using expertcache::SlotTable;

namespace {

[[noreturn]] void fail(const std::string& message) { throw std::invalid_argument("ExpertFfn: " + message); }

template <class T>
T get(const py::dict& d, const char* key, const char* where) {
  if (!d.contains(key)) fail(std::string(where) + " has no '" + key + "'");
  return d[key].cast<T>();
}

template <class T>
T get_or(const py::dict& d, const char* key, T fallback) {
  return d.contains(key) ? d[key].cast<T>() : fallback;
}

FfnDtype dtype_of(const std::string& name, const char* where) {
  if (name == "float32") return FfnDtype::kFloat32;
  if (name == "bfloat16") return FfnDtype::kBFloat16;
  if (name == "float16") return FfnDtype::kFloat16;
  fail(std::string(where) + ": dtype '" + name + "' is not float32, bfloat16 or float16");
}

FfnProjection projection_of(const py::dict& d, const char* where) {
  FfnProjection p;
  const auto encoding = get<std::string>(d, "encoding", where);
  if (encoding == "plain")
    p.encoding = expertcache::FfnEncoding::kPlain;
  else if (encoding == "mxfp4")
    p.encoding = expertcache::FfnEncoding::kMxfp4;
  else if (encoding == "fp8")
    p.encoding = expertcache::FfnEncoding::kFp8;
  else
    fail(std::string(where) + ": encoding '" + encoding + "' is not plain, mxfp4 or fp8");
  const auto form = get<std::string>(d, "form", where);
  if (form != "dot" && form != "axpy") fail(std::string(where) + ": form '" + form + "' is not dot or axpy");
  p.form = form == "dot" ? expertcache::FfnForm::kDot : expertcache::FfnForm::kAxpy;
  p.weight_dtype = dtype_of(get_or<std::string>(d, "weight_dtype", "bfloat16"), where);
  p.inputs = get<size_t>(d, "inputs", where);
  p.outputs = get<size_t>(d, "outputs", where);
  p.weight_offset = get<size_t>(d, "weight_offset", where);
  p.scale_offset = get_or<size_t>(d, "scale_offset", 0);
  p.block_rows = get_or<size_t>(d, "block_rows", 0);
  p.block_cols = get_or<size_t>(d, "block_cols", 0);
  p.bias_offset = get_or<int64_t>(d, "bias_offset", -1);
  p.bias_dtype = dtype_of(get_or<std::string>(d, "bias_dtype", "bfloat16"), where);
  return p;
}

struct Ffn {
  std::unique_ptr<ExpertFfn> ffn;
  std::mutex busy;  // one call at a time: the scratch is the object's
  // run_routed's scratch: the batch's grouping and the rows as float32.
  std::vector<int64_t> bounds, rows, tokens;
  std::vector<float> weights, x;
};

// `obj` as a contiguous array of `count` values of the compute dtype's storage (2-byte items for
// bf16 / fp16, float32 for fp32).
py::array storage_arg(const py::object& obj, FfnDtype d, size_t count, const char* name, bool writable) {
  if (!py::isinstance<py::array>(obj)) fail(std::string(name) + " must be a numpy array");
  py::array a = obj.cast<py::array>();
  const size_t bytes = d == FfnDtype::kFloat32 ? 4 : 2;
  if (size_t(a.itemsize()) != bytes || (d == FfnDtype::kFloat32 && a.dtype().kind() != 'f'))
    fail(std::string(name) + " must hold the compute dtype's " + std::to_string(bytes) + "-byte values");
  if (!(a.flags() & py::array::c_style)) fail(std::string(name) + " must be C-contiguous");
  if (size_t(a.size()) != count) fail(std::string(name) + " must hold " + std::to_string(count) + " values");
  if (writable && !a.writeable()) fail(std::string(name) + " must be writable");
  return a;
}

template <class T>
py::array_t<T> vector_arg(const py::object& obj, const char* name, const char* what) {
  if (!py::isinstance<py::array_t<T>>(obj)) fail(std::string(name) + " must be a numpy array of " + what);
  auto a = obj.cast<py::array_t<T>>();
  if (!(a.flags() & py::array::c_style)) fail(std::string(name) + " must be C-contiguous");
  return a;
}

// out[t] = the sum over k of pairs[t * top_k + k] (k in order, in float32), rounded to the compute dtype;
// with `add`, out[t] += that rounded sum, rounded again (torch's residual add in the compute dtype).
void combine_into(const float* p, size_t T, size_t top_k, size_t H, FfnDtype compute, uint8_t* o, bool add) {
  for (size_t t = 0; t < T; ++t)
    for (size_t h = 0; h < H; ++h) {
      float sum = p[(t * top_k) * H + h];
      for (size_t k = 1; k < top_k; ++k) sum += p[(t * top_k + k) * H + h];
      sum = expertcache::ffn_round(sum, compute);
      uint8_t* at = o + (compute == FfnDtype::kFloat32 ? 4 : 2) * (t * H + h);
      if (add) sum = expertcache::ffn_round(sum + expertcache::ffn_load(o, compute, t * H + h), compute);
      if (compute == FfnDtype::kFloat32) {
        std::memcpy(at, &sum, 4);
      } else {
        const uint16_t bits = compute == FfnDtype::kBFloat16 ? uint16_t(expertcache::bits_of(sum) >> 16)
                                                             : expertcache::float_to_fp16(sum);
        std::memcpy(at, &bits, 2);
      }
    }
}

// The pairs of `experts` (pinned in `slots`, n of them) computed from their arena slots:
// pairs[r] = weights[r] * ffn(x[r // K]) for each pair r of ids [S] whose expert is one of them
// (each has one at least), and with `out` the pairs combined into it (added with `add`). x [T, H]
// holds the compute dtype's storage. Every index is checked by the caller.
// The GIL is released around the computation, unless `gil_held` is false (the caller released it).
void routed_core(Ffn& f, const uint8_t* arena, const int64_t* slots, const int64_t* experts, size_t n,
                 const int64_t* ids, const float* weights, size_t S, const uint8_t* x, size_t T, float* pairs,
                 uint8_t* out, bool add, bool gil_held = true) {
  const FfnSpec& s = f.ffn->spec();
  const size_t H = f.ffn->hidden(), K = S / T;
  std::unique_lock<std::mutex> lock(f.busy, std::try_to_lock);
  if (!lock.owns_lock()) fail("run_routed called while another run of the same object is in progress");
  // The batch's pairs grouped by expert, rows ascending within each.
  f.bounds.assign(1, 0);
  f.rows.clear();
  f.tokens.clear();
  f.weights.clear();
  for (size_t e = 0; e < n; ++e) {
    for (size_t r = 0; r < S; ++r)
      if (ids[r] == experts[e]) {
        f.rows.push_back(int64_t(r));
        f.tokens.push_back(int64_t(r / K));
        f.weights.push_back(weights[r]);
      }
    if (int64_t(f.rows.size()) == f.bounds.back())
      fail("expert " + std::to_string(experts[e]) + " has no pair in ids");
    f.bounds.push_back(int64_t(f.rows.size()));
  }
  f.x.resize(T * H);
  for (size_t i = 0; i < T * H; ++i) f.x[i] = expertcache::ffn_load(x, s.compute, i);
  std::optional<py::gil_scoped_release> release;
  if (gil_held) release.emplace();
  f.ffn->run(arena, slots, n, f.bounds.data(), f.rows.data(), f.tokens.data(), f.weights.data(), f.x.data(),
             pairs);
  if (out != nullptr) combine_into(pairs, T, K, H, s.compute, out, add);
}

// The arena argument checked: its bytes and its number of slots.
std::pair<const uint8_t*, size_t> arena_arg(const Ffn& f, const py::object& arena_obj) {
  if (!py::isinstance<py::array>(arena_obj)) fail("arena must be a numpy uint8 array");
  py::array arena = arena_obj.cast<py::array>();
  if (arena.dtype().kind() != 'u' || arena.itemsize() != 1 || !(arena.flags() & py::array::c_style))
    fail("arena must be a contiguous numpy uint8 array");
  return {static_cast<const uint8_t*>(arena.data()), size_t(arena.size()) / f.ffn->spec().slot_bytes};
}

// The rows arguments of a routed call checked: x [T, H] (T from x), `pairs` float32 [S, H] and
// `out` (none, or T * H of the compute dtype); returns T.
size_t rows_args(const Ffn& f, size_t S, const py::object& x_obj, const py::object& pairs_obj,
                 const py::object& out_obj, py::array& x, py::array_t<float>& pairs, py::array& out) {
  const FfnSpec& s = f.ffn->spec();
  const size_t H = f.ffn->hidden();
  pairs = vector_arg<float>(pairs_obj, "pairs", "float32 [T * K, H]");
  if (pairs.ndim() != 2 || size_t(pairs.shape(0)) != S || size_t(pairs.shape(1)) != H || !pairs.writeable())
    fail("pairs must be a writable float32 [" + std::to_string(S) + ", " + std::to_string(H) + "]");
  if (!py::isinstance<py::array>(x_obj) || x_obj.cast<py::array>().ndim() != 2)
    fail("x must be [T, " + std::to_string(H) + "]");
  const size_t T = size_t(x_obj.cast<py::array>().shape(0));
  if (T == 0 || S % T) fail("ids must hold T * K values for x's T rows");
  x = storage_arg(x_obj, s.compute, T * H, "x", false);
  // With `out`, this batch completes the pairs: they are combined into it at once.
  if (!out_obj.is_none()) out = storage_arg(out_obj, s.compute, T * H, "out", true);
  return T;
}

// run_routed: pairs[r] = weights[r] * ffn(x[r // K]) for the pairs of `experts` (pinned in `slots`), and
// with `out` the pairs combined into it (added with `add`).
void run_routed(Ffn& f, const py::object& arena_obj, const py::object& slots_obj, const py::object& experts_obj,
                const py::object& ids_obj, const py::object& weights_obj, const py::object& x_obj,
                const py::object& pairs_obj, const py::object& out_obj, bool add) {
  const auto [arena, num_slots] = arena_arg(f, arena_obj);
  auto slots = vector_arg<int64_t>(slots_obj, "slots", "int64");
  auto experts = vector_arg<int64_t>(experts_obj, "experts", "int64");
  auto ids = vector_arg<int64_t>(ids_obj, "ids", "int64 [T * K]");
  auto weights = vector_arg<float>(weights_obj, "weights", "float32 [T * K]");
  const size_t n = size_t(slots.size()), S = size_t(ids.size());
  if (size_t(experts.size()) != n) fail("experts and slots must have the same length");
  if (size_t(weights.size()) != S) fail("weights must hold one value per pair (ids)");
  py::array x, out;
  py::array_t<float> pairs;
  const size_t T = rows_args(f, S, x_obj, pairs_obj, out_obj, x, pairs, out);
  for (size_t e = 0; e < n; ++e)
    if (slots.data()[e] < 0 || size_t(slots.data()[e]) >= num_slots)
      fail("slot " + std::to_string(slots.data()[e]) + " is outside the arena's " + std::to_string(num_slots));
  routed_core(f, arena, slots.data(), experts.data(), n, ids.data(), weights.data(), S,
              static_cast<const uint8_t*>(x.data()), T, pairs.mutable_data(),
              out_obj.is_none() ? nullptr : static_cast<uint8_t*>(out.mutable_data()), add);
}

// `experts` pinned through `table` all at once, or none: their slots, or an empty vector (one of
// them not resident: what was pinned is unpinned). Hits are counted only when all were pinned
// (else the layer's acquire pins and counts them).
std::vector<int64_t> pin_all(SlotTable& table, const std::vector<int64_t>& entries) {
  const std::vector<int32_t> got = table.try_pin_many(entries, false);
  std::vector<int64_t> pinned, slots;
  for (size_t e = 0; e < entries.size(); ++e)
    if (got[e] >= 0) {
      pinned.push_back(entries[e]);
      slots.push_back(got[e]);
    }
  if (pinned.size() != entries.size()) {
    table.unpin_many(pinned);
    return {};
  }
  table.count_hits(pinned.size());
  return slots;
}

// Runs `run` over the pinned `entries`, then unpins them: 1, or -1 where the daemon took the pins
// back meanwhile. An error of `run` is raised after the unpin.
template <class Run>
int run_pinned(SlotTable& table, const std::vector<int64_t>& entries, Run&& run) {
  try {
    run();
  } catch (...) {
    try {
      table.unpin_many(entries);
    } catch (const expertcache::StaleClient&) {
      // the pins went with the ledger: the computation's own error is the one to tell
    }
    throw;
  }
  try {
    table.unpin_many(entries);
  } catch (const expertcache::StaleClient&) {
    return -1;  // the daemon took the pins back while they were in use
  }
  return 1;
}

// The arguments of a layer call checked (run_layer: one layer; run_layers: `layers` of them): the
// arena, ids [layers * S] int64 and weights [layers * S] (float32, or the compute dtype's 2-byte
// values), x / pairs / out as rows_args checks them (T from x). The ids' values are checked by
// layer_core, layer by layer: run_layers' attention writes each layer's just before it runs.
struct LayerArgs {
  LayerArgs(const Ffn& f, int64_t num_experts, const py::object& arena_obj, const py::object& ids_obj,
            const py::object& weights_obj, const py::object& x_obj, const py::object& pairs_obj,
            const py::object& out_obj, size_t layers) {
    const FfnSpec& s = f.ffn->spec();
    if (num_experts < 1) fail("num_experts must be >= 1, got " + std::to_string(num_experts));
    if (out_obj.is_none()) fail("out is needed: every expert of the layer runs in this call");
    std::tie(arena, num_slots) = arena_arg(f, arena_obj);
    ids_array = vector_arg<int64_t>(ids_obj, "ids", "int64 [T * K]");
    if (size_t(ids_array.size()) % layers) fail("ids must hold T * K values per layer");
    S = size_t(ids_array.size()) / layers;
    if (!py::isinstance<py::array>(weights_obj)) fail("weights must be a numpy array");
    w = weights_obj.cast<py::array>();
    if (!(w.flags() & py::array::c_style) || size_t(w.size()) != S * layers)
      fail("weights must be a contiguous array of one value per pair (ids)");
    f32 = w.dtype().kind() == 'f' && w.itemsize() == 4;
    if (!f32 && !(w.itemsize() == 2 && s.compute != FfnDtype::kFloat32))
      fail("weights must hold float32 values or the compute dtype's 2-byte values");
    compute = s.compute;
    w_data = static_cast<const uint8_t*>(w.data());
    T = rows_args(f, S, x_obj, pairs_obj, out_obj, x, pairs, out);
    x_data = static_cast<const uint8_t*>(x.data());
    pairs_data = pairs.mutable_data();
    out_data = static_cast<uint8_t*>(out.mutable_data());
    ids = ids_array.data();
  }

  // Row `layer`'s weights as float32 (2-byte values of the compute dtype widened exactly). Touches
  // no Python object: run_layers calls it without the GIL.
  void widen(size_t layer, float* dst) const {
    if (f32) {
      std::memcpy(dst, w_data + layer * S * 4, S * sizeof(float));
    } else {
      for (size_t r = 0; r < S; ++r) dst[r] = expertcache::ffn_load(w_data, compute, layer * S + r);
    }
  }

  const uint8_t* arena = nullptr;
  size_t num_slots = 0, S = 0, T = 0;
  const int64_t* ids = nullptr;
  const uint8_t* x_data = nullptr;
  const uint8_t* w_data = nullptr;
  float* pairs_data = nullptr;
  uint8_t* out_data = nullptr;
  bool f32 = false;
  FfnDtype compute = FfnDtype::kFloat32;
  py::array_t<int64_t> ids_array;
  py::array w, x, out;
  py::array_t<float> pairs;
};

// Pinned slots beyond the arena: the table is not this arena's.
void check_arena_slots(const int64_t* slots, size_t n, size_t num_slots) {
  for (size_t i = 0; i < n; ++i)
    if (slots[i] >= int64_t(num_slots))
      fail("slot " + std::to_string(slots[i]) + " is outside the arena's " + std::to_string(num_slots));
}

struct LayerScratch {
  std::vector<int64_t> experts, entries;
};

// One decode layer from its routing `ids` [S] (each checked to be one of the layer's experts) and
// float32 `weights` [S]: its experts, ascending and each once, pinned through `table` at entries
// layer * num_experts + e, all or none, run into args.out (added with `add`) and unpinned. The number of experts run; 0, with nothing
// pinned or run, where one is not resident or they are more than `max_experts`; -1 where it ran
// but the daemon took the pins back meanwhile. StaleClient, with nothing run, as try_pin_many
// raises it. `gil_held`: as routed_core takes it.
int64_t layer_core(Ffn& f, SlotTable& table, int64_t layer, int64_t num_experts, size_t max_experts,
                   const LayerArgs& args, const int64_t* ids, const float* weights, bool add, bool gil_held,
                   LayerScratch& scratch, const std::function<void()>& on_pinned = {}) {
  std::vector<int64_t>& experts = scratch.experts;
  experts.clear();
  for (size_t r = 0; r < args.S; ++r) {
    const int64_t e = ids[r];
    if (e < 0 || e >= num_experts)
      fail("expert " + std::to_string(e) + " is outside the layer's " + std::to_string(num_experts));
    const auto at = std::lower_bound(experts.begin(), experts.end(), e);
    if (at == experts.end() || *at != e) experts.insert(at, e);
  }
  if (experts.size() > max_experts) return 0;
  std::vector<int64_t>& entries = scratch.entries;
  entries.resize(experts.size());
  for (size_t e = 0; e < experts.size(); ++e) entries[e] = layer * num_experts + experts[e];
  const std::vector<int64_t> slots = pin_all(table, entries);
  if (slots.size() != experts.size()) return 0;
  const int ran = run_pinned(table, entries, [&] {
    if (on_pinned) on_pinned();  // all of the layer is pinned: it runs here
    check_arena_slots(slots.data(), slots.size(), args.num_slots);
    routed_core(f, args.arena, slots.data(), experts.data(), experts.size(), ids, weights, args.S,
                args.x_data, args.T, args.pairs_data, args.out_data, add, gil_held);
  });
  return ran < 0 ? -1 : int64_t(experts.size());
}

// A layer's experts (`scratch`) pinned where resident (uncounted): the pinned ones' entries, slots
// and experts, and the indices of the others.
struct Pinned {
  std::vector<int64_t> entries, slots, experts;
  std::vector<size_t> others;
};

Pinned pin_resident(SlotTable& table, const LayerScratch& scratch) {
  Pinned p;
  const std::vector<int32_t> got = table.try_pin_many(scratch.entries, false);
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] >= 0) {
      p.entries.push_back(scratch.entries[i]);
      p.slots.push_back(got[i]);
      p.experts.push_back(scratch.experts[i]);
    } else {
      p.others.push_back(i);
    }
  }
  return p;
}

// What run_in_flight did with a layer.
struct InFlight {
  bool applies = false;  // none of its experts was absent: it was run here, or waited for in vain
  int64_t ran = 0;       // its experts, where it ran; 0 where not (nothing pinned, nothing added
                         // into out); -1 where it ran but the daemon took the pins back meanwhile
  size_t loading = 0;    // its experts that were in flight (LOADING) when it came
  double wait_s = 0;     // the seconds it waited for them
};

// A layer layer_core found not all resident (its experts and entries in `scratch`, valid where
// they were at most max_experts), where none of its experts is absent, only some in flight
// (LOADING: prefetched, or another client's load): pins its resident experts and runs them into
// their pair rows, waits for the others (at most `wait_s` in all), pins and runs them and
// combines the whole layer into out (with `add`), then unpins; counts the first as hits and the
// others as waited. Where one does not land in time or is gone meanwhile, it unpins what it
// pinned and adds nothing into out (ran 0). StaleClient as try_pin_many raises it, nothing left
// pinned and nothing added into out.
InFlight run_in_flight(Ffn& f, SlotTable& table, const LayerArgs& args, const int64_t* ids, const float* weights,
                       const LayerScratch& scratch, size_t max_experts, double wait_s) {
  InFlight r;
  const std::vector<int64_t>& experts = scratch.experts;
  const std::vector<int64_t>& entries = scratch.entries;
  if (!(wait_s > 0) || experts.empty() || experts.size() > max_experts || entries.size() != experts.size())
    return r;
  for (int32_t s : table.resident_slots(entries))
    if (s == -2) return r;  // absent: the layer's demand loads it
  r.applies = true;
  Pinned got = pin_resident(table, scratch);
  std::vector<int64_t>& pinned = got.entries;
  std::vector<int64_t>& slots = got.slots;
  std::vector<int64_t>& ran_experts = got.experts;
  const std::vector<size_t>& late = got.others;  // the experts in flight
  const size_t hits = pinned.size();
  r.loading = late.size();
  const auto unpin = [&] {
    try {
      table.unpin_many(pinned);
    } catch (const expertcache::StaleClient&) {
      // the pins went with the ledger
    }
  };
  size_t first = 0;  // the experts the last run takes (from there on), with the combine
  try {
    check_arena_slots(slots.data(), hits, args.num_slots);
    if (!late.empty()) {
      // The resident ones first, into their pair rows, while the others are still in flight.
      if (hits)
        routed_core(f, args.arena, slots.data(), ran_experts.data(), hits, ids, weights, args.S, args.x_data,
                    args.T, args.pairs_data, nullptr, true, false);
      using clock = std::chrono::steady_clock;
      const auto started = clock::now();
      const auto deadline = started + std::chrono::duration<double>(wait_s);
      bool landed = true;
      for (size_t i = 0; i < late.size() && landed; ++i) {
        const double left = std::chrono::duration<double>(deadline - clock::now()).count();
        landed = left > 0 && table.wait_resident(entries[late[i]], left);
      }
      r.wait_s = std::chrono::duration<double>(clock::now() - started).count();
      std::vector<int64_t> late_entries;
      for (size_t i : late) late_entries.push_back(entries[i]);
      const std::vector<int32_t> got_late =
          landed ? table.try_pin_many(late_entries, false) : std::vector<int32_t>(late.size(), -1);
      for (size_t i = 0; i < late.size(); ++i) {
        if (got_late[i] < 0) continue;
        pinned.push_back(late_entries[i]);
        slots.push_back(got_late[i]);
        ran_experts.push_back(experts[late[i]]);
      }
      if (pinned.size() != experts.size()) {  // not landed in time, or gone meanwhile
        unpin();
        return r;
      }
      check_arena_slots(slots.data() + hits, late.size(), args.num_slots);
      first = hits;
    }
    routed_core(f, args.arena, slots.data() + first, ran_experts.data() + first, slots.size() - first, ids,
                weights, args.S, args.x_data, args.T, args.pairs_data, args.out_data, true, false);
  } catch (...) {
    unpin();
    throw;
  }
  try {
    table.unpin_many(pinned);
  } catch (const expertcache::StaleClient&) {
    r.ran = -1;  // the daemon took the pins back while they were in use
    return r;
  }
  table.count_hits(hits);
  table.count_waited(r.loading);
  r.ran = int64_t(experts.size());
  return r;
}

// run_layers' signals: per layer that runs, its lookahead (the attention's routers of the layers
// ahead on its MoE input, or the caller's predictions as given) and the LayerSignals write.
class SpanAhead {
 public:
  SpanAhead(const py::object& signals_obj, const py::object& ids_obj, const py::object& scores_obj,
            const DecodeLayerRunner& runner, size_t S, size_t L) {
    if (signals_obj.is_none()) {
      if (!ids_obj.is_none() || !scores_obj.is_none()) fail("ahead_ids and ahead_scores go with signals");
      return;
    }
    signals_ = &layer_signals_of(signals_obj, "signals");
    const size_t D = signals_->depth();
    if (signals_->layers() != L || signals_->rows() * signals_->top_k() != S)
      fail("signals are for " + std::to_string(signals_->layers()) + " layers of " +
           std::to_string(signals_->rows() * signals_->top_k()) + " pairs, the step has " + std::to_string(L) +
           " of " + std::to_string(S));
    if (ids_obj.is_none() != scores_obj.is_none()) fail("ahead_ids and ahead_scores go together");
    if (!ids_obj.is_none()) {
      given_ids_ = vector_arg<int64_t>(ids_obj, "ahead_ids", "int64 [layers, depth, T * K]");
      given_scores_ = vector_arg<float>(scores_obj, "ahead_scores", "float32 [layers, depth, T * K]");
      if (size_t(given_ids_.size()) != L * D * S || size_t(given_scores_.size()) != L * D * S)
        fail("ahead_ids and ahead_scores must hold layers x depth x T * K = " + std::to_string(L * D * S) + " values");
      as_given_ = true;
    } else if (D > 0 && !runner.route_ahead) {
      fail("signals with a lookahead need an attention that routes (router_top_k) or ahead_ids / ahead_scores");
    } else if (D > 0 && runner.top_k != signals_->top_k()) {
      fail("the attention routes a top " + std::to_string(runner.top_k) + ", the signals' is " +
           std::to_string(signals_->top_k()));
    }
    ids_.resize(D * S);
    scores_.resize(D * S);
    pid_.resize(D);
    psc_.resize(D);
    S_ = S;
  }

  // Layer `layer`'s lookahead, after its dense half ran (its MoE input is the attention's mlp_in).
  void predict(size_t layer, const DecodeLayerRunner& runner) {
    if (signals_ == nullptr) return;
    const size_t D = signals_->depth();
    for (size_t d = 1; d <= D; ++d) {
      const int64_t target = signals_->ahead(layer, d);
      if (target < 0) {
        pid_[d - 1] = nullptr;
        psc_[d - 1] = nullptr;
      } else if (as_given_) {
        pid_[d - 1] = given_ids_.data() + (layer * D + d - 1) * S_;
        psc_[d - 1] = given_scores_.data() + (layer * D + d - 1) * S_;
      } else {
        runner.route_ahead(size_t(target), ids_.data() + (d - 1) * S_, scores_.data() + (d - 1) * S_);
        pid_[d - 1] = ids_.data() + (d - 1) * S_;
        psc_[d - 1] = scores_.data() + (d - 1) * S_;
      }
    }
  }

  // What layer_core calls once the layer is pinned: its signals written.
  std::function<void()> writer(size_t layer, const int64_t* ids) {
    if (signals_ == nullptr) return {};
    return [this, layer, ids] { signals_->write(layer, ids, pid_, psc_, as_given_); };
  }

  // The layer the span stops at for a miss: its signals written, the doorbell left to its demand.
  void missed(size_t layer, const int64_t* ids) {
    if (signals_ != nullptr) signals_->write(layer, ids, pid_, psc_, as_given_, false);
  }

  // The doorbell for what `missed` wrote (the span waits for the layer's experts in flight).
  void ring() {
    if (signals_ != nullptr) signals_->ring();
  }

  // What `missed` wrote went with the doorbell of the layer's demand (run_demanded).
  void covered() {
    if (signals_ != nullptr) signals_->covered();
  }

 private:
  expertcache::LayerSignals* signals_ = nullptr;
  py::array_t<int64_t> given_ids_;
  py::array_t<float> given_scores_;
  bool as_given_ = false;
  size_t S_ = 0;
  std::vector<int64_t> ids_;
  std::vector<float> scores_;
  std::vector<const int64_t*> pid_;
  std::vector<const float*> psc_;
};

// What run_demanded did with a layer.
struct Demanded {
  bool posted = false;  // a demand went for its experts that were not resident (or none was
                        // needed any more: all were pinned, and it ran)
  int64_t ran = 0;      // its experts, where it ran (their result combined into out); 0 where not
                        // (handed back: `demand.pending`); -1 where it ran but the daemon took the
                        // pins back meanwhile
};

// A layer layer_core found not all resident (its experts and entries in `scratch`), with an expert
// absent or one in flight past the span's wait: pins its resident experts (counted as hits), posts a
// demand for the others on `demand`'s channel and rings (for the layer's signals written unrung
// too), runs the resident ones into their pair rows, waits for the daemon's answer and for the
// misses to land (each run as it lands, or together with `gather`), combines the whole layer into
// out (added) and unpins everything: its source tiers and its wait go to `demand`'s results. Where
// the wait does not end well (an error reply, a failed load, a miss dropped, the time limit, `stop`)
// the layer is handed back: `demand.pending`, with its pins and its demand, nothing added into out.
// Where every expert is resident by then, the layer just runs. Nothing is posted (nothing pinned)
// where there are more experts than max_experts or misses than the channel takes, or the demand was
// stopped. StaleClient, with nothing pinned, as try_pin_many raises it. Another error after the post
// leaves the layer pending (the caller drops the stream).
Demanded run_demanded(Ffn& f, SlotTable& table, SpanDemand& demand, int64_t layer, const LayerArgs& args,
                      const int64_t* ids, const float* weights, const LayerScratch& scratch, size_t max_experts,
                      SpanAhead& ahead) {
  using clock = SpanDemand::clock;
  Demanded r;
  const std::vector<int64_t>& experts = scratch.experts;
  const std::vector<int64_t>& entries = scratch.entries;
  if (demand.is_stopped() || demand.pending || experts.empty() || experts.size() > max_experts ||
      entries.size() != experts.size())
    return r;
  expertcache::ClientChannel& channel = demand.channel;
  Pinned got = pin_resident(table, scratch);
  std::vector<int64_t>& pinned = got.entries;
  std::vector<int64_t>& slots = got.slots;
  std::vector<int64_t>& ran_experts = got.experts;
  std::vector<int64_t> misses, miss_entries;
  for (size_t i : got.others) {
    misses.push_back(experts[i]);
    miss_entries.push_back(entries[i]);
  }
  if (misses.size() > channel.max_demand()) {  // a demand the channel cannot take: the acquire's
    try {
      table.unpin_many(pinned);
    } catch (const expertcache::StaleClient&) {
      // the pins went with the ledger
    }
    return r;
  }
  table.count_hits(pinned.size());
  if (misses.empty()) {  // every one landed since layer_core looked: the layer runs as it would have
    r.posted = true;
    r.ran = run_pinned(table, pinned, [&] {
      check_arena_slots(slots.data(), slots.size(), args.num_slots);
      routed_core(f, args.arena, slots.data(), ran_experts.data(), slots.size(), ids, weights, args.S,
                  args.x_data, args.T, args.pairs_data, args.out_data, true, false);
    });
    if (r.ran > 0) r.ran = int64_t(experts.size());
    return r;
  }
  const uint32_t fail_seen = channel.fail_seq();
  const uint32_t seq = channel.post_demand(uint32_t(layer), misses);
  channel.ring_doorbell();
  ahead.covered();
  const auto posted_at = clock::now();
  r.posted = true;
  demand.pending = true;  // until it ran: an error or a hand back leaves it to the caller
  demand.layer = uint32_t(layer);
  demand.seq = seq;
  demand.fail_seen = fail_seen;
  demand.hit_experts = ran_experts;
  demand.hit_slots = slots;
  demand.misses = misses;
  const auto until = demand.until(posted_at);
  const auto left = [&] { return std::chrono::duration<double>(until - clock::now()).count(); };
  const auto hand_back = [&] {
    demand.elapsed_s = std::chrono::duration<double>(clock::now() - posted_at).count();
    return r;
  };
  double computed_s = 0;  // of the time since the post, the experts' runs: not waits
  const auto timed = [&](auto&& run) {
    const auto started = clock::now();
    run();
    computed_s += std::chrono::duration<double>(clock::now() - started).count();
  };
  check_arena_slots(slots.data(), slots.size(), args.num_slots);
  // The resident ones first, into their pair rows, while the daemon admits and loads the others.
  if (!slots.empty())
    timed([&] {
      routed_core(f, args.arena, slots.data(), ran_experts.data(), slots.size(), ids, weights, args.S, args.x_data,
                  args.T, args.pairs_data, nullptr, true, false);
    });
  while (channel.reply_seq() != seq) {
    const uint32_t seen = channel.notify_seq();  // before the checks: a stop after them wakes the wait
    if (channel.reply_seq() == seq) break;
    if (demand.is_stopped() || left() <= 0) return hand_back();
    channel.wait_reply(seq, seen, left(), demand.spin_s, demand.reply_grace_s);
  }
  if (channel.reply_status() != 0) return hand_back();
  // Admitted: every miss is pinned in this client's ledger; each runs once it is resident.
  std::vector<size_t> waiting(misses.size());
  for (size_t i = 0; i < waiting.size(); ++i) waiting[i] = i;
  std::vector<int64_t> waiting_entries, landed_slots, landed_experts;
  std::vector<size_t> still;
  while (!waiting.empty()) {
    const uint32_t seen = channel.notify_seq();  // before the checks: a landing after them wakes the wait
    if (channel.fail_seq() != fail_seen) return hand_back();
    waiting_entries.clear();
    for (size_t i : waiting) waiting_entries.push_back(miss_entries[i]);
    const std::vector<int32_t> state = table.resident_slots(waiting_entries);
    landed_slots.clear();
    landed_experts.clear();
    still.clear();
    for (size_t k = 0; k < waiting.size(); ++k) {
      if (state[k] == -2) return hand_back();  // dropped: the daemon's stream ended
      if (state[k] >= 0) {
        landed_slots.push_back(state[k]);
        landed_experts.push_back(misses[waiting[k]]);
      } else {
        still.push_back(waiting[k]);
      }
    }
    if (!landed_slots.empty() && (still.empty() || !demand.gather)) {
      check_arena_slots(landed_slots.data(), landed_slots.size(), args.num_slots);
      timed([&] {
        routed_core(f, args.arena, landed_slots.data(), landed_experts.data(), landed_slots.size(), ids, weights,
                    args.S, args.x_data, args.T, args.pairs_data, still.empty() ? args.out_data : nullptr, true,
                    false);
      });
      waiting.swap(still);
      continue;
    }
    if (demand.is_stopped() || left() <= 0) return hand_back();
    channel.wait_notify(seen, left(), demand.spin_s, demand.landing_grace_s);
  }
  demand.pending = false;
  pinned.insert(pinned.end(), miss_entries.begin(), miss_entries.end());
  try {
    table.unpin_many(pinned);
  } catch (const expertcache::StaleClient&) {
    r.ran = -1;  // the daemon took the pins back while they were in use
    return r;
  }
  for (size_t i = 0; i < misses.size(); ++i) demand.sources.push_back(channel.source(uint32_t(i)));
  demand.waits.push_back(std::chrono::duration<double>(clock::now() - posted_at).count() - computed_s);
  r.ran = int64_t(experts.size());
  return r;
}

}  // namespace

void bind_expert_ffn(py::module_& m) {
  std::vector<std::string> paths;
  for (expertcache::FfnPath p : expertcache::ffn_paths()) paths.emplace_back(expertcache::ffn_path_name(p));
  // The SIMD paths this CPU runs, fastest first; the first is what spec['path'] "auto" runs.
  m.attr("FFN_PATHS") = paths;
  py::class_<Ffn>(m, "ExpertFfn")
      .def(py::init([](const py::dict& spec) {
             FfnSpec s;
             s.first = projection_of(get<py::dict>(spec, "first", "spec"), "spec['first']");
             s.down = projection_of(get<py::dict>(spec, "down", "spec"), "spec['down']");
             const auto gate = get<std::string>(spec, "gate", "spec");
             if (gate == "glu_halves")
               s.gate = expertcache::FfnGate::kGluHalves;
             else if (gate == "gpt_oss")
               s.gate = expertcache::FfnGate::kGptOss;
             else if (gate == "plain")
               s.gate = expertcache::FfnGate::kPlain;
             else
               fail("spec['gate'] '" + gate + "' is not glu_halves, gpt_oss or plain");
             const auto act = get_or<std::string>(spec, "act", "silu");
             if (act == "silu")
               s.act = expertcache::FfnAct::kSilu;
             else if (act == "gelu")
               s.act = expertcache::FfnAct::kGelu;
             else if (act == "gelu_tanh")
               s.act = expertcache::FfnAct::kGeluTanh;
             else if (act == "relu")
               s.act = expertcache::FfnAct::kRelu;
             else
               fail("spec['act'] '" + act + "' is not silu, gelu, gelu_tanh or relu");
             s.alpha = get_or<float>(spec, "alpha", 1.702f);
             s.limit = get_or<float>(spec, "limit", 7.0f);
             s.compute = dtype_of(get<std::string>(spec, "compute", "spec"), "spec['compute']");
             s.round_weighted = get_or<bool>(spec, "round_weighted", false);
             s.slot_bytes = get<size_t>(spec, "slot_bytes", "spec");
             const auto path = get_or<std::string>(spec, "path", "auto");
             if (path == "auto")
               s.path = expertcache::FfnPath::kAuto;
             else if (path == "avx512")
               s.path = expertcache::FfnPath::kAvx512;
             else if (path == "amx")
               s.path = expertcache::FfnPath::kAmx;
             else if (path == "avx512-bf16")
               s.path = expertcache::FfnPath::kAvx512Bf16;
             else if (path == "avx2")
               s.path = expertcache::FfnPath::kAvx2;
             else if (path == "portable")
               s.path = expertcache::FfnPath::kPortable;
             else
               fail("spec['path'] '" + path + "' is not auto, amx, avx512-bf16, avx512, avx2 or portable");
             if (s.first.inputs != s.down.outputs)
               fail("the first projection reads " + std::to_string(s.first.inputs) + " features, the down "
                    "projection writes " + std::to_string(s.down.outputs));
             auto f = std::make_unique<Ffn>();
             f->ffn = std::make_unique<ExpertFfn>(s);
             return f;
           }),
           py::arg("spec"))
      .def_property_readonly("path", [](const Ffn& f) { return std::string(f.ffn->path()); })
      .def_property_readonly("hidden", [](const Ffn& f) { return f.ffn->hidden(); })
      .def_property_readonly("threads", [](const Ffn& f) { return f.ffn->threads(); })
      .def_property_readonly("amx_items", [](const Ffn& f) { return f.ffn->amx_items(); })
      .def(
          "decode_only",
          [](Ffn& f, const py::object& arena_obj, int64_t slot) {
            const auto [arena, num_slots] = arena_arg(f, arena_obj);
            if (slot < 0 || size_t(slot) >= num_slots)
              fail("slot " + std::to_string(slot) + " is outside the arena's " + std::to_string(num_slots));
            const uint8_t* a = arena + size_t(slot) * f.ffn->spec().slot_bytes;
            py::gil_scoped_release release;
            return f.ffn->decode_only(a);
          },
          py::arg("arena"), py::arg("slot"),
          "the MXFP4 weights of the expert in `slot` decoded as the avx512 and amx kernels decode them, nothing "
          "computed (their words' xor): what a kernel that multiplies nothing costs")
      .def(
          "set_threads",
          [](Ffn& f, int threads) {
            if (threads < 1 || threads > 1024) fail("threads must be 1 .. 1024, got " + std::to_string(threads));
            std::lock_guard<std::mutex> lock(f.busy);
            f.ffn->set_threads(threads);
          },
          py::arg("threads"))
      .def(
          "run",
          [](Ffn& f, const py::object& arena_obj, const py::object& slots_obj, const py::object& bounds_obj,
             const py::object& rows_obj, const py::object& tokens_obj, const py::object& weights_obj,
             const py::object& x_obj, const py::object& out_obj) {
            const auto [a, num_slots] = arena_arg(f, arena_obj);
            auto slots = vector_arg<int64_t>(slots_obj, "slots", "int64");
            auto bounds = vector_arg<int64_t>(bounds_obj, "bounds", "int64");
            auto rows = vector_arg<int64_t>(rows_obj, "rows", "int64");
            auto tokens = vector_arg<int64_t>(tokens_obj, "tokens", "int64");
            auto weights = vector_arg<float>(weights_obj, "weights", "float32");
            auto x = vector_arg<float>(x_obj, "x", "float32 [T, H]");
            auto out = vector_arg<float>(out_obj, "out", "float32 [P, H]");
            const size_t n = size_t(slots.size()), H = f.ffn->hidden();
            if (size_t(bounds.size()) != n + 1) fail("bounds must hold len(slots) + 1 = " + std::to_string(n + 1) + " values");
            const int64_t* b = bounds.data();
            if (b[0] != 0) fail("bounds[0] must be 0");
            for (size_t e = 0; e < n; ++e)
              if (b[e + 1] <= b[e]) fail("bounds must increase (every expert has rows)");
            const size_t total = size_t(b[n]);
            if (size_t(rows.size()) != total || size_t(tokens.size()) != total || size_t(weights.size()) != total)
              fail("rows, tokens and weights must each hold bounds[-1] = " + std::to_string(total) + " values");
            if (x.ndim() != 2 || size_t(x.shape(1)) != H) fail("x must be float32 [T, " + std::to_string(H) + "]");
            if (out.ndim() != 2 || size_t(out.shape(1)) != H) fail("out must be float32 [P, " + std::to_string(H) + "]");
            if (!out.writeable()) fail("out must be writable");
            const int64_t T = x.shape(0), P = out.shape(0);
            for (size_t e = 0; e < n; ++e)
              if (slots.data()[e] < 0 || size_t(slots.data()[e]) >= num_slots)
                fail("slot " + std::to_string(slots.data()[e]) + " is outside the arena's " + std::to_string(num_slots));
            for (size_t r = 0; r < total; ++r) {
              if (tokens.data()[r] < 0 || tokens.data()[r] >= T)
                fail("token " + std::to_string(tokens.data()[r]) + " is outside x's " + std::to_string(T) + " rows");
              if (rows.data()[r] < 0 || rows.data()[r] >= P)
                fail("row " + std::to_string(rows.data()[r]) + " is outside out's " + std::to_string(P) + " rows");
            }
            const int64_t *sp = slots.data(), *rp = rows.data(), *tp = tokens.data();
            const float *wp = weights.data(), *xp = x.data();
            float* op = out.mutable_data();
            std::unique_lock<std::mutex> lock(f.busy, std::try_to_lock);
            if (!lock.owns_lock()) fail("run called while another run of the same object is in progress");
            py::gil_scoped_release release;
            f.ffn->run(a, sp, n, b, rp, tp, wp, xp, op);
          },
          py::arg("arena"), py::arg("slots"), py::arg("bounds"), py::arg("rows"), py::arg("tokens"),
          py::arg("weights"), py::arg("x"), py::arg("out"),
          "out[rows[r]] = weights[r] * ffn(x[tokens[r]]) for the experts in arena slots `slots`, expert e "
          "owning r in bounds[e] .. bounds[e + 1]")
      .def(
          "run_routed",
          [](Ffn& f, const py::object& arena_obj, const py::object& slots_obj, const py::object& experts_obj,
             const py::object& ids_obj, const py::object& weights_obj, const py::object& x_obj,
             const py::object& pairs_obj, const py::object& out_obj, bool add) {
            run_routed(f, arena_obj, slots_obj, experts_obj, ids_obj, weights_obj, x_obj, pairs_obj, out_obj, add);
          },
          py::arg("arena"), py::arg("slots"), py::arg("experts"), py::arg("ids"), py::arg("weights"), py::arg("x"),
          py::arg("pairs"), py::arg("out") = py::none(), py::arg("add") = false,
          "pairs[r] = weights[r] * ffn(x[r // K]) for every pair r whose expert ids[r] is in `experts` (pinned in "
          "`slots`, same order); x [T, H] holds the compute dtype's values, K = len(ids) / T. With `out` (the "
          "last batch of the pairs), then out = combine(pairs, K) at once, or with `add` out += it (rounded as "
          "torch's add in the compute dtype)")
      .def(
          "run_resident",
          [](Ffn& f, SlotTable& table, const py::object& entries_obj, const py::object& arena_obj,
             const py::object& experts_obj, const py::object& ids_obj, const py::object& weights_obj,
             const py::object& x_obj, const py::object& pairs_obj, const py::object& out_obj, bool add) {
            auto entries = vector_arg<int64_t>(entries_obj, "entries", "int64");
            auto experts = vector_arg<int64_t>(experts_obj, "experts", "int64");
            const size_t n = size_t(entries.size());
            if (size_t(experts.size()) != n) fail("experts and entries must have the same length");
            if (out_obj.is_none()) fail("out is needed: every expert of the layer runs in this call");
            const std::vector<int64_t> keys(entries.data(), entries.data() + n);
            // All or none: pins taken while another of the layer's experts is not resident go again.
            const std::vector<int64_t> got = pin_all(table, keys);
            if (got.size() != n) return 0;
            py::array_t<int64_t> slots(static_cast<py::ssize_t>(n));
            std::copy(got.begin(), got.end(), slots.mutable_data());
            return run_pinned(table, keys, [&] {
              run_routed(f, arena_obj, slots, experts_obj, ids_obj, weights_obj, x_obj, pairs_obj, out_obj, add);
            });
          },
          py::arg("table"), py::arg("entries"), py::arg("arena"), py::arg("experts"), py::arg("ids"),
          py::arg("weights"), py::arg("x"), py::arg("pairs"), py::arg("out"), py::arg("add") = false,
          "A whole layer whose experts are all resident, in one call: pins slot-table `entries` (one per expert "
          "of `experts`, same order) through `table` (compute's handle), runs run_routed on their slots with "
          "`out` (and `add`) and unpins them: 1. 0, with nothing pinned or run, where one of them is not "
          "resident; -1 when it ran but the daemon took the pins back meanwhile (the slots may have been "
          "overwritten); StaleClient, with nothing run, as try_pin_many raises it")
      .def(
          "run_layer",
          [](Ffn& f, SlotTable& table, int64_t layer, int64_t num_experts, size_t max_experts,
             const py::object& arena_obj, const py::object& ids_obj, const py::object& weights_obj,
             const py::object& x_obj, const py::object& pairs_obj, const py::object& out_obj, bool add) -> int64_t {
            if (layer < 0) fail("layer must be >= 0, got " + std::to_string(layer));
            const LayerArgs args(f, num_experts, arena_obj, ids_obj, weights_obj, x_obj, pairs_obj, out_obj, 1);
            std::vector<float> widened(args.S);
            args.widen(0, widened.data());
            LayerScratch scratch;
            return layer_core(f, table, layer, num_experts, max_experts, args, args.ids, widened.data(), add,
                              true, scratch);
          },
          py::arg("table"), py::arg("layer"), py::arg("num_experts"), py::arg("max_experts"), py::arg("arena"),
          py::arg("ids"), py::arg("weights"), py::arg("x"), py::arg("pairs"), py::arg("out"), py::arg("add") = false,
          "A decode layer straight from its routing, in one call: the experts of `ids` [T * K] (each of "
          "0 .. num_experts - 1), ascending, pinned through `table` (compute's handle) at entries "
          "layer * num_experts + e, all or none; run_routed over their slots with `weights` (float32, or the "
          "compute dtype's 2-byte values) into `out` (added with `add`), then unpinned. The number of experts "
          "run; 0, with nothing pinned or run, where one is not resident or they are more than `max_experts`; "
          "-1 when it ran but the daemon took the pins back meanwhile; StaleClient, with nothing run, as "
          "try_pin_many raises it")
      .def(
          "run_layers",
          [](Ffn& f, const py::object& attention, SlotTable& table, size_t first, int64_t num_experts,
             size_t max_experts, const py::object& arena_obj, const py::object& ids_obj,
             const py::object& weights_obj, const py::object& x_obj, const py::object& pairs_obj,
             const py::object& out_obj, const py::object& signals_obj, const py::object& ahead_ids_obj,
             const py::object& ahead_scores_obj, double loading_wait_s, const py::object& demand_obj) -> py::tuple {
            if (!std::isfinite(loading_wait_s) || loading_wait_s < 0)
              fail("loading_wait_s must be finite and >= 0, got " + std::to_string(loading_wait_s));
            SpanDemand* demand = demand_obj.is_none() ? nullptr : &span_demand_of(demand_obj, "demand");
            if (demand != nullptr && demand->pending)
              fail("demand holds a layer handed back (DaemonClient adopts it before the next span)");
            DecodeLayerRunner runner = decode_layer_runner(attention);
            const size_t L = runner.layers;
            if (first >= L) fail("first must be below the attention's " + std::to_string(L) + " layers");
            const LayerArgs args(f, num_experts, arena_obj, ids_obj, weights_obj, x_obj, pairs_obj, out_obj, L);
            if (args.T != runner.rows)
              fail("x has " + std::to_string(args.T) + " rows but the attention's step has " +
                   std::to_string(runner.rows));
            std::vector<float> widened(args.S);
            LayerScratch scratch;
            SpanAhead ahead(signals_obj, ahead_ids_obj, ahead_scores_obj, runner, args.S, L);
            size_t layer = first;
            int64_t ran = 0;
            const char* stop = "done";
            size_t waited = 0;         // experts in flight the span waited for, and ran
            std::vector<double> waits;  // per layer that ran after such a wait, its seconds
            double lost_s = 0;         // the wait of the layer it stopped at, where that wait was in vain
            {
              py::gil_scoped_release release;
              for (; layer < L; ++layer) {
                runner.run(layer);  // writes the layer's routing (where the attention routes) and x
                args.widen(layer, widened.data());
                ahead.predict(layer, runner);
                const int64_t* ids = args.ids + layer * args.S;
                int64_t got;
                try {
                  got = layer_core(f, table, int64_t(layer), num_experts, max_experts, args, ids, widened.data(),
                                   true, false, scratch, ahead.writer(layer, ids));
                } catch (const expertcache::StaleClient&) {
                  stop = "stale";
                  break;
                }
                if (got == 0) {
                  // Its signals go now, whatever follows: the daemon learns the route and the
                  // lookahead (its prefetch for the layers ahead) before anything waits.
                  ahead.missed(layer, ids);
                  InFlight in_flight;
                  try {
                    in_flight = run_in_flight(f, table, args, ids, widened.data(), scratch, max_experts,
                                              loading_wait_s);
                  } catch (const expertcache::StaleClient&) {
                    stop = "stale";
                    break;
                  }
                  if (in_flight.applies) {
                    ahead.ring();
                    if (in_flight.ran > 0) {
                      ran += in_flight.ran;
                      if (in_flight.loading) {
                        waited += in_flight.loading;
                        waits.push_back(in_flight.wait_s);
                      }
                      continue;
                    }
                    lost_s = in_flight.wait_s;
                    got = in_flight.ran;
                  }
                  if (got == 0 && demand != nullptr) {
                    Demanded demanded;
                    try {
                      demanded = run_demanded(f, table, *demand, int64_t(layer), args, ids, widened.data(), scratch,
                                              max_experts, ahead);
                    } catch (const expertcache::StaleClient&) {
                      stop = "stale";
                      break;
                    }
                    if (demanded.posted) {
                      if (demanded.ran > 0) {
                        ran += demanded.ran;
                        continue;
                      }
                      stop = demanded.ran < 0 ? "taken" : "demand";
                      break;
                    }
                  }
                  if (got == 0) {
                    stop = "miss";
                    break;
                  }
                }
                if (got < 0) {
                  stop = "taken";
                  break;
                }
                ran += got;
              }
            }
            return py::make_tuple(layer, ran, stop, waited, py::cast(waits), lost_s);
          },
          py::arg("attention"), py::arg("table"), py::arg("first"), py::arg("num_experts"), py::arg("max_experts"),
          py::arg("arena"), py::arg("ids"), py::arg("weights"), py::arg("x"), py::arg("pairs"), py::arg("out"),
          py::arg("signals") = py::none(), py::arg("ahead_ids") = py::none(), py::arg("ahead_scores") = py::none(),
          py::arg("loading_wait_s") = 0.0, py::arg("demand") = py::none(),
          "A decode step's layers from `first` on, in one call without the GIL: per layer, the dense half of "
          "`attention` (a DecodeAttention whose step has begun), then the layer's experts as run_layer runs "
          "them (with `add`), from row `layer` of `ids` / `weights` [layers, T * K]. With `signals` (a "
          "LayerSignals of the step's rows), each layer whose experts all run writes its signals once they "
          "are pinned, before they run: its routing, and its lookahead from the later layers' routers on its "
          "MoE input (the attention's), or from `ahead_ids` / `ahead_scores` [layers, depth, T * K] as given. "
          "A layer whose experts are not all resident, none absent but some in flight (LOADING: prefetched), "
          "writes its signals and rings, runs its resident experts, waits for the others (for at most "
          "`loading_wait_s` in all; 0: never), runs them and combines the layer (table.hits counts the "
          "first, table.waited the others). With `demand` (a SpanDemand), a layer with an expert absent (or in flight "
          "past that wait) pins its resident experts, posts a demand for the others, runs them as they land and "
          "combines (run_demanded; `demand` has their sources and waits); where that wait does not end well the "
          "layer is handed back (`demand.handed_back`: its pins and demand stay) and the call stops there "
          "('demand'). Stops at the first layer whose experts do not run; for a miss, that layer's signals are "
          "written too, without the doorbell where it did not wait (signals.unrung: the layer's demand rings "
          "it). Returns (layer, experts, why, waited, waits, lost_s): `layer` the first layer whose experts did "
          "not run (its dense half did) or the number of layers; `experts` the experts run; `why` 'done', "
          "'miss' (one not resident, or more than `max_experts`: nothing of it pinned or run), 'stale' "
          "(try_pin_many raised StaleClient: nothing of it pinned or run), 'demand' (handed back) or 'taken' (it ran but the daemon "
          "took the pins back meanwhile); `waited` the experts of `experts` that were in flight when their "
          "layer came; `waits` the seconds each layer that waited for them waited; `lost_s` the seconds the "
          "layer it stopped at waited in vain (0.0 where it did not)")
      .def(
          "combine",
          [](Ffn& f, const py::object& pairs_obj, size_t top_k, const py::object& out_obj) {
            const FfnSpec& s = f.ffn->spec();
            const size_t H = f.ffn->hidden();
            auto pairs = vector_arg<float>(pairs_obj, "pairs", "float32 [T * K, H]");
            if (top_k == 0 || pairs.ndim() != 2 || size_t(pairs.shape(1)) != H || size_t(pairs.shape(0)) % top_k)
              fail("pairs must be float32 [T * top_k, " + std::to_string(H) + "]");
            const size_t T = size_t(pairs.shape(0)) / top_k;
            py::array out = storage_arg(out_obj, s.compute, T * H, "out", true);
            combine_into(pairs.data(), T, top_k, H, s.compute, static_cast<uint8_t*>(out.mutable_data()), false);
          },
          py::arg("pairs"), py::arg("top_k"), py::arg("out"),
          "out[t] = sum over k of pairs[t * top_k + k] (k in order, in float32), rounded to the compute dtype");
}
