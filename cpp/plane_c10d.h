// Tensor planes over a torch.distributed process group (gloo on the CPU, NCCL on GPUs).
#pragma once

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "zmq_comm.h"

namespace amoe {

// P2P send/recv issued from C++; receive buffers are allocated on device. Transfers to a higher rank go over
// `up`, to a lower rank over `down` (the same group for both is fine where directions do not block each
// other, as in gloo). The groups should be dedicated to the communicator: its tags (seq mod 2^31) would
// collide with other P2P traffic.
std::shared_ptr<TensorPlane> make_process_group_plane(const std::string& name,
                                                      c10::intrusive_ptr<c10d::ProcessGroup> up,
                                                      c10::intrusive_ptr<c10d::ProcessGroup> down,
                                                      at::Device device);

}  // namespace amoe
