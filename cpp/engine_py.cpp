// Python bindings of the engine, its messages and the loopback communicator. Blocking calls release the GIL.
#include <Python.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstring>

#include "comm.h"
#include "engine.h"
#include "errors.h"
#include "queues.h"

namespace amoe {

namespace py = pybind11;

namespace {

py::object opt(const at::Tensor& t) { return t.defined() ? py::cast(t) : py::none(); }

py::tuple layer_tuple(const LayerId& l) {
  return py::make_tuple(l.kind == kAttn ? "attn" : "expert", l.block, l.index);
}

std::vector<int64_t> as_i64(const at::Tensor& t, int64_t n, const char* name) {
  AMOE_CHECK_ARG(t.dim() == 1 && t.numel() == n, name << " must be 1-D with " << n << " rows");
  auto c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + n);
}

Message message_from_arrays(const at::Tensor& request_id, const at::Tensor& kind, const at::Tensor& block,
                            const at::Tensor& index, const at::Tensor& position,
                            const at::Tensor& chunk_start, const at::Tensor& chunk_len,
                            const at::Tensor& slot, const at::Tensor& expert_id, const at::Tensor& weight,
                            const at::Tensor& attn_rank, const at::Tensor& data) {
  const int64_t n = data.size(0);
  auto rq = as_i64(request_id, n, "request_id"), kd = as_i64(kind, n, "kind"), bl = as_i64(block, n, "block");
  auto ix = as_i64(index, n, "index"), ps = as_i64(position, n, "position");
  auto cs = as_i64(chunk_start, n, "chunk_start"), cl = as_i64(chunk_len, n, "chunk_len");
  auto sl = as_i64(slot, n, "slot"), ex = as_i64(expert_id, n, "expert_id"),
       ar = as_i64(attn_rank, n, "attn_rank");
  AMOE_CHECK_ARG(weight.dim() == 1 && weight.numel() == n, "weight must be 1-D with " << n << " rows");
  auto w = weight.to(at::kFloat).contiguous();
  Message m;
  m.rows.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    m.rows[i] = RowMeta{
        static_cast<uint64_t>(rq[i]),
        LayerId{static_cast<int32_t>(kd[i]), static_cast<int32_t>(bl[i]), static_cast<int32_t>(ix[i])},
        static_cast<int32_t>(ps[i]),
        static_cast<int32_t>(cs[i]),
        static_cast<int32_t>(cl[i]),
        static_cast<int32_t>(sl[i]),
        static_cast<int32_t>(ex[i]),
        w.data_ptr<float>()[i],
        static_cast<int32_t>(ar[i])};
  }
  m.header.num_rows = n;
  m.header.dtype = static_cast<int32_t>(data.scalar_type());
  m.header.hidden = data.dim() == 2 ? data.size(1) : 0;
  m.data = data;
  return m;
}

py::dict message_meta(const Message& m) {
  const int64_t n = static_cast<int64_t>(m.rows.size());
  const char* names[] = {"request_id", "kind", "block",     "index",     "position", "chunk_start",
                         "chunk_len",  "slot", "expert_id", "attn_rank", "wave"};
  constexpr int kCols = sizeof(names) / sizeof(names[0]);
  std::vector<at::Tensor> cols;
  for (int c = 0; c < kCols; ++c) cols.push_back(at::empty({n}, at::kLong));
  auto w = at::empty({n}, at::kFloat);
  for (int64_t i = 0; i < n; ++i) {
    const RowMeta& r = m.rows[i];
    const int64_t v[] = {static_cast<int64_t>(r.request_id),
                         r.layer.kind,
                         r.layer.block,
                         r.layer.index,
                         r.position,
                         r.chunk_start,
                         r.chunk_len,
                         r.slot,
                         r.expert_id,
                         r.attn_rank,
                         r.wave};
    for (int c = 0; c < kCols; ++c) cols[c].data_ptr<int64_t>()[i] = v[c];
    w.data_ptr<float>()[i] = r.weight;
  }
  py::dict d;
  for (int c = 0; c < kCols; ++c) d[names[c]] = cols[c];
  d["weight"] = w;
  return d;
}

