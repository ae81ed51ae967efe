// amoe._core: the module file only registers each area's bindings.
#include <torch/extension.h>

#include "dispatch.h"
#include "errors.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "amoe C++ core: dispatcher kernels, and (next) mu-queues, token pool, scheduler, threads";
  pybind11::register_exception<amoe::InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);
  amoe::register_dispatch(m);
}
