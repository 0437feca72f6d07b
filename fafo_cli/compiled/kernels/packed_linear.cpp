// fafo::packed_linear: y = x W^T where W is kept as a GGUF file's blocks, on the CPU.
//
// Why: a decoding step on a CPU is bound by reading the weights. A GGUF model is dequantized by gguf's own
// dequantizer to float32 and loaded in bf16, so each of its weights is bf16 of a float32 that a few bits of
// the file determine; the step reads those bits and rebuilds the 16 exactly. Every float32 value gguf computes
// for the types below is one rounding away from exact arithmetic (a product of a float16 scale and a small
// integer is exact in float32, and so is that times a 4- to 6-bit code), so computing the same products in
// any order, fused or not, gives gguf's float32 bits; the conversion to bf16 rounds to nearest even as torch
// does. The weights multiplied are therefore exactly the model's; only the order of the additions is ours.
//
// Products: AMX tiles where the CPU has them (the rebuilt weights are stored as a 16 x 32 tile and multiplied
// with all the step's rows at once), else AVX-512 pair dot products, else (no AVX512-BF16) plain C++ that
// rebuilds the same values one by one. A float32 model (the default where a CPU lacks AVX512-BF16) holds gguf's
// float32 values themselves: for it the kernel rebuilds them without the bf16 rounding and multiplies float32
// rows with AVX2 multiply-adds, else in plain C++; the weights are again exactly the model's. Each output depends
// only on its own input row: every row's sums run the same instructions in the same order whatever the number
// of rows, so a verifying row computes bit for bit what a plain step would.
//
// Layout of a packed weight (uint8 [out / kTile, in / 64, kTile, entry bytes]): per tile of kTile weight rows
// and per 64 columns (two blocks of 32, A and B), one entry per row. Its size names its format (the GGUF types
// it serves, bytes per weight against the file's):
//   Q4_1 (48: Q4_1, 0.75 vs 0.625; Q4_K for float32 rows, d = d * sc, m = -(dmin * m) per sub-block, 0.75 vs
//        0.5625): 32 bytes of codes (byte i = A's code i | B's code i << 4), then dA, mA, dB, mB as float32;
//        w = bf16(d * q + m).
//   K4   (40: Q4_K, 0.625 vs 0.5625): codes as Q4_1's; scA, mA, scB, mB (the 6-bit sub-block scale and minimum,
//        one byte each); d, dmin (float16, the super-block's); w = bf16((d * sc) * q - dmin * m).
//   S5   (44: Q5_0, 0.6875 as the file): the codes' low 4 bits as Q4_1's; A's and B's fifth bits (uint32, bit i
//        for weight i); dA, dB (float16); w = bf16(d * (q - 16)).
//   S6   (56: Q6_K, 0.875 vs 0.82): the codes' low 4 bits as Q4_1's; A's, B's fifth bits, A's, B's sixth bits
//        (uint32 each); the four 16-weight sub-blocks' scales s (int8); d (float16); 2 bytes of padding;
//        w = bf16((d * s) * (q - 32)).
//   Q8_0 (68: Q8_0, 1.0625 as the file; Q5_0 for float32 rows, its codes less 16): A's and B's 32 int8 codes, dA,
//        dB (float16); w = bf16(d * q).
//   B6   (80: Q6_K for float32 rows, 1.25): A's and B's 32 int8 codes (q - 32), then D = d * s of A's two 16-weight
//        sub-blocks and of B's (float32); w = D * q.
// The float32 path is bound by its instructions, not by memory: it reads every type in the formats that widen with
// the fewest (Q4_1, Q8_0, B6: nothing assembled per weight or per entry), more bytes than K4, S5 and S6 but faster
// (docs/benchmarks.md, s35).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

// (built with -DFAFO_PLAIN, any CPU runs the plain path: how the tests check it on CPUs that have the others)
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__F16C__) && !defined(FAFO_PLAIN)
#include <immintrin.h>
#define FAFO_PACKED 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(FAFO_PLAIN)
#include <immintrin.h>
#define FAFO_AVX2 1
#endif

