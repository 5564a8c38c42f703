// The few CUDA runtime calls the host code of the kernels makes, for the emulation on
// host memory. Launches run synchronously, so streams and events only need handles.
#include "emu.h"

#include <cstring>

namespace {
// Distinct non-null handles; nothing is ever waited on.
CUstream_st* next_stream() {
  static unsigned char slots[64];
  static unsigned n = 0;
  return reinterpret_cast<CUstream_st*>(&slots[n++ % 64]);
}
CUevent_st* next_event() {
  static unsigned char slots[64];
  static unsigned n = 0;
  return reinterpret_cast<CUevent_st*>(&slots[n++ % 64]);
}
}  // namespace

extern "C" cudaError_t cudaGetLastError() { return emu::take_error(); }

// 1: later launches run their blocks last to first; 0: first to last.
extern "C" void emu_set_block_order(int reverse) { emu::reverse_block_order = reverse != 0; }

// What the kernels executed since the last call (emu.h Counters): out = {mma, philox, atomics}.
extern "C" void emu_take_counters(uint64_t* out) {
  out[0] = emu::counters.mma;
  out[1] = emu::counters.philox;
  out[2] = emu::counters.atomics;
  emu::counters = emu::Counters{};
}
extern "C" cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  return cudaSuccess;
}
extern "C" const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaErrorLaunchFailure ? "cudaErrorLaunchFailure (emulated)" : "emulated error";
}
extern "C" const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaErrorLaunchFailure ? emu::reported.c_str() : "emulated runtime call failed";
}
extern "C" cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) {
  return cudaSuccess;
}
extern "C" cudaError_t cudaGetDevice(int* dev) {
  *dev = 0;
  return cudaSuccess;
}
extern "C" cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = next_stream();
  return cudaSuccess;
}
extern "C" cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = next_event();
  return cudaSuccess;
}
extern "C" cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
extern "C" cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned) {
  return cudaSuccess;
}
