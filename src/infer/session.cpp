// Decoding engine (see session.hpp): the walk of the stack plan over the new tokens only; each layer's
// mixer reads and extends its own cache (KdaMixer / GatedMla prefill and decode).
//
// Legend: rows new tokens in this walk (n of one sequence in prefill, S sequences in decode), d hidden,
//         Q reads per AttnRes block group.
#include "infer/session.hpp"

#include <algorithm>
#include <exception>
#include <utility>

#include "core/error.hpp"
#include "core/parallel.hpp"
#include "ops/attnres/attnres.hpp"
#include "ops/cross_entropy/cross_entropy.hpp"
#include "ops/embedding/embedding.hpp"
#include "ops/rmsnorm/rmsnorm.hpp"

namespace lm::infer {

namespace {

using Buf = std::vector<float>;

struct Timer {
  double& acc;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  explicit Timer(double& a) : acc(a) {}
  ~Timer() { acc += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); }
};

void add_into(float* y, const float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// Decode steps of a few rows are too small to pay for waking a thread team at every GEMM and expert loop:
// below kSerialRows rows the FFN / MoE and KDA work runs inside a one-thread region (where parallel_for and
// OpenBLAS stay on the calling thread). MLA over a long cache keeps all threads.
constexpr int64_t kSerialRows = 16;
template <class Fn>
void serial_if(bool serial, Fn&& f) {
  if (!serial || omp_in_parallel()) return f();
  std::exception_ptr err;
#pragma omp parallel num_threads(1)
  {
    try {
      f();
    } catch (...) {
      err = std::current_exception();
    }
  }
  if (err) std::rethrow_exception(err);
}

}  // namespace

// ---- Sequence -----------------------------------------------------------------------------------------

int64_t Sequence::cache_bytes() const {
  int64_t n = 0;
  for (const auto& l : layers) n += l.size();
  return n * 4;
}

int64_t Sequence::cache_capacity_bytes() const {
  int64_t n = 0;
  for (const auto& l : layers) n += l.capacity();
  return n * 4 + static_cast<int64_t>(tokens.capacity() * sizeof(int32_t));
}

int64_t context_limit(const model::ModelConfig& c, int64_t requested) {
  return requested > 0 ? requested : c.max_position_embeddings.value_or(131072);
}

// ---- Session setup --------------------------------------------------------------------------------------

Session::Session(model::Model<float>& m, SessionOptions o) : m_(m), cfg_(m.config()), plan_(m.plan()), opt_(o) {
  LM_CHECK(opt_.prefill_chunk >= 1, "session: prefill chunk {} must be >= 1", opt_.prefill_chunk);
  LM_CHECK(opt_.prefix_cache_bytes >= 0, "session: prefix cache budget must not be negative");
  max_ctx_ = context_limit(cfg_, opt_.max_context);
  const int64_t L = cfg_.num_hidden_layers;
  auto& ps = m_.params();
  for (int64_t i = 0; i < L; ++i) {
    specs_.push_back(m_.cache_spec(i));
    const std::string P = "model.layers." + std::to_string(i);
    ln1_.push_back(ps.w(P + ".input_layernorm.weight"));
    ln2_.push_back(ps.w(P + ".post_attention_layernorm.weight"));
    if (plan_.attn_res) {
      attn_w_.push_back(ps.w(P + ".self_attention_res_proj.weight"));
      attn_g_.push_back(ps.w(P + ".self_attention_res_norm.weight"));
      mlp_w_.push_back(ps.w(P + ".mlp_res_proj.weight"));
      mlp_g_.push_back(ps.w(P + ".mlp_res_norm.weight"));
    }
  }
  embed_ = ps.w("model.embed_tokens.weight");
  lm_head_ = ps.w("lm_head.weight");
  final_norm_ = ps.w("model.norm.weight");
  if (plan_.attn_res) {
    out_w_ = ps.w("model.output_attn_res_proj.weight");
    out_g_ = ps.w("model.output_attn_res_norm.weight");
    const int64_t d = cfg_.hidden_size;
    for (const auto& group : plan_.block_reads) {
      BlockReads br;
      for (const model::ReadPlan& r : group) {
        const size_t i = static_cast<size_t>(r.layer);
        const auto [w, g] = r.kind == model::ReadPlan::Out    ? std::pair{out_w_, out_g_}
                            : r.kind == model::ReadPlan::Attn ? std::pair{attn_w_[i], attn_g_[i]}
                                                              : std::pair{mlp_w_[i], mlp_g_[i]};
        br.w.insert(br.w.end(), w, w + d);
        br.g.insert(br.g.end(), g, g + d);
        ++br.Q;
      }
      blocks_.push_back(std::move(br));
    }
  }
}

Sequence Session::new_sequence() const {
  Sequence s;
  for (const auto& spec : specs_) s.layers.push_back(model::LayerCache<float>::empty(spec));
  return s;
}

void Session::check_sequence(const Sequence& s, const char* what, int64_t index) const {
  bool ok = s.layers.size() == specs_.size();
  for (size_t i = 0; ok && i < specs_.size(); ++i)
    ok = s.layers[i].states.size() == specs_[i].states.size() && s.layers[i].row_width == specs_[i].row_width;
  LM_CHECK(ok, "{}: sequence {} does not belong to this model", what, index);
}

void Session::check_ids(std::span<const int32_t> ids, int64_t media_rows) const {
  int64_t placeholders = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    LM_CHECK(ids[i] >= 0 && ids[i] < cfg_.vocab_size, "token id {} at position {} is outside the vocabulary [0, {})",
             ids[i], i, cfg_.vocab_size);
    // A placeholder without an attached feature row would embed the placeholder's own row (SPEC §9).
    if (ids[i] == m_.media_placeholder() && ++placeholders > media_rows)
      fail("token id {} at position {} is the media placeholder, but {} image feature row(s) are attached to the "
           "sequence (attach the image first: one placeholder per feature row)",
           ids[i], i, media_rows);
  }
}

