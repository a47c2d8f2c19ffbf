// comm/comm_loopback.cpp on device buffers, ranks as threads sharing the device: a ring with starts, a pair exchanging
// both ways, messages waited out of order arriving in order, a recv's data read on another stream after
// wait_on_stream with no host wait between, a count mismatch and a silent peer reported by name, and a host comm of
// another process refused. Runs on the emulator in every build (with concurrent streams too, where only the events
// order the copies against the streams that read them) and on a GPU where one is visible.
#if TUNA_CUDA
#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

float element(int from, int64_t m, int64_t i) { return static_cast<float>(from * 100000 + m * 1000 + i % 997); }

// Runs body(device comm, compute stream) on `size` threads, each with a comm stream and a compute stream of its own
// and a loopback comm over a LocalComm group.
void on_device_threads(int size, double timeout_s, const std::function<void(Comm&, cudaStream_t)>& body) {
  std::vector<std::unique_ptr<Comm>> hosts = make_local_comms(size, timeout_s);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; r++)
    threads.emplace_back([&, r] {
      try {
        cudaStream_t comm_stream, compute;
        TUNA_CUDA_CHECK(cudaStreamCreate(&comm_stream));
        TUNA_CUDA_CHECK(cudaStreamCreate(&compute));
        {
          std::unique_ptr<Comm> device = make_loopback_device_comm(std::move(hosts[r]), comm_stream, timeout_s);
          EXPECT_EQ(device->backend(), "loopback");
          body(*device, compute);
        }
        TUNA_CUDA_CHECK(cudaStreamDestroy(compute));
        TUNA_CUDA_CHECK(cudaStreamDestroy(comm_stream));
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    });
  for (std::thread& t : threads) t.join();
}

TEST(CommLoopbackGpu, PointToPointOnDeviceBuffers) {
  TUNA_REQUIRE_GPU();
  on_device_threads(3, 60, [](Comm& c, cudaStream_t compute) {
    const int P = c.size(), next = (c.rank() + 1) % P, prev = (c.rank() + P - 1) % P;
    // A ring, recv started before send; the recv's data read on the compute stream after wait_on_stream, before the
    // host waits for anything.
    for (int64_t n : {int64_t(1), int64_t(4099)}) {
      std::vector<float> host(n);
      for (int64_t i = 0; i < n; i++) host[i] = element(c.rank(), 0, i);
      DeviceBuffer<float> out(host), in(n), copy(n);
      in.poison(), copy.poison();
      CommRequest r = c.recv_start(in.get(), n, CommType::F32, prev, "test ring");
      CommRequest s = c.send_start(out.get(), n, CommType::F32, next, "test ring");
      c.wait_on_stream(r, compute);
      TUNA_CUDA_CHECK(cudaMemcpyAsync(copy.get(), in.get(), n * sizeof(float), cudaMemcpyDeviceToDevice, compute));
      c.wait(s);
      c.wait(r);
      const std::vector<float> got = copy.download();
      for (int64_t i = 0; i < n; i++) ASSERT_EQ(got[i], element(prev, 0, i)) << "n " << n << " i " << i;
    }
    // Ranks 0 and 1 exchange both ways (send waited first), then rank 0 sends 20 messages that rank 1 waits for
    // last to first.
    if (c.rank() > 1) return;
    const int peer = 1 - c.rank();
    std::vector<float> mine(1000);
    for (int64_t i = 0; i < 1000; i++) mine[i] = element(c.rank(), 1, i);
    DeviceBuffer<float> out(mine), in(1000);
    CommRequest s = c.send_start(out.get(), 1000, CommType::F32, peer, "test exchange");
    CommRequest r = c.recv_start(in.get(), 1000, CommType::F32, peer, "test exchange");
    c.wait(s);
    c.wait(r);
    const std::vector<float> theirs = in.download();
    for (int64_t i = 0; i < 1000; i++) ASSERT_EQ(theirs[i], element(peer, 1, i)) << i;
    const int kMessages = 20;
    std::vector<std::unique_ptr<DeviceBuffer<float>>> buffers;
    std::vector<CommRequest> requests;
    for (int m = 0; m < kMessages; m++) {
      std::vector<float> h(10 + m);
      for (int64_t i = 0; i < 10 + m; i++) h[i] = element(0, m, i);
      buffers.push_back(std::make_unique<DeviceBuffer<float>>(h));
      if (c.rank() == 1) buffers.back()->poison();
      requests.push_back(c.rank() == 0 ? c.send_start(buffers[m]->get(), 10 + m, CommType::F32, 1, "test order")
                                       : c.recv_start(buffers[m]->get(), 10 + m, CommType::F32, 0, "test order"));
    }
    for (int m = kMessages - 1; m >= 0; m--) c.wait(requests[m]);
    for (int m = 0; m < kMessages; m++) {
      const std::vector<float> got = buffers[m]->download();
      for (int64_t i = 0; i < 10 + m; i++) ASSERT_EQ(got[i], element(0, m, i)) << "message " << m << " i " << i;
    }
  });
}

