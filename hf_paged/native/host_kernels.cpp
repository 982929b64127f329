// One-pass host (CPU) kernels for the blockwise 8-bit and 4-bit and the fp32 AdamW, Lion and AdEMAMix updates of
// hf_paged.
//
// Each block of `block_size` elements is read once: its state codes are decoded as the update rule reads them, the
// rule runs in fp32 with the parameter written once, the new state goes to block-local fp32 buffers (on the stack)
// while the block's new largest magnitudes are found, and is then encoded from the buffers into the block's codes
// and scale. Blocks are independent, so results do not depend on the number of threads or on how a segment is
// chunked.
//
// The arithmetic is that of the eager PyTorch kernels (hf_paged/codecs.py, hf_paged/optim/adamw.py and lion.py),
// operation by operation in fp32 with the same constants and rounding, so that both give bitwise the same results:
// products and sums are rounded one by one (no contraction into fused multiply-adds), lerp is ATen's vectorized
// lerp (one fused multiply-add where the target has one, as ATen's kernels of that capability), square roots and
// quotients are IEEE (correctly rounded; the PyTorch kernels take theirs through hf_paged/rounding.py). The kernels
// are written once over `Vec`: eight lanes of AVX2 where the build targets it (PyTorch's AVX2 and AVX512
// capabilities), else one scalar lane (its DEFAULT capability).
//
// Each rule is a struct (AdamW, Lion, AdEMAMix): its states, scalars, one vector of elements' step, and a block's
// decode-step-encode; the operators are templates over the rule. The segment operators (adamw_segment_,
// lion_segment_, ademamix_segment_) take one segment of whole blocks, or of fp32 state. The batch operators
// (adamw_batch_, lion_batch_, ademamix_batch_) take every segment of a batch of pages at once (see
// hf_paged/kernels/batch.py): one parallel pass over all the batch's blocks, or over tiles of fp32 state; a partial
// last block of a segment is updated through zero-padded copies of its parameter and gradient elements on the
// stack, as the per-segment path pads it.
//
// Rank-1 normalized 4-bit AdamW state (adamw_rank1_batch_, adamw_rank1_gather_) takes the 4-bit maps with each
// element's normalizer min(row max, column max) in place of the block's scale; its normalizers are computed per
// block from the tensor's statistics. The gathering pass raises the next maxima, shared by the threads, atomically.
//
// The kernels write in place and allocate nothing once they write: every argument is checked before the first write.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HF_PAGED_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define HF_PAGED_AVX2 1
#endif

namespace hf_paged {
namespace {

constexpr int64_t kMaxBlockSize = 4096;

// The codes of normalized values n, operation by operation, for the AVX2 and scalar `Vec`s (the AVX-512 one has fewer
// operations of its own), with s = codecs.saturate_(n) (n clamped to [-1, 1], NaN as 0). 8-bit (Codes8):
// rint(sqrt(|s|) top) with the sign of s, and max(rint(sqrt(s) top), 1) for s > 0, else 0. 4-bit (Codes4), as floats:
// 7 + floor((sqrt(max(196 |s| - 1, 0)) + 1) / 2) with the sign of s, and
// max(floor((sqrt(max(1024 s - 1, 0)) + 1) / 2) - 1, 0).
template <class V>
struct CodesByOperations {
  template <typename F>
  static void store_signed_root_codes(int8_t* x, F n, F top) {
    const F normalized = V::saturate(n);
    V::store_signed_codes(x, V::rint_root_times(V::abs(normalized), top), normalized);
  }
  template <typename F>
  static void store_unsigned_root_codes(uint8_t* x, F n, F top) {
    const F normalized = V::saturate(n);
    V::store_codes(x, V::max(V::rint_root_times(normalized, top), V::positive(normalized)));
  }
  template <typename F>
  static F signed_level_code(F n) {
    const F normalized = V::saturate(n);
    const F excess = V::sub(V::mul(V::abs(normalized), V::splat(196.0f)), V::splat(1.0f));
    const F level = V::floor_half_root_plus_half(V::max(excess, V::zero()));
    return V::add(V::signed_like(level, normalized), V::splat(7.0f));
  }
  template <typename F>
  static F unsigned_root_code(F n) {
    const F excess = V::sub(V::mul(V::saturate(n), V::splat(1024.0f)), V::splat(1.0f));
    const F level = V::floor_half_root_plus_half(V::max(excess, V::zero()));
    return V::max(V::sub(level, V::splat(1.0f)), V::zero());
  }
};

#ifdef HF_PAGED_AVX512

// Sixteen fp32 lanes (AVX-512 F, BW and DQ): lane by lane the operations of the eight-lane AVX2 code below.
struct Vec {
  static constexpr int64_t kWidth = 16;
  using F = __m512;

  static F splat(float x) { return _mm512_set1_ps(x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F abs(F a) { return _mm512_andnot_ps(_mm512_set1_ps(-0.0f), a); }
  static F rint(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F floor(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  // a > b ? a : b and a < b ? a : b, lane by lane (the x86 semantics, also of the other lanes' code).
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  // 1 where a > 0, else 0.
  static F positive(F a) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero(), _CMP_GT_OQ), splat(1.0f)); }
  // torch.sign: 1, -1 or 0.
  static F sign(F a) {
    return sub(positive(a), _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero(), _CMP_LT_OQ), splat(1.0f)));
  }
  // 0 where a is NaN, else a.
  static F zero_nan(F a) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), a); }
  static F zero_non_finite(F a) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(abs(a), _mm512_set1_ps(FLT_MAX), _CMP_LE_OQ), a);
  }
  // a clamped to [-1, 1], NaN as 0 (codecs.saturate_).
  static F saturate(F a) {
    return min(_mm512_maskz_max_ps(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), a, splat(-1.0f)), splat(1.0f));
  }
  // The non-negative magnitude with the sign bit of source (one bitwise select).
  static F signed_like(F magnitude, F source) {
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(magnitude), _mm512_castps_si512(source),
                                                         _mm512_set1_epi32(INT32_MIN), 0xF8));
  }
  // +infinity where a is FLT_MAX, else a.
  static F infinity_at_max(F a) {
    return _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(a, splat(FLT_MAX), _CMP_EQ_OQ), splat(INFINITY));
  }
  // 1 / s where s >= FLT_MIN, else 0 (codecs.inverse_scales), and 1 / sqrt(s) where s > 0, else 0.
  static F inverse_scales(F s) {
    return _mm512_maskz_div_ps(_mm512_cmp_ps_mask(s, splat(FLT_MIN), _CMP_GE_OQ), splat(1.0f), s);
  }
  static F inverse_root_scales(F s) {
    return _mm512_maskz_div_ps(_mm512_cmp_ps_mask(s, zero(), _CMP_GT_OQ), splat(1.0f), sqrt(s));
  }
  // Bit k set where lane k of a is greater than that of b.
  static uint32_t greater(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  // The largest lane of non-negative, non-NaN lanes, by halves: any order gives the same lane.
  static float reduce_max(F a) {
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    const __m256 half = _mm256_max_ps(_mm512_castps512_ps256(a), high);
    __m128 quarter = _mm_max_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    quarter = _mm_max_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_max_ss(quarter, _mm_movehdup_ps(quarter)));
  }

  static F load(const float* x) { return _mm512_loadu_ps(x); }
  static F load(const c10::BFloat16* x) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static F load(const c10::Half* x) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))); }
  static void store(float* x, F a) { _mm512_storeu_ps(x, a); }
  // Round to nearest even, NaN to 0x7FC0: c10::BFloat16's conversion.
  static void store(c10::BFloat16* x, F a) {
    const __m512i bits = _mm512_castps_si512(a);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtepi32_epi16(rounded));  // each in [0, 0xFFFF]
  }
  static void store(c10::Half* x, F a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
  }

  // rint(sqrt(x) * top) and floor((sqrt(x) + 1) / 2), as the encodings round square roots to codes.
  static F rint_root_times(F x, F top) { return rint(mul(sqrt(x), top)); }
  static F floor_half_root_plus_half(F x) { return floor(mul(add(sqrt(x), splat(1.0f)), splat(0.5f))); }

  static __m512i load_bytes(const uint8_t* x) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  }
  static F load_codes(const int8_t* x) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))));
  }
  static F load_codes(const uint8_t* x) { return _mm512_cvtepi32_ps(load_bytes(x)); }
  // The 8-bit codes of normalized values n (Codes8): rint(sqrt(|s|) top) with the sign of s, and
  // max(rint(sqrt(s) top), 1) for s > 0, else 0, with s = codecs.saturate_(n) (n clamped to [-1, 1], NaN as 0).
  // Here min(|n|, 1) (vrangeps, 1 for a NaN) is s's magnitude but for a NaN n, whose code is then set to 0, and a
  // conversion rounding to nearest even is rint's then an exact conversion.
  static void store_signed_root_codes(int8_t* x, F n, F top) {
    const F magnitude = mul(sqrt(_mm512_range_ps(n, splat(1.0f), 0x0A)), top);
    const __m512i codes = _mm512_maskz_cvt_roundps_epi32(_mm512_cmp_ps_mask(n, n, _CMP_ORD_Q), signed_like(magnitude, n),
                                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm512_cvtsepi32_epi8(codes));
  }
  // min(n, 1) is s but for a NaN or non-positive n, whose code is then set to 0.
  static void store_unsigned_root_codes(uint8_t* x, F n, F top) {
    const __m512i codes =
        _mm512_cvt_roundps_epi32(mul(sqrt(min(n, splat(1.0f))), top), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i positive =
        _mm512_maskz_max_epi32(_mm512_cmp_ps_mask(n, zero(), _CMP_GT_OQ), codes, _mm512_set1_epi32(1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm512_cvtepi32_epi8(positive));  // each in [0, 255]
  }
  // Integers in [0, 255], as bytes (saturated as the AVX2 code's packs saturate).
  static void store_bytes(uint8_t* x, __m512i values) {
    const __m512i nonnegative = _mm512_max_epi32(values, _mm512_setzero_si512());
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm512_cvtusepi32_epi8(nonnegative));
  }
  // The low or high 4-bit codes of sixteen bytes.
  static F load_nibble(const uint8_t* x, bool high) {
    const __m512i bytes = load_bytes(x);
    return _mm512_cvtepi32_ps(high ? _mm512_srli_epi32(bytes, 4) : _mm512_and_si512(bytes, _mm512_set1_epi32(15)));
  }
  // Codes4's codes of normalized values n (see CodesByOperations), as integers: the level's floor and the code's
  // rint are the conversions' rounding, n's sign and NaN lanes masks.
  using Codes = __m512i;
  static Codes signed_level_code(F n) {
    const F excess = max(sub(mul(_mm512_range_ps(n, splat(1.0f), 0x0A), splat(196.0f)), splat(1.0f)), zero());
    const __m512i level = _mm512_maskz_cvt_roundps_epi32(_mm512_cmp_ps_mask(n, n, _CMP_ORD_Q),
                                                         mul(add(sqrt(excess), splat(1.0f)), splat(0.5f)),
                                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512i seven = _mm512_set1_epi32(7);
    return _mm512_mask_sub_epi32(_mm512_add_epi32(seven, level), _mm512_cmp_ps_mask(n, zero(), _CMP_LT_OQ), seven,
                                 level);
  }
  // min(n, 1) is s but for a NaN or non-positive n, whose code is then set to 0.
  static Codes unsigned_root_code(F n) {
    const F excess = max(sub(mul(min(n, splat(1.0f)), splat(1024.0f)), splat(1.0f)), zero());
    const __m512i level = _mm512_cvt_roundps_epi32(mul(add(sqrt(excess), splat(1.0f)), splat(0.5f)),
                                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm512_maskz_max_epi32(_mm512_cmp_ps_mask(n, zero(), _CMP_GT_OQ), _mm512_sub_epi32(level, _mm512_set1_epi32(1)),
                                  _mm512_setzero_si512());
  }
  // Codes in [0, 15].
  static void store_nibbles(uint8_t* x, Codes low, Codes high) {
    store_bytes(x, _mm512_or_si512(low, _mm512_slli_epi32(high, 4)));
  }
};

#elif defined(HF_PAGED_AVX2)

// Eight fp32 lanes (AVX2 and FMA).
struct Vec : CodesByOperations<Vec> {
  static constexpr int64_t kWidth = 8;
  using F = __m256;

  static F splat(float x) { return _mm256_set1_ps(x); }
  static F zero() { return _mm256_setzero_ps(); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F abs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static F rint(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F floor(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  // a > b ? a : b and a < b ? a : b, lane by lane (the x86 semantics, also of the scalar lane below).
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  // 1 where a > 0, else 0.
  static F positive(F a) { return _mm256_and_ps(_mm256_cmp_ps(a, zero(), _CMP_GT_OQ), splat(1.0f)); }
  // torch.sign: 1, -1 or 0.
  static F sign(F a) {
    return sub(positive(a), _mm256_and_ps(_mm256_cmp_ps(a, zero(), _CMP_LT_OQ), splat(1.0f)));
  }
  // 0 where a is NaN, else a.
  static F zero_nan(F a) { return _mm256_and_ps(a, _mm256_cmp_ps(a, a, _CMP_ORD_Q)); }
  static F zero_non_finite(F a) { return _mm256_and_ps(a, _mm256_cmp_ps(abs(a), _mm256_set1_ps(FLT_MAX), _CMP_LE_OQ)); }
  // a clamped to [-1, 1], NaN as 0 (codecs.saturate_): max takes its second operand, -1, for a NaN.
  static F saturate(F a) {
    return _mm256_and_ps(min(max(a, splat(-1.0f)), splat(1.0f)), _mm256_cmp_ps(a, a, _CMP_ORD_Q));
  }
  // The non-negative magnitude with the sign bit of source.
  static F signed_like(F magnitude, F source) {
    return _mm256_or_ps(magnitude, _mm256_and_ps(source, splat(-0.0f)));
  }
  // +infinity where a is FLT_MAX, else a.
  static F infinity_at_max(F a) {
    return _mm256_blendv_ps(a, splat(INFINITY), _mm256_cmp_ps(a, splat(FLT_MAX), _CMP_EQ_OQ));
  }
  // 1 / s where s >= FLT_MIN, else 0 (codecs.inverse_scales), and 1 / sqrt(s) where s > 0, else 0.
  static F inverse_scales(F s) {
    return _mm256_and_ps(div(splat(1.0f), s), _mm256_cmp_ps(s, splat(FLT_MIN), _CMP_GE_OQ));
  }
  static F inverse_root_scales(F s) {
    return _mm256_and_ps(div(splat(1.0f), sqrt(s)), _mm256_cmp_ps(s, zero(), _CMP_GT_OQ));
  }
  // Bit k set where lane k of a is greater than that of b.
  static uint32_t greater(F a, F b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
  // The largest lane of non-negative, non-NaN lanes, by halves: any order gives the same lane.
  static float reduce_max(F a) {
    __m128 quarter = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    quarter = _mm_max_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_max_ss(quarter, _mm_movehdup_ps(quarter)));
  }

  static F load(const float* x) { return _mm256_loadu_ps(x); }
  static F load(const c10::BFloat16* x) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static F load(const c10::Half* x) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))); }
  static void store(float* x, F a) { _mm256_storeu_ps(x, a); }
  // Round to nearest even, NaN to 0x7FC0: c10::BFloat16's conversion.
  static void store(c10::BFloat16* x, F a) {
    const __m256i bits = _mm256_castps_si256(a);
    const __m256i bias =
        _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x), packed);
  }
  static void store(c10::Half* x, F a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
  }

  // rint(sqrt(x) * top) and floor((sqrt(x) + 1) / 2), as the encodings round square roots to codes.
  static F rint_root_times(F x, F top) { return rint(mul(sqrt(x), top)); }
  static F floor_half_root_plus_half(F x) { return floor(mul(add(sqrt(x), splat(1.0f)), splat(0.5f))); }

  static __m256i load_bytes(const uint8_t* x) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
  }
  static F load_codes(const int8_t* x) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x))));
  }
  static F load_codes(const uint8_t* x) { return _mm256_cvtepi32_ps(load_bytes(x)); }
  // Integer-valued magnitudes in [0, 127] with the sign bits of source (a zero magnitude stays code 0).
  static void store_signed_codes(int8_t* x, F magnitude, F source) {
    const __m256i values = _mm256_cvttps_epi32(signed_like(magnitude, source));
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(values), _mm256_extracti128_si256(values, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(x), _mm_packs_epi16(words, words));
  }
  // Integer-valued codes in [0, 255].
  static void store_codes(uint8_t* x, F codes) { store_bytes(x, _mm256_cvttps_epi32(codes)); }
  static void store_bytes(uint8_t* x, __m256i values) {
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(values), _mm256_extracti128_si256(values, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(x), _mm_packus_epi16(words, words));
  }
  // The low or high 4-bit codes of eight bytes.
  static F load_nibble(const uint8_t* x, bool high) {
    const __m256i bytes = load_bytes(x);
    return _mm256_cvtepi32_ps(high ? _mm256_srli_epi32(bytes, 4) : _mm256_and_si256(bytes, _mm256_set1_epi32(15)));
  }
  // Codes4's codes (CodesByOperations) are integer-valued floats in [0, 15].
  using Codes = F;
  static void store_nibbles(uint8_t* x, F low, F high) {
    store_bytes(x, _mm256_or_si256(_mm256_cvttps_epi32(low), _mm256_slli_epi32(_mm256_cvttps_epi32(high), 4)));
  }
};

