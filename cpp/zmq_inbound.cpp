// ZmqCommunicator's inbound half: the I/O thread (arrivals, validation and drop counting, posting two-phase
// receives, transfer and backlog deadlines, the disconnect monitor). The receive buffers and the lane threads
// that complete two-phase transfers are in zmq_lanes.cpp; construction, connect/close, sends and statistics
// in zmq_comm.cpp.
#include <c10/core/impl/alloc_cpu.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>

#include "zmq_api.h"
#include "zmq_comm_internal.h"

namespace amoe {

using zmq_internal::item_size;
using zmq_internal::kAnyGeneration;
using zmq_internal::kMetaBytes;
using zmq_internal::kZeroCopyMin;

namespace {

constexpr uint64_t kMaxTransferBytes = 1ull << 36;  // a larger claim is malformed, not a real batch
constexpr int kBurst = 256;                         // inbound messages per I/O turn, so sends keep going
constexpr int kBusyTickMs = 5;                      // poll period while transfers or a backlog wait
constexpr int kIdleTickMs = 200;

std::vector<int64_t> shape_of(const MessageHeader& h) {
  return h.hidden > 0 ? std::vector<int64_t>{h.num_rows, h.hidden} : std::vector<int64_t>{h.num_rows};
}

// The tensor of an inline payload frame (a zmq_msg_t*) of h's shape and dtype. A large one is wrapped, not
// copied: the tensor then owns the ZeroMQ message, and *frame is set to nullptr.
at::Tensor payload_tensor(void** frame, const MessageHeader& h) {
  auto* m1 = static_cast<zmq_msg_t*>(*frame);
  const size_t len1 = zmq_msg_size(m1);
  void* payload = zmq_msg_data(m1);
  const auto options = at::TensorOptions().dtype(static_cast<at::ScalarType>(h.dtype));
  // libzmq puts a large payload 8 bytes past a malloc boundary: aligned for every dtype we carry (<= 8
  // bytes).
  if (len1 >= kZeroCopyMin && reinterpret_cast<uintptr_t>(payload) % 8 == 0) {
    // Zero copy: the tensor owns the ZeroMQ message and closes it when the last reference goes.
    *frame = nullptr;
    return at::from_blob(
        payload, shape_of(h),
        [m1](void*) {
          zmq_msg_close(m1);
          delete m1;
        },
        options);
  }
  auto data = at::empty(shape_of(h), options);
  if (len1 > 0) std::memcpy(data.data_ptr(), payload, len1);
  return data;
}

// A buffer an announced payload is received into and thrown away when its real buffer cannot be had: fresh
// pages the kernel reserves nothing for (MAP_NORESERVE), not the allocator that just failed; only touched
// pages cost memory. CPU planes only: a GPU plane has no such second source (it throws).
at::Tensor discard_buffer(const std::vector<int64_t>& shape, at::ScalarType dtype, const at::Device& device) {
  if (!device.is_cpu()) throw std::runtime_error("no discard buffer on " + device.str());
  size_t nbytes = c10::elementSize(dtype);
  for (const int64_t d : shape) nbytes *= static_cast<size_t>(d);
  nbytes = std::max<size_t>(nbytes, 1);
  void* block =
      mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (block == MAP_FAILED) throw std::bad_alloc();
  return at::from_blob(
      block, shape, [nbytes](void* p) { munmap(p, nbytes); }, at::TensorOptions().dtype(dtype));
}

}  // namespace

// ---- the I/O thread ----

void ZmqCommunicator::io_loop() {
  std::vector<zmq_pollitem_t> items;
  while (true) {
    const bool stopping = closing_.load();
    retry_backlogs();
    drain_inbound();
    drain_monitor();
    check_deadlines();
    if (stopping) break;
    items.clear();
    items.push_back(zmq_pollitem_t{pull_, 0, ZMQ_POLLIN, 0});
    items.push_back(zmq_pollitem_t{nullptr, wake_fd_, ZMQ_POLLIN, 0});
    items.push_back(zmq_pollitem_t{monitor_, 0, ZMQ_POLLIN, 0});
    const bool busy = backlog_.load(std::memory_order_relaxed) > 0 ||
                      in_flight_send_.load(std::memory_order_relaxed) > 0 ||
                      in_flight_recv_.load(std::memory_order_relaxed) > 0;
    zmq_poll(items.data(), static_cast<int>(items.size()), busy ? kBusyTickMs : kIdleTickMs);
    if (items[1].revents & ZMQ_POLLIN) {
      uint64_t v;
      (void)!::read(wake_fd_, &v, sizeof(v));
    }
  }
  for (auto& p : peers_) {
    if (!p) continue;
    std::lock_guard<std::mutex> lock(p->mu);  // see Peer::mu
    backlog_.fetch_sub(static_cast<int64_t>(p->backlog.size()), std::memory_order_relaxed);
    send_dropped_.fetch_add(static_cast<int64_t>(p->backlog.size()), std::memory_order_relaxed);
    p->backlog.clear();
    p->closed = true;
    if (p->sock != nullptr) zmq_close(p->sock);  // nullptr: a slot no runtime held
    p->sock = nullptr;
  }
  zmq_socket_monitor(pull_, nullptr, 0);
  zmq_close(monitor_);
  zmq_close(pull_);
}

void ZmqCommunicator::drain_monitor() {
  while (true) {
    zmq_msg_t event;
    zmq_msg_init(&event);
    if (zmq_msg_recv(&event, monitor_, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&event);
      return;
    }
    uint16_t id = 0;
    uint32_t fd = 0;
    if (zmq_msg_size(&event) >= 6) {
      std::memcpy(&id, zmq_msg_data(&event), 2);
      std::memcpy(&fd, static_cast<const char*>(zmq_msg_data(&event)) + 2, 4);
    }
    bool more = zmq_msg_more(&event);
    zmq_msg_close(&event);
    while (more) {  // the rest is the endpoint
      zmq_msg_t part;
      zmq_msg_init(&part);
      if (zmq_msg_recv(&part, monitor_, 0) < 0) break;
      more = zmq_msg_more(&part);
      zmq_msg_close(&part);
    }
    if (id == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL || id == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
        id == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
      rejected_.fetch_add(1, std::memory_order_relaxed);
      if (!rejected_logged_.exchange(true))
        std::fprintf(stderr,
                     "[amoe.comm] runtime %d refused a connection without the cluster's keys "
                     "(logged once; counted in rejected_handshakes)\n",
                     rank_);
      continue;
    }
    if (id != ZMQ_EVENT_DISCONNECTED) continue;
    if (retired_fds_.erase(static_cast<int>(fd)) > 0) continue;  // a replaced process's: nothing to judge
    auto it = fd_rank_.find(static_cast<int>(fd));
    if (it == fd_rank_.end()) continue;
    // Judged a moment later: a goodbye sent just before the connection closed may still be on its way.
    lost_.push_back(
        Lost{it->second, Clock::now() + std::chrono::milliseconds(kIdleTickMs), fd_generation_[it->first]});
    rank_fd_.erase(it->second);  // a replacement of that peer may claim its rank on a new connection
    fd_generation_.erase(it->first);
    fd_rank_.erase(it);
  }
}

// ---- arrivals: validated, then delivered (inline) or their receive posted (two-phase); else dropped ----

void ZmqCommunicator::drop(DropKind kind, const std::string& why) {
  dropped_[kind].fetch_add(1, std::memory_order_relaxed);
  if (!drop_logged_[kind].exchange(true)) {
    std::fprintf(stderr, "[amoe.comm] runtime %d dropped a %s message: %s (logged once per kind)\n", rank_,
                 kDropNames[kind], why.c_str());
  }
}

bool ZmqCommunicator::reject(DropKind kind, const std::string& why) {
  drop(kind, why);
  return false;
}

void ZmqCommunicator::drain_inbound() {
  std::vector<void*> frames;  // zmq_msg_t*, closed by handle_inbound unless it keeps them
  for (int i = 0; i < kBurst; ++i) {
    auto* first = new zmq_msg_t;
    zmq_msg_init(first);
    if (zmq_msg_recv(first, pull_, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(first);
      delete first;
      return;
    }
    frames.assign(1, first);
    bool more = zmq_msg_more(first);
    while (more) {  // ZeroMQ delivers the whole multipart message at once
      auto* part = new zmq_msg_t;
      zmq_msg_init(part);
      if (zmq_msg_recv(part, pull_, 0) < 0) {
        zmq_msg_close(part);
        delete part;
        break;
      }
      more = zmq_msg_more(part);
      frames.push_back(part);
    }
    const size_t n = frames.size();
    handle_inbound(frames, n);
    for (void* f : frames) {
      if (!f) continue;
      zmq_msg_close(static_cast<zmq_msg_t*>(f));
      delete static_cast<zmq_msg_t*>(f);
    }
  }
}

// A rank belongs to the first connection that speaks for it, until that connection closes: frames claiming it
// on any other connection are dropped, so a stray or hostile connection can neither pose as a peer nor, by
// closing, get that peer reported lost. The disconnect monitor names a connection only by its fd.
//
// Once reconnect() has named a newer generation of a rank, frames of older processes are dropped, and their
// connection gives the rank up at once to the new process's (whose frames carry the named generation); it is
// retired, so its closing later is no failure of the new process.
bool ZmqCommunicator::claim_rank(int fd, const TransferHeader& th) {
  const int rank = th.src;
  if (replaced(rank, th.generation)) return reject(kInconsistent, "a frame of a replaced process");
  if (fd < 0) return true;  // no fd to tell connections apart (never on ipc or tcp)
  if (retired_fds_.count(fd) > 0) return reject(kInconsistent, "a frame on a replaced process's connection");
  auto owner = rank_fd_.find(rank);
  if (owner != rank_fd_.end() && owner->second != fd && replaced(rank, fd_generation_[owner->second])) {
    retired_fds_.insert(owner->second);
    fd_generation_.erase(owner->second);
    fd_rank_.erase(owner->second);
    rank_fd_.erase(owner);
    owner = rank_fd_.end();
  }
  if (owner == rank_fd_.end()) {
    rank_fd_[rank] = fd;
    fd_rank_[fd] = rank;
    fd_generation_[fd] = th.generation;
    return true;
  }
  if (owner->second == fd) return true;
  drop(kInconsistent, "a second connection speaks for rank " + std::to_string(rank));
  return false;
}

// Whether `rank`'s process of `generation` (mod 256) is older than the one reconnect() last named.
bool ZmqCommunicator::replaced(int rank, uint8_t generation) const {
  const int64_t named = peers_[rank]->generation.load(std::memory_order_relaxed);  // see Peer::generation
  const auto behind = static_cast<uint8_t>(static_cast<uint8_t>(named) - generation);
  return named >= 0 && behind > 0 && behind < 128;
}

// The transfer header names the kind; each kind checks the rest of its frames. A handler that keeps a frame
// (a zero-copy payload) nulls its slot.
void ZmqCommunicator::handle_inbound(std::vector<void*>& frames, size_t num_frames) {
  auto* m0 = static_cast<zmq_msg_t*>(frames[0]);
  TransferHeader th;
  if (!read_transfer_header(m0, &th)) return;
  if (!claim_rank(zmq_msg_get(m0, ZMQ_SRCFD), th)) return;
  switch (th.kind) {
    case kHelloTransfer:
    case kByeTransfer:
      return handle_hello_bye(th, zmq_msg_size(m0), num_frames);
    case kTwoPhaseTransfer:
      return handle_two_phase(th, m0, num_frames);
    case kInlineTransfer:
      return handle_inline(th, frames, num_frames);
    default:
      return drop(kInconsistent, "unknown transfer kind " + std::to_string(th.kind));
  }
}

// Frame 0's transfer header into *th, from a peer; false when dropped.
bool ZmqCommunicator::read_transfer_header(void* frame0, TransferHeader* th) {
  auto* m0 = static_cast<zmq_msg_t*>(frame0);
  const auto* f0 = static_cast<const char*>(zmq_msg_data(m0));
  const size_t len0 = zmq_msg_size(m0);
  if (len0 < sizeof(TransferHeader)) {
    const bool prefix = len0 > 0 && std::memcmp(f0, &kTransferMagic, std::min<size_t>(len0, 4)) == 0;
    return reject(prefix ? kTruncated : kGarbage, "a frame shorter than the transfer header");
  }
  std::memcpy(th, f0, sizeof(*th));
  if (th->magic != kTransferMagic) return reject(kGarbage, "bad transfer magic");
  if (th->version != kTransferVersion)
    return reject(kVersion, "transfer protocol version " + std::to_string(th->version));
  if (th->src < 0 || th->src >= num_runtimes_ || th->src == rank_)
    return reject(kInconsistent, "sender rank " + std::to_string(th->src) + " is not a peer");
  return true;
}

// A peer connected (hello) or is closing in order (bye): no message, only the departed set changes.
void ZmqCommunicator::handle_hello_bye(const TransferHeader& th, size_t frame0_bytes, size_t num_frames) {
  if (frame0_bytes != sizeof(th) || num_frames != 1) return drop(kInconsistent, "a hello/bye with a body");
  std::lock_guard<std::mutex> lock(peers_mu_);  // stats() reads the departed set
  auto it = std::find(departed_.begin(), departed_.end(), th.src);
  if (th.kind == kByeTransfer && it == departed_.end()) departed_.push_back(th.src);
  if (th.kind == kHelloTransfer && it != departed_.end()) departed_.erase(it);
}

// The message header and row records that follow frame 0's transfer header, into *msg (data left undefined);
// false when dropped. Once accepted, th.nbytes is the payload size they describe.
bool ZmqCommunicator::read_message(const TransferHeader& th, void* frame0, Message* msg) {
  auto* m0 = static_cast<zmq_msg_t*>(frame0);
  const auto* f0 = static_cast<const char*>(zmq_msg_data(m0));
  const size_t len0 = zmq_msg_size(m0);
  if (len0 < kMetaBytes) {
    const bool prefix =
        std::memcmp(f0 + sizeof(th), &kMessageMagic, std::min<size_t>(len0 - sizeof(th), 4)) == 0;
    return reject(prefix ? kTruncated : kGarbage, "a frame shorter than the message header");
  }
  MessageHeader h;
  std::memcpy(&h, f0 + sizeof(th), sizeof(h));
  if (h.magic != kMessageMagic) return reject(kGarbage, "bad message magic");
  if (h.version != kMessageVersion || h.row_size != sizeof(RowMeta))
    return reject(kVersion, "message layout version " + std::to_string(h.version) + ", row size " +
                                std::to_string(h.row_size));
  if (h.num_rows < 0 || h.hidden < 0 || h.src_runtime != th.src)
    return reject(kInconsistent, "negative sizes or a sender mismatch");
  const uint64_t rows = static_cast<uint64_t>(h.num_rows);
  const size_t row_bytes = len0 - kMetaBytes;
  if (rows > row_bytes / sizeof(RowMeta)) return reject(kTruncated, "fewer row records than num_rows");
  if (row_bytes != rows * sizeof(RowMeta)) return reject(kInconsistent, "more row records than num_rows");
  size_t itemsize = 0;
  if (!item_size(h.dtype, &itemsize))
    return reject(kInconsistent, "unknown dtype " + std::to_string(h.dtype));
  uint64_t expected = 0;
  if (__builtin_mul_overflow(rows, static_cast<uint64_t>(std::max<int64_t>(h.hidden, 1)), &expected) ||
      __builtin_mul_overflow(expected, static_cast<uint64_t>(itemsize), &expected) ||
      expected > kMaxTransferBytes)
    return reject(kInconsistent, "an impossible payload size");
  if (th.nbytes != expected) return reject(kInconsistent, "byte length disagrees with dtype and shape");
  msg->header = h;
  msg->rows.resize(rows);
  if (rows > 0) std::memcpy(msg->rows.data(), f0 + kMetaBytes, rows * sizeof(RowMeta));
  return true;
}

// Two-phase: frame 0 alone; the payload comes over the tensor plane, into a receive posted here.
void ZmqCommunicator::handle_two_phase(const TransferHeader& th, void* frame0, size_t num_frames) {
  Message msg;
  if (!read_message(th, frame0, &msg)) return;
  if (num_frames != 1) return drop(kInconsistent, "a two-phase transfer with extra frames");
  if (!plane_) return drop(kInconsistent, "a two-phase transfer on an inline communicator");
  post_recv(th, std::move(msg));
}

// Inline: the payload is frame 1, so the message is complete on arrival.
void ZmqCommunicator::handle_inline(const TransferHeader& th, std::vector<void*>& frames, size_t num_frames) {
  Message msg;
  if (!read_message(th, frames[0], &msg)) return;
  if (num_frames < 2) return drop(kTruncated, "an inline transfer without its payload frame");
  if (num_frames > 2) return drop(kInconsistent, "an inline transfer with extra frames");
  const size_t len1 = zmq_msg_size(static_cast<zmq_msg_t*>(frames[1]));
  if (len1 != th.nbytes)
    return drop(len1 < th.nbytes ? kTruncated : kInconsistent, "payload bytes disagree with the header");
  msg.data = payload_tensor(&frames[1], msg.header);
  messages_in_.fetch_add(1, std::memory_order_relaxed);
  bytes_in_.fetch_add(static_cast<int64_t>(len1), std::memory_order_relaxed);
  deliver(std::move(msg));
}

void ZmqCommunicator::post_recv(const TransferHeader& th, Message msg) {
  if (th.nbytes == 0) {
    msg.data = at::empty(shape_of(msg.header),
                         at::TensorOptions().dtype(static_cast<at::ScalarType>(msg.header.dtype)));
    messages_in_.fetch_add(1, std::memory_order_relaxed);
    return deliver(std::move(msg));
  }
  Link& link = *links_[th.src];
  std::lock_guard<std::mutex> lock(link.mu);  // see Link::mu
  if (!link.plane) {  // the peer was just replaced and its new link is being built: posted when it comes
    link.deferred.push_back(Deferred{th, std::move(msg), Clock::now() + timeout_});
    in_flight_recv_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  post_on_link(link, th, std::move(msg));
}

// Every announced payload is received, in announcement order: a receive skipped would leave its sender's send
// unmatched (gloo: pending until the timeout fails the pair) or, on a plane that matches by order (NCCL),
// pair the next receive with it. So a payload without memory is received into a discard buffer and dropped;
// with not even that, nothing more is taken from the peer until it is replaced (and the pair is failed).
void ZmqCommunicator::post_on_link(Link& link, const TransferHeader& th, Message msg) {
  const int src = th.src;
  if (link.broken) return drop(kNoMemory, "a transfer after one that had nowhere to go (until a reconnect)");
  if (link.generation != kAnyGeneration && th.generation != static_cast<uint8_t>(link.generation))
    return drop(kInconsistent, "a two-phase transfer of a replaced process");
  auto p = std::make_shared<Pending>();
  p->is_recv = true;
  p->peer = src;
  p->epoch = link.epoch;
  p->nbytes = th.nbytes;
  p->deadline = Clock::now() + timeout_;
  try {
    msg.data = receive_buffer(msg.header, &p->discard);
  } catch (const std::exception& e) {
    link.broken = true;
    drop(kNoMemory, "no memory for an announced payload, not even to discard it");
    return fail_peer(src, std::string("no memory to receive an announced payload: ") + e.what());
  }
  if (p->discard) drop(kNoMemory, "no memory for an announced payload: received into a discard buffer");
  try {
    p->transfer = link.plane->recv(msg.data, src, th.tag);
  } catch (const std::exception& e) {
    link.broken = true;  // the same: this payload will not be received
    transfer_errors_.fetch_add(1, std::memory_order_relaxed);
    return fail_peer(src, std::string("posting a receive failed: ") + e.what());
  }
  p->msg = std::move(msg);
  in_flight_recv_.fetch_add(1, std::memory_order_relaxed);
  recv_lanes_[src]->push(std::move(p));
}

// The buffer a payload of h's shape lands in; *discard when it is only a discard buffer. Throws when there is
// none at all.
at::Tensor ZmqCommunicator::receive_buffer(const MessageHeader& h, bool* discard) {
  const auto dtype = static_cast<at::ScalarType>(h.dtype);
  // inject_alloc_failure(): counts announced payloads down to the one whose allocation fails (seq_cst: any
  // thread may arm it; the I/O thread and set_peer_link() count).
  int64_t left = alloc_fault_skip_.load();
  while (left >= 0 && !alloc_fault_skip_.compare_exchange_weak(left, left - 1)) {
  }
  const bool injected = left == 0;
  try {
    if (injected) throw std::bad_alloc();
    return recv_pool_ ? recv_pool_->empty(shape_of(h), dtype)
                      : at::empty(shape_of(h), at::TensorOptions().dtype(dtype).device(plane_->device()));
  } catch (const std::exception&) {
    *discard = true;
  }
  if (injected && alloc_fault_discard_.load()) throw std::bad_alloc();
  return discard_buffer(shape_of(h), dtype, plane_->device());
}

void ZmqCommunicator::check_deadlines() {
  const auto now = Clock::now();
  for (auto* lanes : {&send_lanes_, &recv_lanes_}) {
    for (auto& l : *lanes) {
      if (l) l->expire(now);
    }
  }
  for (int r = 0; per_peer_ && r < num_runtimes_; ++r) {  // announced payloads still waiting for a link
    if (r == rank_) continue;
    int64_t expired = 0;
    {
      std::lock_guard<std::mutex> lock(links_[r]->mu);  // see Link::mu
      auto& deferred = links_[r]->deferred;
      if (!deferred.empty() && now >= deferred.front().deadline)
        expired = static_cast<int64_t>(deferred.size());
      if (expired > 0) deferred.clear();
    }
    if (expired == 0) continue;
    in_flight_recv_.fetch_sub(expired, std::memory_order_relaxed);
    timeouts_.fetch_add(expired, std::memory_order_relaxed);
    fail_peer(r, "its tensor-plane link was not built within timeout_s");
  }
  for (size_t i = 0; i < lost_.size();) {
    if (now < lost_[i].judge_at) {
      ++i;
      continue;
    }
    const int peer = lost_[i].rank;
    const bool old_process = replaced(peer, lost_[i].generation);  // the peer already has a successor
    lost_.erase(lost_.begin() + i);
    if (old_process) continue;
    bool departed;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);  // see fail_peer()
      departed = std::find(departed_.begin(), departed_.end(), peer) != departed_.end();
    }
    if (!departed) fail_peer(peer, "its connection closed without a goodbye");
  }
  if (backlog_.load(std::memory_order_relaxed) == 0) return;
  for (size_t r = 0; r < peers_.size(); ++r) {
    Peer* p = peers_[r].get();
    if (!p) continue;
    std::lock_guard<std::mutex> lock(p->mu);  // see Peer::mu
    if (p->backlog.empty() || now - p->backlog.front().queued < timeout_) continue;
    const auto n = static_cast<int64_t>(p->backlog.size());
    p->backlog.clear();
    backlog_.fetch_sub(n, std::memory_order_relaxed);
    send_dropped_.fetch_add(n, std::memory_order_relaxed);
    fail_peer(static_cast<int>(r),
              "its queue stayed full for timeout_s; " + std::to_string(n) + " messages to it were dropped");
  }
}

}  // namespace amoe
