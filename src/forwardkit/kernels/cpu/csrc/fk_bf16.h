/* bf16 <-> float32 in portable C, for forwardkit's native CPU kernels.
 *
 * A bf16 value is the upper 16 bits of a float32, so widening is one shift; narrowing rounds
 * to nearest even (as PyTorch's casts do) and keeps NaNs quiet. Both are plain integer
 * arithmetic on 32-bit lanes, which GCC vectorises in `#pragma omp simd` loops for whatever
 * ISA the file is compiled for.
 *
 * Included by decode_attention.c, both linear_few_rows builds and quant_linear.c; the builder (kernels/cpu/native_build.py) hashes every file
 * a source includes with #include "..." into the library's name, so a change here rebuilds.
 */
#ifndef FK_BF16_H
#define FK_BF16_H

#include <stdint.h>
#include <string.h>

static inline float fk_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t fk_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

#endif /* FK_BF16_H */
