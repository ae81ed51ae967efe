#include "dispatch.h"

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

void register_dispatch(pybind11::module_& m) {
  // The sort touches only plain memory, so it runs without the GIL.
  m.def("group_by_destination", &group_by_destination, pybind11::arg("dest"), pybind11::arg("num_dest"),
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Stable grouping of row indices by destination: returns (perm, offsets).");
}

}  // namespace amoe
