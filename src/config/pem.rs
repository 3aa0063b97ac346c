//! PEM files that a client reads only when it connects (PostgreSQL's `sslrootcert`, the
//! NATS TLS files, librdkafka's `ssl.*.location`), read now so that a missing or malformed
//! one is a config error. An error says why in a few words (`does not exist`, `cannot be
//! used (...)`) for the caller to put after the key and the path; it never quotes the
//! file.

use std::path::Path;

use openssl::pkey::{PKey, Private};
use openssl::x509::X509;

/// The certificates in `path`, at least one.
pub(crate) fn certificates(path: &Path) -> Result<Vec<X509>, String> {
    let certs = read(path, X509::stack_from_pem)?;
    if certs.is_empty() {
        return Err(unusable("no PEM certificate in it"));
    }
    Ok(certs)
}

/// The private key in `path`, decrypted with `passphrase` if it is encrypted.
pub(crate) fn private_key(path: &Path, passphrase: Option<&str>) -> Result<PKey<Private>, String> {
    match passphrase {
        Some(p) => read(path, |pem| {
            PKey::private_key_from_pem_passphrase(pem, p.as_bytes())
        }),
        None => read(path, PKey::private_key_from_pem),
    }
}

/// Whether `key` is the private half of `cert`'s public key.
pub(crate) fn belongs_to(key: &PKey<Private>, cert: &X509) -> bool {
    cert.public_key().is_ok_and(|public| public.public_eq(key))
}

/// `does not exist` or `cannot be used (why)`.
pub(crate) fn why(path: &Path, error: &dyn std::fmt::Display) -> String {
    if path.exists() {
        unusable(error)
    } else {
        "does not exist".to_owned()
    }
}

fn unusable(why: impl std::fmt::Display) -> String {
    format!("cannot be used ({why})")
}

fn read<T>(
    path: &Path,
    parse: impl FnOnce(&[u8]) -> Result<T, openssl::error::ErrorStack>,
) -> Result<T, String> {
    let pem = std::fs::read(path).map_err(|e| why(path, &e))?;
    parse(&pem).map_err(|e| why(path, &e))
}

/// A self-signed certificate and its key, PEM, for tests.
#[cfg(test)]
pub(super) fn self_signed() -> (Vec<u8>, Vec<u8>) {
    use openssl::{asn1::Asn1Time, hash::MessageDigest, rsa::Rsa, x509::X509NameBuilder};
    let key = PKey::from_rsa(Rsa::generate(2048).unwrap()).unwrap();
    let mut name = X509NameBuilder::new().unwrap();
    name.append_entry_by_text("CN", "relay-test").unwrap();
    let name = name.build();
    let mut cert = X509::builder().unwrap();
    cert.set_subject_name(&name).unwrap();
    cert.set_issuer_name(&name).unwrap();
    cert.set_pubkey(&key).unwrap();
    cert.set_not_before(&Asn1Time::days_from_now(0).unwrap())
        .unwrap();
    cert.set_not_after(&Asn1Time::days_from_now(1).unwrap())
        .unwrap();
    cert.sign(&key, MessageDigest::sha256()).unwrap();
    let cert = cert.build().to_pem().unwrap();
    (cert, key.private_key_to_pem_pkcs8().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_and_its_key_are_read_and_matched() {
        let dir = std::env::temp_dir().join(format!("pem-ok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert_pem, key_pem) = self_signed();
        let (cert, key) = (dir.join("c.pem"), dir.join("k.pem"));
        std::fs::write(&cert, cert_pem).unwrap();
        std::fs::write(&key, key_pem).unwrap();
        let certs = certificates(&cert).unwrap();
        assert!(belongs_to(&private_key(&key, None).unwrap(), &certs[0]));
        let (_, other) = self_signed();
        std::fs::write(&key, other).unwrap();
        assert!(!belongs_to(&private_key(&key, None).unwrap(), &certs[0]));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_or_malformed_file_says_which() {
        assert_eq!(
            certificates(Path::new("/nope.pem")).unwrap_err(),
            "does not exist"
        );
        let dir = std::env::temp_dir().join(format!("pem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.pem");
        std::fs::write(&junk, "not PEM").unwrap();
        assert!(certificates(&junk)
            .unwrap_err()
            .starts_with("cannot be used ("));
        assert!(private_key(&junk, None)
            .unwrap_err()
            .starts_with("cannot be used ("));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