namespace {

constexpr int64_t kTile = 16;       // weight rows per task (an AMX tile's rows)
constexpr int64_t kSub = 4;         // weight rows per AVX-512 register block: 4 accumulators per input row
constexpr int64_t kRows = 6;        // input rows per AVX-512 register block (6 x 4 accumulators)
constexpr int64_t kTallRows = 9;    // or up to this many over 2 weight rows (9 x 2: 10-12 rows measured slower)
constexpr int64_t kGroup = 64;      // columns per entry: two blocks
constexpr int64_t kPrefetch = 8192;  // bytes ahead: the weights stream from memory (measured: 2.5x at 1 row)

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if FAFO_AVX2 || FAFO_PACKED
  return _cvtsh_ss(bits);  // one instruction; c10's conversion is a dozen (both exact)
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}
inline float float_at(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint32_t word_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

constexpr int64_t kScales = 4;  // floats `scales` leaves per entry

#if FAFO_PACKED
// Stores scales computed in a vector for rebuild to read back from memory: each then reaches its table as a
// broadcast load, where the compiler would otherwise move it out of the register with a permute (the shuffle
// units are what a one-row step waits on)
inline void store_scales(float* out, __m512 scales) {
  _mm512_store_ps(out, scales);
  asm volatile("" : : "r"(out) : "memory");
}

// The 32-bit words at `offset` of kSub consecutive entries of `size` bytes
inline __m128i words(const uint8_t* first, int64_t size, int64_t offset) {
  static_assert(kSub == 4, "words reads four entries");
  return _mm_setr_epi32(word_at(first + offset), word_at(first + size + offset), word_at(first + 2 * size + offset),
                        word_at(first + 3 * size + offset));
}
#endif

#if FAFO_AVX2
// The 8 bytes at p, one per 32-bit lane (zero- or sign-extended)
inline __m256i bytes_of(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i signed_bytes_of(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
// The 5- and 6-bit formats build half an entry's codes as bytes (A's 16 in the low lane, B's 16 in the high
// one), then widen them: about half the instructions of building them in 32-bit lanes, 8 at a time.
// Columns 16h .. 16h + 15 of A's and of B's low 4 bits, one byte each
inline __m256i nibble_bytes(const uint8_t* e, int h) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(e + 16 * h)), low = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(codes, 4), low), _mm_and_si128(codes, low));
}
// Bits 16h .. 16h + 15 of A's plane word `word` and of B's (the next) as bytes of 0 or `value`; `planes`: the
// entry's plane words, in both lanes
inline __m256i plane_bytes(__m256i planes, int h, int word, char value) {
  const char a = static_cast<char>(4 * word + 2 * h), b = static_cast<char>(a + 4);
  const char a1 = static_cast<char>(a + 1), b1 = static_cast<char>(b + 1);
  const __m256i spread = _mm256_setr_epi8(a, a, a, a, a, a, a, a, a1, a1, a1, a1, a1, a1, a1, a1,
                                          b, b, b, b, b, b, b, b, b1, b1, b1, b1, b1, b1, b1, b1);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);  // byte i of each 8 tests bit i
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(planes, spread), bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(value));
}
// w[0], w[1]: A's and B's columns 16h .. 16h + 7 as scale * q (one rounding) from int8 codes q laid out as
// nibble_bytes; w[2], w[3]: the next 8
inline void widen_bytes(__m256i q, __m256 scaleA, __m256 scaleB, __m256* w) {
  const __m128i a = _mm256_castsi256_si128(q), b = _mm256_extracti128_si256(q, 1);
  w[0] = _mm256_mul_ps(scaleA, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)));
  w[1] = _mm256_mul_ps(scaleB, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  w[2] = _mm256_mul_ps(scaleA, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(a, a))));
  w[3] = _mm256_mul_ps(scaleB, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b))));
}
// Chunk c of a Q4_1-like entry: its weights d * q + m (one rounding: d * q is exact) in columns 8c .. 8c + 7 of
// block A (w[0]) and of block B (w[1]; the codes' low and high nibbles)
[[gnu::always_inline]] inline void widen_nibbles(const uint8_t* e, int c, float dA, float mA, float dB, float mB,
                                                 __m256* w) {
  const __m256i codes = bytes_of(e + 8 * c);
  w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(codes, _mm256_set1_epi32(15))), _mm256_set1_ps(dA),
                         _mm256_set1_ps(mA));
  w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(codes, 4)), _mm256_set1_ps(dB), _mm256_set1_ps(mB));
}

// body(part) for each part of an entry: two-chunk parts spelt out, so that their byte shuffles' indices are
// constants (body must be always_inline); one-chunk parts in a loop (unrolled, their multi-row products measured
// slower)
template <class F, class Body>
[[gnu::always_inline]] inline void each_part(Body body) {
  if constexpr (F::kPart == 2) {
    body(0);
    body(1);
  } else {
    for (int c = 0; c < 4; ++c) body(c);
  }
}

// An entry's 64 weights, chunk by chunk: use(c, a, b) gets columns 8c .. 8c + 7 of block A and of block B
template <class F, class Use>
[[gnu::always_inline]] inline void widen(const uint8_t* e, Use use) {
  each_part<F>([&](int part) __attribute__((always_inline)) {
    __m256 w[2 * F::kPart];
    F::widen_part(e, part, w);
    for (int k = 0; k < F::kPart; ++k) use(part * F::kPart + k, w[2 * k], w[2 * k + 1]);
  });
}
#endif

// Each format gives one weight row's 64 columns of an entry: `plain` as the 64 float32 values gguf's
// dequantizer computes (the caller rounds them to bf16 for a bf16 model), `widen_part` (AVX2) as the same float32
// values 8 at a time (part p: chunks p * kPart .. of 8 columns, w[2k] of block A and w[2k + 1] of B for each; the
// 5- and 6-bit formats take two chunks, whose codes they build as bytes), `rebuild` (AVX-512) as two vectors of 32
// bf16 (blocks A and B), the same values rounded the same way. `rebuild` reads an entry's scales as `scales` left
// them: Q4_K's and Q6_K's are computed for kSub consecutive entries together, in vectors (one entry's alone took
// more instructions than its 64 weights' table lookups; see rebuild_batch); the other formats read theirs from the
// entry.
struct Q4_1 {
  static constexpr int64_t entry = 48;

  static void plain(const uint8_t* __restrict e, float* __restrict w) {  // d * q is exact: fused or not, one rounding
    for (int half = 0; half < 2; ++half) {
      const float d = float_at(e + 32 + 8 * half), m = float_at(e + 36 + 8 * half);
      for (int i = 0; i < 32; ++i) w[32 * half + i] = d * static_cast<float>((e[i] >> (4 * half)) & 15) + m;
    }
  }
#if FAFO_AVX2
  static constexpr int kPart = 1;
  [[gnu::always_inline]] static void widen_part(const uint8_t* e, int c, __m256* w) {
    widen_nibbles(e, c, float_at(e + 32), float_at(e + 36), float_at(e + 40), float_at(e + 44), w);
  }
#endif
#if FAFO_PACKED
  static void scales(const uint8_t*, float*) {}  // d and m are float32 in the entry already

  // bf16(d * q + m) for q = 0..15, in both halves of a 32-entry table (the permute reads 5 index bits)
  static __m512i values(float d, float m) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 v = _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(m));
    return (__m512i)_mm512_cvtne2ps_pbh(v, v);
  }

  // Two blocks of 4-bit codes (byte i = A's code i | B's code i << 4) looked up in their tables (`dm`: dA, mA, dB,
  // mB). (One table of A's and B's values takes a conversion less but two integer operations more: slower.)
  static void lookup(const uint8_t* entry, const float* dm, __m512i& a, __m512i& b) {
    const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(entry)));
    a = _mm512_permutexvar_epi16(codes, values(dm[0], dm[1]));
    b = _mm512_permutexvar_epi16(_mm512_srli_epi16(codes, 4), values(dm[2], dm[3]));
  }

  static void rebuild(const uint8_t* entry, const float*, __m512i& a, __m512i& b) {
    lookup(entry, reinterpret_cast<const float*>(entry + 32), a, b);
  }
