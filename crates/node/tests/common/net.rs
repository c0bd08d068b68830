//! Network helpers of the node's VM tests: shell steps that must work, listeners that count
//! what reaches them, and nftables rulesets read back as JSON (`nft -j`).

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

pub fn run(script: &str) {
    let out = std::process::Command::new("sh")
        .args(["-e", "-c", script])
        .output()
        .expect("sh");
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A listener that counts the connections it accepts, bound in `netns` (None: the host's).
pub struct Listener {
    pub port: u16,
    pub hits: Arc<AtomicUsize>,
}

pub fn listen(netns: Option<&str>, ip: Ipv4Addr) -> Listener {
    let (tx, rx) = std::sync::mpsc::channel();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    let netns = netns.map(String::from);
    std::thread::spawn(move || {
        if let Some(ns) = netns {
            let f = std::fs::File::open(format!("/run/netns/{ns}")).expect("netns");
            // SAFETY: setns on a descriptor we own; it moves only this thread.
            let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns");
        }
        let l = TcpListener::bind(SocketAddr::from((ip, 0))).expect("bind");
        tx.send(l.local_addr().expect("addr").port()).expect("send");
        for c in l.incoming() {
            if c.is_ok() {
                h.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    let port = rx.recv_timeout(Duration::from_secs(10)).expect("port");
    Listener { port, hits }
}

pub fn nft_json(netns: Option<&str>, what: &[&str]) -> Value {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = std::process::Command::new("ip");
            c.args(["netns", "exec", ns, "nft", "-j"]);
            c
        }
        None => {
            let mut c = std::process::Command::new("nft");
            c.arg("-j");
            c
        }
    };
    let out = cmd.args(what).output().expect("nft -j");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("nft json")
}

/// The rules of `chain` as their expression lists, in order.
pub fn chain_rules(doc: &Value, chain: &str) -> Vec<Vec<Value>> {
    doc["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|o| o.get("rule"))
        .filter(|r| r["chain"] == chain)
        .map(|r| r["expr"].as_array().cloned().unwrap_or_default())
        .collect()
}

pub fn chain_policy(doc: &Value, chain: &str) -> Option<String> {
    doc["nftables"]
        .as_array()?
        .iter()
        .filter_map(|o| o.get("chain"))
        .find(|c| c["name"] == chain)
        .and_then(|c| c["policy"].as_str().map(String::from))
}

/// The prefixes and addresses a rule's `ip daddr` matches, as "a.b.c.d/len" strings.
pub fn daddr_set(expr: &[Value]) -> Vec<String> {
    let mut out = Vec::new();
    for e in expr {
        let m = &e["match"];
        if m["left"]["payload"]["field"] != "daddr" {
            continue;
        }
        let items: Vec<Value> = match &m["right"] {
            Value::Object(o) if o.contains_key("set") => {
                o["set"].as_array().cloned().unwrap_or_default()
            }
            other => vec![other.clone()],
        };
        for it in items {
            match it {
                Value::String(s) => out.push(format!("{s}/32")),
                Value::Object(o) if o.contains_key("prefix") => out.push(format!(
                    "{}/{}",
                    o["prefix"]["addr"].as_str().unwrap_or(""),
                    o["prefix"]["len"]
                )),
                _ => {}
            }
        }
    }
    out
}

pub fn verdict(expr: &[Value]) -> Option<&'static str> {
    expr.iter().find_map(|e| {
        if e.get("drop").is_some() {
            Some("drop")
        } else if e.get("accept").is_some() {
            Some("accept")
        } else {
            None
        }
    })
}

/// True when `expr` matches `ip saddr != <want>` (an address or a prefix "a.b.c.d/len").
pub fn saddr_not(expr: &[Value], want: &str) -> bool {
    expr.iter().any(|e| {
        let m = &e["match"];
        if m["left"]["payload"]["field"] != "saddr" || m["op"] != "!=" {
            return false;
        }
        match &m["right"] {
            Value::String(s) => s == want,
            Value::Object(o) => o.get("prefix").is_some_and(|p| {
                format!("{}/{}", p["addr"].as_str().unwrap_or(""), p["len"]) == want
            }),
            _ => false,
        }
    })
}
