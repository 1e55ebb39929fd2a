// moe/file_reader.cpp: reader threads over io_uring (or pread), see file_reader.h.
#include "moe/file_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/check.h"
#include "core/log.h"

#if KILN_HAVE_URING
#include <liburing.h>
#endif

namespace kiln::moe {

struct FileReader::Batch {
  std::atomic<size_t> remaining{0};
  std::mutex mu;
  Status first;  // first error of any read in the batch
  std::function<void(Status)> done;
};

namespace {

struct AlignedBuf {
  explicit AlignedBuf(size_t n) : p(static_cast<std::byte*>(std::aligned_alloc(kDirectAlign, n))) {}
  ~AlignedBuf() { std::free(p); }
  std::byte* p;
};

// Reads [offset, offset + len) into dst until done or EOF; `need` bytes must arrive.
Status pread_full(int fd, std::byte* dst, uint64_t offset, uint64_t len, uint64_t need,
                  const std::string& path) {
  uint64_t got = 0;
  while (got < len) {
    const ssize_t r = ::pread(fd, dst + got, len - got, static_cast<off_t>(offset + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return Status::errorf("reading '{}' at {}: {}", path, offset + got, std::strerror(errno));
    }
    if (r == 0) break;
    got += static_cast<uint64_t>(r);
  }
  if (got < need)
    return Status::errorf("reading '{}' at {}: file ended after {} of {} bytes", path, offset, got,
                          need);
  return Status::ok();
}

#if KILN_HAVE_URING
// Empty string: io_uring works for reads of this descriptor; else why not.
std::string probe_uring(int fd) {
  io_uring ring;
  if (int r = io_uring_queue_init(4, &ring, 0); r < 0)
    return fmt::format("io_uring_queue_init: {}", std::strerror(-r));
  AlignedBuf buf(kDirectAlign);
  io_uring_sqe* sqe = io_uring_get_sqe(&ring);
  io_uring_prep_read(sqe, fd, buf.p, kDirectAlign, 0);
  std::string why;
  if (int r = io_uring_submit(&ring); r != 1) {
    why = fmt::format("io_uring_submit: {}", r < 0 ? std::strerror(-r) : "nothing submitted");
  } else {
    io_uring_cqe* cqe = nullptr;
    if (int w = io_uring_wait_cqe(&ring, &cqe); w < 0) {
      why = fmt::format("io_uring_wait_cqe: {}", std::strerror(-w));
    } else {
      if (cqe->res < 0) why = fmt::format("io_uring read: {}", std::strerror(-cqe->res));
      io_uring_cqe_seen(&ring, cqe);
    }
  }
  io_uring_queue_exit(&ring);
  return why;
}
#endif

}  // namespace

Expected<std::unique_ptr<FileReader>> FileReader::open(const std::string& path,
                                                       const FileReaderOptions& opt) {
  if (opt.n_threads < 1 || opt.queue_depth < 1 || opt.chunk_bytes < kDirectAlign ||
      opt.chunk_bytes % kDirectAlign != 0)
    return Status::errorf(
        "file reader: {} threads, queue depth {}, chunk {} bytes (need >= 1, "
        ">= 1, a multiple of {})",
        opt.n_threads, opt.queue_depth, opt.chunk_bytes, kDirectAlign);
  std::unique_ptr<FileReader> fr(new FileReader());
  fr->path_ = path;
  fr->opt_ = opt;
  fr->opt_.force_pread = opt.force_pread || static_cast<bool>(opt.fault_for_testing);
  // Direct I/O keeps streamed experts out of the page cache (the point of streaming is that
  // they do not fit); a file system that refuses it (tmpfs, some overlays) reads buffered.
  int fd = fr->opt_.force_pread ? -1 : ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  if (fd >= 0) {
    AlignedBuf buf(kDirectAlign);
    if (::pread(fd, buf.p, kDirectAlign, 0) < 0) {
      ::close(fd);
      fd = -1;
    }
  }
  fr->direct_ = fd >= 0;
  if (fd < 0) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::errorf("cannot open '{}': {}", path, std::strerror(errno));
  fr->fd_ = fd;
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    return Status::errorf("cannot stat '{}': {}", path, std::strerror(errno));
  fr->file_size_ = static_cast<uint64_t>(st.st_size);

  std::string why = "io_uring disabled for this store";
#if KILN_HAVE_URING
  if (!fr->opt_.force_pread) why = probe_uring(fd);
  fr->uring_ = why.empty();
#else
  why = "built without liburing";
#endif
  if (!fr->uring_) log_notice("expert store: reading '{}' with pread ({})", path, why);
  fr->threads_.reserve(static_cast<size_t>(opt.n_threads));
  for (int32_t i = 0; i < opt.n_threads; ++i)
    fr->threads_.emplace_back([r = fr.get()] { r->worker(); });
  return fr;
}

FileReader::~FileReader() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  if (fd_ >= 0) ::close(fd_);
}

void FileReader::submit(std::span<const ReadRequest> reqs, std::function<void(Status)> done) {
  auto batch = std::make_shared<Batch>();
  batch->done = std::move(done);
  std::vector<Job> jobs;
  for (const ReadRequest& r : reqs) {
    KILN_CHECK(r.offset % kDirectAlign == 0 && r.dst.size() % kDirectAlign == 0 &&
                   reinterpret_cast<uintptr_t>(r.dst.data()) % kDirectAlign == 0,
               "unaligned read of {} bytes at {}", r.dst.size(), r.offset);
    for (uint64_t o = 0; o < r.dst.size(); o += opt_.chunk_bytes)
      jobs.push_back(Job{r.offset + o, r.dst.data() + o,
                         std::min<uint64_t>(opt_.chunk_bytes, r.dst.size() - o), batch});
  }
  if (jobs.empty()) {
    batch->done(Status::ok());
    return;
  }
  batch->remaining.store(jobs.size(), std::memory_order_relaxed);
  {
    std::lock_guard lock(mu_);
    for (Job& j : jobs) queue_.push_back(std::move(j));
  }
  cv_.notify_all();
}

void FileReader::finish(const Job& j, const Status& s) {
  Batch& b = *j.batch;
  if (!s) {
    std::lock_guard lock(b.mu);
    if (b.first) b.first = s;
  }
  if (b.remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    Status first;
    {
      std::lock_guard lock(b.mu);
      first = b.first;
    }
    b.done(first);
  }
}

Status FileReader::read_pread(const Job& j) const {
  const uint64_t need = j.offset >= file_size_ ? 0 : std::min(j.len, file_size_ - j.offset);
  if (opt_.fault_for_testing) {
    const int64_t give = opt_.fault_for_testing(j.offset, j.len);
    if (give < 0)
      return Status::errorf("reading '{}' at {}: {}", path_, j.offset, std::strerror(EIO));
    if (static_cast<uint64_t>(give) < j.len)  // a short read: what a truncated file gives
      return pread_full(fd_, j.dst, j.offset, static_cast<uint64_t>(give), need, path_);
  }
  return pread_full(fd_, j.dst, j.offset, j.len, need, path_);
}

void FileReader::worker() {
#if KILN_HAVE_URING
  io_uring ring;
  bool have_ring = uring_ && io_uring_queue_init(opt_.queue_depth, &ring, 0) == 0;
#endif
  std::vector<Job> batch;
  for (;;) {
    batch.clear();
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) break;  // stop_ and nothing left
      while (!queue_.empty() && batch.size() < opt_.queue_depth) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
#if KILN_HAVE_URING
    if (have_ring) {
      std::vector<Status> st(batch.size());
      for (size_t i = 0; i < batch.size(); ++i) {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring);
        KILN_CHECK(sqe != nullptr, "io_uring queue depth {} exceeded", opt_.queue_depth);
        io_uring_prep_read(sqe, fd_, batch[i].dst, static_cast<unsigned>(batch[i].len),
                           batch[i].offset);
        io_uring_sqe_set_data64(sqe, i);
      }
      int submitted = io_uring_submit(&ring);
      if (submitted < 0) submitted = 0;
      std::vector<bool> seen(batch.size(), false);
      for (int c = 0; c < submitted; ++c) {
        io_uring_cqe* cqe = nullptr;
        int w = 0;
        do w = io_uring_wait_cqe(&ring, &cqe);
        while (w == -EINTR);
        // A read in flight cannot be abandoned (the kernel still writes into dst).
        KILN_CHECK(w == 0, "io_uring_wait_cqe on '{}': {}", path_, std::strerror(-w));
        const size_t i = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
        const int res = cqe->res;
        io_uring_cqe_seen(&ring, cqe);
        seen[i] = true;
        const Job& j = batch[i];
        if (res < 0) {
          st[i] = Status::errorf("reading '{}' at {}: {}", path_, j.offset, std::strerror(-res));
        } else if (static_cast<uint64_t>(res) < j.len) {
          // Short read (EOF or interrupted): the rest synchronously.
          const uint64_t got = static_cast<uint64_t>(res);
          const uint64_t need = j.offset >= file_size_ ? 0 : std::min(j.len, file_size_ - j.offset);
          if (got < need)
            st[i] = pread_full(fd_, j.dst + got, j.offset + got, j.len - got, need - got, path_);
        }
      }
      // Anything the ring did not complete (submit refused part of it) goes through pread.
      for (size_t i = 0; i < batch.size(); ++i)
        if (!seen[i]) st[i] = read_pread(batch[i]);
      for (size_t i = 0; i < batch.size(); ++i) finish(batch[i], st[i]);
      continue;
    }
#endif
    for (const Job& j : batch) finish(j, read_pread(j));
  }
#if KILN_HAVE_URING
  if (have_ring) io_uring_queue_exit(&ring);
#endif
}

}  // namespace kiln::moe
