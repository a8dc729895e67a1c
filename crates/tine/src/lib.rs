//! Tine: KVM microVM sandboxes for AI agents, served over MCP.
//!
//! The `tine` binary is a thin `main` over this library: [`cli::main`]
//! parses the command line and runs the command. The rest is the crate's
//! own:
//!
//! - [`cli`]: the commands (`tine server|doctor|template|tenant|vm`), each
//!   in its own file.
//! - `server`: the HTTP server (routes, connections, shutdown) that serves
//!   the MCP tools at `/mcp`.
//! - `mcp`: the MCP tools, grouped by family in `mcp/tools/`, and the
//!   session's handler that runs them.
//! - `auth`: the operator token, tenants and their API keys, OAuth.
//! - `cluster`: more than one host (calls naming another host's sandbox
//!   go there).
//! - `mcp_client`: the MCP client (rmcp's Streamable HTTP client) that
//!   the cluster forwards calls with and the command line talks to a
//!   server with.
//! - `config`: the configuration file and the data directory.
//! - `files_url`: signed URLs that stream one sandbox file in or out.
//! - `preview`: preview URLs, a browser's way to a server in a sandbox;
//!   `port_forward`: raw TCP into a guest port over an upgraded request;
//!   `published_ports`: host ports the server listens on for a sandbox.
//! - `secrets`: API keys a sandbox uses without holding them (sealed in
//!   the data directory, swapped in by the broker, `crates/broker`).
//! - `metrics` and `audit`: `/metrics` and the audit log.

pub mod cli;

mod audit;
mod auth;
mod cluster;
mod config;
mod files_url;
mod mcp;
mod mcp_client;
mod mcp_seed;
mod metrics;
mod port_forward;
mod preview;
mod published_ports;
mod secrets;
mod server;
mod splice;
