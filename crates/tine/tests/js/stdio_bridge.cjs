// `tine mcp stdio --url URL` driven by the official MCP TypeScript SDK's
// StdioClientTransport (npm @modelcontextprotocol/sdk, found through
// NODE_PATH).
//
// Run by crates/tine/tests/cli.rs against a real `tine server start --dev`:
//
//     NODE_PATH=... node stdio_bridge.cjs TINE URL STATUS_FILE
//
// The SDK starts `sh -c 'TINE mcp stdio --url URL; echo "exit $?" >
// STATUS_FILE'`, so the bridge's own exit status is recorded when it exits
// (the SDK closes its stdin, waits 2 s, then kills it). Every check prints
// `CHECK <name> ok`; the last line is `ALL OK`. Any failure exits 1.

const { Client } = require("@modelcontextprotocol/sdk/client/index.js");
const { StdioClientTransport } = require("@modelcontextprotocol/sdk/client/stdio.js");

function check(name, ok, detail) {
  if (!ok) {
    throw new Error(`${name}: ${detail ?? ""}`);
  }
  console.log(`CHECK ${name} ok`);
}

function quote(s) {
  return `'${s.replaceAll("'", `'\\''`)}'`;
}

async function call(client, name, args) {
  const r = await client.callTool({ name, arguments: args });
  const text = (r.content ?? []).map((c) => c.text ?? "").join("");
  if (r.isError) {
    throw new Error(`${name}(${JSON.stringify(args)}): ${text}`);
  }
  return r.structuredContent;
}

async function main([tine, url, statusFile]) {
  const script = `${quote(tine)} mcp stdio --url ${quote(url)}; echo "exit $?" > ${quote(statusFile)}`;
  const transport = new StdioClientTransport({ command: "sh", args: ["-c", script], stderr: "inherit" });
  const client = new Client({ name: "tine-cli-test", version: "1.0.0" });
  await client.connect(transport);
  check("initialized through the bridge", client.getServerVersion()?.name === "tine", JSON.stringify(client.getServerVersion()));
  const { tools } = await client.listTools();
  const names = new Set(tools.map((t) => t.name));
  check("tools listed", ["sandbox_create", "sandbox_exec", "sandbox_run_python"].every((n) => names.has(n)), [...names].join(","));
  const created = await call(client, "sandbox_create", { labels: { "tine-test": "stdio-ts" } });
  const id = created.sandbox_id;
  check("sandbox created", created.state === "running", JSON.stringify(created));
  const p = await call(client, "sandbox_run_python", { sandbox_id: id, code: "x = 6 * 7\nx" });
  check("python cell ran", p.result === "42" && p.error === null, JSON.stringify(p));
  const k = await call(client, "sandbox_kill", { sandbox_id: id });
  check("sandbox killed", k.killed === true, JSON.stringify(k));
  await client.close();
  console.log("ALL OK");
}

main(process.argv.slice(2)).catch((e) => {
  console.error(e);
  process.exit(1);
});
