#include "queues.h"

#include <algorithm>
#include <cstring>

#include "dispatch.h"
#include "errors.h"

namespace amoe {

void EngineConfig::validate() const {
  AMOE_CHECK_ARG(num_blocks > 0, "num_blocks must be positive, got " << num_blocks);
  AMOE_CHECK_ARG(num_experts > 0, "num_experts must be positive, got " << num_experts);
  AMOE_CHECK_ARG(top_k >= 1 && top_k <= num_experts, "top_k must be in [1, num_experts], got " << top_k);
  AMOE_CHECK_ARG(hidden > 0, "hidden must be positive, got " << hidden);
  AMOE_CHECK_ARG(
      static_cast<int>(expert_runtime.size()) == num_experts,
      "expert_runtime needs one runtime per expert (" << num_experts << "), got " << expert_runtime.size());
  AMOE_CHECK_ARG(!attn_runtime.empty(), "attn_runtime must list at least one attention rank");
  AMOE_CHECK_ARG(
      !policy.empty() && lookahead >= 0 && decay >= 0 && attn_cap > 0 && expert_cap > 0 &&
          (group_experts == 0 || group_experts == 1) && max_wave_hold_s > 0,
      "scheduling settings unset or out of range (amoe.core.engine_config fills them from the config)");
  AMOE_CHECK_ARG(num_waves >= 1, "num_waves must be >= 1, got " << num_waves);
  AMOE_CHECK_ARG(wave_group >= 0, "wave_group must be >= 0, got " << wave_group);
  AMOE_CHECK_ARG(replicas.empty() ||
                     static_cast<int64_t>(replicas.size()) == static_cast<int64_t>(num_blocks) * num_experts,
                 "replicas needs one entry per (block, expert): " << num_blocks * num_experts << ", got "
                                                                  << replicas.size());
  for (const auto& where : replicas) {
    AMOE_CHECK_ARG(!where.empty(), "every (block, expert) needs at least one replica");
    for (int r : where) AMOE_CHECK_ARG(r >= 0, "replica runtime ids must be >= 0, got " << r);
  }
  if (is_attention) {
    AMOE_CHECK_ARG(attn_rank >= 0 && attn_rank < static_cast<int>(attn_runtime.size()),
                   "attn_rank " << attn_rank << " has no entry in attn_runtime");
  } else {
    // A live placement's runtime may host nothing for a while: one that joins gets its replicas by a
    // rebalance.
    AMOE_CHECK_ARG(!experts.empty() || !hosted.empty() || !replicas.empty(),
                   "an expert runtime must host at least one expert");
    for (int e : experts) AMOE_CHECK_ARG(e >= 0 && e < num_experts, "hosted expert " << e << " out of range");
    for (int l : hosted)
      AMOE_CHECK_ARG(l >= 0 && l < num_blocks * num_experts, "hosted layer " << l << " out of range");
  }
}

namespace {

// Group cells: an expert runtime under waves groups its columns by wave group (wave_group > 0).
int wave_groups(const EngineConfig& cfg) {
  if (cfg.is_attention || cfg.policy != "waves" || cfg.wave_group <= 0) return 1;
  return (std::max(1, cfg.num_waves) + cfg.wave_group - 1) / cfg.wave_group;
}

}  // namespace

LayerQueues::LayerQueues(const EngineConfig& cfg)
    : cfg_(cfg),
      num_cols_(cfg.is_attention ? (cfg.policy == "waves" ? std::max(1, cfg.num_waves) : 1)
                                 : cfg.num_experts * wave_groups(cfg)),
      groups_(wave_groups(cfg)),
      hosted_(static_cast<size_t>(cfg.num_blocks) * cfg.num_experts, 0),
      hosted_blocks_(cfg.num_experts, 0),
      scheduler_(cfg.is_attention ? cfg.num_blocks + 1 : cfg.num_blocks, num_cols_, parse_policy(cfg.policy),
                 cfg.lookahead, cfg.decay) {
  cfg_.validate();
  waves_ = cfg.is_attention && cfg.policy == "waves";
  scheduler_.set_wave_cols(waves_);
  // waves, expert side: a block waits for the attention ranks on their way to it (docs/scheduler.md
  // "The straggler wait", "The meeting block").
  rank_barrier_ = !cfg.is_attention && cfg.policy == "waves";
  // Block 0 is where the ranks' waves meet (the meeting block): it waits for ranks up to ceil(num_blocks / W)
  // blocks back.
  if (rank_barrier_)
    scheduler_.set_rank_barrier(static_cast<int>(cfg.attn_runtime.size()), cfg.max_wave_hold_s,
                                (cfg.num_blocks + cfg.num_waves - 1) / cfg.num_waves);
  // Group cells: the columns are (group, hosted expert); the notes per (rank, wave).
  if (rank_barrier_ && cfg.wave_group > 0)
    scheduler_.set_wave_groups(std::max(1, cfg.num_waves), cfg.wave_group, cfg.num_experts);
  queues_.resize(static_cast<size_t>(scheduler_.num_blocks()) * num_cols_);
  pool_.reserve(4096);
  for (int b = 0; b < scheduler_.num_blocks(); ++b) {
    for (int c = 0; c < num_cols_; ++c) {
      queues_[b * num_cols_ + c].layer =
          cfg.is_attention ? LayerId{kAttn, b, cfg.attn_rank} : LayerId{kExpert, b, c % cfg.num_experts};
    }
  }
  if (cfg.is_attention) {
    replicas_.resize(static_cast<size_t>(cfg.num_blocks) * cfg.num_experts);
    for (int b = 0; b < cfg.num_blocks; ++b)
      for (int e = 0; e < cfg.num_experts; ++e) {
        const size_t l = static_cast<size_t>(b) * cfg.num_experts + e;
        replicas_[l] = cfg.replicas.empty() ? std::vector<int>{cfg.expert_runtime[e]} : cfg.replicas[l];
      }
    return;
  }
  if (cfg.hosted.empty()) {
    for (int e : cfg.experts) {
      AMOE_CHECK_ARG(hosted_blocks_[e] == 0, "expert " << e << " listed twice");
      for (int b = 0; b < cfg.num_blocks; ++b) mark_hosted(b, e, true);
    }
  } else {
    for (int l : cfg.hosted) mark_hosted(l / cfg.num_experts, l % cfg.num_experts, true);
  }
}

void LayerQueues::mark_hosted(int block, int expert, bool on) {
  char& h = hosted_[static_cast<size_t>(block) * cfg_.num_experts + expert];
  if (static_cast<bool>(h) == on) return;
  h = on ? 1 : 0;
  int& n = hosted_blocks_[expert];
  if (on && n++ == 0) ++hosted_experts_;
  if (!on && --n == 0) --hosted_experts_;
  scheduler_.set_lookahead_cols(std::max(1, hosted_experts_) * groups_);
}

void LayerQueues::check_layer(int block, int expert) const {
  AMOE_CHECK_ARG(block >= 0 && block < cfg_.num_blocks && expert >= 0 && expert < cfg_.num_experts,
                 "(block " << block << ", expert " << expert << ") is outside the model");
}

void LayerQueues::host(int block, int expert) {
  AMOE_CHECK_ARG(!cfg_.is_attention, "an attention runtime hosts no experts");
  check_layer(block, expert);
  mark_hosted(block, expert, true);
}

int64_t LayerQueues::unhost(int block, int expert) {
  AMOE_CHECK_ARG(!cfg_.is_attention, "an attention runtime hosts no experts");
  check_layer(block, expert);
  mark_hosted(block, expert, false);
  int64_t dropped = 0;
  for (int g = 0; g < groups_; ++g) {
    const int q = block * num_cols_ + g * cfg_.num_experts + expert;
    MuQueue& mq = queues_[q];
    if (mq.depth == 0) continue;
    dropped += mq.depth;
    scheduler_.add(block, q % num_cols_, -mq.depth);
    mq.rows.clear();
    mq.depth = 0;
  }
  drops_.retired += dropped;
  return dropped;
}

void LayerQueues::set_replicas(int block, int expert, std::vector<int> runtimes) {
  AMOE_CHECK_ARG(cfg_.is_attention, "only an attention runtime routes to replicas");
  check_layer(block, expert);
  AMOE_CHECK_ARG(!runtimes.empty(), "(block " << block << ", expert " << expert << ") needs a replica");
  for (int r : runtimes) AMOE_CHECK_ARG(r >= 0, "replica runtime ids must be >= 0, got " << r);
  std::sort(runtimes.begin(), runtimes.end());
  runtimes.erase(std::unique(runtimes.begin(), runtimes.end()), runtimes.end());
  replicas_[block * cfg_.num_experts + expert] = std::move(runtimes);
}

int LayerQueues::choose(int block, int expert, std::vector<int64_t>* load) const {
  return choose_replica(replicas_[block * cfg_.num_experts + expert], load);
}

void LayerQueues::release_inflight(int dest) {
  if (dest >= 0 && dest < static_cast<int>(inflight_.size()) && inflight_[dest] > 0) --inflight_[dest];
}

int64_t LayerQueues::outstanding(const std::vector<std::array<int, 3>>& replicas) const {
  // (runtime, block, expert) packed into one key: ids are < 2^20 (the wire's ranges are narrower still).
  auto pack = [](int64_t r, int64_t b, int64_t e) { return (r << 40) | (b << 20) | e; };
  std::unordered_set<int64_t> wanted;
  for (const auto& [r, b, e] : replicas) wanted.insert(pack(r, b, e));
  int64_t n = 0;
  for (const auto& [key, x] : expected_)
    if (wanted.count(pack(x.dest, x.sent.layer.block, x.sent.layer.index))) ++n;
  return n;
}

bool LayerQueues::listed(size_t q) const {
  const MuQueue& mq = queues_[q];
  if (mq.depth > 0 || mq.batches > 0 || cfg_.is_attention) return true;
  return hosted_[static_cast<size_t>(mq.layer.block) * cfg_.num_experts + mq.layer.index] != 0;
}

int LayerQueues::queue_index(const LayerId& l) const {
  if (cfg_.is_attention) {
    if (l.kind != kAttn || l.index != cfg_.attn_rank || l.block < 0 || l.block > cfg_.num_blocks) return -1;
    return l.block;
  }
  if (l.kind != kExpert || l.block < 0 || l.block >= cfg_.num_blocks || l.index < 0 ||
      l.index >= cfg_.num_experts || !hosts(l.block, l.index))
    return -1;
  return l.block * num_cols_ + l.index;
}

int LayerQueues::group_of(int32_t wave) const {
  if (groups_ == 1 || wave < 0 || wave >= cfg_.num_waves) return 0;
  return wave / cfg_.wave_group;
}

double LayerQueues::clock_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_).count();
}

