// amoe._core: the module file only registers each area's bindings.
#include <torch/extension.h>

#include "dispatch.h"
#include "errors.h"

namespace amoe {
void register_scheduler(pybind11::module_& m);
void register_engine(pybind11::module_& m);
void register_comm(pybind11::module_& m);
void register_exchange(pybind11::module_& m);
}  // namespace amoe

PYBIND11_MODULE(_core, m) {
  m.doc() =
      "amoe C++ core: scheduler, token pool, mu-queues, execution engine, loopback and ZeroMQ communicators, "
      "the synchronous modes' barrier exchange";
  pybind11::register_exception<amoe::InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);
  amoe::register_dispatch(m);
  amoe::register_scheduler(m);
  amoe::register_engine(m);
  amoe::register_comm(m);      // after the engine: ZmqCommunicator derives from Communicator
  amoe::register_exchange(m);  // after the engine: BarrierExchange takes a Communicator
}
