// Data-parallel training over the job's processes (RunConfig::parallel.dp, train/engine_cpu.cpp): the losses of
// 10 steps equal those of one process training the same run (within 1e-6 relative), whatever the world size this
// binary runs at (alone, or under mpirun with 2 and 4 ranks); a world size the config does not ask for is refused.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.hpp"
#include "dist/comm.hpp"
#include "io/checkpoint.hpp"
#include "io/file.hpp"
#include "model/model.hpp"
#include "train/optim.hpp"
#include "train/run_dir.hpp"
#include "testing.hpp"
#include "train/tiny_run.hpp"
#include "train/trainer.hpp"

namespace fs = std::filesystem;
using namespace lm;
using namespace lm::train;
using lm::testing::error_of;

namespace {

// A fresh folder `name` for this world size, with the tiny run's model and corpus (rank 0 writes them before any
// rank reads them), and the tiny run in `out` below it: its first stage in one piece per replica, 10 steps.
fs::path shared_root(dist::Comm& w, const std::string& name) {
  // The test's full name in the folder's: ctest runs each test in a process of its own, two at once, and each builds
  // the reference run (one_process) afresh; the ranks of one job share the name.
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string test = std::string(info->test_suite_name()) + "_" + info->name();
  const fs::path root = fs::path(::testing::TempDir()) / (name + "_" + test + "_" + std::to_string(w.size()));
  if (w.rank() == 0) {
    fs::remove_all(root);
    tiny::tiny_run(root, "");
  }
  w.barrier();
  return root;
}
RunConfig ten_steps(const fs::path& root, const std::string& out) {
  RunConfig c = tiny::tiny_run(root, (root / out).string());
  c.stages[0].micro_seqs = 0;
  c.max_steps = 10;
  return c;
}

// ten_steps trained by one process (on every rank, once for all the tests: the reference they compare with).
const TrainResult& one_process(dist::Comm& w) {
  static const TrainResult r = [&] {
    const fs::path root = shared_root(w, "lm_one");
    TrainOptions o;
    o.quiet = true;
    o.comm = &dist::single();
    return lm::train::train(ten_steps(root, "one-" + std::to_string(w.rank())), o);
  }();
  return r;
}

}  // namespace

// Expert parallel (parallel.ep): groups of ep replicas share the experts, each holding and running its share of
// them over the rows its whole group routes there; 10 steps give the losses of one process (within 1e-6 relative),
// and so does the held-out loss. ep = the world size, and at 4 ranks also ep 2 (two groups of two).
TEST(ExpertParallel, TenStepsEqualOneProcess) {
  dist::Comm& w = dist::world();
  const fs::path root = shared_root(w, "lm_ep");
  TrainOptions o;
  o.quiet = true;
  const RunConfig one = ten_steps(root, "one-" + std::to_string(w.rank()));
  const TrainResult& ref = one_process(w);
  for (int64_t ep_size = w.size(); ep_size >= 2 || ep_size == w.size(); ep_size /= 2) {
    RunConfig ep = one;
    ep.out = (root / ("ep" + std::to_string(ep_size))).string();
    ep.parallel.dp = w.size(), ep.parallel.ep = ep_size;
    o.comm = &w;
    const TrainResult got = lm::train::train(ep, o);
    ASSERT_EQ(got.losses.size(), ref.losses.size());
    double worst = 0;
    for (size_t i = 0; i < ref.losses.size(); ++i)
      worst = std::max(worst, std::abs(got.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]));
    if (w.rank() == 0)
      std::printf("[ measure  ] expert parallel, %d replica(s) in groups of %ld, vs one process, 10 steps: worst loss "
                  "difference %.2e relative, %ld assignments dropped\n", w.size(), long(ep_size), worst,
                  long(got.ep_dropped));
    EXPECT_LE(worst, 1e-6);
    EXPECT_EQ(got.ep_dropped, 0);  // (capacity 0: lossless)
    EXPECT_NEAR(got.heldout_loss, ref.heldout_loss, 1e-6 * std::abs(ref.heldout_loss));
    if (ep_size == 1) break;
  }
  RunConfig bad = one;
  bad.parallel.dp = w.size(), bad.parallel.ep = w.size() + 1;
  EXPECT_THROW(RunConfig::from_json(bad.to_json(), "bad"), lm::Error);
}

