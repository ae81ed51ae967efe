#include "plane_c10d.h"

#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

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
class ProcessGroupPlane : public TensorPlane {
 public:
  ProcessGroupPlane(std::string name, c10::intrusive_ptr<c10d::ProcessGroup> up,
                    c10::intrusive_ptr<c10d::ProcessGroup> down, at::Device device)
      : name_(std::move(name)), up_(std::move(up)), down_(std::move(down)), device_(device) {}
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
    auto work = group_to(dst)->send(tensors, dst, static_cast<int>(tag));
    return std::make_unique<WorkTransfer>(std::move(work), data);
  }

  std::unique_ptr<Transfer> recv(const at::Tensor& buffer, int src, uint32_t tag) override {
    std::vector<at::Tensor> tensors{buffer};
    auto work = group_from(src)->recv(tensors, src, static_cast<int>(tag));
    return std::make_unique<WorkTransfer>(std::move(work), buffer);
  }

 private:
  // A transfer's group depends only on its direction, so sender and receiver pick the same one.
  const c10::intrusive_ptr<c10d::ProcessGroup>& group_to(int dst) const {
    return up_->getRank() < dst ? up_ : down_;
  }
  const c10::intrusive_ptr<c10d::ProcessGroup>& group_from(int src) const {
    return src < up_->getRank() ? up_ : down_;
  }

  std::string name_;
  c10::intrusive_ptr<c10d::ProcessGroup> up_, down_;
  at::Device device_;
};

}  // namespace

std::shared_ptr<TensorPlane> make_process_group_plane(const std::string& name,
                                                      c10::intrusive_ptr<c10d::ProcessGroup> up,
                                                      c10::intrusive_ptr<c10d::ProcessGroup> down,
                                                      at::Device device) {
  return std::make_shared<ProcessGroupPlane>(name, std::move(up), std::move(down), device);
}

}  // namespace amoe
