//! Network isolation with real guests: what a guest can and cannot reach. Every packet goes to
//! an address this test controls (another guest's slot, the host's veth ends, listeners the test
//! binds on the host and in a namespace it makes); for ranges a test cannot host, the installed
//! rulesets are read back as JSON (`nft -j`) and checked.

mod common;

use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::net::{
    chain_policy, chain_rules, daddr_set, listen, nft_json, run, saddr_not, verdict,
};
use common::{host_lock, node_with, runtime, unique};
use vmon_proto::node::{NetworkPolicy, NodeCalls};

/// envd's port in every guest.
const ENVD: u16 = 49983;

/// A namespace standing in for the network beyond the host: a "public" address (TEST-NET-3,
/// never routed on the internet) and a private one, behind a veth whose host end has an address
/// of its own (one of the host's addresses a guest must not reach).
struct Beyond {
    ns: String,
}

const NS: &str = "vmt-beyond";
const HOST_IF: &str = "vmt-by0";
const PUBLIC: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
const PUBLIC_HOST: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const PRIVATE: Ipv4Addr = Ipv4Addr::new(10, 231, 77, 2);
/// Stands in for a part of the cluster (etcd, say): inside the private range the operator opens,
/// and in the node's protected list.
const PROTECTED: Ipv4Addr = Ipv4Addr::new(10, 231, 77, 3);
/// What the operator's `private_allow` opens: the private server's /24 (PROTECTED included).
const PRIVATE_ALLOW: &str = "10.231.77.0/24";

/// This binary's node: `private_allow` opens [`PRIVATE_ALLOW`], [`PROTECTED`] is protected.
fn node() -> std::sync::Arc<vmon_node::Node> {
    node_with(|c| {
        c.private_allow = vec![PRIVATE_ALLOW.to_string()];
        c.protected = vec![PROTECTED.to_string()];
    })
}

impl Beyond {
    fn make() -> Beyond {
        let _ = std::process::Command::new("sh")
            .args([
                "-c",
                &format!("ip netns del {NS} 2>/dev/null; ip link del {HOST_IF} 2>/dev/null; true"),
            ])
            .status();
        run(&format!(
            "ip netns add {NS}
ip link add {HOST_IF} type veth peer name eth0 netns {NS}
ip addr add {PUBLIC_HOST}/24 dev {HOST_IF}
ip addr add 10.231.77.1/24 dev {HOST_IF}
ip link set {HOST_IF} up
ip -n {NS} link set lo up
ip -n {NS} addr add {PUBLIC}/24 dev eth0
ip -n {NS} addr add {PRIVATE}/24 dev eth0
ip -n {NS} addr add {PROTECTED}/24 dev eth0
ip -n {NS} link set eth0 up"
        ));
        Beyond { ns: NS.into() }
    }
}

impl Drop for Beyond {
    fn drop(&mut self) {
        let _ = std::process::Command::new("sh")
            .args([
                "-c",
                &format!("ip netns del {} ; ip link del {HOST_IF}", self.ns),
            ])
            .status();
    }
}

/// One probe per target from inside the guest: "reached" or "blocked" per line.
async fn probe(node: &vmon_node::Node, id: &str, targets: &[(Ipv4Addr, u16)]) -> Vec<String> {
    // Parallel probes, printed in any order: tag each with its target.
    let cmd = targets
        .iter()
        .map(|(ip, port)| {
            format!(
                "(timeout 3 bash -c 'echo x > /dev/tcp/{ip}/{port}' 2>/dev/null && echo {ip}:{port}=reached || echo {ip}:{port}=blocked) & "
            )
        })
        .collect::<String>()
        + "wait";
    let out = node
        .exec(id, "root", &cmd, Duration::from_secs(60))
        .await
        .expect("exec");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    targets
        .iter()
        .map(|(ip, port)| {
            let key = format!("{ip}:{port}=");
            text.lines()
                .find_map(|l| l.strip_prefix(&key).map(String::from))
                .unwrap_or_else(|| panic!("no answer for {key} in {text:?}"))
        })
        .collect()
}

/// The namespace and host chain names of the slot whose guest is reached at `addr`.
fn slot_names(addr: Ipv4Addr) -> (String, String) {
    let n = (u32::from(addr) - u32::from(Ipv4Addr::new(169, 254, 128, 0))) / 4;
    let (block, index) = (n / 512, n % 512);
    (
        format!("vmon{block:x}-s{index}"),
        format!("s-vmh{block:x}-{index}"),
    )
}

