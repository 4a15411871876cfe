//! `gpumesh adapters`: what this machine can run on, and how fast.

use std::process::ExitCode;

use gpumesh_protocol::NodeCapability;
use gpumesh_shaders::executor::ExecutorLimits;
use gpumesh_shaders::{adapter, calibrate, BackendChoice, Executor};

pub fn run(json: bool, calibrate_speed: bool) -> anyhow::Result<ExitCode> {
    let mut found: Vec<NodeCapability> = Vec::new();
    for a in adapter::adapters(BackendChoice::Auto) {
        let mut cap = adapter::describe(&a);
        if calibrate_speed {
            match Executor::with_adapter(a, ExecutorLimits::default())
                .and_then(|mut ex| calibrate::calibrate(&mut ex).map(|_| ex))
            {
                Ok(ex) => cap = ex.capability().clone(),
                Err(e) => eprintln!("warning: could not calibrate {}: {e}", cap.adapter_name),
            }
        }
        found.push(cap);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&found)?);
        return Ok(ExitCode::SUCCESS);
    }
    if found.is_empty() {
        println!(
            "no GPU adapters found (install mesa-vulkan-drivers for lavapipe, or a GPU driver)"
        );
        return Ok(ExitCode::FAILURE);
    }
    println!(
        "{:<3} {:<34} {:<7} {:<11} {:>10} {:>8} {:>12} {:>9}",
        "#", "adapter", "backend", "device", "GFLOP/s", "GB/s", "max buffer", "max wg/dim"
    );
    for (i, c) in found.iter().enumerate() {
        let speed = |v: f64| {
            if v > 0.0 {
                format!("{v:.1}")
            } else {
                "-".into()
            }
        };
        println!(
            "{:<3} {:<34} {:<7} {:<11} {:>10} {:>8} {:>12} {:>9}",
            i,
            truncate(&c.adapter_name, 34),
            c.backend.name(),
            c.device_kind.name(),
            speed(c.gflops),
            speed(c.gbps),
            human_bytes(c.limits.max_buffer_size),
            c.limits.max_compute_workgroups_per_dimension
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}

pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
