// core/dtype.cpp — dtype names and sizes, bulk conversions.
#include "core/dtype.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace tuna {

namespace {

struct DTypeEntry {
  DType dtype;
  std::string_view name;
  size_t size;
};

constexpr DTypeEntry kDTypes[] = {
    {DType::F64, "F64", 8}, {DType::F32, "F32", 4}, {DType::F16, "F16", 2}, {DType::BF16, "BF16", 2},
    {DType::I64, "I64", 8}, {DType::I32, "I32", 4}, {DType::I16, "I16", 2}, {DType::I8, "I8", 1},
    {DType::U8, "U8", 1},   {DType::BOOL, "BOOL", 1},
};

const DTypeEntry& entry(DType dtype) {
  for (const DTypeEntry& e : kDTypes)
    if (e.dtype == dtype) return e;
  TUNA_CHECK(false, "DType value ", static_cast<int>(dtype), " is not in the dtype table");
  __builtin_unreachable();
}

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelThreshold = int64_t{1} << 16;

// Element loads go through memcpy because src may be unaligned; compilers turn it into a plain load.
template <typename T>
T load(const void* base, int64_t i) {
  T value;
  std::memcpy(&value, static_cast<const std::byte*>(base) + i * static_cast<int64_t>(sizeof(T)),
              sizeof(T));
  return value;
}

template <typename T>
void store(void* base, int64_t i, T value) {
  std::memcpy(static_cast<std::byte*>(base) + i * static_cast<int64_t>(sizeof(T)), &value, sizeof(T));
}

}  // namespace

size_t dtype_size(DType dtype) { return entry(dtype).size; }

std::string_view dtype_name(DType dtype) { return entry(dtype).name; }

std::optional<DType> parse_dtype(std::string_view name) {
  for (const DTypeEntry& e : kDTypes)
    if (e.name == name) return e.dtype;
  return std::nullopt;
}

bool is_floating(DType dtype) {
  return dtype == DType::F64 || dtype == DType::F32 || dtype == DType::F16 || dtype == DType::BF16;
}

void convert_to_f32(const void* src, DType src_dtype, float* dst, int64_t n) {
  TUNA_CHECK(n >= 0, "n = ", n);
  TUNA_CHECK(is_floating(src_dtype), "convert_to_f32 from ", dtype_name(src_dtype));
  switch (src_dtype) {
    case DType::F32:
      if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::F64:
#pragma omp parallel for if (n >= kParallelThreshold)
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(load<double>(src, i));
      return;
    case DType::F16:
#pragma omp parallel for if (n >= kParallelThreshold)
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(load<uint16_t>(src, i));
      return;
    case DType::BF16:
#pragma omp parallel for if (n >= kParallelThreshold)
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load<uint16_t>(src, i));
      return;
    default:
      return;  // excluded by the check above
  }
}

void convert_from_f32(const float* src, DType dst_dtype, void* dst, int64_t n) {
  TUNA_CHECK(n >= 0, "n = ", n);
  TUNA_CHECK(is_floating(dst_dtype), "convert_from_f32 to ", dtype_name(dst_dtype));
  switch (dst_dtype) {
    case DType::F32:
      if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::F64:
#pragma omp parallel for if (n >= kParallelThreshold)
      for (int64_t i = 0; i < n; ++i) store<double>(dst, i, static_cast<double>(src[i]));
      return;
    case DType::F16:
#pragma omp parallel for if (n >= kParallelThreshold)
      for (int64_t i = 0; i < n; ++i) store<uint16_t>(dst, i, f32_to_f16(src[i]));
      return;
    case DType::BF16:
#pragma omp parallel for if (n >= kParallelThreshold)
      for (int64_t i = 0; i < n; ++i) store<uint16_t>(dst, i, f32_to_bf16(src[i]));
      return;
    default:
      return;
  }
}

namespace {

// Non-finite means all exponent bits set (inf or NaN), whatever the sign and mantissa.
template <typename Bits>
bool exponent_all_ones(const void* src, int64_t i, Bits mask) {
  return (load<Bits>(src, i) & mask) == mask;
}

template <typename Bits>
int64_t first_with_exponent_all_ones(const void* src, int64_t n, Bits mask) {
  // Blocks so that threads can stop looking early within their block; the minimum over blocks is the first.
  constexpr int64_t kBlock = 1 << 16;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  int64_t first = n;
#pragma omp parallel for reduction(min : first) if (n >= kParallelThreshold)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t end = std::min(n, (b + 1) * kBlock);
    for (int64_t i = b * kBlock; i < end; ++i)
      if (exponent_all_ones<Bits>(src, i, mask)) {
        first = std::min(first, i);
        break;
      }
  }
  return first == n ? -1 : first;
}

}  // namespace

int64_t first_non_finite(const void* src, DType dtype, int64_t n) {
  TUNA_CHECK(n >= 0, "n = ", n);
  switch (dtype) {
    case DType::F64: return first_with_exponent_all_ones<uint64_t>(src, n, 0x7ff0000000000000ull);
    case DType::F32: return first_with_exponent_all_ones<uint32_t>(src, n, 0x7f800000u);
    case DType::F16: return first_with_exponent_all_ones<uint16_t>(src, n, uint16_t{0x7c00});
    case DType::BF16: return first_with_exponent_all_ones<uint16_t>(src, n, uint16_t{0x7f80});
    default: TUNA_CHECK(false, "first_non_finite of ", dtype_name(dtype));
  }
  return -1;
}

double element_as_double(const void* src, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::F64: return load<double>(src, i);
    case DType::F32: return load<float>(src, i);
    case DType::F16: return f16_to_f32(load<uint16_t>(src, i));
    case DType::BF16: return bf16_to_f32(load<uint16_t>(src, i));
    default: TUNA_CHECK(false, "element_as_double of ", dtype_name(dtype));
  }
  return 0;
}

}  // namespace tuna
