#include "exchange.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>

#include "dispatch.h"
#include "errors.h"

namespace amoe {

namespace {

using Clock = std::chrono::steady_clock;
// A waiting gather re-checks its deadline at least this often.
constexpr auto kRecvSlice = std::chrono::milliseconds(500);
const char* const kPhaseNames[] = {"begin", "dispatch", "combine"};

// A message body [1 + n, hidden]: row 0 for the tag row (zeros), rows 1.. for the payload.
at::Tensor frame(int64_t n, int64_t hidden, const at::TensorOptions& options) {
  auto body = at::empty({1 + n, hidden}, options);
  body[0].zero_();
  return body;
}

at::Tensor index_tensor(const int64_t* values, int64_t n) {
  auto t = at::empty({n}, at::kLong);
  if (n > 0) std::memcpy(t.data_ptr<int64_t>(), values, n * sizeof(int64_t));
  return t;
}

at::Tensor flat(const at::Tensor& t, at::ScalarType type, int64_t n, const char* name) {
  AMOE_CHECK_ARG(t.numel() == n, name << " has " << t.numel() << " values, expected " << n);
  return t.to(at::kCPU, type).contiguous().reshape({n});
}

}  // namespace

std::string ExchangeTag::str() const {
  std::ostringstream os;
  os << "(it " << iteration << ", block " << block << ", "
     << (phase >= 0 && phase <= kCombine ? kPhaseNames[phase] : "phase?") << ", mb " << micro << ")";
  return os.str();
}

BarrierExchange::BarrierExchange(std::shared_ptr<Communicator> comm, int rank, double timeout_s,
                                 std::vector<int> expert_device, std::vector<int> expert_devices)
    : comm_(std::move(comm)),
      rank_(rank),
      timeout_s_(timeout_s),
      expert_device_(std::move(expert_device)),
      expert_devices_(std::move(expert_devices)) {
  AMOE_CHECK_ARG(comm_ != nullptr, "a barrier exchange needs a communicator");
  AMOE_CHECK_ARG(timeout_s > 0, "timeout_s must be positive, got " << timeout_s);
  std::sort(expert_devices_.begin(), expert_devices_.end());
  for (int d : expert_devices_) num_dest_ = std::max(num_dest_, d + 1);
  for (size_t e = 0; e < expert_device_.size(); ++e) {
    const int d = expert_device_[e];
    AMOE_CHECK_ARG(std::binary_search(expert_devices_.begin(), expert_devices_.end(), d),
                   "expert " << e << " is on runtime " << d << ", which is not an expert device");
  }
}

void BarrierExchange::send(int dest, const ExchangeTag& tag, std::vector<RowMeta>&& rows, at::Tensor framed,
                           int64_t info, int64_t flags, float step_s) {
  const int64_t n = static_cast<int64_t>(rows.size());
  if (dest == rank_) {  // to oneself: straight into the pending exchanges, no message
    file(tag, rank_, Parcel{info, flags, step_s, std::move(rows), framed.narrow(0, 1, n)});
    return;
  }
  RowMeta head{static_cast<uint64_t>(tag.iteration),
               LayerId{tag.phase == kDispatch ? kExpert : kAttn, tag.block, tag.micro},
               static_cast<int32_t>(info),
               static_cast<int32_t>(flags),
               /*chunk_len=*/0,
               tag.phase,
               /*expert_id=*/-1,
               /*weight=*/step_s,
               rank_};
  rows.insert(rows.begin(), head);
  Message m;
  m.header.num_rows = n + 1;
  m.header.dtype = static_cast<int32_t>(framed.scalar_type());
  m.header.hidden = framed.size(1);
  m.rows = std::move(rows);
  m.data = std::move(framed);
  comm_->send(dest, std::move(m));
}

void BarrierExchange::signal(int dest, const ExchangeTag& tag, int64_t info, int64_t flags, float step_s) {
  send(dest, tag, {}, frame(0, 1, at::kFloat), info, flags, step_s);
}

void BarrierExchange::drop(const std::string& why) {
  dropped_.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(drop_mu_);  // pairs with last_drop() on the stats thread
  last_drop_ = why;
}

std::string BarrierExchange::last_drop() const {
  std::lock_guard<std::mutex> lock(drop_mu_);
  return last_drop_;
}

void BarrierExchange::receive(Message&& msg) {
  const int64_t n = static_cast<int64_t>(msg.rows.size());
  if (n < 1 || msg.rows[0].chunk_len != 0) {
    drop("a message without a tag row from runtime " + std::to_string(msg.header.src_runtime));
    return;
  }
  const RowMeta& head = msg.rows[0];
  if (head.slot < kBegin || head.slot > kCombine || !msg.data.defined() || msg.data.dim() != 2 ||
      msg.data.size(0) != n) {
    drop("a malformed barrier message from runtime " + std::to_string(msg.header.src_runtime));
    return;
  }
  ExchangeTag tag{static_cast<int64_t>(head.request_id), head.layer.block, head.slot, head.layer.index};
  Parcel p{head.position, head.chunk_start, head.weight,
           std::vector<RowMeta>(msg.rows.begin() + 1, msg.rows.end()), msg.data.narrow(0, 1, n - 1)};
  file(tag, head.attn_rank, std::move(p));
}

void BarrierExchange::file(const ExchangeTag& tag, int src, Parcel&& parcel) {
  auto& got = pending_[tag];
  if (got.count(src)) {
    drop("a duplicate " + tag.str() + " from runtime " + std::to_string(src));
    return;
  }
  got.emplace(src, std::move(parcel));
}

std::map<int, Parcel> BarrierExchange::gather(const ExchangeTag& tag, const std::vector<int>& sources) {
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
  std::vector<Message> inbound;
  while (true) {
    std::vector<int> missing;
    auto it = pending_.find(tag);
    for (int s : sources)
      if (it == pending_.end() || !it->second.count(s)) missing.push_back(s);
    if (missing.empty()) {
      std::map<int, Parcel> out;
      if (it != pending_.end()) {
        out = std::move(it->second);
        pending_.erase(it);
      }
      slowest_step_s_ = 0.0f;
      for (const auto& [src, p] : out) slowest_step_s_ = std::max(slowest_step_s_, p.step_s);
      return out;
    }
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) {
      std::ostringstream os;
      os << "runtime " << rank_ << ": no message " << tag.str() << " from peer(s) [";
      for (size_t i = 0; i < missing.size(); ++i) os << (i ? ", " : "") << missing[i];
      os << "] within " << timeout_s_ << " s; a peer died or stopped";
      throw PeerSilent(os.str());
    }
    inbound.clear();
    comm_->recv(&inbound, std::chrono::duration_cast<std::chrono::microseconds>(
                              std::min<Clock::duration>(left, kRecvSlice)));
    for (auto& m : inbound) receive(std::move(m));
  }
}

