/* What both GEMV paths (quant_gemv.c: float x, q8_gemv.c: 8-bit x) read the same way out of GGUF blocks: the
 * type ids, each format's weights and bytes per block, the fp16 scale, the packed K-quant and IQ4_XS scales and
 * the IQ4 code book. The block layouts themselves are described at the top of quant_gemv.c. */
#ifndef FM_BLOCK_FORMATS_H
#define FM_BLOCK_FORMATS_H

#include <stdint.h>
#include <string.h>

/* GGUF type ids (the file format's numbering) of the formats the kernels read */
enum { FM_F16 = 1, FM_Q4_0 = 2, FM_Q4_1 = 3, FM_Q5_0 = 6, FM_Q5_1 = 7, FM_Q8_0 = 8, FM_Q2_K = 10,
       FM_Q3_K = 11, FM_Q4_K = 12, FM_Q5_K = 13, FM_Q6_K = 14, FM_IQ4_NL = 20, FM_IQ4_XS = 23,
       FM_BF16 = 30 };

/* bytes per block, 0 for a format the kernels do not read */
static inline int fm_block_bytes(int type) {
    switch (type) {
    case FM_Q4_0: return 18;
    case FM_Q4_1: return 20;
    case FM_Q5_0: return 22;
    case FM_Q5_1: return 24;
    case FM_Q8_0: return 34;
    case FM_Q2_K: return 84;
    case FM_Q3_K: return 110;
    case FM_Q4_K: return 144;
    case FM_Q5_K: return 176;
    case FM_Q6_K: return 210;
    case FM_IQ4_NL: return 18;
    case FM_IQ4_XS: return 136;
    case FM_F16: case FM_BF16: return 64; /* unquantized: read as blocks of 32 values */
    default: return 0;
    }
}

/* weights per block: 32 for the small formats, 256 for the K-quants and IQ4_XS */
static inline int fm_block_weights(int type) {
    switch (type) {
    case FM_Q4_0: case FM_Q4_1: case FM_Q5_0: case FM_Q5_1: case FM_Q8_0: case FM_IQ4_NL:
    case FM_F16: case FM_BF16: return 32;
    default: return 256;
    }
}

static const int8_t IQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* F16 and BF16 weights are multiplied with float x (no 8-bit path: nothing to gain over their
 * 2 bytes a weight but rounding). */
static inline int fm_is_float_format(int type) { return type == FM_F16 || type == FM_BF16; }

static inline float bf16_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float half_to_float(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* Q4_K's (and Q5_K's) 6-bit scale and min of sub-block j (0..7) from its 12 packed bytes. */
static inline void q4k_scale_min(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q3_K's 16 6-bit scales (stored + 32) from their 12 packed bytes, four at a time: low nibbles of
 * bytes 0..7 (then their high nibbles), 2 high bits each in bytes 8..11 (scale k's at bit
 * 2 * (k / 4) of byte 8 + k % 4) */
static inline void q3k_scales(const uint8_t *packed, int8_t *sc) {
    uint32_t a[3], s[4];
    memcpy(a, packed, 12);
    const uint32_t low4 = 0x0F0F0F0F, low2 = 0x03030303;
    s[0] = (a[0] & low4) | ((a[2] & low2) << 4);
    s[1] = (a[1] & low4) | (((a[2] >> 2) & low2) << 4);
    s[2] = ((a[0] >> 4) & low4) | (((a[2] >> 4) & low2) << 4);
    s[3] = ((a[1] >> 4) & low4) | (((a[2] >> 6) & low2) << 4);
    memcpy(sc, s, 16);
}

/* IQ4_XS's scale of sub-block j (0..7), minus its 32: nibble j of the low bytes | 2 bits of the high word << 4 */
static inline int iq4xs_scale(const uint8_t *b, int j) {
    uint16_t high;
    memcpy(&high, b + 2, 2);
    return (((b[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4)) - 32;
}

#endif
