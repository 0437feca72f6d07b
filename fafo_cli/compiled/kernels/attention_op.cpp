// fafo::attend: masked attention of a few query rows against a long KV cache, on the CPU.
//
// Why our own kernel: torch's CPU flash attention issues a small GEMM library call per head and key
// block, which for decoding (1 to ~32 query rows, thousands of cached keys) costs several times what
// reading the keys and values costs. Here each task takes one KV head and one chunk of cached slots,
// multiplies all the query rows that share that KV head (GQA) with register-blocked vector code, and
// a final pass merges the chunks' softmax partials (flash-decoding), so both cores stream the cache once.
//
// Queries, keys and values are all float32 or all bfloat16 (a bf16 model's compact cache: half the bytes to
// stream). Softmax and the sums run in float32. With bf16, the value sum takes each probability rounded to bf16,
// as bf16 attention on any hardware does, wherever the products run on bf16 pairs: on a CPU with AMX, the scores
// and the value sums are tile products (a FAFO step's dozen verify queries per KV head cost what a plain step's
// three do; vector code spent a cycle per query and slot on multiply-adds); without AMX, AVX512-BF16's pair dot
// products (the scores by pairs of dimensions, the value sums by pairs of slots: half the instructions of widening
// both; products of two bf16 are exact in float32). Elsewhere both are widened exactly.
// Each query's result depends only on its own inputs, never on the other rows of the step: a row verifying a
// guess computes bit for bit what a plain step would for that token, which lossless decoding rests on (a draft
// tree's row reads its ancestors at the slots a plain step after them would; see `own` below).
//
// Portable C++ (GCC/Clang vector extensions): vectors of 16 floats (AVX-512 registers), or of 8 where the CPU has AVX2
// and not AVX-512.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <cfloat>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// 16-float vectors where the CPU has AVX-512 (or neither it nor AVX2: generic code), else 8-float ones; FAFO_VECTOR8
// builds the latter on any CPU with AVX2 (how the tests check it on AVX-512 CPUs)
#if (defined(__AVX512F__) || !defined(__AVX2__)) && !defined(FAFO_VECTOR8)
#define FAFO_WIDE 1
#endif
#if defined(__AVX512BF16__) && FAFO_WIDE
#define FAFO_PAIRS 1  // bf16 products by AVX512-BF16 pair dot products
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && FAFO_PAIRS && !defined(FAFO_NO_AMX)
#define FAFO_ATTEND_AMX 1
#include "amx.h"
#endif

namespace {

#if FAFO_WIDE
constexpr int64_t kLanes = 16;   // floats per vector: an AVX-512 register
constexpr int64_t kCols = 4;     // vectors per register block row
#else
// AVX2: vectors of 8 floats, blocks of 6 x 2 (16-float vectors took two registers each and spilled: a step's rows
// cost 1.4-7x torch's kernel)
constexpr int64_t kLanes = 8;
constexpr int64_t kCols = 2;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef int8_t vb __attribute__((vector_size(kLanes)));  // kLanes bools of the mask
constexpr int64_t kChunk = 64;   // cached slots per task
constexpr int64_t kRows = 6;     // most query rows per register block (6 x kCols accumulators + kCols operands)
constexpr int64_t kBlock = kCols * kLanes;
static_assert(kChunk % kBlock == 0, "a chunk holds whole register blocks");

typedef uint16_t vh __attribute__((vector_size(2 * kLanes)));  // kLanes bfloat16
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline vf load(const at::BFloat16* p) {  // a bfloat16 is the top half of a float32: widening is a shift
#if defined(__AVX512F__) && FAFO_WIDE
  // one zero-extending load and a shift (GCC splits the generic conversion into 256-bit halves)
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  vh half;
  std::memcpy(&half, p, sizeof half);
  const vu bits = __builtin_convertvector(half, vu) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) {  // one broadcast (not vf{} + x: that adds 0.0f first)
  // GCC builds the generic loop below lane by lane: 16 masked broadcasts on AVX-512, inserts and a permute on AVX2
  // (the float32 scores' and value sums' bottleneck)
#if defined(__AVX512F__) && FAFO_WIDE
  return (vf)_mm512_set1_ps(x);
#elif FAFO_WIDE
  vf v;
  for (int l = 0; l < kLanes; ++l) v[l] = x;
  return v;
#else
  return (vf)_mm256_set1_ps(x);
#endif
}

// lanes whose mask byte is set (GCC builds the generic conversion of 16 bytes to 16 ints lane by lane in scalars)
inline vi visible(const int8_t* bytes) {
#if defined(__AVX512F__) && FAFO_WIDE
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))) != 0;
#elif defined(__AVX2__) && !FAFO_WIDE
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))) != 0;
#else
  vb v;
  std::memcpy(&v, bytes, sizeof v);
  return __builtin_convertvector(v, vi) != 0;
#endif
}

// Reads `bytes` from `p` front to back, one load per cache line. A chunk's cache rows interleave the KV heads, so a
// task that takes one head reads a third of each row's lines: the hardware prefetcher then fetches at about half the
// bandwidth of a sequential read (docs/benchmarks.md), and this pass first brings the whole chunk in, in order.
inline void stream_in(const void* p, int64_t bytes) {
  const char* at = static_cast<const char*>(p);
  int32_t sink = 0;
  for (int64_t b = 0; b < bytes; b += 64) {
    int32_t word;
    std::memcpy(&word, at + b, sizeof word);
    sink |= word;
  }
  __asm__ volatile("" : : "r"(sink));  // the loads are the point: keep them
}

