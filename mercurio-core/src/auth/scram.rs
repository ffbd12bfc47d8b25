//! SCRAM-SHA-256 and SCRAM-SHA-512 (RFC 5802, RFC 7677), the server side, for MQTT 5.0
//! enhanced authentication (section 4.12): the client's first message comes in CONNECT's
//! Authentication Data, the server's first in AUTH 0x18 (Continue authentication), the
//! client's final in AUTH 0x18, the server's final in the CONNACK (or, on a
//! re-authentication, AUTH 0x00).
//!
//! The server keeps, per user and mechanism, only what RFC 5802 section 3 says it needs:
//! the salt, the iteration count, StoredKey = H(ClientKey) and ServerKey ([`ScramKeys`]);
//! never the password. Channel binding is not offered (`n,,` or `y,,`; a client asking for
//! it with `p=` is refused). User names are compared as sent (no SASLprep); `=2C` and `=3D`
//! are decoded. For a user without keys, the exchange goes on with a salt derived from the
//! name, and fails at the end as a wrong password does, so that the answers do not tell
//! which users exist.

use std::fmt;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256, Sha512};
use subtle::ConstantTimeEq;

/// Iterations of PBKDF2 for keys made by [`ScramKeys::derive`] (RFC 7677 asks at least 4096).
pub const DEFAULT_ITERATIONS: u32 = 4096;
/// Most iterations a stored key may ask (a client must compute them at every connection).
pub const MAX_ITERATIONS: u32 = 1_000_000;
/// Longest SCRAM message accepted from a client, in bytes.
const MAX_MESSAGE: usize = 4096;

/// A SCRAM mechanism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Mechanism {
    /// `SCRAM-SHA-256` (RFC 7677).
    #[serde(rename = "SCRAM-SHA-256")]
    Sha256,
    /// `SCRAM-SHA-512`.
    #[serde(rename = "SCRAM-SHA-512")]
    Sha512,
}

impl Mechanism {
    /// Every mechanism, in the order keys are made.
    pub const ALL: [Mechanism; 2] = [Mechanism::Sha256, Mechanism::Sha512];

    /// The name, as in the Authentication Method property: `SCRAM-SHA-256`, `SCRAM-SHA-512`.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::Sha256 => "SCRAM-SHA-256",
            Mechanism::Sha512 => "SCRAM-SHA-512",
        }
    }

    /// The mechanism an Authentication Method names; `None` for any other method.
    pub fn from_name(name: &str) -> Option<Mechanism> {
        Mechanism::ALL.into_iter().find(|m| m.name() == name)
    }

    pub(crate) fn hmac(self, key: &[u8], data: &[u8]) -> Vec<u8> {
        match self {
            Mechanism::Sha256 => {
                let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(key) else {
                    return Vec::new(); // HMAC takes a key of any length.
                };
                mac.update(data);
                mac.finalize().into_bytes().to_vec()
            }
            Mechanism::Sha512 => {
                let Ok(mut mac) = Hmac::<Sha512>::new_from_slice(key) else {
                    return Vec::new();
                };
                mac.update(data);
                mac.finalize().into_bytes().to_vec()
            }
        }
    }

    fn hash(self, data: &[u8]) -> Vec<u8> {
        match self {
            Mechanism::Sha256 => Sha256::digest(data).to_vec(),
            Mechanism::Sha512 => Sha512::digest(data).to_vec(),
        }
    }

    fn salted_password(self, password: &[u8], salt: &[u8], iterations: u32) -> Vec<u8> {
        match self {
            Mechanism::Sha256 => {
                let mut out = vec![0u8; 32];
                pbkdf2::pbkdf2_hmac::<Sha256>(password, salt, iterations, &mut out);
                out
            }
            Mechanism::Sha512 => {
                let mut out = vec![0u8; 64];
                pbkdf2::pbkdf2_hmac::<Sha512>(password, salt, iterations, &mut out);
                out
            }
        }
    }
}

