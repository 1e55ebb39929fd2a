// tests/server/chat_page_test.mjs: kiln serve's chat page in headless Chromium, driven over
// the DevTools protocol on a pipe (--remote-debugging-pipe: no npm package, no port). Loads the
// page, types a message, sends it, waits for the streamed answer, and saves a screenshot.
// Fails on any console error or exception (a CSP violation shows as one).
// Usage: node chat_page_test.mjs CHROMIUM URL API_KEY SCREENSHOT.png
// Prints one JSON line: {"answer", "updates", "screenshot"}; exits non-zero with "FAIL: ...".
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const [chromium, url, key, shot] = process.argv.slice(2);
const profile = mkdtempSync(join(tmpdir(), 'kiln-chromium-'));
const browser = spawn(chromium, ['--headless=new', '--no-sandbox', '--disable-gpu', '--no-first-run',
                                 '--no-default-browser-check', '--window-size=1000,800',
                                 `--user-data-dir=${profile}`, '--remote-debugging-pipe'],
                      { stdio: ['ignore', 'ignore', 'pipe', 'pipe', 'pipe'] });
let stderr = '';
browser.stderr.on('data', (d) => { stderr += d; });
// Ends the test: Chromium is killed and waited for before its profile is removed (it writes
// there until it is gone).
const finish = (code, msg) => {
  if (msg) console.error(msg);
  browser.removeAllListeners('exit');
  const cleanup = () => {
    try { rmSync(profile, { recursive: true, force: true, maxRetries: 5 }); } catch {}
    process.exit(code);
  };
  if (browser.exitCode !== null || browser.signalCode !== null) return cleanup();
  browser.once('exit', cleanup);
  browser.kill('SIGKILL');
};
const fail = (m) => finish(1, 'FAIL: ' + m + (stderr ? '\nchromium stderr:\n' + stderr.slice(-2000) : ''));
setTimeout(() => fail('timed out after 90 s'), 90000).unref();
browser.on('exit', (code) => fail(`chromium exited (${code})`));

// The protocol: JSON messages, each ended by a NUL byte, on fds 3 (to) and 4 (from).
let nextId = 1, buf = Buffer.alloc(0);
const pending = new Map(), problems = [];
browser.stdio[4].on('data', (chunk) => {
  buf = Buffer.concat([buf, chunk]);
  for (let at; (at = buf.indexOf(0)) >= 0;) {
    const msg = JSON.parse(buf.subarray(0, at).toString());
    buf = buf.subarray(at + 1);
    if (msg.id && pending.has(msg.id)) {
      const { resolve, reject } = pending.get(msg.id);
      pending.delete(msg.id);
      if (msg.error) reject(new Error(JSON.stringify(msg.error)));
      else resolve(msg.result);
    } else if (msg.method === 'Runtime.exceptionThrown') {
      problems.push('exception: ' + JSON.stringify(msg.params.exceptionDetails));
    } else if (msg.method === 'Runtime.consoleAPICalled' && msg.params.type === 'error') {
      problems.push('console.error: ' + JSON.stringify(msg.params.args));
    } else if (msg.method === 'Log.entryAdded' && msg.params.entry.level === 'error' &&
               !msg.params.entry.url?.endsWith('/favicon.ico') &&
               // The model name asked for before the key is typed: the expected 401.
               !(msg.params.entry.url?.endsWith('/v1/models') && msg.params.entry.text.includes('401'))) {
      problems.push('log: ' + msg.params.entry.text);
    }
  }
});
let session;
const send = (method, params = {}) => {
  const id = nextId++;
  browser.stdio[3].write(JSON.stringify({ id, method, params, ...(session ? { sessionId: session } : {}) }) + '\0');
  return new Promise((resolve, reject) => pending.set(id, { resolve, reject }));
};
const evaluate = async (expression) => {
  const r = await send('Runtime.evaluate', { expression, awaitPromise: true, returnByValue: true });
  if (r.exceptionDetails) fail('evaluate: ' + JSON.stringify(r.exceptionDetails));
  return r.result.value;
};
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const until = async (what, expression, ms) => {
  for (const end = Date.now() + ms; Date.now() < end; await sleep(100))
    if (await evaluate(expression)) return;
  fail(what);
};

try {
  const { targetId } = await send('Target.createTarget', { url: 'about:blank' });
  ({ sessionId: session } = await send('Target.attachToTarget', { targetId, flatten: true }));
  await send('Runtime.enable');
  await send('Log.enable');
  await send('Page.enable');
  await send('Page.navigate', { url });
  await until('the page never became idle', `document.body?.dataset.state === 'idle'`, 15000);

  // Accessibility basics: the message box has a label, the conversation is a live log.
  const a11y = await evaluate(`({ label: document.querySelector('label[for=input]')?.textContent,
                                  log: document.getElementById('log').getAttribute('role'),
                                  lang: document.documentElement.lang })`);
  if (a11y.label !== 'Message' || a11y.log !== 'log' || a11y.lang !== 'en')
    fail('accessibility: ' + JSON.stringify(a11y));

  // The server wants a key: the page says so before anything is sent.
  await until('no API-key hint', `document.getElementById('status').textContent.includes('API key')`, 5000);

  // Count the answer's distinct texts as it streams in (300 tokens: many network reads).
  await evaluate(`window.kilnSeen = new Set();
    new MutationObserver(() => {
      const t = document.querySelector('.msg.assistant:last-child .text');
      if (t && t.textContent) window.kilnSeen.add(t.textContent);
    }).observe(document.getElementById('log'), { subtree: true, childList: true, characterData: true });
    document.getElementById('key').value = ${JSON.stringify(key)};
    document.getElementById('key').dispatchEvent(new Event('change'));
    document.getElementById('max').value = '300';
    document.getElementById('temp').value = '0';
    document.getElementById('input').value = 'Tell me a story about a cat.';
    document.getElementById('send').click();
    true`);
  await until('the answer never started', `document.body.dataset.state === 'streaming' ||
                                           document.querySelector('.msg.assistant')`, 10000);
  await until('the answer never finished', `document.body.dataset.state === 'idle'`, 60000);
  const out = await evaluate(`({
    user: document.querySelector('.msg.user .text')?.textContent,
    answer: document.querySelector('.msg.assistant .text')?.textContent,
    error: !!document.querySelector('.msg.error'),
    updates: window.kilnSeen.size })`);
  if (out.user !== 'Tell me a story about a cat.') fail('user message: ' + JSON.stringify(out));
  if (out.error || !out.answer) fail('no answer: ' + JSON.stringify(out));
  const model = await evaluate(`document.getElementById('model').textContent`);
  if (model !== 'stories260K') fail('model name after the key: ' + JSON.stringify(model));
  if (out.updates < 2) fail('the answer did not stream (one update): ' + JSON.stringify(out));
  const { data } = await send('Page.captureScreenshot', { format: 'png' });
  writeFileSync(shot, Buffer.from(data, 'base64'));
  if (problems.length) fail('page problems:\n' + problems.join('\n'));
  console.log(JSON.stringify({ answer: out.answer, updates: out.updates, screenshot: shot }));
  finish(0);
} catch (e) {
  fail(e.stack ?? String(e));
}
