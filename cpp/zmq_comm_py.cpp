// Python bindings of the ZeroMQ communicator. Blocking calls release the GIL.
#include <Python.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "errors.h"
#include "plane_c10d.h"
#include "zmq_comm.h"

namespace amoe {

namespace py = pybind11;

namespace {

// Joining the I/O and lane threads may free tensors Python also referenced, which takes the GIL.
void delete_comm(ZmqCommunicator* c) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release no_gil;
    delete c;
  } else {
    delete c;
  }
}

std::shared_ptr<TensorPlane> make_plane(const std::string& plane, int rank, int num_runtimes,
                                        const py::object& process_group) {
  if (plane == "inline") {
    AMOE_CHECK_ARG(process_group.is_none(), "the inline plane takes no process_group");
    return nullptr;
  }
  AMOE_CHECK_ARG(plane == "gloo" || plane == "nccl",
                 "plane must be \"inline\", \"gloo\" or \"nccl\", got \"" << plane << "\"");
  AMOE_CHECK_ARG(!process_group.is_none(), "the " << plane << " plane needs a process_group");
  // One group, or two: (up, down) carry the transfers to a higher and to a lower rank on communicators of
  // their own, so the two directions between a pair never queue behind each other (NCCL runs one pair's
  // sends and receives on one stream, in order: a large send each way would wait for each other's receive).
  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups;
  if (py::isinstance<py::tuple>(process_group) || py::isinstance<py::list>(process_group)) {
    for (auto g : process_group) groups.push_back(g.cast<c10::intrusive_ptr<c10d::ProcessGroup>>());
    AMOE_CHECK_ARG(groups.size() == 2, "process_group must be a group or a pair (up, down) of groups");
  } else {
    groups.push_back(process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>());
  }
  for (const auto& pg : groups) {
    AMOE_CHECK_ARG(pg->getRank() == rank && pg->getSize() == num_runtimes,
                   "process group rank/size " << pg->getRank() << "/" << pg->getSize() << " differ from "
                                              << rank << "/" << num_runtimes);
  }
  at::Device device(at::kCPU);
  if (plane == "nccl") {
    // Read on the constructing (Python) thread: the I/O thread's current device is always 0.
    auto index = py::module_::import("torch").attr("cuda").attr("current_device")().cast<int>();
    device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  return make_process_group_plane(plane, groups.front(), groups.back(), device);
}

py::dict stats_dict(const CommStats& s) {
  py::dict dropped;
  for (int k = 0; k < kNumDropKinds; ++k) dropped[kDropNames[k]] = s.dropped[k];
  py::dict d;
  d["plane"] = s.plane;
  d["messages_in"] = s.messages_in;
  d["messages_out"] = s.messages_out;
  d["bytes_in"] = s.bytes_in;
  d["bytes_out"] = s.bytes_out;
  d["messages_local"] = s.messages_local;
  d["dropped"] = dropped;
  d["timeouts"] = s.timeouts;
  d["transfer_errors"] = s.transfer_errors;
  d["send_blocked"] = s.send_blocked;
  d["send_dropped"] = s.send_dropped;
  d["rejected_handshakes"] = s.rejected_handshakes;
  d["backlog"] = s.backlog;
  d["in_flight_send"] = s.in_flight_send;
  d["in_flight_recv"] = s.in_flight_recv;
  d["failed_peers"] = s.failed_peers;
  d["departed_peers"] = s.departed_peers;
  d["last_error"] = s.last_error;
  d["delayed_messages"] = s.delayed_messages;
  d["delay_s"] = s.delay_s;
  return d;
}

}  // namespace

void register_comm(py::module_& m) {
  py::class_<ZmqCommunicator, Communicator, std::shared_ptr<ZmqCommunicator>>(
      m, "ZmqCommunicator", "A runtime's endpoint between processes: ZeroMQ metadata + a tensor plane.")
      .def(py::init([](int rank, int num_runtimes, const std::string& bind, const std::string& plane,
                       const py::object& process_group, double timeout_s) {
             auto tp = make_plane(plane, rank, num_runtimes, process_group);
             return std::shared_ptr<ZmqCommunicator>(
                 new ZmqCommunicator(rank, num_runtimes, bind, std::move(tp), timeout_s), &delete_comm);
           }),
           py::arg("rank"), py::arg("num_runtimes"), py::arg("bind") = "ipc", py::arg("plane") = "inline",
           py::arg("process_group") = py::none(), py::arg("timeout_s") = 10.0)
      .def_property_readonly("endpoint", &ZmqCommunicator::endpoint, "The address really bound.")
      .def_property_readonly("plane", &ZmqCommunicator::plane_name)
      .def_property_readonly("num_runtimes", &ZmqCommunicator::num_runtimes)
      .def_property_readonly("closed", &ZmqCommunicator::closed)
      .def("connect", &ZmqCommunicator::connect, py::arg("endpoints"),
           "Connects to endpoints[r] for every runtime r and starts the I/O thread.")
      .def("close", &ZmqCommunicator::close,
           py::call_guard<py::gil_scoped_release>(),  // joins threads that may need the GIL
           "Says goodbye to peers, stops the threads, closes the sockets; idempotent.")
      .def("reconnect", &ZmqCommunicator::reconnect, py::arg("rank"), py::arg("endpoint"),
           py::call_guard<py::gil_scoped_release>(),  // takes the peer's lock, which senders hold
           "A peer was replaced by a new process at `endpoint`: send there from now on (inline plane).")
      .def(
          "listen_secure",
          [](ZmqCommunicator& c, const std::string& tcp_bind, const std::string& server_public,
             const std::string& server_secret, const std::string& client_public,
             const std::string& client_secret) {
            return c.listen_secure(tcp_bind,
                                   CurveKeys{server_public, server_secret, client_public, client_secret});
          },
          py::arg("tcp_bind"), py::arg("server_public"), py::arg("server_secret"), py::arg("client_public"),
          py::arg("client_secret"),
          "Also listen on tcp_bind with CURVE (the cluster's Z85 keys) and reach tcp:// peers with them; "
          "before connect(). Returns the endpoint bound.")
      .def_property_readonly("secure_endpoint",
                             [](const ZmqCommunicator& c) { return c.stats().secure_endpoint; })
      .def("__enter__", [](py::object self) { return self; })
      .def(
          "__exit__", [](ZmqCommunicator& c, py::args) { c.close(); },
          py::call_guard<py::gil_scoped_release>())  // joins threads that may need the GIL
      .def("set_link_delays", &ZmqCommunicator::set_link_delays, py::arg("latency_s"),
           py::arg("seconds_per_row"),
           "Emulated links, one entry per source runtime (wall seconds; zeros: none): a message of n rows "
           "from "
           "src reaches recv() latency_s[src] + n * seconds_per_row[src] after src's link is free. Before "
           "connect().")
      .def("failed_peers", &ZmqCommunicator::failed_peers,
           "Runtimes whose transfer timed out or failed (for the cluster manager).")
      .def(
          "stats", [](const ZmqCommunicator& c) { return stats_dict(c.stats()); },
          "A snapshot: messages/bytes in and out, drops by kind, timeouts, failed peers, in-flight "
          "transfers, messages held by emulated links.");
}

}  // namespace amoe
