// core/status.h: Status and Expected<T>, the error values returned at every boundary
// (bad input is a value with a message; broken invariants use KILN_CHECK instead).
#pragma once

#include <fmt/format.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace kiln {

// A failed operation's one-line message. The message names the object and the numbers
// involved ("tensor 'blk.0.attn_q.weight': offset 4096 + 8192 bytes past end of file (10000)").
class Status {
 public:
  Status() = default;  // ok
  static Status ok() { return Status(); }
  static Status error(std::string msg) {
    Status s;
    s.msg_ = std::move(msg);
    s.failed_ = true;
    return s;
  }
  template <typename... Args>
  static Status errorf(fmt::format_string<Args...> f, Args&&... args) {
    return error(fmt::format(f, std::forward<Args>(args)...));
  }
  bool is_ok() const { return !failed_; }
  explicit operator bool() const { return !failed_; }
  const std::string& message() const { return msg_; }
  // Prefix the message with context: "loading model: <msg>".
  Status context(std::string_view what) const {
    if (!failed_) return *this;
    return error(fmt::format("{}: {}", what, msg_));
  }

 private:
  std::string msg_;
  bool failed_ = false;
};

// Either a T or a failed Status. Accessing the value of a failed Expected aborts:
// callers must test first (the abort is an invariant violation, not input handling).
template <typename T>
class Expected {
 public:
  Expected(T value) : v_(std::move(value)) {}                    // NOLINT: implicit by design
  Expected(Status err) : v_(std::move(err)) { check_failed(); }  // NOLINT
  bool has_value() const { return v_.index() == 0; }
  explicit operator bool() const { return has_value(); }
  T& value() & {
    check_value();
    return std::get<0>(v_);
  }
  const T& value() const& {
    check_value();
    return std::get<0>(v_);
  }
  T&& value() && {
    check_value();
    return std::move(std::get<0>(v_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  const Status& status() const {
    static const Status ok_status;
    return has_value() ? ok_status : std::get<1>(v_);
  }
  const std::string& error() const { return status().message(); }

 private:
  void check_value() const {
    if (!has_value()) {
      fmt::print(stderr, "kiln: fatal: value of failed Expected accessed: {}\n",
                 std::get<1>(v_).message());
      std::abort();
    }
  }
  void check_failed() const {
    if (std::get<1>(v_).is_ok()) {
      fmt::print(stderr, "kiln: fatal: Expected constructed from an ok Status\n");
      std::abort();
    }
  }
  std::variant<T, Status> v_;
};

}  // namespace kiln

// Propagate a failed Status / Expected out of the current function.
#define KILN_TRY(expr)                                           \
  do {                                                           \
    auto&& kiln_try_s_ = (expr);                                 \
    if (!kiln_try_s_) return ::kiln::detail_status(kiln_try_s_); \
  } while (0)

namespace kiln {
inline Status detail_status(const Status& s) { return s; }
template <typename T>
inline Status detail_status(const Expected<T>& e) {
  return e.status();
}
}  // namespace kiln

#define KILN_CONCAT_INNER_(a, b) a##b
#define KILN_CONCAT_(a, b) KILN_CONCAT_INNER_(a, b)
// KILN_ASSIGN_OR_RETURN(auto x, expr): x = *expr or return its Status.
#define KILN_ASSIGN_OR_RETURN(lhs, expr)                                                 \
  auto KILN_CONCAT_(kiln_e_, __LINE__) = (expr);                                         \
  if (!KILN_CONCAT_(kiln_e_, __LINE__)) return KILN_CONCAT_(kiln_e_, __LINE__).status(); \
  lhs = std::move(*KILN_CONCAT_(kiln_e_, __LINE__))
