// Program queries (peers, communicator groups), family purpose names, atomic file writes and equality; the JSON
// round trip is in program_json.cpp.
#include "piper/core/program.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "piper/core/error.hpp"

namespace piper::core {

namespace {
constexpr std::array<const char*, 9> kFamilyPurposeNames = {"dp", "dp-ep",          "dp-shard", "dp-replicate", "ep",
                                                            "tp", "tied-embedding", "cp",       "grad-norm"};
}  // namespace

std::string to_string(FamilyPurpose p) { return kFamilyPurposeNames.at(static_cast<std::size_t>(p)); }

FamilyPurpose family_purpose_from_string(const std::string& s) {
  for (std::size_t i = 0; i < kFamilyPurposeNames.size(); ++i)
    if (s == kFamilyPurposeNames[i]) return static_cast<FamilyPurpose>(i);
  std::string choices;
  for (const char* name : kFamilyPurposeNames) choices += std::string(choices.empty() ? "" : ", ") + name;
  throw std::invalid_argument("unknown family purpose '" + s + "' (expected one of " + choices + ")");
}

std::int64_t Plan::op_count() const {
  std::int64_t n = 0;
  for (const auto& s : streams) n += static_cast<std::int64_t>(s.ops.size());
  return n;
}

int Program::position_in(DeviceSetId set, int device) const {
  if (set < 0 || static_cast<std::size_t>(set) >= device_sets.size()) return -1;
  const auto& devices = device_sets[static_cast<std::size_t>(set)];
  for (std::size_t i = 0; i < devices.size(); ++i)
    if (devices[i] == device) return static_cast<int>(i);
  return -1;
}

int Program::peer_of(const Op& op, int device) const {
  int pos = position_in(op.device_set, device);
  if (pos < 0) return -1;
  if (op.peer_set < 0 || static_cast<std::size_t>(op.peer_set) >= device_sets.size()) return -1;
  const auto& peers = device_sets[static_cast<std::size_t>(op.peer_set)];
  return static_cast<std::size_t>(pos) < peers.size() ? peers[static_cast<std::size_t>(pos)] : -1;
}

namespace {

// The device list of family `f` and its number of groups, after checking the partition is well formed.
const std::vector<int>& family_devices(const Program& p, int family, int& num_groups) {
  if (family < 0 || static_cast<std::size_t>(family) >= p.families.size())
    throw PlanError("plan: family " + std::to_string(family) + " out of range");
  const CommFamily& f = p.families[static_cast<std::size_t>(family)];
  if (f.devices < 0 || static_cast<std::size_t>(f.devices) >= p.device_sets.size())
    throw PlanError("plan: family " + std::to_string(family) + ": device set " + std::to_string(f.devices) +
                    " out of range");
  const auto& devices = p.device_sets[static_cast<std::size_t>(f.devices)];
  int n = static_cast<int>(devices.size());
  if (f.group_size <= 0 || n % f.group_size != 0 || f.stride <= 0 || (f.stride > 1 && f.group_size * f.stride != n))
    throw PlanError("plan: family " + std::to_string(family) + ": group_size " + std::to_string(f.group_size) +
                    " with stride " + std::to_string(f.stride) + " does not partition " + std::to_string(n) +
                    " devices");
  num_groups = n / f.group_size;
  return devices;
}

}  // namespace

std::vector<std::vector<int>> Program::groups(int family) const {
  int num_groups = 0;
  const auto& devices = family_devices(*this, family, num_groups);
  const CommFamily& f = families[static_cast<std::size_t>(family)];
  std::vector<std::vector<int>> out(static_cast<std::size_t>(num_groups));
  for (std::size_t i = 0; i < devices.size(); ++i) {
    // stride 1: chunk i / group_size; stride k: residue i % k.
    std::size_t g = f.stride == 1 ? i / static_cast<std::size_t>(f.group_size) : i % static_cast<std::size_t>(f.stride);
    out[g].push_back(devices[i]);
  }
  return out;
}

std::vector<int> Program::group_of(int family, int device) const {
  int num_groups = 0;
  const auto& devices = family_devices(*this, family, num_groups);
  const CommFamily& f = families[static_cast<std::size_t>(family)];
  int pos = position_in(f.devices, device);
  if (pos < 0) return {};
  std::vector<int> out;
  out.reserve(static_cast<std::size_t>(f.group_size));
  if (f.stride == 1) {
    int first = pos / f.group_size * f.group_size;
    for (int i = 0; i < f.group_size; ++i) out.push_back(devices[static_cast<std::size_t>(first + i)]);
  } else {
    for (std::size_t i = static_cast<std::size_t>(pos % f.stride); i < devices.size();
         i += static_cast<std::size_t>(f.stride))
      out.push_back(devices[i]);
  }
  return out;
}

std::int64_t Program::total_ops() const {
  std::vector<std::int64_t> devices_per_plan(plans.size(), 0);
  for (int p : plan_of_device) devices_per_plan.at(static_cast<std::size_t>(p)) += 1;
  std::int64_t total = 0;
  for (std::size_t p = 0; p < plans.size(); ++p) total += devices_per_plan[p] * plans[p].op_count();
  return total;
}

namespace {

// write(2) until everything is written; the system's reason on failure.
bool write_whole(int fd, const std::string& contents, int& err) {
  std::size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : ENOSPC;
      return false;
    }
    done += static_cast<std::size_t>(n);
  }
  return true;
}

