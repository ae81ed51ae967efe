// ZmqCommunicator's two-phase completion: the pool of receive buffers a posted receive lands in, and the lane
// threads that wait on the tensor plane and hand each completed message to recv(). The I/O thread that posts
// the receives is in zmq_inbound.cpp.
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>

#include "zmq_comm_internal.h"

namespace amoe {

// ---- receive buffers ----

ZmqCommunicator::BufferPool::~BufferPool() { close(); }

at::Tensor ZmqCommunicator::BufferPool::empty(at::IntArrayRef shape, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
  size_t nbytes = c10::elementSize(dtype);
  for (const int64_t d : shape) nbytes *= static_cast<size_t>(d);
  if (nbytes < kMinBytes) return at::empty(shape, options);
  // Size classes a quarter of a power of two apart: at most 25 % slack, and equal shapes share blocks.
  const size_t step = size_t{1} << (63 - __builtin_clzll(nbytes) - 2);
  const size_t size = (nbytes + step - 1) & ~(step - 1);
  void* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);  // see mu_
    auto it = idle_.find(size);
    if (it != idle_.end() && !it->second.blocks.empty()) {
      block = it->second.blocks.back();  // the most recently used: likeliest still in a cache
      it->second.blocks.pop_back();
      it->second.last_used = ++clock_;
      idle_bytes_ -= size;
    }
  }
  if (!block) block = c10::alloc_cpu(size);  // throws when out of memory
  // The tensor owns the block from here: its deleter gives it back (not a catch here, which could return it
  // twice). The pool outlives every tensor it handed out.
  auto self = shared_from_this();
  return at::from_blob(block, shape, [self, size](void* p) { self->give_back(p, size); }, options);
}

void ZmqCommunicator::BufferPool::give_back(void* block, size_t size) {
  std::vector<void*> evicted;
  {
    std::lock_guard<std::mutex> lock(mu_);  // see mu_
    while (!closed_ && size <= max_idle_ && idle_bytes_ + size > max_idle_) {
      // Make room by the least recently used other class, if any holds a block.
      SizeClass* victim = nullptr;
      size_t victim_size = 0;
      for (auto& [s, c] : idle_) {
        if (s != size && !c.blocks.empty() && (!victim || c.last_used < victim->last_used)) {
          victim = &c;
          victim_size = s;
        }
      }
      if (!victim) break;
      evicted.push_back(victim->blocks.front());  // the coldest block of that class
      victim->blocks.erase(victim->blocks.begin());
      idle_bytes_ -= victim_size;
    }
    if (!closed_ && idle_bytes_ + size <= max_idle_) {
      auto& c = idle_[size];
      c.blocks.push_back(block);
      c.last_used = ++clock_;
      idle_bytes_ += size;
      block = nullptr;
    }
  }
  for (void* b : evicted) c10::free_cpu(b);
  if (block) c10::free_cpu(block);
}

void ZmqCommunicator::BufferPool::close() {
  std::map<size_t, SizeClass> idle;
  {
    std::lock_guard<std::mutex> lock(mu_);  // see mu_
    closed_ = true;
    idle.swap(idle_);
    idle_bytes_ = 0;
  }
  for (auto& [size, c] : idle) {
    for (void* b : c.blocks) c10::free_cpu(b);
  }
}

// ---- lane threads ----
ZmqCommunicator::Lane::Lane(ZmqCommunicator* owner) : owner_(owner) {}

ZmqCommunicator::Lane::~Lane() {
  abort_all();
  if (thread_.joinable()) thread_.join();
}

void ZmqCommunicator::Lane::push(std::shared_ptr<Pending> p) {
  {
    std::lock_guard<std::mutex> lock(mu_);  // the I/O thread appends, the lane thread pops
    q_.push_back(std::move(p));
    // The thread starts with the first transfer: a slot no runtime holds yet (an elastic cluster's spare
    // ranks) costs no thread. Started under mu_, so the destructor's join sees it.
    if (!thread_.joinable() && !stop_) thread_ = std::thread([this] { loop(); });
  }
  cv_.notify_one();
}

void ZmqCommunicator::Lane::expire(Clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);  // the lane thread pops concurrently
  for (auto& p : q_) {
    if (now >= p->deadline && !p->expired.exchange(true)) p->transfer->abort();
  }
}

void ZmqCommunicator::Lane::cancel(uint64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);  // the lane thread pops concurrently
  for (auto& p : q_) {
    if (p->epoch < epoch) p->transfer->abort();
  }
}

void ZmqCommunicator::Lane::abort_all() {
  {
    std::lock_guard<std::mutex> lock(mu_);  // orders stop_ before the lane thread's next check
    stop_ = true;
    for (auto& p : q_) p->transfer->abort();
  }
  cv_.notify_all();
}

void ZmqCommunicator::Lane::loop() {
  if (owner_->plane_) owner_->plane_->on_lane_thread();
  while (true) {
    std::shared_ptr<Pending> p;
    {
      std::unique_lock<std::mutex> lock(mu_);  // waits for the I/O thread to post
      cv_.wait(lock, [&] { return !q_.empty() || stop_; });
      if (q_.empty()) return;
      p = q_.front();  // stays queued while waited on, so expire() can abort it
    }
    bool ok = false;
    std::string error;
    try {
      ok = p->transfer->wait();
    } catch (const std::exception& e) {
      error = e.what();
      if (error.empty()) error = "tensor plane error";
    }
    {
      std::lock_guard<std::mutex> lock(mu_);  // see push()
      q_.pop_front();
    }
    owner_->finish(p, ok, error);
  }
}

void ZmqCommunicator::finish(const std::shared_ptr<Pending>& p, bool ok, const std::string& error) {
  (p->is_recv ? in_flight_recv_ : in_flight_send_).fetch_sub(1, std::memory_order_relaxed);
  if (ok) {
    if (p->is_recv && !p->discard) {  // a discarded one was counted as dropped when it was posted
      messages_in_.fetch_add(1, std::memory_order_relaxed);
      bytes_in_.fetch_add(static_cast<int64_t>(p->nbytes), std::memory_order_relaxed);
      deliver(std::move(p->msg));
    }
    return;
  }
  {
    // The plane may still touch an aborted transfer's buffer; keep it until the communicator goes.
    std::lock_guard<std::mutex> lock(graveyard_mu_);
    graveyard_.push_back(p);
  }
  if (closing_.load()) return;  // aborted by close()
  if (stale(*p)) {              // its peer was replaced meanwhile: abandoned, no failure of the new process
    cancelled_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  const char* dir = p->is_recv ? "receive from" : "send to";
  if (p->expired.load()) {
    timeouts_.fetch_add(1, std::memory_order_relaxed);
    fail_peer(p->peer, std::string("a ") + dir + " it timed out");
  } else {
    transfer_errors_.fetch_add(1, std::memory_order_relaxed);
    fail_peer(p->peer, std::string("a ") + dir + " it failed: " + (error.empty() ? "aborted" : error));
  }
}

bool ZmqCommunicator::stale(const Pending& p) {
  if (!per_peer_) return false;
  Link& link = *links_[p.peer];
  std::lock_guard<std::mutex> lock(link.mu);  // see Link::mu
  return p.epoch != link.epoch;
}

}  // namespace amoe
