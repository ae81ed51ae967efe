// Python bindings of the synchronous modes' barrier exchange. Every call that waits on peers, or that builds
// and sends messages, releases the GIL: the runtime's control thread (heartbeats, request admission) runs
// meanwhile.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "exchange.h"

namespace amoe {

namespace py = pybind11;

void register_exchange(py::module_& m) {
  // A silent peer is the engine-dead condition the runtime already reports (amoe.errors.EngineDeadError).
  py::object engine_dead = py::module_::import("amoe.errors").attr("EngineDeadError");
  py::register_exception<PeerSilent>(m, "PeerSilentError", engine_dead);
  m.attr("EXPERTS_FAILED") = kExpertsFailed;

  py::class_<DispatchPlan, std::shared_ptr<DispatchPlan>>(
      m, "DispatchPlan",
      "Where a batch's routed copies went (BarrierExchange.dispatch); combine() undoes it.")
      .def_property_readonly("sizes",
                             [](const DispatchPlan& p) {
                               py::dict d;
                               for (size_t i = 0; i < p.devices.size(); ++i)
                                 d[py::int_(p.devices[i])] = p.start[i + 1] - p.start[i];
                               return d;
                             })
      .def_property_readonly("shape", [](const DispatchPlan& p) { return py::make_tuple(p.n, p.k); });

  py::class_<ExpertGroup>(m, "ExpertGroup", "One expert's rows of an all-to-all, in arrival order.")
      .def_readonly("expert", &ExpertGroup::expert)
      .def_readonly("rows", &ExpertGroup::rows)
      .def_readonly("x", &ExpertGroup::x)
      .def_readonly("request_ids", &ExpertGroup::request_ids)
      .def_readonly("positions", &ExpertGroup::positions)
      .def_readonly("weights", &ExpertGroup::weights)
      .def_property_readonly("num_rows", [](const ExpertGroup& g) { return g.rows.size(0); });

  py::class_<ExpertWork, std::shared_ptr<ExpertWork>>(m, "ExpertWork",
                                                      "What an expert device received in one all-to-all.")
      .def_readonly("groups", &ExpertWork::groups)
      .def_readonly("sources", &ExpertWork::sources)
      .def_readonly("sizes", &ExpertWork::sizes)
      .def_readonly("error", &ExpertWork::error)
      .def_property_readonly("block", [](const ExpertWork& w) { return w.tag.block; });

  py::class_<BarrierExchange, std::shared_ptr<BarrierExchange>>(
      m, "BarrierExchange",
      "The barrier all-to-all of the synchronous modes over a communicator (exchange.h).")
      .def(py::init<std::shared_ptr<Communicator>, int, double, std::vector<int>, std::vector<int>>(),
           py::arg("comm"), py::arg("rank"), py::arg("timeout_s"), py::arg("expert_device"),
           py::arg("expert_devices"))
      .def_property_readonly("rank", &BarrierExchange::rank)
      .def_property_readonly("dropped", &BarrierExchange::dropped,
                             "Messages dropped: without a tag row, malformed, duplicates, wrong row counts.")
      .def_property_readonly("last_drop", &BarrierExchange::last_drop)
      .def(
          "begin",
          [](BarrierExchange& ex, int64_t iteration, const std::vector<int>& peers, int64_t rows,
             bool stopping, float step_s) { return ex.begin(iteration, peers, rows, stopping, step_s); },
          py::arg("iteration"), py::arg("peers"), py::arg("rows"), py::arg("stopping"),
          py::arg("step_s") = 0.0f, py::call_guard<py::gil_scoped_release>(),
          "BEGIN barrier: send rows, the stop flag and the step before it (seconds) to every peer → (all "
          "peers' "
          "rows, anyone stopping).")
      .def_property_readonly("slowest_step_s", &BarrierExchange::slowest_step_s,
                             "The longest step the last completed gather's sources sent before it (seconds).")
      .def(
          "signal",
          [](BarrierExchange& ex, int dest, int64_t iteration, int block, int phase, int micro, int64_t info,
             int64_t flags) { ex.signal(dest, ExchangeTag{iteration, block, phase, micro}, info, flags); },
          py::arg("dest"), py::arg("iteration"), py::arg("block"), py::arg("phase"), py::arg("micro") = 0,
          py::arg("info") = 0, py::arg("flags") = 0, py::call_guard<py::gil_scoped_release>(),
          "A payload-free message of the tag (iteration, block, phase, micro).")
      .def(
          "gather_info",
          [](BarrierExchange& ex, int64_t iteration, int block, int phase, int micro,
             const std::vector<int>& sources) {
            std::map<int, std::pair<int64_t, int64_t>> out;
            for (const auto& [src, p] : ex.gather(ExchangeTag{iteration, block, phase, micro}, sources))
              out[src] = {p.info, p.flags};
            return out;
          },
          py::arg("iteration"), py::arg("block"), py::arg("phase"), py::arg("micro"), py::arg("sources"),
          py::call_guard<py::gil_scoped_release>(),
          "Wait for the tag from every source → {source: (info, flags)}; EngineDeadError after timeout_s.")
      .def(
          "dispatch",
          [](BarrierExchange& ex, int64_t iteration, int block, int micro, const at::Tensor& moe_input,
             const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& request_ids,
             const at::Tensor& positions, float step_s) {
            return ex.dispatch(ExchangeTag{iteration, block, kDispatch, micro}, moe_input, topk_ids,
                               topk_weights, request_ids, positions, step_s);
          },
          py::arg("iteration"), py::arg("block"), py::arg("micro"), py::arg("moe_input"), py::arg("topk_ids"),
          py::arg("topk_weights"), py::arg("request_ids"), py::arg("positions"), py::arg("step_s") = 0.0f,
          py::call_guard<py::gil_scoped_release>(),
          "Dispatch half of the all-to-all: one message to every expert device → the plan combine() needs.")
      .def("combine", &BarrierExchange::combine, py::arg("plan"), py::call_guard<py::gil_scoped_release>(),
           "Wait for every expert device → expert_out [N, K, H] in router order, or None if one failed.")
      .def(
          "collect",
          [](BarrierExchange& ex, int64_t iteration, int block, int micro, const std::vector<int>& sources) {
            return ex.collect(ExchangeTag{iteration, block, kDispatch, micro}, sources);
          },
          py::arg("iteration"), py::arg("block"), py::arg("micro"), py::arg("sources"),
          py::call_guard<py::gil_scoped_release>(),
          "Expert side: wait for every source's rows → ExpertWork (rows grouped by hosted expert).")
      .def("reply", &BarrierExchange::reply, py::arg("work"), py::arg("outputs"), py::arg("failed") = false,
           py::arg("step_s") = 0.0f, py::call_guard<py::gil_scoped_release>(),
           "Send every source its outputs in the order it sent its rows (zeros flagged EXPERTS_FAILED when "
           "failed, when the work had an error, or when the outputs do not fit the groups).");
}

}  // namespace amoe
