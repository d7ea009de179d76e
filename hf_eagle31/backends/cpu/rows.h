// What one source of the rows library calls in another (rows_step.cpp calls both).
#pragma once

#include <ATen/ATen.h>

namespace hf_eagle31_rows {

// x [..., K] times the weights the library holds under `key` (rows_linear.cpp's `hold`), plus their bias:
// [..., out_features].
at::Tensor product(const at::Tensor& x, int64_t key, int64_t out_features, int64_t near);

// The new keys and values [B, G, n, D] written into the buffers of `layer` that the library holds under `room`
// (rows_attention.cpp's `hold_room`), behind its `length` cached entries, then the query's rows [B, G, R, D]
// attending over all length + n.
at::Tensor attention_in_room(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                             c10::SymInt room, int64_t layer, c10::SymInt length,
                             const c10::optional<at::Tensor>& mask, double scale);

}  // namespace hf_eagle31_rows