#endif
};

struct K4 {  // Q4_K: each 32-weight sub-block is Q4_1's bf16(D * q + M) with D = d * sc, M = -(dmin * m)
  static constexpr int64_t entry = 40;

  // D and M of block A (half 0) or B: exact products (11-bit by 6-bit), so gguf's float32 values; gguf's
  // D * q - dmin * m is then D * q + M exactly (subtraction is addition of the negation)
  static void block_scales(const uint8_t* e, int half, float& d, float& m) {
    d = half_at(e + 36) * static_cast<float>(e[32 + 2 * half]);
    m = -(half_at(e + 38) * static_cast<float>(e[33 + 2 * half]));
  }

  static void plain(const uint8_t* __restrict e, float* __restrict w) {
    for (int half = 0; half < 2; ++half) {
      float d, m;
      block_scales(e, half, d, m);
      for (int i = 0; i < 32; ++i) w[32 * half + i] = d * static_cast<float>((e[i] >> (4 * half)) & 15) + m;
    }
  }
#if FAFO_AVX2
  static constexpr int kPart = 1;
  [[gnu::always_inline]] static void widen_part(const uint8_t* e, int c, __m256* w) {
    float dA, mA, dB, mB;
    block_scales(e, 0, dA, mA);
    block_scales(e, 1, dB, mB);
    widen_nibbles(e, c, dA, mA, dB, mB, w);
  }
#endif
#if FAFO_PACKED
  // D, M of block A, then of B, per entry: block_scales' products, the same float32 values
  static void scales(const uint8_t* first, float* out) {
    const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(words(first, entry, 32)));  // scA mA scB mB
    const __m256 halves = _mm256_cvtph_ps(words(first, entry, 36));  // d dmin of each entry
    const __m512 both = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7),
                                              _mm512_castps256_ps512(halves));
    const __m512 negate = _mm512_castsi512_ps(_mm512_set4_epi32(INT32_MIN, 0, INT32_MIN, 0));  // the minimums
    store_scales(out, _mm512_xor_ps(_mm512_mul_ps(both, codes), negate));
  }

  static void rebuild(const uint8_t* entry, const float* dm, __m512i& a, __m512i& b) { Q4_1::lookup(entry, dm, a, b); }
#endif
};

// The 5- or 6-bit codes of an S5 or S6 entry's block `half` (A: 0), less `offset`: low 4 bits, then the bit planes
// (loops the compiler vectorizes)
inline void codes_of(const uint8_t* __restrict e, int half, int planes, int offset, int32_t* __restrict q) {
  const uint32_t fifth = word_at(e + 32 + 4 * half), sixth = planes > 1 ? word_at(e + 40 + 4 * half) : 0;
  for (int j = 0; j < 32; ++j)
    q[j] = static_cast<int32_t>(((e[j] >> (4 * half)) & 15) | (((fifth >> j) & 1) << 4) | (((sixth >> j) & 1) << 5)) -
           offset;
}

struct S5 {  // Q5_0: bf16(d * (q - 16)), q of 5 bits
  static constexpr int64_t entry = 44;

  static void plain(const uint8_t* __restrict e, float* __restrict w) {
    int32_t q[32];
    for (int half = 0; half < 2; ++half) {
      const float d = half_at(e + 40 + 2 * half);
      codes_of(e, half, 1, 16, q);
      for (int j = 0; j < 32; ++j) w[32 * half + j] = d * static_cast<float>(q[j]);
    }
  }
#if FAFO_AVX2
  static constexpr int kPart = 2;
  [[gnu::always_inline]] static void widen_part(const uint8_t* e, int h, __m256* w) {
    const __m256i planes = _mm256_broadcastsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(e + 32)));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nibble_bytes(e, h), plane_bytes(planes, h, 0, 16)),
                                      _mm256_set1_epi8(16));
    widen_bytes(q, _mm256_set1_ps(half_at(e + 40)), _mm256_set1_ps(half_at(e + 42)), w);
  }
#endif
#if FAFO_PACKED
  // bf16(d * (q - 16)) for q = 0..31: the 32-entry table a permute reads with the 5-bit codes
  static __m512i values(float d) {
    const __m512 low = _mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m512 high = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 scale = _mm512_set1_ps(d);
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(high, scale), _mm512_mul_ps(low, scale));
  }

  static void scales(const uint8_t*, float*) {}  // read with each entry: batching them measured slower

  static void rebuild(const uint8_t* entry, const float*, __m512i& a, __m512i& b) {
    const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(entry)));
    const __m512i sixteen = _mm512_set1_epi16(16);
    uint16_t bits[2];
    std::memcpy(bits, entry + 40, 4);
    const __m512i qa = _mm512_and_si512(codes, _mm512_set1_epi16(15)), qb = _mm512_srli_epi16(codes, 4);
    a = _mm512_permutexvar_epi16(_mm512_mask_add_epi16(qa, word_at(entry + 32), qa, sixteen),
                                 values(_cvtsh_ss(bits[0])));
    b = _mm512_permutexvar_epi16(_mm512_mask_add_epi16(qb, word_at(entry + 36), qb, sixteen),
                                 values(_cvtsh_ss(bits[1])));
  }
#endif
};

struct S6 {  // Q6_K: bf16(D * (q - 32)), q of 6 bits, D = d * s per 16 weights (exact: 11-bit by 8-bit)
  static constexpr int64_t entry = 56;

