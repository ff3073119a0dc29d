// Python binding of expertcache::SlotTable (see csrc/include/expertcache/slot_table.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bind.h"
#include "expertcache/channel.h"
#include "expertcache/layer_signals.h"
#include "expertcache/slot_table.h"
#include "span_demand.h"

namespace py = pybind11;
using expertcache::ClientChannel;
using expertcache::SignalRecord;
using expertcache::SignalType;
using expertcache::TableState;
using expertcache::SlotTable;

namespace {

// A channel is a view into its table's mapping: the Python object keeps the table alive.
struct PyChannel {
  ClientChannel channel;
  py::object table;
};

// A LayerSignals writes to a channel: the Python object keeps that channel (and its table) alive.
struct PyLayerSignals {
  std::unique_ptr<expertcache::LayerSignals> signals;
  py::object channel;
};

// A SpanDemand posts on a channel: the Python object keeps that channel (and its table) alive.
struct PySpanDemand {
  std::unique_ptr<SpanDemand> demand;
  py::object channel;
};

py::object record_to_py(const SignalRecord& r) {
  switch (r.type) {
    case SignalType::kBegin:
      return py::make_tuple("begin", r.handle, py::bytes(r.request_id));
    case SignalType::kEnd:
      return py::make_tuple("end", r.handle);
    case SignalType::kRoute: {
      py::array_t<int64_t> ex(static_cast<py::ssize_t>(r.experts[0].size()));
      auto* d = ex.mutable_data();
      for (size_t i = 0; i < r.experts[0].size(); ++i) d[i] = r.experts[0][i];
      return py::make_tuple("route", r.handle, r.token, r.layers[0], ex);
    }
    case SignalType::kAhead: {
      py::list preds;
      for (size_t k = 0; k < r.layers.size(); ++k) {
        py::array_t<int64_t> ex(static_cast<py::ssize_t>(r.experts[k].size()));
        auto* d = ex.mutable_data();
        for (size_t i = 0; i < r.experts[k].size(); ++i) d[i] = r.experts[k][i];
        py::array_t<float> sc(static_cast<py::ssize_t>(r.scores[k].size()));
        std::copy(r.scores[k].begin(), r.scores[k].end(), sc.mutable_data());
        preds.append(py::make_tuple(r.layers[k], r.depths[k], ex, sc));
      }
      return py::make_tuple("ahead", r.handle, r.token, preds);
    }
    default:
      return py::none();
  }
}

}  // namespace

expertcache::LayerSignals& layer_signals_of(const py::object& obj, const char* what) {
  if (!py::isinstance<PyLayerSignals>(obj)) throw std::invalid_argument(std::string(what) + " must be a LayerSignals");
  return *obj.cast<PyLayerSignals&>().signals;
}

SpanDemand& span_demand_of(const py::object& obj, const char* what) {
  if (!py::isinstance<PySpanDemand>(obj)) throw std::invalid_argument(std::string(what) + " must be a SpanDemand");
  return *obj.cast<PySpanDemand&>().demand;
}

