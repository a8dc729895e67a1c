//! The server's CA certificates beside the guest's own trust store
//! (`Op::InstallTrust`): a bundle of both in [`TRUST_BUNDLE`], the
//! server's alone in [`TRUST_EXTRA`], and the variables TLS clients read
//! pointing at them ([`crate::env::set_trust`]).
//!
//! The certificates the guest's own bundle lacks are also appended to it
//! (where it can be written), so that clients that read only the
//! distribution's bundle (wget, apt, ...) trust them as well; the host
//! sends its certificates at every start and restore, so a template needs
//! none of its own. A certificate the guest's bundle already holds (the
//! same base64 body) is not added twice.

use std::io::Write;

use tine_protocol::{AgentError, MAX_TRUST_BYTES, TRUST_BUNDLE, TRUST_EXTRA};

/// Where the guest's own bundle may be: Debian's and Alpine's
/// (`/etc/ssl/certs/ca-certificates.crt`), Fedora's, then OpenSSL's.
const SYSTEM_BUNDLES: [&str; 3] =
    ["/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem"];

/// The variables that name the bundle, and Node.js's, which names the
/// extra certificates (it adds them to its own).
const BUNDLE_VARS: [&str; 5] = ["SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO"];
const NODE_VAR: &str = "NODE_EXTRA_CA_CERTS";

const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
const END: &str = "-----END CERTIFICATE-----";

/// Installs `pem` (see the module docs); an empty one takes the
/// variables away and leaves the files.
///
/// Errors: `InvalidRequest` (over [`MAX_TRUST_BYTES`], or text that is
/// not PEM certificates), `Io` (the files cannot be written).
pub fn install(pem: &str) -> Result<(), AgentError> {
    if pem.trim().is_empty() {
        return crate::env::set_trust(Vec::new());
    }
    if pem.len() > MAX_TRUST_BYTES {
        return Err(AgentError::InvalidRequest {
            reason: format!("{} bytes of CA certificates: at most {MAX_TRUST_BYTES}", pem.len()),
        });
    }
    let ours = certificates(pem);
    if ours.is_empty() {
        return Err(AgentError::InvalidRequest { reason: format!("no {BEGIN} in the CA certificates") });
    }
    let system = SYSTEM_BUNDLES.iter().find_map(|p| std::fs::read_to_string(p).ok().map(|t| (*p, t)));
    let (system_path, system) = system.unwrap_or(("", String::new()));
    let known: std::collections::HashSet<String> = certificates(&system).into_iter().map(|c| body(&c)).collect();
    let mut bundle = system.trim_end().to_string();
    if !bundle.is_empty() {
        bundle.push('\n');
    }
    let mut extra = String::new();
    let mut missing = String::new();
    for c in &ours {
        extra.push_str(c);
        extra.push('\n');
        if !known.contains(&body(c)) {
            missing.push_str(c);
            missing.push('\n');
        }
    }
    bundle.push_str(&missing);
    let io = |what: &str, e: std::io::Error| AgentError::Io { message: format!("{what}: {e}") };
    if !missing.is_empty() && !system_path.is_empty() {
        // The distribution's bundle too; a read-only one is left alone
        // (the variables below name ours).
        let appended = std::fs::OpenOptions::new().append(true).open(system_path).and_then(|mut f| {
            let sep = if system.ends_with('\n') || system.is_empty() { "" } else { "\n" };
            f.write_all(format!("{sep}{missing}").as_bytes())
        });
        if let Err(e) = appended {
            eprintln!("tine-agent: cannot add the server's CA certificates to {system_path}: {e}");
        }
    }
    if let Some(dir) = std::path::Path::new(TRUST_BUNDLE).parent() {
        std::fs::create_dir_all(dir).map_err(|e| io(&dir.display().to_string(), e))?;
    }
    write(TRUST_EXTRA, extra.as_bytes()).map_err(|e| io(TRUST_EXTRA, e))?;
    write(TRUST_BUNDLE, bundle.as_bytes()).map_err(|e| io(TRUST_BUNDLE, e))?;
    let mut vars: Vec<(String, String)> =
        BUNDLE_VARS.iter().map(|v| (v.to_string(), TRUST_BUNDLE.to_string())).collect();
    vars.push((NODE_VAR.to_string(), TRUST_EXTRA.to_string()));
    crate::env::set_trust(vars)
}

/// The PEM certificate blocks of `text`, each from its BEGIN to its END line.
fn certificates(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(BEGIN) {
        let after = &rest[start..];
        let Some(end) = after.find(END) else { break };
        out.push(after[..end + END.len()].to_string());
        rest = &after[end + END.len()..];
    }
    out
}

/// A block's base64 body, whitespace removed: the same certificate
/// whatever its line breaks.
fn body(block: &str) -> String {
    block.trim_start_matches(BEGIN).trim_end_matches(END).chars().filter(|c| !c.is_whitespace()).collect()
}

/// Writes `bytes` to `path` (mode 0644) through a temporary name and a
/// rename, so a reader never sees half a bundle.
fn write(path: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = format!("{path}.tmp");
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(&tmp)?;
    f.write_all(bytes)?;
    drop(f);
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_found_and_compared_by_their_bodies() {
        let a = format!("{BEGIN}\nAAAA\nBBBB\n{END}");
        let text = format!("junk\n{a}\nmore\n{BEGIN}\nCCCC\n{END}\n");
        let found = certificates(&text);
        assert_eq!(found.len(), 2);
        assert_eq!(body(&found[0]), "AAAABBBB");
        assert_eq!(body(&format!("{BEGIN}\nAAAABBBB\n{END}")), body(&a), "line breaks do not matter");
        assert!(certificates("no pem here").is_empty());
        assert!(matches!(install("not pem"), Err(AgentError::InvalidRequest { .. })));
    }
}