  static void plain(const uint8_t* __restrict e, float* __restrict w) {
    const float d = half_at(e + 52);
    int32_t q[32];
    for (int half = 0; half < 2; ++half) {
      codes_of(e, half, 2, 32, q);
      for (int k = 0; k < 2; ++k) {
        const float scale = d * static_cast<float>(static_cast<int8_t>(e[48 + 2 * half + k]));
        for (int j = 0; j < 16; ++j) w[32 * half + 16 * k + j] = scale * static_cast<float>(q[16 * k + j]);
      }
    }
  }
#if FAFO_AVX2
  static constexpr int kPart = 2;
  [[gnu::always_inline]] static void widen_part(const uint8_t* e, int h, __m256* w) {
    const __m256i planes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e + 32)));
    const __m256i q = _mm256_or_si256(_mm256_or_si256(nibble_bytes(e, h), plane_bytes(planes, h, 0, 16)),
                                      plane_bytes(planes, h, 2, 32));
    // weights 16h .. 16h + 15 of a block take its sub-block h's scale
    const float d = half_at(e + 52);
    widen_bytes(_mm256_sub_epi8(q, _mm256_set1_epi8(32)),
                _mm256_set1_ps(d * static_cast<float>(static_cast<int8_t>(e[48 + h]))),
                _mm256_set1_ps(d * static_cast<float>(static_cast<int8_t>(e[50 + h]))), w);
  }
#endif
#if FAFO_PACKED
  // 32 weights: their codes' low 4 bits (16-bit lanes), fifth and sixth bits, the two halves' scales
  static __m512i block(__m512i q, __mmask32 fifth, __mmask32 sixth, float d0, float d1) {
    q = _mm512_mask_add_epi16(q, fifth, q, _mm512_set1_epi16(16));
    q = _mm512_mask_add_epi16(q, sixth, q, _mm512_set1_epi16(32));
    q = _mm512_sub_epi16(q, _mm512_set1_epi16(32));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(high, _mm512_set1_ps(d1)),
                                        _mm512_mul_ps(low, _mm512_set1_ps(d0)));
  }

  // D = d * s of each entry's four 16-weight sub-blocks (the padding after d is read and not used)
  static void scales(const uint8_t* first, float* out) {
    const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(words(first, entry, 48)));
    const __m256 halves = _mm256_cvtph_ps(words(first, entry, 52));  // d, padding, per entry
    const __m512 d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6),
                                           _mm512_castps256_ps512(halves));
    store_scales(out, _mm512_mul_ps(d, s));
  }

  static void rebuild(const uint8_t* entry, const float* scale, __m512i& a, __m512i& b) {
    const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(entry)));
    a = block(_mm512_and_si512(codes, _mm512_set1_epi16(15)), word_at(entry + 32), word_at(entry + 40), scale[0],
              scale[1]);
    b = block(_mm512_srli_epi16(codes, 4), word_at(entry + 36), word_at(entry + 44), scale[2], scale[3]);
  }
#endif
};

struct Q8_0 {
  static constexpr int64_t entry = 68;

  static void plain(const uint8_t* __restrict e, float* __restrict w) {
    for (int half = 0; half < 2; ++half) {
      const float d = half_at(e + 64 + 2 * half);
      for (int j = 0; j < 32; ++j) w[32 * half + j] = static_cast<float>(static_cast<int8_t>(e[32 * half + j])) * d;
    }
  }
#if FAFO_AVX2
  static constexpr int kPart = 1;
  [[gnu::always_inline]] static void widen_part(const uint8_t* e, int c, __m256* w) {
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(signed_bytes_of(e + 8 * c)), _mm256_set1_ps(half_at(e + 64)));
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(signed_bytes_of(e + 32 + 8 * c)), _mm256_set1_ps(half_at(e + 66)));
  }
#endif
#if FAFO_PACKED
  static __m512i block(const uint8_t* codes, float d) {  // bf16(d * q) of 32 int8 codes, in order
    auto half = [&](int at) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + at));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(d));
    };
    return (__m512i)_mm512_cvtne2ps_pbh(half(16), half(0));
  }

  static void scales(const uint8_t*, float*) {}  // read with each entry: batching them measured slower

  static void rebuild(const uint8_t* entry, const float*, __m512i& a, __m512i& b) {
    uint16_t bits[2];
    std::memcpy(bits, entry + 64, 4);
    a = block(entry, _cvtsh_ss(bits[0]));
    b = block(entry + 32, _cvtsh_ss(bits[1]));
  }
#endif
};

struct B6 {  // Q6_K widened: bf16(D * q), q the code less 32 (one signed byte), D per 16 weights (float32)
  static constexpr int64_t entry = 80;

  static void plain(const uint8_t* __restrict e, float* __restrict w) {
    for (int j = 0; j < 64; ++j)
      w[j] = float_at(e + 64 + 4 * (j / 16)) * static_cast<float>(static_cast<int8_t>(e[j]));
  }
#if FAFO_AVX2
  static constexpr int kPart = 1;
  [[gnu::always_inline]] static void widen_part(const uint8_t* e, int c, __m256* w) {
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(signed_bytes_of(e + 8 * c)),
                         _mm256_set1_ps(float_at(e + 64 + 4 * (c / 2))));
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(signed_bytes_of(e + 32 + 8 * c)),
                         _mm256_set1_ps(float_at(e + 72 + 4 * (c / 2))));
  }
#endif
#if FAFO_PACKED
  static __m512i block(const uint8_t* codes, const uint8_t* scales) {  // bf16(D * q) of 32 codes, in order
    auto half = [&](int at) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + at));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(float_at(scales + at / 4)));
    };
    return (__m512i)_mm512_cvtne2ps_pbh(half(16), half(0));
  }

  static void scales(const uint8_t*, float*) {}  // float32 in the entry already

  static void rebuild(const uint8_t* entry, const float*, __m512i& a, __m512i& b) {
    a = block(entry, entry + 64);
    b = block(entry + 32, entry + 72);
  }
#endif
};

// f(F{}) for the format whose entries are `entry` bytes
template <class Op>
auto by_format(int64_t entry, Op f) {
  switch (entry) {
    case K4::entry: return f(K4{});
    case S5::entry: return f(S5{});
    case Q4_1::entry: return f(Q4_1{});
    case S6::entry: return f(S6{});
    case B6::entry: return f(B6{});
    default: return f(Q8_0{});  // check_packed has admitted only these sizes
  }
}

bool known_entry(int64_t entry) {
  return entry == K4::entry || entry == S5::entry || entry == Q4_1::entry || entry == S6::entry ||
         entry == Q8_0::entry || entry == B6::entry;
}

#if FAFO_PACKED

// bf16 of 16 floats, rounded to nearest even exactly as at::BFloat16 does (a NaN becomes 0x7FC0)
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

