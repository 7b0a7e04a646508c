// int8 x int8 -> int32 matrix products through oneDNN's matmul, as XLA FFI custom calls.
//
// Two handlers, both pure functions of their operands:
//   OnednnInt8Pack: q int8 [k, n] -> uint8 [packed_bytes]
//       the weights reordered once into the blocked layout oneDNN's VNNI / AMX kernels read
//       (with its zero-point compensation), opaque to XLA;
//   onednn_int8_packed_bytes(k, n): that buffer's size, for the caller to allocate.
//   OnednnInt8Matmul: x uint8 [m, k], packed uint8 [packed_bytes], attribute n -> int32 [m, n]
//       sum_j (x[i, j] - 128) * q[j, c]: x holds int8 activations shifted by
//       128 (oneDNN's fast kernels take unsigned activations), the zero point undone inside,
//       so the result is the exact int32 product of the int8 activations and q.
// Inside a decoding while loop the pack's operand is loop-invariant, so XLA hoists it out of
// the loop: each weight matrix is packed once per call, not once per step.

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <omp.h>

#include "dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

namespace {

constexpr int32_t kZeroPoint = 128;
constexpr int64_t kPackRows = 32;  // the row count the packed layout is chosen for
constexpr double kSerialOps = 1 << 26;  // products of fewer m * k * n run on one thread

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

int Threads() {  // OpenMP's default team size (OMP_NUM_THREADS, else the cores)
  static const int threads = omp_get_max_threads();
  return threads;
}

dnnl::stream& Stream() {  // one per thread: calls from several threads never share one
  thread_local dnnl::stream stream(Engine());
  return stream;
}

// XLA may run independent custom calls at once on several threads; oneDNN's own scratchpad
// is one buffer shared by every primitive (its default build), so each call brings its own.
dnnl::primitive_attr Attr() {
  dnnl::primitive_attr attr;
  attr.set_zero_points_mask(DNNL_ARG_SRC, 0);
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

// The calling thread's scratchpad, grown as needed: concurrent calls run on distinct threads.
void* Scratchpad(size_t bytes) {
  thread_local std::vector<uint8_t> buffer;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

dnnl::matmul::primitive_desc MatmulDesc(int64_t m, int64_t k, int64_t n) {
  dnnl::memory::desc x({m, k}, dt::u8, tag::ab);
  dnnl::memory::desc w({k, n}, dt::s8, tag::any);
  dnnl::memory::desc y({m, n}, dt::s32, tag::ab);
  return dnnl::matmul::primitive_desc(Engine(), x, w, y, Attr());
}

struct Cached {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
  bool packed_layout;  // its weights layout is the one OnednnInt8Pack writes
};

std::mutex cache_mutex;
std::map<std::tuple<int64_t, int64_t, int64_t>, Cached>& Cache() {
  static std::map<std::tuple<int64_t, int64_t, int64_t>, Cached> cache;
  return cache;
}

const Cached& Matmul(int64_t m, int64_t k, int64_t n) {
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto key = std::make_tuple(m, k, n);
  auto it = Cache().find(key);
  if (it == Cache().end()) {
    auto pd = MatmulDesc(m, k, n);
    bool same = m == kPackRows || pd.weights_desc() == MatmulDesc(kPackRows, k, n).weights_desc();
    it = Cache().emplace(key, Cached{pd, dnnl::matmul(pd), same}).first;
  }
  return it->second;
}

ffi::Error Fail(const char* what, const dnnl::error& e) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string(what) + ": " + e.what());
}

}  // namespace

// Whether oneDNN's int8 kernels here sum u8 x s8 products exactly: with VNNI (vpdpbusd, AVX2 or
// AVX-512) or AMX. Without it (vpmaddubsw) pairs of products saturate at 16 bits, and the
// int32 results are wrong (measured with ONEDNN_MAX_CPU_ISA=AVX2), so the kernel is refused.
extern "C" int onednn_int8_exact_isa() {
  using isa = dnnl::cpu_isa;
  switch (dnnl::get_effective_cpu_isa()) {
    case isa::avx2_vnni:
    case isa::avx2_vnni_2:
    case isa::avx512_core_vnni:
    case isa::avx512_core_bf16:
    case isa::avx512_core_fp16:
    case isa::avx512_core_amx:
    case isa::avx512_core_amx_fp16:
      return 1;
    default:
      return 0;
  }
}