#else

// One scalar lane: the same operations where the build does not target AVX2.
struct Vec : CodesByOperations<Vec> {
  static constexpr int64_t kWidth = 1;
  using F = float;

  static F splat(float x) { return x; }
  static F zero() { return 0.0f; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  // ATen's generic vectorized fmadd is a * b + c, fused only where the compiler targets a fused multiply-add.
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
#else
  static F fma(F a, F b, F c) { return a * b + c; }
#endif
  static F sqrt(F a) { return std::sqrt(a); }
  static F abs(F a) { return std::fabs(a); }
  static F rint(F a) { return std::nearbyint(a); }
  static F floor(F a) { return std::floor(a); }
  static F max(F a, F b) { return a > b ? a : b; }
  static F min(F a, F b) { return a < b ? a : b; }
  static F positive(F a) { return a > 0.0f ? 1.0f : 0.0f; }
  static F sign(F a) { return a > 0.0f ? 1.0f : (a < 0.0f ? -1.0f : 0.0f); }
  static F zero_nan(F a) { return std::isnan(a) ? 0.0f : a; }
  static F zero_non_finite(F a) { return std::isfinite(a) ? a : 0.0f; }
  static F saturate(F a) { return min(max(zero_nan(a), -1.0f), 1.0f); }
  static F signed_like(F magnitude, F source) { return std::copysign(magnitude, source); }
  static F infinity_at_max(F a) { return a == FLT_MAX ? INFINITY : a; }
  static F inverse_scales(F s) { return s >= FLT_MIN ? 1.0f / s : 0.0f; }
  static F inverse_root_scales(F s) { return s > 0.0f ? 1.0f / std::sqrt(s) : 0.0f; }
  static uint32_t greater(F a, F b) { return a > b ? 1 : 0; }
  static float reduce_max(F a) { return a; }

  static F rint_root_times(F x, F top) { return std::nearbyint(std::sqrt(x) * top); }
  static F floor_half_root_plus_half(F x) { return std::floor((std::sqrt(x) + 1.0f) * 0.5f); }

  template <typename T>
  static F load(const T* x) {
    return static_cast<float>(*x);
  }
  template <typename T>
  static void store(T* x, F a) {
    *x = T(a);
  }
  static F load_codes(const int8_t* x) { return static_cast<float>(*x); }
  static F load_codes(const uint8_t* x) { return static_cast<float>(*x); }
  static void store_signed_codes(int8_t* x, F magnitude, F source) {
    *x = static_cast<int8_t>(static_cast<int32_t>(signed_like(magnitude, source)));
  }
  static void store_codes(uint8_t* x, F codes) { *x = static_cast<uint8_t>(static_cast<int32_t>(codes)); }
  static F load_nibble(const uint8_t* x, bool high) { return static_cast<float>(high ? *x >> 4 : *x & 15); }
  using Codes = F;
  static void store_nibbles(uint8_t* x, F low, F high) {
    *x = static_cast<uint8_t>(static_cast<int32_t>(low) | (static_cast<int32_t>(high) << 4));
  }
};

#endif

using F = Vec::F;
constexpr int64_t kWidth = Vec::kWidth;

// ATen's vectorized lerp: start + w (end - start) for |w| < 0.5, else end + (w - 1) (end - start), one fused
// multiply-add.
struct Lerp {
  explicit Lerp(float weight)
      : small(std::fabs(weight) < 0.5f), coefficient(Vec::splat(small ? weight : weight - 1.0f)) {}
  F operator()(F start, F end) const {
    return Vec::fma(coefficient, Vec::sub(end, start), small ? start : end);
  }
  bool small;
  F coefficient;
};

// The magnitudes of values as block scales and rank-1 statistics count them: a NaN as zero, an infinity as FLT_MAX.
inline F magnitude(F values) { return Vec::min(Vec::splat(FLT_MAX), Vec::zero_nan(Vec::abs(values))); }

// A non-negative state's values: normalized values times their scales, FLT_MAX read as +infinity, as an infinity is
// stored (codecs.scaled).
inline F unsigned_scaled(F normalized, F scale) { return Vec::infinity_at_max(Vec::mul(normalized, scale)); }

// The running largest finite magnitude of a block (_BlockScaled.block_scales): the largest of the magnitudes
// (values) is the largest |value| but NaN, which Vec::max passes over (it takes its second operand, the running
// largest, for a NaN), with an infinity read as FLT_MAX once at the end.
struct AbsMax {
  F largest = Vec::zero();
  void add(F values) { largest = Vec::max(Vec::abs(values), largest); }
  float value() const { return std::min(FLT_MAX, Vec::reduce_max(largest)); }
};

// 1 / scale, and 0 for a zero or subnormal scale (codecs.inverse_scales).
inline float inverse_scale(float scale) { return scale >= FLT_MIN ? 1.0f / scale : 0.0f; }

// 1 / sqrt(scale) for a positive scale, else 0 (codecs.square_roots; torch.rsqrt on the CPU is 1 / sqrt).
inline float inverse_root_scale(float scale) { return scale > 0.0f ? 1.0f / std::sqrt(scale) : 0.0f; }

// One state's storage: codes (one byte per element, or two 4-bit codes per byte) and one fp32 scale per block.
struct State {
  uint8_t* codes;
  float* scales;
};

// The 8-bit codecs (Blockwise8bitCodec). Signed: x = s n |n| with n = q / 127; non-negative: x = s n^4 with
// n = q / 255.
struct Codes8 {
  // The decoded values of a block, eight (or one) at a time.
  struct SignedDecoder {
    SignedDecoder(const State& state, int64_t block, int64_t size)
        : codes(reinterpret_cast<const int8_t*>(state.codes) + block * size), scale(Vec::splat(state.scales[block])) {}
    F operator()(int64_t i) const {
      const F normalized = Vec::mul(Vec::load_codes(codes + i), Vec::splat(static_cast<float>(1.0 / 127)));
      return Vec::mul(Vec::mul(normalized, Vec::abs(normalized)), scale);
    }
    const int8_t* codes;
    F scale;
  };

