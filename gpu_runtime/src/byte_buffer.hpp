// Byte buffers of the runtime's binary files (checkpoints, parameter dumps): little-endian values as
// the host writes them. The readers are hardened for untrusted files: a read past the end throws
// std::runtime_error("truncated") and never touches memory beyond the buffer, whatever the count.
#pragma once

#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace piper::runtime::bytes {

template <class T>
void put(std::string& out, const T& v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

inline void put_floats(std::string& out, const std::vector<float>& v) {
  if (!v.empty()) out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

template <class T>
T get(const std::string& in, std::size_t& pos) {
  if (pos > in.size() || sizeof(T) > in.size() - pos) throw std::runtime_error("truncated");
  T v;
  std::memcpy(&v, in.data() + pos, sizeof(T));
  pos += sizeof(T);
  return v;
}

// n floats at pos into v (resized to n); n is checked against the bytes left before anything is sized.
inline void get_floats(const std::string& in, std::size_t& pos, std::vector<float>& v, std::size_t n) {
  if (pos > in.size() || n > (in.size() - pos) / sizeof(float)) throw std::runtime_error("truncated");
  v.resize(n);
  if (n > 0) std::memcpy(v.data(), in.data() + pos, n * sizeof(float));  // a tied head holds no floats
  pos += n * sizeof(float);
}

}  // namespace piper::runtime::bytes