std::chrono::steady_clock::time_point LayerQueues::release_at() const {
  const double t = scheduler_.release_at();
  if (!rank_barrier_ || !(t < 1e12)) return std::chrono::steady_clock::time_point::max();
  return epoch_ +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(t));
}

int LayerQueues::wave_of(uint64_t request_id) {
  if (!waves_) return 0;
  auto [it, inserted] = wave_.try_emplace(request_id, 0);
  if (inserted) it->second = scheduler_.admit(cfg_.attn_cap);
  return it->second;
}

void LayerQueues::ingest(Message&& msg) {
  const int64_t n = static_cast<int64_t>(msg.rows.size());
  const MessageHeader& h = msg.header;
  const bool header_ok = h.magic == kMessageMagic && h.version == kMessageVersion && h.num_rows == n &&
                         msg.data.defined() && msg.data.dim() >= 1 && msg.data.size(0) == n;
  const bool is_ids = header_ok && msg.data.dim() == 1 && msg.data.scalar_type() == at::kLong;
  const bool is_act = header_ok && msg.data.dim() == 2 && msg.data.size(1) == cfg_.hidden;
  if (!is_ids && !is_act) {
    ++drops_.bad_message;
    return;
  }
  rows_in_ += n;
  const double now = rank_barrier_ ? clock_s() : 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const RowMeta& m = msg.rows[i];
    const int q = queue_index(m.layer);
    if (q < 0) {
      ++drops_.misrouted;
      continue;
    }
    if (cfg_.track_requests && m.layer.kind == kAttn && live_.count(m.request_id) == 0) {
      ++drops_.unknown_request;
      continue;
    }
    const bool wants_ids = m.layer.kind == kAttn && m.layer.block == 0;
    if (wants_ids != is_ids) {
      ++drops_.bad_row;
      continue;
    }
    if (m.layer.kind == kExpert) {
      // Expert rows are independent: ready as soon as they arrive (in their wave's group, group cells).
      const int qg = q + group_of(m.wave) * cfg_.num_experts;
      MuQueue& mq = queues_[qg];
      mq.rows.push_back(ExpertRow{m, TensorRef{msg.data, i}});
      ++mq.depth;
      scheduler_.add(qg / num_cols_, qg % num_cols_, 1);
      if (rank_barrier_) scheduler_.arrived(qg / num_cols_, m.attn_rank, now, m.wave);
    } else if (waves_) {
      // The row's wave travels with its expert parts (group cells): the expert side groups by it.
      RowMeta mw = m;
      mw.wave = wave_of(m.request_id);
      ingest_attention_row(q * num_cols_ + mw.wave, mw, msg.data, i);
    } else {
      ingest_attention_row(q, m, msg.data, i);
    }
  }
}

