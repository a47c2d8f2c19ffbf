// What prepare needs from its peers when it runs as several processes (mpirun): one collective, a gather
// to all of byte strings of uneven lengths. Kept this small so that the single-process run is the same code
// with a one-member group. The implementation for mpirun (data/prepare_comm.cpp) sits on comm/comm.h's
// Comm, which owns MPI: no MPI call in data/.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace tuna {

class PrepareComm {
 public:
  virtual ~PrepareComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every member's bytes (any length, 0 too), concatenated in rank order, on every member. *lengths, when
  // given, receives each member's length.
  virtual std::vector<char> all_gather(const void* data, size_t bytes, std::vector<uint64_t>* lengths = nullptr) = 0;
  // Stops the whole group after a fatal error on one member (MPI_Abort); the local group just returns.
  virtual void abort(int code) {}

  // Typed convenience over all_gather.
  template <typename T>
  std::vector<T> all_gather_values(const std::vector<T>& values) {
    std::vector<char> bytes = all_gather(values.data(), values.size() * sizeof(T));
    std::vector<T> out(bytes.size() / sizeof(T));
    if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
    return out;
  }
  template <typename T>
  std::vector<T> all_gather_value(const T& value) {
    return all_gather_values(std::vector<T>{value});
  }
};

// The group of one: this process alone.
class LocalComm : public PrepareComm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::vector<char> all_gather(const void* data, size_t bytes, std::vector<uint64_t>* lengths) override {
    if (lengths) *lengths = {bytes};
    const char* p = static_cast<const char*>(data);
    return std::vector<char>(p, p + bytes);
  }
};

// When this process is one of several started by mpirun or srun (comm/comm.h: detect_launch), the world as a
// PrepareComm (MPI initialized now, finalized when it is destroyed); otherwise null.
std::unique_ptr<PrepareComm> world_prepare_comm_if_launched();

}  // namespace tuna
