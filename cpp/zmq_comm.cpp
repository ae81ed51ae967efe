// ZmqCommunicator: construction, connect/close, outbound sends (with the backlog the I/O thread retries) and
// statistics. The inbound half (the I/O thread and the lane threads) is in zmq_inbound.cpp; the inbox recv()
// drains, with its emulated links, in zmq_inbox.cpp.
#include "zmq_comm.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "errors.h"
#include "zmq_api.h"
#include "zmq_comm_internal.h"

namespace amoe {

namespace {

// The payload as the plane moves it: contiguous, on the plane's device. A GPU tensor bound for a host plane
// (the inline ZeroMQ frame, gloo) is staged through pinned host memory: a DMA copy, not the driver's pageable
// bounce. The copy blocks this (dispatching) thread until the bytes are on the host, so the frame never sees
// stale data.
at::Tensor stage_for_plane(const at::Tensor& data, const at::Device& device) {
  if (data.device() == device) return data.contiguous();
  if (data.is_cuda() && device.is_cpu()) {
    auto host = at::empty(data.sizes(), data.options().device(at::kCPU).pinned_memory(true));
    host.copy_(data);
    return host;
  }
  return data.to(device).contiguous();
}

constexpr int kHwm = 1000;                                // ZeroMQ queue depth (messages) per socket
constexpr int kLingerMs = 200;                            // how long close() lets queued goodbyes leave
constexpr size_t kRecvPoolIdleBytes = size_t{128} << 20;  // warm receive buffers kept between messages

std::string zmq_error(const std::string& what) { return what + ": " + zmq_strerror(zmq_errno()); }

std::string unique_ipc_endpoint() {
  std::random_device rd;
  char name[64];
  std::snprintf(name, sizeof(name), "amoe-%d-%08x%08x.ipc", static_cast<int>(getpid()), rd(), rd());
  std::string dir = std::filesystem::temp_directory_path().string();
  if (dir.size() + sizeof(name) > 100) dir = "/tmp";  // sun_path holds 108 bytes
  return "ipc://" + dir + "/" + name;
}

// "tcp://host:0" means any free port; ZeroMQ spells that "*".
std::string bind_address(const std::string& bind) {
  if (bind == "ipc") return unique_ipc_endpoint();
  if (bind.rfind("tcp://", 0) == 0 && bind.size() > 2 && bind.compare(bind.size() - 2, 2, ":0") == 0)
    return bind.substr(0, bind.size() - 1) + "*";
  return bind;
}

void release_tensor(void*, void* hint) { delete static_cast<at::Tensor*>(hint); }

void set_int(void* sock, int option, int value) { zmq_setsockopt(sock, option, &value, sizeof(value)); }

}  // namespace

using zmq_internal::item_size;
using zmq_internal::kAnyGeneration;
using zmq_internal::kMetaBytes;
using zmq_internal::kZeroCopyMin;

ZmqCommunicator::ZmqCommunicator(int rank, int num_runtimes, const std::string& bind,
                                 std::shared_ptr<TensorPlane> plane, double timeout_s, bool per_peer,
                                 uint32_t generation)
    : rank_(rank),
      num_runtimes_(num_runtimes),
      plane_(std::move(plane)),
      timeout_(std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6))),
      per_peer_(per_peer),
      generation_(generation) {
  AMOE_CHECK_ARG(num_runtimes > 0 && rank >= 0 && rank < num_runtimes,
                 "rank " << rank << " is outside [0, " << num_runtimes << ")");
  AMOE_CHECK_ARG(timeout_s > 0, "timeout_s must be positive");
  AMOE_CHECK_ARG(plane_ || !per_peer, "per-peer links need a process-group plane");
  const std::string addr = bind_address(bind);
  AMOE_CHECK_ARG(addr.rfind("ipc://", 0) == 0 || addr.rfind("tcp://", 0) == 0,
                 "bind must be \"ipc\", ipc://path or tcp://host:port, got " << bind);
  ctx_ = zmq_ctx_new();
  pull_ = zmq_socket(ctx_, ZMQ_PULL);
  set_int(pull_, ZMQ_RCVHWM, kHwm);
  set_int(pull_, ZMQ_LINGER, 0);
  if (zmq_bind(pull_, addr.c_str()) != 0) {
    const std::string err = zmq_error("cannot bind " + addr);
    zmq_close(pull_);
    zmq_ctx_term(ctx_);
    AMOE_CHECK_ARG(false, err);
  }
  // Disconnect events tell a peer's death from its goodbye (ZMQ_SRCFD ties a connection to a rank); failed
  // handshakes are peers refused by CURVE (listen_secure), counted.
  const std::string monitor_addr =
      "inproc://amoe-monitor-" + std::to_string(reinterpret_cast<uintptr_t>(this));
  zmq_socket_monitor(pull_, monitor_addr.c_str(),
                     ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                         ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH);
  monitor_ = zmq_socket(ctx_, ZMQ_PAIR);
  set_int(monitor_, ZMQ_LINGER, 0);
  zmq_connect(monitor_, monitor_addr.c_str());
  char last[512];
  size_t len = sizeof(last);
  zmq_getsockopt(pull_, ZMQ_LAST_ENDPOINT, last, &len);
  endpoint_ = last;
  if (endpoint_.rfind("ipc://", 0) == 0) ipc_path_ = endpoint_.substr(6);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (plane_ && plane_->device().is_cpu()) recv_pool_ = std::make_shared<BufferPool>(kRecvPoolIdleBytes);
  // Every slot's Peer (and, two-phase, its Lane objects) exists from here on: the vectors never change size
  // or entries again, so the threads that index them need no lock for that; a slot no runtime holds yet has
  // no socket and no lane thread.
  peers_.resize(num_runtimes_);
  send_lanes_.resize(num_runtimes_);
  recv_lanes_.resize(num_runtimes_);
  for (int r = 0; r < num_runtimes_; ++r) {
    if (r == rank_) continue;
    peers_[r] = std::make_unique<Peer>();
    if (plane_) {
      send_lanes_[r] = std::make_unique<Lane>(this);
      recv_lanes_[r] = std::make_unique<Lane>(this);
    }
  }
  if (plane_) {
    links_.resize(num_runtimes_);
    for (int r = 0; r < num_runtimes_; ++r) {
      if (r == rank_) continue;
      links_[r] = std::make_unique<Link>();
      if (!per_peer_) links_[r]->plane = plane_;  // one group of every runtime: the link of each
    }
  }
}

