// Generation helpers: checkpoint directories (config.json + model.safetensors + tokenizer.model),
// stop tokens / stop strings / max_tokens, and generate() == a hand-written decode loop.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "infer/generate.hpp"
#include "io/checkpoint.hpp"
#include "io/file.hpp"
#include "io/safetensors.hpp"
#include "testing.hpp"

using namespace lm;
using namespace lm::infer;

namespace {

std::string tmpdir(const std::string& tag) {
  const auto d = std::filesystem::temp_directory_path() / ("longmoe_gen_" + tag + "_" + std::to_string(getpid()));
  std::filesystem::create_directories(d);
  return d.string();
}

const io::Tokenizer& tokenizer() {
  static std::shared_ptr<io::Tokenizer> tok;
  if (!tok) {
    std::vector<std::string> texts;
    const char* w[] = {"one", "two", "three", "river", "stone", "light", "hello", "world"};
    for (int i = 0; i < 30; ++i) {
      std::string s;
      for (int k = 0; k < 150; ++k) s += std::string(w[(k * 5 + i) % 8]) + (k % 7 == 6 ? ".\n" : " ");
      texts.push_back(s);
    }
    io::Tokenizer::TrainOptions o;
    o.vocab_size = 300;
    tok = std::make_shared<io::Tokenizer>(io::Tokenizer::train(texts, tmpdir("tok") + "/tokenizer.model", o));
  }
  return *tok;
}

model::ModelConfig config(int64_t vocab) {
  const std::string s = R"({"model_type": "kimi_linear", "vocab_size": )" + std::to_string(vocab) + R"(,
    "hidden_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "q_lora_rank": null, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
    "mla_use_nope": true,
    "linear_attn_config": {"num_heads": 2, "head_dim": 4, "short_conv_kernel_size": 4,
       "kda_layers": [1], "full_attn_layers": [2]},
    "hidden_act": "silu", "intermediate_size": 32, "first_k_dense_replace": 2, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": false})";
  return model::ModelConfig::from_json(io::json::parse(s), "generate test config");
}

}  // namespace

TEST(Generate, CheckpointDirectoryRoundTrip) {
  const auto& tok = tokenizer();
  const auto cfg = config(tok.vocab_size());
  model::Model<float> m(cfg);
  m.params().init(3);
  const std::string dir = tmpdir("ckpt");
  io::save_checkpoint(dir, m.params().named(), uint64_t(1) << 30);
  cfg.save(dir + "/config.json");
  {
    std::ofstream f(dir + "/tokenizer.model", std::ios::binary);
    f << tok.model_bytes();
  }
  LoadedModel lm = load_model_dir(dir);
  ASSERT_TRUE(lm.tokenizer);
  EXPECT_EQ(lm.tokenizer->vocab_size(), tok.vocab_size());
  const auto ids = tok.encode("hello world river");
  Session a(m, SessionOptions{64, 0, 0}), b(*lm.model, SessionOptions{64, 0, 0});
  Sequence sa = a.new_sequence(), sb = b.new_sequence();
  EXPECT_EQ(a.prefill(sa, ids), b.prefill(sb, ids));
  std::filesystem::remove(dir + "/tokenizer.model");
  EXPECT_THROW(load_model_dir(dir), Error);
  EXPECT_NO_THROW(load_model_dir(dir, false));
  EXPECT_THROW(load_model_dir(dir + "/missing"), Error);
}

// A checkpoint laid out as HF transformers shards one (model-0000k-of-00002.safetensors and model.safetensors.index.json
// written here by hand: its "metadata" and "weight_map", tensors spread over the files out of order) loads as the
// model it holds.
TEST(Generate, HfShardedCheckpointLoads) {
  const auto& tok = tokenizer();
  const auto cfg = config(tok.vocab_size());
  model::Model<float> m(cfg);
  m.params().init(6);
  const std::string dir = tmpdir("hf_sharded");
  const io::NamedTensors all = m.params().named();
  io::NamedTensors shard[2];
  io::json map = io::json::object();
  uint64_t total = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const std::string file = i % 2 ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors";
    shard[i % 2].push_back(all[i]);
    map[all[i].first] = file;
    total += all[i].second.nbytes();
  }
  ASSERT_GT(shard[1].size(), 2u);
  io::save_safetensors(dir + "/model-00001-of-00002.safetensors", shard[0]);
  io::save_safetensors(dir + "/model-00002-of-00002.safetensors", shard[1]);
  io::write_file_atomic(dir + "/model.safetensors.index.json",
                        io::json{{"metadata", {{"total_size", total}}}, {"weight_map", map}}.dump(2));
  cfg.save(dir + "/config.json");
  io::write_file_atomic(dir + "/tokenizer.model", tok.model_bytes());
  ASSERT_FALSE(std::filesystem::exists(dir + "/model.safetensors"));
  LoadedModel lm = load_model_dir(dir);
  const auto ids = tok.encode("hello world river");
  Session a(m, SessionOptions{64, 0, 0}), b(*lm.model, SessionOptions{64, 0, 0});
  Sequence sa = a.new_sequence(), sb = b.new_sequence();
  EXPECT_EQ(a.prefill(sa, ids), b.prefill(sb, ids));
  // A tensor the index names in a shard that lacks it is an error naming it.
  map[all[0].first] = "model-00002-of-00002.safetensors";
  io::write_file_atomic(dir + "/model.safetensors.index.json",
                        io::json{{"metadata", {{"total_size", total}}}, {"weight_map", map}}.dump(2));
  try {
    load_model_dir(dir);
    ADD_FAILURE() << "an index naming the wrong shard loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(all[0].first), std::string::npos) << e.what();
  }
}