/// A private range the operator's `private_allow` does not list is refused, before anything
/// boots, with a message naming the entry and the setting.
async fn refuses_private_ranges_it_does_not_list(node: &vmon_node::Node) {
    for entry in ["10.231.78.2", "192.168.0.0/16", "10.0.0.0/8"] {
        let refused = NetworkPolicy {
            allow_internet_access: true,
            allow_out: vec![entry.to_string()],
            deny_out: vec![],
        };
        match node.boot_image(&unique("isor"), 1, 384, &refused).await {
            Err(vmon_proto::node::NodeError::InvalidArgument(m)) => {
                assert!(m.contains(entry) && m.contains("private_allow"), "{m}")
            }
            other => panic!(
                "allowOut {entry} outside private_allow: {:?}",
                other.map(|r| r.sandbox_id)
            ),
        }
    }
}

#[test]
fn a_guest_reaches_only_the_internet_and_what_allow_out_opens() {
    let node = node();
    let _exclusive = host_lock().write();
    let beyond = Beyond::make();
    runtime().block_on(async {
        let (a_id, b_id) = (unique("isoa"), unique("isob"));
        let open = NetworkPolicy {
            allow_internet_access: true,
            ..Default::default()
        };
        refuses_private_ranges_it_does_not_list(&node).await;
        // B: no internet, but its allowOut names the private server's range (which
        // private_allow lists; the protected address inside it stays closed).
        let closed = NetworkPolicy {
            allow_internet_access: false,
            allow_out: vec![PRIVATE_ALLOW.to_string()],
            deny_out: vec![],
        };
        let (ra, rb) = tokio::join!(
            node.boot_image(&a_id, 1, 384, &open),
            node.boot_image(&b_id, 1, 384, &closed)
        );
        let (ra, rb) = (ra.expect("boot a"), rb.expect("boot b"));
        let ip4 = |ip: std::net::IpAddr| match ip {
            std::net::IpAddr::V4(v) => v,
            other => panic!("{other}"),
        };
        let (a_addr, b_addr) = (ip4(ra.guest_ip), ip4(rb.guest_ip));
        let a_host_end = Ipv4Addr::from(u32::from(a_addr) - 1);

        let public = listen(Some(&beyond.ns), PUBLIC);
        let private = listen(Some(&beyond.ns), PRIVATE);
        let protected = listen(Some(&beyond.ns), PROTECTED);
        let host_end = listen(None, a_host_end);
        let host_other = listen(None, PUBLIC_HOST);
        // A server in guest B, on a port of its own.
        let b_srv = node
            .exec(
                &b_id,
                "root",
                "nohup python3 -c 'import socket,time\ns=socket.socket();s.bind((\"0.0.0.0\",8000));s.listen();time.sleep(600)' >/dev/null 2>&1 & echo started",
                Duration::from_secs(60),
            )
            .await
            .expect("server in b");
        assert_eq!(String::from_utf8_lossy(&b_srv.stdout).trim(), "started");
        tokio::time::sleep(Duration::from_millis(500)).await;

        // From A (internet allowed).
        let got = probe(
            &node,
            &a_id,
            &[
                (PUBLIC, public.port),
                (PRIVATE, private.port),
                (b_addr, 49983),
                (b_addr, 8000),
                (Ipv4Addr::from(u32::from(b_addr) - 1), 49983),
                (a_host_end, host_end.port),
                (PUBLIC_HOST, host_other.port),
                (Ipv4Addr::new(169, 254, 0, 22), 22),
            ],
        )
        .await;
        assert_eq!(
            got,
            ["reached", "blocked", "blocked", "blocked", "blocked", "blocked", "blocked", "blocked"],
            "from A: public, private, B's envd, B's server, B's host end, A's host end, host address, gateway"
        );
        // From B (no internet; allowOut opens the private server only).
        let got = probe(
            &node,
            &b_id,
            &[
                (PRIVATE, private.port),
                (PROTECTED, protected.port),
                (PUBLIC, public.port),
                (a_addr, 49983),
            ],
        )
        .await;
        assert_eq!(
            got,
            ["reached", "blocked", "blocked", "blocked"],
            "from B: private (allowed), protected (in the allowed range), public, A"
        );
        // What the guests reached, the listeners saw; nothing else.
        assert!(public.hits.load(Ordering::SeqCst) >= 1);
        assert!(private.hits.load(Ordering::SeqCst) >= 1);
        assert_eq!(host_end.hits.load(Ordering::SeqCst), 0, "host end of A's veth");
        assert_eq!(host_other.hits.load(Ordering::SeqCst), 0, "another host address");
        assert_eq!(protected.hits.load(Ordering::SeqCst), 0, "the protected address");

        // Ranges a test cannot host: read the installed rules back.
        let ns_doc = nft_json(Some(&slot_names(a_addr).0), &["list", "ruleset"]);
        assert_eq!(chain_policy(&ns_doc, "forward").as_deref(), Some("drop"));
        let rules = chain_rules(&ns_doc, "forward");
        let dropped: Vec<String> = rules
            .iter()
            .filter(|r| verdict(r) == Some("drop"))
            .flat_map(|r| daddr_set(r))
            .collect();
        for range in [
            "169.254.0.0/16",
            "127.0.0.0/8",
            "10.0.0.0/8",
            "172.16.0.0/12",
            "192.168.0.0/16",
            "100.64.0.0/10",
            "224.0.0.0/3",
        ] {
            assert!(dropped.iter().any(|d| d == range), "{range} not dropped in the slot: {dropped:?}");
        }
        let host_doc = nft_json(None, &["list", "table", "ip", "vmon"]);
        let input = chain_rules(&host_doc, "input");
        assert!(
            input.last().is_some_and(|r| verdict(r) == Some("drop")
                && r.iter().any(|e| e["match"]["right"] == "vmh*")),
            "the host drops what slots send to its own sockets: {input:?}"
        );
        let forward = chain_rules(&host_doc, "forward");
        let host_dropped: Vec<String> = forward
            .iter()
            .filter(|r| verdict(r) == Some("drop"))
            .flat_map(|r| daddr_set(r))
            .collect();
        for range in ["169.254.0.0/16", "10.0.0.0/8", "192.168.0.0/16", "10.231.77.3/32"] {
            assert!(host_dropped.iter().any(|d| d == range), "{range} not dropped on the host: {host_dropped:?}");
        }

        node.kill(&a_id, &ra.execution_id).await.expect("kill a");
        node.kill(&b_id, &rb.execution_id).await.expect("kill b");
        // The host keeps no rules for slots that are gone. A kill answers once
        // the guest is dead; its slot is freed just after, so this waits for it.
        let gone: Vec<String> = [a_addr, b_addr].into_iter().map(|a| slot_names(a).1).collect();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let host_doc = nft_json(None, &["list", "table", "ip", "vmon"]);
            let chains: Vec<String> = host_doc["nftables"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|o| o.get("chain").and_then(|c| c["name"].as_str()).map(String::from))
                .collect();
            let left: Vec<&String> = gone.iter().filter(|n| chains.contains(n)).collect();
            if left.is_empty() {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{left:?} left on the host 30 s after kill");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    drop(beyond);
}

/// Whether a TCP connection to `ip:port` opens within 5 s from a `bash` started under
/// `prefix` (e.g. `ip netns exec <ns>`), as `uid` (and the same gid) when given.
fn connects(prefix: &[&str], uid: Option<u32>, ip: Ipv4Addr, port: u16) -> bool {
    use std::os::unix::process::CommandExt;
    let probe = format!("echo x > /dev/tcp/{ip}/{port}");
    let argv: Vec<&str> = prefix
        .iter()
        .copied()
        .chain(["timeout", "5", "bash", "-c", &probe])
        .collect();
    let mut cmd = std::process::Command::new(argv[0]);
    cmd.args(&argv[1..]).stderr(std::process::Stdio::null());
    if let Some(u) = uid {
        cmd.uid(u).gid(u);
    }
    cmd.status().expect("bash").success()
}

/// A namespace standing in for a container on the host: a veth to the host, its default
/// route through it.
struct Container;

const CTR_NS: &str = "vmt-ctr";
const CTR_IF: &str = "vmt-ct0";
const CTR_HOST: Ipv4Addr = Ipv4Addr::new(10, 231, 79, 1);

impl Container {
    fn make() -> Container {
        let _ = std::process::Command::new("sh")
            .args([
                "-c",
                &format!(
                    "ip netns del {CTR_NS} 2>/dev/null; ip link del {CTR_IF} 2>/dev/null; true"
                ),
            ])
            .status();
        run(&format!(
            "ip netns add {CTR_NS}
ip link add {CTR_IF} type veth peer name eth0 netns {CTR_NS}
ip addr add {CTR_HOST}/24 dev {CTR_IF}
ip link set {CTR_IF} up
ip -n {CTR_NS} link set lo up
ip -n {CTR_NS} addr add 10.231.79.2/24 dev eth0
ip -n {CTR_NS} link set eth0 up
ip -n {CTR_NS} route add default via {CTR_HOST}"
        ));
        Container
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = std::process::Command::new("sh")
            .args([
                "-c",
                &format!("ip netns del {CTR_NS}; ip link del {CTR_IF} 2>/dev/null; true"),
            ])
            .status();
    }
}

/// The local-user suite: a guest's ports answer vmon (root: the node's envd client, the proxy)
/// and nobody else on the host, neither another local user nor a container's namespace.
#[test]
fn only_vmon_opens_connections_to_guests() {
    let node = node();
    let _exclusive = host_lock().write();
    let ctr = Container::make();
    runtime().block_on(async {
        let id = unique("local");
        let r = boot_open(&node, &id, 1).await;
        let addr = match r.guest_ip {
            std::net::IpAddr::V4(v) => v,
            other => panic!("{other}"),
        };
        let srv = node
            .exec(
                &id,
                "root",
                "nohup python3 -c 'import socket,time\ns=socket.socket();s.bind((\"0.0.0.0\",8000));s.listen();time.sleep(600)' >/dev/null 2>&1 & echo started",
                Duration::from_secs(60),
            )
            .await
            .expect("server in the guest");
        assert_eq!(String::from_utf8_lossy(&srv.stdout).trim(), "started");
        // Python starts slowly under TCG: wait until the guest itself reaches its server.
        let up = node
            .exec(
                &id,
                "root",
                "for i in $(seq 150); do (echo > /dev/tcp/127.0.0.1/8000) 2>/dev/null && echo up && break; sleep 0.2; done",
                Duration::from_secs(60),
            )
            .await
            .expect("wait for the server");
        assert_eq!(String::from_utf8_lossy(&up.stdout).trim(), "up");
        let nobody = Some(65534);
        let host = listen(None, Ipv4Addr::LOCALHOST);
        let ctr_host = listen(None, CTR_HOST);
        // What each caller reaches; the last column is the control (the caller can connect
        // at all).
        let got = tokio::task::spawn_blocking(move || {
            let ns: &[&str] = &["ip", "netns", "exec", CTR_NS];
            [
                (
                    "root",
                    connects(&[], None, addr, ENVD),
                    connects(&[], None, addr, 8000),
                    true,
                ),
                (
                    "nobody",
                    connects(&[], nobody, addr, ENVD),
                    connects(&[], nobody, addr, 8000),
                    connects(&[], nobody, Ipv4Addr::LOCALHOST, host.port),
                ),
                (
                    "container",
                    connects(ns, None, addr, ENVD),
                    connects(ns, None, addr, 8000),
                    connects(ns, None, CTR_HOST, ctr_host.port),
                ),
            ]
        })
        .await
        .expect("probes");
        assert_eq!(
            got,
            [
                ("root", true, true, true),
                ("nobody", false, false, true),
                ("container", false, false, true)
            ],
            "(who, envd, a guest server, control)"
        );
        // The node's own envd client (root) still reaches the guest.
        let out = node
            .exec(&id, "user", "echo still", Duration::from_secs(60))
            .await
            .expect("exec after the probes");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "still");
        // The rules that did it, read back: only uid 0 opens connections into slot veths, and
        // nothing is forwarded into them but replies.
        let host_doc = nft_json(None, &["list", "table", "ip", "vmon"]);
        let output = chain_rules(&host_doc, "output");
        let text = serde_json::to_string(&output).expect("json");
        assert!(text.contains("skuid"), "{text}");
        assert!(
            output.last().is_some_and(|r| verdict(r) == Some("drop")),
            "the output chain ends in a drop for slot veths: {text}"
        );
        node.kill(&id, &r.execution_id).await.expect("kill");
    });
    drop(ctr);
}

/// Boots a guest with internet access, `vcpus` vCPUs and 384 MiB.
async fn boot_open(node: &vmon_node::Node, id: &str, vcpus: u32) -> vmon_proto::node::Running {
    let open = NetworkPolicy {
        allow_internet_access: true,
        ..Default::default()
    };
    node.boot_image(id, vcpus, 384, &open).await.expect("boot")
}

/// The QEMU process serving the guest reached at `addr`: the one process in its slot.
fn qemu_pid(addr: Ipv4Addr) -> u32 {
    let out = std::process::Command::new("ip")
        .args(["netns", "pids", &slot_names(addr).0])
        .output()
        .expect("ip netns pids");
    let pids: Vec<u32> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                c.starts_with(b"/usr/bin/qemu-system") || c.windows(11).any(|w| w == b"qemu-system")
            })
        })
        .collect();
    assert_eq!(pids.len(), 1, "one QEMU in the slot: {pids:?}");
    pids[0]
}

