//! The OS packages the gate needs beyond Rust: MPI (the `mpi` step) and a software Vulkan
//! driver (the `wgpu` step). `cargo xtask test` installs them with apt-get where this run may
//! (in CI, `CI=true`, or as root), so that a fresh machine needs nothing done by hand; where
//! it may not, the steps that need them are skipped with a message naming the packages.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Once;

/// A set of Debian packages and what they enable.
pub struct Packages {
    pub names: &'static [&'static str],
    pub enables: &'static str,
}

/// OpenMPI and libclang (bindgen, for the `mpi` crate).
pub const MPI: Packages = Packages {
    names: &["openmpi-bin", "libopenmpi-dev", "libclang-dev"],
    enables: "the MPI step",
};

/// Mesa's Vulkan drivers, lavapipe among them: Burn's wgpu backend on the CPU.
pub const VULKAN: Packages = Packages {
    names: &["mesa-vulkan-drivers"],
    enables: "the wgpu step",
};

/// The Vulkan ICD file of lavapipe, Mesa's software Vulkan device.
const LAVAPIPE_ICD: &str = "/usr/share/vulkan/icd.d";

/// Installs what is missing of each set where this run may; quiet when all is there.
pub fn ensure_all() {
    for packages in [&MPI, &VULKAN] {
        if !installed(packages) && may_install() {
            install(packages);
        }
    }
    if is_root() {
        // mpirun refuses to run as root unless told; CI containers often are root.
        // SAFETY: called at the start of the gate, before xtask starts any thread.
        unsafe {
            std::env::set_var("OMPI_ALLOW_RUN_AS_ROOT", "1");
            std::env::set_var("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        }
    }
}

/// Whether every package of the set is installed (by dpkg's account).
pub fn installed(packages: &Packages) -> bool {
    Command::new("dpkg")
        .arg("-s")
        .args(packages.names)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether lavapipe's Vulkan driver is present (installed by apt or otherwise).
pub fn lavapipe_present() -> bool {
    std::fs::read_dir(Path::new(LAVAPIPE_ICD)).is_ok_and(|dir| {
        dir.flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("lvp_icd"))
    })
}

/// How to install a set by hand.
pub fn how_to_enable(packages: &Packages) -> String {
    format!(
        "install {} (`apt-get install {}`; `cargo xtask test` does it in CI or as root) to \
         enable {}",
        packages.names.join(" "),
        packages.names.join(" "),
        packages.enables
    )
}

fn may_install() -> bool {
    (crate::test::in_ci() || is_root()) && has("apt-get")
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn has(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `apt-get install` of the set (after one `apt-get update` per run), through sudo when not
/// root. A failure is reported and left to the steps, which skip.
fn install(packages: &Packages) {
    static UPDATED: Once = Once::new();
    println!("==> installing {}", packages.names.join(" "));
    let apt = |args: &[&str]| {
        let mut command = if is_root() {
            Command::new("apt-get")
        } else {
            let mut sudo = Command::new("sudo");
            sudo.arg("apt-get");
            sudo
        };
        command
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    UPDATED.call_once(|| {
        apt(&["update", "-qq"]);
    });
    let mut args = vec!["install", "-y", "-qq"];
    args.extend(packages.names);
    if !apt(&args) {
        println!("    could not install {}", packages.names.join(" "));
    }
}
