#include "plane_c10d.h"

namespace amoe {

namespace {

// A posted send or receive; holds the tensor so its memory outlives the transfer.
class WorkTransfer : public TensorPlane::Transfer {
 public:
  WorkTransfer(c10::intrusive_ptr<c10d::Work> work, at::Tensor tensor)
      : work_(std::move(work)), tensor_(std::move(tensor)) {}
  // No timeout here: a gloo wait that times out poisons every pair of the group; the communicator aborts
  // a transfer past its deadline instead, which only ends this wait.
  bool wait() override { return work_->wait(); }
  void abort() override { work_->abort(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  at::Tensor tensor_;
};

class ProcessGroupPlane : public TensorPlane {
 public:
  ProcessGroupPlane(std::string name, c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device)
      : name_(std::move(name)), pg_(std::move(pg)), device_(device) {}
  std::string name() const override { return name_; }
  at::Device device() const override { return device_; }

  std::unique_ptr<Transfer> send(const at::Tensor& data, int dst, uint32_t tag) override {
    std::vector<at::Tensor> tensors{data};
    auto work = pg_->send(tensors, dst, static_cast<int>(tag));
    return std::make_unique<WorkTransfer>(std::move(work), data);
  }

  std::unique_ptr<Transfer> recv(const at::Tensor& buffer, int src, uint32_t tag) override {
    std::vector<at::Tensor> tensors{buffer};
    auto work = pg_->recv(tensors, src, static_cast<int>(tag));
    return std::make_unique<WorkTransfer>(std::move(work), buffer);
  }

 private:
  std::string name_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  at::Device device_;
};

}  // namespace

std::shared_ptr<TensorPlane> make_process_group_plane(const std::string& name,
                                                      c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                      at::Device device) {
  return std::make_shared<ProcessGroupPlane>(name, std::move(pg), device);
}

}  // namespace amoe
