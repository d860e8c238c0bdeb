/* The FP8 quantization descriptor's checks (sluice.h: sl_quantize_fp8_cuda); the CPU quantizes in
 * jnp (python/sluice/ops/fp8.py), which defines the rule the CUDA kernel follows. */
#include "internal.h"

sl_status sl_quantize_fp8_check(const sl_quantize_fp8_desc *d, const char *op) {
  if (d == NULL || d->struct_size < sizeof(sl_quantize_fp8_desc))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: the descriptor is NULL or its struct_size is too small", op);
  if (d->batch < 0 || d->rows < 0 || d->cols < 0 || d->x_rows < 0 || d->x_rows > d->rows)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: sizes must be non-negative with x_rows <= rows (batch %lld, rows %lld, "
                        "cols %lld, x_rows %lld)",
                        op, (long long)d->batch, (long long)d->rows, (long long)d->cols,
                        (long long)d->x_rows);
  if (d->dtype != SL_DTYPE_F32 && d->dtype != SL_DTYPE_BF16 && d->dtype != SL_DTYPE_F16)
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT, "%s: x must be F32, BF16 or F16 (dtype %d)", op,
                        (int)d->dtype);
  const int br = d->block_rows, bc = d->block_cols;
  if (!((br == 1 && bc == 128) || (br == 128 && bc == 1) || (br == 128 && bc == 128)))
    return sl_set_error(SL_STATUS_INVALID_ARGUMENT,
                        "%s: the block must be 1x128, 128x1 or 128x128, got %dx%d", op, br, bc);
  return SL_STATUS_SUCCESS;
}
