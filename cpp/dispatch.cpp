#include "dispatch.h"

#include <pybind11/stl.h>

#include <vector>

#include "errors.h"

namespace amoe {

void group_rows(const int64_t* dest, int64_t n, int64_t num_dest, int64_t* perm, int64_t* offsets) {
  std::fill(offsets, offsets + num_dest + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    AMOE_CHECK_ARG(dest[i] >= 0 && dest[i] < num_dest,
                   "destination " << dest[i] << " of row " << i << " is outside [0, " << num_dest << ")");
    ++offsets[dest[i] + 1];
  }
  for (int64_t k = 0; k < num_dest; ++k) offsets[k + 1] += offsets[k];
  std::vector<int64_t> cursor(offsets, offsets + num_dest);
  for (int64_t i = 0; i < n; ++i) perm[cursor[dest[i]]++] = i;
}

std::pair<torch::Tensor, torch::Tensor> group_by_destination(const torch::Tensor& dest, int64_t num_dest) {
  AMOE_CHECK_ARG(dest.dim() == 1, "dest must be 1-D, got " << dest.dim() << " dims");
  AMOE_CHECK_ARG(dest.scalar_type() == torch::kInt64, "dest must be int64");
  AMOE_CHECK_ARG(num_dest > 0, "num_dest must be positive, got " << num_dest);
  auto d = dest.contiguous().cpu();
  const int64_t n = d.size(0);
  auto offsets = torch::empty({num_dest + 1}, torch::kInt64);
  auto perm = torch::empty({n}, torch::kInt64);
  group_rows(d.data_ptr<int64_t>(), n, num_dest, perm.data_ptr<int64_t>(), offsets.data_ptr<int64_t>());
  return {perm, offsets};
}

int choose_replica(const std::vector<int>& candidates, std::vector<int64_t>* load) {
  AMOE_CHECK_ARG(!candidates.empty(), "an expert needs at least one replica");
  std::vector<int64_t>& l = *load;
  int best = candidates[0];
  for (int r : candidates) {
    AMOE_CHECK_ARG(r >= 0, "replica runtime ids must be >= 0, got " << r);
    if (r >= static_cast<int>(l.size())) l.resize(r + 1, 0);
    if (l[r] < l[best] || (l[r] == l[best] && r < best)) best = r;
  }
  ++l[best];
  return best;
}

namespace {

// The rule applied row after row, as the dispatcher does within one batch: the oracle tests check it against.
std::vector<int> choose_replicas(const std::vector<std::vector<int>>& candidates, std::vector<int64_t> load) {
  std::vector<int> out;
  out.reserve(candidates.size());
  for (const auto& c : candidates) out.push_back(choose_replica(c, &load));
  return out;
}

}  // namespace

void register_dispatch(pybind11::module_& m) {
  // The sort touches only plain memory, so it runs without the GIL.
  m.def("group_by_destination", &group_by_destination, pybind11::arg("dest"), pybind11::arg("num_dest"),
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Stable grouping of row indices by destination: returns (perm, offsets).");
  // Plain vectors in and out: no tensor, no Python object touched while it runs.
  m.def("choose_replicas", &choose_replicas, pybind11::arg("candidates"), pybind11::arg("inflight"),
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "The replica rule row after row: for each row's candidate runtimes (ascending), the one with the "
        "fewest "
        "rows in flight (inflight[r] plus the rows given so far), ties to the lowest id.");
}

}  // namespace amoe