ZmqCommunicator::~ZmqCommunicator() { close(); }

std::string ZmqCommunicator::plane_name() const { return plane_ ? plane_->name() : "inline"; }

at::Device ZmqCommunicator::plane_device() const { return plane_ ? plane_->device() : at::Device(at::kCPU); }

void ZmqCommunicator::connect(const std::vector<std::string>& endpoints) {
  std::lock_guard<std::mutex> lock(lifecycle_mu_);  // one connect/close transition at a time
  AMOE_CHECK_ARG(!closing_.load(), "communicator is closed");
  AMOE_CHECK_ARG(!connected_.load(), "communicator is already connected");
  AMOE_CHECK_ARG(static_cast<int>(endpoints.size()) <= num_runtimes_,
                 "connect takes at most " << num_runtimes_ << " endpoints, got " << endpoints.size());
  // An empty endpoint (or none) is a slot no runtime holds yet: reconnect() fills it when one joins.
  auto named = [&](int r) {
    return r != rank_ && r < static_cast<int>(endpoints.size()) && !endpoints[r].empty();
  };
  for (int r = 0; r < num_runtimes_; ++r) {
    if (r == rank_) continue;
    Peer& peer = *peers_[r];
    std::lock_guard<std::mutex> peer_lock(peer.mu);  // see Peer::mu
    if (!named(r)) {
      peer.closed = true;  // sends to an empty slot are dropped and counted, never parked
      continue;
    }
    try {
      peer.sock = open_peer(r, endpoints[r]);
    } catch (...) {
      for (auto& p : peers_) {
        if (!p || !p->sock) continue;
        zmq_close(p->sock);
        p->sock = nullptr;
        p->present.store(false, std::memory_order_relaxed);
      }
      throw;
    }
    peer.present.store(true, std::memory_order_relaxed);
  }
  {
    // Held while connected_ flips, so a send() racing with connect() either queues before the flush
    // below or sends after it: per-peer order holds.
    std::lock_guard<std::mutex> out_lock(out_mu_);
    for (int r = 0; r < num_runtimes_; ++r) {
      if (named(r)) send_or_park(*peers_[r], hello_to(r));
    }
    for (auto& out : out_) send_or_park(*peers_[out.dest], std::move(out));
    out_.clear();
    connected_.store(true);
  }
  // Starting the thread is a full barrier: the PULL socket made by the constructor now belongs to it.
  io_ = std::thread([this] { io_loop(); });
}