  struct UnsignedDecoder {
    UnsignedDecoder(const State& state, int64_t block, int64_t size)
        : codes(state.codes + block * size), scale(Vec::splat(state.scales[block])) {}
    F operator()(int64_t i) const {
      const F normalized = Vec::mul(Vec::load_codes(codes + i), Vec::splat(static_cast<float>(1.0 / 255)));
      const F squared = Vec::mul(normalized, normalized);
      return unsigned_scaled(Vec::mul(squared, squared), scale);
    }
    const uint8_t* codes;
    F scale;
  };

  // Nearest code in the sqrt(|x| / s) domain.
  static void encode_signed(const State& state, int64_t block, int64_t size, const float* values, float scale) {
    auto* codes = reinterpret_cast<int8_t*>(state.codes) + block * size;
    const F inverse = Vec::splat(inverse_scale(scale));
    const F top = Vec::splat(127.0f);
    for (int64_t i = 0; i < size; i += kWidth) {
      Vec::store_signed_root_codes(codes + i, Vec::mul(Vec::load(values + i), inverse), top);
    }
    state.scales[block] = scale;
  }

  // Nearest code in the (x / s)^(1/4) domain, from roots = sqrt(x); a positive value never becomes code 0.
  static void encode_unsigned_roots(const State& state, int64_t block, int64_t size, const float* roots,
                                    float scale) {
    uint8_t* codes = state.codes + block * size;
    const F inverse_root = Vec::splat(inverse_root_scale(scale));
    const F top = Vec::splat(255.0f);
    for (int64_t i = 0; i < size; i += kWidth) {
      // sqrt(x / s), whose square root is coded
      Vec::store_unsigned_root_codes(codes + i, Vec::mul(Vec::load(roots + i), inverse_root), top);
    }
    state.scales[block] = scale;
  }
};

// The 4-bit codecs (Blockwise4bitCodec): byte i of a block holds element i in its low nibble and element
// i + size / 2 in its high nibble. Signed: x = s q |q| / 49 with q = code - 7; non-negative: x = s ((code + 1) / 16)^4.
struct Codes4 {
  // The codes of elements i.. of a block: low nibbles in its first half, high nibbles in its second.
  static F codes_at(const uint8_t* packed, int64_t half, int64_t i) {
    return i < half ? Vec::load_nibble(packed + i, false) : Vec::load_nibble(packed + i - half, true);
  }

  // The normalized values (codecs.decode_4bit) of elements i.. of a block whose codes are packed by half-blocks of
  // `half` bytes: q |q| / 49 with q = code - 7, and ((code + 1) / 16)^4.
  static F signed_value(const uint8_t* packed, int64_t half, int64_t i) {
    const F level = Vec::sub(codes_at(packed, half, i), Vec::splat(7.0f));
    return Vec::mul(Vec::mul(level, Vec::abs(level)), Vec::splat(static_cast<float>(1.0 / 49)));
  }
  static F unsigned_value(const uint8_t* packed, int64_t half, int64_t i) {
    const F root = Vec::mul(Vec::add(codes_at(packed, half, i), Vec::splat(1.0f)), Vec::splat(0.0625f));
    const F squared = Vec::mul(root, root);
    return Vec::mul(squared, squared);
  }

  // The decoded values of a block, eight (or one) at a time.
  struct SignedDecoder {
    SignedDecoder(const State& state, int64_t block, int64_t size)
        : packed(state.codes + block * (size / 2)), half(size / 2), scale(Vec::splat(state.scales[block])) {}
    F operator()(int64_t i) const { return Vec::mul(signed_value(packed, half, i), scale); }
    const uint8_t* packed;
    int64_t half;
    F scale;
  };

  struct UnsignedDecoder {
    UnsignedDecoder(const State& state, int64_t block, int64_t size)
        : packed(state.codes + block * (size / 2)), half(size / 2), scale(Vec::splat(state.scales[block])) {}
    F operator()(int64_t i) const { return unsigned_scaled(unsigned_value(packed, half, i), scale); }
    const uint8_t* packed;
    int64_t half;
    F scale;
  };

  // Nearest level (k / 7)^2: |x| >= the midpoint of levels k - 1 and k iff 196 |x| - 1 >= (2k - 1)^2. The level
  // is at most 7 (floor((sqrt(195) + 1) / 2)) as |x| <= 1, and 0 where x is zero, so its sign may be x's sign bit.
  static Vec::Codes signed_code(F values, F inverse) { return Vec::signed_level_code(Vec::mul(values, inverse)); }

  static void encode_signed(const State& state, int64_t block, int64_t size, const float* values, float scale) {
    const int64_t half = size / 2;
    uint8_t* packed = state.codes + block * half;
    const F inverse = Vec::splat(inverse_scale(scale));
    for (int64_t i = 0; i < half; i += kWidth) {
      Vec::store_nibbles(packed + i, signed_code(Vec::load(values + i), inverse),
                         signed_code(Vec::load(values + i + half), inverse));
    }
    state.scales[block] = scale;
  }

  // Nearest of the 16 levels in the sqrt(x / s) domain, from roots = sqrt(x): sqrt(x / s) >= the midpoint of codes
  // k - 1 and k iff 1024 sqrt(x / s) - 1 >= (2k + 1)^2. Zero is not a level; the code is at most 15 as x / s <= 1.
  static Vec::Codes unsigned_code(F roots, F inverse_root) {
    return Vec::unsigned_root_code(Vec::mul(roots, inverse_root));
  }

  static void encode_unsigned_roots(const State& state, int64_t block, int64_t size, const float* roots,
                                    float scale) {
    const int64_t half = size / 2;
    uint8_t* packed = state.codes + block * half;
    const F inverse_root = Vec::splat(inverse_root_scale(scale));
    for (int64_t i = 0; i < half; i += kWidth) {
      Vec::store_nibbles(packed + i, unsigned_code(Vec::load(roots + i), inverse_root),
                         unsigned_code(Vec::load(roots + i + half), inverse_root));
    }
    state.scales[block] = scale;
  }
};

// Stochastic rounding of bf16 parameters (hf_paged/stochastic_rounding.py): the fp32 value's bit pattern plus a
// 16-bit hash of (keys, element index), truncated to bf16; NaN and infinities as c10::BFloat16 converts them.
struct Rounding {
  bool on;
  uint32_t key_a, key_b;
};

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352DU;
  x ^= x >> 15;
  x *= 0x846CA68BU;
  return x ^ (x >> 16);
}

// Writes values[0, size) to p rounded stochastically; `first` is the index in the parameter of values[0].
inline void round_stochastically(c10::BFloat16* p, const float* values, int64_t size, int64_t first,
                                 const Rounding& r) {
  uint32_t high = 0;
  uint32_t high_key = r.key_a ^ mix32(r.key_b);  // the key of the indices' high word, while it stays `high`
  for (int64_t i = 0; i < size; ++i) {
    const float value = values[i];
    if (!std::isfinite(value)) {
      p[i] = c10::BFloat16(value);
      continue;
    }
    const uint64_t index = static_cast<uint64_t>(first + i);
    if (static_cast<uint32_t>(index >> 32) != high) {
      high = static_cast<uint32_t>(index >> 32);
      high_key = r.key_a ^ mix32(high ^ r.key_b);
    }
    const uint32_t hashed = mix32(static_cast<uint32_t>(index) ^ high_key);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    p[i] = c10::BFloat16(static_cast<uint16_t>((bits + (hashed >> 16)) >> 16), c10::BFloat16::from_bits());
  }
}

// Where the new values of a run of parameter elements p[0, size) go: straight to p, or (stochastic rounding of bf16)
// through an fp32 buffer rounded by finish() once the run is done; `index` is the index in the parameter of p[0].
template <typename P>
struct ParamWriter {
  ParamWriter(P* p, const Rounding&, int64_t, float*) : p(p) {}
  void store(int64_t i, F value) const { Vec::store(p + i, value); }
  void finish(int64_t) const {}
  P* p;
};

template <>
struct ParamWriter<c10::BFloat16> {
  ParamWriter(c10::BFloat16* p, const Rounding& rounding, int64_t index, float* buffer)
      : p(p), rounding(rounding), index(index), buffer(buffer) {}
  void store(int64_t i, F value) const {
    if (rounding.on) {
      Vec::store(buffer + i, value);
    } else {
      Vec::store(p + i, value);
    }
  }
  // After elements [0, size) are stored.
  void finish(int64_t size) const {
    if (rounding.on) round_stochastically(p, buffer, size, index, rounding);
  }
  c10::BFloat16* p;
  Rounding rounding;
  int64_t index;
  float* buffer;
};

// Block-local fp32 buffers of one thread (on its stack): a block's new first moments (AdEMAMix: and slow moments),
// square roots of its new second moments, and its new parameter values before stochastic rounding.
struct Scratch {
  alignas(64) float moments[kMaxBlockSize];
  alignas(64) float slow[kMaxBlockSize];
  alignas(64) float roots[kMaxBlockSize];
  alignas(64) float updated[kMaxBlockSize];
};

// A rank-1 block's buffers (Rank1Normalized4bitCodec): those of any block, and the normalizers of each element of
// each state, to decode its codes (`current`) and to encode its new value (`next`).
struct Rank1Scratch : Scratch {
  alignas(64) float current[2][kMaxBlockSize];
  alignas(64) float next[2][kMaxBlockSize];
};

// Elements of fp32 state updated as one unit of work (a multiple of every vector width).
constexpr int64_t kTile = 2048;

// Blockwise state is updated in runs of consecutive whole blocks of at most kRunElements elements (one block where
// blocks are larger): every block of a run steps, then every block is encoded, so that the encodings, which wait
// for their block's largest magnitudes, run back to back instead of between steps. Results are those of one block
// at a time.
constexpr int64_t kRunElements = 1024;
constexpr int64_t kMaxRunBlocks = kRunElements / 16;  // blocks hold at least 16 elements

