// Golden op-file verification for KDA (the `longmoe verify` back end for op files).
//
// Legend: B batch, T tokens, H heads, K key dim, V value dim.
#include "apps/longmoe/verify/kda.hpp"

#include <cmath>
#include <cstdlib>

#include "core/error.hpp"
#include "io/safetensors.hpp"

namespace lm::app {

using namespace lm::kda;

bool is_kda_golden(const io::SafeTensorsFile& f) {
  for (const char* n : {"q", "k", "v", "g", "beta", "A_log", "dt_bias"})
    if (!f.contains(n)) return false;
  return true;
}

namespace {

GateParams gate_from_metadata(const io::SafeTensorsFile& f) {
  auto it = f.metadata().find("lower_bound");
  LM_CHECK(it != f.metadata().end(), "'{}': metadata has no 'lower_bound' (\"none\" or a number)", f.path());
  GateParams g;
  if (it->second == "none" || it->second == "None" || it->second.empty()) {
    g.form = GateForm::Softplus;
    return g;
  }
  char* end = nullptr;
  const double lb = std::strtod(it->second.c_str(), &end);
  LM_CHECK(end && *end == '\0' && std::isfinite(lb) && lb < 0,
           "'{}': metadata lower_bound '{}' is neither \"none\" nor a negative number", f.path(), it->second);
  g.form = GateForm::LowerBound;
  g.lower_bound = lb;
  return g;
}

template <class F>
std::vector<VerifyRow> run(const io::SafeTensorsFile& f, const VerifyOptions& opt, std::string* summary) {
  constexpr DType dt = dtype_of<F>;
  const auto& qi = f.info("q");
  LM_CHECK(qi.shape.size() == 4, "'{}': q must be [B, T, H, K], got {}", f.path(), shape_str(qi.shape));
  const int64_t B = qi.shape[0], T = qi.shape[1], H = qi.shape[2], K = qi.shape[3];
  const auto& vi = f.info("v");
  LM_CHECK(vi.shape.size() == 4 && vi.shape[0] == B && vi.shape[1] == T && vi.shape[2] == H,
           "'{}': v must be [B, T, H, V] matching q {}, got {}", f.path(), shape_str(qi.shape), shape_str(vi.shape));
  const int64_t V = vi.shape[3];
  LM_CHECK(B > 0 && T > 0 && H > 0 && K > 0 && V > 0, "'{}': empty dimensions in q {} / v {}", f.path(),
           shape_str(qi.shape), shape_str(vi.shape));
  const Shape sqk{B, T, H, K}, sv{B, T, H, V}, sb{B, T, H}, ss{B, H, K, V};
  Tensor q = f.get_as("q", dt, sqk), k = f.get_as("k", dt, sqk), v = f.get_as("v", dt, sv);
  Tensor g = f.get_as("g", dt, sqk), beta = f.get_as("beta", dt, sb);
  Tensor A_log = f.get_as("A_log", dt, {H}), dt_bias = f.get_as("dt_bias", dt, {H * K});
  Tensor h0 = f.contains("h0") ? f.get_as("h0", dt, ss) : Tensor();
  for (Tensor* t : {&q, &k, &v, &g, &beta, &A_log, &dt_bias, &h0})
    if (t->defined()) *t = t->contiguous();

  FusedInputs<F> in;
  in.q = q.data<F>();
  in.k = k.data<F>();
  in.v = v.data<F>();
  in.g_raw = g.data<F>();
  in.beta_raw = beta.data<F>();
  in.A_log = A_log.data<F>();
  in.dt_bias = dt_bias.data<F>();
  in.h0 = h0.defined() ? h0.data<F>() : nullptr;
  in.gate = gate_from_metadata(f);
  in.scale = static_cast<F>(1.0 / std::sqrt(static_cast<double>(K)));
  if (auto it = f.metadata().find("scale"); it != f.metadata().end()) {
    char* end = nullptr;
    const double s = std::strtod(it->second.c_str(), &end);
    LM_CHECK(end && *end == '\0' && std::isfinite(s) && s > 0, "'{}': metadata scale '{}' is not a positive number",
             f.path(), it->second);
    in.scale = static_cast<F>(s);
  }
  Dims d{B, T, H, K, V};
  const DiagPath diag = opt.core == CorePath::Chunked ? resolve_diag_path(opt.diag, in.gate) : DiagPath::Auto;

  std::vector<Tensor> outs;
  std::vector<std::pair<std::string, Tensor>> got;
  Tensor o = Tensor::zeros(sv, dt), ht = Tensor::zeros(ss, dt);
  fused_forward(in, d, o.data<F>(), ht.data<F>(), opt.core, diag);
  got.emplace_back("o", o);
  got.emplace_back("ht", ht);

  const bool has_grads = f.contains("do");
  if (has_grads) {
    Tensor dO = f.get_as("do", dt, sv).contiguous();
    Tensor dht = f.contains("dht") ? f.get_as("dht", dt, ss).contiguous() : Tensor();
    Tensor dq = Tensor::zeros(sqk, dt), dk = Tensor::zeros(sqk, dt), dv = Tensor::zeros(sv, dt);
    Tensor dg = Tensor::zeros(sqk, dt), dbeta = Tensor::zeros(sb, dt), dA = Tensor::zeros({H}, dt);
    Tensor ddt = Tensor::zeros({H * K}, dt), dh0 = Tensor::zeros(ss, dt);
    FusedGrads<F> gr{dq.data<F>(),    dk.data<F>(), dv.data<F>(),  dg.data<F>(),
                     dbeta.data<F>(), dA.data<F>(), ddt.data<F>(), dh0.data<F>()};
    fused_backward(in, d, dO.data<F>(), dht.defined() ? dht.data<F>() : nullptr, gr, opt.core, diag);
    for (auto& [n, t] : std::vector<std::pair<std::string, Tensor>>{{"dq", dq},       {"dk", dk},      {"dv", dv},
                                                                    {"dg", dg},       {"dbeta", dbeta}, {"dA_log", dA},
                                                                    {"ddt_bias", ddt}, {"dh0", dh0}})
      got.emplace_back(n, t);
  }

  std::vector<VerifyRow> rows;
  for (auto& [name, t] : got) {
    if (!f.contains(name)) continue;  // a file may store only some outputs
    const Tensor ref = f.get_as(name, DType::F64, t.shape());
    rows.push_back({name, shape_str(t.shape()), rel_rms(ref, t), opt.tol});
  }
  LM_CHECK(!rows.empty(), "'{}': holds KDA inputs but none of the outputs o, ht, dq, ... to compare with", f.path());
  if (summary)
    *summary = fmt::format("KDA op B={} T={} H={} K={} V={}, {} gate{}, core {}{}, {}", B, T, H, K, V,
                           in.gate.form == GateForm::Softplus ? "softplus" : "lower-bound",
                           in.gate.form == GateForm::LowerBound ? fmt::format(" ({})", in.gate.lower_bound) : "",
                           opt.core == CorePath::Chunked ? "chunked/" : "reference",
                           opt.core == CorePath::Chunked ? diag_path_name(diag) : "", opt.f64 ? "float64" : "fp32");
  return rows;
}

}  // namespace

std::vector<VerifyRow> verify_golden(const io::SafeTensorsFile& f, const VerifyOptions& opt, std::string* summary) {
  return opt.f64 ? run<double>(f, opt, summary) : run<float>(f, opt, summary);
}

}  // namespace lm::app