// True for `<prefix><pid>` where pid is a process that no longer exists: a temporary that a write
// killed before its rename left behind. kill(pid, 0) is ESRCH only for no such process (EPERM: another
// user's, alive); a live pid keeps its file, even a reused one, and this process's own is truncated by
// the open that follows.
bool temporary_of_a_dead_process(const std::string& name, const std::string& prefix) {
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return false;
  const std::string digits = name.substr(prefix.size());
  if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) return false;
  const auto pid = static_cast<pid_t>(std::stol(digits));
  if (pid <= 0 || pid == ::getpid()) return false;
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

// Removes the temporaries `<prefix><pid>` in `folder` that a killed write of the same output left (a
// SIGKILL cannot be caught, so they are cleared on the next write rather than by a handler). A folder is
// listed once per process, keeping the names that hold ".tmp.": `export-chakra` writes one file per
// device into one folder, and a listing per write would read it n^2/2 times.
void remove_stale_temporaries(const std::filesystem::path& folder, const std::string& prefix) {
  namespace fs = std::filesystem;
  static std::mutex mutex;
  static std::map<std::string, std::vector<std::string>> listed;  // absolute folder -> names with ".tmp."
  std::error_code ec;
  const std::string key = fs::absolute(folder.empty() ? fs::path(".") : folder, ec).lexically_normal().string();
  if (ec) return;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = listed.find(key);
  if (it == listed.end()) {
    std::vector<std::string> names;
    if (DIR* dir = ::opendir(key.c_str())) {
      while (const dirent* entry = ::readdir(dir))
        if (std::strstr(entry->d_name, ".tmp.") != nullptr) names.emplace_back(entry->d_name);
      ::closedir(dir);
    }
    it = listed.emplace(key, std::move(names)).first;
  }
  std::vector<std::string>& names = it->second;
  names.erase(std::remove_if(names.begin(), names.end(),
                             [&](const std::string& name) {
                               if (!temporary_of_a_dead_process(name, prefix)) return false;
                               // Only a regular file of this user: never a link, a folder or
                               // another user's file that happens to match the pattern.
                               const std::string file = (fs::path(key) / name).string();
                               struct stat sb {};
                               if (::lstat(file.c_str(), &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_uid == ::geteuid())
                                 (void)::unlink(file.c_str());
                               return true;
                             }),
              names.end());
}

}  // namespace

