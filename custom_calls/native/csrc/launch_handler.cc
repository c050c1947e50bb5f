// XLA FFI handler that launches precompiled kernels (DeepGEMM's, and Triton kernels compiled to
// cubins) on the call's CUDA stream: one, or a short sequence in order.
//
// Everything shape-dependent arrives as static attributes (see launch_plan.py): per kernel the
// cubin path, grid/block/cluster/shared memory, its argument list and its TMA descriptors, whose
// base addresses are taken from the call's buffers at every launch (XLA may place them anywhere).
// The kernels of a sequence share the call's operands; nothing else runs on the stream between
// them, so a later kernel launched programmatically overlaps only kernels of the same call.
// Driver entry points come from libcuda.so.1 at run time, so nothing links against a stub library.
//
// Two symbols share the launch: MoeJaxDeepGemmLaunch, and MoeJaxDeepGemmLaunchCmdBuffer with XLA's
// kCmdBufferCompatible trait. With the trait, XLA may record the call into a command buffer (a CUDA
// graph): it runs this handler once under stream capture and replays the recording on later
// executions. That is safe here because a launch depends only on static attributes and on the
// operands' device addresses, and XLA re-records a command buffer whenever the address of any
// allocation its commands use differs from the recorded one (CommandBufferThunk compares them on
// every execution; the custom-call command re-traces the handler), so the TMA descriptors frozen
// in the recorded kernel parameters always point at the current buffers. Values in device memory
// (m_indices, masked_m) are read by the kernel when it runs. The handler allocates no device
// memory and never synchronizes or queries the stream; its one-time kernel load per cubin and
// context runs in relaxed capture mode (it is not stream work), see GetKernel.
//
// A launch may be cooperative (launch[4]: the driver then guarantees that all blocks are resident
// at once, or fails the launch) and programmatic (launch[5]: programmatic stream serialization, so
// the kernel's blocks may start before the previous kernel on the stream has finished; only for
// kernels that wait with griddepcontrol.wait before reading what an earlier kernel wrote).

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <cuda.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// kArgPtr: operand address + byte offset; kArgSymBuffer: DeepGEMM's one-rank layout::SymBuffer by
// value ({int64 base; int64 offsets[72]; uint32 rank}: base = the operand's address, the rest zero).
constexpr int64_t kArgPtr = 0, kArgU32 = 1, kArgTmap = 2, kArgNull = 3, kArgBytes = 4, kArgSymBuffer = 5;
constexpr size_t kSymBufferBytes = 592;
constexpr size_t kTmapWords = 19;

struct Driver {
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*LibraryLoadFromFile)(CUlibrary*, const char*, CUjit_option*, void**, unsigned int,
                                  CUlibraryOption*, void**, unsigned int) = nullptr;
  CUresult (*LibraryGetKernelCount)(unsigned int*, CUlibrary) = nullptr;
  CUresult (*LibraryEnumerateKernels)(CUkernel*, unsigned int, CUlibrary) = nullptr;
  CUresult (*KernelGetFunction)(CUfunction*, CUkernel) = nullptr;
  CUresult (*FuncSetAttribute)(CUfunction, CUfunction_attribute, int) = nullptr;
  CUresult (*LaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**) = nullptr;
  CUresult (*TensorMapEncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                   CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                   CUtensorMapFloatOOBfill) = nullptr;
  CUresult (*StreamGetCtx)(CUstream, CUcontext*) = nullptr;
  CUresult (*CtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*CtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*CtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*ThreadExchangeStreamCaptureMode)(CUstreamCaptureMode*) = nullptr;
  std::string error;
};

template <typename T>
bool Load(void* lib, const char* name, T* fn, std::string* error) {
  *fn = reinterpret_cast<T>(dlsym(lib, name));
  if (*fn == nullptr) *error += std::string("missing driver symbol ") + name + "; ";
  return *fn != nullptr;
}

