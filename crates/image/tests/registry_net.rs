//! Registry pulls reach only what the operator allows (`registry_allow`): real skopeo, a real
//! registry (Debian's `docker-registry`) on loopback, and servers of the test's own that count
//! connections or redirect a pull elsewhere. Root (the pull's network namespace).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use vmon_image::oci::{resolve_digest, Pull};

/// A listener that counts the connections it accepts (and closes them).
struct Counter {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
}

impl Counter {
    fn on(ip: &str) -> Counter {
        let l = TcpListener::bind((ip, 0)).expect("bind counter");
        let addr = l.local_addr().expect("addr");
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                h.fetch_add(1, Ordering::SeqCst);
                drop(c);
            }
        });
        Counter { addr, hits }
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// A plain-HTTP registry front that answers `/v2/` and sends every other request to `to`.
fn redirector(to: String) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind redirector");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            let to = to.clone();
            std::thread::spawn(move || {
                let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
                let mut head = Vec::new();
                let mut b = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match c.read(&mut b) {
                        Ok(n) if n > 0 => head.extend_from_slice(&b[..n]),
                        _ => return,
                    }
                }
                let text = String::from_utf8_lossy(&head);
                let path = text.split_whitespace().nth(1).unwrap_or("");
                let answer = if path == "/v2/" {
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ndocker-distribution-api-version: registry/2.0\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}".to_string()
                } else {
                    format!("HTTP/1.1 307 Temporary Redirect\r\nlocation: {to}/blob\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                };
                let _ = c.write_all(answer.as_bytes());
            });
        }
    });
    addr
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port()
}

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Debian's docker-registry on 127.0.0.1, holding one (empty) image `test/img:1`.
struct Registry {
    child: Child,
    host: String,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn registry(dir: &Path) -> Registry {
    let host = format!("127.0.0.1:{}", free_port());
    let config = dir.join("config.yml");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {host}\n",
            dir.join("storage").display()
        ),
    )
    .expect("config");
    let child = Command::new("docker-registry")
        .arg("serve")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("docker-registry (apt-get install docker-registry)");
    let r = Registry { child, host };
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(&r.host).is_err() {
        assert!(Instant::now() < deadline, "docker-registry did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    let layout = dir.join("layout");
    run(Command::new("umoci")
        .arg("init")
        .arg("--layout")
        .arg(&layout));
    run(Command::new("umoci")
        .arg("new")
        .arg("--image")
        .arg(format!("{}:1", layout.display())));
    run(Command::new("skopeo").args([
        "copy",
        "--quiet",
        "--dest-tls-verify=false",
        &format!("oci:{}:1", layout.display()),
        &format!("docker://{}/test/img:1", r.host),
    ]));
    r
}

fn pull<'a>(registry: &'a str, reference: &'a str, allow: &'a [String]) -> Pull<'a> {
    Pull {
        reference,
        registry,
        credentials: None,
        tls_verify: false,
        registry_allow: allow,
    }
}

/// skopeo as it runs without vmon: in this namespace, no proxy, no vetting.
fn unconfined_inspect(reference: &str) -> std::process::Output {
    Command::new("skopeo")
        .args(["inspect", "--raw", "--tls-verify=false"])
        .arg(format!("docker://{reference}"))
        .output()
        .expect("skopeo")
}

fn this_hosts_address() -> String {
    let out = Command::new("ip")
        .args(["-4", "-o", "addr", "show", "scope", "global"])
        .output()
        .expect("ip");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .filter_map(|l| l.split_whitespace().nth(3))
        .filter_map(|a| a.split('/').next())
        .next()
        .expect("this host has no global IPv4 address")
        .to_string()
}

#[tokio::test]
async fn a_registry_at_an_address_not_listed_is_refused_before_anything_connects() {
    let counter = Counter::on("127.0.0.1");
    let host = counter.addr.to_string();
    let reference = format!("{host}/test/img:1");
    for registry in [host.clone(), format!("localhost:{}", counter.addr.port())] {
        let reference = format!("{registry}/test/img:1");
        let e = resolve_digest(&pull(&registry, &reference, &[]))
            .await
            .expect_err("an unlisted loopback registry was pulled from");
        assert!(
            e.0.contains("registry_allow") && e.0.contains(&registry),
            "{}",
            e.0
        );
    }
    // Listing another address does not open this one.
    let other = vec!["127.0.0.2/32".to_string()];
    assert!(resolve_digest(&pull(&host, &reference, &other))
        .await
        .is_err());
    assert_eq!(counter.hits(), 0, "skopeo connected to a refused registry");
}

#[tokio::test]
async fn a_listed_registry_is_pulled_from_through_the_pulls_namespace() {
    let dir = tempfile::tempdir().expect("dir");
    let r = registry(dir.path());
    let reference = format!("{}/test/img:1", r.host);
    let direct = unconfined_inspect(&reference);
    assert!(direct.status.success(), "{direct:?}");
    let want = format!("sha256:{}", hex::encode(Sha256::digest(&direct.stdout)));
    let allow = vec!["127.0.0.1/32".to_string()];
    let got = resolve_digest(&pull(&r.host, &reference, &allow))
        .await
        .expect("a listed registry");
    assert_eq!(got, want);
}

#[tokio::test]
async fn a_registry_that_redirects_to_an_unlisted_address_fails() {
    let allow = vec!["127.0.0.1/32".to_string()];
    // Another loopback address: the pull's namespace has nothing listening there.
    let loopback = Counter::on("127.0.0.2");
    // This host's own address, and a private one: the proxy refuses both.
    let own = Counter::on("0.0.0.0");
    let own_url = format!("http://{}:{}", this_hosts_address(), own.addr.port());
    for (target, counter) in [
        (format!("http://{}", loopback.addr), Some(&loopback)),
        (own_url, Some(&own)),
        ("http://10.255.255.1:5000".to_string(), None),
    ] {
        let front = redirector(target.clone()).to_string();
        let reference = format!("{front}/test/img:1");
        // Without vmon's namespace the redirect is followed: the target is reached.
        if let Some(c) = counter {
            let before = c.hits();
            let _ = unconfined_inspect(&reference);
            assert!(
                c.hits() > before,
                "the redirect to {target} was not followed unconfined"
            );
        }
        let before = counter.map(|c| c.hits());
        let e = resolve_digest(&pull(&front, &reference, &allow))
            .await
            .expect_err("a redirect to an unlisted address was followed");
        assert_eq!(
            counter.map(|c| c.hits()),
            before,
            "{target} was reached: {}",
            e.0
        );
        if !target.contains("127.0.0.2") {
            assert!(e.0.contains("refused destination"), "{target}: {}", e.0);
        }
    }
}
