"""Tine's capped tools at their worst, through the official MCP Python SDK.

Run by crates/tine/tests/python_sdk.rs against a real `tine server start`:

    python worst_cases.py URL

Every check prints `CHECK <name> ok`; the last line is `ALL OK`. Any
failure raises (exit status 1). The SDK's log goes to stderr, where the
Rust test looks for transport errors ("SSE stream failed", "exceeded")
and an unclean close ("Session termination failed").
"""

import asyncio
import base64
import hashlib
import logging
import os
import sys

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

# The result budget the server documents (src/mcp/budget.rs).
RESULT_BUDGET = 512 * 1024
DOWNLOAD_CHUNK = 128 * 1024
# The chunked download: 1.5 MB (12 chunks; past the 1 MiB a message may
# carry) here, the 10 MB with TINE_TEST_FULL set (every first touch
# of a tmpfs page is a fault here).
BIG = 10_000_000 if os.environ.get("TINE_TEST_FULL") else 1_500_000
# The branch's files for the large diff (below): 40, 80 with TINE_TEST_FULL.
FILES = 80 if os.environ.get("TINE_TEST_FULL") else 40


def check(name, ok, detail=""):
    if not ok:
        raise AssertionError(f"{name}: {detail}")
    print(f"CHECK {name} ok", flush=True)


# Commands and cells in the guest: their default timeout is 60 s, and a
# loaded CI guest took 73 s for one that takes 8 s here (stop 56).
GUEST_CALLS = {"sandbox_exec", "sandbox_run_python"}
GUEST_TIMEOUT_SECS = 600


async def call(session, tool, **args):
    if tool in GUEST_CALLS:
        args.setdefault("timeout_secs", GUEST_TIMEOUT_SECS)
    r = await session.call_tool(tool, args)
    text = "".join(getattr(c, "text", "") for c in r.content)
    if r.is_error:
        raise AssertionError(f"{tool}({ {k: v for k, v in args.items() if k != 'data_base64'} }): {text}")
    # The text copy is the structured content's JSON.
    check(f"{tool} fits the budget", len(text) <= RESULT_BUDGET, str(len(text)))
    return r.structured_content


async def main(url):
    async with streamable_http_client(url) as (read, write):
        async with ClientSession(read, write) as session:
            await session.initialize()
            tools = {t.name for t in (await session.list_tools()).tools}
            check("tools listed", {"sandbox_create", "sandbox_download", "sandbox_diff"} <= tools, str(tools))

            # One session rule: create, then calls without sandbox_id land there.
            created = await call(session, "sandbox_create")
            a = created["sandbox_id"]
            x = await call(session, "sandbox_exec", command="echo here > /tmp/where; hostname")
            check("exec without id lands in the created sandbox", x["sandbox_id"] == a, f"{x['sandbox_id']} != {a}")

            # A 5 MB repr.
            p = await call(session, "sandbox_run_python", code="'x' * 5_000_000")
            check("python result is cut", p["result_truncated"] and p["result"].startswith("'xxx"), str(p)[:200])
            check("python result_bytes is the full size", p["result_bytes"] == 5_000_002, str(p["result_bytes"]))
            check("python ran in the created sandbox", p["sandbox_id"] == a, p["sandbox_id"])

            # Output of NUL bytes: 6 bytes of JSON each.
            x = await call(session, "sandbox_exec", command="head -c 100000 /dev/zero; head -c 50000 /dev/zero >&2")
            check("exec streams are cut", x["truncated"], str(x)[:200])
            check("exec stream totals", (x["stdout_bytes"], x["stderr_bytes"]) == (100000, 50000), str(x)[-200:])
            p = await call(session, "sandbox_run_python", code="import sys\nsys.stdout.write('\\0' * 3_000_000)\n1")
            check("python streams are cut", p["truncated"] and p["stdout_bytes"] == 3_000_000, str(p)[-300:])

            # A 1 MiB text read of /dev/zero.
            r = await call(session, "sandbox_files_read", path="/dev/zero", length=1 << 20)
            content = r["content"]
            check("read of /dev/zero is cut", r["truncated"] and 0 < len(content) < (1 << 20), str(len(content)))
            check("read returns NULs", content == "\0" * len(content))
            check("read says where to go on", r["next_offset"] == r["offset"] + r["bytes"] == len(content))

            # A BIG-byte download in chunks, compared by SHA-256.
            x = await call(
                session,
                "sandbox_exec",
                command=f"openssl rand {BIG} > /tmp/big && sha256sum /tmp/big",
            )
            check("the big file is written", x["exit_code"] == 0 and x["stdout"], str(x)[:300])
            print(f"{BIG} bytes written and hashed in the guest in {x['duration_ms']} ms", flush=True)
            want = x["stdout"].split()[0]
            h, offset, calls, size = hashlib.sha256(), 0, 0, 0
            while True:
                d = await call(session, "sandbox_download", path="/tmp/big", offset=offset)
                data = base64.b64decode(d["data_base64"])
                check_chunk = len(data) == d["bytes"] <= DOWNLOAD_CHUNK
                if not check_chunk:
                    raise AssertionError(f"chunk of {len(data)} bytes, said {d['bytes']}")
                h.update(data)
                offset, calls, size = d["next_offset"], calls + 1, size + len(data)
                if d["remaining"] == 0:
                    break
            check("the big download matches", (h.hexdigest(), size) == (want, BIG), f"{calls} calls")
            print(f"download: {calls} calls", flush=True)

            # A large diff: a branch that writes FILES files of 16 KiB text
            # (each added file's unified diff is in the report: some 0.7 MB
            # together, past the 512 KiB a result may carry) and a big text
            # change. (Fewer, larger files than a real tree: each file is a
            # write and a read in the guest, a quarter of a second each on a
            # slow one; 80 files took 36-77 s here beside tine::load.)
            b = (await call(session, "sandbox_branch", n=1))["children"][0]["sandbox_id"]
            # In Python: a shell loop forks per file, minutes on a slow guest.
            w = await call(
                session,
                "sandbox_run_python",
                sandbox_id=b,
                code="import os\nos.makedirs('/work/many', exist_ok=True)\n"
                f"for i in range({FILES}):\n"
                "    open(f'/work/many/f-{i}-{i:080d}', 'w').write(f'file {i}\\n' * 2048)\n"
                "open('/tmp/where', 'w').write(''.join(f'{i}\\n' for i in range(20000)))\n"
                "len(os.listdir('/work/many'))",
            )
            check("the branch wrote its files", w["result"] == str(FILES), str(w)[:300])
            d = await call(session, "sandbox_diff", a=a, b=b, unified=True, max_text_bytes=1 << 20)
            listed = len(d["added"]) + len(d["removed"]) + len(d["modified"])
            check("diff report is cut", d["report_truncated"] and listed < d["total_changes"], f"{listed}/{d['total_changes']}")

            # After a merge, calls without sandbox_id land in the parent, which has the winner's state.
            m = await call(session, "sandbox_merge_into", winner=b, parent=a)
            check("merge keeps the parent's id", m["sandbox_id"] == a, str(m))
            x = await call(session, "sandbox_exec", command="ls /work/many | wc -l")
            check("after a merge, exec without id lands in the parent", x["sandbox_id"] == a, x["sandbox_id"])
            check("the parent has the winner's files", x["stdout"].strip() == str(FILES), x["stdout"])

            await call(session, "sandbox_kill", sandbox_id=a)
    print("ALL OK", flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main(sys.argv[1]))
