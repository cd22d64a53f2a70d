// Batched LoRA on the CPU (Punica's SGMV/BGMV): each token row's adapter delta added to
// a linear layer's product, rows of many adapters in one call, the base product done
// once for the whole batch before it.
//
//   out[t, c] += scale[s] * sum_r (sum_i x[t, i] a[s, r, i]) * b[s, r, c]
//
// for every row t whose slot s = slots[t] >= 0, over the ranks r of the part whose
// columns hold c (a layer's stacked parts: q/k/v, gate/up). Rows of one slot go
// together, a few at a time, so that each of its A and B rows is read once for them.
#pragma once

#include "pyengine/tensor_view.h"

namespace pyengine {

//   out:          [tokens, n] float32 or bfloat16, rows dense (written in place)
//   x:            [tokens, k] of out's dtype, rows dense
//   a:            [num_slots, ranks, k] of out's dtype, dense: the parts' A stacked,
//                 part p's rank rows p * ranks / num_parts onwards
//   b:            [num_slots, ranks, n] of out's dtype, dense: part p's rank rows hold
//                 its B transposed over its columns (the rest is never read)
//   slots:        int32 [tokens], each row's slot, or -1 (no adapter)
//   scale:        float32 [num_slots]
//   part_columns: int64 [num_parts + 1], from 0, ascending, ending at n; num_parts
//                 divides ranks
// Arithmetic in float32: a row's delta summed over the ranks, times its scale, then
// added to out (rounded once to bfloat16 for a bfloat16 out). Throws InvalidArgument
// naming the argument, before writing anything. All tensors on the CPU, or all but
// part_columns (on the CPU) on one CUDA device where pyengine was built with CUDA (also
// float16; on `stream`, a cudaStream_t; slots are not read back to be checked there, one
// outside the slots counting as none).
void lora_add(const TensorView& out, const TensorView& x, const TensorView& a, const TensorView& b,
              const TensorView& slots, const TensorView& scale, const TensorView& part_columns,
              void* stream = nullptr);

// The embedding's delta, a one-hot row's: out[t, c] += scale[s] * sum_r a[s, ids[t], r] *
// b[s, r, c] for every row t whose slot s = slots[t] >= 0.
//   out:   [tokens, n] float32 or bfloat16, rows dense (the looked-up rows, in place)
//   ids:   int32 or int64 [tokens], each in [0, vocab)
//   a:     [num_slots, vocab, ranks] of out's dtype, dense: A transposed
//   b:     [num_slots, ranks, n] of out's dtype, dense: B transposed
//   slots: int32 [tokens]; scale: float32 [num_slots]
// As lora_add's arithmetic and errors; on the CPU only (a GPU adds it with torch).
void lora_embedding_add(const TensorView& out, const TensorView& ids, const TensorView& a,
                        const TensorView& b, const TensorView& slots, const TensorView& scale);

}  // namespace pyengine
