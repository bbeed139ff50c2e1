// Each event (a JSON array of {label, event} on stdin's file argument) parsed as the OpenAI Agents SDK's
// realtime transport parses what the server sends (`parseRealtimeEvent`: its zod schema of the server
// events, a generic event for a type it does not know). Prints the events that failed, one JSON line each.
import { readFileSync } from "node:fs";

// Not among the package's exports: imported by its file, as the transport itself imports it.
const { realtimeServerEventSchema, genericEventSchema } = await import(
  new URL("./node_modules/@openai/agents-realtime/dist/openaiRealtimeEvents.mjs", import.meta.url));

const events = JSON.parse(readFileSync(process.argv[2], "utf8"));
let failed = 0;
for (const { label, event, known } of events) {
  const result = (known ? realtimeServerEventSchema : genericEventSchema).safeParse(event);
  if (!result.success) {
    failed++;
    console.log(JSON.stringify({ label, type: event.type, issues: result.error.issues }));
  }
}
process.exit(failed ? 1 : 0);