int64_t run_blocks(int64_t block_size) { return std::max<int64_t>(1, kRunElements / block_size); }

// adamw_update_: m = lerp(m, g, 1 - b1); v = v b2 + (g (1 - b2)) g;
// p = p (1 - lr wd) - m / (sqrt(v) / sqrt(1 - b2^t) + eps) lr / (1 - b1^t).
struct AdamW {
  static constexpr const char* kBatchName = "adamw_batch_";
  static constexpr const char* kSegmentName = "adamw_segment_";
  static constexpr int64_t kStates = 2;
  static constexpr bool kSigned[kStates] = {true, false};
  // decay, avg_weight, beta2, sq_weight, eps, step_size, inv_bias_correction2_sqrt
  static constexpr int64_t kScalars = 7;

  struct Constants {
    explicit Constants(const float* s)
        : average(s[1]),
          decay(Vec::splat(s[0])),
          beta2(Vec::splat(s[2])),
          sq_weight(Vec::splat(s[3])),
          eps(Vec::splat(s[4])),
          step_size(Vec::splat(s[5])),
          inv_bias_correction2_sqrt(Vec::splat(s[6])) {}
    Lerp average;
    F decay, beta2, sq_weight, eps, step_size, inv_bias_correction2_sqrt;
  };

  // One vector of elements' new moment and second moment (adamw_moments_).
  static void moments(const Constants& c, F gradient, F moment, F second, F& new_moment, F& new_second) {
    new_moment = c.average(moment, gradient);
    new_second = Vec::add(Vec::mul(second, c.beta2), Vec::mul(Vec::mul(gradient, c.sq_weight), gradient));
  }

  // One vector of elements: the new moment and second moment, the square root of the latter, the new parameter.
  static void step(const Constants& c, F param, F gradient, F moment, F second, F& new_param, F& new_moment,
                   F& new_second, F& root) {
    moments(c, gradient, moment, second, new_moment, new_second);
    root = Vec::sqrt(new_second);
    const F denominator = Vec::add(Vec::mul(root, c.inv_bias_correction2_sqrt), c.eps);
    new_param = Vec::sub(Vec::mul(param, c.decay), Vec::mul(Vec::div(new_moment, denominator), c.step_size));
  }

  // What each state encodes from: the new moments, and the square roots of the new second moments.
  static float* encoded(Scratch& scratch, int64_t k) { return k == 0 ? scratch.moments : scratch.roots; }

  // Block `block` of blockwise `states`, whose elements are p[e, e + size) and g[e, e + size): new parameter values
  // through `writer`, what each state encodes into encoded(scratch, k) + e, each state's largest magnitude.
  template <class Codes, typename P, typename G>
  static void step_block(const ParamWriter<P>& writer, const P* p, const G* g, const State* states, int64_t block,
                         int64_t e, int64_t size, const Constants& constants, Scratch& scratch, float* maxima) {
    const Constants c = constants;  // a local copy, which the loop's stores cannot alias: read once, not per vector
    const typename Codes::SignedDecoder old_moments(states[0], block, size);
    const typename Codes::UnsignedDecoder old_seconds(states[1], block, size);
    AbsMax moments, seconds;
    for (int64_t i = 0; i < size; i += kWidth) {
      F new_param, moment, second, root;
      step(c, Vec::load(p + e + i), Vec::load(g + e + i), old_moments(i), old_seconds(i), new_param, moment, second,
           root);
      writer.store(e + i, new_param);
      Vec::store(scratch.moments + e + i, moment);
      Vec::store(scratch.roots + e + i, root);
      moments.add(moment);
      seconds.add(second);
    }
    maxima[0] = moments.value();
    maxima[1] = seconds.value();
  }

  // A block of rank-1 normalized 4-bit states whose codes are packed[0] and packed[1]: Codes4's maps with each
  // element's normalizer in place of the block's scale, scratch.current to decode and scratch.next to encode.
  template <typename P, typename G>
  static void rank1_block(P* p, const G* g, uint8_t* const* packed, int64_t size, const Constants& c,
                          const Rounding& rounding, int64_t index, Rank1Scratch& scratch) {
    const int64_t half = size / 2;
    const ParamWriter<P> writer(p, rounding, index, scratch.updated);
    for (int64_t i = 0; i < size; i += kWidth) {
      const F moment = Vec::mul(Codes4::signed_value(packed[0], half, i), Vec::load(scratch.current[0] + i));
      const F second = unsigned_scaled(Codes4::unsigned_value(packed[1], half, i), Vec::load(scratch.current[1] + i));
      F new_param, new_moment, new_second, root;
      step(c, Vec::load(p + i), Vec::load(g + i), moment, second, new_param, new_moment, new_second, root);
      writer.store(i, new_param);
      Vec::store(scratch.moments + i, new_moment);
      Vec::store(scratch.roots + i, root);  // the encoding takes sqrt(v)
    }
    writer.finish(size);
    const auto signed_code = [&](int64_t i) {
      return Codes4::signed_code(Vec::load(scratch.moments + i), Vec::inverse_scales(Vec::load(scratch.next[0] + i)));
    };
    const auto unsigned_code = [&](int64_t i) {
      return Codes4::unsigned_code(Vec::load(scratch.roots + i),
                                   Vec::inverse_root_scales(Vec::load(scratch.next[1] + i)));
    };
    for (int64_t i = 0; i < half; i += kWidth) {
      Vec::store_nibbles(packed[0] + i, signed_code(i), signed_code(i + half));
      Vec::store_nibbles(packed[1] + i, unsigned_code(i), unsigned_code(i + half));
    }
  }

  // The magnitudes of a rank-1 block's new moments (into scratch.moments) and second moments (scratch.roots),
  // decoded and advanced as rank1_block advances them; writes nothing else.
  template <typename G>
  static void rank1_magnitudes(const G* g, const uint8_t* const* packed, int64_t size, const Constants& c,
                               Rank1Scratch& scratch) {
    const int64_t half = size / 2;
    for (int64_t i = 0; i < size; i += kWidth) {
      const F moment = Vec::mul(Codes4::signed_value(packed[0], half, i), Vec::load(scratch.current[0] + i));
      const F second = unsigned_scaled(Codes4::unsigned_value(packed[1], half, i), Vec::load(scratch.current[1] + i));
      F new_moment, new_second;
      moments(c, Vec::load(g + i), moment, second, new_moment, new_second);
      Vec::store(scratch.moments + i, magnitude(new_moment));
      Vec::store(scratch.roots + i, magnitude(new_second));
    }
  }

  // Elements [i, i + kWidth) of fp32 states.
  template <typename P, typename G>
  static void elements(const ParamWriter<P>& writer, const P* p, const G* g, float* const* values, int64_t i,
                       const Constants& c) {
    F new_param, moment, second, root;
    step(c, Vec::load(p + i), Vec::load(g + i), Vec::load(values[0] + i), Vec::load(values[1] + i), new_param, moment,
         second, root);
    writer.store(i, new_param);
    Vec::store(values[0] + i, moment);
    Vec::store(values[1] + i, second);
  }
};

// lion_update_: p = p (1 - lr wd) - lr sign(lerp(m, g, 1 - b1)); m = lerp(m, g, 1 - b2), NaN and infinities stored as 0.
struct Lion {
  static constexpr const char* kBatchName = "lion_batch_";
  static constexpr const char* kSegmentName = "lion_segment_";
  static constexpr int64_t kStates = 1;
  static constexpr bool kSigned[kStates] = {true};
  // lr, decay, direction_weight, avg_weight
  static constexpr int64_t kScalars = 4;

  struct Constants {
    explicit Constants(const float* s)
        : direction(s[2]), average(s[3]), lr(Vec::splat(s[0])), decay(Vec::splat(s[1])) {}
    Lerp direction, average;
    F lr, decay;
  };

  static void step(const Constants& c, F param, F gradient, F moment, F& new_param, F& new_moment) {
    const F direction = Vec::sign(c.direction(moment, gradient));
    new_param = Vec::sub(Vec::mul(param, c.decay), Vec::mul(direction, c.lr));
    new_moment = Vec::zero_non_finite(c.average(moment, gradient));
  }

  static float* encoded(Scratch& scratch, int64_t) { return scratch.moments; }

  // See AdamW::step_block.
  template <class Codes, typename P, typename G>
  static void step_block(const ParamWriter<P>& writer, const P* p, const G* g, const State* states, int64_t block,
                         int64_t e, int64_t size, const Constants& c, Scratch& scratch, float* maxima) {
    const typename Codes::SignedDecoder old_moments(states[0], block, size);
    AbsMax moments;
    for (int64_t i = 0; i < size; i += kWidth) {
      F new_param, moment;
      step(c, Vec::load(p + e + i), Vec::load(g + e + i), old_moments(i), new_param, moment);
      writer.store(e + i, new_param);
      Vec::store(scratch.moments + e + i, moment);
      moments.add(moment);
    }
    maxima[0] = moments.value();
  }

  template <typename P, typename G>
  static void elements(const ParamWriter<P>& writer, const P* p, const G* g, float* const* values, int64_t i,
                       const Constants& c) {
    F new_param, moment;
    step(c, Vec::load(p + i), Vec::load(g + i), Vec::load(values[0] + i), new_param, moment);
    writer.store(i, new_param);
    Vec::store(values[0] + i, moment);
  }
};

// ademamix_update_, in bitsandbytes' reference's order: m1 = m1 b1 + g (1 - b1) and m2 = m2 b3 + g (1 - b3), each one
// fused multiply-add (ATen's add with alpha); v = v b2 + (g (1 - b2)) g, one fused multiply-add (ATen's addcmul);
// u = (m1 / c1 + m2 alpha) / (sqrt(v) / sqrt(c2) + eps); p = p + (u + p wd) (-lr), u + p wd fused (add with alpha).
struct AdEMAMix {
  static constexpr const char* kBatchName = "ademamix_batch_";
  static constexpr const char* kSegmentName = "ademamix_segment_";
  static constexpr int64_t kStates = 3;
  static constexpr bool kSigned[kStates] = {true, true, false};
  // beta1, avg_weight, beta3, slow_weight, beta2, sq_weight, eps, bias_correction1, bias_correction2_sqrt, alpha,
  // weight_decay, neg_lr
  static constexpr int64_t kScalars = 12;

  struct Constants {
    explicit Constants(const float* s)
        : beta1(Vec::splat(s[0])),
          avg_weight(Vec::splat(s[1])),
          beta3(Vec::splat(s[2])),
          slow_weight(Vec::splat(s[3])),
          beta2(Vec::splat(s[4])),
          sq_weight(Vec::splat(s[5])),
          eps(Vec::splat(s[6])),
          bias_correction1(Vec::splat(s[7])),
          bias_correction2_sqrt(Vec::splat(s[8])),
          alpha(Vec::splat(s[9])),
          weight_decay(Vec::splat(s[10])),
          neg_lr(Vec::splat(s[11])) {}
    F beta1, avg_weight, beta3, slow_weight, beta2, sq_weight, eps, bias_correction1, bias_correction2_sqrt, alpha,
        weight_decay, neg_lr;
  };

