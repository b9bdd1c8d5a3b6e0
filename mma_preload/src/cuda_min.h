// Minimal CUDA runtime / driver declarations, enough for mma_preload and the modelled runtime.
// Values match the CUDA 12/13 headers; no CUDA toolkit is needed to build.
#pragma once
#include <cstddef>
#include <cstdint>

extern "C" {

typedef int cudaError_t;
enum : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorPeerAccessAlreadyEnabled = 704,
  cudaErrorNotSupported = 801,
  cudaErrorUnknown = 999,
};

typedef int cudaMemcpyKind;
enum : int {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

enum : int {
  cudaMemoryTypeUnregistered = 0,
  cudaMemoryTypeHost = 1,
  cudaMemoryTypeDevice = 2,
  cudaMemoryTypeManaged = 3,
};

// The real struct is {type, device, devicePointer, hostPointer}; padding guards against growth in newer runtimes.
struct cudaPointerAttributes {
  int type;
  int device;
  void* devicePointer;
  void* hostPointer;
  long reserved[16];
};

struct CUstream_st;
struct CUevent_st;
typedef CUstream_st* cudaStream_t;
typedef CUevent_st* cudaEvent_t;
typedef void (*cudaHostFn_t)(void* userData);
typedef void (*cudaStreamCallback_t)(cudaStream_t stream, cudaError_t status, void* userData);

#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)
enum : unsigned {
  cudaStreamDefault = 0x0,
  cudaStreamNonBlocking = 0x1,
  cudaEventDefault = 0x0,
  cudaEventBlockingSync = 0x1,
  cudaEventDisableTiming = 0x2,
  cudaHostAllocDefault = 0x0,
  cudaHostAllocPortable = 0x1,
  cudaHostAllocMapped = 0x2,
  cudaHostRegisterDefault = 0x0,
};
enum : int { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1 };

// Driver API pieces used for the stream wait (memory op or spin kernel).
typedef int CUresult;
enum : int { CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_NOT_FOUND = 500, CUDA_ERROR_NOT_SUPPORTED = 801 };
typedef unsigned long long CUdeviceptr;
typedef CUstream_st* CUstream;
struct CUmod_st;
struct CUfunc_st;
typedef CUmod_st* CUmodule;
typedef CUfunc_st* CUfunction;
enum : unsigned { CU_STREAM_WAIT_VALUE_GEQ = 0x0 };
struct CUmemLocation {
  int type;  // CU_MEM_LOCATION_TYPE_DEVICE = 1
  int id;
};
enum : unsigned long long { CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3 };

}  // extern "C"
