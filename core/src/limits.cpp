// Resource limits (see limits.hpp): the table, overrides from flags and the environment, and the
// size-checked file reader every input path goes through.
#include "piper/core/limits.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <unistd.h>  // environ, read

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "piper/core/suggest.hpp"

namespace piper::core {

namespace {

// Defaults are far above any real job (the largest zoo model has 96 blocks; clusters being built have
// ~10^5 GPUs) and low enough that the work they allow finishes in minutes and fits in memory.
const std::vector<LimitInfo> kTable = {
    {Limit::InputBytes, "input-bytes", 256LL << 20, "size of an input file in bytes"},
    {Limit::Layers, "layers", 4096, "transformer blocks in a model"},
    {Limit::ModelWidth, "model-width", 1LL << 20,
     "any model width: vocab, hidden, ffn, expert_ffn, heads, kv_heads, head_dim, MLA ranks, max_positions"},
    {Limit::Experts, "experts", 65536, "MoE experts (also top_k and shared experts)"},
    {Limit::TokensPerMicrobatch, "tokens-per-microbatch", 1LL << 24, "seq_len x micro_batch_size"},
    {Limit::Microbatches, "microbatches", 16384, "microbatches per training step"},
    {Limit::Devices, "devices", 262144, "devices in a strategy, program or cluster (device ids are below it)"},
    {Limit::DagNodes, "dag-nodes", 4'000'000, "nodes of the global training DAG while compiling"},
    {Limit::SimulatedOps, "simulated-ops", 250'000'000, "op instances one simulation runs (all devices)"},
    {Limit::SweepRuns, "sweep-runs", 100'000, "combinations in one sweep"},
    // Piper's own files nest at most ~8 deep (a plan's model_spec); 10^5 levels overflowed the stack.
    {Limit::JsonDepth, "json-depth", 256, "nesting depth of arrays and objects in any JSON input"},
    {Limit::DataBytes, "data-bytes", 1LL << 30, "size of a --data token file in bytes"},
    {Limit::CheckpointBytes, "checkpoint-bytes", 64LL << 30,
     "size of a checkpoint file in bytes (also at most what a checkpoint of the plan's model holds)"},
};

constexpr std::size_t kCount = 13;

std::string env_name(const char* name) {
  std::string s = "PIPER_LIMIT_";
  for (const char* p = name; *p; ++p)
    s += *p == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(*p)));
  return s;
}

std::int64_t parse_positive(const std::string& text, const std::string& where) {
  std::int64_t v = 0;
  std::size_t used = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  // stoll skips leading white space: " 5" must be refused as "5 " is.
  if (used == 0 || used != text.size() || v < 1 || std::isspace(static_cast<unsigned char>(text.front())))
    throw LimitError(fmt::format("{}: expected a positive integer, got '{}'", where, text));
  return v;
}

struct Values {
  std::array<std::atomic<std::int64_t>, kCount> v;
  Values() { reset(); }
  void reset() {
    for (std::size_t i = 0; i < kCount; ++i) v[i] = kTable[i].default_value;
  }
};

// Read the environment once; a malformed variable is reported on every use (it never half-applies).
Values& values() {
  static Values vals;
  static const std::string env_error = [] {
    // A misspelt variable (PIPER_LIMIT_DEVICE=8) would leave its limit at the default without a word.
    std::vector<std::string> known;
    for (const LimitInfo& l : kTable) known.push_back(env_name(l.name));
    const std::string prefix = "PIPER_LIMIT_";
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      const std::string entry = *e;
      const std::string name = entry.substr(0, entry.find('='));
      if (name.rfind(prefix, 0) == 0 && std::find(known.begin(), known.end(), name) == known.end())
        return fmt::format("{}: not a piper limit{} (piper limits lists them)", printable(name, 80),
                           did_you_mean(name, known));
    }
    for (std::size_t i = 0; i < kCount; ++i) {
      const std::string name = env_name(kTable[i].name);
      if (const char* text = std::getenv(name.c_str())) {
        try {
          vals.v[i] = parse_positive(text, name);
        } catch (const LimitError& e) {
          return std::string(e.what());
        }
      }
    }
    return std::string();
  }();
  if (!env_error.empty()) throw LimitError(env_error);
  return vals;
}

