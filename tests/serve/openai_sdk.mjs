// The server through the official OpenAI Node SDK (npm `openai`), run by tests/serve/test_openai_sdk.cpp
// against a server on 127.0.0.1: models, chat and text completions (plain and streamed), the issue-24
// fields (developer role, content parts, max_completion_tokens, logprobs, echo, include_usage) and the
// errors the SDK maps to its classes (404 model_not_found, 400 naming the field, 401).
import OpenAI from 'openai';

const baseURL = process.env.LONGMOE_BASE_URL;
const apiKey = process.env.LONGMOE_TEST_KEY;
const model = process.env.LONGMOE_MODEL;
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 30000 });
let failures = 0;

function check(cond, what) {
  console.log(`${cond ? 'ok  ' : 'FAIL'} ${what}`);
  if (!cond) failures++;
}
async function expectError(promise, status, what, param) {
  try {
    await promise;
    check(false, `${what}: no error`);
  } catch (e) {
    check(e.status === status && (param === undefined || e.param === param),
          `${what}: ${e.constructor.name} ${e.status} param=${e.param} ${e.message}`);
  }
}

try {
  const models = await client.models.list();
  check(models.data.length === 1 && models.data[0].id === model, 'models.list');
  check((await client.models.retrieve(model)).id === model, 'models.retrieve');
  await expectError(client.models.retrieve('gpt-9'), 404, 'models.retrieve of an unknown model');

  const chat = await client.chat.completions.create({
    model,
    messages: [{ role: 'developer', content: 'be brief' },
               { role: 'user', content: [{ type: 'text', text: 'river' }, { type: 'text', text: 'stone' }] }],
    max_completion_tokens: 5, temperature: 0, logprobs: true, top_logprobs: 2,
  });
  const c0 = chat.choices[0];
  check(c0.message.role === 'assistant' && typeof c0.message.content === 'string', 'chat.completions.create');
  check(chat.usage.completion_tokens === 5 && c0.finish_reason === 'length', 'max_completion_tokens, finish_reason');
  check(c0.logprobs.content.length === 5 && c0.logprobs.content.every(t => t.top_logprobs.length === 2 && t.logprob <= 0),
        'logprobs + top_logprobs');

  const stream = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'river' }], max_tokens: 6, temperature: 0,
    stream: true, stream_options: { include_usage: true },
  });
  let text = '', finish = null, usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.delta?.content ?? '';
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  check(finish === 'length' && usage?.completion_tokens === 6, 'chat stream with include_usage');
  const same = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'river' }], max_tokens: 6, temperature: 0 });
  check(same.choices[0].message.content === text, 'streamed text == non-streamed text');

  const echo = await client.completions.create({ model, prompt: 'alpha beta', max_tokens: 4, temperature: 0, echo: true });
  check(echo.choices[0].text.startsWith('alpha beta'), 'completions with echo');
  const lp = await client.completions.create({ model, prompt: 'alpha', max_tokens: 3, logprobs: 2, seed: 1 });
  check(lp.choices[0].logprobs.tokens.length === 3 && lp.choices[0].logprobs.token_logprobs.length === 3,
        'completions with logprobs');
  let pieces = 0;
  for await (const c of await client.completions.create({ model, prompt: 'alpha', max_tokens: 3, stream: true }))
    pieces += c.choices.length;
  check(pieces >= 1, 'completions stream');

  await expectError(client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'hi' }],
    tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object' } } }] }),
    400, 'tools are refused, naming the field', 'tools');
  await expectError(client.chat.completions.create({ model: 'gpt-9', messages: [{ role: 'user', content: 'hi' }] }),
    404, 'an unknown model');
  await expectError(client.chat.completions.create({
    model, messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'data:image/png;base64,AAAA' } }] }] }),
    400, 'image parts are refused', 'messages[0].content[0].type');
  await expectError(new OpenAI({ baseURL, apiKey: 'wrong', maxRetries: 0 }).models.list(), 401, 'a wrong API key');
} catch (e) {
  check(false, `unexpected error: ${e.stack ?? e}`);
}
process.exit(failures ? 1 : 0);