// Sharded checkpoints under expert parallel: 5 steps with the experts split over every rank write one model shard
// per rank (the HF index layout) and one optimiser shard per rank; every tensor reads back through the index; one
// process resumes and continues exactly (steps 6-10 equal the uninterrupted run's within 1e-6 relative), and so does
// the job in another layout (at 4 ranks ep 2, at 2 ranks plain data parallel).
TEST(ExpertParallel, ShardedCheckpointsResumeOnAnotherLayout) {
  dist::Comm& w = dist::world();
  if (w.size() == 1) GTEST_SKIP() << "needs several ranks";
  const fs::path root = shared_root(w, "lm_ep_ckpt");
  TrainOptions o;
  o.quiet = true;
  const TrainResult& ref = one_process(w);
  RunConfig part = ten_steps(root, "ep");
  part.max_steps = 5;
  part.parallel.dp = part.parallel.ep = w.size();
  o.comm = &w;
  lm::train::train(part, o);
  w.barrier();
  const fs::path ck = root / "ep" / "ckpt" / "step-00000005";
  EXPECT_FALSE(fs::exists(ck / "model.safetensors"));
  EXPECT_TRUE(fs::exists(ck / "model.safetensors.index.json"));
  for (int r = 0; r < w.size(); ++r) EXPECT_TRUE(fs::exists(ck / io::shard_file_name(size_t(r), size_t(w.size()))));
  EXPECT_EQ(optimizer_files(ck).size(), size_t(w.size()));
  const model::ModelConfig mc = model::ModelConfig::load((ck / "config.json").string());
  EXPECT_NO_THROW(model::check_checkpoint(model::param_specs(mc), io::Checkpoint::open(ck.string())));
  if (w.rank() == 0) fs::copy(root / "ep", root / "ep-copy", fs::copy_options::recursive);
  w.barrier();
  auto worst_rest = [&](const TrainResult& rest) {
    EXPECT_EQ(rest.losses.size(), 5u);
    double worst = 0;
    for (size_t i = 0; i < std::min<size_t>(5, rest.losses.size()); ++i)
      worst = std::max(worst, std::abs(rest.losses[i] - ref.losses[5 + i]) / std::abs(ref.losses[5 + i]));
    return worst;
  };
  // The job in another layout resumes the copy.
  RunConfig other = part;
  other.out = (root / "ep-copy").string();
  other.max_steps = 10;
  other.parallel.ep = w.size() >= 4 ? w.size() / 2 : 1;
  o.resume = true;
  const double worst_other = worst_rest(lm::train::train(other, o));
  EXPECT_LE(worst_other, 1e-6);
  // One process resumes the original.
  if (w.rank() == 0) {
    RunConfig one = part;
    one.max_steps = 10;
    one.parallel = {};
    o.comm = &dist::single();
    const double worst_one = worst_rest(lm::train::train(one, o));
    EXPECT_LE(worst_one, 1e-6);
    std::printf("[ measure  ] EP over %d ranks for 5 steps, its sharded checkpoint resumed by one process and by %d "
                "ranks with ep %ld: worst loss difference %.2e / %.2e relative\n", w.size(), w.size(),
                long(other.parallel.ep), worst_one, worst_other);
  }
  w.barrier();
}

// Buffers below the load (ep_capacity 0.5 of the balanced load): the overflow is dropped, counted in the result and
// in every metrics line.
TEST(ExpertParallel, DroppedAssignmentsAreReported) {
  dist::Comm& w = dist::world();
  if (w.size() == 1) GTEST_SKIP() << "needs several ranks";
  const fs::path root = shared_root(w, "lm_ep_drop");
  TrainOptions o;
  o.quiet = true;
  o.comm = &w;
  RunConfig c = ten_steps(root, "run");
  c.max_steps = 2;
  c.parallel.dp = c.parallel.ep = w.size();
  c.parallel.ep_capacity = 0.5;
  const TrainResult r = lm::train::train(c, o);
  EXPECT_GT(r.ep_dropped, 0);
  w.barrier();
  std::ifstream f(root / "run" / "metrics.jsonl");
  std::string line;
  int64_t logged = 0;
  while (std::getline(f, line))
    if (const io::json j = io::json::parse(line); j.contains("ep_dropped")) logged += j["ep_dropped"].get<int64_t>();
  EXPECT_EQ(logged, r.ep_dropped);
  if (w.rank() == 0)
    std::printf("[ measure  ] capacity 0.5 x the balanced load over %d ranks: %ld assignments dropped in 2 steps\n",
                w.size(), long(r.ep_dropped));
}

