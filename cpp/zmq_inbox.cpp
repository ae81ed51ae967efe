// ZmqCommunicator's inbox: complete messages wait here for recv(). With emulated links (set_link_delays) a
// message from a peer is held until the link from that peer would have carried it, so emulated GPUs on
// different nodes see the network's time in flight (docs/emulation.md, "Links"); without them every message
// is ready on arrival and recv() behaves as a plain queue.
#include <algorithm>
#include <chrono>
#include <cmath>

#include "errors.h"
#include "zmq_comm.h"

namespace amoe {

namespace {

bool all_zero(const std::vector<double>& v) {
  return std::all_of(v.begin(), v.end(), [](double x) { return x == 0; });
}

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

}  // namespace

void ZmqCommunicator::set_link_delays(const std::vector<double>& latency_s,
                                      const std::vector<double>& seconds_per_row) {
  const auto n = static_cast<size_t>(num_runtimes_);
  AMOE_CHECK_ARG(latency_s.size() == n && seconds_per_row.size() == n,
                 "set_link_delays needs " << n << " latencies and " << n << " seconds per row");
  for (size_t i = 0; i < n; ++i) {
    AMOE_CHECK_ARG(std::isfinite(latency_s[i]) && latency_s[i] >= 0 && std::isfinite(seconds_per_row[i]) &&
                       seconds_per_row[i] >= 0,
                   "link delays of runtime " << i << " must be finite and >= 0");
  }
  // Holds off connect(): once peers' messages arrive, a changed latency could let a source's later message
  // overtake an earlier one.
  std::lock_guard<std::mutex> lifecycle(lifecycle_mu_);
  AMOE_CHECK_ARG(!connected_.load() && !closing_.load(), "set_link_delays must come before connect()");
  std::lock_guard<std::mutex> lock(inbox_mu_);  // a send to itself may deliver concurrently
  if (all_zero(latency_s) && all_zero(seconds_per_row)) {
    link_latency_s_.clear();
    link_s_per_row_.clear();
    link_free_.clear();
    return;
  }
  link_latency_s_ = latency_s;
  link_s_per_row_ = seconds_per_row;
  link_free_.assign(n, Clock::time_point::min());
}

// Called with inbox_mu_ held. A link moves one message at a time at its full bandwidth (back-to-back
// messages queue behind each other rather than share it), so a message starts when the link is free,
// occupies it for its rows, and is ready one latency later. Token-id messages (hidden 0, 8 bytes a row) pay
// the latency only: seconds_per_row prices rows of activations.
ZmqCommunicator::Clock::time_point ZmqCommunicator::link_ready(const MessageHeader& h,
                                                               Clock::time_point now) {
  const int src = h.src_runtime;
  if (link_latency_s_.empty() || src == rank_) return now;
  const double busy_s = h.hidden > 0 ? static_cast<double>(h.num_rows) * link_s_per_row_[src] : 0.0;
  const auto start = std::max(now, link_free_[src]);
  link_free_[src] = start + seconds(busy_s);
  const auto ready = link_free_[src] + seconds(link_latency_s_[src]);
  if (ready > now) {
    delayed_messages_.fetch_add(1, std::memory_order_relaxed);
    delay_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(ready - now).count(),
                        std::memory_order_relaxed);
  }
  return ready;
}

void ZmqCommunicator::deliver(Message msg) {
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);  // see recv()
    // Taken under the lock, so arrival times (and ready times without links) follow inbox order.
    const auto now = Clock::now();
    const auto ready = link_ready(msg.header, now);
    inbox_.push_back(Inbound{ready, std::move(msg)});
  }
  inbox_cv_.notify_one();
}

// Called with inbox_mu_ held; time_point::max() when the inbox is empty.
ZmqCommunicator::Clock::time_point ZmqCommunicator::earliest_ready() const {
  auto first = Clock::time_point::max();
  for (const auto& m : inbox_) first = std::min(first, m.ready);
  return first;
}

size_t ZmqCommunicator::recv(std::vector<Message>* out, std::chrono::microseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  // The lock pairs with deliver(); the wait drops it so the I/O and lane threads never block on recv().
  std::unique_lock<std::mutex> lock(inbox_mu_);
  // Wakes for a new arrival, an interrupt, or the earliest held message coming due, whichever is first.
  while (!interrupted_) {
    const auto now = Clock::now();
    const auto first = earliest_ready();
    if (first <= now || now >= deadline) break;
    inbox_cv_.wait_until(lock, std::min(first, deadline));
  }
  interrupted_ = false;
  return take_ready(out, Clock::now());
}

// Called with inbox_mu_ held. Moves the messages ready by `now` to out, earliest ready first.
size_t ZmqCommunicator::take_ready(std::vector<Message>* out, Clock::time_point now) {
  const auto is_ready = [now](const Inbound& m) { return m.ready <= now; };
  // Stable, so equal ready times keep arrival order; one source's ready times never decrease (its link
  // serialises), so its messages keep their order.
  const auto end = std::stable_partition(inbox_.begin(), inbox_.end(), is_ready);
  if (!link_latency_s_.empty()) {
    const auto by_ready = [](const Inbound& a, const Inbound& b) { return a.ready < b.ready; };
    std::stable_sort(inbox_.begin(), end, by_ready);
  }
  const auto n = static_cast<size_t>(end - inbox_.begin());
  for (auto it = inbox_.begin(); it != end; ++it) out->push_back(std::move(it->msg));
  inbox_.erase(inbox_.begin(), end);
  return n;
}

void ZmqCommunicator::interrupt() {
  {
    std::lock_guard<std::mutex> lock(inbox_mu_);  // a receiver between its check and its wait sees the flag
    interrupted_ = true;
  }
  inbox_cv_.notify_all();
}

}  // namespace amoe