const Driver& GetDriver() {
  static Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d.error = std::string("cannot dlopen libcuda.so.1: ") + dlerror();
      return d;
    }
    Load(lib, "cuGetErrorString", &d.GetErrorString, &d.error);
    Load(lib, "cuLibraryLoadFromFile", &d.LibraryLoadFromFile, &d.error);
    Load(lib, "cuLibraryGetKernelCount", &d.LibraryGetKernelCount, &d.error);
    Load(lib, "cuLibraryEnumerateKernels", &d.LibraryEnumerateKernels, &d.error);
    Load(lib, "cuKernelGetFunction", &d.KernelGetFunction, &d.error);
    Load(lib, "cuFuncSetAttribute", &d.FuncSetAttribute, &d.error);
    Load(lib, "cuLaunchKernelEx", &d.LaunchKernelEx, &d.error);
    Load(lib, "cuTensorMapEncodeTiled", &d.TensorMapEncodeTiled, &d.error);
    Load(lib, "cuStreamGetCtx", &d.StreamGetCtx, &d.error);
    Load(lib, "cuCtxGetCurrent", &d.CtxGetCurrent, &d.error);
    Load(lib, "cuCtxPushCurrent_v2", &d.CtxPushCurrent, &d.error);
    Load(lib, "cuCtxPopCurrent_v2", &d.CtxPopCurrent, &d.error);
    Load(lib, "cuThreadExchangeStreamCaptureMode", &d.ThreadExchangeStreamCaptureMode, &d.error);
    return d;
  }();
  return d;
}

std::string CuError(const Driver& d, CUresult r, const char* what) {
  const char* s = nullptr;
  if (d.GetErrorString) d.GetErrorString(r, &s);
  return std::string(what) + " failed: " + (s ? s : "unknown CUDA error") + " (" + std::to_string(r) + ")";
}

// Bytes per element of the tensor-map data types launch_plan.py emits (4-bit types handled apart).
uint64_t ElementBytes(int64_t dtype) {
  switch (dtype) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: return 1;
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: return 2;
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32: return 4;
    case CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B:
    case CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B: return 1;  // two elements per byte, rounded up below
    default: return 0;
  }
}

struct LoadedKernel {
  CUfunction fn = nullptr;
  int smem = -1;
};

std::mutex g_mu;
std::map<std::pair<std::string, CUcontext>, LoadedKernel> g_kernels;
std::map<std::string, CUlibrary> g_libraries;