TEST(DataParallel, TenStepsEqualOneProcess) {
  dist::Comm& w = dist::world();
  const fs::path root = shared_root(w, "lm_dp");
  TrainOptions o;
  o.quiet = true;
  // The reference: one process, in a folder of its own on every rank.
  const RunConfig one = ten_steps(root, "one-" + std::to_string(w.rank()));
  const TrainResult& ref = one_process(w);
  RunConfig dp = one;
  dp.out = (root / "dp").string();
  dp.parallel.dp = w.size();
  o.comm = &w;
  const TrainResult got = lm::train::train(dp, o);
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  double worst = 0;
  for (size_t i = 0; i < ref.losses.size(); ++i)
    worst = std::max(worst, std::abs(got.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]));
  if (w.rank() == 0)
    std::printf("[ measure  ] %d replica(s) vs one process, 10 steps: worst loss difference %.2e relative\n", w.size(),
                worst);
  EXPECT_LE(worst, 1e-6);
  // Rank 0 wrote the run folder; its last checkpoint is the one of step 10.
  w.barrier();
  EXPECT_TRUE(fs::exists(root / "dp" / "ckpt" / "step-00000010" / "model.safetensors"));
  // A world size the run does not ask for is refused before anything is written.
  RunConfig bad = one;
  bad.out = (root / "bad").string();
  bad.parallel.dp = w.size() + 1;
  bad.stages[0].batch_seqs = 8 * (w.size() + 1);
  bad.stages[1].batch_seqs = 4 * (w.size() + 1);
  try {
    lm::train::train(bad, o);
    ADD_FAILURE() << "a run for " << w.size() + 1 << " processes started on " << w.size();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mpirun -np"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(root / "bad"));
  w.barrier();
}

TEST(DataParallel, LayoutsThatCannotSplitAreConfigErrors) {
  const fs::path root = fs::path(::testing::TempDir()) / ("lm_dp_layout_" + std::to_string(dist::world().rank()));
  RunConfig c = tiny::tiny_run(root, "x");
  io::json j = c.to_json();
  j["parallel"] = {{"dp", 3}};  // batch_seqs 8 and 4 do not split in 3
  EXPECT_THROW(RunConfig::from_json(j, "dp3"), Error);
  j["parallel"] = {{"dp", 2}, {"ep", 4}};  // groups of ep replicas: ep divides dp
  EXPECT_THROW(RunConfig::from_json(j, "ep4"), Error);
  j["parallel"] = {{"dp", 2}, {"ep", 2}, {"zero", 0}};  // the experts' optimiser state lives with them
  EXPECT_THROW(RunConfig::from_json(j, "ep2 zero0"), Error);
  // ep must divide the model's 8 experts: refused before anything is written, whatever the job's size.
  RunConfig three = c;
  three.out = (root / "ep3").string();
  three.parallel.dp = three.parallel.ep = 3;
  EXPECT_NE(error_of([&] { lm::train::train(three, TrainOptions{}); }).find("divide the 8 routed experts"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(three.out));
  j["parallel"] = {{"dp", 2}, {"cp", 2}};
  EXPECT_THROW(RunConfig::from_json(j, "cp2"), Error);
  j["parallel"] = {{"dp", 2}, {"ep", 2}};
  EXPECT_EQ(RunConfig::from_json(j, "ep2").parallel.ep, 2);
  j["parallel"] = {{"dp", 2}};
  EXPECT_EQ(RunConfig::from_json(j, "dp2").parallel.dp, 2);
  EXPECT_EQ(RunConfig::from_json(j, "dp2").to_json()["parallel"]["dp"], 2);
}

// Context parallel (parallel.cp = the world size, dp 1): every rank trains on its segment of each sequence of the
// step (seq_len 32 split 2 or 4 ways, concat_documents stages); the losses of 10 steps and the held-out loss equal
// one process's within 1e-6 relative, and rank 0 writes the run folder.
TEST(ContextParallel, TenStepsEqualOneProcess) {
  dist::Comm& w = dist::world();
  const fs::path root = shared_root(w, "lm_cp");
  TrainOptions o;
  o.quiet = true;
  RunConfig one = ten_steps(root, "one-" + std::to_string(w.rank()));
  for (auto& s : one.stages) s.concat_documents = true;  // whole sequences: no document boundary to split
  o.comm = &dist::single();
  const auto t0 = std::chrono::steady_clock::now();
  const TrainResult ref = lm::train::train(one, o);
  const auto t1 = std::chrono::steady_clock::now();
  RunConfig cp = one;
  cp.out = (root / "cp").string();
  cp.parallel.cp = w.size();
  o.comm = &w;
  const TrainResult got = lm::train::train(cp, o);
  const auto t2 = std::chrono::steady_clock::now();
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  double worst = 0;
  for (size_t i = 0; i < ref.losses.size(); ++i)
    worst = std::max(worst, std::abs(got.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]));
  if (w.rank() == 0)
    std::printf("[ measure  ] context parallel over %d rank(s) vs one process, 10 steps of 8 x 32 tokens: worst loss "
                "difference %.2e relative (one process %.2f s, context parallel %.2f s)\n",
                w.size(), worst, std::chrono::duration<double>(t1 - t0).count(),
                std::chrono::duration<double>(t2 - t1).count());
  EXPECT_LE(worst, 1e-6);
  EXPECT_NEAR(got.heldout_loss, ref.heldout_loss, 1e-6 * std::abs(ref.heldout_loss));
  w.barrier();
  EXPECT_TRUE(fs::exists(root / "cp" / "ckpt" / "step-00000010" / "model.safetensors"));
  w.barrier();
}