impl fmt::Display for Mechanism {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the server keeps of a password for one mechanism (RFC 5802 section 3). Salt and keys
/// are standard base64 in JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScramKeys {
    /// The mechanism these keys are for.
    pub mechanism: Mechanism,
    /// PBKDF2 iterations, 4096 ([`DEFAULT_ITERATIONS`]) to [`MAX_ITERATIONS`].
    pub iterations: u32,
    /// The salt, base64.
    pub salt: String,
    /// StoredKey = H(HMAC(SaltedPassword, "Client Key")), base64.
    pub stored_key: String,
    /// ServerKey = HMAC(SaltedPassword, "Server Key"), base64.
    pub server_key: String,
}

impl ScramKeys {
    /// The keys of `password` for `mechanism`: a random 16-byte salt, [`DEFAULT_ITERATIONS`].
    /// CPU-bound (PBKDF2).
    ///
    /// Errors: the operating system's random source failed.
    pub fn derive(mechanism: Mechanism, password: &[u8]) -> Result<ScramKeys, String> {
        let mut salt = [0u8; 16];
        getrandom::fill(&mut salt).map_err(|e| format!("no random salt: {e}"))?;
        Ok(ScramKeys::with_salt(
            mechanism,
            password,
            &salt,
            DEFAULT_ITERATIONS,
        ))
    }

    /// The keys of `password` with this salt and iteration count.
    pub fn with_salt(
        mechanism: Mechanism,
        password: &[u8],
        salt: &[u8],
        iterations: u32,
    ) -> ScramKeys {
        let salted = mechanism.salted_password(password, salt, iterations);
        let client_key = mechanism.hmac(&salted, b"Client Key");
        ScramKeys {
            mechanism,
            iterations,
            salt: STANDARD.encode(salt),
            stored_key: STANDARD.encode(mechanism.hash(&client_key)),
            server_key: STANDARD.encode(mechanism.hmac(&salted, b"Server Key")),
        }
    }

    /// Checks the values: base64 salt and keys of the mechanism's length, iterations in range.
    pub fn validate(&self) -> Result<(), String> {
        let len = match self.mechanism {
            Mechanism::Sha256 => 32,
            Mechanism::Sha512 => 64,
        };
        if !(1..=MAX_ITERATIONS).contains(&self.iterations) {
            return Err(format!(
                "{}: iterations must be 1 to {MAX_ITERATIONS}",
                self.mechanism
            ));
        }
        match STANDARD.decode(&self.salt) {
            Ok(s) if !s.is_empty() => {}
            _ => {
                return Err(format!(
                    "{}: the salt must be non-empty base64",
                    self.mechanism
                ))
            }
        }
        for (what, key) in [
            ("stored_key", &self.stored_key),
            ("server_key", &self.server_key),
        ] {
            match STANDARD.decode(key) {
                Ok(k) if k.len() == len => {}
                _ => {
                    return Err(format!(
                        "{}: {what} must be {len} bytes in base64",
                        self.mechanism
                    ))
                }
            }
        }
        Ok(())
    }
}

/// Why an exchange failed: a malformed message (MQTT: Protocol Error / Bad authentication
/// method), or a wrong proof (Bad user name or password).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScramError {
    /// A message that is not SCRAM as RFC 5802 writes it, with what is wrong.
    Malformed(String),
    /// The proof does not match: wrong password, or a user without keys.
    BadProof,
}

impl fmt::Display for ScramError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScramError::Malformed(m) => write!(f, "malformed SCRAM message: {m}"),
            ScramError::BadProof => f.write_str("wrong SCRAM proof"),
        }
    }
}

/// The user name of a client-first-message (`n,,n=USER,r=NONCE`), to look its keys up.
pub fn client_first_user(message: &[u8]) -> Result<String, ScramError> {
    Ok(parse_client_first(message)?.user)
}

struct ClientFirst {
    gs2_header: String,
    bare: String,
    user: String,
    nonce: String,
}

fn malformed(m: &str) -> ScramError {
    ScramError::Malformed(m.to_string())
}

