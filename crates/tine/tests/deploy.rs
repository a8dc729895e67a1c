//! `deploy/`: the Kubernetes manifests (`deploy/kubernetes/*.yaml`)
//! validate against the Kubernetes JSON schemas, strictly, with
//! `kubernetes-validate` (PyPI, pinned; `scripts/setup.sh` installs it in
//! its venv, schemas bundled, no network), which is also shown to reject
//! broken ones; the manifests agree with each other and with the server
//! (the ConfigMap's `tine.toml` goes through the server's own parser); and
//! the Grafana dashboard (`deploy/grafana/tine-dashboard.json`) only
//! queries series the server exports, with their labels.
//!
//! A missing venv skips the validator's tests loudly, or fails them under
//! `$TINE_REQUIRE_PY_SDK` / `$CI` (as `scripts/test.sh` sets).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The validator and its version (`scripts/setup.sh` pins the same).
const VALIDATOR: &str = "kubernetes-validate";
const VALIDATOR_VERSION: &str = "1.37.0";
/// The Kubernetes version whose schemas the manifests must meet (bundled
/// by the validator).
const KUBERNETES_VERSION: &str = "1.33.0";

/// Every resource in `deploy/kubernetes/`, as the validator names them.
const RESOURCES: [&str; 9] = [
    "namespace/tine",
    "secret/tine-token",
    "secret/tine-tenants",
    "secret/tine-peer-key",
    "configmap/tine-config",
    "daemonset/tine",
    "service/tine",
    "service/tine-peers",
    "ingress/tine",
];

