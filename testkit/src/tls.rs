//! A throwaway certificate authority for the TLS tests ([`TestCa`]).
//!
//! Starts no server: it runs the `openssl` command a few times in a scratch directory to
//! make a CA, a server certificate and a client certificate. Dropping the [`TestCa`]
//! removes the directory with every key in it.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::process::scratch_dir;

/// A throwaway certificate authority made with the `openssl` command: a CA, a server
/// certificate for IP 127.0.0.1 (no host name), and a client certificate for
/// `outbox_relay`. A second `TestCa` is a different, untrusted CA.
pub struct TestCa {
    dir: PathBuf,
}

impl TestCa {
    pub fn new() -> Result<TestCa> {
        let dir = scratch_dir("ca")?;
        let run = |args: &[&str]| -> Result<()> {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .output()
                .context("run openssl (apt-get install openssl)")?;
            if !out.status.success() {
                bail!(
                    "openssl {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Ok(())
        };
        std::fs::write(dir.join("server.ext"), "subjectAltName = IP:127.0.0.1\n")?;
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=outbox-relay test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
        ])?;
        for (name, subject, ext) in [
            ("server", "/CN=127.0.0.1", Some("server.ext")),
            ("client", "/CN=outbox_relay", None),
        ] {
            let key = format!("{name}.key");
            let csr = format!("{name}.csr");
            let crt = format!("{name}.crt");
            run(&[
                "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", &key, "-out",
                &csr,
            ])?;
            let mut sign = vec![
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                &crt,
            ];
            if let Some(ext) = ext {
                sign.extend(["-extfile", ext]);
            }
            run(&sign)?;
        }
        Ok(TestCa { dir })
    }

    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    pub fn server_cert(&self) -> PathBuf {
        self.dir.join("server.crt")
    }

    pub fn server_key(&self) -> PathBuf {
        self.dir.join("server.key")
    }

    pub fn client_cert(&self) -> PathBuf {
        self.dir.join("client.crt")
    }

    pub fn client_key(&self) -> PathBuf {
        self.dir.join("client.key")
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
