// `longmoe verify FILE|DIR ...`: runs the engine on the inputs stored in golden files and prints,
// per output tensor, the relative RMS error against the stored expectation and pass/fail.
// Exits non-zero if any comparison fails or any file cannot be read.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "apps/longmoe/commands.hpp"
#include "apps/longmoe/verify/kda.hpp"
#include "apps/longmoe/verify/model.hpp"
#include "apps/longmoe/verify/vision.hpp"
#include "core/error.hpp"
#include "io/safetensors.hpp"

namespace {

struct VerifyArgs {
  std::vector<std::string> paths;
  std::string path = "auto";
  std::string core = "chunked";
  bool f64 = false;
  double tol = 0;  // 0: the golden README's tolerance per file kind
};

void print_rows(const std::string& title, const std::vector<lm::app::VerifyRow>& rows, int& failures) {
  std::printf("%s\n", title.c_str());
  std::printf("  %-10s %-22s %12s %10s  %s\n", "tensor", "shape", "rel_rms", "tol", "result");
  for (const auto& r : rows) {
    std::printf("  %-10s %-22s %12.3e %10.1e  %s\n", r.name.c_str(), r.shape.c_str(), r.err, r.tol,
                r.pass() ? "pass" : "FAIL");
    if (!r.pass()) ++failures;
  }
}

int run(const VerifyArgs& a) {
  lm::app::VerifyOptions opt;
  if (a.path == "bounded") opt.diag = lm::kda::DiagPath::Bounded;
  else if (a.path == "exact") opt.diag = lm::kda::DiagPath::Exact;
  opt.core = a.core == "reference" ? lm::kda::CorePath::Reference : lm::kda::CorePath::Chunked;
  opt.f64 = a.f64;
  if (a.tol > 0) opt.tol = a.tol;
  int failures = 0, unreadable = 0, checked = 0;
  for (const auto& p : a.paths) {
    try {
      if (std::filesystem::is_directory(p)) {
        failures += lm::app::is_vision_dir(p)
                        ? lm::app::verify_vision_dir(p, a.tol, a.f64, a.core == "reference")
                        : lm::app::verify_model_dir(p, a.tol, a.f64);
        ++checked;
        continue;
      }
      const auto f = lm::io::SafeTensorsFile::open(p);
      LM_CHECK(lm::app::is_kda_golden(f), "'{}' is not a KDA op golden (needs q, k, v, g, beta, A_log, dt_bias)", p);
      std::string summary;
      const auto rows = lm::app::verify_golden(f, opt, &summary);
      print_rows(p + ": " + summary, rows, failures);
      ++checked;
    } catch (const lm::Error& e) {
      std::fprintf(stderr, "longmoe verify: %s\n", e.what());
      ++unreadable;
    }
  }
  std::printf("verify: %d file(s) checked, %d comparison(s) failed, %d file(s) unreadable\n", checked, failures,
              unreadable);
  return failures || unreadable ? 1 : 0;
}

lm::app::Register reg({"verify", "Compare the engine with golden files (KDA op files, model and vision directories)",
                       [](CLI::App& sub) {
                         auto a = std::make_shared<VerifyArgs>();
                         sub.add_option("paths", a->paths, "Golden .safetensors op files, model or vision directories")
                             ->required()
                             ->check(CLI::ExistingPath);
                         sub.add_option("--path", a->path, "KDA diagonal-tile path")
                             ->check(CLI::IsMember({"auto", "bounded", "exact"}));
                         sub.add_option("--core", a->core, "KDA core: chunked or the token-by-token reference (vision "
                                                      "directories: the float64 definition)")
                             ->check(CLI::IsMember({"chunked", "reference"}));
                         sub.add_flag("--f64", a->f64, "Run in float64 instead of fp32");
                         sub.add_option("--tol", a->tol, "Override the tolerance (relative RMS)");
                         return [a] { return run(*a); };
                       }});

}  // namespace
