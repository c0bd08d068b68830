//! What the hostile-image suite builds its images with: layers written as tar by hand (so
//! they can hold what no well-behaved tool writes: `..` names, links out of the tree, hard
//! links to host paths), an OCI layout around them, and Debian's `docker-registry` on a free
//! loopback port that `skopeo` pushes them to and `make_disk` pulls them from.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// One entry of a layer.
pub enum Entry<'a> {
    Dir(&'a str, u32),
    File(&'a str, &'a [u8], u32),
    Symlink(&'a str, &'a str),
    HardLink(&'a str, &'a str),
    CharDevice(&'a str, u32, u32),
    BlockDevice(&'a str, u32, u32),
}

/// A ustar archive of `entries`, names taken as they are (`..` and absolute ones included).
pub fn tar(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in entries {
        let (name, kind, mode, link, data, dev): (&str, u8, u32, &str, &[u8], (u32, u32)) = match *e
        {
            Entry::Dir(n, m) => (n, b'5', m, "", &[], (0, 0)),
            Entry::File(n, d, m) => (n, b'0', m, "", d, (0, 0)),
            Entry::Symlink(n, t) => (n, b'2', 0o777, t, &[], (0, 0)),
            Entry::HardLink(n, t) => (n, b'1', 0o644, t, &[], (0, 0)),
            Entry::CharDevice(n, ma, mi) => (n, b'3', 0o666, "", &[], (ma, mi)),
            Entry::BlockDevice(n, ma, mi) => (n, b'4', 0o660, "", &[], (ma, mi)),
        };
        assert!(
            name.len() < 100 && link.len() < 100,
            "{name} -> {link}: too long"
        );
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        octal(&mut h[100..108], u64::from(mode));
        octal(&mut h[108..116], 0);
        octal(&mut h[116..124], 0);
        octal(&mut h[124..136], data.len() as u64);
        octal(&mut h[136..148], 1_700_000_000);
        h[156] = kind;
        h[157..157 + link.len()].copy_from_slice(link.as_bytes());
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        octal(&mut h[329..337], u64::from(dev.0));
        octal(&mut h[337..345], u64::from(dev.1));
        h[148..156].copy_from_slice(b"        ");
        let sum: u64 = h.iter().map(|b| u64::from(*b)).sum();
        let s = format!("{sum:06o}\0 ");
        h[148..156].copy_from_slice(s.as_bytes());
        out.extend_from_slice(&h);
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.resize(out.len() + 1024, 0);
    out
}

fn octal(field: &mut [u8], v: u64) {
    let s = format!("{v:0width$o}\0", width = field.len() - 1);
    field.copy_from_slice(s.as_bytes());
}

fn sha(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

/// Writes an OCI layout at `dir` holding the image `name:1` made of `layers` (in order).
pub fn layout(dir: &Path, layers: &[Vec<u8>]) {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).expect("layout");
    let put = |b: &[u8]| {
        let d = sha(b);
        std::fs::write(blobs.join(d.trim_start_matches("sha256:")), b).expect("blob");
        (d, b.len())
    };
    let mut descs = Vec::new();
    for l in layers {
        let (d, n) = put(l);
        descs.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": d, "size": n,
        }));
    }
    let diff_ids: Vec<String> = layers.iter().map(|l| sha(l)).collect();
    let config = serde_json::json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": ["/bin/bash"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    })
    .to_string();
    let (cd, cn) = put(config.as_bytes());
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cn},
        "layers": descs,
    })
    .to_string();
    let (md, mn) = put(manifest.as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": mn,
            "annotations": {"org.opencontainers.image.ref.name": "1"},
        }],
    });
    std::fs::write(dir.join("index.json"), index.to_string()).expect("index");
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).expect("layout");
}

/// Debian's `docker-registry` serving from `dir` on a free loopback port; stopped when dropped.
pub struct Registry {
    pub host: String,
    child: Child,
}

impl Registry {
    pub fn start(dir: &Path) -> Registry {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let host = format!("127.0.0.1:{port}");
        std::fs::create_dir_all(dir).expect("registry dir");
        let config = format!(
            "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {host}\n",
            dir.join("storage").display()
        );
        std::fs::write(dir.join("config.yml"), config).expect("registry config");
        let log = std::fs::File::create(dir.join("registry.log")).expect("registry log");
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(dir.join("config.yml"))
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("docker-registry (apt-get install docker-registry)");
        let r = Registry { host, child };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(&r.host) {
                let _ = s.write_all(b"GET /v2/ HTTP/1.0\r\n\r\n");
                let mut buf = [0u8; 12];
                if s.read_exact(&mut buf).is_ok() && buf.starts_with(b"HTTP/1.") {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "docker-registry did not start");
            std::thread::sleep(Duration::from_millis(200));
        }
        r
    }

    /// Pushes the layout's `1` as `hostile/<name>:1`; returns the reference.
    pub fn push(&self, layout: &Path, name: &str) -> String {
        let reference = format!("{}/hostile/{name}:1", self.host);
        let out = Command::new("skopeo")
            .args(["copy", "--quiet", "--dest-tls-verify=false"])
            .arg(format!("oci:{}:1", layout.display()))
            .arg(format!("docker://{reference}"))
            .stdin(Stdio::null())
            .output()
            .expect("skopeo (apt-get install skopeo)");
        assert!(
            out.status.success(),
            "skopeo push of {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        reference
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a canary is: contents (files), mode, owner, mtime.
pub type Snapshot = BTreeMap<PathBuf, (Vec<u8>, u32, u32, u32, i64, i64)>;

/// Every name under `dir` (itself included), never following a link.
pub fn snapshot(dir: &Path) -> Snapshot {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(p) = todo.pop() {
        let m = std::fs::symlink_metadata(&p).expect("canary");
        let bytes = if m.is_file() {
            std::fs::read(&p).expect("canary")
        } else {
            Vec::new()
        };
        if m.is_dir() {
            for e in std::fs::read_dir(&p).expect("canary dir").flatten() {
                todo.push(e.path());
            }
        }
        out.insert(
            p,
            (bytes, m.mode(), m.uid(), m.gid(), m.mtime(), m.mtime_nsec()),
        );
    }
    out
}

/// `debugfs -R "stat <path>"` of the disk: its `Type:` and `Mode:` (octal) when it exists.
pub fn disk_stat(disk: &Path, path: &str) -> Option<(String, u32)> {
    let out = Command::new("debugfs")
        .arg("-R")
        .arg(format!("stat {path}"))
        .arg(disk)
        .stdin(Stdio::null())
        .output()
        .expect("debugfs");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.contains("Type:"))?;
    let kind = line
        .split("Type:")
        .nth(1)?
        .split_whitespace()
        .next()?
        .to_string();
    let mode = line.split("Mode:").nth(1)?.split_whitespace().next()?;
    Some((kind, u32::from_str_radix(mode, 8).ok()?))
}

/// `debugfs -R "cat <path>"` of the disk.
pub fn disk_cat(disk: &Path, path: &str) -> Vec<u8> {
    Command::new("debugfs")
        .arg("-R")
        .arg(format!("cat {path}"))
        .arg(disk)
        .stdin(Stdio::null())
        .output()
        .expect("debugfs")
        .stdout
}