void Session::attach_media(Sequence& seq, std::span<const float> features) const {
  const int64_t d = cfg_.hidden_size;
  LM_CHECK(m_.media_placeholder() >= 0, "this model takes no images (no vision tower or placeholder id)");
  LM_CHECK(!features.empty() && std::ssize(features) % d == 0,
           "attach_media: {} values are not whole feature rows of width {}", features.size(), d);
  check_sequence(seq, "attach_media", 0);
  if (seq.media_taken > 0) {  // drop the rows already taken
    seq.media.erase(seq.media.begin(), seq.media.begin() + seq.media_taken * d);
    seq.media_taken = 0;
  }
  seq.media.insert(seq.media.end(), features.begin(), features.end());
}

// ---- the walk over the layers -----------------------------------------------------------------------------

void Session::walk(const std::vector<Sequence*>& seqs, const int32_t* ids, int64_t rows, bool decode, float* hn,
                   const float* features) {
  const int64_t d = cfg_.hidden_size, L = cfg_.num_hidden_layers, V = cfg_.vocab_size, nd = rows * d;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  Buf a(nd), f(nd), xn(nd), x(nd);
  Buf prefix(nd);
  {
    Timer t(profile.other);
    ops::embedding_forward(ids, rows, embed_, V, d, prefix.data());
    // The splice (SPEC §9), as Model::forward does it: each placeholder's row is the next image feature row.
    for (int64_t r = 0; features && r < rows; ++r)
      if (ids[r] == m_.media_placeholder()) std::copy_n(features, d, prefix.data() + r * d), features += d;
  }
  const model::Seqs seqs_rows = model::Seqs::batch(1, rows);
  std::vector<model::LayerCache<float>*> caches(seqs.size());
  auto mixer = [&](int64_t i, const float* in, float* out) {
    for (size_t s = 0; s < seqs.size(); ++s) caches[s] = &seqs[s]->layers[static_cast<size_t>(i)];
    if (auto* k = m_.kda(i)) {
      Timer t(profile.kda);
      if (decode) serial_if(rows <= kSerialRows, [&] { k->decode(caches, in, out); });
      else k->prefill(*caches[0], in, rows, out);
    } else {
      Timer t(profile.mla);
      if (decode) m_.mla(i)->decode(caches, in, out);
      else m_.mla(i)->prefill(*caches[0], in, rows, out);
    }
  };
  auto ffn = [&](int64_t i, const float* in, float* out) {
    Timer t(profile.ffn);
    auto run = [&] {
      if (auto* moe = m_.moe(i)) moe->forward(in, out, seqs_rows);
      else m_.dense(i)->forward(in, out, seqs_rows);
    };
    serial_if(decode && rows <= kSerialRows, run);
  };
  auto yield = [&] {  // (set_prefill_yield)
    if (decode || !yield_ || yielding_) return;
    yielding_ = true;
    struct Reset {
      bool& b;
      ~Reset() { b = false; }
    } reset{yielding_};
    yield_();
  };
  auto norm = [&](const float* in, const float* w, float* out) {
    Timer t(profile.other);
    ops::rmsnorm_forward(in, w, out, static_cast<float*>(nullptr), rows, d, eps);
  };
  if (!plan_.attn_res) {
    for (int64_t i = 0; i < L; ++i) {
      norm(prefix.data(), ln1_[i], xn.data());
      mixer(i, xn.data(), a.data());
      yield();
      add_into(prefix.data(), a.data(), nd);
      norm(prefix.data(), ln2_[i], xn.data());
      ffn(i, xn.data(), f.data());
      yield();
      add_into(prefix.data(), f.data(), nd);
    }
    norm(prefix.data(), final_norm_, hn);
    return;
  }
  // Block AttnRes: closed sources (embedding first), the partial sum `prefix`, and per block the phase-1
  // state (m, l, acc) of all reads that share the block's closed sources.
  std::vector<Buf> closed;
  std::vector<const float*> src;
  Buf m1, l1, acc1;
  int64_t read = 0;  // next read of the current block
  const BlockReads* br = nullptr;
  auto phase2 = [&](const float* w, const float* g, float* out) {
    Timer t(profile.attnres);
    const float* v = prefix.data();
    ops::attnres_phase2(m1.data() + read * rows, l1.data() + read * rows, acc1.data() + read * nd, &v, 1, rows, d, w, g,
                        eps, out);
    ++read;
  };
  for (int64_t i = 0; i < L; ++i) {
    const model::LayerPlan& lp = plan_[i];
    const bool first = lp.opens_block;  // closes the partial sum and starts the block's read group
    const float* xin = x.data();
    if (first) {
      Timer t(profile.attnres);
      if (lp.attn_closed == 0) {
        xin = prefix.data();
      } else {
        src.clear();
        for (const auto& b : closed) src.push_back(b.data());
        src.push_back(prefix.data());
        ops::attnres_forward(src.data(), static_cast<int64_t>(src.size()), rows, d, attn_w_[i], attn_g_[i], eps,
                             x.data());
      }
      norm(xin, ln1_[i], xn.data());  // before the push: xin may be `prefix`
      closed.push_back(prefix);
      br = &blocks_[static_cast<size_t>(lp.block)];
      src.clear();
      for (const auto& b : closed) src.push_back(b.data());
      m1.resize(br->Q * rows), l1.resize(br->Q * rows), acc1.resize(br->Q * nd);
      ops::attnres_phase1(src.data(), static_cast<int64_t>(src.size()), rows, d, br->w.data(), br->g.data(), br->Q,
                          eps, m1.data(), l1.data(), acc1.data());
      read = 0;
    } else {
      phase2(attn_w_[i], attn_g_[i], x.data());
      norm(x.data(), ln1_[i], xn.data());
    }
    mixer(i, xn.data(), a.data());
    yield();
    if (first) std::copy(a.begin(), a.end(), prefix.begin());
    else add_into(prefix.data(), a.data(), nd);
    phase2(mlp_w_[i], mlp_g_[i], x.data());
    norm(x.data(), ln2_[i], xn.data());
    ffn(i, xn.data(), f.data());
    yield();
    add_into(prefix.data(), f.data(), nd);
  }
  phase2(out_w_, out_g_, x.data());
  LM_CHECK(read == br->Q, "session: AttnRes read count {} != {} (internal)", read, br->Q);
  norm(x.data(), final_norm_, hn);
}

