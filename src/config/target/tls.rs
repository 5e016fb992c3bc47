//! TLS for both targets: what a connection trusts (the system's roots, or
//! only the CA file a URL names), what it checks (the chain and the host name,
//! or the chain alone) and the client certificate it presents. The files are
//! read once, when the configuration is loaded, so an unreadable or unusable
//! file is a configuration error naming its parameter; nothing read from a
//! key file is ever printed.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{WebPkiServerVerifier, verify_server_cert_signed_by_trust_anchor};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use crate::config::file::{PEM_FILE_LIMIT, read_bounded};

/// What the server's certificate must prove.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// A chain to a trusted root, valid for the host name (`verify-full`,
    /// `require`; AMQPS by default).
    ChainAndName,
    /// A chain to a trusted root, whatever name it is for (`verify-ca`;
    /// AMQPS with `server_name_indication=disable`).
    ChainOnly,
}

/// The files a URL names, by their parameter names (`sslrootcert`, …), so
/// that an error says which parameter is at fault.
pub struct Files<'a> {
    /// (parameter, path) of the CA certificates that replace the system roots.
    pub roots: Option<(&'a str, &'a str)>,
    /// (parameter, path) of the client certificate chain.
    pub cert: Option<(&'a str, &'a str)>,
    /// (parameter, path) of the client certificate's private key.
    pub key: Option<(&'a str, &'a str)>,
}

/// The ring provider, named explicitly: the build carries no other.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Builds the client configuration: the roots (the CA file's certificates
/// only, else the system's), the check and the client certificate.
pub fn client_config(files: &Files<'_>, check: Check) -> Result<ClientConfig, String> {
    let provider = provider();
    let mut roots = RootCertStore::empty();
    match files.roots {
        Some((param, path)) if path != "system" => {
            for cert in certificates(param, path)? {
                roots
                    .add(cert)
                    .map_err(|e| format!("{param} {path}: unusable certificate: {e}"))?;
            }
        }
        _ => {
            for cert in rustls_native_certs::load_native_certs().certs {
                // A system certificate the TLS library cannot use is skipped.
                let _ = roots.add(cert);
            }
        }
    }
    let roots = Arc::new(roots);
    let webpki = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| match files.roots {
            Some((param, path)) => format!("{param} {path}: {e}"),
            None => format!("no usable system root certificates ({e}); name a CA file"),
        })?;
    let verifier: Arc<dyn ServerCertVerifier> = match check {
        Check::ChainAndName => webpki,
        Check::ChainOnly => Arc::new(ChainOnly {
            webpki,
            roots,
            provider: provider.clone(),
        }),
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match (files.cert, files.key) {
        (None, None) => builder.with_no_client_auth(),
        (Some((cert_param, cert_path)), Some((key_param, key_path))) => {
            let chain = certificates(cert_param, cert_path)?;
            let bytes = read(key_param, key_path)?;
            let key = PrivateKeyDer::from_pem_slice(&bytes).map_err(|_| {
                format!(
                    "{key_param} {key_path}: no unencrypted PEM private key (PKCS#8, PKCS#1 or SEC1)"
                )
            })?;
            builder.with_client_auth_cert(chain, key).map_err(|e| {
                format!(
                    "{cert_param} {cert_path} and {key_param} {key_path} do not go together: {e}"
                )
            })?
        }
        (Some((param, _)), None) | (None, Some((param, _))) => {
            let other = if files.cert.is_some() {
                "a key"
            } else {
                "a certificate"
            };
            return Err(format!("{param} needs {other} as well"));
        }
    };
    Ok(config)
}

fn read(param: &str, path: &str) -> Result<Vec<u8>, String> {
    read_bounded(Path::new(path), PEM_FILE_LIMIT).map_err(|e| format!("{param} {path}: {e}"))
}

/// The certificates of a PEM file; a file without one is an error.
fn certificates(param: &str, path: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = read(param, path)?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&bytes)
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(format!("{param} {path}: no PEM certificate in the file"));
    }
    Ok(certs)
}

/// `verify-ca`: the chain must lead to a trusted root; the name it was
/// issued for is not checked.
#[derive(Debug)]
struct ChainOnly {
    /// Checks the handshake signatures.
    webpki: Arc<WebPkiServerVerifier>,
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = ParsedCertificate::try_from(end_entity)?;
        verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}
