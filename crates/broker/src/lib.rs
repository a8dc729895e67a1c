//! Tine's TLS broker: secrets that never enter a sandbox.
//!
//! A sandbox's guest holds a placeholder where a secret's value would be
//! (an environment variable). When the guest opens TLS to a host one of
//! its secrets may go to, its network (the NAT, `crates/netstack`) hands
//! the connection here instead of splicing it: the broker ends the
//! guest's TLS with a certificate for that name signed by the server's
//! own CA ([`ca`], which the guests trust), opens its own TLS to the real
//! host over the connection the NAT already made, verified against the
//! host's trust store and the operator's extra CAs, and passes every
//! HTTP request on with the placeholders swapped for the values
//! ([`swap`]). Responses stream back scrubbed: each bound secret's value
//! the host sends back (an echo) is replaced by its placeholder
//! ([`scrub`]), so the guest never reads a value.
//!
//! - Both sides speak what the guest offered and the host chose: the
//!   guest's ALPN list (`h2`, `http/1.1`, RFC 7301) is offered upstream
//!   and the host's choice is the only one offered back, so HTTP/2 stays
//!   HTTP/2 and HTTP/1.1 (with keep-alive and upgrades: WebSockets)
//!   stays HTTP/1.1.
//! - A request that names another authority than the name the TLS
//!   connection was opened for, anywhere (its target, absolute-form or
//!   `:authority`; any `Host` header, or more than one), is answered
//!   `421 Misdirected Request` (RFC 9110 §15.5.20) and nothing of it is
//!   passed on; the broker writes the authority upstream itself, from
//!   the TLS name and the port ([`authority`]). The value goes only to
//!   the host the guest named in its ClientHello, whose certificate was
//!   verified, and a front end that routes by `Host` sees that name.
//! - The bindings are asked for at every request ([`FlowHooks`]), so a
//!   secret detached or deleted stops being swapped at once, also on a
//!   kept-alive connection.
//! - Placeholders of secrets that may not go to this host are left as
//!   they are and reported ([`BrokerEvent::LeakBlocked`]).
//! - Bodies read whole to swap in them are held within the sandbox's
//!   [`BodyBudget`] across all its flows and requests ([`budget`]); a
//!   request past it is refused (503) and reported
//!   ([`BrokerEvent::BodyBudget`]).
//!
//! Errors end the flow: the guest sees its TLS connection close (or, for
//! a request that cannot be passed on, a `502`); each is a
//! [`BrokerError`].

pub mod authority;
pub mod budget;
pub mod ca;
mod flow;
pub mod scrub;
pub mod swap;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use budget::{BodyBudget, DEFAULT_SANDBOX_BODY_BUDGET};
pub use ca::{CaError, CertificateAuthority};
pub use flow::FlowStats;
pub use hyper::header::HeaderName;
pub use swap::{Binding, HostPattern, SecretValue, SwapError};

/// How long each TLS handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a guest connection may sit between requests (HTTP/1.1 waits
/// this long for the next request's head; HTTP/2 pings past it).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// What the broker needs to start.
#[derive(Debug)]
pub struct BrokerConfig {
    /// The CA whose leaves the guests see.
    pub ca: Arc<CertificateAuthority>,
    /// Trust the host's own store (`/etc/ssl/certs`, as
    /// `rustls-native-certs` finds it) for upstream certificates.
    pub native_roots: bool,
    /// More CA certificates (PEM files) upstream certificates may chain
    /// to (`[network] upstream_ca_certificates`).
    pub extra_roots: Vec<PathBuf>,
}