// ---- prefill / decode -------------------------------------------------------------------------------------

std::vector<float> Session::prefill(Sequence& seq, std::span<const int32_t> tokens, std::vector<float>* all_logits,
                                    bool store) {
  const int64_t n = static_cast<int64_t>(tokens.size()), d = cfg_.hidden_size, V = cfg_.vocab_size;
  LM_CHECK(n >= 1, "prefill: no tokens");
  const int64_t media_rows = std::ssize(seq.media) / d - seq.media_taken;
  check_ids(tokens, media_rows);
  const int32_t ph = m_.media_placeholder();
  const bool has_media = ph >= 0 && std::find(tokens.begin(), tokens.end(), ph) != tokens.end();
  LM_CHECK(seq.pos() + n <= max_ctx_, "prompt of {} tokens (after {} cached) exceeds the context limit of {} tokens", n,
           seq.pos(), max_ctx_);
  check_sequence(seq, "prefill", 0);
  int64_t off = 0;
  if (seq.pos() == 0 && !all_logits && opt_.prefix_cache_bytes > 0) {
    // (a stored prefix holds no image: a sequence with one is never stored)
    if (Snapshot snap = lookup_prefix(tokens, n - 1)) {
      std::vector<float> media = std::move(seq.media);  // the images attached for this prompt stay
      const int64_t taken = seq.media_taken;
      seq = resume(snap);
      seq.media = std::move(media), seq.media_taken = taken;
      off = snap->pos();
    }
  }
  if (all_logits) all_logits->resize(static_cast<size_t>(n * V));
  if (seq.pos() % opt_.prefill_chunk != 0 || has_media) seq.on_grid = false;
  const int64_t end = seq.pos() + (n - off);
  // Room for the whole prompt at once; a prompt arriving in pieces (the server's) grows it by at least 1/16, not by
  // one piece at a time, which would copy the whole cache per piece.
  for (auto& c : seq.layers) {
    const auto need = static_cast<size_t>(end * c.row_width), cap = c.rows.capacity();
    if (c.row_width && need > cap) c.rows.reserve(std::max(need, cap + cap / 16));
  }
  // The snapshot worth keeping is the last grid point of this prompt (a later prompt that extends it
  // resumes there); earlier grid points would cost O(T) each.
  const int64_t Cp = opt_.prefill_chunk, snap_at = end / Cp * Cp;
  std::vector<float> last(static_cast<size_t>(V));
  Buf hn;
  std::vector<Sequence*> one{&seq};
  while (off < n) {
    const int64_t p = seq.pos(), stop = std::min(end, (p / Cp + 1) * Cp), c = stop - p;
    hn.resize(static_cast<size_t>(c * d));
    const float* features = has_media ? seq.media.data() + seq.media_taken * d : nullptr;
    walk(one, tokens.data() + off, c, false, hn.data(), features);
    if (has_media) seq.media_taken += std::count(tokens.begin() + off, tokens.begin() + off + c, ph);
    seq.tokens.insert(seq.tokens.end(), tokens.begin() + off, tokens.begin() + off + c);
    if (all_logits) {
      Timer t(profile.other);
      ops::lm_head_logits(hn.data(), lm_head_, c, d, V, all_logits->data() + off * V);
    }
    off += c;
    if (off == n) {
      Timer t(profile.other);
      ops::lm_head_logits(hn.data() + (c - 1) * d, lm_head_, 1, d, V, last.data());
    }
    if (store && seq.on_grid && opt_.prefix_cache_bytes > 0 && stop == snap_at && snap_at > 0) store_prefix(seq);
  }
  return last;
}