void LayerQueues::ingest_attention_row(int q, const RowMeta& m, const at::Tensor& data, int64_t row) {
  const int ppr = m.layer.block == 0 ? 1 : 1 + cfg_.top_k;
  if (m.chunk_len < 1 || m.chunk_start < 0 || m.position < m.chunk_start ||
      m.position >= m.chunk_start + m.chunk_len || m.slot < 0 || m.slot >= ppr) {
    ++drops_.bad_row;
    return;
  }
  if (ppr == 1 && m.chunk_len == 1) {  // a decode token id: nothing to merge
    Chunk c;
    c.head = m;
    c.parts_per_row = 1;
    c.present = 1;
    c.parts.resize(1);
    c.parts[0].ref = TensorRef{data, row};
    enqueue_chunk(q, std::move(c));
    return;
  }
  if (cfg_.track_requests && m.slot > 0) {
    const auto found = expected_.find(ExpectKey{m.request_id, m.layer.block, m.position, m.slot});
    if (found == expected_.end()) {
      ++drops_.duplicate;  // an expert output nobody waits for: the second answer to a resent row, or garbage
      return;
    }
    release_inflight(found->second.dest);
    expected_.erase(found);
    scheduler_.add_pending(m.layer.block, -1, q % num_cols_);
  }
  auto [it, inserted] = pool_.try_emplace(PoolKey{m.request_id, m.layer, m.chunk_start});
  Chunk& c = it->second;
  if (inserted) {
    c.head = m;
    c.parts_per_row = ppr;
    c.parts.resize(static_cast<int64_t>(m.chunk_len) * ppr);
  } else if (c.head.chunk_len != m.chunk_len || c.head.attn_rank != m.attn_rank) {
    ++drops_.bad_row;
    return;
  }
  const int64_t r = m.position - m.chunk_start;
  Part& part = c.parts[r * ppr + m.slot];
  if (part.ref.t.defined()) {
    ++drops_.duplicate;
    return;
  }
  part.ref = TensorRef{data, row};
  part.expert_id = m.expert_id;
  ++c.present;
  ++pool_parts_;
  if (c.present == c.parts.size()) {
    pool_parts_ -= c.present;
    enqueue_chunk(q, std::move(c));
    pool_.erase(it);
  }
}

