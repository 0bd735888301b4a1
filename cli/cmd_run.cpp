// `piper run`: trains a compiled Program for real, one MPI rank per device (host backend; or every
// device as a thread of this process with --virtual-devices), on GPUs (--backend cuda: one rank per
// GPU over NCCL, or --virtual-devices on one GPU), or the single-process reference on the same global
// batch (--reference).
#include <algorithm>
#include <array>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <mpi.h>

#include "cli/common.hpp"
#include "piper/core/limits.hpp"
#include "piper/runtime/executor.hpp"
#include "piper/runtime/trainer.hpp"
#include "piper/sim/simulate.hpp"
#ifdef PIPER_HAVE_CUDA
#include "piper/runtime/cuda/cuda_trainer.hpp"
#endif

namespace piper::cli {

namespace {

// The settings that apply only with --loss-scale dynamic.
constexpr std::array<const char*, 3> kDynamicScaleFlags = {"--initial-loss-scale", "--loss-scale-window",
                                                           "--min-loss-scale"};

struct RunArgs {
  ScenarioFlags scenario;
  std::string plan_path;
  std::optional<core::Scenario> scenario_file;  // --scenario's, read once (apply_scenario_train)
  bool reference = false;
  std::string backend = "host";
  bool virtual_devices = false;
  std::string precision = "fp32";
  std::string on_nonfinite = "stop";
  std::string lr_decay = "constant";
  std::string loss_scale;  // --loss-scale: "dynamic", a power of two, or empty (none)
  runtime::TrainOptions train;
  std::set<std::string> dynamic_only_given;            // kDynamicScaleFlags given (as flags or scenario keys)
  json train_given;                                    // the training flags given, under the scenario's "train" keys
  std::map<std::string, std::string> train_from_file;  // flag -> "train" key, for each setting the scenario set
  CLI::Option* plan = nullptr;
};

// A training setting's error names its flag ("--beta1 must be in [0, 1) (got 1)"); a setting the
// scenario's "train" section set is named as the file's field instead ("s.json: field 'train.beta1':
// must be in [0, 1) (got 1)"), and so is each such setting it mentions ("between 0 and 'train.lr' 0.003").
std::string in_train_terms(const RunArgs& a, const std::string& message) {
  if (a.train_from_file.empty()) return message;
  auto flag_at = [&](std::size_t pos) -> const std::pair<const std::string, std::string>* {
    for (const auto& entry : a.train_from_file) {
      const std::string& flag = entry.first;
      const std::size_t end = pos + flag.size();
      if (message.compare(pos, flag.size(), flag) == 0 &&
          (end == message.size() || !(std::isalnum(static_cast<unsigned char>(message[end])) || message[end] == '-')))
        return &entry;
    }
    return nullptr;
  };
  std::string lead, body;
  std::size_t i = 0;
  if (const auto* first = flag_at(0)) {
    lead = fmt::format("{}: field 'train.{}': ", a.scenario.scenario_path, first->second);
    i = first->first.size();
    if (message.compare(i, 1, " ") == 0) ++i;
  }
  while (i < message.size()) {
    if (const auto* f = (i == 0 || message[i - 1] == ' ') ? flag_at(i) : nullptr) {
      body += "'train." + f->second + "'";
      i += f->first.size();
    } else {
      body += message[i++];
    }
  }
  return lead + body;
}

// Runs `train` in this process (the reference, --virtual-devices), its setup errors in the scenario's
// terms: the trainer names a setting as its flag ("--steps 2 is below the step of the checkpoint").
template <class Train>
void train_here(const RunArgs& a, Train&& train) {
  try {
    train();
  } catch (const std::invalid_argument& e) {
    throw CliError("", in_train_terms(a, e.what()));
  }
}

// --save-scenario: the compile inputs and the training settings given (a scenario's "train" section),
// so that `piper run --scenario FILE` repeats the run. Written after a run that succeeded (rank 0 of an
// MPI run): the option was taken and nothing was written.
void save_run_scenario(const RunArgs& a) {
  if (a.scenario.save_scenario_path.empty()) return;
  core::Scenario s = a.scenario.scenario();
  s.train = a.train_given;
  a.scenario.save_if_requested(s);
}

// A failure mid-step leaves peers waiting on this rank: end them all now, with the reason. A
// RuntimeError (a peer died, stalled or disagreed) exits 4; a core::Error that is not an internal one
// (an output that cannot be written: `--report` on a full disk) exits 2, as it does without mpirun;
// anything else is a bug in piper (3).
[[noreturn]] void abort_ranks(int rank, const std::exception& e) {
  const bool bad_input_or_output =
      dynamic_cast<const core::Error*>(&e) != nullptr && dynamic_cast<const core::InternalError*>(&e) == nullptr;
  if (dynamic_cast<const runtime::RuntimeError*>(&e) || bad_input_or_output) {
    fmt::print(stderr, "piper: error: rank {}: {}\n", rank, one_line(e.what()));
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, bad_input_or_output ? kExitBadInput : kExitPeerFailure);
  } else {
    fmt::print(stderr,
               "piper: internal error: rank {}: {} (please report this: it is a bug in piper, not in the input)\n",
               rank, one_line(e.what()));
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, kExitInternal);
  }
  std::abort();  // MPI_Abort does not return
}

