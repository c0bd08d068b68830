//! The image build's tests.

use super::*;

#[test]
fn debootstrap_lines_make_a_rising_percent() {
    let mut p = DebootstrapProgress::default();
    assert_eq!(p.line("W: something"), None);
    let (d, first) = p.line("I: Retrieving InRelease ").expect("progress");
    assert_eq!(d, "fetching the package lists");
    let mut last = first;
    for line in [
        "I: Retrieving libc6 2.36-9",
        "I: Validating libc6 2.36-9",
        "I: Retrieving bash 5.2",
        "I: Extracting libc6...",
        "I: Installing core packages...",
        "I: Unpacking required packages...",
        "I: Configuring required packages...",
        "I: Unpacking the base system...",
        "I: Configuring the base system...",
        "I: Base system installed successfully.",
    ] {
        if let Some((_, pct)) = p.line(line) {
            assert!(pct >= last, "{line}: {pct} < {last}");
            last = pct;
        }
    }
    assert_eq!(last, DEBOOTSTRAP_DONE);
    assert_eq!(p.retrieved, 2);
}

/// Every module of the code interpreter's package is installed (a module left out of
/// [`CODE_INTERPRETER_FILES`] would be an ImportError in the guest only), beside the entry.
#[test]
fn the_code_interpreter_is_installed_whole() {
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/code_interpreter");
    let mut modules: Vec<String> = std::fs::read_dir(&assets)
        .expect("assets/code_interpreter")
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.ends_with(".py"))
        .collect();
    modules.sort();
    let (entry, package) = CODE_INTERPRETER_FILES.split_first().expect("files");
    assert_eq!(entry.0, CODE_INTERPRETER_PATH);
    let mut installed: Vec<String> = package
        .iter()
        .map(|(path, _)| {
            let name = path
                .strip_prefix("/usr/local/lib/vmon/code_interpreter/")
                .expect("beside the entry");
            assert!(!name.contains('/'), "{path}");
            name.to_string()
        })
        .collect();
    installed.sort();
    assert_eq!(installed, modules);
    for (path, text) in package {
        let name = path.rsplit('/').next().expect("name");
        let on_disk = std::fs::read_to_string(assets.join(name)).expect("module");
        assert_eq!(*text, on_disk, "{path} is not its asset");
    }
}
