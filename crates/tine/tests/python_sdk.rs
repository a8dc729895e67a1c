//! The official MCP Python SDK (PyPI `mcp` 2.3, the README's client)
//! against a real `tine server start --dev` and real guests: every capped
//! tool's worst case fits the SDK's 1 MiB SSE event limit, the session rule
//! holds, and the client closes without "Session termination failed".
//! The client is `tests/py/worst_cases.py`, run in the venv that
//! `scripts/setup.sh` makes; then `tests/py/toolsets.py` lists every
//! toolset (`/mcp?tools=`) with the SDK and converts the schemas of those
//! meant for strict clients with the OpenAI Agents SDK's converter. One
//! server serves every check here.

use std::path::Path;
use std::time::Instant;

use testkit::mcp::{python_sdk, TineServer};

const CONFIG: &str = "[limits]\nboot_timeout_secs = 1200\n";

#[test]
fn official_python_sdk_gets_every_worst_case() {
    if !testkit::kvm_available("official_python_sdk_gets_every_worst_case") {
        return;
    }
    let Some(python) = python_sdk("official_python_sdk_gets_every_worst_case") else {
        return;
    };
    // Creates wait for the default template; have it before timing anything.
    let server = TineServer::start_with_default_template(Path::new(env!("CARGO_BIN_EXE_tine")), None, CONFIG);

    // A foreign Origin is refused (MCP transport spec, Streamable HTTP,
    // "Security Warning"), also under --dev; no Origin passes.
    let initialize = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}"#;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let http = reqwest::Client::new();
    let post = |origin: Option<&str>| {
        let mut req = http
            .post(&server.url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(initialize);
        if let Some(o) = origin {
            req = req.header("origin", o);
        }
        rt.block_on(req.send()).expect("POST /mcp").status().as_u16()
    };
    assert_eq!(post(Some("https://evil.example")), 403);
    assert_eq!(post(Some("http://localhost")), 403);
    assert_eq!(post(None), 200);

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/worst_cases.py");
    let t = Instant::now();
    let out =
        std::process::Command::new(&python).arg(&script).arg(&server.url).output().expect("run the Python client");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("--- Python client ({:.1} s) stdout:\n{stdout}\n--- stderr:\n{stderr}", t.elapsed().as_secs_f64());
    assert!(out.status.success(), "the Python client failed: {}", out.status);
    assert_eq!(stdout.lines().last(), Some("ALL OK"));
    for bad in ["Session termination failed", "SSE stream failed", "exceeded", "Traceback"] {
        assert!(!stderr.contains(bad), "the Python SDK logged {bad:?}");
    }

    // Every toolset through the SDK, and the OpenAI Agents SDK's strict
    // conversion of every toolset meant for it (tests/py/toolsets.py).
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/toolsets.py");
    let out = std::process::Command::new(&python).arg(&script).arg(&server.url).output().expect("run toolsets.py");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("--- toolsets.py stdout:\n{stdout}\n--- stderr:\n{stderr}");
    assert!(out.status.success() && stdout.lines().last() == Some("ALL OK"), "toolsets.py: {stdout}");
}
