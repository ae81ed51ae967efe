#include "dispatch.h"

#include <vector>

#include "errors.h"

namespace amoe {

std::pair<torch::Tensor, torch::Tensor> group_by_destination(const torch::Tensor& dest, int64_t num_dest) {
  AMOE_CHECK_ARG(dest.dim() == 1, "dest must be 1-D, got " << dest.dim() << " dims");
  AMOE_CHECK_ARG(dest.scalar_type() == torch::kInt64, "dest must be int64");
  AMOE_CHECK_ARG(num_dest > 0, "num_dest must be positive, got " << num_dest);
  auto d = dest.contiguous().cpu();
  const int64_t n = d.size(0);
  const int64_t* dp = d.data_ptr<int64_t>();
  auto offsets = torch::zeros({num_dest + 1}, torch::kInt64);
  int64_t* op = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    AMOE_CHECK_ARG(dp[i] >= 0 && dp[i] < num_dest,
                   "destination " << dp[i] << " of row " << i << " is outside [0, " << num_dest << ")");
    ++op[dp[i] + 1];
  }
  for (int64_t k = 0; k < num_dest; ++k) op[k + 1] += op[k];
  auto perm = torch::empty({n}, torch::kInt64);
  int64_t* pp = perm.data_ptr<int64_t>();
  std::vector<int64_t> cursor(op, op + num_dest);
  for (int64_t i = 0; i < n; ++i) pp[cursor[dp[i]]++] = i;
  return {perm, offsets};
}

void register_dispatch(pybind11::module_& m) {
  // The sort touches only plain memory, so it runs without the GIL.
  m.def("group_by_destination", &group_by_destination, pybind11::arg("dest"), pybind11::arg("num_dest"),
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Stable grouping of row indices by destination: returns (perm, offsets).");
}

}  // namespace amoe