  // One vector of elements: the new averages and second moment, the square root of the latter, the new parameter.
  static void step(const Constants& c, F param, F gradient, F fast, F slow, F second, F& new_param, F& new_fast,
                   F& new_slow, F& new_second, F& root) {
    new_fast = Vec::fma(gradient, c.avg_weight, Vec::mul(fast, c.beta1));
    new_slow = Vec::fma(gradient, c.slow_weight, Vec::mul(slow, c.beta3));
    new_second = Vec::fma(Vec::mul(gradient, c.sq_weight), gradient, Vec::mul(second, c.beta2));
    root = Vec::sqrt(new_second);
    const F denominator = Vec::add(Vec::div(root, c.bias_correction2_sqrt), c.eps);
    const F numerator = Vec::add(Vec::div(new_fast, c.bias_correction1), Vec::mul(new_slow, c.alpha));
    const F update = Vec::div(numerator, denominator);
    new_param = Vec::add(param, Vec::mul(Vec::fma(param, c.weight_decay, update), c.neg_lr));
  }

  // What each state encodes from: the new fast and slow averages, the square roots of the new second moments.
  static float* encoded(Scratch& scratch, int64_t k) {
    return k == 0 ? scratch.moments : (k == 1 ? scratch.slow : scratch.roots);
  }

  // See AdamW::step_block.
  template <class Codes, typename P, typename G>
  static void step_block(const ParamWriter<P>& writer, const P* p, const G* g, const State* states, int64_t block,
                         int64_t e, int64_t size, const Constants& c, Scratch& scratch, float* maxima) {
    const typename Codes::SignedDecoder old_fast(states[0], block, size);
    const typename Codes::SignedDecoder old_slow(states[1], block, size);
    const typename Codes::UnsignedDecoder old_seconds(states[2], block, size);
    AbsMax fasts, slows, seconds;
    for (int64_t i = 0; i < size; i += kWidth) {
      F new_param, fast, slow, second, root;
      step(c, Vec::load(p + e + i), Vec::load(g + e + i), old_fast(i), old_slow(i), old_seconds(i), new_param, fast,
           slow, second, root);
      writer.store(e + i, new_param);
      Vec::store(scratch.moments + e + i, fast);
      Vec::store(scratch.slow + e + i, slow);
      Vec::store(scratch.roots + e + i, root);
      fasts.add(fast);
      slows.add(slow);
      seconds.add(second);
    }
    maxima[0] = fasts.value();
    maxima[1] = slows.value();
    maxima[2] = seconds.value();
  }

  template <typename P, typename G>
  static void elements(const ParamWriter<P>& writer, const P* p, const G* g, float* const* values, int64_t i,
                       const Constants& c) {
    F new_param, fast, slow, second, root;
    step(c, Vec::load(p + i), Vec::load(g + i), Vec::load(values[0] + i), Vec::load(values[1] + i),
         Vec::load(values[2] + i), new_param, fast, slow, second, root);
    writer.store(i, new_param);
    Vec::store(values[0] + i, fast);
    Vec::store(values[1] + i, slow);
    Vec::store(values[2] + i, second);
  }
};

int64_t grain_blocks(int64_t block_size) { return std::max<int64_t>(1, 32768 / block_size); }

// Blocks [first, first + count) of blockwise `states`, whose parameter and gradient elements are p[0, count size) and
// g[0, count size), count size <= kMaxBlockSize (see kRunElements): every block steps, then every block's states are
// encoded from what it left in the scratch buffers (the square roots of non-negative states).
template <class Rule, class Codes, typename P, typename G>
void update_blocks(P* p, const G* g, const State* states, int64_t first, int64_t count, int64_t size,
                   const typename Rule::Constants& c, const Rounding& rounding, int64_t index, Scratch& scratch) {
  const ParamWriter<P> writer(p, rounding, index, scratch.updated);
  float maxima[kMaxRunBlocks][Rule::kStates];
  for (int64_t b = 0; b < count; ++b) {
    Rule::template step_block<Codes>(writer, p, g, states, first + b, b * size, size, c, scratch, maxima[b]);
  }
  writer.finish(count * size);
  for (int64_t b = 0; b < count; ++b) {
    for (int64_t k = 0; k < Rule::kStates; ++k) {
      const float* values = Rule::encoded(scratch, k) + b * size;
      if (Rule::kSigned[k]) {
        Codes::encode_signed(states[k], first + b, size, values, maxima[b][k]);
      } else {
        Codes::encode_unsigned_roots(states[k], first + b, size, values, maxima[b][k]);
      }
    }
  }
}

// The rule on every block of a segment of whole blocks (the per-segment operators); `start` is the index in its
// parameter of the segment's first element.
template <class Rule, class Codes, typename P, typename G>
void segment_blocks(P* param, const G* grad, const State* states, int64_t blocks, int64_t size,
                    const float* scalars, const Rounding& rounding, int64_t start) {
  at::parallel_for(0, blocks, grain_blocks(size), [&](int64_t begin, int64_t end) {
    Scratch scratch;
    const typename Rule::Constants constants(scalars);
    for (int64_t block = begin; block < end; block += run_blocks(size)) {
      const int64_t first = block * size;
      update_blocks<Rule, Codes>(param + first, grad + first, states, block, std::min(run_blocks(size), end - block),
                                 size, constants, rounding, start + first, scratch);
    }
  });
}

// body(p, g) on a block of `count` of `size` elements: on its own parameter and gradient elements where it is whole,
// else on zero-padded copies of them, as the per-segment path pads a partial last block (the new parameter values
// copied back).
template <typename P, typename G, class Body>
void on_padded_block(P* p, const G* g, int64_t count, int64_t size, const Body& body) {
  if (count == size) {
    body(p, g);
    return;
  }
  P padded_param[kMaxBlockSize];
  G padded_grad[kMaxBlockSize];
  std::copy_n(p, count, padded_param);
  std::fill(padded_param + count, padded_param + size, P(0.0f));
  std::copy_n(g, count, padded_grad);
  std::fill(padded_grad + count, padded_grad + size, G(0.0f));
  body(padded_param, static_cast<const G*>(padded_grad));
  std::copy_n(padded_param, count, p);
}

// Blocks [first, last) of a segment of `length` elements (its parameter and gradient elements from p and g) whose
// first block is block `first_block` of the page's `states`; `index` is the index in its parameter of p[0].
template <class Rule, class Codes, typename P, typename G>
void batch_blocks(P* p, const G* g, const State* states, int64_t first_block, int64_t length, int64_t first,
                  int64_t last, int64_t size, const typename Rule::Constants& constants, const Rounding& rounding,
                  int64_t index, Scratch& scratch) {
  const int64_t whole = std::min(last, length / size);  // blocks [first, whole) are whole
  for (int64_t j = first; j < whole; j += run_blocks(size)) {
    const int64_t e = j * size;
    update_blocks<Rule, Codes>(p + e, g + e, states, first_block + j, std::min(run_blocks(size), whole - j), size,
                               constants, rounding, index + e, scratch);
  }
  for (int64_t j = std::max(first, whole); j < last; ++j) {
    const int64_t e = j * size;
    on_padded_block(p + e, g + e, length - e, size, [&](P* block_p, const G* block_g) {
      update_blocks<Rule, Codes>(block_p, block_g, states, first_block + j, 1, size, constants, rounding, index + e,
                                 scratch);
    });
  }
}

// The statistics of one tensor's rank-1 normalized states (PageBatch.statistics): the row and column maxima of each
// state that its codes are normalized by, and those being gathered, of a matrix of `columns` columns.
struct Rank1Maxima {
  const float* rows[2];
  const float* cols[2];
  float* next_rows[2];
  float* next_cols[2];
  int64_t columns;
};

// torch.minimum of a row's and a column's maximum: the smaller, NaN where either is NaN.
inline float normalizer(float row, float col) {
  if (std::isnan(row) || std::isnan(col)) return std::numeric_limits<float>::quiet_NaN();
  return col < row ? col : row;
}

// The normalizers min(rows[i], cols[j]) of elements [first, first + count) of a matrix of `columns` columns into
// out[0, count), and 0 into out[count, size) (a partial last block's padding; count > 0).
void fill_normalizers(const float* rows, const float* cols, int64_t columns, int64_t first, int64_t count,
                      int64_t size, float* out) {
  int64_t row = first / columns, col = first % columns;
  for (int64_t k = 0; k < count; ++row, col = 0) {
    const int64_t run = std::min(columns - col, count - k);
    const float row_max = rows[row];
    for (int64_t t = 0; t < run; ++t) out[k + t] = normalizer(row_max, cols[col + t]);
    k += run;
  }
  std::fill(out + count, out + size, 0.0f);
}