std::vector<float> Session::decode(const std::vector<Sequence*>& seqs, std::span<const int32_t> tokens) {
  const int64_t S = static_cast<int64_t>(seqs.size()), d = cfg_.hidden_size, V = cfg_.vocab_size;
  LM_CHECK(S >= 1 && static_cast<int64_t>(tokens.size()) == S, "decode: {} tokens for {} sequences", tokens.size(), S);
  check_ids(tokens);
  for (int64_t s = 0; s < S; ++s) {
    LM_CHECK(seqs[s] && seqs[s]->pos() + 1 <= max_ctx_, "decode: sequence {} is at the context limit of {} tokens", s,
             max_ctx_);
    check_sequence(*seqs[s], "decode", s);
    for (int64_t t = 0; t < s; ++t) LM_CHECK(seqs[t] != seqs[s], "decode: sequence {} appears twice", s);
  }
  Buf hn(static_cast<size_t>(S * d));
  walk(seqs, tokens.data(), S, true, hn.data());
  for (int64_t s = 0; s < S; ++s) seqs[s]->tokens.push_back(tokens[s]), seqs[s]->on_grid = false;
  std::vector<float> logits(static_cast<size_t>(S * V));
  Timer t(profile.other);
  ops::lm_head_logits(hn.data(), lm_head_, S, d, V, logits.data());
  return logits;
}

// ---- snapshots and the prefix cache -----------------------------------------------------------------------

Snapshot Session::snapshot(const Sequence& seq) {
  auto s = std::make_shared<Sequence>(seq);  // (a vector's copy holds no spare capacity)
  return s;
}

Sequence Session::resume(const Snapshot& s) {
  LM_CHECK(s != nullptr, "resume: null snapshot");
  return Sequence(*s);
}

void Session::store_prefix(const Sequence& s) {
  if (prefix_.find(s.tokens)) return;  // (made the most recent)
  auto copy = std::make_shared<Sequence>(s);
  copy->media.clear(), copy->media_taken = 0;  // images attached for later prompts are not the prefix's
  Snapshot snap = std::move(copy);
  const int64_t bytes = snap->cache_bytes() + static_cast<int64_t>(s.tokens.size() * sizeof(int32_t));
  if (bytes > opt_.prefix_cache_bytes) return;
  while (prefix_.bytes() + bytes > opt_.prefix_cache_bytes && !prefix_.empty()) prefix_.pop_lru();
  prefix_.insert(s.tokens, std::move(snap), bytes);
}

Snapshot Session::lookup_prefix(std::span<const int32_t> tokens, int64_t max_len) {
  auto* e = prefix_.longest(tokens, max_len, opt_.prefill_chunk);
  return e ? e->value : nullptr;
}

}  // namespace lm::infer
