//! `gpumesh keygen`: makes a cluster key, the shared secret of a closed mesh.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use gpumesh::node::ClusterKey;

#[derive(clap::Args, Debug)]
pub struct KeygenArgs {
    /// Write the key to FILE (created readable by its owner only; never
    /// overwritten) instead of printing it.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

pub fn keygen(args: KeygenArgs) -> anyhow::Result<ExitCode> {
    let key = ClusterKey::generate();
    match &args.out {
        Some(path) => {
            key.write_new(path)?;
            println!(
                "wrote a new cluster key to {} (fingerprint {})",
                path.display(),
                key.fingerprint()
            );
            println!(
                "copy it to every node and start each with --cluster-key {}",
                path.display()
            );
        }
        None => {
            // The key alone on stdout, so `gpumesh keygen > FILE` makes a key file;
            // the fingerprint goes to stderr.
            std::io::stdout().write_all(key.to_key_file().as_bytes())?;
            eprintln!("fingerprint {}", key.fingerprint());
        }
    }
    Ok(ExitCode::SUCCESS)
}
