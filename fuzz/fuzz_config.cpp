// libFuzzer target: arbitrary bytes -> JSON -> ModelConfig::from_json. Invalid JSON is skipped;
// lm::Error is the expected answer to a bad config; any other exception, a crash or a sanitizer
// report is a bug. An accepted config must survive to_json() -> from_json() unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "model/config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(data, data + size);
  } catch (const nlohmann::json::exception&) {  // parse_error, or out_of_range for 1e999
    return 0;
  }
  try {
    const lm::model::ModelConfig c = lm::model::ModelConfig::from_json(j, "fuzz");
    // Derived facts must be computable for anything from_json accepted.
    // (Summed as unsigned so the harness itself cannot overflow.)
    volatile uint64_t sink = 0;
    for (int64_t v : {c.num_moe_layers(), c.num_dense_ffn_layers(), c.num_mla_layers(), c.attn_res_max_sources(),
                      c.mla_qk_head_dim(), c.mla_cache_dim(), c.expert_width(), c.kda_key_dim(),
                      c.shared_intermediate_size()})
      sink = sink + static_cast<uint64_t>(v);
    for (int64_t i = 0; i < c.num_hidden_layers && i < 4096; ++i)
      sink = sink + (c.is_kda(i) ? 1u : 0u) + (c.is_moe(i) ? 2u : 0u);
    const lm::model::ModelConfig back = lm::model::ModelConfig::from_json(c.to_json(), "fuzz:to_json");
    if (!(back == c)) {
      std::fprintf(stderr, "fuzz_config: to_json() -> from_json() changed the config\n%s\n",
                   c.to_json().dump(2).c_str());
      std::abort();
    }
  } catch (const lm::Error&) {
    // Rejected with a message: the expected outcome for a bad config.
  }
  return 0;
}
