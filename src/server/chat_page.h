// server/chat_page.h: the chat web page `kiln serve` answers at `/`: one static HTML page with
// its script and style as separate same-origin files (so a strict Content-Security-Policy
// holds: no inline script or style, nothing from another origin), compiled into the binary.
// The page streams from /v1/chat/completions; there is no build step.
#pragma once

#include <span>
#include <string_view>

namespace kiln::server {

struct StaticFile {
  std::string_view path;          // the route, e.g. "/chat.js"
  std::string_view content_type;  // with charset where text
  std::string_view body;
};

// "/", "/chat.js", "/chat.css".
std::span<const StaticFile> chat_page_files();

// The Content-Security-Policy the page is served with: same-origin script, style and fetch.
std::string_view chat_page_csp();

}  // namespace kiln::server
