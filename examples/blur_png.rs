//! Blurs a generated 768x768 image on a 3-node mesh (8 shards), checks it against the
//! CPU pixel for pixel, and writes both images as PNG.
//!
//! `cargo run --release --example blur_png [OUT_DIR]`

#[path = "common/mod.rs"]
mod common;

use std::path::PathBuf;

use gpumesh::protocol::{BindingRole, BindingSpec, Grid, MergeRule, ShaderSource, TaskSpec};
use gpumesh::shaders::builtins::{blur_reference, test_image};

const SIDE: u32 = 768;

fn write_png(path: &PathBuf, pixels: &[u32]) -> anyhow::Result<()> {
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut encoder = png::Encoder::new(file, SIDE, SIDE);
    encoder.set_color(png::ColorType::Rgba);
    encoder.set_depth(png::BitDepth::Eight);
    let bytes: Vec<u8> = pixels.iter().flat_map(|p| p.to_le_bytes()).collect();
    encoder.write_header()?.write_image_data(&bytes)?;
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let out_dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "blur-out".into()));
    std::fs::create_dir_all(&out_dir)?;
    let image = test_image(SIDE, SIDE, 11);
    let mesh = common::LocalMesh::start("blur", 3).await?;
    let client = mesh.client(0);
    let bytes: Vec<u8> = image.iter().flat_map(|p| p.to_le_bytes()).collect();
    let size = bytes.len() as u64;
    let blob = client.upload(bytes).await?;
    let spec = TaskSpec {
        shader: ShaderSource::Builtin("blur".into()),
        entry_point: "main".into(),
        bindings: vec![
            BindingSpec {
                binding: 0,
                role: BindingRole::Param {
                    data: [SIDE, SIDE, 0, 0]
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect(),
                },
            },
            BindingSpec {
                binding: 1,
                role: BindingRole::Input { blob, size },
            },
            BindingSpec {
                binding: 2,
                role: BindingRole::Output { size },
            },
        ],
        grid: Grid([SIDE / 16, SIDE / 16, 1]),
        shards: 8,
        merge: MergeRule::Changes,
        merges: Default::default(),
        options: Default::default(),
    };
    let task = client.submit(spec, None).await?;
    let view = client
        .wait(task, |d, n| println!("  {d}/{n} shards"))
        .await?;
    let out = mesh.client(1).results(task).await?;
    let blurred: Vec<u32> = out[&2]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    anyhow::ensure!(
        blurred == blur_reference(&image, SIDE, SIDE),
        "the mesh's blur differs from the CPU's"
    );
    write_png(&out_dir.join("input.png"), &image)?;
    write_png(&out_dir.join("blurred.png"), &blurred)?;
    let nodes: std::collections::BTreeSet<_> = view.shards.iter().filter_map(|s| s.node).collect();
    println!(
        "blurred {SIDE}x{SIDE} in 8 shards on {} nodes; identical to the CPU; wrote {}/input.png and blurred.png",
        nodes.len(),
        out_dir.display()
    );
    mesh.stop().await;
    Ok(())
}
