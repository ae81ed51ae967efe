// Internals of ZmqCommunicator shared by its two halves: zmq_comm.cpp (construct / connect / close, outbound
// sends, statistics) and zmq_inbound.cpp (the I/O thread: arrivals, validation and drops, two-phase receives,
// timeouts, the disconnect monitor; and the lane threads). Not part of the public interface (zmq_comm.h).
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "meta.h"
#include "zmq_comm.h"

namespace amoe {
namespace zmq_internal {

constexpr size_t kZeroCopyMin = 16 * 1024;  // below this a copy is cheaper than the bookkeeping
constexpr size_t kMetaBytes = sizeof(TransferHeader) + sizeof(MessageHeader);
constexpr uint32_t kAnyGeneration = UINT32_MAX;  // a link whose peer generation no one has named yet

// The dtypes a message may carry, with their item size; anything else on the wire is malformed.
inline bool item_size(int32_t dtype, size_t* size) {
  if (dtype < 0 || dtype >= static_cast<int32_t>(at::ScalarType::NumOptions)) return false;
  switch (static_cast<at::ScalarType>(dtype)) {
    case at::kByte:
    case at::kChar:
    case at::kBool:
      *size = 1;
      return true;
    case at::kShort:
    case at::kHalf:
    case at::kBFloat16:
      *size = 2;
      return true;
    case at::kInt:
    case at::kFloat:
      *size = 4;
      return true;
    case at::kLong:
    case at::kDouble:
      *size = 8;
      return true;
    default:
      return false;
  }
}

}  // namespace zmq_internal

// A message on its way out, in per-peer order. frame0 = TransferHeader + MessageHeader + rows.
struct ZmqCommunicator::Outgoing {
  int dest = -1;
  TransferHeader th;
  std::string frame0;
  at::Tensor data;  // contiguous, on the CPU (inline) or the plane's device
  Clock::time_point queued;
  bool numbered = false;  // seq assigned (a retry after a full queue keeps it)
};

struct ZmqCommunicator::Peer {
  std::mutex mu;  // one thread at a time on sock: send() callers, close() and the I/O thread's retries
  bool closed = false;
  void* sock = nullptr;
  std::deque<Outgoing> backlog;  // waits for room in a full ZeroMQ queue, in order
  uint64_t next_seq = 0;
  // The generation reconnect() last named (-1: none), read by the I/O thread to tell a replaced process's
  // connection from its successor's (relaxed: a stale read only delays that by one frame).
  std::atomic<int64_t> generation{-1};
  // A runtime holds this slot (connect() named its endpoint, or reconnect() did since). Slots of an elastic
  // cluster that no runtime holds yet are neither linked nor waited for (relaxed: read by stats()).
  std::atomic<bool> present{false};
};

// A posted two-phase transfer.
struct ZmqCommunicator::Pending {
  bool is_recv = false;
  bool discard = false;  // received into a discard buffer (no memory for it): dropped once complete
  int peer = -1;
  uint64_t epoch = 0;  // its link's at posting; an older one than the link's now: the peer was replaced
  uint64_t nbytes = 0;
  Clock::time_point deadline;
  std::unique_ptr<TensorPlane::Transfer> transfer;
  Message msg;  // receive: released to the inbox once the transfer is complete
  std::atomic<bool> expired{false};
};

// An announced payload whose peer has no link yet (per-peer planes, just after a replacement).
struct ZmqCommunicator::Deferred {
  TransferHeader th;
  Message msg;
  Clock::time_point deadline;
};

// The tensor-plane link to one peer. On a one-group plane every link holds that plane from the start.
struct ZmqCommunicator::Link {
  // Senders (inside the peer's mutex), the I/O thread, set_peer_link(), reconnect() and finish() on the lane
  // threads: posting under it keeps one peer's receives in announcement order (NCCL matches by order).
  std::mutex mu;
  std::shared_ptr<TensorPlane> plane;                  // nullptr: not built yet
  uint32_t generation = zmq_internal::kAnyGeneration;  // the peer process it reaches
  uint64_t epoch = 0;                                  // +1 per reconnect()
  bool broken = false;  // an announced payload had nowhere to go: nothing more is taken until a reconnect
  std::deque<Deferred> deferred;  // announced before the link came; posted in order when it does
};

// Receive buffers for a CPU tensor plane. A fresh multi-megabyte allocation made on the I/O thread comes
// from a glibc thread arena whose heaps are unmapped again once the message is freed, so every page the
// plane writes into faults first (about 1.7 ms per 4 MB here, as long as the transfer itself). The pool
// keeps the blocks messages released, by size class, and hands them out again already mapped. A block goes
// back only when the last reference to its tensor (and every view) dies, so nothing the engine holds, nor
// a buffer an aborted transfer may still touch, is ever reused. At most max_idle bytes stay idle: a block
// returning to a full pool evicts the least recently used other classes first (sizes change over time).
// After close() every block is freed when it comes back.
class ZmqCommunicator::BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  static constexpr size_t kMinBytes = 64 * 1024;  // smaller buffers come from malloc's bins, already warm
  explicit BufferPool(size_t max_idle) : max_idle_(max_idle) {}
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // An uninitialised CPU tensor; its memory comes from the pool when it is at least kMinBytes.
  at::Tensor empty(at::IntArrayRef shape, at::ScalarType dtype);
  // Frees the idle blocks; blocks given back later are freed at once.
  void close();

 private:
  struct SizeClass {
    std::vector<void*> blocks;  // idle, most recently returned last
    uint64_t last_used = 0;
  };
  void give_back(void* block, size_t size);

  const size_t max_idle_;
  std::mutex mu_;  // the I/O thread takes blocks, any thread that drops a tensor gives one back
  std::map<size_t, SizeClass> idle_;  // by class size in bytes
  size_t idle_bytes_ = 0;
  uint64_t clock_ = 0;  // orders uses of classes
  bool closed_ = false;
};

// One thread completing one peer's transfers of one direction in posting order.
class ZmqCommunicator::Lane {
 public:
  explicit Lane(ZmqCommunicator* owner);
  ~Lane();

  void push(std::shared_ptr<Pending> p);
  // Aborts transfers past their deadline; the lane thread then reports them as timeouts.
  void expire(Clock::time_point now);
  // Aborts the transfers posted before `epoch` (a replaced peer's); the lane goes on with later ones.
  void cancel(uint64_t epoch);
  void abort_all();

 private:
  void loop();

  ZmqCommunicator* owner_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> q_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace amoe
