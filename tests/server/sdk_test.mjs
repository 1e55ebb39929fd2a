// tests/server/sdk_test.mjs: the official OpenAI Node SDK against `kiln serve` on loopback
// (run by node_e2e_test.cpp from a folder where `npm install openai` put node_modules).
// Usage: node sdk_test.mjs PORT API_KEY. Exits non-zero with "FAIL: ..." on any mismatch.
import OpenAI from 'openai';

const [port, key] = process.argv.slice(2);
const baseURL = `http://127.0.0.1:${port}/v1`;
const client = new OpenAI({ baseURL, apiKey: key, maxRetries: 0, timeout: 30000 });
const fail = (m) => { console.error('FAIL: ' + m); process.exit(1); };
const check = (c, m) => { if (!c) fail(m); };
const noEos = { '2': -100 };

const models = await client.models.list();
check(models.data.length === 1 && models.data[0].id === 'stories260K', 'models.list: ' + JSON.stringify(models.data));

const req = { model: 'stories260K', messages: [{ role: 'system', content: 'Tell stories.' }, { role: 'user', content: 'A dog' }],
              max_tokens: 12, seed: 7, temperature: 0.8, logit_bias: noEos };
const chat = await client.chat.completions.create(req);
check(chat.object === 'chat.completion', 'chat object');
check(chat.choices[0].message.role === 'assistant', 'chat role');
check(chat.choices[0].message.content.length > 0, 'chat content empty');
check(chat.choices[0].finish_reason === 'length', 'chat finish ' + chat.choices[0].finish_reason);
check(chat.usage.completion_tokens === 12, 'chat usage ' + JSON.stringify(chat.usage));

const stream = await client.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } });
let text = '', finish = null, usage = null, n = 0;
for await (const chunk of stream) {
  n++;
  if (chunk.choices.length) {
    text += chunk.choices[0].delta.content ?? '';
    if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
  }
  if (chunk.usage) usage = chunk.usage;
}
check(text === chat.choices[0].message.content, `stream text ${JSON.stringify(text)} != ${JSON.stringify(chat.choices[0].message.content)}`);
check(finish === 'length', 'stream finish ' + finish);
check(usage && usage.completion_tokens === 12 && usage.prompt_tokens === chat.usage.prompt_tokens, 'stream usage ' + JSON.stringify(usage));

const comp = await client.completions.create({ model: 'stories260K', prompt: 'Once upon a time', max_tokens: 8, temperature: 0, stop: ['zzz'] });
check(comp.object === 'text_completion' && comp.choices[0].text.length > 0, 'completion ' + JSON.stringify(comp));

const lp = await client.chat.completions.create({ ...req, max_tokens: 3, logprobs: true, top_logprobs: 2 });
check(lp.choices[0].logprobs.content.length === 3 && lp.choices[0].logprobs.content[0].top_logprobs.length === 2, 'logprobs');

// n choices, as the SDK types them: indexed, the prompt counted once.
const many = await client.chat.completions.create({ ...req, n: 3 });
check(many.choices.length === 3 && many.choices.every((c, i) => c.index === i && c.message.content.length > 0),
      'n=3 choices ' + JSON.stringify(many.choices));
check(many.usage.completion_tokens === 36 && many.usage.prompt_tokens === chat.usage.prompt_tokens, 'n=3 usage ' + JSON.stringify(many.usage));
check(many.choices[0].message.content === chat.choices[0].message.content, 'choice 0 is the seed\'s sample');
const manyStream = await client.chat.completions.create({ ...req, n: 2, stream: true });
const streamed = ['', ''];
for await (const chunk of manyStream) for (const c of chunk.choices) streamed[c.index] += c.delta.content ?? '';
check(streamed[0] === chat.choices[0].message.content && streamed[1] === many.choices[1].message.content,
      'n=2 stream ' + JSON.stringify(streamed));

// Forcing a call where the model's template has no tool format: a 400 the SDK raises.
try {
  await client.chat.completions.create({ ...req, tools: [{ type: 'function', function: { name: 'f' } }], tool_choice: 'required' });
  fail('tools accepted without a template');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.status === 400, 'forced call without a template: ' + e);
}

try {
  await client.chat.completions.create({ model: 'stories260K', messages: [{ role: 'wizard', content: 'x' }] });
  fail('unknown role accepted');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError, 'unknown role: ' + e);
  check(e.status === 400 && e.code === 'invalid_value' && /wizard/.test(e.message), 'error shape: ' + e.message);
}
try {
  await client.chat.completions.create({ ...req, max_tokens: 100000 });
  fail('huge max_tokens accepted');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.status === 400, 'huge max_tokens: ' + e);
}
try {
  await new OpenAI({ baseURL, apiKey: 'wrong', maxRetries: 0 }).models.list();
  fail('wrong key accepted');
} catch (e) {
  check(e instanceof OpenAI.AuthenticationError && e.status === 401, 'wrong key: ' + e);
}
console.log(JSON.stringify({ ok: true, chunks: n, text }));
