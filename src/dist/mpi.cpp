// The MPI communicator (comm.hpp) over MPI_COMM_WORLD; without MPI at build time, make_mpi() throws.
#include "dist/comm.hpp"

#include <memory>

#include "core/error.hpp"

#ifdef LONGMOE_HAVE_MPI
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#endif

namespace lm::dist {

#ifndef LONGMOE_HAVE_MPI

bool built_with_mpi() { return false; }
std::unique_ptr<Comm> make_mpi() { throw Error("longmoe was built without MPI"); }
void mpi_abort(int) {}

#else

bool built_with_mpi() { return true; }

namespace {

void ok(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw Error(fmt::format("MPI {} failed: {}", what, std::string(msg, static_cast<size_t>(len))));
}

// MPI counts are int: larger messages go in pieces of at most 1 GiB.
constexpr size_t kPiece = size_t(1) << 30;

// Requests of one non-blocking collective (one per piece of a large message).
class MpiPending final : public Pending {
 public:
  std::vector<MPI_Request> reqs;
  const char* what = "";
  bool done = false;
  ~MpiPending() override {
    if (!done) MPI_Waitall(int(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE);
  }
  bool test() override {
    if (done) return true;
    int flag = 0;
    ok(MPI_Testall(int(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE), what);
    return done = flag != 0;
  }
  void wait() override {
    if (done) return;
    done = true;  // (even when it fails: the destructor must not wait again)
    ok(MPI_Waitall(int(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE), what);
  }
};

// The thread support MPI_Init_thread gave (MPI_THREAD_MULTIPLE asked for).
int g_thread_level = MPI_THREAD_SINGLE;

// A thread that runs one communicator's non-blocking reductions, in the order they were started, as blocking ones on
// a duplicate of it: they then proceed while the caller computes (MPI moves its own non-blocking collectives on only
// inside MPI calls, which a computing thread makes too seldom), and never mix with the caller's own collectives.
// Needs MPI_THREAD_MULTIPLE.
class Worker {
 public:
  struct State {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    std::string error;
  };
  explicit Worker(MPI_Comm c) {
    ok(MPI_Comm_dup(c, &c_), "comm dup");
    MPI_Comm_set_errhandler(c_, MPI_ERRORS_RETURN);
    thread_ = std::thread([this] { loop(); });
  }
  ~Worker() {
    {
      const std::lock_guard<std::mutex> g(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) MPI_Comm_free(&c_);
  }
  std::shared_ptr<State> all_reduce(float* x, size_t n) {
    auto st = std::make_shared<State>();
    {
      const std::lock_guard<std::mutex> g(m_);
      jobs_.push_back({x, n, st});
    }
    cv_.notify_all();
    return st;
  }

 private:
  struct Job {
    float* x;
    size_t n;
    std::shared_ptr<State> st;
  };
  void loop() {
    for (;;) {
      Job j;
      {
        std::unique_lock<std::mutex> l(m_);
        cv_.wait(l, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        j = jobs_.front();
        jobs_.pop_front();
      }
      std::string error;
      try {
        const size_t per = kPiece / sizeof(float);
        for (size_t o = 0; o < j.n; o += per)
          ok(MPI_Allreduce(MPI_IN_PLACE, j.x + o, int(std::min(per, j.n - o)), MPI_FLOAT, MPI_SUM, c_),
             "non-blocking all_reduce");
      } catch (const Error& e) {
        error = e.what();
      }
      {
        const std::lock_guard<std::mutex> g(j.st->m);
        j.st->done = true, j.st->error = error;
      }
      j.st->cv.notify_all();
    }
  }
  MPI_Comm c_ = MPI_COMM_NULL;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

class WorkerPending final : public Pending {
 public:
  explicit WorkerPending(std::shared_ptr<Worker::State> st) : st_(std::move(st)) {}
  ~WorkerPending() override {
    std::unique_lock<std::mutex> l(st_->m);
    st_->cv.wait(l, [&] { return st_->done; });
  }
  bool test() override {
    const std::lock_guard<std::mutex> g(st_->m);
    return st_->done;
  }
  void wait() override {
    std::unique_lock<std::mutex> l(st_->m);
    st_->cv.wait(l, [&] { return st_->done; });
    if (!st_->error.empty()) throw Error(st_->error);
  }

 private:
  std::shared_ptr<Worker::State> st_;
};

class Mpi final : public Comm {
 public:
  // A communicator split from another one (freed with this object).
  explicit Mpi(MPI_Comm c) : c_(c), owned_(true) {
    MPI_Comm_set_errhandler(c_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(c_, &rank_);
    MPI_Comm_size(c_, &size_);
  }
  ~Mpi() override {
    worker_.reset();
    int fin = 0;
    MPI_Finalized(&fin);
    if (owned_ && !fin) MPI_Comm_free(&c_);
  }
  Mpi() {
    int inited = 0;
    MPI_Initialized(&inited);
    if (inited) MPI_Query_thread(&g_thread_level);
    if (!inited) {
      ok(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &g_thread_level), "init");
      std::atexit([] {
        int fin = 0;
        MPI_Finalized(&fin);
        if (!fin) MPI_Finalize();
      });
    }
    // Errors come back as return codes (and become lm::Error) instead of aborting inside MPI.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  Mpi(const Mpi&) = delete;
  Mpi& operator=(const Mpi&) = delete;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return fmt::format("MPI ({} ranks)", size_); }

  // On a thread of its own where MPI allows it (collective on first use: the duplicate communicator), else
  // MPI_Iallreduce, which moves on only inside this process's later MPI calls (Pending::test).
  std::unique_ptr<Pending> iall_reduce_sum(float* x, size_t n) override {
    if (g_thread_level >= MPI_THREAD_MULTIPLE) {
      if (!worker_) worker_ = std::make_unique<Worker>(c_);
      return std::make_unique<WorkerPending>(worker_->all_reduce(x, n));
    }
    auto p = std::make_unique<MpiPending>();
    p->what = "non-blocking all_reduce";
    const size_t per = kPiece / sizeof(float);
    for (size_t o = 0; o < n; o += per) {
      p->reqs.emplace_back();
      ok(MPI_Iallreduce(MPI_IN_PLACE, x + o, int(std::min(per, n - o)), MPI_FLOAT, MPI_SUM, c_, &p->reqs.back()),
         p->what);
    }
    return p;
  }
  std::unique_ptr<Comm> split(int color, int key) override {
    MPI_Comm c = MPI_COMM_NULL;
    ok(MPI_Comm_split(c_, color, key, &c), "comm split");
    return std::make_unique<Mpi>(c);
  }

  void all_reduce_sum(float* x, size_t n) override { reduce(x, n, MPI_FLOAT, sizeof(float)); }
  void all_reduce_sum(double* x, size_t n) override { reduce(x, n, MPI_DOUBLE, sizeof(double)); }
  void all_reduce_sum(int64_t* x, size_t n) override { reduce(x, n, MPI_INT64_T, sizeof(int64_t)); }

  void all_gather(const void* send, size_t bytes, void* recv) override {
    LM_CHECK(bytes <= INT_MAX, "all_gather: {} bytes per rank is more than one MPI message", bytes);
    ok(MPI_Allgather(send, int(bytes), MPI_BYTE, recv, int(bytes), MPI_BYTE, c_), "all_gather");
  }
  std::vector<char> all_gather_v(const void* send, size_t bytes) override {
    LM_CHECK(bytes <= INT_MAX, "all_gather_v: {} bytes is more than one MPI message", bytes);
    const int mine = int(bytes);
    const auto R = static_cast<size_t>(size_);
    std::vector<int> counts(R), displs(R);
    ok(MPI_Allgather(&mine, 1, MPI_INT, counts.data(), 1, MPI_INT, c_), "all_gather_v sizes");
    size_t total = 0;
    for (int r = 0; r < size_; ++r) {
      LM_CHECK(total + size_t(counts[size_t(r)]) <= INT_MAX, "all_gather_v: more than one MPI message in all");
      displs[size_t(r)] = int(total);
      total += size_t(counts[size_t(r)]);
    }
    std::vector<char> out(total);
    ok(MPI_Allgatherv(send, mine, MPI_BYTE, out.data(), counts.data(), displs.data(), MPI_BYTE, c_),
       "all_gather_v");
    return out;
  }
  void reduce_scatter_sum(const float* send, float* recv, size_t n) override {
    LM_CHECK(n <= INT_MAX, "reduce_scatter: {} elements per rank is more than one MPI message", n);
    ok(MPI_Reduce_scatter_block(send, recv, int(n), MPI_FLOAT, MPI_SUM, c_), "reduce_scatter");
  }
  void all_to_all_v(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                    const std::vector<size_t>& recv_bytes) override {
    LM_CHECK(send_bytes.size() == size_t(size_) && recv_bytes.size() == size_t(size_),
             "all_to_all_v: {} send and {} receive sizes for {} ranks", send_bytes.size(), recv_bytes.size(), size_);
    const auto R = static_cast<size_t>(size_);
    std::vector<int> sc(R), sd(R), rc(R), rd(R);
    size_t so = 0, ro = 0;
    for (size_t r = 0; r < R; ++r) {
      LM_CHECK(so + send_bytes[r] <= INT_MAX && ro + recv_bytes[r] <= INT_MAX,
               "all_to_all_v: more than one MPI message");
      sc[r] = int(send_bytes[r]), sd[r] = int(so), rc[r] = int(recv_bytes[r]), rd[r] = int(ro);
      so += send_bytes[r], ro += recv_bytes[r];
    }
    ok(MPI_Alltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(), MPI_BYTE, c_),
       "all_to_all_v");
  }
  void broadcast(void* x, size_t bytes, int root) override {
    LM_CHECK(root >= 0 && root < size_, "broadcast: root {} of {} ranks", root, size_);
    for (size_t o = 0; o < bytes; o += kPiece)
      ok(MPI_Bcast(static_cast<char*>(x) + o, int(std::min(kPiece, bytes - o)), MPI_BYTE, root, c_),
         "broadcast");
  }
  void barrier() override { ok(MPI_Barrier(c_), "barrier"); }

 private:
  void reduce(void* x, size_t n, MPI_Datatype t, size_t esize) {
    const size_t per = kPiece / esize;
    for (size_t o = 0; o < n; o += per)
      ok(MPI_Allreduce(MPI_IN_PLACE, static_cast<char*>(x) + o * esize, int(std::min(per, n - o)), t, MPI_SUM, c_),
         "all_reduce");
  }
  MPI_Comm c_ = MPI_COMM_WORLD;
  bool owned_ = false;
  std::unique_ptr<Worker> worker_;  // (iall_reduce_sum)
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Comm> make_mpi() { return std::make_unique<Mpi>(); }
void mpi_abort(int code) { MPI_Abort(MPI_COMM_WORLD, code); }

#endif

}  // namespace lm::dist
