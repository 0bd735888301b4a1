// Canonical checkpoints: mapping a device's shards and chunks to and from each layer's full vector,
// and the durable, atomic checkpoint file (one JSON header line, then per layer params, m, v).
#include "piper/runtime/checkpoint.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <array>
#include <cmath>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "piper/core/limits.hpp"
#include "piper/core/program.hpp"
#include "piper/runtime/host_backend.hpp"
#include "piper/runtime/trainer.hpp"
#include "byte_buffer.hpp"

namespace piper::runtime {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::size_t ix(std::int64_t i) { return static_cast<std::size_t>(i); }

// Calls fn(layer, local_begin, local_end, canonical_offset) for every contiguous run of `sp`'s local
// vector (HostModel::canonical_runs: expert shards, TP slices) that meets [begin, end).
template <class Fn>
void for_each_layer_part(const host::HostModel& model, const host::SegmentParams& sp, std::int64_t begin,
                         std::int64_t end, Fn&& fn) {
  for (const auto& r : model.canonical_runs(sp)) {
    const std::int64_t a = std::max(r.local, begin), b = std::min(r.local + r.length, end);
    if (a >= b) continue;
    fn(r.layer, a, b, r.canonical + (a - r.local));
  }
}

// Byte buffers: the hardened reader shared with the other binary files (byte_buffer.hpp).
using bytes::get;
using bytes::get_floats;
using bytes::put;
using bytes::put_floats;

const char* kind_name(int k) { return k == 0 ? "parameters" : k == 1 ? "AdamW first moment" : "AdamW second moment"; }

void write_all(int fd, const std::string& data, const std::string& temp) {
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error("cannot write " + temp + ": " + std::strerror(errno));
    }
    done += static_cast<std::size_t>(n);
  }
}

// The CRC-32 table of the reflected IEEE 802.3 polynomial 0xEDB88320, built at compile time.
constexpr std::array<std::uint32_t, 256> kCrcTable = [] {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[i] = c;
  }
  return t;
}();

std::uint32_t crc_of_floats(const std::vector<float>& v) { return crc32(v.data(), v.size() * sizeof(float)); }

// The header's checksum covers its JSON without the checksum field (nlohmann dumps keys sorted, so
// the text is canonical for what the writer put there).
std::uint32_t header_crc(json header) {
  header.erase("header_crc32");
  const std::string text = header.dump();
  return crc32(text.data(), text.size());
}

// Writes `data` into an existing non-regular file (a device, a FIFO): never replaced by a rename.
void write_through(const std::string& path, const std::string& data) {
  const int fd = core::open_to_write_through(path);  // a FIFO that no program reads is refused, not waited on
  try {
    write_all(fd, data, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  if (::close(fd) != 0) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
}

// Temporary files `<name>.tmp.<pid>` of this checkpoint whose writer is gone (a save killed mid-write):
// removed before the next save. A live pid (even a reused one) keeps its file.
void remove_stale_temporaries(const fs::path& folder, const std::string& name) {
  std::error_code ec;
  const std::string prefix = name + ".tmp.";
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string f = it->path().filename().string();
    if (f.size() <= prefix.size() || f.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = f.substr(prefix.size());
    if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(digits));
    if (pid == ::getpid() || pid <= 0) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;
    std::error_code ignored;
    fs::remove(it->path(), ignored);
  }
}

}  // namespace

