// train::cuda::DataParallel (data_parallel.hpp): the bucket plan, the sends during the backward, the ZeRO-1 norm,
// step and moments, and Quantile Balancing over the replicas.
//
// Legend: as data_parallel.hpp; S = Σ_j c_j, the moments held here (zero1), mo_j the offset of bucket j's block in
//         them.
#include "train/cuda/data_parallel.hpp"

#include <algorithm>
#include <climits>
#include <cmath>
#include <tuple>

#include "core/error.hpp"
#include "model/cuda/gpu_model.hpp"

#ifdef LONGMOE_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda/check.hpp"
#include "model/cuda/glue_cuda.hpp"
#endif

namespace lm::train::cuda {

std::vector<GradRange> plan_buckets(std::vector<GradRange> params, size_t train_end, size_t target) {
  constexpr size_t Q = kBucketQuantum;
  LM_CHECK(train_end % Q == 0, "plan_buckets: the trainable range ({} elements) is not a multiple of {}", train_end,
           Q);
  target = std::max(Q, target / Q * Q);
  std::erase_if(params, [&](const GradRange& p) { return p.begin >= train_end || p.end <= p.begin; });
  std::sort(params.begin(), params.end(), [](const GradRange& a, const GradRange& b) { return a.begin < b.begin; });
  // Runs of one stage in flat order; each starts where its first parameter does (rounded down), the first at 0.
  std::vector<GradRange> runs;
  for (const GradRange& p : params) {
    if (!runs.empty() && runs.back().stage == p.stage) continue;
    const size_t start = runs.empty() ? 0 : p.begin / Q * Q;
    if (!runs.empty() && start <= runs.back().begin) continue;  // (inside the last run's first quantum)
    if (!runs.empty()) runs.back().end = start;
    runs.push_back({start, train_end, p.stage});
  }
  if (runs.empty() && train_end > 0) runs.push_back({0, train_end, -1});
  // Pieces of at most `target` (equal multiples of Q), then consecutive pieces merged up to `target`.
  std::vector<GradRange> out;
  for (const GradRange& r : runs) {
    const size_t n = r.end - r.begin, k = (n + target - 1) / target;
    if (n == 0) continue;
    const size_t piece = (n / k + Q - 1) / Q * Q;
    for (size_t b = r.begin; b < r.end; b += piece) {
      const size_t e = std::min(r.end, b + piece);
      if (!out.empty() && out.back().end == b && out.back().end - out.back().begin + (e - b) <= target)
        out.back().end = e;
      else
        out.push_back({b, e, 0});
    }
  }
  // Each bucket's stage: the least of the parameters it holds (every one is final once that stage is passed).
  size_t i = 0;
  for (GradRange& b : out) {
    while (i < params.size() && params[i].end <= b.begin) ++i;
    int64_t s = INT64_MAX;
    for (size_t j = i; j < params.size() && params[j].begin < b.end; ++j) s = std::min(s, params[j].stage);
    b.stage = s == INT64_MAX ? -1 : s;  // (a bucket of padding alone: sent at the end)
  }
  return out;
}

#ifndef LONGMOE_HAVE_CUDA

struct DataParallel::Impl {};
[[noreturn]] static void no_cuda() { throw Error("longmoe was built without CUDA (nvcc was not found at build time)"); }
DataParallel::DataParallel(model::cuda::GpuModel&, const std::vector<model::ParamSpec>&, dist::DeviceComm&,
                           dist::Comm&, bool zero1, size_t)
    : zero1_(zero1) {
  no_cuda();
}
DataParallel::~DataParallel() = default;
void DataParallel::arm() { no_cuda(); }
void DataParallel::disarm() { no_cuda(); }
void DataParallel::finish() { no_cuda(); }
double DataParallel::grad_norm() { no_cuda(); }
void DataParallel::step(const AdamWStep&) { no_cuda(); }
void DataParallel::balance() { no_cuda(); }
void DataParallel::load_moments(const std::map<std::string, std::pair<const float*, const float*>>&) { no_cuda(); }
void DataParallel::save_moments(const std::map<std::string, std::pair<float*, float*>>&) { no_cuda(); }
size_t DataParallel::state_bytes() const { no_cuda(); }

#else

namespace {

constexpr cu::Checker ck{"data parallel"};

// A device buffer that only grows (fp32 elements).
struct Buf {
  void* p = nullptr;
  size_t bytes = 0;
  Buf() = default;
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() {
    if (p) cudaFree(p);
  }
  float* f() const { return static_cast<float*>(p); }
  float* ensure(size_t n) {
    if (n * 4 > bytes) {
      if (p) ck(cudaFree(p), "cudaFree");
      p = nullptr;
      ck(cudaMalloc(&p, n * 4), fmt::format("cudaMalloc of {:.1f} MiB", n * 4 / 1048576.0).c_str());
      bytes = n * 4;
    }
    return f();
  }
};

}  // namespace

struct DataParallel::Impl {
  model::cuda::GpuModel& model;
  dist::DeviceComm& dc;
  dist::Comm& host;
  bool zero1;
  int R = 1, r = 0;
  std::vector<GradRange> buckets;
  std::vector<size_t> order;  // bucket indices by stage, the latest written first: the send order
  size_t next = 0;            // order[next] is the next bucket to send this step
  struct Param {              // a parameter's range of the flat arrays
    std::string name;
    size_t begin, end;
  };
  std::vector<Param> params;  // by begin
  std::vector<size_t> mo;     // zero1: per bucket, its block's offset in m, v
  Buf m, v;                   // zero1: AdamW moments [S]
  Buf moved;                  // load/save_moments: one bucket
  Buf scores, alpha;          // balance: every replica's router statistics
  Impl(model::cuda::GpuModel& mdl, dist::DeviceComm& d, dist::Comm& h, bool z) : model(mdl), dc(d), host(h), zero1(z) {}