/// The directory of `pid`'s group in the hierarchy that has `controller` (v1), or its v2 group.
fn group_dir(pid: u32, controller: &str) -> std::path::PathBuf {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    if std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        let path = text
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .expect("v2 line");
        return std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    }
    let path = text
        .lines()
        .find_map(|l| {
            let mut p = l.splitn(3, ':');
            let (_, ctrls, path) = (p.next()?, p.next()?, p.next()?);
            ctrls.split(',').any(|c| c == controller).then_some(path)
        })
        .expect("v1 line");
    std::path::Path::new("/sys/fs/cgroup")
        .join(controller)
        .join(path.trim_start_matches('/'))
}

fn read_num(p: std::path::PathBuf) -> String {
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .trim()
        .to_string()
}

/// A guest cannot send with another source address: the slot's forward chain drops what
/// comes from `tap0` with a source other than the guest's, and the host's drops what comes
/// from a slot veth with a source outside the slot range (both read back as JSON).
fn assert_spoofing_dropped(ns: &str) {
    let ns_doc = nft_json(Some(ns), &["list", "table", "ip", "vmon"]);
    let fwd = chain_rules(&ns_doc, "forward");
    assert!(
        fwd.iter().any(|r| verdict(r) == Some("drop")
            && saddr_not(r, "169.254.0.21")
            && r.iter().any(|e| e["match"]["right"] == "tap0")),
        "no anti-spoofing drop in {ns}: {fwd:?}"
    );
    let host_doc = nft_json(None, &["list", "table", "ip", "vmon"]);
    let hfwd = chain_rules(&host_doc, "forward");
    assert!(
        hfwd.iter().any(|r| verdict(r) == Some("drop")
            && saddr_not(r, "169.254.128.0/17")
            && r.iter().any(|e| e["match"]["right"] == "vmh*")),
        "no anti-spoofing drop on the host: {hfwd:?}"
    );
}