std::uint32_t crc32(const void* data, std::size_t size, std::uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (std::size_t i = 0; i < size; ++i) crc = kCrcTable[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

SaveLock::SaveLock(const std::string& checkpoint_path) {
  std::error_code ec;
  if (const fs::file_status st = fs::status(checkpoint_path, ec); !ec && fs::exists(st) && !fs::is_regular_file(st))
    return;
  const fs::path target(checkpoint_path);
  const fs::path folder = target.has_parent_path() ? target.parent_path() : fs::path(".");
  fs::create_directories(folder, ec);
  if (ec) throw std::invalid_argument("cannot create the checkpoint folder " + folder.string() + ": " + ec.message());
  const std::string lock = checkpoint_path + ".lock";
  fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw std::invalid_argument(
        fmt::format("{}: cannot open the lock file {}: {}", checkpoint_path, lock, std::strerror(errno)));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK)
      throw std::invalid_argument(fmt::format(
          "{}: another run is saving to this checkpoint ({} is locked); choose another --save", checkpoint_path, lock));
    throw std::invalid_argument(fmt::format("{}: cannot lock {}: {}", checkpoint_path, lock, std::strerror(err)));
  }
}

SaveLock::~SaveLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock; the file stays (removing it would race a waiting writer)
}

std::vector<StateRecord> state_records(host::HostModel& model) {
  std::vector<StateRecord> out;
  for (const auto& sp : model.segments()) {
    const std::int64_t n = static_cast<std::int64_t>(sp.params.size());
    // ZeRO >= 1: the parameters of this replica's chunk, from its fp32 master copy (ZeRO-3 keeps them
    // nowhere else; ZeRO-1/2 hold the same values in params on the host, but a bf16 GPU run holds
    // rounded ones there). The replicas' chunks cover the vector.
    const bool from_master = sp.zero_level >= 1;
    const std::int64_t pb = from_master ? sp.chunk_begin : 0, pe = from_master ? sp.chunk_end : n;
    for_each_layer_part(model, sp, pb, pe, [&](int l, std::int64_t a, std::int64_t b, std::int64_t at) {
      const auto& src = from_master ? sp.master : sp.params;
      const std::int64_t base = from_master ? sp.chunk_begin : 0;
      out.push_back({l, StateKind::Params, at, std::vector<float>(src.begin() + (a - base), src.begin() + (b - base))});
    });
    // Moments cover the chunk this device updates (ZeRO 0: the whole local vector).
    for_each_layer_part(
        model, sp, sp.chunk_begin, sp.chunk_end, [&](int l, std::int64_t a, std::int64_t b, std::int64_t at) {
          const auto off = a - sp.chunk_begin, len = b - a;
          out.push_back(
              {l, StateKind::AdamM, at, std::vector<float>(sp.adam_m.begin() + off, sp.adam_m.begin() + off + len)});
          out.push_back(
              {l, StateKind::AdamV, at, std::vector<float>(sp.adam_v.begin() + off, sp.adam_v.begin() + off + len)});
        });
  }
  return out;
}

std::string serialize_state_records(const std::vector<StateRecord>& records) {
  std::string out;
  for (const auto& r : records) {
    put(out, static_cast<std::int32_t>(r.layer));
    put(out, static_cast<std::int32_t>(r.kind));
    put(out, r.offset);
    put(out, static_cast<std::int64_t>(r.values.size()));
    put_floats(out, r.values);
  }
  return out;
}

std::vector<StateRecord> parse_state_records(const std::string& bytes) {
  std::vector<StateRecord> out;
  std::size_t pos = 0;
  while (pos < bytes.size()) {
    StateRecord r;
    r.layer = get<std::int32_t>(bytes, pos);
    r.kind = static_cast<StateKind>(get<std::int32_t>(bytes, pos));
    r.offset = get<std::int64_t>(bytes, pos);
    const auto count = get<std::int64_t>(bytes, pos);
    if (count < 0) throw std::runtime_error("negative record length");
    get_floats(bytes, pos, r.values, ix(count));
    out.push_back(std::move(r));
  }
  return out;
}

