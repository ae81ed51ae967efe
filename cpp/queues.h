// Receptor state: the token pool that merges a token's parts, the μ-queues (one per hosted LayerID) and
// batch assembly. Not thread-safe by itself: the engine serialises ingest() and drain() under one lock;
// assemble() works on drained items only and runs without any lock.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <chrono>
#include <deque>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "comm.h"
#include "meta.h"
#include "scheduler.h"

namespace amoe {

struct EngineConfig {
  int runtime_id = 0;               // this runtime's id in the placement maps (== its communicator rank)
  bool is_attention = true;         // attention runtime (one DP rank, all blocks + head) or expert runtime
  int attn_rank = 0;                // the DP rank an attention runtime serves
  std::vector<int> experts;         // expert ids an expert runtime hosts (for every block)
  int num_blocks = 1;               // decoder blocks of the model
  int num_experts = 1;              // experts per block
  int top_k = 1;                    // experts per token
  int64_t hidden = 0;               // activation width H
  std::vector<int> expert_runtime;  // [num_experts] home runtime of expert e (every block)
  std::vector<int> attn_runtime;    // [num_attn_ranks] runtime serving attention rank r
  // The live expert map (docs/rebalancing.md): [num_blocks * num_experts], block-major, the runtimes serving
  // each (block, expert), ascending; empty: expert e of every block on expert_runtime[e]. An attention
  // runtime routes by it; Engine::set_replicas changes it while serving.
  std::vector<std::vector<int>> replicas;
  // An expert runtime's hosted layers as block * num_experts + expert; empty: `experts` of every block.
  // Engine::host / unhost change them while serving.
  std::vector<int> hosted;
  // Scheduling: no defaults here. amoe.core.engine_config fills them from the config's scheduler section (the
  // one home of policy names and defaults); validate() refuses a config that left them unset.
  std::string policy;      // defrag | mtfs | flfs | wave | waves
  int lookahead = -1;      // K of Algorithm 1
  double decay = -1.0;     // δ of Algorithm 1
  int64_t attn_cap = 0;    // rows per attention batch (a chunk is never split, so one chunk may exceed it)
  int64_t expert_cap = 0;  // rows per expert (of one queue) in an expert batch
  // 1: an expert runtime drains every hosted expert's queue of the block its scheduler picks, as one grouped
  // step (each expert up to expert_cap rows), as EP and ping-pong run a device's experts; 0: the picked queue
  // only. -1: unset.
  int group_experts = -1;
  // The longest a wave-policy runtime holds for a returning wave, in wall seconds (a guard, not a tuning
  // knob: engine.cpp). amoe.core.engine_config scales it by an emulated executor's time scale, so the guard
  // is the same emulated time whatever the scale.
  double max_wave_hold_s = 1.0;
  // An attention runtime that tracks its requests accepts rows only of requests that entered here
  // (add_tokens) and have not finished or been forgotten: a late row of a finished request, or a peer's
  // garbage, is dropped and counted instead of reaching a layer that no longer knows the request.
  bool track_requests = false;
  // waves (docs/scheduler.md): the attention runtimes' W waves, ceil(their most requests / attn_cap)
  // (amoe.core.engine_config); an attention runtime's grid is (block, wave), and an expert runtime's block 0
  // waits for waves up to ceil(num_blocks / W) blocks back (the meeting block). 1 otherwise.
  int num_waves = 1;
  // waves, expert side (group cells): the waves of each attention rank that make one group, which an expert
  // runtime serves as one (block, group) step and gathers over the ranks; 0: per rank (the straggler wait,
  // the meeting block).
  int wave_group = 0;

