// Gated activations: out[t, i] = act(x[t, i]) * x[t, d + i] for x [T, 2d], act = SiLU or
// GELU-tanh (g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3)); 16-byte vectors where the
// layout allows, a flat grid-stride loop so any T and d fill the GPU.
#include "freetoken/cuda_common.cuh"

namespace freetoken {
namespace {

template <bool kGelu>
__device__ __forceinline__ float gate_act(float g) {
  const float a = kGelu ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
  return g / (1.f + __expf(-a));
}

template <typename T, int VEC, bool kGelu>
__global__ void act_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t rows,
                                    int64_t nvec, int64_t x_stride, int64_t out_stride) {
  int64_t total = rows * nvec;
  int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    int64_t row = i / nvec, col = (i - row * nvec) * VEC;
    const T* xr = x + row * x_stride;
    Vec<T, VEC> gate = load_vec<T, VEC>(xr + col);
    Vec<T, VEC> up = load_vec<T, VEC>(xr + nvec * VEC + col);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      float g = to_float(gate.v[e]);
      gate.v[e] = from_float<T>(gate_act<kGelu>(g) * to_float(up.v[e]));
    }
    store_vec<T, VEC>(out + row * out_stride + col, gate);
  }
}

template <typename T, int VEC, bool kGelu>
void launch(TensorView out, TensorView x, RowView ro, RowView rx, cudaStream_t stream) {
  int64_t nvec = ro.width / VEC;
  int threads = 256;
  int64_t blocks = ceil_div(ro.rows * nvec, threads);
  blocks = blocks < 65536 ? blocks : 65536;  // grid-stride beyond this
  act_and_mul_kernel<T, VEC, kGelu><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      data_of<T>(out), data_of<T>(x), ro.rows, nvec, rx.stride, ro.stride);
  check_launch(kGelu ? "gelu_tanh_and_mul" : "silu_and_mul");
}

/*! \brief out[T, d] = act(x[:, :d]) * x[:, d:] for x [T, 2d]. */
template <bool kGelu>
void act_and_mul(TensorView out, TensorView x) {
  int dev = x.device().device_id;
  check_gpu(out, "out", dev);
  check_gpu(x, "x", dev);
  FloatType ft = float_type(x, "x");
  check_same_dtype(out, x, "out", "x");
  RowView rx = row_view(x, 1, "x"), ro = row_view(out, 1, "out");
  TVM_FFI_ICHECK(rx.width % 2 == 0 && rx.width == 2 * ro.width && rx.rows == ro.rows)
      << "x must be [T, 2d] and out [T, d]; got x rows of " << rx.width << " and out rows of "
      << ro.width;
  if (ro.rows == 0 || ro.width == 0) return;
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(x);
  int64_t vec = ft == FloatType::kF32 ? 4 : 8;
  bool vec_ok = ro.width % vec == 0 && rx.stride % vec == 0 && ro.stride % vec == 0 &&
                aligned16(x) && aligned16(out);
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    if (vec_ok) {
      launch<T, 16 / sizeof(T), kGelu>(out, x, ro, rx, stream);
    } else {
      launch<T, 1, kGelu>(out, x, ro, rx, stream);
    }
  });
}

void silu_and_mul(TensorView out, TensorView x) { act_and_mul<false>(out, x); }

void gelu_tanh_and_mul(TensorView out, TensorView x) { act_and_mul<true>(out, x); }

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(silu_and_mul, freetoken::silu_and_mul);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gelu_tanh_and_mul, freetoken::gelu_tanh_and_mul);