CanonicalState assemble_state(const core::Model& model, const std::vector<StateRecord>& records) {
  CanonicalState s;
  std::map<int, std::array<std::vector<char>, 3>> covered;
  const int layers = static_cast<int>(model.layers().size());
  for (int l = 0; l < layers; ++l) {
    std::int64_t n = 0;
    for (const auto& t : host::layer_tensors(model.layers()[ix(l)])) n += t.size();
    for (int k = 0; k < 3; ++k) {
      s.layers[l][ix(k)].assign(ix(n), 0.0f);
      covered[l][ix(k)].assign(ix(n), 0);
    }
  }
  for (const auto& r : records) {
    const int k = static_cast<int>(r.kind);
    auto it = s.layers.find(r.layer);
    if (it == s.layers.end() || k < 0 || k > 2 || r.offset < 0 ||
        r.offset + static_cast<std::int64_t>(r.values.size()) > static_cast<std::int64_t>(it->second[ix(k)].size()))
      throw std::runtime_error(
          fmt::format("checkpoint record out of range (layer {}, kind {}, offset {})", r.layer, k, r.offset));
    std::copy(r.values.begin(), r.values.end(), it->second[ix(k)].begin() + r.offset);
    std::fill_n(covered[r.layer][ix(k)].begin() + r.offset, r.values.size(), char{1});
  }
  for (const auto& [l, kinds] : covered)
    for (int k = 0; k < 3; ++k) {
      const auto& c = kinds[ix(k)];
      const auto gap = std::find(c.begin(), c.end(), char{0});
      if (gap != c.end())
        throw std::runtime_error(fmt::format("checkpoint: no device holds element {} of layer {} ('{}') {}",
                                             gap - c.begin(), l, model.layers()[ix(l)].name, kind_name(k)));
    }
  return s;
}

void write_checkpoint(const std::string& path, const CheckpointInfo& info, const CanonicalState& state) {
  json layers = json::array();
  std::string body;
  for (const auto& [l, kinds] : state.layers) {
    layers.push_back({{"layer", l},
                      {"floats", kinds[0].size()},
                      {"crc32", {crc_of_floats(kinds[0]), crc_of_floats(kinds[1]), crc_of_floats(kinds[2])}}});
    for (const auto& v : kinds) put_floats(body, v);
  }
  json header = {{"format", "piper-checkpoint"},
                 {"version", 3},
                 {"layout", "canonical"},
                 {"model", info.model_name},
                 {"fingerprint", info.fingerprint},
                 {"step", info.step},
                 {"data_position", info.data_position},
                 {"sequences_per_step", info.sequences_per_step},
                 {"seq_len", info.seq_len},
                 {"saved_layout", info.saved_layout},
                 {"layers", layers}};
  if (!info.optimizer.empty()) header["optimizer"] = json::parse(info.optimizer);
  if (info.loss_scale)
    header["loss_scale"] = {{"scale", info.loss_scale->scale}, {"good_steps", info.loss_scale->good_steps}};
  header["header_crc32"] = header_crc(header);
  std::error_code ec;
  if (const fs::file_status st = fs::status(path, ec);
      !ec && fs::exists(st) && !fs::is_regular_file(st) && !fs::is_directory(st)) {
    write_through(path, header.dump() + "\n" + body);  // a device or FIFO is written into, not replaced
    return;
  }
  const fs::path target(path);
  const fs::path folder = target.has_parent_path() ? target.parent_path() : fs::path(".");
  fs::create_directories(folder, ec);
  if (ec) throw std::runtime_error("cannot create the checkpoint folder " + folder.string() + ": " + ec.message());
  if (fs::is_directory(target)) throw std::runtime_error(path + ": is a folder; --save takes a checkpoint file name");
  remove_stale_temporaries(folder, target.filename().string());
  // Same folder as the target, so rename() stays on one file system and replaces it atomically.
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + temp + ": " + std::strerror(errno));
  try {
    write_all(fd, header.dump() + "\n", temp);
    write_all(fd, body, temp);
    // The data must be on disk before the rename makes it the checkpoint, or a power cut could leave
    // a renamed but empty file.
    if (::fsync(fd) != 0) throw std::runtime_error("cannot sync " + temp + ": " + std::strerror(errno));
  } catch (...) {
    ::close(fd);
    fs::remove(temp, ec);
    throw;
  }
  ::close(fd);
  if (const char* crash = std::getenv("PIPER_TEST_CRASH_BEFORE_RENAME"); crash && std::atoi(crash) == info.step) {
    std::fprintf(stderr, "piper: test hook: exiting after writing %s, before renaming it\n", temp.c_str());
    std::fflush(stderr);
    std::_Exit(86);
  }
  fs::rename(temp, target, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(temp, ignored);
    throw std::runtime_error("cannot rename " + temp + " to " + path + ": " + ec.message());
  }
  // Make the rename itself durable.
  if (const int dir = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dir >= 0) {
    (void)::fsync(dir);
    ::close(dir);
  }
}

