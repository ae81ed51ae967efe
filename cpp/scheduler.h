// The layer scheduler: which hosted μ-queue the executor drains next (paper §3.4).
// Plain C++ (no torch): the engine owns one behind its lock; Python gets one for tests and benchmarks.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace amoe {

enum class Policy { kDefrag, kMtfs, kFlfs, kWaves };

Policy parse_policy(const std::string& name);
const char* policy_name(Policy p);

// Queue depths (rows) on a grid [num_blocks][num_cols]. An expert runtime's grid is (block, hosted expert);
// an attention runtime's grid is (block 0..num_blocks incl. the head, its one rank). Not thread-safe: the
// owner serialises access.
class Scheduler {
 public:
  Scheduler(int num_blocks, int num_cols, Policy policy, int lookahead, double decay);

  // Algorithm 1's N_E, the look-ahead's divisor: the columns in use (default: every column). An expert
  // runtime's grid has a column per expert id, so it sets the number of experts it hosts.
  void set_lookahead_cols(int n);
  int lookahead_cols() const { return static_cast<int>(lookahead_cols_); }

  void add(int block, int col, int64_t delta);
  void set(int block, int col, int64_t depth);
  int64_t depth(int block, int col) const { return depth_[block * num_cols_ + col]; }
  int64_t total() const { return total_; }

  // Rows that left this runtime and will come back to `block` (an attention runtime's outstanding expert
  // outputs, in parts), per (block, wave column) under `waves` on an attention runtime (wave_cols): a wave
  // is not ready while part of it is still out.
  void add_pending(int block, int64_t delta, int col = 0);
  int64_t pending(int block, int col = 0) const {
    return pending_[static_cast<size_t>(block) * num_cols_ + col];
  }

  // `waves` (docs/scheduler.md): on an attention runtime the columns are its waves. The
  // scheduler counts each wave's members; the runtime keeps request -> wave and calls admit/leave.
  void set_wave_cols(bool on) { wave_cols_ = on; }
  bool wave_cols() const { return wave_cols_; }
  // The wave a new request joins: the lowest with fewer than `wave_rows` members, else the one with fewest.
  int admit(int64_t wave_rows);
  void leave(int wave);
  int64_t members(int wave) const { return members_[wave]; }
  int wave_position(int wave) const { return pos_[wave]; }

  // waves, expert side (docs/scheduler.md "The straggler wait", "The meeting block"): a block waits for the
  // attention ranks on their way to it. `set_rank_barrier` turns it on for `num_ranks` attention ranks (each
  // hold at most `max_hold_s`); block 0 waits for ranks served at any of the `meet_span` blocks before it (1:
  // the block before, as every other block). The owner notes each row's arrival and each step's serving per
  // attention rank, in seconds on one clock.
  void set_rank_barrier(int num_ranks, double max_hold_s, int meet_span = 1);
  int barrier_ranks() const { return num_ranks_; }
  // Group cells (docs/scheduler.md), after set_rank_barrier: the notes are per (rank, wave) of `num_waves`
  // waves a rank; the columns are `groups` groups of `cols_per_group` (group g = waves g*group_waves ..), a
  // cell is (block, group) and a step takes one cell; a cell waits for its group's waves on their way to it,
  // block 0 for them wherever they are on the ring. `wave` of arrived / served is the row's wave (ignored
  // without groups).
  void set_wave_groups(int num_waves, int group_waves, int cols_per_group);
  int num_groups() const { return groups_; }
  void arrived(int block, int rank, double now, int wave = 0);
  void served(int block, int rank, double now, int wave = 0);
  void set_now(double now) { now_ = now; }
  // When holding under the rank barrier: the earliest time a held block's wait ends (else +inf).
  double release_at() const { return release_at_; }
  // Rank r's (wave's, with groups) last measured turn-around (served at a block -> its rows arrived at
  // the next), or -1.
  double turn_around(int rank, int wave = 0) const {
    const int v = note(rank, wave);
    return v < 0 ? -1.0 : turn_[v];
  }

  // Picks a non-empty queue; false when all are empty or, under waves, when no wave or cell is ready and
  // `force` is false (then holding() is true). Ties go to the lowest (block, col).
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
  bool pick_waves(int* block, int* col, bool force);
  bool pick_oldest_block(int* block, int* col, bool force);
  bool pick_oldest_group(int* block, int* col, bool force);
  // Of `n` cells (`total(i)` rows; `until(i)` when its wait ends), the one whose rows have waited longest
  // among those not waiting (`stamps`: set the first time a pick sees a cell non-empty, in index order); none
  // ready: hold (false, release_at() the earliest end of a wait), or when forced the oldest. False when all
  // are empty.
  template <typename Total, typename Until>
  bool pick_oldest(int n, std::vector<int64_t>& stamps, Total total, Until until, bool force, int* out);
  // The time block b stops waiting for ranks on their way (<= now_ when none is), under the rank barrier.
  double waits_until(int b) const;
  // Group cells: the time cell (b, group g) stops waiting for its group's waves on their way.
  double group_waits_until(int b, int g) const;
  // Until when block b waits for note v: the nearest of the `span` blocks before b that served it since it
  // last arrived at b, plus twice its turn-around per block between, at most max_hold_s_ (-inf: not waited
  // for).
  double note_waits_until(int v, int b, int span) const;
  // The note index of (rank, wave): the rank alone without groups; -1 when not tracked.
  int note(int rank, int wave) const;

  int num_blocks_, num_cols_;
  double lookahead_cols_;
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
  std::vector<int64_t> pending_;  // [num_blocks * num_cols] parts out that return to each (block, column)
  // waves: the columns are waves (attention runtime); each wave's position (block last served) and member
  // count; readiness stamps (per wave, or per block on an expert runtime: -1 = not ready / empty) and the
  // next.
  bool wave_cols_ = false;
  std::vector<int> pos_;
  std::vector<int64_t> members_;
  std::vector<int64_t> wave_stamp_, block_stamp_;
  int64_t next_stamp_ = 0;
  bool holding_ = false;
  // rank barrier (expert side under waves): per (rank, block) the last serving / arrival (-inf: never), per
  // rank its last turn-around (-1: none yet); the clock of the last note or set_now.
  int num_ranks_ = 0;
  int meet_span_ = 1;
  double max_hold_s_ = 0.0;
  std::vector<double> served_at_, arrived_at_, turn_;
  // group cells: waves a rank, waves a group, groups, columns a group; each (block, group) cell's rows, stamp
  int num_waves_ = 1, group_waves_ = 1, groups_ = 0, cols_per_group_ = 0;
  std::vector<int64_t> cell_total_, cell_stamp_;
  double now_ = 0.0;
  double release_at_ = std::numeric_limits<double>::infinity();
};

}  // namespace amoe
