// quant/convert.cpp: tensor re-encoding, row by row, on a few threads.
#include "quant/convert.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "quant/quant.h"

namespace kiln::quant {

Status convert_rows(DType from, DType to, int64_t row_len, int64_t n_rows,
                    std::span<const std::byte> src, std::span<std::byte> dst, int n_threads) {
  if (row_len <= 0 || n_rows < 0)
    return Status::errorf("convert: bad shape {} x {}", row_len, n_rows);
  const auto in_row = row_bytes(from, static_cast<uint64_t>(row_len));
  const auto out_row = row_bytes(to, static_cast<uint64_t>(row_len));
  if (!in_row)
    return Status::errorf("convert: row of {} elements is not whole {} blocks", row_len,
                          dtype_name(from));
  if (!out_row)
    return Status::errorf("convert: row of {} elements is not whole {} blocks of {}", row_len,
                          dtype_name(to), traits(to).block_size);
  if (src.size() != *in_row * static_cast<uint64_t>(n_rows) ||
      dst.size() != *out_row * static_cast<uint64_t>(n_rows))
    return Status::errorf("convert: {} -> {}: {} rows need {} -> {} bytes, got {} -> {}",
                          dtype_name(from), dtype_name(to), n_rows, *in_row * n_rows,
                          *out_row * n_rows, src.size(), dst.size());
  if (from == to) {
    std::memcpy(dst.data(), src.data(), src.size());
    return Status::ok();
  }
  if (!can_dequantize(from)) return Status::errorf("convert: cannot decode {}", dtype_name(from));
  if (!can_quantize(to)) return Status::errorf("convert: cannot encode {}", dtype_name(to));

  // Rows are independent; each worker takes the next unclaimed row. The first non-finite
  // row (lowest index) is reported, so the message does not depend on scheduling.
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> bad_row{n_rows};
  auto work = [&] {
    std::vector<float> buf(static_cast<size_t>(row_len));
    for (int64_t r = next++; r < n_rows; r = next++) {
      dequantize_row(from, src.subspan(static_cast<size_t>(r * *in_row), *in_row), buf);
      bool finite = true;
      for (float v : buf) finite &= std::isfinite(v);
      if (!finite) {
        int64_t cur = bad_row.load();
        while (r < cur && !bad_row.compare_exchange_weak(cur, r)) {
        }
        continue;
      }
      quantize_row(to, buf, dst.subspan(static_cast<size_t>(r * *out_row), *out_row));
    }
  };
  const int workers =
      static_cast<int>(std::clamp<int64_t>(n_threads, 1, std::max<int64_t>(n_rows, 1)));
  std::vector<std::thread> pool;
  for (int i = 1; i < workers; ++i) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (bad_row.load() < n_rows)
    return Status::errorf("row {} holds a NaN or infinite value", bad_row.load());
  return Status::ok();
}

}  // namespace kiln::quant