#[test]
fn qemu_runs_under_seccomp_in_cgroups_of_its_own() {
    let node = node();
    let _shared = host_lock().read();
    runtime().block_on(async {
        let id = unique("conf");
        let r = boot_open(&node, &id, 2).await;
        let addr = match r.guest_ip {
            std::net::IpAddr::V4(v) => v,
            other => panic!("{other}"),
        };
        let pid = qemu_pid(addr);
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        assert_eq!(field("Seccomp:"), "2", "QEMU runs under a seccomp filter");
        assert_eq!(field("NoNewPrivs:"), "1");
        // An unprivileged user of its own: real, effective, saved and fs ids, no capabilities.
        let ids: Vec<u32> = field("Uid:")
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect();
        assert_eq!(ids.len(), 4, "{ids:?}");
        assert!(
            ids.iter().all(|&u| u != 0 && u == ids[0]),
            "QEMU runs as uid {ids:?}"
        );
        assert!(
            field("Gid:").split_whitespace().all(|g| g != "0"),
            "gid {}",
            field("Gid:")
        );
        assert_eq!(field("CapEff:"), "0000000000000000");
        assert_eq!(field("CapPrm:"), "0000000000000000");
        // The seccomp policy QEMU was started with: no spawning, no privilege changes.
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let sandbox = args
            .iter()
            .position(|a| a == "-sandbox")
            .and_then(|i| args.get(i + 1))
            .unwrap_or_else(|| panic!("no -sandbox in {args:?}"));
        let opts: Vec<&str> = sandbox.split(',').collect();
        for want in [
            "on",
            "spawn=deny",
            "elevateprivileges=deny",
            "obsolete=deny",
            "resourcecontrol=deny",
        ] {
            assert!(opts.contains(&want), "-sandbox {sandbox} lacks {want}");
        }
        // The slot's anti-spoofing rules and IPv6, read back.
        let (ns, _) = slot_names(addr);
        assert_spoofing_dropped(&ns);
        for conf in ["all", "default", "veth0", "tap0"] {
            let out = std::process::Command::new("ip")
                .args(["netns", "exec", &ns, "cat"])
                .arg(format!("/proc/sys/net/ipv6/conf/{conf}/disable_ipv6"))
                .output()
                .expect("ip netns exec cat");
            assert_eq!(
                String::from_utf8_lossy(&out.stdout).trim(),
                "1",
                "IPv6 is off in {ns} ({conf}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let v6 = std::process::Command::new("ip")
            .args(["-n", &ns, "-6", "-o", "addr", "show"])
            .output()
            .expect("ip -6 addr");
        assert_eq!(
            String::from_utf8_lossy(&v6.stdout).trim(),
            "",
            "no IPv6 address in {ns}"
        );
        let overhead = vmon_vm::cgroup::settings().overhead_mib;
        let want_mem = ((2 * 384 + overhead) * 1024 * 1024).to_string();
        let want_pids = vmon_vm::cgroup::settings().pids.to_string();
        let mem_dir = group_dir(pid, "memory");
        assert!(
            mem_dir.ends_with(format!(
                "vmon/{}",
                mem_dir.file_name().and_then(|n| n.to_str()).unwrap_or("")
            )),
            "{}",
            mem_dir.display()
        );
        if std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            assert_eq!(read_num(mem_dir.join("memory.max")), want_mem);
            assert_eq!(read_num(mem_dir.join("cpu.max")), "200000 100000");
            assert_eq!(read_num(mem_dir.join("pids.max")), want_pids);
        } else {
            assert_eq!(read_num(mem_dir.join("memory.limit_in_bytes")), want_mem);
            let cpu = group_dir(pid, "cpu");
            assert_eq!(read_num(cpu.join("cpu.cfs_quota_us")), "200000");
            assert_eq!(read_num(cpu.join("cpu.cfs_period_us")), "100000");
            assert_eq!(read_num(group_dir(pid, "pids").join("pids.max")), want_pids);
        }
        // The guest still works inside its limits.
        let out = node
            .exec(&id, "user", "nproc", Duration::from_secs(60))
            .await
            .expect("exec");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "2");
        node.kill(&id, &r.execution_id).await.expect("kill");
        assert!(
            !mem_dir.exists(),
            "the group goes with its QEMU: {}",
            mem_dir.display()
        );
    });
}