  size_t block(size_t j) const { return (buckets[j].end - buckets[j].begin) / size_t(R); }
  // Sends, in order, the buckets whose gradients are final once `stage` is passed; returns how many.
  int64_t send(int64_t stage) {
    int64_t sent = 0;
    while (next < order.size() && buckets[order[next]].stage >= stage) {
      if (sent++ == 0) dc.wait_for(nullptr);  // (the gradients were queued on the null stream)
      const size_t j = order[next++], c = block(j);
      float* g = model.flat().grad + buckets[j].begin;
      if (zero1)
        dc.reduce_scatter_sum(g, g + size_t(r) * c, c, DType::F32);  // (in place: this rank's block)
      else
        dc.all_reduce_sum(g, buckets[j].end - buckets[j].begin, DType::F32);
    }
    return sent;
  }
  // The parameters' pieces inside bucket j: f(name, piece begin, piece end, parameter begin).
  template <class F>
  void pieces(size_t j, F&& f) const {
    const GradRange& b = buckets[j];
    auto it = std::lower_bound(params.begin(), params.end(), b.begin,
                               [](const Param& q, size_t x) { return q.end <= x; });
    for (; it != params.end() && it->begin < b.end; ++it) {
      const size_t s = std::max(it->begin, b.begin), e = std::min(it->end, b.end);
      if (s < e) f(it->name, s, e, it->begin);
    }
  }
};

DataParallel::DataParallel(model::cuda::GpuModel& model, const std::vector<model::ParamSpec>& specs,
                           dist::DeviceComm& dc, dist::Comm& host, bool zero1, size_t bucket_bytes)
    : zero1_(zero1), p_(std::make_unique<Impl>(model, dc, host, zero1)) {
  Impl& p = *p_;
  p.R = dc.size(), p.r = dc.rank();
  LM_CHECK(host.size() == p.R && host.rank() == p.r, "data parallel: the host communicator ({}) is not the device "
           "one ({})", host.name(), dc.name());
  const model::cuda::GpuModel::Flat f = model.flat();
  const int64_t L = model.config().num_hidden_layers;
  std::vector<GradRange> ranges;
  for (const model::ParamSpec& s : specs) {
    const model::cuda::ParamSlot sl = model.slot(s.name);
    p.params.push_back({s.name, sl.off, sl.off + size_t(sl.numel)});
    if (s.trainable) ranges.push_back({sl.off, sl.off + size_t(sl.numel), model::cuda::GpuModel::grad_stage(s, L)});
  }
  std::sort(p.params.begin(), p.params.end(), [](const Impl::Param& a, const Impl::Param& b) {
    return a.begin < b.begin;
  });
  p.buckets = buckets_ = plan_buckets(std::move(ranges), f.train_end, bucket_bytes / 4);
  for (size_t j = 0; j < buckets_.size(); ++j) p.order.push_back(j);
  std::stable_sort(p.order.begin(), p.order.end(),
                   [&](size_t a, size_t b) { return buckets_[a].stage > buckets_[b].stage; });
  if (zero1_) {
    size_t S = 0;
    for (const GradRange& b : buckets_) {
      LM_CHECK((b.end - b.begin) % size_t(p.R) == 0, "parallel.zero 1 on the GPU splits every gradient bucket into "
               "equal blocks, one per replica, which needs a number of replicas dividing {} (got {}); use "
               "parallel.zero 0", kBucketQuantum, p.R);
      p.mo.push_back(S);
      S += (b.end - b.begin) / size_t(p.R);
    }
    S = std::max<size_t>(S, 1);
    ck(cudaMemset(p.m.ensure(S), 0, S * 4), "memset");
    ck(cudaMemset(p.v.ensure(S), 0, S * 4), "memset");
  }
}

DataParallel::~DataParallel() {
  if (p_) p_->model.set_grad_ready(nullptr);
}

void DataParallel::arm() {
  LM_CHECK(p_->next == 0, "data parallel: a backward armed after buckets were sent (finish() the step first)");
  sent_in_backward_ = 0;
  p_->model.set_grad_ready([this](int64_t stage) { sent_in_backward_ += p_->send(stage); });
}

void DataParallel::disarm() { p_->model.set_grad_ready(nullptr); }

void DataParallel::finish() {
  Impl& p = *p_;
  p.model.set_grad_ready(nullptr);
  p.send(INT64_MIN);
  p.next = 0;
  p.dc.join(nullptr);
}

double DataParallel::grad_norm() {
  Impl& p = *p_;
  if (!zero1_) return p.model.grad_norm();
  const float* g = p.model.flat().grad;
  double s = 0;  // this replica's blocks in bucket order, then the replicas' sums in rank order: deterministic
  for (size_t j = 0; j < buckets_.size(); ++j)
    s += model::cuda::sum_squares(g + buckets_[j].begin + size_t(p.r) * p.block(j), int64_t(p.block(j)));
  std::vector<double> all(size_t(p.R));
  p.host.all_gather(&s, sizeof s, all.data());
  double t = 0;
  for (double x : all) t += x;
  return std::sqrt(t);
}

void DataParallel::step(const AdamWStep& a) {
  Impl& p = *p_;
  LM_CHECK(zero1_, "data parallel: step() is ZeRO-1's (with zero 0 every replica's AdamW steps)");
  const model::cuda::GpuModel::Flat f = p.model.flat();
  AdamWArgs k = adamw_args(a);
  for (size_t j = 0; j < buckets_.size(); ++j) {
    const size_t c = p.block(j), lo = buckets_[j].begin + size_t(p.r) * c, hi = lo + c;
    // This replica's block, split where the decaying tensors end.
    const size_t mid = std::clamp(f.decay_end, lo, hi);
    for (auto [s, e, wd] : {std::tuple{lo, mid, float(a.weight_decay)}, std::tuple{mid, hi, 0.f}}) {
      if (s >= e) continue;
      k.wd = wd;
      const size_t o = p.mo[j] + (s - lo);
      adamw_update(f.master + s, f.grad + s, p.m.f() + o, p.v.f() + o, static_cast<uint16_t*>(f.bf16) + s,
                   int64_t(e - s), k);
    }
    // Every replica's new block of this bucket (in place), beside the next bucket's update.
    p.dc.wait_for(nullptr);
    p.dc.all_gather(f.master + lo, f.master + buckets_[j].begin, c * 4);
  }
  p.dc.join(nullptr);
  model::cuda::cast_f32_bf16(f.master, f.bf16, int64_t(f.train_end));
  p.model.weights_updated();
}

void DataParallel::balance() {
  Impl& p = *p_;
  const int64_t E = p.model.config().num_experts;
  p.model.balance([&](const model::cuda::GpuModel::RouterRows& mine) {
    std::vector<int64_t> rows(size_t(p.R));
    p.host.all_gather(&mine.rows, sizeof mine.rows, rows.data());
    std::vector<size_t> sb, ab;
    int64_t total = 0;
    for (int64_t n : rows) sb.push_back(size_t(n * E) * 4), ab.push_back(size_t(n) * 4), total += n;
    float* s = p.scores.ensure(size_t(std::max<int64_t>(total * E, 1)));
    float* al = p.alpha.ensure(size_t(std::max<int64_t>(total, 1)));
    p.dc.wait_for(nullptr);  // (the forward wrote them on the null stream)
    p.dc.all_gather_v(mine.scores, s, sb);
    p.dc.all_gather_v(mine.alpha, al, ab);
    p.dc.join(nullptr);
    return model::cuda::GpuModel::RouterRows{s, al, total};
  });
}

void DataParallel::load_moments(const std::map<std::string, std::pair<const float*, const float*>>& mine) {
  Impl& p = *p_;
  LM_CHECK(zero1_, "data parallel: load_moments is ZeRO-1's");
  size_t most = 1;
  for (const GradRange& b : buckets_) most = std::max(most, b.end - b.begin);
  float* t = p.moved.ensure(most);
  for (Buf* dst : {&p.m, &p.v}) {
    for (size_t j = 0; j < buckets_.size(); ++j) {
      // This rank's parameters in the bucket, zeros elsewhere: the sum over the ranks is every parameter's own.
      ck(cudaMemset(t, 0, (buckets_[j].end - buckets_[j].begin) * 4), "memset");
      p.pieces(j, [&](const std::string& name, size_t s, size_t e, size_t q0) {
        auto it = mine.find(name);
        if (it == mine.end()) return;
        const float* src = dst == &p.m ? it->second.first : it->second.second;
        ck(cudaMemcpy(t + (s - buckets_[j].begin), src + (s - q0), (e - s) * 4, cudaMemcpyHostToDevice),
           "moments to the device");
      });
      p.dc.wait_for(nullptr);  // (the memset and copies are the null stream's)
      p.dc.reduce_scatter_sum(t, dst->f() + p.mo[j], p.block(j), DType::F32);
      p.dc.synchronize();  // (t is the next bucket's)
    }
  }
}

void DataParallel::save_moments(const std::map<std::string, std::pair<float*, float*>>& mine) {
  Impl& p = *p_;
  LM_CHECK(zero1_, "data parallel: save_moments is ZeRO-1's");
  size_t most = 1;
  for (const GradRange& b : buckets_) most = std::max(most, b.end - b.begin);
  float* t = p.moved.ensure(most);
  p.dc.wait_for(nullptr);  // (the last step's update)
  for (const Buf* src : {&p.m, &p.v}) {
    for (size_t j = 0; j < buckets_.size(); ++j) {
      p.dc.all_gather(src->f() + p.mo[j], t, p.block(j) * 4);
      p.dc.synchronize();
      p.pieces(j, [&](const std::string& name, size_t s, size_t e, size_t q0) {
        auto it = mine.find(name);
        if (it == mine.end()) return;
        float* out = src == &p.m ? it->second.first : it->second.second;
        ck(cudaMemcpy(out + (s - q0), t + (s - buckets_[j].begin), (e - s) * 4, cudaMemcpyDeviceToHost),
           "moments to the host");
      });
    }
  }
}

size_t DataParallel::state_bytes() const { return zero1_ ? p_->m.bytes + p_->v.bytes : 0; }

#endif

}  // namespace lm::train::cuda