// The collectives go through host staging: one reduce-scatter and a broadcast stand for them here (the staged comm's
// own tests cover the rest).
TEST(CommLoopbackGpu, CollectivesAreStaged) {
  TUNA_REQUIRE_GPU();
  on_device_threads(2, 60, [](Comm& c, cudaStream_t) {
    DeviceBuffer<float> in(std::vector<float>{1.0f + c.rank(), 2.0f, 3.0f}), out(2);
    c.reduce_scatter(in.get(), out.get(), 3, "test rs");
    const std::vector<float> got = out.download();
    if (c.rank() == 0) EXPECT_EQ(got, (std::vector<float>{3.0f, 4.0f}));
    else EXPECT_EQ(got[0], 6.0f);
    DeviceBuffer<float> b(std::vector<float>{static_cast<float>(c.rank() + 5)});
    c.broadcast(b.get(), sizeof(float), 1, "test broadcast");
    EXPECT_EQ(b.download()[0], 6.0f);
  });
}

TEST(CommLoopbackGpu, CountMismatchAndSilentPeerAreReported) {
  TUNA_REQUIRE_GPU();
  std::vector<std::string> errors(3);
  on_device_threads(2, 0.5, [&](Comm& c, cudaStream_t) {
    DeviceBuffer<float> buf(8);
    if (c.rank() == 0) {
      c.send(buf.get(), 5, CommType::F32, 1, "test short");
      try {
        c.recv(buf.get(), 8, CommType::F32, 1, "activations");  // rank 1 never sends
      } catch (const Error& e) {
        errors[0] = e.what();
      }
      try {
        c.send(buf.get(), 8, CommType::F32, 1, "gradients");  // nor receives
      } catch (const Error& e) {
        errors[2] = e.what();
      }
    } else {
      try {
        c.recv(buf.get(), 8, CommType::F32, 0, "test short");
      } catch (const Error& e) {
        errors[1] = e.what();
      }
    }
  });
  EXPECT_NE(errors[0].find("rank 0 of 2 (loopback): recv 'activations' (8 elements from rank 1) did not complete within "
                           "0.5 s (--comm_timeout): rank 1 did not send it"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("sent 5 elements"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("expects 8"), std::string::npos) << errors[1];
  EXPECT_NE(errors[2].find("send 'gradients' (8 elements to rank 1) did not complete within 0.5 s (--comm_timeout): "
                           "rank 1 did not post the matching recv"),
            std::string::npos)
      << errors[2];
}

// Ranks in other processes share no rendezvous: refused by name.
TEST(CommLoopbackGpu, RefusesAHostCommOfAnotherKind) {
  TUNA_REQUIRE_GPU();
  try {
    make_loopback_device_comm(make_single_comm(), nullptr, 1);
    ADD_FAILURE() << "a loopback comm over a single comm";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the loopback device comm is for ranks as threads of one process"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace tuna::test

#endif  // TUNA_CUDA
