// Streamed retrieval with the Node SDK: a background job read with responses.stream({response_id}),
// cut after a few events and resumed with starting_after; prints what the test compares.
import OpenAI from "openai";

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: "x", maxRetries: 0, timeout: 60000 });

async function collect(params, limit) {
  const events = [];
  const stream = client.responses.stream(params);
  for await (const event of stream) {
    events.push(event);
    if (limit && events.length >= limit) break;
  }
  return events;
}

const job = await client.responses.create({ model, input: "go", background: true, max_output_tokens: 200 });
const head = await collect({ response_id: job.id }, 5);
const last = head[head.length - 1].sequence_number;
const tail = await collect({ response_id: job.id, starting_after: last });
const unbroken = await collect({ response_id: job.id });
const seq = (events) => events.map((e) => [e.sequence_number, e.type]);
console.log(JSON.stringify({ resumed: seq([...head, ...tail]), unbroken: seq(unbroken), last: unbroken[unbroken.length - 1].type }));
