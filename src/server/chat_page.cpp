// server/chat_page.cpp: the chat page's three files (see chat_page.h). Edited here as they
// are served: HTML, CSS and JavaScript in raw strings, no build step, no external resource.
#include "server/chat_page.h"

#include <array>

namespace kiln::server {

namespace {

constexpr std::string_view kHtml = R"page(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>kiln chat</title>
<link rel="stylesheet" href="/chat.css">
<script src="/chat.js" defer></script>
</head>
<body data-state="loading">
<header>
  <h1>kiln <span id="model"></span></h1>
  <button id="clear" type="button">New chat</button>
</header>
<main id="log" role="log" aria-live="polite" aria-label="Conversation"></main>
<form id="form">
  <label for="input" class="hidden">Message</label>
  <textarea id="input" rows="3" placeholder="Message (Enter sends, Shift+Enter starts a new line)"></textarea>
  <div class="buttons">
    <button id="send" type="submit">Send</button>
    <button id="stop" type="button" disabled>Stop</button>
  </div>
  <details>
    <summary>Settings</summary>
    <label>System prompt <textarea id="system" rows="2"></textarea></label>
    <label>Temperature <input id="temp" type="number" min="0" max="2" step="0.1" placeholder="server default"></label>
    <label>Max tokens <input id="max" type="number" min="1" placeholder="until the end"></label>
    <label>API key <input id="key" type="password" autocomplete="off" placeholder="if the server needs one"></label>
  </details>
  <p id="status" role="status"></p>
</form>
</body>
</html>
)page";

constexpr std::string_view kCss =
    R"page(:root { color-scheme: light dark; --accent: #3b6fd8; --muted: #8888; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 52rem; min-height: 100vh; display: flex; flex-direction: column;
       font: 16px/1.5 system-ui, sans-serif; padding: 0 1rem; }
header { display: flex; align-items: center; justify-content: space-between; }
h1 { font-size: 1.2rem; }
#model { font-weight: normal; opacity: 0.7; }
#log { flex: 1; overflow-y: auto; }
.msg { margin: 0.75rem 0; padding: 0.5rem 0.75rem; border-radius: 0.5rem; border: 1px solid var(--muted); }
.msg.user { border-color: var(--accent); }
.msg.error { border-color: #d33; }
.who { display: block; font-size: 0.8rem; font-weight: bold; opacity: 0.7; }
.text { white-space: pre-wrap; overflow-wrap: anywhere; }
form { position: sticky; bottom: 0; padding: 0.5rem 0 1rem; background: Canvas; }
textarea, input { width: 100%; font: inherit; padding: 0.4rem; }
.buttons { display: flex; gap: 0.5rem; margin: 0.4rem 0; }
button { font: inherit; padding: 0.3rem 1rem; }
button:focus-visible, textarea:focus-visible, input:focus-visible { outline: 2px solid var(--accent); }
details label { display: block; margin: 0.3rem 0; }
#status { min-height: 1.5em; margin: 0; font-size: 0.9rem; opacity: 0.8; }
.hidden { position: absolute; width: 1px; height: 1px; overflow: hidden; clip: rect(0 0 0 0); }
)page";

constexpr std::string_view kJs =
    R"page(// chat.js: kiln's chat page. Plain DOM; the answer streams from /v1/chat/completions (SSE).
// document.body.dataset.state is "idle" or "streaming" (tests and scripts can wait on it).
'use strict';
const $ = (id) => document.getElementById(id);
const log = $('log'), input = $('input'), send = $('send'), stop = $('stop'), status = $('status');
let history = [];
let controller = null;

function headers() {
  const h = { 'Content-Type': 'application/json' };
  const key = $('key').value.trim();
  if (key) h.Authorization = 'Bearer ' + key;
  return h;
}

function add(role, text) {
  const msg = document.createElement('div');
  msg.className = 'msg ' + role;
  const who = document.createElement('span');
  who.className = 'who';
  who.textContent = role === 'user' ? 'You' : 'Assistant';
  const body = document.createElement('div');
  body.className = 'text';
  body.textContent = text;
  msg.append(who, body);
  log.append(msg);
  log.scrollTop = log.scrollHeight;
  return body;
}

