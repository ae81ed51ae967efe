// The barrier exchange of the synchronous modes (--parallel ep | pingpong): tagged messages, per-tag gathers
// with a deadline, and the MoE all-to-all (dispatch → experts → combine) built on them. In C++ so that an EP
// device's host work per block — one message to every peer each way, the split by expert device and its
// inverse — costs microseconds instead of the milliseconds of per-field tensor ops it took in Python, and so
// that the waits release the GIL (docs/baselines.md "Barriers and tags").
//
// Every message starts with a tag row (RowMeta; its data row is zeros) naming the exchange it completes:
//   request_id = iteration   layer = {EXPERT for DISPATCH else ATTN, block, micro-batch}   slot = phase
//   chunk_len = 0 (payload rows always have >= 1)   attn_rank = sender   position = info   chunk_start =
//   flags   weight = the sender's step before this exchange, in seconds (what a barrier waits for; 0: none)
// so a zero-row message still says what it completes, and a fast peer's message for a later exchange is kept
// for it instead of being taken for the current one.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "comm.h"

namespace amoe {

enum ExchangePhase : int32_t { kBegin = 0, kDispatch = 1, kCombine = 2 };

// A combine message's flag: the expert layer raised (or its input was unusable); its rows carry no outputs.
constexpr int64_t kExpertsFailed = 1;

struct ExchangeTag {
  int64_t iteration = 0;
  int32_t block = 0;
  int32_t phase = kBegin;
  int32_t micro = 0;

  bool operator<(const ExchangeTag& o) const {
    return std::tie(iteration, block, phase, micro) < std::tie(o.iteration, o.block, o.phase, o.micro);
  }
  std::string str() const;
};

// A gather that did not complete in time: a peer died or stopped (Python: amoe.errors.EngineDeadError).
class PeerSilent : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A received message without its tag row.
struct Parcel {
  int64_t info = 0;
  int64_t flags = 0;
  float step_s = 0.0f;        // the sender's step before it sent (the tag row's weight)
  std::vector<RowMeta> rows;  // payload rows
  at::Tensor data;            // [rows, hidden] payload (a view past the tag row)
};

// Where each of a batch's N x K routed copies went; combine() puts the replies back in router order.
struct DispatchPlan {
  ExchangeTag tag;  // the DISPATCH tag
  int64_t n = 0, k = 0, hidden = 0;
  at::ScalarType dtype = at::kFloat;
  std::vector<int> devices;    // every expert device, ascending
  std::vector<int64_t> order;  // [N * K] flat copy indices (row * K + k), grouped by device
  std::vector<int64_t> start;  // [devices + 1] device i's copies are order[start[i]:start[i+1]]
};

// The rows one expert of this device runs in an all-to-all, in arrival order (source rank, then sent order).
struct ExpertGroup {
  int64_t expert = 0;
  at::Tensor rows;  // int64 [n] indices into the all-to-all's received rows
  at::Tensor x, request_ids, positions, weights;
};

// An expert device's part of one all-to-all: what it received and whom it answers.
struct ExpertWork {
  ExchangeTag tag;             // the DISPATCH tag
  std::vector<int> sources;    // ascending
  std::vector<int64_t> sizes;  // rows from each source
  int64_t hidden = 0;
  at::Tensor x;                     // [M, hidden] every source's rows, back to back
  std::vector<ExpertGroup> groups;  // ascending expert id; experts without rows are absent
  std::string error;  // set when the input cannot run (e.g. an expert this device does not host)
};

class BarrierExchange {
 public:
  // expert_device[e]: the rank hosting expert e; expert_devices: every rank hosting experts.
  BarrierExchange(std::shared_ptr<Communicator> comm, int rank, double timeout_s,
                  std::vector<int> expert_device, std::vector<int> expert_devices);

  int rank() const { return rank_; }
  double timeout_s() const { return timeout_s_; }

  // A payload-free message of `tag` to dest, carrying info and flags (and the sender's step, step_s).
  void signal(int dest, const ExchangeTag& tag, int64_t info, int64_t flags, float step_s = 0.0f);
  // One parcel of `tag` from every source, keyed by source; throws PeerSilent after timeout_s. Notes the
  // slowest source's step (slowest_step_s).
  std::map<int, Parcel> gather(const ExchangeTag& tag, const std::vector<int>& sources);
  // The longest step the sources of the last completed gather (begin, collect, combine) reported before
  // sending: what this device's own step is compared with to count its wait for a slower peer. Loop thread.
  float slowest_step_s() const { return slowest_step_s_; }

  // BEGIN of an iteration: every peer's row count and stop flag → (total rows, anyone stopping). `step_s`:
  // this device's step before it (the last iteration's head).
  std::pair<int64_t, bool> begin(int64_t iteration, const std::vector<int>& peers, int64_t rows,
                                 bool stopping, float step_s = 0.0f);

  // Dispatch half of the all-to-all: one message (maybe zero rows) to every expert device.
  // moe_input [N, H] (host), topk_ids [N, K], topk_weights [N, K], request_ids [N], positions [N]; step_s:
  // the attention step that made them.
  std::shared_ptr<DispatchPlan> dispatch(const ExchangeTag& tag, const at::Tensor& moe_input,
                                         const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                         const at::Tensor& request_ids, const at::Tensor& positions,
                                         float step_s = 0.0f);
  // Combine half: wait for every expert device → expert_out [N, K, H] in router order; nullopt when an expert
  // device failed on these rows (or answered with the wrong number of rows).
  std::optional<at::Tensor> combine(const DispatchPlan& plan);

  // Expert side: wait for `tag` from every source and group what arrived by expert.
  std::shared_ptr<ExpertWork> collect(const ExchangeTag& tag, const std::vector<int>& sources);
  // Send every source its rows' outputs (outputs[g] for work.groups[g]) in the order it sent them; with
  // `failed` every source gets zeros flagged kExpertsFailed (the barrier completes, the sources fail the
  // rows). step_s: the expert step that made the outputs.
  void reply(const ExpertWork& work, const std::vector<at::Tensor>& outputs, bool failed,
             float step_s = 0.0f);

  int64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }
  std::string last_drop() const;

 private:
  void send(int dest, const ExchangeTag& tag, std::vector<RowMeta>&& rows, at::Tensor framed, int64_t info,
            int64_t flags, float step_s = 0.0f);
  void receive(Message&& msg);
  void file(const ExchangeTag& tag, int src, Parcel&& parcel);
  void drop(const std::string& why);

  std::shared_ptr<Communicator> comm_;
  const int rank_;
  const double timeout_s_;
  const std::vector<int> expert_device_;
  std::vector<int> expert_devices_;                       // ascending
  int num_dest_ = 0;                                      // 1 + the largest expert device rank
  std::map<ExchangeTag, std::map<int, Parcel>> pending_;  // loop thread only
  float slowest_step_s_ = 0.0f;                           // loop thread only
  std::atomic<int64_t> dropped_{0};
  mutable std::mutex drop_mu_;  // last_drop_ is read by the stats thread
  std::string last_drop_;
};

}  // namespace amoe