// A training run folder (config.json at its root, checkpoints under ckpt/, `latest` naming the newest)
// loads as its latest checkpoint; a `latest` that names no checkpoint is a clear error.
TEST(Generate, RunFolderLoadsItsLatestCheckpoint) {
  const auto& tok = tokenizer();
  const auto cfg = config(tok.vocab_size());
  model::Model<float> m(cfg);
  m.params().init(5);
  const std::string run = tmpdir("run"), ck = run + "/ckpt/step-00000007";
  std::filesystem::create_directories(ck);
  io::save_checkpoint(ck, m.params().named(), uint64_t(1) << 30);
  cfg.save(ck + "/config.json");
  cfg.save(run + "/config.json");  // the trainer keeps one at the run root too
  {
    std::ofstream f(ck + "/tokenizer.model", std::ios::binary);
    f << tok.model_bytes();
  }
  {
    std::ofstream f(run + "/latest");
    f << "ckpt/step-00000007\n";
  }
  LoadedModel lm = load_model_dir(run);
  EXPECT_EQ(std::filesystem::path(lm.dir).filename(), "step-00000007");
  const auto ids = tok.encode("hello world river");
  Session a(m, SessionOptions{64, 0, 0}), b(*lm.model, SessionOptions{64, 0, 0});
  Sequence sa = a.new_sequence(), sb = b.new_sequence();
  EXPECT_EQ(a.prefill(sa, ids), b.prefill(sb, ids));
  {
    std::ofstream f(run + "/latest");
    f << "ckpt/step-00000009\n";
  }
  EXPECT_THROW(load_model_dir(run), Error);
}

TEST(Generate, StopConditions) {
  const auto& tok = tokenizer();
  const int64_t V = tok.vocab_size();
  // Logits that always pick `t`.
  auto one_hot = [&](int32_t t) {
    std::vector<float> l(static_cast<size_t>(V), 0.0f);
    l[static_cast<size_t>(t)] = 10.0f;
    return l;
  };
  // A learned piece of at least 3 bytes, e.g. "river".
  int32_t a = -1;
  for (int32_t id = 0; id < V && a < 0; ++id)
    if (!tok.is_special(id) && tok.piece_bytes(id).size() >= 3) a = id;
  ASSERT_GE(a, 0);
  const std::string P = tok.piece_bytes(a);
  const int32_t end = tok.special("<|end|>");
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 3;
  p.stop_tokens = {end};
  Generation g(&tok, p, {});
  EXPECT_FALSE(g.next(one_hot(a).data(), V).done);
  const auto st = g.next(one_hot(end).data(), V);
  EXPECT_TRUE(st.done);
  EXPECT_EQ(g.finish_reason(), "stop");
  EXPECT_EQ(g.generated().size(), 1u);  // the stop token is not part of the output
  Generation h(&tok, p, {});
  for (int i = 0; i < 2; ++i) EXPECT_FALSE(h.next(one_hot(a).data(), V).done);
  const auto last = h.next(one_hot(a).data(), V);
  EXPECT_TRUE(last.done);
  EXPECT_EQ(last.token, -1);
  EXPECT_EQ(h.finish_reason(), "length");
  EXPECT_EQ(h.text(), tok.decode(h.generated()));
  SamplingParams q = p;
  q.max_tokens = 50;
  q.stop = {P.substr(1) + P.substr(0, 1)};  // spans two tokens: "river"+"river" holds "iverr"
  Generation s(&tok, q, {});
  std::string out;
  for (int i = 0; i < 10 && !s.done(); ++i) out += s.next(one_hot(a).data(), V).text;
  EXPECT_EQ(s.finish_reason(), "stop");
  EXPECT_EQ(out, P.substr(0, 1));
}

