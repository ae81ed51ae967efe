#include "scheduler.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>

#include "errors.h"

namespace amoe {

Policy parse_policy(const std::string& name) {
  if (name == "defrag") return Policy::kDefrag;
  if (name == "mtfs") return Policy::kMtfs;
  if (name == "flfs") return Policy::kFlfs;
  if (name == "wave") return Policy::kWave;
  AMOE_CHECK_ARG(false, "unknown scheduling policy '" << name << "' (expected defrag, mtfs, flfs or wave)");
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
    case Policy::kWave:
      return "wave";
  }
  return "?";
}

Scheduler::Scheduler(int num_blocks, int num_cols, Policy policy, int lookahead, double decay)
    : num_blocks_(num_blocks),
      num_cols_(num_cols),
      policy_(policy),
      lookahead_(lookahead),
      decay_(decay),
      depth_(static_cast<size_t>(num_blocks) * num_cols, 0),
      block_total_(num_blocks, 0),
      block_max_(num_blocks, 0),
      block_argmax_(num_blocks, 0),
      block_dirty_(num_blocks, 0),
      pending_(num_blocks, 0) {
  AMOE_CHECK_ARG(num_blocks > 0 && num_cols > 0,
                 "scheduler grid must be non-empty, got " << num_blocks << " x " << num_cols);
  AMOE_CHECK_ARG(lookahead >= 0, "lookahead must be >= 0, got " << lookahead);
  AMOE_CHECK_ARG(decay >= 0.0, "decay must be >= 0, got " << decay);
  for (int k = 0; k <= lookahead; ++k) decay_pow_.push_back(std::pow(decay, static_cast<double>(k)));
}

void Scheduler::add(int block, int col, int64_t delta) { set(block, col, depth(block, col) + delta); }

void Scheduler::add_pending(int block, int64_t delta) {
  AMOE_CHECK_ARG(block >= 0 && block < num_blocks_, "block " << block << " is outside the grid");
  AMOE_CHECK_ARG(pending_[block] + delta >= 0, "pending rows would become negative at block " << block);
  pending_[block] += delta;
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
    case Policy::kWave:
      return pick_wave(block, col, force);
    case Policy::kDefrag:
      return pick_defrag(block, col);
    case Policy::kMtfs:
      return pick_mtfs(block, col);
    case Policy::kFlfs:
      return pick_flfs(block, col);
  }
  return false;
}

// Algorithm 1 as printed: Score[b][e] = Q[b][e] + sum_{k=1..K} (total of block (b+k) mod N_B) / N_E *
// delta^k, only for non-empty queues; argmax. Within a block the look-ahead is shared, so the block's deepest
// queue (lowest column on ties) is its best cell; the double arithmetic matches the Python reference step for
// step.
bool Scheduler::pick_defrag(int* block, int* col) {
  double best = -1.0;
  const double ne = static_cast<double>(num_cols_);
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

// Wave (docs/engine.md "wave"): a block is served whole (an expert runtime's grouped step takes every hosted
// expert's queue of it), so blocks are compared by their total rows. A block part of whose wave is still out
// (pending > 0) is not ready: it waits for the rest, so the wave leaves together instead of as fragments. Of
// the ready blocks, the one with the most rows; when none is ready, hold (false) unless forced, then the
// non-ready block with the most rows.
bool Scheduler::pick_wave(int* block, int* col, bool force) {
  int64_t ready = 0, waiting = 0;
  int ready_b = -1, waiting_b = -1;
  for (int b = 0; b < num_blocks_; ++b) {
    const int64_t rows = block_total_[b];
    if (rows == 0) continue;
    if (pending_[b] == 0) {
      if (rows > ready) ready = rows, ready_b = b;
    } else if (rows > waiting) {
      waiting = rows, waiting_b = b;
    }
  }
  if (ready_b < 0) {
    if (!force) {
      holding_ = true;
      return false;
    }
    ready_b = waiting_b;
  }
  if (block_dirty_[ready_b]) refresh_block(ready_b);
  *block = ready_b;
  *col = block_argmax_[ready_b];
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
          [](Scheduler& s, bool force) -> py::object {
            int b = 0, c = 0;
            if (!s.pick(&b, &c, force)) return py::none();
            return py::make_tuple(b, c);
          },
          py::arg("force") = false,
          "The (block, col) to drain next, or None when every queue is empty or (wave) the runtime holds for "
          "a returning wave (holding).")
      .def("add_pending", &Scheduler::add_pending, py::arg("block"), py::arg("delta"),
           "Changes the rows out that will return to a block (the wave policy holds it while any are out).")
      .def("pending", &Scheduler::pending, py::arg("block"))
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
