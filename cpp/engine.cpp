#include "engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>

#include "dispatch.h"
#include "errors.h"

namespace amoe {

namespace {

using Clock = std::chrono::steady_clock;

at::Tensor index_rows(const at::Tensor& data, const std::vector<int64_t>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  bool identity = n == data.size(0);
  for (int64_t i = 0; identity && i < n; ++i) identity = rows[i] == i;
  if (identity) return data;  // the whole output goes to one runtime in order: no copy
  auto idx = at::empty({n}, at::kLong);
  std::memcpy(idx.data_ptr<int64_t>(), rows.data(), n * sizeof(int64_t));
  return data.index_select(0, idx.to(data.device()));
}

Message make_message(std::vector<RowMeta>&& rows, at::Tensor data) {
  Message m;
  m.header.num_rows = static_cast<int64_t>(rows.size());
  m.header.dtype = static_cast<int32_t>(data.scalar_type());
  m.header.hidden = data.dim() == 2 ? data.size(1) : 0;
  m.rows = std::move(rows);
  m.data = std::move(data);
  return m;
}

}  // namespace

Engine::Engine(const EngineConfig& cfg, std::shared_ptr<Communicator> comm)
    : cfg_(cfg), comm_(std::move(comm)), queues_(cfg) {
  AMOE_CHECK_ARG(comm_ != nullptr, "engine needs a communicator");
  AMOE_CHECK_ARG(comm_->rank() == cfg.runtime_id,
                 "communicator rank " << comm_->rank() << " differs from runtime_id " << cfg.runtime_id);
  for (int r : cfg.expert_runtime) num_runtimes_ = std::max(num_runtimes_, r + 1);
  for (int r : cfg.attn_runtime) num_runtimes_ = std::max(num_runtimes_, r + 1);
  for (const auto& where : cfg.replicas)
    for (int r : where) num_runtimes_ = std::max(num_runtimes_, r + 1);
  num_runtimes_ = std::max(num_runtimes_, cfg.runtime_id + 1);
  hold_unfiled_ = cfg.is_attention && cfg.policy == "waves";
}

Engine::~Engine() { stop(); }

void Engine::start() {
  std::lock_guard<std::mutex> lock(lifecycle_mu_);  // one start/stop transition at a time
  AMOE_CHECK_ARG(!stopping_.load(), "engine was stopped; build a new one");
  if (started_.load()) return;
  receptor_ = std::thread([this] { receptor_loop(); });
  dispatcher_ = std::thread([this] { dispatcher_loop(); });
  started_.store(true);
}

void Engine::stop() {
  std::lock_guard<std::mutex> lock(lifecycle_mu_);  // a second stop() waits for the first, then no-ops
  stopping_.store(true);
  {
    // Taking each lock orders the flag before any waiter's predicate check, so no wake-up is lost.
    std::lock_guard<std::mutex> q(mu_);
  }
  ready_cv_.notify_all();
  {
    std::lock_guard<std::mutex> j(jobs_mu_);
  }
  jobs_cv_.notify_all();
  comm_->interrupt();
  if (receptor_.joinable()) receptor_.join();
  if (dispatcher_.joinable()) dispatcher_.join();
}

void Engine::ingest(Message msg) {
  {
    std::lock_guard<std::mutex> lock(mu_);  // pool and queues are shared with next_batch()
    queues_.ingest(std::move(msg));
  }
  ready_cv_.notify_all();
}

size_t Engine::pump(double timeout_s) {
  std::vector<Message> msgs;
  const auto timeout = std::chrono::microseconds(static_cast<int64_t>(std::max(0.0, timeout_s) * 1e6));
  const size_t n = comm_->recv(&msgs, timeout);
  constexpr size_t kPerLock = 32;
  for (size_t lo = 0; lo < n; lo += kPerLock) {
    bool was_empty;
    {
      // A bounded group of messages per lock hold: few hand-offs, yet next_batch() can run during a backlog.
      std::lock_guard<std::mutex> lock(mu_);
      // A holding scheduler waits for exactly these arrivals (its returning wave): wake it too.
      was_empty = queues_.depth_total() == 0 || queues_.holding();
      for (size_t i = lo; i < std::min(n, lo + kPerLock); ++i) queues_.ingest(std::move(msgs[i]));
    }
    if (was_empty) ready_cv_.notify_all();  // next_batch() only waits while every queue is empty or it holds
  }
  return n;
}

void Engine::receptor_loop() {
  while (!stopping_.load()) {
    try {
      pump(0.02);  // bounded wait so a missed interrupt still ends the loop within 20 ms
    } catch (const std::exception&) {
      errors_.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

void Engine::add_tokens(const at::Tensor& request_ids, const at::Tensor& token_ids,
                        const at::Tensor& positions, const at::Tensor& chunk_starts,
                        const at::Tensor& chunk_lens) {
  AMOE_CHECK_ARG(cfg_.is_attention, "add_tokens is for attention runtimes");
  enter_block0(request_ids, token_ids, positions, chunk_starts, chunk_lens);
}

// Rows for ATTN (0, rank) of this attention runtime: per row its request, token id, position and chunk. Their
// requests are held from here on (request tracking) until they finish or are forgotten.
void Engine::enter_block0(const at::Tensor& request_ids, const at::Tensor& token_ids,
                          const at::Tensor& positions, const at::Tensor& chunk_starts,
                          const at::Tensor& chunk_lens) {
  const int64_t n = token_ids.numel();
  for (const at::Tensor* t : {&request_ids, &positions, &chunk_starts, &chunk_lens}) {
    AMOE_CHECK_ARG(t->dim() == 1 && t->numel() == n,
                   "token rows: every array must be 1-D with " << n << " rows");
  }
  AMOE_CHECK_ARG(token_ids.dim() == 1, "token_ids must be 1-D");
  if (n == 0) return;
  auto rq = request_ids.to(at::kLong).contiguous(), ps = positions.to(at::kLong).contiguous();
  auto cs = chunk_starts.to(at::kLong).contiguous(), cl = chunk_lens.to(at::kLong).contiguous();
  std::vector<RowMeta> rows(n);
  for (int64_t i = 0; i < n; ++i) {
    RowMeta& m = rows[i];
    m.request_id = static_cast<uint64_t>(rq.data_ptr<int64_t>()[i]);
    m.layer = LayerId{kAttn, 0, cfg_.attn_rank};
    m.position = static_cast<int32_t>(ps.data_ptr<int64_t>()[i]);
    m.chunk_start = static_cast<int32_t>(cs.data_ptr<int64_t>()[i]);
    m.chunk_len = static_cast<int32_t>(cl.data_ptr<int64_t>()[i]);
    m.slot = 0;
    m.expert_id = -1;
    m.weight = 0.f;
    m.attn_rank = cfg_.attn_rank;
  }
  Message msg = make_message(std::move(rows), token_ids.to(at::kLong).contiguous());
  {
    std::lock_guard<std::mutex> lock(mu_);  // the tracked set, pool and queues are shared with the receptor
    for (const RowMeta& m : msg.rows) queues_.admit(m.request_id);
    queues_.ingest(std::move(msg));
  }
  ready_cv_.notify_all();
}

void Engine::forget(const at::Tensor& request_ids, bool purge) {
  auto ids = request_ids.to(at::kLong).contiguous();
  std::vector<uint64_t> gone(ids.numel());
  for (int64_t i = 0; i < ids.numel(); ++i) gone[i] = static_cast<uint64_t>(ids.data_ptr<int64_t>()[i]);
  std::lock_guard<std::mutex> lock(mu_);  // the tracked set, pool and queues are shared with the receptor
  queues_.forget(gone, purge);
}

std::shared_ptr<Batch> Engine::next_batch(double timeout_s) {
  polls_.fetch_add(1, std::memory_order_relaxed);
  Drained d;
  bool got = false;
  {
    std::unique_lock<std::mutex> lock(mu_);  // the scheduler sees a consistent set of queues
    const auto t0 = Clock::now();
    const bool forever = timeout_s < 0;
    const auto deadline =
        t0 + std::chrono::microseconds(static_cast<int64_t>(std::max(0.0, timeout_s) * 1e6));
    constexpr auto kNever = Clock::time_point::max();
    // The waves policy holds for a returning wave, at most cfg_.max_wave_hold_s. A guard, not a tuning knob:
    // in steady state the wave is back within one round trip (milliseconds); only a lost row (resent after
    // the transport's timeout) or a failed expert batch keeps a part out, and the hold must not wait for
    // those.
    const auto max_hold =
        std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg_.max_wave_hold_s));
    auto hold_until = kNever;
    while (!stopping_.load()) {
      const auto now = Clock::now();
      if (hold_unfiled_ && attn_unfiled_ > 0) {  // waves: the last step's outputs first (engine.h)
        if (!forever && now >= deadline) break;
        if (forever)
          ready_cv_.wait(lock);
        else
          ready_cv_.wait_until(lock, deadline);
        continue;
      }
      if ((got = queues_.drain(&d, now >= hold_until))) break;
      if (!queues_.holding()) {
        hold_until = kNever;
      } else if (hold_until == kNever) {
        hold_until = now + max_hold;
      }
      // An expert runtime's rank barrier (waves) ends a block's wait at a time it knows: wake then too.
      const auto release = queues_.holding() ? queues_.release_at() : kNever;
      const auto wake = std::min(release, forever ? hold_until : std::min(deadline, hold_until));
      if (wake == kNever) {
        ready_cv_.wait(lock);
      } else if (ready_cv_.wait_until(lock, wake) == std::cv_status::timeout && !forever &&
                 Clock::now() >= deadline) {
        got = !stopping_.load() && queues_.drain(&d, Clock::now() >= hold_until);
        break;
      }
    }
    idle_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  }
  if (!got) return nullptr;
  // Assembly reads only the drained rows and the immutable config: no lock, so the receptor keeps going.
  auto batch = std::make_shared<Batch>(queues_.assemble(std::move(d)));
  batch->is_head = batch->layer.kind == kAttn && batch->layer.block == cfg_.num_blocks;
  return batch;
}

void Engine::push_job(Job job) {
  if (!started_.load() ||
      stopping_.load()) {  // no dispatcher thread: relabel and send on the caller's thread
    dispatch(job);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);  // hand-off to the dispatcher thread
    jobs_.push_back(std::move(job));
  }
  jobs_cv_.notify_one();
}

void Engine::submit_expert(std::shared_ptr<Batch> batch, at::Tensor out) {
  AMOE_CHECK_ARG(batch && batch->layer.kind == kExpert, "submit_expert needs an expert batch");
  AMOE_CHECK_ARG(out.dim() == 2 && out.size(0) == batch->num_rows() && out.size(1) == cfg_.hidden,
                 "expert output must be [" << batch->num_rows() << ", " << cfg_.hidden << "]");
  push_job(Job{std::move(batch), std::move(out), {}, {}, {}});
}

void Engine::submit_attention(std::shared_ptr<Batch> batch, at::Tensor residual, at::Tensor moe_input,
                              at::Tensor topk_ids, at::Tensor topk_weights) {
  AMOE_CHECK_ARG(batch && batch->layer.kind == kAttn && batch->layer.block < cfg_.num_blocks,
                 "submit_attention needs an attention batch of block < num_blocks");
  const int64_t n = batch->num_rows();
  AMOE_CHECK_ARG(residual.dim() == 2 && residual.size(0) == n && residual.size(1) == cfg_.hidden,
                 "residual must be [" << n << ", " << cfg_.hidden << "]");
  AMOE_CHECK_ARG(moe_input.sizes() == residual.sizes(),
                 "moe_input must be [" << n << ", " << cfg_.hidden << "]");
  AMOE_CHECK_ARG(topk_ids.dim() == 2 && topk_ids.size(0) == n && topk_ids.size(1) == cfg_.top_k,
                 "topk_ids must be [" << n << ", " << cfg_.top_k << "]");
  AMOE_CHECK_ARG(topk_weights.sizes() == topk_ids.sizes(),
                 "topk_weights must be [" << n << ", " << cfg_.top_k << "]");
  if (n > 0) {
    // Checked here, on the caller's thread, so a bad router output raises instead of stranding pool entries.
    auto [lo, hi] = at::aminmax(topk_ids);
    AMOE_CHECK_ARG(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < cfg_.num_experts,
                   "topk_ids must be in [0, " << cfg_.num_experts << ")");
  }
  if (hold_unfiled_) {
    std::lock_guard<std::mutex> lock(mu_);  // next_batch reads it under the same lock
    ++attn_unfiled_;
  }
  push_job(Job{std::move(batch), std::move(moe_input), std::move(residual), std::move(topk_ids),
               std::move(topk_weights)});
}

void Engine::submit_head(std::shared_ptr<Batch> batch, const at::Tensor& request_ids,
                         const at::Tensor& token_ids, const at::Tensor& positions,
                         const at::Tensor& finished) {
  AMOE_CHECK_ARG(batch && batch->layer.kind == kAttn && batch->layer.block == cfg_.num_blocks,
                 "submit_head needs a head batch (ATTN block num_blocks)");
  // The head's output is the next decode row of each request that goes on (sampling and stop decisions are
  // Python's): it re-enters block 0 here as one-row chunks, like any layer's output entering the next layer.
  // Finished requests have no rows anywhere else (all their parts met at the head): forgetting them suffices.
  forget(finished, /*purge=*/false);
  enter_block0(request_ids, token_ids, positions, positions, at::ones_like(positions, at::kLong));
}

void Engine::dispatcher_loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(jobs_mu_);  // pairs with push_job()
      jobs_cv_.wait(lock, [&] { return stopping_.load() || !jobs_.empty(); });
      if (stopping_.load()) return;  // pending jobs are dropped on stop
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    try {
      dispatch(job);
    } catch (const std::exception&) {
      errors_.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

void Engine::dispatch(const Job& job) {
  if (job.batch->layer.kind == kExpert) {
    dispatch_expert(job);
  } else {
    dispatch_attention(job);
  }
}

// EXPERT (b, e) -> ATTN (b + 1, attn_rank) on the runtime serving that rank; the slot tells the pool which
// part.
void Engine::dispatch_expert(const Job& job) {
  const Batch& b = *job.batch;
  const int64_t n = b.num_rows();
  std::vector<RowMeta> rows(b.meta);
  std::vector<int64_t> dest(n), src(n);
  for (int64_t i = 0; i < n; ++i) {
    RowMeta& m = rows[i];
    m.layer = LayerId{kAttn, b.layer.block + 1, m.attn_rank};
    dest[i] = cfg_.attn_runtime.at(m.attn_rank);
    src[i] = i;
  }
  send_grouped(std::move(rows), src, dest, job.out);
}

// ATTN (b, r) -> K copies to EXPERT (b, topk_ids) on their runtimes; the residual stays here as slot 0 of
// ATTN (b + 1, r).
void Engine::dispatch_attention(const Job& job) {
  // waves: however this job ends (filed, or an exception), its batch no longer holds the next pick
  // (engine.h).
  struct Filed {
    Engine* e;
    bool done = false;
    void operator()() {
      if (done || !e->hold_unfiled_) return;
      done = true;
      {
        std::lock_guard<std::mutex> lock(e->mu_);
        --e->attn_unfiled_;
      }
      e->ready_cv_.notify_all();
    }
    ~Filed() { (*this)(); }
  } filed{this};
  const Batch& b = *job.batch;
  const int64_t n = b.num_rows();
  const int k = cfg_.top_k;
  std::vector<RowMeta> keep(b.meta);
  for (RowMeta& m : keep) m.layer = LayerId{kAttn, b.layer.block + 1, cfg_.attn_rank};
  auto ids = job.topk_ids.to(at::kCPU, at::kLong).contiguous();
  auto ws = job.topk_weights.to(at::kCPU, at::kFloat).contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* wp = ws.data_ptr<float>();
  std::vector<RowMeta> rows(n * k);
  std::vector<int64_t> dest(n * k), src(n * k);
  for (int64_t i = 0; i < n; ++i) {
    for (int s = 0; s < k; ++s) {
      const int64_t j = i * k + s;
      const int64_t e = ip[j];
      AMOE_CHECK_ARG(e >= 0 && e < cfg_.num_experts, "router chose expert " << e << " outside the model");
      RowMeta& m = rows[j];
      m = b.meta[i];
      m.layer = LayerId{kExpert, b.layer.block, static_cast<int32_t>(e)};
      m.slot = s + 1;
      m.expert_id = static_cast<int32_t>(e);
      m.weight = wp[j];
      src[j] = i;
    }
  }
  {
    // The residual waits here, and (tracking requests) each expert output it waits for is on record with
    // what it takes to ask again, before any row leaves: an answer can never arrive unexpected. Replicas
    // are chosen under the same lock that a map change takes, so a row is on record at the replica it went
    // to before anyone can see that replica's outstanding rows drop to zero.
    std::lock_guard<std::mutex> lock(mu_);  // pool, queues, map and expectations are shared
    queues_.ingest(make_message(std::move(keep), job.residual));
    std::vector<int64_t> load = queues_.inflight();
    for (int64_t j = 0; j < n * k; ++j) dest[j] = queues_.choose(b.layer.block, rows[j].layer.index, &load);
    if (cfg_.track_requests) {
      const auto now = Clock::now();
      for (int64_t j = 0; j < n * k; ++j) queues_.expect(rows[j], TensorRef{job.out, src[j]}, dest[j], now);
    }
  }
  filed();  // before the sends: the next pick need not wait for the network
  ready_cv_.notify_all();
  send_grouped(std::move(rows), src, dest, job.out);
}

int64_t Engine::resend(int runtime, double older_than_s) {
  const auto cutoff =
      Clock::now() - std::chrono::microseconds(static_cast<int64_t>(std::max(0.0, older_than_s) * 1e6));
  std::vector<Expected> due;
  {
    std::lock_guard<std::mutex> lock(mu_);  // the expectations are shared with the receptor
    due = queues_.due(runtime, cutoff);
  }
  std::map<int, std::vector<const Expected*>> by_dest;
  for (const Expected& e : due) by_dest[e.dest].push_back(&e);
  for (auto& [dest, parts] : by_dest) {
    const at::Tensor& first = parts.front()->input.t;
    auto data = at::empty({static_cast<int64_t>(parts.size()), first.size(1)}, first.options());
    std::vector<RowMeta> rows;
    rows.reserve(parts.size());
    for (size_t i = 0; i < parts.size(); ++i) {
      rows.push_back(parts[i]->sent);
      data[static_cast<int64_t>(i)].copy_(parts[i]->input.t[parts[i]->input.row]);
    }
    comm_->send(dest, make_message(std::move(rows), data));
  }
  resent_.fetch_add(static_cast<int64_t>(due.size()), std::memory_order_relaxed);
  return static_cast<int64_t>(due.size());
}

void Engine::set_replicas(int block, int expert, const std::vector<int>& runtimes) {
  std::lock_guard<std::mutex> lock(mu_);  // the dispatcher chooses replicas under it (dispatch_attention)
  queues_.set_replicas(block, expert, runtimes);
}

std::vector<int> Engine::replicas(int block, int expert) {
  AMOE_CHECK_ARG(cfg_.is_attention, "only an attention runtime routes to replicas");
  std::lock_guard<std::mutex> lock(mu_);  // set_replicas may run on the control thread
  queues_.check_layer(block, expert);
  return queues_.replicas(block, expert);
}

int64_t Engine::outstanding(const std::vector<std::array<int, 3>>& replicas) {
  std::lock_guard<std::mutex> lock(mu_);  // the expectations are shared with the receptor and dispatcher
  return queues_.outstanding(replicas);
}

void Engine::host(int block, int expert) {
  std::lock_guard<std::mutex> lock(mu_);  // the receptor routes rows by the hosted set
  queues_.host(block, expert);
}

int64_t Engine::unhost(int block, int expert) {
  std::lock_guard<std::mutex> lock(mu_);  // the receptor and next_batch() share the queues
  return queues_.unhost(block, expert);
}

void Engine::send_grouped(std::vector<RowMeta>&& rows, const std::vector<int64_t>& src_rows,
                          const std::vector<int64_t>& dest, const at::Tensor& data) {
  const int64_t n = static_cast<int64_t>(rows.size());
  // A replica may live on a runtime that joined after this engine was built: size by the destinations too.
  int64_t num_dest = num_runtimes_;
  for (int64_t d : dest) num_dest = std::max(num_dest, d + 1);
  std::vector<int64_t> perm(n), offsets(num_dest + 1);
  group_rows(dest.data(), n, num_dest, perm.data(), offsets.data());
  for (int r = 0; r < num_dest; ++r) {
    const int64_t lo = offsets[r], hi = offsets[r + 1];
    if (lo == hi) continue;
    std::vector<RowMeta> part(hi - lo);
    std::vector<int64_t> part_src(hi - lo);
    for (int64_t i = lo; i < hi; ++i) {
      part[i - lo] = rows[perm[i]];
      part_src[i - lo] = src_rows[perm[i]];
    }
    comm_->send(r, make_message(std::move(part), index_rows(data, part_src)));
    tokens_out_.fetch_add(hi - lo, std::memory_order_relaxed);
    messages_out_.fetch_add(1, std::memory_order_relaxed);
  }
}

EngineStats Engine::stats() {
  EngineStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);  // a consistent snapshot of queues and pool
    const auto& all = queues_.queues();
    for (size_t i = 0; i < all.size(); ++i) {
      if (!queues_.listed(i)) continue;  // an expert id this runtime never hosted
      const MuQueue& q = all[i];
      s.layers.push_back(q.layer);
      s.depth.push_back(q.depth);
      s.batches.push_back(q.batches);
      s.rows.push_back(q.rows_drained);
    }
    s.pool_entries = queues_.pool_entries();
    s.pool_parts = queues_.pool_parts();
    s.tokens_in = queues_.rows_in();
    s.drops = queues_.drops();
    s.tracked_requests = queues_.num_tracked();
    s.expected_parts = queues_.num_expected();
    s.inflight = queues_.inflight();
    s.idle_s = static_cast<double>(idle_ns_) * 1e-9;
  }
  {
    std::lock_guard<std::mutex> lock(jobs_mu_);  // size of the dispatcher's backlog
    s.dispatch_pending = static_cast<int64_t>(jobs_.size());
  }
  s.tokens_out = tokens_out_.load(std::memory_order_relaxed);
  s.messages_out = messages_out_.load(std::memory_order_relaxed);
  s.errors = errors_.load(std::memory_order_relaxed);
  s.polls = polls_.load(std::memory_order_relaxed);
  s.resent_rows = resent_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace amoe