std::pair<int64_t, bool> BarrierExchange::begin(int64_t iteration, const std::vector<int>& peers,
                                                int64_t rows, bool stopping, float step_s) {
  const ExchangeTag tag{iteration, 0, kBegin, 0};
  for (int peer : peers) signal(peer, tag, rows, stopping ? 1 : 0, step_s);
  int64_t total = 0;
  bool anyone_stopping = false;
  for (const auto& [src, p] : gather(tag, peers)) {
    total += p.info;
    anyone_stopping = anyone_stopping || p.flags != 0;
  }
  return {total, anyone_stopping};
}

std::shared_ptr<DispatchPlan> BarrierExchange::dispatch(const ExchangeTag& tag, const at::Tensor& moe_input,
                                                        const at::Tensor& topk_ids,
                                                        const at::Tensor& topk_weights,
                                                        const at::Tensor& request_ids,
                                                        const at::Tensor& positions, float step_s) {
  AMOE_CHECK_ARG(moe_input.dim() == 2 && topk_ids.dim() == 2 && topk_ids.size(0) == moe_input.size(0),
                 "dispatch needs moe_input [N, H] and topk_ids [N, K]");
  auto plan = std::make_shared<DispatchPlan>();
  plan->tag = ExchangeTag{tag.iteration, tag.block, kDispatch, tag.micro};
  const int64_t n = plan->n = topk_ids.size(0), k = plan->k = topk_ids.size(1);
  plan->hidden = moe_input.size(1);
  plan->dtype = moe_input.scalar_type();
  plan->devices = expert_devices_;
  auto ids = flat(topk_ids, at::kLong, n * k, "topk_ids");
  auto weights = flat(topk_weights, at::kFloat, n * k, "topk_weights");
  auto rq = flat(request_ids, at::kLong, n, "request_ids");
  auto pos = flat(positions, at::kLong, n, "positions");
  const int64_t* e = ids.data_ptr<int64_t>();
  std::vector<int64_t> where(n * k), offsets(num_dest_ + 1);
  for (int64_t i = 0; i < n * k; ++i) {
    AMOE_CHECK_ARG(e[i] >= 0 && e[i] < static_cast<int64_t>(expert_device_.size()),
                   "expert id " << e[i] << " outside [0, " << expert_device_.size() << ")");
    where[i] = expert_device_[e[i]];
  }
  plan->order.resize(n * k);
  group_rows(where.data(), n * k, num_dest_, plan->order.data(), offsets.data());
  // Only expert devices receive copies, so their groups are contiguous in ascending rank.
  plan->start.push_back(0);
  for (int d : plan->devices) plan->start.push_back(offsets[d + 1]);

  const auto x = moe_input.contiguous();
  const float* w = weights.data_ptr<float>();
  const int64_t *r = rq.data_ptr<int64_t>(), *p = pos.data_ptr<int64_t>();
  std::vector<int64_t> source_rows;
  for (size_t i = 0; i < plan->devices.size(); ++i) {
    const int64_t lo = plan->start[i], m = plan->start[i + 1] - lo;
    std::vector<RowMeta> rows(m);
    source_rows.resize(m);
    for (int64_t j = 0; j < m; ++j) {
      const int64_t copy = plan->order[lo + j], row = copy / k;
      const int32_t expert = static_cast<int32_t>(e[copy]);
      source_rows[j] = row;
      rows[j] = RowMeta{static_cast<uint64_t>(r[row]),
                        LayerId{kExpert, tag.block, expert},
                        static_cast<int32_t>(p[row]),
                        /*chunk_start=*/0,
                        /*chunk_len=*/1,
                        static_cast<int32_t>(copy % k + 1),
                        expert,
                        w[copy],
                        /*attn_rank=*/0};
    }
    auto body = frame(m, plan->hidden, x.options());
    if (m > 0) {
      auto out = body.narrow(0, 1, m);
      at::index_select_out(out, x, 0, index_tensor(source_rows.data(), m));
    }
    send(plan->devices[i], plan->tag, std::move(rows), std::move(body), 0, 0, step_s);
  }
  return plan;
}