// A hash of the whole name keeps two long outputs that share their cut part apart (export-chakra's
// per-device files under a long prefix would otherwise share one temporary).
std::string temporary_prefix(const std::string& name) {
  if (name.size() <= 200) return name + ".tmp.";
  std::uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (const unsigned char ch : name) h = (h ^ ch) * 1099511628211ULL;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return name.substr(0, 180) + "." + hex + ".tmp.";
}

std::string output_target(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p(path);
  for (int links = 0; links < 40; ++links) {  // Linux's own bound on links in one lookup
    std::error_code ec;
    if (!fs::is_symlink(fs::symlink_status(p, ec))) return p.string();
    // The kernel's fs.protected_symlinks rule, which a link followed here would bypass: in a sticky,
    // world-writable folder (/tmp) a link is followed only if it is this user's or the folder owner's
    // (another user's link there could aim a write at any file of ours).
    struct stat link {
    }, folder{};
    const fs::path parent = p.has_parent_path() ? p.parent_path() : fs::path(".");
    if (::lstat(p.c_str(), &link) == 0 && ::stat(parent.c_str(), &folder) == 0 && (folder.st_mode & S_ISVTX) &&
        (folder.st_mode & S_IWOTH) && link.st_uid != ::geteuid() && link.st_uid != folder.st_uid)
      throw Error("cannot write " + path + ": " + p.string() +
                  " is another user's symbolic link in a shared sticky folder; not followed");
    const fs::path to = fs::read_symlink(p, ec);
    if (ec) return p.string();
    p = to.is_absolute() ? to : p.parent_path() / to;
  }
  throw Error("cannot write " + path + ": too many levels of symbolic links (a loop?)");
}

int open_to_write_through(const std::string& path) {
  constexpr auto kReaderGrace = std::chrono::seconds(2);
  const auto give_up = std::chrono::steady_clock::now() + kReaderGrace;
  for (;;) {
    // Without O_NONBLOCK a FIFO with no reader blocks here; with it, ENXIO says so at once.
    const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0) {
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      return fd;
    }
    if (errno != ENXIO && errno != EINTR) throw Error("cannot write " + path + ": " + std::strerror(errno));
    if (errno == ENXIO && std::chrono::steady_clock::now() >= give_up)
      throw Error("cannot write " + path + ": a pipe (FIFO) that no program reads");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void write_file_atomically(const std::string& path, const std::string& contents) {
  namespace fs = std::filesystem;
  if (path.empty()) throw Error("cannot write an output file with an empty name");
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);  // follows symbolic links
  if (!ec && fs::exists(st) && !fs::is_regular_file(st)) {
    // A device, a FIFO or a socket is written into, never replaced: a rename would put a regular
    // file in its place (/dev/null would become a file).
    if (fs::is_directory(st)) throw Error("cannot write " + path + ": is a folder");
    const int fd = open_to_write_through(path);
    int err = 0;
    const bool ok = write_whole(fd, contents, err);
    if (::close(fd) != 0 && ok) err = errno;
    if (!ok || err != 0) throw Error("cannot write " + path + ": " + std::strerror(err));
    return;
  }
  // A symbolic link stays a link: its target is the file replaced (or created, for a dangling link).
  const std::string target = output_target(path);
  // The temporary sits in the same folder so the rename stays within one file system (atomic).
  const fs::path target_path(target);
  const std::string prefix = temporary_prefix(target_path.filename().string());
  remove_stale_temporaries(target_path.parent_path(), prefix);
  const std::string temp = (target_path.parent_path() / (prefix + std::to_string(::getpid()))).string();
  // A new file, never through a link or onto a file planted under the temporary's (predictable) name.
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
  if (fd < 0 && errno == EEXIST && ::unlink(temp.c_str()) == 0)
    fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
  if (fd < 0) throw Error("cannot write " + path + ": " + std::strerror(errno));
  // An existing file keeps its permissions.
  struct stat old {};
  if (::stat(target.c_str(), &old) == 0 && S_ISREG(old.st_mode)) (void)::fchmod(fd, old.st_mode & 07777);
  int err = 0;
  bool ok = write_whole(fd, contents, err);
  // On disk before the rename makes it the file, or a power cut could leave a renamed empty file.
  if (ok && ::fsync(fd) != 0) ok = false, err = errno;
  if (::close(fd) != 0 && ok) ok = false, err = errno;
  if (!ok) {
    std::error_code ignored;
    fs::remove(temp, ignored);
    throw Error("cannot write " + path + ": " + std::strerror(err));
  }
  fs::rename(temp, target, ec);
  if (ec) {
    std::error_code ignored;
    fs::remove(temp, ignored);
    throw Error("cannot write " + path + ": " + ec.message());
  }
}

