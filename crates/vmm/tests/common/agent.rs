//! Reaching a guest's agent from a test.

use std::time::{Duration, Instant};

use tine_agent_client::{AgentClient, AGENT_PORT};

/// Connects to the agent behind the vsock socket `uds`, retrying for up to
/// 120 s (a restored guest needs a moment to handle its transport reset).
pub async fn connect(uds: &std::path::Path) -> AgentClient {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match AgentClient::connect(uds, AGENT_PORT).await {
            Ok(a) => return a,
            Err(e) if Instant::now() < deadline => {
                eprintln!("connect: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("agent unreachable: {e}"),
        }
    }
}
