// Calibrated kernel tables (`piper calibrate`, docs/cost-model.md "Calibrating a table"): the times a
// run measured are compared, kernel class by kernel class, with what the per-kernel cost model
// predicts for the same plan, and one time multiplier is fitted per class (GEMM, attention,
// memory-bound, AdamW). The result is a derived kernel table ({"base": …, "gemm_scale": …}): it keeps
// the base table's dependence on shape, so it predicts other shapes, strategies and models.
#pragma once

#include <array>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "piper/core/program.hpp"
#include "piper/sim/cost_model.hpp"

namespace piper::sim {

enum class KernelClass { Gemm = 0, Attention, Memory, Adamw };
inline constexpr int kKernelClasses = 4;
std::string to_string(KernelClass c);
// Time per kernel class.
using ClassSeconds = std::array<double, kKernelClasses>;

// One measured time and the model's prediction of the same work, split by class.
struct CalibrationObservation {
  std::string what;          // "COMPUTE F (flops 9.06e12)", "GEMM kernels"
  ClassSeconds predicted{};  // by the base table, without the launch floors: what the per-class scales move
  double measured_s = 0;
  // The kernels' launch floors (KernelTable::launch_floor_s each), which a scale does not move: the
  // calibrated table predicts fixed_s + sum of multiplier x predicted. 0 for a kernel trace, whose
  // kernel durations hold no launch gaps.
  double fixed_s = 0;
};

struct TableCalibration {
  std::string base;                             // the base table (a built-in name or file)
  ClassSeconds multiplier{1, 1, 1, 1};          // measured over predicted time, per class
  std::array<bool, kKernelClasses> observed{};  // false: no observation had time in the class (multiplier 1)
  // A run may be slower than its GPU's measured kernels, but not by much faster: a multiplier is at
  // least kMinMultiplier. A class the fit holds there is one the observations could not separate
  // from the others (give a kernel trace).
  static constexpr double kMinMultiplier = 0.5;
  std::array<bool, kKernelClasses> at_bound{};
  std::vector<CalibrationObservation> observations;
  // The derived table: {"name", "base", "gemm_scale", "attention_scale", "memory_scale", "adamw_scale",
  // "calibration": {how it was made, the multipliers, each observation}}; a scale is 1 / multiplier.
  nlohmann::json table_json(const std::string& name, const std::string& source) const;
};

// Fits the multipliers to observations: least squares of the relative errors, each multiplier at
// least kMinMultiplier, with a weak pull of the observed classes towards one common multiplier (it
// decides what the observations leave open); a class with no time in any observation keeps 1. Throws
// core::Error when nothing was observed, or when a multiplier passes 1 / kMinTableScale (what a
// calibrated table may scale); `where` (the file) prefixes its errors.
void fit_multipliers(TableCalibration& c, const std::string& where = "calibrate");

// From the op times of a run of `program` (a piper-calibration file, `piper run --calibrate`): one
// observation per calibration entry that some COMPUTE or UPD op of the plan matches. `where` (the
// file) prefixes its errors: a COMPUTE or UPD entry's time must be > 0, and no op may be measured
// more than 1 / kMinTableScale times faster or slower than the table predicts (a unit slipped).
TableCalibration calibrate_from_ops(const core::Program& program, const CostModel& cost, const Calibration& measured,
                                    const std::string& where = "calibrate");

// From a Chrome trace of GPU kernels (the PyTorch profiler's export: events with "ph": "X",
// "cat": "kernel", "name", "dur" in µs) covering `steps` training steps of device `device`'s plan: the
// kernel times summed by class (classify_kernel), one observation per class. `steps` is at most the
// trace's kernels (a step runs one at least); the classes' times obey calibrate_from_ops's bounds.
TableCalibration calibrate_from_trace(const core::Program& program, const CostModel& cost, const nlohmann::json& trace,
                                      int steps, int device, const std::string& where);

// The class of a GPU kernel by its name (cuBLAS/nvjet/CUTLASS GEMMs, SDPA/flash attention, multi-tensor
// AdamW, the rest memory-bound); false for communication kernels (NCCL), which are not compute.
bool classify_kernel(const std::string& name, KernelClass& out);

// The model's prediction of one op by class (the per-kernel model's split of kernel_seconds) without
// its kernels' launch floors, which are added to *launch_s when given; all zero for ops the per-kernel
// model does not cost.
ClassSeconds class_seconds(const core::Program& program, const CostModel& cost, int device, const core::Op& op,
                           double* launch_s = nullptr);

}  // namespace piper::sim
