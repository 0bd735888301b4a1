// Training driver of the CUDA backend: N virtual devices in one process sharing the current GPU
// (loopback transport, one thread per device), or one MPI rank per GPU over NCCL.
#pragma once

#include "piper/core/program.hpp"
#include "piper/runtime/cuda/device.hpp"
#include "piper/runtime/trainer.hpp"

namespace piper::runtime::cuda {

struct CudaRunOptions {
  bool virtual_devices = false;  // every device of the plan in this process, on GPU 0
  DType dtype = DType::F32;
};

// Virtual devices: no MPI needed. Otherwise MPI must be initialised with one rank per plan device;
// rank r uses GPU (local rank mod visible GPUs). Writes the same report, parameter dump, trace,
// checkpoint and calibration files as train_distributed; the trace and the calibration hold CUDA-event
// times per op. The program's sm_partition is realised once per GPU (sm_partition.hpp).
TrainResult train_cuda(const core::Program& program, const TrainOptions& options, const CudaRunOptions& cuda);

}  // namespace piper::runtime::cuda