std::optional<at::Tensor> BarrierExchange::combine(const DispatchPlan& plan) {
  const ExchangeTag tag{plan.tag.iteration, plan.tag.block, kCombine, plan.tag.micro};
  auto parcels = gather(tag, plan.devices);
  auto out = at::empty({plan.n * plan.k, plan.hidden}, at::TensorOptions().dtype(plan.dtype));
  bool failed = false;
  for (size_t i = 0; i < plan.devices.size(); ++i) {
    const Parcel& p = parcels.at(plan.devices[i]);
    const int64_t lo = plan.start[i], m = plan.start[i + 1] - lo;
    failed = failed || (p.flags & kExpertsFailed);
    if (failed) break;
    if (p.data.size(0) != m || (m > 0 && p.data.size(1) != plan.hidden)) {
      drop("runtime " + std::to_string(plan.devices[i]) + " returned " + std::to_string(p.data.size(0)) +
           " rows for " + std::to_string(m) + " sent " + tag.str());
      failed = true;
      break;
    }
    if (m > 0) out.index_copy_(0, index_tensor(plan.order.data() + lo, m), p.data.to(plan.dtype));
  }
  if (failed) return std::nullopt;
  return out.view({plan.n, plan.k, plan.hidden});
}

std::shared_ptr<ExpertWork> BarrierExchange::collect(const ExchangeTag& tag,
                                                     const std::vector<int>& sources) {
  auto work = std::make_shared<ExpertWork>();
  work->tag = ExchangeTag{tag.iteration, tag.block, kDispatch, tag.micro};
  auto parcels = gather(work->tag, sources);
  if (parcels.empty()) {  // nobody sends to this device
    work->x = at::zeros({0, 0});
    return work;
  }
  std::vector<at::Tensor> datas;
  std::vector<const RowMeta*> meta;
  for (auto& [src, p] : parcels) {
    work->sources.push_back(src);
    work->sizes.push_back(p.data.size(0));
    datas.push_back(p.data);
    for (const RowMeta& row : p.rows) meta.push_back(&row);
  }
  work->hidden = datas.front().size(1);
  for (const auto& d : datas) {
    if (d.size(1) != work->hidden || d.scalar_type() != datas.front().scalar_type()) {
      work->error = "sources sent rows of different widths or dtypes " + work->tag.str();
      work->x = at::zeros({0, work->hidden});
      return work;
    }
  }
  work->x = datas.size() == 1 ? datas.front() : at::cat(datas);
  const int64_t total = work->x.size(0), num_experts = static_cast<int64_t>(expert_device_.size());
  std::vector<int64_t> experts(total), perm(total), offsets(num_experts + 1);
  for (int64_t j = 0; j < total; ++j) {
    const int64_t e = meta[j]->expert_id;
    if (e < 0 || e >= num_experts || expert_device_[e] != rank_) {
      work->error = "a row for expert " + std::to_string(e) + ", which runtime " + std::to_string(rank_) +
                    " does not host " + work->tag.str();
      return work;
    }
    experts[j] = e;
  }
  group_rows(experts.data(), total, num_experts, perm.data(), offsets.data());
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t lo = offsets[e], m = offsets[e + 1] - lo;
    if (m == 0) continue;
    ExpertGroup g;
    g.expert = e;
    g.rows = index_tensor(perm.data() + lo, m);
    g.x = m == total ? work->x : work->x.index_select(0, g.rows);  // EP's usual case: one expert, no gather
    g.request_ids = at::empty({m}, at::kLong);
    g.positions = at::empty({m}, at::kLong);
    g.weights = at::empty({m}, at::kFloat);
    auto* rq = g.request_ids.data_ptr<int64_t>();
    auto* ps = g.positions.data_ptr<int64_t>();
    auto* wt = g.weights.data_ptr<float>();
    for (int64_t j = 0; j < m; ++j) {
      const RowMeta& row = *meta[perm[lo + j]];
      rq[j] = static_cast<int64_t>(row.request_id);
      ps[j] = row.position;
      wt[j] = row.weight;
    }
    work->groups.push_back(std::move(g));
  }
  return work;
}