void LayerQueues::enqueue_chunk(int q, Chunk&& c) {
  MuQueue& mq = queues_[q];
  const int64_t n = c.head.chunk_len;
  mq.chunks.push_back(std::move(c));
  mq.depth += n;
  scheduler_.add(q / num_cols_, q % num_cols_, n);
}

void LayerQueues::admit(uint64_t request_id) {
  if (cfg_.track_requests) live_.insert(request_id);
  wave_of(request_id);  // waves: a new request joins its wave as it enters
}

void LayerQueues::expect(const RowMeta& sent, const TensorRef& input, int dest,
                         std::chrono::steady_clock::time_point at) {
  // A request forgotten since its rows were drained (cancelled): its outputs will be dropped on arrival
  // (unknown_request), so nothing waits for them — counted as out, they would hold its wave (and a block
  // under wave) until the deadline guard, each time round.
  if (!cfg_.track_requests || live_.count(sent.request_id) == 0) return;
  const ExpectKey key{sent.request_id, sent.layer.block + 1, sent.position, sent.slot};
  auto found = expected_.find(key);
  if (found != expected_.end()) {  // asked again: still one part out, now from `dest`
    release_inflight(found->second.dest);
    found->second = Expected{sent, input, dest, at};
  } else {
    expected_.emplace(key, Expected{sent, input, dest, at});
    scheduler_.add_pending(sent.layer.block + 1, 1, wave_of(sent.request_id));
  }
  if (dest >= static_cast<int>(inflight_.size())) inflight_.resize(dest + 1, 0);
  ++inflight_[dest];
}

