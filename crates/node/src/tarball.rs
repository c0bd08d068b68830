//! The few GNU tar records bucket mounts need (`node/bucket.rs`): writing directories and
//! regular files (long names as GNU `L` records, large sizes in base-256) into the archive a
//! confined `tar --extract` unpacks into a cache, and reading the archive a confined
//! `tar --create --format=gnu` made of it, entry by entry, as a stream.
//!
//! The node never touches a tenant's path on its filesystem through this: it only writes and
//! parses bytes; GNU tar, running as the volume's own unprivileged ids, does the filesystem
//! work.

use std::io::{self, Read, Write};

const BLOCK: usize = 512;
/// The longest long name (`L` record) a reader accepts.
const MAX_LONG_NAME: u64 = 64 << 10;

/// The guest's `user` (files a fill writes belong to it, so its programs may change them).
pub const GUEST_USER: u32 = 1000;

/// Writes a GNU tar stream to `out`.
pub struct Writer<W: Write> {
    out: W,
}

fn octal(field: &mut [u8], v: u64) {
    let digits = field.len() - 1;
    let s = format!("{v:0digits$o}");
    field[..digits].copy_from_slice(&s.as_bytes()[s.len() - digits..]);
    field[digits] = 0;
}

/// A numeric field: octal when it fits, else GNU's base-256 (first byte 0x80).
fn number(field: &mut [u8], v: u64) {
    let digits = field.len() - 1;
    if digits >= 22 || v < (1u64 << (3 * digits)) {
        octal(field, v);
    } else {
        field.fill(0);
        field[0] = 0x80;
        let n = field.len();
        field[n - 8..].copy_from_slice(&v.to_be_bytes());
    }
}

fn header(name: &[u8], mode: u32, size: u64, mtime: i64, kind: u8) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    let n = name.len().min(100);
    h[..n].copy_from_slice(&name[..n]);
    octal(&mut h[100..108], u64::from(mode));
    octal(&mut h[108..116], u64::from(GUEST_USER));
    octal(&mut h[116..124], u64::from(GUEST_USER));
    number(&mut h[124..136], size);
    octal(&mut h[136..148], mtime.max(0) as u64);
    h[156] = kind;
    h[257..265].copy_from_slice(b"ustar  \0");
    h[148..156].fill(b' ');
    let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
    let s = format!("{sum:06o}");
    h[148..154].copy_from_slice(s.as_bytes());
    h[154] = 0;
    h[155] = b' ';
    h
}

fn pad(len: u64) -> usize {
    (BLOCK - (len % BLOCK as u64) as usize) % BLOCK
}

impl<W: Write> Writer<W> {
    pub fn new(out: W) -> Writer<W> {
        Writer { out }
    }

    fn name(&mut self, name: &str) -> io::Result<()> {
        if name.len() < 100 {
            return Ok(());
        }
        let len = name.len() as u64 + 1;
        self.out
            .write_all(&header(b"././@LongLink", 0, len, 0, b'L'))?;
        self.out.write_all(name.as_bytes())?;
        self.out.write_all(&[0])?;
        self.out.write_all(&[0u8; BLOCK][..pad(len)])
    }

    /// A directory (`path` relative, without a trailing `/`).
    pub fn dir(&mut self, path: &str, mtime: i64) -> io::Result<()> {
        let name = format!("{path}/");
        self.name(&name)?;
        self.out
            .write_all(&header(name.as_bytes(), 0o755, 0, mtime, b'5'))
    }

    /// A regular file of exactly `size` bytes read from `data` (fewer is an error).
    pub fn file(
        &mut self,
        path: &str,
        size: u64,
        mtime: i64,
        data: &mut dyn Read,
    ) -> io::Result<()> {
        self.name(path)?;
        self.out
            .write_all(&header(path.as_bytes(), 0o644, size, mtime, b'0'))?;
        let copied = io::copy(&mut data.take(size), &mut self.out)?;
        if copied != size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{path}: {copied} bytes of {size}"),
            ));
        }
        self.out.write_all(&[0u8; BLOCK][..pad(size)])
    }

    /// The end-of-archive blocks; returns the output.
    pub fn finish(mut self) -> io::Result<W> {
        self.out.write_all(&[0u8; 2 * BLOCK])?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// What an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    /// A link, a device, a FIFO, or a record this reader does not know.
    Other,
}