TEST(ContextParallel, LayoutsItCannotRunAreConfigErrors) {
  RunConfig c = tiny::tiny_run(fs::path(::testing::TempDir()) / "lm_cp_layout", "x");
  for (auto& s : c.stages) s.concat_documents = true;
  io::json j = c.to_json();
  j["parallel"] = {{"cp", 4}};
  EXPECT_EQ(RunConfig::from_json(j, "cp4").parallel.world(), 4);
  EXPECT_EQ(RunConfig::from_json(j, "cp4").to_json()["parallel"]["cp"], 4);
  auto refused = [&](const io::json& bad, const char* what) {
    try {
      RunConfig::from_json(bad, "bad");
      ADD_FAILURE() << "accepted " << bad["parallel"].dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  j["parallel"] = {{"dp", 2}, {"cp", 2}};
  refused(j, "dp 2 x cp 2");
  j["parallel"] = {{"cp", 3}};  // seq_len 32 does not split in 3
  refused(j, "a multiple of cp");
  io::json packed = j;
  packed["parallel"] = {{"cp", 2}};
  packed["stages"][0]["concat_documents"] = false;
  refused(packed, "concat_documents");
  io::json aux = j;
  aux["parallel"] = {{"cp", 2}};
  aux["balance"]["kind"] = "aux";
  refused(aux, "balance aux");
}

// A run stopped after 5 steps in one process and resumed by all the job's replicas continues as if uninterrupted:
// a checkpoint does not depend on the layout (the weights, the optimiser state and the stream position are whole).
TEST(DataParallel, ResumeOnAnotherWorldSizeContinuesExactly) {
  dist::Comm& w = dist::world();
  const fs::path root = shared_root(w, "lm_dp_resume");
  TrainOptions o;
  o.quiet = true;
  const TrainResult& ref = one_process(w);
  RunConfig part = ten_steps(root, "part");
  part.max_steps = 5;
  o.comm = &dist::single();
  if (w.rank() == 0) lm::train::train(part, o);  // one process writes steps 1-5
  w.barrier();
  part.max_steps = 10;
  part.parallel.dp = w.size();
  o.comm = &w;
  o.resume = true;
  const TrainResult rest = lm::train::train(part, o);
  ASSERT_EQ(rest.losses.size(), 5u);
  double worst = 0;
  for (size_t i = 0; i < 5; ++i)
    worst = std::max(worst, std::abs(rest.losses[i] - ref.losses[5 + i]) / std::abs(ref.losses[5 + i]));
  if (w.rank() == 0)
    std::printf("[ measure  ] 1 process for 5 steps, then %d replica(s) for 5: worst loss difference %.2e relative\n",
                w.size(), worst);
  EXPECT_LE(worst, 1e-6);
  w.barrier();
}

// ZeRO-1 (parallel.zero 1, the default): each replica holds its share of the optimiser state, the checkpoints hold
// one shard per rank and an index, and such a checkpoint resumes on another world size (here one process) exactly;
// zero 0 (a whole state per replica) takes the same steps.
TEST(DataParallel, ShardedOptimizerStateAndCheckpoints) {
  dist::Comm& w = dist::world();
  const fs::path root = shared_root(w, "lm_zero");
  TrainOptions o;
  o.quiet = true;
  const RunConfig full = ten_steps(root, "full-" + std::to_string(w.rank()));
  const TrainResult& ref = one_process(w);
  // The state a replica holds: Optimizer::shard on this world.
  {
    model::Model<float> m(model::ModelConfig::load(full.model));
    m.params().enable_grads();
    Optimizer whole(m.params(), m.config(), full.optim), part(m.params(), m.config(), full.optim);
    part.shard(w);
    const double share = double(part.state_bytes()) / double(whole.state_bytes());
    std::printf("[ measure  ] rank %d of %d holds %.3f of the optimizer state\n", w.rank(), w.size(), share);
    if (w.size() > 1) EXPECT_LT(share, 1.5 / w.size());
    else EXPECT_EQ(share, 1.0);
  }
  RunConfig zero0 = full;
  zero0.out = (root / "zero0").string();
  zero0.parallel.dp = w.size(), zero0.parallel.zero = 0;
  o.comm = &w;
  const TrainResult z0 = lm::train::train(zero0, o);
  RunConfig part = full;
  part.out = (root / "part").string();
  part.max_steps = 5;
  part.parallel.dp = w.size();
  const TrainResult first = lm::train::train(part, o);  // sharded (zero 1) on this world size
  w.barrier();
  const fs::path ck = root / "part" / "ckpt" / "step-00000005";
  if (w.size() > 1) {
    EXPECT_TRUE(fs::exists(ck / "optimizer.index.json"));
    EXPECT_FALSE(fs::exists(ck / "optimizer.safetensors"));
    EXPECT_EQ(optimizer_files(ck).size(), size_t(w.size()));
  } else {
    EXPECT_TRUE(fs::exists(ck / "optimizer.safetensors"));
  }
  w.barrier();
  double worst = 0;
  if (w.rank() == 0) {  // one process resumes the sharded checkpoint
    part.max_steps = 10;
    part.parallel.dp = 1;
    o.comm = &dist::single();
    o.resume = true;
    const TrainResult rest = lm::train::train(part, o);
    ASSERT_EQ(rest.losses.size(), 5u);
    for (size_t i = 0; i < 5; ++i) {
      worst = std::max(worst, std::abs(rest.losses[i] - ref.losses[5 + i]) / std::abs(ref.losses[5 + i]));
      worst = std::max(worst, std::abs(first.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]));
    }
    for (size_t i = 0; i < ref.losses.size(); ++i)
      worst = std::max(worst, std::abs(z0.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]));
    std::printf("[ measure  ] ZeRO-1 on %d replica(s), its sharded checkpoint resumed by one process, and zero 0: "
                "worst loss difference %.2e relative\n", w.size(), worst);
  }
  EXPECT_LE(worst, 1e-6);
  w.barrier();
}