std::vector<Expected> LayerQueues::due(int dest, std::chrono::steady_clock::time_point cutoff) {
  std::vector<Expected> out;
  const auto now = std::chrono::steady_clock::now();
  for (auto& [key, e] : expected_) {
    if ((dest < 0 || e.dest == dest) && e.at <= cutoff) {
      e.at = now;
      out.push_back(e);
    }
  }
  return out;
}

void LayerQueues::forget(const std::vector<uint64_t>& request_ids, bool purge) {
  for (uint64_t id : request_ids) live_.erase(id);
  // A finished or forgotten request leaves its wave; with purge its parts out are dropped below (their wave
  // looked up first).
  std::unordered_map<uint64_t, int> left;
  for (uint64_t id : request_ids) {
    auto it = wave_.find(id);
    if (it == wave_.end()) continue;
    scheduler_.leave(it->second);
    left.emplace(id, it->second);
    wave_.erase(it);
  }
  if (!purge || request_ids.empty()) return;
  const std::unordered_set<uint64_t> gone(request_ids.begin(), request_ids.end());
  for (auto it = expected_.begin(); it != expected_.end();) {
    if (gone.count(it->first.request_id)) {
      const auto w = left.find(it->first.request_id);
      scheduler_.add_pending(it->first.block, -1, w == left.end() ? 0 : w->second);
      release_inflight(it->second.dest);
      it = expected_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = pool_.begin(); it != pool_.end();) {
    if (gone.count(it->first.request_id)) {
      pool_parts_ -= it->second.present;
      it = pool_.erase(it);
    } else {
      ++it;
    }
  }
  for (size_t q = 0; q < queues_.size(); ++q) {
    MuQueue& mq = queues_[q];
    int64_t removed = 0;
    for (auto it = mq.chunks.begin(); it != mq.chunks.end();) {
      if (gone.count(it->head.request_id)) {
        removed += it->head.chunk_len;
        it = mq.chunks.erase(it);
      } else {
        ++it;
      }
    }
    if (removed > 0) {
      mq.depth -= removed;
      scheduler_.add(static_cast<int>(q) / num_cols_, static_cast<int>(q) % num_cols_, -removed);
    }
  }
}

bool LayerQueues::drain(Drained* out, bool force) {
  int b = 0, col = 0;
  const double now = rank_barrier_ ? clock_s() : 0.0;
  if (rank_barrier_) scheduler_.set_now(now);
  if (!scheduler_.pick(&b, &col, force)) return false;
  const MuQueue& picked = queues_[b * num_cols_ + col];
  out->layer = picked.layer;
  if (picked.layer.kind == kExpert) {
    if (cfg_.group_experts == 1) {
      // The block's every hosted expert in one step: one host step and one kernel sequence for all of them
      // (of the picked column's wave group, group cells).
      const int per = cfg_.num_experts, first = (col / per) * per;
      for (int c = first; c < first + per; ++c) out->num_rows += take_expert_rows(b, c, out);
    } else {
      out->num_rows = take_expert_rows(b, col, out);
    }
    if (rank_barrier_) {
      // Each attention rank (wave, with groups) served here is on its way to the next block (the straggler
      // wait, group cells); each once per step.
      const int waves = cfg_.wave_group > 0 ? std::max(1, cfg_.num_waves) : 1;
      std::vector<char> seen(cfg_.attn_runtime.size() * waves, 0);
      for (const ExpertRow& r : out->rows) {
        const int rank = r.meta.attn_rank;
        const int wave = waves > 1 ? r.meta.wave : 0;
        if (rank < 0 || rank >= static_cast<int>(cfg_.attn_runtime.size()) || wave < 0 || wave >= waves)
          continue;
        char& s = seen[static_cast<size_t>(rank) * waves + wave];
        if (s) continue;
        s = 1;
        scheduler_.served(b, rank, now, r.meta.wave);
      }
    }
    return true;
  }
  // Whole chunks only: the attention layer needs a request's chunk together.
  MuQueue& mq = queues_[b * num_cols_ + col];
  int64_t taken = 0;
  while (!mq.chunks.empty()) {
    const int64_t n = mq.chunks.front().head.chunk_len;
    if (taken > 0 && taken + n > cfg_.attn_cap) break;
    out->chunks.push_back(std::move(mq.chunks.front()));
    mq.chunks.pop_front();
    taken += n;
  }
  out->num_rows = taken;
  mq.depth -= taken;
  ++mq.batches;
  mq.rows_drained += taken;
  scheduler_.add(b, col, -taken);
  return true;
}

int64_t LayerQueues::take_expert_rows(int b, int col, Drained* out) {
  MuQueue& mq = queues_[b * num_cols_ + col];
  const int64_t n = std::min(mq.depth, cfg_.expert_cap);
  if (n == 0) return 0;
  out->rows.reserve(out->rows.size() + n);
  for (int64_t i = 0; i < n; ++i) {
    out->rows.push_back(std::move(mq.rows.front()));
    mq.rows.pop_front();
  }
  out->groups.emplace_back(mq.layer.index, n);
  mq.depth -= n;
  ++mq.batches;
  mq.rows_drained += n;
  scheduler_.add(b, col, -n);
  return n;
}

namespace {

// Copies refs[i]'s row into dst[i]. dst is contiguous, [N, ...] with one source row per dst row.
void gather_rows(const std::vector<const TensorRef*>& refs, at::Tensor& dst) {
  const int64_t n = static_cast<int64_t>(refs.size());
  if (n == 0) return;
  const size_t row_bytes = static_cast<size_t>(dst.numel() / n) * dst.element_size();
  bool fast = dst.device().is_cpu();
  for (int64_t i = 0; fast && i < n; ++i) {
    const at::Tensor& t = refs[i]->t;
    fast = t.device().is_cpu() && t.scalar_type() == dst.scalar_type() && t.is_contiguous();
  }
  if (fast) {
    // CPU: one memcpy per row, the CPU stand-in for the paper's gather kernel.
    char* out = static_cast<char*>(dst.data_ptr());
    for (int64_t i = 0; i < n; ++i) {
      const char* src = static_cast<const char*>(refs[i]->t.const_data_ptr()) + refs[i]->row * row_bytes;
      std::memcpy(out + i * row_bytes, src, row_bytes);
    }
    return;
  }
  // General (GPU, strided, mixed dtype): one index_select + index_copy_ per source tensor.
  std::unordered_map<const void*, std::pair<std::vector<int64_t>, std::vector<int64_t>>> groups;
  std::vector<const at::Tensor*> order;
  for (int64_t i = 0; i < n; ++i) {
    auto& g = groups[refs[i]->t.unsafeGetTensorImpl()];
    if (g.first.empty()) order.push_back(&refs[i]->t);
    g.first.push_back(i);
    g.second.push_back(refs[i]->row);
  }
  for (const at::Tensor* t : order) {
    auto& g = groups[t->unsafeGetTensorImpl()];
    auto src_idx = at::tensor(g.second, at::kLong).to(t->device());
    auto dst_idx = at::tensor(g.first, at::kLong).to(dst.device());
    dst.index_copy_(0, dst_idx, t->index_select(0, src_idx).to(dst.device(), dst.scalar_type()));
  }
}

at::Tensor int64_tensor(const std::vector<int64_t>& v) {
  auto t = at::empty({static_cast<int64_t>(v.size())}, at::kLong);
  if (!v.empty()) std::memcpy(t.data_ptr<int64_t>(), v.data(), v.size() * sizeof(int64_t));
  return t;
}

// Row r of a chunk: the chunk's metadata at its position, as the row's slot 0.
RowMeta chunk_row(const RowMeta& head, int32_t r) {
  RowMeta m = head;
  m.position = head.chunk_start + r;
  m.slot = 0;
  m.expert_id = -1;
  m.weight = 0.f;
  return m;
}

// Fills order (K entries) with a row's expert slots s (its part 1 + s) by ascending expert id: the order
// Hugging Face sums expert outputs in (insertion sort: K is small). parts = the row's 1 + K parts.
void sort_expert_slots(const Part* parts, std::vector<int>* order) {
  std::vector<int>& o = *order;
  const int k = static_cast<int>(o.size());
  for (int s = 0; s < k; ++s) {
    int j = s;
    for (; j > 0 && parts[1 + o[j - 1]].expert_id > parts[1 + s].expert_id; --j) o[j] = o[j - 1];
    o[j] = s;
  }
}

// request_ids, positions and attn_ranks [N] from the rows' metadata.
void set_row_ids(Batch* b) {
  const int64_t n = b->num_rows();
  b->request_ids = at::empty({n}, at::kLong);
  b->positions = at::empty({n}, at::kLong);
  b->attn_ranks = at::empty({n}, at::kLong);
  int64_t* req = b->request_ids.data_ptr<int64_t>();
  int64_t* pos = b->positions.data_ptr<int64_t>();
  int64_t* rank = b->attn_ranks.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const RowMeta& m = b->meta[i];
    req[i] = static_cast<int64_t>(m.request_id);
    pos[i] = m.position;
    rank[i] = m.attn_rank;
  }
}

}  // namespace

