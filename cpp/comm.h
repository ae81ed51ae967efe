// Messages and the communicator interface. A message is a batch of rows for one destination runtime:
// a fixed header, RowMeta per row, and one tensor (the tensor plane). The loopback hub wires several
// engines inside one process; the ZeroMQ communicator implements the same interface.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "meta.h"

namespace amoe {

struct Message {
  MessageHeader header;
  std::vector<RowMeta> rows;  // [num_rows]
  at::Tensor data;            // [num_rows, hidden] activations, or int64 [num_rows] token ids
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  // This runtime's id in the placement map.
  virtual int rank() const = 0;
  // Hands a message to runtime dest (may be rank() itself); never blocks on the receiver.
  virtual void send(int dest, Message msg) = 0;
  // Moves every waiting inbound message into out, waiting up to timeout for the first; returns how many.
  virtual size_t recv(std::vector<Message>* out, std::chrono::microseconds timeout) = 0;
  // Wakes a recv() that is waiting (used by stop()).
  virtual void interrupt() = 0;
};

// In-process inboxes, one per runtime; LoopbackHub::communicator(r) is runtime r's endpoint.
class LoopbackHub : public std::enable_shared_from_this<LoopbackHub> {
 public:
  explicit LoopbackHub(int num_runtimes) : inboxes_(num_runtimes) {
    for (auto& box : inboxes_) box = std::make_unique<Inbox>();
  }
  int num_runtimes() const { return static_cast<int>(inboxes_.size()); }
  std::shared_ptr<Communicator> communicator(int rank);

  void push(int dest, Message msg) {
    Inbox& box = *inboxes_.at(dest);
    {
      // Senders on any thread append to the receiver's inbox; the lock guards the deque.
      std::lock_guard<std::mutex> lock(box.mu);
      box.messages.push_back(std::move(msg));
    }
    box.cv.notify_one();
  }

  size_t pop_all(int rank, std::vector<Message>* out, std::chrono::microseconds timeout) {
    Inbox& box = *inboxes_.at(rank);
    // The lock pairs with push(); the wait drops it so senders are never blocked by a waiting receiver.
    std::unique_lock<std::mutex> lock(box.mu);
    if (box.messages.empty() && !box.interrupted) {
      box.cv.wait_for(lock, timeout, [&] { return !box.messages.empty() || box.interrupted; });
    }
    box.interrupted = false;
    const size_t n = box.messages.size();
    for (auto& m : box.messages) out->push_back(std::move(m));
    box.messages.clear();
    return n;
  }

  void interrupt(int rank) {
    Inbox& box = *inboxes_.at(rank);
    {
      // Under the lock so a receiver between its check and its wait cannot miss the flag.
      std::lock_guard<std::mutex> lock(box.mu);
      box.interrupted = true;
    }
    box.cv.notify_all();
  }

 private:
  struct Inbox {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Message> messages;
    bool interrupted = false;
  };
  std::vector<std::unique_ptr<Inbox>> inboxes_;
};

class LoopbackCommunicator : public Communicator {
 public:
  LoopbackCommunicator(std::shared_ptr<LoopbackHub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}
  int rank() const override { return rank_; }
  void send(int dest, Message msg) override {
    msg.header.src_runtime = rank_;
    hub_->push(dest, std::move(msg));
  }
  size_t recv(std::vector<Message>* out, std::chrono::microseconds timeout) override {
    return hub_->pop_all(rank_, out, timeout);
  }
  void interrupt() override { hub_->interrupt(rank_); }

 private:
  std::shared_ptr<LoopbackHub> hub_;
  int rank_;
};

inline std::shared_ptr<Communicator> LoopbackHub::communicator(int rank) {
  (void)inboxes_.at(rank);  // range check
  return std::make_shared<LoopbackCommunicator>(shared_from_this(), rank);
}

}  // namespace amoe