core::Program load_program(const RunArgs& a) {
  if (a.scenario_file) return core::compile_scenario(*a.scenario_file).result.program;
  if (!a.plan_path.empty()) {
    const json j = read_json_file(a.plan_path);  // its errors name the file already
    try {
      return core::Program::from_json(j);
    } catch (const core::Error& e) {
      throw CliError(a.plan_path, e.what());
    }
  }
  if (a.scenario.model.empty())
    throw CliError("", "give --plan FILE, --scenario FILE or the compile inputs (--model ...)");
  return core::compile_scenario(a.scenario.scenario()).result.program;
}

// --backend cuda: checks for a GPU first (one line and exit 2 without one), then trains on virtual
// devices in this process or as one MPI rank per GPU.
int run_cuda(const RunArgs& a) {
#ifdef PIPER_HAVE_CUDA
  std::string why;
  if (!runtime::cuda::device_available(&why)) {
    print_error("", "--backend cuda: " + why);
    return kExitBadInput;
  }
  runtime::cuda::CudaRunOptions c;
  c.virtual_devices = a.virtual_devices;
  c.dtype = a.precision == "bf16"   ? runtime::cuda::DType::BF16
            : a.precision == "fp16" ? runtime::cuda::DType::F16
                                    : runtime::cuda::DType::F32;
  if (a.virtual_devices) {
    const core::Program program = load_program(a);
    train_here(a, [&] { runtime::cuda::train_cuda(program, a.train, c); });
    save_run_scenario(a);
    return 0;
  }
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SINGLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int code = 0;
  core::Program program;
  try {
    program = load_program(a);
  } catch (const CliError& e) {
    if (rank == 0) print_error(e.file(), e.what());
    code = kExitBadInput;
  } catch (const std::exception& e) {
    if (rank == 0) print_error("", e.what());
    code = kExitBadInput;
  }
  if (code == 0) {
    try {
      runtime::TrainOptions o = a.train;
      o.print = rank == 0;
      runtime::cuda::train_cuda(program, o, c);
      if (rank == 0) save_run_scenario(a);
    } catch (const runtime::ReportedByAnotherRank&) {
      code = kExitBadInput;
    } catch (const runtime::TrainingDiverged& e) {
      print_error("", e.what());
      code = kExitBadInput;
    } catch (const std::invalid_argument& e) {
      print_error("", in_train_terms(a, e.what()));
      code = kExitBadInput;
    } catch (const std::exception& e) {
      abort_ranks(rank, e);
    }
  }
  MPI_Finalize();
  return code;
#else
  (void)a;
  print_error("", "--backend cuda: this piper was built without CUDA (configure with a CUDA compiler, PIPER_CUDA=ON)");
  return kExitBadInput;
#endif
}