  void validate() const;
};

// One row of a tensor that arrived; the data stays there until assembly.
struct TensorRef {
  at::Tensor t;
  int64_t row = 0;
};

struct ExpertRow {
  RowMeta meta;
  TensorRef ref;
};

// One part of a token at an attention layer: the residual (slot 0) or one expert output.
struct Part {
  TensorRef ref;
  int32_t expert_id = -1;
};

// A chunk's parts, indexed (position - chunk_start) * parts_per_row + slot. A decode step (one row, up to
// 1 + 7 parts) stays inline: no allocation per token on the hot path; prefill chunks spill to the heap.
class PartList {
 public:
  static constexpr int64_t kInline = 8;
  void resize(int64_t n) {
    size_ = n;
    if (n > kInline) heap_.resize(n);
  }
  int64_t size() const { return size_; }
  Part& operator[](int64_t i) { return size_ > kInline ? heap_[i] : inline_[i]; }
  const Part& operator[](int64_t i) const { return size_ > kInline ? heap_[i] : inline_[i]; }

 private:
  std::array<Part, kInline> inline_;
  std::vector<Part> heap_;
  int64_t size_ = 0;
};

// The rows of one request at one attention layer (a decode step or a prefill chunk), merged from parts.
struct Chunk {
  RowMeta head;           // request id, layer, chunk_start, chunk_len, attn_rank
  int parts_per_row = 1;  // 1 at block 0 (token ids), else 1 + K (residual + K expert outputs)
  int64_t present = 0;    // parts arrived so far
  PartList parts;         // [chunk_len * parts_per_row]
};

struct MuQueue {
  LayerId layer{};
  std::deque<ExpertRow> rows;  // expert queues
  std::deque<Chunk> chunks;    // attention queues
  int64_t depth = 0;           // rows waiting
  int64_t batches = 0;         // batches drained
  int64_t rows_drained = 0;
};

// Rows drained from one queue (attention) or from a block's hosted expert queues (a grouped expert step),
// assembled outside the lock.
struct Drained {
  LayerId layer{};
  std::vector<ExpertRow> rows;                      // expert: grouped by expert, in the order of `groups`
  std::vector<std::pair<int32_t, int64_t>> groups;  // expert: (expert id, rows) per drained queue
  std::vector<Chunk> chunks;
  int64_t num_rows = 0;
};

// What next_batch() hands to Python (tensor fields left undefined are None).
struct Batch {
  LayerId layer{};
  int top_k = 1;
  std::vector<RowMeta> meta;  // [N] per row, for the dispatcher
  at::Tensor request_ids;     // int64 [N]
  at::Tensor positions;       // int64 [N]
  at::Tensor attn_ranks;      // int64 [N]
  at::Tensor cu_rows;         // int64 [R + 1] chunk boundaries (attention); [G + 1] expert groups (expert)
  at::Tensor group_experts;   // int64 [G] the expert of each group of rows (expert)
  at::Tensor context_lens;    // int64 [R] tokens of the request after this chunk (attention)
  at::Tensor x;               // [N, H] expert input
  at::Tensor weights;         // float32 [N] top-k weight (expert)
  at::Tensor token_ids;       // int64 [N] (attention block 0)
  at::Tensor residual;        // [N, H] (attention block > 0, head)
  at::Tensor expert_out;  // [N, K, H] weighted expert outputs in ascending expert id (attention block > 0)
  at::Tensor expert_ids;  // int64 [N, K] ascending (attention block > 0)
  bool is_head = false;   // ATTN block num_blocks: the final norm, lm_head and sampler
  int64_t num_rows() const { return static_cast<int64_t>(meta.size()); }
};

struct PoolKey {
  uint64_t request_id;
  LayerId layer;
  int32_t chunk_start;
  bool operator==(const PoolKey& o) const {
    return request_id == o.request_id && layer == o.layer && chunk_start == o.chunk_start;
  }
};

struct PoolKeyHash {
  size_t operator()(const PoolKey& k) const {
    return std::hash<uint64_t>()(k.request_id * 0x9E3779B97F4A7C15ull) ^ LayerIdHash()(k.layer) ^
           (static_cast<size_t>(k.chunk_start) << 17);
  }
};

// An expert output an attention runtime waits for: the part (request, ATTN block, position, slot) it will
// fill.
struct ExpectKey {
  uint64_t request_id;
  int32_t block;
  int32_t position;
  int32_t slot;
  bool operator==(const ExpectKey& o) const {
    return request_id == o.request_id && block == o.block && position == o.position && slot == o.slot;
  }
};

struct ExpectKeyHash {
  size_t operator()(const ExpectKey& k) const {
    return std::hash<uint64_t>()(k.request_id * 0x9E3779B97F4A7C15ull) ^
           (static_cast<size_t>(k.block) << 48) ^ (static_cast<size_t>(k.position) << 8) ^
           static_cast<size_t>(k.slot);
  }
};

// What it takes to ask for an expert output again: the row as sent, its input, where and when it went.
struct Expected {
  RowMeta sent;  // layer EXPERT (b, e)
  TensorRef input;
  int dest = -1;
  std::chrono::steady_clock::time_point at;
};

struct DropCounts {
  int64_t bad_message = 0;      // malformed header / tensor shape
  int64_t misrouted = 0;        // a row for a layer this runtime does not host
  int64_t bad_row = 0;          // inconsistent chunk / slot / position
  int64_t duplicate = 0;        // a part that already arrived
  int64_t unknown_request = 0;  // a row of a request this runtime does not hold (track_requests)
  int64_t retired = 0;          // rows still queued for a layer unhosted after its drain (second copies)
};

class LayerQueues {
 public:
  explicit LayerQueues(const EngineConfig& cfg);

