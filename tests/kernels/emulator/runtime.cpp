// tests/kernels/emulator/runtime.cpp — the streams of the emulated runtime (runtime.h, "streams"): in order, or each
// stream on a host thread of its own with events and the legacy default stream as the only order between them,
// and the copies and memsets queued on them. Apart from the header so that the emulated objects, which all include
// runtime.h, need not be rebuilt when this changes.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <random>
#include <thread>

#include "tests/kernels/emulator/runtime.h"

namespace tuna::emulator {

namespace {

double host_milliseconds() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct QueuedWork {
  std::function<void()> work;    // empty: an event's record or a wait
  std::vector<MarkerPtr> waits;  // runs once these are done
  MarkerPtr done;
};

}  // namespace

struct StreamQueue {
  std::deque<QueuedWork> queue;
  MarkerPtr tail;  // the last queued piece's: done when the stream is idle
  bool blocking = true, stopping = false;
  std::mt19937_64 random;
  std::thread thread;
};

namespace {

struct Streams {
  std::mutex mutex;
  std::condition_variable changed;  // any piece done, any piece queued
  StreamOrder order;
  uint64_t created = 0;             // streams so far (each one's jitter draws from the seed and its number)
  std::vector<StreamQueue*> live;   // concurrent streams not destroyed, the legacy default stream's included
  StreamQueue* legacy = nullptr;    // the legacy default stream's (stream 0), made at its first use
  std::exception_ptr failure;       // the first exception of queued work, not yet reported
};
// Never destroyed: the legacy default stream's thread lives to the end of the process.
Streams& streams() {
  static Streams* instance = new Streams;
  return *instance;
}

void run_stream(StreamQueue* q) {
  Streams& s = streams();
  std::uniform_int_distribution<int> delay(-200, 200);  // microseconds; below 0: none
  std::unique_lock<std::mutex> lock(s.mutex);
  for (;;) {
    s.changed.wait(lock, [&] { return !q->queue.empty() || q->stopping; });
    if (q->queue.empty()) return;
    // A deque's front stays where it is while other threads queue behind it.
    const std::vector<MarkerPtr>& waits = q->queue.front().waits;
    s.changed.wait(lock, [&] { return std::all_of(waits.begin(), waits.end(), [](const MarkerPtr& m) { return m->done; }); });
    QueuedWork piece = std::move(q->queue.front());
    q->queue.pop_front();
    const bool skip = s.failure != nullptr;
    const int sleep_us = s.order.jitter ? delay(q->random) : 0;
    lock.unlock();
    if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    std::exception_ptr error;
    if (piece.work && !skip) {
      try {
        ApiGuard guard(api_lock());
        piece.work();
      } catch (...) {
        error = std::current_exception();
      }
    }
    lock.lock();
    if (error && !s.failure) s.failure = error;
    piece.done->milliseconds = host_milliseconds();
    piece.done->done = true;
    s.changed.notify_all();
  }
}

// The caller holds s.mutex.
StreamQueue* start_stream_queue(bool blocking) {
  Streams& s = streams();
  auto* q = new StreamQueue;
  q->blocking = blocking;
  q->random.seed(s.order.jitter_seed * 0x9E3779B97F4A7C15ull + ++s.created);
  q->thread = std::thread(run_stream, q);
  s.live.push_back(q);
  return q;
}

// The queue that runs a stream's work; null when it runs in order.
StreamQueue* queue_of(cudaStream_t stream) {
  if (stream != nullptr) return stream->queue;
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.order.concurrent) return nullptr;
  if (s.legacy == nullptr) s.legacy = start_stream_queue(/*blocking=*/true);
  return s.legacy;
}

MarkerPtr done_marker() {
  auto m = std::make_shared<Marker>();
  m->done = true, m->milliseconds = host_milliseconds();
  return m;
}

}  // namespace

StreamQueue* make_stream_queue(bool blocking) {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.order.concurrent ? start_stream_queue(blocking) : nullptr;
}

void destroy_stream_queue(StreamQueue* q) {
  Streams& s = streams();
  MarkerPtr tail;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    tail = q->tail;
  }
  wait_for({tail}, /*quietly=*/true);
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    q->stopping = true;
    s.live.erase(std::find(s.live.begin(), s.live.end(), q));
    if (q == s.legacy) s.legacy = nullptr;
    s.changed.notify_all();
  }
  q->thread.join();
  delete q;
}

