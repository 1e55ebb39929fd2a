// tokenizer/jinja/chat_template.cpp: the library boundary. Interpreter errors (C++
// exceptions internal to jinja/) become Status values here; nothing throws past this file.
#include "tokenizer/jinja/chat_template.h"

#include <fmt/format.h>

#include <cstdio>
#include <ctime>

#include "tokenizer/jinja/interp.h"
#include "tokenizer/jinja/parser.h"

namespace kiln {
namespace {
using namespace jinja;

constexpr int64_t kMaxRange = 100000;  // jinja2.sandbox.MAX_RANGE

Expected<std::tm> parse_now(const std::optional<std::string>& now) {
  std::tm tm{};
  if (!now) {
    std::time_t t = std::time(nullptr);
    localtime_r(&t, &tm);
    return tm;
  }
  int y, mo, d, h = 0, mi = 0, s = 0;
  int n = std::sscanf(now->c_str(), "%d-%d-%dT%d:%d:%d", &y, &mo, &d, &h, &mi, &s);
  if (n < 3 || mo < 1 || mo > 12 || d < 1 || d > 31 || h < 0 || h > 23 || mi < 0 || mi > 59 ||
      s < 0 || s > 60)
    return Status::errorf("bad date '{}' for strftime_now (want YYYY-MM-DDTHH:MM:SS)", *now);
  tm.tm_year = y - 1900;
  tm.tm_mon = mo - 1;
  tm.tm_mday = d;
  tm.tm_hour = h;
  tm.tm_min = mi;
  tm.tm_sec = s;
  std::time_t t = timegm(&tm);  // fills tm_wday / tm_yday
  gmtime_r(&t, &tm);
  return tm;
}

ScopePtr make_globals(const nlohmann::ordered_json& ctx, const std::tm& now) {
  auto g = std::make_shared<Scope>();
  g->vars["raise_exception"] =
      Value::function("raise_exception", [](Interp&, CallArgs& a) -> Value {
        fail("TemplateError", a.pos.empty() ? std::string() : py_str(a.pos[0]));
      });
  g->vars["strftime_now"] = Value::function("strftime_now", [now](Interp&, CallArgs& a) {
    if (a.pos.empty() || !a.pos[0].is_string()) type_error("strftime_now() needs a format string");
    if (a.pos[0].s.size() > 256) fail("ValueError", "format string too long");
    char buf[1024];
    size_t n = std::strftime(buf, sizeof buf, a.pos[0].s.c_str(), &now);
    return Value::string(std::string(buf, n));
  });
  g->vars["range"] = Value::function("range", [](Interp&, CallArgs& a) {
    int64_t start = 0, stop = 0, step = 1;
    for (const auto& v : a.pos)
      if (!v.is_int_like())
        type_error(fmt::format("'{}' object cannot be interpreted as an integer", py_type_name(v)));
    if (a.pos.size() == 1)
      stop = a.pos[0].as_int();
    else if (a.pos.size() >= 2) {
      start = a.pos[0].as_int();
      stop = a.pos[1].as_int();
      if (a.pos.size() >= 3) step = a.pos[2].as_int();
    } else
      type_error("range expected at least 1 argument, got 0");
    if (step == 0) fail("ValueError", "range() arg 3 must not be zero");
    std::vector<Value> out;
    for (int64_t k = start; step > 0 ? k < stop : k > stop;) {
      if (static_cast<int64_t>(out.size()) >= kMaxRange)
        fail("OverflowError",
             fmt::format("Range too big. The sandbox blocks ranges larger than MAX_RANGE ({}).",
                         kMaxRange));
      out.push_back(Value::integer(k));
      if (__builtin_add_overflow(k, step, &k)) break;  // past int64 is past stop too
    }
    return Value::new_list(std::move(out));
  });
  auto make_dict = [](Interp&, CallArgs& a, Dict::Kind kind) {
    Value d = Value::new_dict();
    d.dict->kind = kind;
    if (!a.pos.empty()) {
      if (!a.pos[0].is_dict()) type_error("dict() argument must be a mapping");
      d.dict->items = a.pos[0].dict->items;
    }
    for (const auto& [k, v] : a.kw) d.dict->set(k, v);
    return d;
  };
  g->vars["dict"] = Value::function(
      "dict", [make_dict](Interp& in, CallArgs& a) { return make_dict(in, a, Dict::Kind::Plain); });
  g->vars["namespace"] = Value::function("namespace", [make_dict](Interp& in, CallArgs& a) {
    return make_dict(in, a, Dict::Kind::Namespace);
  });
  g->vars["joiner"] = Value::function("joiner", [](Interp&, CallArgs& a) {
    std::string sep = a.pos.empty() ? ", " : py_str(a.pos[0]);
    auto used = std::make_shared<bool>(false);
    return Value::function("joiner", [sep, used](Interp&, CallArgs&) {
      if (!*used) {
        *used = true;
        return Value::string("");
      }
      return Value::string(sep);
    });
  });
  if (ctx.is_object())
    for (auto it = ctx.begin(); it != ctx.end(); ++it) g->vars[it.key()] = from_json(it.value());
  return g;
}

}  // namespace

Expected<ChatTemplate> ChatTemplate::parse(std::string_view source) {
  try {
    ChatTemplate t;
    t.tmpl_ = std::make_shared<const Template>(jinja::parse(source));
    t.source_ = std::make_shared<const std::string>(source);
    return t;
  } catch (const jinja::Error& e) {
    return Status::error(e.what());
  } catch (const std::exception& e) {
    return Status::errorf("TemplateError: {}", e.what());
  }
}

Expected<std::string> ChatTemplate::render(const nlohmann::ordered_json& context,
                                           const ChatTemplateOptions& opt) const {
  if (!tmpl_) return Status::error("TemplateError: template not parsed");
  if (!context.is_object() && !context.is_null())
    return Status::error("TemplateError: context must be a JSON object");
  KILN_ASSIGN_OR_RETURN(std::tm now, parse_now(opt.now));
  try {
    RenderLimits limits;
    limits.max_output_bytes = opt.max_output_bytes;
    limits.max_steps = opt.max_steps;
    limits.max_time = opt.max_time;
    // The context's own values are made before the budget starts: the cap bounds what the
    // template makes.
    jinja::MemoryBudget budget{
        .live = 0,
        .cap = int64_t(opt.max_memory_bytes + 4 * (context.is_null() ? 0 : context.dump().size()))};
    Interp in(make_globals(context, now), limits);
    const jinja::MemoryBudgetScope scope(&budget);
    return in.render(*tmpl_);
  } catch (const jinja::Error& e) {
    return Status::error(e.what());
  } catch (const std::bad_alloc&) {
    return Status::error("MemoryError: out of memory while rendering the template");
  } catch (const std::exception& e) {
    return Status::errorf("TemplateError: {}", e.what());
  }
}

Expected<std::string> render_chat_template(std::string_view source,
                                           const nlohmann::ordered_json& context,
                                           const ChatTemplateOptions& opt) {
  KILN_ASSIGN_OR_RETURN(ChatTemplate t, ChatTemplate::parse(source));
  return t.render(context, opt);
}

}  // namespace kiln