// The next chunk's cache lines, asked for into L2 a few at a time from inside the current chunk's work, so memory and
// arithmetic overlap: asked for all at once (a chunk is ~750 lines) they measured no faster, the core keeping few
// misses in flight.
struct ReadAhead {
  const char *key = nullptr, *key_end = nullptr, *value = nullptr, *value_end = nullptr;
  void start(const void* keys, int64_t key_bytes, const void* values, int64_t value_bytes) {
    key = static_cast<const char*>(keys), key_end = key + key_bytes;
    value = static_cast<const char*>(values), value_end = value + value_bytes;
  }
  void stop() { key = key_end = value = value_end = nullptr; }
  void ask(int lines) {
    for (int i = 0; i < lines && (key < key_end || value < value_end); ++i) {  // (neither: the chunk is asked for)
      if (key < key_end) { __builtin_prefetch(key, 0, 2); key += 64; }
      if (value < value_end) { __builtin_prefetch(value, 0, 2); value += 64; }
    }
  }
};

// exp for x <= 0 (scores minus their maximum), Cephes' polynomial: within 2 ulp of expf
inline vf exp_nonpositive(vf x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  const vf shifter = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  vf t = x * 1.44269504088896341f + shifter;
  vf n = t - shifter;
  vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // 2^n
  return p * reinterpret_cast<vf&>(bits);
}

// tile[r][l] <- tile[l][r] for a kLanes x kLanes tile: log2(kLanes) rounds, each swapping blocks of `span` lanes
// between rows r and r + span
#define FAFO_LANES(...) __VA_ARGS__
#if defined(__clang__) || __GNUC__ >= 12
#define FAFO_SHUFFLE(x, y, lanes) __builtin_shufflevector(x, y, FAFO_LANES lanes)
#else  // GCC before 12 (Ubuntu 22.04's 11, RHEL 8's and 9's): its own builtin, the lanes as a vector
#define FAFO_SHUFFLE(x, y, lanes) __builtin_shuffle(x, y, vi{FAFO_LANES lanes})
#endif
#define FAFO_TRANSPOSE_ROUND(span, low, high)     \
  for (int r = 0; r < kLanes; ++r) {             \
    if (r & span) continue;                      \
    const vf x = tile[r], y = tile[r + span];    \
    tile[r] = FAFO_SHUFFLE(x, y, low);           \
    tile[r + span] = FAFO_SHUFFLE(x, y, high);   \
  }