Batch LayerQueues::assemble(Drained&& d) const {
  Batch b = d.layer.kind == kExpert ? assemble_expert(d) : assemble_attention(d);
  b.layer = d.layer;
  b.top_k = cfg_.top_k;
  set_row_ids(&b);
  return b;
}

// EXPERT (b, e): one row per token part, its activation and top-k weight.
Batch LayerQueues::assemble_expert(const Drained& d) const {
  const int64_t n = d.num_rows;
  Batch b;
  b.meta.reserve(n);
  std::vector<const TensorRef*> refs(n);
  b.weights = at::empty({n}, at::kFloat);
  float* wp = b.weights.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    b.meta.push_back(d.rows[i].meta);
    wp[i] = d.rows[i].meta.weight;
    refs[i] = &d.rows[i].ref;
  }
  b.x = at::empty({n, cfg_.hidden}, d.rows[0].ref.t.options());
  gather_rows(refs, b.x);
  const int64_t g = static_cast<int64_t>(d.groups.size());
  std::vector<int64_t> cu(g + 1, 0), experts(g);
  for (int64_t i = 0; i < g; ++i) {
    experts[i] = d.groups[i].first;
    cu[i + 1] = cu[i] + d.groups[i].second;
  }
  b.cu_rows = int64_tensor(cu);
  b.group_experts = int64_tensor(experts);
  return b;
}