py::bytes message_to_bytes(const Message& m) {
  std::string s(sizeof(MessageHeader) + m.rows.size() * sizeof(RowMeta), '\0');
  MessageHeader h = m.header;
  h.num_rows = static_cast<int64_t>(m.rows.size());
  std::memcpy(&s[0], &h, sizeof(h));
  if (!m.rows.empty()) std::memcpy(&s[sizeof(h)], m.rows.data(), m.rows.size() * sizeof(RowMeta));
  return py::bytes(s);
}

Message message_from_bytes(const py::bytes& b, const at::Tensor& data) {
  const std::string s = b;
  AMOE_CHECK_ARG(s.size() >= sizeof(MessageHeader), "message metadata shorter than its header");
  Message m;
  std::memcpy(&m.header, s.data(), sizeof(MessageHeader));
  AMOE_CHECK_ARG(m.header.magic == kMessageMagic && m.header.version == kMessageVersion &&
                     m.header.row_size == sizeof(RowMeta),
                 "message header has the wrong magic, version or row size");
  AMOE_CHECK_ARG(
      m.header.num_rows >= 0 &&
          s.size() == sizeof(MessageHeader) + static_cast<size_t>(m.header.num_rows) * sizeof(RowMeta),
      "message metadata length does not match its row count");
  m.rows.resize(m.header.num_rows);
  if (m.header.num_rows > 0)
    std::memcpy(m.rows.data(), s.data() + sizeof(MessageHeader), m.rows.size() * sizeof(RowMeta));
  m.data = data;
  return m;
}

py::dict stats_dict(const EngineStats& s) {
  py::dict depth, batches, rows;
  for (size_t i = 0; i < s.layers.size(); ++i) {
    auto key = layer_tuple(s.layers[i]);
    // waves: an attention layer has one queue per wave; the layer's numbers are their sums.
    auto add = [&key](py::dict& d, int64_t v) { d[key] = d.contains(key) ? d[key].cast<int64_t>() + v : v; };
    add(depth, s.depth[i]);
    add(batches, s.batches[i]);
    add(rows, s.rows[i]);
  }
  py::dict drops;
  drops["bad_message"] = s.drops.bad_message;
  drops["misrouted"] = s.drops.misrouted;
  drops["bad_row"] = s.drops.bad_row;
  drops["duplicate"] = s.drops.duplicate;
  drops["unknown_request"] = s.drops.unknown_request;
  drops["retired"] = s.drops.retired;
  py::dict d;
  d["depth"] = depth;
  d["batches"] = batches;
  d["rows"] = rows;
  d["pool_entries"] = s.pool_entries;
  d["pool_parts"] = s.pool_parts;
  d["tokens_in"] = s.tokens_in;
  d["tokens_out"] = s.tokens_out;
  d["messages_out"] = s.messages_out;
  d["dispatch_pending"] = s.dispatch_pending;
  d["errors"] = s.errors;
  d["tracked_requests"] = s.tracked_requests;
  d["polls"] = s.polls;
  d["expected_parts"] = s.expected_parts;
  d["resent_rows"] = s.resent_rows;
  d["inflight"] = s.inflight;
  d["dropped"] = drops;
  d["idle_s"] = s.idle_s;
  return d;
}

// Python may drop the last reference with the GIL held; the threads being joined may need it briefly
// (freeing a tensor that Python also referenced), so release it around the join.
void delete_engine(Engine* e) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release no_gil;
    delete e;
  } else {
    delete e;
  }
}

}  // namespace

