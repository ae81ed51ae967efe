// Python bindings of the ZeroMQ communicator. Blocking calls release the GIL.
#include <Python.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

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

// The backend of a group: a torch.distributed ProcessGroup (its backend for `device`) or a Backend such as
// ProcessGroupGloo made directly.
GroupPtr backend_of(const py::handle& group, const at::Device& device) {
  try {
    return group.cast<GroupPtr>();
  } catch (const py::cast_error&) {
  }
  return group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>()->getBackend(device.type());
}

// One group, or two: (up, down) carry the transfers to a higher and to a lower rank on communicators of their
// own, so the two directions between a pair never queue behind each other (NCCL runs one pair's sends and
// receives on one stream, in order: a large send each way would wait for each other's receive).
std::pair<GroupPtr, GroupPtr> groups_of(const py::object& groups, const at::Device& device, int rank,
                                        int size) {
  std::vector<GroupPtr> out;
  if (py::isinstance<py::tuple>(groups) || py::isinstance<py::list>(groups)) {
    for (auto g : groups) out.push_back(backend_of(g, device));
    AMOE_CHECK_ARG(out.size() == 2, "a group or a pair (up, down) of groups, got " << out.size());
  } else {
    out.push_back(backend_of(groups, device));
  }
  for (const auto& g : out) {
    AMOE_CHECK_ARG(g->getRank() == rank && g->getSize() == size,
                   "process group rank/size " << g->getRank() << "/" << g->getSize() << " differ from "
                                              << rank << "/" << size);
  }
  return {out.front(), out.back()};
}

std::shared_ptr<TensorPlane> make_plane(const std::string& plane, int rank, int num_runtimes,
                                        const py::object& process_group, bool peer_groups) {
  if (plane == "inline") {
    AMOE_CHECK_ARG(process_group.is_none() && !peer_groups, "the inline plane takes no process group");
    return nullptr;
  }
  AMOE_CHECK_ARG(plane == "gloo" || plane == "nccl",
                 "plane must be \"inline\", \"gloo\" or \"nccl\", got \"" << plane << "\"");
  AMOE_CHECK_ARG(process_group.is_none() == peer_groups,
                 "the " << plane << " plane needs a process_group, or peer_groups=True (not both)");
  at::Device device(at::kCPU);
  if (plane == "nccl") {
    // Read on the constructing (Python) thread: the I/O thread's current device is always 0.
    auto index = py::module_::import("torch").attr("cuda").attr("current_device")().cast<int>();
    device = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  if (peer_groups) return make_per_peer_plane(plane, device);
  auto [up, down] = groups_of(process_group, device, rank, num_runtimes);
  return make_process_group_plane(plane, up, down, device);
}

// A peer's own group(s) (two members: the lower runtime is rank 0) into the communicator's link to it.
bool set_peer_group(ZmqCommunicator& c, int peer, const py::object& groups, uint32_t generation) {
  AMOE_CHECK_ARG(peer >= 0 && peer < c.num_runtimes() && peer != c.rank(),
                 "runtime " << peer << " is not a peer");
  auto [up, down] = groups_of(groups, c.plane_device(), c.rank() < peer ? 0 : 1, 2);
  auto link = make_pair_plane(c.plane_name(), c.rank(), std::move(up), std::move(down), c.plane_device());
  py::gil_scoped_release no_gil;  // waits for the link's lock, which the I/O thread holds while posting
  return c.set_peer_link(peer, generation, std::move(link));
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
  d["cancelled"] = s.cancelled;
  d["unlinked_peers"] = s.unlinked_peers;
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
                       const py::object& process_group, double timeout_s, bool peer_groups,
                       uint32_t generation) {
             auto tp = make_plane(plane, rank, num_runtimes, process_group, peer_groups);
             return std::shared_ptr<ZmqCommunicator>(
                 new ZmqCommunicator(rank, num_runtimes, bind, std::move(tp), timeout_s, peer_groups,
                                     generation),
                 &delete_comm);
           }),
           py::arg("rank"), py::arg("num_runtimes"), py::arg("bind") = "ipc", py::arg("plane") = "inline",
           py::arg("process_group") = py::none(), py::arg("timeout_s") = 10.0, py::arg("peer_groups") = false,
           py::arg("generation") = 0)
      .def_property_readonly("endpoint", &ZmqCommunicator::endpoint, "The address really bound.")
      .def_property_readonly("plane", &ZmqCommunicator::plane_name)
      .def_property_readonly("num_runtimes", &ZmqCommunicator::num_runtimes)
      .def_property_readonly("closed", &ZmqCommunicator::closed)
      .def("connect", &ZmqCommunicator::connect, py::arg("endpoints"),
           "Connects to endpoints[r] for every runtime r and starts the I/O thread; an empty endpoint (or "
           "none past "
           "the list) is a slot no runtime holds yet, which reconnect() fills when one joins.")
      .def("close", &ZmqCommunicator::close,
           py::call_guard<py::gil_scoped_release>(),  // joins threads that may need the GIL
           "Says goodbye to peers, stops the threads, closes the sockets; idempotent.")
      .def("reconnect", &ZmqCommunicator::reconnect, py::arg("rank"), py::arg("endpoint"),
           py::arg("generation") = 0,
           py::call_guard<py::gil_scoped_release>(),  // takes the peer's lock, which senders hold
           "A peer was replaced by a new process (of `generation`) at `endpoint`: send there from now on; "
           "with "
           "peer groups, its transfers wait for the group set_peer_group() gives for that generation.")
      .def("set_peer_group", &set_peer_group, py::arg("peer"), py::arg("group"), py::arg("generation") = 0,
           "peer_groups: the group of this runtime and `peer` alone (or a pair (up, down)), reaching the "
           "peer's "
           "process of `generation`. False if it came too late (the peer was replaced again) or twice.")
      .def("unlinked_peers", &ZmqCommunicator::unlinked_peers,
           "peer_groups: the peers without a group yet (their transfers wait).")
      .def(
          "inject_alloc_failure", &ZmqCommunicator::inject_alloc_failure, py::arg("skip") = 0,
          py::arg("discard") = false,
          "Test hook: the receive buffer of the (skip + 1)-th next announced payload fails to allocate (with "
          "discard, its discard buffer too).")
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