/// The series families `/metrics` exports (crates/tine/src/metrics.rs),
/// whether each is a histogram (`_bucket` with `le`, `_sum`, `_count`),
/// and their labels. The server's own `/metrics` test checks that it
/// exports these same names; this list is what the dashboard may query.
const FAMILIES: &[(&str, bool, &[&str])] = &[
    ("tine_sandboxes", false, &["state"]),
    ("tine_sandboxes_created_total", false, &["how"]),
    ("tine_sandbox_start_seconds", true, &["how"]),
    ("tine_sandboxes_killed_total", false, &["reason"]),
    ("tine_tool_calls_total", false, &["tool", "tenant", "outcome"]),
    ("tine_tenant_sandboxes", false, &["tenant", "state"]),
    ("tine_tool_call_duration_seconds", true, &["tool"]),
    ("tine_guest_memory_bytes", false, &[]),
    ("tine_guest_memory_budget_bytes", false, &[]),
    ("tine_disk_bytes", false, &["kind"]),
    ("tine_disk_reserved_bytes", false, &[]),
    ("tine_disk_budget_bytes", false, &[]),
    ("tine_pool_ready", false, &[]),
    ("tine_pool_size", false, &[]),
    ("tine_mcp_sessions", false, &[]),
    ("tine_forwarded_calls_total", false, &["peer", "outcome"]),
    ("tine_build_info", false, &["version", "host"]),
];
/// Labels Prometheus adds to every scraped series.
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `deploy/kubernetes/*.yaml`, sorted.
fn manifests() -> Vec<PathBuf> {
    let dir = repo().join("deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "deploy/kubernetes has only {files:?}");
    files
}

/// The venv with the validator, or `None` after a SKIPPED line (see the
/// module's comment).
fn venv(test: &str) -> Option<PathBuf> {
    testkit::mcp::python_venv_with(test, VALIDATOR, VALIDATOR_VERSION)
}

/// Runs the validator on `files`: whether it succeeded, and its output.
fn validate(venv: &Path, files: &[PathBuf]) -> (bool, String) {
    let out = Command::new(venv.join("bin").join(VALIDATOR))
        .args(["--kubernetes-version", KUBERNETES_VERSION, "--strict"])
        .args(files)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {VALIDATOR}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn kubernetes_manifests_validate_strictly() {
    let Some(venv) = venv("kubernetes_manifests_validate_strictly") else {
        return;
    };
    let files = manifests();
    let (ok, out) = validate(&venv, &files);
    eprintln!("--- {VALIDATOR} {VALIDATOR_VERSION}, Kubernetes {KUBERNETES_VERSION}, --strict:\n{out}");
    assert!(ok, "the manifests do not validate");
    // A kind or apiVersion without a schema only warns (and passes).
    assert!(!out.contains("WARN"), "the validator warned");
    for r in RESOURCES {
        assert!(out.contains(&format!("passed for resource {r} ")), "{r} was not validated");
    }
    assert_eq!(out.matches("passed for resource").count(), RESOURCES.len(), "resources other than {RESOURCES:?}");
}

#[test]
fn the_validator_rejects_broken_manifests() {
    let Some(venv) = venv("the_validator_rejects_broken_manifests") else {
        return;
    };
    let good = std::fs::read_to_string(repo().join("deploy/kubernetes/30-daemonset.yaml")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let without_selector = {
        let (start, end) = (good.find("\n  selector:\n").unwrap(), good.find("\n  updateStrategy:").unwrap());
        format!("{}{}", &good[..start], &good[end..])
    };
    let cases = [
        ("unchanged", good.clone(), None),
        ("port-name", good.replace("containerPort: 5555", "containerPort: \"http\""), Some("is not of type 'integer'")),
        ("no-selector", without_selector, Some("'selector' is a required property")),
        ("typo", good.replace("hostNetwork: false", "hostNetwrok: false"), Some("'hostNetwrok' was unexpected")),
    ];
    for (name, text, error) in cases {
        assert!(error.is_none() || text != good, "{name}: the edit changed nothing");
        let file = dir.path().join(format!("{name}.yaml"));
        std::fs::write(&file, text).unwrap();
        let (ok, out) = validate(&venv, &[file]);
        eprintln!("--- {name}:\n{out}");
        match error {
            None => assert!(ok, "{name}: the unchanged DaemonSet must pass"),
            Some(e) => {
                assert!(!ok, "{name}: the validator accepted a broken DaemonSet");
                assert!(out.contains(e), "{name}: expected {e:?}");
            }
        }
    }
}

/// Every YAML document of `files`, as JSON (PyYAML, from the venv).
fn yaml_documents(venv: &Path, files: &[PathBuf]) -> Vec<Value> {
    let script = "import json, sys, yaml\n\
                  print(json.dumps([d for f in sys.argv[1:] for d in yaml.safe_load_all(open(f)) if d]))";
    let out = Command::new(venv.join("bin/python")).args(["-c", script]).args(files).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in deploy/kubernetes"))
}

/// A memory quantity in bytes (only the binary suffixes used here).
fn quantity(q: &str) -> u64 {
    let (n, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
    let n: u64 = n.parse().unwrap_or_else(|_| panic!("quantity {q:?}"));
    n * match unit {
        "Gi" => 1 << 30,
        "Mi" => 1 << 20,
        other => panic!("quantity {q:?}: unit {other:?}"),
    }
}

#[test]
fn the_manifests_agree_with_each_other_and_the_server() {
    let Some(venv) = venv("the_manifests_agree_with_each_other_and_the_server") else {
        return;
    };
    let docs = yaml_documents(&venv, &manifests());
    let secret = find(&docs, "Secret", "tine-token");
    let config_map = find(&docs, "ConfigMap", "tine-config");
    let ds = find(&docs, "DaemonSet", "tine");
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];

    // The configuration goes through the server's own parser (unknown
    // keys are errors there): `tine template list` loads it, with stand-in
    // images and data directory.
    let text = config_map["data"]["tine.toml"].as_str().expect("tine.toml in the ConfigMap");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tine.toml");
    std::fs::write(&config, text).unwrap();
    for image in ["vmlinux", "rootfs.ext4"] {
        std::fs::write(dir.path().join(image), "stand-in").unwrap();
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tine"))
        .args(["template", "list", "--config"])
        .arg(&config)
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--kernel")
        .arg(dir.path().join("vmlinux"))
        .arg("--rootfs")
        .arg(dir.path().join("rootfs.ext4"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the server refuses the ConfigMap's tine.toml: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let toml: toml::Value = toml::from_str(text).unwrap();

    // The port: the config's listen, the container's port `http`, which
    // the probes, both Services and the Ingress use by name.
    let listen = toml["listen"].as_str().unwrap();
    let port: u64 = listen.rsplit(':').next().unwrap().parse().unwrap();
    assert!(listen.starts_with("0.0.0.0:"), "listen {listen}: the kubelet and the Services reach the pod's IP");
    assert_eq!(c["ports"][0]["containerPort"], port);
    assert_eq!(c["ports"][0]["name"], "http");
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        assert_eq!(c[probe]["httpGet"]["path"], "/healthz", "{probe}");
        assert_eq!(c[probe]["httpGet"]["port"], "http", "{probe}");
    }

    // The token from the Secret as $TINE_TOKEN; the host name is the pod's
    // IP (which the server writes with dashes, as the DNS names below).
    let env = |name: &str| -> &Value {
        c["env"].as_array().unwrap().iter().find(|e| e["name"] == name).unwrap_or_else(|| panic!("no env {name}"))
    };
    let token = &env("TINE_TOKEN")["valueFrom"]["secretKeyRef"];
    assert_eq!(token["name"], secret["metadata"]["name"]);
    let key = token["key"].as_str().unwrap();
    assert!(secret["stringData"][key].is_string(), "the Secret has no {key}");
    assert_eq!(env("TINE_HOST_NAME")["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP");

    // The config file is the ConfigMap's, where the args say.
    let args: Vec<&str> = c["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    let config_path = args[args.iter().position(|a| *a == "--config").unwrap() + 1];
    let mount = c["volumeMounts"].as_array().unwrap().iter().find(|m| m["name"] == "config").unwrap();
    assert_eq!(format!("{}/tine.toml", mount["mountPath"].as_str().unwrap()), config_path);
    let volume = |name: &str| -> &Value {
        pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no volume {name}"))
    };
    assert_eq!(volume("config")["configMap"]["name"], config_map["metadata"]["name"]);
    assert_eq!(toml["data_dir"].as_str(), Some("/var/lib/tine"));
    assert!(args.windows(2).any(|w| w == ["--data-dir", "/var/lib/tine"]));

    // KVM nodes only, the devices, its own network namespace.
    assert_eq!(pod["nodeSelector"]["tine.dev/kvm"], "true");
    assert_eq!(pod["hostNetwork"], false);
    for dev in ["/dev/kvm", "/dev/userfaultfd"] {
        let v = pod["volumes"].as_array().unwrap().iter().find(|v| v["hostPath"]["path"] == dev).unwrap();
        assert_eq!(v["hostPath"]["type"], "CharDevice", "{dev}");
        assert!(c["volumeMounts"].as_array().unwrap().iter().any(|m| m["mountPath"] == dev), "{dev} not mounted");
    }

    // Capacity: the pod's memory (request = limit) holds the guests'
    // budget, and some more for the daemon itself.
    let budget = toml["limits"]["memory_budget_mib"].as_integer().unwrap() as u64;
    assert!(budget > 0, "memory_budget_mib must be set on Kubernetes");
    let (request, limit) = (&c["resources"]["requests"]["memory"], &c["resources"]["limits"]["memory"]);
    assert_eq!(request, limit, "memory request and limit differ");
    let memory = quantity(request.as_str().unwrap());
    assert!(
        memory >= (budget << 20) + (1 << 30),
        "pod memory {request} leaves the daemon under 1 GiB over {budget} MiB"
    );

    // Both Services select the DaemonSet's pods by its port name.
    let labels = &ds["spec"]["template"]["metadata"]["labels"];
    assert_eq!(&ds["spec"]["selector"]["matchLabels"], labels);
    for name in ["tine", "tine-peers"] {
        let svc = find(&docs, "Service", name);
        for (k, v) in svc["spec"]["selector"].as_object().unwrap() {
            assert_eq!(&labels[k], v, "Service {name} selects {k}={v}");
        }
        assert_eq!(svc["spec"]["ports"][0]["targetPort"], "http");
    }

    // Peers: the headless Service publishes every ready pod as
    // <dashed-ip>.<service>.<namespace>.svc.cluster.local, and peer_url
    // turns a host name (the dashed IP) into that name and the pod's port.
    let peers = find(&docs, "Service", "tine-peers");
    assert_eq!(peers["spec"]["clusterIP"], "None");
    assert_ne!(peers["spec"]["publishNotReadyAddresses"], true, "a pod that is not ready owns no session");
    let peer_url = toml["cluster"]["peer_url"].as_str().expect("[cluster] peer_url in the ConfigMap");
    assert!(peer_url.contains("{host}"), "peer_url {peer_url} has no {{host}}");
    let (name, namespace) =
        (peers["metadata"]["name"].as_str().unwrap(), peers["metadata"]["namespace"].as_str().unwrap());
    assert_eq!(namespace, ds["metadata"]["namespace"]);
    assert_eq!(peer_url, format!("http://{{host}}.{name}.{namespace}.svc.cluster.local:{port}"));
    // Pods present a key of their own to each other, from its own Secret,
    // mode 0400 (the server refuses a key others can read); never the token.
    let peer_key_file = toml["cluster"]["peer_key_file"].as_str().expect("[cluster] peer_key_file in the ConfigMap");
    let peer_key = find(&docs, "Secret", "tine-peer-key");
    let (dir, key) = peer_key_file.rsplit_once('/').unwrap();
    let mount = c["volumeMounts"].as_array().unwrap().iter().find(|m| m["mountPath"] == dir).expect("peer key mount");
    let v = volume(mount["name"].as_str().unwrap());
    assert_eq!(v["secret"]["secretName"], peer_key["metadata"]["name"]);
    assert_ne!(v["secret"]["secretName"], secret["metadata"]["name"], "the peer key is not the operator's token");
    assert_eq!(v["secret"]["defaultMode"], 0o400);
    assert!(peer_key["stringData"][key].is_string(), "the Secret tine-peer-key has no {key}");
    // rmcp matches allowed_hosts exactly: a pattern would match nothing.
    let allowed: Vec<&str> = toml["allowed_hosts"].as_array().unwrap().iter().map(|h| h.as_str().unwrap()).collect();
    for h in &allowed {
        assert!(!h.contains(['*', '{', '/']), "allowed_hosts entry {h:?} is not a host name");
    }

    // The Ingress: its host accepted by the server, sessions kept by a
    // cookie, not by hashing Mcp-Session-Id (ingress-nginx hashes the
    // empty key of every `initialize` onto one pod), the client Service
    // behind it.
    let ingress = find(&docs, "Ingress", "tine");
    let host = ingress["spec"]["rules"][0]["host"].as_str().unwrap();
    assert!(allowed.contains(&host), "{host} is not in allowed_hosts {allowed:?}");
    let annotations = &ingress["metadata"]["annotations"];
    assert_eq!(annotations["nginx.ingress.kubernetes.io/affinity"], "cookie");
    assert_eq!(annotations["nginx.ingress.kubernetes.io/affinity-mode"], "persistent");
    assert!(annotations["nginx.ingress.kubernetes.io/upstream-hash-by"].is_null(), "hashing and cookie affinity");
    let backend = &ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"];
    assert_eq!(backend["name"], "tine");
    assert_eq!(backend["port"]["name"], "http");
}

/// A label matcher: label, operator (`=`, `!=`, `=~`, `!~`), value.
type Matcher = (String, String, String);
/// A series selector: the metric name and its matchers.
type Selector = (String, Vec<Matcher>);

/// The metric names in a PromQL expression (identifiers outside strings,
/// ranges and Grafana variables that start with `tine_`), each with the
/// label names of its selector, and the labels of every `by`/`without`.
fn promql_names(expr: &str) -> (Vec<Selector>, Vec<String>) {
    let b = expr.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b':';
    let skip_ws = |mut i: usize| {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    let (mut metrics, mut grouping) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' | b'\'' => {
                let q = b[i];
                i += 1;
                while i < b.len() && b[i] != q {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'[' => i = expr[i..].find(']').map_or(b.len(), |j| i + j + 1),
            b'$' => {
                i += 1;
                while i < b.len() && ident(b[i]) {
                    i += 1;
                }
            }
            c if ident(c) && !c.is_ascii_digit() => {
                let start = i;
                while i < b.len() && ident(b[i]) {
                    i += 1;
                }
                let word = &expr[start..i];
                let next = skip_ws(i);
                if word.starts_with("tine_") {
                    let mut matchers = Vec::new();
                    if next < b.len() && b[next] == b'{' {
                        let end = next + expr[next..].find('}').expect("unclosed selector");
                        for m in expr[next + 1..end].split(',').filter(|m| !m.trim().is_empty()) {
                            let op_at = m.find(['=', '!']).unwrap_or_else(|| panic!("matcher {m:?} in {expr}"));
                            let op_len = if m[op_at + 1..].starts_with(['=', '~']) { 2 } else { 1 };
                            let value = m[op_at + op_len..].trim().trim_matches('"');
                            matchers.push((m[..op_at].trim().into(), m[op_at..op_at + op_len].into(), value.into()));
                        }
                        i = end + 1;
                    }
                    metrics.push((word.to_string(), matchers));
                } else if (word == "by" || word == "without") && next < b.len() && b[next] == b'(' {
                    let end = next + expr[next..].find(')').unwrap();
                    grouping.extend(expr[next + 1..end].split(',').map(|l| l.trim().to_string()));
                    i = end + 1;
                }
            }
            _ => i += 1,
        }
    }
    (metrics, grouping)
}

/// Every string under key `key`, anywhere in `v`.
fn strings_at<'a>(v: &'a Value, key: &str, out: &mut Vec<&'a str>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                match x {
                    Value::String(s) if k == key => out.push(s),
                    _ => strings_at(x, key, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| strings_at(x, key, out)),
        _ => {}
    }
}

#[test]
fn the_grafana_dashboard_queries_only_exported_series() {
    let path = repo().join("deploy/grafana/tine-dashboard.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).expect("the dashboard is JSON");
    assert_eq!(dash["schemaVersion"], 39);
    let vars = dash["templating"]["list"].as_array().unwrap();
    let var = |name: &str| vars.iter().find(|v| v["name"] == name).unwrap_or_else(|| panic!("no variable {name}"));
    assert_eq!(var("DS_PROMETHEUS")["type"], "datasource");
    assert_eq!(var("DS_PROMETHEUS")["query"], "prometheus");
    assert_eq!(var("instance")["type"], "query");

    // Every Prometheus query goes to the variable's data source.
    let mut sources = Vec::new();
    strings_at(&dash, "uid", &mut sources);
    for s in sources.iter().filter(|s| **s != "tine-overview" && **s != "-- Grafana --") {
        assert_eq!(*s, "${DS_PROMETHEUS}", "a data source other than the variable");
    }
    let mut ids = BTreeSet::new();
    for p in dash["panels"].as_array().unwrap() {
        assert!(ids.insert(p["id"].as_u64().unwrap()), "panel id {} twice", p["id"]);
        if p["type"] != "row" {
            assert!(!p["targets"].as_array().unwrap().is_empty(), "panel {} has no query", p["title"]);
        }
    }

    let mut exprs = Vec::new();
    strings_at(&dash, "expr", &mut exprs);
    strings_at(&dash, "definition", &mut exprs);
    assert!(exprs.len() >= 20, "only {} queries", exprs.len());
    let mut used = BTreeSet::new();
    let all_labels: BTreeSet<&str> =
        FAMILIES.iter().flat_map(|f| f.2.iter().copied()).chain(TARGET_LABELS).chain(["le"]).collect();
    for expr in &exprs {
        let (metrics, grouping) = promql_names(expr);
        assert!(!metrics.is_empty(), "no tine_ series in {expr}");
        for (name, matchers) in metrics {
            let (family, labels) = FAMILIES
                .iter()
                .find_map(|(f, histogram, labels)| {
                    let mut ok = name == *f;
                    let mut labels = labels.to_vec();
                    if *histogram {
                        ok = ["_sum", "_count"].iter().any(|s| name == format!("{f}{s}"));
                        if name == format!("{f}_bucket") {
                            ok = true;
                            labels.push("le");
                        }
                    }
                    ok.then_some((*f, labels))
                })
                .unwrap_or_else(|| panic!("{name} in {expr} is not a series the server exports"));
            used.insert(family);
            for (label, op, value) in matchers {
                assert!(
                    labels.contains(&label.as_str()) || TARGET_LABELS.contains(&label.as_str()),
                    "{name} has no label {label} ({expr})"
                );
                if op != "=" {
                    continue;
                }
                let known: &[&str] = match label.as_str() {
                    "state" => &["starting", "running", "paused", "hibernated", "stopped", "failed"],
                    "how" => &["boot", "restore", "pool", "branch"],
                    "outcome" => &["ok", "error"],
                    _ => &[],
                };
                assert!(known.is_empty() || known.contains(&value.as_str()), "{label}=\"{value}\" in {expr}");
                if label == "tool" {
                    assert!(value.starts_with("sandbox_"), "tool \"{value}\" is not an MCP tool name ({expr})");
                }
            }
        }
        for label in grouping {
            assert!(all_labels.contains(label.as_str()), "grouping by {label}, which no series has ({expr})");
        }
    }
    let unused: Vec<&str> = FAMILIES.iter().map(|f| f.0).filter(|f| !used.contains(f)).collect();
    assert!(unused.is_empty(), "the dashboard shows nothing of {unused:?}");
    eprintln!("{} queries over {} series families: all exported", exprs.len(), used.len());
}