function setBusy(on) {
  document.body.dataset.state = on ? 'streaming' : 'idle';
  send.disabled = on;
  stop.disabled = !on;
}

// Reads "data: ..." events; calls onEvent with each parsed JSON object.
async function readSse(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    for (let at; (at = buf.indexOf('\n\n')) >= 0;) {
      const ev = buf.slice(0, at);
      buf = buf.slice(at + 2);
      if (!ev.startsWith('data: ') || ev === 'data: [DONE]') continue;
      onEvent(JSON.parse(ev.slice(6)));
    }
  }
}

async function submit(event) {
  event.preventDefault();
  const text = input.value.trim();
  if (!text || controller) return;
  input.value = '';
  status.textContent = '';
  history.push({ role: 'user', content: text });
  add('user', text);
  const out = add('assistant', '');
  out.parentElement.setAttribute('aria-busy', 'true');
  setBusy(true);
  controller = new AbortController();
  const system = $('system').value.trim();
  const body = { messages: (system ? [{ role: 'system', content: system }] : []).concat(history),
                 stream: true };
  const temperature = parseFloat($('temp').value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($('max').value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  let answer = '';
  try {
    const r = await fetch('/v1/chat/completions', { method: 'POST', headers: headers(),
                                                    body: JSON.stringify(body),
                                                    signal: controller.signal });
    if (!r.ok) {
      const e = await r.json().catch(() => ({}));
      throw new Error(e.error?.message ?? 'HTTP ' + r.status);
    }
    await readSse(r, (j) => {
      if (j.error) throw new Error(j.error.message);
      const choice = j.choices?.[0];
      if (choice?.delta?.content) {
        answer += choice.delta.content;
        out.textContent = answer;
        log.scrollTop = log.scrollHeight;
      }
      if (choice?.finish_reason && choice.finish_reason !== 'stop')
        status.textContent = 'Finished: ' + choice.finish_reason;
    });
    history.push({ role: 'assistant', content: answer });
  } catch (e) {
    if (e.name === 'AbortError') {
      history.push({ role: 'assistant', content: answer });
      status.textContent = 'Stopped';
    } else {
      history.pop();
      out.parentElement.classList.add('error');
      out.textContent = (answer ? answer + '\n' : '') + 'Error: ' + e.message;
    }
  } finally {
    out.parentElement.removeAttribute('aria-busy');
    controller = null;
    setBusy(false);
    input.focus();
  }
}

$('form').addEventListener('submit', submit);
input.addEventListener('keydown', (e) => {
  if (e.key !== 'Enter' || e.shiftKey || e.isComposing) return;
  e.preventDefault();
  $('form').requestSubmit();
});
stop.addEventListener('click', () => controller?.abort());
$('clear').addEventListener('click', () => {
  controller?.abort();
  history = [];
  log.replaceChildren();
  status.textContent = '';
  input.focus();
});
// The model's name in the header; a server with --api-key says so until the key is given.
function showModel() {
  fetch('/v1/models', { headers: headers() })
    .then((r) => {
      if (r.status === 401) status.textContent = 'This server needs an API key: enter it under Settings.';
      return r.ok ? r.json() : null;
    })
    .then((m) => {
      if (!m?.data?.[0]) return;
      $('model').textContent = m.data[0].id;
      if (status.textContent.includes('API key')) status.textContent = '';
    })
    .catch(() => {});
}
$('key').addEventListener('change', showModel);
showModel();
setBusy(false);
input.focus();
)page";

constexpr std::array<StaticFile, 3> kFiles = {{
    {"/", "text/html; charset=utf-8", kHtml},
    {"/chat.css", "text/css; charset=utf-8", kCss},
    {"/chat.js", "text/javascript; charset=utf-8", kJs},
}};

}  // namespace

std::span<const StaticFile> chat_page_files() { return kFiles; }

std::string_view chat_page_csp() {
  return "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
         "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";
}

}  // namespace kiln::server