int run_distributed(const RunArgs& a) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SINGLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int code = 0;
  core::Program program;
  try {
    program = load_program(a);
  } catch (const CliError& e) {  // the same on every rank: one rank says it
    if (rank == 0) print_error(e.file(), e.what());
    code = kExitBadInput;
  } catch (const std::exception& e) {
    if (rank == 0) print_error("", e.what());
    code = kExitBadInput;
  }
  if (code == 0) {
    try {
      runtime::TrainOptions o = a.train;
      o.print = rank == 0;
      runtime::train_distributed(program, o);
      if (rank == 0) save_run_scenario(a);
    } catch (const runtime::ReportedByAnotherRank&) {
      code = kExitBadInput;
    } catch (const runtime::TrainingDiverged& e) {  // every rank stopped at the same step; rank 0 says why
      print_error("", e.what());
      code = kExitBadInput;
    } catch (const std::invalid_argument& e) {  // setup errors: train_distributed throws them on one rank only
      print_error("", in_train_terms(a, e.what()));
      code = kExitBadInput;
    } catch (const std::exception& e) {
      abort_ranks(rank, e);
    }
  }
  MPI_Finalize();
  return code;
}

// --scenario: the file fixes the model and strategy (a compile input beside it is an error naming the
// flag), and its "train" section sets each training setting whose flag was not given.
void apply_scenario_train(RunArgs& a, const CLI::App& cmd) {
  a.scenario_file = a.scenario.scenario();
  sim::check_scenario_cluster_and_engine(*a.scenario_file);
  const core::Scenario& s = *a.scenario_file;
  auto& t = a.train;
  for (auto it = s.train.begin(); it != s.train.end(); ++it) {
    const std::string& key = it.key();
    std::string flag = "--" + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (cmd.get_option(flag)->count() > 0) continue;  // the flag wins
    a.train_from_file[flag] = key;
    const json& v = it.value();
    if (key == "steps") t.steps = v.get<int>();
    if (key == "seed") t.seed = v.get<std::uint64_t>();
    if (key == "lr") t.adamw.lr = v.get<float>();
    if (key == "min_lr") t.adamw.min_lr = v.get<float>();
    if (key == "warmup_steps") t.adamw.warmup_steps = v.get<int>();
    if (key == "lr_decay") a.lr_decay = v.get<std::string>();
    if (key == "lr_decay_steps") t.adamw.decay_steps = v.get<int>();
    if (key == "weight_decay") t.adamw.weight_decay = v.get<float>();
    if (key == "beta1") t.adamw.beta1 = v.get<float>();
    if (key == "beta2") t.adamw.beta2 = v.get<float>();
    if (key == "adam_eps") t.adamw.eps = v.get<float>();
    if (key == "loss_scale") a.loss_scale = v.is_string() ? v.get<std::string>() : fmt::format("{}", v.get<double>());
    if (std::find(kDynamicScaleFlags.begin(), kDynamicScaleFlags.end(), flag) != kDynamicScaleFlags.end())
      a.dynamic_only_given.insert(flag);
    if (key == "initial_loss_scale") t.adamw.loss_scaling.initial = v.get<double>();
    if (key == "loss_scale_window") t.adamw.loss_scaling.window = v.get<int>();
    if (key == "min_loss_scale") t.adamw.loss_scaling.min_scale = v.get<double>();
    if (key == "data") t.data_path = v.get<std::string>();
    if (key == "on_nonfinite") a.on_nonfinite = v.get<std::string>();
    if (key == "resume") t.resume_path = v.get<std::string>();
    if (key == "precision") a.precision = v.get<std::string>();
    // The section's files are looked for now, so that a missing one is named as the file's field: the
    // trainer reads them later and names them as the flags ("--data nosuch.txt: cannot open").
    if (key == "data" || key == "resume") {
      namespace fs = std::filesystem;
      const std::string file = v.get<std::string>();
      std::error_code ec;
      const fs::file_status st = fs::status(file, ec);
      const char* why = ec || !fs::exists(st)  ? "cannot open: no such file"
                        : fs::is_directory(st) ? "is a directory, expected a file"
                                               : nullptr;
      if (why != nullptr)
        throw CliError("", fmt::format("{}: field 'train.{}': '{}': {}", a.scenario.scenario_path, key,
                                       core::printable(file, 200), why));
    }
  }
}