/// Errors of the broker.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The CA failed to sign a leaf.
    #[error(transparent)]
    Ca(#[from] CaError),
    /// No trust anchor at all, or an extra CA file that cannot be read.
    #[error("upstream trust: {0}")]
    Roots(String),
    /// TLS setup (a protocol version, a name rustls refuses).
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    /// The guest's ClientHello names another host than the flow's.
    #[error("the guest's ClientHello names {got:?}, not {want}")]
    Misdirected {
        /// The flow's name.
        want: String,
        /// The ClientHello's.
        got: Option<String>,
    },
    /// A handshake took longer than [`HANDSHAKE_TIMEOUT`].
    #[error("the {0} TLS handshake took longer than {HANDSHAKE_TIMEOUT:?}")]
    Timeout(&'static str),
    /// Reading or writing a side failed (a reset, a certificate the
    /// upstream's chain does not verify to).
    #[error("{side}: {source}")]
    Io {
        /// `guest` or `upstream`.
        side: &'static str,
        /// What failed.
        source: std::io::Error,
    },
    /// HTTP on either side.
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
}

/// Something the broker saw in a flow, for the sandbox's network log.
/// Never carries a secret's value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BrokerEvent {
    /// A request was passed on and answered.
    Request {
        /// `GET`, `POST`, ...
        method: String,
        /// The host (the flow's name).
        host: String,
        /// The target's path (without the query, which may hold a value).
        path: String,
        /// The upstream's status code (or the broker's own: 421, 413, 502).
        status: u16,
        /// The secrets whose values went in.
        swapped: Vec<String>,
    },
    /// Placeholders of secrets that may not go to this host were found
    /// and left as they are.
    LeakBlocked {
        /// The host.
        host: String,
        /// The secrets (names).
        secrets: Vec<String>,
    },
    /// A secret's value (in one of its forms, [`scrub::forms`]) was found
    /// in a response and replaced by its placeholder before the guest got
    /// it (an echo: the host sent back what it was sent).
    EchoScrubbed {
        /// The host.
        host: String,
        /// The request's path (without the query).
        path: String,
        /// The secrets (names).
        secrets: Vec<String>,
    },
    /// A request for another authority than the flow's name (refused, 421).
    Misdirected {
        /// The flow's name.
        host: String,
        /// The request's authority.
        authority: String,
    },
    /// A request whose body would have taken the sandbox's
    /// [`BodyBudget`] past its limit (refused, 503).
    BodyBudget {
        /// The flow's name.
        host: String,
        /// The budget (bytes).
        limit: u64,
    },
}

/// The sandbox's side of a flow: its bindings now, and where its events go.
pub trait FlowHooks: Send + Sync {
    /// The sandbox's secret bindings now (asked at every request).
    fn bindings(&self) -> Vec<Arc<Binding>>;
    /// Records `event` (the sandbox's network log).
    fn event(&self, event: BrokerEvent);
    /// The sandbox's budget for request bodies held to swap in them (one
    /// for all its flows).
    fn body_budget(&self) -> Arc<BodyBudget>;
}

/// One guest connection handed to the broker.
pub struct Flow<U> {
    /// The name the guest's ClientHello gave (lower case), which its
    /// secrets' hosts matched.
    pub name: String,
    /// The port the guest dialled (the one the NAT connected to): the
    /// authority written upstream is `name:port` (`name` for 443).
    pub port: u16,
    /// The connection to the real host, open (the NAT made it to the
    /// address the guest dialled).
    pub upstream: U,
    /// The sandbox's bindings and log.
    pub hooks: Arc<dyn FlowHooks>,
}

/// The broker: its CA, the upstream trust, the TLS settings.
pub struct Broker {
    ca: Arc<CertificateAuthority>,
    client: Arc<rustls::ClientConfig>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker").finish_non_exhaustive()
    }
}

impl Broker {
    /// A broker with `config`'s CA and upstream trust.
    ///
    /// Errors: [`BrokerError::Roots`] (an extra CA file that is not PEM,
    /// or no trust anchor at all), [`BrokerError::Tls`].
    pub fn new(config: BrokerConfig) -> Result<Self, BrokerError> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        if config.native_roots {
            let found = rustls_native_certs::load_native_certs();
            for e in &found.errors {
                tracing::warn!("broker: the host's trust store: {e}");
            }
            let (added, ignored) = roots.add_parsable_certificates(found.certs);
            tracing::debug!("broker: {added} CA certificates of the host's store ({ignored} unusable)");
        }
        for path in &config.extra_roots {
            use rustls_pki_types::pem::PemObject;
            let text = std::fs::read(path).map_err(|e| BrokerError::Roots(format!("{}: {e}", path.display())))?;
            let mut n = 0;
            for c in rustls_pki_types::CertificateDer::pem_slice_iter(&text) {
                let c = c.map_err(|e| BrokerError::Roots(format!("{}: {e}", path.display())))?;
                roots.add(c).map_err(|e| BrokerError::Roots(format!("{}: {e}", path.display())))?;
                n += 1;
            }
            if n == 0 {
                return Err(BrokerError::Roots(format!("{}: no PEM certificate in it", path.display())));
            }
        }
        if roots.is_empty() {
            return Err(BrokerError::Roots("no CA certificate to verify upstream hosts with".into()));
        }
        let client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Broker { ca: config.ca, client: Arc::new(client), provider })
    }

    /// The CA certificate (PEM) the guests must trust.
    pub fn ca_pem(&self) -> &str {
        self.ca.cert_pem()
    }

    /// Serves one guest connection `guest` (its TLS not yet begun) until
    /// either side closes it.
    ///
    /// Errors: [`BrokerError`]; the guest's connection is closed.
    pub async fn serve<G, U>(&self, guest: G, flow: Flow<U>) -> Result<FlowStats, BrokerError>
    where
        G: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
        U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        flow::serve(self, guest, flow).await
    }
}