MarkerPtr enqueue(cudaStream_t stream, std::function<void()> work, std::vector<MarkerPtr> waits) {
  StreamQueue* q = queue_of(stream);
  if (q == nullptr) {
    if (work) {
      ApiGuard guard(api_lock());
      work();
    }
    return done_marker();
  }
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  // The legacy default stream waits for the blocking streams' earlier work, and they for its (CUDA's implicit
  // synchronization; streams made with cudaStreamNonBlocking take no part).
  if (q == s.legacy) {
    for (StreamQueue* other : s.live)
      if (other != q && other->blocking && other->tail) waits.push_back(other->tail);
  } else if (q->blocking && s.legacy != nullptr && s.legacy->tail) {
    waits.push_back(s.legacy->tail);
  }
  q->queue.push_back({std::move(work), std::move(waits), std::make_shared<Marker>()});
  q->tail = q->queue.back().done;
  s.changed.notify_all();
  return q->tail;
}

void wait_for(const std::vector<MarkerPtr>& markers, bool quietly) {
  Streams& s = streams();
  std::unique_lock<std::mutex> lock(s.mutex);
  const auto all_done = [&] {
    return std::all_of(markers.begin(), markers.end(), [](const MarkerPtr& m) { return m == nullptr || m->done; });
  };
  if (!all_done()) {
    TUNA_CHECK(api_lock_depth() == 0, "the emulated runtime would wait for a stream while this thread holds its lock, "
               "which that stream's thread needs");
    s.changed.wait(lock, all_done);
  }
  if (quietly || !s.failure) return;
  std::exception_ptr failure = s.failure;
  s.failure = nullptr;
  lock.unlock();
  std::rethrow_exception(failure);
}

bool is_done(const MarkerPtr& marker) {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  return marker == nullptr || marker->done;
}

MarkerPtr stream_tail(cudaStream_t stream) {
  StreamQueue* q = queue_of(stream);
  if (q == nullptr) return nullptr;
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  return q->tail;
}

std::vector<MarkerPtr> every_stream_tail() {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<MarkerPtr> tails;
  for (StreamQueue* q : s.live) tails.push_back(q->tail);
  return tails;
}

void set_stream_order(bool concurrent, bool jitter, uint64_t jitter_seed) {
  Streams& s = streams();
  StreamQueue* legacy = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    legacy = s.legacy;
  }
  if (legacy != nullptr) destroy_stream_queue(legacy);
  std::lock_guard<std::mutex> lock(s.mutex);
  s.order = {concurrent, concurrent && jitter, jitter_seed};
}

StreamOrder stream_order() {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.order;
}

MarkerPtr hold_stream(cudaStream_t stream) {
  auto gate = std::make_shared<Marker>();
  enqueue(stream, {}, {gate});
  return gate;
}

void release(const MarkerPtr& gate) {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  gate->done = true;
  s.changed.notify_all();
}

cudaError_t copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                    cudaMemcpyKind kind, cudaStream_t stream, bool synchronous) {
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) return record(cudaErrorInvalidMemcpyDirection);
  if (width > dpitch || width > spitch) return record(cudaErrorInvalidPitchValue);
  if (width == 0 || height == 0) return cudaSuccess;
  const size_t dst_span = (height - 1) * dpitch + width, src_span = (height - 1) * spitch + width;
  bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyDefault) dst_device = in_device_allocation(dst, 1), src_device = in_device_allocation(src, 1);
  if ((dst_device && !in_device_allocation(dst, dst_span)) || (src_device && !in_device_allocation(src, src_span)))
    return record(cudaErrorInvalidValue);
  const bool staged = !src_device && !in_pinned_allocation(src);
  std::shared_ptr<std::vector<char>> staging;  // pageable: read now, kept until the copy runs
  if (staged && queue_of(stream) != nullptr) {
    staging = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + src_span);
    src = staging->data();
  }
  const MarkerPtr done = enqueue(stream, [=, keep = std::move(staging)] {
    (void)keep;  // the staged source lives as long as the copy
    for (size_t r = 0; r < height; ++r)
      std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
  });
  if (synchronous && !(src_device && dst_device) && !(staged && dst_device)) wait_for({done});
  return cudaSuccess;
}

cudaError_t set_bytes(void* p, int value, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (!in_device_allocation(p, bytes)) return record(cudaErrorInvalidValue);
  enqueue(stream, [=] { std::memset(p, value, bytes); });
  return cudaSuccess;
}

}  // namespace tuna::emulator
