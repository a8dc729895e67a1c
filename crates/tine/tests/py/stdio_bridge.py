"""`tine mcp stdio` driven by the official MCP Python SDK's stdio transport,
as Claude Desktop and other stdio clients start it: the bridge (`--url`,
against a real `tine server start --dev`) or the in-process server.

Run by crates/tine/tests/cli.rs:

    python stdio_bridge.py STATUS_FILE TINE mcp stdio [ARGS...]

The SDK starts `sh -c '"$@"; echo "exit $?" > STATUS_FILE' sh TINE mcp
stdio ARGS...`, so that tine's own exit status is recorded when it exits
(the SDK closes its stdin, waits 2 s, then kills its process group: a
process that did not end on its own leaves no status). Every check prints
`CHECK <name> ok`; the session's own sandbox is printed as
`SESSION_SANDBOX <id>` (it must be gone once the session ended); the last
line is `ALL OK`. Any failure raises (exit status 1). For the in-process
server (no `--url`), a signed file URL is used too: the HTTP routes it
serves beside the stdio session.
"""

import asyncio
import shlex
import sys
import urllib.request

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


def check(name, ok, detail=""):
    if not ok:
        raise AssertionError(f"{name}: {detail}")
    print(f"CHECK {name} ok", flush=True)


async def call(session, tool, **args):
    r = await session.call_tool(tool, args)
    text = "".join(getattr(c, "text", "") for c in r.content)
    if r.is_error:
        raise AssertionError(f"{tool}({args}): {text}")
    return r.structured_content


async def main(status_file, command):
    script = f'"$@"; echo "exit $?" > {shlex.quote(status_file)}'
    params = StdioServerParameters(command="sh", args=["-c", script, "sh", *command])
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write) as session:
            init = await session.initialize()
            check("initialized", init.server_info.name == "tine", str(init.server_info))
            tools = {t.name for t in (await session.list_tools()).tools}
            check("tools listed", {"sandbox_create", "sandbox_exec", "sandbox_run_python"} <= tools, str(tools))

            created = await call(session, "sandbox_create", labels={"tine-test": "stdio"})
            a = created["sandbox_id"]
            check("sandbox created", created["state"] == "running", str(created))
            p = await call(session, "sandbox_run_python", sandbox_id=a, code="x = 6 * 7\nx")
            check("python cell ran", p["result"] == "42" and p["error"] is None, str(p))
            if "--url" not in command:
                u = await call(session, "sandbox_files_url", sandbox_id=a, path="/tmp/up.txt", method="PUT")
                put = urllib.request.Request(u["url"], data=b"through the file URL\n", method="PUT")
                await asyncio.to_thread(lambda: urllib.request.urlopen(put, timeout=60).read())
                r = await call(session, "sandbox_files_read", sandbox_id=a, path="/tmp/up.txt")
                check("a signed file URL works", r["content"] == "through the file URL\n", str(r))
            k = await call(session, "sandbox_kill", sandbox_id=a)
            check("sandbox killed", k["killed"] is True, str(k))

            # The session's own sandbox, made on first use: killed when the
            # session ends (the bridge ends it when its stdin closes).
            p = await call(session, "sandbox_run_python", code="y = 1\ny + 1")
            check("the session's own sandbox ran a cell", p["result"] == "2", str(p))
            print(f"SESSION_SANDBOX {p['sandbox_id']}", flush=True)
    print("ALL OK", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2:]))
