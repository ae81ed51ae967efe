// The communicator between runtime processes (paper §3.5): phase 1 puts the message's metadata on the
// receiver's ZeroMQ socket; phase 2 moves the tensor, either as an extra ZeroMQ frame (the `inline` plane)
// or over a tensor plane (a gloo / NCCL process group, `TensorPlane`). See docs/communicator.md.
//
// A peer whose connection drops without a goodbye (its process died) is marked failed, as is one whose
// transfer times out or fails; failed_peers() is what the cluster manager polls.
//
// Threads: send() puts a message on the peer's PUSH socket on the caller's thread (ZMQ_DONTWAIT; a full
// queue parks it in the peer's backlog, which the I/O thread retries), each PUSH socket guarded by its
// peer's mutex (a ZeroMQ socket may change threads behind a full barrier). One I/O thread owns the bound
// PULL socket: it validates arrivals, fills the inbox recv() drains, posts the receives of two-phase
// transfers and enforces timeouts. Two-phase transfers are completed by one waiter thread per peer and
// direction (the process-group API offers only a blocking wait), so neither the senders nor the I/O
// thread block and many transfers stay in flight; a received message enters the inbox only once its
// tensor is complete. Emulated links (set_link_delays) then hold it for its time in flight (zmq_inbox.cpp).
//
// A process-group plane is one group for every runtime (fixed members), or a link per peer (set_peer_link: a
// plane of that pair alone), which reconnect() swaps when the peer is replaced; sends to a peer whose link is
// not built yet wait in its backlog, announced receives from it are posted once the link comes.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "comm.h"
#include "meta.h"

namespace amoe {

// Moves two-phase payloads point to point. send()/recv() return at once; Transfer::wait() blocks.
class TensorPlane {
 public:
  class Transfer {
   public:
    virtual ~Transfer() = default;
    // Blocks until the transfer is done: true on success, false if aborted; throws on a transport error.
    virtual bool wait() = 0;
    // Makes a current or later wait() return false; callable from any thread.
    virtual void abort() = 0;
  };
  virtual ~TensorPlane() = default;
  virtual std::string name() const = 0;
  // Where receive buffers are allocated.
  virtual at::Device device() const = 0;
  // Called first on each lane thread (the threads that wait on transfers): a GPU plane gives it its device
  // and a dedicated stream there, so waiting never queues behind the compute stream.
  virtual void on_lane_thread() {}
  virtual std::unique_ptr<Transfer> send(const at::Tensor& data, int dst, uint32_t tag) = 0;
  virtual std::unique_ptr<Transfer> recv(const at::Tensor& buffer, int src, uint32_t tag) = 0;
};

// Why an inbound ZeroMQ message was dropped. no_memory: its announced payload found no receive buffer (it was
// received into a discard buffer, or its pair was failed: see post_on_link()).
enum DropKind : int { kGarbage = 0, kTruncated, kVersion, kInconsistent, kNoMemory, kNumDropKinds };
constexpr std::array<const char*, kNumDropKinds> kDropNames = {"garbage", "truncated", "version",
                                                               "inconsistent", "no_memory"};

struct CommStats {
  std::string plane;
  int64_t messages_in = 0, messages_out = 0, bytes_in = 0, bytes_out = 0;  // remote traffic only
  int64_t messages_local = 0;                                              // sent to itself
  std::array<int64_t, kNumDropKinds> dropped{};
  int64_t timeouts = 0;         // transfers not done within timeout_s (the peer is marked failed)
  int64_t transfer_errors = 0;  // transfers the tensor plane failed (the peer is marked failed)
  int64_t send_blocked = 0;     // sends that met a full ZeroMQ queue (or an unbuilt link) and waited
  int64_t send_dropped = 0;     // backlogged sends given up after timeout_s (the peer is marked failed)
  int64_t backlog = 0;          // sends waiting for room in a full ZeroMQ queue, or for their link
  // Two-phase transfers posted (or, announced receives, waiting for their peer's link), not yet done.
  int64_t in_flight_send = 0, in_flight_recv = 0;
  int64_t cancelled = 0;            // transfers abandoned because their peer was replaced (reconnect)
  std::vector<int> unlinked_peers;  // per-peer planes: peers whose tensor-plane link is not built yet
  std::vector<int> failed_peers;
  std::vector<int> departed_peers;  // peers that said goodbye (closed in order)
  std::string last_error;
  int64_t delayed_messages = 0;  // held back by an emulated link (set_link_delays)
  double delay_s = 0;            // their total hold, from arrival to ready
  int64_t rejected_handshakes =
      0;                        // connections refused before any frame: no CURVE, or not the cluster's keys
  std::string secure_endpoint;  // the CURVE tcp:// endpoint (listen_secure), empty if none
};

// The cluster's CURVE key pairs, Z85 text (40 characters each). Every runtime holds both: it serves with the
// server pair and connects with the client pair (docs/multinode.md "Security").
struct CurveKeys {
  std::string server_public, server_secret, client_public, client_secret;
};

class ZmqCommunicator : public Communicator {
 public:
  // Binds the inbound socket at once ("ipc" = a unique ipc:// path, or "tcp://host:port", port 0 = any) so
  // endpoint() is known; starts no thread. plane == nullptr selects the inline plane. per_peer: `plane` only
  // names the kind and device; each peer's transfers go over the link set_peer_link() gives it. generation:
  // this process's (0 first, +1 per replacement of its rank), carried in every header.
  ZmqCommunicator(int rank, int num_runtimes, const std::string& bind, std::shared_ptr<TensorPlane> plane,
                  double timeout_s, bool per_peer = false, uint32_t generation = 0);
  ~ZmqCommunicator() override;
  ZmqCommunicator(const ZmqCommunicator&) = delete;
  ZmqCommunicator& operator=(const ZmqCommunicator&) = delete;