// y[r][n0 .. n0 + 16) = bf16(sums[.][r] + bias) for the `height` input rows of a tile's sums ([16][height], as
// both paths leave them); the outputs past out_features (a last, padded tile) are not written
void store_rows(const float* sums, int64_t height, const float* bias, int64_t n0, int64_t out_features,
                at::BFloat16* y) {
  const int64_t valid = std::min(kTile, out_features - n0);
  const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1);
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(height)));
  const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
  for (int64_t r = 0; r < height; ++r) {
    const __m512 sum = _mm512_add_ps(_mm512_i32gather_ps(column, sums + r, 4), b);
    _mm256_mask_storeu_epi16(y + r * out_features + n0, keep, to_bf16(sum));
  }
}

#if FAFO_PACKED
// Rebuilds `count` of the kSub consecutive entries from `first`, from its entry `from` on, their scales computed
// together: use(t, a, b) for each (t from 0). Every vector path rebuilds weights through this, packing's check
// (packed_weight) included.
template <class F, int count = kSub, class Use>
[[gnu::always_inline]] inline void rebuild_batch(const uint8_t* first, Use use, int from = 0) {
  alignas(64) float scales[kSub * kScales];
  F::scales(first, scales);
  for (int t = 0; t < count; ++t) {
    __m512i a, b;
    F::rebuild(first + (from + t) * F::entry, scales + (from + t) * kScales, a, b);
    use(t, a, b);
  }
}
#endif

// Ask for the group kPrefetch bytes past `group`: into L2 on the AVX-512 path (locality 2; AMD Zen 4, SmolLM2's 211
// matrices for 1 / 6 rows: 7.1 / 12.2 ms into L1, 6.2 / 10.2 into L2), into L1 on the AMX path (3: as measured on
// its CPU)
template <class F, int locality>
inline void prefetch(const uint8_t* group) {
  for (int64_t line = 0; line < kTile * F::entry; line += 64) __builtin_prefetch(group + kPrefetch + line, 0, locality);
}

// Sums of `width` weight rows of a tile, from row part * width on, with `rows` input rows (AVX-512 pair dot
// products): sums[t * ld + r]. Blocks of more rows take fewer weight rows (rows x width accumulators).
template <class F, int rows, int width = kSub>
void avx512_block(const at::BFloat16* x, int64_t ldx, const uint8_t* tile, int64_t groups, int part, float* sums,
                  int64_t ld) {
  static_assert(kSub % width == 0, "a block's weight rows lie in one batch");
  const int first = part * width;  // the block's first weight row in the tile
  __m512 acc[rows][width];
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < width; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = tile + g * kTile * F::entry;
    if (part == 0) prefetch<F, 2>(group);
    rebuild_batch<F, width>(group + first / kSub * kSub * F::entry, [&](int t, __m512i a, __m512i b) {
      for (int r = 0; r < rows; ++r) {
        const at::BFloat16* xr = x + r * ldx + g * kGroup;
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)_mm512_loadu_si512(xr), (__m512bh)a);
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)_mm512_loadu_si512(xr + 32), (__m512bh)b);
      }
    }, first % kSub);
  }
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < width; ++t) sums[(first + t) * ld + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// A tile whose entries are rebuilt already: each entry's 64 bf16 weights (blocks A and B) as `rebuild` gave them
struct Built {
  static constexpr int64_t entry = 128;

  static void scales(const uint8_t*, float*) {}

  static void rebuild(const uint8_t* entry, const float*, __m512i& a, __m512i& b) {
    a = _mm512_loadu_si512(entry);
    b = _mm512_loadu_si512(entry + 64);
  }
};

template <class F>
void avx512_tile(const at::BFloat16* x, int64_t rows, int64_t ldx, const uint8_t* tile, int64_t groups,
                 float* sums) {
  if constexpr (!std::is_same_v<F, Built>) {
    if (rows > kRows && rows <= kTallRows) {  // one block of all rows, two weight rows at a time: each weight
      for (int part = 0; part < kTile / 2; ++part) {  // rebuilt once, straight into the products
        switch (rows) {
          case 7: avx512_block<F, 7, 2>(x, ldx, tile, groups, part, sums, rows); break;
          case 8: avx512_block<F, 8, 2>(x, ldx, tile, groups, part, sums, rows); break;
          default: avx512_block<F, 9, 2>(x, ldx, tile, groups, part, sums, rows); break;
        }
      }
      return;
    }
    if (rows > kRows) {  // several register blocks of rows: rebuild the tile's weights once, not once per block
      thread_local std::vector<uint8_t> built;  // (the same bf16 values, multiplied in the same order: same bits)
      built.resize(groups * kTile * Built::entry);
      for (int64_t e0 = 0; e0 < groups * kTile; e0 += kSub) {
        if (e0 % kTile == 0) prefetch<F, 2>(tile + e0 * F::entry);  // the weights stream from memory: ask ahead
        rebuild_batch<F>(tile + e0 * F::entry, [&](int t, __m512i a, __m512i b) {
          _mm512_storeu_si512(built.data() + (e0 + t) * Built::entry, a);
          _mm512_storeu_si512(built.data() + (e0 + t) * Built::entry + 64, b);
        });
      }
      avx512_tile<Built>(x, rows, ldx, built.data(), groups, sums);
      return;
    }
  }
  for (int64_t r0 = 0; r0 < rows; r0 += kRows)
    for (int sub = 0; sub < kTile / kSub; ++sub) {
      const at::BFloat16* xr = x + r0 * ldx;
      float* out = sums + r0;
      switch (std::min(kRows, rows - r0)) {  // compile-time heights keep the accumulators in registers
        case 1: avx512_block<F, 1>(xr, ldx, tile, groups, sub, out, rows); break;
        case 2: avx512_block<F, 2>(xr, ldx, tile, groups, sub, out, rows); break;
        case 3: avx512_block<F, 3>(xr, ldx, tile, groups, sub, out, rows); break;
        case 4: avx512_block<F, 4>(xr, ldx, tile, groups, sub, out, rows); break;
        case 5: avx512_block<F, 5>(xr, ldx, tile, groups, sub, out, rows); break;
        default: avx512_block<F, 6>(xr, ldx, tile, groups, sub, out, rows); break;
      }
    }
}
static_assert(kRows == 6 && kTallRows == 9, "avx512_tile covers heights 1..kRows and to kTallRows");

// (built with -DFAFO_NO_AMX, an AMX CPU runs the AVX-512 path: how the README's AVX-512 figures were taken)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(FAFO_NO_AMX)
#define FAFO_AMX 1
#include "amx.h"

// AMX: each group's two blocks are rebuilt into two 16 x 32 bf16 tiles (weight rows x columns) and multiplied
// with the input rows, laid out in pairs of columns ([in / 2][rows][2]), into a 16 x rows float32 tile.
// The tiles amx_tile uses, for `rows` input rows: loaded once per thread and call (loading costs microseconds).
void amx_configure(int64_t rows) {
  fafo_amx::TileConfig config;
  const uint16_t width = static_cast<uint16_t>(rows * 4);
  config.tile_rows[0] = 16, config.colsb[0] = width;                 // sums
  config.tile_rows[1] = config.tile_rows[2] = 16;                    // weights, blocks A and B
  config.colsb[1] = config.colsb[2] = 64;
  config.tile_rows[3] = config.tile_rows[4] = 16;                    // inputs, blocks A and B
  config.colsb[3] = config.colsb[4] = width;
  _tile_loadconfig(&config);
}

// Sums of a tile's 16 weight rows with `rows` (<= 16) input rows in pairs (`pairs`: [in / 2][rows][2]),
// under amx_configure(rows).
template <class F>
void amx_tile(const at::BFloat16* pairs, int64_t rows, const uint8_t* tile, int64_t groups, float* sums) {
  const int64_t width = rows * 4;
  alignas(64) at::BFloat16 weights[2][2][kTile][32];  // [buffer][block][row][column]: two groups in flight
  _tile_zero(0);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group = tile + g * kTile * F::entry;
    prefetch<F, 3>(group);
    auto& w = weights[g & 1];
    for (int t0 = 0; t0 < kTile; t0 += kSub)
      rebuild_batch<F>(group + t0 * F::entry, [&](int t, __m512i a, __m512i b) {
        _mm512_store_si512(w[0][t0 + t], a);
        _mm512_store_si512(w[1][t0 + t], b);
      });
    const at::BFloat16* x = pairs + g * kGroup * rows;
    _tile_loadd(1, w[0], 64);
    _tile_loadd(3, x, width);
    _tile_loadd(2, w[1], 64);
    _tile_loadd(4, x + 32 * rows, width);
    _tile_dpbf16ps(0, 1, 3);
    _tile_dpbf16ps(0, 2, 4);
  }
  _tile_stored(0, sums, width);
}
#endif