// ---- equality: every field a plan file holds (the JSON round trip's test) ----

namespace {

bool same_op(const Op& a, const Op& b) {
  return a.kind == b.kind && a.pass == b.pass && a.node == b.node && a.label == b.label && a.tags == b.tags &&
         a.microbatch == b.microbatch && a.flops == b.flops && a.memory_bytes == b.memory_bytes && a.bytes == b.bytes &&
         a.device_set == b.device_set && a.peer_set == b.peer_set && a.family == b.family && a.pair == b.pair &&
         a.waits == b.waits && a.uses == b.uses && a.segment == b.segment && a.segments == b.segments &&
         a.tp_bytes == b.tp_bytes && a.tp_collectives == b.tp_collectives && a.cp_bytes == b.cp_bytes &&
         a.cp_steps == b.cp_steps && a.elementwise_bytes == b.elementwise_bytes &&
         a.recompute_flops == b.recompute_flops && a.gemm_kernels == b.gemm_kernels &&
         a.route_groups == b.route_groups && a.route_group_limit == b.route_group_limit &&
         a.route_top_k == b.route_top_k;
}

bool same_plan(const Plan& a, const Plan& b) {
  if (a.streams.size() != b.streams.size() || a.buffers.size() != b.buffers.size()) return false;
  for (std::size_t s = 0; s < a.streams.size(); ++s) {
    const Stream& x = a.streams[s];
    const Stream& y = b.streams[s];
    if (x.name != y.name || x.ops.size() != y.ops.size()) return false;
    for (std::size_t i = 0; i < x.ops.size(); ++i)
      if (!same_op(x.ops[i], y.ops[i])) return false;
  }
  for (std::size_t i = 0; i < a.buffers.size(); ++i) {
    const Buffer& x = a.buffers[i];
    const Buffer& y = b.buffers[i];
    if (x.name != y.name || x.kind != y.kind || x.bytes != y.bytes || x.alloc != y.alloc || x.free != y.free)
      return false;
  }
  return true;
}

}  // namespace

bool operator==(const Program& a, const Program& b) {
  if (a.model_name != b.model_name || a.model_spec != b.model_spec || a.segments != b.segments ||
      a.training.seq_len != b.training.seq_len || a.training.micro_batch_size != b.training.micro_batch_size ||
      a.training.precision != b.training.precision || a.training.fp32_main_grads != b.training.fp32_main_grads ||
      a.training.grad_accumulation != b.training.grad_accumulation || a.microbatches != b.microbatches ||
      a.num_devices != b.num_devices || a.device_sets != b.device_sets || a.families != b.families ||
      a.plan_of_device != b.plan_of_device || a.sm_partition != b.sm_partition || a.clip_grad != b.clip_grad ||
      a.plans.size() != b.plans.size())
    return false;
  for (std::size_t i = 0; i < a.plans.size(); ++i)
    if (!same_plan(a.plans[i], b.plans[i])) return false;
  return true;
}

}  // namespace piper::core
