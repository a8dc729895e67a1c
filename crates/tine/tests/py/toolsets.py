"""Every toolset of a Tine server through the clients that read it.

For each toolset (`full`, `core`, each group, two groups combined), the
official MCP Python SDK lists `/mcp?tools=<set>`, and the OpenAI Agents
SDK's strict-schema converter (`agents.strict_schema.
ensure_strict_json_schema`, what `MCPServerStreamableHttp(...,
convert_schemas_to_strict=True)` runs on each tool) converts every input
schema of the toolsets meant for it (all but `full`, whose maps are open
objects). Prints one line per toolset, then `ALL OK`; exits 1 on a
failure, with the tool and the converter's message. Usage:
`python toolsets.py URL` (URL: the server's /mcp).
"""
import asyncio
import sys
import warnings

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from agents.strict_schema import ensure_strict_json_schema

SETS = ["full", "core", "processes", "templates", "network", "files", "admin", "core,processes"]


async def tools_of(url):
    async with streamable_http_client(url) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            return (await session.list_tools()).tools


async def main(url):
    failed = []
    for s in SETS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tools = await tools_of(f"{url}?tools={s}")
        if caught:
            failed.append(f"{s}: the SDK warned: {[str(w.message) for w in caught]}")
        strict_ok = 0
        if s != "full":
            for t in tools:
                try:
                    # As `MCPUtil.to_function_tool` converts it: a schema
                    # it refuses there is sent loose, not strict.
                    ensure_strict_json_schema(dict(t.input_schema), _reject_open_objects=True)
                    strict_ok += 1
                except Exception as e:  # the converter's refusal
                    failed.append(f"{s}: {t.name}: {type(e).__name__}: {e}")
        print(f"{s}: {len(tools)} tools, {strict_ok} strict")
    for f in failed:
        print("FAILED", f)
    if failed:
        sys.exit(1)
    print("ALL OK")


asyncio.run(main(sys.argv[1]))
