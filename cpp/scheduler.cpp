#include "scheduler.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "errors.h"

namespace amoe {

Policy parse_policy(const std::string& name) {
  if (name == "defrag") return Policy::kDefrag;
  if (name == "mtfs") return Policy::kMtfs;
  if (name == "flfs") return Policy::kFlfs;
  if (name == "waves") return Policy::kWaves;
  AMOE_CHECK_ARG(false, "unknown scheduling policy '" << name << "' (expected defrag, mtfs, flfs or waves)");
  return Policy::kDefrag;
}

const char* policy_name(Policy p) {
  switch (p) {
    case Policy::kDefrag:
      return "defrag";
    case Policy::kMtfs:
      return "mtfs";
    case Policy::kFlfs:
      return "flfs";
    case Policy::kWaves:
      return "waves";
  }
  return "?";
}

Scheduler::Scheduler(int num_blocks, int num_cols, Policy policy, int lookahead, double decay)
    : num_blocks_(num_blocks),
      num_cols_(num_cols),
      lookahead_cols_(num_cols),
      policy_(policy),
      lookahead_(lookahead),
      decay_(decay),
      depth_(static_cast<size_t>(num_blocks) * num_cols, 0),
      block_total_(num_blocks, 0),
      block_max_(num_blocks, 0),
      block_argmax_(num_blocks, 0),
      block_dirty_(num_blocks, 0),
      pending_(static_cast<size_t>(num_blocks) * num_cols, 0),
      pos_(num_cols, 0),
      members_(num_cols, 0),
      wave_stamp_(num_cols, -1),
      block_stamp_(num_blocks, -1) {
  AMOE_CHECK_ARG(num_blocks > 0 && num_cols > 0,
                 "scheduler grid must be non-empty, got " << num_blocks << " x " << num_cols);
  AMOE_CHECK_ARG(lookahead >= 0, "lookahead must be >= 0, got " << lookahead);
  AMOE_CHECK_ARG(decay >= 0.0, "decay must be >= 0, got " << decay);
  for (int k = 0; k <= lookahead; ++k) decay_pow_.push_back(std::pow(decay, static_cast<double>(k)));
}

void Scheduler::set_lookahead_cols(int n) {
  AMOE_CHECK_ARG(n > 0, "the look-ahead's columns must be positive, got " << n);
  lookahead_cols_ = n;
}

void Scheduler::add(int block, int col, int64_t delta) { set(block, col, depth(block, col) + delta); }

void Scheduler::add_pending(int block, int64_t delta, int col) {
  AMOE_CHECK_ARG(block >= 0 && block < num_blocks_ && col >= 0 && col < num_cols_,
                 "(" << block << ", " << col << ") is outside the grid");
  int64_t& p = pending_[static_cast<size_t>(block) * num_cols_ + col];
  AMOE_CHECK_ARG(p + delta >= 0, "pending rows would become negative at (" << block << ", " << col << ")");
  p += delta;
}

int Scheduler::admit(int64_t wave_rows) {
  AMOE_CHECK_ARG(wave_rows > 0, "wave_rows must be > 0, got " << wave_rows);
  int best = 0;
  for (int w = 0; w < num_cols_; ++w) {
    if (members_[w] < wave_rows) {
      best = w;
      break;
    }
    if (members_[w] < members_[best]) best = w;
  }
  ++members_[best];
  return best;
}

void Scheduler::leave(int wave) {
  AMOE_CHECK_ARG(wave >= 0 && wave < num_cols_ && members_[wave] > 0,
                 "wave " << wave << " has no member to leave");
  --members_[wave];
}

void Scheduler::set(int block, int col, int64_t d) {
  AMOE_CHECK_ARG(block >= 0 && block < num_blocks_ && col >= 0 && col < num_cols_,
                 "queue (" << block << ", " << col << ") is outside the " << num_blocks_ << " x " << num_cols_
                           << " grid");
  AMOE_CHECK_ARG(d >= 0, "queue depth would become negative: " << d);
  int64_t& cell = depth_[block * num_cols_ + col];
  const int64_t old = cell;
  cell = d;
  block_total_[block] += d - old;
  total_ += d - old;
  if (groups_ > 0) cell_total_[static_cast<size_t>(block) * groups_ + col / cols_per_group_] += d - old;
  // waves: a wave whose cell at its position is drained empty has left that block (it is out to the next
  // one): rows arriving there later (new requests at block 0) are behind it and wait for its next pass.
  if (policy_ == Policy::kWaves && wave_cols_ && d == 0 && old > 0 && pos_[col] == block)
    pos_[col] = (block + 1) % num_blocks_;
  if (block_dirty_[block]) return;
  // A queue that grows can only take over the block maximum; one that shrinks may lose it, so recompute.
  if (d > block_max_[block] || (d == block_max_[block] && col < block_argmax_[block])) {
    block_max_[block] = d;
    block_argmax_[block] = col;
  } else if (d < old && col == block_argmax_[block]) {
    block_dirty_[block] = 1;
  }
}

void Scheduler::refresh_block(int b) {
  const int64_t* row = &depth_[b * num_cols_];
  int64_t best = row[0];
  int arg = 0;
  for (int c = 1; c < num_cols_; ++c) {
    if (row[c] > best) {
      best = row[c];
      arg = c;
    }
  }
  block_max_[b] = best;
  block_argmax_[b] = arg;
  block_dirty_[b] = 0;
}

bool Scheduler::pick(int* block, int* col, bool force) {
  holding_ = false;
  if (total_ == 0) return false;
  switch (policy_) {
    case Policy::kDefrag:
      return pick_defrag(block, col);
    case Policy::kMtfs:
      return pick_mtfs(block, col);
    case Policy::kFlfs:
      return pick_flfs(block, col);
    case Policy::kWaves:
      if (wave_cols_) return pick_waves(block, col, force);
      return groups_ > 0 ? pick_oldest_group(block, col, force) : pick_oldest_block(block, col, force);
  }
  return false;
}

// Algorithm 1 as printed: Score[b][e] = Q[b][e] + sum_{k=1..K} (total of block (b+k) mod N_B) / N_E *
// delta^k, only for non-empty queues; argmax. Within a block the look-ahead is shared, so the block's deepest
// queue (lowest column on ties) is its best cell; the double arithmetic matches the Python reference step for
// step.
bool Scheduler::pick_defrag(int* block, int* col) {
  double best = -1.0;
  const double ne = lookahead_cols_;
  for (int b = 0; b < num_blocks_; ++b) {
    if (block_total_[b] == 0) continue;
    double lscore = 0.0;
    for (int k = 1; k <= lookahead_; ++k) {
      const int bk = (b + k) % num_blocks_;
      lscore = lscore + (static_cast<double>(block_total_[bk]) / ne) * decay_pow_[k];
    }
    if (block_dirty_[b]) refresh_block(b);
    const double score = lscore + static_cast<double>(block_max_[b]);
    if (score > best) {
      best = score;
      *block = b;
      *col = block_argmax_[b];
    }
  }
  return best >= 0.0;
}

bool Scheduler::pick_mtfs(int* block, int* col) {
  int64_t best = 0;
  for (int b = 0; b < num_blocks_; ++b) {
    if (block_total_[b] == 0) continue;
    if (block_dirty_[b]) refresh_block(b);
    if (block_max_[b] > best) {
      best = block_max_[b];
      *block = b;
      *col = block_argmax_[b];
    }
  }
  return best > 0;
}

// First layer first: the lowest block with waiting rows; within it the deepest queue.
bool Scheduler::pick_flfs(int* block, int* col) {
  for (int b = 0; b < num_blocks_; ++b) {
    if (block_total_[b] == 0) continue;
    if (block_dirty_[b]) refresh_block(b);
    *block = b;
    *col = block_argmax_[b];
    return true;
  }
  return false;
}

// Waves (docs/scheduler.md "The attention side"): the columns are waves. A wave's position is the
// block it was last picked at (the next one once that cell is drained: set()); its front is the first block,
// in ring order from its position, with rows or parts out of it; it is ready when it has rows there and none
// are out. Rows of the wave elsewhere (fragments ahead, new requests at block 0 behind it) wait for the
// front. Of the ready waves the one ready longest (stamped in the first pick that sees it ready, in column
// order); with none ready hold, or when forced take the fullest non-empty cell. The picked wave's position
// becomes the block.
bool Scheduler::pick_waves(int* block, int* col, bool force) {
  int best_w = -1, best_b = -1;
  for (int w = 0; w < num_cols_; ++w) {
    int front = -1;
    for (int i = 0; i < num_blocks_; ++i) {
      const int b = (pos_[w] + i) % num_blocks_;
      const size_t cell = static_cast<size_t>(b) * num_cols_ + w;
      if (depth_[cell] > 0 || pending_[cell] > 0) {
        front = b;
        break;
      }
    }
    const bool ready = front >= 0 && pending_[static_cast<size_t>(front) * num_cols_ + w] == 0 &&
                       depth_[static_cast<size_t>(front) * num_cols_ + w] > 0;
    if (!ready) {
      wave_stamp_[w] = -1;
      continue;
    }
    if (wave_stamp_[w] < 0) wave_stamp_[w] = next_stamp_++;
    if (best_w < 0 || wave_stamp_[w] < wave_stamp_[best_w]) best_w = w, best_b = front;
  }
  if (best_w < 0) {
    if (!force) {
      holding_ = true;
      return false;
    }
    int64_t most = 0;
    for (int b = 0; b < num_blocks_; ++b)
      for (int w = 0; w < num_cols_; ++w)
        if (depth(b, w) > most) most = depth(b, w), best_b = b, best_w = w;
  }
  pos_[best_w] = best_b;
  *block = best_b;
  *col = best_w;
  return true;
}

void Scheduler::set_rank_barrier(int num_ranks, double max_hold_s, int meet_span) {
  AMOE_CHECK_ARG(num_ranks >= 0, "num_ranks must be >= 0, got " << num_ranks);
  AMOE_CHECK_ARG(max_hold_s > 0, "max_hold_s must be > 0, got " << max_hold_s);
  AMOE_CHECK_ARG(meet_span >= 1, "meet_span must be >= 1, got " << meet_span);
  num_ranks_ = num_ranks;
  groups_ = 0;  // per rank until set_wave_groups (group cells)
  cell_total_.clear();
  cell_stamp_.clear();
  // Block 0's span never reaches block 0 itself (a wave served there is a whole iteration away).
  meet_span_ = std::min(meet_span, std::max(1, num_blocks_ - 1));
  max_hold_s_ = max_hold_s;
  const double never = -std::numeric_limits<double>::infinity();
  served_at_.assign(static_cast<size_t>(num_ranks) * num_blocks_, never);
  arrived_at_.assign(static_cast<size_t>(num_ranks) * num_blocks_, never);
  turn_.assign(num_ranks, -1.0);
}

void Scheduler::set_wave_groups(int num_waves, int group_waves, int cols_per_group) {
  AMOE_CHECK_ARG(num_ranks_ > 0, "set_wave_groups needs set_rank_barrier first");
  AMOE_CHECK_ARG(num_waves >= 1 && group_waves >= 1 && cols_per_group >= 1,
                 "wave groups need num_waves, group_waves and cols_per_group >= 1");
  const int groups = (num_waves + group_waves - 1) / group_waves;
  AMOE_CHECK_ARG(groups * cols_per_group == num_cols_,
                 "wave groups: " << groups << " groups of " << cols_per_group << " columns do not make the "
                                 << num_cols_ << " columns of the grid");
  AMOE_CHECK_ARG(total_ == 0, "set_wave_groups on a grid that holds rows");
  num_waves_ = num_waves;
  group_waves_ = group_waves;
  groups_ = groups;
  cols_per_group_ = cols_per_group;
  const double never = -std::numeric_limits<double>::infinity();
  const size_t notes = static_cast<size_t>(num_ranks_) * num_waves;
  served_at_.assign(notes * num_blocks_, never);
  arrived_at_.assign(notes * num_blocks_, never);
  turn_.assign(notes, -1.0);
  cell_total_.assign(static_cast<size_t>(num_blocks_) * groups, 0);
  cell_stamp_.assign(static_cast<size_t>(num_blocks_) * groups, -1);
}

int Scheduler::note(int rank, int wave) const {
  if (rank < 0 || rank >= num_ranks_) return -1;
  if (groups_ == 0) return rank;
  return wave >= 0 && wave < num_waves_ ? rank * num_waves_ + wave : -1;
}

// A row of `rank` (and `wave`, with groups) arrived at `block`: if it was on its way here (served at the
// block before since its rows last arrived here), this is its turn-around.
void Scheduler::arrived(int block, int rank, double now, int wave) {
  now_ = now;
  const int v = note(rank, wave);
  if (v < 0 || block < 0 || block >= num_blocks_) return;  // not tracked
  const int prev = (block + num_blocks_ - 1) % num_blocks_;
  const double served = served_at_[static_cast<size_t>(v) * num_blocks_ + prev];
  double& arrived = arrived_at_[static_cast<size_t>(v) * num_blocks_ + block];
  if (served > arrived) turn_[v] = std::max(0.0, now - served);
  arrived = now;
}

void Scheduler::served(int block, int rank, double now, int wave) {
  now_ = now;
  const int v = note(rank, wave);
  if (v < 0 || block < 0 || block >= num_blocks_) return;
  served_at_[static_cast<size_t>(v) * num_blocks_ + block] = now;
}

double Scheduler::note_waits_until(int v, int b, int span) const {
  if (turn_[v] < 0) return -std::numeric_limits<double>::infinity();
  const double arrived = arrived_at_[static_cast<size_t>(v) * num_blocks_ + b];
  for (int d = 1; d <= span; ++d) {
    const int prev = ((b - d) % num_blocks_ + num_blocks_) % num_blocks_;
    const double served = served_at_[static_cast<size_t>(v) * num_blocks_ + prev];
    if (served > arrived) return served + std::min(2.0 * d * turn_[v], max_hold_s_);
  }
  return -std::numeric_limits<double>::infinity();
}

// Block b waits for every rank on its way to it (served at the block before after its rows last arrived here,
// with a turn-around measured) until twice that turn-around, at most max_hold_s_, after the serving. Block 0
// (the meeting block) looks meet_span_ blocks back: the nearest block that served the rank since, and twice
// the blocks left times the turn-around.
double Scheduler::waits_until(int b) const {
  const int span = b == 0 ? meet_span_ : 1;
  double until = -std::numeric_limits<double>::infinity();
  for (int r = 0; r < num_ranks_; ++r) until = std::max(until, note_waits_until(r, b, span));
  return until;
}

// Group cells: cell (b, g) waits for each wave of group g on its way to b: served at the block before since
// its rows last arrived here — at block 0 at any block before (a group meets there once an iteration,
// wherever its waves are) — until twice its turn-around per block still to pass, at most max_hold_s_ after
// that serving.
double Scheduler::group_waits_until(int b, int g) const {
  const int span = b == 0 ? num_blocks_ - 1 : 1;
  double until = -std::numeric_limits<double>::infinity();
  const int last = std::min(num_waves_, (g + 1) * group_waves_);
  for (int r = 0; r < num_ranks_; ++r)
    for (int w = g * group_waves_; w < last; ++w)
      until = std::max(until, note_waits_until(r * num_waves_ + w, b, span));
  return until;
}

template <typename Total, typename Until>
bool Scheduler::pick_oldest(int n, std::vector<int64_t>& stamps, Total total, Until until, bool force,
                            int* out) {
  int best = -1, oldest = -1;
  release_at_ = std::numeric_limits<double>::infinity();
  for (int i = 0; i < n; ++i) {
    if (total(i) == 0) {
      stamps[i] = -1;
      continue;
    }
    if (stamps[i] < 0) stamps[i] = next_stamp_++;
    if (oldest < 0 || stamps[i] < stamps[oldest]) oldest = i;
    const double u = until(i);
    if (u > now_) {
      release_at_ = std::min(release_at_, u);
      continue;
    }
    if (best < 0 || stamps[i] < stamps[best]) best = i;
  }
  if (oldest < 0) return false;
  if (best < 0) {
    if (!force) {
      holding_ = true;
      return false;
    }
    best = oldest;
  }
  *out = best;
  return true;
}

// Group cells: the (block, group) cell whose rows have waited longest among those whose group has no wave on
// its way (stamped in the first pick that sees the cell non-empty, in (block, group) order); the step takes
// that group's columns. None ready: hold, or when forced take the oldest cell.
bool Scheduler::pick_oldest_group(int* block, int* col, bool force) {
  int best = -1;
  const auto total = [this](int c) { return cell_total_[c]; };
  const auto until = [this](int c) { return group_waits_until(c / groups_, c % groups_); };
  if (!pick_oldest(num_blocks_ * groups_, cell_stamp_, total, until, force, &best)) return false;
  const int b = best / groups_, first = (best % groups_) * cols_per_group_;
  int argmax = first;  // the group's deepest column (the grouped step takes all of them anyway)
  for (int c = first; c < first + cols_per_group_; ++c)
    if (depth(b, c) > depth(b, argmax)) argmax = c;
  *block = b;
  *col = argmax;
  return true;
}

// Waves, expert side: the block whose rows have waited longest (stamped in the first pick that sees it
// non-empty, in block order), its deepest queue (a grouped step takes every hosted expert's queue of it
// anyway). Under the rank barrier (the straggler wait) only blocks no rank is on its way to are ready; with
// none ready hold (release_at(): the earliest end of a wait), or when forced take the oldest block.
bool Scheduler::pick_oldest_block(int* block, int* col, bool force) {
  int best = -1;
  const auto total = [this](int b) { return block_total_[b]; };
  const auto until = [this](int b) {
    return num_ranks_ > 0 ? waits_until(b) : -std::numeric_limits<double>::infinity();
  };
  if (!pick_oldest(num_blocks_, block_stamp_, total, until, force, &best)) return false;
  if (block_dirty_[best]) refresh_block(best);
  *block = best;
  *col = block_argmax_[best];
  return true;
}

namespace py = pybind11;

void register_scheduler(py::module_& m) {
  py::class_<Scheduler>(m, "Scheduler", "Layer scheduler over a (block, column) grid of queue depths.")
      .def(py::init([](int num_blocks, int num_cols, const std::string& policy, int lookahead, double decay) {
             return new Scheduler(num_blocks, num_cols, parse_policy(policy), lookahead, decay);
           }),
           // No defaults: policy names and defaults live in the config's scheduler section only.
           py::arg("num_blocks"), py::arg("num_cols"), py::arg("policy"), py::arg("lookahead"),
           py::arg("decay"))
      .def("add", &Scheduler::add, py::arg("block"), py::arg("col"), py::arg("delta"),
           "Changes one queue's depth by delta rows.")
      .def("set", &Scheduler::set, py::arg("block"), py::arg("col"), py::arg("depth"),
           "Sets one queue's depth.")
      .def(
          "set_depths",
          [](Scheduler& s, py::array_t<int64_t, py::array::c_style | py::array::forcecast> depths) {
            AMOE_CHECK_ARG(
                depths.ndim() == 2 && depths.shape(0) == s.num_blocks() && depths.shape(1) == s.num_cols(),
                "depths must have shape (" << s.num_blocks() << ", " << s.num_cols() << ")");
            auto d = depths.unchecked<2>();
            for (int b = 0; b < s.num_blocks(); ++b)
              for (int c = 0; c < s.num_cols(); ++c) s.set(b, c, d(b, c));
          },
          py::arg("depths"), "Sets every queue's depth from an int array [num_blocks, num_cols].")
      .def("depth", &Scheduler::depth, py::arg("block"), py::arg("col"))
      .def(
          "pick",
          [](Scheduler& s, bool force, py::object now) -> py::object {
            if (!now.is_none()) s.set_now(now.cast<double>());
            int b = 0, c = 0;
            if (!s.pick(&b, &c, force)) return py::none();
            return py::make_tuple(b, c);
          },
          py::arg("force") = false, py::arg("now") = py::none(),
          "The (block, col) to drain next, or None when every queue is empty or (waves) the runtime holds "
          "for "
          "a returning wave (holding).")
      .def("add_pending", &Scheduler::add_pending, py::arg("block"), py::arg("delta"), py::arg("col") = 0,
           "Changes the rows out that will return to a (block, wave column) (waves holds a wave while any of "
           "its rows are out).")
      .def("pending", &Scheduler::pending, py::arg("block"), py::arg("col") = 0)
      .def_property("wave_cols", &Scheduler::wave_cols, &Scheduler::set_wave_cols,
                    "waves: the columns are an attention runtime's waves (else an expert runtime's experts).")
      .def("admit", &Scheduler::admit, py::arg("wave_rows"),
           "waves: the wave a new request joins (the lowest with fewer than wave_rows members, else the "
           "fewest); counts it.")
      .def("leave", &Scheduler::leave, py::arg("wave"), "waves: a finished request leaves its wave.")
      .def("members", &Scheduler::members, py::arg("wave"))
      .def("wave_position", &Scheduler::wave_position, py::arg("wave"))
      .def("set_rank_barrier", &Scheduler::set_rank_barrier, py::arg("num_ranks"), py::arg("max_hold_s"),
           py::arg("meet_span") = 1,
           "waves, expert side: a block waits for the attention ranks on their way to it (docs/scheduler.md "
           "\"The straggler wait\", \"The meeting block\"; block 0 for ranks served up to meet_span blocks "
           "before it), each wait at most max_hold_s.")
      .def(
          "set_wave_groups", &Scheduler::set_wave_groups, py::arg("num_waves"), py::arg("group_waves"),
          py::arg("cols_per_group"),
          "waves, expert side, after set_rank_barrier (docs/scheduler.md \"Group cells\"): notes per "
          "(rank, wave); the columns are groups of cols_per_group (group g = waves g*group_waves ..); a step "
          "takes one (block, group) cell, which waits for its group's waves on their way (block 0: "
          "anywhere).")
      .def_property_readonly("num_groups", &Scheduler::num_groups)
      .def("arrived", &Scheduler::arrived, py::arg("block"), py::arg("rank"), py::arg("now"),
           py::arg("wave") = 0,
           "Rank barrier: a row of attention rank `rank` (of `wave`, with groups) arrived at `block` at time "
           "`now` (seconds).")
      .def("served", &Scheduler::served, py::arg("block"), py::arg("rank"), py::arg("now"),
           py::arg("wave") = 0,
           "Rank barrier: a step served rows of attention rank `rank` (of `wave`, with groups) at `block` at "
           "time `now` (seconds).")
      .def("turn_around", &Scheduler::turn_around, py::arg("rank"), py::arg("wave") = 0)
      .def_property_readonly("barrier_ranks", &Scheduler::barrier_ranks)
      .def_property_readonly("release_at", &Scheduler::release_at,
                             "Holding under the rank barrier: the earliest time a block's wait ends.")
      .def_property_readonly("holding", &Scheduler::holding)
      .def_property_readonly("total", &Scheduler::total)
      .def_property_readonly("num_blocks", &Scheduler::num_blocks)
      .def_property_readonly("num_cols", &Scheduler::num_cols)
      .def_property_readonly("policy",
                             [](const Scheduler& s) { return std::string(policy_name(s.policy())); })
      .def_property_readonly("lookahead", &Scheduler::lookahead)
      .def_property_readonly("decay", &Scheduler::decay);
}

}  // namespace amoe
