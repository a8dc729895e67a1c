"""Progress and logging through the official MCP Python SDK.

Run by crates/tine/tests/default_template.rs against a server that is
still building its default template:

    python progress.py URL

A create (which waits for the template build) and a 3 s exec, each with a
progress callback, must report progress; `logging/setLevel` is accepted.
The last line is `PROGRESS OK`; any failure raises (exit status 1).
"""

import asyncio
import logging
import sys

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client


async def main(url):
    async with streamable_http_client(url) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            await session.set_logging_level("info")
            seen = {"create": [], "exec": []}

            def recorder(name):
                async def record(progress, total, message):
                    print(f"progress {name}: {progress} {total} {message!r}", flush=True)
                    seen[name].append((progress, message))

                return record

            r = await session.call_tool("sandbox_create", {}, progress_callback=recorder("create"))
            assert not r.is_error, r.content
            sandbox = r.structured_content["sandbox_id"]
            r = await session.call_tool(
                "sandbox_exec",
                {"sandbox_id": sandbox, "command": "for i in 1 2 3; do echo tick$i; sleep 1; done"},
                progress_callback=recorder("exec"),
            )
            assert not r.is_error, r.content
            assert r.structured_content["stdout"].endswith("tick3\n"), r.structured_content
            for name, calls in seen.items():
                assert calls, f"no progress for {name}"
                values = [p for p, _ in calls]
                assert values == sorted(set(values)), f"{name}: progress not increasing: {values}"
            assert any("tick" in (m or "") for _, m in seen["exec"]), seen["exec"]
            r = await session.call_tool("sandbox_kill", {"sandbox_id": sandbox})
            assert not r.is_error, r.content
    print("PROGRESS OK", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main(sys.argv[1]))
