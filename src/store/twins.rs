//! Twins: tenant names that share a `hashtext` value, and so one claim key
//! and one writers' lock (see `claim.sql`). The configured tenants are
//! checked at start, one statement whatever their number
//! ([`Store::find_twins`]); every claim also says its tenant's hash, which
//! finds a discovered tenant's twin at its first sweep, with no statement of
//! its own. Each pair is named once at WARN. A tenant with a known twin
//! waits its turn for the claim (`claim_turn.sql`) and chains no batch while
//! the twin has rows pending (`twins_pending.sql`), so neither starves the
//! other.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::types::Type;

use super::{Store, StoreError};

/// How long the claim of a tenant with a known twin waits for its turn
/// (`claim_turn.sql`): a waiting sweep gets the key as soon as the twin's
/// transaction ends, so the bound only limits how long a slot waits for a
/// claim held that long (a relay cut off mid-sweep); past it the sweep is
/// skipped, and the poll readies the tenant again. Well within the claim's
/// deadline ([`QUERY_TIMEOUT`](super::QUERY_TIMEOUT)).
pub(super) const CLAIM_TURN_WAIT: Duration = Duration::from_secs(1);

/// The tenants whose hash is known, by name and by hash, and the pairs
/// already named.
#[derive(Debug, Default)]
pub(super) struct Twins {
    hash_of: HashMap<Arc<str>, i32>,
    by_hash: HashMap<i32, Vec<Arc<str>>>,
    named: HashSet<(Arc<str>, Arc<str>)>,
}

impl Twins {
    /// Records `tenant`'s hash; names each pair it makes that was not named
    /// before.
    pub(super) fn learn(&mut self, tenant: &str, hash: i32, table: &str) {
        if self.hash_of.get(tenant) == Some(&hash) {
            return;
        }
        let tenant: Arc<str> = Arc::from(tenant);
        self.hash_of.insert(tenant.clone(), hash);
        let names = self.by_hash.entry(hash).or_default();
        for twin in names.iter() {
            let pair = if twin < &tenant {
                (twin.clone(), tenant.clone())
            } else {
                (tenant.clone(), twin.clone())
            };
            if self.named.insert(pair.clone()) {
                tracing::warn!(
                    tenant = &*pair.0,
                    twin = &*pair.1,
                    hash,
                    table,
                    "tenants {} and {} share a hashtext value, and so one claim key and one \
                     writers' lock: they take turns, and an open or prepared transaction that \
                     wrote either holds back the other's rows too (see docs/design.md, \
                     One sweep of one tenant)",
                    pair.0,
                    pair.1
                );
            }
        }
        names.push(tenant);
    }

    /// The other tenants known to share `tenant`'s hash.
    pub(super) fn of(&self, tenant: &str) -> Vec<Arc<str>> {
        let Some(hash) = self.hash_of.get(tenant) else {
            return Vec::new();
        };
        self.by_hash[hash]
            .iter()
            .filter(|twin| &***twin != tenant)
            .cloned()
            .collect()
    }

    /// Forgets `tenant`'s hash (a discovered tenant the schedule forgot):
    /// its first claim when it comes back learns it again. A pair once
    /// named is not named again.
    pub(super) fn forget(&mut self, tenant: &str) {
        let Some(hash) = self.hash_of.remove(tenant) else {
            return;
        };
        if let Some(names) = self.by_hash.get_mut(&hash) {
            names.retain(|name| &**name != tenant);
            if names.is_empty() {
                self.by_hash.remove(&hash);
            }
        }
    }
}

impl Store {
    /// Finds which of `tenants` share a `hashtext` value, one statement,
    /// and names each such pair once at WARN (see [`Twins`]).
    pub async fn find_twins(&self, tenants: &[String]) -> Result<(), StoreError> {
        let groups: Vec<(i32, Vec<String>)> = self
            .query_all(
                "the check of tenants sharing a hashtext value",
                super::statements::TWINS,
                &[(&tenants, Type::TEXT_ARRAY)],
                |row| Ok((row.try_get(0)?, row.try_get(1)?)),
            )
            .await?;
        for (hash, names) in groups {
            for name in names {
                self.learn_hash(&name, hash);
            }
        }
        Ok(())
    }

    /// Records `tenant`'s hash, as a claim found it (see [`Twins::learn`]).
    /// The twins known so far, whatever a panicking holder left.
    fn twins(&self) -> std::sync::MutexGuard<'_, Twins> {
        self.twins.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn learn_hash(&self, tenant: &str, hash: i32) {
        self.twins().learn(tenant, hash, &self.lock_key);
    }

    /// The other tenants known to share `tenant`'s claim key.
    pub(super) fn twins_of(&self, tenant: &str) -> Vec<Arc<str>> {
        self.twins().of(tenant)
    }

    /// Forgets a discovered tenant the schedule forgot (see [`Twins::forget`]).
    pub fn forget_tenant(&self, tenant: &str) {
        self.twins().forget(tenant);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_learns_its_twins_and_forgets_them() {
        let mut twins = Twins::default();
        twins.learn("a", 7, "s.t");
        twins.learn("b", 8, "s.t");
        assert!(twins.of("a").is_empty());
        twins.learn("c", 7, "s.t");
        twins.learn("c", 7, "s.t");
        assert_eq!(twins.of("a"), [Arc::from("c")]);
        assert_eq!(twins.of("c"), [Arc::from("a")]);
        assert_eq!(twins.named.len(), 1, "the pair is named once");
        twins.forget("c");
        assert!(twins.of("a").is_empty());
        assert!(twins.of("c").is_empty());
        twins.learn("c", 7, "s.t");
        assert_eq!(twins.of("a"), [Arc::from("c")]);
        assert_eq!(twins.named.len(), 1, "not named again");
        for tenant in ["a", "b", "c"] {
            twins.forget(tenant);
        }
        assert!(twins.by_hash.is_empty() && twins.hash_of.is_empty());
    }
}
