// Timeline: what a simulated or measured step looked like — per device, per stream, op spans with
// start and end times, plus memory over time. Reports, Chrome traces and the GUI are functions of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "piper/core/program.hpp"

namespace piper::core {

// One executed op: it points into program->plan_for(device).streams[stream].ops[index].
struct OpSpan {
  std::int32_t stream = 0;
  std::int32_t index = 0;
  double start_s = 0;
  double end_s = 0;
};

// Device memory in use from `time_s` on (bytes), with the part held by each BufferKind.
struct MemorySample {
  double time_s = 0;
  std::int64_t bytes = 0;
};

// A vector that copies share until one of them is written (copy on write). Devices of one symmetry
// class have equal spans and memory samples (sim/symmetry.hpp): expanding a reduced simulation to
// 131,072 devices shares the representatives' vectors instead of copying gigabytes. Reading goes
// through the const interface (or the implicit `const std::vector<T>&`); any non-const access first
// takes a private copy if the storage is shared, so a write never shows through another copy.
template <class T>
class SharedVector {
 public:
  using value_type = T;
  using const_iterator = typename std::vector<T>::const_iterator;
  using iterator = typename std::vector<T>::iterator;

  SharedVector() = default;
  SharedVector(std::vector<T> v)
      : data_(std::make_shared<std::vector<T>>(std::move(v))) {}  // NOLINT: implicit by design
  SharedVector(std::initializer_list<T> v) : SharedVector(std::vector<T>(v)) {}

  const std::vector<T>& get() const {
    static const std::vector<T> kEmpty;
    return data_ ? *data_ : kEmpty;
  }
  operator const std::vector<T>&() const { return get(); }  // NOLINT: implicit by design
  std::size_t size() const { return data_ ? data_->size() : 0; }
  bool empty() const { return size() == 0; }
  const_iterator begin() const { return get().begin(); }
  const_iterator end() const { return get().end(); }
  const T& operator[](std::size_t i) const { return (*data_)[i]; }
  const T& at(std::size_t i) const { return get().at(i); }
  const T& back() const { return get().back(); }
  bool operator==(const SharedVector& o) const { return get() == o.get(); }
  // Whether the two share storage (tests; a written copy never does).
  bool shares_storage_with(const SharedVector& o) const { return data_ && data_ == o.data_; }

  // Writes: on a private copy.
  std::vector<T>& mutable_vector() {
    if (!data_)
      data_ = std::make_shared<std::vector<T>>();
    else if (data_.use_count() > 1)
      data_ = std::make_shared<std::vector<T>>(*data_);
    return *data_;
  }
  iterator begin() { return mutable_vector().begin(); }
  iterator end() { return mutable_vector().end(); }
  T& operator[](std::size_t i) { return mutable_vector()[i]; }
  T& back() { return mutable_vector().back(); }
  void push_back(const T& v) { mutable_vector().push_back(v); }
  void reserve(std::size_t n) { mutable_vector().reserve(n); }
  void assign(std::size_t n, const T& v) { mutable_vector().assign(n, v); }
  void clear() { data_.reset(); }

 private:
  std::shared_ptr<std::vector<T>> data_;
};

struct DeviceTimeline {
  SharedVector<OpSpan> spans;         // every op of the device's plan once; sorted by (stream, index)
  SharedVector<MemorySample> memory;  // step function, sorted by time
  std::int64_t peak_memory_bytes = 0;
  double peak_memory_time_s = 0;
};

struct Timeline {
  std::string source;  // "simgrid", "analytic", "measured"
  std::shared_ptr<const Program> program;
  double step_time_s = 0;               // end of the last op on any device
  std::vector<DeviceTimeline> devices;  // indexed by device id

  const Op& op(int device, const OpSpan& s) const {
    return program->plan_for(device)
        .streams.at(static_cast<std::size_t>(s.stream))
        .ops.at(static_cast<std::size_t>(s.index));
  }
};

// Chrome trace event format (opens in Perfetto / chrome://tracing): one process per device, one thread
// per stream, ops as complete ("X") events named by their label, flow arrows from each SEND to its
// RECV, and memory as a counter track per device. Times in microseconds. Predicted and measured
// timelines share this writer.
void write_chrome_trace(const Timeline& timeline, std::ostream& out);

}  // namespace piper::core
