// The execution engine of one runtime: a receptor thread (communicator -> token pool -> μ-queues), the
// scheduler and batch assembly behind next_batch(), and a dispatcher thread (relabel, group by destination,
// send). Python only calls next_batch() and submit_*(); no Python runs on the engine's threads.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "comm.h"
#include "queues.h"

namespace amoe {

struct EngineStats {
  std::vector<LayerId> layers;   // every hosted queue
  std::vector<int64_t> depth;    // rows waiting per queue
  std::vector<int64_t> batches;  // batches executed per queue
  std::vector<int64_t> rows;     // rows executed per queue
  int64_t pool_entries = 0, pool_parts = 0;
  int64_t tokens_in = 0, tokens_out = 0, messages_out = 0;
  int64_t dispatch_pending = 0, errors = 0;
  int64_t tracked_requests = 0;   // requests held (track_requests)
  int64_t polls = 0;              // calls of next_batch(): the loop's progress
  int64_t expected_parts = 0;     // expert outputs still awaited (track_requests)
  int64_t resent_rows = 0;        // rows sent again to the experts
  std::vector<int64_t> inflight;  // expert outputs awaited per destination runtime (track_requests)
  DropCounts drops;
  double idle_s = 0;  // time next_batch() waited with nothing to run
};

class Engine {
 public:
  Engine(const EngineConfig& cfg, std::shared_ptr<Communicator> comm);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void start();
  void stop();  // idempotent; joins both threads
  bool running() const { return started_.load() && !stopping_.load(); }

  // Receptor path, also callable directly (tests, and a runtime injecting its own tokens).
  void ingest(Message msg);
  // Receives whatever the communicator holds (waiting up to timeout) and ingests it; for use without start().
  size_t pump(double timeout_s);
  // New prompts and next decode tokens of this attention rank: rows for ATTN (0, rank).
  void add_tokens(const at::Tensor& request_ids, const at::Tensor& token_ids, const at::Tensor& positions,
                  const at::Tensor& chunk_starts, const at::Tensor& chunk_lens);

  // The next assembled batch, or nullptr after timeout_s (< 0: wait until stop()) or once stopped.
  std::shared_ptr<Batch> next_batch(double timeout_s);

  // Layer outputs of a batch from next_batch(); relabelled and sent by the dispatcher thread (or inline
  // when the engine is not started).
  void submit_expert(std::shared_ptr<Batch> batch, at::Tensor out);
  void submit_attention(std::shared_ptr<Batch> batch, at::Tensor residual, at::Tensor moe_input,
                        at::Tensor topk_ids, at::Tensor topk_weights);
  // The head's continuing requests (request id, sampled token, its position) re-enter ATTN (0, rank); the
  // finished ones are no longer held (request tracking).
  void submit_head(std::shared_ptr<Batch> batch, const at::Tensor& request_ids, const at::Tensor& token_ids,
                   const at::Tensor& positions, const at::Tensor& finished);
  // Requests that ended elsewhere (a failed batch, an abort that timed out): their later rows are dropped,
  // and with purge their parts and chunks still waiting here too.
  void forget(const at::Tensor& request_ids, bool purge);
  // Asks again for the expert outputs this attention runtime still waits for, sent to `runtime` (any, when
  // -1) at least `older_than_s` ago: after a replaced expert runtime joins, or when answers seem lost. Their
  // late answers, if any, are dropped as duplicates. Returns the rows sent.
  int64_t resend(int runtime, double older_than_s);

  // The live expert map (docs/rebalancing.md), changed while serving, each call atomic under the queue lock.
  // Attention runtime: rows of (block, expert) go to these replicas from now on (rows sent before are still
  // awaited where they went).
  void set_replicas(int block, int expert, const std::vector<int>& runtimes);
  std::vector<int> replicas(int block, int expert);
  // Attention runtime: expert outputs still awaited from any of these (runtime, block, expert) replicas — a
  // drained replica owes none.
  int64_t outstanding(const std::vector<std::array<int, 3>>& replicas);
  // Expert runtime: (block, expert) takes rows from now on (its weights must have landed in the executor).
  void host(int block, int expert);
  // Expert runtime: rows of (block, expert) arriving from now on are misrouted; those still queued (second
  // copies, once its replica drained) are dropped and counted. Returns how many.
  int64_t unhost(int block, int expert);

  EngineStats stats();
  const EngineConfig& config() const { return cfg_; }

 private:
  struct Job {
    std::shared_ptr<Batch> batch;
    at::Tensor out, residual, topk_ids, topk_weights;  // expert: out; attention: all four (out = moe_input)
  };

  void enter_block0(const at::Tensor& request_ids, const at::Tensor& token_ids, const at::Tensor& positions,
                    const at::Tensor& chunk_starts, const at::Tensor& chunk_lens);
  void receptor_loop();
  void dispatcher_loop();
  void push_job(Job job);
  void dispatch(const Job& job);
  void dispatch_expert(const Job& job);
  void dispatch_attention(const Job& job);
  void send_grouped(std::vector<RowMeta>&& rows, const std::vector<int64_t>& src_rows,
                    const std::vector<int64_t>& dest, const at::Tensor& data);

  EngineConfig cfg_;
  std::shared_ptr<Communicator> comm_;
  int num_runtimes_ = 0;

  std::mutex mu_;  // guards queues_, idle_ns_: the receptor, add_tokens and next_batch contend here
  std::condition_variable ready_cv_;  // signalled when rows enter a μ-queue or on stop
  LayerQueues queues_;
  int64_t idle_ns_ = 0;
  // waves, attention runtime: attention batches submitted whose outputs the dispatcher has not yet filed (as
  // the next block's residuals and expected expert outputs). Until it has, the batch's wave is in none of the
  // queues' counts, and the scheduler would serve the wave's other rows (new requests at block 0) as a
  // fragment.
  int64_t attn_unfiled_ = 0;  // guarded by mu_
  bool hold_unfiled_ = false;

  std::mutex jobs_mu_;  // guards jobs_: submit (Python thread) produces, the dispatcher consumes
  std::condition_variable jobs_cv_;
  std::deque<Job> jobs_;

  std::mutex lifecycle_mu_;  // serialises start()/stop() so concurrent stops join once
  std::atomic<bool> started_{false};
  std::atomic<bool> stopping_{false};  // seq_cst: read in wait predicates that also hold the matching lock
  std::thread receptor_, dispatcher_;

  std::atomic<int64_t> tokens_out_{0}, messages_out_{0}, errors_{0};  // relaxed counters
  // Calls of next_batch(): the loop thread's heartbeat. A loop wedged in Python stops it while the control
  // thread goes on reporting, which is how the coordinator tells a stuck runtime from a slow one. Relaxed
  // counter.
  std::atomic<int64_t> polls_{0};
  std::atomic<int64_t> resent_{0};  // rows sent again (resend); relaxed counter
};

}  // namespace amoe
