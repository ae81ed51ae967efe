// Dispatcher kernels: grouping a batch's rows by the runtime they go to next.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace amoe {

// Stable counting sort on plain memory: perm[offsets[d]:offsets[d+1]] lists the rows with dest == d, in
// order. dest values must be in [0, num_dest); perm has n entries, offsets num_dest + 1.
void group_rows(const int64_t* dest, int64_t n, int64_t num_dest, int64_t* perm, int64_t* offsets);

// Stable grouping of row indices by destination.
// dest: int64 [num_rows], each in [0, num_dest).
// Returns (perm, offsets): perm [num_rows] lists the rows of destination d at
// perm[offsets[d]:offsets[d+1]], in their original order; offsets [num_dest + 1].
std::pair<torch::Tensor, torch::Tensor> group_by_destination(const torch::Tensor& dest, int64_t num_dest);

// The replica rule (docs/rebalancing.md "The rule"): a row of an expert goes to the replica whose runtime has
// the fewest rows in `load` — the rows this sender has sent there and not yet had answered (all experts and
// blocks: the runtime's backlog as the sender sees it), plus those this dispatch already gave it; ties go to
// the lowest runtime id. `candidates` are ascending runtime ids; the chosen one's load grows by the row.
int choose_replica(const std::vector<int>& candidates, std::vector<int64_t>* load);

void register_dispatch(pybind11::module_& m);

}  // namespace amoe