// *target = max(*target, value), atomically: threads raise the maxima of the rows and columns they share.
inline void raise_to(float* target, float value) {
  float current;
  __atomic_load(target, &current, __ATOMIC_RELAXED);
  while (value > current &&
         !__atomic_compare_exchange(target, &current, &value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}

// Raises the maxima of the rows and columns of elements [first, first + count) of a matrix of `columns` columns to
// their `magnitudes` (count > 0). A vector of columns is read first, without atomics, and only the columns below
// their magnitudes are raised: maxima only grow, so a column read before another thread raised it is raised (or
// found high enough) by raise_to, and one read at or above a magnitude stays there.
void raise_maxima(float* rows, float* cols, int64_t columns, int64_t first, int64_t count, const float* magnitudes) {
  int64_t row = first / columns, col = first % columns;
  for (int64_t k = 0; k < count; ++row, col = 0) {
    const int64_t run = std::min(columns - col, count - k);
    const float* values = magnitudes + k;
    float* run_cols = cols + col;
    F row_max = Vec::zero();
    int64_t t = 0;
    for (; t + kWidth <= run; t += kWidth) {
      const F vector = Vec::load(values + t);
      row_max = Vec::max(vector, row_max);
      for (uint32_t below = Vec::greater(vector, Vec::load(run_cols + t)); below != 0; below &= below - 1) {
        const int lane = __builtin_ctz(below);
        raise_to(run_cols + t + lane, values[t + lane]);
      }
    }
    float largest = Vec::reduce_max(row_max);
    for (; t < run; ++t) {
      largest = values[t] > largest ? values[t] : largest;
      raise_to(run_cols + t, values[t]);
    }
    raise_to(rows + row, largest);
    k += run;
  }
}

// Tiles [first, last) of kTile elements of a segment of `length` elements of fp32 state (`values`: its states'
// first elements). A last run of fewer than kWidth elements goes through zero-padded copies.
template <class Rule, typename P, typename G>
void batch_tiles(P* p, const G* g, float* const* values, int64_t length, int64_t first, int64_t last,
                 const typename Rule::Constants& constants, const Rounding& rounding, int64_t index,
                 Scratch& scratch) {
  for (int64_t j = first; j < last; ++j) {
    const int64_t e = j * kTile;
    const int64_t count = std::min(kTile, length - e);
    const int64_t body = count - count % kWidth;
    float* tile_values[Rule::kStates];
    for (int64_t k = 0; k < Rule::kStates; ++k) tile_values[k] = values[k] + e;
    const ParamWriter<P> writer(p + e, rounding, index + e, scratch.updated);
    for (int64_t i = 0; i < body; i += kWidth) Rule::elements(writer, p + e, g + e, tile_values, i, constants);
    writer.finish(body);
    if (body == count) continue;
    const int64_t rest = count - body;
    P padded_param[kWidth];
    G padded_grad[kWidth];
    float padded_values[Rule::kStates][kWidth];
    float* padded_pointers[Rule::kStates];
    std::copy_n(p + e + body, rest, padded_param);
    std::fill(padded_param + rest, padded_param + kWidth, P(0.0f));
    std::copy_n(g + e + body, rest, padded_grad);
    std::fill(padded_grad + rest, padded_grad + kWidth, G(0.0f));
    for (int64_t k = 0; k < Rule::kStates; ++k) {
      std::copy_n(tile_values[k] + body, rest, padded_values[k]);
      std::fill(padded_values[k] + rest, padded_values[k] + kWidth, 0.0f);
      padded_pointers[k] = padded_values[k];
    }
    const ParamWriter<P> rest_writer(padded_param, rounding, index + e + body, scratch.updated);
    Rule::elements(rest_writer, padded_param, padded_grad, padded_pointers, 0, constants);
    rest_writer.finish(rest);
    std::copy_n(padded_param, rest, p + e + body);
    for (int64_t k = 0; k < Rule::kStates; ++k) std::copy_n(padded_values[k], rest, tile_values[k] + body);
  }
}

bool is_float_type(c10::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

// 4-bit codes are packed by half-blocks, which the vector code takes kWidth elements at a time.
void check_half_blocks(const char* op, int64_t bits, int64_t block_size) {
  TORCH_CHECK(bits != 4 || (block_size / 2) % kWidth == 0, op, ": 4-bit blocks must be of at least ", 2 * kWidth,
              " elements in this build (", kWidth, " vector lanes), got ", block_size);
}

State state_of(const at::Tensor& codes, const at::Tensor& scales) {
  return {static_cast<uint8_t*>(codes.data_ptr()), scales.data_ptr<float>()};
}

// Calls body(value) with a value of the C++ type of an fp32, bf16 or fp16 tensor (checked before).
template <typename Body>
void with_type(c10::ScalarType type, const Body& body) {
  switch (type) {
    case at::kFloat:
      body(float{});
      break;
    case at::kBFloat16:
      body(c10::BFloat16{});
      break;
    default:
      body(c10::Half{});
  }
}

// Calls body(codes, param pointer, grad pointer) for the tensors' types and the state's bits.
template <typename Body>
void dispatch(const at::Tensor& param, const at::Tensor& grad, int64_t bits, const Body& body) {
  with_type(param.scalar_type(), [&](auto param_value) {
    using P = decltype(param_value);
    with_type(grad.scalar_type(), [&](auto grad_value) {
      using G = decltype(grad_value);
      auto* p = static_cast<P*>(param.data_ptr());
      const auto* g = static_cast<const G*>(grad.data_ptr());
      if (bits == 8) {
        body(Codes8{}, p, g);
      } else {
        body(Codes4{}, p, g);
      }
    });
  });
}

// The stochastic rounding keys of an operator, checked: 32-bit.
Rounding rounding_of(const char* op, bool on, int64_t key_a, int64_t key_b) {
  for (const int64_t key : {key_a, key_b}) {
    TORCH_CHECK(key >= 0 && key <= 0xFFFFFFFFLL, op, ": stochastic rounding keys must be in [0, 2**32), got ", key);
  }
  return {on, static_cast<uint32_t>(key_a), static_cast<uint32_t>(key_b)};
}

// The rule on one segment (the segment operators adamw_segment_, lion_segment_, ademamix_segment_): `arrays` are its
// states' buffers in the page format's order, the codes and scales of whole blocks of each blockwise state (bits 8 or
// 4, block_size elements a block) or the values of each fp32 state (bits 32, block_size 1), as many elements as the
// parameter; `round_start` is the index in its parameter of its first element. Checks everything before its first
// write.
template <class Rule>
void segment_update(const at::Tensor& param, const at::Tensor& grad, at::TensorList arrays, int64_t bits,
                    int64_t block_size, at::ArrayRef<double> scalars, bool stochastic_round, int64_t round_key_a,
                    int64_t round_key_b, int64_t round_start) {
  const char* op = Rule::kSegmentName;
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 32, op, ": bits must be 8, 4 or 32 (fp32 state), got ", bits);
  if (bits == 32) {
    TORCH_CHECK(block_size == 1, op, ": block_size must be 1 for fp32 state, got ", block_size);
  } else {
    TORCH_CHECK(block_size >= 16 && block_size <= kMaxBlockSize && (block_size & (block_size - 1)) == 0, op,
                ": block_size must be a power of two from 16 to ", kMaxBlockSize, ", got ", block_size);
    check_half_blocks(op, bits, block_size);
  }
  const int64_t numel = param.numel();
  for (const at::Tensor* tensor : {&param, &grad}) {
    TORCH_CHECK(tensor->device().is_cpu() && tensor->is_contiguous() && is_float_type(tensor->scalar_type()), op,
                ": param and grad must be contiguous CPU tensors of fp32, bf16 or fp16, got ",
                tensor->scalar_type(), " on ", tensor->device(), tensor->is_contiguous() ? "" : " (not contiguous)");
  }
  TORCH_CHECK(grad.numel() == numel, op, ": grad has ", grad.numel(), " elements, param ", numel);
  TORCH_CHECK(numel % block_size == 0, op, ": the parameter's ", numel, " elements are not whole blocks of ",
              block_size);
  const int64_t blocks = numel / block_size;
  const int64_t per_state = bits == 32 ? 1 : 2;
  TORCH_CHECK(static_cast<int64_t>(arrays.size()) == per_state * Rule::kStates, op, ": arrays must hold ",
              per_state * Rule::kStates, " tensors (", per_state, " per state), got ", arrays.size());
  State states[Rule::kStates];
  float* values[Rule::kStates];
  for (int64_t k = 0; k < Rule::kStates; ++k) {
    if (bits == 32) {
      const at::Tensor& state = arrays[k];
      TORCH_CHECK(state.device().is_cpu() && state.is_contiguous() && state.scalar_type() == at::kFloat &&
                      state.numel() == numel,
                  op, ": a state must be a contiguous CPU fp32 tensor of ", numel, " elements, got ", state.numel(),
                  " ", state.scalar_type(), " on ", state.device());
      values[k] = state.data_ptr<float>();
      continue;
    }
    const at::Tensor& codes = arrays[2 * k];
    const at::Tensor& scales = arrays[2 * k + 1];
    const c10::ScalarType code_type = bits == 8 && Rule::kSigned[k] ? at::kChar : at::kByte;
    const int64_t code_count = bits == 8 ? numel : numel / 2;
    TORCH_CHECK(codes.device().is_cpu() && codes.is_contiguous() && codes.scalar_type() == code_type &&
                    codes.numel() == code_count,
                op, ": a state's codes must be a contiguous CPU tensor of ", code_count, " ", code_type,
                " elements, got ", codes.numel(), " ", codes.scalar_type(), " on ", codes.device());
    TORCH_CHECK(scales.device().is_cpu() && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                    scales.numel() == blocks,
                op, ": a state's scales must be a contiguous CPU fp32 tensor of ", blocks, " elements, got ",
                scales.numel(), " ", scales.scalar_type(), " on ", scales.device());
    states[k] = state_of(codes, scales);
  }
  TORCH_CHECK(static_cast<int64_t>(scalars.size()) == Rule::kScalars, op, ": scalars must hold ", Rule::kScalars,
              " values, got ", scalars.size());
  float constants_row[Rule::kScalars];
  for (int64_t k = 0; k < Rule::kScalars; ++k) constants_row[k] = static_cast<float>(scalars[k]);
  const Rounding rounding = rounding_of(op, stochastic_round && param.scalar_type() == at::kBFloat16, round_key_a,
                                        round_key_b);
  TORCH_CHECK(round_start >= 0, op, ": round_start must be >= 0, got ", round_start);
  if (bits != 32) {
    dispatch(param, grad, bits, [&](auto codes, auto* p, const auto* g) {
      segment_blocks<Rule, decltype(codes)>(p, g, states, blocks, block_size, constants_row, rounding, round_start);
    });
    return;
  }
  with_type(param.scalar_type(), [&](auto param_value) {
    using P = decltype(param_value);
    with_type(grad.scalar_type(), [&](auto grad_value) {
      using G = decltype(grad_value);
      auto* p = static_cast<P*>(param.data_ptr());
      const auto* g = static_cast<const G*>(grad.data_ptr());
      at::parallel_for(0, (numel + kTile - 1) / kTile, grain_blocks(kTile), [&](int64_t begin, int64_t end) {
        Scratch scratch;
        const typename Rule::Constants constants(constants_row);
        batch_tiles<Rule>(p, g, values, numel, begin, end, constants, rounding, round_start, scratch);
      });
    });
  });
}

// The batch operators ---------------------------------------------------------------------------------------------

// One row of a batch's table, checked, with the addresses it names.
template <class Rule>
struct BatchSegment {
  void* param;       // the parameter's element `start`
  const void* grad;  // the gradient's element `start`
  c10::ScalarType param_type, grad_type;
  int64_t tensor, start, length;
  State states[Rule::kStates];   // blockwise: the page's codes and scales (rank-1: codes only)
  float* values[Rule::kStates];  // fp32 state: the segment's first elements
  int64_t first_block;           // blockwise: the segment's first block in the page
  const float* scalars;
  Rounding rounding;
};

// A byte range [begin, end) of one segment, and the segment.
struct Extent {
  uintptr_t begin, end;
  int64_t segment;
  bool operator<(const Extent& other) const { return begin < other.begin; }
};

// Raises where two non-empty extents share a byte.
void check_disjoint(const char* op, std::vector<Extent>& extents, const char* what) {
  std::sort(extents.begin(), extents.end());
  for (size_t k = 1; k < extents.size(); ++k) {
    TORCH_CHECK(extents[k].begin >= extents[k - 1].end, op, ": segments ", extents[k - 1].segment, " and ",
                extents[k].segment, " of the table overlap in ", what);
  }
}

void check_cpu_contiguous(const char* op, const at::Tensor& tensor, const char* name) {
  TORCH_CHECK(tensor.device().is_cpu() && tensor.is_contiguous(), op, ": ", name,
              " must be a contiguous CPU tensor, got one on ", tensor.device(),
              tensor.is_contiguous() ? "" : " (not contiguous)");
}

// Checks every argument of batch operator `op` before anything is written, and reads the table: one BatchSegment
// per row. `bits` is 8 or 4 for blockwise state of `block_size` elements a block, 32 for fp32 state (block_size 1);
// `rank1`: 4-bit rank-1 normalized state, whose pages hold each state's packed codes and no scales.
template <class Rule>
std::vector<BatchSegment<Rule>> check_batch(const char* op, at::TensorList params, at::TensorList grads,
                                            at::TensorList buffers, const at::Tensor& table, const at::Tensor& scalars,
                                            const std::optional<at::Tensor>& rounding, int64_t bits,
                                            int64_t block_size, bool rank1 = false) {
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 32, op, ": bits must be 8, 4 or 32 (fp32 state), got ", bits);
  if (bits == 32) {
    TORCH_CHECK(block_size == 1, op, ": block_size must be 1 for fp32 state, got ", block_size);
  } else {
    TORCH_CHECK(block_size >= 16 && block_size <= kMaxBlockSize && (block_size & (block_size - 1)) == 0, op,
                ": block_size must be a power of two from 16 to ", kMaxBlockSize, ", got ", block_size);
    check_half_blocks(op, bits, block_size);
  }
  TORCH_CHECK(params.size() == grads.size(), op, ": params has ", params.size(), " tensors, grads ", grads.size());
  for (size_t t = 0; t < params.size(); ++t) {
    for (const at::Tensor* tensor : {&params[t], &grads[t]}) {
      TORCH_CHECK(tensor->device().is_cpu() && tensor->is_contiguous() && is_float_type(tensor->scalar_type()), op,
                  ": params and grads must be contiguous CPU tensors of fp32, bf16 or fp16, got ",
                  tensor->scalar_type(), " on ", tensor->device(), tensor->is_contiguous() ? "" : " (not contiguous)",
                  " at position ", t);
    }
    TORCH_CHECK(grads[t].numel() == params[t].numel(), op, ": grads[", t, "] has ", grads[t].numel(),
                " elements, params[", t, "] ", params[t].numel());
  }
  const int64_t per_page = bits == 32 || rank1 ? Rule::kStates : 2 * Rule::kStates;
  TORCH_CHECK(buffers.size() % per_page == 0, op, ": buffers must hold ", per_page, " tensors per page, got ",
              buffers.size());
  const int64_t pages = static_cast<int64_t>(buffers.size()) / per_page;
  for (size_t b = 0; b < buffers.size(); ++b) {
    const int64_t k = static_cast<int64_t>(b) % per_page;
    c10::ScalarType expected = at::kFloat;  // fp32 values, and the scales of blockwise states
    if (rank1) {
      expected = at::kByte;
    } else if (bits != 32 && k % 2 == 0) {
      expected = bits == 8 && Rule::kSigned[k / 2] ? at::kChar : at::kByte;
    }
    TORCH_CHECK(buffers[b].device().is_cpu() && buffers[b].is_contiguous() && buffers[b].scalar_type() == expected,
                op, ": buffers[", b, "] must be a contiguous CPU tensor of ", expected, ", got ",
                buffers[b].scalar_type(), " on ", buffers[b].device(),
                buffers[b].is_contiguous() ? "" : " (not contiguous)");
  }
  check_cpu_contiguous(op, table, "table");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 6, op,
              ": table must be int64 of shape (segments, 6), got ", table.scalar_type(), " of shape ", table.sizes());
  check_cpu_contiguous(op, scalars, "scalars");
  TORCH_CHECK(scalars.scalar_type() == at::kFloat && scalars.dim() == 2 && scalars.size(1) == Rule::kScalars, op,
              ": scalars must be fp32 of shape (rows, ", Rule::kScalars, "), got ", scalars.scalar_type(),
              " of shape ", scalars.sizes());
  const int64_t segments = table.size(0);
  const int64_t* keys = nullptr;
  if (rounding.has_value()) {
    check_cpu_contiguous(op, *rounding, "rounding");
    TORCH_CHECK(rounding->scalar_type() == at::kLong && rounding->dim() == 2 && rounding->size(0) == segments &&
                    rounding->size(1) == 2,
                op, ": rounding must be int64 of shape (", segments, ", 2), got ", rounding->scalar_type(),
                " of shape ", rounding->sizes());
    keys = rounding->data_ptr<int64_t>();
  }
  const int64_t* rows = table.data_ptr<int64_t>();
  const int64_t tensors = static_cast<int64_t>(params.size());
  std::vector<BatchSegment<Rule>> result(segments);
  std::vector<Extent> param_extents, state_extents;
  param_extents.reserve(segments);
  state_extents.reserve(segments);
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t* row = rows + 6 * s;
    const int64_t tensor = row[0], start = row[1], length = row[2], page = row[3], offset = row[4], row_index = row[5];
    TORCH_CHECK(tensor >= 0 && tensor < tensors, op, ": table[", s, "] names tensor ", tensor, " of ", tensors);
    const int64_t numel = params[tensor].numel();
    TORCH_CHECK(start >= 0 && length >= 0 && length <= numel - start, op, ": table[", s, "] takes elements [", start,
                ", ", start, " + ", length, ") of a tensor of ", numel);
    TORCH_CHECK(page >= 0 && page < pages, op, ": table[", s, "] names page ", page, " of ", pages);
    TORCH_CHECK(offset >= 0 && offset % block_size == 0, op, ": table[", s, "] starts at element ", offset,
                " of its page, which must be a multiple of the block size ", block_size);
    TORCH_CHECK(row_index >= 0 && row_index < scalars.size(0), op, ": table[", s, "] names scalar row ", row_index,
                " of ", scalars.size(0));
    BatchSegment<Rule>& segment = result[s];
    const at::Tensor& param = params[tensor];
    const at::Tensor& grad = grads[tensor];
    segment.param = static_cast<char*>(param.data_ptr()) + start * param.element_size();
    segment.grad = static_cast<const char*>(grad.data_ptr()) + start * grad.element_size();
    segment.param_type = param.scalar_type();
    segment.grad_type = grad.scalar_type();
    segment.tensor = tensor;
    segment.start = start;
    segment.length = length;
    segment.scalars = scalars.data_ptr<float>() + Rule::kScalars * row_index;
    segment.rounding = {false, 0, 0};
    if (keys != nullptr && !(keys[2 * s] == -1 && keys[2 * s + 1] == -1)) {
      TORCH_CHECK(param.scalar_type() == at::kBFloat16, op, ": table[", s,
                  "] has stochastic rounding keys, but its parameter is ", param.scalar_type(),
                  " (only bf16 parameters round stochastically; -1 marks a segment that does not round)");
      segment.rounding = rounding_of(op, true, keys[2 * s], keys[2 * s + 1]);
    }
    const at::Tensor* page_buffers = buffers.data() + page * per_page;
    uintptr_t state_begin = 0, state_end = 0;
    if (bits == 32) {
      for (int64_t k = 0; k < Rule::kStates; ++k) {
        TORCH_CHECK(length <= page_buffers[k].numel() - offset, op, ": table[", s, "] takes elements [", offset, ", ",
                    offset, " + ", length, ") of page ", page, "'s state of ", page_buffers[k].numel());
        segment.values[k] = page_buffers[k].data_ptr<float>() + offset;
      }
      state_begin = reinterpret_cast<uintptr_t>(segment.values[0]);
      state_end = state_begin + length * sizeof(float);
    } else {
      const int64_t blocks = (length + block_size - 1) / block_size;
      const int64_t first_block = offset / block_size;
      const int64_t code_bytes = (first_block + blocks) * block_size / (bits == 8 ? 1 : 2);
      for (int64_t k = 0; k < Rule::kStates; ++k) {
        if (rank1) {
          const at::Tensor& codes = page_buffers[k];
          TORCH_CHECK(code_bytes <= codes.numel(), op, ": table[", s, "] takes blocks [", first_block, ", ",
                      first_block + blocks, ") of page ", page, ", whose state ", k, " has ", codes.numel(),
                      " code bytes");
          segment.states[k] = {static_cast<uint8_t*>(codes.data_ptr()), nullptr};
          continue;
        }
        const at::Tensor& codes = page_buffers[2 * k];
        const at::Tensor& scales = page_buffers[2 * k + 1];
        TORCH_CHECK(code_bytes <= codes.numel() && first_block + blocks <= scales.numel(), op, ": table[", s,
                    "] takes blocks [", first_block, ", ", first_block + blocks, ") of page ", page, ", whose state ",
                    k, " has ", codes.numel(), " code bytes and ", scales.numel(), " scales");
        segment.states[k] = state_of(codes, scales);
      }
      segment.first_block = first_block;
      const int64_t block_bytes = block_size / (bits == 8 ? 1 : 2);
      state_begin = reinterpret_cast<uintptr_t>(segment.states[0].codes) + first_block * block_bytes;
      state_end = state_begin + blocks * block_bytes;
    }
    if (length > 0) {
      const uintptr_t param_begin = reinterpret_cast<uintptr_t>(segment.param);
      param_extents.push_back({param_begin, param_begin + length * param.element_size(), s});
      state_extents.push_back({state_begin, state_end, s});
    }
  }
  check_disjoint(op, param_extents, "their parameter elements");
  check_disjoint(op, state_extents, "their pages' state");
  return result;
}

