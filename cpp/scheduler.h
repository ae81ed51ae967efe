// The layer scheduler: which hosted μ-queue the executor drains next (paper §3.4).
// Plain C++ (no torch): the engine owns one behind its lock; Python gets one for tests and benchmarks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace amoe {

enum class Policy { kDefrag, kMtfs, kFlfs, kWave };

Policy parse_policy(const std::string& name);
const char* policy_name(Policy p);

// Queue depths (rows) on a grid [num_blocks][num_cols]. An expert runtime's grid is (block, hosted expert);
// an attention runtime's grid is (block 0..num_blocks incl. the head, its one rank). Not thread-safe: the
// owner serialises access.
class Scheduler {
 public:
  Scheduler(int num_blocks, int num_cols, Policy policy, int lookahead, double decay);

  void add(int block, int col, int64_t delta);
  void set(int block, int col, int64_t depth);
  int64_t depth(int block, int col) const { return depth_[block * num_cols_ + col]; }
  int64_t total() const { return total_; }

  // Rows that left this runtime and will come back to `block` (an attention runtime's outstanding expert
  // outputs, in parts): the wave policy holds a block while part of its wave is still out.
  void add_pending(int block, int64_t delta);
  int64_t pending(int block) const { return pending_[block]; }

  // Picks a non-empty queue; false when all are empty or, under wave, when every non-empty block still waits
  // for part of its wave and `force` is false (then holding() is true). Ties go to the lowest (block, col).
  bool pick(int* block, int* col, bool force = false);
  bool holding() const { return holding_; }

  int num_blocks() const { return num_blocks_; }
  int num_cols() const { return num_cols_; }
  Policy policy() const { return policy_; }
  int lookahead() const { return lookahead_; }
  double decay() const { return decay_; }

 private:
  void refresh_block(int b);
  bool pick_defrag(int* block, int* col);
  bool pick_mtfs(int* block, int* col);
  bool pick_flfs(int* block, int* col);
  bool pick_wave(int* block, int* col, bool force);

  int num_blocks_, num_cols_;
  Policy policy_;
  int lookahead_;
  double decay_;
  std::vector<double> decay_pow_;     // decay^k for k = 0..lookahead, from libm pow like Python's **
  std::vector<int64_t> depth_;        // [num_blocks * num_cols]
  std::vector<int64_t> block_total_;  // sum of depth_ over a block, kept incrementally
  std::vector<int64_t> block_max_;    // deepest queue of a block (valid unless dirty)
  std::vector<int> block_argmax_;     // its lowest column
  std::vector<char> block_dirty_;
  int64_t total_ = 0;
  std::vector<int64_t> pending_;  // [num_blocks] rows out that return to each block
  bool holding_ = false;
};

}  // namespace amoe
