// Tensor planes over torch.distributed process groups (gloo on the CPU, NCCL on GPUs).
#pragma once

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "zmq_comm.h"

namespace amoe {

using GroupPtr = c10::intrusive_ptr<c10d::Backend>;

// P2P send/recv issued from C++; receive buffers are allocated on device. Transfers to a higher rank go over
// `up`, to a lower rank over `down` (the same group for both is fine where directions do not block each
// other, as in gloo). The groups should be dedicated to the communicator: its tags (seq mod 2^31) would
// collide with other P2P traffic.
//
// One group of every runtime (rank = runtime rank): its members are fixed.
std::shared_ptr<TensorPlane> make_process_group_plane(const std::string& name, GroupPtr up, GroupPtr down,
                                                      at::Device device);
// The link of runtime `rank` to one peer over groups of that pair alone (two members, the lower runtime is
// rank 0): what ZmqCommunicator::set_peer_link() takes, and swaps when the peer is replaced.
std::shared_ptr<TensorPlane> make_pair_plane(const std::string& name, int rank, GroupPtr up, GroupPtr down,
                                             at::Device device);
// No group yet: the kind and device of a communicator whose peers get links of their own.
std::shared_ptr<TensorPlane> make_per_peer_plane(const std::string& name, at::Device device);

}  // namespace amoe