void register_engine(py::module_& m) {
  py::class_<Message>(m, "Message", "A batch of rows for one runtime: header + RowMeta per row + one tensor.")
      .def(py::init(&message_from_arrays), py::arg("request_id"), py::arg("kind"), py::arg("block"),
           py::arg("index"), py::arg("position"), py::arg("chunk_start"), py::arg("chunk_len"),
           py::arg("slot"), py::arg("expert_id"), py::arg("weight"), py::arg("attn_rank"), py::arg("data"))
      .def_static("from_bytes", &message_from_bytes, py::arg("meta"), py::arg("data"),
                  "Rebuilds a message from to_bytes() metadata and its tensor.")
      .def("to_bytes", &message_to_bytes, "The fixed-layout metadata (header + rows) as bytes.")
      .def("meta", &message_meta, "Per-row metadata as a dict of 1-D tensors.")
      .def_property_readonly("data", [](const Message& msg) { return msg.data; })
      .def_property_readonly("num_rows", [](const Message& msg) { return msg.rows.size(); })
      .def_property_readonly("src_runtime", [](const Message& msg) { return msg.header.src_runtime; });

  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator", "A runtime's endpoint.")
      .def_property_readonly("rank", &Communicator::rank)
      .def("send", &Communicator::send, py::arg("dest"), py::arg("message"),
           py::call_guard<py::gil_scoped_release>())  // the inbox lock may be contended by engine threads
      .def(
          "recv",
          [](Communicator& c, double timeout_s) {
            std::vector<Message> out;
            {
              py::gil_scoped_release no_gil;  // waits for senders on other threads
              c.recv(&out, std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6)));
            }
            return out;
          },
          py::arg("timeout") = 0.0, "Every waiting message (waits up to timeout seconds for the first).")
      .def("interrupt", &Communicator::interrupt,
           py::call_guard<py::gil_scoped_release>(),  // the inbox lock may be contended by engine threads
           "Wakes a recv() that is waiting (it returns what is ready, perhaps nothing).");

  py::class_<LoopbackHub, std::shared_ptr<LoopbackHub>>(m, "LoopbackHub",
                                                        "In-process inboxes for N runtimes.")
      .def(py::init<int>(), py::arg("num_runtimes"))
      .def_property_readonly("num_runtimes", &LoopbackHub::num_runtimes)
      .def("communicator", &LoopbackHub::communicator, py::arg("rank"))
      .def("send", &LoopbackHub::push, py::arg("dest"), py::arg("message"),
           py::call_guard<py::gil_scoped_release>());  // the inbox lock may be contended by engine threads

  py::class_<EngineConfig>(m, "EngineConfig",
                           "Placement, model shape, scheduling policy and caps of one runtime.")
      .def(py::init<>())
      .def_readwrite("runtime_id", &EngineConfig::runtime_id)
      .def_readwrite("is_attention", &EngineConfig::is_attention)
      .def_readwrite("attn_rank", &EngineConfig::attn_rank)
      .def_readwrite("experts", &EngineConfig::experts)
      .def_readwrite("num_blocks", &EngineConfig::num_blocks)
      .def_readwrite("num_experts", &EngineConfig::num_experts)
      .def_readwrite("top_k", &EngineConfig::top_k)
      .def_readwrite("hidden", &EngineConfig::hidden)
      .def_readwrite("expert_runtime", &EngineConfig::expert_runtime)
      .def_readwrite("attn_runtime", &EngineConfig::attn_runtime)
      .def_readwrite("replicas", &EngineConfig::replicas)
      .def_readwrite("hosted", &EngineConfig::hosted)
      .def_readwrite("policy", &EngineConfig::policy)
      .def_readwrite("lookahead", &EngineConfig::lookahead)
      .def_readwrite("group_experts", &EngineConfig::group_experts)
      .def_readwrite("max_wave_hold_s", &EngineConfig::max_wave_hold_s)
      .def_readwrite("decay", &EngineConfig::decay)
      .def_readwrite("attn_cap", &EngineConfig::attn_cap)
      .def_readwrite("expert_cap", &EngineConfig::expert_cap)
      .def_readwrite("track_requests", &EngineConfig::track_requests)
      .def_readwrite("num_waves", &EngineConfig::num_waves)
      .def_readwrite("wave_group", &EngineConfig::wave_group)
      .def("validate", &EngineConfig::validate);

  py::class_<Batch, std::shared_ptr<Batch>>(m, "Batch",
                                            "Rows drained from one μ-queue, assembled contiguously.")
      .def_property_readonly("layer", [](const Batch& b) { return layer_tuple(b.layer); })
      .def_property_readonly("kind",
                             [](const Batch& b) {
                               if (b.layer.kind == kExpert) return "expert";
                               return b.is_head ? "head" : "attn";
                             })
      .def_property_readonly("block", [](const Batch& b) { return b.layer.block; })
      .def_property_readonly("index", [](const Batch& b) { return b.layer.index; })
      .def_property_readonly("top_k", [](const Batch& b) { return b.top_k; })
      .def_property_readonly("num_rows", &Batch::num_rows)
      .def("__len__", &Batch::num_rows)
      .def_property_readonly("request_ids", [](const Batch& b) { return b.request_ids; })
      .def_property_readonly("positions", [](const Batch& b) { return b.positions; })
      .def_property_readonly("attn_ranks", [](const Batch& b) { return b.attn_ranks; })
      .def_property_readonly("cu_rows", [](const Batch& b) { return opt(b.cu_rows); })
      .def_property_readonly("context_lens", [](const Batch& b) { return opt(b.context_lens); })
      .def_property_readonly("x", [](const Batch& b) { return opt(b.x); })
      .def_property_readonly("weights", [](const Batch& b) { return opt(b.weights); })
      .def_property_readonly("token_ids", [](const Batch& b) { return opt(b.token_ids); })
      .def_property_readonly("residual", [](const Batch& b) { return opt(b.residual); })
      .def_property_readonly("expert_out", [](const Batch& b) { return opt(b.expert_out); })
      .def_property_readonly("expert_ids", [](const Batch& b) { return opt(b.expert_ids); })
      .def_property_readonly("group_experts", [](const Batch& b) { return opt(b.group_experts); })
      .def("__repr__", [](const Batch& b) {
        return "Batch(" + std::string(b.layer.kind == kAttn ? (b.is_head ? "head" : "attn") : "expert") +
               ", block=" + std::to_string(b.layer.block) + ", index=" + std::to_string(b.layer.index) +
               ", rows=" + std::to_string(b.num_rows()) + ")";
      });

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine", "One runtime's execution engine (see engine.h).")
      .def(py::init([](const EngineConfig& cfg, std::shared_ptr<Communicator> comm) {
             return std::shared_ptr<Engine>(new Engine(cfg, std::move(comm)), &delete_engine);
           }),
           py::arg("config"), py::arg("communicator"))
      .def("start", &Engine::start, "Starts the receptor and dispatcher threads.")
      .def("stop", &Engine::stop,
           py::call_guard<py::gil_scoped_release>(),  // joins threads that may need the GIL
           "Stops and joins both threads; idempotent.")
      .def(
          "__enter__",
          [](Engine& e) -> Engine& {
            e.start();
            return e;
          },
          py::return_value_policy::reference)
      .def(
          "__exit__", [](Engine& e, py::args) { e.stop(); },
          py::call_guard<py::gil_scoped_release>())  // joins threads that may need the GIL
      .def_property_readonly("running", &Engine::running)
      .def("ingest", &Engine::ingest, py::arg("message"),
           py::call_guard<py::gil_scoped_release>(),  // takes the queue lock the receptor holds
           "Receptor path for one message, on the caller's thread.")
      .def("pump", &Engine::pump, py::arg("timeout") = 0.0,
           py::call_guard<py::gil_scoped_release>(),  // waits on the communicator
           "Receives and ingests waiting messages on the caller's thread (for use without start()).")
      .def("add_tokens", &Engine::add_tokens, py::arg("request_ids"), py::arg("token_ids"),
           py::arg("positions"), py::arg("chunk_starts"), py::arg("chunk_lens"),
           py::call_guard<py::gil_scoped_release>(),  // takes the queue lock the receptor holds
           "Queues token ids for ATTN (0, rank): new prompts and next decode tokens.")
      .def(
          "next_batch",
          [](Engine& e, std::optional<double> timeout) {
            // Waits for tokens from other threads, and assembles them: neither needs Python.
            py::gil_scoped_release no_gil;
            return e.next_batch(timeout ? *timeout : -1.0);
          },
          py::arg("timeout") = std::optional<double>(),
          "The next assembled Batch, or None after timeout seconds (None: until stop()) or once stopped.")
      .def("submit_expert", &Engine::submit_expert, py::arg("batch"), py::arg("out"),
           py::call_guard<py::gil_scoped_release>(),  // may dispatch inline and take engine locks
           "Hands an expert batch's output [N, H] to the dispatcher.")
      .def("submit_attention", &Engine::submit_attention, py::arg("batch"), py::arg("residual"),
           py::arg("moe_input"), py::arg("topk_ids"), py::arg("topk_weights"),
           py::call_guard<py::gil_scoped_release>(),  // may dispatch inline and take engine locks
           "Hands an attention batch's outputs to the dispatcher.")
      .def(
          "submit_head", &Engine::submit_head, py::arg("batch"), py::arg("request_ids"), py::arg("token_ids"),
          py::arg("positions"), py::arg("finished"),
          py::call_guard<py::gil_scoped_release>(),  // takes the queue lock the receptor holds
          "Hands a head batch's output on: each continuing request's sampled token re-enters ATTN (0, rank); "
          "the finished requests are no longer held.")
      .def("forget", &Engine::forget, py::arg("request_ids"), py::arg("purge") = true,
           py::call_guard<py::gil_scoped_release>(),  // takes the queue lock the receptor holds
           "Stops holding requests that ended elsewhere; with purge, drops their waiting parts and chunks.")
      .def("resend", &Engine::resend, py::arg("runtime") = -1, py::arg("older_than_s") = 0.0,
           py::call_guard<py::gil_scoped_release>(),  // takes the queue lock and sends
           "Asks again for the expert outputs still awaited from `runtime` (-1: any) sent at least "
           "older_than_s ago; returns the rows sent.")
      .def("set_replicas", &Engine::set_replicas, py::arg("block"), py::arg("expert"), py::arg("runtimes"),
           py::call_guard<py::gil_scoped_release>(),  // takes the queue lock the dispatcher holds
           "Attention runtime: rows of (block, expert) go to these replica runtimes from now on.")
      .def("replicas", &Engine::replicas, py::arg("block"), py::arg("expert"),
           py::call_guard<py::gil_scoped_release>(),  // takes the queue lock the dispatcher holds
           "Attention runtime: the replica runtimes of (block, expert).")
      .def("outstanding", &Engine::outstanding, py::arg("replicas"),
           py::call_guard<py::gil_scoped_release>(),  // takes the queue lock the receptor holds
           "Attention runtime: expert outputs still awaited from any of these (runtime, block, expert).")
      .def("host", &Engine::host, py::arg("block"), py::arg("expert"),
           py::call_guard<py::gil_scoped_release>(),  // takes the queue lock the receptor holds
           "Expert runtime: (block, expert) takes rows from now on.")
      .def("unhost", &Engine::unhost, py::arg("block"), py::arg("expert"),
           py::call_guard<py::gil_scoped_release>(),  // takes the queue lock the receptor holds
           "Expert runtime: (block, expert) takes no more rows; drops (and returns the count of) those "
           "queued.")
      .def(
          "stats",
          [](Engine& e) {
            EngineStats s;
            {
              py::gil_scoped_release no_gil;  // takes the queue lock the receptor holds
              s = e.stats();
            }
            return stats_dict(s);
          },
          "A snapshot: queue depths, pool size, tokens in/out, batches and rows per layer, idle seconds.");
}

}  // namespace amoe
