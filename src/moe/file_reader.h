// moe/file_reader.h: parallel readers that copy byte ranges of one file into caller memory,
// for the expert store. io_uring with O_DIRECT where the kernel and file system allow it
// (queue depth per reader, no page-cache copy), else pread on a buffered descriptor; the
// fallback is announced once, the bytes delivered are the same either way.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"

namespace kiln::moe {

// Direct I/O wants offset, length and destination aligned to the logical block size; 4 KiB
// covers every common device, so callers align to this.
inline constexpr uint64_t kDirectAlign = 4096;

// Tests only (fault injection): called before each read of `len` bytes at `offset`; returns
// how many bytes the read delivers (len: all; fewer: a short read, as at the end of a
// truncated file; negative: an I/O error, EIO). Set, it turns io_uring off.
using ReadFault = std::function<int64_t(uint64_t offset, uint64_t len)>;

struct FileReaderOptions {
  int32_t n_threads = 4;             // reader threads (each with its own ring)
  uint32_t queue_depth = 8;          // reads in flight per reader thread (io_uring)
  uint64_t chunk_bytes = 256 << 10;  // a request is split into reads of at most this size
  bool force_pread = false;          // skip io_uring and O_DIRECT (tests of the fallback path)
  ReadFault fault_for_testing;       // see ReadFault; empty in every real use
};

// One read: `dst.size()` bytes at `offset`. Both, and dst.data(), are multiples of
// kDirectAlign. The bytes past the end of the file (a read of the last tensor, rounded up)
// are left as they were.
struct ReadRequest {
  uint64_t offset = 0;
  std::span<std::byte> dst;
};

class FileReader {
 public:
  static Expected<std::unique_ptr<FileReader>> open(const std::string& path,
                                                    const FileReaderOptions& opt);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  // Queues `reqs`; `done` runs once, on a reader thread, after every read finished, with the
  // first error (ok if none). `done` must not call submit() recursively and wait on it.
  void submit(std::span<const ReadRequest> reqs, std::function<void(Status)> done);

  bool uses_uring() const { return uring_; }
  bool uses_direct() const { return direct_; }
  uint64_t file_size() const { return file_size_; }
  const std::string& path() const { return path_; }

 private:
  struct Batch;
  struct Job {
    uint64_t offset;
    std::byte* dst;
    uint64_t len;
    std::shared_ptr<Batch> batch;
  };
  FileReader() = default;
  void worker();
  Status read_pread(const Job& j) const;
  static void finish(const Job& j, const Status& s);

  std::string path_;
  int fd_ = -1;
  uint64_t file_size_ = 0;
  bool uring_ = false, direct_ = false;
  FileReaderOptions opt_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace kiln::moe