// The first message on a connection: it tells the peer this rank is (back) there.
ZmqCommunicator::Outgoing ZmqCommunicator::hello_to(int dest) const {
  Outgoing hello;
  hello.dest = dest;
  hello.th.kind = kHelloTransfer;
  hello.th.src = rank_;
  hello.th.generation = static_cast<uint8_t>(generation_);
  hello.frame0.assign(sizeof(TransferHeader), '\0');
  hello.queued = Clock::now();
  return hello;
}

void* ZmqCommunicator::open_peer(int rank, const std::string& endpoint) {
  void* sock = zmq_socket(ctx_, ZMQ_PUSH);
  set_int(sock, ZMQ_SNDHWM, kHwm);
  set_int(sock, ZMQ_LINGER, kLingerMs);
  if (curve_ && endpoint.rfind("tcp://", 0) == 0) {  // another host: only over CURVE
    zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, curve_->server_public.c_str(), 40);
    zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, curve_->client_public.c_str(), 40);
    zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, curve_->client_secret.c_str(), 40);
  }
  if (zmq_connect(sock, endpoint.c_str()) != 0) {
    const std::string err =
        zmq_error("cannot connect to runtime " + std::to_string(rank) + " at " + endpoint);
    zmq_close(sock);
    AMOE_CHECK_ARG(false, err);
  }
  return sock;
}

std::string ZmqCommunicator::listen_secure(const std::string& tcp_bind, const CurveKeys& keys) {
  std::lock_guard<std::mutex> lock(lifecycle_mu_);
  AMOE_CHECK_ARG(!connected_.load() && !closing_.load(), "listen_secure comes before connect()");
  AMOE_CHECK_ARG(!curve_, "listen_secure was already called");
  AMOE_CHECK_ARG(tcp_bind.rfind("tcp://", 0) == 0, "listen_secure needs tcp://host:port, got " << tcp_bind);
  for (const std::string* key :
       {&keys.server_public, &keys.server_secret, &keys.client_public, &keys.client_secret})
    AMOE_CHECK_ARG(key->size() == 40, "CURVE keys are 40 Z85 characters");
  // ZeroMQ copies a socket's options into each endpoint when it is bound: this one serves CURVE, the first
  // (ipc, for peers on this host) stays as it was.
  const int on = 1, off = 0;
  zmq_setsockopt(pull_, ZMQ_CURVE_SERVER, &on, sizeof(on));
  zmq_setsockopt(pull_, ZMQ_CURVE_SECRETKEY, keys.server_secret.c_str(), 40);
  const std::string addr = bind_address(tcp_bind);
  const int rc = zmq_bind(pull_, addr.c_str());
  const std::string err = rc != 0 ? zmq_error("cannot bind " + addr) : "";
  zmq_setsockopt(pull_, ZMQ_CURVE_SERVER, &off, sizeof(off));
  AMOE_CHECK_ARG(rc == 0, err);
  char last[512];
  size_t len = sizeof(last);
  zmq_getsockopt(pull_, ZMQ_LAST_ENDPOINT, last, &len);
  secure_endpoint_ = last;
  curve_ = std::make_unique<CurveKeys>(keys);
  return secure_endpoint_;
}

