// Every toolset of `/mcp` and every seed endpoint through the official MCP
// TypeScript SDK (npm @modelcontextprotocol/sdk, found through NODE_PATH):
// its Streamable HTTP client lists the tools (the SDK compiles the output
// schemas there), and the SDK's own validator (AjvJsonSchemaValidator,
// Ajv with its formats) compiles every input and output schema. Nothing
// may be warned or logged as an error meanwhile (Ajv writes "unknown
// format ... ignored" and strict-mode complaints with console.warn).
//
// Run by crates/tine/tests/seeds.rs against a real `tine server start --dev`:
//
//     NODE_PATH=... node schemas.cjs URL
//
// Prints a line per endpoint, then `ALL OK`; any failure exits 1.

const { Client } = require("@modelcontextprotocol/sdk/client/index.js");
const { StreamableHTTPClientTransport } = require("@modelcontextprotocol/sdk/client/streamableHttp.js");
const { AjvJsonSchemaValidator } = require("@modelcontextprotocol/sdk/validation/ajv-provider.js");

const ENDPOINTS = [
  "?tools=full",
  "?tools=core",
  "?tools=processes",
  "?tools=templates",
  "?tools=network",
  "?tools=files",
  "?tools=admin",
  "/microsandbox",
  "/podflare",
  "/forkd",
  "/superserve",
];

async function main([url]) {
  const said = [];
  for (const level of ["warn", "error"]) {
    const original = console[level];
    console[level] = (...args) => {
      said.push(`${level}: ${args.join(" ")}`);
      original(...args);
    };
  }
  const validator = new AjvJsonSchemaValidator();
  for (const e of ENDPOINTS) {
    const client = new Client({ name: "tine-schemas-test", version: "1.0.0" });
    await client.connect(new StreamableHTTPClientTransport(new URL(`${url}${e}`)));
    const { tools } = await client.listTools();
    for (const t of tools) {
      validator.getValidator(t.inputSchema);
      if (t.outputSchema) {
        validator.getValidator(t.outputSchema);
      }
    }
    await client.close();
    console.log(`${e}: ${tools.length} tools compiled`);
  }
  if (said.length) {
    throw new Error(`the SDK warned:\n${said.join("\n")}`);
  }
  console.log("ALL OK");
}

main(process.argv.slice(2)).catch((e) => {
  console.error(e);
  process.exit(1);
});
