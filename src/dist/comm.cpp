// The single-process communicator and the choice of the job's communicator (comm.hpp); MPI's is mpi.cpp.
#include "dist/comm.hpp"

#include <cstdlib>
#include <cstring>
#include <memory>

#include "core/error.hpp"

namespace lm::dist {

namespace {

class Done final : public Pending {
 public:
  bool test() override { return true; }
  void wait() override {}
};

class Single final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "single process"; }
  void all_reduce_sum(float*, size_t) override {}
  void all_reduce_sum(double*, size_t) override {}
  void all_reduce_sum(int64_t*, size_t) override {}
  void all_gather(const void* send, size_t bytes, void* recv) override {
    if (bytes) std::memmove(recv, send, bytes);
  }
  std::vector<char> all_gather_v(const void* send, size_t bytes) override {
    const char* s = static_cast<const char*>(send);
    return std::vector<char>(s, s + bytes);
  }
  void reduce_scatter_sum(const float* send, float* recv, size_t n) override {
    if (n) std::memmove(recv, send, n * sizeof(float));
  }
  void all_to_all_v(const void* send, const std::vector<size_t>& send_bytes, void* recv,
                    const std::vector<size_t>& recv_bytes) override {
    LM_CHECK(send_bytes.size() == 1 && recv_bytes.size() == 1 && send_bytes[0] == recv_bytes[0],
             "all_to_all_v: one rank sends itself what it receives");
    if (send_bytes[0]) std::memmove(recv, send, send_bytes[0]);
  }
  void broadcast(void*, size_t, int root) override { LM_CHECK(root == 0, "broadcast: root {} of 1 rank", root); }
  void barrier() override {}
  std::unique_ptr<Comm> split(int, int) override { return std::make_unique<Single>(); }
};

bool launched_by_mpi() { return std::getenv("OMPI_COMM_WORLD_SIZE") || std::getenv("PMI_SIZE"); }

}  // namespace

std::unique_ptr<Pending> Comm::iall_reduce_sum(float* x, size_t n) {
  all_reduce_sum(x, n);
  return std::make_unique<Done>();
}

std::unique_ptr<Comm> Comm::split(int, int) {
  if (size() == 1) return std::make_unique<Single>();
  throw Error(fmt::format("{} cannot be split into groups", name()));
}

std::unique_ptr<Comm> make_mpi();  // mpi.cpp
void mpi_abort(int code);          // mpi.cpp

Comm& single() {
  static Single s;
  return s;
}

Comm& world() {
  static std::unique_ptr<Comm> w = [] {
    if (!launched_by_mpi()) return std::unique_ptr<Comm>();
    LM_CHECK(built_with_mpi(), "this process was started by an MPI launcher, but longmoe was built without MPI "
             "(install libopenmpi-dev and rebuild)");
    return make_mpi();
  }();
  return w ? *w : single();
}

void abort_job(int code) {
  if (launched_by_mpi() && built_with_mpi() && world().size() > 1) mpi_abort(code);
}

}  // namespace lm::dist