// --loss-scale's value: "dynamic", or a static scale (a power of two, checked by check_loss_scaling).
void parse_loss_scale(RunArgs& a) {
  auto& ls = a.train.adamw.loss_scaling;
  if (a.loss_scale.empty()) {
    ls.mode = runtime::host::LossScaleMode::None;
  } else if (a.loss_scale == "dynamic") {
    ls.mode = runtime::host::LossScaleMode::Dynamic;
  } else {
    // In decimal, as every number flag: stod also read "0x10", "0x1p4" and " 16" as 16.
    std::size_t used = 0;
    double v = 0;
    try {
      if (decimal_number(a.loss_scale, false)) v = std::stod(a.loss_scale, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != a.loss_scale.size()) {
      const std::string shown = core::printable(a.loss_scale, 80);
      if (std::any_of(a.loss_scale.begin(), a.loss_scale.end(), [](char c) { return std::isdigit(c & 0xff); }))
        throw CliError("", fmt::format("--loss-scale '{}': expected \"dynamic\" or a static scale in decimal, such as "
                                       "1024",
                                       shown));
      throw CliError("",
                     fmt::format("--loss-scale must be \"dynamic\" or a static scale such as 1024 (got '{}')", shown));
    }
    ls.mode = runtime::host::LossScaleMode::Static;
    ls.initial = v;
  }
  if (!a.dynamic_only_given.empty() && ls.mode != runtime::host::LossScaleMode::Dynamic)
    throw CliError("", fmt::format("{} applies only with --loss-scale dynamic", *a.dynamic_only_given.begin()));
  runtime::host::check_loss_scaling(ls);
}

// AdamW and the learning-rate schedule (runtime::host::AdamWConfig; a scenario's "train" section
// under the same names).
void add_optimizer_flags(CLI::App* cmd, RunArgs& a) {
  cmd->add_option("--lr", a.train.adamw.lr, "AdamW peak learning rate (after warmup, before decay)")
      ->check(kNonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--min-lr", a.train.adamw.min_lr, "learning rate the decay ends at")
      ->check(kNonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--warmup-steps", a.train.adamw.warmup_steps, "linear warmup: step s of the first N uses lr * s / N")
      ->check(kNonNegativeInt)
      ->capture_default_str();
  cmd->add_option("--lr-decay", a.lr_decay, "after warmup: constant, cosine or linear decay to --min-lr")
      ->check(CLI::IsMember({"constant", "cosine", "linear"}))
      ->capture_default_str();
  cmd->add_option("--lr-decay-steps", a.train.adamw.decay_steps,
                  "the step at which the decay reaches --min-lr (default: --steps)")
      ->check(kPositiveInt);
  cmd->add_option("--weight-decay", a.train.adamw.weight_decay, "AdamW decoupled weight decay")
      ->check(kNonNegativeNumber)
      ->capture_default_str();
  cmd->add_option("--beta1", a.train.adamw.beta1, "AdamW beta1")->capture_default_str();
  cmd->add_option("--beta2", a.train.adamw.beta2, "AdamW beta2")->capture_default_str();
  auto& ls = a.train.adamw.loss_scaling;
  cmd->add_option("--loss-scale", a.loss_scale,
                  "loss scaling (fp16 training; needs --clip-grad): dynamic (halved and the step skipped when "
                  "gradients overflow, doubled after --loss-scale-window good steps), or a static power of two");
  cmd->add_option("--initial-loss-scale", ls.initial, "--loss-scale dynamic: the first scale (a power of two)")
      ->capture_default_str();
  cmd->add_option("--loss-scale-window", ls.window,
                  "--loss-scale dynamic: good steps in a row before the scale doubles")
      ->check(kPositiveInt)
      ->capture_default_str();
  cmd->add_option("--min-loss-scale", ls.min_scale, "--loss-scale dynamic: the scale never falls below this")
      ->capture_default_str();
}

// The run's optimizer, loss-scaling and precision settings from the flags (and scenario), each
// checked: one line naming the flag for what cannot work.
void settle_training_flags(RunArgs& a, const CLI::App& cmd) {
  a.train.skip_nonfinite = a.on_nonfinite == "skip";
  auto& adamw = a.train.adamw;
  adamw.decay = runtime::host::parse_lr_decay(a.lr_decay);
  if (adamw.decay != runtime::host::LrDecay::Constant && adamw.decay_steps == 0)
    adamw.decay_steps = a.train.steps;  // decay over the whole run
  runtime::host::check_adamw(adamw);
  for (const char* flag : kDynamicScaleFlags)
    if (cmd.get_option(flag)->count() > 0) a.dynamic_only_given.insert(flag);
  parse_loss_scale(a);
  if (a.precision != "fp32" && a.backend != "cuda")
    throw CliError("", "--precision needs --backend cuda (the host backend computes in fp32)");
  // The training flags given, for --save-scenario (floats in their shortest form: 0.01, not 0.00999...).
  auto shortest = [](double f) { return std::stod(fmt::format("{}", static_cast<float>(f))); };
  for (const std::string& key : core::scenario_train_keys()) {
    std::string flag = "--" + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (cmd.get_option(flag)->count() == 0) continue;
    json& v = a.train_given[key];
    if (key == "steps") v = a.train.steps;
    if (key == "seed") v = a.train.seed;
    if (key == "lr") v = shortest(adamw.lr);
    if (key == "min_lr") v = shortest(adamw.min_lr);
    if (key == "warmup_steps") v = adamw.warmup_steps;
    if (key == "lr_decay") v = a.lr_decay;
    if (key == "lr_decay_steps") v = adamw.decay_steps;
    if (key == "weight_decay") v = shortest(adamw.weight_decay);
    if (key == "beta1") v = shortest(adamw.beta1);
    if (key == "beta2") v = shortest(adamw.beta2);
    if (key == "adam_eps") v = shortest(adamw.eps);
    if (key == "loss_scale") v = a.loss_scale == "dynamic" ? json(a.loss_scale) : json(adamw.loss_scaling.initial);
    if (key == "initial_loss_scale") v = adamw.loss_scaling.initial;
    if (key == "loss_scale_window") v = adamw.loss_scaling.window;
    if (key == "min_loss_scale") v = adamw.loss_scaling.min_scale;
    if (key == "data") v = a.train.data_path;
    if (key == "on_nonfinite") v = a.on_nonfinite;
    if (key == "resume") v = a.train.resume_path;
    if (key == "precision") v = a.precision;
  }
  if (a.precision == "fp16" && adamw.loss_scaling.mode == runtime::host::LossScaleMode::None)
    throw CliError("",
                   "--precision fp16 needs --loss-scale (dynamic, or a static power of two): fp16 "
                   "gradients below 6e-8 flush to zero without it");
}

// The same, with a setting of the scenario's "train" section named as the file's field.
void settle_training_settings(RunArgs& a, const CLI::App& cmd) {
  try {
    settle_training_flags(a, cmd);
  } catch (const CliError& e) {
    throw CliError(e.file(), in_train_terms(a, e.what()));
  } catch (const std::invalid_argument& e) {
    throw CliError("", in_train_terms(a, e.what()));
  }
}

}  // namespace

Command add_run_command(CLI::App& app) {
  auto args = std::make_shared<RunArgs>();
  CLI::App* cmd = app.add_subcommand(
      "run", "train a plan for real: one MPI rank per device (mpirun -np N piper run ...), or --reference");
  args->scenario.add_to(cmd);
  cmd->get_option("--model")->required(false);
  args->plan =
      cmd->add_option("--plan", args->plan_path, "a compiled Program (piper compile -o); else the compile inputs")
          ->excludes("--model");
  args->scenario
      .add_file_option(
          cmd,
          "a scenario file (piper-studio's, --save-scenario's): its model, strategy and \"train\" settings "
          "(the flags below win over them)")
      ->excludes(args->plan);
  cmd->add_flag("--reference", args->reference,
                "run the same model on the same global batch in one process, without parallelism");
  cmd->add_option("--backend", args->backend,
                  "host: Eigen kernels, one MPI rank per device (or --virtual-devices); cuda: GPUs (one MPI rank per "
                  "GPU over NCCL, or --virtual-devices)")
      ->check(CLI::IsMember({"host", "cuda"}));
  cmd->add_flag("--virtual-devices", args->virtual_devices,
                "run every device of the plan as a thread of this process, no mpirun (loopback transport; --backend "
                "cuda: all on one GPU)");
  cmd->add_option("--precision", args->precision,
                  "--backend cuda: storage type of parameters and activations (fp32 accumulation either way)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  cmd->add_option("--steps", args->train.steps, "training steps (a resumed run continues up to this step)")
      ->check(kPositiveInt);
  cmd->add_option("--seed", args->train.seed, "seed of the parameter initialisation and the synthetic token stream")
      ->check(kNonNegativeInt64);
  cmd->add_option("--data", args->train.data_path,
                  "train on this file's bytes (mod vocab) instead of synthetic tokens");
  add_optimizer_flags(cmd, *args);
  cmd->add_option(
         "--adam-eps", args->train.adamw.eps,
         "AdamW epsilon (the equivalence tests raise it so that rounding-level gradients stay rounding-level updates)")
      ->check(kNonNegativeNumber);
  cmd->add_option("--report", args->train.report_path, "write run.json: losses, tokens_per_s, step_time_s")
      ->check(kOutputPath);
  cmd->add_option("--trace", args->train.trace_path, "write the last step's measured timeline as a Chrome trace")
      ->check(kOutputPath);
  auto* save = cmd->add_option("--save", args->train.save_path,
                               "after the last step, write a checkpoint FILE (canonical layout: resumable under any "
                               "strategy of the same model)")
                   ->check(kOutputPath)
                   ->check(kMakesItsFolder);
  cmd->add_option("--save-every", args->train.save_every,
                  "also write the --save checkpoint every N steps (atomically: the last good one survives a crash)")
      ->check(kPositiveInt)
      ->needs(save);
  cmd->add_option("--resume", args->train.resume_path,
                  "continue from a checkpoint FILE, saved under this or another strategy of the same model");
  cmd->add_option("--dump-params", args->train.dump_params_path,
                  "write the final parameters (canonical layout) to FILE")
      ->check(kOutputPath);
  cmd->add_option("--calibrate", args->train.calibrate_path,
                  "write measured per-op times (median over the steps after the first) as a piper-calibration FILE for "
                  "piper simulate --calibration")
      ->check(kOutputPath);
  cmd->add_option("--on-nonfinite", args->on_nonfinite,
                  "a NaN/Inf loss, gradient norm or update: stop (exit 2, nothing saved after it) or skip the step "
                  "(its update is dropped, as Megatron does)")
      ->check(CLI::IsMember({"stop", "skip"}))
      ->capture_default_str();
  cmd->add_option("--stall-timeout", args->train.stall_timeout_s, "seconds without progress before a rank gives up")
      ->check(kPositiveNumber);
  return {cmd, [args, cmd]() -> int {
            if (!args->plan_path.empty()) args->scenario.reject_beside_plan();
            if (!args->scenario.scenario_path.empty()) apply_scenario_train(*args, *cmd);
            settle_training_settings(*args, *cmd);
            if (args->virtual_devices && args->reference)
              throw CliError("",
                             "--virtual-devices runs the plan's devices; --reference runs no plan devices: give one");
            // --reference runs on the host CPU: a GPU backend would be quietly ignored.
            if (args->reference && args->backend != "host")
              throw CliError("", "--reference runs in one process on the CPU; it takes no --backend " + args->backend +
                                     " (drop --reference to train on the GPUs)");
            if (args->reference && !args->train.calibrate_path.empty())
              throw CliError("", "--calibrate measures the plan's ops: it needs a distributed run, not --reference");
            // The reference runs no plan devices: the trace was taken and never written, exit 0.
            if (args->reference && !args->train.trace_path.empty())
              throw CliError("",
                             "--trace records the plan's devices' timeline: it needs a distributed run, not "
                             "--reference");
            if (args->backend == "cuda" && !args->reference) return run_cuda(*args);
            if (args->reference) {
              const core::Program program = load_program(*args);
              train_here(*args, [&] { runtime::train_reference(program, args->train); });
              save_run_scenario(*args);
              return 0;
            }
            if (args->virtual_devices) {
              const core::Program program = load_program(*args);
              train_here(*args, [&] { runtime::train_virtual(program, args->train); });
              save_run_scenario(*args);
              return 0;
            }
            return run_distributed(*args);
          }};
}

}  // namespace piper::cli