fn parse_client_first(message: &[u8]) -> Result<ClientFirst, ScramError> {
    if message.len() > MAX_MESSAGE {
        return Err(malformed("message too long"));
    }
    let text = std::str::from_utf8(message).map_err(|_| malformed("not UTF-8"))?;
    let (gs2_header, bare) = match text.strip_prefix("n,") {
        Some(r) => ("n,", r),
        None => match text.strip_prefix("y,") {
            Some(r) => ("y,", r),
            None if text.starts_with("p=") => {
                return Err(malformed("channel binding is not supported"))
            }
            None => return Err(malformed("expected the GS2 header n,, or y,,")),
        },
    };
    // The authorization identity (a=) is not supported: it must be empty.
    let Some(bare) = bare.strip_prefix(',') else {
        return Err(malformed("an authorization identity (a=) is not supported"));
    };
    let mut user = None;
    let mut nonce = None;
    for (i, attr) in bare.split(',').enumerate() {
        match (i, attr.split_at_checked(2)) {
            (0, Some(("n=", v))) => user = Some(decode_name(v)?),
            (1, Some(("r=", v)))
                if !v.is_empty() && v.bytes().all(|b| (0x21..0x7f).contains(&b) && b != b',') =>
            {
                nonce = Some(v.to_string())
            }
            (0 | 1, _) => return Err(malformed("expected n=USER,r=NONCE")),
            _ => {} // extensions
        }
    }
    match (user, nonce) {
        (Some(user), Some(nonce)) if !user.is_empty() => Ok(ClientFirst {
            gs2_header: format!("{gs2_header},"),
            bare: bare.to_string(),
            user,
            nonce,
        }),
        _ => Err(malformed("expected n=USER,r=NONCE")),
    }
}