void BarrierExchange::reply(const ExpertWork& work, const std::vector<at::Tensor>& outputs, bool failed,
                            float step_s) {
  const int64_t num_sources = static_cast<int64_t>(work.sources.size());
  const int64_t total = work.x.defined() ? work.x.size(0) : 0;
  failed = failed || !work.error.empty() || outputs.size() != work.groups.size();
  for (size_t g = 0; !failed && g < outputs.size(); ++g) {
    const auto& o = outputs[g];
    failed =
        !o.defined() || o.dim() != 2 || o.size(0) != work.groups[g].rows.size(0) || o.size(1) != work.hidden;
  }
  at::Tensor body;
  if (failed) {
    int64_t rows = num_sources;
    for (int64_t s : work.sizes) rows += s;
    body = at::zeros({rows, work.hidden});
  } else {
    // One buffer holds every source's body back to back: a row lands one row (its source's tag row) after the
    // rows of the sources before it, so each output is written once, into the message it leaves in.
    body = at::empty({total + num_sources, work.hidden}, work.x.options());
    std::vector<int64_t> shift(total);
    for (int64_t s = 0, row = 0; s < num_sources; ++s)
      for (int64_t j = 0; j < work.sizes[s]; ++j) shift[row++] = s + 1;
    for (size_t g = 0; g < outputs.size(); ++g) {
      const auto& rows = work.groups[g].rows;
      auto target = rows.clone();
      auto* t = target.data_ptr<int64_t>();
      for (int64_t j = 0; j < target.size(0); ++j) t[j] += shift[t[j]];
      body.index_copy_(0, target, outputs[g].to(body.device(), body.scalar_type()));
    }
  }
  const ExchangeTag back{work.tag.iteration, work.tag.block, kCombine, work.tag.micro};
  int64_t start = 0;
  for (int64_t s = 0; s < num_sources; ++s) {
    const int64_t n = work.sizes[s];
    auto piece = body.narrow(0, start, 1 + n);
    piece[0].zero_();
    RowMeta blank{};
    blank.chunk_len = 1;  // payload rows never look like a tag row
    blank.expert_id = -1;
    send(work.sources[s], back, std::vector<RowMeta>(n, blank), piece, 0, failed ? kExpertsFailed : 0,
         step_s);
    start += 1 + n;
  }
}

}  // namespace amoe
