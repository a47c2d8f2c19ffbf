// comm/comm_staged.cpp on device buffers, ranks as threads (LocalComm as the host comm, one stream each):
// reduce-scatter in fp32 and bf16; point to point: a ring with starts, a pair exchanging both ways, messages waited
// out of order arriving in order, a count mismatch and a silent peer reported through the host comm. Runs on the
// emulator in every build and on a GPU where one is visible.
#if TUNA_CUDA
#include <cuda_runtime_api.h>

#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "tests/comm/comm_checks.h"
#include "tests/kernels/gpu_test_util.h"

namespace tuna::test {
namespace {

float element(int from, int64_t m, int64_t i) { return static_cast<float>(from * 100000 + m * 1000 + i % 997); }

// Runs body(device comm) on `size` threads, each with its own stream and staged comm over a LocalComm group.
void on_device_threads(int size, double timeout_s, const std::function<void(Comm&)>& body) {
  std::vector<std::unique_ptr<Comm>> hosts = make_local_comms(size, timeout_s);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; r++)
    threads.emplace_back([&, r] {
      try {
        cudaStream_t stream;
        TUNA_CUDA_CHECK(cudaStreamCreate(&stream));
        {
          std::unique_ptr<Comm> device = make_staged_device_comm(std::move(hosts[r]), stream);
          body(*device);
        }
        TUNA_CUDA_CHECK(cudaStreamDestroy(stream));
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    });
  for (std::thread& t : threads) t.join();
}

TEST(CommStagedGpu, PointToPointOnDeviceBuffers) {
  TUNA_REQUIRE_GPU();
  on_device_threads(3, 60, [](Comm& c) {
    const int P = c.size(), next = (c.rank() + 1) % P, prev = (c.rank() + P - 1) % P;
    // A ring, recv started before send.
    for (int64_t n : {int64_t(1), int64_t(4099)}) {
      std::vector<float> host(n);
      for (int64_t i = 0; i < n; i++) host[i] = element(c.rank(), 0, i);
      DeviceBuffer<float> out(host), in(n);
      in.poison();
      CommRequest r = c.recv_start(in.get(), n, CommType::F32, prev, "test ring");
      CommRequest s = c.send_start(out.get(), n, CommType::F32, next, "test ring");
      c.wait(s);
      c.wait(r);
      const std::vector<float> got = in.download();
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

// Reduce-scatter of device buffers in fp32 and bf16 (widened on the host, each piece rounded once) at sizes that
// leave ranks short or empty, each piece written and nothing past it.
TEST(CommStagedGpu, ReduceScatterOfDeviceBuffersInFp32AndBf16) {
  TUNA_REQUIRE_GPU();
  on_device_threads(3, 60, [](Comm& c) {
    const int P = c.size();
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(2), int64_t(P + 1), int64_t(100003)}) {
      const Range mine = shard_range(n, c.rank(), P);
      std::vector<float> f(n);
      std::vector<uint16_t> b(n);
      for (int64_t i = 0; i < n; i++) {
        f[i] = comm_checks::value(c.rank(), i);
        b[i] = f32_to_bf16(comm_checks::bf16_value(c.rank(), i));
      }
      DeviceBuffer<float> f_in(f), f_out(mine.size() + 1);
      DeviceBuffer<uint16_t> b_in(b), b_out(mine.size() + 1);
      f_out.poison(), b_out.poison();
      c.reduce_scatter(f_in.get(), f_out.get(), n, "test rs f32");
      c.reduce_scatter(b_in.get(), b_out.get(), n, CommType::BF16, "test rs bf16");
      const std::vector<float> got_f = f_out.download();
      const std::vector<uint16_t> got_b = b_out.download();
      for (int64_t i = 0; i < mine.size(); i++) {
        double sum_f = 0, sum_b = 0;
        for (int r = 0; r < P; r++)
          sum_f += comm_checks::value(r, mine.begin + i), sum_b += comm_checks::bf16_value(r, mine.begin + i);
        ASSERT_EQ(got_f[i], static_cast<float>(sum_f)) << "n " << n << " i " << i;
        ASSERT_EQ(got_b[i], f32_to_bf16(static_cast<float>(sum_b))) << "n " << n << " i " << i;
      }
      EXPECT_TRUE(std::isnan(got_f[mine.size()])) << "n " << n << ": wrote past its fp32 piece";
      EXPECT_EQ(got_b[mine.size()], 0xffff) << "n " << n << ": wrote past its bf16 piece";
    }
  });
}

TEST(CommStagedGpu, CountMismatchAndSilentPeerAreReported) {
  TUNA_REQUIRE_GPU();
  std::vector<std::string> errors(2);
  on_device_threads(2, 0.5, [&](Comm& c) {
    DeviceBuffer<float> buf(8);
    if (c.rank() == 0) {
      c.send(buf.get(), 5, CommType::F32, 1, "test short");
      try {
        c.recv(buf.get(), 8, CommType::F32, 1, "activations");  // rank 1 never sends
      } catch (const Error& e) {
        errors[0] = e.what();
      }
    } else {
      try {
        c.recv(buf.get(), 8, CommType::F32, 0, "test short");
      } catch (const Error& e) {
        errors[1] = e.what();
      }
    }
  });
  EXPECT_NE(errors[0].find("rank 0 of 2 (threads): recv 'activations' (8 elements from rank 1) did not complete"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("sent 5 elements"), std::string::npos) << errors[1];
  EXPECT_NE(errors[1].find("expects 8"), std::string::npos) << errors[1];
}

}  // namespace
}  // namespace tuna::test

#endif  // TUNA_CUDA