#endif

// A packed product's shapes, checked, and its bias in float32 (bias_p: nullptr where there is none).
struct Product {
  int64_t rows, in_features, tiles, groups;
  at::Tensor bias_f;
  const float* bias_p = nullptr;

  Product(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const c10::optional<at::Tensor>& bias)
      : rows(x.size(0)), in_features(x.size(1)), tiles(packed.size(0)), groups(packed.size(1)) {
    // (the last tile must hold some of the outputs: the stores of a tile past them would write beyond y)
    TORCH_CHECK(in_features == groups * kGroup && out_features <= tiles * kTile && out_features > (tiles - 1) * kTile,
                "fafo::packed_linear: x and the packed weight do not fit");
    TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->numel() == out_features),
                "fafo::packed_linear: the bias does not fit the outputs");
    if (bias.has_value()) {
      bias_f = bias->to(at::kFloat).contiguous();
      bias_p = bias_f.data_ptr<float>();
    }
  }
};

#if FAFO_PACKED
template <class F>
at::Tensor linear_as(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                     const c10::optional<at::Tensor>& bias) {
  const Product p(x, packed, out_features, bias);
  const int64_t rows = p.rows, in_features = p.in_features, tiles = p.tiles, groups = p.groups;
  const float* bias_p = p.bias_p;
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
#if FAFO_AMX
  const bool amx = fafo_amx::ready();
#else
  const bool amx = false;
#endif
  // AMX takes up to 16 input rows at a time, their columns in pairs: [chunk][in / 2][rows][2]
  constexpr int64_t kAmxRows = 16;
  // (one row is already in that layout)
  std::vector<at::BFloat16> pairs;
  if (amx && rows > 1) {
    pairs.resize(rows * in_features);
    const int64_t words = in_features / 2;  // a pair of bf16 moves as one 32-bit word
    const uint32_t* from = reinterpret_cast<const uint32_t*>(xp);
    for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
      const int64_t height = std::min(kAmxRows, rows - r0);
      uint32_t* chunk = reinterpret_cast<uint32_t*>(pairs.data() + r0 * in_features);
      for (int64_t k = 0; k < words; ++k)
        for (int64_t r = 0; r < height; ++r) chunk[k * height + r] = from[(r0 + r) * words + k];
    }
  }
  [[maybe_unused]] const at::BFloat16* laid_out = rows > 1 ? pairs.data() : xp;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(amx ? 0 : kTile * rows);  // the AVX-512 path's [weight row][input row]
    int64_t configured = 0;  // the row count the tiles are configured for
    for (int64_t tile = begin; tile < end; ++tile) {
      const uint8_t* weights = wp + tile * groups * kTile * F::entry;
      const int64_t n0 = tile * kTile;  // this tile's first output
#if FAFO_AMX
      if (amx) {
        for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
          const int64_t height = std::min(kAmxRows, rows - r0);
          if (height != configured) amx_configure(configured = height);
          alignas(64) float block[kTile * kAmxRows];  // [weight row][input row]
          amx_tile<F>(laid_out + r0 * in_features, height, weights, groups, block);
          store_rows(block, height, bias_p, n0, out_features, yp + r0 * out_features);
        }
        continue;
      }
