//! Which daemon a call comes from. Every daemon holds the same bearer token, so the token
//! says only "a daemon of this cluster"; with the cluster CA configured (`daemon_ca`), a
//! daemon registers by signing a one-time challenge with its node certificate's key (the
//! certificate must be the CA's and name the label it registers), and gets a session
//! credential that binds each later call to the daemon id it registered as. Challenges and
//! sessions live in memory: after a restart the daemons register again, as they do anyway.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use base64::Engine;
use grandis_wire::{DaemonId, NodeProof, RegisterRequest};
use subtle::ConstantTimeEq;

use crate::error::ApiError;

/// A challenge is refused this long after it was handed out.
pub const CHALLENGE_TTL: Duration = Duration::from_secs(60);
/// Outstanding challenges at most (a flood of challenge requests cannot grow memory).
const MAX_CHALLENGES: usize = 4096;

/// Outstanding challenges and the sessions of registered daemons.
#[derive(Default)]
pub struct DaemonAuth {
    /// Challenge -> when it was handed out.
    challenges: HashMap<String, Instant>,
    /// Daemon id -> its session credential.
    sessions: HashMap<DaemonId, String>,
}

/// 32 random bytes, base64url: a challenge or a session credential.
fn random_token() -> Result<String, ApiError> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)
        .map_err(|e| ApiError::internal(anyhow::anyhow!("no randomness: {e}")))?;
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

impl DaemonAuth {
    /// A new one-time challenge.
    pub fn challenge(&mut self, now: Instant) -> Result<String, ApiError> {
        self.challenges
            .retain(|_, at| now.saturating_duration_since(*at) < CHALLENGE_TTL);
        if self.challenges.len() >= MAX_CHALLENGES {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_challenges",
                format!(
                    "{MAX_CHALLENGES} registration challenges are outstanding; retry in a minute"
                ),
            ));
        }
        let c = random_token()?;
        self.challenges.insert(c.clone(), now);
        Ok(c)
    }

    /// `req`'s proof, its challenge used up: refused when there is none or its challenge is
    /// unknown, used or expired. The signature is [`verify_proof`]'s to check.
    pub fn take_proof<'r>(
        &mut self,
        req: &'r RegisterRequest,
        now: Instant,
    ) -> Result<&'r NodeProof, ApiError> {
        let Some(proof) = &req.proof else {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "proof_required",
                "this coordinator verifies daemon identities: sign a challenge of POST \
                 /v1/daemon/challenge with the node certificate of the label (daemons of \
                 protocol 3 do)",
            ));
        };
        let fresh = self
            .challenges
            .remove(&proof.challenge)
            .is_some_and(|at| now.saturating_duration_since(at) < CHALLENGE_TTL);
        if !fresh {
            return Err(refused(
                &req.label,
                "its challenge is unknown, used already or expired (ask for a new one)".into(),
            ));
        }
        Ok(proof)
    }

    /// Opens daemon `id`'s session (sessions of daemons `known` no longer lists are dropped)
    /// and returns its credential.
    pub fn open_session(
        &mut self,
        id: DaemonId,
        known: impl Fn(DaemonId) -> bool,
    ) -> Result<String, ApiError> {
        self.sessions.retain(|&d, _| known(d));
        let token = random_token()?;
        self.sessions.insert(id, token.clone());
        Ok(token)
    }

    /// The daemon a call's session header (`<id>:<credential>`) belongs to. A session this
    /// coordinator does not hold (it restarted, or forgot the daemon) is `unknown_daemon`, as
    /// an unknown id is, so the daemon registers again; a wrong credential is refused.
    pub fn session_daemon(&self, header: Option<&[u8]>) -> Result<DaemonId, ApiError> {
        let Some(header) = header else {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "session_required",
                format!(
                    "missing {} header: register (with a proof of the label) first",
                    grandis_wire::DAEMON_SESSION_HEADER
                ),
            ));
        };
        let malformed = || {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_session",
                format!(
                    "{}: expected <daemon id>:<session>",
                    grandis_wire::DAEMON_SESSION_HEADER
                ),
            )
        };
        let text = std::str::from_utf8(header).map_err(|_| malformed())?;
        let (id, credential) = text.split_once(':').ok_or_else(malformed)?;
        let id: DaemonId = id.trim().parse().map_err(|_| malformed())?;
        let Some(expected) = self.sessions.get(&id) else {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "unknown_daemon",
                format!("no session of daemon {id}; register again"),
            ));
        };
        // Constant time in the credential's content.
        if bool::from(credential.trim().as_bytes().ct_eq(expected.as_bytes())) {
            Ok(id)
        } else {
            Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_session",
                format!("the session credential of daemon {id} is wrong"),
            ))
        }
    }
}

/// Checks that `proof` proves `label` with a certificate of `ca` (its challenge taken by
/// [`DaemonAuth::take_proof`]).
pub fn verify_proof(
    ca: &grandis_quic::ClusterCa,
    label: &str,
    proof: &NodeProof,
) -> Result<(), ApiError> {
    ca.verify_registration(label, proof)
        .map_err(|why| refused(label, why))
}

/// A registration refused for its proof, saying why.
fn refused(label: &str, why: String) -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        "invalid_proof",
        format!("daemon {label:?} is not who it says: {why}"),
    )
}

/// The daemon a verified call comes from (a request extension set by the daemon middleware
/// when the coordinator verifies identities).
#[derive(Clone, Copy, Debug)]
pub struct Acting(pub DaemonId);

/// A call that names daemon `claimed` must come from it (when identities are verified).
pub fn check_acting(acting: Option<Acting>, claimed: DaemonId) -> Result<(), ApiError> {
    match acting {
        Some(Acting(id)) if id != claimed => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "not_this_daemon",
            format!("daemon {id} cannot act as daemon {claimed}"),
        )),
        _ => Ok(()),
    }
}
