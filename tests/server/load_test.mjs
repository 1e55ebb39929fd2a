// tests/server/load_test.mjs: N concurrent streaming clients against `kiln serve` on loopback
// for a fixed time (Node 20 fetch, no dependencies). Every stream must end with a
// finish_reason and data: [DONE]. Prints one JSON line of figures; exits 1 on any error.
// Usage: node load_test.mjs PORT API_KEY CLIENTS SECONDS
const [port, key, clientsArg, secondsArg] = process.argv.slice(2);
const clients = Number(clientsArg), seconds = Number(secondsArg);
const url = `http://127.0.0.1:${port}/v1/chat/completions`;
const deadline = Date.now() + seconds * 1000;
const stats = { streams: 0, errors: 0, incomplete: 0, chunks: 0, tokens: 0, ttft_ms: [], first_error: null };

async function one(i, k) {
  const t0 = Date.now();
  const res = await fetch(url, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${key}` },
    body: JSON.stringify({ model: 'stories260K', stream: true, max_tokens: 16 + (i % 17), seed: i * 1000 + k,
                           messages: [{ role: 'user', content: `Story ${i} ${k}` }],
                           stream_options: { include_usage: true } }),
    signal: AbortSignal.timeout(60000),
  });
  if (res.status !== 200) throw new Error(`status ${res.status}: ${await res.text()}`);
  const dec = new TextDecoder();
  let body = '', first = true;
  for await (const part of res.body) {
    if (first) { stats.ttft_ms.push(Date.now() - t0); first = false; }
    body += dec.decode(part, { stream: true });
  }
  const events = body.split('\n\n').filter((e) => e.length);
  const last = events[events.length - 1];
  let finish = null, usage = null;
  for (const e of events.slice(0, -1)) {
    const j = JSON.parse(e.slice(6));
    if (j.choices.length && j.choices[0].finish_reason) finish = j.choices[0].finish_reason;
    if (j.usage) usage = j.usage;
  }
  if (last !== 'data: [DONE]' || !finish || !usage) { stats.incomplete++; return; }
  stats.streams++;
  stats.chunks += events.length;
  stats.tokens += usage.completion_tokens;
}

async function worker(i) {
  for (let k = 0; Date.now() < deadline; k++) {
    try { await one(i, k); } catch (e) { stats.errors++; stats.first_error ??= String(e); }
  }
}
const t0 = Date.now();
await Promise.all(Array.from({ length: clients }, (_, i) => worker(i)));
const elapsed = (Date.now() - t0) / 1000;
stats.ttft_ms.sort((a, b) => a - b);
const pct = (p) => stats.ttft_ms.length ? stats.ttft_ms[Math.min(stats.ttft_ms.length - 1, Math.floor(p * stats.ttft_ms.length))] : 0;
const out = { clients, seconds: elapsed, streams: stats.streams, errors: stats.errors, incomplete: stats.incomplete,
              tokens: stats.tokens, tokens_per_s: stats.tokens / elapsed, ttft_p50_ms: pct(0.5), ttft_p99_ms: pct(0.99),
              first_error: stats.first_error };
console.log(JSON.stringify(out));
process.exit(stats.errors || stats.incomplete || !stats.streams ? 1 : 0);