std::size_t index_of(Limit l) { return static_cast<std::size_t>(l); }

}  // namespace

const std::vector<LimitInfo>& limit_table() {
  static_assert(static_cast<std::size_t>(Limit::CheckpointBytes) + 1 == kCount);
  return kTable;
}

std::int64_t limit_value(Limit l) { return values().v[index_of(l)]; }

void set_limit(const std::string& name, std::int64_t value) {
  for (std::size_t i = 0; i < kCount; ++i)
    if (name == kTable[i].name) {
      if (value < 1) throw LimitError(fmt::format("--limit {}: must be a positive integer", name));
      values().v[i] = value;
      return;
    }
  std::string names;
  for (const auto& info : kTable) names += (names.empty() ? "" : ", ") + std::string(info.name);
  throw LimitError(fmt::format("--limit: unknown limit '{}' (expected one of: {})", name, names));
}

void set_limit_from_flag(const std::string& spec) {
  const auto eq = spec.find('=');
  if (eq == std::string::npos) throw LimitError(fmt::format("--limit '{}': expected NAME=VALUE", spec));
  const std::string name = spec.substr(0, eq);
  set_limit(name, parse_positive(spec.substr(eq + 1), "--limit " + name));
}

void reset_limits_to_defaults() { values().reset(); }

std::string limit_message(Limit l, std::int64_t value, const std::string& unit) {
  const LimitInfo& info = kTable[index_of(l)];
  return fmt::format("{}{}{} exceeds the limit of {} (limit '{}'; raise it with --limit {}=N or {}=N)", value,
                     unit.empty() ? "" : " ", unit, limit_value(l), info.name, info.name, env_name(info.name));
}

void check_limit(Limit l, std::int64_t value, const std::string& where, const std::string& unit) {
  if (value <= limit_value(l)) return;
  throw LimitError(where.empty() ? limit_message(l, value, unit) : where + ": " + limit_message(l, value, unit));
}

std::string read_input_file(const std::string& path) { return read_input_file(path, Limit::InputBytes); }