/// `saslname`: `=2C` is `,` and `=3D` is `=`; any other `=` is an error.
fn decode_name(v: &str) -> Result<String, ScramError> {
    let mut out = String::with_capacity(v.len());
    let mut rest = v;
    while let Some(i) = rest.find('=') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(t) = tail.strip_prefix("=2C") {
            out.push(',');
            rest = t;
        } else if let Some(t) = tail.strip_prefix("=3D") {
            out.push('=');
            rest = t;
        } else {
            return Err(malformed("bad escape in the user name"));
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// One server side exchange, from the client's first message to the server's final one.
pub struct ScramServer {
    mechanism: Mechanism,
    client_first: ClientFirst,
    /// The user's keys; `None`: a user without keys (the exchange fails at the end).
    keys: Option<(Vec<u8>, Vec<u8>)>,
    server_first: String,
    nonce: String,
}

impl ScramServer {
    /// Starts an exchange on the client's first message, with the keys stored for its user
    /// (`None` when it has none: then `unknown_salt` stands in, so that the answer looks the
    /// same as for a known user). Returns the server-first-message to send.
    pub fn start(
        mechanism: Mechanism,
        client_first: &[u8],
        keys: Option<&ScramKeys>,
        unknown_salt: &[u8],
    ) -> Result<(ScramServer, Vec<u8>), ScramError> {
        let client_first = parse_client_first(client_first)?;
        let mut random = [0u8; 18];
        getrandom::fill(&mut random)
            .map_err(|e| ScramError::Malformed(format!("no random nonce: {e}")))?;
        let nonce = format!("{}{}", client_first.nonce, STANDARD.encode(random));
        let keys = keys.filter(|k| k.mechanism == mechanism);
        let (salt, iterations, stored) = match keys {
            Some(k) => {
                let decoded = (
                    STANDARD.decode(&k.stored_key),
                    STANDARD.decode(&k.server_key),
                );
                match decoded {
                    (Ok(stored), Ok(server)) => {
                        (k.salt.clone(), k.iterations, Some((stored, server)))
                    }
                    _ => (STANDARD.encode(unknown_salt), DEFAULT_ITERATIONS, None),
                }
            }
            None => (STANDARD.encode(unknown_salt), DEFAULT_ITERATIONS, None),
        };
        let server_first = format!("r={nonce},s={salt},i={iterations}");
        let out = server_first.clone().into_bytes();
        Ok((
            ScramServer {
                mechanism,
                client_first,
                keys: stored,
                server_first,
                nonce,
            },
            out,
        ))
    }

    /// The user name the client gave.
    pub fn user(&self) -> &str {
        &self.client_first.user
    }

    /// Checks the client's final message (`c=...,r=...,p=PROOF`); returns the
    /// server-final-message (`v=SIGNATURE`) to send on success.
    pub fn finish(self, client_final: &[u8]) -> Result<Vec<u8>, ScramError> {
        if client_final.len() > MAX_MESSAGE {
            return Err(malformed("message too long"));
        }
        let text = std::str::from_utf8(client_final).map_err(|_| malformed("not UTF-8"))?;
        let (without_proof, proof) = text
            .rsplit_once(",p=")
            .ok_or_else(|| malformed("expected c=...,r=...,p=PROOF"))?;
        let mut attrs = without_proof.split(',');
        let binding = attrs
            .next()
            .and_then(|a| a.strip_prefix("c="))
            .ok_or_else(|| malformed("expected c= first"))?;
        let nonce = attrs
            .next()
            .and_then(|a| a.strip_prefix("r="))
            .ok_or_else(|| malformed("expected r= second"))?;
        if STANDARD.decode(binding).ok().as_deref() != Some(self.client_first.gs2_header.as_bytes())
        {
            return Err(malformed(
                "the channel binding does not repeat the GS2 header",
            ));
        }
        if nonce != self.nonce {
            return Err(malformed("the nonce is not the one the server sent"));
        }
        let proof = STANDARD
            .decode(proof)
            .map_err(|_| malformed("the proof is not base64"))?;
        let Some((stored_key, server_key)) = &self.keys else {
            return Err(ScramError::BadProof);
        };
        let auth_message = format!(
            "{},{},{}",
            self.client_first.bare, self.server_first, without_proof
        );
        let m = self.mechanism;
        let signature = m.hmac(stored_key, auth_message.as_bytes());
        if proof.len() != signature.len() {
            return Err(ScramError::BadProof);
        }
        let client_key: Vec<u8> = proof.iter().zip(&signature).map(|(a, b)| a ^ b).collect();
        if !bool::from(m.hash(&client_key).ct_eq(stored_key)) {
            return Err(ScramError::BadProof);
        }
        let server_signature = m.hmac(server_key, auth_message.as_bytes());
        Ok(format!("v={}", STANDARD.encode(server_signature)).into_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 7677 section 3's example: user "user", password "pencil".
    #[test]
    fn rfc7677_example() {
        let keys = ScramKeys::with_salt(
            Mechanism::Sha256,
            b"pencil",
            &STANDARD.decode("W22ZaJ0SNY7soEsUEjb6gQ==").unwrap(),
            4096,
        );
        let client_first = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO";
        let (mut server, first) =
            ScramServer::start(Mechanism::Sha256, client_first, Some(&keys), b"x").unwrap();
        // The example's server nonce, in place of the random one.
        server.nonce = "rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0".into();
        server.server_first = format!("r={},s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096", server.nonce);
        assert!(String::from_utf8(first)
            .unwrap()
            .starts_with("r=rOprNGfwEbeRWgbNEkqO"));
        let final_ = server
            .finish(b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
            .unwrap();
        assert_eq!(
            final_,
            b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=".to_vec()
        );
    }

    #[test]
    fn wrong_proofs_and_malformed_messages() {
        let keys = ScramKeys::with_salt(Mechanism::Sha512, b"pw", b"salt", 4096);
        keys.validate().unwrap();
        let (server, _) =
            ScramServer::start(Mechanism::Sha512, b"n,,n=u,r=abc", Some(&keys), b"x").unwrap();
        let nonce = server.nonce.clone();
        let e = server
            .finish(format!("c=biws,r={nonce},p=AAAA").as_bytes())
            .unwrap_err();
        assert_eq!(e, ScramError::BadProof);
        assert!(
            ScramServer::start(Mechanism::Sha512, b"p=tls-unique,,n=u,r=a", None, b"x").is_err()
        );
        assert!(ScramServer::start(Mechanism::Sha512, b"n,a=x,n=u,r=a", None, b"x").is_err());
        assert_eq!(client_first_user(b"n,,n=a=2Cb=3D,r=x").unwrap(), "a,b=");
        assert!(client_first_user(b"n,,n=a=2x,r=x").is_err());
    }
}
