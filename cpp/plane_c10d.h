// Tensor planes over a torch.distributed process group (gloo on the CPU, NCCL on GPUs).
#pragma once

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "zmq_comm.h"

namespace amoe {

// P2P send/recv on pg, issued from C++; receive buffers are allocated on device. The group should be
// dedicated to the communicator: its tags (seq mod 2^31) would collide with other P2P traffic.
std::shared_ptr<TensorPlane> make_process_group_plane(const std::string& name,
                                                      c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                      at::Device device);

}  // namespace amoe