  const std::string& endpoint() const { return endpoint_; }
  int num_runtimes() const { return num_runtimes_; }
  std::string plane_name() const;
  at::Device plane_device() const;  // where two-phase receive buffers live (the CPU on the inline plane)
  // Connects to every peer (endpoints[r] for runtime r, its own included) and starts the I/O thread. Slots
  // past the list, or with an empty endpoint, are held by no runtime yet (an elastic cluster's spare ranks):
  // nothing is sent there (sends are dropped and counted) and no link is waited for, until reconnect()
  // names the runtime that joins there.
  void connect(const std::vector<std::string>& endpoints);
  // Says goodbye to peers, stops every thread, closes the sockets; idempotent. Pending transfers are aborted.
  void close();
  // A peer joined an empty slot, or was replaced by a new process (of `generation`) at `endpoint`: messages
  // now go there (what was
  // waiting for the old one is dropped), and the peer is no longer failed. Per-peer planes: the old link's
  // transfers are abandoned (counted in cancelled), sequence numbers restart, and the peer's two-phase
  // transfers wait for the link set_peer_link() gives for `generation`. Not on a one-group plane (its
  // members are fixed).
  void reconnect(int rank, const std::string& endpoint, uint32_t generation = 0);
  // Per-peer planes: `link` (a plane of this pair alone) reaches the peer's process of `generation`. Parked
  // sends to it go, announced receives from it are posted in order. False, and nothing changes, if the peer
  // has a link or reconnect() named another generation (a build that lost a race with a newer replacement).
  bool set_peer_link(int peer, uint32_t generation, std::shared_ptr<TensorPlane> link);
  // Per-peer planes: the peers without a link yet (empty on other planes).
  std::vector<int> unlinked_peers() const;
  // Test hook (AMOE_FAULTS "alloc"): the receive buffer of the (skip + 1)-th next announced payload fails to
  // allocate; with `discard`, its discard buffer too (the pair is then failed). One injection at a time.
  void inject_alloc_failure(int64_t skip, bool discard);
  // For peers on other hosts: binds a second inbound endpoint, TCP with CURVE encryption and authentication
  // (`tcp_bind` "tcp://ip:port", port 0 = any), and encrypts every later connection to a tcp:// peer with
  // `keys`. A peer without them fails the handshake before any frame (counted, rejected_handshakes). Before
  // connect(); returns the endpoint bound.
  std::string listen_secure(const std::string& tcp_bind, const CurveKeys& keys);
  bool closed() const { return closing_.load(); }