  // Routes every row of msg into the pool or a μ-queue; malformed parts are dropped and counted.
  void ingest(Message&& msg);
  // Picks a queue with the scheduler and pops up to the cap; false when nothing is waiting or the scheduler
  // holds for a returning wave (holding(); `force` takes the best block anyway).
  bool drain(Drained* out, bool force = false);
  bool holding() const { return scheduler_.holding(); }
  // Holding under the expert side's rank barrier (docs/scheduler.md "The straggler wait"): when the earliest
  // wait ends (time_point::max() otherwise): the engine wakes then even if nothing arrives.
  std::chrono::steady_clock::time_point release_at() const;
  // Gathers drained rows into contiguous tensors (no lock needed).
  Batch assemble(Drained&& d) const;
  // Request tracking (cfg.track_requests): admit marks a request held; forget ends it, and with purge also
  // drops its parts waiting in the pool and its chunks waiting in the queues.
  void admit(uint64_t request_id);
  void forget(const std::vector<uint64_t>& request_ids, bool purge);
  int64_t num_tracked() const { return static_cast<int64_t>(live_.size()); }
  // Outstanding expert outputs (cfg.track_requests): expect() as rows go out to the experts; an arriving
  // expert output is accepted only if expected (a resent row's second answer is a duplicate); due() hands out
  // the ones sent to `dest` (any, when -1) no later than `cutoff`, marked as sent again now.
  void expect(const RowMeta& sent, const TensorRef& input, int dest,
              std::chrono::steady_clock::time_point at);
  std::vector<Expected> due(int dest, std::chrono::steady_clock::time_point cutoff);
  int64_t num_expected() const { return static_cast<int64_t>(expected_.size()); }

  // The live placement (docs/rebalancing.md). Expert runtime: whether (block, expert) takes rows; unhost
  // drops what of it still waits (counted as retired) and returns how many rows that was.
  void host(int block, int expert);
  int64_t unhost(int block, int expert);
  bool hosts(int block, int expert) const { return hosted_[block * cfg_.num_experts + expert] != 0; }
  // Attention runtime: where rows of (block, expert) go from now on, and the runtime `choose` picks for one
  // row by the replica rule (dispatch.h) from `load`, the rows in flight per runtime it updates.
  void set_replicas(int block, int expert, std::vector<int> runtimes);
  const std::vector<int>& replicas(int block, int expert) const {
    return replicas_[block * cfg_.num_experts + expert];
  }
  int choose(int block, int expert, std::vector<int64_t>* load) const;
  // Expert outputs awaited per runtime (cfg.track_requests), the load the replica rule starts from.
  const std::vector<int64_t>& inflight() const { return inflight_; }
  // Expert outputs awaited from any of these (runtime, block, expert) replicas, in one pass over the record:
  // what draining replicas still owe.
  int64_t outstanding(const std::vector<std::array<int, 3>>& replicas) const;
  void check_layer(int block, int expert) const;  // a clear error for a (block, expert) outside the model
  // Whether stats list queue q: a hosted layer's, or one that ran or holds rows (counters stay monotonic).
  bool listed(size_t q) const;

