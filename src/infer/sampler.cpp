// Sampling (see sampler.hpp): penalty -> temperature -> top-k -> top-p -> one counter-based uniform draw.
#include "infer/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <unordered_set>

#include "core/error.hpp"

namespace lm::infer {

void SamplingParams::validate() const {
  LM_CHECK(std::isfinite(temperature) && temperature >= 0.0f && temperature <= 100.0f,
           "temperature {} must be in [0, 100]", temperature);
  LM_CHECK(top_k >= 0, "top_k {} must be >= 0", top_k);
  LM_CHECK(std::isfinite(top_p) && top_p > 0.0f && top_p <= 1.0f, "top_p {} must be in (0, 1]", top_p);
  // Below 0.01 a penalised logit (logit / r) overflows to infinity and the softmax turns into NaN.
  LM_CHECK(std::isfinite(repetition_penalty) && repetition_penalty >= 0.01f && repetition_penalty <= 100.0f,
           "repetition_penalty {} must be in [0.01, 100]", repetition_penalty);
  LM_CHECK(top_logprobs >= -1 && top_logprobs <= 20, "top_logprobs {} must be in [-1, 20]", top_logprobs);
  LM_CHECK(max_tokens >= 1, "max_tokens {} must be >= 1", max_tokens);
  for (const auto& s : stop) LM_CHECK(!s.empty(), "stop strings must not be empty");
}

Sampler::Sampler(SamplingParams p, uint64_t stream) : p_(std::move(p)), rng_{p_.seed, stream} { p_.validate(); }

bool Sampler::is_stop_token(int32_t t) const {
  return std::find(p_.stop_tokens.begin(), p_.stop_tokens.end(), t) != p_.stop_tokens.end();
}

namespace {

std::vector<float> penalised(const float* logits, int64_t V, const std::vector<int32_t>& history, float r) {
  std::vector<float> x(logits, logits + V);
  if (r == 1.0f) return x;
  std::vector<char> seen(static_cast<size_t>(V), 0);
  for (int32_t t : history)
    if (t >= 0 && t < V && !seen[static_cast<size_t>(t)]) {
      seen[static_cast<size_t>(t)] = 1;
      float& v = x[static_cast<size_t>(t)];
      v = v > 0 ? v / r : v * r;
    }
  return x;
}

int32_t argmax(const std::vector<float>& x) {
  return static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());  // first max: lowest id
}

// Token ids in descending probability order (ties: lower id first), truncated by top-k and top-p, with
// their renormalised probabilities.
void filtered(const std::vector<float>& x, const SamplingParams& p, std::vector<int32_t>& ids, std::vector<double>& pr) {
  const int64_t V = static_cast<int64_t>(x.size());
  ids.resize(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) {
    const float xa = x[static_cast<size_t>(a)], xb = x[static_cast<size_t>(b)];
    return xa != xb ? xa > xb : a < b;
  };
  const int64_t k = p.top_k > 0 ? std::min(p.top_k, V) : V;
  if (k < V) {
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), by_logit);
    ids.resize(static_cast<size_t>(k));
  } else {
    std::sort(ids.begin(), ids.end(), by_logit);
  }
  const double inv_t = 1.0 / static_cast<double>(p.temperature);
  const double mx = static_cast<double>(x[static_cast<size_t>(ids[0])]);
  pr.resize(ids.size());
  double sum = 0;
  for (size_t i = 0; i < ids.size(); ++i) sum += (pr[i] = std::exp((x[static_cast<size_t>(ids[i])] - mx) * inv_t));
  for (auto& v : pr) v /= sum;
  if (p.top_p < 1.0f) {
    double cum = 0;
    size_t keep = 0;
    while (keep < pr.size()) {
      cum += pr[keep++];
      if (cum >= static_cast<double>(p.top_p)) break;
    }
    ids.resize(keep);
    pr.resize(keep);
    const double s = std::accumulate(pr.begin(), pr.end(), 0.0);
    for (auto& v : pr) v /= s;
  }
}

}  // namespace

std::vector<float> Sampler::distribution(const float* logits, int64_t V, const std::vector<int32_t>& history) const {
  const std::vector<float> x = penalised(logits, V, history, p_.repetition_penalty);
  std::vector<float> out(static_cast<size_t>(V), 0.0f);
  if (p_.temperature == 0.0f) {
    out[static_cast<size_t>(argmax(x))] = 1.0f;
    return out;
  }
  std::vector<int32_t> ids;
  std::vector<double> pr;
  filtered(x, p_, ids, pr);
  for (size_t i = 0; i < ids.size(); ++i) out[static_cast<size_t>(ids[i])] = static_cast<float>(pr[i]);
  return out;
}

