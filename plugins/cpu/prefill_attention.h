/* What prefill_attention.c (the driver and the AVX2 tile, base library) and prefill_attention_bf16.c
 * (the AVX512_BF16 tile, AVX-512 library) share: the tile geometry and the scalar helpers both
 * tiles round with, so that the two paths compute the same rounded values. */
#ifndef LKV_PREFILL_ATTENTION_H
#define LKV_PREFILL_ATTENTION_H
#include "common.h"
#include "lkv_abi.h"

#define KT 64          /* keys per tile: 4 x 16 lanes */
#define MR 6           /* query rows per register tile: the bf16 tiles' table has MR + 1 entries */
_Static_assert(MR + 1 == LKV_PREFILL_TILES, "lkv_abi.h's tile table is the tiles of 0..MR rows");

/* visible keys of a tile at t0 for a row at `pos`: 0 .. KT */
static inline int visible(int64_t pos, int64_t t0) {
    const int64_t c = pos - t0 + 1;
    return c <= 0 ? 0 : c >= KT ? KT : (int)c;
}

static inline float exp2_1(float x) {                    /* the same polynomial, one value */
    if (x < -127.0f) x = -127.0f;
    const float n = nearbyintf(x), f = x - n;
    float y = 1.5403530e-4f;
    y = fmaf(y, f, 1.3333558e-3f);
    y = fmaf(y, f, 9.6181291e-3f);
    y = fmaf(y, f, 5.5504109e-2f);
    y = fmaf(y, f, 2.4022651e-1f);
    y = fmaf(y, f, 6.9314718e-1f);
    y = fmaf(y, f, 1.0f);
    const int e = (int)n + 127;                            /* n in [-127, 0]: 2^n, or 0 at -127 */
    uint32_t u = e > 0 ? (uint32_t)e << 23 : 0;
    float two;
    memcpy(&two, &u, 4);
    return y * two;
}

#endif
