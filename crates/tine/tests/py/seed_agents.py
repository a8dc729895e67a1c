"""An agent framework on a seed endpoint, unchanged.

The OpenAI Agents SDK (`openai-agents`) connects to `/mcp/microsandbox`
with `MCPServerStreamableHttp`, lists its tools, turns each into a
strict function tool (`MCPUtil.to_function_tool(..., True)`, what an
agent with `mcp_config={"convert_schemas_to_strict": True}` does; it falls back to a non-strict schema when the
conversion fails: every tool must come out strict), and calls them the
way the SDK calls a tool a model chose (`MCPUtil.invoke_mcp_tool` with the
model's JSON), sending every property as a strict-mode model does, `null`
for those it leaves out. Then the official MCP Python SDK lists every
seed endpoint's tools with warnings recorded (there must be none).
Prints progress lines, then `ALL OK`; exits 1 on a failure. Usage:
`python seed_agents.py URL` (URL: the server's /mcp).
"""
import asyncio
import json
import sys
import warnings

from agents import RunContextWrapper
from agents.mcp import MCPServerStreamableHttp, MCPUtil
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

SEEDS = ["microsandbox", "podflare", "forkd", "superserve"]


def strict_args(tool, given):
    """`given` with every other property of the tool's schema as null."""
    props = tool.params_json_schema.get("properties", {})
    return {name: given.get(name) for name in props}


def output_text(out):
    """The text of a tool output: a string, a `{"type": "text", "text"}`
    dict (one text block), or an object with `.text`."""
    if isinstance(out, str):
        return out
    if isinstance(out, dict):
        return out["text"]
    return out.text


async def microsandbox(url):
    async with MCPServerStreamableHttp(
        params={"url": f"{url}/microsandbox", "timeout": 600, "sse_read_timeout": 1200},
        client_session_timeout_seconds=600,
    ) as server:
        listed = await server.list_tools()
        tools = {t.name: (t, MCPUtil.to_function_tool(t, server, True)) for t in listed}
        loose = [name for name, (_, ft) in tools.items() if not ft.strict_json_schema]
        if loose:
            raise SystemExit(f"not strict: {loose}")
        print(f"microsandbox: {len(tools)} tools, all strict")
        ctx = RunContextWrapper(context=None)

        async def invoke(name, **given):
            mcp_tool, ft = tools[name]
            out = await MCPUtil.invoke_mcp_tool(server, mcp_tool, ctx, json.dumps(strict_args(ft, given)))
            text = output_text(out)
            try:
                return json.loads(text)
            except ValueError:
                raise SystemExit(f"{name}: not JSON: {out!r}")

        sb, ns = "agents-sdk", "agents"
        started = await invoke("sandbox_start", sandbox=sb, namespace=ns,
                               config={"image": "microsandbox/python", "memory": None, "cpus": None,
                                       "volumes": None, "ports": None, "envs": ["WHO=agents"]})
        assert started == f"Sandbox {sb} started successfully", started
        r = await invoke("sandbox_run_code", sandbox=sb, namespace=ns, code="import os\nprint(os.environ['WHO'])",
                         language="python")
        assert r["output"] == [{"stream": "stdout", "text": "agents"}], r
        r = await invoke("sandbox_run_command", sandbox=sb, namespace=ns, command="uname", args=["-s"])
        assert r["exit_code"] == 0 and r["output"][0]["text"] == "Linux", r
        m = await invoke("sandbox_get_metrics", namespace=ns, sandbox=sb)
        assert m["sandboxes"][0]["name"] == sb and m["sandboxes"][0]["running"] is True, m
        stopped = await invoke("sandbox_stop", sandbox=sb, namespace=ns)
        assert stopped == f"Sandbox {sb} stopped successfully", stopped
        print("microsandbox: start, run_code, run_command, get_metrics, stop called through the SDK")


async def listed_without_warnings(url):
    for seed in SEEDS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with streamable_http_client(f"{url}/{seed}") as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    tools = (await session.list_tools()).tools
        if caught:
            raise SystemExit(f"{seed}: the SDK warned: {[str(w.message) for w in caught]}")
        print(f"{seed}: {len(tools)} tools listed")


async def main(url):
    await microsandbox(url)
    await listed_without_warnings(url)
    print("ALL OK")


asyncio.run(main(sys.argv[1]))
