// Dispatcher kernels: grouping a batch's rows by the runtime they go to next.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <utility>

namespace amoe {

// Stable counting sort of row indices by destination.
// dest: int64 [num_rows], each in [0, num_dest).
// Returns (perm, offsets): perm [num_rows] lists the rows of destination d at
// perm[offsets[d]:offsets[d+1]], in their original order; offsets [num_dest + 1].
std::pair<torch::Tensor, torch::Tensor> group_by_destination(const torch::Tensor& dest, int64_t num_dest);

void register_dispatch(pybind11::module_& m);

}  // namespace amoe