extern "C" int64_t onednn_int8_packed_bytes(int64_t k, int64_t n) {
  try {
    return static_cast<int64_t>(Matmul(kPackRows, k, n).pd.weights_desc().get_size());
  } catch (const dnnl::error&) {
    return -1;
  }
}

static ffi::Error PackImpl(ffi::Buffer<ffi::S8> q, ffi::ResultBuffer<ffi::U8> packed) {
  auto dims = q.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("q must be [k, n]");
  int64_t k = dims[0], n = dims[1];
  omp_set_num_threads(Threads());
  try {
    const Cached& c = Matmul(kPackRows, k, n);
    if (static_cast<size_t>(packed->size_bytes()) != c.pd.weights_desc().get_size())
      return ffi::Error::InvalidArgument("packed buffer size differs from oneDNN's layout");
    dnnl::stream& stream = Stream();
    dnnl::memory plain({{k, n}, dt::s8, tag::ab}, Engine(), q.typed_data());
    dnnl::memory blocked(c.pd.weights_desc(), Engine(), packed->typed_data());
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    dnnl::reorder::primitive_desc pd(plain, blocked, attr);
    dnnl::memory scratch(pd.scratchpad_desc(), Engine(),
                         Scratchpad(pd.scratchpad_desc().get_size()));
    dnnl::reorder(pd).execute(stream, {{DNNL_ARG_FROM, plain},
                                       {DNNL_ARG_TO, blocked},
                                       {DNNL_ARG_SCRATCHPAD, scratch}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return Fail("onednn_int8_pack", e);
  }
  return ffi::Error::Success();
}

static ffi::Error MatmulImpl(ffi::Buffer<ffi::U8> x, ffi::Buffer<ffi::U8> packed, int64_t n,
                             ffi::ResultBuffer<ffi::S32> y) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("x must be [m, k]");
  int64_t m = dims[0], k = dims[1];
  if (m == 0) return ffi::Error::Success();
  // A small product runs on the calling thread alone: waking OpenMP's team costs more than
  // it saves (docs/benchmarks.md, "int8 through oneDNN"), and XLA may run an independent op
  // on its other threads meanwhile. The setting is this thread's own, made
  // before the primitive is created, which plans its blocking for the threads it will have.
  omp_set_num_threads(static_cast<double>(m) * k * n < kSerialOps ? 1 : Threads());
  try {
    const Cached& c = Matmul(m, k, n);
    // The packed layout was chosen for kPackRows rows; a layout chosen otherwise for m rows
    // would misread the buffer, so it is refused rather than computed.
    if (!c.packed_layout)
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        "oneDNN chose another weight layout for this row count");
    dnnl::stream& stream = Stream();
    dnnl::memory xm(c.pd.src_desc(), Engine(), x.typed_data());
    dnnl::memory wm(c.pd.weights_desc(), Engine(), packed.typed_data());
    dnnl::memory ym(c.pd.dst_desc(), Engine(), y->typed_data());
    int32_t zero_point = kZeroPoint;
    dnnl::memory zp({{1}, dt::s32, tag::a}, Engine(), &zero_point);
    dnnl::memory scratch(c.pd.scratchpad_desc(), Engine(),
                         Scratchpad(c.pd.scratchpad_desc().get_size()));
    c.primitive.execute(stream, {{DNNL_ARG_SRC, xm},
                                 {DNNL_ARG_WEIGHTS, wm},
                                 {DNNL_ARG_DST, ym},
                                 {DNNL_ARG_ATTR_ZERO_POINTS | DNNL_ARG_SRC, zp},
                                 {DNNL_ARG_SCRATCHPAD, scratch}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return Fail("onednn_int8_matmul", e);
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnInt8Pack, PackImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S8>>().Ret<ffi::Buffer<ffi::U8>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnInt8Matmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::Buffer<ffi::S32>>());