#endif
      avx512_tile<F>(xp, rows, in_features, weights, groups, sums.data());
      store_rows(sums.data(), rows, bias_p, n0, out_features, yp);
    }
#if FAFO_AMX
    if (configured) _tile_release();
#endif
  });
  return y;
}

#endif

#if FAFO_AVX2
// The float32 path. A tile's weight rows are taken two at a time, with up to kRows32 input rows: each (weight row,
// input row) keeps one vector accumulator, which takes an entry's columns chunk by chunk (8 of block A, then the
// same 8 of block B), so every row's sum runs the same multiply-adds in the same order whatever the number of rows.
// More input rows take the weights again, widened anew: widening a tile once into a buffer and reading it back
// per block of rows measured slower (the buffer leaves L1).
constexpr int64_t kRows32 = 4;

inline float sum_of(__m256 v) {  // lanes added in a fixed order
  const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// sums[t * ld + r] for weight rows t and t + 1 of a tile and `rows` input rows
template <class F, int rows>
void avx2_pair(const float* x, int64_t ldx, const uint8_t* tile, int64_t groups, int64_t t, float* sums, int64_t ld) {
  __m256 acc[2][rows];
  for (int r = 0; r < rows; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * kGroup;
    const uint8_t* e = tile + (g * kTile + t) * F::entry;
    // (the two weight rows' parts side by side: each input chunk is loaded once for both)
    each_part<F>([&](int part) __attribute__((always_inline)) {
      __m256 w0[2 * F::kPart], w1[2 * F::kPart];
      F::widen_part(e, part, w0);
      F::widen_part(e + F::entry, part, w1);
      for (int k = 0; k < F::kPart; ++k) {
        const int c = part * F::kPart + k;
        for (int r = 0; r < rows; ++r) {
          const __m256 xa = _mm256_loadu_ps(xg + r * ldx + 8 * c), xb = _mm256_loadu_ps(xg + r * ldx + 32 + 8 * c);
          acc[0][r] = _mm256_fmadd_ps(xb, w0[2 * k + 1], _mm256_fmadd_ps(xa, w0[2 * k], acc[0][r]));
          acc[1][r] = _mm256_fmadd_ps(xb, w1[2 * k + 1], _mm256_fmadd_ps(xa, w1[2 * k], acc[1][r]));
        }
      }
    });
  }
  for (int r = 0; r < rows; ++r) sums[t * ld + r] = sum_of(acc[0][r]), sums[(t + 1) * ld + r] = sum_of(acc[1][r]);
}

// Sums of a tile's kTile weight rows with `rows` input rows ([kTile][rows]); `next`: the tile this thread takes
// next (nullptr: none), asked for from memory an eighth per pair of weight rows
template <class F>
void avx2_tile(const float* x, int64_t rows, int64_t ldx, const uint8_t* tile, int64_t groups, float* sums,
               const uint8_t* next) {
  const int64_t share = groups * F::entry * 2;  // an eighth of a tile's bytes
  for (int64_t t = 0; t < kTile; t += 2) {
    if (next)
      for (int64_t line = 0; line < share; line += 64) __builtin_prefetch(next + t / 2 * share + line, 0, 3);
    for (int64_t r0 = 0; r0 < rows; r0 += kRows32) {
      const float* xr = x + r0 * ldx;
      switch (std::min(kRows32, rows - r0)) {  // compile-time heights keep the accumulators in registers
        case 1: avx2_pair<F, 1>(xr, ldx, tile, groups, t, sums + r0, rows); break;
        case 2: avx2_pair<F, 2>(xr, ldx, tile, groups, t, sums + r0, rows); break;
        case 3: avx2_pair<F, 3>(xr, ldx, tile, groups, t, sums + r0, rows); break;
        default: avx2_pair<F, 4>(xr, ldx, tile, groups, t, sums + r0, rows); break;
      }
    }
  }
}
static_assert(kRows32 == 4, "avx2_tile covers heights 1..kRows32");

template <class F>
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const c10::optional<at::Tensor>& bias) {
  const Product p(x, packed, out_features, bias);
  const int64_t rows = p.rows, in_features = p.in_features, tiles = p.tiles, groups = p.groups;
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tile_bytes = groups * kTile * F::entry;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(kTile * rows);
    for (int64_t tile = begin; tile < end; ++tile) {
      const uint8_t* weights = wp + tile * tile_bytes;
      const uint8_t* next = tile + 1 < end ? weights + tile_bytes : nullptr;
      avx2_tile<F>(xp, rows, in_features, weights, groups, sums.data(), next);
      for (int64_t t = 0; t < kTile && tile * kTile + t < out_features; ++t) {
        const int64_t n = tile * kTile + t;
        for (int64_t r = 0; r < rows; ++r)
          yp[r * out_features + n] = p.bias_p ? sums[t * rows + r] + p.bias_p[n] : sums[t * rows + r];
      }
    }
  });
  return y;
}
#endif

// x rounded to bf16 as at::BFloat16 rounds it (to nearest even; a NaN becomes 0x7FC0), as a float: in a form the
// compiler vectorizes
inline float bf16_value(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits = x != x ? 0x7FC00000u : (bits + 0x7FFFu + ((bits >> 16) & 1)) & 0xFFFF0000u;
  float y;
  std::memcpy(&y, &bits, 4);
  return y;
}