// Relaxed stream-capture mode for this thread while in scope: the first launch of a kernel may
// happen while XLA captures the stream into a command buffer, and loading a module is an API call
// that the default (thread-local) capture mode may refuse; it does no work on the captured stream.
class RelaxedCapture {
 public:
  explicit RelaxedCapture(const Driver& d) : d_(d) { d_.ThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { d_.ThreadExchangeStreamCaptureMode(&mode_); }

 private:
  const Driver& d_;
  CUstreamCaptureMode mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
};

// The slow path of GetKernel (caller holds g_mu): load the cubin's kernel and/or set its smem limit.
ffi::Error LoadKernel(const Driver& d, const std::string& path, const std::pair<std::string, CUcontext>& key,
                      int smem, CUfunction* out) {
  auto it = g_kernels.find(key);
  if (it == g_kernels.end()) {
    CUlibrary lib;
    auto lit = g_libraries.find(path);
    if (lit == g_libraries.end()) {
      CUresult r = d.LibraryLoadFromFile(&lib, path.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0);
      if (r != CUDA_SUCCESS) return ffi::Error::Internal(CuError(d, r, "cuLibraryLoadFromFile") + ": " + path);
      g_libraries[path] = lib;
    } else {
      lib = lit->second;
    }
    unsigned int count = 0;
    CUresult r = d.LibraryGetKernelCount(&count, lib);
    if (r != CUDA_SUCCESS) return ffi::Error::Internal(CuError(d, r, "cuLibraryGetKernelCount"));
    if (count != 1)
      return ffi::Error::Internal("cubin " + path + " holds " + std::to_string(count) + " kernels, expected 1");
    CUkernel kernel;
    r = d.LibraryEnumerateKernels(&kernel, 1, lib);
    if (r != CUDA_SUCCESS) return ffi::Error::Internal(CuError(d, r, "cuLibraryEnumerateKernels"));
    CUfunction fn;
    r = d.KernelGetFunction(&fn, kernel);
    if (r != CUDA_SUCCESS) return ffi::Error::Internal(CuError(d, r, "cuKernelGetFunction"));
    it = g_kernels.emplace(key, LoadedKernel{fn, -1}).first;
  }
  if (smem > 0 && it->second.smem != smem) {
    CUresult r = d.FuncSetAttribute(it->second.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem);
    if (r != CUDA_SUCCESS) return ffi::Error::Internal(CuError(d, r, "cuFuncSetAttribute(max dynamic smem)"));
    it->second.smem = smem;
  }
  *out = it->second.fn;
  return ffi::Error::Success();
}

// Loads (once per cubin and context) the single kernel of a cubin and raises its dynamic
// shared-memory limit (the attribute persists on the function).
ffi::Error GetKernel(const Driver& d, const std::string& path, CUcontext ctx, int smem, CUfunction* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto key = std::make_pair(path, ctx);
  auto it = g_kernels.find(key);
  if (it == g_kernels.end() || (smem > 0 && it->second.smem != smem)) {
    RelaxedCapture relaxed(d);
    return LoadKernel(d, path, key, smem, out);
  }
  *out = it->second.fn;
  return ffi::Error::Success();
}

// Encodes one kernel's tensor maps (tmaps: its words) for the current addresses, 64-byte aligned.
ffi::Error EncodeMaps(const Driver& d, const int64_t* tmaps, size_t num_maps, const std::vector<void*>& buffers,
                      const std::vector<uint64_t>& sizes, std::vector<CUtensorMap>* maps) {
  maps->resize(num_maps);
  for (size_t m = 0; m < num_maps; ++m) {
    const int64_t* w = tmaps + m * kTmapWords;
    const int64_t operand = w[0], offset = w[1], dtype = w[2], rank = w[3];
    if (operand < 0 || operand >= static_cast<int64_t>(buffers.size()) || rank < 1 || rank > 5)
      return ffi::Error::InvalidArgument("bad tensor map operand or rank");
    cuuint64_t dims[5], strides[4];
    cuuint32_t box[5], estrides[5];
    for (int i = 0; i < rank; ++i) {
      dims[i] = static_cast<cuuint64_t>(w[4 + i]);
      box[i] = static_cast<cuuint32_t>(w[13 + i]);
      estrides[i] = 1;
      if (i + 1 < rank) strides[i] = static_cast<cuuint64_t>(w[9 + i]);
    }
    // The map must stay inside its buffer (launch_plan.py checks the same at trace time).
    const uint64_t esize = ElementBytes(dtype);
    if (esize == 0) return ffi::Error::InvalidArgument("tensor map " + std::to_string(m) + ": unknown data type");
    for (int i = 0; i < rank; ++i)
      if (w[4 + i] <= 0) return ffi::Error::InvalidArgument("tensor map " + std::to_string(m) + ": a dimension is 0");
    const bool four_bit =
        dtype == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B || dtype == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B;
    uint64_t extent = four_bit ? (dims[0] + 1) / 2 : dims[0] * esize;
    for (int i = 1; i < rank; ++i) extent += (dims[i] - 1) * strides[i - 1];
    if (offset < 0 || static_cast<uint64_t>(offset) + extent > sizes[operand])
      return ffi::Error::InvalidArgument("tensor map " + std::to_string(m) + " spans " + std::to_string(extent) +
                                         " bytes past offset " + std::to_string(offset) + ", operand " +
                                         std::to_string(operand) + " holds " + std::to_string(sizes[operand]));
    void* base = static_cast<char*>(buffers[operand]) + offset;
    CUresult r = d.TensorMapEncodeTiled(&(*maps)[m], static_cast<CUtensorMapDataType>(dtype),
                                        static_cast<cuuint32_t>(rank), base, dims, strides, box, estrides,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, static_cast<CUtensorMapSwizzle>(w[18]),
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
      return ffi::Error::Internal(CuError(d, r, "cuTensorMapEncodeTiled") + " for map " + std::to_string(m));
  }
  return ffi::Error::Success();
}

// Kernel arguments of one kernel (args: its triples): kernelParams[i] points at the i-th value,
// which lives in *values until the launch.
struct ArgValues {
  std::vector<void*> ptrs;
  std::vector<std::vector<char>> structs;
  std::vector<uint32_t> u32s;
  std::vector<void*> params;
};

ffi::Error BuildArgs(const int64_t* args, size_t num_args, const std::vector<void*>& buffers,
                     const std::vector<uint64_t>& sizes, std::vector<CUtensorMap>& maps,
                     ffi::Span<const int64_t> blob, ArgValues* v) {
  v->ptrs.assign(num_args, nullptr);
  v->structs.assign(num_args, {});
  v->u32s.assign(num_args, 0);
  v->params.assign(num_args, nullptr);
  const char* blob_bytes = reinterpret_cast<const char*>(blob.begin());
  for (size_t i = 0; i < num_args; ++i) {
    const int64_t kind = args[3 * i], value = args[3 * i + 1], extra = args[3 * i + 2];
    switch (kind) {
      case kArgPtr:
        if (value < 0 || value >= static_cast<int64_t>(buffers.size()))
          return ffi::Error::InvalidArgument("pointer argument refers to a missing operand");
        if (extra < 0 || static_cast<uint64_t>(extra) >= sizes[value])
          return ffi::Error::InvalidArgument("pointer argument offset " + std::to_string(extra) + " outside operand " +
                                             std::to_string(value) + " of " + std::to_string(sizes[value]) + " bytes");
        v->ptrs[i] = static_cast<char*>(buffers[value]) + extra;
        v->params[i] = &v->ptrs[i];
        break;
      case kArgSymBuffer: {
        if (value < 0 || value >= static_cast<int64_t>(buffers.size()))
          return ffi::Error::InvalidArgument("symmetric-buffer argument refers to a missing operand");
        v->structs[i].assign(kSymBufferBytes, 0);
        const int64_t base = reinterpret_cast<int64_t>(buffers[value]);
        std::memcpy(v->structs[i].data(), &base, sizeof(base));
        v->params[i] = v->structs[i].data();
        break;
      }
      case kArgNull:
        v->params[i] = &v->ptrs[i];
        break;
      case kArgU32:
        v->u32s[i] = static_cast<uint32_t>(value);
        v->params[i] = &v->u32s[i];
        break;
      case kArgTmap:
        if (value < 0 || value >= static_cast<int64_t>(maps.size()))
          return ffi::Error::InvalidArgument("tensor map argument out of range");
        v->params[i] = &maps[value];
        break;
      case kArgBytes:
        if (value < 0 || value + extra > static_cast<int64_t>(blob.size() * 8))
          return ffi::Error::InvalidArgument("by-value argument outside the blob");
        v->params[i] = const_cast<char*>(blob_bytes + value);
        break;
      default:
        return ffi::Error::InvalidArgument("unknown kernel argument kind");
    }
  }
  return ffi::Error::Success();
}

ffi::Error LaunchOne(const Driver& d, CUstream stream, CUcontext ctx, const std::string& cubin, const int64_t* launch,
                     ArgValues& values) {
  const int smem = static_cast<int>(launch[3]);
  CUfunction fn = nullptr;
  ffi::Error err = GetKernel(d, cubin, ctx, smem, &fn);
  if (!err.success()) return err;
  CUlaunchAttribute attrs[3];
  std::memset(attrs, 0, sizeof(attrs));
  CUlaunchConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.gridDimX = static_cast<unsigned>(launch[0]);
  cfg.gridDimY = static_cast<unsigned>(launch[6]);
  cfg.gridDimZ = static_cast<unsigned>(launch[7]);
  cfg.blockDimX = static_cast<unsigned>(launch[1]);
  cfg.blockDimY = cfg.blockDimZ = 1;
  cfg.sharedMemBytes = static_cast<unsigned>(smem);
  cfg.hStream = stream;
  unsigned num_attrs = 0;
  if (launch[2] > 1) {
    attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attrs[num_attrs].value.clusterDim.x = static_cast<unsigned>(launch[2]);
    attrs[num_attrs].value.clusterDim.y = attrs[num_attrs].value.clusterDim.z = 1;
    ++num_attrs;
  }
  if (launch[4] == 1) {
    attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attrs[num_attrs].value.cooperative = 1;
    ++num_attrs;
  }
  if (launch[5] == 1) {
    attrs[num_attrs].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[num_attrs].value.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  cfg.attrs = num_attrs ? attrs : nullptr;
  cfg.numAttrs = num_attrs;
  CUresult r = d.LaunchKernelEx(&cfg, fn, values.params.data(), nullptr);
  if (r != CUDA_SUCCESS) return ffi::Error::Internal(CuError(d, r, "cuLaunchKernelEx") + " for " + cubin);
  return ffi::Error::Success();
}

ffi::Error Launch(CUstream stream, std::string_view cubins, ffi::Span<const int64_t> launch,
                  ffi::Span<const int64_t> counts, ffi::Span<const int64_t> args, ffi::Span<const int64_t> tmaps,
                  ffi::Span<const int64_t> blob, ffi::RemainingArgs ins, ffi::RemainingRets outs) {
  const Driver& d = GetDriver();
  if (!d.error.empty()) return ffi::Error::Internal(d.error);
  constexpr size_t kLaunchWords = 8;
  const size_t num_kernels = counts.size() / 2;
  if (num_kernels == 0 || counts.size() % 2 != 0 || launch.size() != kLaunchWords * num_kernels)
    return ffi::Error::InvalidArgument("counts must hold 2 and launch 8 values per kernel");
  std::vector<std::string> paths;
  for (size_t start = 0;;) {
    const size_t end = cubins.find('\n', start);
    paths.emplace_back(cubins.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  if (paths.size() != num_kernels) return ffi::Error::InvalidArgument("cubin must name one file per kernel");
  size_t total_args = 0, total_maps = 0;
  for (size_t k = 0; k < num_kernels; ++k) {
    const int64_t* l = launch.begin() + kLaunchWords * k;
    if (counts[2 * k] < 0 || counts[2 * k + 1] < 0 || l[0] <= 0 || l[1] <= 0 || l[2] <= 0 || l[3] < 0 ||
        l[4] < 0 || l[4] > 1 || l[5] < 0 || l[5] > 1 || l[6] <= 0 || l[7] <= 0)
      return ffi::Error::InvalidArgument(
          "launch attribute: grid, block and cluster must be > 0, smem >= 0, cooperative and programmatic 0 or 1");
    total_args += counts[2 * k];
    total_maps += counts[2 * k + 1];
  }
  // an attribute array cannot be empty: a lone word stands for "none"
  if (args.size() != 3 * total_args && !(total_args == 0 && args.size() == 1))
    return ffi::Error::InvalidArgument("args attribute must hold 3 words per argument of every kernel");
  if (tmaps.size() != kTmapWords * total_maps && !(total_maps == 0 && tmaps.size() == 1))
    return ffi::Error::InvalidArgument("tmaps attribute must hold " + std::to_string(kTmapWords) + " words per map");

  // Operand addresses and sizes: inputs first, then outputs.
  std::vector<void*> buffers;
  std::vector<uint64_t> sizes;
  for (size_t i = 0; i < ins.size(); ++i) {
    auto b = ins.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    buffers.push_back(b->untyped_data());
    sizes.push_back(b->size_bytes());
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    auto b = outs.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    buffers.push_back((*b)->untyped_data());
    sizes.push_back((*b)->size_bytes());
  }

  // Every kernel's maps and arguments before the first launch: a bad attribute launches nothing.
  std::vector<std::vector<CUtensorMap>> maps(num_kernels);
  std::vector<ArgValues> values(num_kernels);
  for (size_t k = 0, a = 0, m = 0; k < num_kernels; a += counts[2 * k], m += counts[2 * k + 1], ++k) {
    ffi::Error err = EncodeMaps(d, tmaps.begin() + kTmapWords * m, counts[2 * k + 1], buffers, sizes, &maps[k]);
    if (!err.success()) return err;
    err = BuildArgs(args.begin() + 3 * a, counts[2 * k], buffers, sizes, maps[k], blob, &values[k]);
    if (!err.success()) return err;
  }

  // Kernels and tensor maps belong to the stream's context; make it current for the calls.
  CUcontext ctx = nullptr, current = nullptr;
  CUresult r = d.StreamGetCtx(stream, &ctx);
  if (r != CUDA_SUCCESS) return ffi::Error::Internal(CuError(d, r, "cuStreamGetCtx"));
  r = d.CtxGetCurrent(&current);
  if (r != CUDA_SUCCESS) return ffi::Error::Internal(CuError(d, r, "cuCtxGetCurrent"));
  const bool pushed = current != ctx;
  if (pushed) {
    r = d.CtxPushCurrent(ctx);
    if (r != CUDA_SUCCESS) return ffi::Error::Internal(CuError(d, r, "cuCtxPushCurrent"));
  }
  ffi::Error err = ffi::Error::Success();
  for (size_t k = 0; k < num_kernels && err.success(); ++k)
    err = LaunchOne(d, stream, ctx, paths[k], launch.begin() + kLaunchWords * k, values[k]);
  if (pushed) {
    CUcontext popped = nullptr;
    r = d.CtxPopCurrent(&popped);
    if (r != CUDA_SUCCESS && err.success()) err = ffi::Error::Internal(CuError(d, r, "cuCtxPopCurrent"));
  }
  return err;
}

}  // namespace

namespace {

auto LaunchBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<CUstream>>()
      .Attr<std::string_view>("cubin")
      .Attr<ffi::Span<const int64_t>>("launch")
      .Attr<ffi::Span<const int64_t>>("counts")
      .Attr<ffi::Span<const int64_t>>("args")
      .Attr<ffi::Span<const int64_t>>("tmaps")
      .Attr<ffi::Span<const int64_t>>("blob")
      .RemainingArgs()
      .RemainingRets();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxDeepGemmLaunch, Launch, LaunchBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeJaxDeepGemmLaunchCmdBuffer, Launch, LaunchBinding(),
                              {ffi::Traits::kCmdBufferCompatible});