TEST(Generate, GenerateEqualsAHandWrittenLoop) {
  const auto& tok = tokenizer();
  model::Model<float> m(config(tok.vocab_size()));
  m.params().init(5);
  Session s(m, SessionOptions{16, 0, 0});
  const auto prompt = tok.encode("one two three");
  SamplingParams p;
  p.temperature = 0.7f;
  p.top_k = 20;
  p.seed = 9;
  p.max_tokens = 15;
  Sequence seq = s.new_sequence();
  std::string streamed;
  const Generation g = generate(s, seq, tok, prompt, p, [&](const std::string& t) { streamed += t; });
  EXPECT_EQ(streamed, g.text());
  // By hand: the same sampler stream over prefill + decode logits.
  Sampler smp(p);
  Sequence q = s.new_sequence();
  std::vector<float> l = s.prefill(q, prompt);
  std::vector<int32_t> hist = prompt, out;
  for (int i = 0; i < 15; ++i) {
    const int32_t t = smp.sample(l.data(), s.vocab_size(), hist);
    out.push_back(t);
    hist.push_back(t);
    if (i + 1 < 15) l = s.decode({&q}, std::span(&t, 1));
  }
  EXPECT_EQ(g.generated(), out);
  EXPECT_EQ(g.finish_reason(), "length");
}

// A config.json that disagrees with the weights is refused from the safetensors headers, before the model is
// allocated: with hidden_size 2^14 and intermediate_size 2^24 its parameters would need terabytes, so allocating
// first would fail on the memory check instead of naming the shape.
TEST(Generate, ConfigThatDisagreesWithTheWeightsFailsBeforeAllocating) {
  const auto& tok = tokenizer();
  const auto cfg = config(tok.vocab_size());
  model::Model<float> m(cfg);
  m.params().init(4);
  const std::string dir = tmpdir("mismatch");
  io::save_checkpoint(dir, m.params().named(), uint64_t(1) << 30);
  {
    std::ofstream f(dir + "/tokenizer.model", std::ios::binary);
    f << tok.model_bytes();
  }
  cfg.save(dir + "/config.json");
  io::json j = io::load_json_file(dir + "/config.json");
  j["hidden_size"] = 1 << 14;
  j["intermediate_size"] = 1 << 24;
  {
    std::ofstream f(dir + "/config.json");
    f << j.dump(2);
  }
  try {
    load_model_dir(dir);
    ADD_FAILURE() << "a config that disagrees with the weights loaded";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("has shape"), std::string::npos) << what;
    EXPECT_EQ(what.find("GiB"), std::string::npos) << what;
  }
  // The same config with no weights to check: the memory check refuses it with both figures.
  try {
    model::Model<float> huge(model::ModelConfig::load(dir + "/config.json"));
    ADD_FAILURE() << "a model of terabytes was allocated";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("GiB of host memory, more than this machine's"), std::string::npos) << what;
  }
}

// vocab_size 2^24 or intermediate_size 2^24 in config.json (each alone: a model of a few GB, which a machine may hold)
// is refused from the safetensors headers with the tensor's shape, before anything of that size is allocated.
TEST(Generate, HugeVocabOrIntermediateSizeIsRefusedBeforeAllocating) {
  const auto& tok = tokenizer();
  const auto cfg = config(tok.vocab_size());
  model::Model<float> m(cfg);
  m.params().init(4);
  const std::string dir = tmpdir("huge");
  io::save_checkpoint(dir, m.params().named(), uint64_t(1) << 30);
  {
    std::ofstream f(dir + "/tokenizer.model", std::ios::binary);
    f << tok.model_bytes();
  }
  for (const char* field : {"vocab_size", "intermediate_size"}) {
    io::json j = cfg.to_json();
    j[field] = 1 << 24;
    io::write_file_atomic(dir + "/config.json", j.dump(2));
    auto peak_bytes = [] {
      rusage u{};
      getrusage(RUSAGE_SELF, &u);
      return int64_t{u.ru_maxrss} << 10;
    };
    const int64_t peak = peak_bytes();
    try {
      load_model_dir(dir);
      ADD_FAILURE() << field << " 2^24 loaded";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("has shape"), std::string::npos) << field << ": " << what;
      EXPECT_NE(what.find("16777216"), std::string::npos) << field << ": " << what;
    }
    EXPECT_LT(peak_bytes() - peak, int64_t(256) << 20) << field;
  }
}
