// tests/moe/memory_limit_test.cpp: the real limit. A qwen3moe model of ~200 MB (the shared
// fixture's layers with 128 experts instead of 8) runs a 256-token prefill and greedy steps in
// a child process whose private memory is capped far below the file (RLIMIT_DATA), with the
// file dropped from the page cache first; it must complete with the ids of an unlimited
// mapped run, and its peak RSS must stay well below the file while the mapped run's (the
// control, which shows the measurement can fail) approaches it.
//
// Why RLIMIT_DATA and not RLIMIT_AS: RLIMIT_AS counts the read-only mapping of the whole GGUF
// (the dense weights are views into it), so a limit below the file would refuse the mapping
// itself. RLIMIT_DATA counts private writable memory (heap, slabs, scratch, KV), not the shared
// file mapping; the streamed experts are read with io_uring/pread (O_DIRECT) into slabs, never
// faulted in through the mapping, which the peak-RSS check shows. A memory cgroup would also
// work but is not available in CI containers.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "backend/cpu/cpu_backend.h"
#include "common/testdata.h"
#include "engine/session.h"
#include "format/gguf_writer.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KILN_UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KILN_UNDER_SANITIZER 1
#endif
#endif

namespace kiln {
namespace {

constexpr int32_t kExperts = 128;

// The shared qwen3moe-f16 fixture with kExperts experts per layer: its dense tensors as they
// are, a router and expert tensors of random small f16 values (deterministic).
std::string make_big_moe(const std::string& dir) {
  auto src = GgufFile::open(testing::model_path("qwen3moe-f16.gguf"));
  KILN_CHECK(src.has_value(), "{}", src.error());
  GgufWriter w;
  w.copy_metadata(*src);
  w.set_u32("qwen3moe.expert_count", kExperts);
  for (const TensorInfo& t : src->tensors()) {
    std::vector<int64_t> ne(t.ne.begin(), t.ne.begin() + t.n_dims);
    const bool exps = t.name.find("_exps.") != std::string::npos;
    const bool router = t.name.find("ffn_gate_inp") != std::string::npos;
    if (!exps && !router) {
      w.add_tensor(t.name, t.dtype, ne, src->view(t).bytes);
      continue;
    }
    ne.back() = kExperts;
    const uint64_t seed = std::hash<std::string>{}(t.name);
    w.add_tensor_produced(t.name, t.dtype, ne, [seed, dt = t.dtype](std::span<std::byte> out) {
      std::mt19937_64 rng(seed);
      if (dt == DType::F32) {
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        for (size_t i = 0; i + 4 <= out.size(); i += 4) {
          const float f = u(rng);
          std::memcpy(out.data() + i, &f, 4);
        }
      } else {  // f16: random sign and mantissa, exponent 2^-5 (|x| in [0.03, 0.06))
        for (size_t i = 0; i + 8 <= out.size(); i += 8) {
          uint64_t r = rng() & 0x83FF83FF83FF83FFull;
          r |= 0x2800280028002800ull;
          std::memcpy(out.data() + i, &r, 8);
        }
      }
      return Status::ok();
    });
  }
  const std::string path = dir + "/big-qwen3moe-f16.gguf";
  const Status s = w.write(path);
  KILN_CHECK(s.is_ok(), "{}", s.message());
  return path;
}

struct ChildResult {
  int exit_code = -1;
  std::vector<int32_t> ids;
  std::string error;
  uint64_t max_rss = 0;  // bytes
};

// Runs the prompt + greedy steps in a child process under RLIMIT_DATA = data_limit (0: none).
ChildResult run_child(const std::string& path, const moe::StoreConfig& cfg, uint64_t data_limit) {
  int fds[2];
  KILN_CHECK(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  KILN_CHECK(pid >= 0, "fork: {}", std::strerror(errno));
  if (pid == 0) {
    ::close(fds[0]);
    auto fail = [&](const std::string& msg) {
      const int32_t n = -1;
      (void)!::write(fds[1], &n, 4);
      (void)!::write(fds[1], msg.data(), msg.size());
      ::_exit(2);
    };
    if (data_limit) {
      rlimit rl{data_limit, data_limit};
      if (::setrlimit(RLIMIT_DATA, &rl) != 0) fail("setrlimit failed");
    }
    auto m = Model::load(path, cfg);
    if (!m.has_value()) fail(m.error());
    auto be = make_cpu_backend({.threads = 1});
    Session s(*m, *be, 320);
    std::vector<int32_t> prompt;
    for (int i = 0; i < 256; ++i) prompt.push_back(1 + (i * 37) % 500);
    std::vector<int32_t> ids;
    auto lg = s.eval(prompt, false);
    for (int step = 0; step < 4 && lg.has_value(); ++step) {
      const int32_t id =
          static_cast<int32_t>(std::max_element(lg->begin(), lg->end()) - lg->begin());
      ids.push_back(id);
      lg = s.eval(std::span<const int32_t>(&id, 1), false);
    }
    if (!lg.has_value()) fail(lg.error());
    const int32_t n = static_cast<int32_t>(ids.size());
    (void)!::write(fds[1], &n, 4);
    (void)!::write(fds[1], ids.data(), ids.size() * 4);
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string got;
  char buf[4096];
  for (ssize_t r; (r = ::read(fds[0], buf, sizeof buf)) != 0;) {
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) break;
    got.append(buf, static_cast<size_t>(r));
  }
  ::close(fds[0]);
  ChildResult res;
  int status = 0;
  rusage ru{};
  KILN_CHECK(::wait4(pid, &status, 0, &ru) == pid);
  res.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  res.max_rss = static_cast<uint64_t>(ru.ru_maxrss) * 1024;
  if (got.size() >= 4) {
    int32_t n = 0;
    std::memcpy(&n, got.data(), 4);
    if (n < 0) {
      res.error = got.substr(4);
    } else if (got.size() == 4 + 4 * static_cast<size_t>(n)) {
      res.ids.resize(static_cast<size_t>(n));
      std::memcpy(res.ids.data(), got.data() + 4, 4 * static_cast<size_t>(n));
    }
  }
  return res;
}

void drop_page_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ::fdatasync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);  // best effort: a hint, not a guarantee
  ::close(fd);
}

TEST(MemoryLimit, StreamsAModelLargerThanItsPrivateMemoryLimit) {
#ifdef KILN_UNDER_SANITIZER
  GTEST_SKIP() << "sanitizer shadow memory counts toward RLIMIT_DATA; runs in the release suite";
#else
  const std::string dir = testing::temp_dir();
  const std::string path = make_big_moe(dir);
  const uint64_t file_size = GgufFile::open(path)->file_size();
  const uint64_t limit = 96ull << 20;
  ASSERT_LT(limit, file_size / 2);

  drop_page_cache(path);
  const ChildResult streamed = run_child(path, {.cap = 2, .n_readers = 2}, limit);
  EXPECT_EQ(streamed.exit_code, 0) << streamed.error;
  ASSERT_EQ(streamed.ids.size(), 4u) << streamed.error;

  drop_page_cache(path);
  const ChildResult mapped = run_child(path, {}, 0);
  EXPECT_EQ(mapped.exit_code, 0) << mapped.error;
  EXPECT_EQ(streamed.ids, mapped.ids);
  std::printf(
      "[ limit ] file %.1f MiB, RLIMIT_DATA %.1f MiB; peak RSS streamed %.1f MiB, "
      "mapped %.1f MiB\n",
      file_size / 1048576.0, limit / 1048576.0, streamed.max_rss / 1048576.0,
      mapped.max_rss / 1048576.0);
  EXPECT_LT(streamed.max_rss, file_size / 2);
  EXPECT_GT(mapped.max_rss, file_size * 7 / 10) << "the control did not touch the experts";
  std::remove(path.c_str());
#endif
}

}  // namespace
}  // namespace kiln