/// One entry of an archive being read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Relative, without `./` and without a trailing `/`.
    pub path: String,
    pub kind: Kind,
    pub size: u64,
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn parse_number(field: &[u8]) -> io::Result<u64> {
    if field[0] & 0x80 != 0 {
        if field[..field.len() - 8].iter().skip(1).any(|&b| b != 0) {
            return Err(invalid("a tar number past 64 bits"));
        }
        let mut b = [0u8; 8];
        b.copy_from_slice(&field[field.len() - 8..]);
        return Ok(u64::from_be_bytes(b));
    }
    let s: String = field
        .iter()
        .take_while(|&&b| b != 0)
        .map(|&b| b as char)
        .collect();
    let s = s.trim();
    if s.is_empty() {
        return Ok(0);
    }
    u64::from_str_radix(s, 8).map_err(|_| invalid(format!("a tar number {s:?}")))
}

fn skip(r: &mut dyn Read, n: u64) -> io::Result<()> {
    let skipped = io::copy(&mut r.take(n), &mut io::sink())?;
    if skipped != n {
        return Err(invalid("the archive ends inside an entry"));
    }
    Ok(())
}

/// Reads every entry of the GNU tar stream `r`, calling `each` with the entry and a reader of
/// exactly its data (what `each` leaves unread is skipped).
pub fn read_entries(
    r: &mut dyn Read,
    mut each: impl FnMut(&Entry, &mut dyn Read) -> io::Result<()>,
) -> io::Result<()> {
    let mut long_name: Option<Vec<u8>> = None;
    loop {
        let mut h = [0u8; BLOCK];
        r.read_exact(&mut h)?;
        if h.iter().all(|&b| b == 0) {
            return Ok(());
        }
        let want = parse_number(&h[148..156])?;
        let sum: u64 = h
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                if (148..156).contains(&i) {
                    32
                } else {
                    u64::from(b)
                }
            })
            .sum();
        if sum != want {
            return Err(invalid("a tar header's checksum does not match"));
        }
        let size = parse_number(&h[124..136])?;
        let padded = size + pad(size) as u64;
        let kind = h[156];
        if kind == b'L' || kind == b'K' {
            if size > MAX_LONG_NAME {
                return Err(invalid("a tar long name past 64 KiB"));
            }
            let mut buf = vec![0u8; padded as usize];
            r.read_exact(&mut buf)?;
            if kind == b'L' {
                buf.truncate(size as usize);
                let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
                buf.truncate(end);
                long_name = Some(buf);
            }
            continue;
        }
        let raw = match long_name.take() {
            Some(n) => n,
            None => {
                let end = h[..100].iter().position(|&b| b == 0).unwrap_or(100);
                h[..end].to_vec()
            }
        };
        // A name that is not UTF-8 can be no object key: such an entry is "other".
        let (raw, utf8) = match String::from_utf8(raw) {
            Ok(s) => (s, true),
            Err(e) => (String::from_utf8_lossy(e.as_bytes()).into_owned(), false),
        };
        let kind = match kind {
            b'0' | 0 | b'7' if utf8 => Kind::File,
            b'5' if utf8 => Kind::Dir,
            _ => Kind::Other,
        };
        let path = raw
            .trim_start_matches("./")
            .trim_end_matches('/')
            .to_string();
        let path = if path == "." { String::new() } else { path };
        let entry = Entry {
            path,
            kind,
            // A link's or a directory's size field says nothing of data that follows.
            size: if kind == Kind::File { size } else { 0 },
        };
        let mut data = r.take(entry.size);
        each(&entry, &mut data)?;
        let left = data.limit();
        if kind == Kind::File {
            skip(r, left + pad(size) as u64)?;
        } else {
            skip(r, padded)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gnu_tar(args: &[&str], dir: &std::path::Path) -> std::process::Output {
        std::process::Command::new("/usr/bin/tar")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("tar")
    }

    #[test]
    fn gnu_tar_unpacks_what_the_writer_makes_and_the_reader_reads_what_gnu_tar_makes() {
        let work = tempfile::tempdir().expect("tempdir");
        let long = format!("{}/{}", "d".repeat(120), "f".repeat(150));
        let archive = work.path().join("a.tar");
        {
            let mut w = Writer::new(std::fs::File::create(&archive).expect("create"));
            w.dir("sub", 1_700_000_000).expect("dir");
            w.file("sub/one.txt", 5, 1_700_000_000, &mut &b"hello"[..])
                .expect("file");
            w.dir(&"d".repeat(120), 0).expect("long dir");
            w.file(&long, 3, 0, &mut &b"abc"[..]).expect("long file");
            w.file("empty", 0, 0, &mut &b""[..]).expect("empty");
            assert!(w.file("short", 4, 0, &mut &b"ab"[..]).is_err());
        }
        // The failed entry left a partial record: write a clean archive for tar.
        let archive = work.path().join("b.tar");
        {
            let mut w = Writer::new(std::fs::File::create(&archive).expect("create"));
            w.dir("sub", 1_700_000_000).expect("dir");
            w.file("sub/one.txt", 5, 1_700_000_000, &mut &b"hello"[..])
                .expect("file");
            w.dir(&"d".repeat(120), 0).expect("long dir");
            w.file(&long, 3, 0, &mut &b"abc"[..]).expect("long file");
            w.file("empty", 0, 0, &mut &b""[..]).expect("empty");
            w.finish().expect("finish");
        }
        let out = work.path().join("out");
        std::fs::create_dir(&out).expect("out");
        let x = gnu_tar(&["-xf", archive.to_str().expect("utf-8")], &out);
        assert!(x.status.success(), "{}", String::from_utf8_lossy(&x.stderr));
        assert_eq!(
            std::fs::read(out.join("sub/one.txt")).expect("one"),
            b"hello"
        );
        assert_eq!(std::fs::read(out.join(&long)).expect("long"), b"abc");
        assert_eq!(
            std::fs::metadata(out.join("empty")).expect("empty").len(),
            0
        );

        // GNU tar's own archive of that tree, plus a symlink and a big sparse-free file.
        std::os::unix::fs::symlink("/etc/passwd", out.join("link")).expect("symlink");
        std::fs::write(out.join("big"), vec![9u8; 70_000]).expect("big");
        let made = work.path().join("c.tar");
        let c = gnu_tar(
            &[
                "--create",
                "--format=gnu",
                "--sort=name",
                "-f",
                made.to_str().expect("utf-8"),
                ".",
            ],
            &out,
        );
        assert!(c.status.success(), "{}", String::from_utf8_lossy(&c.stderr));
        let mut seen = Vec::new();
        read_entries(&mut std::fs::File::open(&made).expect("open"), |e, data| {
            let mut v = Vec::new();
            if e.path == "big" {
                // Left unread: the reader skips it.
            } else {
                data.read_to_end(&mut v)?;
            }
            seen.push((e.path.clone(), e.kind, e.size, v));
            Ok(())
        })
        .expect("read");
        let find = |p: &str| seen.iter().find(|s| s.0 == p).cloned();
        assert_eq!(find("sub/one.txt").expect("one").3, b"hello");
        assert_eq!(find(&long).expect("long").3, b"abc");
        assert_eq!(find("big").expect("big").2, 70_000);
        assert_eq!(find("link").expect("link").1, Kind::Other);
        assert_eq!(find("sub").expect("sub").1, Kind::Dir);
        assert_eq!(find("").expect("root").1, Kind::Dir);
        assert_eq!(find("empty").expect("empty").2, 0);
    }

    #[test]
    fn base_256_sizes_round_trip_and_garbage_is_refused() {
        let mut f = [0u8; 12];
        number(&mut f, 1 << 40);
        assert_eq!(f[0], 0x80);
        assert_eq!(parse_number(&f).expect("n"), 1 << 40);
        number(&mut f, 0o777);
        assert_eq!(parse_number(&f).expect("n"), 0o777);
        let mut bad = [0u8; BLOCK];
        bad[0] = b'x';
        let r = read_entries(&mut &bad[..], |_, _| Ok(()));
        assert!(r.is_err(), "a header with a wrong checksum is refused");
    }
}