// Units of work of a segment: blocks of blockwise state, tiles of fp32 state.
int64_t units_of(int64_t length, int64_t bits, int64_t block_size) {
  const int64_t unit = bits == 32 ? kTile : block_size;
  return (length + unit - 1) / unit;
}

// Units [first, last) of one segment of a batch.
template <class Rule>
void update_units(const BatchSegment<Rule>& segment, int64_t first, int64_t last, int64_t bits, int64_t block_size,
                  Scratch& scratch) {
  with_type(segment.param_type, [&](auto param_value) {
    using P = decltype(param_value);
    with_type(segment.grad_type, [&](auto grad_value) {
      using G = decltype(grad_value);
      auto* p = static_cast<P*>(segment.param);
      const auto* g = static_cast<const G*>(segment.grad);
      const typename Rule::Constants constants(segment.scalars);
      if (bits == 32) {
        batch_tiles<Rule>(p, g, segment.values, segment.length, first, last, constants, segment.rounding,
                          segment.start, scratch);
      } else if (bits == 8) {
        batch_blocks<Rule, Codes8>(p, g, segment.states, segment.first_block, segment.length, first, last,
                                   block_size, constants, segment.rounding, segment.start, scratch);
      } else {
        batch_blocks<Rule, Codes4>(p, g, segment.states, segment.first_block, segment.length, first, last,
                                   block_size, constants, segment.rounding, segment.start, scratch);
      }
    });
  });
}

// One parallel pass over every unit of every segment of a batch: body(s, first, last, scratch) takes units
// [first, last) of segment s, with a thread's ScratchType buffers.
template <class ScratchType, class Rule, class Body>
void for_units(const std::vector<BatchSegment<Rule>>& segments, int64_t bits, int64_t block_size, const Body& body) {
  std::vector<int64_t> ends(segments.size());  // the units of segments [0, s], for each s
  int64_t total = 0;
  for (size_t s = 0; s < segments.size(); ++s) {
    total += units_of(segments[s].length, bits, block_size);
    ends[s] = total;
  }
  const int64_t grain = bits == 32 ? grain_blocks(kTile) : grain_blocks(block_size);
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    ScratchType scratch;
    // the first segment with units at or after `begin`
    size_t s = std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin();
    for (int64_t unit = begin; unit < end; ++s) {
      const int64_t segment_first = s == 0 ? 0 : ends[s - 1];
      const int64_t last = std::min(end, ends[s]);
      if (last > unit) {
        body(s, unit - segment_first, last - segment_first, scratch);
        unit = last;
      }
    }
  });
}