#[test]
fn a_guest_flooding_its_console_leaves_a_bounded_log() {
    let node = node();
    let _shared = host_lock().read();
    runtime().block_on(async {
        let id = unique("flood");
        let r = boot_open(&node, &id, 1).await;
        // 12 MiB of lines, three times the bound, then a last line.
        let out = node
            .exec(
                &id,
                "root",
                "head -c 12582912 /dev/zero | tr '\\0' x | fold -w 99 > /dev/ttyS0; echo FLOOD-END > /dev/ttyS0; echo done",
                Duration::from_secs(600),
            )
            .await
            .expect("flood");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "done");
        let console = node
            .console_logs(&id)
            .pop()
            .expect("the running execution's console log");
        let bound = vmon_node::telemetry::MAX_CONSOLE_FILE + 64 * 1024;
        // The scraper caps the log every few seconds.
        let mut len = u64::MAX;
        for _ in 0..60 {
            len = std::fs::metadata(&console).map(|m| m.len()).unwrap_or(u64::MAX);
            if len <= bound {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        assert!(len <= bound, "console log is {len} bytes after a 12 MiB flood");
        let tail = vmon_vm::console::read_tail(&console, 4096).expect("tail");
        assert!(tail.contains("FLOOD-END"), "the newest lines are kept: {tail:?}");
        node.kill(&id, &r.execution_id).await.expect("kill");
    });
}
