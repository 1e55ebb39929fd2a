// tests/server/sdk_tools_test.mjs: tool calling through the official OpenAI Node SDK against
// `kiln serve` on a stories260K copy whose token 300 reads as a whole Hermes call and whose
// template is Hermes 3's (node_e2e_test.cpp writes it). A +100 logit bias makes that token the
// reply, so the SDK sees a real tool-call response: message.tool_calls, streamed tool-call
// deltas, then the round trip (the call and the tool's answer sent back).
// Usage: node sdk_tools_test.mjs PORT API_KEY. Exits non-zero with "FAIL: ..." on a mismatch.
import OpenAI from 'openai';

const [port, key] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `http://127.0.0.1:${port}/v1`, apiKey: key, maxRetries: 0, timeout: 30000 });
const fail = (m) => { console.error('FAIL: ' + m); process.exit(1); };
const check = (c, m) => { if (!c) fail(m); };

const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Get the weather',
  parameters: { type: 'object', properties: { city: { type: 'string' }, unit: { type: 'string' } }, required: ['city'] } } }];
const messages = [{ role: 'user', content: 'Weather in Paris?' }];
const req = { model: 'hermes', messages, tools, tool_choice: 'auto', max_tokens: 3, temperature: 0,
              logit_bias: { '300': 100 }, stop: ['</tool_call>'] };
const args = '{"city":"Paris","unit":"celsius"}';

const r = await client.chat.completions.create(req);
const msg = r.choices[0].message;
check(r.choices[0].finish_reason === 'tool_calls', 'finish ' + r.choices[0].finish_reason);
check(msg.content === null, 'content ' + JSON.stringify(msg.content));
check(msg.tool_calls?.length === 1, 'tool_calls ' + JSON.stringify(msg.tool_calls));
const call = msg.tool_calls[0];
check(call.type === 'function' && call.function.name === 'get_weather' && call.function.arguments === args,
      'call ' + JSON.stringify(call));
check(/^call_[A-Za-z0-9]{24}$/.test(call.id), 'id ' + call.id);
check(JSON.parse(call.function.arguments).city === 'Paris', 'arguments parse');

// Streamed: the SDK's accumulated final message equals the non-streamed one.
const stream = client.beta?.chat?.completions?.stream
  ? client.beta.chat.completions.stream({ ...req, stream: true })
  : client.chat.completions.stream({ ...req, stream: true });
let deltas = 0;
stream.on('chunk', (c) => { if (c.choices[0]?.delta?.tool_calls) deltas++; });
const final = await stream.finalChatCompletion();
const sc = final.choices[0];
check(deltas === 1, 'tool-call deltas ' + deltas);
check(sc.finish_reason === 'tool_calls', 'stream finish ' + sc.finish_reason);
check(sc.message.tool_calls?.length === 1 && sc.message.tool_calls[0].function.name === 'get_weather' &&
      sc.message.tool_calls[0].function.arguments === args, 'stream call ' + JSON.stringify(sc.message));
check(!sc.message.content, 'stream content ' + JSON.stringify(sc.message.content));

// Round trip: the assistant's call as the SDK returned it, the tool's answer, a plain reply.
const back = await client.chat.completions.create({
  model: 'hermes', tools, max_tokens: 4, temperature: 0,
  messages: [...messages, msg, { role: 'tool', tool_call_id: call.id, content: '{"temperature": 21}' }] });
check(back.choices[0].message.role === 'assistant' && back.usage.prompt_tokens > r.usage.prompt_tokens,
      'round trip ' + JSON.stringify(back));

// A forced call (constrained decoding): the model, which would otherwise write anything, must
// call the named function with arguments its schema allows, whole and streamed.
const forcedTools = [{ type: 'function', function: { name: 'get_weather', description: 'Get the weather',
  parameters: { type: 'object', properties: { city: { enum: ['Paris', 'Oslo'] } }, required: ['city'] } } }];
const forced = { model: 'hermes', messages, tools: forcedTools, max_tokens: 120, temperature: 0,
                 tool_choice: { type: 'function', function: { name: 'get_weather' } }, parallel_tool_calls: false };
const f = await client.chat.completions.create(forced);
check(f.choices[0].finish_reason === 'tool_calls' && f.choices[0].message.tool_calls.length === 1,
      'forced ' + JSON.stringify(f));
const fargs = JSON.parse(f.choices[0].message.tool_calls[0].function.arguments);
check(f.choices[0].message.tool_calls[0].function.name === 'get_weather' && ['Paris', 'Oslo'].includes(fargs.city),
      'forced call ' + JSON.stringify(f.choices[0].message.tool_calls));
let fcall = null;
for await (const chunk of await client.chat.completions.create({ ...forced, tool_choice: 'required', stream: true }))
  for (const t of chunk.choices[0]?.delta?.tool_calls ?? []) fcall = t;
check(fcall && fcall.function.name === 'get_weather' && ['Paris', 'Oslo'].includes(JSON.parse(fcall.function.arguments).city),
      'forced stream ' + JSON.stringify(fcall));
// A function that is not offered is refused by name.
try {
  await client.chat.completions.create({ ...forced, tool_choice: { type: 'function', function: { name: 'nope' } } });
  fail('a forced call of an unknown function accepted');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.param === 'tool_choice', 'unknown function: ' + e);
}
console.log(JSON.stringify({ ok: true, id: call.id, deltas, forced: fargs }));