void ZmqCommunicator::reconnect(int rank, const std::string& endpoint, uint32_t generation) {
  std::lock_guard<std::mutex> lock(lifecycle_mu_);  // not during connect() or close()
  AMOE_CHECK_ARG(connected_.load() && !closing_.load(), "reconnect needs a connected communicator");
  AMOE_CHECK_ARG(rank >= 0 && rank < num_runtimes_ && rank != rank_, "runtime " << rank << " is not a peer");
  // One group of every runtime has fixed members: a replaced peer could not take its old place in it.
  AMOE_CHECK_ARG(!plane_ || per_peer_,
                 "a replaced runtime can rejoin a " << plane_->name() << " plane only with per-peer groups");
  if (per_peer_) {
    // The pair's groups are keyed by both generations: the same one again would meet the old process's
    // rendezvous (a launcher that did not pass the replacement its generation).
    std::lock_guard<std::mutex> link_lock(links_[rank]->mu);  // see Link::mu
    AMOE_CHECK_ARG(links_[rank]->generation == kAnyGeneration || links_[rank]->generation != generation,
                   "runtime " << rank << " was replaced by a process of the same generation " << generation);
  }
  void* sock = open_peer(rank, endpoint);
  Peer& peer = *peers_[rank];
  std::shared_ptr<TensorPlane> old_link;
  uint64_t epoch = 0;
  {
    std::lock_guard<std::mutex> peer_lock(peer.mu);  // see Peer::mu
    // What waited for the old process goes nowhere: its owner asks again (Engine::resend).
    backlog_.fetch_sub(static_cast<int64_t>(peer.backlog.size()), std::memory_order_relaxed);
    send_dropped_.fetch_add(static_cast<int64_t>(peer.backlog.size()), std::memory_order_relaxed);
    peer.backlog.clear();
    if (peer.sock != nullptr) {  // nullptr: an empty slot a runtime joins now
      set_int(peer.sock, ZMQ_LINGER, 0);
      zmq_close(peer.sock);
    }
    peer.sock = sock;
    peer.present.store(true, std::memory_order_relaxed);
    peer.next_seq = 0;  // the new process numbers (and tags) from 0 too
    peer.closed = false;
    peer.generation.store(generation, std::memory_order_relaxed);  // see Peer::generation
    if (per_peer_) {
      Link& link = *links_[rank];
      std::lock_guard<std::mutex> link_lock(link.mu);  // see Link::mu; inside the peer's, as in try_send()
      old_link = std::move(link.plane);
      link.plane.reset();  // two-phase sends to it wait in the backlog until set_peer_link()
      link.generation = generation;
      epoch = ++link.epoch;
      link.broken = false;
      const auto n = static_cast<int64_t>(link.deferred.size());  // the old process's: never coming
      link.deferred.clear();
      in_flight_recv_.fetch_sub(n, std::memory_order_relaxed);
      cancelled_.fetch_add(n, std::memory_order_relaxed);
    }
    Outgoing hello = hello_to(rank);
    if (!try_send(peer, hello)) {
      peer.backlog.push_back(std::move(hello));
      backlog_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (per_peer_) {  // the old link's transfers end now; finish() counts them cancelled, not failed
    send_lanes_[rank]->cancel(epoch);
    recv_lanes_[rank]->cancel(epoch);
  }
  {
    std::lock_guard<std::mutex> peers_lock(peers_mu_);  // stats() reads the failed and departed sets
    failed_.erase(rank);
    departed_.erase(std::remove(departed_.begin(), departed_.end(), rank), departed_.end());
  }
  wake_io();
  old_link.reset();  // last, outside every lock: a group's teardown joins its threads
}

bool ZmqCommunicator::set_peer_link(int peer, uint32_t generation, std::shared_ptr<TensorPlane> link) {
  std::lock_guard<std::mutex> lock(lifecycle_mu_);  // not during close(), which takes the lanes down
  AMOE_CHECK_ARG(per_peer_, "set_peer_link needs a communicator with per-peer groups");
  AMOE_CHECK_ARG(peer >= 0 && peer < num_runtimes_ && peer != rank_, "runtime " << peer << " is not a peer");
  AMOE_CHECK_ARG(link != nullptr, "set_peer_link needs a link");
  if (closing_.load()) return false;
  Link& l = *links_[peer];
  {
    std::lock_guard<std::mutex> link_lock(l.mu);  // see Link::mu
    if (l.plane || (l.generation != kAnyGeneration && l.generation != generation)) return false;
    l.plane = std::move(link);
    l.generation = generation;
    while (!l.deferred.empty()) {  // in announcement order, before any later arrival (it waits for l.mu)
      Deferred d = std::move(l.deferred.front());
      l.deferred.pop_front();
      in_flight_recv_.fetch_sub(1, std::memory_order_relaxed);
      post_on_link(l, d.th, std::move(d.msg));
    }
  }
  wake_io();  // sends parked for the link go now
  return true;
}

std::vector<int> ZmqCommunicator::unlinked_peers() const {
  std::vector<int> out;
  if (!per_peer_) return out;
  for (int r = 0; r < num_runtimes_; ++r) {
    if (r == rank_ || !peers_[r]->present.load(std::memory_order_relaxed)) continue;
    std::lock_guard<std::mutex> lock(links_[r]->mu);  // see Link::mu
    if (!links_[r]->plane) out.push_back(r);
  }
  return out;
}

void ZmqCommunicator::inject_alloc_failure(int64_t skip, bool discard) {
  AMOE_CHECK_ARG(skip >= 0, "skip must be >= 0");
  alloc_fault_discard_.store(discard);  // seq_cst: read after the countdown below reaches it
  alloc_fault_skip_.store(skip);
}

void ZmqCommunicator::close() {
  std::lock_guard<std::mutex> lock(lifecycle_mu_);  // a second close() waits for the first, then no-ops
  if (closing_.load()) return;
  closing_.store(true);  // send() refuses from here on
  {
    std::lock_guard<std::mutex> out_lock(out_mu_);                                          // see connect()
    send_dropped_.fetch_add(static_cast<int64_t>(out_.size()), std::memory_order_relaxed);  // never connected
    out_.clear();
  }
  if (connected_.load()) {
    for (int r = 0; r < num_runtimes_; ++r) {
      if (r == rank_ || !peers_[r]->present.load(std::memory_order_relaxed)) continue;
      Outgoing bye;  // after every message sent before: the peer's mutex orders them
      bye.dest = r;
      bye.th.kind = kByeTransfer;
      bye.th.src = rank_;
      bye.th.generation = static_cast<uint8_t>(generation_);
      bye.frame0.assign(sizeof(TransferHeader), '\0');
      bye.queued = Clock::now();
      send_or_park(*peers_[r], std::move(bye));
    }
  }
  wake_io();
  if (io_.joinable()) {
    io_.join();  // the I/O thread sends what is queued, then closes its sockets
  } else {
    zmq_socket_monitor(pull_, nullptr, 0);
    zmq_close(monitor_);
    zmq_close(pull_);
  }
  pull_ = monitor_ = nullptr;
  for (auto* lanes : {&send_lanes_, &recv_lanes_}) {
    for (auto& l : *lanes) {
      if (l) l->abort_all();
    }
    for (auto& l : *lanes) l.reset();  // joins
  }
  if (recv_pool_) recv_pool_->close();  // tensors still out free their blocks when they go
  zmq_ctx_term(ctx_);                   // waits up to the linger period for queued goodbyes
  ctx_ = nullptr;
  if (wake_fd_ >= 0) ::close(wake_fd_);
  wake_fd_ = -1;
  if (!ipc_path_.empty()) ::unlink(ipc_path_.c_str());
  interrupt();
}

void ZmqCommunicator::send(int dest, Message msg) {
  AMOE_CHECK_ARG(dest >= 0 && dest < num_runtimes_, "destination " << dest << " is not a runtime");
  AMOE_CHECK_ARG(!closing_.load(), "communicator is closed");
  const int64_t n = static_cast<int64_t>(msg.rows.size());
  AMOE_CHECK_ARG(msg.data.defined() && (msg.data.dim() == 1 || msg.data.dim() == 2) && msg.data.size(0) == n,
                 "message data must be [" << n << "] or [" << n << ", hidden]");
  size_t itemsize = 0;
  AMOE_CHECK_ARG(item_size(static_cast<int32_t>(msg.data.scalar_type()), &itemsize),
                 "message dtype " << msg.data.scalar_type() << " cannot cross a socket");
  msg.header.src_runtime = rank_;
  msg.header.num_rows = n;
  msg.header.dtype = static_cast<int32_t>(msg.data.scalar_type());
  msg.header.hidden = msg.data.dim() == 2 ? msg.data.size(1) : 0;
  if (dest == rank_) {
    messages_local_.fetch_add(1, std::memory_order_relaxed);
    deliver(std::move(msg));
    return;
  }
  Outgoing out;
  out.dest = dest;
  out.th.kind = plane_ ? kTwoPhaseTransfer : kInlineTransfer;
  out.th.src = rank_;
  out.th.generation = static_cast<uint8_t>(generation_);
  out.data = stage_for_plane(msg.data, plane_ ? plane_->device() : at::Device(at::kCPU));
  out.th.nbytes = static_cast<uint64_t>(out.data.numel()) * itemsize;
  out.frame0.resize(kMetaBytes + n * sizeof(RowMeta));
  std::memcpy(&out.frame0[sizeof(TransferHeader)], &msg.header, sizeof(MessageHeader));
  if (n > 0) std::memcpy(&out.frame0[kMetaBytes], msg.rows.data(), n * sizeof(RowMeta));
  out.queued = Clock::now();
  if (!connected_.load()) {
    std::lock_guard<std::mutex> lock(out_mu_);  // see connect()
    if (!connected_.load()) return out_.push_back(std::move(out));
  }
  send_or_park(*peers_[dest], std::move(out));
}

void ZmqCommunicator::send_or_park(Peer& peer, Outgoing&& out) {
  std::lock_guard<std::mutex> lock(peer.mu);  // see Peer::mu
  if (peer.closed) {
    send_dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (peer.backlog.empty() && try_send(peer, out)) return;
  // Never dropped silently: it waits, counted, until the queue has room or timeout_s passes.
  send_blocked_.fetch_add(1, std::memory_order_relaxed);
  backlog_.fetch_add(1, std::memory_order_relaxed);
  peer.backlog.push_back(std::move(out));
  wake_io();  // so the I/O thread polls on its short tick and retries
}

void ZmqCommunicator::wake_io() {
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!::write(wake_fd_, &one, sizeof(one));  // EAGAIN: a wake-up is already pending
}

// ---- outbound: one ZeroMQ send attempt, and the I/O thread's retries of parked sends ----

void ZmqCommunicator::retry_backlogs() {
  if (backlog_.load(std::memory_order_relaxed) == 0) return;
  for (auto& p : peers_) {
    if (!p) continue;
    std::lock_guard<std::mutex> lock(p->mu);  // see Peer::mu
    while (!p->backlog.empty() && try_send(*p, p->backlog.front())) {
      p->backlog.pop_front();
      backlog_.fetch_sub(1, std::memory_order_relaxed);
    }
  }
}

bool ZmqCommunicator::try_send(Peer& peer, Outgoing& out) {
  const bool is_message = out.th.kind == kInlineTransfer || out.th.kind == kTwoPhaseTransfer;
  std::shared_ptr<TensorPlane> link;  // the payload's, fixed while the peer's mutex is held (see reconnect())
  uint64_t epoch = 0;
  if (out.th.kind == kTwoPhaseTransfer && out.th.nbytes > 0) {
    Link& l = *links_[out.dest];
    std::lock_guard<std::mutex> lock(l.mu);  // see Link::mu
    if (!l.plane) return false;  // the link is being built: the message waits in the backlog, in order
    link = l.plane;
    epoch = l.epoch;
  }
  if (!out.numbered && is_message) {
    out.th.seq = peer.next_seq++;
    out.th.tag = static_cast<uint32_t>(out.th.seq & 0x7fffffffu);
    out.numbered = true;
  }
  std::memcpy(&out.frame0[0], &out.th, sizeof(TransferHeader));
  const bool has_payload_frame = out.th.kind == kInlineTransfer;
  zmq_msg_t m0;
  zmq_msg_init_size(&m0, out.frame0.size());
  std::memcpy(zmq_msg_data(&m0), out.frame0.data(), out.frame0.size());
  if (zmq_msg_send(&m0, peer.sock, ZMQ_DONTWAIT | (has_payload_frame ? ZMQ_SNDMORE : 0)) < 0) {
    zmq_msg_close(&m0);
    if (zmq_errno() == EAGAIN) return false;
    send_dropped_.fetch_add(1, std::memory_order_relaxed);
    fail_peer(out.dest, zmq_error("send failed"));
    return true;
  }
  // The first frame got in, so the rest of a multipart message is accepted without waiting.
  if (has_payload_frame) send_payload_frame(peer, out);
  if (!is_message) return true;
  messages_out_.fetch_add(1, std::memory_order_relaxed);
  bytes_out_.fetch_add(static_cast<int64_t>(out.th.nbytes), std::memory_order_relaxed);
  // Posted after the metadata: a receiver that must match the send (NCCL) learns about it first.
  if (link) post_send(out, *link, epoch);
  return true;
}

// Inline: the payload as frame 1 of the multipart message whose frame 0 was just sent (under peer.mu, like
// try_send()).
void ZmqCommunicator::send_payload_frame(Peer& peer, const Outgoing& out) {
  zmq_msg_t m1;
  const size_t nbytes = out.th.nbytes;
  if (nbytes >= kZeroCopyMin) {
    // Zero copy: ZeroMQ reads the tensor's memory and drops this reference when it is done with it.
    auto* hold = new at::Tensor(out.data);
    zmq_msg_init_data(&m1, hold->data_ptr(), nbytes, &release_tensor, hold);
  } else {
    zmq_msg_init_size(&m1, nbytes);
    if (nbytes > 0) std::memcpy(zmq_msg_data(&m1), out.data.data_ptr(), nbytes);
  }
  if (zmq_msg_send(&m1, peer.sock, 0) < 0) zmq_msg_close(&m1);
}

// Two-phase: the payload's send on the tensor plane, completed by the peer's send lane.
void ZmqCommunicator::post_send(const Outgoing& out, TensorPlane& link, uint64_t epoch) {
  auto p = std::make_shared<Pending>();
  p->peer = out.dest;
  p->epoch = epoch;
  p->nbytes = out.th.nbytes;
  p->deadline = Clock::now() + timeout_;
  try {
    p->transfer = link.send(out.data, out.dest, out.th.tag);
  } catch (const std::exception& e) {
    transfer_errors_.fetch_add(1, std::memory_order_relaxed);
    return fail_peer(out.dest, std::string("posting a send failed: ") + e.what());
  }
  in_flight_send_.fetch_add(1, std::memory_order_relaxed);
  send_lanes_[out.dest]->push(std::move(p));
}

// ---- errors and statistics (any thread) ----

void ZmqCommunicator::fail_peer(int peer, const std::string& why) {
  bool is_new;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);  // stats() reads the failed set on another thread
    is_new = failed_.emplace(peer, why).second;
    last_error_ = "runtime " + std::to_string(peer) + ": " + why;
  }
  if (is_new) {
    std::fprintf(stderr, "[amoe.comm] runtime %d marks runtime %d failed: %s\n", rank_, peer, why.c_str());
  }
}

std::vector<int> ZmqCommunicator::failed_peers() const {
  std::lock_guard<std::mutex> lock(peers_mu_);  // see fail_peer()
  std::vector<int> out;
  for (const auto& [peer, why] : failed_) out.push_back(peer);
  return out;
}

CommStats ZmqCommunicator::stats() const {
  CommStats s;
  s.plane = plane_name();
  const auto r = std::memory_order_relaxed;
  s.messages_in = messages_in_.load(r);
  s.messages_out = messages_out_.load(r);
  s.bytes_in = bytes_in_.load(r);
  s.bytes_out = bytes_out_.load(r);
  s.messages_local = messages_local_.load(r);
  for (int k = 0; k < kNumDropKinds; ++k) s.dropped[k] = dropped_[k].load(r);
  s.timeouts = timeouts_.load(r);
  s.transfer_errors = transfer_errors_.load(r);
  s.send_blocked = send_blocked_.load(r);
  s.send_dropped = send_dropped_.load(r);
  s.rejected_handshakes = rejected_.load(r);
  s.secure_endpoint = secure_endpoint_;
  s.backlog = backlog_.load(r);
  s.in_flight_send = in_flight_send_.load(r);
  s.in_flight_recv = in_flight_recv_.load(r);
  s.cancelled = cancelled_.load(r);
  s.unlinked_peers = unlinked_peers();
  s.delayed_messages = delayed_messages_.load(r);
  s.delay_s = static_cast<double>(delay_ns_.load(r)) * 1e-9;
  std::lock_guard<std::mutex> lock(peers_mu_);  // see fail_peer()
  for (const auto& [peer, why] : failed_) s.failed_peers.push_back(peer);
  s.departed_peers = departed_;
  s.last_error = last_error_;
  return s;
}

}  // namespace amoe