// ATTN (b, r): whole chunks, one row per position. Block 0 gathers token ids; later blocks the residual and
// the K expert outputs.
Batch LayerQueues::assemble_attention(const Drained& d) const {
  const int64_t n = d.num_rows;
  const int64_t num_chunks = static_cast<int64_t>(d.chunks.size());
  Batch b;
  b.meta.reserve(n);
  std::vector<int64_t> cu(num_chunks + 1, 0), ctx(num_chunks);
  std::vector<const TensorRef*> slot0;  // per row: its token id (block 0) or residual
  slot0.reserve(n);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const Chunk& ch = d.chunks[c];
    cu[c + 1] = cu[c] + ch.head.chunk_len;
    ctx[c] = ch.head.chunk_start + ch.head.chunk_len;
    for (int32_t r = 0; r < ch.head.chunk_len; ++r) {
      b.meta.push_back(chunk_row(ch.head, r));
      slot0.push_back(&ch.parts[static_cast<int64_t>(r) * ch.parts_per_row].ref);
    }
  }
  b.cu_rows = int64_tensor(cu);
  b.context_lens = int64_tensor(ctx);
  if (d.layer.block == 0) {
    b.token_ids = at::empty({n}, at::kLong);
    gather_rows(slot0, b.token_ids);
  } else {
    b.residual = at::empty({n, cfg_.hidden}, slot0[0]->t.options());
    gather_rows(slot0, b.residual);
    gather_expert_outputs(d.chunks, &b);
  }
  return b;
}

// expert_out [N, K, H] (dtype and device of the residual) and expert_ids [N, K]: each row's K expert parts in
// ascending expert id. b's rows are the chunks' rows, in order.
void LayerQueues::gather_expert_outputs(const std::vector<Chunk>& chunks, Batch* b) const {
  const int64_t n = b->num_rows();
  const int k = cfg_.top_k;
  std::vector<const TensorRef*> refs;
  std::vector<int64_t> eids;
  refs.reserve(n * k);
  eids.reserve(n * k);
  std::vector<int> order(k);
  for (const Chunk& ch : chunks) {
    for (int32_t r = 0; r < ch.head.chunk_len; ++r) {
      const Part* p = &ch.parts[static_cast<int64_t>(r) * ch.parts_per_row];
      sort_expert_slots(p, &order);
      for (int s : order) {
        refs.push_back(&p[1 + s].ref);
        eids.push_back(p[1 + s].expert_id);
      }
    }
  }
  auto eo = at::empty({n * k, cfg_.hidden}, b->residual.options());
  gather_rows(refs, eo);
  b->expert_out = eo.view({n, k, cfg_.hidden});
  b->expert_ids = int64_tensor(eids).view({n, k});
}

}  // namespace amoe