  int rank() const override { return rank_; }
  void send(int dest, Message msg) override;
  size_t recv(std::vector<Message>* out, std::chrono::microseconds timeout) override;
  void interrupt() override;
  // Emulated links (docs/emulation.md), one entry per source runtime, in wall seconds: a message of n rows
  // from src reaches recv() once src's link has carried it (latency_s[src] + n * seconds_per_row[src], one
  // message after another). Zeros (the default) hold nothing; messages to itself are never held. Before
  // connect(), so a source's ready times never go backwards.
  void set_link_delays(const std::vector<double>& latency_s, const std::vector<double>& seconds_per_row);

  CommStats stats() const;
  std::vector<int> failed_peers() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Outgoing;
  struct Peer;
  struct Pending;
  struct Link;
  struct Deferred;
  class Lane;
  class BufferPool;

  void io_loop();
  void send_or_park(Peer& peer, Outgoing&& out);
  void retry_backlogs();
  bool try_send(Peer& peer, Outgoing& out);
  void send_payload_frame(Peer& peer, const Outgoing& out);
  void post_send(const Outgoing& out, TensorPlane& link, uint64_t epoch);
  void drain_inbound();
  void drain_monitor();
  void* open_peer(int rank, const std::string& endpoint);  // a PUSH connected to endpoint (CURVE if tcp)
  Outgoing hello_to(int dest) const;
  // One arrival (frames: zmq_msg_t*), handled by transfer kind; read_*() validate, false: dropped.
  void handle_inbound(std::vector<void*>& frames, size_t num_frames);
  bool read_transfer_header(void* frame0, TransferHeader* th);
  bool claim_rank(int fd, const TransferHeader& th);  // the first connection to speak for a rank owns it
  bool replaced(int rank, uint8_t generation) const;
  void handle_hello_bye(const TransferHeader& th, size_t frame0_bytes, size_t num_frames);
  bool read_message(const TransferHeader& th, void* frame0, Message* msg);
  void handle_two_phase(const TransferHeader& th, void* frame0, size_t num_frames);
  void handle_inline(const TransferHeader& th, std::vector<void*>& frames, size_t num_frames);
  void deliver(Message msg);
  Clock::time_point link_ready(const MessageHeader& h, Clock::time_point now);
  Clock::time_point earliest_ready() const;
  size_t take_ready(std::vector<Message>* out, Clock::time_point now);
  void post_recv(const TransferHeader& th, Message msg);
  void post_on_link(Link& link, const TransferHeader& th, Message msg);  // under link.mu
  at::Tensor receive_buffer(const MessageHeader& h, bool* discard);
  bool stale(const Pending& p);  // its peer was replaced since it was posted
  void check_deadlines();
  void finish(const std::shared_ptr<Pending>& p, bool ok, const std::string& error);
  void drop(DropKind kind, const std::string& why);
  bool reject(DropKind kind, const std::string& why);  // drop(), then false
  void fail_peer(int peer, const std::string& why);
  void wake_io();

  const int rank_;
  const int num_runtimes_;
  const std::shared_ptr<TensorPlane> plane_;  // nullptr: inline; per peer: the kind and device only
  const std::chrono::microseconds timeout_;
  const bool per_peer_;                       // links are per peer (set_peer_link) and swapped by reconnect()
  const uint32_t generation_;                 // this process's
  std::vector<std::unique_ptr<Link>> links_;  // per runtime (nullptr for itself) on a process-group plane
  std::string endpoint_;
  std::string ipc_path_;  // unlinked on close
  std::string secure_endpoint_;
  std::unique_ptr<CurveKeys> curve_;  // set by listen_secure(): tcp:// peers are reached with CURVE

