// out [m, n] = x [m, k] @ w + bias, for the few rows of a decode step (m up to about 64),
// CPU, float32. The weight is packed once into panels of kPanelWidth columns, each
// [k, kPanelWidth] contiguous, so that a step streams every weight byte once, in order
// (hardware prefetch follows it), while tiles of 8 rows x kPanelWidth columns accumulate
// in registers. Larger m is a job for a blocked GEMM library.
#pragma once

#include <cstdint>

#include "pyengine/attention.h"
#include "pyengine/tensor_view.h"

namespace pyengine {

inline constexpr int64_t kPanelWidth = 48;

// Floats a packed [k, n] weight takes: n rounded up to whole panels.
int64_t packed_weight_size(int64_t k, int64_t n);

// Packs w_t [k, n] (w transposed: the dense right operand) into `packed` (float32
// [packed_weight_size(k, n)]); columns past n in the last panel are zero.
void pack_weight(const TensorView& packed, const TensorView& w_t);

// Block-quantized weights, the form of GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K:
// along k, every kQuantBlock rows of a column share a scale and an offset (every 16, in
// an int8 weight of Q6_K's groups), w[i][j] = q[i][j] * scale[i / kQuantBlock][j] +
// offset[i / kQuantBlock][j] with q a small integer and, where the offset is not zero,
// the scales of few significant bits (at most 20 for 4-bit q, 17 for 8-bit; GGUF's are a
// float16 times a 6-bit integer at most), so that the product is exact and the float32
// result rounds once. Packed, a panel takes 0.625-0.75 (4-bit) or 1.0625-1.25 (8-bit;
// 1.5 with groups of 16) bytes a weight instead of 4 (the scales and offsets in float16
// where they are float16s: QuantParams), so a decode step streams a fifth of the bytes; each
// panel is widened to float32 in the thread's cache before the tiles use it, so the
// product is exactly the float32 one over the widened weight. FP8 checkpoints' weights
// take the same form with e4m3 codes (a float8_e4m3fn buffer): any scale, no offset,
// w = e4m3 * scale rounded once, as torch dequantizes them.
inline constexpr int64_t kQuantBlock = 32;

// Which builds the quantized kernels run, for tests and benchmarks: the widest this CPU
// has (kAuto); kAvx512: the AVX-512 widening (which also multiplies a decode step's few
// rows in registers) and int8 products on VNNI where the CPU has it; kAvx2: int8 products
// on AVX2, the portable widening; kGeneric: the portable builds of both. Throws
// InvalidArgument for what this CPU cannot run.
void set_quantized_dense_isa(CpuIsa isa);
CpuIsa quantized_dense_isa();

// How a packed quantized weight stores its scales and offsets: float32; float16 (half
// the bytes), where every scale and offset is a float16 exactly (GGUF's Q4_0, Q4_1, Q5_0,
// Q5_1 and Q8_0 store theirs so); float16 scales alone, where every offset is zero too;
// float32 scales alone, for fp8 weights (whose offsets are zero). Groups of 16 rows take
// float32 only, fp8 weights float32 or float32 scales alone.
enum class QuantParams : uint8_t { kFloat32, kFloat16, kScaleFloat16, kScaleFloat32 };

// The narrowest QuantParams that holds scale_t and offset_t exactly, for q_t (as
// pack_quantized_weight takes them).
QuantParams narrowest_quant_params(const TensorView& q_t, const TensorView& scale_t,
                                   const TensorView& offset_t);

// Bytes a packed quantized [k, n] weight takes, bits 4 or 8 (k a multiple of
// kQuantBlock), each group_rows rows of a column sharing a scale and offset: 32, or, for
// 8 bits, 16 (Q6_K's groups: a block's halves have a scale and offset each), stored as
// `params`.
int64_t packed_quantized_weight_size(int64_t k, int64_t n, int bits,
                                     int64_t group_rows = kQuantBlock,
                                     QuantParams params = QuantParams::kFloat32);

// Packs q_t [k, n] (uint8 0..15 for 4 bits; int8, or float8_e4m3fn without NaN, for 8),
// scale_t and offset_t (float32 [k / group_rows, n], group_rows 32 or, int8, 16; the
// scales of few significant bits where an offset is not zero, as above; fp8: any scale,
// offsets zero) into `packed` of q_t's dtype [size], size packed_quantized_weight_size(k,
// n, bits, group_rows), or twice that of n / 2 with gate_up (q_t [k, 2 * n]: gate
// columns, then up, paired as pack_gate_up_weight pairs them), its scales and offsets
// stored as `params` (which must hold them exactly).
void pack_quantized_weight(const TensorView& packed, const TensorView& q_t,
                           const TensorView& scale_t, const TensorView& offset_t, bool gate_up,
                           QuantParams params = QuantParams::kFloat32);

// Split-bfloat16 weights, for many rows (a prefill) on CPUs with AMX: each weight split
// exactly into three bfloat16s, of whose products with x's (split alike) the six that
// float32 would not round away run on the tile unit (cpp/src/kernels/split_bf16_gemm.h). As
// accurate as a float32 GEMM; 6 bytes a weight.
bool split_gemm_supported();

// bfloat16s a split [k, n] weight takes (gate_up: a gate/up pair of n columns each).
int64_t packed_split_weight_size(int64_t k, int64_t n, bool gate_up);

// Packs w_t [k, n] (gate_up: [k, 2n], gate columns then up) into `packed` (bfloat16
// [packed_split_weight_size(k, n, gate_up)], n the columns of one half with gate_up).
void pack_split_weight(const TensorView& packed, const TensorView& w_t, bool gate_up);

// bfloat16 weights for bfloat16 activations (a model in bfloat16 on the CPU): panels of
// kPanelWidth columns, each ceil(k / 2) pairs of rows, a column's pair a 4-byte lane (the
// operand of AVX512-BF16's vdpbf16ps; cpp/src/kernels/bf16_panel.h). The products of
// bfloat16s are exact and summed in float32 (AVX512-BF16 where the CPU has it, the same
// sums widened in registers elsewhere), the result rounded once to bfloat16: 2 bytes a
// weight, and twice float32's multiply-adds an instruction.
int64_t packed_bf16_weight_size(int64_t k, int64_t n);

// Packs w_t [k, n] (float32, each rounded to the nearest bfloat16; gate_up: [k, 2n], gate
// columns then up, paired as pack_gate_up_weight pairs them) into `packed` (bfloat16
// [packed_bf16_weight_size(k, n)], twice that of n with gate_up).
void pack_bf16_weight(const TensorView& packed, const TensorView& w_t, bool gate_up);

// Whether bfloat16 panels multiply on AVX512-BF16: the CPU has it, and the quantized
// kernels are not pinned to a narrower build (set_quantized_dense_isa).
bool bf16_dot_product();

// Whether bfloat16 panels (k a multiple of 32) and int8 weights (int8_dense, k a multiple
// of 64; with AMX-INT8) multiply blocks of 16 rows on AMX's tile unit: the CPU has AMX
// and the OS lets this process use it, the quantized kernels run their AVX-512 build, and
// set_amx_tiles(false) has not turned it off (for tests and benchmarks). The int8 sums
// are the same integers; bfloat16's are summed in the tile unit's order.
bool amx_tiles();
// Throws InvalidArgument turning it on where AMX is not usable.
void set_amx_tiles(bool enabled);

// out [m, n] = x [m, k] @ (the packed weight of k x n) + bias [n] (optional: bias.data
// null). x and out float32 with a dense last dim; packed float32 (pack_weight),
// uint8/int8/float8_e4m3fn (pack_quantized_weight) or bfloat16 (pack_split_weight, where
// split_gemm_supported()); or x, out and bias bfloat16 with bfloat16 panels
// (pack_bf16_weight: told from a split weight by x's dtype). int8_activations: with a
// 4-bit or int8 block-quantized weight, x's rows are quantized to int8 per block of
// kQuantBlock (d = max|x| / 127, as llama.cpp's q8_0) and multiplied in integers
// (AVX-512 VNNI where the CPU has it; the same results in every build): a fifth of the
// float widening's instructions for a decode step's few rows, a third of the float
// tiles' for many, and no longer the float32 product of the widened weight (that of x's
// rounding to 8 bits).
void dense(const TensorView& out, const TensorView& x, const TensorView& packed,
           const TensorView& bias, int64_t n, bool int8_activations = false);

// Packs w_t [k, 2n], gate columns then up columns (an MLP's fused gate/up projection), for
// dense_silu_and_mul into `packed` (float32 [2 * packed_weight_size(k, n)]): each
// gate panel followed by the up panel of the same columns.
void pack_gate_up_weight(const TensorView& packed, const TensorView& w_t);

// out [m, n] = silu(x @ gate) * (x @ up) over a pack_gate_up_weight weight: the gate/up
// product never leaves the thread's cache, and the activation rounds exactly as
// silu_and_mul's. x and out float32 with a dense last dim; packed float32
// (pack_gate_up_weight), uint8/int8 (pack_quantized_weight with gate_up) or bfloat16
// (pack_split_weight with gate_up); or x and out bfloat16 with bfloat16 panels
// (pack_bf16_weight with gate_up: the gate and up sums rounded to bfloat16 before the
// activation, as an unfused product and silu_and_mul round them). int8_activations: as
// dense's.
void dense_silu_and_mul(const TensorView& out, const TensorView& x, const TensorView& packed,
                        int64_t n, bool int8_activations = false);

// Frees the calling thread's OpenMP worker threads (the kernels' thread pool). For a
// thread that hands the kernels over to another: the OpenMP runtime spins its idle
// workers only while it manages no more threads than there are cores, so a second pool
// beside the first makes every parallel region of both wake sleeping workers.
void release_thread_pool();

// out [t, k] = columns ids [t] of a packed [k, n] weight (float32 panels or
// block-quantized ones), widened to float32 exactly as dense widens them (bfloat16
// panels: out bfloat16, the weights themselves): an embedding table kept only in the
// packed form of the head that multiplies by it. ids int32 or int64, each in [0, n).
void packed_columns(const TensorView& out, const TensorView& packed, const TensorView& ids,
                    int64_t n);

}  // namespace pyengine