std::string read_input_file(const std::string& path, Limit bytes_limit, std::int64_t max_bytes,
                            const std::string& what) {
  namespace fs = std::filesystem;
  // The tighter of the limit and max_bytes; over max_bytes is named by `what`, not by a limit.
  const auto check = [&](std::int64_t size, const char* unit) {
    if (max_bytes >= 0 && max_bytes < limit_value(bytes_limit) && size > max_bytes)
      throw LimitError(fmt::format("{}: {} {} is more than {} ({} bytes at most)", path, size, unit, what, max_bytes));
    check_limit(bytes_limit, size, path, unit);
  };
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) throw Error(fmt::format("{}: cannot open: no such file", path));
  if (fs::is_directory(st)) throw Error(fmt::format("{}: is a directory, expected a file", path));
  if (fs::is_socket(st)) throw Error(fmt::format("{}: not a regular file (a socket), expected a file", path));
  // Regular files are sized before reading; pipes and devices (/dev/stdin, /dev/zero) are read in
  // chunks and stopped as soon as they pass the bound.
  if (fs::is_regular_file(st)) {
    const auto size = fs::file_size(path, ec);
    if (!ec) check(static_cast<std::int64_t>(size), "bytes");
  }
  const bool fifo = fs::is_fifo(st);
  // open(2) of a FIFO waits for a writer, forever if none comes (`run --data fifo` hung): it is opened
  // without waiting, and read once a program writes to it (a shell's pipe, /dev/stdin or <(...), or a
  // writer started first: it waits in its own open).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (fifo ? O_NONBLOCK : 0));
  if (fd < 0) throw Error(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  std::string text;
  char buffer[1 << 16];
  if (fifo) {
    // A read of an empty FIFO says whether a writer has it open (EAGAIN) or not (0). A writer started
    // just after piper gets a moment to open it; then the FIFO is refused, not waited on.
    constexpr auto kWriterGrace = std::chrono::seconds(2);
    const auto give_up = std::chrono::steady_clock::now() + kWriterGrace;
    for (;;) {
      const ssize_t n = ::read(fd, buffer, sizeof buffer);
      if (n > 0) text.append(buffer, static_cast<std::size_t>(n));
      if (n > 0 || (n < 0 && errno == EAGAIN)) break;
      if (n < 0 && errno != EINTR) throw Error(fmt::format("{}: read failed: {}", path, std::strerror(errno)));
      if (std::chrono::steady_clock::now() >= give_up)
        throw Error(fmt::format("{}: not a regular file: a pipe (FIFO) that no program writes to", path));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  }
  // Grown by doubling but never past the bound and one buffer: /dev/zero stops at about the bound in
  // memory, not twice it.
  std::int64_t bound = limit_value(bytes_limit);
  if (max_bytes >= 0) bound = std::min(bound, max_bytes);
  const auto cap = static_cast<std::size_t>(std::min<std::int64_t>(bound, std::int64_t{1} << 60)) + sizeof buffer;
  check(static_cast<std::int64_t>(text.size()), "bytes (or more)");
  for (;;) {
    const ssize_t got = ::read(fd, buffer, sizeof buffer);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw Error(fmt::format("{}: read failed: {}", path, std::strerror(errno)));
    if (got == 0) break;
    const auto n = static_cast<std::size_t>(got);
    if (text.size() + n > text.capacity()) {
      // Straight to the cap once doubling would pass half of it (libstdc++ doubles any smaller request).
      std::size_t want = std::max(2 * text.capacity(), text.size() + n);
      if (want > cap / 2) want = cap;
      text.reserve(want);
    }
    text.append(buffer, n);
    check(static_cast<std::int64_t>(text.size()), "bytes (or more)");
  }
  return text;
}

std::string printable(std::string_view s, std::size_t max_bytes) {
  std::string out;
  std::size_t i = 0;
  while (i < s.size()) {
    if (max_bytes > 0 && i >= max_bytes) {
      out += fmt::format("... ({} bytes in all)", s.size());
      break;
    }
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    // A whole UTF-8 sequence (a file name like modèle.json) is kept as is.
    const std::size_t n = c >= 0xf5 ? 0 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 ? 2 : 0;
    bool utf8 = n > 0 && i + n <= s.size();
    for (std::size_t k = 1; utf8 && k < n; ++k) utf8 = (static_cast<unsigned char>(s[i + k]) & 0xc0) == 0x80;
    if (utf8) {
      out.append(s.substr(i, n));
      i += n;
      continue;
    }
    out += fmt::format("\\x{:02x}", c);
    ++i;
  }
  return out;
}

namespace {

// Whether the 3 bytes at s[i] are the UTF-8 of a bidirectional control (U+202A-U+202E, U+2066-U+2069).
bool bidi_at(std::string_view s, std::size_t i) {
  if (i + 2 >= s.size() || static_cast<unsigned char>(s[i]) != 0xE2) return false;
  const auto b = static_cast<unsigned char>(s[i + 1]), c = static_cast<unsigned char>(s[i + 2]);
  return (b == 0x80 && c >= 0xAA && c <= 0xAE) || (b == 0x81 && c >= 0xA6 && c <= 0xA9);
}

}  // namespace

bool plain_text(std::string_view s) {
  if (printable(s) != s) return false;
  for (std::size_t i = 0; i < s.size(); ++i)
    if (bidi_at(s, i)) return false;
  return true;
}

std::string printable_text(std::string_view text, std::size_t max_bytes) {
  const std::string s = printable(text, max_bytes);
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (!bidi_at(s, i)) {
      out += s[i];
      continue;
    }
    const unsigned code =
        ((static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 6) | (static_cast<unsigned char>(s[i + 2]) & 0x3Fu);
    out += fmt::format("\\u{:04x}", 0x2000u | code);
    i += 2;
  }
  return out;
}

void check_json_depth(std::string_view text, const std::string& where) {
  const std::int64_t limit = limit_value(Limit::JsonDepth);
  std::int64_t depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;  // skip the escaped character (\" does not end the string)
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > limit) check_limit(Limit::JsonDepth, depth, where, "levels of JSON nesting (or more)");
    } else if (c == ']' || c == '}') {
      if (depth > 0) --depth;
    }
  }
}