  void* ctx_ = nullptr;
  void* pull_ = nullptr;                  // inbound; owned by the I/O thread once connect() starts it
  void* monitor_ = nullptr;               // pull_'s disconnect events; owned like pull_
  std::map<int, int> fd_rank_;            // connection fd -> the peer that sent on it (I/O thread only)
  std::map<int, int> rank_fd_;            // peer -> the connection that speaks for it (I/O thread only)
  std::map<int, uint8_t> fd_generation_;  // connection fd -> its process's generation (I/O thread only)
  std::set<int> retired_fds_;  // connections of replaced processes: ignored to the end (I/O thread only)
  struct Lost {
    int rank;
    Clock::time_point judge_at;
    uint8_t generation;  // of the process whose connection dropped
  };
  std::vector<Lost> lost_;  // peers whose connection dropped, judged later (I/O thread only)
  std::vector<std::unique_ptr<Peer>>
      peers_;         // outbound, one per runtime (nullptr for itself); set by connect()
  int wake_fd_ = -1;  // eventfd: send()/close() wake the I/O thread's poll
  std::thread io_;
  std::vector<std::unique_ptr<Lane>> send_lanes_, recv_lanes_;  // per peer; made by connect() (two-phase)
  // Two-phase receive buffers on the CPU, kept warm (already faulted in) between messages; shared with the
  // tensors it handed out, whose last reference gives the block back. nullptr: not a CPU tensor plane.
  std::shared_ptr<BufferPool> recv_pool_;

  std::mutex lifecycle_mu_;  // one connect/close transition at a time
  std::atomic<bool> connected_{false}, closing_{false};

  std::mutex out_mu_;  // messages sent before connect(), which sends them
  std::deque<Outgoing> out_;

  struct Inbound {
    Clock::time_point ready;  // when recv() may have it: its arrival, or later if an emulated link holds it
    Message msg;
  };
  std::mutex inbox_mu_;  // the I/O thread and lane threads fill, recv() drains; also guards the links below
  std::condition_variable inbox_cv_;
  std::deque<Inbound> inbox_;  // arrival order
  bool interrupted_ = false;
  // Emulated links per source runtime (empty: none): latency and transfer seconds per row, and when each link
  // is done carrying what it was given.
  std::vector<double> link_latency_s_, link_s_per_row_;
  std::vector<Clock::time_point> link_free_;

  // Counters are relaxed atomics: they are statistics, nothing orders against them.
  std::atomic<int64_t> messages_in_{0}, messages_out_{0}, bytes_in_{0}, bytes_out_{0}, messages_local_{0};
  std::array<std::atomic<int64_t>, kNumDropKinds> dropped_{};
  std::atomic<int64_t> timeouts_{0}, transfer_errors_{0}, send_blocked_{0}, send_dropped_{0}, backlog_{0};
  std::atomic<int64_t> in_flight_send_{0}, in_flight_recv_{0}, cancelled_{0};
  std::atomic<int64_t> alloc_fault_skip_{-1};  // inject_alloc_failure(): announced payloads left before it
  std::atomic<bool> alloc_fault_discard_{false};
  std::atomic<int64_t> delayed_messages_{0}, delay_ns_{0};
  std::atomic<int64_t> rejected_{0};
  std::atomic<bool> rejected_logged_{false};
  std::array<std::atomic<bool>, kNumDropKinds> drop_logged_{};

  mutable std::mutex peers_mu_;  // failed / departed sets and last_error, read by stats() on any thread
  std::map<int, std::string> failed_;
  std::vector<int> departed_;
  std::string last_error_;
  bool failure_logged_ = false;

  std::mutex graveyard_mu_;  // aborted transfers whose buffers the plane may still touch; freed on close
  std::vector<std::shared_ptr<Pending>> graveyard_;
};

}  // namespace amoe
