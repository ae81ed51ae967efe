#include "plane_c10d.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <stdexcept>

namespace amoe {

namespace {

// A posted send or receive; holds the tensor so its memory outlives the transfer (a send's source stays alive
// until the send is done, whatever the engine does with it meanwhile).
class WorkTransfer : public TensorPlane::Transfer {
 public:
  WorkTransfer(c10::intrusive_ptr<c10d::Work> work, at::Tensor tensor)
      : work_(std::move(work)), tensor_(std::move(tensor)) {}
  // No timeout here: a gloo wait that times out poisons every pair of the group; the communicator aborts
  // a transfer past its deadline instead, which only ends this wait.
  bool wait() override {
    if (!work_->wait()) return false;
    if (tensor_.is_cuda()) {
      // NCCL's wait() only orders the current stream (the lane's own, see on_lane_thread) after the transfer
      // on NCCL's stream; the host learns nothing. An event recorded there and waited for on this lane thread
      // is what says the bytes have landed: only then does the receptor hand the message to the scheduler,
      // and only then may a send's source tensor go.
      c10::impl::VirtualGuardImpl impl(tensor_.device().type());
      c10::Event done(tensor_.device().type());
      done.record(impl.getStream(tensor_.device()));
      done.synchronize();
    }
    return true;
  }
  void abort() override { work_->abort(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor tensor_;
};

// P2P over a process group. NCCL issues its send/recv on its own communication stream, ordered after the
// caller's current stream (the compute that produced the tensor) by an event, without waiting on the host.
// `self` is this runtime's rank; `pair`: the groups hold only self and one peer (the lower runtime is rank 0
// in them), so a runtime rank becomes a group rank.
class ProcessGroupPlane : public TensorPlane {
 public:
  ProcessGroupPlane(std::string name, GroupPtr up, GroupPtr down, at::Device device, int self, bool pair)
      : name_(std::move(name)),
        up_(std::move(up)),
        down_(std::move(down)),
        device_(device),
        self_(self),
        pair_(pair) {}
  std::string name() const override { return name_; }
  at::Device device() const override { return device_; }

  void on_lane_thread() override {
    if (!device_.is_cuda()) return;
    c10::impl::VirtualGuardImpl impl(device_.type());
    impl.setDevice(device_);
    // A stream of the device's pool: the completion events of this lane are recorded and waited for there, so
    // a finished transfer is never held up by the compute queued on the default stream.
    impl.exchangeStream(impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/true));
  }

  std::unique_ptr<Transfer> send(const at::Tensor& data, int dst, uint32_t tag) override {
    std::vector<at::Tensor> tensors{data};
    auto work = group(self_ < dst)->send(tensors, group_rank(dst), static_cast<int>(tag));
    return std::make_unique<WorkTransfer>(std::move(work), data);
  }

  std::unique_ptr<Transfer> recv(const at::Tensor& buffer, int src, uint32_t tag) override {
    std::vector<at::Tensor> tensors{buffer};
    auto work = group(src < self_)->recv(tensors, group_rank(src), static_cast<int>(tag));
    return std::make_unique<WorkTransfer>(std::move(work), buffer);
  }

 private:
  // A transfer's group depends only on its direction (up: from the lower runtime to the higher), so sender
  // and receiver pick the same one.
  const GroupPtr& group(bool upward) const {
    const GroupPtr& g = upward ? up_ : down_;
    if (!g) throw std::logic_error("the " + name_ + " plane has no group for this peer yet");
    return g;
  }
  int group_rank(int runtime) const { return pair_ ? (runtime > self_ ? 1 : 0) : runtime; }

  std::string name_;
  GroupPtr up_, down_;
  at::Device device_;
  int self_;
  bool pair_;
};

}  // namespace

std::shared_ptr<TensorPlane> make_process_group_plane(const std::string& name, GroupPtr up, GroupPtr down,
                                                      at::Device device) {
  const int self = up->getRank();
  return std::make_shared<ProcessGroupPlane>(name, std::move(up), std::move(down), device, self, false);
}

std::shared_ptr<TensorPlane> make_pair_plane(const std::string& name, int rank, GroupPtr up, GroupPtr down,
                                             at::Device device) {
  return std::make_shared<ProcessGroupPlane>(name, std::move(up), std::move(down), device, rank, true);
}

std::shared_ptr<TensorPlane> make_per_peer_plane(const std::string& name, at::Device device) {
  return std::make_shared<ProcessGroupPlane>(name, GroupPtr(), GroupPtr(), device, -1, true);
}

}  // namespace amoe