nlohmann::json parse_json(std::string_view text, const std::string& where) {
  check_json_depth(text, where);
  // nlohmann keeps the last of two equal keys of one object; a repeated key ("pp": 2, ... "pp": 4) is an
  // edit gone wrong, and one of its values would be dropped without a word: refused instead.
  // The keys of each open object (innermost last) are kept in vectors reused from object to object (a
  // plan has hundreds of thousands of small objects: no set and no allocation per object) and checked
  // when the object closes, sorted; a repeated key is reported before the parse returns.
  using Event = nlohmann::json::parse_event_t;
  std::vector<std::vector<std::string>> keys;
  std::size_t open = 0;
  return nlohmann::json::parse(text, [&](int /*depth*/, Event event, nlohmann::json& parsed) {
    if (event == Event::object_start) {
      if (++open > keys.size()) keys.emplace_back();
      keys[open - 1].clear();
    } else if (event == Event::key) {
      keys[open - 1].push_back(parsed.get_ref<const std::string&>());
    } else if (event == Event::object_end) {
      std::vector<std::string>& k = keys[--open];
      std::sort(k.begin(), k.end());
      if (auto d = std::adjacent_find(k.begin(), k.end()); d != k.end())
        throw Error(where + ": duplicate key '" + printable(*d, 80) +
                    "' in one JSON object (one of its values would be silently dropped)");
    }
    return true;
  });
}

std::optional<UnknownField> unknown_field(const nlohmann::json& obj, std::span<const std::string_view> known) {
  for (auto it = obj.begin(); it != obj.end(); ++it) {
    const std::string& key = it.key();
    if (std::find(known.begin(), known.end(), std::string_view(key)) != known.end()) continue;
    // The hint is built only on failure; a key may hold any bytes, and the line stays one line.
    return UnknownField{printable(key, 80), "unknown field" + unknown_field_hint(key, std::vector<std::string>(
                                                                                          known.begin(), known.end()))};
  }
  return std::nullopt;
}

std::optional<UnknownField> unknown_field(const nlohmann::json& obj, std::initializer_list<std::string_view> known) {
  return unknown_field(obj, std::span<const std::string_view>(known.begin(), known.size()));
}

std::string wrong_input_kind(const nlohmann::json& obj, std::string_view expected) {
  if (!obj.is_object()) return {};
  std::string kind, goes;
  if (obj.contains("format") && obj["format"] == "piper-program") {
    kind = "a plan (\"format\": \"piper-program\")";
    goes = "piper verify, simulate --plan, run --plan or export-chakra (Python: plan=)";
  } else if (obj.contains("format")) {
    return {};
  } else if (obj.contains("model") && obj["model"].is_string() && !obj.contains("vocab")) {
    kind = "a scenario (a \"model\" with its settings)";
    goes = "--scenario";
  } else if (obj.contains("model_type")) {
    kind = "a Hugging Face config (\"model_type\")";
    goes = "--model";
  } else if (obj.contains("vocab") && obj.contains("hidden") && obj.contains("layers")) {
    kind = "a model spec (\"vocab\", \"hidden\", \"layers\")";
    goes = "--model";
  } else {
    return {};
  }
  if (kind.rfind(expected, 0) == 0) return {};
  return fmt::format("this is {}, not {}: give it to {}", kind, expected, goes);
}

}  // namespace piper::core