// A replica that dies (rank 0 aborts inside the save of step 8, as a kill would) ends the whole job, within a
// timeout, instead of leaving the other replica waiting in the next step's all-reduce; the run then resumes from
// the checkpoint of step 4 on two replicas and finishes. Runs `mpiexec -n 2 longmoe train` itself, so only when
// this binary runs alone.
TEST(DataParallel, AReplicaThatDiesEndsTheJob) {
#ifndef LONGMOE_MPIEXEC
  GTEST_SKIP() << "built without MPI";
#else
  if (dist::world().size() > 1) GTEST_SKIP() << "runs its own mpiexec (only from a single-process run)";
  const fs::path root = fs::path(::testing::TempDir()) / "lm_dp_dies";
  fs::remove_all(root);
  RunConfig c = tiny::tiny_run(root, (root / "run").string());
  c.parallel.dp = 2;
  lm::io::write_file_atomic((root / "run.json").string(), c.to_json().dump());
  // (LeakSanitizer off in the replicas, as for the other MPI tests: OpenMPI keeps allocations past MPI_Finalize)
  const std::string mpi = std::string("ASAN_OPTIONS=detect_leaks=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 120 ") +
                          LONGMOE_MPIEXEC + " -n 2 --oversubscribe " + LONGMOE_BINARY + " --threads 1 train --quiet ";
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = std::system(("LONGMOE_CRASH_IN_SAVE_AT_STEP=8 " + mpi + "--config " + (root / "run.json").string() +
                              " > " + (root / "log").string() + " 2>&1")
                                 .c_str());
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ measure  ] rank 0 aborted at step 8: the job ended after %.1f s with status %d\n", took, rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(WEXITSTATUS(rc), 124) << "the job hung until the timeout";
  EXPECT_LT(took, 100);
  EXPECT_TRUE(fs::exists(root / "run" / "ckpt" / "step-00000004"));
  EXPECT_EQ(std::system((mpi + "--resume --config " + (root / "run.json").string() + " > /dev/null 2>&1").c_str()), 0);
  EXPECT_TRUE(fs::exists(root / "run" / "summary.json"));
#endif
}