// Every segment of a batch in one parallel pass over all its blocks (or tiles); see hf_paged/kernels/batch.py.
template <class Rule>
void update_batch(at::TensorList params, at::TensorList grads, at::TensorList buffers, const at::Tensor& table,
                  const at::Tensor& scalars, const std::optional<at::Tensor>& rounding, int64_t bits,
                  int64_t block_size) {
  const std::vector<BatchSegment<Rule>> segments =
      check_batch<Rule>(Rule::kBatchName, params, grads, buffers, table, scalars, rounding, bits, block_size);
  for_units<Scratch>(segments, bits, block_size, [&](size_t s, int64_t first, int64_t last, Scratch& scratch) {
    update_units(segments[s], first, last, bits, block_size, scratch);
  });
}

// Rank-1 normalized 4-bit AdamW state (Rank1Normalized4bitCodec) -------------------------------------------------

// Checks the rank-1 statistics of a batch's params (8 tensors each: see PageBatch.statistics) and reads them.
// `gathering`: the next maxima are written, so they must share no memory with each other or the current ones.
std::vector<Rank1Maxima> check_statistics(const char* op, at::TensorList params, at::TensorList statistics,
                                          bool gathering) {
  TORCH_CHECK(statistics.size() == 8 * params.size(), op, ": statistics must hold 8 tensors per parameter (",
              8 * params.size(), "), got ", statistics.size());
  std::vector<Rank1Maxima> result(params.size());
  for (size_t t = 0; t < params.size(); ++t) {
    const at::Tensor* entry = statistics.data() + 8 * t;
    const int64_t rows = entry[0].numel(), columns = entry[1].numel();
    for (int64_t k = 0; k < 8; ++k) {
      const at::Tensor& tensor = entry[k];
      const int64_t expected = k % 2 == 0 ? rows : columns;
      TORCH_CHECK(tensor.device().is_cpu() && tensor.is_contiguous() && tensor.scalar_type() == at::kFloat &&
                      tensor.numel() == expected,
                  op, ": statistics[", 8 * t + k, "] must be a contiguous CPU fp32 tensor of ", expected, " (the ",
                  k % 2 == 0 ? "rows" : "columns", " of params[", t, "]), got ", tensor.numel(), " ",
                  tensor.scalar_type(), " on ", tensor.device(), tensor.is_contiguous() ? "" : " (not contiguous)");
    }
    TORCH_CHECK(rows * columns == params[t].numel(), op, ": params[", t, "] has ", params[t].numel(),
                " elements, its statistics ", rows, " rows of ", columns, " columns");
    if (gathering) {
      for (int64_t k = 4; k < 8; ++k) {
        const auto begin = reinterpret_cast<uintptr_t>(entry[k].data_ptr());
        for (int64_t other = 0; other < k; ++other) {
          const auto other_begin = reinterpret_cast<uintptr_t>(entry[other].data_ptr());
          const bool apart = begin + entry[k].nbytes() <= other_begin || other_begin + entry[other].nbytes() <= begin;
          TORCH_CHECK(apart || entry[k].numel() == 0, op, ": statistics[", 8 * t + k,
                      "] shares memory with statistics[", 8 * t + other, "]: the next maxima are written");
        }
      }
    }
    Rank1Maxima& maxima = result[t];
    for (int64_t k = 0; k < 2; ++k) {
      maxima.rows[k] = entry[2 * k].data_ptr<float>();
      maxima.cols[k] = entry[2 * k + 1].data_ptr<float>();
      maxima.next_rows[k] = entry[4 + 2 * k].data_ptr<float>();
      maxima.next_cols[k] = entry[5 + 2 * k].data_ptr<float>();
    }
    maxima.columns = columns;
  }
  return result;
}

// The codes of block j of a rank-1 segment, each state's, and the normalizers to decode them (and, with `next`, to
// encode the block's new state) into scratch.
void rank1_prepare(const BatchSegment<AdamW>& segment, const Rank1Maxima& maxima, int64_t j, int64_t size, bool next,
                   uint8_t* (&packed)[2], Rank1Scratch& scratch) {
  const int64_t e = j * size;
  const int64_t count = std::min(size, segment.length - e);
  for (int64_t k = 0; k < 2; ++k) {
    packed[k] = segment.states[k].codes + (segment.first_block + j) * (size / 2);
    fill_normalizers(maxima.rows[k], maxima.cols[k], maxima.columns, segment.start + e, count, size,
                     scratch.current[k]);
    if (next) {
      fill_normalizers(maxima.next_rows[k], maxima.next_cols[k], maxima.columns, segment.start + e, count, size,
                       scratch.next[k]);
    }
  }
}

// adamw_rank1_batch_: every segment of a batch of rank-1 pages, decoded with the current maxima and encoded with the
// next ones (see hf_paged/kernels/batch.py), in one parallel pass over all its blocks.
void adamw_rank1_batch(at::TensorList params, at::TensorList grads, at::TensorList buffers, const at::Tensor& table,
                       const at::Tensor& scalars, const std::optional<at::Tensor>& rounding, at::TensorList statistics,
                       int64_t block_size) {
  const char* op = "adamw_rank1_batch_";
  const auto segments = check_batch<AdamW>(op, params, grads, buffers, table, scalars, rounding, 4, block_size, true);
  const std::vector<Rank1Maxima> maxima = check_statistics(op, params, statistics, false);
  for_units<Rank1Scratch>(segments, 4, block_size, [&](size_t s, int64_t first, int64_t last, Rank1Scratch& scratch) {
    const BatchSegment<AdamW>& segment = segments[s];
    with_type(segment.param_type, [&](auto param_value) {
      using P = decltype(param_value);
      with_type(segment.grad_type, [&](auto grad_value) {
        using G = decltype(grad_value);
        auto* p = static_cast<P*>(segment.param);
        const auto* g = static_cast<const G*>(segment.grad);
        const AdamW::Constants constants(segment.scalars);
        for (int64_t j = first; j < last; ++j) {
          uint8_t* packed[2];
          rank1_prepare(segment, maxima[segment.tensor], j, block_size, true, packed, scratch);
          const int64_t e = j * block_size;
          on_padded_block(p + e, g + e, std::min(block_size, segment.length - e), block_size,
                          [&](P* block_p, const G* block_g) {
                            AdamW::rank1_block(block_p, block_g, packed, block_size, constants, segment.rounding,
                                               segment.start + e, scratch);
                          });
        }
      });
    });
  });
}

// adamw_rank1_gather_: raises the next row and column maxima of each tensor of a batch of rank-1 pages to the
// magnitudes of the state a step computes (see hf_paged/kernels/batch.py); writes nothing else.
void adamw_rank1_gather(at::TensorList params, at::TensorList grads, at::TensorList buffers, const at::Tensor& table,
                        const at::Tensor& scalars, at::TensorList statistics, int64_t block_size) {
  const char* op = "adamw_rank1_gather_";
  const auto segments =
      check_batch<AdamW>(op, params, grads, buffers, table, scalars, std::nullopt, 4, block_size, true);
  const std::vector<Rank1Maxima> maxima = check_statistics(op, params, statistics, true);
  for_units<Rank1Scratch>(segments, 4, block_size, [&](size_t s, int64_t first, int64_t last, Rank1Scratch& scratch) {
    const BatchSegment<AdamW>& segment = segments[s];
    const Rank1Maxima& tensor_maxima = maxima[segment.tensor];
    with_type(segment.grad_type, [&](auto grad_value) {
      using G = decltype(grad_value);
      const auto* g = static_cast<const G*>(segment.grad);
      const AdamW::Constants constants(segment.scalars);
      G padded_grad[kMaxBlockSize];
      for (int64_t j = first; j < last; ++j) {
        uint8_t* packed[2];
        rank1_prepare(segment, tensor_maxima, j, block_size, false, packed, scratch);
        const int64_t e = j * block_size;
        const int64_t count = std::min(block_size, segment.length - e);
        const G* block_g = g + e;
        if (count < block_size) {
          std::copy_n(block_g, count, padded_grad);
          std::fill(padded_grad + count, padded_grad + block_size, G(0.0f));
          block_g = padded_grad;
        }
        AdamW::rank1_magnitudes(block_g, packed, block_size, constants, scratch);
        const float* magnitudes[2] = {scratch.moments, scratch.roots};
        for (int64_t k = 0; k < 2; ++k) {
          raise_maxima(tensor_maxima.next_rows[k], tensor_maxima.next_cols[k], tensor_maxima.columns,
                       segment.start + e, count, magnitudes[k]);
        }
      }
    });
  });
}

}  // namespace
}  // namespace hf_paged

TORCH_LIBRARY(hf_paged, m) {
  // The lanes of `Vec` this build computes with: 16 for AVX-512 code, 8 for AVX2 code, 1 for scalar code.
  m.def("vector_lanes() -> int", []() -> int64_t { return hf_paged::Vec::kWidth; });
  // Each rule's segment operator (see segment_update: arrays are its states' buffers, scalars the rule's in the order
  // of its struct's Constants) and batch operator (hf_paged/kernels/batch.py: buffers are the pages' buffers, page
  // after page); bits 8 or 4 for blockwise state, 32 (block_size 1) for fp32 state.
  for (const char* name : {"adamw", "lion", "ademamix"}) {
    m.def((std::string(name) +
           "_segment_(Tensor(a!) param, Tensor grad, Tensor(b!)[] arrays, int bits, int block_size, float[] scalars, "
           "bool stochastic_round=False, int round_key_a=0, int round_key_b=0, int round_start=0) -> ()")
              .c_str());
    m.def((std::string(name) +
           "_batch_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] buffers, Tensor table, Tensor scalars, "
           "Tensor? rounding, int bits, int block_size) -> ()")
              .c_str());
  }
  // A page batch of rank-1 normalized 4-bit AdamW state: buffers are each page's packed codes of both states,
  // statistics each param's 8 maxima (PageBatch.statistics, flattened). The update decodes with the current maxima
  // and encodes with the next ones; the gathering raises the next ones to the new state's magnitudes.
  m.def(
      "adamw_rank1_batch_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] buffers, Tensor table, Tensor scalars, "
      "Tensor? rounding, Tensor[] statistics, int block_size) -> ()");
  m.def(
      "adamw_rank1_gather_(Tensor[] params, Tensor[] grads, Tensor[] buffers, Tensor table, Tensor scalars, "
      "Tensor(a!)[] statistics, int block_size) -> ()");
}

TORCH_LIBRARY_IMPL(hf_paged, CPU, m) {
  m.impl("adamw_segment_", &hf_paged::segment_update<hf_paged::AdamW>);
  m.impl("lion_segment_", &hf_paged::segment_update<hf_paged::Lion>);
  m.impl("ademamix_segment_", &hf_paged::segment_update<hf_paged::AdEMAMix>);
  m.impl("adamw_batch_", &hf_paged::update_batch<hf_paged::AdamW>);
  m.impl("lion_batch_", &hf_paged::update_batch<hf_paged::Lion>);
  m.impl("ademamix_batch_", &hf_paged::update_batch<hf_paged::AdEMAMix>);
  m.impl("adamw_rank1_batch_", &hf_paged::adamw_rank1_batch);
  m.impl("adamw_rank1_gather_", &hf_paged::adamw_rank1_gather);
}