inline void transpose(vf* tile) {
#if FAFO_WIDE
  FAFO_TRANSPOSE_ROUND(8, (0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                       (8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
  FAFO_TRANSPOSE_ROUND(4, (0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                       (4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
  FAFO_TRANSPOSE_ROUND(2, (0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                       (2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
  FAFO_TRANSPOSE_ROUND(1, (0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                       (1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#else
  FAFO_TRANSPOSE_ROUND(4, (0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))
  FAFO_TRANSPOSE_ROUND(2, (0, 1, 8, 9, 4, 5, 12, 13), (2, 3, 10, 11, 6, 7, 14, 15))
  FAFO_TRANSPOSE_ROUND(1, (0, 8, 2, 10, 4, 12, 6, 14), (1, 9, 3, 11, 5, 13, 7, 15))
#endif
}

inline float hmax(vf v) {  // max is exact in any order
#if defined(__AVX512F__) && FAFO_WIDE
  return _mm512_reduce_max_ps((__m512)v);
#else
  float m = v[0]; for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]); return m;
#endif
}
inline float hsum(vf v) { float s = 0; for (int i = 0; i < kLanes; ++i) s += v[i]; return s; }

// acc[i][t] += the scores of query i with kBlock slots, from bf16 pairs: `keys` [dim / 2, kChunk] as above, a
// query's pair p is word p of its bf16 row, which starts `offset[i]` bf16 into `q2`
template <int R>
inline void scores_by_pairs(vf (&acc)[R][kCols], const uint32_t* q2, const int64_t* offset, const float* keys,
                            int64_t dim) {
#if FAFO_PAIRS
  const uint32_t* query[R];
  for (int64_t i = 0; i < R; ++i) query[i] = q2 + offset[i] / 2;
  for (int64_t p = 0; p < dim / 2; ++p) {
    __m512bh kv[kCols];
    for (int64_t t = 0; t < kCols; ++t) kv[t] = (__m512bh)_mm512_loadu_ps(&keys[p * kChunk + t * kLanes]);
    for (int64_t i = 0; i < R; ++i) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(query[i][p]));
      for (int64_t t = 0; t < kCols; ++t) acc[i][t] = (vf)_mm512_dpbf16_ps((__m512)acc[i][t], b, kv[t]);
    }
  }
#endif
}

#if FAFO_PAIRS
// Value sums by bf16 pairs of slots (2m, 2m + 1) take each 32 dimensions of the two slots' values unpacked into two
// vectors of 16 (dimension, both slots) pairs. AVX-512's unpack interleaves within 128-bit lanes, so of dimensions
// [32g, 32g + 32), vector 2g's lane 4L + i is dimension 32g + 8L + i and vector 2g + 1's is 32g + 8L + 4 + i
// (i, L < 4). unpair stores two such vectors' sums (x: 2g, y: 2g + 1) as dimensions 32g .. 32g + 31, in order.
inline void unpair(float* out, __m512 x, __m512 y) {
  const __m512i lower = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i upper = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(x, lower, y));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(x, upper, y));
}
#endif

#if FAFO_ATTEND_AMX
// AMX (bf16 queries, keys and values): per task and block of 16 queries, the scores come out of tiles with the
// slots as rows (keys are the left operand, read straight from the cache: nothing is laid out for them), so the
// softmax runs down the slots with one query per lane; the probabilities, rounded to bf16 (as a bf16 attention's
// value product takes them), multiply the values in pairs of slots. Each query's sums run the same tile and vector
// instructions whatever the other queries are, so a verify row still computes what a plain step would.
// tiles 0-3: sums (scores of 16 slots, or outputs of 16 dimensions); 4, 6, 7: left operands; 5: right operand
void configure_tiles() {
  fafo_amx::TileConfig config;
  for (int t = 0; t < 8; ++t) config.tile_rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

constexpr int64_t kBlockQueries = 16;  // queries per block: a tile's columns

// What every task of one call reads.
struct AmxCall {
  const at::BFloat16* keys;
  int64_t key_stride, key_head, dim, slots, cached, rows, queries, chunks;
  const uint32_t* query_pairs;  // [kv_heads][dim / 2][blocks * 16]: each query's dimensions in pairs, one word each
  int64_t padded;               // blocks * 16
  const uint16_t *all_bits, *part_bits, *local_bits;  // per block: queries that see all, C(kv); [block][rows]: own
  const bool* view_mask;
  int64_t view_mask_stride;
  float scale;
  float* partial;  // [kv_heads, queries, chunks, 2 + dim]
};

// A thread's scratch space.
struct AmxScratch {
  std::vector<at::BFloat16> value_pairs;  // [dim / 16][32 pairs][16 dims x 2 slots], see pair_values
  std::vector<at::BFloat16> short_keys;   // a short last group's 16 key rows, zero-padded: [16][dim]
  std::vector<float> outputs;             // [16 queries][dim], dimensions in pair_values' order
  alignas(64) float scores[kChunk][kBlockQueries];  // [slot][query]: scores, then probabilities
  alignas(64) at::BFloat16 probs[2][kBlockQueries][32];  // [half of the chunk][query][slot]
  explicit AmxScratch(int64_t dim) : value_pairs(dim * 2 * kChunk), short_keys(16 * dim), outputs(16 * dim) {}
};

// The chunk's values for the right operand of probs . values: per 16 dimensions, 32 rows (pairs of slots 2m, 2m + 1)
// of 16 (dimension, both slots) pairs, in unpair's order (tile t holds what vector t does there).
// Slots past `n` are zeros.
void pair_values(at::BFloat16* out, const at::BFloat16* values, int64_t stride, int64_t n, int64_t dim) {
  for (int64_t m = 0; m < kChunk / 2; ++m) {
    for (int64_t g = 0; g < dim / 32; ++g) {
      const at::BFloat16* a = values + 2 * m * stride + 32 * g;
      const __m512i x = 2 * m < n ? _mm512_loadu_si512(a) : _mm512_setzero_si512();
      const __m512i y = 2 * m + 1 < n ? _mm512_loadu_si512(a + stride) : _mm512_setzero_si512();
      _mm512_storeu_si512(out + ((2 * g) * 32 + m) * 32, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(out + ((2 * g + 1) * 32 + m) * 32, _mm512_unpackhi_epi16(x, y));
    }
  }
}

// One chunk `c` of KV head `h` for the queries of block `b`, whose rows see some slot of it.
void amx_block(const AmxCall& a, int64_t c, int64_t h, int64_t b, AmxScratch& scratch) {
  const int64_t s0 = c * kChunk, n = std::min(kChunk, a.slots - s0), dim = a.dim;
  const int64_t groups = (n + 15) / 16, halves = (n + 31) / 32;
  // scores: tile s holds slots 16s .. 16s + 15 (rows) by the block's queries (columns)
  auto key_rows = [&](int64_t s, int64_t half, const void** base, int64_t* stride) {
    if (16 * s + 16 <= n) {
      *base = a.keys + (s0 + 16 * s) * a.key_stride + h * a.key_head + 32 * half;
      *stride = a.key_stride * 2;
    } else {  // the short last group: its rows past n would read past the cache
      *base = scratch.short_keys.data() + 32 * half;
      *stride = dim * 2;
    }
  };
  if (16 * groups > n) {
    const int64_t s = groups - 1;
    std::fill(scratch.short_keys.begin(), scratch.short_keys.end(), at::BFloat16(0.0f));
    for (int64_t j = 16 * s; j < n; ++j)
      std::memcpy(scratch.short_keys.data() + (j - 16 * s) * dim, a.keys + (s0 + j) * a.key_stride + h * a.key_head,
                  dim * 2);
  }
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const uint32_t* queries = a.query_pairs + h * (dim / 2) * a.padded + b * kBlockQueries;
  for (int64_t half = 0; half < dim / 32; ++half) {
    _tile_loadd(5, queries + 16 * half * a.padded, a.padded * 4);
    const void* base;
    int64_t stride;
#define FAFO_SCORES(T) if (T < groups) { key_rows(T, half, &base, &stride); _tile_loadd(4, base, stride); _tile_dpbf16ps(T, 4, 5); }
    FAFO_SCORES(0) FAFO_SCORES(1) FAFO_SCORES(2) FAFO_SCORES(3)
#undef FAFO_SCORES
  }
  float* scores = &scratch.scores[0][0];
  if (groups > 0) _tile_stored(0, scores, 64);
  if (groups > 1) _tile_stored(1, scores + 16 * 16, 64);
  if (groups > 2) _tile_stored(2, scores + 32 * 16, 64);
  if (groups > 3) _tile_stored(3, scores + 48 * 16, 64);

  // softmax down the slots, one query per lane; masked and padding slots get probability exactly 0
  uint16_t bits[kChunk];
  const uint16_t all = a.all_bits[b], part = a.part_bits[b];
  for (int64_t j = 0; j < n; ++j) {
    const int64_t slot = s0 + j;
    bits[j] = slot < a.cached ? (all | (a.view_mask[slot * a.view_mask_stride] ? part : 0))
                              : a.local_bits[b * a.rows + slot - a.cached];
  }
  const __m512 scale = _mm512_set1_ps(a.scale);
  __m512 top = _mm512_set1_ps(-FLT_MAX);
  for (int64_t j = 0; j < n; ++j) {
    const __m512 x = _mm512_mul_ps(_mm512_load_ps(scores + 16 * j), scale);
    _mm512_store_ps(scores + 16 * j, x);
    top = _mm512_mask_max_ps(top, bits[j], top, x);
  }
  vf total = {};
  for (int64_t j = 0; j < n; ++j) {
    const vf e = exp_nonpositive(load(scores + 16 * j) - (vf)top);
    const vf kept = (vf)_mm512_maskz_mov_ps(bits[j], (__m512)e);
    total += kept;
    store(scores + 16 * j, kept);
  }
  for (int64_t j = n; j < 32 * halves; ++j) store(scores + 16 * j, vf{});
  // probabilities as the left operand: [query][slot] in bf16, 32 slots per tile
  for (int64_t half = 0; half < halves; ++half) {
    vf low[kLanes], high[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) {
      low[i] = load(scores + 16 * (32 * half + i));
      high[i] = load(scores + 16 * (32 * half + 16 + i));
    }
    transpose(low);
    transpose(high);
    for (int64_t q = 0; q < kBlockQueries; ++q)
      _mm512_store_si512(scratch.probs[half][q], (__m512i)_mm512_cvtne2ps_pbh((__m512)high[q], (__m512)low[q]));
  }
  // outputs = probs . values: tile t holds the block's queries (rows) by 16 dimensions (columns)
  const at::BFloat16* pairs = scratch.value_pairs.data();
  float* outputs = scratch.outputs.data();
  _tile_loadd(6, scratch.probs[0], 64);
  if (halves > 1) _tile_loadd(7, scratch.probs[1], 64);
  for (int64_t t0 = 0; t0 < dim / 16; t0 += 4) {
#define FAFO_VALUES(T)                                                        \
    if (t0 + T < dim / 16) {                                                  \
      _tile_zero(T);                                                          \
      _tile_loadd(5, pairs + (t0 + T) * 32 * 32, 64);                         \
      _tile_dpbf16ps(T, 6, 5);                                                \
      if (halves > 1) {                                                       \
        _tile_loadd(5, pairs + ((t0 + T) * 32 + 16) * 32, 64);                \
        _tile_dpbf16ps(T, 7, 5);                                              \
      }                                                                       \
      _tile_stored(T, outputs + (t0 + T) * 16, dim * 4);                      \
    }
    FAFO_VALUES(0) FAFO_VALUES(1) FAFO_VALUES(2) FAFO_VALUES(3)
#undef FAFO_VALUES
  }
  // each query's partial, its dimensions back in order (see pair_values)
  alignas(64) float tops[kLanes], totals[kLanes];
  _mm512_store_ps(tops, top);
  store(totals, total);
  for (int64_t l = 0; l < kBlockQueries && b * kBlockQueries + l < a.queries; ++l) {
    float* out = a.partial + ((h * a.queries + b * kBlockQueries + l) * a.chunks + c) * (dim + 2);
    out[0] = tops[l];
    out[1] = totals[l];
    for (int64_t g = 0; g < dim / 32; ++g)
      unpair(out + 2 + 32 * g, _mm512_loadu_ps(outputs + l * dim + 32 * g), _mm512_loadu_ps(outputs + l * dim + 32 * g + 16));
  }
}
#endif

// `n` floats for a call's partials, reused call after call by the calling thread: a fresh buffer past glibc's mmap
// threshold (32 MB: 24 rows of Qwen2.5-1.5B at 16K cached tokens) is mapped and zero-faulted anew on every call and
// layer, which cost more than the attention itself. Every element a call reads it writes first (a chunk a row does
// not see has its sum set to 0). One larger than kScratchKept (a long prompt's prefill chunk) is not kept.
constexpr int64_t kScratchKept = int64_t(256) << 20;  // bytes

at::Tensor scratch_floats(int64_t n, const at::TensorOptions& floats) {
  thread_local at::Tensor kept;
  if (n * int64_t(sizeof(float)) > kScratchKept) return at::empty({n}, floats);
  if (!kept.defined() || kept.numel() < n) kept = at::empty({n}, floats);
  return kept.narrow(0, 0, n);
}

// The mask comes in the pieces a decoding step has, so no graph has to build [rows, slots] per layer: row r sees
// cached slot s when sees_cache[r], or when sees_view[r] and view_mask[s]; it sees the step's own rows (the last
// `rows` slots) through local[r].
template <typename T>  // the element type of queries, keys and values
at::Tensor attend_as(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& all_in,
                  const at::Tensor& part_in, const at::Tensor& view_mask_in, const at::Tensor& local_in,
                  double scale_in) {
  // q [rows, heads, dim]; k, v [slots, kv_heads, dim]; sees_cache, sees_view [rows]; view_mask [slots - rows];
  // local [rows, rows]; -> [rows, heads, dim]
  TORCH_CHECK(all_in.scalar_type() == at::kBool && part_in.scalar_type() == at::kBool &&
              view_mask_in.scalar_type() == at::kBool && local_in.scalar_type() == at::kBool,
              "fafo::attend: bool visibility");
  const int64_t dim = q_in.size(2);
#if FAFO_PAIRS
  const bool pairs = std::is_same<T, at::BFloat16>::value && dim % (2 * kLanes) == 0;  // scores by bf16 pairs
#else
  const bool pairs = false;
#endif
  // the queries as float32 for scores not taken by pairs (exact from bf16); by pairs, the bf16 ones as they are
  const at::Tensor q = pairs ? at::Tensor() : q_in.to(at::kFloat).contiguous(), sees_cache = all_in.contiguous();
  const at::Tensor q16 = pairs ? q_in.contiguous() : at::Tensor(), sees_view = part_in.contiguous();
  const at::Tensor local = local_in.contiguous();
  const at::Tensor& view_mask = view_mask_in;  // a column of [cached, layers]: read in place, not copied per layer
  const at::Tensor k = k_in.stride(2) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(2) == 1 ? v_in : v_in.contiguous();
  const int64_t rows = q_in.size(0), heads = q_in.size(1);
  const at::TensorOptions floats = q_in.options().dtype(at::kFloat);
  // (keys and values of one shape, the queries' head size: the loops read both by the keys' shape)
  TORCH_CHECK(q_in.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && k.size(2) == dim && k.size(1) > 0,
              "fafo::attend: the keys, values and queries do not fit");
  const int64_t slots = k.size(0), kv_heads = k.size(1), group = heads / kv_heads;
  const int64_t cached = view_mask.size(0);
  TORCH_CHECK(dim % kLanes == 0 && heads % kv_heads == 0 && sees_cache.numel() == rows && sees_view.numel() == rows &&
              cached + rows == slots && local.size(0) == rows && local.size(1) == rows,
              "fafo::attend: unsupported shapes");
  const int64_t chunks = (slots + kChunk - 1) / kChunk;
  const int64_t queries = rows * group, width = dim + 2;
  const float scale = static_cast<float>(scale_in);
  const float* qp = pairs ? nullptr : q.data_ptr<float>();
  // bf16 queries as pairs of dimensions, one 32-bit word each
  const uint32_t* q2 = pairs ? reinterpret_cast<const uint32_t*>(q16.data_ptr<at::BFloat16>()) : nullptr;
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const bool *row_all = sees_cache.data_ptr<bool>(), *row_part = sees_view.data_ptr<bool>();
  const bool *vis = view_mask.data_ptr<bool>(), *loc = local.data_ptr<bool>();
  const int64_t vis_stride = view_mask.stride(0);
  const int64_t ks = k.stride(0), kh = k.stride(1), vs = v.stride(0), vh = v.stride(1);
  // The whole mask [rows, slots] (a row's cached part is all, `view_mask` or nothing), and
  // which rows see anything of each chunk [chunks, rows]. A decoding step mixes rows that see the whole cache
  // with rows that see a small part of it (FAFO's fumble rows) or none (padding rows): those skip most chunks.
#if FAFO_ATTEND_AMX
  const bool amx = pairs && fafo_amx::ready();
#else
  const bool amx = false;
#endif
  // A row of a draft tree sees its ancestors among the step's rows, which need not be the first rows: it reads them
  // where plain decoding has them, its k-th visible row at slot cached + k, as if the rows it does not see were
  // not there (the sums then group them into the same chunks and lanes, and round the same). `own[r][k]`: the
  // step's row that row r's slot cached + k reads; `moved[r]`: a row whose slots differ from the step's order.
  // (The AMX path reads the step's rows in place: there a tree's other branches may round otherwise.)
  std::vector<int64_t> own(rows * rows);
  std::vector<char> moved(rows, 0);
  std::vector<int8_t> mask(rows * slots);
  std::vector<char> sees(chunks * rows);
  // the view's column, gathered once for all the rows that see it (its slots lie a row of [cached, layers] apart:
  // gathered per row, a window of 23 rows walked that table 23 times a layer)
  std::vector<int8_t> view_bytes;
  for (int64_t r = 0; r < rows && view_bytes.empty(); ++r)
    if (!row_all[r] && row_part[r]) {
      view_bytes.resize(cached);
      for (int64_t s = 0; s < cached; ++s) view_bytes[s] = vis[s * vis_stride];
    }
  for (int64_t r = 0; r < rows; ++r) {
    int8_t* m = &mask[r * slots];
    if (row_all[r]) std::memset(m, 1, cached);
    else if (row_part[r]) std::copy(view_bytes.begin(), view_bytes.end(), m);
    else std::memset(m, 0, cached);
    int64_t seen = 0;
    for (int64_t i = 0; i < rows; ++i) {
      if (!loc[r * rows + i]) continue;
      moved[r] |= i != seen;
      own[r * rows + seen++] = i;
    }
    for (int64_t i = seen; i < rows; ++i) own[r * rows + i] = i;  // not seen: any slot of the step (finite values)
    if (amx) moved[r] = 0;
    for (int64_t i = 0; i < rows; ++i) m[cached + i] = moved[r] ? i < seen : loc[r * rows + i];
    for (int64_t c = 0; c < chunks; ++c)
      sees[c * rows + r] = std::memchr(m + c * kChunk, 1, std::min(kChunk, slots - c * kChunk)) != nullptr;
  }
  const int8_t* mp = mask.data();
  // per task and query: running max, sum of exponentials, unnormalised output; a query's chunks side by side, for
  // the merge to read them in order
  at::Tensor partial = scratch_floats(kv_heads * queries * chunks * width, floats);
  float* pp = partial.data_ptr<float>();

  // A task is one chunk of slots for one KV head. Each thread takes a contiguous run of chunks and all KV heads of
  // each, so it streams one region of the cache (a slot's heads are adjacent), which the hardware prefetcher
  // follows (tasks dealt round-robin made both threads read every slot's lines: 10% slower). Before a chunk's tasks
  // a thread reads the chunk in order (stream_in), and while computing it asks for the next one (ReadAhead).
  const int64_t slot_bytes = ((kv_heads - 1) * std::max(kh, vh) + dim) * int64_t(sizeof(T));
  // where a slot's KV heads are adjacent (the cache's layout), a chunk's keys and values are two runs of memory
  const bool interleaved = kv_heads > 1 && std::max(kh, vh) < std::min(ks, vs);
  auto run_bytes = [&](int64_t c, int64_t stride) {  // from chunk c's first slot to the end of its last
    return (std::min(kChunk, slots - c * kChunk) - 1) * stride * int64_t(sizeof(T)) + slot_bytes;
  };
  auto stream_chunk = [&](int64_t c) {
    if (!interleaved) return;
    stream_in(kp + c * kChunk * ks, run_bytes(c, ks));
    stream_in(vp + c * kChunk * vs, run_bytes(c, vs));
  };
#if FAFO_ATTEND_AMX
  // The AMX path's read-ahead: per head, the h-th share of the next chunk (not measured against ReadAhead, which needs
  // an AMX CPU)
  auto prefetch_next = [&](int64_t c, int64_t h) {
    if (c + 1 >= chunks) return;
    const int64_t next = (c + 1) * kChunk, n = std::min(kChunk, slots - next);
    for (int64_t j = next + h * n / kv_heads; j < next + (h + 1) * n / kv_heads; ++j) {
      const char* key = reinterpret_cast<const char*>(kp + j * ks);
      const char* value = reinterpret_cast<const char*>(vp + j * vs);
      for (int64_t b = 0; b < slot_bytes; b += 64) {
        __builtin_prefetch(key + b);
        __builtin_prefetch(value + b);
      }
    }
  };
  if (amx) {
    if constexpr (std::is_same<T, at::BFloat16>::value) {
      const int64_t blocks = (queries + kBlockQueries - 1) / kBlockQueries, padded = blocks * kBlockQueries;
      std::vector<uint32_t> query_pairs(kv_heads * dim / 2 * padded, 0);
      std::vector<uint16_t> all_bits(blocks, 0), part_bits(blocks, 0), local_bits(blocks * rows, 0);
      for (int64_t qi = 0; qi < queries; ++qi) {
        const int64_t r = qi / group, b = qi / kBlockQueries;
        const uint16_t bit = uint16_t(1u << (qi % kBlockQueries));
        if (row_all[r]) all_bits[b] |= bit;
        else if (row_part[r]) part_bits[b] |= bit;
        for (int64_t i = 0; i < rows; ++i)
          if (loc[r * rows + i]) local_bits[b * rows + i] |= bit;
        for (int64_t h = 0; h < kv_heads; ++h)
          for (int64_t p = 0; p < dim / 2; ++p)
            query_pairs[(h * dim / 2 + p) * padded + qi] = q2[(r * heads + h * group + qi % group) * dim / 2 + p];
      }
      const AmxCall call{kp, ks, kh, dim, slots, cached, rows, queries, chunks, query_pairs.data(), padded,
                         all_bits.data(), part_bits.data(), local_bits.data(), vis, vis_stride, scale, pp};
      at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
        configure_tiles();  // per thread and call: packed_linear configures the tiles its own way
        AmxScratch scratch(dim);
        for (int64_t c = first; c < last; ++c)
        for (int64_t h = 0; h < kv_heads; ++h) {
          if (h == 0) stream_chunk(c);
          prefetch_next(c, h);
          bool values_ready = false;
          for (int64_t b = 0; b < blocks; ++b) {
            bool seen = false;
            for (int64_t qi = b * kBlockQueries; qi < std::min(queries, (b + 1) * kBlockQueries); ++qi)
              seen = seen || sees[c * rows + qi / group];
            if (!seen) {  // sums 0: nothing visible
              for (int64_t qi = b * kBlockQueries; qi < std::min(queries, (b + 1) * kBlockQueries); ++qi)
                pp[((h * queries + qi) * chunks + c) * width + 1] = 0.0f;
              continue;
            }
            if (!values_ready) {
              pair_values(scratch.value_pairs.data(), vp + c * kChunk * vs + h * vh, vs,
                          std::min(kChunk, slots - c * kChunk), dim);
              values_ready = true;
            }
            amx_block(call, c, h, b, scratch);
          }
        }
        _tile_release();  // (an idle thread holding tile state costs its core larger context switches)
      });
    }
  } else
#endif
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    // this chunk's keys, transposed: [dim, slot], or with pairs [dim / 2, slot] of two bf16 in each float's bits
    std::vector<float> keys_t(dim * kChunk);
    std::vector<int64_t> active(queries);  // the queries whose rows see a slot of this chunk
    alignas(64) float probs[kRows][kChunk];
    alignas(64) at::BFloat16 probs16[kRows][kChunk];  // with pairs: the probabilities rounded to bf16
    int64_t slot_of[kChunk];  // the slot each of the chunk's slots reads (its own but for a moved row's, see own)
    ReadAhead ahead;  // this thread's next chunk, asked for per tile of keys and per pair of slots' values
    for (int64_t c = first; c < last; ++c)
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t s0 = c * kChunk, n = std::min(kChunk, slots - s0);
      if (h == 0) {
        stream_chunk(c);
        if (interleaved && c + 1 < last)
          ahead.start(kp + (c + 1) * kChunk * ks, run_bytes(c + 1, ks), vp + (c + 1) * kChunk * vs,
                      run_bytes(c + 1, vs));
        else ahead.stop();
      }
      // moved rows read a chunk that holds some of the step's rows with slots of their own, one row at a time
      const bool own_rows = s0 + n > cached;
      int64_t n_active = 0;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          if (!sees[c * rows + r]) pp[((h * queries + r * group + g) * chunks + c) * width + 1] = 0.0f;  // sum 0
          else if (!(own_rows && moved[r])) active[n_active++] = r * group + g;
        }
      }
      // the chunk's slots as `row` (-1: as the step lays them out) reads them, then the active queries [from, to)
      auto chunk_for = [&](const int64_t row, const int64_t from, const int64_t to) {
        for (int64_t j = 0; j < n; ++j) {
          const int64_t slot = s0 + j;
          slot_of[j] = row < 0 || slot < cached ? slot : cached + own[row * rows + slot - cached];
        }
        // the last chunk may be short: work on whole register blocks past its end, masked out below
        const int64_t n_vec = (n + kLanes - 1) / kLanes * kLanes, n_block = (n + kBlock - 1) / kBlock * kBlock;
        const int64_t columns = pairs ? dim / 2 : dim;  // transposed as 32-bit words: a float, or a bf16 pair
        for (int64_t j0 = 0; j0 < n_block; j0 += kLanes) {
          for (int64_t d0 = 0; d0 < columns; d0 += kLanes) {
            ahead.ask(8);
            vf tile[kLanes];
            for (int64_t j = 0; j < kLanes; ++j) {
              const T* key = kp + (j0 + j < n ? slot_of[j0 + j] : 0) * ks + h * kh;
              if (j0 + j >= n) tile[j] = vf{};
              else if (pairs) std::memcpy(&tile[j], key + 2 * d0, sizeof(vf));  // the bits, not widened
              else tile[j] = load(key + d0);
            }
            transpose(tile);
            for (int64_t d = 0; d < kLanes; ++d) store(&keys_t[(d0 + d) * kChunk + j0], tile[d]);
          }
        }
        // R queries at a time, R a compile-time block height (exact: no lanes spent on repeated queries)
        auto query_block = [&](const int64_t q0, auto height) {
          constexpr int R = decltype(height)::value;
          int64_t offset[R];  // where each query's row starts in q (float32) or q16
          const int8_t* mrow[R];
          float* part[R];  // this task's partial of each query
          for (int64_t i = 0; i < R; ++i) {
            const int64_t qi = active[q0 + i], r = qi / group;
            part[i] = pp + ((h * queries + qi) * chunks + c) * width;
            offset[i] = (r * heads + h * group + qi % group) * dim;
            mrow[i] = mp + r * slots + s0;
          }
          // scores = q . k * scale, R queries x kBlock slots at a time
          for (int64_t j0 = 0; j0 < n_block; j0 += kBlock) {
            vf acc[R][kCols] = {};
            if (pairs) scores_by_pairs<R>(acc, q2, offset, &keys_t[j0], dim);
            else {
              for (int64_t d = 0; d < dim; ++d) {
                vf kv[kCols];
                for (int64_t t = 0; t < kCols; ++t) kv[t] = load(&keys_t[d * kChunk + j0 + t * kLanes]);
                for (int64_t i = 0; i < R; ++i) {
                  const vf b = splat(qp[offset[i] + d]);
                  for (int64_t t = 0; t < kCols; ++t) acc[i][t] += b * kv[t];
                }
              }
            }
            for (int64_t i = 0; i < R; ++i)
              for (int64_t t = 0; t < kCols; ++t) store(&probs[i][j0 + t * kLanes], acc[i][t] * scale);
          }
          // softmax within the chunk; masked and padding slots get probability exactly 0
          for (int64_t i = 0; i < R; ++i) {
            float* pr = probs[i];
            vf vmax = splat(-FLT_MAX);
            for (int64_t j = 0; j < n_vec; j += kLanes) {
              vi seen;
              if (j + kLanes <= n) {
                seen = visible(mrow[i] + j);
              } else {
                for (int l = 0; l < kLanes; ++l) seen[l] = (j + l < n && mrow[i][j + l]) ? -1 : 0;
              }
              const vf x = seen ? load(pr + j) : splat(-FLT_MAX);
              store(pr + j, x);
              vmax = x > vmax ? x : vmax;
            }
            const float m = hmax(vmax);
            vf vsum = {};
            for (int64_t j = 0; j < n_vec; j += kLanes) {
              vf x = load(pr + j);
              vf e = exp_nonpositive(x - m);
              e = x == -FLT_MAX ? splat(0.0f) : e;
              store(pr + j, e);
              vsum += e;
            }
            part[i][0] = m;
            part[i][1] = hsum(vsum);
          }
  #if FAFO_PAIRS
          // bf16: output = probs . v by pair dot products over pairs of slots, the probabilities rounded to bf16 as
          // the AMX path (and any bf16 attention) takes them: half the instructions of widening every value
          if (pairs) {
            const uint32_t* prob_pairs[R];
            for (int64_t i = 0; i < R; ++i) {
              for (int64_t j = 0; j < n_vec; j += kLanes)
                _mm256_store_si256(reinterpret_cast<__m256i*>(&probs16[i][j]),
                                   (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(&probs[i][j])));
              prob_pairs[i] = reinterpret_cast<const uint32_t*>(probs16[i]);
            }
            // kCols vectors of 16 dimensions in unpair's order: the unpacked halves of 32 dimensions of two slots
            for (int64_t t0 = 0; t0 < dim / kLanes; t0 += kCols) {
              __m512 acc[R][kCols];
              for (int64_t i = 0; i < R; ++i)
                for (int64_t t = 0; t < kCols; ++t) acc[i][t] = _mm512_setzero_ps();
              const int64_t nt = std::min(kCols, dim / kLanes - t0);  // dim is a multiple of 32: nt is even
              const T* values = vp + h * vh + t0 * kLanes;
              for (int64_t m = 0; m < (n + 1) / 2; ++m) {
                ahead.ask(2);
                __m512bh vv[kCols];
                const T* first = values + slot_of[2 * m] * vs;
                const T* second = 2 * m + 1 < n ? values + slot_of[2 * m + 1] * vs : nullptr;
                for (int64_t t = 0; t < kCols; t += 2) {
                  if (t >= nt) { vv[t] = vv[t + 1] = (__m512bh)_mm512_setzero_si512(); continue; }
                  const __m512i x = _mm512_loadu_si512(first + t * kLanes);
                  const __m512i y = second ? _mm512_loadu_si512(second + t * kLanes) : _mm512_setzero_si512();
                  vv[t] = (__m512bh)_mm512_unpacklo_epi16(x, y);
                  vv[t + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
                }
                for (int64_t i = 0; i < R; ++i) {
                  const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(prob_pairs[i][m]));
                  for (int64_t t = 0; t < kCols; ++t) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], b, vv[t]);
                }
              }
              for (int64_t i = 0; i < R; ++i)
                for (int64_t t = 0; t < nt; t += 2) unpair(part[i] + 2 + (t0 + t) * kLanes, acc[i][t], acc[i][t + 1]);
            }
            return;
          }
  #endif
          // output = probs . v, R queries x kBlock dims at a time
          for (int64_t d0 = 0; d0 < dim; d0 += kBlock) {
            const int64_t nd = std::min(kCols, (dim - d0) / kLanes);
            vf acc[R][kCols] = {};
            for (int64_t j = 0; j < n; ++j) {
              const T* value = vp + slot_of[j] * vs + h * vh + d0;
              vf vv[kCols];
              for (int64_t t = 0; t < kCols; ++t) vv[t] = t < nd ? load(value + t * kLanes) : vf{};
              for (int64_t i = 0; i < R; ++i) {
                const vf b = splat(probs[i][j]);
                for (int64_t t = 0; t < kCols; ++t) acc[i][t] += b * vv[t];
              }
            }
            for (int64_t i = 0; i < R; ++i) {
              for (int64_t t = 0; t < nd; ++t) store(part[i] + 2 + d0 + t * kLanes, acc[i][t]);
            }
          }
        };
        static_assert(kRows == 6, "the switch below names every block height up to kRows");
        for (int64_t b0 = from; b0 < to; b0 += kRows) {
          switch (std::min(kRows, to - b0)) {
            case 6: query_block(b0, std::integral_constant<int, 6>{}); break;
            case 5: query_block(b0, std::integral_constant<int, 5>{}); break;
            case 4: query_block(b0, std::integral_constant<int, 4>{}); break;
            case 3: query_block(b0, std::integral_constant<int, 3>{}); break;
            case 2: query_block(b0, std::integral_constant<int, 2>{}); break;
            default: query_block(b0, std::integral_constant<int, 1>{}); break;
          }
        }
      };
      if (n_active > 0) chunk_for(-1, 0, n_active);
      if (!own_rows) continue;
      for (int64_t r = 0; r < rows; ++r) {
        if (!moved[r] || !sees[c * rows + r]) continue;
        for (int64_t g = 0; g < group; ++g) active[g] = r * group + g;
        chunk_for(r, 0, group);
      }
    }
  });

  // merge the chunks of each (kv head, query)
  at::Tensor result = at::empty({rows, heads, dim}, floats);
  float* rp = result.data_ptr<float>();
  at::parallel_for(0, kv_heads * queries, 16, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / queries, qi = task % queries, r = qi / group;
      float m = -FLT_MAX;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = pp + ((h * queries + qi) * chunks + c) * width;
        if (part[1] != 0.0f) m = std::max(m, part[0]);
      }
      float* out = rp + (r * heads + h * group + qi % group) * dim;
      std::fill(out, out + dim, 0.0f);
      float total = 0.0f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = pp + ((h * queries + qi) * chunks + c) * width;
        if (part[1] == 0.0f) continue;  // nothing view_mask in this chunk
        const float w = std::exp(part[0] - m);
        total += part[1] * w;
        for (int64_t d = 0; d < dim; d += kLanes) store(out + d, load(out + d) + load(part + 2 + d) * w);
      }
      const float inv = total > 0.0f ? 1.0f / total : 0.0f;
      for (int64_t d = 0; d < dim; d += kLanes) store(out + d, load(out + d) * inv);
    }
  });
  return result;
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& sees_cache,
                  const at::Tensor& sees_view, const at::Tensor& view_mask, const at::Tensor& local, double scale) {
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "fafo::attend: queries, keys and values of one dtype");
  if (k.scalar_type() == at::kBFloat16)
    return attend_as<at::BFloat16>(q, k, v, sees_cache, sees_view, view_mask, local, scale);
  TORCH_CHECK(k.scalar_type() == at::kFloat, "fafo::attend: float32 or bfloat16");
  return attend_as<float>(q, k, v, sees_cache, sees_view, view_mask, local, scale);
}

}  // namespace

TORCH_LIBRARY(fafo, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor sees_cache, Tensor sees_view, Tensor view_mask, Tensor local, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(fafo, CPU, m) {
  m.impl("attend", &attend);
}
