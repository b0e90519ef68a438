// The Vercel AI SDK against Kiln (run by test_client_families_real_model.py from the pinned npm
// install): generateText, streamText and a forced tool round trip through openai.responses.
// Prints one JSON object of what the user sees.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, jsonSchema, stepCountIs, streamText, tool } from "ai";

const [baseURL, model] = process.argv.slice(2);
const openai = createOpenAI({ baseURL, apiKey: "sk-local" });
const common = { model: openai.responses(model), temperature: 0, maxRetries: 0 };

const plain = await generateText({ ...common, prompt: "Say hello.", maxOutputTokens: 16 });

const streamed = streamText({ ...common, prompt: "Name a colour.", maxOutputTokens: 16 });
const deltas = [];
for await (const delta of streamed.textStream) deltas.push(delta);

const getWeather = tool({
  description: "The weather in a city.",
  inputSchema: jsonSchema({ type: "object", properties: { city: { type: "string" } }, required: ["city"] }),
  execute: async ({ city }) => `Sunny, 21 C in ${city}.`,
});
// Forced on the first step; the second step answers from the tool result.
const tooled = await generateText({
  ...common,
  prompt: "What's the weather in Rome?",
  maxOutputTokens: 48,
  tools: { get_weather: getWeather },
  stopWhen: stepCountIs(2),
  prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? { type: "tool", toolName: "get_weather" } : "none" }),
});
const call = tooled.steps[0]?.toolCalls[0];
const result = tooled.steps[0]?.toolResults[0];
console.log(JSON.stringify({
  text: plain.text,
  stream: deltas,
  stream_final: await streamed.text,
  tool: call ? { name: call.toolName, arguments: call.input, output: result?.output } : null,
  after_tool: tooled.steps.length > 1 ? tooled.steps[1].text : null,
  steps: tooled.steps.length,
}));
