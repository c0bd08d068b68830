//! Reading the host's apt sources, so the guest is built from the same suite and mirror.

use std::path::Path;

/// A Debian suite and the mirror it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AptSource {
    pub suite: String,
    pub mirror: String,
}

/// The first Debian (non-security, non-updates) source of the host: deb822 `.sources` files and
/// one-line `sources.list` entries both count.
pub fn host_apt_source() -> anyhow::Result<AptSource> {
    let mut texts = Vec::new();
    for p in ["/etc/apt/sources.list"] {
        if let Ok(t) = std::fs::read_to_string(p) {
            texts.push(t);
        }
    }
    if let Ok(dir) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut paths: Vec<_> = dir.flatten().map(|e| e.path()).collect();
        paths.sort();
        for p in paths {
            if let Ok(t) = std::fs::read_to_string(&p) {
                texts.push(t);
            }
        }
    }
    for t in &texts {
        if let Some(s) = parse_sources(t) {
            return Ok(s);
        }
    }
    anyhow::bail!(
        "no Debian apt source found in /etc/apt (pass --suite and --mirror to choose one)"
    )
}

fn is_debian_main(uri: &str, suite: &str) -> bool {
    !uri.contains("security")
        && !suite.contains('-')
        && !suite.contains('/')
        && (uri.contains("debian") || Path::new("/etc/debian_version").exists())
        && !uri.contains("nodesource")
        && !uri.contains("cloud.google")
}

/// Parses either format; returns the first plain Debian suite.
pub(crate) fn parse_sources(text: &str) -> Option<AptSource> {
    // One-line format: `deb [opts] URI SUITE COMPONENTS...`
    for line in text.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("deb ") {
            let mut words = rest.split_whitespace().peekable();
            if words.peek().is_some_and(|w| w.starts_with('[')) {
                for w in words.by_ref() {
                    if w.ends_with(']') {
                        break;
                    }
                }
            }
            if let (Some(uri), Some(suite)) = (words.next(), words.next()) {
                if is_debian_main(uri, suite) {
                    return Some(AptSource {
                        suite: suite.into(),
                        mirror: uri.into(),
                    });
                }
            }
        }
    }
    // deb822: stanzas separated by blank lines.
    for stanza in text.split("\n\n") {
        let mut uris = Vec::new();
        let mut suites = Vec::new();
        let mut is_deb = false;
        for line in stanza.lines() {
            if let Some((k, v)) = line.split_once(':') {
                match k.trim() {
                    "Types" => is_deb = v.split_whitespace().any(|t| t == "deb"),
                    "URIs" => uris = v.split_whitespace().map(String::from).collect(),
                    "Suites" => suites = v.split_whitespace().map(String::from).collect(),
                    _ => {}
                }
            }
        }
        if !is_deb {
            continue;
        }
        for uri in &uris {
            for suite in &suites {
                if is_debian_main(uri, suite) {
                    return Some(AptSource {
                        suite: suite.clone(),
                        mirror: uri.clone(),
                    });
                }
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deb822_picks_main_suite() {
        let t = "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\nTypes: deb\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n";
        let s = parse_sources(t).expect("a source");
        assert_eq!(s.suite, "bookworm");
        assert_eq!(s.mirror, "http://deb.debian.org/debian");
    }

    #[test]
    fn one_line_with_options() {
        let t = "# c\ndeb [arch=amd64 signed-by=/x] http://mirror.example/debian trixie main\n";
        let s = parse_sources(t).expect("a source");
        assert_eq!(s.suite, "trixie");
        assert_eq!(s.mirror, "http://mirror.example/debian");
    }

    #[test]
    fn security_only_is_none() {
        let t = "deb http://deb.debian.org/debian-security bookworm-security main\n";
        assert_eq!(parse_sources(t), None);
    }
}