int32_t Sampler::sample(const float* logits, int64_t V, const std::vector<int32_t>& history, TokenLogprobs* lp) {
  LM_CHECK(V >= 1, "sample: empty logits");
  if (p_.temperature == 0.0f && !lp && p_.repetition_penalty == 1.0f) {  // greedy: no copy of the row
    ++i_;
    return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);  // first max: lowest id
  }
  const std::vector<float> x = penalised(logits, V, history, p_.repetition_penalty);
  const uint64_t i = static_cast<uint64_t>(i_++);
  const int64_t top_n = std::max<int64_t>(0, p_.top_logprobs);
  if (p_.temperature == 0.0f) {
    const int32_t t = argmax(x);
    if (lp) {
      // log-softmax at temperature 1 over the penalised logits.
      const double mx = static_cast<double>(x[static_cast<size_t>(t)]);
      double sum = 0;
      for (const float v : x) sum += std::exp(static_cast<double>(v) - mx);
      const double lse = mx + std::log(sum);
      lp->token = t;
      lp->logprob = static_cast<double>(x[static_cast<size_t>(t)]) - lse;
      std::vector<int32_t> ids(static_cast<size_t>(V));
      std::iota(ids.begin(), ids.end(), 0);
      const int64_t k = std::min(top_n, V);
      std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
        const float xa = x[static_cast<size_t>(a)], xb = x[static_cast<size_t>(b)];
        return xa != xb ? xa > xb : a < b;
      });
      lp->top.clear();
      for (int64_t j = 0; j < k; ++j)
        lp->top.emplace_back(ids[static_cast<size_t>(j)], static_cast<double>(x[static_cast<size_t>(ids[static_cast<size_t>(j)])]) - lse);
    }
    return t;
  }
  std::vector<int32_t> ids;
  std::vector<double> pr;
  filtered(x, p_, ids, pr);
  const double u = rng_.uniform_f64(i);
  double cum = 0;
  size_t pick = ids.size() - 1;  // rounding: u above the last cumulative sum
  for (size_t j = 0; j < ids.size(); ++j) {
    cum += pr[j];
    if (u < cum) {
      pick = j;
      break;
    }
  }
  if (lp) {
    lp->token = ids[pick];
    lp->logprob = std::log(pr[pick]);
    lp->top.clear();
    for (size_t j = 0; j < std::min<size_t>(static_cast<size_t>(top_n), ids.size()); ++j)
      lp->top.emplace_back(ids[j], std::log(pr[j]));
  }
  return ids[pick];
}

// ---- streaming text ------------------------------------------------------------------------------------

size_t utf8_complete_prefix(std::string_view s) {
  // Walk back over at most 3 continuation bytes to the last lead byte; keep it only if complete.
  const size_t n = s.size();
  size_t i = n;
  int cont = 0;
  while (i > 0 && cont < 4) {
    const auto c = static_cast<unsigned char>(s[i - 1]);
    if ((c & 0xC0) != 0x80) {
      const int need = c >= 0xF0 && c < 0xF8 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
      return cont + 1 >= need ? n : i - 1;
    }
    ++cont;
    --i;
  }
  return n;  // only continuation bytes (invalid): do not stall
}

std::string TextStream::update(std::string_view full) {
  if (stopped_) return {};
  // The emitted text is always a prefix of `full` (detokenising more tokens only appends), except when a
  // tokenizer rewrites the tail; then emit nothing new until it settles.
  if (full.substr(0, emitted_.size()) != emitted_) return {};
  size_t safe = utf8_complete_prefix(full);
  for (const auto& s : stop_) {
    const size_t at = full.find(s);
    if (at != std::string_view::npos) {
      stopped_ = true;
      safe = std::min(safe, at);
    }
  }
  if (!stopped_) {
    // Hold back a tail that could still grow into a stop string.
    for (const auto& s : stop_)
      for (size_t k = std::min(s.size() - 1, full.size()); k > 0; --k)
        if (full.substr(full.size() - k) == std::string_view(s).substr(0, k)) {
          safe = std::min(safe, full.size() - k);
          break;
        }
  }
  if (safe <= emitted_.size()) return {};
  std::string out(full.substr(emitted_.size(), safe - emitted_.size()));
  emitted_ += out;
  return out;
}

std::string TextStream::finish(std::string_view full) {
  std::string out = update(full);
  if (stopped_ || full.substr(0, emitted_.size()) != emitted_) return out;
  const size_t safe = utf8_complete_prefix(full);
  if (safe > emitted_.size()) {
    std::string tail(full.substr(emitted_.size(), safe - emitted_.size()));
    emitted_ += tail;
    out += tail;
  }
  return out;
}

}  // namespace lm::infer