std::int64_t checkpoint_bytes_bound(const core::Program& program) {
  const core::Model model = program_model(program);
  std::int64_t floats = 0;
  for (const auto& layer : model.layers())
    for (const auto& t : host::layer_tensors(layer)) floats += t.size();
  // Three floats per parameter (value, Adam m and v) plus the header line: 1 MiB and 4 KiB per layer
  // is far more than its JSON (a few dozen bytes per layer) ever takes.
  return 3 * static_cast<std::int64_t>(sizeof(float)) * floats + (1 << 20) +
         4096 * static_cast<std::int64_t>(model.layers().size());
}

std::string read_checkpoint_bytes(const std::string& path, const core::Program& program) {
  if (fs::is_directory(path)) throw std::invalid_argument(path + ": is a folder, not a checkpoint file");
  // Bounded before allocating (a 10 GB sparse file or /dev/zero is refused, not read whole): by the
  // checkpoint-bytes limit and by what a checkpoint of this plan's model can hold.
  try {
    return core::read_input_file(path, core::Limit::CheckpointBytes, checkpoint_bytes_bound(program),
                                 fmt::format("a checkpoint of model '{}' holds", program.model_name));
  } catch (const core::Error& e) {
    throw std::invalid_argument(e.what());
  }
}

Checkpoint parse_checkpoint(const std::string& path, const std::string& bytes) {
  const auto nl = bytes.find('\n');
  json h;
  try {
    const std::string header = bytes.substr(0, nl == std::string::npos ? bytes.size() : nl);
    h = core::parse_json(header, path);
  } catch (const core::LimitError& e) {
    throw std::invalid_argument(e.what());
  } catch (const json::exception&) {
    throw std::invalid_argument(path + ": not a piper checkpoint (or its header line is damaged)");
  }
  if (!h.is_object() || h.value("format", "") != "piper-checkpoint")
    throw std::invalid_argument(path + ": not a piper checkpoint");
  const json version = h.value("version", json(0));
  if (!version.is_number_integer() || (version != 2 && version != 3))
    throw std::invalid_argument(fmt::format(
        "{}: checkpoint version {} is not supported (this piper reads versions 2 and 3)", path, version.dump()));
  // Version 3 carries CRC-32 checksums (header and each tensor); version 2, written by earlier
  // pipers, has none and is read with the value checks only. A version-2 header that holds checksum
  // fields is a damaged version 3 (its version digit changed), so it is not let through unchecked.
  const bool checked = version == 3;
  if (checked) {
    const auto it = h.find("header_crc32");
    if (it == h.end() || !it->is_number_unsigned() || it->get<std::uint64_t>() != header_crc(h))
      throw std::invalid_argument(
          path + ": damaged checkpoint (the header's checksum does not match: it was edited or corrupted)");
  } else if (h.contains("header_crc32")) {
    throw std::invalid_argument(path + ": damaged checkpoint (a version-2 header with version-3 checksums)");
  }
  Checkpoint c;
  try {
    c.info.model_name = h.at("model").get<std::string>();
    c.info.fingerprint = h.at("fingerprint").get<std::string>();
    c.info.step = h.at("step").get<int>();
    c.info.data_position = h.at("data_position").get<std::int64_t>();
    c.info.sequences_per_step = h.at("sequences_per_step").get<std::int64_t>();
    c.info.seq_len = h.at("seq_len").get<std::int64_t>();
    c.info.saved_layout = h.value("saved_layout", "");
    if (const auto it = h.find("optimizer"); it != h.end()) c.info.optimizer = it->dump();
    if (const auto it = h.find("loss_scale"); it != h.end()) {
      host::LossScaleState ls{it->at("scale").get<double>(), it->at("good_steps").get<int>()};
      if (!host::is_loss_scale(ls.scale) || ls.good_steps < 0)
        throw std::invalid_argument(fmt::format(
            "{}: checkpoint loss scale {} (after {} good steps) is not a power of two >= 1 with a count >= 0", path,
            ls.scale, ls.good_steps));
      c.info.loss_scale = ls;
    }
    if (c.info.step < 0)
      throw std::invalid_argument(fmt::format("{}: checkpoint step {} is negative", path, c.info.step));
    if (c.info.sequences_per_step <= 0 || c.info.seq_len <= 0)
      throw std::invalid_argument(
          fmt::format("{}: checkpoint sequences per step {} and sequence length {} must be positive", path,
                      c.info.sequences_per_step, c.info.seq_len));
    if (c.info.data_position != static_cast<std::int64_t>(c.info.step) * c.info.sequences_per_step)
      throw std::invalid_argument(fmt::format("{}: checkpoint data position {} is not step {} x {} sequences", path,
                                              c.info.data_position, c.info.step, c.info.sequences_per_step));
    std::size_t pos = nl + 1;
    for (const auto& l : h.at("layers")) {
      const int layer = l.at("layer").get<int>();
      const auto floats = l.at("floats").get<std::int64_t>();
      if (floats < 0) throw std::runtime_error("negative size");
      auto& kinds = c.state.layers[layer];
      for (std::size_t k = 0; k < kinds.size(); ++k) {
        auto& v = kinds[k];
        get_floats(bytes, pos, v, ix(floats));
        if (checked && crc_of_floats(v) != l.at("crc32").at(k).get<std::uint32_t>())
          throw std::runtime_error(
              fmt::format("layer {} {}: checksum mismatch", layer, kind_name(static_cast<int>(k))));
        // A checksum proves the bytes are the ones written; values must also be usable: finite, and
        // second moments never negative.
        for (std::size_t i = 0; i < v.size(); ++i)
          if (!std::isfinite(v[i]) || (k == 2 && v[i] < 0))
            throw std::invalid_argument(
                fmt::format("{}: checkpoint layer {} {} element {} is {}", path, layer, kind_name(static_cast<int>(k)),
                            i, std::isfinite(v[i]) ? fmt::format("negative ({})", v[i]) : fmt::format("{}", v[i])));
      }
    }
    if (pos != bytes.size()) throw std::runtime_error("trailing bytes");
  } catch (const json::exception& e) {
    throw std::invalid_argument(path + ": malformed checkpoint header: " + e.what());
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument(path + ": damaged checkpoint (" + e.what() + ")");
  }
  return c;
}