void bind_slot_table(py::module_& m) {
  m.attr("ABSENT") = static_cast<uint32_t>(TableState::kAbsent);
  m.attr("LOADING") = static_cast<uint32_t>(TableState::kLoading);
  m.attr("RESIDENT") = static_cast<uint32_t>(TableState::kResident);
  m.attr("EVICTING") = static_cast<uint32_t>(TableState::kEvicting);
  m.attr("SLOT_TABLE_VERSION") = expertcache::kSlotTableVersion;
  // Subclass of RuntimeError: the handle's client ledger was reclaimed by the daemon.
  py::register_exception<expertcache::StaleClient>(m, "StaleClient", PyExc_RuntimeError);

  // The pin/unpin calls keep the GIL: they never block (a few atomics per entry). Measured for
  // try_pin_many + unpin_many of 4 entries: p50 0.69 us holding the GIL, 0.80 us releasing it.
  // reclaim_client may wait for a client inside a call, so it releases the GIL.
  m.attr("DEFAULT_RING_BYTES") = expertcache::kDefaultRingBytes;
  m.attr("MAX_REQUEST_ID_BYTES") = expertcache::kMaxRequestIdBytes;

  // The compute side's calls keep the GIL (a few stores into shared memory) except the waits;
  // the daemon side's wait_doorbell releases it.
  py::class_<PyChannel>(m, "ClientChannel")
      .def_property_readonly("max_demand", [](const PyChannel& c) { return c.channel.max_demand(); })
      .def_property_readonly("ring_bytes", [](const PyChannel& c) { return c.channel.ring_bytes(); })
      .def("post_demand", [](PyChannel& c, uint32_t layer, const std::vector<int64_t>& experts,
                             const py::bytes& trace) {
            return c.channel.post_demand(layer, experts, std::string(trace));
          }, py::arg("layer"), py::arg("experts"), py::arg("trace") = py::bytes(),
          "Posts a demand (with a traced demand's W3C context, expertcache.protocol); its seq.")
      .def("signal_begin", [](PyChannel& c, uint32_t handle, const std::string& id) {
            return c.channel.signal_begin(handle, id);
          }, py::arg("handle"), py::arg("request_id"))
      .def("signal_end", [](PyChannel& c, uint32_t handle) { return c.channel.signal_end(handle); },
           py::arg("handle"))
      .def("signal_route",
           [](PyChannel& c, uint32_t handle, uint32_t token, uint32_t layer,
              const std::vector<int64_t>& experts) {
             return c.channel.signal_route(handle, token, layer, experts);
           },
           py::arg("handle"), py::arg("token"), py::arg("layer"), py::arg("experts"))
      .def("signal_ahead",
           [](PyChannel& c, uint32_t handle, uint32_t token, const std::vector<uint32_t>& layers,
              const std::vector<uint32_t>& depths, const std::vector<std::vector<int64_t>>& experts,
              const std::vector<std::vector<float>>& scores) {
             return c.channel.signal_ahead(handle, token, layers, depths, experts, scores);
           },
           py::arg("handle"), py::arg("token"), py::arg("layers"), py::arg("depths"), py::arg("experts"),
           py::arg("scores"))
      .def("ring_doorbell", [](PyChannel& c) { c.channel.ring_doorbell(); })
      .def_property_readonly("reply_seq", [](const PyChannel& c) { return c.channel.reply_seq(); })
      .def_property_readonly("reply_status", [](const PyChannel& c) { return c.channel.reply_status(); })
      .def_property_readonly("reply_message", [](const PyChannel& c) { return c.channel.reply_message(); })
      .def_property_readonly("fail_seq", [](const PyChannel& c) { return c.channel.fail_seq(); })
      .def_property_readonly("fail_status", [](const PyChannel& c) { return c.channel.fail_status(); })
      .def_property_readonly("fail_message", [](const PyChannel& c) { return c.channel.fail_message(); })
      .def_property_readonly("notify_seq", [](const PyChannel& c) { return c.channel.notify_seq(); })
      .def_property_readonly("ring_dropped", [](const PyChannel& c) { return c.channel.ring_dropped(); })
      .def("wait_notify", [](PyChannel& c, uint32_t seen, double timeout_s, double spin_s, double grace_s) {
            py::gil_scoped_release nogil;
            return c.channel.wait_notify(seen, timeout_s, spin_s, grace_s);
          }, py::arg("seen"), py::arg("timeout_s") = -1.0, py::arg("spin_s") = 0.0, py::arg("grace_s") = 0.0,
          "Sleeps until the notify word moves past `seen`; polls first for grace_s, and for up to "
          "spin_s while the daemon's thread copies for this client (`copying`)")
      .def_property("copying", [](const PyChannel& c) { return c.channel.copying(); },
                    [](PyChannel& c, bool on) { c.channel.set_copying(on); },
                    "Whether the daemon's thread copies experts for this client now (the daemon sets it)")
      .def("wait_reply", [](PyChannel& c, uint32_t seq, uint32_t seen, double timeout_s, double spin_s,
                            double grace_s) {
            py::gil_scoped_release nogil;
            return c.channel.wait_reply(seq, seen, timeout_s, spin_s, grace_s);
          }, py::arg("seq"), py::arg("seen"), py::arg("timeout_s") = -1.0, py::arg("spin_s") = 0.0,
          py::arg("grace_s") = 0.0,
          "Waits for the answer to demand `seq`, or any notify after `seen` (read notify_seq "
          "before checking for an interrupt or the stream's end)")
      .def("source", [](const PyChannel& c, uint32_t i) { return c.channel.source(i); }, py::arg("i"))
      .def("notify", [](PyChannel& c) { c.channel.notify(); })
      .def_property_readonly("doorbell_seq", [](const PyChannel& c) { return c.channel.doorbell_seq(); })
      .def("wait_doorbell", [](PyChannel& c, uint32_t seen, double timeout_s) {
            py::gil_scoped_release nogil;
            return c.channel.wait_doorbell(seen, timeout_s);
          }, py::arg("seen"), py::arg("timeout_s") = -1.0)
      .def("take_demand", [](PyChannel& c, uint32_t taken, bool copying) -> py::object {
            uint32_t seq = 0, layer = 0;
            std::vector<uint32_t> experts;
            std::string trace;
            if (!c.channel.take_demand(taken, &seq, &layer, &experts, &trace, copying)) return py::none();
            return py::make_tuple(seq, layer, experts, py::bytes(trace));
          }, py::arg("taken"), py::arg("copying") = false,
          "The posted demand newer than `taken`: (seq, layer, experts, trace), or None. An expert "
          "of 4294967295 marks a count beyond the mailbox; trace is b'' for an untraced demand. "
          "Taking one sets `copying` to `copying` in the same call.")
      .def("reply", [](PyChannel& c, uint32_t seq, int32_t status, const std::string& message) {
            c.channel.reply(seq, status, message);
          }, py::arg("seq"), py::arg("status"), py::arg("message") = "")
      .def("fail", [](PyChannel& c, int32_t status, const std::string& message) {
            c.channel.fail(status, message);
          }, py::arg("status"), py::arg("message"))
      .def("set_source", [](PyChannel& c, uint32_t i, uint8_t tier) { c.channel.set_source(i, tier); },
           py::arg("i"), py::arg("tier"))
      .def("drain", [](PyChannel& c) {
            bool corrupt = false;
            std::vector<SignalRecord> records = c.channel.drain(&corrupt);
            py::list out;
            for (const auto& r : records) out.append(record_to_py(r));
            return py::make_tuple(out, corrupt);
          },
          "Every complete signal record since the last drain, as tuples ('begin', handle, id bytes) "
          "/ ('end', handle) / ('route', handle, token, layer, experts int64) / ('ahead', handle, "
          "token, [(layer, depth, experts int64, scores float32)]), and whether a malformed record "
          "ended the drain (the rest was skipped)")
      .def("reset", [](PyChannel& c) { c.channel.reset(); });

  py::class_<PySpanDemand>(m, "SpanDemand")
      .def(py::init([](const py::object& channel, double timeout_s, double deadline_s, double spin_s,
                       double reply_grace_s, double landing_grace_s, bool gather) {
             if (!py::isinstance<PyChannel>(channel)) throw std::invalid_argument("channel must be a ClientChannel");
             const auto check = [](double v, const char* what) {
               if (!(v >= 0))
                 throw std::invalid_argument(std::string(what) + " must be >= 0, got " + std::to_string(v));
             };
             check(timeout_s, "timeout_s");
             check(deadline_s, "deadline_s");
             check(spin_s, "spin_s");
             check(reply_grace_s, "reply_grace_s");
             check(landing_grace_s, "landing_grace_s");
             auto out = std::make_unique<PySpanDemand>();
             out->demand = std::make_unique<SpanDemand>(channel.cast<PyChannel&>().channel, timeout_s, deadline_s,
                                                        spin_s, reply_grace_s, landing_grace_s, gather);
             out->channel = channel;
             return out;
           }),
           py::arg("channel"), py::arg("timeout_s"), py::arg("deadline_s"), py::arg("spin_s") = 0.0,
           py::arg("reply_grace_s") = 0.0, py::arg("landing_grace_s") = 0.0, py::arg("gather") = false,
           "A native span's demands on `channel` (ExpertFfn.run_layers' `demand`): a layer with an expert not "
           "resident pins the resident ones, posts a demand for the others and waits for them there, each wait "
           "at most `timeout_s` and none past `deadline_s` from now (>= 1e9: none), polling as "
           "ClientChannel.wait_reply (`reply_grace_s`) and wait_notify (`landing_grace_s`) do, `spin_s` while the "
           "daemon copies; with `gather`, misses run once all landed. A wait that does not end well hands the "
           "layer back (`handed_back`)")
      .def("stop", [](PySpanDemand& d) { d.demand->stop(); },
           "Ends a wait in progress (another thread: an interrupt, the stream's end): its layer is handed back, "
           "and no later layer of the call posts a demand")
      .def_property_readonly("stopped", [](const PySpanDemand& d) { return d.demand->is_stopped(); })
      .def_property_readonly("sources", [](const PySpanDemand& d) {
            return std::vector<int>(d.demand->sources.begin(), d.demand->sources.end());
          }, "Per expert demanded and run in the call, in order, its source tier (the channel's codes)")
      .def_property_readonly("waits", [](const PySpanDemand& d) { return d.demand->waits; },
                             "Per layer demanded and run in the call, the seconds it waited for its misses (from its post until "
                             "it ran, less its experts' runs)")
      .def_property_readonly("handed_back", [](const PySpanDemand& d) -> py::object {
            const SpanDemand& x = *d.demand;
            if (!x.pending) return py::none();
            return py::make_tuple(x.layer, x.seq, x.fail_seen, x.hit_experts, x.hit_slots, x.misses, x.elapsed_s);
          },
          "The layer the call handed back, or None: (layer, seq, fail_seen, hit experts, their slots, misses, "
          "elapsed_s): its resident experts pinned (uncounted in held), demand `seq` posted for the misses "
          "(the channel's fail_seq was fail_seen then), waited for elapsed_s");

  py::class_<PyLayerSignals>(m, "LayerSignals")
      .def(py::init([](const py::object& channel, const std::vector<int64_t>& handles,
                       const std::vector<int64_t>& tokens, size_t top_k, size_t layers, size_t depth,
                       const std::vector<int64_t>& ahead) {
             if (!py::isinstance<PyChannel>(channel)) throw std::invalid_argument("channel must be a ClientChannel");
             const auto u32 = [](const std::vector<int64_t>& v, const char* what) {
               std::vector<uint32_t> out;
               for (int64_t x : v) {
                 if (x < 0 || x > int64_t(UINT32_MAX))
                   throw std::invalid_argument(std::string(what) + " " + std::to_string(x) + " is outside 0 .. 2**32 - 1");
                 out.push_back(uint32_t(x));
               }
               return out;
             };
             for (int64_t a : ahead)
               if (a < -1 || a >= int64_t(layers))
                 throw std::invalid_argument("lookahead layer " + std::to_string(a) + " is outside -1 .. " +
                                             std::to_string(layers - 1));
             auto out = std::make_unique<PyLayerSignals>();
             out->signals = std::make_unique<expertcache::LayerSignals>(
                 channel.cast<PyChannel&>().channel, u32(handles, "handle"), u32(tokens, "token"), top_k, layers,
                 depth, ahead);
             out->channel = channel;
             return out;
           }),
           py::arg("channel"), py::arg("handles"), py::arg("tokens"), py::arg("top_k"), py::arg("layers"),
           py::arg("depth"), py::arg("ahead"),
           "A decode step's signals for the layers ExpertFfn.run_layers runs (layer_signals.h): per row its "
           "request's channel `handles` and `tokens`; `ahead` [layers * depth] the layer predicted at depth "
           "d + 1 from layer l (-1: none)")
      .def_property_readonly("written", [](const PyLayerSignals& s) { return s.signals->written(); })
      .def_property_readonly("dropped", [](const PyLayerSignals& s) { return s.signals->dropped(); })
      .def_property_readonly("unrung", [](const PyLayerSignals& s) { return s.signals->unrung(); },
                             "Records were written since the doorbell last rang (a miss layer's: its demand rings)")
      .def(
          "write",
          [](PyLayerSignals& s, size_t layer, const py::array_t<int64_t, py::array::c_style>& ids,
             const py::object& ahead_ids, const py::object& ahead_scores, bool as_given, bool ring) {
            const size_t n = s.signals->rows() * s.signals->top_k();
            if (size_t(ids.size()) != n)
              throw std::invalid_argument("ids must hold rows * top_k = " + std::to_string(n) + " values");
            std::vector<py::array_t<int64_t, py::array::c_style>> keep_ids;
            std::vector<py::array_t<float, py::array::c_style>> keep_scores;
            std::vector<const int64_t*> pid;
            std::vector<const float*> psc;
            for (const auto& a : ahead_ids) keep_ids.push_back(a.cast<py::array_t<int64_t, py::array::c_style>>());
            for (const auto& a : ahead_scores) keep_scores.push_back(a.cast<py::array_t<float, py::array::c_style>>());
            if (keep_ids.size() != keep_scores.size() || keep_ids.size() > s.signals->depth())
              throw std::invalid_argument("ahead_ids and ahead_scores need one array each per depth");
            for (size_t d = 0; d < keep_ids.size(); ++d) {
              if (size_t(keep_ids[d].size()) != n || size_t(keep_scores[d].size()) != n)
                throw std::invalid_argument("each depth's ahead_ids and ahead_scores hold as many values as ids");
              pid.push_back(keep_ids[d].data());
              psc.push_back(keep_scores[d].data());
            }
            if (layer >= s.signals->layers()) throw std::invalid_argument("layer is outside the signals' layers");
            s.signals->write(layer, ids.data(), pid, psc, as_given, ring);
          },
          py::arg("layer"), py::arg("ids"), py::arg("ahead_ids"), py::arg("ahead_scores"), py::arg("as_given") = false,
          py::arg("ring") = true,
          "One layer's records (what run_layers writes for a layer it runs): `ids` [rows * top_k], and per "
          "depth `ahead_ids` / `ahead_scores` [rows * top_k] (router weights, or final scores `as_given`)");

  py::class_<SlotTable>(m, "SlotTable")
      .def_static("create", &SlotTable::create, py::arg("name"), py::arg("num_entries"),
                  py::arg("num_slots"), py::arg("num_clients") = expertcache::kDefaultClients,
                  py::arg("max_demand") = 0, py::arg("ring_bytes") = expertcache::kDefaultRingBytes,
                  "The daemon's table (memfds, no file): see slot_table.h")
      .def_static("attach", &SlotTable::attach, py::arg("table_fd"), py::arg("region_fd"),
                  py::arg("client"), py::arg("epoch"),
                  "Compute's handle: the table read-only and its own region, from the daemon's fds "
                  "(the caller keeps and closes them)")
      .def_static("table_bytes", &SlotTable::table_bytes, py::arg("num_entries"))
      .def_static("region_bytes", &SlotTable::region_bytes, py::arg("num_entries"),
                  py::arg("max_demand") = 0, py::arg("ring_bytes") = expertcache::kDefaultRingBytes)
      .def_property_readonly("is_owner", &SlotTable::is_owner)
      .def("table_fd", &SlotTable::table_fd)
      .def("client_fd", &SlotTable::client_fd, py::arg("client"))
      .def("audit_client", [](const SlotTable& t, int64_t client) {
            expertcache::ClientAudit a;
            {
              py::gil_scoped_release nogil;
              a = t.audit_client(client);
            }
            return py::make_tuple(a.pinned_entries, a.stray);
          }, py::arg("client"),
          "(entries the client's region pins, up to 64 of those that are neither LOADING nor RESIDENT)")
      .def("channel", [](py::object self, int64_t client) {
            SlotTable& t = self.cast<SlotTable&>();
            return PyChannel{t.channel(client), self};
          }, py::arg("client"))
      // The per-client mutex may be held by a reclaim waiting (bounded) for a client: no GIL.
      .def("hold_for_client", &SlotTable::hold_for_client, py::arg("client"), py::arg("epoch"),
           py::arg("entry"), py::call_guard<py::gil_scoped_release>())
      .def("unhold_for_client", &SlotTable::unhold_for_client, py::arg("client"), py::arg("epoch"),
           py::arg("entry"), py::call_guard<py::gil_scoped_release>())
      .def("claim_channel", &SlotTable::claim_channel, py::arg("client"),
           py::call_guard<py::gil_scoped_release>(),
           "A new, empty region for ledger `client` (the old one is detached); returns its epoch")
      .def_property("signals_wanted", &SlotTable::signals_wanted, &SlotTable::set_signals_wanted)
      .def_property_readonly("max_demand", &SlotTable::max_demand)
      .def_property_readonly("ring_bytes", &SlotTable::ring_bytes)
      .def("resident_slots", &SlotTable::resident_slots, py::arg("entries"))
      .def_property_readonly("bound_client", &SlotTable::bound_client)
      .def("try_pin", &SlotTable::try_pin, py::arg("entry"))
      .def("try_pin_many", [](SlotTable& t, const std::vector<int64_t>& entries) { return t.try_pin_many(entries); },
           py::arg("entries"))
      .def("unpin", &SlotTable::unpin, py::arg("entry"))
      .def("unpin_many", &SlotTable::unpin_many, py::arg("entries"))
      .def("client_epoch", &SlotTable::client_epoch, py::arg("client"))
      .def("client_pins", &SlotTable::client_pins, py::arg("client"), py::arg("entry"))
      .def("reclaim_client", &SlotTable::reclaim_client, py::arg("client"),
           py::call_guard<py::gil_scoped_release>())
      .def("accessed_since", &SlotTable::accessed_since, py::arg("since"),
           "(entries pinned through the regions with a stamp in (since, until], in stamp order; until)")
      .def_property_readonly("hits", &SlotTable::hits)
      .def_property_readonly("waited", &SlotTable::waited,
                             "Experts in flight compute waited for and pinned itself (misses no demand "
                             "told the daemon of): this client's (compute side), every client's so far "
                             "(daemon side)")
      .def("count_waited", &SlotTable::count_waited, py::arg("n"),
           "Counts `n` experts this client waited for in flight and pinned itself (compute side; "
           "ExpertFfn.run_layers counts its own)")
      .def_property_readonly("num_clients", &SlotTable::num_clients)
      .def("begin_load", &SlotTable::begin_load, py::arg("entry"), py::arg("slot"))
      .def("finish_load", &SlotTable::finish_load, py::arg("entry"))
      .def("abort_load", &SlotTable::abort_load, py::arg("entry"))
      .def("try_evict", &SlotTable::try_evict, py::arg("entry"))
      .def("hold", &SlotTable::hold, py::arg("entry"), py::arg("n") = 1)
      .def("wait_resident", &SlotTable::wait_resident, py::arg("entry"), py::arg("timeout_s"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("unpin_seq", &SlotTable::unpin_seq)
      .def("wait_unpin", &SlotTable::wait_unpin, py::arg("seen"), py::arg("timeout_s") = -1.0,
           py::call_guard<py::gil_scoped_release>())
      .def("wake_unpin_waiters", &SlotTable::wake_unpin_waiters)
      .def("states", &SlotTable::states)
      .def("slots", &SlotTable::slots)
      .def("state", [](const SlotTable& t, int64_t e) { return static_cast<uint32_t>(t.state(e)); },
           py::arg("entry"))
      .def("pins", &SlotTable::pins, py::arg("entry"))
      .def("slot", &SlotTable::slot, py::arg("entry"))
      .def("generation", &SlotTable::generation, py::arg("entry"))
      .def_property_readonly("num_entries", &SlotTable::num_entries)
      .def_property_readonly("num_slots", &SlotTable::num_slots)
      .def_property_readonly("name", &SlotTable::name)
      .def("__repr__", [](const SlotTable& t) {
        return "<SlotTable " + t.name() + " entries=" + std::to_string(t.num_entries()) +
               " slots=" + std::to_string(t.num_slots()) + ">";
      });

}
