//! What mercurioctl's integration tests share: the binary under test and the mercuriod beside
//! it (built when missing, as with `cargo test -p mercurioctl`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The mercurioctl binary under test.
pub const MERCURIOCTL: &str = env!("CARGO_BIN_EXE_mercurioctl");

/// target/<profile>/mercuriod, built if missing.
pub fn mercuriod() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = Path::new(MERCURIOCTL).parent().expect("target dir");
        let exe = dir.join("mercuriod");
        if !exe.exists() {
            let target = dir.parent().expect("target root");
            let mut build = Command::new(env!("CARGO"));
            build
                .args(["build", "-p", "mercuriod", "--target-dir"])
                .arg(target)
                .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
            if dir.file_name().is_some_and(|n| n == "release") {
                build.arg("--release");
            }
            let status = build.status().expect("run cargo build -p mercuriod");
            assert!(status.success(), "cargo build -p mercuriod failed");
        }
        exe
    })
}