// The plain path: each weight rebuilt by `plain` (for a bf16 model, T, rounded to bf16 as at::BFloat16 rounds: to
// nearest even), products and sums in float32. A weight row's sum with an input row runs over 64 lanes in a fixed
// order (lane j takes columns j, j + 64, ...), then adds the lanes in order: the same for every row count.
template <class F, class T>
at::Tensor plain_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                        const c10::optional<at::Tensor>& bias) {
  const Product p(x, packed, out_features, bias);
  const int64_t rows = p.rows, in_features = p.in_features, tiles = p.tiles, groups = p.groups;
  const float* bias_p = p.bias_p;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  at::Tensor y = at::empty({rows, out_features}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  T* yp = y.data_ptr<T>();
  constexpr int64_t kLanes = kGroup;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> lanes(kTile * rows * kLanes);  // [weight row][input row][lane]
    float w[kGroup];
    for (int64_t tile = begin; tile < end; ++tile) {
      std::fill(lanes.begin(), lanes.end(), 0.0f);
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t t = 0; t < kTile; ++t) {
          F::plain(wp + ((tile * groups + g) * kTile + t) * F::entry, w);
          if constexpr (!std::is_same_v<T, float>)
            for (int64_t j = 0; j < kGroup; ++j) w[j] = bf16_value(w[j]);
          for (int64_t r = 0; r < rows; ++r) {
            const float* __restrict xr = xp + r * in_features + g * kGroup;
            float* __restrict lane = lanes.data() + (t * rows + r) * kLanes;
            for (int64_t j = 0; j < kLanes; ++j) lane[j] += xr[j] * w[j];
          }
        }
      for (int64_t t = 0; t < kTile && tile * kTile + t < out_features; ++t) {
        const int64_t n = tile * kTile + t;
        for (int64_t r = 0; r < rows; ++r) {
          const float* lane = lanes.data() + (t * rows + r) * kLanes;
          float sum = 0.0f;
          for (int64_t j = 0; j < kLanes; ++j) sum += lane[j];
          yp[r * out_features + n] = T(bias_p ? sum + bias_p[n] : sum);
        }
      }
    }
  });
  return y;
}

// The weights a packed product multiplies with, [tiles * kTile, in_features]: bf16, rebuilt by the vector code
// (`rebuild`) where there is one, else by `plain` and rounded; float32 (`wide`), widened by `widen` or `plain`.
template <class F>
at::Tensor weight_as(const at::Tensor& packed, int64_t out_features, bool wide) {
  const int64_t tiles = packed.size(0), groups = packed.size(1);
  at::Tensor w =
      at::empty({tiles * kTile, groups * kGroup}, at::TensorOptions().dtype(wide ? at::kFloat : at::kBFloat16));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    [[maybe_unused]] float values[kGroup];
    for (int64_t tile = begin; tile < end; ++tile)
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* entries = wp + (tile * groups + g) * kTile * F::entry;
        const int64_t first = tile * kTile * groups * kGroup + g * kGroup;  // row 0's column 0 of this group
        if (wide) {
          float* out = w.data_ptr<float>() + first;
          for (int64_t t = 0; t < kTile; ++t) {
            float* row = out + t * groups * kGroup;
#if FAFO_AVX2
            widen<F>(entries + t * F::entry, [&](int c, __m256 a, __m256 b) {
              _mm256_storeu_ps(row + 8 * c, a);
              _mm256_storeu_ps(row + 32 + 8 * c, b);
            });
#else
            F::plain(entries + t * F::entry, row);
#endif
          }
          continue;
        }
        at::BFloat16* out = w.data_ptr<at::BFloat16>() + first;
        auto row = [&](int64_t t) { return out + t * groups * kGroup; };
#if FAFO_PACKED
        for (int64_t t0 = 0; t0 < kTile; t0 += kSub)  // what the vector kernels multiply with
          rebuild_batch<F>(entries + t0 * F::entry, [&](int t, __m512i a, __m512i b) {
            _mm512_storeu_si512(row(t0 + t), a);
            _mm512_storeu_si512(row(t0 + t) + 32, b);
          });
#else
        for (int64_t t = 0; t < kTile; ++t) {
          F::plain(entries + t * F::entry, values);
          for (int64_t j = 0; j < kGroup; ++j) row(t)[j] = at::BFloat16(values[j]);
        }
#endif
      }
  });
  return w.narrow(0, 0, out_features).clone();
}

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.size(2) == kTile &&
              known_entry(packed.size(3)) && packed.is_contiguous(),
              "fafo::packed_linear: not a packed weight");
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
  check_packed(packed);
  const bool wide = x.scalar_type() == at::kFloat;
  TORCH_CHECK(x.dim() == 2 && (wide || x.scalar_type() == at::kBFloat16) && x.is_contiguous(),
              "fafo::packed_linear: x must be a contiguous bf16 or float32 [rows, in_features]");
  return by_format(packed.size(3), [&](auto format) {
    using F = decltype(format);
    if (wide) {
#if FAFO_AVX2
      return linear_f32<F>(x, packed, out_features, bias);
#else
      return plain_linear<F, float>(x, packed, out_features, bias);
#endif
    }
#if FAFO_PACKED
    return linear_as<F>(x, packed, out_features, bias);
#else
    return plain_linear<F, at::BFloat16>(x, packed, out_features, bias);
#endif
  });
}

// The dense weight [out_features, in_features] a packed weight multiplies with, in `dtype` (bf16 by default, or
// float32), rebuilt by the same code: packing checks it against the model's own weight, bit for bit.
at::Tensor packed_weight(const at::Tensor& packed, int64_t out_features, c10::optional<at::ScalarType> dtype) {
  check_packed(packed);
  const bool wide = dtype.has_value() && *dtype == at::kFloat;
  TORCH_CHECK(wide || !dtype.has_value() || *dtype == at::kBFloat16, "fafo::packed_weight: bf16 or float32 only");
  return by_format(packed.size(3),
                   [&](auto format) { return weight_as<decltype(format)>(packed, out_features, wide); });
}

// Which path packed_linear takes on this CPU for rows of `dtype` (bf16 by default): "amx", "avx512-bf16" or
// "plain" for bf16, "avx2" or "plain" for float32
std::string packed_kernel(c10::optional<at::ScalarType> dtype) {
  if (dtype.has_value() && *dtype == at::kFloat) {
#if FAFO_AVX2
    return "avx2";
#else
    return "plain";
#endif
  }
#if FAFO_AMX
  if (fafo_amx::ready()) return "amx";
#endif
#if FAFO_PACKED
  return "avx512-bf16";
#else
  return "plain";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fafo, m) {
  m.def("packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("packed_weight(Tensor packed, int out_features, ScalarType? dtype=None) -> Tensor");
  m.def("packed_kernel(ScalarType? dtype=None) -> str", &packed_kernel);
}

TORCH_LIBRARY_IMPL(fafo, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_weight", &packed_weight);
}