void check_compatible(const std::string& path, const Checkpoint& ckpt, const core::Program& program) {
  const auto& i = ckpt.info;
  if (i.fingerprint != model_fingerprint(program) && i.fingerprint != model_fingerprint(program, true))
    throw std::invalid_argument(
        fmt::format("{}: checkpoint of model '{}' ({}) does not match the plan's model '{}' ({}): their specs differ",
                    path, i.model_name, i.fingerprint, program.model_name, model_fingerprint(program)));
  const DataShape shape = data_shape(program);
  if (i.seq_len != shape.seq_len)
    throw std::invalid_argument(fmt::format("{}: checkpoint trained on sequences of {} tokens, the plan uses {}", path,
                                            i.seq_len, shape.seq_len));
  const std::int64_t per_step = static_cast<std::int64_t>(shape.microbatches) * shape.ranks * shape.micro_batch_size;
  if (i.sequences_per_step != per_step)
    throw std::invalid_argument(
        fmt::format("{}: checkpoint took {} sequences per step, the plan takes {} (microbatches x data-parallel ranks "
                    "x micro-batch size must match to continue the same run)",
                    path, i.sequences_per_step, per_step));
  if (i.data_position != static_cast<std::int64_t>(i.step) * per_step)
    throw std::invalid_argument(fmt::format("{}: checkpoint data position {} is not step {} x {} sequences", path,
                                            i.data_position, i.step, per_step));
  const core::Model model = program_model(program);
  if (ckpt.state.layers.size() != model.layers().size())
    throw std::invalid_argument(fmt::format("{}: checkpoint holds {} layers, the model has {}", path,
                                            ckpt.state.layers.size(), model.layers().size()));
  for (std::size_t l = 0; l < model.layers().size(); ++l) {
    std::int64_t n = 0;
    for (const auto& t : host::layer_tensors(model.layers()[l])) n += t.size();
    auto it = ckpt.state.layers.find(static_cast<int>(l));
    if (it == ckpt.state.layers.end() || static_cast<std::int64_t>(it->second[0].size()) != n)
      throw std::invalid_argument(fmt::format("{}: checkpoint layer {} ('{}') does not hold {} parameters", path, l,
                                              model.layers()[l].name, n));
  }
}

