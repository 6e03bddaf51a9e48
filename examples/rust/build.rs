// Links libzerotrain: from ZEROTRAIN_LIB_DIR when set (a build tree), else from pkg-config's
// `zerotrain` package (an installed prefix), else the default linker paths. The directory is
// also put in the binaries' run path, so they run without LD_LIBRARY_PATH.
use std::env;
use std::process::Command;

fn pkg_config_lib_dirs() -> Vec<String> {
    let out = Command::new("pkg-config").args(["--libs-only-L", "zerotrain"]).output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .filter_map(|f| f.strip_prefix("-L").map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    }
}

fn main() {
    println!("cargo:rerun-if-env-changed=ZEROTRAIN_LIB_DIR");
    let dirs = match env::var("ZEROTRAIN_LIB_DIR") {
        Ok(dir) if !dir.is_empty() => vec![dir],
        _ => pkg_config_lib_dirs(),
    };
    for dir in &dirs {
        println!("cargo:rustc-link-search=native={dir}");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    println!("cargo:rustc-link-lib=dylib=zerotrain");
}