  int64_t depth_total() const { return scheduler_.total(); }
  int64_t pool_entries() const { return static_cast<int64_t>(pool_.size()); }
  int64_t pool_parts() const { return pool_parts_; }
  int64_t rows_in() const { return rows_in_; }
  const DropCounts& drops() const { return drops_; }
  const std::vector<MuQueue>& queues() const { return queues_; }
  const Scheduler& scheduler() const { return scheduler_; }

 private:
  double clock_s() const;                   // seconds since construction: the rank barrier's clock
  int queue_index(const LayerId& l) const;  // -1 when not hosted; an attention queue's block (wave 0)
  void release_inflight(int dest);          // an expected_ entry for `dest` was answered or purged
  // Marks (block, expert) hosted or not, keeping the count of experts hosted in any block: the scheduler's
  // look-ahead divides by it (Algorithm 1's N_E).
  void mark_hosted(int block, int expert, bool on);
  // waves on an attention runtime: the request's wave (joining one, counted by the scheduler, if new).
  int wave_of(uint64_t request_id);
  void enqueue_chunk(int q, Chunk&& c);
  int64_t take_expert_rows(int b, int col, Drained* out);  // up to expert_cap rows of queue (b, col); taken
  void ingest_attention_row(int q, const RowMeta& m, const at::Tensor& data, int64_t row);
  Batch assemble_expert(const Drained& d) const;
  Batch assemble_attention(const Drained& d) const;
  void gather_expert_outputs(const std::vector<Chunk>& chunks, Batch* b) const;

  EngineConfig cfg_;
  int num_cols_;
  int groups_ = 1;  // expert runtime under waves with wave_group > 0: wave groups (group cells)
  // Expert runtime: its grid has a column per expert id (of each wave group), so a replica can join any; only
  // hosted layers take rows. [num_blocks * num_experts]
  std::vector<char> hosted_;
  std::vector<int> hosted_blocks_;          // [num_experts] blocks in which each expert is hosted
  int hosted_experts_ = 0;                  // experts hosted in some block
  std::vector<std::vector<int>> replicas_;  // attention runtime: the live map, as EngineConfig::replicas
  std::vector<int64_t> inflight_;           // attention runtime: expected_ entries per destination runtime
  Scheduler scheduler_;
  std::vector<MuQueue> queues_;  // [grid blocks * num_cols], index = block * num_cols + col
  // Group cells: the group of an expert row's wave (0 without groups or for a wave outside the ranks').
  int group_of(int32_t wave) const;
  std::unordered_map<PoolKey, Chunk, PoolKeyHash> pool_;
  std::unordered_set<uint64_t> live_;       // requests held, when cfg_.track_requests
  bool waves_ = false;                      // the columns are waves (policy waves, attention runtime)
  bool rank_barrier_ = false;               // waves on an expert runtime: blocks wait for ranks on their way
  std::unordered_map<uint64_t, int> wave_;  // request -> its wave, when waves_
  std::unordered_map<ExpectKey, Expected, ExpectKeyHash> expected_;  // outstanding expert outputs, ditto
  std::chrono::steady_clock::time_point epoch_ = std::chrono::steady_clock::now();
  int64_t pool_parts_ = 0;
  int64_t rows_in_ = 0;
  DropCounts drops_;
};

}  // namespace amoe