void load_state(host::HostModel& model, const CanonicalState& state) {
  for (auto& sp : model.segments()) {
    const auto n = static_cast<std::int64_t>(sp.params.size());
    for_each_layer_part(model, sp, 0, n, [&](int l, std::int64_t a, std::int64_t b, std::int64_t at) {
      const auto& src = state.layers.at(l)[0];
      std::copy(src.begin() + at, src.begin() + at + (b - a), sp.params.begin() + a);
    });
    if (sp.zero_level >= 1) sp.master.assign(sp.params.begin() + sp.chunk_begin, sp.params.begin() + sp.chunk_end);
    for_each_layer_part(model, sp, sp.chunk_begin, sp.chunk_end,
                        [&](int l, std::int64_t a, std::int64_t b, std::int64_t at) {
                          const auto& m = state.layers.at(l)[1];
                          const auto& v = state.layers.at(l)[2];
                          std::copy(m.begin() + at, m.begin() + at + (b - a), sp.adam_m.begin() + (a - sp.chunk_begin));
                          std::copy(v.begin() + at, v.begin() + at + (b - a), sp.adam_v.begin() + (a - sp.chunk_begin));
                        });
    std::fill(sp.grads.begin(), sp.grads.end(), 0.0f);
    std::fill(sp.grad_chunk.begin(), sp.grad_chunk.end(), 0.0f);
    sp.grad_chunk_ready = false;
    if (sp.zero_level >= 3) model.poison_params(sp.segment);
  }
}

std::string layout_summary(const core::Program& program) {
  std::string s = fmt::format("{} devices, {} microbatches;", program.num_devices, program.microbatches);
  for (const auto& seg : program.segments)
    s += fmt::format(
        " layers {}-{}: {} shard(s) x {} replica(s){}, ZeRO-{}{};", seg.first_layer, seg.last_layer - 1,
        seg.shard_degree, seg.replicas,
        seg.tp_degree > 1 ? fmt::format(", TP{}{}", seg.tp_degree, seg.sequence_parallel ? "+SP" : "") : "",
        seg.zero_level, seg.zero_shards != seg.replicas ? fmt::format(" in groups of {}", seg.zero_shards) : "");
  s.pop_back();
  return s;
}

}  // namespace piper::runtime
